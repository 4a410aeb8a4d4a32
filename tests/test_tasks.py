"""Tests for vcpo_jax.tasks: answer grading table, countdown, arithmetic, loaders, registry."""

import json
import os
import random
import re
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vcpo_jax import tasks
from vcpo_jax.tasks import answers, arithmetic, countdown, datasets

# ----------------------------------------------------------------------------
# The grading table: (task, model output, reference, expected correct?)
# ----------------------------------------------------------------------------
CASES = [
  # --- GSM8K: "#### N", thousands separators, signs, units, punctuation, fallbacks
  ("gsm8k", "3 * 12 = 36, 36 - 10 = 26\n#### 26", "26", True),
  ("gsm8k", "#### 26", "He has 26.\n#### 26", True),  # full reference accepted
  ("gsm8k", "So the total is\n#### 1,920", "1920", True),
  ("gsm8k", "#### 1920", "1,920", True),
  ("gsm8k", "#### $1,920.00", "1920", True),
  ("gsm8k", "#### 1920 dollars", "1920", True),
  ("gsm8k", "#### -7", "-7", True),
  ("gsm8k", "#### 7", "-7", False),
  ("gsm8k", "#### −7", "-7", True),  # unicode minus
  ("gsm8k", "The answer is 15.", "15", True),
  ("gsm8k", "The answer is 15.5", "15", False),
  ("gsm8k", "The answer is: 15 apples, since 3 + 12 = 15 and 4 more", "15", True),
  ("aime", "So the answer is 33 since 3 * 11 = 33 and 2", "33", True),
  ("gsm8k", "It costs 3 dollars each, so 4 cost 12 dollars.", "12", True),  # last number
  ("gsm8k", "It costs 12 dollars; 4 of them.", "12", False),  # last number is 4
  ("gsm8k", "\\boxed{42}", "42", True),
  ("gsm8k", "first #### 5 then corrected #### 6", "6", True),
  ("gsm8k", "#### 6\n more text 7", "6", True),  # the marker beats the last number
  ("gsm8k", "", "6", False),
  ("gsm8k", "I don't know.", "6", False),
  ("gsm8k", "#### 2.50", "2.5", True),
  ("gsm8k", "#### 0.5", "1/2", True),
  ("gsm8k", "#### 100", "1000", False),
  ("gsm8k", "#### 1,000,000", "1000000", True),
  # --- MATH: boxed with nested braces, \frac / \dfrac, decimals vs fractions, units, text
  ("math", "so $\\boxed{\\frac{5}{6}}$.", "\\frac{5}{6}", True),
  ("math", "$\\boxed{\\dfrac{5}{6}}$", "\\frac{5}{6}", True),
  ("math", "$\\boxed{\\tfrac56}$", "\\frac{5}{6}", True),
  ("math", "\\boxed{5/6}", "\\frac{5}{6}", True),
  ("math", "\\boxed{0.5}", "\\frac{1}{2}", True),
  ("math", "\\boxed{0.33}", "\\frac{1}{3}", False),  # decimals equal fractions only when exact
  ("math", "\\boxed{\\frac{-3}{4}}", "-\\frac{3}{4}", True),
  ("math", "\\boxed{-\\frac{3}{4}}", "\\frac{3}{4}", False),
  ("math", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}", True),  # nested braces
  ("math", "\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", True),  # symbolic: math-verify
  ("math", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
  ("math", "\\boxed{3\\sqrt{2}}", "\\sqrt{8}", False),
  ("math", "\\boxed{5 \\sqrt{2}}", "5\\sqrt{2}", True),
  ("math", "\\boxed{9\\pi}", "9\\pi", True),
  ("math", "\\boxed{9}", "9\\pi", False),
  ("math", "\\boxed{12,000}", "12{,}000", True),
  ("math", "\\boxed{720^\\circ}", "720", True),
  ("math", "\\boxed{720 \\text{ degrees}}", "720", True),
  ("math", "\\boxed{10\\text{ cm}^2}", "10", True),
  ("math", "\\boxed{50\\%}", "50", True),
  ("math", "\\boxed{x = 4}", "4", True),
  ("math", "\\boxed{(1,4)}", "(1,4)", True),
  ("math", "\\boxed{(1, 4)}", "(1,4)", True),
  ("math", "\\boxed{(4,1)}", "(1,4)", False),
  ("math", "\\boxed{x+1}", "x+1", True),
  ("math", "\\boxed{1+x}", "x+1", True),  # commutativity via math-verify
  ("math", "\\boxed{\\text{(B)}}", "B", True),
  ("math", "\\boxed{(C)}", "\\text{(B)}", False),
  ("math", "first \\boxed{3} then \\boxed{4}", "4", True),  # last box counts
  ("math", "first \\boxed{4} then \\boxed{3}", "4", False),
  ("math", "\\boxed 7", "7", True),
  ("math", "\\boxed{4", "4", False),  # unclosed box, no answer
  ("math", "The final answer is $\\frac{2}{3}$.", "\\frac{2}{3}", True),
  ("math", "no boxed answer here, 4", "4", False),  # MATH does not guess the last number
  ("math", "\\boxed{0.2}", "\\frac{1}{5}", True),
  ("math", "\\boxed{.2}", "0.2", True),
  ("math", "\\boxed{+3}", "3", True),
  ("math", "\\boxed{\\left(\\frac{2}{3}\\right)}", "\\frac{2}{3}", True),
  ("math", "\\boxed{4x+4}", "4x+4", True),
  ("math", "\\boxed{4x+5}", "4x+4", False),
  ("math", "\\boxed{(-1,4]}", "(-1,4]", True),
  ("math500", "\\boxed{\\frac{7}{12}}", "\\frac{7}{12}", True),
  ("math500", "\\boxed{2.25}", "\\frac{9}{4}", True),
  # --- AIME: integers 0..999, leading zeros
  ("aime", "\\boxed{033}", "33", True),
  ("aime", "\\boxed{33}", "033", True),
  ("aime", "The answer is 000.", "0", True),
  ("aime", "so we get 142", "142", True),
  ("aime", "\\boxed{141}", "142", False),
  ("aime", "\\boxed{142.0}", "142", True),
  ("aime", "", "142", False),
]


def test_table_is_large_enough():
  assert len(CASES) >= 60


@pytest.mark.parametrize("task,output,reference,expected", CASES)
def test_answer_table(task, output, reference, expected):
  r = tasks.score(task, output, reference)
  assert tasks.is_correct(r) == expected, (task, output, reference, r)
  assert r in (0.0, 1.0)


def test_extract_boxed_nested_and_linear():
  assert answers.extract_boxed("\\boxed{\\frac{a}{\\sqrt{b^{2}}}}") == "\\frac{a}{\\sqrt{b^{2}}}"
  assert answers.extract_boxed("\\fbox{7}") == "7"
  assert answers.extract_boxed("nothing") is None
  # 200k unclosed boxes: the brace table keeps this linear.
  text = "\\boxed{" * 200_000
  assert answers.extract_boxed(text) is None


def test_normalize_examples():
  assert answers.normalize("\\dfrac{1}{2}") == "1/2"
  assert answers.normalize("$1,234$.") == "1234"
  assert answers.normalize("-\\frac{3}{4}") == "-3/4"
  assert answers.normalize("\\text{(C)}") == "C"
  assert answers.normalize("18 dollars") == "18"


def test_to_number_rejects_scientific_and_huge():
  assert answers.to_number("1e999999") is None
  assert answers.to_number("9" * 1000) is None
  assert answers.to_number("\\frac{1}{0}") is None
  assert answers.to_number("-.5") == answers.to_number("-1/2")


_HANGING_WORKER = """
import sys, time
sys.stdout.write("ready\\n"); sys.stdout.flush()
for line in sys.stdin:
    time.sleep(3600)  # stands in for sympy stuck in C code, which signal.alarm cannot stop
"""
_CRASHING_WORKER = """
import sys, os
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline(); os._exit(3)
"""


def test_math_verify_worker_killed_on_hang_and_crash():
  hang = answers._MathVerifyWorker(code=_HANGING_WORKER)
  t0 = time.time()
  assert hang.equal("1", "1", timeout_s=1.0) is False
  assert time.time() - t0 < 20
  assert hang._proc is None  # killed, so the next call starts clean
  crash = answers._MathVerifyWorker(code=_CRASHING_WORKER)
  assert crash.equal("1", "1", timeout_s=5.0) is False
  assert crash.equal("1", "1", timeout_s=5.0) is False  # restarted, crashes again, still no raise
  broken = answers._MathVerifyWorker(code="raise SystemExit(1)")
  assert broken.equal("1", "1", timeout_s=1.0) is False and broken._broken


def test_math_verify_worker_after_fork():
  # In a forked child (pid differs) the worker forgets the parent's process and
  # starts its own instead of talking over the parent's pipes. A real fork under
  # a multithreaded JAX process is avoided here; the pid check is what matters.
  w = answers._MathVerifyWorker()
  try:
    assert w.equal("2\\sqrt{2}", "\\sqrt{8}", timeout_s=5.0) is True
    parent_proc = w._proc
    w._pid = -1  # as seen from a child after fork
    assert w.equal("x+1", "1+x", timeout_s=5.0) is True
    assert w._proc is not parent_proc and parent_proc.poll() is None  # parent's worker untouched
  finally:
    w.close()
    parent_proc.kill()
    parent_proc.wait()


def test_math_verify_real_worker():
  assert answers.math_verify_equal("2\\sqrt{2}", "\\sqrt{8}") is True
  assert answers.math_verify_equal("9^{9^{9^{9}}}", "9^{9^{9^{9}}}+1", timeout_s=2.0) is False
  assert answers.math_verify_equal("x" * 10_000, "x" * 10_000) is False  # over MAX_ANSWER_CHARS


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300))
def test_score_never_raises_on_any_text(text):
  before = tasks.grading_failures()
  for task, ref in [
    ("gsm8k", "12"),
    ("aime", "7"),
    ("countdown", {"numbers": [1, 2, 3], "target": 6}),
    ("arithmetic", "19"),
  ]:
    r = tasks.score(task, text, ref)
    assert 0.0 <= r <= 1.0
  # answers' fast path alone (no math-verify calls): any text, as output and as reference
  assert answers.answers_match(text, "1, (2, 3]", use_math_verify=False) in (True, False)
  assert answers.answers_match("\\frac{1}{2}", text, use_math_verify=False) in (True, False)
  answers.extract_math(text)
  assert tasks.grading_failures() == before  # junk is graded, not a grading bug


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="0123456789,.-+ ()[]{}\\$%/:=xmabc\n", max_size=80))
def test_fast_path_total_on_answer_like_text(text):
  # Answer-shaped junk (brackets, commas, signs, units) through every fast-path branch.
  for ref in ("1, 2", "(1, 2]", "10\\%", "1 1/2", "12,000", "x"):
    assert answers.answers_match(text, ref, use_math_verify=False) in (True, False)
    assert answers.answers_match(ref, text, use_math_verify=False) in (True, False)
  assert answers.answers_match(text, text, use_math_verify=False) in (True, False)


