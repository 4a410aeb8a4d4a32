"""The Task protocol: where problems come from, how an answer is graded, how a demonstrator answers, how it is
evaluated.

A task is one configured object, built once from the run's task config
(`tasks.build`), that every consumer shares: the training pool, the rollout's
rewards (each Problem carries the task that made it as `Problem.grader`), the
warm start (sft.py asks the task for its demonstrations) and the evaluation
(whose protocol takes the task's `eval_n` unless the config sets eval.n).
Options given to the constructor (countdown's format_weight, a data file, a
prompt template) therefore reach every reward; nothing branches on a task's
name: consumers look a task up in the registry (tasks.TASKS) or take the
problem's own grader.

Two kinds:
  generated   (countdown, arithmetic): `make_problems(split, n, seed)` draws n
              fresh instances; the answer is parsed by the task itself, so an
              answers.EXTRACTORS method does not apply (`uses_extraction` False).
  data set    (gsm8k, math, math500, aime): `make_problems` loads a finite file
              read by the data set's own `datasets.DataSet` (fields, reference
              rule, default template and extraction); n = None takes all of it.

`TaskDefaults` holds the defaults a task may inherit: the reference protocol's
n = 3 samples per problem, demonstrations that are the problem's worked
solution, and no wrong demonstrations.
"""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Grader(Protocol):
  """What grading needs (tasks.score): a name, whether it takes an extraction method, score, check_reference."""

  name: str  # registry name, e.g. "countdown"; recorded with evaluations
  uses_extraction: bool  # whether `score` takes an answers.EXTRACTORS method (data sets) or parses itself

  def score(self, model_output: str, reference: Any, extraction: str | None = None) -> float:
    """Reward in [0, 1] (>= tasks.CORRECT_THRESHOLD: correct); may raise only on a grading bug."""
    ...

  def check_reference(self, reference: Any) -> None:
    """Raises ValueError for a malformed reference (a caller bug, unlike junk model output)."""
    ...


@runtime_checkable
class Task(Grader, Protocol):
  """What the trainer, rollouts, warm start and evaluation need from a task (CountdownTask, ArithmeticTask,
  TextTask)."""

  generated: bool  # True: make_problems generates n instances; False: it loads a finite data set
  eval_n: int  # samples per problem of the task's default eval protocol (config.eval.n = None takes it)
  can_demonstrate_wrong: bool  # whether `demonstrate_wrong` writes wrong answers (sft.noise > 0 needs it)

  def make_problems(self, split: str, n: int | None, seed: int, template: str | None = None) -> list:
    """n problems (tasks.Problem) of `split`, deterministic in seed; n = None: the whole data set."""
    ...

  def demonstrate(self, problem) -> str:
    """The response a demonstrator writes for `problem` (no EOS): what the verifier accepts (the warm start's
    target). Raises ValueError when the task has none for it."""
    ...

  def demonstrate_wrong(self, problem, rng: random.Random) -> str:
    """A well-formed WRONG response for `problem`, formatted as `demonstrate` (a noisy demonstrator), a function
    of `rng`. Raises ValueError when the task cannot write one (can_demonstrate_wrong False)."""
    ...


class TaskDefaults:
  """Defaults a task class may inherit: eval_n = 3, the worked solution as its demonstration, no wrong ones."""

  eval_n = 3  # the reference's validation protocol: mean@3
  can_demonstrate_wrong = False

  def demonstrate(self, problem) -> str:
    if problem.solution is None:
      raise ValueError(
        f"problem {problem.id!r} has no solution: the warm start needs solver/worked solutions "
        "(countdown, arithmetic, or a data set with a solution column); set sft.steps=0."
      )
    return str(problem.solution).strip()

  def demonstrate_wrong(self, problem, rng: random.Random) -> str:
    raise ValueError(f"task {self.name!r} cannot write wrong answers; set sft.noise=0.")
