"""The Task protocol: where problems come from and how an answer is graded.

A task is one configured object, built once from the run's task config
(`tasks.build`), that every consumer shares: the training pool, the rollout's
rewards (each Problem carries the task that made it as `Problem.grader`) and
the evaluation. Options given to the constructor (countdown's format_weight,
a data file, a prompt template) therefore reach every reward; nothing looks a
task up by name once it is built.

Two kinds:
  generated   (countdown, arithmetic): `make_problems(split, n, seed)` draws n
              fresh instances; the answer is parsed by the task itself, so an
              answers.EXTRACTORS method does not apply (`uses_extraction` False).
  data set    (gsm8k, math, math500, aime): `make_problems` loads a finite file;
              n = None takes all of it; answers are extracted by a named method.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Task(Protocol):
  """What the trainer, rollouts and evaluation need from a task (CountdownTask, ArithmeticTask, TextTask)."""

  name: str  # registry name, e.g. "countdown"; recorded with evaluations
  generated: bool  # True: make_problems generates n instances; False: it loads a finite data set
  uses_extraction: bool  # whether `score` takes an answers.EXTRACTORS method (data sets) or parses itself

  def make_problems(self, split: str, n: int | None, seed: int, template: str | None = None) -> list:
    """n problems (tasks.Problem) of `split`, deterministic in seed; n = None: the whole data set."""
    ...

  def score(self, model_output: str, reference: Any, extraction: str | None = None) -> float:
    """Reward in [0, 1] (>= tasks.CORRECT_THRESHOLD: correct); may raise only on a grading bug."""
    ...

  def check_reference(self, reference: Any) -> None:
    """Raises ValueError for a malformed reference (a caller bug, unlike junk model output)."""
    ...
