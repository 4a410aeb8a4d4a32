"""Multi-turn tool-use rollouts: the Batch from a scripted sampler, and the real run() end to end."""

import json
import os

import numpy as np
import pytest

from configs import multiturn as multiturn_config
from tests import fixtures
from vcpo_jax import batch as batch_lib
from vcpo_jax import evaluation
from vcpo_jax import metrics as metrics_lib
from vcpo_jax import run_config, trainer
from vcpo_jax.model.tokenizer import build_char_tokenizer
from vcpo_jax.rollout import common as rollout_common
from vcpo_jax.rollout import multiturn
from vcpo_jax.sampler import SamplerConfig
from vcpo_jax.batch import Batch
from vcpo_jax.tasks import Problem

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
ENC = lambda s: list(TOK.encode(s, add_special_tokens=False))

# Per prompt, the policy text of each model turn (EOS appended to the last one).
PLANS = {
  "Q: six times seven?": ["ok<code>print(6*7)</code>", "so \\boxed{42}"],  # one tool call, then correct
  "Q: three plus four?": ["\\boxed{8}"],  # answers at once, wrong (reference 7)
}
REFS = {"Q: six times seven?": "42", "Q: three plus four?": "7"}


def _logp(tok_id, pos):
  """The fake's behavior log-prob of a token: distinct, so misplaced values are visible."""
  return -0.01 * (tok_id + 1) - 0.001 * pos


class ScriptedSampler:
  """Plays PLANS like the real sampler: stops after EOS, after any stop id, or at the budget.

  routing > 0: records an MoE routing record of that width (SamplerConfig.record_routing) as the real sampler
  lays it out (last_records [n, Tn, E], response column r = continuation token r, -1 on each continuation's
  last token, which it never fed), every entry the token's position in its episode, so a misplaced record shows;
  `lasts` keeps, per prompt, the positions of the continuations' last tokens."""

  def __init__(self, routing: int = 0):
    self.cfg = SamplerConfig(
      eos_id=EOS,
      pad_id=TOK.pad_token_id,
      max_new_tokens=32,
      prompt_buckets=(16, 128),
      new_token_buckets=(32,),
      record_routing=routing > 0,
    )
    self.routing, self.last_records, self.lasts = routing, {}, {}
    self.calls = []

  def generate_continuations(self, params, contexts, max_new, stop_ids, rng):
    del params, rng
    self.calls.append((len(contexts), int(max_new), tuple(stop_ids)))
    out = []
    for ctx in contexts:
      text = TOK.decode(ctx, skip_special_tokens=True)
      prompt = next(p for p in PLANS if text.startswith(p))
      turn = text.count("</output>")
      done = text.rsplit("</output>\n", 1)[1] if turn else text[len(prompt) :]
      plan = PLANS[prompt]
      ids = ENC(plan[turn][len(done) :]) + ([EOS] if turn == len(plan) - 1 else [])
      new = []
      for t in ids[:max_new]:
        new.append(t)
        if t == EOS or t in stop_ids:
          break
      out.append(
        (np.asarray(new, np.int32), np.asarray([_logp(t, len(ctx) + i) for i, t in enumerate(new)], np.float32))
      )
      self.lasts.setdefault(prompt, set()).add(len(ctx) + len(new) - 1)
    if self.routing:
      rec = np.full((len(contexts), max_new, self.routing), -1, np.int16)
      for n, (ctx, (new, _)) in enumerate(zip(contexts, out)):
        rec[n, : len(new) - 1] = (len(ctx) + np.arange(len(new) - 1))[:, None]
      self.last_records = {"expert_ids": rec}
    return out


