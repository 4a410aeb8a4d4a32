"""Multi-turn tool use: the model writes Python in tags, the sandbox runs it.

Text protocol (tags configurable in ``ToolEnvConfig``)::

    <prompt> ... model text ... <code>print(2**10)</code>
    <output>
    1024
    </output>
    ... model text ... final answer, no code block

A *turn* is one stretch of model text. It ends at the first complete
``<code>...</code>`` block, at an EOS token, or after ``max_new_tokens``. A turn
that ends with a code block is executed (``sandbox.run_code``) and its output is
appended as *tool tokens*; a turn without one is the final answer. The episode
ends at the final answer, after ``max_turns`` model turns (code in the last
allowed turn is not executed: nothing would read its output), or when the
response reaches ``max_response_tokens``. The reward is
``reward_fn(final_text, reference)`` on the text of the last model turn, so an
answer printed by the code does not count until the model states it.

Masks (per episode, length T_i = prompt + response):
  response_mask: 1 on every token after the prompt (policy and tool tokens).
  loss_mask:     1 only on policy-generated tokens; 0 on prompt and tool tokens,
                 whose log-probs are not the policy's: they must enter neither
                 the policy loss nor the importance ratios l_i.
  behavior_logp: the sampler's log-prob of each policy token, 0 elsewhere.
  records:       the sampler's per-token records (`record_fields`: MoE routing, top-k) on policy tokens,
                 each record's fill on prompt and tool tokens (the learner's own routing there, as on a prompt).

Host-side only: ``generate_fn`` is the sampler (or a deterministic fake in
tests); nothing here is jitted. ``pad_episodes`` turns episodes into the fixed
[N, T] arrays the learner consumes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from vcpo_jax.tasks import sandbox

# generate_fn(contexts, max_new_tokens) -> [(new_ids [R_n], new_logps [R_n])] or, with per-token records,
# [(new_ids, new_logps, {name: [R_n, ...]})]
GenerateFn = Callable[[list[list[int]], int], Sequence[tuple]]
# {name: (dtype, trailing shape, fill)}: the per-token records episodes carry (sampler.record_fields)
RecordFields = Mapping[str, tuple[Any, tuple[int, ...], Any]]
TRUNCATION_NOTE = "\n[output truncated]\n"


@dataclasses.dataclass(frozen=True)
class ToolEnvConfig:
  """Episode limits and the text protocol.

  Attributes:
    reward_fn: (final_text, reference) -> float; the trainer passes
      ``functools.partial(vcpo_jax.tasks.score, task)``.
    max_turns: M, model turns per episode (so at most M - 1 executions).
    max_new_tokens: token budget of one model turn.
    max_response_tokens: budget of the whole response (policy + tool tokens).
    max_tool_output_tokens: tool observation budget per call; longer output is
      cut to its head plus ``TRUNCATION_NOTE``.
    code_open, code_close, output_open, output_close: protocol tags.
    eos_token_ids: token ids that end a turn (and the episode). When set, a
      generation that stops early on anything else (a sampler stop id that
      is not the end of ``code_close``) resumes within the same turn.
    sandbox: limits for each execution.
    max_workers: parallel executions per round (None: CPU count).
  """

  reward_fn: Callable[[str, Any], float]
  max_turns: int = 4
  max_new_tokens: int = 512
  max_response_tokens: int = 2048
  max_tool_output_tokens: int = 256
  code_open: str = "<code>"
  code_close: str = "</code>"
  output_open: str = "<output>"
  output_close: str = "</output>"
  eos_token_ids: tuple[int, ...] = ()
  sandbox: sandbox.SandboxConfig = sandbox.SandboxConfig()
  max_workers: int | None = None

  def __post_init__(self):
    if not callable(self.reward_fn):
      raise ValueError("reward_fn must be callable (final_text, reference) -> float")
    for name in ("max_turns", "max_new_tokens", "max_response_tokens", "max_tool_output_tokens"):
      if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
        raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
    for name in ("code_open", "code_close", "output_open", "output_close"):
      if not getattr(self, name):
        raise ValueError(f"{name} must be a non-empty tag string")
    object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


@dataclasses.dataclass(frozen=True)
class Episode:
  """One finished multi-turn trajectory (host-side, numpy).

  Attributes:
    tokens: [T_i] int32, prompt then response.
    prompt_len: number of prompt tokens.
    response_mask: [T_i] float32, 1 after the prompt.
    loss_mask: [T_i] float32, 1 on policy-generated tokens only.
    behavior_logp: [T_i] float32, sampler log-probs on policy tokens, else 0.
    reward: reward_fn(final_text, reference).
    num_turns: model turns taken.
    tool_kinds: sandbox result kind of each execution, in order ("ok",
      "timeout", "memory", "output_limit", "forbidden", "exception").
    final_text: text of the last model turn (what the reward saw).
    response_text: decoded response, tool output included (for logs).
    finish_reason: "answer" | "max_turns" | "max_tokens".
    records: {name: [T_i, ...]}, the sampler's record of each policy token, the record's fill elsewhere.
  """

  tokens: np.ndarray
  prompt_len: int
  response_mask: np.ndarray
  loss_mask: np.ndarray
  behavior_logp: np.ndarray
  reward: float
  num_turns: int
  tool_kinds: tuple[str, ...]
  final_text: str
  response_text: str
  finish_reason: str
  records: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  @property
  def num_tool_errors(self) -> int:
    return sum(k != "ok" for k in self.tool_kinds)


def find_code(text: str, cfg: ToolEnvConfig) -> str | None:
  """The body of the first complete code block in ``text``, else None."""
  a = text.find(cfg.code_open)
  if a < 0:
    return None
  b = text.find(cfg.code_close, a + len(cfg.code_open))
  return None if b < 0 else text[a + len(cfg.code_open) : b]


def format_observation(result: sandbox.SandboxResult) -> str:
  """Text the model sees for one execution: stdout, then stderr, then the error kind."""
  text = result.stdout + result.stderr
  if result.kind != "ok":
    if text and not text.endswith("\n"):
      text += "\n"
    text += f"[{result.kind}: {result.message}]\n"
  return text


@dataclasses.dataclass
class _State:
  """Mutable per-episode bookkeeping while the batch is rolled out."""

  tokens: list[int]
  prompt_len: int
  loss: list[float]
  logp: list[float]
  turn_start: int  # index in tokens where the current model turn began
  fields: RecordFields  # the records carried (run_episodes' record_fields)
  recs: dict[str, list[np.ndarray]]  # per record, its [n, ...] pieces in token order
  turns: int = 1  # model turns started
  kinds: list[str] = dataclasses.field(default_factory=list)
  final_text: str = ""
  finish: str | None = None

  @property
  def response_len(self) -> int:
    return len(self.tokens) - self.prompt_len

  def add_records(self, n: int, recs: Mapping[str, np.ndarray] | None = None):
    """Appends n tokens' records: recs[name][:n] where given, the record's fill otherwise."""
    for name, (dtype, shape, fill) in self.fields.items():
      x = np.full((n, *shape), fill, dtype) if recs is None or name not in recs else np.asarray(recs[name][:n], dtype)
      self.recs[name].append(x)


def _first_block_cut(ids: list[int], decode, cfg: ToolEnvConfig) -> int:
  """Smallest k with a complete code block in decode(ids[:k]); ids must contain one.

  Binary search: once a prefix holds a complete block, every longer prefix does.
  """
  lo, hi = 1, len(ids)
  while lo < hi:
    mid = (lo + hi) // 2
    if find_code(decode(ids[:mid]), cfg) is not None:
      hi = mid
    else:
      lo = mid + 1
  return lo


def _tool_tokens(result, encode, cfg: ToolEnvConfig) -> list[int]:
  obs = list(encode(format_observation(result)))
  if len(obs) > cfg.max_tool_output_tokens:
    note = list(encode(TRUNCATION_NOTE))
    obs = obs[: max(cfg.max_tool_output_tokens - len(note), 0)] + note
  return list(encode(cfg.output_open + "\n")) + obs + list(encode(cfg.output_close + "\n"))


def run_episodes(
  generate_fn: GenerateFn,
  tokenizer_encode: Callable[[str], Sequence[int]],
  tokenizer_decode: Callable[[Sequence[int]], str],
  prompts: Sequence[str | Sequence[int]],
  references: Sequence[Any],
  env_cfg: ToolEnvConfig,
  record_fields: RecordFields | None = None,
) -> list[Episode]:
  """Rolls out one multi-turn tool-use episode per prompt, batched per round.

  Args:
    generate_fn: host-side sampler; called with the full token contexts of all
      episodes still generating and a per-call token budget; returns, per
      context, the new token ids and their behavior log-probs. It may stop at
      EOS, at a stop id or at the budget; tokens it emits past a completed
      code block or an EOS are dropped here (with their log-probs).
    tokenizer_encode: text -> ids, WITHOUT special tokens (for Hugging Face:
      ``lambda s: tok.encode(s, add_special_tokens=False)``).
    tokenizer_decode: ids -> text.
    prompts: P prompts, as text (encoded here) or token ids.
    references: P references handed to ``env_cfg.reward_fn``.
    env_cfg: limits and protocol.
    record_fields: {name: (dtype, trailing shape, fill)} of the per-token records generate_fn returns as a
      third element (its token r's record in row r); kept on the policy tokens, fill elsewhere.
  Returns:
    P Episodes, in prompt order.
  """
  if len(prompts) != len(references):
    raise ValueError(f"prompts ({len(prompts)}) and references ({len(references)}) must have equal length")
  cfg = env_cfg
  eos = frozenset(cfg.eos_token_ids)
  fields = dict(record_fields or {})
  states = []
  for p in prompts:
    ids = [int(t) for t in (tokenizer_encode(p) if isinstance(p, str) else p)]
    s = _State(ids, len(ids), [0.0] * len(ids), [0.0] * len(ids), len(ids), fields, {k: [] for k in fields})
    s.add_records(len(ids))
    states.append(s)
  # Episodes whose current model turn is still open.
  generating = list(range(len(states)))
  while generating:
    budgets = []
    for i in generating:
      s = states[i]
      used_in_turn = len(s.tokens) - s.turn_start
      budgets.append(min(cfg.max_new_tokens - used_in_turn, cfg.max_response_tokens - s.response_len))
    # One call per round with one budget: the largest; each row is cut to its own below.
    outs = generate_fn([list(states[i].tokens) for i in generating], max(budgets))
    if len(outs) != len(generating):
      raise ValueError(f"generate_fn returned {len(outs)} continuations for {len(generating)} contexts")
    to_run: list[tuple[int, str]] = []
    still = []
    for i, budget, (new_ids, new_logps, *recs) in zip(generating, budgets, outs):
      step = _model_turn(states[i], budget, new_ids, new_logps, tokenizer_decode, cfg, eos, *recs)
      if step is _RESUME:
        still.append(i)
      elif step is not None:
        to_run.append((i, step))
    results = sandbox.run_many([c for _, c in to_run], cfg.sandbox, cfg.max_workers)
    for (i, _), result in zip(to_run, results):
      if _tool_turn(states[i], result, tokenizer_encode, cfg):
        still.append(i)
    generating = sorted(still)
  return [_episode(s, ref, tokenizer_decode, cfg) for s, ref in zip(states, references)]


_RESUME = object()  # _model_turn: the turn stopped on a non-final stop id and goes on next round


def _model_turn(s: _State, budget: int, new_ids, new_logps, decode, cfg: ToolEnvConfig, eos: frozenset, recs=None):
  """Appends one round's continuation to episode `s`; returns the code to run, _RESUME, or None (finished).

  The continuation is cut at the row's budget, after an EOS, and after the turn's first complete code
  block (tokens past it are dropped with their log-probs and records). A finished episode gets its final_text and
  finish reason ("answer", "max_tokens" or "max_turns").
  """
  new_ids = [int(t) for t in new_ids]
  new_logps = [float(x) for x in new_logps]
  if len(new_ids) != len(new_logps):
    raise ValueError(f"generate_fn returned {len(new_ids)} ids but {len(new_logps)} log-probs")
  stopped_early = len(new_ids) < budget
  new_ids, new_logps = new_ids[:budget], new_logps[:budget]
  hit_eos = False
  for k, t in enumerate(new_ids):
    if t in eos:
      new_ids, new_logps, hit_eos = new_ids[: k + 1], new_logps[: k + 1], True
      break
  turn_ids = s.tokens[s.turn_start :] + new_ids
  code = find_code(decode(turn_ids), cfg)
  if code is not None:
    cut = _first_block_cut(turn_ids, decode, cfg) - (len(s.tokens) - s.turn_start)
    new_ids, new_logps, hit_eos = new_ids[:cut], new_logps[:cut], False
  s.tokens += new_ids
  s.loss += [1.0] * len(new_ids)
  s.logp += new_logps
  s.add_records(len(new_ids), recs)
  turn_full = len(s.tokens) - s.turn_start >= cfg.max_new_tokens
  out_of_tokens = s.response_len >= cfg.max_response_tokens
  if code is None and not hit_eos and not turn_full and not out_of_tokens and stopped_early and eos and new_ids:
    return _RESUME  # stopped on a non-final stop id: resume this turn
  s.final_text = decode(s.tokens[s.turn_start :])
  if code is None:
    s.finish = "max_tokens" if (out_of_tokens and not hit_eos) else "answer"
  elif s.turns >= cfg.max_turns:
    s.finish = "max_turns"
  elif out_of_tokens:
    s.finish = "max_tokens"
  else:
    return code
  return None


def _tool_turn(s: _State, result, encode, cfg: ToolEnvConfig) -> bool:
  """Appends the sandbox's observation (loss mask 0) to episode `s`; True if a new model turn follows."""
  s.kinds.append(result.kind)
  tool = _tool_tokens(result, encode, cfg)
  room = cfg.max_response_tokens - s.response_len
  s.tokens += tool[:room]
  s.loss += [0.0] * min(len(tool), room)
  s.logp += [0.0] * min(len(tool), room)
  s.add_records(min(len(tool), room))
  if len(tool) >= room:
    s.finish = "max_tokens"  # no room left for another model turn
    return False
  s.turns += 1
  s.turn_start = len(s.tokens)
  return True


def _episode(s: _State, ref, decode, cfg: ToolEnvConfig) -> Episode:
  """The finished episode `s` as arrays, rewarded by cfg.reward_fn(final_text, ref)."""
  tokens = np.asarray(s.tokens, np.int32)
  response = np.zeros(len(tokens), np.float32)
  response[s.prompt_len :] = 1.0
  return Episode(
    tokens=tokens,
    prompt_len=s.prompt_len,
    response_mask=response,
    loss_mask=np.asarray(s.loss, np.float32),
    behavior_logp=np.asarray(s.logp, np.float32),
    reward=float(cfg.reward_fn(s.final_text, ref)),
    num_turns=s.turns,
    tool_kinds=tuple(s.kinds),
    final_text=s.final_text,
    response_text=decode(s.tokens[s.prompt_len :]),
    finish_reason=s.finish,
    records={k: np.concatenate(v) for k, v in s.recs.items()},
  )


def pad_episodes(
  episodes: Sequence[Episode], length: int | None = None, pad_id: int = 0, record_fields: RecordFields | None = None
) -> dict[str, np.ndarray]:
  """Right-pads episodes into fixed-shape arrays for the learner.

  Returns:
    tokens [N, T] int32, prompt_mask / response_mask / loss_mask [N, T]
    float32, behavior_logp [N, T] float32, rewards [N] float32, and each of
    record_fields' records [N, T, ...] (the episodes', its fill on padding).
    Padding has all masks 0. T = ``length`` or the longest episode.
  """
  if not episodes:
    raise ValueError("episodes is empty")
  longest = max(len(e.tokens) for e in episodes)
  t = longest if length is None else length
  if t < longest:
    raise ValueError(f"length={length} is shorter than the longest episode ({longest}); raise it")
  n = len(episodes)
  out = dict(
    tokens=np.full((n, t), pad_id, np.int32),
    prompt_mask=np.zeros((n, t), np.float32),
    response_mask=np.zeros((n, t), np.float32),
    loss_mask=np.zeros((n, t), np.float32),
    behavior_logp=np.zeros((n, t), np.float32),
    rewards=np.asarray([e.reward for e in episodes], np.float32),
  )
  for name, (dtype, shape, fill) in (record_fields or {}).items():
    out[name] = np.full((n, t, *shape), fill, dtype)
  for i, e in enumerate(episodes):
    L = len(e.tokens)
    out["tokens"][i, :L] = e.tokens
    out["prompt_mask"][i, : e.prompt_len] = 1.0
    out["response_mask"][i, :L] = e.response_mask
    out["loss_mask"][i, :L] = e.loss_mask
    out["behavior_logp"][i, :L] = e.behavior_logp
    for name in record_fields or {}:
      out[name][i, :L] = e.records[name]
  return out
