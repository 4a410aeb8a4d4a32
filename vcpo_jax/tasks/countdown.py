"""Countdown: combine the given numbers with + - * / to reach a target.

Instances are generated from a seed and are solvable by construction: the
target is the value of a random expression tree over the numbers, or (method
"uniform") drawn from the values the exhaustive solver can reach; the
expression is kept as the proof (and as a warm-start solution), and
`solve(numbers, target)` finds one for any instance.

The verifier parses the model's expression with `ast` and a node whitelist
(never `eval`): only integer literals, binary + - * /, and parentheses. It
evaluates with exact `Fraction` arithmetic, so `/` is true division and
intermediate fractions are allowed (`(8 / 3) * 3 == 8`). Each given number may
be used at most once (as a multiset: a number given twice may appear twice).
Unary minus, powers, names, calls and floats are rejected; the expression
length is capped, which bounds nesting depth and the size of every value.

Reward: 1.0 when the expression is valid and equals the target, else
`format_weight` (default 0.1, TinyZero's convention) when the answer is
present in the expected `<answer>...</answer>` form, else 0.0.
"""

from __future__ import annotations

import ast
import dataclasses
import random
import re
import zlib
from fractions import Fraction

from vcpo_jax.tasks.base import TaskDefaults
from vcpo_jax.tasks.datasets import Problem

__all__ = [
  "DEFAULT_TEMPLATE",
  "CountdownInstance",
  "CountdownTask",
  "extract_expression",
  "evaluate_expression",
  "generate",
  "reachable",
  "solve",
  "verify",
]

