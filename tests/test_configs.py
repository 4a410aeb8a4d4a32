"""Every config loads and parses; the released configs hold the paper's released values; smoke variants run;
every bad value fails at parse time on one line naming the field; every field is on the command line
(the method's tree through main.py's own pass, rl/choices.py)."""

import dataclasses
import glob
import importlib
import json
import os
import subprocess
import sys

import pytest

from configs import common
from vcpo_jax import run_config, run_spec, schema, trainer
from vcpo_jax import metrics as metrics_lib
from vcpo_jax.model import hf_io, policy, transformer
from vcpo_jax.rl import choices
from vcpo_jax.rl import method as method_lib

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
NAMES = sorted(
  os.path.basename(p)[:-3]
  for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
  if os.path.basename(p) not in ("__init__.py", "common.py", "released.py")
)
SMOKE = ("countdown", "gsm8k", "math", "multiturn")  # configs with a ':smoke' variant

# The VCPO paper's released hyper-parameters (arXiv 2602.17616).
# name: (P, G, max prompt, max response, k, rho_on, eval n)
RELEASED = {
  "gsm8k": (8, 8, 2048, 2048, 12, 1.0, 3),
  "math": (32, 16, 1024, 2048, 10, 1.0, 3),
  "multiturn": (128, 16, 4096, 12288, 2, 0.55, 5),
}


def _load(name, variant=""):
  return importlib.import_module(f"configs.{name}").get_config(variant or None)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
  """A tiny local HF checkpoint standing in for the user's download (parse_config needs config.json)."""
  return hf_io.make_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), family="qwen2")


def _localize(c, ckpt):
  """The released configs point at the user's downloads: swap in the tiny checkpoint and the fixtures."""
  if c.model.checkpoint:
    c.model.checkpoint = ckpt
  c.task.data_path = ""
  c.eval.data_path = ""
  return c


def test_all_configs_found():
  assert set(RELEASED) | {"countdown"} <= set(NAMES)


@pytest.mark.parametrize("name,variant", [(n, "") for n in NAMES] + [(n, "smoke") for n in SMOKE if n in NAMES])
def test_config_parses(name, variant, tiny_ckpt):
  c = _load(name, variant)
  if not set(common.get_base_config()) <= set(c):
    # An experiment's own config (configs/stability.py drives vcpo_jax.experiments, not run()).
    assert "mode" not in c, f"configs/{name}.py sets a mode but does not derive from configs.common"
    return
  spec = run_config.parse_config(_localize(c, tiny_ckpt))
  assert spec.steps >= 1
  if variant == "smoke":
    assert not c.model.checkpoint and not c.task.data_path  # random preset + shipped fixtures
    assert c.mode in ("sync", "lag") and c.steps <= 3


VARIANTS = {
  "countdown": ("", "smoke", "study13", "moe"),
  "gsm8k": ("", "smoke"),
  "math": ("", "smoke", "qwen3_8b", "qwen3_30b_a3b"),
}
VARIANTS["multiturn"] = ("", "smoke")


def test_every_variant_of_every_config_has_only_known_keys():
  """Each shipped run config's variants (configs/*.py but the study's own) model every key they set."""
  assert set(VARIANTS) == set(NAMES) - {"stability"}
  for name, variants in VARIANTS.items():
    for variant in variants:
      schema.check_keys(run_spec.RunConfig, _load(name, variant))
  with pytest.raises(ValueError, match="unknown variant"):
    _load("countdown", "nope")