@pytest.mark.parametrize("junk", [None, 42, b"\\boxed{4}", ["#### 4"], "\x00" * 100, "\\boxed{" * 1000 + "}"])
def test_score_never_raises_on_junk(junk):
  for task in ("gsm8k", "math", "aime"):
    assert tasks.score(task, junk, "4") < 0.5
  assert tasks.score("countdown", junk, {"numbers": [1, 3], "target": 4}) < 0.5


@pytest.mark.parametrize("task", ["gsm8k", "math", "aime"])
def test_long_outputs_grade_correctly(task):
  # ~1 MB of reasoning with many numbers and stray braces, answer at the end
  t0 = time.perf_counter()
  noise = "step 12, {x} 3.5 \\frac{1}{2} " * 30_000
  assert tasks.score(task, noise + "so \\boxed{42}", "42") == 1.0
  assert tasks.score(task, noise + "so \\boxed{43}", "42") == 0.0
  assert tasks.score(task, noise + "\\boxed{" + "x" * 100_000 + "}", "\\sqrt{2}") == 0.0
  assert time.perf_counter() - t0 < 60.0  # hang guard, not a benchmark


def test_score_rejects_bad_task_and_reference():
  with pytest.raises(ValueError, match="unknown"):
    tasks.score("gsm9k", "#### 4", "4")
  with pytest.raises(ValueError, match="numbers"):
    tasks.score("countdown", "1+3", "4")
  with pytest.raises(ValueError, match="extraction"):
    tasks.score("math", "x", "4", extraction="nope")


def test_extraction_methods_differ():
  out = "blah 12\n"
  assert tasks.score("gsm8k", out, "12") == 1.0
  assert tasks.score("gsm8k", out, "12", extraction="gsm8k_strict") == 0.0