def _maker(sampler, **mt):
  problems = [Problem(id=f"p{i}", task="aime", prompt=p, reference=REFS[p]) for i, p in enumerate(PLANS)]
  cfg = rollout_common.RolloutConfig(
    task="aime", prompts_per_step=2, group_size=2, max_prompt_len=24, max_new_tokens=72
  )
  mt_cfg = multiturn.MultiTurnConfig(
    **{
      **dict(
        max_turns=3, max_turn_tokens=32, max_tool_output_tokens=16, sandbox_cpu_seconds=1, sandbox_wall_seconds=5.0
      ),
      **mt,
    }
  )
  m = multiturn.MultiTurnRolloutMaker(cfg, mt_cfg, TOK, sampler, problems)
  m.problems_for_step = lambda step: problems  # fixed order: row 2p, 2p + 1 answer problem p
  return m


@pytest.fixture(scope="module")
def scripted():
  sampler = ScriptedSampler()
  maker = _maker(sampler)
  batch, info = maker.make(None, 0, np.zeros((2,), np.uint32), version=5)
  return sampler, maker, batch, info


def test_batch_layout_and_masks(scripted):
  sampler, maker, batch, info = scripted
  n, tp, t = 4, 24, 24 + 72
  # The one Batch (vcpo_jax/batch.py), as the single-turn RolloutMaker makes it: same keys, dtypes, shapes.
  assert isinstance(batch, Batch) and list(batch) == list(batch_lib.FIELDS)
  for k, (dtype, shape) in batch_lib.schema(n, t).items():
    assert batch[k].shape == shape and batch[k].dtype == dtype, k
  assert batch["valid_mask"].dtype == bool and batch["tokens"].dtype == np.int32  # by hand, not only the schema
  assert info["grading_failures"] == 0
  np.testing.assert_array_equal(batch["group_id"], [0, 0, 1, 1])
  np.testing.assert_array_equal(batch["policy_version"], [5, 5, 5, 5])
  # The stop id is the last token of "</code>"; "<code>" also ends in ">", so the env must resume.
  assert all(c[2] == (ENC("</code>")[-1],) for c in sampler.calls)

  for row, prompt in enumerate(p for p in PLANS for _ in range(2)):
    toks, valid, loss = batch["tokens"][row], batch["valid_mask"][row], batch["loss_mask"][row]
    plen = len(ENC(prompt))
    # Prompt left-padded to end at column Tp; valid = prompt + response, contiguous.
    cols = np.flatnonzero(valid)
    assert cols[0] == tp - plen and np.all(np.diff(cols) == 1)
    assert TOK.decode(toks[tp - plen : tp]) == prompt
    assert not loss[:tp].any()  # prompt tokens are never in the loss
    assert not (loss & ~valid).any()
    assert np.all(batch["behavior_logp"][row][~loss] == 0)
    # Rebuild the response piece by piece: policy turns in the loss, tool output out of it.
    plan = PLANS[prompt]
    pieces = []
    for i, text in enumerate(plan):
      ids = ENC(text) + ([EOS] if i == len(plan) - 1 else [])
      pieces.append((ids, True))
      if i < len(plan) - 1:
        pieces.append((ENC("<output>\n42\n</output>\n"), False))
    pos = tp
    for ids, is_policy in pieces:
      np.testing.assert_array_equal(toks[pos : pos + len(ids)], ids)
      assert loss[pos : pos + len(ids)].all() if is_policy else not loss[pos : pos + len(ids)].any()
      if is_policy:  # the sampler's log-probs, at the token they belong to
        want = [_logp(tk, pos - (tp - plen) + j) for j, tk in enumerate(ids)]
        np.testing.assert_allclose(batch["behavior_logp"][row][pos : pos + len(ids)], want, rtol=1e-6)
      pos += len(ids)
    assert cols[-1] == pos - 1  # nothing valid after the episode
    assert loss.sum() == sum(len(ids) for ids, p in pieces if p)
  np.testing.assert_array_equal(batch["rewards"], [1.0, 1.0, 0.0, 0.0])
  np.testing.assert_array_equal(batch["correct"], [1.0, 1.0, 0.0, 0.0])
  m = info["metrics"]
  assert m["rollout/tool_calls_mean"] == 0.5 and m["rollout/tool_error_frac"] == 0.0
  assert m["rollout/turns_mean"] == 1.5 and info["finished_frac"] == 1.0
  # Rounds: "ok<code>" stops on '>' (resumed), the block closes, then the answer turn.
  assert m["rollout/sampler_rounds"] == len(sampler.calls) == 3


