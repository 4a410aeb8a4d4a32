"""Answer extraction, normalization and equivalence for GSM8K, MATH and AIME.

Grading is two-staged so that it is fast, exact where possible, and can never hang the trainer:

1. Fast path (pure string work, linear in the output length): extract the final answer (see "Which answer
   counts"), parse it into an atom, a bare list (`1, -2`) or a bracketed tuple/interval (`(1, 4]`), normalize
   each atom (`\\dfrac` -> `\\frac`, thousands separators, signs, `$`, units, degrees, percent, trailing
   punctuation, `x = ...`, `f(x) = ...`, mixed numbers, clock times), and compare exactly: equal strings, or
   equal rationals when both sides are numbers (`0.5 == \\frac{1}{2} == 1/2`, but `0.33 != \\frac{1}{3}`: a
   decimal equals a fraction only when it is exact, so `0.0833` never matches `\\frac{1}{12}`).
2. Slow path, only when a side is not plain numbers (`2\\sqrt{2}` vs `\\sqrt{8}`): math-verify in a pool of
   persistent worker *processes*, each with a hard wall-clock timeout and a memory limit (why processes:
   docs/design_notes.md "tasks/answers.py"). A timeout, crash or error grades as "not equal".

Which answer counts (MATH-style outputs, `extract_math`):
  * The final `\\boxed{}` group, unless an explicit "final answer is X" / "Final Answer: X" statement comes
    after it ("... \\boxed{255} ... The final answer is $10,455$." grades 10,455; "The final answer is
    $\\boxed{5}$" grades 5). A later "the answer is correct" is commentary and does not override a box.
    Without any box, the last "answer is X" / "answer: X" statement counts.
  * A box group is the last box with the boxes just before it separated only by connectors (whitespace, `$`,
    `\\[ \\]`, `\\quad`, commas, "and", "or", `\\text{and}`, `x =`): `\\boxed{-2}\\quad\\text{and}\\quad\\boxed{1}`
    is `-2, 1`, but "first \\boxed{3}, wait, then \\boxed{4}" is 4. A boxed reference is read the same way.

Lists and numbers:
  * A bare comma list is unordered (`1, -2` == `-2, 1`); a bracketed one is ordered and its brackets must
    agree (`(1, 4) != (4, 1)`, `[-3, 2] != (-3, 2)`); a tuple against a bare list compares in order.
  * A comma is a thousands separator only in `10{,}000` / `10,\\!000` or when the whole answer is one number
    grouped as `[1-9]\\d{0,2}(,\\d{3})+` with no spaces (`7,425,000`): `32, 349` and `1,22` are lists.
  * A percent answer `X%` (`\\%`, "percent", "pct") equals both X and X/100; a bare number never equals its
    100-fold.

Nothing here raises on model output; callers get `None` for "no answer found". Outputs longer than
MAX_OUTPUT_CHARS are graded on their last MAX_OUTPUT_CHARS characters, so every call's cost is bounded.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

# Extracted answers longer than this are not sent to math-verify: no real
# final answer is that long, and sympy's cost grows badly with input size.
MAX_ANSWER_CHARS = 512
# Only the last this-many characters of a model output are graded (1 MiB):
# bounds every call's cost; a final answer sits at the end of the output.
MAX_OUTPUT_CHARS = 1 << 20
# Wall-clock limit of one math-verify call (seconds), read at call time.
MATH_VERIFY_TIMEOUT_S = 5.0
# Digits allowed in a number parsed on the fast path (bounds Fraction cost).
_MAX_NUMBER_CHARS = 64
# Items in a list answer compared on the fast path (bounds the matching cost).
_MAX_LIST_ITEMS = 32

__all__ = [
  "EXTRACTORS",
  "MAX_ANSWER_CHARS",
  "MATH_VERIFY_TIMEOUT_S",
  "MAX_OUTPUT_CHARS",
  "answers_match",
  "boxed_reference",
  "configure_math_verify",
  "extract_aime",
  "extract_answer",
  "extract_answer_is",
  "extract_answer_is_number",
  "extract_boxed",
  "extract_boxed_group",
  "extract_gsm8k",
  "extract_last_number",
  "extract_math",
  "marked_reference",
  "math_verify_equal",
  "math_verify_many",
  "normalize",
  "to_number",
]


# ----------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_BRACE_RE = re.compile(r"[{}]")


def _box_spans(text: str) -> list[tuple[int, int, str]]:
  """(start, end, content) of every complete `\\boxed{...}` / `\\fbox{...}`, in order.

  One pass builds the matching-brace table with a stack, so adversarial
  inputs (thousands of unclosed `\\boxed{`) stay O(len(text)).
  """
  first = _BOX_RE.search(text)
  if first is None:
    return []
  match: dict[int, int] = {}
  stack: list[int] = []
  for b in _BRACE_RE.finditer(text, first.end()):  # braces before the first box cannot matter
    i = b.start()
    if text[i] == "{":
      stack.append(i)
    elif stack:
      match[stack.pop()] = i
  out = []
  for m in _BOX_RE.finditer(text, first.start()):
    j = m.end()
    while j < len(text) and text[j] == " ":
      j += 1
    if j < len(text) and text[j] == "{":
      if j in match:
        out.append((m.start(), match[j] + 1, text[j + 1 : match[j]]))
    else:  # `\boxed 5`: the next whitespace/`$`-delimited token
      tok = re.match(r"[^\s$]+", text[j : j + MAX_ANSWER_CHARS])
      if tok:
        out.append((m.start(), j + tok.end(), tok.group(0)))
  return out


def _all_boxed(text: str) -> list[str]:
  """Contents of every complete box, in order."""
  return [c for _, _, c in _box_spans(text)]


def extract_boxed(text: str) -> str | None:
  """Content of the last complete `\\boxed{}` (nested braces allowed), else None."""
  boxes = _box_spans(text)
  return boxes[-1][2] if boxes else None


# Text allowed between two boxes of one answer group: whitespace, math
# delimiters, spacing, commas, "and"/"or" (bare or in \text{}), `&`, `\\`,
# and a variable being assigned (`x = \boxed{2}, y = \boxed{3}`). Single-character
# alternatives only (no `\s+` inside the `*`), so a failing match cannot backtrack
# exponentially; gaps are also capped at _MAX_GAP_CHARS.
_CONNECTOR_RE = re.compile(
  r"(?:\s|\$|\\[\[\]()]|\\q?quad\b|\\[,;: !]|[,;&.]|\\\\|\band\b|\bor\b|"
  r"\\(?:text|textnormal|mathrm)\s*\{\s*(?:and|or|,)?\s*\}|[a-zA-Z](?:_\{?\w+\}?)?\s*=)*",
  re.IGNORECASE,
)
_MAX_GAP_CHARS = 200
_MAX_GROUP_BOXES = 16


def _box_group(boxes: list[tuple[int, int, str]], text: str) -> list[tuple[int, int, str]]:
  """The last box and the boxes chained to it by connectors only (in text order)."""
  group = [boxes[-1]]
  for prev in reversed(boxes[:-1]):
    gap = text[prev[1] : group[0][0]]
    if len(gap) > _MAX_GAP_CHARS or len(group) >= _MAX_GROUP_BOXES or not _CONNECTOR_RE.fullmatch(gap):
      break
    group.insert(0, prev)
  return group


def extract_boxed_group(text: str) -> str | None:
  """The final box group as one answer: `\\boxed{-2} and \\boxed{1}` -> "-2, 1"; else None."""
  boxes = _box_spans(text)
  if not boxes:
    return None
  return ", ".join(c for _, _, c in _box_group(boxes, text))


_GSM8K_RE = re.compile(r"####[ \t]*([^\n#]*)")
_NUMBER_RE = re.compile(r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-−]?\.\d+")


def extract_gsm8k(text: str) -> str | None:
  """The number after the last `####` (GSM8K's answer marker), else None."""
  hits = _GSM8K_RE.findall(text)
  if not hits:
    return None
  nums = _NUMBER_RE.findall(hits[-1])
  return nums[0] if nums else (hits[-1].strip() or None)


_ANSWER_IS_RE = re.compile(
  r"(?:final answer|answer)\s*(?:is|:|=)\s*:?\s*([^\n]{1,%d})" % MAX_ANSWER_CHARS,
  re.IGNORECASE,
)
# Only an explicit *final* answer overrides an earlier box ("the answer is correct",
# "check the answer: ..." after a box are commentary).
_FINAL_ANSWER_RE = re.compile(r"final answer\s*(?:is|:|=)\s*:?\s*([^\n]{1,%d})" % MAX_ANSWER_CHARS, re.IGNORECASE)
_MATH_SEGMENT_RE = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
_IS_RE = re.compile(r"\b(?:is|are|equals|=)\s+")


def _last_statement(text: str, pattern: re.Pattern = _ANSWER_IS_RE) -> re.Match | None:
  last = None
  for last in pattern.finditer(text):
    pass
  return last


def _statement_answer(span: str) -> str | None:
  """The answer inside the text after "answer is" (up to the line end).

  "Final Answer: The final answer is $28\\%$. I hope it is correct." -> "28\\%";
  "The largest $n$ is 34." -> "34"; "$\\frac{1}{2}$." -> "\\frac{1}{2}".
  """
  for _ in range(4):  # "Final Answer: The final answer is X": the innermost statement
    inner = _last_statement(span)
    if inner is None:
      break
    span = inner.group(1)
  span = span.strip()
  boxes = _box_spans(span)
  if boxes:
    return ", ".join(c for _, _, c in _box_group(boxes, span))
  seg = _MATH_SEGMENT_RE.match(span)
  if seg:  # "$(0, 1)$. I hope it is correct."
    return next(g for g in seg.groups() if g is not None).strip() or None
  end = _SENTENCE_END_RE.search(span)
  if end:  # the first sentence only
    span = span[: end.start()]
  words = None
  if span[:1].isalpha():  # a sentence, not the answer itself: "The largest $n$ is 34" -> "34"
    for words in _IS_RE.finditer(span):
      pass
  if words is not None and words.end() < len(span):
    span = span[words.end() :]
  seg = _MATH_SEGMENT_RE.match(span.strip())
  if seg:
    span = next(g for g in seg.groups() if g is not None)
  return span.strip().rstrip(" .;,!") or None


def extract_answer_is(text: str) -> str | None:
  """The answer of the last "answer is" / "answer:" statement, else None."""
  m = _last_statement(text)
  return _statement_answer(m.group(1)) if m else None


def extract_math(text: str) -> str | None:
  """MATH: the final box group, unless a "final answer is" statement comes later (module docstring).

  Without a box, the last "answer is" / "answer:" statement.
  """
  boxes = _box_spans(text)
  if not boxes:
    stmt = _last_statement(text)
    return _statement_answer(stmt.group(1)) if stmt else None
  final = _last_statement(text, _FINAL_ANSWER_RE)
  if final is not None and final.start() > boxes[-1][0]:
    return _statement_answer(final.group(1))
  return ", ".join(c for _, _, c in _box_group(boxes, text))


def extract_last_number(text: str) -> str | None:
  """The last number-looking token (`-1,234.5`, `3/4`), else None."""
  last = None
  for last in _NUMBER_RE.finditer(text):
    pass
  return last.group(0) if last else None


def extract_answer_is_number(text: str) -> str | None:
  """The first number after the last "answer is" ("The answer is 15 apples since ..." -> "15")."""
  m = _last_statement(text)
  if m is None:
    return None
  num = _NUMBER_RE.search(m.group(1))
  return num.group(0) if num else None


def extract_aime(text: str) -> str | None:
  """AIME: the MATH answer (box or statement, whichever is later), else the last number."""
  ans = extract_math(text)
  if ans is not None:
    num = _NUMBER_RE.search(ans)
    return num.group(0) if num and to_number(normalize(ans)) is None else ans
  return extract_last_number(text)


def _chain(*fns):
  def extract(text: str) -> str | None:
    for fn in fns:
      ans = fn(text)
      if ans is not None:
        return ans
    return None

  return extract


# Named extraction methods; an eval protocol records which one it used.
EXTRACTORS = {
  # GSM8K: `#### N` (the training format), then boxed, then "answer is", then last number.
  "gsm8k": _chain(extract_gsm8k, extract_boxed, extract_answer_is_number, extract_last_number),
  # GSM8K strict: only the `####` marker counts.
  "gsm8k_strict": extract_gsm8k,
  # MATH: the final box group or a later "answer is"; no last-number guessing (answers are expressions).
  "math": extract_math,
  "boxed": extract_boxed,
  "aime": extract_aime,
  "last_number": extract_last_number,
}


def extract_answer(text: str, method: str) -> str | None:
  """Extract with a named method from EXTRACTORS on the output's last MAX_OUTPUT_CHARS; None for non-str."""
  if method not in EXTRACTORS:
    raise ValueError(f"extraction method {method!r} unknown; choose one of {sorted(EXTRACTORS)}")
  if not isinstance(text, str):
    return None
  return EXTRACTORS[method](text[-MAX_OUTPUT_CHARS:])


def boxed_reference(reference: str) -> str:
  """The bare answer inside a reference: its final box group (a MATH solution), else the reference as is."""
  if "\\boxed" in reference or "\\fbox" in reference:
    return extract_boxed_group(reference) or reference
  return reference


def marked_reference(reference: str) -> str:
  """The bare answer inside a GSM8K-style reference: the `#### N` number where the marker is, else
  `boxed_reference`."""
  if "####" in reference:
    return extract_gsm8k(reference) or reference
  return boxed_reference(reference)


# ----------------------------------------------------------------------------
# Normalization
# ----------------------------------------------------------------------------
_REMOVE = [
    "\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\qquad", "\\quad",
    "^{\\circ}", "^\\circ", "\\circ", "\\degree", "°", "\\%", "%", "\\$",
    "$", "\\(", "\\)", "\\[", "\\]",
]  # fmt: skip
_LATEX_THOUSANDS_RE = re.compile(r"(?<=\d)(?:\{,\}|,\\!)\s*(?=\d{3})")
_LONG_UNITS = (
  "units?|square|cubic|meters?|metres?|inch(?:es)?|feet|foot|yards?|"
  "miles?|mph|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|years?|"
  "dollars?|cents?|degrees?|pounds?|lbs|ounces?|grams?|liters?|litres?|"
  "gallons?|people|students?|apples?|points?|ways?|times|percent(?:age)?|pct"
)
# Letters glued to a number are a product with a variable (`10m`), so these need a space.
_SHORT_UNITS = "sq|cm|mm|km|m|in|ft|lb|oz|g|kg|l|ml"
# One place for whitespace per unit: nested optional \s* would backtrack exponentially.
_UNIT = r"(?:%s|%s)\b(?:\s*\^\{?\d\}?)?\s*" % (_LONG_UNITS, _SHORT_UNITS)
_TRAILING_UNITS_RE = re.compile(r"^(.*?\d)(?:\s+|(?=(?:%s)\b))(?:%s)+$" % (_LONG_UNITS, _UNIT), re.IGNORECASE)
_GLUED_RE = re.compile(r"^[+-]?\d+(?:\.\d+)?(?:%s)$" % _SHORT_UNITS)
_PERCENT_RE = re.compile(r"(?:\\?%|\bpercent(?:age)?\b|\bpct\b)\s*[.]?\s*$", re.IGNORECASE)
_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm|textnormal|mathbf)\s*\{([^{}]*)\}")
_VAR_EQ_RE = re.compile(r"^(?:[a-zA-Z](?:_\{?\w+\}?)?|[a-zA-Z]\([a-zA-Z]\))\s*=\s*(?!=)")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\d)\s*(\d)")
_SQRT_SHORT_RE = re.compile(r"\\sqrt\s*(\d)")
_THOUSANDS_RE = re.compile(r"^[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?$")
_CHOICE_RE = re.compile(r"^\(?([A-E])\)?$")
_TIME_RE = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?\s*(?:\\text\{\s*)?(?:([ap])\.?\s*m\.?)?\s*\}?$", re.IGNORECASE)
_MIXED_RE = re.compile(r"^([+-]?)(\d+)(?:\s+(\d+)/(\d+)|\\frac\{(\d+)\}\{(\d+)\})$")


