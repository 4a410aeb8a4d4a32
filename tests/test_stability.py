"""Tests of the pure exact-lag run (pure_lag.py) and the stability study's bookkeeping (stability.py)."""

import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import fixtures
from vcpo_jax import estimator, run_config, trainer
from vcpo_jax import metrics as metrics_lib
from vcpo_jax.experiments import legacy_method
from vcpo_jax.experiments import pure_lag as pl
from vcpo_jax.experiments import stability as st
from vcpo_jax.experiments import tuning
from vcpo_jax.model import transformer
from vcpo_jax.rl import choices, losses

CFG = pl.PureLagConfig(
  alphabet=4,
  max_stride=2,
  resp_len=4,
  prompts_per_step=2,
  group_size=4,
  steps=6,
  eval_every=3,
  eval_samples=1,
  hidden=16,
  layers=1,
  heads=2,
  mlp=16,
  debug_trace=True,
)
MAX_K = 2


@pytest.fixture(scope="module")
def run():
  # One compile (k is traced) shared by every pure_lag test; vcpo exercises OPOB and the ESS rate.
  return jax.jit(pl.make_run_fn(CFG, estimator.method_from_preset("vcpo"), MAX_K))


@pytest.fixture(scope="module")
def runs(run):
  key = jax.random.key(7)
  return {k: jax.device_get(run(key, jnp.float32(3e-2), k)) for k in (0, MAX_K)}


def test_reward_hand_computed():
  # alphabet 4, stride token 4 + s - 1; position t correct iff y_t == (y_{t-1} + s) % 4, y_{-1} = a.
  prompt = jnp.array([[1, 5], [1, 5], [0, 4], [3, 4]])  # (a=1, s=2), (a=1, s=2), (a=0, s=1), (a=3, s=1)
  resp = jnp.array(
    [
      [3, 1, 3, 1],  # all correct
      [3, 0, 2, 5],  # 3 ok; 0 != 1; 2 == (0+2)%4 ok; 5 is a stride token: wrong
      [1, 2, 3, 0],  # all correct (wraps)
      [1, 1, 2, 3],
    ]
  )  # 0 wanted; 1 != 2; 2 ok; 3 ok
  np.testing.assert_allclose(pl.reward(CFG, prompt, resp), [1.0, 0.5, 1.0, 0.5])
  assert CFG.vocab == 6 and CFG.num_prompts == 8 and CFG.chance == pytest.approx(1 / 6)


