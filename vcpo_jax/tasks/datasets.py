"""Problems, the data sets' own reading rules (`DataSet`), local loaders and a resumable stream.

A data set is one `DataSet` value: the record fields it reads (matched case-insensitively; "problem" and
"question" are aliases), how a reference becomes the bare answer and when it is malformed, where a worked
solution comes from, its default prompt template and extraction method, whether answers are integers, and its
default eval protocol's n. The shipped ones (schemas as published):
  GSM8K    question, answer            (answer ends in "#### N"; it is the worked solution)
  MATH     problem, solution           (final answer: the last \\boxed{...} group, see answers.py)
  MATH500  problem, answer             (solution optional; graded as math)
  AIME     problem, answer             ("question" accepted for problem; integer answer; mean@5)
An optional "id" / "unique_id" / "idx" field becomes Problem.id. A new data set is one `DataSet` and one
registration (`tasks.register(TextTask(MY_SET))`); loaders and graders read everything from it.

Files: .jsonl, .json (a list of records) or .parquet (pyarrow). Nothing is
fetched at run time; small hand-written fixtures ship in tasks/data/.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, Iterator, Sequence

import numpy as np

from vcpo_jax.tasks import answers
from vcpo_jax.tasks.base import TaskDefaults

__all__ = [
  "AIME",
  "DATASETS",
  "DATA_DIR",
  "GSM8K",
  "MATH",
  "MATH500",
  "DataSet",
  "Problem",
  "ProblemStream",
  "TextTask",
  "fixture_path",
  "load_problems",
  "load_records",
]

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")

_ALIASES = {"problem": ("question",), "question": ("problem",)}
_ID_FIELDS = ("id", "unique_id", "idx", "problem_id")
_BOXED_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def well_formed(raw: str, bare: str) -> str:
  """Every reference string is well formed: no complaint."""
  return ""


def needs_hash_marker(raw: str, bare: str) -> str:
  """GSM8K: the answer field must end in the `#### N` marker."""
  return "" if "####" in raw else f"gsm8k answer must end in '#### N', got {raw[-60:]!r}"


def needs_box(raw: str, bare: str) -> str:
  """MATH: a solution must hold a \\boxed{} answer (else the bare answer is the whole solution)."""
  return "" if bare != raw else "math solution has no \\boxed{...} answer"


@dataclasses.dataclass(frozen=True)
class DataSet:
  """How one data set's records are read and graded: a data-set task's own knowledge (`TextTask` takes one).

  Callables are module-level functions (problems and their grader travel to sampler processes by pickle).
  """

  name: str  # registry name, e.g. "gsm8k"; Problem.dataset and the fixture's file name
  prompt_field: str  # the record field holding the problem ("problem" and "question" are aliases)
  reference_field: str  # the record field holding the answer (or the worked solution)
  template: str  # default prompt template; {problem} is the prompt field
  extraction: str  # default answers.EXTRACTORS method for model outputs
  reference: Callable[[str], str] = answers.boxed_reference  # any reference -> the bare answer (idempotent)
  malformed: Callable[[str, str], str] = well_formed  # (raw, bare) -> what is wrong with a record's reference, or ""
  solution_is_reference: bool = False  # the reference field is a worked solution; else the record's "solution"
  integer_answers: bool = False  # compare as integers, no math-verify (AIME 0..999: "007" == "7")
  grades_as: str = ""  # the Problem.task its problems carry ("" = name; MATH-500 grades as math)
  eval_n: int = TaskDefaults.eval_n  # samples per problem of its default eval protocol
  fixture: str = ""  # the shipped file ("" = tasks/data/<name>_fixture.jsonl)


GSM8K = DataSet(
  "gsm8k",
  "question",
  "answer",
  "{problem}\nLet's think step by step and output the final answer after \"####\".",
  "gsm8k",
  reference=answers.marked_reference,
  malformed=needs_hash_marker,
  solution_is_reference=True,
)
MATH = DataSet("math", "problem", "solution", _BOXED_TEMPLATE, "math", malformed=needs_box, solution_is_reference=True)
MATH500 = DataSet("math500", "problem", "answer", _BOXED_TEMPLATE, "math", grades_as="math")
AIME = DataSet("aime", "problem", "answer", _BOXED_TEMPLATE, "aime", integer_answers=True, eval_n=5)

# name -> DataSet of the shipped data sets (TextTask("gsm8k") looks its name up here).
DATASETS = {d.name: d for d in (GSM8K, MATH, MATH500, AIME)}


@dataclasses.dataclass(frozen=True)
class Problem:
  """One prompt with its reference.

  id: stable identifier; task: the scoring task passed to `tasks.score`
  ("gsm8k", "math", "aime", "countdown", "arithmetic"); prompt: the full
  plain-string prompt; reference: the bare answer string (or the countdown
  dict {"numbers", "target"}); dataset: where it came from ("math500");
  solution: a worked solution when the source has one (for warm starts);
  grader: the task object that made it, with its configured options (e.g.
  countdown's format_weight), which `tasks.score_problem` grades with (None:
  the registry's default instance for `task`). It travels with the problem to
  sampler processes; it takes no part in equality.
  """

  id: str
  task: str
  prompt: str
  reference: Any
  dataset: str = ""
  solution: str | None = None
  grader: Any = dataclasses.field(default=None, compare=False, repr=False)


def data_set(dataset: str | DataSet) -> DataSet:
  """The DataSet itself, or the shipped one of that name (DATASETS)."""
  if isinstance(dataset, DataSet):
    return dataset
  if dataset not in DATASETS:
    raise ValueError(f"dataset {dataset!r} unknown; choose one of {sorted(DATASETS)}")
  return DATASETS[dataset]


def fixture_path(dataset: str | DataSet) -> str:
  """Path of the shipped fixture of a data set."""
  ds = data_set(dataset)
  return ds.fixture or os.path.join(DATA_DIR, f"{ds.name}_fixture.jsonl")


def load_records(path: str) -> list[dict]:
  """Records from a .jsonl, .json (list) or .parquet file."""
  if not os.path.exists(path):
    raise ValueError(f"data file {path!r} does not exist; pass a local .jsonl/.json/.parquet path")
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()
  if path.endswith(".jsonl"):
    out = []
    with open(path) as f:
      for lineno, line in enumerate(f, 1):
        if line.strip():
          try:
            out.append(json.loads(line))
          except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
    return out
  if path.endswith(".json"):
    with open(path) as f:
      data = json.load(f)
    if not isinstance(data, list):
      raise ValueError(f"{path}: a .json data file must hold a list of records")
    return data
  raise ValueError(f"data file {path!r} must end in .jsonl, .json or .parquet")


def _field(rec: dict, name: str, where: str):
  lower = {str(k).lower(): v for k, v in rec.items()}
  for key in (name, *_ALIASES.get(name, ())):
    if key in lower and lower[key] is not None:
      return lower[key]
  raise ValueError(f"{where}: record lacks field {name!r} (has {sorted(rec)}); check the dataset schema")


def load_problems(
  dataset: str | DataSet,
  path: str | None = None,
  split: str = "test",
  template: str | None = None,
) -> list[Problem]:
  """Problems of a data set (a DataSet or a shipped one's name) from a local file (default: its fixture).

  The reference is reduced to the bare answer by the data set's own rule (`DataSet.reference`): GSM8K's
  "#### N" number, the final \\boxed{} group of a MATH solution (`\\boxed{1}, \\boxed{2}` -> "1, 2"),
  MATH-500/AIME's answer field as a string; a reference the data set calls malformed is a ValueError.
  """
  ds = data_set(dataset)
  template = ds.template if template is None else template
  if "{problem}" not in template:
    raise ValueError(f"prompt template must contain '{{problem}}', got {template!r}")
  path = fixture_path(ds) if path is None else path
  out = []
  for i, rec in enumerate(load_records(path)):
    where = f"{path} record {i}"
    text = str(_field(rec, ds.prompt_field, where))
    raw_ref = str(_field(rec, ds.reference_field, where)).strip()
    ref = ds.reference(raw_ref)
    complaint = ds.malformed(raw_ref, ref)
    if complaint:
      raise ValueError(f"{where}: {complaint}")
    rid = next((rec[k] for k in _ID_FIELDS if rec.get(k) is not None), None)
    out.append(
      Problem(
        id=str(rid) if rid is not None else f"{ds.name}-{split}-{i}",
        task=ds.grades_as or ds.name,
        prompt=template.format(problem=text),
        reference=ref,
        dataset=ds.name,
        solution=raw_ref if ds.solution_is_reference else rec.get("solution"),
      )
    )
  return out


class TextTask(TaskDefaults):
  """A data-set task (tasks.Task) for one DataSet (gsm8k, math, math500, aime, or one of your own).

  make_problems loads `path` (default: the shipped fixture), shuffles with the
  seed and takes the first n; scoring extracts with the data set's method (or a named one) from the
  output's last answers.MAX_OUTPUT_CHARS characters and compares with
  answers.answers_match (exact fast path, then math-verify; integer data sets like AIME: integers only).
  Demonstrations are the worked solution (TaskDefaults); eval_n is the data set's.
  """

  generated = False
  uses_extraction = True

  def __init__(self, dataset: str | DataSet, path: str | None = None, template: str | None = None):
    self.dataset = data_set(dataset)
    self.name = self.dataset.name
    self.task = self.dataset.grades_as or self.dataset.name
    self.eval_n = self.dataset.eval_n
    self.path = path
    self.template = template

  def make_problems(self, split: str = "test", n: int | None = None, seed: int = 0, template: str | None = None):
    probs = load_problems(self.dataset, self.path, split, template if template is not None else self.template)
    order = np.random.default_rng(seed).permutation(len(probs))
    if n is not None:
      if not 0 <= n <= len(probs):
        raise ValueError(f"n={n} but {self.name} at {self.path or 'fixture'} has {len(probs)} problems")
      order = order[:n]
    return [dataclasses.replace(probs[i], grader=self) for i in order]

  def score(self, model_output: str, reference: str, extraction: str | None = None) -> float:
    ref = self.dataset.reference(str(reference))
    pred = answers.extract_answer(model_output, extraction or self.dataset.extraction)
    if pred is None:
      return 0.0
    return float(answers.answers_match(pred, ref, use_math_verify=not self.dataset.integer_answers))

  def check_reference(self, reference) -> None:
    """Any reference string is well formed (the data set's rule reduces a full solution to its answer)."""


class ProblemStream:
  """Deterministic epoch iteration over problems with a resumable position.

  Epoch e visits problems in the permutation drawn from seed (seed, e);
  `position` counts problems handed out so far, so a stream rebuilt with the
  same problems, seed and position continues exactly where the old one was.
  """

  def __init__(self, problems: Sequence[Problem], seed: int = 0, position: int = 0):
    if len(problems) == 0:
      raise ValueError("ProblemStream needs at least one problem")
    if position < 0:
      raise ValueError(f"position must be >= 0, got {position}")
    self.problems = list(problems)
    self.seed = int(seed)
    self.position = int(position)
    self._epoch_cache: tuple[int, np.ndarray] | None = None

  def _order(self, epoch: int) -> np.ndarray:
    if self._epoch_cache is None or self._epoch_cache[0] != epoch:
      perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))
      self._epoch_cache = (epoch, perm)
    return self._epoch_cache[1]

  @property
  def epoch(self) -> int:
    return self.position // len(self.problems)

  def next(self, k: int) -> list[Problem]:
    """The next k problems (crossing epoch boundaries as needed)."""
    if k < 0:
      raise ValueError(f"k must be >= 0, got {k}")
    out = []
    for _ in range(k):
      epoch, idx = divmod(self.position, len(self.problems))
      out.append(self.problems[int(self._order(epoch)[idx])])
      self.position += 1
    return out

  def __iter__(self) -> Iterator[Problem]:
    while True:
      yield self.next(1)[0]

  def state_dict(self) -> dict:
    return {"seed": self.seed, "position": self.position, "num_problems": len(self.problems)}

  @classmethod
  def from_state(cls, problems: Sequence[Problem], state: dict) -> "ProblemStream":
    if state["num_problems"] != len(problems):
      raise ValueError(
        f"state was saved for {state['num_problems']} problems, got {len(problems)}; resume with the same problem list"
      )
    return cls(problems, seed=state["seed"], position=state["position"])