def _clean(ans: str) -> str:
  """Delimiters, spacing and LaTeX thousands removed; `\\dfrac`/`\\tfrac`/`\\cfrac` -> `\\frac`."""
  s = ans.strip().replace("−", "-")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\cfrac", "\\frac")
  s = _LATEX_THOUSANDS_RE.sub("", s)
  for tok in ("\\left", "\\right", "\\displaystyle", "\\$", "$", "\\(", "\\)", "\\[", "\\]"):
    s = s.replace(tok, "")
  s = s.strip()
  if not s.endswith(("...", "\\dots", "\\ldots", "\\cdots")):  # "1, 2, 3, ..." is not "1, 2, 3"
    s = s.rstrip(".,;:!?").strip()
  return s


def _time(s: str) -> str | None:
  """Canonical "H:MM:SS" of a clock time ("8:34 p.m." -> "20:34:00"), else None."""
  m = _TIME_RE.match(s)
  if not m:
    return None
  h, mi, sec = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
  if m.group(4):
    h = h % 12 + (12 if m.group(4).lower() == "p" else 0)
  return f"{h}:{mi:02d}:{sec:02d}"


def normalize(ans: str) -> str:
  """Canonical string form of one extracted answer atom (see module docstring).

  Numbers come out in a canonical rational form ("1/2", "-3"), so two
  numerically equal plain numbers normalize to the same string.
  """
  s = _clean(ans)
  t = _time(s)
  if t is not None:
    return t
  for tok in _REMOVE:
    s = s.replace(tok, "")
  s = s.strip()
  # `\text{...}` alone is the answer ("\text{(B)}"); next to other text it is a unit.
  whole = _TEXT_RE.fullmatch(s)
  if whole:
    s = whole.group(1)
  else:
    stripped = _TEXT_RE.sub("", s).strip()
    if stripped:
      s = re.sub(r"\^\{?\d\}?$", "", stripped) if stripped != s else s
  s = s.strip().rstrip(".,;:!?").strip()
  units = _TRAILING_UNITS_RE.match(s)
  if units:
    s = units.group(1)
  s = _VAR_EQ_RE.sub("", s).strip()
  if _THOUSANDS_RE.match(s):  # before spaces go: "32, 349" is a list, not 32349
    s = s.replace(",", "")
  s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
  mixed = _MIXED_RE.match(s)
  if mixed:  # "1 1/2", "2\frac{5}{8}": a whole number and a proper fraction
    whole_part, num, den = (
      int(mixed.group(2)),
      int(mixed.group(3) or mixed.group(5)),
      int(mixed.group(4) or mixed.group(6)),
    )
    if 0 < num < den:
      v = whole_part + Fraction(num, den)
      return str(-v if mixed.group(1) == "-" else v)
  s = s.replace(" ", "").replace("\n", "").replace("\t", "")
  s = _SQRT_SHORT_RE.sub(r"\\sqrt{\1}", s)
  choice = _CHOICE_RE.match(s)
  if choice:
    s = choice.group(1)
  s = s.rstrip(".")
  num = to_number(s)
  if num is not None:
    return str(num)
  return s.lstrip("+") if s.startswith("+") else s


