"""Every config loads and parses; the released configs hold PAPER.md's values; smoke variants run."""

import glob
import importlib
import os

import pytest

from configs import common
from vcpo_jax import metrics as metrics_lib
from vcpo_jax import run_config, trainer
from vcpo_jax.model import hf_io

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
NAMES = sorted(
  os.path.basename(p)[:-3]
  for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
  if os.path.basename(p) not in ("__init__.py", "common.py")
)
SMOKE = ("countdown", "gsm8k", "math", "multiturn")  # configs with a ':smoke' variant

# ../shared/PAPER.md, "Released hyper-parameters".
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


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_hyperparameters(name, tiny_ckpt):
  P, G, prompt_len, resp_len, k, rho_on, eval_n = RELEASED[name]
  c = _load(name)
  assert (c.task.prompts_per_step, c.task.group_size) == (P, G)
  assert (c.task.max_prompt_len, c.task.max_new_tokens) == (prompt_len, resp_len)
  assert c.lag.k == k and c.vcpo.rho_on == rho_on
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
  pg = spec.learner.pg
  assert spec.method == "vcpo" and pg.is_variant == "tis" and pg.tis_c == 8.0
  assert pg.ess_lr and pg.opob and pg.rho_on == rho_on
  assert spec.k == k and spec.rollout.batch_size == P * G and spec.lr == 1e-6
  assert (spec.eval.temperature, spec.eval.top_p, spec.eval.n) == (0.8, 0.7, eval_n)
  assert spec.temperature == 1.0 and spec.schedule == "constant"


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