DEFAULT_TEMPLATE = (
  "Using the numbers {numbers}, create an equation that equals {target}. "
  "You can use basic arithmetic operations (+, -, *, /) and each number can be "
  "used at most once. Show your work in <think> </think> tags. And return the "
  "final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
# Longer expressions are rejected before parsing: 6 numbers with operators and
# generous parentheses and spaces fit easily; it also keeps ast.parse away
# from its nesting limits.
MAX_EXPRESSION_CHARS = 200

# Only the last this-many characters of an output are read (1 MiB, the same
# cap as the text tasks): with the linear scan below, every call costs O(cap).
MAX_OUTPUT_CHARS = 1 << 20
# Demonstrations are re-solved canonically up to this many numbers (the exhaustive solver takes ~1 ms at 3
# numbers, ~15 ms at 4; beyond, the generator's own expression is used).
CANONICAL_MAX_NUMBERS = 4
_OPEN, _CLOSE = "<answer>", "</answer>"
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclasses.dataclass(frozen=True)
class CountdownInstance:
  """numbers: the available numbers; target: the value to reach; solution: a solver proof."""

  numbers: tuple[int, ...]
  target: int
  solution: str

  def reference(self) -> dict:
    return {"numbers": list(self.numbers), "target": self.target}


# ----------------------------------------------------------------------------
# Solver
# ----------------------------------------------------------------------------
def _combine(a: dict, b: dict, out: dict) -> None:
  """All values of `x op y` for x in a, y in b (both orders for - and /)."""
  for va, ea in a.items():
    for vb, eb in b.items():
      cands = [(va + vb, f"{ea} + {eb}"), (va * vb, f"{ea} * {eb}")]
      cands.append((va - vb, f"{ea} - {eb}"))
      cands.append((vb - va, f"{eb} - {ea}"))
      if vb != 0:
        cands.append((va / vb, f"{ea} / {eb}"))
      if va != 0:
        cands.append((vb / va, f"{eb} / {ea}"))
      for v, e in cands:
        if v not in out:
          out[v] = f"({e})"


def reachable(numbers) -> dict[Fraction, str]:
  """Every value reachable using each number at most once -> one expression for it.

  Dynamic programming over subsets (bitmasks): reach[S] = values of S's
  numbers combined; reach[S] joins reach[A] op reach[S \\ A] over splits.
  Cost grows quickly with len(numbers): fine up to 5, slow at 6.
  """
  nums = [int(x) for x in numbers]
  k = len(nums)
  reach: list[dict] = [dict() for _ in range(1 << k)]
  for i, x in enumerate(nums):
    reach[1 << i][Fraction(x)] = str(x)
  for mask in range(1, 1 << k):
    if mask & (mask - 1) == 0:
      continue
    out = reach[mask]
    sub = (mask - 1) & mask
    while sub:
      other = mask ^ sub
      if sub < other:  # each unordered split once; _combine covers both orders
        _combine(reach[sub], reach[other], out)
      sub = (sub - 1) & mask
  result: dict[Fraction, str] = {}
  for mask in range(1, 1 << k):
    for v, e in reach[mask].items():
      if v not in result or len(e) < len(result[v]):
        result[v] = e
  return {v: (e[1:-1] if e.startswith("(") and _balanced_outer(e) else e) for v, e in result.items()}


def _balanced_outer(e: str) -> bool:
  """Whether e's first '(' closes at its last character (so they can be dropped)."""
  depth = 0
  for i, ch in enumerate(e):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return i == len(e) - 1
  return False


def _random_tree(numbers, rng: random.Random) -> tuple[Fraction, str]:
  """Combine all numbers pairwise at random with + - * / into one expression."""
  items = [(Fraction(x), str(x)) for x in numbers]
  while len(items) > 1:
    i, j = rng.sample(range(len(items)), 2)
    (va, ea), (vb, eb) = items[i], items[j]
    op = rng.choice("+-*/" if vb != 0 else "+-*")
    value = {"+": va + vb, "-": va - vb, "*": va * vb}[op] if op != "/" else va / vb
    items = [it for t, it in enumerate(items) if t not in (i, j)]
    items.append((value, f"({ea} {op} {eb})" if len(items) else f"{ea} {op} {eb}"))
  return items[0]


def solve(numbers, target: int) -> str | None:
  """An expression over `numbers` (each at most once) equal to target, or None."""
  return reachable(numbers).get(Fraction(target))


def generate(
  n: int,
  seed: int,
  num_numbers: tuple[int, int] = (3, 4),
  number_range: tuple[int, int] = (1, 99),
  target_range: tuple[int, int] = (1, 99),
  split: str = "train",
  test_fraction: float = 0.1,
  method: str = "tree",
) -> list[CountdownInstance]:
  """n solvable instances from a seed.

  num_numbers: inclusive (min, max) count of numbers; number_range and
  target_range: inclusive value ranges. Targets equal to one of the given
  numbers are excluded (trivial). method: "tree" combines all the numbers in
  a random expression tree and takes its value as the target (fast, about
  1 ms per instance with rejections; the tree is the proof; larger counts are
  rejected more often, so with (3, 4) about 2/3 of instances have 3 numbers);
  "uniform" draws the target
  uniformly from every integer the exhaustive solver can reach (about 15 ms
  per instance with 4 numbers, slow with 6). Splits are disjoint by construction: an
  instance belongs to "test" iff a hash of its numbers tuple falls in the
  first `test_fraction` of buckets, so train and test never share a number tuple.
  """
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  if not (1 <= num_numbers[0] <= num_numbers[1] <= 6):
    raise ValueError(f"num_numbers must satisfy 1 <= min <= max <= 6, got {num_numbers}")
  if not (1 <= number_range[0] <= number_range[1]):
    raise ValueError(f"number_range must be positive and ordered, got {number_range}")
  if target_range[0] > target_range[1]:
    raise ValueError(f"target_range must be ordered, got {target_range}")
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
  if method not in ("tree", "uniform"):
    raise ValueError(f"method must be 'tree' or 'uniform', got {method!r}")
  rng = random.Random(f"countdown/{seed}/{split}")
  out: list[CountdownInstance] = []
  attempts = 0
  while len(out) < n:
    attempts += 1
    if attempts > 1000 * (n + 10):
      raise ValueError(f"could not generate {n} {split} instances; widen target_range/number_range")
    k = rng.randint(*num_numbers)
    numbers = tuple(rng.randint(*number_range) for _ in range(k))
    # Split by the numbers alone (checked before the costly solve): train and
    # test never share a number tuple, hence never an instance.
    in_test = zlib.crc32(str(numbers).encode()) % 1000 < int(round(test_fraction * 1000))
    if in_test != (split == "test"):
      continue
    if method == "tree":
      value, expr = _random_tree(numbers, rng)
      if value.denominator != 1 or not target_range[0] <= value <= target_range[1] or int(value) in numbers:
        continue
      out.append(CountdownInstance(numbers, int(value), expr))
      continue
    reach = reachable(numbers)
    targets = sorted(
      int(v) for v in reach if v.denominator == 1 and target_range[0] <= v <= target_range[1] and int(v) not in numbers
    )
    if not targets:
      continue
    target = rng.choice(targets)
    out.append(CountdownInstance(numbers, target, reach[Fraction(target)]))
  return out


# ----------------------------------------------------------------------------
# Verifier
# ----------------------------------------------------------------------------
def _last_tagged(text: str) -> str | None:
  """Content of the last complete `<answer>...</answer>`: the last close tag and the last open tag before it.

  Two `str.rfind` scans, so the cost is linear in len(text) however many
  unclosed `<answer>` tags it holds (a lazy `<answer>(.*?)</answer>` regex
  rescans the rest of the text from every open tag: quadratic). With nested
  tags the innermost content counts.
  """
  close = text.rfind(_CLOSE)
  if close < 0:
    return None
  start = text.rfind(_OPEN, 0, close)
  return None if start < 0 else text[start + len(_OPEN) : close]


def extract_expression(text: str) -> tuple[str | None, bool]:
  """(expression, well_formatted): the last `<answer>...</answer>` content.

  Without answer tags, falls back to the last non-empty line (not well
  formatted). A trailing `= target` is dropped. Reads only the last
  MAX_OUTPUT_CHARS characters; no regex sees more than the expression.
  """
  if not isinstance(text, str):
    return None, False
  text = text[-MAX_OUTPUT_CHARS:]
  expr = _last_tagged(text)
  formatted = expr is not None
  if expr is None:
    tail = text.rstrip()
    if not tail:
      return None, False
    expr = tail[tail.rfind("\n") + 1 :]  # after rstrip the last line is non-empty
  expr = expr.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
  if "=" in expr:
    expr = expr.split("=", 1)[0].strip()
  return (expr or None), formatted


def _eval_node(node: ast.AST, budget: list[int]) -> Fraction:
  """Exact value of a whitelisted node; records each literal into budget's consumer."""
  if isinstance(node, ast.Expression):
    return _eval_node(node.body, budget)
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    left = _eval_node(node.left, budget)
    right = _eval_node(node.right, budget)
    op = type(node.op)
    if op is ast.Add:
      return left + right
    if op is ast.Sub:
      return left - right
    if op is ast.Mult:
      return left * right
    if right == 0:
      raise ZeroDivisionError("division by zero")
    return left / right
  if isinstance(node, ast.Constant) and type(node.value) is int:
    budget.append(node.value)
    return Fraction(node.value)
  raise ValueError(f"disallowed syntax: {type(node).__name__}")


def evaluate_expression(expr: str, numbers) -> tuple[Fraction | None, str]:
  """(value, error): the exact value of expr if it is valid for `numbers`, else (None, why).

  Never raises; rejects anything outside the whitelist, numbers not given,
  numbers used more often than given, division by zero, overlong input.
  """
  if not isinstance(expr, str):
    return None, "not a string"
  if len(expr) > MAX_EXPRESSION_CHARS:
    return None, "expression too long"
  if not re.fullmatch(r"[\d\s+\-*/().]*", expr):
    return None, "disallowed characters"
  try:
    tree = ast.parse(expr, mode="eval")
    used: list[int] = []
    value = _eval_node(tree, used)
  except ZeroDivisionError:
    return None, "division by zero"
  except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, OverflowError) as e:
    return None, f"invalid expression: {type(e).__name__}"
  available: dict[int, int] = {}
  for x in numbers:
    available[int(x)] = available.get(int(x), 0) + 1
  for x in used:
    if available.get(x, 0) == 0:
      return None, f"number {x} not available or used too often"
    available[x] -= 1
  return value, ""