_DEC = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PLAIN_RE = re.compile(r"^([+-]?)(%s)$" % _DEC)
_SLASH_RE = re.compile(r"^([+-]?)(%s)/(%s)$" % (_DEC, _DEC))
_FRAC_RE = re.compile(r"^([+-]?)\\frac\{([+-]?)(%s)\}\{([+-]?)(%s)\}$" % (_DEC, _DEC))


def to_number(s: str) -> Fraction | None:
  """Exact rational value of a plain number (`-12`, `0.5`, `3/4`, `\\frac{-1}{2}`), else None.

  Scientific notation is deliberately not parsed: `1e999999` would build a
  million-digit integer.
  """
  if len(s) > _MAX_NUMBER_CHARS:
    return None
  try:
    m = _PLAIN_RE.match(s)
    if m:
      v = Fraction(m.group(2))
      return -v if m.group(1) == "-" else v
    m = _SLASH_RE.match(s)
    if m:
      v = Fraction(m.group(2)) / Fraction(m.group(3))
      return -v if m.group(1) == "-" else v
    m = _FRAC_RE.match(s)
    if m:
      num = Fraction(m.group(3)) * (-1 if m.group(2) == "-" else 1)
      den = Fraction(m.group(5)) * (-1 if m.group(4) == "-" else 1)
      v = num / den
      return -v if m.group(1) == "-" else v
  except (ValueError, ZeroDivisionError):
    return None
  return None


