"""Answer extraction, normalization and equivalence for GSM8K, MATH and AIME.

Grading is two-staged so that it is fast, exact where possible, and can never
hang the trainer:

1. Fast path (pure string work, linear in the output length): extract the final
   answer (`#### N`, the last `\\boxed{...}` with nested braces, "the answer is
   X", or the last number), normalize it (`\\dfrac` -> `\\frac`, thousands
   separators, signs, `$`, units in `\\text{}`, degrees, percent, trailing
   punctuation, `x = ...`), and compare exactly: equal strings, or equal
   rationals when both sides are numbers (`0.5 == \\frac{1}{2} == 1/2`, but
   `0.33 != \\frac{1}{3}`: a decimal equals a fraction only when it is exact).
2. Slow path, only when a side is not a plain number (`2\\sqrt{2}` vs
   `\\sqrt{8}`): math-verify in a persistent worker *process* with a hard
   wall-clock timeout and a memory limit. math-verify's own timeout uses
   `signal.alarm`, which works only in the main thread and cannot interrupt
   long C-level work (sympy big-integer arithmetic); a separate process that
   is killed on timeout can. A timeout, crash or error grades as "not equal".

Nothing here raises on model output; callers get `None` for "no answer found".
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction

# Extracted answers longer than this are not sent to math-verify: no real
# final answer is that long, and sympy's cost grows badly with input size.
MAX_ANSWER_CHARS = 512
# Digits allowed in a number parsed on the fast path (bounds Fraction cost).
_MAX_NUMBER_CHARS = 64

__all__ = [
  "EXTRACTORS",
  "MAX_ANSWER_CHARS",
  "answers_match",
  "extract_answer",
  "extract_boxed",
  "extract_gsm8k",
  "extract_answer_is",
  "extract_answer_is_number",
  "extract_last_number",
  "extract_aime",
  "normalize",
  "to_number",
  "math_verify_equal",
  "reference_answer",
]


# ----------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_BRACE_RE = re.compile(r"[{}]")


def _all_boxed(text: str) -> list[str]:
  """Contents of every complete `\\boxed{...}` / `\\fbox{...}`, in order.

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
        out.append(text[j + 1 : match[j]])
    else:  # `\boxed 5`: the next whitespace/`$`-delimited token
      tok = re.match(r"[^\s$]+", text[j : j + MAX_ANSWER_CHARS])
      if tok:
        out.append(tok.group(0))
  return out


def extract_boxed(text: str) -> str | None:
  """Content of the last complete `\\boxed{}` (nested braces allowed), else None."""
  boxes = _all_boxed(text)
  return boxes[-1] if boxes else None


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


def extract_answer_is(text: str) -> str | None:
  """The span after the last "answer is" / "answer:" up to the line end."""
  hits = _ANSWER_IS_RE.findall(text)
  if not hits:
    return None
  ans = hits[-1].strip()
  boxed = extract_boxed(ans)
  if boxed is not None:
    return boxed
  if ans.startswith("$") and ans.count("$") >= 2:  # "$\frac{1}{2}$."
    ans = ans[1 : ans.index("$", 1)]
  return ans.rstrip(" .;,!") or None


def extract_last_number(text: str) -> str | None:
  """The last number-looking token (`-1,234.5`, `3/4`), else None."""
  last = None
  for last in _NUMBER_RE.finditer(text):
    pass
  return last.group(0) if last else None


def extract_answer_is_number(text: str) -> str | None:
  """The first number after the last "answer is" ("The answer is 15 apples since ..." -> "15")."""
  ans = extract_answer_is(text)
  if ans is None:
    return None
  m = _NUMBER_RE.search(ans)
  return m.group(0) if m else None


def extract_aime(text: str) -> str | None:
  """AIME: boxed, else the number after "answer is", else the last number (an integer 0..999)."""
  for fn in (extract_boxed, extract_answer_is_number, extract_last_number):
    ans = fn(text)
    if ans is not None:
      return ans
  return None


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
  # MATH: last boxed, then "answer is"; no last-number guessing (answers are expressions).
  "math": _chain(extract_boxed, extract_answer_is),
  "boxed": extract_boxed,
  "aime": extract_aime,
  "last_number": extract_last_number,
}


def extract_answer(text: str, method: str) -> str | None:
  """Extract with a named method from EXTRACTORS; None for non-str or no answer."""
  if method not in EXTRACTORS:
    raise ValueError(f"extraction method {method!r} unknown; choose one of {sorted(EXTRACTORS)}")
  if not isinstance(text, str):
    return None
  try:
    return EXTRACTORS[method](text)
  except Exception:  # never let model output crash grading
    return None