# ----------------------------------------------------------------------------
# Countdown
# ----------------------------------------------------------------------------
REF = {"numbers": [3, 7, 25, 50], "target": 75}


@pytest.mark.parametrize(
  "output,correct,fmt",
  [
    ("<think>ok</think><answer>50 + 25</answer>", 1.0, 1.0),
    ("<answer>(50 + 25)</answer>", 1.0, 1.0),
    ("<answer>(7 - 3) * 25 - 25</answer>", 0.0, 1.0),  # 25 used twice
    ("<answer>3 * 25</answer>", 1.0, 1.0),
    ("<answer>50 + 25 = 75</answer>", 1.0, 1.0),  # trailing "= target" allowed
    ("<answer>50 + 24 + 1</answer>", 0.0, 1.0),  # numbers not given
    ("<answer>50 + 25.0</answer>", 0.0, 1.0),  # floats rejected
    ("<answer>50 * 3 / 2</answer>", 0.0, 1.0),  # 2 not given
    ("<answer>(50 * 3) / (7 - 3 - 4 + 2)</answer>", 0.0, 1.0),
    ("<answer>-25 + 50 + 50</answer>", 0.0, 1.0),  # unary minus and reuse
    ("<answer>50 + 25</answer> <answer>3</answer>", 0.0, 1.0),  # last answer counts
    ("50 + 25", 1.0, 0.0),  # no tags: last line, no format credit
    ("<answer></answer>", 0.0, 1.0),
    ("", 0.0, 0.0),
    ("<answer>(50 + 25 × 7) ÷ 3</answer>", 1.0, 1.0),  # unicode operators
  ],
)
def test_countdown_verify(output, correct, fmt):
  comps = countdown.verify(output, REF)
  assert comps["correct"] == correct and comps["format"] == fmt
  expected = 1.0 if correct else 0.1 * fmt
  assert comps["reward"] == pytest.approx(expected)
  assert tasks.score("countdown", output, REF) == pytest.approx(expected)


def test_countdown_require_format_and_bad_knobs():
  assert countdown.verify("50 + 25", REF, require_format=True)["reward"] == 0.0
  assert countdown.verify("<answer>50 + 25</answer>", REF, require_format=True)["reward"] == 1.0
  with pytest.raises(ValueError, match="format_weight"):
    countdown.CountdownTask(format_weight=0.6)
  with pytest.raises(ValueError, match="num_numbers"):
    countdown.CountdownTask(num_numbers=(3, 9))
  with pytest.raises(TypeError):
    countdown.CountdownTask(num_nums=(3, 4))  # a typo'd knob must not pass silently


def test_countdown_multiset_and_fractions():
  assert countdown.evaluate_expression("5 + 5", [5, 5])[0] == 10
  assert countdown.evaluate_expression("5 + 5", [5, 6])[0] is None
  assert countdown.evaluate_expression("(8 / 3) * 3", [8, 3, 3])[0] == 8


ADVERSARIAL = [
  "9 ** 9 ** 9 ** 9",  # huge exponent: Pow is not whitelisted
  "2**99999999",
  "(" * 5000 + "1" + ")" * 5000,  # deep nesting, over the length cap
  "(" * 90 + "1" + ")" * 90,  # nesting under the cap
  "50 / (25 - 25)",  # division by zero
  "50 / 0",
  "3 + 3 + 3",  # reused
  "__import__('os').system('echo hi')",
  "open('/etc/passwd').read()",
  "[x for x in range(10**9)]",
  "lambda: 1",
  "7 if 3 else 25",
  "50 // 25",
  "50 % 7",
  "50 << 25",
  "True + 50",
  "1_000",
  "1" * 10_000_000,  # a very long string
  "50 + 25\x00",
  "50 +",
  "",
  ")(",
  "50 25",
]


@pytest.mark.parametrize("expr", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_countdown_parser_adversarial(expr):
  t0 = time.perf_counter()
  value, err = countdown.evaluate_expression(expr, REF["numbers"])
  assert value is None and err
  assert countdown.verify(f"<answer>{expr}</answer>", REF)["correct"] == 0.0
  assert tasks.score("countdown", expr, REF) < 0.5
  # hang guard, not a benchmark: this takes milliseconds, a hang would take forever
  assert time.perf_counter() - t0 < 30.0


@pytest.mark.parametrize("method", ["tree", "uniform"])
def test_countdown_generator_solvable_and_seeded(method):
  a = countdown.generate(15, seed=3, method=method)
  b = countdown.generate(15, seed=3, method=method)
  c = countdown.generate(15, seed=4, method=method)
  assert a == b and a != c
  for inst in a:
    assert countdown.solve(inst.numbers, inst.target) is not None
    assert 3 <= len(inst.numbers) <= 4
    assert 1 <= inst.target <= 99 and inst.target not in inst.numbers
    value, err = countdown.evaluate_expression(inst.solution, inst.numbers)
    assert value == inst.target, (inst, err)
    out = f"<answer>{inst.solution}</answer>"
    assert tasks.score("countdown", out, inst.reference()) == 1.0


def test_countdown_splits_disjoint():
  # Membership is a hash bucket of the numbers tuple: test iff bucket < 10% of 1000.
  import zlib

  def bucket(i):
    return zlib.crc32(str(i.numbers).encode()) % 1000

  for method in ("tree", "uniform"):
    assert all(bucket(i) >= 100 for i in countdown.generate(40, seed=0, split="train", method=method))
    assert all(bucket(i) < 100 for i in countdown.generate(5, seed=0, split="test", method=method))


def test_countdown_solver_against_brute_force():
  # Brute force over all expression trees for 3 numbers, each used at most once.
  from fractions import Fraction
  from itertools import permutations

  def brute(nums):
    vals = set()

    def rec(items):
      for v in items:
        vals.add(v)
      for i, j in permutations(range(len(items)), 2):
        a, b = items[i], items[j]
        rest = [items[t] for t in range(len(items)) if t not in (i, j)]
        outs = [a + b, a - b, a * b] + ([a / b] if b != 0 else [])
        for o in outs:
          rec(rest + [o])

    rec([Fraction(x) for x in nums])
    return vals

  rng = random.Random(0)
  for _ in range(5):
    nums = [rng.randint(1, 12) for _ in range(3)]
    reach = countdown.reachable(nums)
    assert set(reach) == brute(nums)
    for v, expr in reach.items():
      assert countdown.evaluate_expression(expr, nums)[0] == v


def test_countdown_template():
  task = countdown.CountdownTask(template="N={numbers} T={target}")
  p = task.make_problems("train", 2, seed=1)[0]
  assert p.prompt.startswith("N=[") and p.task == "countdown"
  with pytest.raises(ValueError, match="template"):
    countdown.CountdownTask(template="{nums}")


# ----------------------------------------------------------------------------
# Arithmetic
# ----------------------------------------------------------------------------
def test_arithmetic_generate_and_verify():
  pairs = arithmetic.generate(50, seed=0, max_digits=2, ops="+-*", num_terms=3)
  assert pairs == arithmetic.generate(50, seed=0, max_digits=2, ops="+-*", num_terms=3)
  for expr, ans in pairs:
    # cross-check the precedence-aware evaluator on the safe generated string
    import ast

    assert int(ans) == _ast_eval(ast.parse(expr, mode="eval").body)
    assert int(ans) >= 0
  assert arithmetic.generate(3, seed=1)[0][0].count("+") == 1


def _ast_eval(node):
  import ast

  if isinstance(node, ast.Constant):
    return node.value
  a, b = _ast_eval(node.left), _ast_eval(node.right)
  return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(node.op)]