# ----------------------------------------------------------------------------
# Structured answers: atoms, bare lists, bracketed tuples / intervals
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Answer:
  """kind: "atom" | "list" (bare, unordered) | two bracket chars like "()" or "(]" (ordered).

  norm: the normalized atom string; values: the exact values an atom may mean
  (two for a percent, X and X/100), None when it is not a plain number.
  """

  kind: str
  norm: str = ""
  values: frozenset | None = None
  items: tuple = ()

  @property
  def numeric(self) -> bool:
    return self.values is not None if self.kind == "atom" else all(i.numeric for i in self.items)


def _split_top(s: str) -> list[str]:
  """s split at commas outside (), [], {} (one linear pass)."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(s):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(s[start:i])
      start = i + 1
  parts.append(s[start:])
  return parts


def _wraps(s: str, opens: str, closes: str) -> bool:
  """Whether s[0] (in opens) is closed exactly by s[-1] (in closes)."""
  if len(s) < 2 or s[0] not in opens or s[-1] not in closes:
    return False
  depth = 0
  for i, ch in enumerate(s):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if depth == 0:
      return i == len(s) - 1
  return False


def _atom(s: str) -> _Answer:
  norm = normalize(s)
  v = to_number(norm)
  if v is None:
    return _Answer("atom", norm)
  percent = _PERCENT_RE.search(_TEXT_RE.sub(r"\1", _clean(s))) is not None
  return _Answer("atom", norm, frozenset({v, v / 100}) if percent else frozenset({v}))


def _parse(s: str, depth: int = 0) -> _Answer:
  s = _clean(s)
  if depth < 3 and _wraps(s, "{", "}") and not s.startswith("\\"):
    s = s[1:-1].strip()  # LaTeX grouping braces: `{1,3}` renders as 1,3
  if depth < 3 and _wraps(s, "([", ")]"):
    parts = _split_top(s[1:-1])
    if len(parts) >= 2:
      return _Answer(s[0] + s[-1], items=tuple(_parse(p, depth + 1) for p in parts[:_MAX_LIST_ITEMS]))
    if s[0] == "(" and s[-1] == ")" and not _CHOICE_RE.match(s):  # "(2/3)" is 2/3
      return _parse(s[1:-1], depth + 1)
  if depth < 3 and not _THOUSANDS_RE.match(s.replace(" ", "") if "," in s and ", " not in s else s):
    parts = [p for p in _split_top(s) if p.strip()]
    if len(parts) >= 2:
      return _Answer("list", items=tuple(_parse(p, depth + 1) for p in parts[:_MAX_LIST_ITEMS]))
  return _atom(s)


def _compare(a: _Answer, b: _Answer) -> bool | None:
  """True / False when the fast path decides, None when math-verify must."""
  decided_false = False if a.numeric and b.numeric else None
  if a.kind == "atom" and b.kind == "atom":
    if not a.norm or not b.norm:
      return False  # an empty answer matches nothing
    if a.norm == b.norm:
      return True
    if a.values is not None and b.values is not None:
      return bool(a.values & b.values)
    if (a.values is not None and _GLUED_RE.match(b.norm)) or (b.values is not None and _GLUED_RE.match(a.norm)):
      return False  # `10m` is 10 times m, not 10 metres (math-verify would strip it as a unit)
    return None
  if a.kind == "atom" or b.kind == "atom":
    return decided_false
  if len(a.items) != len(b.items):
    return decided_false
  if a.kind == "list" and b.kind == "list":  # unordered: match each item once
    left = list(b.items)
    for x in a.items:
      j = next((j for j, y in enumerate(left) if _compare(x, y) is True), None)
      if j is None:
        return decided_false
      left.pop(j)
    return True
  if a.kind != b.kind and "list" not in (a.kind, b.kind):
    return decided_false  # [a, b) vs (a, b)
  if "list" in (a.kind, b.kind) and "(" not in (a.kind[0] + b.kind[0]):
    return decided_false if a.numeric and b.numeric else None
  verdicts = [_compare(x, y) for x, y in zip(a.items, b.items)]
  if all(v is True for v in verdicts):
    return True
  if any(v is False for v in verdicts):
    return False
  return None


# ----------------------------------------------------------------------------
# math-verify in a pool of killable worker processes
# ----------------------------------------------------------------------------
_WORKER_CODE = r"""
import json, re, sys
try:
    import resource
    _lim = 4 << 30  # address-space cap: a runaway sympy expression dies, not the host
    resource.setrlimit(resource.RLIMIT_AS, (_lim, _lim))
