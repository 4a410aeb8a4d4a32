"""Tasks and verifiable rewards: the Task protocol, a registry by name, one builder, one grading entry point.

    from vcpo_jax import tasks
    task = tasks.build("countdown", options={"format_weight": 0.0})  # the run's one configured task
    probs = task.make_problems("train", n=64, seed=0)                 # each Problem carries `task`
    probs = tasks.TASKS["countdown"].make_problems("train", n=64, seed=0)  # a registry default
    r = tasks.score(probs[0].task, model_output, probs[0].reference)
    task = CountdownTask(format_weight=0.0)   # a configured task: grade with the object
    r = tasks.score(task, model_output, probs[0].reference)
    r = tasks.score_problem(task.make_problems("train", 1)[0], model_output)  # the same
    rewards, failures = tasks.score_problems(problems_per_sample, outputs)

`score` contract: 1.0 for a correct answer; below 0.5 for a wrong or missing
one (countdown's named format component adds 0.1 for a well-formed wrong
answer); so "correct" means score >= 0.5. It never raises on model output
(any string, None, or other junk); it raises ValueError only for an unknown
task name or a malformed reference, which are caller bugs. An exception inside
a task's scorer is a grading bug: the sample grades 0.0, the bug is counted
(`grading_failures()`, for the trainer's `train/grading_failures`) and its
first occurrences are logged with a traceback, instead of vanishing.

`task` is a registry name (the registry's default instance) or a task object (a `Task`, tasks/base.py; grading
needs only its `Grader` part: name, uses_extraction, score, check_reference): a run with configured task
options must grade with its own object, or those options never reach the reward. Problems remember the task
object that made them (`Problem.grader`), so the rollout's call is `score_problems(problems_per_sample, texts)`.

Cost: every call is bounded by its input size (outputs are read up to answers.MAX_OUTPUT_CHARS = 1 MiB from
the end; all scans are linear) plus at most one math-verify call of bounded time; `score_batch` runs a
batch's math-verify calls in parallel in the worker pool.

Each task owns its knowledge (problems, grading, warm-start demonstrator, eval protocol `eval_n`), so no
consumer branches on a task's name. Adding a task is one task file (or one registration: `tasks.register`)
plus its test, then one line in TASKS below: docs/guide.md section 7. The multi-turn tool environment
(tool_env.py, sandbox.py) lives beside these but is not imported here, so that grading stays cheap to import.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from vcpo_jax.tasks.answers import EXTRACTORS
from vcpo_jax.tasks.arithmetic import ArithmeticTask
from vcpo_jax.tasks.base import Grader, Task, TaskDefaults
from vcpo_jax.tasks.countdown import CountdownTask
from vcpo_jax.tasks.datasets import AIME, GSM8K, MATH, MATH500, DataSet, Problem, ProblemStream, TextTask, load_problems

__all__ = [
  "CORRECT_THRESHOLD",
  "TASKS",
  "DataSet",
  "Grader",
  "Problem",
  "ProblemStream",
  "Task",
  "TaskDefaults",
  "TextTask",
  "build",
  "grading_failures",
  "is_correct",
  "load_problems",
  "register",
  "score",
  "score_batch",
  "score_problem",
  "score_problems",
  "task_of",
]

_log = logging.getLogger(__name__)

# score >= this counts as a correct answer (format bonuses stay below it).
CORRECT_THRESHOLD = 0.5

# name -> the default instance of each Task (tasks/base.py). Text datasets load the shipped fixtures by
# default; a run builds its own configured instance with `build` (a data file, a template, options).
TASKS: dict[str, Task] = {
  "countdown": CountdownTask(),
  "arithmetic": ArithmeticTask(),
  "gsm8k": TextTask(GSM8K),
  "math": TextTask(MATH),
  "math500": TextTask(MATH500),
  "aime": TextTask(AIME),
}


def register(task: Task, *, replace: bool = False) -> Task:
  """Adds `task` (its default instance) to TASKS under task.name and returns it; a taken name is a ValueError
  unless replace=True. `tasks.build`, the config's task.name / eval.dataset, the warm start and the
  evaluation then find it like a shipped task."""
  if not isinstance(task, Task):
    raise TypeError(f"{task!r} is not a tasks.Task (a member is missing; see tasks/base.py and TaskDefaults)")
  if task.name in TASKS and not replace:
    raise ValueError(f"task {task.name!r} is already registered; pass replace=True to replace it")
  TASKS[task.name] = task
  return task


def task_of(problem: Problem) -> Task:
  """The task object that made `problem` (its grader, with the run's options), else the registry's default
  instance of `problem.task`."""
  if problem.grader is not None:
    return problem.grader
  if problem.task not in TASKS:
    raise ValueError(f"task {problem.task!r} unknown; choose one of {sorted(TASKS)}")
  return TASKS[problem.task]


# Grading bugs since the last reset (process-wide; every sampler process counts its own).
_FAILURES = 0
_FAILURES_LOCK = threading.Lock()
_LOGGED_FAILURES_MAX = 5  # tracebacks logged per process; later failures are only counted


def grading_failures(reset: bool = False) -> int:
  """Number of samples whose grading raised (each graded 0.0) since the last reset."""
  global _FAILURES
  with _FAILURES_LOCK:
    n = _FAILURES
    if reset:
      _FAILURES = 0
  return n


def _record_failure(name: str) -> None:
  global _FAILURES
  with _FAILURES_LOCK:
    _FAILURES += 1
    n = _FAILURES
  if n <= _LOGGED_FAILURES_MAX:
    _log.warning("grading bug in task %r (graded 0.0, counted in grading_failures())", name, exc_info=True)


def build(name: str, *, template: str = "", options: dict | None = None, data_path: str = "") -> Task:
  """The configured task: registry `name` with a prompt template ("" = the task's default), a generated
  task's options (its generator knobs, countdown's format_weight / require_format) or a data set's local
  file ("" = the shipped fixture). Raises ValueError / TypeError naming a bad option."""
  if name not in TASKS:
    raise ValueError(f"task {name!r} unknown; choose one of {sorted(TASKS)}")
  options = dict(options or {})
  kw = {"template": template} if template else {}
  if TASKS[name].generated:
    if data_path:
      raise ValueError(f"data_path={data_path!r}: task {name!r} is generated, it reads no file; leave it empty.")
    return type(TASKS[name])(**kw, **options)
  if options:
    raise ValueError(f"{sorted(options)[0]}: task {name!r} is a data set and takes no generator options.")
  return TextTask(TASKS[name].dataset, path=data_path or None, template=template or None)


def _resolve(task) -> tuple[str, Task]:
  """(name, task object) for a registry name or a task object."""
  if isinstance(task, str):
    if task not in TASKS:
      raise ValueError(f"task {task!r} unknown; choose one of {sorted(TASKS)}")
    return task, TASKS[task]
  if isinstance(task, Grader) and isinstance(task.name, str):
    return task.name, task
  raise ValueError(f"task must be a name in {sorted(TASKS)} or a task object (tasks.Task), got {task!r}")


def _check(obj: Task, reference, extraction) -> None:
  """Raise ValueError for caller bugs: a malformed reference or an unknown extraction."""
  obj.check_reference(reference)  # malformed references are caller bugs: raise
  if extraction is not None:
    if extraction not in EXTRACTORS:
      raise ValueError(f"extraction {extraction!r} unknown; choose one of {sorted(EXTRACTORS)}")


def _grade(name: str, obj, model_output, reference, extraction) -> tuple[float, bool]:
  """(reward, failed): a raising scorer grades 0.0 and is recorded."""
  if not isinstance(model_output, str):
    return 0.0, False
  try:
    return float(obj.score(model_output, reference, extraction)), False
  except Exception:  # a grading bug must not kill a training run: grade as wrong, count it
    _record_failure(name)
    return 0.0, True


def score(task, model_output, reference, extraction: str | None = None) -> float:
  """Reward of one model output against a reference, in [0, 1].

  task: "gsm8k" | "math" | "math500" | "aime" | "countdown" | "arithmetic", or
    a task object (e.g. the run's configured CountdownTask).
  reference: the bare answer string (a full GSM8K answer with "#### N" or a
    MATH solution with \\boxed{} is also accepted); for countdown a dict
    {"numbers": [...], "target": int}; for arithmetic the integer string.
  extraction: a method name from answers.EXTRACTORS (text tasks only);
    None picks the task's default.
  """
  name, obj = _resolve(task)
  _check(obj, reference, extraction)
  return _grade(name, obj, model_output, reference, extraction)[0]


def score_batch(
  task, outputs: Sequence, references: Sequence, extraction: str | None = None
) -> tuple[list[float], int]:
  """(rewards, failures): `score` of each (output, reference) pair, and how many of them hit a grading bug.

  Text tasks grade in up to answers' math-verify pool size threads, so the
  slow math-verify calls of a batch (power towers, factorials: up to the
  timeout each) run in parallel worker processes instead of one after another.
  """
  if len(outputs) != len(references):
    raise ValueError(f"score_batch: {len(outputs)} outputs but {len(references)} references; pass one per output")
  name, obj = _resolve(task)
  for ref in references:
    _check(obj, ref, extraction)
  grade = lambda pair: _grade(name, obj, pair[0], pair[1], extraction)
  pairs = list(zip(outputs, references))
  if obj.uses_extraction and len(pairs) > 1:  # a data set: math-verify may be slow
    from vcpo_jax.tasks import answers

    with ThreadPoolExecutor(max_workers=min(answers._POOL.size, len(pairs))) as ex:
      graded = list(ex.map(grade, pairs))
  else:
    graded = [grade(p) for p in pairs]
  return [r for r, _ in graded], sum(f for _, f in graded)


def score_problem(problem: Problem, model_output, extraction: str | None = None) -> float:
  """`score` of an output for a problem, with the task object that made the problem (its configured options)."""
  return score(
    problem.grader if problem.grader is not None else problem.task, model_output, problem.reference, extraction
  )


def score_problems(
  problems: Sequence[Problem], outputs: Sequence, extraction: str | None = None
) -> tuple[list[float], int]:
  """(rewards, failures) of outputs[i] for problems[i], each graded by its problem's task object.

  The rollout's call: problems repeat G times for G samples; consecutive runs of
  one grader go through `score_batch` (parallel math-verify).
  """
  if len(outputs) != len(problems):
    raise ValueError(f"score_problems: {len(outputs)} outputs but {len(problems)} problems; pass one per output")
  rewards: list[float] = []
  failures = 0
  i = 0
  while i < len(problems):
    task = problems[i].grader if problems[i].grader is not None else problems[i].task
    j = i
    while j < len(problems) and (problems[j].grader if problems[j].grader is not None else problems[j].task) is task:
      j += 1
    r, f = score_batch(task, outputs[i:j], [p.reference for p in problems[i:j]], extraction)
    rewards += r
    failures += f
    i = j
  return rewards, failures


def is_correct(reward: float) -> bool:
  """Whether a `score` value counts as a correct answer."""
  return reward >= CORRECT_THRESHOLD