@pytest.mark.slow
def test_the_studys_run_configs_have_only_known_keys():
  """Every run of configs/stability.py's trainer studies (methods x k x lr x tuning knobs) models its keys."""
  from configs import stability as study_config
  from vcpo_jax.experiments import stability

  n = 0
  for arg in ("countdown", "countdown_quick", "claim", "corrections"):
    c = study_config.get_config(arg)
    for method in c.methods:
      knob = c.tuning.knobs.get(method) if c.tuning.enabled else None
      for trial in [None, *((knob[0], v) for v in knob[1])] if knob else [None]:
        for k in c.ks:
          schema.check_keys(run_spec.RunConfig, stability.trainer_run_config(c, method, k, 0, c.lrs[0], trial))
          n += 1
  assert n > 100


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_hyperparameters(name, tiny_ckpt):
  P, G, prompt_len, resp_len, k, rho_on, eval_n = RELEASED[name]
  c = _load(name)
  assert (c.task.prompts_per_step, c.task.group_size) == (P, G)
  assert (c.task.max_prompt_len, c.task.max_new_tokens) == (prompt_len, resp_len)
  assert c.lag.k == k and c.method.lr.rho_on == rho_on
  assert c.optim.lr == 1e-6 and c.optim.weight_decay == 0.1 and c.optim.clip_norm == 1.0
  assert c.optim.schedule == "constant"
  assert c.sampler.temperature == 1.0 and c.sampler.top_p == 1.0
  assert (c.eval.temperature, c.eval.top_p, c.eval.n, c.eval.greedy) == (0.8, 0.7, eval_n, False)
  assert c.model.checkpoint.endswith(("Qwen2-1.5B" if name == "gsm8k" else "Qwen2.5-7B", "Qwen2.5-7B-Instruct"))
  assert c.task.data_path  # a local file the user downloads
  assert c.mode == "async"  # every released run is asynchronous, multi-turn tool use included
  assert c.task.multiturn.enabled == (name == "multiturn")
  # What the learner actually receives: VCPO on sequence TIS c = 8, ESS-scaled lr with this rho_on.
  spec = run_config.parse_config(_localize(c, tiny_ckpt))
  pg = spec.learner.method
  assert spec.config.method == pg and pg.weights == method_lib.tis(8.0)
  assert pg.lr is not None and pg.baseline is not None and pg.lr.rho_on == rho_on
  assert spec.k == k and spec.rollout.batch_size == P * G and spec.lr == 1e-6
  assert (spec.eval.temperature, spec.eval.top_p, spec.eval.n) == (0.8, 0.7, eval_n)
  assert spec.sampling.temperature == 1.0 and spec.optim.schedule == "constant"


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_every_field_has_a_comment(name):
  """Each `c.x = ...` assignment line in a config file carries a comment (house style)."""
  with open(os.path.join(CONFIG_DIR, f"{name}.py")) as f:
    lines = [ln for ln in f if ln.strip().startswith("c.") and "=" in ln]
  assert lines and not [ln.strip() for ln in lines if "#" not in ln]


def test_unknown_variant_is_an_error():
  for name in RELEASED:
    with pytest.raises(ValueError, match="unknown variant"):
      _load(name, "nope")


def test_smoke_variants_run(tmp_path):
  """configs/gsm8k.py:smoke (sync) and configs/math.py:smoke (lag k = 1) through the real run()."""
  for name in ("gsm8k", "math"):
    c = _load(name, "smoke")
    c.model.hidden_size = 32  # smaller than the preset: the test only needs the code path
    c.model.intermediate_size = 64
    c.model.num_layers = 1
    workdir = str(tmp_path / name)
    summary = trainer.run(c, workdir)
    assert summary["step"] == 2 and summary["nonfinite_steps"] == []
    recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/pg_loss" in r]
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[1]["train/lag_max"] == (1.0 if name == "math" else 0.0)
    assert recs[0]["train/ess_ratio"] == pytest.approx(1.0, abs=1e-4)  # step 0 is on-policy


@pytest.mark.parametrize(
  "mode,method,extra",
  [
    # decoupled PPO with its log-linear pi_prox (reads each row's policy_version) and 2 x 2 updates per step
    (
      "lag",
      "decoupled_ppo",
      {"method.loss": "decoupled_ppo_loglinear", "learner.ppo_epochs": 2, "learner.minibatches": 2},
    ),
    ("sync", "vcpo_tis_ess", {"method.weights.target": 0.99}),  # VCPO with the ESS-targeted cap, logged as tis_c
  ],
)
@pytest.mark.slow
def test_issue13_methods_run(tmp_path, mode, method, extra):
  """Issue 13's methods through the real run() (every preset's learner step: tests/test_learner.py; the
  27-run matrix of presets x modes: by hand, see the issue's report)."""
  c = _load("countdown", "smoke")
  c.model.hidden_size, c.model.intermediate_size, c.model.num_layers = 32, 64, 1
  c.steps, c.checkpoint.every, c.log.norm_overhead_every = 2, 100, 0
  c.mode = mode
  _set(c, "method", method)
  if mode == "lag":
    c.lag.k = 1
  for k, v in extra.items():
    _set(c, k, v)
  workdir = str(tmp_path / "run")
  summary = trainer.run(c, workdir)
  assert summary["step"] == 2 and summary["nonfinite_steps"] == []
  recs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/pg_loss" in r]
  assert [r["step"] for r in recs] == [1, 2]
  assert all(0 < r["train/ess_ratio"] <= 1 for r in recs)  # every method reports the same ESS metrics
  if method == "vcpo_tis_ess":
    assert all(r["train/tis_c"] >= 1.0 for r in recs)
  else:
    assert all(r["train/updates"] == 4.0 and "train/loss/clip_frac" in r for r in recs)