except Exception:
    pass
import sympy
from math_verify import parse, verify
_TRIG = re.compile(r"\\(?:sin|cos|tan|sec|csc|cot)\b")
_DEG = re.compile(r"(\d+(?:\.\d+)?)\s*\^\s*(?:\{\s*\\circ\s*\}|\\circ)")

def prep(s):
    # Degrees inside a trig argument are an angle unit: sin(90^\circ - x) = cos x.
    return _DEG.sub(r"(\1\\pi/180)", s) if _TRIG.search(s) else s

def only_i(p):
    fs = getattr(p[0], "free_symbols", None) if p else None
    return bool(fs) and {getattr(x, "name", "") for x in fs} == {"i"}

def with_i(p):
    return [p[0].subs({x: sympy.I for x in p[0].free_symbols})]

sys.stdout.write("ready\n"); sys.stdout.flush()
for line in sys.stdin:
    ok = False
    try:
        req = json.loads(line)
        t = int(req["t"])
        gold = parse("$" + prep(req["gold"]) + "$", parsing_timeout=t)
        pred = parse("$" + prep(req["pred"]) + "$", parsing_timeout=t)
        if only_i(gold) and only_i(pred):  # no other unknowns: i is the imaginary unit
            gold, pred = with_i(gold), with_i(pred)
        ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=t))
    except BaseException:
        ok = False
    sys.stdout.write(json.dumps({"ok": ok}) + "\n"); sys.stdout.flush()
