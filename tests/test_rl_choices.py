"""Tests of vcpo_jax.rl.choices: the config's method tree of named choices, each with only its own fields.

A value set in the tree reaches the Method the learner runs (hand numbers), a choice switched replaces its part's
fields, a preset's tree builds back to the preset, and every bad name is one ConfigError naming the nearest."""

import dataclasses
import math

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from vcpo_jax import schema
from vcpo_jax.rl import advantages, choices, losses, method, presets, weights

R = dataclasses.replace
VCPO, PPO = method.PRESETS["vcpo"], method.PRESETS["ppo_clip"]


def _config(preset="vcpo"):
  return ml_collections.ConfigDict({"method": choices.preset(preset), "seed": 0})


def _set(items, preset="vcpo"):
  c = _config(preset)
  choices.set_paths(c, items)
  return c


def test_every_preset_is_its_tree_built_back():
  for name, m in method.PRESETS.items():
    assert choices.build(choices.preset(name)) == m, name
    assert presets.method_from_preset(name) == m, name


def test_each_choice_holds_only_its_own_fields_at_its_factorys_defaults():
  # hand-written: what each choice's factory signature (or dataclass) says, and nothing of another choice
  assert choices.defaults("weights", "tis") == {"c": 8.0}
  assert choices.defaults("weights", "token_tis") == {"c": 2.0}
  assert choices.defaults("weights", "clip") == {"lower": 0.5, "upper": 2.0}
  assert choices.defaults("weights", "tis_ess") == {"target": 0.5}
  assert choices.defaults("weights", "none") == {} == choices.defaults("baseline", "none")
  assert choices.defaults("advantage", "grpo") == {"std": "sample", "std_eps": 1e-6}
  assert choices.defaults("advantage", "rloo") == {}  # no group std: its std options would be inert
  assert choices.defaults("lr", "ess_lr") == {"rule": "sqrt", "rho_on": 1.0}
  assert set(choices.defaults("loss", "ppo_clip")) == {
    "eps_low",
    "eps_high",
    "dual_clip_c",
    "loss_agg",
    "log_ratio_clamp",
  }
  assert choices.defaults("loss", "ppo_clip")["eps_high"] == 0.2
  # and, for every registered choice, exactly the factory's keyword-only arguments (no second statement)
  for name, variant in weights.WEIGHT_VARIANTS.items():
    assert choices.defaults("weights", name) == variant.defaults, name
  for name, loss in losses.POLICY_LOSSES.items():
    own = {k: v for k, v in loss.defaults.items() if k not in losses.STEP_INPUTS}
    assert choices.defaults("loss", name) == own, name
  assert choices.defaults("loss", "surrogate") == dataclasses.asdict(method.Surrogate())


def test_a_value_set_through_the_tree_reaches_the_method():
  """`--config.method=ppo_clip --config.method.loss.eps_high=0.28`: the learner's Method has eps_high 0.28, and the
  loss it computes is PPO's with that clip (a token with r = 1.25 > 1.2 and A > 0 is clipped at 1.2, not at 1.28)."""
  m = choices.build(_set([("method", "ppo_clip"), ("method.loss.eps_high", "0.28")]).method)
  assert m.loss.kwargs["eps_high"] == 0.28 and m.loss.kwargs["eps_low"] == 0.2
  assert m == R(PPO, loss=losses.ppo_clip(eps_high=0.28))
  logp, old = jnp.log(jnp.array([[1.25]])), jnp.zeros((1, 1))
  fn = m.bind_loss({})
  loss, _ = fn(logp, old, old, jnp.array([1.0]), jnp.ones((1, 1)))
  loss_default, _ = PPO.bind_loss({})(logp, old, old, jnp.array([1.0]), jnp.ones((1, 1)))
  assert math.isclose(float(loss), -1.25, rel_tol=1e-6)  # unclipped: r A with r = 1.25 <= 1.28
  assert math.isclose(float(loss_default), -1.2, rel_tol=1e-6)  # clipped at 1 + 0.2