def _eval_sampling(maker, built):
  """EvalSampling over tool-use episodes; `built` collects the SamplerConfig of every sampler it builds."""

  def make_sampler(cfg):
    built.append(cfg)
    s = ScriptedSampler()
    s.cfg = cfg
    return s

  return evaluation.EvalSampling(make_sampler, ScriptedSampler().cfg, TOK, episodes=maker.eval_episodes)


def test_routing_record_follows_policy_tokens_across_turns():
  """MoE routing replay in tool use: each policy token's record is the one the sampler call that drew it made
  (as many calls per episode as turns and resumes), -1 on tool tokens and on each call's last token (never fed
  in that call: the learner's own routing there, as on the prompt), over the response columns only."""
  sampler = ScriptedSampler(routing=3)
  batch, _ = _maker(sampler).make(None, 0, np.zeros((2,), np.uint32), version=0)
  tp, r = 24, 72
  assert batch["expert_ids"].shape == (4, r, 3) and batch["expert_ids"].dtype == np.int16
  for row, prompt in enumerate(p for p in PLANS for _ in range(2)):
    start = tp - len(ENC(prompt))  # the episode's position 0 in the row
    loss, rec = batch["loss_mask"][row, tp:], batch["expert_ids"][row]
    pos = np.arange(tp, tp + r) - start  # each response column's position in its episode
    want = np.where(loss & ~np.isin(pos, list(sampler.lasts[prompt])), pos, -1)
    np.testing.assert_array_equal(rec, np.repeat(want[:, None], 3, axis=1))
    assert (rec[~loss] == -1).all() and (rec[loss] >= 0).sum() > 10  # tool tokens unrecorded; policy mostly
  if len(PLANS["Q: six times seven?"]) > 1:  # the tool-call episode resumed: more calls than turns
    assert len(sampler.lasts["Q: six times seven?"]) > 2


def test_smoke_run_moe_routing_replay(tmp_path):
  """configs/multiturn.py:smoke on a tiny Qwen3-MoE with routing replay: the tool-use batch carries the
  sampler's routing record, and at step 0 (the learner's own parameters) it is the learner's own routing
  (mismatch 0; a record shifted by a column would not be) and replay keeps the ratios at 1."""
  c = _smoke_config()
  c.model.preset, c.model.routing_replay = "tiny_qwen3_moe", True
  workdir = str(tmp_path / "mt_moe")
  summary = trainer.run(c, workdir)
  assert summary["step"] == 2 and summary["nonfinite_steps"] == []
  recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/pg_loss" in r]
  assert "train/moe/route_mismatch" in recs[0], sorted(recs[0])
  assert recs[0]["train/moe/route_mismatch"] < 1e-3
  assert recs[0]["train/moe/ess_replay"] == pytest.approx(1.0, abs=1e-4)


def test_eval_generate_returns_final_turns():
  maker, built = _maker(ScriptedSampler()), []
  gen = _eval_sampling(maker, built).generate_fn(None, np.zeros((2,), np.uint32))
  out = gen(list(PLANS), 3, 0.8, 0.7, 72, False)
  assert out == [["so \\boxed{42}"] * 3, ["\\boxed{8}"] * 3]
  # the eval sampler decodes with the settings it was handed; the per-turn budget stays the maker's
  assert [(c.temperature, c.top_p, c.top_k, c.max_new_tokens) for c in built] == [(0.8, 0.7, 0, 32)]
  gen(list(PLANS), 1, 0.8, 0.7, 72, True)  # greedy: a second sampler at temperature 0
  assert [(c.temperature, c.top_p) for c in built] == [(0.8, 0.7), (0.0, 0.7)]