"""


class _MathVerifyWorker:
  """A persistent math-verify subprocess; killed and restarted on timeout.

  The process is a fresh interpreter started by exec (what multiprocessing's
  "spawn" context does, without re-importing the parent's `__main__`): nothing
  of a parent that runs JAX threads is ever forked into a Python child.
  """

  def __init__(self, code: str = _WORKER_CODE):
    self._code = code
    self._proc: subprocess.Popen | None = None
    self._lock = threading.Lock()
    self._broken = False  # math-verify cannot even start: stop trying
    self._pid = os.getpid()

  def _start(self, startup_timeout_s: float) -> bool:
    self._proc = subprocess.Popen(
      [sys.executable, "-c", self._code],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
      env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if self._readline(startup_timeout_s) != "ready":
      self._kill()
      self._broken = True
      return False
    return True

  def _readline(self, timeout_s: float) -> str | None:
    assert self._proc is not None and self._proc.stdout is not None
    ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
    if not ready:
      return None
    line = self._proc.stdout.readline()
    return line.strip() if line else None

  def _kill(self):
    if self._proc is not None:
      try:
        self._proc.kill()
        self._proc.wait(timeout=5)
      except Exception:
        pass
    self._proc = None

  def _after_fork(self):
    # A forked child (e.g. a rollout worker) must not share the parent's pipes:
    # forget the parent's worker without killing it and start its own.
    if os.getpid() != self._pid:
      self._pid = os.getpid()
      self._proc = None
      self._lock = threading.Lock()

  def equal(self, gold: str, pred: str, timeout_s: float) -> bool:
    self._after_fork()
    with self._lock:
      if self._broken:
        return False
      try:
        if self._proc is None or self._proc.poll() is not None:
          if not self._start(startup_timeout_s=60.0):
            return False
        req = json.dumps({"gold": gold, "pred": pred, "t": max(1, int(timeout_s))})
        self._proc.stdin.write(req + "\n")
        self._proc.stdin.flush()
        line = self._readline(timeout_s + 1.0)
        if line is None:  # hung or died: kill so the next call starts clean
          self._kill()
          return False
        return bool(json.loads(line).get("ok", False))
      except Exception:
        self._kill()
        return False

  def close(self):
    self._after_fork()
    with self._lock:
      self._kill()


class _MathVerifyPool:
  """size workers, each serving one request at a time; callers borrow a free one.

  A call waits at most wait_s for a free worker (then grades "not equal") and
  at most timeout_s + 1 for its answer, so every call is bounded. Workers start
  lazily and the most recently used is lent first (LIFO), so sequential use
  keeps one process warm and concurrent use (`math_verify_many`, threads)
  grows to `size` processes that run their sympy work in parallel.
  """

  def __init__(self, size: int, code: str = _WORKER_CODE, wait_s: float = 120.0):
    if size < 1:
      raise ValueError(f"math-verify pool size must be >= 1, got {size}")
    self.size, self._code, self.wait_s = size, code, wait_s
    self._pid = os.getpid()
    self._build()

  def _build(self):
    self._workers = [_MathVerifyWorker(self._code) for _ in range(self.size)]
    self._free: queue.LifoQueue = queue.LifoQueue()
    for w in reversed(self._workers):
      self._free.put(w)

  def equal(self, gold: str, pred: str, timeout_s: float) -> bool:
    if os.getpid() != self._pid:  # forked child: fresh workers of its own
      self._pid = os.getpid()
      self._build()
    try:
      w = self._free.get(timeout=self.wait_s)
    except queue.Empty:
      return False
    try:
      return w.equal(gold, pred, timeout_s)
    finally:
      self._free.put(w)

  def close(self):
    for w in self._workers:
      w.close()


def _default_pool_size() -> int:
  env = os.environ.get("VCPO_MATH_VERIFY_WORKERS")
  if env:
    try:
      n = int(env)
    except ValueError:
      raise ValueError(f"VCPO_MATH_VERIFY_WORKERS={env!r} must be an integer >= 1") from None
    if n < 1:
      raise ValueError(f"VCPO_MATH_VERIFY_WORKERS={env!r} must be an integer >= 1")
    return n
  return max(1, min(4, os.cpu_count() or 1))


_POOL = _MathVerifyPool(_default_pool_size())
atexit.register(lambda: _POOL.close())


def configure_math_verify(workers: int) -> None:
  """Replace the math-verify pool with one of `workers` processes (default: $VCPO_MATH_VERIFY_WORKERS or min(4, cpus))."""
  global _POOL
  old, _POOL = _POOL, _MathVerifyPool(int(workers))
  old.close()


def math_verify_equal(gold: str, pred: str, timeout_s: float | None = None) -> bool:
  """math-verify equivalence of two answer strings, in a killable pooled worker process.

  Returns False on timeout, worker crash, parse failure, or inputs longer than
  MAX_ANSWER_CHARS; never raises, never blocks longer than about timeout_s
  (default MATH_VERIFY_TIMEOUT_S; plus a one-off worker start of about a second, plus the wait for a free
  worker when more than the pool's size of calls run at once).
  """
  if not isinstance(gold, str) or not isinstance(pred, str):
    return False
  if len(gold) > MAX_ANSWER_CHARS or len(pred) > MAX_ANSWER_CHARS:
    return False
  return _POOL.equal(gold, pred, MATH_VERIFY_TIMEOUT_S if timeout_s is None else timeout_s)


def math_verify_many(pairs, timeout_s: float | None = None) -> list[bool]:
  """math_verify_equal over (gold, pred) pairs, up to the pool's size at once.

  k slow pairs finish in about ceil(k / pool size) timeouts, not k.
  """
  pairs = list(pairs)
  if len(pairs) <= 1:
    return [math_verify_equal(g, p, timeout_s) for g, p in pairs]
  with ThreadPoolExecutor(max_workers=min(_POOL.size, len(pairs))) as ex:
    return list(ex.map(lambda gp: math_verify_equal(gp[0], gp[1], timeout_s), pairs))


def answers_match(pred: str | None, ref: str, use_math_verify: bool = True, timeout_s: float | None = None) -> bool:
  """Whether an extracted answer equals the reference answer.

  Exact fast path first (atoms, unordered bare lists, ordered tuples and
  intervals; normalized strings, then exact rationals: see the module
  docstring), which decides whenever both sides are plain numbers;
  math-verify only when a side is symbolic. Raises only on a grading bug
  (callers such as `tasks.score` count those), never on odd input.
  """
  if not isinstance(pred, str) or not isinstance(ref, str):
    return False
  verdict = _compare(_parse(pred[:MAX_OUTPUT_CHARS]), _parse(ref))
  if verdict is not None:
    return verdict
  if not use_math_verify:
    return False
  return math_verify_equal(ref, pred, timeout_s)