def test_sync_on_policy_has_unit_ess_and_zero_lag(runs):
  out = runs[0]
  np.testing.assert_array_equal(out["version"], np.arange(CFG.steps))
  # On-policy: learner and sampler log-probs agree up to float error (cache vs full forward).
  np.testing.assert_allclose(out["ess_ratio"], 1.0, atol=1e-4)
  np.testing.assert_allclose(out["lr_scale"], 1.0, atol=1e-4)
  assert np.abs(out["log_ratio_max"]).max() < 1e-3
  assert out["accuracy"].shape == (CFG.steps // CFG.eval_every,)
  np.testing.assert_array_equal(out["eval_step"], [3, 6])


def _version_params(key, trace_params, v):
  """Parameters of version v: v = 0 is the init, v >= 1 the params after step v - 1's update."""
  if v == 0:
    return pl.init_params(CFG, jax.random.split(key, 3)[0])
  return jax.tree.map(lambda x: x[v - 1], trace_params)


def test_lag_batch_sampled_with_params_of_step_t_minus_k(runs):
  out, k, key = runs[MAX_K], MAX_K, jax.random.key(7)
  np.testing.assert_array_equal(out["version"], np.maximum(np.arange(CFG.steps) - k, 0))
  graphdef = pl._graphdef(CFG)
  score = jax.jit(lambda p, tok, val: transformer.sequence_logprobs(graphdef, p, tok, val))
  valid = jnp.ones(out["tokens"].shape[1:], bool)
  for t in range(CFG.steps):
    v = max(0, t - k)
    tokens = jnp.asarray(out["tokens"][t])
    lp = score(_version_params(key, out["params"], v), tokens, valid)
    np.testing.assert_allclose(
      np.asarray(lp)[:, 2:],
      out["behavior_logp"][t][:, 2:],
      atol=2e-5,
      err_msg=f"step {t}: behavior log-probs are not version {v}'s",
    )
    if t >= k:  # and not the next version's (the params do change every step)
      lp_next = score(_version_params(key, out["params"], v + 1), tokens, valid)
      assert np.abs(np.asarray(lp_next)[:, 2:] - out["behavior_logp"][t][:, 2:]).max() > 1e-3
  # Stale data: the ratios are no longer 1 once the lag is real.
  assert out["ess_ratio"][k:].min() < 0.999


def test_run_is_deterministic_for_a_key(run, runs):
  again = jax.device_get(run(jax.random.key(7), jnp.float32(3e-2), 0))
  for name in ("accuracy", "reward", "ess_ratio", "grad_norm", "tokens"):
    np.testing.assert_array_equal(again[name], runs[0][name])
  other = jax.device_get(run(jax.random.key(8), jnp.float32(3e-2), 0))
  assert not np.array_equal(other["tokens"], runs[0]["tokens"])


def test_config_errors():
  with pytest.raises(ValueError, match="eval_every"):
    pl.PureLagConfig(steps=10, eval_every=3)
  with pytest.raises(ValueError, match="grad_path"):
    pl.PureLagConfig(grad_path="loop")
  with pytest.raises(ValueError, match="max_k"):
    pl.run_grid(CFG, estimator.method_from_preset("none"), 3, [0], [1e-2], max_k=2)


# ----------------------------------------------------------------------------- bookkeeping


def test_resume_skips_finished_cells(tmp_path):
  calls = []

  def cell_fn(method, k):
    calls.append((method, k))
    return dict(accuracy=np.full((1, 1, 2), float(k)))

  cells = [("none", 0), ("none", 8), ("vcpo", 0)]
  assert st.run_cells(cells[:2], tmp_path, "pure_lag", "fp1", cell_fn, log=lambda s: None) == cells[:2]
  # "Interrupted" after two cells: the rerun does only the third.
  assert st.run_cells(cells, tmp_path, "pure_lag", "fp1", cell_fn, log=lambda s: None) == [("vcpo", 0)]
  assert calls == cells
  z = st.load_cell(st.cell_path(tmp_path, "pure_lag", "none", 8), "fp1")
  np.testing.assert_array_equal(z["accuracy"], np.full((1, 1, 2), 8.0))
  # Other settings (fingerprint) or a torn file: the cell runs again.
  assert st.load_cell(st.cell_path(tmp_path, "pure_lag", "none", 8), "fp2") is None
  st.cell_path(tmp_path, "pure_lag", "vcpo", 0).write_bytes(b"torn")
  assert st.run_cells(cells, tmp_path, "pure_lag", "fp1", cell_fn, log=lambda s: None) == [("vcpo", 0)]


def test_cell_compute_seconds_sums_the_runs_own_times():
  # The runs' own times, when every run recorded one (a cell rebuilt from the ledger in 0.1 s cost 30 s) ...
  assert st.cell_compute_seconds(dict(seconds=np.asarray(0.1), run_s=np.array([[10.0, 20.0]]))) == 30.0
  # ... else the time the cell took to build (the pure_lag backend; runs from before run_s was recorded).
  assert st.cell_compute_seconds(dict(seconds=np.asarray(7.0))) == 7.0
  assert st.cell_compute_seconds(dict(seconds=np.asarray(7.0), run_s=np.array([[10.0, np.nan]]))) == 7.0


def test_final_and_collapse_hand_made_curves():
  steps = np.arange(1, 11) * 10  # evaluations at 10..100
  rising = np.linspace(0.1, 0.9, 10)
  crash = np.array([0.1, 0.4, 0.7, 0.8, 0.6, 0.3, 0.2, 0.15, 0.1, 0.1])
  # last 10% of 100 steps: only the evaluation at 100 (step > 90); 20%: steps 90 and 100.
  np.testing.assert_allclose(st.final_value(np.stack([rising, crash]), steps, 100, 0.1), [0.9, 0.1])
  np.testing.assert_allclose(st.final_value(crash, steps, 100, 0.2), 0.1)
  chance = 0.1
  # rising: final 0.9 = best: fine. crash: best 0.8 (gain 0.7), final 0.1 (gain 0) < 0.35: collapsed.
  # flat at chance: best gain 0.02 < min_gain: never learned, not collapsed. below chance: collapsed.
  flat = np.full(10, 0.1) + np.r_[0.02, np.zeros(9)]
  fin = [0.9, 0.1, 0.1, 0.05]
  best = [0.9, 0.8, 0.12, 0.3]
  np.testing.assert_array_equal(st.collapsed(fin, best, chance, 0.5, 0.1), [False, True, False, True])
  # collapse step: line = 0.1 + 0.5 * 0.7 = 0.45; after the best (step 40) 0.6 is above, 0.3 at step 60
  # is below and stays below.
  assert st.collapse_step(crash, steps, chance, 0.5) == 60.0
  # a dip that recovers is not the collapse step
  dip = np.array([0.1, 0.8, 0.2, 0.7, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1])
  assert st.collapse_step(dip, steps, chance, 0.5) == 50.0
  assert math.isnan(st.collapse_step(rising, steps, chance, 0.5))
  del flat


def test_alarm_and_lead_time_hand_made():
  np.testing.assert_allclose(st.trailing_median(np.array([1.0, 0.2, 0.3, 0.9, 0.1]), 3), [1.0, 0.6, 0.3, 0.3, 0.3])
  ess = np.array([1.0, 1.0, 0.2, 0.2, 0.2, 1.0, 1.0, 1.0])
  # window 3: medians 1, 1, 1, .2 (index 3) -> 1-based step 4
  assert st.alarm_step(ess, 0.25, 3) == 4.0
  assert math.isnan(st.alarm_step(np.ones(8), 0.25, 3))
  steps = np.array([4, 8])
  acc = np.array(
    [
      [0.9, 0.1],  # collapsed at step 8; its ESS alarm fires at 4: lead 4
      [0.9, 0.1],  # collapsed, ESS always 1: missed
      [0.5, 0.9],  # fine, with an alarm: false alarm
      [0.5, 0.9],
    ]
  )  # fine, no alarm
  ess_runs = np.stack([ess, np.ones(8), ess, np.ones(8)])
  r = st.ess_predictor(ess_runs, acc, steps, 0.1, 0.5, 0.1, 0.1, 8, 0.25, 3)
  assert r["n_collapsed"] == 2 and r["n_missed"] == 1 and r["n_ok"] == 2 and r["n_false_alarm"] == 1
  assert r["n_no_step"] == 0
  assert r["lead_times"][0] == 4.0 and math.isnan(r["lead_times"][1])
  assert r["false_alarm_rate"] == 0.5


def test_auc_hand_computed():
  # pairs (pos < neg): 0.1 < {0.3, 0.5}: 2; 0.3 < 0.5: 1, 0.3 == 0.3: 1/2 -> 3.5 / 4
  assert st.auc_lower_predicts([0.1, 0.3], [0.3, 0.5]) == pytest.approx(3.5 / 4)
  assert math.isnan(st.auc_lower_predicts([], [0.3]))


def test_select_lr_rule():
  assert st.select_lr({1e-3: 0.5, 1e-2: 0.7, 3e-2: 0.6}) == 1e-2
  assert st.select_lr({3e-2: 0.7, 1e-2: 0.7}) == 1e-2  # ties: the smaller lr


# ----------------------------------------------------------------------------- the trainer backend


@pytest.mark.slow
def test_trainer_backend_end_to_end_tunes_and_resumes_per_run(tmp_path):
  """configs/stability.py:countdown_quick through run_study: tuning stage, grid, report, run-level resume,
  and the same metrics from cache-loaded programs as from freshly compiled ones."""
  c = st.load_config(
    "countdown_quick", {"trainer.runs": str(tmp_path / "runs"), "trainer.ledger": str(tmp_path / "ledger")}
  )
  c.methods, c.ks = ("vcpo",), (0, 2)
  c.tuning.knobs, c.tuning.trials = {"vcpo": ("rho_on", (0.5,))}, 1  # one trial: the selection is tested below
  assert c.backend == "trainer" and st.chance(c) == 0.0 and st.batch_size(c) == 8
  logs = []
  out = tmp_path / "out"
  knob = ("rho_on", 0.5)
  # run_study turns the cache on in runs/jax_cache; the fixture turns it off again afterwards. The tuning
  # trial (k = 2) compiles; the grid's k = 0 and k = 2 runs load its programs.
  with fixtures.persistent_compilation_cache(tmp_path / "runs" / "jax_cache"):
    st.run_study(c, out, c.methods, log=logs.append)
  wd_tune = st.run_dir(c, "vcpo", 2, 3e-4, 100, knob, "tune")
  assert (wd_tune / "summary.json").exists() and any("tuning vcpo" in s for s in logs)
  assert st.chosen_knob(c, out, "vcpo") == knob
  fp = st.cell_fingerprint(c, out)("vcpo")
  assert fp != st.fingerprint(st.settings(c))  # the chosen knob is part of the cell's fingerprint
  z = st.load_cell(st.cell_path(out, "trainer", "vcpo", 2), fp)
  steps = c.task.steps
  assert z["accuracy"].shape == (1, 1, 2) and z["eval_step"][0, 0].tolist() == [0, steps]
  assert z["ess_ratio"].shape == z["lr_scale"].shape == z["learn_s"].shape == (1, 1, steps)
  assert ((z["ess_ratio"] > 0) & (z["ess_ratio"] <= 1 + 1e-6)).all() and (z["run_s"] > 0).all()
  # k = 0 is the synchronous reference: ratios are 1 up to sampler/learner numerics.
  np.testing.assert_allclose(st.load_cell(st.cell_path(out, "trainer", "vcpo", 0), fp)["ess_ratio"], 1.0, atol=1e-4)
  wd = st.run_dir(c, "vcpo", 2, c.lrs[0], c.seeds[0], knob)
  assert wd.name == "vcpo_rho_on0.5_k2_lr0.0003_seed0"
  assert (wd / "summary.json").exists() and not (wd / "checkpoints").exists()
  assert json.loads((wd / "config.json").read_text())["method"]["lr"]["rho_on"] == 0.5
  # The same run without the cache (every program compiled afresh) logs the same numbers.
  fresh = tmp_path / "fresh"
  trainer.run(st.trainer_run_config(c, "vcpo", 2, c.seeds[0], c.lrs[0], knob), str(fresh))
  strip = lambda d: [
    {k: v for k, v in r.items() if not k.startswith("time/") and k != "wall_time"}
    for r in metrics_lib.read_jsonl(str(d / "metrics.jsonl"))
  ]
  assert strip(fresh) == strip(wd)
  # A lost cell file with its runs on disk: the cell is rebuilt from metrics.jsonl without training again.
  st.cell_path(out, "trainer", "vcpo", 2).unlink()
  n_runs = sum(s.startswith("  run ") for s in logs)
  assert n_runs == 3
  st.run_study(c, out, c.methods, log=logs.append)
  assert sum(s.startswith("  run ") for s in logs) == n_runs
  assert any(s.startswith("[skip] tuning vcpo") for s in logs)
  np.testing.assert_array_equal(st.load_cell(st.cell_path(out, "trainer", "vcpo", 2), fp)["accuracy"], z["accuracy"])
  # A reset machine: run directories and cells gone, only the ledger (kept in git) left. Nothing trains
  # again and the cells come back equal; a record is reused only under its own run's fingerprint.
  rec = st.record_path(c, "vcpo", 2, c.lrs[0], c.seeds[0], knob)
  assert rec == tmp_path / "ledger" / "vcpo_rho_on0.5_k2_lr0.0003_seed0.npz" and rec.exists()
  assert (tmp_path / "ledger" / "tune" / (wd_tune.name + ".npz")).exists()
  assert st.load_cell(rec, st.run_fingerprint(c, "vcpo", 2, c.seeds[0], c.lrs[0], knob)) is not None
  assert st.load_cell(rec, st.run_fingerprint(c, "vcpo", 2, c.seeds[0], c.lrs[0], ("rho_on", 1.0))) is None
  for d in (tmp_path / "runs").iterdir():
    if d.name != "jax_cache":
      shutil.rmtree(d)
  shutil.rmtree(out / "stability_raw")
  st.run_study(c, out, c.methods, log=logs.append)
  assert sum(s.startswith("  run ") for s in logs) == n_runs
  np.testing.assert_array_equal(st.load_cell(st.cell_path(out, "trainer", "vcpo", 2), fp)["accuracy"], z["accuracy"])
  np.testing.assert_array_equal(st.load_cell(st.cell_path(out, "trainer", "vcpo", 2), fp)["run_s"], z["run_s"])
  summary = st.summarize(c, out)
  assert set(summary["stats"]) == {("vcpo", 0, c.lrs[0]), ("vcpo", 2, c.lrs[0])}
  # The rebuilt cells took ~0 s to build; the compute the report quotes is what their runs took.
  rebuilt = summary["cells"][("vcpo", 2)]
  assert float(rebuilt["seconds"]) < float(rebuilt["run_s"].sum())
  assert st.cell_compute_seconds(rebuilt) == pytest.approx(float(z["run_s"].sum()))
  assert summary["knobs"] == {"vcpo": knob} and set(summary["trials"]) == {"vcpo"}
  path = st.write_report(c, out, summary, None, "cmd")
  text = path.read_text()
  assert path.name == "stability_countdown.md" and "backend: `trainer`" in text
  assert "## Equal tuning budget" in text and "| vcpo (rho_on = 0.5) | 0.0003 | 2 |" in text
  assert "## Wall time per method" in text
  names = st.plot(c, summary, out)
  assert {"stability_countdown_accuracy_grid.png", "stability_countdown_tuning.png"} <= set(names)
  assert "stability_countdown_time.png" in names
  for name in names:
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({name})" in text


def test_read_run_rejects_incomplete_metrics(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
    '{"step": 0, "eval/accuracy": 0.5}\n{"step": 1, "train/pg_loss": 0.0, "train/ess_ratio": 1.0}\n'
  )
  with pytest.raises(ValueError, match="expected 1..2"):
    st.read_run(tmp_path, steps=2)


def test_read_run_keeps_the_drift_diagnostics_and_stacking_keeps_the_common_keys(tmp_path):
  """A centered run's per-step drift rows become drift_* arrays of its record; records made before them (or of
  an uncentered method) lack them, and stack_runs keeps only the keys every run has."""
  rows = ['{"step": 0, "eval/accuracy": 0.5}']
  for t, (l1, k1) in enumerate([(0.1, 0.01), (0.3, 0.02)], start=1):
    rows.append(
      json.dumps(
        {
          "step": t,
          "train/pg_loss": 0.0,
          "train/ess_ratio": 1.0,
          "train/ess_ratio_applied": 1.0,
          "train/lr_scale": 1.0,
          "train/grad_norm": 1.0,
          "time/learn_s": 0.1,
          "time/rollout_s": 0.1,
          "train/drift/coef_l1": l1,
          "train/drift/k1_kl_qp": k1,
          "train/log_mean_weight": -3.0 * t,
        }
      )
    )
  (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
  prov = {"git": {"commit": "ab" * 20, "dirty": True}, "cpu_model": "Fake CPU"}
  (tmp_path / "config.json").write_text(json.dumps({"seed": 0, "provenance": prov}))
  z = st.read_run(tmp_path, steps=2)
  np.testing.assert_array_equal(z["log_mean_weight"], [-3.0, -6.0])  # the collapse signal ESS / N misses
  assert "log_ratio_mean" not in z  # a signal the run did not log is left out, as the drift rows
  assert str(z["commit"]) == "ab" * 20 + "+dirty" and str(z["machine"]) == "Fake CPU"
  np.testing.assert_array_equal(z["drift_coef_l1"], [0.1, 0.3])
  np.testing.assert_array_equal(z["drift_k1_kl_qp"], [0.01, 0.02])
  assert "drift_q_head_mass" not in z  # exact centering logs no head masses
  older = {k: v for k, v in z.items() if not k.startswith("drift_") and k not in ("log_mean_weight", "commit")}
  both = tuning.stack_runs([z, older])
  assert set(both) == set(older) and both["accuracy"].shape == (2, 1)


def test_committed_ledger_records_keep_their_fingerprints(monkeypatch):
  """The study's records in git are reused only under their run's fingerprint: a config field added since they
  were made (not in st.LEDGER_FIELDS) is left out at its old value, else every record would train again."""
  c = st.load_config("countdown")
  ledger = Path(__file__).resolve().parents[1] / "docs" / "results" / "stability_ledger" / "countdown"
  for method, k, lr, seed in [("none", 0, 3e-4, 0), ("none", 8, 1e-3, 4)]:
    rec = ledger / f"{method}_k{k}_lr{lr:g}_seed{seed}.npz"
    with np.load(rec) as z:
      assert str(z["fingerprint"]) == st.run_fingerprint(c, method, k, seed, lr)
  # runs with a tuned knob: the method's fields were flat vcpo.* names then (experiments/legacy_method.py)
  claim = st.load_config("claim")
  for cfg, method, knob, k, seed, lr in [
    (claim, "ppo_clip", ("eps", 0.28), 8, 1, 2e-4),  # a peer loss's hyper-parameters: one policy_loss_kw text
    (claim, "seq_tis", ("tis_c", 4.0), 32, 1, 2e-4),  # tis's c: tis_c
    (c, "token_tis", ("token_tis_c", 8.0), 32, 0, 3e-4),  # token_tis's c: token_tis_c
    (c, "clip", ("clip_c", 8.0), 32, 0, 3e-4),  # clip's lower, upper: clip_lower, clip_upper
    (c, "vcpo_tis_ess", ("tis_ess_target", 0.5), 32, 0, 3e-4),  # tis_ess's target
    (c, "gspo", ("gspo_eps_x", 4.0), 32, 0, 3e-4),  # products written at %g
    (c, "icepop", ("icepop_interval", (0.1, 10.0)), 32, 0, 3e-4),  # a pair of floats
  ]:
    name = f"{method}_{knob[0]}{tuning.value_str(knob[1])}_k{k}_lr{lr:g}_seed{seed}.npz"
    with np.load(ledger.parent / Path(cfg.trainer.ledger).name / name) as z:
      assert str(z["fingerprint"]) == st.run_fingerprint(cfg, method, k, seed, lr, knob), name
  # A field added since the records (model.lora_rank) is in the run config; at its old value (its default) it is
  # left out, at any other it counts; so does one whose default has changed since (OLD_VALUES) at its old value.
  assert "model.lora_rank" not in st.LEDGER_FIELDS and "model.preset" in st.LEDGER_FIELDS
  assert set(st.OLD_VALUES) == {"async_.publish_buffers", "async_.publish_checksum"}
  assert json.loads(st.trainer_run_config(c, "none", 0, 0, 3e-4).to_json())["model"]["lora_rank"] == 0
  fp = st.run_fingerprint(c, "none", 0, 0, 3e-4)
  assert _fingerprint_with(monkeypatch, c, model__lora_rank=8) != fp
  assert _fingerprint_with(monkeypatch, c, model__lora_rank=0) == fp
  cfg = dict(mode="async", async___publish_buffers=0, async___publish_checksum="background")  # the old values
  fp = _fingerprint_with(monkeypatch, c, **cfg)
  assert _fingerprint_with(monkeypatch, c, **dict(cfg, async___publish_buffers=1)) != fp  # today's default
  assert _fingerprint_with(monkeypatch, c, **dict(cfg, async___publish_checksum="true")) != fp


def _fingerprint_with(monkeypatch, c, **fields):
  """st.run_fingerprint(c, "none", 0, 0, 3e-4) of its run config with `fields` set (a__b: a.b; async___x: async_.x)."""
  real = st.trainer_run_config

  def changed(*a, **kw):
    cfg = real(*a, **kw)
    for key, value in fields.items():
      *parents, leaf = key.replace("async___", "async_.").replace("__", ".").split(".")
      node = cfg
      for name in parents:
        node = node[name]
      node[leaf] = value
    return cfg

  with monkeypatch.context() as m:
    m.setattr(st, "trainer_run_config", changed)
    return st.run_fingerprint(c, "none", 0, 0, 3e-4)


def test_a_new_config_field_needs_no_list_to_keep_the_ledgers_fingerprints(monkeypatch):
  """A field added to the run config's tree (here sampler.fake_knob = 3, patched in) keeps every run's fingerprint
  at its default, the old behaviour by convention, and changes it at any other value; nothing lists it."""
  from configs import common
  from vcpo_jax import run_spec, sampler, schema

  c = st.load_config("countdown")
  rec = Path(__file__).resolve().parents[1] / "docs/results/stability_ledger/countdown/none_k0_lr0.0003_seed0.npz"
  with np.load(rec) as z:
    stored = str(z["fingerprint"])
  assert st.run_fingerprint(c, "none", 0, 0, 3e-4) == stored
  knob = dataclasses.field(default=3)
  sampling = dataclasses.make_dataclass(
    "SamplingConfig", [("fake_knob", int, knob)], bases=(sampler.SamplingConfig,), frozen=True
  )
  tree = dataclasses.make_dataclass(
    "RunConfig", [("sampler", sampling, schema.section(sampling))], bases=(run_spec.RunConfig,), frozen=True
  )
  monkeypatch.setattr(run_spec, "RunConfig", tree)
  monkeypatch.setattr(common, "RunConfig", tree)
  assert json.loads(st.trainer_run_config(c, "none", 0, 0, 3e-4).to_json())["sampler"]["fake_knob"] == 3
  assert "sampler.fake_knob" not in st.LEDGER_FIELDS
  assert st.run_fingerprint(c, "none", 0, 0, 3e-4) == stored
  assert _fingerprint_with(monkeypatch, c, sampler__fake_knob=4) != stored
  assert _fingerprint_with(monkeypatch, c, sampler__fake_knob=3) == stored


def test_countdown_study_config_matches_issue():
  c = st.load_config("countdown")
  assert c.backend == "trainer" and c.ks == (0, 8, 32, 128) and c.seeds == (0, 1, 2, 3, 4) and c.lrs == (3e-4, 1e-3)
  old = {
    "none",
    "seq_tis",
    "clip",
    "mask",
    "token_tis",
    "vcpo",
    "vcpo_no_esslr",
    "vcpo_no_opob",
    "vcpo_applied_opob",
    "vcpo_loo_opob",
  }
  new = {
    "ppo_clip",
    "decoupled_ppo",
    "gspo",
    "cispo",
    "m2po_paper",
    "m2po_released",
    "icepop",
    "dppo_tv",
    "vcpo_tis_ess",
  }
  assert set(c.methods) == old | new and len(c.methods) == 19
  rc = st.trainer_run_config(c, "vcpo", 8, 1, 1e-3)
  assert (rc.mode, rc.lag.k, rc.seed, rc.optim.lr, rc.steps) == ("lag", 8, 1, 1e-3, c.task.steps)
  assert st.trainer_run_config(c, "vcpo", 0, 1, 1e-3).mode == "sync"
  # The equal budget: every method with a knob has the same number of trials, tuned on seeds outside the report.
  assert c.tuning.enabled and not set(c.tuning.seeds) & set(c.seeds)
  for m in c.methods:
    spec = tuning.knob_of(c, m)
    assert (spec is None) == (m == "none")
    if spec is not None:
      assert len(spec[1]) == c.tuning.trials == 4
  # Policy-loss presets run 1 x 2 updates per step (the trust region acts), the others one update.
  rc = st.trainer_run_config(c, "ppo_clip", 8, 1, 1e-3, ("eps", 0.28))
  assert (rc.learner.ppo_epochs, rc.learner.minibatches) == (1, 2)
  assert (rc.method.loss.name, rc.method.loss.eps_low, rc.method.loss.eps_high) == ("ppo_clip", 0.28, 0.28)
  assert run_config.parse_config(rc).learner.method.loss == losses.ppo_clip(eps_low=0.28, eps_high=0.28)
  rc = st.trainer_run_config(c, "vcpo", 8, 1, 1e-3, ("rho_on", 0.5))
  assert (rc.learner.minibatches, rc.method.lr.rho_on) == (1, 0.5)


def test_the_ledgers_flat_names_of_a_runs_method_hand_checked():
  """legacy_method: the method.* overrides of a study run written as the flat names the ledger's records hold."""
  f = legacy_method.flat_overrides
  m = estimator.method_from_preset
  assert f(m("seq_tis"), [("method.weights.c", 4.0)]) == {"tis_c": 4.0}
  assert f(m("tis_sc"), [("method.weights.c", 1.5)]) == {"token_tis_c": 1.5}
  assert f(m("clip"), [("method.weights.lower", 0.25), ("method.weights.upper", 4.0)]) == {
    "clip_lower": 0.25,
    "clip_upper": 4.0,
  }
  assert f(m("vcpo"), [("method.lr.rho_on", 0.5), ("method.loss.sc_topk", 8)]) == {"rho_on": 0.5, "sc_topk": 8}
  ppo = [("method.loss.eps_low", 0.28), ("method.loss.eps_high", 0.28)]
  assert f(m("ppo_clip"), ppo) == {"policy_loss_kw": "eps_low=0.28,eps_high=0.28"}
  kpop = [("method.loss.phi", 0.05), ("method.loss.normalizer", "loss_tokens")]
  assert f(m("kpop"), kpop) == {"policy_loss_kw": "phi=0.05,normalizer=loss_tokens"}
  run = {"method": choices.tree(m("seq_tis", {"weights.c": 4.0})).to_dict(), "seed": 0}
  old = legacy_method.run_config(run, "seq_tis", [("method.weights.c", 4.0)])
  assert old["method"] == "seq_tis" and old["seed"] == 0 and len(old["vcpo"]) == 31
  assert {k: v for k, v in old["vcpo"].items() if v is not None} == {"tis_c": 4.0}
  with pytest.raises(ValueError, match="is not preset 'seq_tis'"):
    legacy_method.run_config(run, "seq_tis", [])  # its tree says c = 4: the old form must say it too


def test_the_ledgers_flat_names_file_missing_is_one_clear_error(monkeypatch, tmp_path):
  """The old names are the ledger's data (legacy_method.NAMES_FILE): without it the error names the file."""
  names = legacy_method.names()
  assert len(names["flat_names"]) == 31 and names["peer_loss_text"] == "policy_loss_kw"
  monkeypatch.setattr(legacy_method, "NAMES_FILE", tmp_path / "legacy_method_names.json")
  legacy_method.names.cache_clear()
  try:
    with pytest.raises(FileNotFoundError, match="legacy_method_names.json is missing"):
      legacy_method.flat_overrides(estimator.method_from_preset("seq_tis"), [("method.weights.c", 4.0)])
  finally:
    legacy_method.names.cache_clear()


def test_knob_overrides_hand_checked():
  assert tuning.knob_overrides("clip_c", 4.0) == {"method.weights.lower": 0.25, "method.weights.upper": 4.0}
  assert tuning.knob_overrides("mask_c", 2.0) == {"method.weights.lower": 0.5, "method.weights.upper": 2.0}
  assert tuning.knob_overrides("gspo_eps_x", 3.0) == {"method.loss.eps_low": 0.0009, "method.loss.eps_high": 0.0012}
  assert 4e-4 * 3.0 != 0.0012  # the %g rounding the records' values went through is kept
  assert tuning.knob_overrides("icepop_interval", (0.2, 5.0)) == {"method.loss.lower": 0.2, "method.loss.upper": 5.0}
  assert tuning.knob_overrides("tv", 0.3) == {"method.loss.mask_low": 0.3, "method.loss.mask_high": 0.3}
  assert tuning.knob_overrides("budget", 0.04) == {"method.loss.budget": 0.04}
  assert tuning.knob_overrides("ipo_threshold", 0.2) == {"method.loss.ipo_threshold": 0.2}
  assert tuning.knob_overrides("kpop_phi", 0.05) == {"method.loss.phi": 0.05, "method.loss.normalizer": "loss_tokens"}
  assert tuning.value_str((0.5, 5.0)) == "0.5-5" and tuning.value_str(8.0) == "8" and tuning.value_str(None) == "-"
  with pytest.raises(ValueError, match="tuning knob 'eps_lo'"):
    tuning.knob_overrides("eps_lo", 0.1)


def test_tuning_selects_each_methods_best_value_on_fake_runs():
  """run_trials + chosen on hand-made runs: final = mean of the evaluations in the last 20% of steps."""
  c = st.load_config("countdown_quick")
  c.tuning.knobs, c.tuning.trials = {"none": None, "vcpo": ("rho_on", (0.25, 0.5, 1.0)), "ppo_clip": None}, 3
  c.tuning.seeds, c.tuning.cells = (100, 101), ((2, 3e-4), (8, 1e-3))
  c.task.steps, c.task.eval_every = 10, 5  # evaluations at 0, 5, 10; final = the one at step 10
  # final accuracy of (rho_on, k, seed): rho_on 0.5 is best on average (0.6) although 1.0 wins one run.
  table = {0.25: [0.2, 0.3, 0.2, 0.3], 0.5: [0.6, 0.6, 0.5, 0.7], 1.0: [0.9, 0.1, 0.1, 0.1]}
  calls = []

  def run_fn(method, k, seed, lr, knob):
    calls.append((method, k, seed, lr, knob))
    i = [(2, 100), (2, 101), (8, 100), (8, 101)].index((k, seed))
    fin = table[knob[1]][i] if knob else 0.4
    return dict(accuracy=np.array([0.0, 0.5, fin]), eval_step=np.array([0, 5, 10]), ess_ratio=np.ones(10))

  z = tuning.run_trials(c, "vcpo", run_fn)
  assert z["accuracy"].shape == (3, 2, 2, 3) and z["values"].tolist() == ["0.25", "0.5", "1"]
  assert len(calls) == 12 and {x[3] for x in calls} == {3e-4, 1e-3}
  np.testing.assert_allclose(tuning.scores(z, st._final(c)), [0.25, 0.6, 0.3])
  assert tuning.chosen(c, z, "vcpo", st._final(c)) == ("rho_on", 0.5)
  assert tuning.chosen(c, None, "none", st._final(c)) is None  # no knob: nothing to choose
  with pytest.raises(LookupError, match="not finished"):
    tuning.chosen(c, None, "vcpo", st._final(c))
  zn = tuning.run_trials(c, "none", run_fn)  # a method without a knob runs once per cell and seed
  assert zn["accuracy"].shape == (1, 2, 2, 3) and zn["values"].tolist() == ["-"]
  # ties and nan go to the value listed first
  assert tuning.select([1, 2, 3], [0.5, 0.7, 0.7]) == 1 and tuning.select([1, 2], [math.nan, math.nan]) == 0


def test_auc_tuning_score_penalises_a_mid_run_collapse_that_final_accuracy_hides():
  """tuning.score = "auc": the mean accuracy over the evaluations after step 0. A trial that falls to 0.05 at
  step 5 and recovers to 0.6 wins on final accuracy but loses to a steady 0.5 under auc."""
  c = st.load_config("countdown_quick", {"tuning.score": "auc", "task.steps": 10})
  ev = np.array([0, 5, 10])  # final = the evaluation at step 10
  z = dict(accuracy=np.array([[[[0.2, 0.05, 0.6]]], [[[0.2, 0.5, 0.5]]]]), eval_step=np.broadcast_to(ev, (2, 1, 1, 3)))
  np.testing.assert_allclose(tuning.scores(z, st._final(c)), [0.6, 0.5])  # the final score
  np.testing.assert_allclose(tuning.scores(z, tuning.score_fn(c, st._final(c))), [0.325, 0.5])
  base = st.settings(c)
  assert "score" in tuning.settings(c, base, "vcpo")  # an auc study's trials are not a final study's
  assert "score" not in tuning.settings(st.load_config("countdown_quick"), base, "vcpo")  # old prints kept
  with pytest.raises(ValueError, match="tuning.score='best'"):
    st.load_config("countdown_quick", {"tuning.score": "best"})


def test_protocol_studies_run_each_arm_only_at_its_own_lags():
  """The attribution runs its arms at k = 128 and the reference (none) at 0 and 128; the horizon runs none at 0
  only; method_ks must name a subset of ks."""
  c = st.load_config("protocol_attribution")
  assert {m: st.ks_of(c, m) for m in c.methods} == {
    "none": (0, 128),
    **{m: (128,) for m in c.methods if m != "none"},
  }
  assert st.trainer_run_config(c, "vcpo_cap4", 128, 0, 2e-4).method.weights.c == 4.0  # VCPO with one part changed
  rc = st.trainer_run_config(c, "seq_tis_c4", 128, 0, 2e-4)
  assert choices.describe(choices.build(rc.method)) == "seq_tis (weights.c=4.0)"
  h = st.load_config("protocol_horizon", {"methods": ("none", "vcpo", "seq_tis_c4", "vcpo_no_esslr")})
  assert h.task.steps == 800 and [st.ks_of(h, m) for m in h.methods] == [(0,), (128,), (128,), (128,)]
  assert Path(h.trainer.ledger) != Path(c.trainer.ledger)  # 800-step records never share a file with 200-step ones
  with pytest.raises(ValueError, match=r"method_ks\['vcpo'\]=\(8,\): give a subset"):
    st.load_config("protocol_attribution", {"method_ks.vcpo": (8,)})


def test_tuning_config_errors():
  with pytest.raises(ValueError, match=r"tuning.seeds=\(0,\) shares \[0\]"):
    st.load_config("countdown_quick", {"tuning.seeds": (0,)})
  with pytest.raises(ValueError, match=r"knobs\['vcpo'\]: 2 values, but tuning.trials=3"):
    st.load_config("countdown_quick", {"tuning.trials": 3})
  with pytest.raises(
    ValueError, match=r"knobs\['vcpo'\] = \('eps', 0.1\).*config\.method\.loss\.eps_low=0\.1: unknown field"
  ):
    st.load_config("countdown_quick", {"tuning.knobs.vcpo": ("eps", (0.1, 0.2))})
  with pytest.raises(ValueError, match="no entry for method 'seq_tis'"):
    st.load_config("countdown_quick", {"methods": ("none", "seq_tis")})
  with pytest.raises(ValueError, match=r"tuning.cells: \(2,\)"):
    st.load_config("countdown_quick", {"tuning.cells": ((2,),)})