@pytest.mark.parametrize(
  "out,ok",
  [("19", True), (" 19\n", True), ("19<eos>", True), ("191", False), ("1 9", False), ("x19", False), ("", False)],
)
def test_arithmetic_scoring(out, ok):
  assert tasks.score("arithmetic", out, "19") == float(ok)


def test_arithmetic_problems_and_splits():
  probs = tasks.TASKS["arithmetic"].make_problems("train", 5, seed=0)
  assert all(p.prompt.endswith("=") and p.task == "arithmetic" for p in probs)
  tr = {e for e, _ in arithmetic.generate(300, 0, max_digits=1)}
  te = {e for e, _ in arithmetic.generate(5, 0, max_digits=1, split="test")}
  assert not tr & te
  with pytest.raises(ValueError, match="ops"):
    arithmetic.generate(3, 0, ops="/")


# ----------------------------------------------------------------------------
# Datasets, fixtures, loaders, stream
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gsm8k", "math", "math500", "aime"])
def test_fixtures_load_and_solutions_grade(name):
  recs = datasets.load_records(datasets.fixture_path(name))
  assert len(recs) >= 20
  probs = datasets.load_problems(name)
  assert len({p.id for p in probs}) == len(probs)
  for p in probs:
    assert p.prompt and p.reference not in ("", None)
    if name in ("gsm8k", "math"):  # the worked solution grades as correct
      assert tasks.score(p.task, p.solution, p.reference) == 1.0
    # a boxed reference answer grades as correct
    assert tasks.score(p.task, f"\\boxed{{{p.reference}}}", p.reference) == 1.0


def test_aime_references_are_integers():
  for p in datasets.load_problems("aime"):
    assert 0 <= int(p.reference) <= 999


def test_parquet_path(tmp_path):
  recs = datasets.load_records(datasets.fixture_path("gsm8k"))
  path = os.path.join(tmp_path, "gsm8k.parquet")
  pq.write_table(pa.Table.from_pylist(recs), path)
  a = datasets.load_problems("gsm8k", path=path)
  b = datasets.load_problems("gsm8k")
  assert [(p.prompt, p.reference) for p in a] == [(p.prompt, p.reference) for p in b]


def test_loader_errors(tmp_path):
  bad = os.path.join(tmp_path, "bad.jsonl")
  with open(bad, "w") as f:
    f.write(json.dumps({"question": "q"}) + "\n")
  with pytest.raises(ValueError, match="answer"):
    datasets.load_problems("gsm8k", path=bad)
  with pytest.raises(ValueError, match="does not exist"):
    datasets.load_problems("gsm8k", path=os.path.join(tmp_path, "missing.jsonl"))
  with pytest.raises(ValueError, match="template"):
    datasets.load_problems("gsm8k", template="no field")
  with pytest.raises(ValueError, match="unknown"):
    datasets.load_problems("svamp")


def test_schema_aliases_and_case(tmp_path):
  path = os.path.join(tmp_path, "aime25.jsonl")
  with open(path, "w") as f:
    f.write(json.dumps({"ID": "2025-I-1", "Question": "Q?", "Answer": "070"}) + "\n")
  (p,) = datasets.load_problems("aime", path=path)
  assert p.reference == "070" and "Q?" in p.prompt
  assert tasks.score("aime", "\\boxed{70}", p.reference) == 1.0


def test_stream_deterministic_and_resumable():
  probs = datasets.load_problems("math500")
  s1 = datasets.ProblemStream(probs, seed=5)
  first = [p.id for p in s1.next(50)]  # crosses two epoch boundaries (22 problems)
  # each epoch is a permutation
  assert sorted(first[:22]) == sorted(p.id for p in probs)
  assert first[:22] != first[22:44]
  s2 = datasets.ProblemStream(probs, seed=5)
  s2.next(17)
  s3 = datasets.ProblemStream.from_state(probs, json.loads(json.dumps(s2.state_dict())))
  assert [p.id for p in s3.next(33)] == first[17:]
  with pytest.raises(ValueError, match="same problem list"):
    datasets.ProblemStream.from_state(probs[:3], s2.state_dict())


def test_registry_make_problems():
  assert set(tasks.TASKS) >= {"countdown", "arithmetic", "gsm8k", "math", "math500", "aime"}
  for name, task in tasks.TASKS.items():
    probs = task.make_problems("test", 4, 0)
    assert len(probs) == 4
    assert probs == task.make_problems("test", 4, 0)
    for p in probs:
      assert isinstance(p, datasets.Problem) and isinstance(p.prompt, str)
      assert 0.0 <= tasks.score(p.task, "garbage", p.reference) < 0.5
  with pytest.raises(ValueError, match="has 22 problems"):
    tasks.TASKS["gsm8k"].make_problems("test", 100, 0)


