"""Tasks and verifiable rewards: a registry by name and one grading entry point.

    from vcpo_jax import tasks
    probs = tasks.TASKS["countdown"].make_problems("train", n=64, seed=0)
    r = tasks.score(probs[0].task, model_output, probs[0].reference)

`score` contract: 1.0 for a correct answer; below 0.5 for a wrong or missing
one (countdown's named format component adds 0.1 for a well-formed wrong
answer); so "correct" means score >= 0.5. It never raises on model output
(any string, None, or other junk); it raises ValueError only for an unknown
task name or a malformed reference, which are caller bugs.

The multi-turn tool environment (tool_env.py, sandbox.py) lives beside these
but is not imported here, so that grading stays cheap to import.
"""

from __future__ import annotations

from vcpo_jax.tasks.arithmetic import ArithmeticTask
from vcpo_jax.tasks.countdown import CountdownTask
from vcpo_jax.tasks.datasets import Problem, ProblemStream, TextTask, load_problems

__all__ = ["TASKS", "CORRECT_THRESHOLD", "Problem", "ProblemStream", "is_correct", "load_problems", "score"]

# score >= this counts as a correct answer (format bonuses stay below it).
CORRECT_THRESHOLD = 0.5

# name -> task object with .make_problems(split, n, seed) and .score(output, reference, extraction).
# Text datasets load the shipped fixtures by default; construct TextTask(name, path=...) for real data.
TASKS = {
  "countdown": CountdownTask(),
  "arithmetic": ArithmeticTask(),
  "gsm8k": TextTask("gsm8k"),
  "math": TextTask("math"),
  "math500": TextTask("math500"),
  "aime": TextTask("aime"),
}


def score(task: str, model_output, reference, extraction: str | None = None) -> float:
  """Reward of one model output against a reference, in [0, 1].

  task: "gsm8k" | "math" | "math500" | "aime" | "countdown" | "arithmetic".
  reference: the bare answer string (a full GSM8K answer with "#### N" or a
    MATH solution with \\boxed{} is also accepted); for countdown a dict
    {"numbers": [...], "target": int}; for arithmetic the integer string.
  extraction: a method name from answers.EXTRACTORS (text tasks only);
    None picks the task's default.
  """
  if task not in TASKS:
    raise ValueError(f"task {task!r} unknown; choose one of {sorted(TASKS)}")
  if task == "countdown":
    from vcpo_jax.tasks.countdown import _check_reference

    _check_reference(reference)  # malformed references are caller bugs: raise
  elif task == "arithmetic":
    try:
      int(str(reference).strip())
    except ValueError:
      raise ValueError(f"arithmetic reference must be an integer string, got {reference!r}") from None
  if extraction is not None:
    from vcpo_jax.tasks.answers import EXTRACTORS

    if extraction not in EXTRACTORS:
      raise ValueError(f"extraction {extraction!r} unknown; choose one of {sorted(EXTRACTORS)}")
  if not isinstance(model_output, str):
    return 0.0
  try:
    return float(TASKS[task].score(model_output, reference, extraction))
  except Exception:  # a grading bug must not kill a training run: grade as wrong
    return 0.0


def is_correct(reward: float) -> bool:
  """Whether a `score` value counts as a correct answer."""
  return reward >= CORRECT_THRESHOLD