# ----------------------------------------------------------------------------- bad values fail at parse time

# (field, bad value, config to start from): issue 12 item 10's values first, then one per remaining check.
BAD = [
  ("optim.b1", 1.5, "countdown"),
  ("optim.weight_decay", -1.0, "countdown"),
  ("model.hidden_size", 7, "countdown"),
  ("seed", -1, "countdown"),
  ("sampler.top_k", -1, "countdown"),
  ("sampler.prefill_chunk", -1, "countdown"),
  ("sampler.max_batch", -1, "countdown"),
  ("sampler.max_batch", 6, "countdown"),  # smoke G = 4: a call would split a group
  ("checkpoint.keep_last", 0, "countdown"),
  ("optim.schedule", "foo", "countdown"),
  ("async_.queue_slots", 0, "countdown"),
  ("async_.timeout_s", 0.0, "countdown"),
  ("async_.startup_timeout_s", -1.0, "countdown"),
  ("async_.publish_dtype", "float16", "countdown"),
  ("async_.background_publish", "sometimes", "countdown"),
  ("async_.publish_path", "nvlink", "countdown"),
  ("async_.publish_path", "device", "countdown"),  # without async_.sampler_devices
  ("task.max_prompt_len", 5, "countdown"),
  ("optim.b2", 1.0, "countdown"),
  ("optim.lr", 0.0, "countdown"),
  ("optim.clip_norm", 0.0, "countdown"),
  ("model.num_layers", 0, "countdown"),
  ("model.intermediate_size", 0, "countdown"),
  ("model.preset", "big", "countdown"),
  ("model.dtype", "float16", "countdown"),
  ("steps", 0, "countdown"),
  ("mode", "fast", "countdown"),
  ("method", "foo", "countdown"),
  ("lag.k", 3, "countdown"),  # mode = sync
  ("sampler.temperature", 0.0, "countdown"),
  ("sampler.top_p", 0.0, "countdown"),
  ("checkpoint.every", 0, "countdown"),
  ("checkpoint.keep_best", -1, "countdown"),
  ("async_.sampler_cpus", "a-b", "countdown"),
  ("async_.sampler_devices", "gpu0", "countdown"),
  ("task.prompts_per_step", 0, "countdown"),
  ("task.group_size", 1, "countdown"),
  ("task.name", "chess", "countdown"),
  ("task.data_path", "/nonexistent/train.jsonl", "countdown"),
  ("task.gen.num_numbers", (0, 0), "countdown"),
  ("task.gen.foo", 1, "countdown"),
  ("method.weights.c", -1.0, "countdown"),
  ("method.weights.cc", 4.0, "countdown"),  # a field the chosen weights (tis) do not have
  ("method.weights", "geo", "countdown"),  # not a weight variant
  ("method.log_ratio_clamp", 0.0, "countdown"),
  ("method.baseline.scope", "world", "countdown"),
  ("method.advantage.std", "biased", "countdown"),
  ("method.advantage.std_eps", -1.0, "countdown"),
  ("learner.grad_path", "loop", "countdown"),
  ("learner.ghost_passes", 3, "countdown"),
  ("learner.ppo_epochs", 0, "countdown"),
  ("learner.minibatches", 2, "countdown"),  # countdown's method (vcpo) is a single-update method
  ("method.loss", "trpo", "countdown"),
  ("method.lr.rho_on", 0.0, "countdown"),
  ("learner.on_nonfinite", "ignore", "countdown"),
  ("eval.num_problems", 0, "countdown"),
  ("eval.n", 0, "countdown"),
  ("eval.every", -1, "countdown"),
  ("eval.dataset", "chess", "countdown"),
  ("eval.background", True, "countdown"),  # countdown:smoke is mode=sync: only the async sampler evaluates
  ("log.norm_overhead_every", -1, "countdown"),
  ("sft.steps", -1, "countdown"),
  ("sft.lr", 0.0, "countdown"),
  ("sft.batch_size", 0, "countdown"),
  ("mesh.shape", (1, 1), "countdown"),
  ("distributed.process_id", 1, "countdown"),
  ("model.tokenizer", "/nonexistent/tok", "countdown"),
  ("task.max_prompt_len", 100, "gsm8k"),  # the fixture's longest prompt is longer
  ("task.multiturn.max_turns", 0, "multiturn"),
  ("task.multiturn.max_turn_tokens", 64, "multiturn"),  # > task.max_new_tokens
]