# ----------------------------------------------------------------------------
# Issue 12 items 2 and 14, issue 11: answer sets, peer agreement, bounded cost,
# parallel math-verify, configured task objects, counted grading failures
# ----------------------------------------------------------------------------
ISSUE_CASES = [
  # several boxes joined by connectors are one answer, graded as a set
  ("math", r"\[\boxed{-2}\quad\text{and}\quad\boxed{1}\]", "1,-2", True),
  ("math", r"The integers are $\boxed{-2}$ and $\boxed{1}$.", "1, -2", True),
  ("math", r"The integers are $\boxed{-2}$ and $\boxed{1}$.", "1", False),  # a list is not one of its items
  ("math", r"$x = \boxed{2}$, $y = \boxed{3}$", "2, 3", True),
  ("math", r"\boxed{1,2}", r"$\boxed{1}\boxed{2}$", True),  # a boxed reference reads the same way
  ("math", r"first \boxed{3}, but wait: then \boxed{4}", "3, 4", False),  # a correction, not a list
  # lists vs thousands separators
  ("math", r"is $\boxed{32, 349}$", "32349", False),  # a list of two numbers
  ("math", r"is $\boxed{32,\! 349}$", "32349", True),  # LaTeX's thousands idiom
  ("math", r"\boxed{32,349}", "32349", True),  # one grouped number
  ("math", r"\boxed{11,\! 111,\! 111,\! 100}", "11111111100", True),
  ("math", r"\boxed{-2,1}", "1, -2", True),
  ("math", r"\boxed{1,22}", "1.22", False),  # a list, never a decimal comma
  ("math", r"\boxed{3, 1, 2}", "1, 2, 3", True),  # bare lists are unordered
  ("math", r"\boxed{1, 2}", "1, 2, 3", False),
  ("math", r"\boxed{1, 1, 2}", "1, 2", False),  # a multiset: every item once
  ("math", r"\boxed{(2, 1)}", "(1, 2)", False),  # tuples are ordered
  ("math", r"\boxed{[1, 2]}", "(1, 2)", False),  # and their brackets count
  ("math", r"\boxed{(1, 4.5)}", r"(1, \frac{9}{2})", True),
  ("math", r"$\boxed{1, 2, 3, \ldots}$", "1, 2, 3", False),
  # the later final-answer statement beats an earlier box
  (
    "math",
    r"so $0.05 \cdot 10,200 / 2 = \boxed{255}$. Final Answer: The final answer is $10,455$. I hope it is correct.",
    "10455",
    True,
  ),
  ("math", r"so $\boxed{255}$. Final Answer: The final answer is $10,455$.", "255", False),
  ("math", r"The final answer is $\boxed{5}$.", "5", True),
  ("math", "Final Answer: The largest $n$ is 34.", "34", True),
  # percent: X% is X or X/100; a bare number is never its 100-fold
  ("math", r"\boxed{10\%}", "0.1", True),
  ("math", r"\boxed{0.1}", r"10\%", True),
  ("math", r"\boxed{10\%}", "10", True),
  ("math", r"\boxed{10}", "0.1", False),
  ("math", r"\boxed{28 percent}", "0.28", True),
  ("math", r"\boxed{28}", "0.28", False),
  # the exact-decimal policy is unchanged
  ("math", r"\boxed{0.0833}", r"\frac{1}{12}", False),
  ("math", r"\boxed{0.333}", "1/3", False),
  ("math", r"\boxed{0.125}", r"\frac{1}{8}", True),
  # mixed numbers, clock times, glued letters, function names
  ("math", r"\boxed{1 1/2}", "1.5", True),
  ("math", r"\boxed{2\frac58}", "2.625", True),
  ("math", r"\boxed{8:34 \text{ p.m.}}", "20:34", True),
  ("math", r"\boxed{10m}", "10", False),  # 10 times m
  ("math", r"\boxed{10 m}", "10", True),  # 10 metres
  ("math", r"\boxed{y = 2x + 3}", "f(x) = 2x + 3", True),
]


@pytest.mark.parametrize("task,output,reference,expected", ISSUE_CASES)
def test_issue_grading_examples(task, output, reference, expected):
  r = tasks.score(task, output, reference)
  assert tasks.is_correct(r) == expected, (output, reference, r)


def test_extract_math_rules():
  assert answers.extract_math(r"\boxed{-2} \quad \text{and} \quad \boxed{1}") == "-2, 1"
  assert answers.extract_math(r"first \boxed{3} then \boxed{4}") == "4"
  assert answers.extract_math(r"\boxed{200} ... \boxed{255} ... The final answer is $10,455$.") == "10,455"
  assert answers.extract_math(r"The answer is $\boxed{\frac{1}{2}}$") == r"\frac{1}{2}"
  assert answers.extract_math("Final Answer: The final answer is $(0, 1)$. I hope it is correct.") == "(0, 1)"
  assert answers.extract_math("nothing") is None
  assert answers.boxed_reference(r"so $\boxed{1}\boxed{2}$") == "1, 2"


def _as_output(pred: str) -> str:
  """A peer case's prediction as a model output: boxed, unless it already has a box or an answer statement."""
  return pred if ("\\boxed" in pred or "answer" in pred.lower()) else "\\boxed{" + pred + "}"


PEER_CASES = os.path.join(os.path.dirname(__file__), "data", "grading_cases.jsonl")


def peer_agreement() -> tuple[float, list]:
  """(agreement, disagreements) of tasks.score("math") with the peer cases' expected verdicts.

  python -c "from tests.test_tasks import peer_agreement as f; a, w = f(); print(a, len(w))"
  """
  with open(PEER_CASES) as f:
    rows = [json.loads(line) for line in f][1:]
  assert len(rows) >= 200 and all(r["source"] and isinstance(r["expected"], bool) for r in rows)
  rewards, failures = tasks.score_batch("math", [_as_output(r["pred"]) for r in rows], [r["gold"] for r in rows])
  assert failures == 0
  wrong = [(r["gold"], r["pred"], r["expected"]) for r, x in zip(rows, rewards) if tasks.is_correct(x) != r["expected"]]
  return 1 - len(wrong) / len(rows), wrong


@pytest.mark.slow
def test_peer_grading_agreement(monkeypatch):
  # Answer-only cases of Math-Verify, hendrycks MATH, MARIO and Qwen2.5-Math's own
  # tests (tests/data/grading_cases.jsonl, each with its source). Before issue 12
  # this grader agreed on 186/216 (86.1%); the remaining disagreements are by
  # policy: approximate decimals (0.0833 vs 1/12), decimal commas (1,22 vs 1.22),
  # hendrycks's ordered bare lists.
  # A loaded test machine must not turn slow-but-decidable math-verify cases into
  # timeouts; the calls run in parallel, so the one case that always times out
  # ([1, oo) vs [2^(2^-1000), oo)) costs no extra wall time.
  monkeypatch.setattr(answers, "MATH_VERIFY_TIMEOUT_S", 20.0)
  agreement, wrong = peer_agreement()
  assert agreement >= 0.92, f"agreement {agreement:.3f}; disagreements:\n" + "\n".join(map(repr, wrong))


