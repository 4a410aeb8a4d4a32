"""A small arithmetic task a tiny char-level model can learn on CPU.

Prompt "12+7=", reference "19". The model's answer is the integer at the
very start of its output (leading spaces allowed); anything after the first
non-digit is ignored, so "19<eos>" and "19\\n..." are correct, "191" is not.

Difficulty knobs: operand digit count, number of terms, operators, and
whether negative results are allowed (if not, subtraction is reordered so the
result is >= 0, keeping the output alphabet to digits).
"""

from __future__ import annotations

import random
import re
import zlib

from vcpo_jax.tasks.base import TaskDefaults
from vcpo_jax.tasks.datasets import Problem

__all__ = ["ArithmeticTask", "generate", "extract_integer", "verify"]

_LEADING_INT_RE = re.compile(r"\s*([+-]?\d{1,64})(?!\d)")


def generate(
  n: int,
  seed: int,
  max_digits: int = 2,
  num_terms: int = 2,
  ops: str = "+",
  allow_negative: bool = False,
  split: str = "train",
  test_fraction: float = 0.1,
) -> list[tuple[str, str]]:
  """n (expression, answer) pairs, e.g. ("12+7", "19").

  Operands are uniform in [0, 10**max_digits); ops is a string over "+-*";
  evaluation is left to right with usual precedence (Python int semantics,
  computed from the operand list, not eval). Splits are disjoint: an
  expression is "test" iff a hash of it falls in the first test_fraction.
  """
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  if not 1 <= max_digits <= 9:
    raise ValueError(f"max_digits must be in [1, 9], got {max_digits}")
  if num_terms < 2:
    raise ValueError(f"num_terms must be >= 2, got {num_terms}")
  if not ops or set(ops) - set("+-*"):
    raise ValueError(f"ops must be a non-empty string over '+-*', got {ops!r}")
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
  rng = random.Random(f"arithmetic/{seed}/{split}")
  hi = 10**max_digits - 1
  out = []
  attempts = 0
  while len(out) < n:
    attempts += 1
    if attempts > 1000 * (n + 10):
      raise ValueError(f"could not generate {n} {split} problems; raise max_digits or num_terms")
    terms = [rng.randint(0, hi) for _ in range(num_terms)]
    chosen = [rng.choice(ops) for _ in range(num_terms - 1)]
    value = _value(terms, chosen)
    if value < 0 and not allow_negative:
      if num_terms == 2:  # swap operands so a - b >= 0
        terms = terms[::-1]
        value = _value(terms, chosen)
      if value < 0:
        continue
    expr = str(terms[0]) + "".join(op + str(t) for op, t in zip(chosen, terms[1:]))
    in_test = zlib.crc32(expr.encode()) % 1000 < int(round(test_fraction * 1000))
    if in_test != (split == "test"):
      continue
    out.append((expr, str(value)))
  return out


def _value(terms: list[int], ops: list[str]) -> int:
  """Value with * binding tighter than + and -."""
  total, prod = 0, terms[0]
  sign = 1
  for op, t in zip(ops, terms[1:]):
    if op == "*":
      prod *= t
    else:
      total += sign * prod
      sign, prod = (1 if op == "+" else -1), t
  return total + sign * prod


def extract_integer(text: str) -> int | None:
  """The integer at the start of text (after whitespace), else None."""
  if not isinstance(text, str):
    return None
  m = _LEADING_INT_RE.match(text[:200])
  return int(m.group(1)) if m else None


def verify(model_output: str, reference: str) -> float:
  """1.0 iff the leading integer of the output equals the reference, else 0.0."""
  try:
    ref = int(str(reference).strip())
  except ValueError:
    raise ValueError(f"arithmetic reference must be an integer string, got {reference!r}") from None
  return float(extract_integer(model_output) == ref)


class ArithmeticTask(TaskDefaults):
  """A generated task (tasks.Task): prompt "{expression}=", exact-integer reward; demonstrations are the integer
  answer, wrong ones the answer plus a nonzero offset in [-9, 9], kept >= 0."""

  name = "arithmetic"
  generated = True
  uses_extraction = False  # the leading integer is parsed by `verify`

  def __init__(self, template: str = "{expression}=", **gen_kwargs):
    if "{expression}" not in template:
      raise ValueError(f"arithmetic template must contain '{{expression}}', got {template!r}")
    self.template = template
    generate(0, 0, **gen_kwargs)  # validate generator knobs now, not at first use
    self.gen_kwargs = gen_kwargs

  def make_problems(self, split: str = "train", n: int | None = 100, seed: int = 0, template: str | None = None):
    tmpl = self.template if template is None else template
    pairs = generate(100 if n is None else n, seed, split=split, **self.gen_kwargs)
    return [
      Problem(
        id=f"arithmetic-{split}-{seed}-{i}",
        task="arithmetic",
        prompt=tmpl.format(expression=expr),
        reference=ans,
        dataset="arithmetic",
        solution=ans,
        grader=self,
      )
      for i, (expr, ans) in enumerate(pairs)
    ]

  def score(self, model_output: str, reference: str, extraction: str | None = None) -> float:
    return verify(model_output, reference)

  def check_reference(self, reference) -> None:
    try:
      int(str(reference).strip())
    except ValueError:
      raise ValueError(f"arithmetic reference must be an integer string, got {reference!r}") from None

  can_demonstrate_wrong = True

  def demonstrate_wrong(self, problem: Problem, rng: random.Random) -> str:
    answer = int(str(problem.solution).strip())
    offsets = [d for d in range(-9, 10) if d and answer + d >= 0]
    return str(answer + rng.choice(offsets))