def _set(c, path, value):
  if path.split(".")[0] == "method":  # as the command line sets it: a preset, a part's choice or a field
    return choices.set_paths(c, [(path, value)])
  *parents, name = path.split(".")
  for p in parents:
    c = c[p]
  with c.unlocked():
    c[name] = value


@pytest.fixture
def nothing_built(monkeypatch):
  """Any attempt to build a model (random init or checkpoint load) fails the test."""

  def fail(*a, **k):
    raise AssertionError("the model was built before the config was checked")

  monkeypatch.setattr(policy, "build_policy", fail)
  monkeypatch.setattr(transformer, "init", fail)
  monkeypatch.setattr(hf_io, "load_hf", fail)


@pytest.mark.parametrize("field,value,name", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_bad_value_fails_in_parsing_naming_the_field(field, value, name, tmp_path, nothing_built):
  c = _load(name, "smoke")
  workdir = tmp_path / "run"
  with pytest.raises(run_config.ConfigError) as e:
    _set(c, field, value)  # a method tree's unknown name fails here, as on main.py's command line
    trainer.run(c, str(workdir))
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("config."), msg
  if field == "distributed.process_id":
    assert "config.distributed.process_id=1" in msg
  else:
    assert f"config.{field}" in msg, msg
  assert repr(value) in msg or str(value) in msg, msg
  assert not workdir.exists()  # failed before the run wrote anything


@pytest.mark.parametrize(
  "overrides,match",
  [
    ({"learner.minibatches": 3}, r"config\.learner\.minibatches=3 does not divide the batch size N=8"),
    ({"learner.minibatches": 4}, r"config\.learner\.minibatches=4: a minibatch of N / 4 = 2 rows is not whole groups"),
    ({"method.loss.eps_low": -1.0}, r"^config\.method\.loss\.eps_low=-1\.0: "),
    (
      {"method.loss.eps": 0.2},
      r"^config\.method\.loss\.eps=0\.2: unknown field; did you mean config\.method\.loss\.eps_",
    ),
  ],
)
def test_policy_loss_method_errors_name_the_field(overrides, match, nothing_built, tmp_path):
  # issue 13: a policy-loss method (ppo_clip) with minibatches that split groups, or bad loss keywords
  c = _load("countdown", "smoke")
  c.method = choices.preset("ppo_clip")  # as a config file sets it
  with pytest.raises(run_config.ConfigError, match=match) as e:
    for k, v in overrides.items():
      _set(c, k, v)
    trainer.run(c, str(tmp_path / "run"))
  assert "\n" not in str(e.value)


def test_prompt_length_message_gives_the_fix():
  c = _load("countdown", "smoke")
  c.task.max_prompt_len = 5
  with pytest.raises(run_config.ConfigError, match=r"config.task.max_prompt_len=5: .* 13 tokens; .* >= 13"):
    run_config.parse_config(c)
  c.task.max_prompt_len = 13  # exactly the longest "[a, b, c]>tt:" prompt
  assert run_config.parse_config(c).rollout.max_prompt_len == 13


def test_async_and_mesh_checks_do_not_depend_on_the_mode():
  """An async_ value is checked even in sync mode: switching --config.mode=async later must not surprise."""
  c = _load("countdown", "smoke")
  c.async_.queue_slots = 0
  with pytest.raises(run_config.ConfigError, match="async_.queue_slots=0"):
    run_config.parse_config(c, check_prompts=False)


def test_learner_sft_and_multiturn_sections_are_the_components_configs():
  """config.learner / config.sft / config.task.multiturn are LearnerConfig / SFTConfig / MultiTurnConfig; the fields
  other sections determine are not in the ConfigDict and are set by parse_config (checks that need them run then)."""
  c = common.get_base_config()
  assert not {"method", "group_size", "batch_size"} & set(c.learner) and not {"task", "seed", "task_gen"} & set(c.sft)
  spec = run_config.parse_config(_load("countdown", "smoke"), check_prompts=False)
  assert spec.config.learner.method is None and spec.learner.method == spec.config.method
  assert (spec.learner.group_size, spec.learner.batch_size) == (4, 8)
  assert spec.learner == dataclasses.replace(spec.config.learner, method=spec.config.method, group_size=4, batch_size=8)
  sft_cfg = spec.sft_config()
  assert spec.config.sft.task is None and (sft_cfg.task, sft_cfg.max_prompt_len, sft_cfg.seed) == ("countdown", 24, 0)
  assert spec.multiturn is None
  mt = _load("multiturn", "smoke")
  assert run_config.parse_config(mt, check_prompts=False).multiturn is not None
  bad = _load("countdown", "smoke")
  bad.learner.ppo_epochs = 2  # the method (vcpo) has no policy loss: known only once parse_config sets it
  with pytest.raises(run_config.ConfigError, match=r"^config.learner.ppo_epochs=2: several updates per step need"):
    run_config.parse_config(bad, check_prompts=False)


def test_flat_views_equal_the_config():
  c = _load("countdown")
  spec = run_config.parse_config(c, check_prompts=False)
  assert (spec.lr, spec.weight_decay, spec.clip_norm) == (2e-4, 0.0, 1.0)
  assert (spec.seed, spec.steps, spec.mode, spec.k) == (c.seed, c.steps, c.mode, c.lag.k)
  assert (spec.model_checkpoint, spec.tokenizer_dir, spec.mesh_shape) == ("", "", tuple(c.mesh.shape))
  assert (spec.eval_every, spec.eval_background, spec.sft_steps, spec.on_nonfinite) == (25, False, c.sft.steps, "skip")
  assert spec.sampling is spec.config.sampler and spec.optim is spec.config.optim and spec.log is spec.config.log
  assert spec.async_ is spec.config.async_ and spec.dist is spec.config.distributed
  assert spec.checkpoint is spec.config.checkpoint


# ----------------------------------------------------------------------------- command line

ROOT = os.path.dirname(CONFIG_DIR)


def _parse_cli(*args):
  """The config main.py would get from these command-line arguments (its own absl FlagValues)."""
  from absl import flags
  from ml_collections import config_flags

  argv = ["main.py", *args]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
  fv(argv)
  return fv.config


def _cli_spec(*args):
  """The method main.py's command line gives the learner: the --config.method... flags taken out of argv
  (schema.split_args), the rest parsed by ml_collections, then the method flags set (rl.choices.set_paths)."""
  rest, method = schema.split_args(["main.py", *args], "method")
  c = _parse_cli(*rest[1:])
  choices.set_paths(c, method)
  return run_config.parse_config(c, check_prompts=False)


def test_method_fields_on_the_command_line_reach_the_learner():
  smoke = f"--config={CONFIG_DIR}/countdown.py:smoke"
  spec = _cli_spec(smoke, "--config.method=ppo_clip", "--config.method.loss.eps_high=0.28", "--config.seed=3")
  assert spec.learner.method.loss.kwargs["eps_high"] == 0.28 and spec.learner.method.peer_loss.name == "ppo_clip"
  assert spec.seed == 3  # the other flags still reach ml_collections
  spec = _cli_spec(smoke, "--config.method.weights.c", "4", "--config.method.lr.rho_on=0.9")  # vcpo's parts
  assert spec.learner.method.weights == method_lib.tis(4.0) and spec.learner.method.lr.rho_on == 0.9
  assert spec.learner.method.baseline == method_lib.PRESETS["vcpo"].baseline  # the rest: the preset's
  spec = _cli_spec(smoke, "--config.method.weights=clip", "--config.method.weights.upper=3")  # a switched part
  assert spec.learner.method.weights == method_lib.clip(0.5, 3.0)


@pytest.mark.parametrize("name,variant", [(n, "") for n in NAMES] + [(n, "smoke") for n in SMOKE if n in NAMES])
@pytest.mark.slow
def test_config_help_lists_every_field_with_a_comment(name, variant):
  c = _load(name, variant)
  path = os.path.join(CONFIG_DIR, f"{name}.py")
  text = common.help_text(c, path)
  rows = text.splitlines()[1:]
  shown = [p for p, v, _ in common.leaves(c) if not p.startswith("method.")]
  method_rows = 1 + len(choices.help_lines(c.method)) if "method" in c else 0  # its name, then its choices' fields
  assert len(rows) == len(shown) + method_rows
  assert not [r for r in rows if r.endswith("(no comment)")], "add a one-line comment to these fields"
  if "method" in c:
    assert "  method.log_ratio_clamp: float = 20.0  # " in text
    assert "  optim.b1: float = 0.9  # Adam" in text


@pytest.mark.parametrize("path,guess", [("optim.b3", "optim.b2"), ("sed", "seed"), ("optimm.lr", "optim.lr")])
def test_unknown_field_suggests_the_closest_name(path, guess):
  with pytest.raises(
    run_config.ConfigError, match=rf"config.{path}='1': unknown field; did you mean config.{guess}( or [^?]+)?\?"
  ):
    run_config.check_override_paths(common.get_base_config(), {"seed": "0", path: "1"})
  run_config.check_override_paths(common.get_base_config(), {"optim.b1": "0.8", "task.multiturn.max_turns": "2"})


def _main(*args):
  return subprocess.run(
    [sys.executable, "main.py", *args],
    check=False,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ),
  )