class _CountingRe:
  """Stands in for the `re` module inside countdown: records the length of every string a regex sees."""

  def __init__(self):
    self.lengths = []

  def __getattr__(self, name):
    fn = getattr(re, name)
    if name not in ("fullmatch", "match", "search", "findall", "finditer", "sub", "split"):
      return fn

    def wrapped(pattern, string, *args, **kwargs):
      self.lengths.append(len(string))
      return fn(pattern, string, *args, **kwargs)

    return wrapped


def test_countdown_grading_cost_bounded_on_unclosed_tags(monkeypatch):
  # 128 KB of unclosed <answer> tags used to cost 7.9 s (a lazy regex rescanning from
  # every tag). Now the whole output is only scanned by two str.rfind calls; every
  # regex and the parser see at most the expression itself.
  spy = _CountingRe()
  parsed = []
  real_parse = countdown.ast.parse
  monkeypatch.setattr(countdown, "re", spy)
  monkeypatch.setattr(countdown.ast, "parse", lambda s, *a, **k: parsed.append(len(s)) or real_parse(s, *a, **k))
  assert not [v for v in vars(countdown).values() if isinstance(v, re.Pattern)]  # no precompiled regex bypasses the spy
  bad = "<answer>" * (128 * 1024 // len("<answer>"))
  assert countdown.verify(bad + "\n50 + 25", REF) == {"correct": 1.0, "format": 0.0, "reward": 1.0}
  assert countdown.verify(bad + "<answer>50 + 25</answer>", REF)["reward"] == 1.0
  assert countdown.verify(bad, REF)["reward"] == 0.0
  assert countdown.verify("</answer>" * 16384 + "<answer>" * 16384, REF)["reward"] == 0.0
  assert max(spy.lengths) <= countdown.MAX_EXPRESSION_CHARS and len(spy.lengths) <= 4
  assert max(parsed) <= countdown.MAX_EXPRESSION_CHARS and len(parsed) <= 2
  # Only the last MAX_OUTPUT_CHARS characters are read (documented cap).
  far = "<answer>50 + 25</answer>" + " " * countdown.MAX_OUTPUT_CHARS + "x"
  assert countdown.extract_expression(far) == ("x", False)


def test_math_grading_adversarial_inputs_stay_fast():
  # Inputs that make nested-quantifier regexes backtrack exponentially or naive
  # scans quadratic; linear scans finish these in well under a second. Generous
  # hang guard, not a benchmark.
  t0 = time.perf_counter()
  gap = " " * 150 + "x"  # a long non-connector gap between boxes
  assert tasks.score("math", "\\boxed{1}" + gap + "\\boxed{2}", "2") == 1.0
  assert tasks.score("math", "\\boxed{1 " + "m " * 200 + "x}", "1") == 0.0  # unit-like words, then a failure
  assert tasks.score("math", "answer is " * 20_000, "1") == 0.0
  assert tasks.score("math", "\\boxed{" * 20_000 + "answer: 3", "3") == 1.0
  assert tasks.score("math", "$" * 100_000 + "\\boxed{3}", "3") == 1.0
  assert time.perf_counter() - t0 < 30.0


_BARRIER_WORKER = """
import json, os, sys, time
d, n = {dir!r}, {n}
sys.stdout.write("ready\\n"); sys.stdout.flush()
for line in sys.stdin:
    open(os.path.join(d, "%d-%d" % (os.getpid(), time.monotonic_ns())), "w").close()
    deadline = time.time() + 20  # a serial pool would stall here and answer False
    while len(os.listdir(d)) < n and time.time() < deadline:
        time.sleep(0.01)
    sys.stdout.write(json.dumps({{"ok": len(os.listdir(d)) >= n}}) + "\\n"); sys.stdout.flush()
"""


@pytest.mark.parametrize("via", ["math_verify_many", "score_batch"])
def test_math_verify_pool_runs_calls_concurrently(tmp_path, monkeypatch, via):
  # Each fake worker answers True only once all n requests are in flight at the same
  # time: a pool that ran them one after another (the old single worker) would answer
  # False after 20 s. So all-True proves n concurrent calls in n distinct processes:
  # n slow (timeout-bound) cases cost about one timeout, not n.
  n = 3
  pool = answers._MathVerifyPool(n, code=_BARRIER_WORKER.format(dir=str(tmp_path), n=n))
  monkeypatch.setattr(answers, "_POOL", pool)
  try:
    if via == "math_verify_many":
      got = answers.math_verify_many([("x+%d" % i, "%d+x" % i) for i in range(n)], timeout_s=60.0)
    else:  # symbolic answers go to math-verify; score_batch grades them in parallel
      got, failures = tasks.score_batch("math", ["\\boxed{x+%d}" % i for i in range(n)], ["%d+x" % i for i in range(n)])
      assert failures == 0
    assert all(got), got
    assert len({name.split("-")[0] for name in os.listdir(tmp_path)}) == n  # n worker processes
  finally:
    pool.close()


def test_math_verify_pool_call_is_bounded_when_all_workers_are_busy(monkeypatch):
  pool = answers._MathVerifyPool(1, code=_HANGING_WORKER, wait_s=0.5)
  monkeypatch.setattr(answers, "_POOL", pool)
  try:
    busy = threading.Thread(target=answers.math_verify_equal, args=("x", "y", 3.0))
    busy.start()
    time.sleep(0.2)
    assert answers.math_verify_equal("x", "x+0", timeout_s=3.0) is False  # no free worker within wait_s
    busy.join()
    assert pool._free.qsize() == 1  # the hung worker was killed and handed back
  finally:
    pool.close()
  with pytest.raises(ValueError, match="pool size"):
    answers._MathVerifyPool(0)


def test_score_uses_a_configured_task_object():
  out = "<answer>3 + 3</answer>"  # well formed, wrong
  assert tasks.score("countdown", out, REF) == pytest.approx(0.1)  # the registry's default instance
  assert tasks.score(countdown.CountdownTask(format_weight=0.0), out, REF) == 0.0
  assert tasks.score(countdown.CountdownTask(format_weight=0.3), out, REF) == pytest.approx(0.3)
  strict = countdown.CountdownTask(require_format=True)
  assert tasks.score(strict, "50 + 25", REF) == 0.0 and tasks.score("countdown", "50 + 25", REF) == 1.0
  assert tasks.score(datasets.TextTask("aime"), "\\boxed{033}", "33") == 1.0
  rewards, failures = tasks.score_batch(countdown.CountdownTask(format_weight=0.0), [out, "50 + 25"], [REF, REF])
  assert rewards == [0.0, 1.0] and failures == 0
  with pytest.raises(ValueError, match="numbers"):
    tasks.score(countdown.CountdownTask(), out, "75")  # malformed reference still raises
  with pytest.raises(ValueError, match="task object"):
    tasks.score(object(), out, REF)
  with pytest.raises(ValueError, match="one per output"):
    tasks.score_batch("math", ["a", "b"], ["1"])


class _BuggyTask:
  name = "buggy"
  generated = True
  uses_extraction = False

  def make_problems(self, split="train", n=1, seed=0, template=None):
    return [tasks.Problem(id=f"buggy-{i}", task="buggy", prompt="1+1=", reference="2", grader=self) for i in range(n)]

  def score(self, output, reference, extraction=None):
    raise KeyError("a grading bug")

  def check_reference(self, reference):
    pass


def test_grading_failures_are_counted_not_hidden(monkeypatch, caplog):
  tasks.grading_failures(reset=True)
  assert tasks.score(_BuggyTask(), "x", "1") == 0.0
  assert tasks.score(_BuggyTask(), "y", "1") == 0.0
  assert tasks.score("math", "\\boxed{1}", "1") == 1.0  # a healthy call counts nothing
  assert tasks.grading_failures() == 2
  assert "grading bug" in caplog.text and "KeyError" in caplog.text
  # A bug inside the real MATH path is counted too (it used to vanish as reward 0.0).
  monkeypatch.setattr(answers, "answers_match", lambda *a, **k: 1 / 0)
  rewards, failures = tasks.score_batch("math", ["\\boxed{1}", "\\boxed{2}", None], ["1", "1", "1"])
  assert rewards == [0.0, 0.0, 0.0] and failures == 2  # None is junk output, not a bug
  assert tasks.grading_failures(reset=True) == 4 and tasks.grading_failures() == 0


def test_generic_answer_mentions_do_not_override_a_box():
  assert tasks.score("math", "so \\boxed{42}. The answer is correct.", "42") == 1.0
  assert tasks.score("math", "so \\boxed{42}.\nCheck the answer: 6 * 7 = 42 and 41 < 42", "42") == 1.0
  assert tasks.score("math", "so \\boxed{41}. Final answer: $42$", "42") == 1.0


def test_configure_math_verify_pool(monkeypatch):
  old = answers._POOL
  try:
    answers.configure_math_verify(3)
    assert answers._POOL.size == 3 and answers._POOL is not old
    assert answers.math_verify_equal("2\\sqrt{2}", "\\sqrt{8}") is True
  finally:
    answers._POOL.close()
    answers._POOL = old
  monkeypatch.setenv("VCPO_MATH_VERIFY_WORKERS", "many")
  with pytest.raises(ValueError, match="VCPO_MATH_VERIFY_WORKERS"):
    answers._default_pool_size()
  monkeypatch.setenv("VCPO_MATH_VERIFY_WORKERS", "6")
  assert answers._default_pool_size() == 6


def test_problems_carry_their_configured_grader():
  import pickle

  out = "<answer>3 + 3</answer>"  # well formed, wrong
  quiet = countdown.CountdownTask(format_weight=0.0)
  p = quiet.make_problems("train", 2, seed=0)
  q = tasks.TASKS["countdown"].make_problems("train", 2, seed=0)
  assert p == q and p[0].grader is quiet  # same problems; equality ignores the grader
  assert tasks.score_problem(p[0], out) == 0.0 and tasks.score_problem(q[0], out) == pytest.approx(0.1)
  assert tasks.score(p[0].task, out, p[0].reference) == pytest.approx(0.1)  # a bare name: the default instance
  moved = pickle.loads(pickle.dumps(p[0]))  # as sent to an async sampler process
  assert moved.grader.format_weight == 0.0 and tasks.score_problem(moved, out) == 0.0
  # The rollout's call: G samples per problem, mixed graders, failures counted.
  per_sample = [p[0], p[0], q[1], q[1]]
  sol = p[0].solution
  rewards, failures = tasks.score_problems(per_sample, [out, f"<answer>{sol}</answer>", out, None])
  assert rewards == [0.0, 1.0, pytest.approx(0.1), 0.0] and failures == 0
  bare = datasets.Problem(id="x", task="aime", prompt="?", reference="33")  # hand-made: registry default
  assert tasks.score_problem(bare, "\\boxed{033}") == 1.0
  text = datasets.TextTask("aime").make_problems("test", 2, 0)
  assert all(isinstance(t.grader, datasets.TextTask) for t in text)
  with pytest.raises(ValueError, match="one per output"):
    tasks.score_problems(per_sample, [out])


# ----------------------------------------------------------------------------- the Task protocol and tasks.build


def test_every_registry_task_follows_the_protocol():
  for name, task in tasks.TASKS.items():
    assert isinstance(task, tasks.Task) and task.name == name
    assert task.generated == (name in ("countdown", "arithmetic"))  # the only generated ones
    assert task.uses_extraction == (not task.generated)
  assert not isinstance(object(), tasks.Task)


def _tally_reference(raw: str) -> str:
  return str(raw.count("|")) if set(raw) == {"|"} else raw  # "|||" -> "3"; a bare "3" stays (idempotent)


def _needs_bars(raw: str, bare: str) -> str:
  return "" if set(raw) == {"|"} else f"a tally must be bars only, got {raw!r}"


def test_a_registered_data_set_reads_and_grades_by_its_own_rules(tmp_path, monkeypatch):
  """A data set of one DataSet value and one registration: its own fields, reference rule, malformed check,
  template, extraction and eval_n reach the loader, tasks.build, the grader and the eval protocol. What a bug
  would give: the 'problem' field or a boxed-reference rule (a shipped data set's), or n = 3."""
  from vcpo_jax import evaluation

  path = tmp_path / "tally.jsonl"
  path.write_text(json.dumps({"Q": "count", "Tally": "|||", "id": "t0"}) + "\n")
  tally = datasets.DataSet(
    "tally", "q", "tally", "Count: {problem}", "last_number", _tally_reference, _needs_bars, eval_n=7
  )
  monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))
  registered = tasks.register(datasets.TextTask(tally, path=str(path)))
  with pytest.raises(ValueError, match="already registered"):
    tasks.register(datasets.TextTask(tally))
  with pytest.raises(TypeError, match="not a tasks.Task"):
    tasks.register(object())
  (p,) = registered.make_problems("test", None, 0)
  assert (p.id, p.task, p.prompt, p.reference, p.dataset) == ("t0", "tally", "Count: count", "3", "tally")
  assert tasks.score_problem(p, "I count 2, no: 3") == 1.0 and tasks.score_problem(p, "2") == 0.0
  assert tasks.score("tally", "3", "|||") == 1.0  # a raw reference goes through the data set's own rule
  built = tasks.build("tally", template="{problem}!", data_path=str(path))
  assert built.dataset is tally and built.make_problems("test", 1, 0)[0].prompt == "count!"
  assert evaluation.EvalProtocol(dataset="tally").n == 7
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"q": "count", "tally": "3"}) + "\n")
  with pytest.raises(ValueError, match="record 0: a tally must be bars only"):
    datasets.load_problems(tally, path=str(bad))