def verify(
  model_output: str, reference: dict, format_weight: float = 0.1, require_format: bool = False
) -> dict[str, float]:
  """Named reward components: {"correct", "format", "reward"}.

  correct: 1.0 iff the extracted expression is valid and equals the target
    (and, with require_format, came inside <answer></answer> tags).
  format: 1.0 iff the answer came in <answer></answer> tags.
  reward = 1.0 if correct else format_weight * format (kept below 0.5).
  """
  numbers, target = _check_reference(reference)
  if not 0.0 <= format_weight < 0.5:
    raise ValueError(f"format_weight must be in [0, 0.5), got {format_weight}")
  expr, formatted = extract_expression(model_output)
  correct = 0.0
  if expr is not None:
    value, _ = evaluate_expression(expr, numbers)
    correct = float(value is not None and value == target and (formatted or not require_format))
  fmt = float(formatted)
  reward = 1.0 if correct else format_weight * fmt
  return {"correct": correct, "format": fmt, "reward": reward}


def _check_reference(reference) -> tuple[list[int], int]:
  if not isinstance(reference, dict) or "numbers" not in reference or "target" not in reference:
    raise ValueError(f"countdown reference must be a dict with 'numbers' and 'target', got {reference!r}")
  return [int(x) for x in reference["numbers"]], int(reference["target"])