@pytest.mark.slow
def test_main_reports_an_unknown_field_on_one_line(tmp_path):
  r = _main("--config=configs/countdown.py:smoke", "--config.foo=1", f"--workdir={tmp_path / 'run'}")
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr  # one line, no traceback
  assert "config.foo='1': unknown field; did you mean config." in r.stderr
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
  "line,needle",
  [
    ("c.model.lora_rnak = 8", "config.model.lora_rnak=8: unknown field; did you mean config.model.lora_rank"),
    ("c.task.multiturn.max_turn = 2", "config.task.multiturn.max_turn=2: unknown field; did you mean config.task."),
    ("c.method.weights.cc = 4.0", "config.method.weights.cc=4.0: unknown field; did you mean config.method.weights.c?"),
    ("c.method.loss.name = 'ppo_clp'", "config.method.loss='ppo_clp': unknown surrogate or a peer loss"),
  ],
)
def test_main_reports_an_unknown_key_of_a_config_file_on_one_line(tmp_path, line, needle):
  """A misspelled key in a config file fails like one on the command line: one line, exit 2, nothing built."""
  path = tmp_path / "typo.py"
  path.write_text(
    f"from configs import countdown\n\n\ndef get_config():\n  c = countdown.get_config('smoke')\n  {line}\n  return c\n"
  )
  r = _main(f"--config={path}", f"--workdir={tmp_path / 'run'}")
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr  # one line, no traceback
  assert needle in r.stderr, r.stderr
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_main_config_help(tmp_path):
  r = _main("--config=configs/countdown.py", "--config_help")
  assert r.returncode == 0, r.stderr
  assert r.stdout == common.help_text(_load("countdown"), "configs/countdown.py") + "\n"
  assert "task.gen.num_numbers: tuple = (2, 2)  # 2 numbers" in r.stdout  # a field only countdown.py defines