def test_weights_c_changes_the_tis_coefficients_by_hand_numbers():
  """seq_tis with --config.method.weights.c=4: one group, rewards (1, 0), one token each, l = (2, -1).
  GRPO (sample std): A = (+-0.5) / sqrt(0.5) = +-0.70711; w = min(e^l, c) = (4, e^-1) (c = 8: (e^2, e^-1));
  seq-mean-token-mean: norm = 1 / (N L_n) = 1/2. coef = A w / 2 = (1.41421, -0.13007) (c = 8: 2.61243)."""
  args = (jnp.zeros((2, 1)), jnp.array([[-2.0], [1.0]]), jnp.ones((2, 1)), jnp.array([1.0, 0.0]), jnp.array([0, 0]))
  m4 = choices.build(_set([("method.weights.c", "4")], "seq_tis").method)
  assert m4.weights == weights.tis(4.0)
  np.testing.assert_allclose(m4.coefficients(*args)[0], [1.41421, -0.130065], rtol=1e-5)
  np.testing.assert_allclose(method.PRESETS["seq_tis"].coefficients(*args)[0], [2.61243, -0.130065], rtol=1e-5)


# Every field of every choice the presets use (and each part switched), at a NON-default value, against the Method
# written by hand. (A peer loss's hyper-parameters are its own tests' business: tests/test_policy_losses.py.)
CASES = {
  "weights.c": ("vcpo", 3.0, R(VCPO, weights=weights.tis(3.0))),
  "weights": ("vcpo", "clip", R(VCPO, weights=weights.clip(0.5, 2.0))),
  "log_ratio_clamp": ("vcpo", 5.0, R(VCPO, log_ratio_clamp=5.0)),
  "advantage": ("vcpo", "rloo", R(VCPO, advantage=advantages.rloo())),
  "advantage.std": ("vcpo", "sample", R(VCPO, advantage=advantages.grpo(std="sample"))),
  "advantage.std_eps": ("vcpo", 0.1, R(VCPO, advantage=advantages.grpo(std="population", std_eps=0.1))),
  "baseline": ("vcpo", "none", R(VCPO, baseline=None)),
  "baseline.weights": ("vcpo", "applied", R(VCPO, baseline=advantages.opob(weights="applied"))),
  "baseline.leave_one_out": ("vcpo", True, R(VCPO, baseline=advantages.opob(leave_one_out=True))),
  "baseline.scope": ("vcpo", "minibatch", R(VCPO, baseline=advantages.opob(scope="minibatch"))),
  "baseline.length_normalize_norms": ("vcpo", True, R(VCPO, baseline=advantages.opob(length_normalize_norms=True))),
  "baseline.reference_mode": ("vcpo", True, R(VCPO, baseline=advantages.opob(reference_mode=True))),
  "lr": ("vcpo", "constant", R(VCPO, lr=None)),
  "lr.rule": ("vcpo", "linear", R(VCPO, lr=method.ess_lr("linear", 1.0))),
  "lr.rho_on": ("vcpo", 0.55, R(VCPO, lr=method.ess_lr("sqrt", 0.55))),
  "loss.loss_agg": ("vcpo", "token-mean", R(VCPO, loss=method.surrogate(loss_agg="token-mean"))),
  "loss.mask_normalizer": ("vcpo", "kept", R(VCPO, loss=method.surrogate(mask_normalizer="kept"))),
  "loss.loss_norm_tokens": ("vcpo", 7, R(VCPO, loss=method.surrogate(loss_norm_tokens=7))),
  "loss.score_centering": ("vcpo", "exact", R(VCPO, loss=method.surrogate(score_centering="exact"))),
  "loss": ("ppo_clip", "gspo", R(PPO, loss=losses.gspo())),
  "loss.eps_low": ("ppo_clip", 0.1, R(PPO, loss=losses.ppo_clip(eps_low=0.1))),
  "weights.target": ("vcpo_tis_ess", 0.8, R(method.PRESETS["vcpo_tis_ess"], weights=weights.tis_ess(0.8))),
}


@pytest.mark.parametrize("path", sorted(CASES))
def test_each_field_at_a_non_default_value_changes_exactly_its_part(path):
  preset, value, want = CASES[path]
  assert presets.method_from_preset(preset, {path: value}) == want
  assert presets.method_from_preset(preset, {path: str(value)}) == want  # as the command line gives it