class CountdownTask(TaskDefaults):
  """A generated task (tasks.Task): solver-checked instances, the countdown reward, the solver's demonstrations.

  Demonstrations (the warm start's targets) are the solver's shortest expression (`solve`, canonical: one
  deterministic answer per instance, up to CANONICAL_MAX_NUMBERS numbers; the generator's own expression
  beyond), inside `<answer> </answer>` when the prompt asks for those tags (the default template), otherwise
  the bare expression without spaces (short CPU templates: the verifier falls back to the last line, and every
  character is a token of the char model). Wrong demonstrations are the given numbers in a random order
  joined by random operators, redrawn until the value is not the target.
  """

  name = "countdown"
  generated = True
  uses_extraction = False  # the expression is parsed by `verify`

  def __init__(
    self,
    template: str = DEFAULT_TEMPLATE,
    format_weight: float = 0.1,
    require_format: bool = False,
    **gen_kwargs,
  ):
    try:
      template.format(numbers=[1, 2], target=3)
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"countdown template may only use {{numbers}} and {{target}} fields: {e!r}") from None
    self.template = template
    if not 0.0 <= format_weight < 0.5:
      raise ValueError(f"format_weight must be in [0, 0.5), got {format_weight}")
    self.format_weight = format_weight
    self.require_format = require_format
    generate(0, 0, **gen_kwargs)  # validate generator knobs now, not at first use
    self.gen_kwargs = gen_kwargs

  def prompt(self, inst: CountdownInstance) -> str:
    return self.template.format(numbers=list(inst.numbers), target=inst.target)

  def make_problems(self, split: str = "train", n: int | None = 100, seed: int = 0, template: str | None = None):
    task = (
      self if template is None else CountdownTask(template, self.format_weight, self.require_format, **self.gen_kwargs)
    )
    insts = generate(100 if n is None else n, seed, split=split, **self.gen_kwargs)
    return [
      Problem(
        id=f"countdown-{split}-{seed}-{i}",
        task="countdown",
        prompt=task.prompt(inst),
        reference=inst.reference(),
        dataset="countdown",
        solution=inst.solution,
        grader=task,
      )
      for i, inst in enumerate(insts)
    ]

  def score(self, model_output: str, reference: dict, extraction: str | None = None) -> float:
    return verify(model_output, reference, self.format_weight, self.require_format)["reward"]

  def check_reference(self, reference) -> None:
    _check_reference(reference)

  can_demonstrate_wrong = True

  def demonstrate(self, problem: Problem) -> str:
    super().demonstrate(problem)  # raises for a problem without a solution
    expr = problem.solution
    numbers, target = problem.reference["numbers"], problem.reference["target"]
    if len(numbers) <= CANONICAL_MAX_NUMBERS:
      # The generator's random tree is one of many solutions (random order, structure); the
      # solver's shortest expression is a deterministic function of the instance, which a tiny
      # policy learns far faster (3 numbers: ~8% vs 0% greedy accuracy after 300 steps).
      expr = solve(numbers, target) or expr
    if _OPEN in problem.prompt:
      return f"{_OPEN}{expr}{_CLOSE}"
    return expr.replace(" ", "")

  def demonstrate_wrong(self, problem: Problem, rng: random.Random) -> str:
    """Every number used once, so the verifier's only complaint is the value; the right demonstration when
    every ordering and operator hits the target (no wrong answer exists)."""
    numbers, target = list(problem.reference["numbers"]), problem.reference["target"]
    for _ in range(64):
      rng.shuffle(numbers)
      expr = str(numbers[0]) + "".join(rng.choice("+-*/") + str(x) for x in numbers[1:])
      value, _ = evaluate_expression(expr, problem.reference["numbers"])
      if value is not None and value != target:
        return f"{_OPEN}{expr}{_CLOSE}" if _OPEN in problem.prompt else expr
    return self.demonstrate(problem)