@pytest.mark.parametrize(
  "args,needle",
  [
    (["--config=configs/countdown.py:smoke"], "--workdir: missing; pass --workdir=DIR"),
    (["--workdir=WD"], "--config: missing; pass --config=configs/NAME.py"),
    (["--config=configs/countdown.py:smoke", "--workdir=FILE", "--allow_config_change"], "a file of that name exists"),
    (["--config=configs/countdown.py:smoke", "--workdir=FILE/run"], "cannot write there (Not a directory)"),
    (["--config=configs/countdown.py:smoke", "--workdir=/proc/self/run"], "--workdir='/proc/self/run': cannot write"),
    (["--config=configs/countdown.py:smoke", "--config.method=vcpoo", "--workdir=WD"], "did you mean 'vcpo'"),
    (["--config=configs/countdown.py:smoke", "--config.method=ppo_clp", "--workdir=WD"], "did you mean 'ppo_clip'"),
    (
      [
        "--config=configs/countdown.py:smoke",
        "--config.method=ppo_clip",
        "--config.method.loss.eps_hgih=0.3",
        "--workdir=WD",
      ],
      "config.method.loss.eps_hgih='0.3': unknown field; did you mean config.method.loss.eps_high?",
    ),
    (["--config=configs/countdown.py:smoke", "--config.method.weights=tiss", "--workdir=WD"], "did you mean 'tis'"),
  ],
)
@pytest.mark.slow
def test_main_bad_command_line_or_workdir_is_one_line_exit_2(tmp_path, args, needle):
  (tmp_path / "file").write_text("x")
  args = [a.replace("FILE", str(tmp_path / "file")).replace("WD", str(tmp_path / "run")) for a in args]
  r = _main(*args)
  assert r.returncode == 2, r.stderr
  assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line: no traceback, no help text
  assert needle in r.stderr, r.stderr
  assert not (tmp_path / "run").exists()