def test_build_makes_one_configured_instance():
  task = tasks.build("countdown", options={"format_weight": 0.0, "num_numbers": (3, 3)})
  assert isinstance(task, countdown.CountdownTask) and task.format_weight == 0.0
  probs = task.make_problems("train", 3, seed=1)
  assert all(p.grader is task and len(p.reference["numbers"]) == 3 for p in probs)
  wrong = "<answer>0</answer>"  # well formed; 0 is never one of the numbers
  assert tasks.score_problems(probs, [wrong] * 3) == ([0.0, 0.0, 0.0], 0)
  assert tasks.score_problem(tasks.build("countdown").make_problems("train", 1)[0], wrong) == pytest.approx(0.1)
  assert tasks.build("arithmetic", template="Q: {expression}=").make_problems("train", 1)[0].prompt.startswith("Q: ")
  text = tasks.build("gsm8k", template="{problem} ?")
  assert isinstance(text, datasets.TextTask) and not text.generated and text.make_problems("test", 1)[0].grader is text
  with pytest.raises(ValueError, match="unknown"):
    tasks.build("gsm9k")
  with pytest.raises(ValueError, match="num_numbers: task 'gsm8k' is a data set"):
    tasks.build("gsm8k", options={"num_numbers": 3})
  with pytest.raises(ValueError, match="data_path='x.jsonl': task 'countdown' is generated"):
    tasks.build("countdown", data_path="x.jsonl")
  with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
    tasks.build("countdown", options={"foo": 1})