def reference_answer(reference: str, task: str) -> str:
  """The bare answer inside a reference: `#### N` for GSM8K, last boxed for MATH."""
  if task == "gsm8k" and "####" in reference:
    return extract_gsm8k(reference) or reference
  if "\\boxed" in reference or "\\fbox" in reference:
    return extract_boxed(reference) or reference
  return reference


# ----------------------------------------------------------------------------
# Normalization
# ----------------------------------------------------------------------------
_REMOVE = [
    "\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ",
    "{,}", "^{\\circ}", "^\\circ", "\\circ", "\\degree", "°", "\\%", "%", "\\$",
    "$", "\\(", "\\)", "\\[", "\\]",
]  # fmt: skip
_UNIT_WORDS = (
  "units?|square|sq|cubic|cm|mm|km|m|meters?|metres?|inch(?:es)?|in|feet|foot|ft|yards?|"
  "miles?|mph|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|years?|"
  "dollars?|cents?|degrees?|pounds?|lbs?|ounces?|oz|grams?|g|kg|liters?|litres?|l|ml|"
  "gallons?|people|students?|apples?|points?|ways?|times|percent"
)
_TRAILING_UNITS_RE = re.compile(r"^(.*?\d)\s*(?:(?:%s)\b\s*(?:\^\{?\d\}?)?\s*)+$" % _UNIT_WORDS, re.I)
_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm|textnormal|mathbf)\s*\{([^{}]*)\}")
_VAR_EQ_RE = re.compile(r"^[a-zA-Z]\s*=\s*(?!=)")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\d)\s*(\d)")
_SQRT_SHORT_RE = re.compile(r"\\sqrt\s*(\d)")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_CHOICE_RE = re.compile(r"^\(?([A-E])\)?$")


def normalize(ans: str) -> str:
  """Canonical string form of an extracted answer (see module docstring).

  Numbers come out in a canonical rational form ("1/2", "-3"), so two
  numerically equal plain numbers normalize to the same string.
  """
  s = ans.strip().replace("−", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
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
  s = _VAR_EQ_RE.sub("", s)
  s = s.replace(" ", "").replace("\n", "").replace("\t", "")
  if _THOUSANDS_RE.match(s):
    s = s.replace(",", "")
  s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
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
# math-verify in a killable worker process
# ----------------------------------------------------------------------------
_WORKER_CODE = r"""
import json, sys
try:
    import resource
    _lim = 4 << 30  # address-space cap: a runaway sympy expression dies, not the host
    resource.setrlimit(resource.RLIMIT_AS, (_lim, _lim))
except Exception:
    pass
from math_verify import parse, verify
sys.stdout.write("ready\n"); sys.stdout.flush()
for line in sys.stdin:
    ok = False
    try:
        req = json.loads(line)
        t = int(req["t"])
        gold = parse("$" + req["gold"] + "$", parsing_timeout=t)
        pred = parse("$" + req["pred"] + "$", parsing_timeout=t)
        ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=t))
    except BaseException:
        ok = False
    sys.stdout.write(json.dumps({"ok": ok}) + "\n"); sys.stdout.flush()
"""


class _MathVerifyWorker:
  """A persistent math-verify subprocess; killed and restarted on timeout."""

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


_WORKER = _MathVerifyWorker()
atexit.register(_WORKER.close)


def math_verify_equal(gold: str, pred: str, timeout_s: float = 5.0) -> bool:
  """math-verify equivalence of two answer strings, in a killable worker process.

  Returns False on timeout, worker crash, parse failure, or inputs longer than
  MAX_ANSWER_CHARS; never raises, never blocks longer than about timeout_s
  (plus a one-off worker start of about a second).
  """
  if not isinstance(gold, str) or not isinstance(pred, str):
    return False
  if len(gold) > MAX_ANSWER_CHARS or len(pred) > MAX_ANSWER_CHARS:
    return False
  return _WORKER.equal(gold, pred, timeout_s)


def answers_match(pred: str | None, ref: str, use_math_verify: bool = True, timeout_s: float = 5.0) -> bool:
  """Whether an extracted answer equals the reference answer.

  Exact fast path first (normalized strings, then exact rationals when both are
  plain numbers, which decides the case without math-verify); math-verify only
  when a side is symbolic. Never raises.
  """
  if not isinstance(pred, str) or not isinstance(ref, str):
    return False
  try:
    npred, nref = normalize(pred), normalize(ref)
    if npred == nref:
      return bool(npred)
    if to_number(npred) is not None and to_number(nref) is not None:
      return False  # both plain numbers, and their exact values differ
    if not use_math_verify:
      return False
    return math_verify_equal(ref, pred, timeout_s)
  except Exception:
    return False
