"""A recorded evaluation protocol: every number carries the decoding that made it.

Review finding #11: accuracy numbers cannot be reproduced when the decoding
protocol is unstated. `EvalProtocol` names every choice (data set, split,
size, temperature, top_p, n, max new tokens, greedy, pass@k list, extraction
method, prompt template), and `evaluate` writes one jsonl record per call that
embeds the full protocol next to the checkpoint step, mean@n and pass@k.
`EvalSampling` is the one generation path behind it (trainer, multi-turn, sft):
each call decodes with a sampler built from the settings it is handed, so the
recorded protocol is the decoding that ran.
Records can be tagged "best" or "final" so reports state both (finding #6);
`best_and_final` reads them back.

Defaults match the reference's validation: temperature 0.8, top_p 0.7, and n
from the task's own protocol (`Task.eval_n`: 3; 5 for AIME) unless set.

Metrics, over P problems with n samples each and c_p correct samples:
  mean@n  = (1/P) sum_p c_p / n
  pass@k  = (1/P) sum_p [1 - C(n - c_p, k) / C(n, k)]     (unbiased; Chen et al. 2021)
A sample is correct iff `tasks.score(...) >= tasks.CORRECT_THRESHOLD`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vcpo_jax import fs, schema
from vcpo_jax import tasks as tasks_lib
from vcpo_jax.model.tokenizer import encode_prompts
from vcpo_jax.schema import check_field
from vcpo_jax.tasks import answers
from vcpo_jax.tasks.datasets import Problem

if TYPE_CHECKING:
  from vcpo_jax.sampler import Sampler, SamplerConfig

__all__ = [
  "EvalProtocol",
  "EvalSampling",
  "GenerateFn",
  "best_and_final",
  "evaluate",
  "mean_at_n",
  "pass_at_k",
  "pass_at_k_per_problem",
]

# generate_fn(prompts, n, temperature, top_p, max_new_tokens, greedy) -> [P][n] completions
GenerateFn = Callable[..., list]
_TAGS = (None, "best", "final")


@dataclasses.dataclass(frozen=True)
class EvalProtocol:
  """How an evaluation is run; recorded verbatim with its results.

  dataset: a name in tasks.TASKS ("gsm8k", "math", "math500", "aime", "countdown", "arithmetic").
  split: data split ("test" for held-out data).
  size: number of problems (None = all the loader returns; generated tasks need it).
  temperature, top_p: sampling parameters (ignored by the sampler when greedy).
  n: samples per problem; None -> 1 if greedy, else the task's protocol (tasks.TASKS[dataset].eval_n: 5 for
    AIME, else 3).
  max_new_tokens: generation budget per sample.
  greedy: argmax decoding (then n must be 1: all samples would be identical).
  pass_at_k: the k values to report; each must be <= n.
  extraction: answer extraction method (answers.EXTRACTORS name) or None for the task default.
  prompt_template: template applied when building problems; None = the task default.
  seed: selects and orders the problem subset (and generated instances).
  """

  dataset: str
  split: str = "test"
  size: int | None = None
  temperature: float = 0.8  # reference validation protocol
  top_p: float = 0.7  # reference validation nucleus
  n: int | None = None  # samples per problem (None = the task's protocol, Task.eval_n: 5 for AIME, else 3)
  max_new_tokens: int = 1024
  greedy: bool = False  # argmax decoding instead (then n = 1)
  pass_at_k: tuple[int, ...] = (1,)  # pass@k list
  extraction: str | None = None
  prompt_template: str | None = None
  seed: int = 0

  def __post_init__(self):
    if self.dataset not in tasks_lib.TASKS:
      raise ValueError(f"EvalProtocol.dataset {self.dataset!r} unknown; choose one of {sorted(tasks_lib.TASKS)}")
    if not isinstance(self.split, str) or not self.split:
      raise ValueError(f"EvalProtocol.split must be a non-empty string, got {self.split!r}")
    if self.size is not None and (not isinstance(self.size, int) or self.size < 1):
      raise ValueError(f"EvalProtocol.size must be a positive int or None, got {self.size!r}")
    if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
      raise ValueError(f"EvalProtocol.temperature must be >= 0, got {self.temperature!r}")
    if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
      raise ValueError(f"EvalProtocol.top_p must be in (0, 1], got {self.top_p!r}")
    n = self.n
    if n is None:
      n = 1 if self.greedy else tasks_lib.TASKS[self.dataset].eval_n
      object.__setattr__(self, "n", n)
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"EvalProtocol.n must be a positive int, got {n!r}")
    if self.greedy and n != 1:
      raise ValueError(f"EvalProtocol.greedy=True needs n=1 (greedy samples are identical), got n={n}")
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"EvalProtocol.max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
    ks = tuple(int(k) for k in self.pass_at_k)
    object.__setattr__(self, "pass_at_k", ks)
    if not ks or any(k < 1 or k > n for k in ks):
      raise ValueError(f"EvalProtocol.pass_at_k must be non-empty with 1 <= k <= n={n}, got {ks}")
    if self.extraction is not None and self.extraction not in answers.EXTRACTORS:
      raise ValueError(
        f"EvalProtocol.extraction {self.extraction!r} unknown; choose one of {sorted(answers.EXTRACTORS)} or None"
      )
    if self.extraction is not None and not tasks_lib.TASKS[self.dataset].uses_extraction:
      raise ValueError(f"EvalProtocol.extraction must be None for {self.dataset} (it has its own parser)")

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["pass_at_k"] = list(self.pass_at_k)
    return d

  @classmethod
  def from_dict(cls, d) -> EvalProtocol:
    """From a dict or ConfigDict; unknown keys are an error (typos must not pass silently)."""
    d = dict(d)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"EvalProtocol got unknown fields {unknown}; valid fields are {sorted(names)}")
    if "pass_at_k" in d:
      d["pass_at_k"] = tuple(d["pass_at_k"])
    return cls(**d)


# EvalProtocol's fields a run config sets (config.eval.*, EvalSection): the decoding.
RUN_FIELDS = ("temperature", "top_p", "n", "greedy", "pass_at_k")

# ----------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------
# episodes(sampler, params, contexts [N][token ids], max_new_tokens, rng) -> N final texts (multi-turn)


@dataclasses.dataclass(frozen=True)
@schema.fields_from(EvalProtocol, RUN_FIELDS, after="num_problems")
class EvalSection:
  """config.eval: what is evaluated and when; parse_config builds the EvalProtocol from it.

  The decoding knobs (RUN_FIELDS) are EvalProtocol's fields, with their defaults and comments
  (schema.fields_from). The section is not EvalProtocol itself: the protocol is recorded verbatim with every
  result (`to_dict`), and the section's own knobs are not protocol (data_path, every, background), are named
  otherwise in the ConfigDict than in the records (num_problems: the protocol's size), or differ in meaning
  (dataset "" = the training task; the protocol's is required), while the protocol's split, max_new_tokens,
  prompt_template and seed come from other sections (task, seed)."""

  dataset: str = ""  # held-out data set name ("" = the training task), e.g. math500 or aime
  data_path: str = ""  # its local parquet/jsonl ("" = the shipped fixture / the task's own file)
  every: int = 0  # evaluate every this many steps (0 = only at start and end)
  num_problems: int = 64  # evaluation set size (held-out split)
  background: bool = False  # mode=async: the sampler process evaluates, tagged with the version; no learner stop

  def __post_init__(self):
    check_field(self.every >= 0, "eval.every", self.every, "must be >= 0 (0 = at the start and end only).")


EpisodesFn = Callable[..., list]


class EvalSampling:
  """The one evaluation-generation path: protocol settings -> a sampler with exactly those -> texts.

  `generate_fn(params, rng)` is the GenerateFn `evaluate` calls. Each call decodes with the sampler
  whose config is `sampler_config(temperature, top_p, greedy, max_new_tokens)`:

    temperature' = 0 if greedy else temperature,  top_p' = top_p,  top_k' = 0,
    max_new_tokens' = max_new_tokens (single-turn; multi-turn: the whole episode budget),

  everything else (EOS, pad, stop ids, buckets, logp mode) from `base`. Samplers are built once per
  distinct setting (a run's fixed protocol compiles one) and reused.

  Args:
    make_sampler: SamplerConfig -> Sampler (e.g. `lambda c: Sampler(graphdef, model_cfg, c)`).
    base: the sampler config the settings are written into; its new-token buckets must hold the
      protocol's max_new_tokens (single-turn).
    tokenizer: encodes prompts (no special tokens; chat template if asked) and decodes responses.
    chat_template: wrap prompts in the tokenizer's chat template (RolloutConfig.chat_template).
    episodes: None for single-turn sampling; else multi-turn tool-use episodes
      (`MultiTurnRolloutMaker.eval_episodes`), which receive the sampler and return the final turns.
  """

  def __init__(
    self,
    make_sampler: Callable[[SamplerConfig], Sampler],
    base: SamplerConfig,
    tokenizer,
    *,
    chat_template: bool = False,
    episodes: EpisodesFn | None = None,
  ):
    self.make_sampler, self.base, self.tokenizer = make_sampler, base, tokenizer
    self.chat_template, self.episodes = chat_template, episodes
    self._samplers: dict = {}

  def sampler_config(self, temperature: float, top_p: float, greedy: bool, max_new_tokens: int) -> SamplerConfig:
    """`base` with the protocol's decoding settings written in (see the class docstring)."""
    cfg = {"temperature": 0.0 if greedy else float(temperature), "top_p": float(top_p), "top_k": 0}
    if self.episodes is None:  # multi-turn: the sampler's budget is one turn; the episode takes max_new_tokens
      if max_new_tokens > self.base.new_token_buckets[-1]:
        raise ValueError(
          f"eval max_new_tokens={max_new_tokens} exceeds the eval sampler's largest new-token bucket "
          f"{self.base.new_token_buckets[-1]}; build EvalSampling with a base config that holds it."
        )
      cfg["max_new_tokens"] = int(max_new_tokens)
    return dataclasses.replace(self.base, **cfg)

  def sampler(self, temperature: float, top_p: float, greedy: bool, max_new_tokens: int) -> Sampler:
    cfg = self.sampler_config(temperature, top_p, greedy, max_new_tokens)
    if cfg not in self._samplers:
      self._samplers[cfg] = self.make_sampler(cfg)
    return self._samplers[cfg]

  def generate_fn(self, params, rng) -> GenerateFn:
    """generate(prompts, n, temperature, top_p, max_new_tokens, greedy) -> [P][n] texts with `params`.

    Rows are prompt-major (row p * n + j is sample j of prompt p); rng seeds every row (Sampler's
    per-row streams), so the texts are a pure function of (params, prompts, settings, rng).
    """

    def generate(prompts, n, temperature, top_p, max_new_tokens, greedy):
      sampler = self.sampler(temperature, top_p, greedy, max_new_tokens)
      probs = [Problem(id=str(i), task="", prompt=p, reference=None) for i, p in enumerate(prompts)]
      ids = encode_prompts(self.tokenizer, probs, self.chat_template)
      if self.episodes is not None:
        texts = self.episodes(sampler, params, [p for p in ids for _ in range(n)], max_new_tokens, rng)
      else:
        ro = sampler.generate(params, ids, rng, num_samples=n, max_new_tokens=max_new_tokens)
        texts = [
          self.tokenizer.decode(ro.tokens[i][ro.response_mask[i]], skip_special_tokens=True)
          for i in range(len(ids) * n)
        ]
      return [texts[i * n : (i + 1) * n] for i in range(len(ids))]

    return generate


# ----------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------
def pass_at_k_per_problem(n: int, c, k: int) -> np.ndarray:
  """Unbiased pass@k per problem: 1 - C(n - c, k) / C(n, k).

  Computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the
  (huge) binomials; equals 1 exactly when n - c < k.
  Args: n samples per problem, c [P] correct counts (0 <= c <= n), k <= n.
  Returns: [P] float64.
  """
  c_p = np.atleast_1d(np.asarray(c, dtype=np.int64))
  if not 1 <= k <= n:
    raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
  if np.any(c_p < 0) or np.any(c_p > n):
    raise ValueError(f"correct counts must lie in [0, n={n}], got {c_p.tolist()}")
  out = np.empty(c_p.shape, dtype=np.float64)
  for idx, ci in enumerate(c_p):
    if n - ci < k:
      out[idx] = 1.0
    else:
      i = np.arange(n - ci + 1, n + 1, dtype=np.float64)
      out[idx] = 1.0 - float(np.prod(1.0 - k / i))
  return out


def pass_at_k(n: int, c, k: int) -> float:
  """Mean unbiased pass@k over problems (see pass_at_k_per_problem)."""
  return float(np.mean(pass_at_k_per_problem(n, c, k)))


def mean_at_n(correct_pn) -> float:
  """mean@n: mean over problems of the fraction of correct samples; correct_pn [P, n] bool/0-1."""
  arr = np.asarray(correct_pn, dtype=np.float64)
  if arr.ndim != 2 or arr.size == 0:
    raise ValueError(f"mean_at_n needs a non-empty [P, n] array, got shape {arr.shape}")
  return float(arr.mean(axis=1).mean())


# ----------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------
def evaluate(
  generate_fn: GenerateFn,
  problems: Sequence[Problem],
  protocol: EvalProtocol,
  step: int,
  writer: Any = None,
  jsonl_path: str | None = None,
  tag: str | None = None,
  extra: dict | None = None,
) -> dict:
  """Sample, grade, and record one evaluation.

  generate_fn(prompts: list[str], n=, temperature=, top_p=, max_new_tokens=,
  greedy=) must return a list with one list of n completion strings per
  prompt; it runs on the host (the sampler behind it may be jitted).
  problems: if protocol.size is set, the first `size` are used (fewer is an error).
  writer: anything with add_scalar(name, value, step) (tensorboardX SummaryWriter).
  jsonl_path: append the record there as one json line (a local path or a URL, through vcpo_jax.fs).
  tag: None, "best" or "final" (for best-vs-final reporting).
  extra: additional json-serializable fields to store (e.g. wall-clock, GPU-hours).

  Returns the record: {"kind": "eval", "step", "tag", "protocol", "num_problems",
  "mean_at_n", "pass_at_k": {"k": value}, "mean_reward", "grading_failures", "per_problem":
  [{"id", "num_correct"}], "eval_seconds", "time"} plus `extra`.
  """
  if tag not in _TAGS:
    raise ValueError(f"tag must be one of {_TAGS}, got {tag!r}")
  problems = list(problems)
  if protocol.size is not None:
    if len(problems) < protocol.size:
      raise ValueError(f"protocol.size={protocol.size} but only {len(problems)} problems were given")
    problems = problems[: protocol.size]
  if not problems:
    raise ValueError("evaluate needs at least one problem")
  n = protocol.n
  t0 = time.time()
  prompts = [p.prompt for p in problems]
  outputs = generate_fn(
    prompts,
    n=n,
    temperature=protocol.temperature,
    top_p=protocol.top_p,
    max_new_tokens=protocol.max_new_tokens,
    greedy=protocol.greedy,
  )
  if len(outputs) != len(prompts) or any(len(o) != n for o in outputs):
    shapes = [len(o) for o in outputs][:5]
    raise ValueError(
      f"generate_fn must return {len(prompts)} lists of n={n} completions; got {len(outputs)} lists "
      f"with lengths {shapes}..."
    )
  # Graded by each problem's own task object (the run's configured task: its options reach the reward);
  # a grader that raises counts in record["grading_failures"] instead of vanishing as a 0.
  rewards, failures = tasks_lib.score_problems(
    [p for p, outs in zip(problems, outputs) for _ in outs], [o for outs in outputs for o in outs], protocol.extraction
  )
  reward_pn = np.asarray(rewards, np.float64).reshape(len(problems), n)
  correct_pn = reward_pn >= tasks_lib.CORRECT_THRESHOLD
  c_p = correct_pn.sum(axis=1)
  record = {
    "kind": "eval",
    "step": int(step),
    "tag": tag,
    "protocol": protocol.to_dict(),
    "num_problems": len(problems),
    "mean_at_n": mean_at_n(correct_pn),
    "pass_at_k": {str(k): pass_at_k(n, c_p, k) for k in protocol.pass_at_k},
    "mean_reward": float(reward_pn.mean()),
    "grading_failures": int(failures),
    "per_problem": [{"id": p.id, "num_correct": int(c)} for p, c in zip(problems, c_p)],
    "eval_seconds": time.time() - t0,
    "time": time.time(),
  }
  if extra:
    clash = set(extra) & set(record)
    if clash:
      raise ValueError(f"extra fields {sorted(clash)} would overwrite record fields")
    record.update(extra)
  if writer is not None:
    prefix = f"eval/{protocol.dataset}"
    writer.add_scalar(f"{prefix}/mean@{n}", record["mean_at_n"], int(step))
    for k, v in record["pass_at_k"].items():
      writer.add_scalar(f"{prefix}/pass@{k}", v, int(step))
    writer.add_scalar(f"{prefix}/mean_reward", record["mean_reward"], int(step))
  if jsonl_path is not None:  # a local path or a URL (vcpo_jax.fs)
    fs.append_text(jsonl_path, json.dumps(record) + "\n")
  return record


def best_and_final(jsonl_path: str, dataset: str | None = None, metric: str = "mean_at_n") -> dict:
  """Best and final eval records from a jsonl file.

  Among "eval" records (optionally of one dataset): "final" is the record
  tagged "final" if any, else the one with the largest step; "best" is the
  record tagged "best" if any, else the one with the highest metric
  (earliest step on ties). metric: "mean_at_n", "mean_reward" or "pass@K".
  Returns {"best": record, "final": record}.
  """
  recs = []
  for line in fs.read_text(jsonl_path).splitlines():  # a local path or a URL (vcpo_jax.fs)
    if line.strip():
      r = json.loads(line)
      if r.get("kind") == "eval" and (dataset is None or r["protocol"]["dataset"] == dataset):
        recs.append(r)
  if not recs:
    raise ValueError(f"no eval records{' for ' + dataset if dataset else ''} in {jsonl_path}")
  protos = {json.dumps(r["protocol"], sort_keys=True) for r in recs}
  if len(protos) > 1:
    raise ValueError(
      f"{jsonl_path} mixes {len(protos)} eval protocols; pass dataset= or compare one protocol at a time"
    )

  def value(r):
    if metric.startswith("pass@"):
      return r["pass_at_k"][metric[5:]]
    if metric not in ("mean_at_n", "mean_reward"):
      raise ValueError(f"metric must be mean_at_n, mean_reward or pass@K, got {metric!r}")
    return r[metric]

  tagged_final = [r for r in recs if r.get("tag") == "final"]
  tagged_best = [r for r in recs if r.get("tag") == "best"]
  final = tagged_final[-1] if tagged_final else max(recs, key=lambda r: r["step"])
  best = tagged_best[-1] if tagged_best else max(recs, key=lambda r: (value(r), -r["step"]))
  return {"best": best, "final": final}