def _countdown_spec(**options):
  from configs import countdown as countdown_config
  from vcpo_jax import run_config

  c = countdown_config.get_config("smoke")
  c.task.num_train_problems = 8  # a small pool: generating the default 4096 solver-checked instances takes seconds
  for k, v in options.items():
    c.task.gen[k] = v
  return run_config.parse_config(c, check_prompts=False)


def _rollout_rewards(spec, text: str):
  """Rewards RolloutMaker.to_batch gives `text` as every response of step 0 (a scripted sampler output)."""
  import types

  import numpy as np

  from vcpo_jax.model.tokenizer import build_char_tokenizer
  from vcpo_jax.rollout.common import RolloutMaker
  from vcpo_jax.sampler import Rollout

  tok = build_char_tokenizer()
  maker = RolloutMaker(
    spec.rollout, tok, types.SimpleNamespace(cfg=types.SimpleNamespace(pad_id=0)), spec.make_train_problems()
  )
  resp = list(tok.encode(text, add_special_tokens=False))
  n, tp, r = spec.rollout.batch_size, 4, len(resp)
  tokens = np.tile(np.asarray([5] * tp + resp, np.int32), (n, 1))
  cols = np.arange(tp + r)[None]
  ro = Rollout(
    tokens=tokens,
    prompt_mask=np.broadcast_to(cols < tp, (n, tp + r)),
    response_mask=np.broadcast_to(cols >= tp, (n, tp + r)),
    behavior_logp=np.zeros((n, tp + r), np.float32),
    lengths=np.full((n,), r, np.int32),
    prompt_lengths=np.full((n,), tp, np.int32),
    finished=np.ones((n,), bool),
    group_id=np.repeat(np.arange(spec.rollout.prompts_per_step), spec.rollout.group_size),
  )
  batch, info = maker.to_batch(ro, maker.problems_for_step(0), version=0)
  assert info["texts"] == [text] * n
  return batch["rewards"], info["grading_failures"]


@pytest.mark.parametrize("format_weight", [None, 0.0, 0.3])
def test_configured_format_weight_reaches_rollout_and_eval_rewards(format_weight):
  from vcpo_jax import evaluation

  spec = _countdown_spec(**({} if format_weight is None else {"format_weight": format_weight}))
  want = 0.1 if format_weight is None else format_weight  # None: the task's default
  assert spec.task.format_weight == want and spec.eval_task is spec.task  # one instance, shared
  wrong = "<answer>0</answer>"  # well formed and wrong: the reward is the format weight alone
  rewards, failures = _rollout_rewards(spec, wrong)
  assert list(rewards) == pytest.approx([want] * spec.rollout.batch_size) and failures == 0
  eval_problems = spec.make_eval_problems()
  assert all(p.grader is spec.task for p in eval_problems)
  gen = lambda prompts, n, **_: [[wrong] * n for _ in prompts]
  rec = evaluation.evaluate(gen, eval_problems, spec.eval, step=0)
  assert rec["mean_reward"] == pytest.approx(want) and rec["mean_at_n"] == 0.0 and rec["grading_failures"] == 0


def test_grading_failures_reach_the_rollout_and_eval_counts():
  import dataclasses

  from vcpo_jax import evaluation

  buggy = _BuggyTask()
  spec = dataclasses.replace(_countdown_spec(), task=buggy, eval_task=buggy)
  rewards, failures = _rollout_rewards(spec, "2")
  assert list(rewards) == [0.0] * spec.rollout.batch_size and failures == spec.rollout.batch_size
  gen = lambda prompts, n, **_: [["2"] * n for _ in prompts]
  proto = evaluation.EvalProtocol(dataset="countdown", size=2, n=2, pass_at_k=(1,))
  rec = evaluation.evaluate(gen, buggy.make_problems("train", 2), proto, step=0)
  assert rec["grading_failures"] == 4 and rec["mean_reward"] == 0.0  # 2 problems x 2 samples, each raised
  tasks.grading_failures(reset=True)