def test_switched_choices_take_their_own_fields():
  f = presets.method_from_preset
  assert f("vcpo", {"weights": "geo_mask", "weights.lower": 0.8, "weights.upper": 1.3}).weights == weights.geo_mask(
    0.8, 1.3
  )
  assert f("vcpo", {"weights": "mask", "weights.lower": 0.2, "weights.upper": 3.0}).weights == weights.mask(0.2, 3.0)
  assert f("vcpo", {"weights.upper": 3.0, "weights": "clip", "weights.lower": 0.2}).weights == weights.clip(0.2, 3.0)
  assert f("tis_sc", {"weights.c": 1.5}).weights == weights.token_tis(1.5)
  topk = f("vcpo", {"loss.score_centering": "topk", "loss.sc_topk": 8})
  assert topk.loss == method.surrogate(score_centering="topk", sc_topk=8) and topk.record_topk == 8
  prox = f("decoupled_ppo", {"loss": "decoupled_ppo_loglinear", "loss.eps_high": 0.28})
  assert prox.loss == losses.decoupled_ppo_loglinear(eps_high=0.28) and prox.loss.needs
  covered = {p for p in CASES} | {"weights.lower", "weights.upper", "loss.sc_topk"}
  # every field of the choices the presets use is exercised above at a non-default value
  used = {
    f"{part}.{k}" if k != choices.NAME else part
    for m in method.PRESETS.values()
    if m.peer_loss is None
    for part in choices.PARTS
    for k in choices.tree(m)[part]
  }
  assert used <= covered | {p.split(".")[0] for p in covered}, sorted(used - covered)


def test_a_choice_switch_replaces_the_parts_fields():
  c = _set([("method.weights", "clip")])
  assert c.method.weights.to_dict() == {"name": "clip", "lower": 0.5, "upper": 2.0}  # tis's c is gone
  with pytest.raises(schema.ConfigError) as e:
    _set([("method.weights", "clip"), ("method.weights.c", "4")])
  msg = str(e.value)
  assert (
    msg.startswith("config.method.weights.c='4': unknown field;") and "weights 'clip' has ['lower', 'upper']" in msg
  )
  # a preset after a field on the command line: the preset is applied first, whatever the order
  c = _set([("method.loss.eps_high", "0.28"), ("method", "ppo_clip")])
  assert c.method.loss.eps_high == 0.28 and c.method.loss.name == "ppo_clip"
  assert _set([("method.loss.dual_clip_c", "3.0")], "ppo_clip").method.loss.dual_clip_c == 3.0  # a None default


@pytest.mark.parametrize(
  "items,message",
  [
    ([("method.weights", "tiss")], r"^config\.method\.weights='tiss': unknown importance weights; did you mean 'tis'"),
    ([("method", "vcpo2")], r"^config\.method='vcpo2': unknown preset; did you mean 'vcpo'"),
    (
      [("method.loss.eps_hgih", "0.3")],
      r"^config\.method\.loss\.eps_hgih='0\.3': unknown field; did you mean config\.method\.loss\.eps_high\?",
    ),
    ([("method.lossy", "x")], r"^config\.method\.lossy='x': unknown field; did you mean config\.method\.loss\?"),
    ([("method.weights.c", "big")], r"^config\.method\.weights\.c='big': not a float"),
    ([("method.weights.c", "-1")], r"^config\.method\.weights\.c=-1\.0: variant 'tis' needs a truncation level c > 0"),
    ([("method.lr.rho_on", "0")], r"^config\.method\.lr\.rho_on=0\.0: must be > 0"),
  ],
)
def test_a_bad_name_or_value_is_one_line_naming_the_field(items, message):
  with pytest.raises(schema.ConfigError, match=message) as e:
    preset = "ppo_clip" if "eps_hgih" in items[0][0] else "vcpo"
    choices.build(_set(items, preset).method)
  assert "\n" not in str(e.value)


def test_a_config_files_unknown_key_in_the_tree_is_an_error():
  c = _config()
  c.method.weights.cc = 4.0  # what a config file can write
  with pytest.raises(
    schema.ConfigError,
    match=r"^config\.method\.weights\.cc=4\.0: unknown field; did you mean config\.method\.weights\.c\?",
  ):
    choices.build(c.method)
  c = _config()
  c.method.loss.name = "trpo"
  with pytest.raises(schema.ConfigError, match=r"^config\.method\.loss='trpo': unknown surrogate or a peer loss"):
    choices.build(c.method)


def test_help_lines_show_only_the_chosen_choices_fields():
  paths = {p for p, _, _ in choices.help_lines(choices.preset("ppo_clip"))}
  assert {"method.loss.eps_low", "method.loss.eps_high", "method.loss.dual_clip_c"} <= paths
  assert "method.weights.c" not in paths and "method.lr.rho_on" not in paths and "method.baseline.scope" not in paths
  assert "method.weights.c" in {p for p, _, _ in choices.help_lines(choices.preset("vcpo"))}


def test_describe_names_the_preset_and_what_differs():
  assert choices.describe(VCPO) == "vcpo" and choices.describe(PPO) == "ppo_clip"
  assert choices.describe(presets.method_from_preset("vcpo", {"lr.rho_on": 0.5})) == "vcpo (lr.rho_on=0.5)"