def test_eval_episode_budget_is_the_protocols():
  maker = _maker(ScriptedSampler())
  gen = _eval_sampling(maker, []).generate_fn(None, np.zeros((2,), np.uint32))
  # 12 tokens: "\\boxed{8}" + EOS (10) fits; the other episode is cut inside its first turn
  out = gen(list(PLANS), 1, 0.8, 0.7, 12, False)
  assert out[1] == ["\\boxed{8}"] and "42" not in out[0][0]
  with pytest.raises(ValueError, match="eval max_new_tokens=73"):
    gen(list(PLANS), 1, 0.8, 0.7, 73, False)


def test_turn_limit_and_budget_hold_shapes():
  """max_turns=1: the code block is not executed; the row keeps the fixed shape and loss covers it."""
  maker = _maker(ScriptedSampler(), max_turns=1)
  batch, info = maker.make(None, 0, np.zeros((2,), np.uint32), version=0)
  assert batch["tokens"].shape == (4, 96)
  assert info["metrics"]["rollout/tool_calls_mean"] == 0.0
  assert info["metrics"]["rollout/max_turns_frac"] == 0.5
  row = batch["loss_mask"][0]
  assert row.sum() == len(ENC(PLANS["Q: six times seven?"][0]))
  assert batch["rewards"][0] == 0.0  # the unexecuted turn states no answer


def test_bad_inputs():
  with pytest.raises(ValueError, match="max_turns"):
    multiturn.MultiTurnConfig(max_turns=0)
  with pytest.raises(ValueError, match="max_turn_tokens"):
    _maker(ScriptedSampler(), max_turn_tokens=100)  # > response budget 72


def test_sampler_config_buckets():
  cfg = rollout_common.RolloutConfig(
    task="aime", prompts_per_step=128, group_size=16, max_prompt_len=4096, max_new_tokens=12288
  )
  sc = multiturn.sampler_config(
    SamplerConfig(new_token_buckets=(12288,), max_new_tokens=12288),
    cfg,
    multiturn.MultiTurnConfig(max_turn_tokens=4096),
  )
  assert sc.prompt_buckets == (4096, 8192, 16384) and sc.new_token_buckets == (4096,)
  assert sc.batch_buckets == (128, 512, 2048)


def _smoke_config():
  c = multiturn_config.get_config("smoke")
  c.model.hidden_size = 32  # smaller than the preset: the test only needs the code path
  c.model.intermediate_size = 64
  c.model.num_layers = 1
  return c


def test_config_errors():
  c = _smoke_config()
  c.task.multiturn.max_turn_tokens = 64
  with pytest.raises(run_config.ConfigError, match="task.multiturn.max_turn_tokens"):
    run_config.parse_config(c)
  c = _smoke_config()
  c.task.multiturn.max_turns = 0
  with pytest.raises(run_config.ConfigError, match="task.multiturn"):
    run_config.parse_config(c)
  c = _smoke_config()
  c.task.name, c.task.template = "countdown", ""
  with pytest.raises(run_config.ConfigError, match="task.multiturn.enabled"):
    run_config.parse_config(c)
  spec = run_config.parse_config(_smoke_config())
  assert spec.multiturn.max_turns == 3
  c = _smoke_config()
  c.mode, c.lag.k = "async", 2  # the async sampler process builds tool-use episodes too
  assert run_config.parse_config(c).multiturn == spec.multiturn
  assert spec.model_cfg.max_position >= 240 + 24 + 8  # contexts up to T - 1 plus one turn


def test_smoke_run(tmp_path):
  """configs/multiturn.py:smoke through the real run(): 2 lag steps of tool-use rollouts."""
  workdir = str(tmp_path / "mt")
  summary = trainer.run(_smoke_config(), workdir)
  assert summary["step"] == 2 and summary["nonfinite_steps"] == []
  recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/pg_loss" in r]
  assert [r["step"] for r in recs] == [1, 2]
  # Step 0 is sampled with the learner's own parameters at temperature 1: the behavior log-probs the
  # multi-turn maker records must match the learner's on the loss tokens (ratio 1, ESS ratio 1).
  assert abs(recs[0]["train/log_ratio_max"]) < 1e-3 and abs(recs[0]["train/log_ratio_min"]) < 1e-3
  assert recs[0]["train/ess_ratio"] == pytest.approx(1.0, abs=1e-4)
  assert recs[1]["train/lag_max"] == 1.0
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["task"]["multiturn"]["enabled"] is True


