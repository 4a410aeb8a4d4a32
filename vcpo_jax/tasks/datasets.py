"""Problems, local data loaders in the public schemas, and a resumable stream.

Schemas (as published; field names are matched case-insensitively):
  gsm8k    question, answer            (answer ends in "#### N")
  math     problem, solution           (final answer: the last \\boxed{...} group, see answers.py)
  math500  problem, answer             (solution optional)
  aime     problem, answer             ("question" accepted for problem; integer answer)
An optional "id" / "unique_id" / "idx" field becomes Problem.id.

Files: .jsonl, .json (a list of records) or .parquet (pyarrow). Nothing is
fetched at run time; small hand-written fixtures ship in tasks/data/.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Sequence

import numpy as np

from vcpo_jax.tasks import answers

__all__ = [
  "DATA_DIR",
  "DEFAULT_TEMPLATES",
  "SCHEMAS",
  "Problem",
  "ProblemStream",
  "TextTask",
  "fixture_path",
  "load_problems",
  "load_records",
]

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")

# dataset -> (scoring task, prompt field, reference field)
SCHEMAS = {
  "gsm8k": ("gsm8k", "question", "answer"),
  "math": ("math", "problem", "solution"),
  "math500": ("math", "problem", "answer"),
  "aime": ("aime", "problem", "answer"),
}
_ALIASES = {"problem": ("question",), "question": ("problem",)}
_ID_FIELDS = ("id", "unique_id", "idx", "problem_id")

# Plain-string prompt templates; {problem} is the schema's prompt field.
DEFAULT_TEMPLATES = {
  "gsm8k": "{problem}\nLet's think step by step and output the final answer after \"####\".",
  "math": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
  "math500": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
  "aime": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
}


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


def fixture_path(dataset: str) -> str:
  """Path of the shipped fixture for a dataset in SCHEMAS."""
  if dataset not in SCHEMAS:
    raise ValueError(f"dataset {dataset!r} unknown; choose one of {sorted(SCHEMAS)}")
  return os.path.join(DATA_DIR, f"{dataset}_fixture.jsonl")


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
  dataset: str,
  path: str | None = None,
  split: str = "test",
  template: str | None = None,
) -> list[Problem]:
  """Problems of a dataset from a local file (default: the shipped fixture).

  The reference is reduced to the bare answer: GSM8K's "#### N" number, the
  final \\boxed{} group of a MATH solution (`\\boxed{1}, \\boxed{2}` -> "1, 2"),
  MATH-500/AIME's answer field as a string.
  """
  if dataset not in SCHEMAS:
    raise ValueError(f"dataset {dataset!r} unknown; choose one of {sorted(SCHEMAS)}")
  task, prompt_field, ref_field = SCHEMAS[dataset]
  template = DEFAULT_TEMPLATES[dataset] if template is None else template
  if "{problem}" not in template:
    raise ValueError(f"prompt template must contain '{{problem}}', got {template!r}")
  path = fixture_path(dataset) if path is None else path
  out = []
  for i, rec in enumerate(load_records(path)):
    where = f"{path} record {i}"
    text = str(_field(rec, prompt_field, where))
    raw_ref = str(_field(rec, ref_field, where)).strip()
    ref = answers.reference_answer(raw_ref, task)
    if dataset == "gsm8k" and "####" not in raw_ref:
      raise ValueError(f"{where}: gsm8k answer must end in '#### N', got {raw_ref[-60:]!r}")
    if dataset == "math" and ref == raw_ref:
      raise ValueError(f"{where}: math solution has no \\boxed{{...}} answer")
    rid = next((rec[k] for k in _ID_FIELDS if rec.get(k) is not None), None)
    out.append(
      Problem(
        id=str(rid) if rid is not None else f"{dataset}-{split}-{i}",
        task=task,
        prompt=template.format(problem=text),
        reference=ref,
        dataset=dataset,
        solution=raw_ref if ref_field == "solution" or dataset == "gsm8k" else rec.get("solution"),
      )
    )
  return out


class TextTask:
  """A data-set task (tasks.Task) for a loaded dataset (gsm8k, math, math500, aime).

  make_problems loads `path` (default: the shipped fixture), shuffles with the
  seed and takes the first n; scoring extracts with a named method from the
  output's last answers.MAX_OUTPUT_CHARS characters and compares with
  answers.answers_match (exact fast path, then math-verify; AIME: integers only).
  """

  generated = False
  uses_extraction = True

  def __init__(self, dataset: str, path: str | None = None, template: str | None = None):
    if dataset not in SCHEMAS:
      raise ValueError(f"dataset {dataset!r} unknown; choose one of {sorted(SCHEMAS)}")
    self.name = dataset
    self.task = SCHEMAS[dataset][0]
    self.path = path
    self.template = template

  def make_problems(self, split: str = "test", n: int | None = None, seed: int = 0, template: str | None = None):
    probs = load_problems(self.name, self.path, split, template if template is not None else self.template)
    order = np.random.default_rng(seed).permutation(len(probs))
    if n is not None:
      if not 0 <= n <= len(probs):
        raise ValueError(f"n={n} but {self.name} at {self.path or 'fixture'} has {len(probs)} problems")
      order = order[:n]
    return [dataclasses.replace(probs[i], grader=self) for i in order]

  def score(self, model_output: str, reference: str, extraction: str | None = None) -> float:
    method = extraction or ("gsm8k" if self.task == "gsm8k" else self.task)
    ref = answers.reference_answer(str(reference), self.task)
    pred = answers.extract_answer(model_output, method)
    if pred is None:
      return 0.0
    if self.task == "aime":  # AIME answers are integers 0..999; "007" == "7"
      return float(answers.answers_match(pred, ref, use_math_verify=False))
    return float(answers.answers_match(pred, ref))

  def check_reference(self, reference) -> None:
    """Any reference string is well formed (reference_answer reduces a full solution to its answer)."""


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