def test_config_help_shows_only_the_chosen_choices_fields():
  """`--config_help --config.method=ppo_clip`: PPO's own fields (eps_low / eps_high ...) with their values, none of
  the TIS weights', OPOB's, the ESS lr's or the surrogate's."""
  r = _main(
    "--config=configs/countdown.py", "--config_help", "--config.method=ppo_clip", "--config.method.loss.eps_high=0.28"
  )
  assert r.returncode == 0, r.stderr
  rows = [row for row in r.stdout.splitlines() if row.startswith("  method")]
  assert rows[0].startswith("  method: ppo_clip (loss.eps_high=0.28)  # ")
  assert "  method.loss.eps_low: float = 0.2  # ppo_clip's eps_low" in rows
  assert "  method.loss.eps_high: float = 0.28  # ppo_clip's eps_high" in rows
  assert any(row.startswith("  method.loss: str = 'ppo_clip'  # Token-level PPO clip") for row in rows)
  for inert in ("weights.c", "baseline.scope", "lr.rho_on", "loss.mask_normalizer", "loss.score_centering"):
    assert not any(row.startswith(f"  method.{inert}:") for row in rows), inert
  text = common.help_text(_load("countdown", None), "configs/countdown.py")  # vcpo: TIS c, OPOB, the ESS lr
  for row in ("method.weights.c: float = 8.0", "method.lr.rho_on: float = 1.0", "method.baseline: str = 'opob'"):
    assert f"  {row}  # " in text, row


@pytest.mark.slow
def test_main_refuses_a_resume_with_other_trajectory_fields_on_one_line(tmp_path):
  """A workdir whose newest checkpoint was trained with another optim.lr: one line, exit 2, before jax starts
  (no backend log line) and with config.json untouched. The checkpoint is faked: only its JSON meta is read."""
  from vcpo_jax import fingerprint

  saved = fingerprint.of(_load("countdown", "smoke"))
  saved["optim.lr"] = 0.5
  meta = tmp_path / "run" / "checkpoints" / "7" / "meta"
  meta.mkdir(parents=True)
  (meta / "metadata").write_text(json.dumps({"step": 7, "config_fingerprint": saved}))
  (tmp_path / "run" / "config.json").write_text("{}")
  r = _main("--config=configs/countdown.py:smoke", f"--workdir={tmp_path / 'run'}")
  assert r.returncode == 2, r.stderr
  assert len(r.stderr.strip().splitlines()) == 1, r.stderr
  assert "checkpoint at step 7" in r.stderr and "config.optim.lr: 0.5 -> 0.0003" in r.stderr
  assert "--allow_config_change" in r.stderr
  assert (tmp_path / "run" / "config.json").read_text() == "{}"


def test_fingerprint_is_the_same_on_every_process_of_a_job():
  """Each process of a multi-host job has its own distributed.process_id, and a run may resume on another number
  of hosts: neither is a changed config (the 2-host resume test exited on host 1 when they were)."""
  from vcpo_jax import fingerprint

  c0, c1 = _load("countdown", "smoke"), _load("countdown", "smoke")
  for c, i in ((c0, 0), (c1, 1)):
    c.distributed.enabled, c.distributed.num_processes, c.distributed.process_id = True, 2, i
  assert fingerprint.of(c0) == fingerprint.of(c1)
  c1.distributed.enabled, c1.distributed.num_processes = False, 1  # a 2-host run resumed on one process
  assert fingerprint.of(c0) == fingerprint.of(c1)
