"""Multi-turn tool-use rollouts: problems + params -> the same fixed-shape Batch as RolloutMaker.

Each of the step's P prompts is rolled out G times as a tool-use episode
(`vcpo_jax.tasks.tool_env.run_episodes`): the policy writes text, a
`<code>...</code>` block is run in the sandbox and its output is appended as
tool tokens, until a final answer, `max_turns` or the response budget. The
sampler continues every open episode once per round with
`Sampler.generate_continuations`, stopping at EOS or at the last token of
`code_close`; a stop on that token that does not close a code block resumes the
same turn (tool_env's `eos_token_ids` rule).

Batch layout: the one `vcpo_jax.batch.Batch` (as `rollout.common.RolloutMaker`),
N = P * G rows, T = max_prompt_len + max_new_tokens columns, the response budget
counting policy AND tool tokens. What is particular to episodes:

  tokens         left-padded prompt (ends at column Tp), then the response, then pad
  valid_mask     prompt_mask | response_mask: every real token, tool tokens included
  loss_mask      policy-generated tokens only; tool and prompt tokens are 0, so they
                 enter neither the policy loss nor the importance ratios l_i
  behavior_logp  sampler log-prob on policy tokens, 0 elsewhere
  rewards        the configured task's score of the final model turn against the reference
  records        the sampler's per-token records (MoE routing `expert_ids`, top-k) over the response
                 columns, as the single-turn Batch's: each policy token's record from the sampler call
                 that drew it; the fill on tool tokens (the learner's own routing there, as on a prompt)

Tool tokens stay in `valid_mask` because the policy conditions on them: they are
scored in the forward pass as context but never as actions.

Sampler shapes: a context grows up to T - 1 tokens and one call generates at
most `max_turn_tokens`, so the sampler built by `sampler_config` has prompt
buckets Tp, 2 Tp, 4 Tp, ... up to T and a single new-token bucket; the model
needs max_position >= T + max_turn_tokens (parse_config raises a random
preset's max_position accordingly).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from vcpo_jax import tasks
from vcpo_jax.batch import Batch
from vcpo_jax.model.tokenizer import encode_prompts
from vcpo_jax.rollout.common import RolloutConfig, RolloutMaker
from vcpo_jax.sampler import SamplerConfig, record_fields
from vcpo_jax.tasks import sandbox, tool_env


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
  """Episode limits and protocol of tool-use rollouts (config.task.multiturn).

  Attributes:
    max_turns: model turns per episode (at most max_turns - 1 tool executions).
    max_turn_tokens: token budget of one model turn (the sampler's new-token bucket).
    max_tool_output_tokens: tool observation budget per call (longer output is truncated).
    code_open, code_close, output_open, output_close: protocol tags (tool_env).
    sandbox_cpu_seconds, sandbox_wall_seconds: limits of one execution.
    max_workers: parallel sandbox executions per round (0 = CPU count).
    enabled: the run's rollouts are these episodes (parse_config: RunSpec.multiturn is this config when True,
      else None); what runs episodes (MultiTurnRolloutMaker, sampler_config) does not read it.
  """

  max_turns: int = 4  # model turns per episode (at most max_turns - 1 tool calls)
  max_turn_tokens: int = 512  # token budget of one model turn (task.max_new_tokens = whole response)
  max_tool_output_tokens: int = 256  # tool observation budget per call (head kept, rest cut)
  code_open: str = "<code>"  # the model opens a code block with this tag
  code_close: str = "</code>"  # ... and closes it with this one (its last token is a stop id)
  output_open: str = "<output>"  # tool output is wrapped in these tags (tool tokens, not in the loss)
  output_close: str = "</output>"  # the tool output closes with this tag
  sandbox_cpu_seconds: int = 2  # CPU-time limit of one execution
  sandbox_wall_seconds: float = 5.0  # wall-clock limit of one execution
  max_workers: int = 0  # parallel sandbox executions (0 = CPU count)
  enabled: bool = False  # True: rollouts are multi-turn tool-use episodes (code runs in the sandbox)

  def __post_init__(self):
    for f in ("max_turns", "max_turn_tokens", "max_tool_output_tokens", "sandbox_cpu_seconds"):
      v = getattr(self, f)
      if not (isinstance(v, int) and v >= 1):
        raise ValueError(f"task.multiturn.{f} must be an int >= 1, got {v!r}.")
    if not self.sandbox_wall_seconds > 0:
      raise ValueError(f"task.multiturn.sandbox_wall_seconds must be > 0, got {self.sandbox_wall_seconds}.")
    if self.max_workers < 0:
      raise ValueError(f"task.multiturn.max_workers must be >= 0 (0 = CPU count), got {self.max_workers}.")
    for f in ("code_open", "code_close", "output_open", "output_close"):
      if not getattr(self, f):
        raise ValueError(f"task.multiturn.{f} must be a non-empty tag string.")


def sampler_config(base: SamplerConfig, rollout: RolloutConfig, mt: MultiTurnConfig) -> SamplerConfig:
  """The training SamplerConfig with the buckets multi-turn contexts need (see module docstring).

  Prompt buckets: Tp, 2 Tp, 4 Tp, ... capped at T = Tp + response budget (contexts grow each turn).
  New-token bucket: max_turn_tokens. Batch buckets: N, plus N/4 and N/16 for large N (the
  rounds near the end of a step continue only the few episodes still open).
  """
  tp, t = rollout.max_prompt_len, rollout.max_prompt_len + rollout.max_new_tokens
  prompt_buckets = []
  b = tp
  while b < t:
    prompt_buckets.append(b)
    b *= 2
  prompt_buckets.append(t)
  n = rollout.batch_size
  batch = {n} | ({n // 4, n // 16} if n >= 64 else set())
  return dataclasses.replace(
    base,
    prompt_buckets=tuple(prompt_buckets),
    new_token_buckets=(mt.max_turn_tokens,),
    max_new_tokens=mt.max_turn_tokens,
    batch_buckets=tuple(sorted(batch)),
  )


def _no_reward(text, reference) -> float:
  del text, reference
  return 0.0


class MultiTurnRolloutMaker(RolloutMaker):
  """problems(step) + params -> tool-use Batch; same `make` contract as RolloutMaker.

  Deterministic given (step, params, rng) up to sandbox timing (a run near its wall-clock limit).

  Args:
    cfg: the RolloutConfig (max_new_tokens is the whole response budget: policy + tool tokens).
    mt: episode limits and protocol.
    tokenizer: encodes prompts and tool output (no special tokens), decodes turns; needs an EOS.
    sampler: a `Sampler` (or a fake with `.cfg` and `generate_continuations`); its config should
      come from `sampler_config` so every context length has a bucket.
    problems: the training pool.
  """

  def __init__(self, cfg: RolloutConfig, mt: MultiTurnConfig, tokenizer, sampler, problems: Sequence[tasks.Problem]):
    super().__init__(cfg, tokenizer, sampler, problems)
    self.mt = mt
    if sampler.cfg.eos_id is None:
      raise ValueError("multi-turn rollouts need a tokenizer with an EOS token: it ends the final answer.")
    if mt.max_turn_tokens > cfg.max_new_tokens:
      raise ValueError(
        f"task.multiturn.max_turn_tokens={mt.max_turn_tokens} exceeds the response budget "
        f"task.max_new_tokens={cfg.max_new_tokens}; lower it or raise task.max_new_tokens."
      )
    close_ids = self._encode(mt.code_close)
    if not close_ids:
      raise ValueError(f"task.multiturn.code_close={mt.code_close!r} encodes to no tokens.")
    # The sampler pauses at the last token of code_close so the sandbox can run the block.
    self.stop_ids = (int(close_ids[-1]),)
    self.sandbox = sandbox.SandboxConfig(
      cpu_seconds=mt.sandbox_cpu_seconds, wall_seconds=float(mt.sandbox_wall_seconds)
    )

  def _encode(self, s: str) -> list[int]:
    return list(self.tokenizer.encode(s, add_special_tokens=False))

  def _decode(self, ids) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)

  def env_config(self, reward_fn, max_response_tokens: int | None = None) -> tool_env.ToolEnvConfig:
    """tool_env limits and protocol; reward_fn(final_text, reference) -> float.

    max_response_tokens: the episode budget (policy + tool tokens); None = task.max_new_tokens.
    """
    mt = self.mt
    return tool_env.ToolEnvConfig(
      reward_fn=reward_fn,
      max_turns=mt.max_turns,
      max_new_tokens=mt.max_turn_tokens,
      max_response_tokens=self.cfg.max_new_tokens if max_response_tokens is None else int(max_response_tokens),
      max_tool_output_tokens=mt.max_tool_output_tokens,
      code_open=mt.code_open,
      code_close=mt.code_close,
      output_open=mt.output_open,
      output_close=mt.output_close,
      eos_token_ids=(int(self.sampler.cfg.eos_id),),  # a stop on anything else resumes the turn
      sandbox=self.sandbox,
      max_workers=mt.max_workers or None,
    )

  def make(self, params, step: int, rng: jax.Array, version: int) -> tuple[Batch, dict]:
    """Rolls out G tool-use episodes for each of step's P prompts with `params`; returns (batch, info)."""
    cfg = self.cfg
    problems = self.problems_for_step(step)
    graders = {p.grader if p.grader is not None else p.task for p in problems}  # task objects hash by identity
    if len(graders) != 1:
      names = sorted({p.task for p in problems})
      raise ValueError(f"a multi-turn step mixes task objects (scoring tasks {names}); use one configured task.")
    (grader,) = graders
    prompt_ids = encode_prompts(self.tokenizer, problems, cfg.chat_template)
    too_long = [len(p) for p in prompt_ids if len(p) > cfg.max_prompt_len]
    if too_long:
      raise ValueError(
        f"A prompt has {max(too_long)} tokens > task.max_prompt_len={cfg.max_prompt_len}; raise task.max_prompt_len."
      )
    contexts = [p for p in prompt_ids for _ in range(cfg.group_size)]  # row n = prompt n // G
    references = [p.reference for p in problems for _ in range(cfg.group_size)]
    failures = [0]

    def reward_fn(text, reference):  # the configured task's reward; a grader that raises is counted
      (reward,), failed = tasks.score_batch(grader, [text], [reference])
      failures[0] += failed
      return reward

    episodes, rounds = self.run_episodes(params, contexts, references, self.env_config(reward_fn), rng)
    batch, info = self.episodes_to_batch(episodes, problems, version, rounds=rounds)
    info["grading_failures"] = failures[0]
    return batch, info

  def run_episodes(self, params, contexts, references, env_cfg: tool_env.ToolEnvConfig, rng, sampler=None):
    """tool_env.run_episodes driven by `sampler` (None: this maker's); returns (episodes, sampler rounds)."""
    sampler = self.sampler if sampler is None else sampler
    rounds = [0]

    def generate(ctx, max_new):
      # A fresh key per round: row n of round r draws from fold_in(fold_in(rng, r), n).
      key = jax.random.fold_in(rng, rounds[0])
      rounds[0] += 1
      outs = sampler.generate_continuations(params, ctx, max_new, self.stop_ids, key)
      recs = sampler.last_records  # {name: [n, Tn, ...]}: continuation n's token r in column r
      return [(ids, lps, {k: v[n] for k, v in recs.items()}) for n, (ids, lps) in enumerate(outs)]

    fields = record_fields(sampler.cfg, sampler.routing)
    episodes = tool_env.run_episodes(generate, self._encode, self._decode, contexts, references, env_cfg, fields)
    return episodes, rounds[0]

  def eval_episodes(self, sampler, params, contexts, max_new_tokens: int, rng) -> list[str]:
    """Final model turns of tool-use episodes, for `evaluation.EvalSampling(episodes=...)`.

    contexts: N prompt token lists (prompt-major, n samples each); sampler: the eval sampler
    (EvalSampling writes the protocol's temperature / top_p / greedy into `sampler_config`'s
    multi-turn buckets); max_new_tokens: the protocol's whole-episode budget (policy + tool
    tokens), at most task.max_new_tokens (the sampler's prompt buckets end at Tp + that).
    Returns the N final texts, the text the training reward grades; evaluation.evaluate grades them.
    """
    if max_new_tokens > self.cfg.max_new_tokens:
      raise ValueError(
        f"eval max_new_tokens={max_new_tokens} exceeds the multi-turn response budget "
        f"task.max_new_tokens={self.cfg.max_new_tokens}; the sampler's context buckets end there."
      )
    env_cfg = self.env_config(_no_reward, max_response_tokens=max_new_tokens)
    episodes, _ = self.run_episodes(params, contexts, [None] * len(contexts), env_cfg, rng, sampler=sampler)
    return [e.final_text for e in episodes]

  def episodes_to_batch(
    self, episodes: Sequence[tool_env.Episode], problems, version: int, rounds: int = 0
  ) -> tuple[Batch, dict]:
    """N episodes (prompt-major) -> the fixed-shape Batch, prompts left-padded to end at column Tp."""
    cfg = self.cfg
    n, tp, t = cfg.batch_size, cfg.max_prompt_len, cfg.max_prompt_len + cfg.max_new_tokens
    if len(episodes) != n:
      raise ValueError(f"got {len(episodes)} episodes for a batch of N = P * G = {n}.")
    fields = record_fields(self.sampler.cfg, self.sampler.routing)
    pe = tool_env.pad_episodes(episodes, length=t, pad_id=self.sampler.cfg.pad_id, record_fields=fields)
    valid = (pe["prompt_mask"] > 0) | (pe["response_mask"] > 0)
    arrays = dict(
      tokens=pe["tokens"],
      valid_mask=valid,
      loss_mask=pe["loss_mask"] > 0,
      behavior_logp=pe["behavior_logp"],
      **{k: pe[k] for k in fields},
    )
    # pad_episodes right-pads; shift each row so the response starts at column Tp, as the sampler
    # lays out single-turn rows. Only padding wraps around: the response is <= T - Tp tokens.
    for i, e in enumerate(episodes):
      shift = tp - e.prompt_len
      for k in arrays:
        arrays[k][i] = np.roll(arrays[k][i], shift, axis=0)
    rewards = pe["rewards"].astype(np.float32)
    batch = Batch.from_arrays(
      dict(
        tokens=arrays["tokens"].astype(np.int32),
        valid_mask=arrays["valid_mask"],
        loss_mask=arrays["loss_mask"],
        behavior_logp=arrays["behavior_logp"].astype(np.float32),
        rewards=rewards,
        correct=np.asarray([tasks.is_correct(r) for r in rewards], np.float32),
        group_id=np.repeat(np.arange(cfg.prompts_per_step, dtype=np.int32), cfg.group_size),
        policy_version=np.full((n,), version, np.int32),
        token_version=np.where(arrays["loss_mask"], version, -1).astype(np.int32),
        **{k: arrays[k][:, tp:] for k in fields},  # records: the response columns only
      )
    )
    resp_len = [len(e.tokens) - e.prompt_len for e in episodes]
    calls = [len(e.tool_kinds) for e in episodes]
    # Scalars a logger can write as they are (the trainer's row keys are its own).
    metrics = {
      "rollout/policy_tokens_mean": float(np.mean([e.loss_mask.sum() for e in episodes])),
      "rollout/turns_mean": float(np.mean([e.num_turns for e in episodes])),
      "rollout/tool_calls_mean": float(np.mean(calls)),
      "rollout/tool_error_frac": float(sum(e.num_tool_errors for e in episodes) / max(sum(calls), 1)),
      "rollout/max_turns_frac": float(np.mean([e.finish_reason == "max_turns" for e in episodes])),
      "rollout/sampler_rounds": float(rounds),
    }
    info = dict(
      texts=[e.response_text for e in episodes],
      problem_ids=[p.id for p in problems],
      response_len_mean=float(np.mean(resp_len)),
      finished_frac=float(np.mean([e.finish_reason == "answer" for e in episodes])),
      metrics=metrics,
    )
    return batch, info