@pytest.mark.slow
def test_smoke_run_async(tmp_path, monkeypatch):
  """configs/multiturn.py:smoke with mode="async", k = 1: the spawned sampler builds tool-use episodes
  (its sandbox runs `python -I -S` subprocesses), rows' versions lie in [step - k, step], and the maker's
  multi-turn metrics travel through the queue's metadata into metrics.jsonl."""
  from vcpo_jax.rollout import async_

  k = 1
  built, seen, _ = fixtures.record_sources(monkeypatch)
  c = _smoke_config()
  c.mode, c.lag.k = "async", k
  c.async_.timeout_s = 120.0  # only a hung sampler reaches it
  workdir = str(tmp_path / "mt_async")
  summary = trainer.run(c, workdir)
  assert summary["step"] == 2 and summary["nonfinite_steps"] == []
  (src,) = built
  assert isinstance(src, async_.AsyncSource) and src.proc.exitcode == 0
  assert [s for s, _, _ in seen] == [0, 1]
  names = (
    "rollout/turns_mean",
    "rollout/tool_calls_mean",
    "rollout/tool_error_frac",
    "rollout/max_turns_frac",
    "rollout/policy_tokens_mean",
    "rollout/sampler_rounds",
  )
  for step, versions, info in seen:
    assert ((step - k <= versions) & (versions <= step)).all(), (step, versions)
    assert set(names) <= set(info["metrics"])
    assert 1.0 <= info["metrics"]["rollout/turns_mean"] <= 3.0  # max_turns = 3
    assert info["metrics"]["rollout/sampler_rounds"] >= 1.0
  recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/pg_loss" in r]
  assert [r["step"] for r in recs] == [1, 2]
  for r, (_, _, info) in zip(recs, seen):
    assert all(r[n] == pytest.approx(info["metrics"][n]) for n in names)
    assert 0 <= r["train/lag_min"] <= r["train/lag_max"] <= k


def _sandbox_in_sampler_like_process(conn):
  """Spawn target: the async worker's process setup (SIGINT ignored, parent-death signal, JAX loaded),
  then the sandbox runs snippets in `python -I -S` children, as MultiTurnRolloutMaker does there."""
  import signal

  import jax.numpy as jnp

  from vcpo_jax.rollout.process import worker
  from vcpo_jax.tasks import sandbox

  signal.signal(signal.SIGINT, signal.SIG_IGN)
  worker._set_parent_death_signal()
  jnp.ones(2).block_until_ready()  # a live XLA client with its threads, as in the worker
  cfg = sandbox.SandboxConfig(cpu_seconds=1, wall_seconds=3.0)
  res = sandbox.run_many(["print(6 * 7)", "while True:\n  pass", "import socket"], cfg, max_workers=2)
  conn.send([(r.kind, r.stdout) for r in res])
  conn.close()


@pytest.mark.slow
def test_sandbox_runs_from_a_spawned_sampler_process():
  from vcpo_jax.rollout.process.shm_queue import SPAWN

  parent, child = SPAWN.Pipe(duplex=False)
  proc = SPAWN.Process(target=_sandbox_in_sampler_like_process, args=(child,), daemon=False)
  proc.start()
  child.close()
  try:
    assert parent.poll(120), "the spawned process sent no sandbox results"
    (ok, ok_out), (loop, _), (imp, _) = parent.recv()
  finally:
    proc.join(30)
    if proc.exitcode is None:
      proc.kill()
      proc.join()
  assert proc.exitcode == 0
  assert ok == "ok" and ok_out.strip() == "42"
  assert loop == "timeout" and imp == "forbidden"  # limits and the import hook hold there too
