"""Tests of vcpo_jax.estimator: hand-checked numbers, a numpy reference,
brute-force gradients, hypothesis properties, and two Monte Carlo checks."""

import dataclasses
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import test_policy_losses as TPL
from vcpo_jax import estimator as E
from vcpo_jax import learner
from vcpo_jax.rl import advantages as advantages_lib
from vcpo_jax.rl import choices, presets

HYP = settings(max_examples=60, deadline=None, derandomize=True)

# ---------------------------------------------------------------------------
# Log-ratios, ESS, learning-rate scale
# ---------------------------------------------------------------------------


def test_sequence_log_ratio_hand_numbers_and_stop_gradient():
  logp = jnp.array([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0]])
  beh = jnp.array([[-1.5, -1.0, -jnp.inf], [-0.3, -0.2, -1.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 1]])
  np.testing.assert_allclose(E.sequence_log_ratio(logp, beh, mask), [0.5 - 1.0, 0.2 - 8.0], rtol=1e-6)
  g = jax.grad(lambda lp: E.sequence_log_ratio(lp, beh, mask).sum())(logp)
  assert np.all(np.asarray(g) == 0.0)  # l is a coefficient: never differentiated


@pytest.mark.slow
def test_ess_hand_numbers():
  assert float(E.ess(jnp.zeros(4))) == pytest.approx(4.0)
  assert float(E.ess(jnp.log(jnp.array([1.0, 2.0])))) == pytest.approx(9.0 / 5.0, rel=1e-6)
  # one dominant weight: ESS -> 1 (exp(l) in float32 would overflow here)
  assert float(E.ess(jnp.array([1e4, 0.0, -1e4, 50.0]))) == pytest.approx(1.0)
  # invalid entries are excluded; zero weights (-inf) count in n but add no mass
  assert float(E.ess(jnp.array([0.0, 0.0, 1e4]), jnp.array([True, True, False]))) == pytest.approx(2.0)
  assert float(E.ess_ratio(jnp.array([0.0, -jnp.inf]))) == pytest.approx(0.5)
  assert float(E.ess_ratio(jnp.zeros(3), jnp.zeros(3, bool))) == 1.0  # no data: no brake
  assert float(E.ess(jnp.full(3, -jnp.inf))) == 0.0


def test_log_mean_weight_hand_numbers_sees_what_ess_misses():
  # weights 1 and 3: mean 2
  assert float(E.log_mean_weight(jnp.log(jnp.array([1.0, 3.0])))) == pytest.approx(math.log(2.0), rel=1e-6)
  # every weight 1e-6 together: ESS / N is 1 (equal weights), the mean weight shows the collapse
  lw = jnp.full(8, math.log(1e-6))
  assert float(E.ess_ratio(lw)) == pytest.approx(1.0)
  assert float(E.log_mean_weight(lw)) == pytest.approx(math.log(1e-6), rel=1e-5)
  # invalid rows are left out; huge log-weights do not overflow (log-sum-exp)
  valid = jnp.array([True, True, False])
  assert float(E.log_mean_weight(jnp.array([1e4, 1e4, 5e4]), valid)) == pytest.approx(1e4, rel=1e-6)
  assert float(E.log_mean_weight(jnp.zeros(3), jnp.zeros(3, bool))) == -math.inf


def _ess64(lw):
  lw = np.asarray(lw, np.float64)
  z = lw - lw.max()
  return np.exp(z).sum() ** 2 / np.exp(2 * z).sum()


_ess_j = jax.jit(E.ess)
N_H = 16
log_w_strategy = hnp.arrays(np.float32, N_H, elements=st.floats(-1e4, 1e4, width=32))
valid_strategy = hnp.arrays(bool, N_H).filter(lambda v: v.any())


@HYP
@given(log_w_strategy, valid_strategy, st.floats(-50, 50), st.randoms(use_true_random=False))
def test_ess_properties(lw, valid, shift, rnd):
  n = int(valid.sum())
  e = float(_ess_j(lw, valid))
  assert math.isfinite(e) and 1.0 <= e <= n
  np.testing.assert_allclose(e, _ess64(lw[valid]), rtol=1e-4)
  # multiplying every weight by a constant (shifting log w) changes nothing;
  # rtol covers float32 rounding of l + shift at |l| ~ 1e4.
  np.testing.assert_allclose(float(_ess_j(lw + np.float32(shift), valid)), e, rtol=1e-2)
  perm = np.arange(N_H)
  rnd.shuffle(perm)
  np.testing.assert_allclose(float(_ess_j(lw[perm], valid[perm])), e, rtol=1e-5)


def test_ess_lr_scale():
  assert float(E.ess_lr_scale(0.25)) == pytest.approx(0.5)
  assert float(E.ess_lr_scale(0.25, rule="linear")) == pytest.approx(0.25)
  assert float(E.ess_lr_scale(0.8, reference=0.55)) == 1.0  # capped (review #4)
  assert float(E.ess_lr_scale(0.11, reference=0.55)) == pytest.approx(math.sqrt(0.2), rel=1e-6)
  assert float(E.ess_lr_scale(jnp.nan)) == 0.0  # the reference's min(1, nan) == 1 bug
  with pytest.raises(ValueError, match="rule"):
    E.ess_lr_scale(0.5, rule="cube")
  with pytest.raises(ValueError, match="reference"):
    E.ess_lr_scale(0.5, reference=0.0)


def test_rho_on_statistics():
  s = E.rho_on_statistics([0.9, 1.0, 0.8])
  assert s["mean"] == pytest.approx(0.9) and s["std"] == pytest.approx(0.1) and s["n"] == 3


# ---------------------------------------------------------------------------
# Importance-weight variants
# ---------------------------------------------------------------------------

L_HAND = jnp.log(jnp.array([0.25, 0.5, 1.0, 3.0, 10.0]))


@pytest.mark.parametrize(
  "variant,kw,expected",
  [
    ("none", {}, [1, 1, 1, 1, 1]),
    ("is", {}, [0.25, 0.5, 1, 3, 10]),
    ("tis", dict(c=8.0), [0.25, 0.5, 1, 3, 8]),  # upper-only: 0.25 stays
    ("clip", dict(lower=0.5, upper=2.0), [0.5, 0.5, 1, 2, 2]),
    ("mask", dict(lower=0.5, upper=2.0), [0, 0.5, 1, 0, 0]),
  ],
)
def test_importance_weights_hand_numbers(variant, kw, expected):
  np.testing.assert_allclose(E.importance_weights(L_HAND, variant, **kw), expected, rtol=1e-5)


def test_token_tis_and_geo_mask_hand_numbers():
  d = jnp.log(jnp.array([[0.5, 4.0, 1.0]]))
  np.testing.assert_allclose(E.importance_weights(d, "token_tis", c=2.0), [[0.5, 2.0, 1.0]], rtol=1e-6)
  # geometric mean per token: exp(l / L) = [1.01, 1.5, 0.9] -> keep only inside [0.95, 1.05]
  L = jnp.array([4.0, 2.0, 3.0])
  l = jnp.log(jnp.array([1.01, 1.5, 0.9])) * L
  np.testing.assert_allclose(E.importance_weights(l, "geo_mask", lower=0.95, upper=1.05, lengths_n=L), [1, 0, 0])


def test_clamp_matches_reference_and_weights_are_stop_gradient():
  w = E.importance_weights(jnp.array([25.0, -25.0]), "is")
  np.testing.assert_allclose(w, np.exp([20.0, -20.0]), rtol=1e-6)
  for v in E.WEIGHT_VARIANTS:
    kw = dict(lower=0.5, upper=2.0, lengths_n=jnp.ones(3))
    g = jax.grad(lambda l: E.importance_weights(l, v, **kw).sum())(jnp.array([0.1, 0.3, -0.2]))
    assert np.all(np.asarray(g) == 0.0), v


@HYP
@given(
  hnp.arrays(
    np.float32,
    8,
    elements=st.one_of(st.floats(width=32, allow_nan=False), st.sampled_from([np.inf, -np.inf, 1e4, -1e4])),
  )
)
@pytest.mark.slow
def test_weight_variants_are_finite_for_extreme_log_ratios(l):
  for v, spec in E.WEIGHT_VARIANTS.items():
    x = l[None, :] if spec.level == "token" else l
    w = np.asarray(E.importance_weights(x, v, c=8.0, lower=0.5, upper=2.0, lengths_n=np.full(8, 3.0)))
    assert np.all(np.isfinite(w)) and np.all(w >= 0), v


def test_importance_weights_bad_input():
  with pytest.raises(ValueError, match="variant"):
    E.importance_weights(L_HAND, "ppo")
  with pytest.raises(ValueError, match="lower"):
    E.importance_weights(L_HAND, "clip")
  with pytest.raises(ValueError, match="lengths_n"):
    E.importance_weights(L_HAND, "geo_mask", lower=0.9, upper=1.1)


# ---------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------

R16 = jnp.arange(1.0, 7.0)
G16 = jnp.array([0, 0, 0, 1, 1, 1])


def test_advantages_hand_numbers():
  # RLOO on 1..6, G = 3: r_i - mean of the other two. (Including self would
  # give [-1, 0, 1], the drgrpo numbers.)
  np.testing.assert_allclose(E.advantages(R16, G16, "rloo"), [-1.5, 0, 1.5] * 2)
  np.testing.assert_allclose(E.advantages(R16, G16, "drgrpo"), [-1, 0, 1] * 2)
  # GRPO, population std sqrt(2/3): +-1.2247 (sample std would give +-1)
  np.testing.assert_allclose(E.advantages(R16, G16, "grpo"), [-math.sqrt(1.5), 0, math.sqrt(1.5)] * 2, rtol=1e-6)
  np.testing.assert_allclose(E.advantages(R16, G16, "grpo", std="sample"), [-1, 0, 1] * 2, rtol=1e-6)
  # REINFORCE: batch-mean baseline 3.5, groups ignored
  np.testing.assert_allclose(E.advantages(R16, G16, "reinforce"), R16 - 3.5)
  np.testing.assert_allclose(E.advantages(R16, None, "reinforce"), R16 - 3.5)


def test_advantages_layout_ids_zero_std_and_validity():
  pg = E.advantages(R16.reshape(2, 3), None, "grpo")
  np.testing.assert_allclose(pg.reshape(-1), E.advantages(R16, G16, "grpo"))
  # interleaved, arbitrary ids; a zero-std group contributes nothing
  r = jnp.array([1.0, 5.0, 0.0, 5.0, 1.0, 5.0])
  g = jnp.array([7, 3, 7, 3, 7, 3])
  np.testing.assert_allclose(E.advantages(r, g, "grpo")[1::2], 0.0)
  np.testing.assert_allclose(E.advantages(r, g, "drgrpo")[0::2], [1 / 3, -2 / 3, 1 / 3], rtol=1e-6)
  valid = jnp.array([True, True, False, True, True, True])
  np.testing.assert_allclose(E.advantages(r, g, "drgrpo", valid_n=valid)[0::2], [0, 0, 0])
  with pytest.raises(ValueError, match="group_ids"):
    E.advantages(R16, None, "grpo")
  with pytest.raises(ValueError, match="estimator"):
    E.advantages(R16, G16, "ppo")


@HYP
@given(
  hnp.arrays(np.float32, 12, elements=st.floats(-5, 5, width=32)),
  hnp.arrays(np.int32, 12, elements=st.integers(0, 3)),
  st.sampled_from(sorted(E.ADVANTAGE_ESTIMATORS)),
  st.randoms(use_true_random=False),
)
@pytest.mark.slow
def test_advantages_permutation_equivariant(r, g, est, rnd):
  perm = np.arange(12)
  rnd.shuffle(perm)
  a = np.asarray(E.advantages(r, g, est))
  np.testing.assert_allclose(np.asarray(E.advantages(r[perm], g[perm], est)), a[perm], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# OPOB baseline
# ---------------------------------------------------------------------------


def test_opob_hand_numbers():
  r = jnp.array([1.0, 0.0, 0.0, 1.0])
  w = jnp.array([1.0, 2.0, 1.0, 1.0])
  s = jnp.array([1.0, 1.0, 2.0, 2.0])
  g = jnp.zeros(4, jnp.int32)
  # a = w^2 s = [1, 4, 2, 2]: b = (1 + 2) / 9
  np.testing.assert_allclose(E.opob_baseline(r, w, s, g), [1 / 3] * 4, rtol=1e-6)
  # leave-one-out: b_0 = (0*4 + 0*2 + 1*2) / 8; b_1 = (1 + 2) / 5; b_2 = 3/7; b_3 = 1/7
  np.testing.assert_allclose(E.opob_baseline(r, w, s, g, leave_one_out=True), [0.25, 0.6, 3 / 7, 1 / 7], rtol=1e-6)
  # zero mass -> unweighted mean; empty set (group of one, LOO) -> 0
  np.testing.assert_allclose(E.opob_baseline(r, jnp.zeros(4), s, g), [0.5] * 4)
  np.testing.assert_allclose(
    E.opob_baseline(r, w, s, jnp.array([0, 1, 1, 2]), leave_one_out=True), [0.0, 0.0, 0.0, 0.0]
  )
  # huge weights do not overflow (w^2 = 1e60 in float32 would)
  np.testing.assert_allclose(E.opob_baseline(r, jnp.array([1e30, 1.0, 1.0, 1.0]), s, g), [1.0] * 4)


_opob_j = jax.jit(E.opob_baseline, static_argnums=4)


@HYP
@given(
  hnp.arrays(np.float32, 10, elements=st.floats(-10, 10, width=32)),
  hnp.arrays(np.float32, 10, elements=st.one_of(st.floats(0, 1e6, width=32), st.just(0.0))),
  hnp.arrays(np.float32, 10, elements=st.floats(0, 1e3, width=32)),
  hnp.arrays(np.int32, 10, elements=st.integers(0, 2)),
  st.booleans(),
)
@pytest.mark.slow
def test_opob_within_reward_range_of_its_set(r, w, s, g, loo):
  b = np.asarray(_opob_j(r, w, s, g, loo))
  assert np.all(np.isfinite(b))
  for i in range(10):
    members = (g == g[i]) & ((np.arange(10) != i) if loo else True)
    if members.any():
      assert r[members].min() <= b[i] <= r[members].max()
    else:
      assert b[i] == 0.0


# ---------------------------------------------------------------------------
# Methods (rl.method) and presets, read by the numpy transcriptions through flat names (_Flat)
# ---------------------------------------------------------------------------

# The numpy reference below reads a Method through flat names (one attribute per option): their values where a
# method does not use them, and each part's own fields under their flat name.
FLAT_OFF = dict(opob=False, opob_scope="group", ess_lr=False, policy_loss="pg", loss_agg="seq-mean-token-mean")
FLAT_OFF.update(mask_normalizer="all", loss_norm_tokens=0, rho_on=1.0, reference_mode=False)


WEIGHT_FLAT = {"tis": "tis_", "token_tis": "token_tis_", "tis_ess": "tis_ess_", "clip": "clip_", "mask": "mask_"}
WEIGHT_FLAT["geo_mask"] = "geo_"


class _Flat:
  """A Method read through flat names (tis_c, opob_scope, rho_on, ...), for the numpy transcriptions below."""

  def __init__(self, m):
    a, w, b, lr = m.advantage, m.weights, m.baseline, m.lr
    d = dict(FLAT_OFF, advantage=a.estimator, std=a.std, std_eps=a.std_eps, log_ratio_clamp=m.log_ratio_clamp)
    d.update(is_variant=w.variant, **{WEIGHT_FLAT.get(w.variant, "") + k: v for k, v in w.params})
    if b is not None:
      d.update(opob=True, opob_weights=b.weights, opob_leave_one_out=b.leave_one_out, opob_scope=b.scope)
      d.update(length_normalize_norms=b.length_normalize_norms, reference_mode=b.reference_mode)
    if lr is not None:
      d.update(ess_lr=True, ess_rule=lr.rule, rho_on=lr.rho_on)
    if m.peer_loss is None:
      d.update(dataclasses.asdict(m.loss))
    else:
      d.update(policy_loss=m.peer_loss.name)
    self.__dict__.update(d)


def _pg(overrides=None):
  """Plain GRPO with the population std (what the tests below were written for), with config.method-tree
  overrides ({"weights": "clip", "weights.upper": 3.0}) set as on the command line."""
  c = ml_collections.ConfigDict({"method": choices.tree(E.Method(advantage=advantages_lib.grpo(std="population")))})
  choices.set_paths(c, [(f"method.{p}", v) for p, v in (overrides or {}).items()])
  return choices.build(c.method)


def test_presets_build_and_name_the_base_algorithm():
  for name in E.PRESETS:
    cfg = E.method_from_preset(name)
    assert cfg.advantage.estimator in E.ADVANTAGE_ESTIMATORS  # review #13
  v = _Flat(E.method_from_preset("vcpo"))
  assert (v.advantage, v.is_variant, v.tis_c, v.opob, v.ess_lr) == ("grpo", "tis", 8.0, True, True)
  assert E.needs_sq_norms(E.method_from_preset("vcpo")) and not E.needs_sq_norms(E.method_from_preset("seq_tis"))
  assert E.method_from_preset("vcpo", {"lr.rho_on": 0.55}).lr.rho_on == 0.55
  hash(E.method_from_preset("vcpo"))  # jit-static


@pytest.mark.parametrize(
  "kw,field",
  [
    ({"advantage": "ppo"}, "advantage"),
    ({"weights": "gspo"}, "method.weights='gspo'"),
    ({"loss.loss_agg": "sum"}, "loss_agg"),
    ({"weights": "tis", "weights.c": 0.0}, r"method\.weights\.c=0\.0"),
    ({"lr": "ess_lr", "lr.rho_on": -1.0}, r"method\.lr\.rho_on=-1\.0"),
    ({"weights": "clip", "weights.lower": 3.0}, r"method\.weights\.lower=3\.0"),
    ({"baseline": "opob", "weights": "token_tis"}, "OPOB"),
    ({"baseline": "opob", "baseline.reference_mode": True, "baseline.weights": "applied"}, "reference_mode"),
    ({"baseline": "opob", "baseline.scope": "batch"}, r"method\.baseline\.scope='batch'"),
    ({"advantage.std": "biased"}, "std"),
    ({"lr": "ess_lr", "lr.rule": "log"}, r"method\.lr\.rule='log'"),
    ({"weights.c": 4.0}, r"method\.weights\.c=4\.0: unknown field"),  # the plain method's weights have no c
  ],
)
def test_method_tree_rejects_bad_values(kw, field):
  with pytest.raises(ValueError, match=field):
    _pg(kw)
  with pytest.raises(ValueError, match="preset"):
    E.method_from_preset("vcpo2")


# ---------------------------------------------------------------------------
# The policy-gradient update: numpy reference, brute-force gradients
# ---------------------------------------------------------------------------

N, T, V, D = 12, 6, 7, 5


def logp_fn(params, batch):
  tok = batch["tokens"]  # [N, T]
  prev = jnp.concatenate([jnp.zeros_like(tok[:, :1]), tok[:, :-1]], axis=1)
  h = jnp.tanh(params["emb"][prev] + params["pos"][None])  # [N, T, D]
  logp_ntv = jax.nn.log_softmax(jnp.einsum("ntd,dv->ntv", h, params["out"]), axis=-1)
  return jnp.take_along_axis(logp_ntv, tok[..., None], axis=-1)[..., 0]


def _problem(seed=0, stale=1.0):
  k = iter(jax.random.split(jax.random.PRNGKey(seed), 10))
  params = dict(
    emb=jax.random.normal(next(k), (V, D)),
    pos=jax.random.normal(next(k), (T, D)),
    out=jax.random.normal(next(k), (D, V)),
  )
  tokens = jax.random.randint(next(k), (N, T), 0, V)
  lengths = np.array([6, 5, 3, 6, 0, 4, 6, 2, 6, 5, 1, 6])  # row 4 is padding
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  rewards = np.array([1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1], np.float32)  # group 1: zero std
  group = np.repeat(np.arange(3), 4).astype(np.int32)
  batch = dict(tokens=tokens, loss_mask=jnp.asarray(mask), rewards=jnp.asarray(rewards), group_id=jnp.asarray(group))
  # behavior log-probs: the current ones plus per-row noise of growing size, so
  # that some sequences are near on-policy and others far off (w > 8, w < 0.5)
  sigma_n = stale * jnp.linspace(0.05, 1.5, N)[jax.random.permutation(next(k), N)]
  batch["behavior_logp"] = logp_fn(params, batch) + sigma_n[:, None] * jax.random.normal(next(k), (N, T))
  return params, batch


def np_ess_target_cap(w, target, c_min=1.0):
  """The largest cap c in [c_min, max w] with ESS(min(w, c)) / n >= target, by a float64 grid search.

  rho(c) is non-increasing in c; between two consecutive sorted weights it is smooth, so the crossing
  is located on a fine log grid (no bisection: an independent route to the same number).
  """
  w = np.asarray(w, np.float64)

  def rho(c):  # c: [K] caps -> [K] ESS ratios
    x = np.minimum(w[None, :], np.asarray(c, np.float64)[:, None])
    return x.sum(1) ** 2 / (x**2).sum(1) / len(w)

  if rho([w.max()])[0] >= target or c_min >= w.max():
    return w.max()
  if rho([c_min])[0] < target:
    return c_min
  grid = np.exp(np.linspace(np.log(c_min), np.log(w.max()), 200_001))
  return grid[np.nonzero(rho(grid) >= target)[0].max()]


def _np_reference(logp, beh, mask, r, gid, sq, cfg, out=None):
  """Loop-by-loop numpy transcription of the paper's update (float64).

  Returns (coef_n, tokw_nt, rho, lr_scale): rho is the ESS ratio of the
  UNCLIPPED, UNCLAMPED weights exp(l_n) over the finite rows, lr_scale the
  paper's sqrt(min(1, rho / rho_on)) (or 1 without ESS scaling). A dict `out`
  receives the advantages A_n and the valid rows (what a policy loss reads). cfg: a Method, read by its flat
  names (_Flat).
  """
  cfg = _Flat(cfg)
  logp, beh, mask, r, sq = (np.asarray(x, np.float64) for x in (logp, beh, mask, r, sq))
  gid = np.asarray(gid)
  n = len(r)
  L = mask.sum(1)
  with np.errstate(invalid="ignore"):
    l = np.where(mask > 0, logp - beh, 0).sum(1)
  valid = (L > 0) & np.isfinite(l)  # non-finite rows are masked out
  l = np.where(valid, l, 0.0)
  clamp = cfg.log_ratio_clamp
  w = np.exp(np.clip(l, -clamp, clamp))  # the applied weights are defined with the clamp
  tokw = mask * valid[:, None]
  if cfg.is_variant == "none":
    wa = np.ones(n)
  elif cfg.is_variant == "tis":
    wa = np.minimum(w, cfg.tis_c)
  elif cfg.is_variant == "tis_ess":
    wa = np.minimum(w, np_ess_target_cap(w[valid], cfg.tis_ess_target))
  elif cfg.is_variant == "clip":
    wa = np.clip(w, cfg.clip_lower, cfg.clip_upper)
  elif cfg.is_variant == "mask":
    wa = np.where((w >= cfg.mask_lower) & (w <= cfg.mask_upper), w, 0.0)
  elif cfg.is_variant == "geo_mask":
    geo = np.exp(l / np.maximum(L, 1))
    wa = ((geo >= cfg.geo_lower) & (geo <= cfg.geo_upper)).astype(float)
  elif cfg.is_variant == "token_tis":
    wa = np.ones(n)
    d = np.where(mask > 0, logp - beh, 0)
    tokw = mask * valid[:, None] * np.minimum(np.exp(np.where(valid[:, None], d, 0)), cfg.token_tis_c)
  else:
    raise AssertionError(cfg.is_variant)
  adv = np.zeros(n)
  for i in range(n):
    if not valid[i]:
      continue
    grp = [j for j in range(n) if valid[j] and gid[j] == gid[i]]
    others = [j for j in grp if j != i]
    if cfg.advantage == "grpo":
      sigma = np.std(r[grp], ddof=0 if cfg.std == "population" else 1) if len(grp) > (cfg.std == "sample") else 0.0
      if sigma <= cfg.std_eps:
        continue
    else:
      sigma = 1.0
    b = {
      "reinforce": r[valid].mean(),
      "grpo": r[grp].mean(),
      "drgrpo": r[grp].mean(),
      "rloo": r[others].mean() if others else r[i],
    }[cfg.advantage]
    if cfg.opob:
      js = others if cfg.opob_leave_one_out else grp
      # OPOB weighs by the UNCLAMPED ratio exp(l) (the paper), or by the applied weight
      log_wb = l if cfg.opob_weights == "unclipped" else np.log(np.maximum(wa, 1e-300))
      s = sq / L.clip(1) ** 2 if cfg.length_normalize_norms else sq
      if cfg.reference_mode:
        s = s * wa**2
      log_a = np.array([2 * log_wb[j] + np.log(s[j]) for j in js])
      a = np.exp(log_a - log_a.max()) if js else np.zeros(0)
      b = (a @ r[js]) / a.sum() if a.sum() > 0 else (r[js].mean() if js else 0.0)
    adv[i] = (r[i] - b) / sigma
  rows = valid & (wa > 0) if cfg.mask_normalizer == "kept" else valid
  nv = max(rows.sum(), 1)
  norm = {
    "seq-mean-token-mean": 1.0 / (nv * L.clip(1)),
    "token-mean": np.full(n, 1.0 / max((L * rows).sum(), 1)),
    "seq-mean-token-sum": np.full(n, 1.0 / nv),
    "seq-mean-token-sum-norm": np.full(n, 1.0 / (cfg.loss_norm_tokens or mask.shape[1])),
  }[cfg.loss_agg]
  wu = np.exp(l[valid] - l[valid].max())  # unclipped, unclamped
  rho = wu.sum() ** 2 / (wu**2).sum() / valid.sum()
  rule = {"sqrt": math.sqrt, "linear": lambda x: x}[cfg.ess_rule] if cfg.ess_lr else None
  lr_scale = rule(min(1.0, rho / cfg.rho_on)) if cfg.ess_lr else 1.0
  if out is not None:
    out.update(adv=adv, valid=valid)
  return np.where(valid, adv * wa * norm, 0.0), tokw, rho, lr_scale


@jax.jit
def _grad_one(params, ex, tokw_t):
  return jax.grad(lambda p: jnp.sum(logp_fn(p, ex)[0] * tokw_t))(params)


def _single_example_grad(params, batch, i, tokw_t):
  """grad of sum_t tokw_t * logp_t for example i alone (a batch of one)."""
  return _grad_one(params, jax.tree_util.tree_map(lambda x: x[i : i + 1], batch), tokw_t)


def _loop_score_sq_norms(params, batch):
  return np.array(
    [
      float(
        sum(
          jnp.sum(g**2)
          for g in jax.tree_util.tree_leaves(_single_example_grad(params, batch, i, batch["loss_mask"][i]))
        )
      )
      for i in range(N)
    ]
  )


@pytest.fixture(scope="module")
def problem():
  params, batch = _problem()
  return params, batch, logp_fn(params, batch), _loop_score_sq_norms(params, batch)


# The gradient driver lives in the learner; its reference path checks these coefficients end to end.
_pg_jit = jax.jit(learner.policy_gradient("vmap"), static_argnums=(0, 3))
_coef_jit = jax.jit(E.pg_coefficients, static_argnums=6)
_tokw_jit = jax.jit(E.pg_token_weights, static_argnums=3)

VCPO_CFG = E.method_from_preset("vcpo")
EXTRA_CONFIGS = {
  "rloo_opob_minibatch_token_mean": {
    "advantage": "rloo",
    "weights": "clip",
    "baseline": "opob",
    "baseline.scope": "minibatch",
    "loss.loss_agg": "token-mean",
  },
  "reinforce_lennorm_seqsum": {
    "advantage": "reinforce",
    "weights": "mask",
    "baseline": "opob",
    "baseline.length_normalize_norms": True,
    "loss.loss_agg": "seq-mean-token-sum",
  },
  "drgrpo_token_tis": {"advantage": "drgrpo", "weights": "token_tis", "loss.loss_agg": "seq-mean-token-sum"},
  "mask_kept_token_mean": {
    "weights": "mask",
    "loss.mask_normalizer": "kept",
    "loss.loss_agg": "token-mean",
    "advantage.std": "sample",
  },
  "geo_mask_kept": {"weights": "geo_mask", "weights.lower": 0.6, "weights.upper": 1.6, "loss.mask_normalizer": "kept"},
  "drgrpo_token_sum_norm": {"advantage": "drgrpo", "weights": "tis", "loss.loss_agg": "seq-mean-token-sum-norm"},
  "rloo_token_sum_norm_fixed_t": {
    "advantage": "rloo",
    "loss.loss_agg": "seq-mean-token-sum-norm",
    "loss.loss_norm_tokens": 64,
  },
  # the lr rule, its rho_on, the clamp, the truncation and std_eps at non-default values
  "tis3_linear_rho06_clamp2": {
    "weights": "tis",
    "weights.c": 3.0,
    "baseline": "opob",
    "lr": "ess_lr",
    "lr.rule": "linear",
    "lr.rho_on": 0.6,
    "log_ratio_clamp": 2.0,
  },
  "clip_wide_std_eps": {
    "weights": "clip",
    "weights.lower": 0.2,
    "weights.upper": 5.0,
    "advantage.std": "sample",
    "advantage.std_eps": 0.3,
  },
}
ALL_CONFIGS = {
  **{k: E.method_from_preset(k) for k in E.PRESETS},
  **{k: _pg(v) for k, v in EXTRA_CONFIGS.items()},
}
# this synthetic batch is far more stale per token than an LLM's: widen the
# geometric-mean interval so that some sequences survive
ALL_CONFIGS["geo_mask"] = E.method_from_preset("geo_mask", {"weights.lower": 0.6, "weights.upper": 1.6})


def _coefficients(batch, logp, sq, cfg):
  """(coef [N], aux) of the jitted estimator on `batch` with the current log-probs `logp` [N, T], the exact
  per-example squared norms `sq` [N] and the method `cfg`."""
  b = batch
  return _coef_jit(logp, b["behavior_logp"], b["loss_mask"], b["rewards"], b["group_id"], jnp.asarray(sq), cfg)


@pytest.mark.parametrize("name", [n for n in ALL_CONFIGS if _Flat(ALL_CONFIGS[n]).opob_scope == "group"])
@pytest.mark.slow
def test_coefficients_match_numpy_reference(problem, name):
  params, batch, logp, sq = problem
  cfg = ALL_CONFIGS[name]
  coef, aux = _coefficients(batch, logp, sq, cfg)
  ref, tokw, rho, lr_scale = _np_reference(
    logp, batch["behavior_logp"], batch["loss_mask"], batch["rewards"], batch["group_id"], sq, cfg
  )
  np.testing.assert_allclose(np.asarray(coef), ref, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(
    np.asarray(_tokw_jit(logp, batch["behavior_logp"], batch["loss_mask"], cfg)), tokw, rtol=1e-5
  )
  # the brake: ESS of the unclipped weights (mutant: of the clipped ones) and the rate it gives
  assert float(aux["ess_ratio"]) == pytest.approx(rho, rel=1e-5)
  assert float(aux["lr_scale"]) == pytest.approx(lr_scale, rel=1e-5)
  assert float(aux["n_valid"]) == N - 1 and not bool(aux["valid_n"][4]) and float(aux["nonfinite_rows"]) == 0


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
@pytest.mark.slow
def test_policy_gradient_equals_brute_force(problem, name):
  params, batch, logp, sq = problem
  cfg = ALL_CONFIGS[name]
  grads, metrics = _pg_jit(logp_fn, params, batch, cfg)
  if cfg.peer_loss is not None:
    _assert_policy_loss_gradient(problem, cfg, grads, metrics)
    return
  # coefficients from exact loop norms (not the vmap path), then one example at a time
  coef, _ = _coefficients(batch, logp, sq, cfg)
  tokw = _tokw_jit(logp, batch["behavior_logp"], batch["loss_mask"], cfg)
  brute = jax.tree_util.tree_map(lambda p: np.zeros(p.shape, np.float64), params)
  for i in range(N):
    g = _single_example_grad(params, batch, i, tokw[i])
    brute = jax.tree_util.tree_map(lambda a, b: a - float(coef[i]) * np.asarray(b), brute, g)
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(brute))
  assert scale > 0
  for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(brute)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * scale)
  surrogate = -float(jnp.sum(coef[:, None] * tokw * logp))
  assert float(metrics["pg_loss"]) == pytest.approx(surrogate, rel=1e-5, abs=1e-7)


def _assert_policy_loss_gradient(problem, cfg, grads, metrics):
  """A policy-loss preset (issue 13): the gradient equals the chain rule through the numpy transcription.

  The loss is tests/test_policy_losses' float64 transcription of the source's formula, fed with the numpy
  reference's advantages and pi_old = pi_theta (one update per step); d loss / d logp_nt by central
  finite differences of it, then sum_n grad_params sum_t (d loss / d logp_nt) logp_nt, one example at a
  time. No code of vcpo_jax.policy_losses is on this side.
  """
  params, batch, logp, sq = problem
  ref = TPL.REFS[cfg.peer_loss.name]
  info = {}
  _np_reference(logp, batch["behavior_logp"], batch["loss_mask"], batch["rewards"], batch["group_id"], sq, cfg, info)
  lp = np.asarray(logp, np.float64)
  beh = np.asarray(batch["behavior_logp"], np.float64)
  mask = np.asarray(batch["loss_mask"], np.float64) * info["valid"][:, None]
  adv = np.broadcast_to(info["adv"][:, None], lp.shape)
  cot = TPL.fd_grad(ref, lp, lp, beh, adv, mask)  # d loss / d logp_nt
  brute = jax.tree_util.tree_map(lambda p: np.zeros(p.shape, np.float64), params)
  for i in range(N):
    g = _single_example_grad(params, batch, i, jnp.asarray(cot[i], jnp.float32))
    brute = jax.tree_util.tree_map(lambda a, b: a + np.asarray(b), brute, g)
  scale = max(float(np.max(np.abs(x))) for x in jax.tree_util.tree_leaves(brute))
  assert scale > 0
  for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(brute)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-4 * scale)
  assert float(metrics["pg_loss"]) == pytest.approx(ref(lp, lp, lp, beh, adv, mask), rel=1e-4, abs=1e-6)
  # every method reports the ESS of its log-ratio l_n = sum_t log pi_theta - log mu, like VCPO
  vcpo_aux = _coefficients(batch, logp, sq, VCPO_CFG)[1]
  assert float(metrics["ess_ratio"]) == pytest.approx(float(vcpo_aux["ess_ratio"]), rel=1e-6)
  assert float(metrics["loss/ess_ratio"]) == pytest.approx(float(vcpo_aux["ess_ratio"]), rel=1e-5)


# ---------------------------------------------------------------------------
# Hand-checked numbers of issue 12 (items 1, 3, 4, 5, 15)
# ---------------------------------------------------------------------------


def _seq_batch(l_n, length=1):
  """logp / behavior / mask [N, length] whose sequence log-ratios are l_n."""
  l_n = np.asarray(l_n, np.float32)
  logp = np.repeat((l_n / length)[:, None], length, axis=1).astype(np.float32)
  return jnp.asarray(logp), jnp.zeros_like(logp), jnp.ones_like(logp)


def test_opob_weighs_by_the_unclamped_ratio_worked_example():
  # Issue 12 item 1: one group, l = [25, 30, -1, 0], R = [1, 0, 1, 0], ||s||^2 = 100, L = 10.
  # log a = 2 l + log 100: the l = 30 row dominates, so b = (e^50 + e^-2) / (e^50 + e^60 + e^-2 + 1)
  # = 4.54e-5. sigma (population) = 0.5, w~ = min(exp(clamp(l)), 8) = [8, 8, e^-1, 1], 1 / (N L) = 1/40:
  # coef = 2 (R - b) w~ / 40 = [0.4, -1.8e-5, 0.0184, -2.3e-6].
  # (Clamping l at 20 before the baseline, the bug, gives b = 0.5 and [0.2, -0.2, 0.0092, -0.025].)
  logp, beh, mask = _seq_batch([25.0, 30.0, -1.0, 0.0], length=10)
  r = jnp.array([1.0, 0.0, 1.0, 0.0])
  coef, aux = _coef_jit(logp, beh, mask, r, jnp.zeros(4, jnp.int32), jnp.full(4, 100.0), E.method_from_preset("vcpo"))
  b = (math.exp(50) + math.exp(-2)) / (math.exp(50) + math.exp(60) + math.exp(-2) + 1)
  assert b == pytest.approx(4.54e-5, rel=1e-3)
  np.testing.assert_allclose(aux["baseline_n"], [b] * 4, rtol=1e-4)
  expected = [2 * (1 - b) * 8 / 40, -2 * b * 8 / 40, 2 * (1 - b) * math.exp(-1) / 40, -2 * b / 40]
  np.testing.assert_allclose(coef, expected, rtol=1e-4)
  np.testing.assert_allclose(coef, [0.4, 0.0, 0.018, 0.0], atol=5e-4)
  # opob_baseline itself: log weights in, no overflow (exp(60) is finite but exp(2 * 60) is not in float32)
  lw = jnp.array([25.0, 30.0, -1.0, 0.0])
  np.testing.assert_allclose(
    E.opob_baseline(r, None, jnp.full(4, 100.0), jnp.zeros(4, jnp.int32), log_weights_n=lw), [b] * 4, rtol=1e-4
  )
  with pytest.raises(ValueError, match="exactly one"):
    E.opob_baseline(r, jnp.ones(4), jnp.ones(4), jnp.zeros(4, jnp.int32), log_weights_n=lw)
  # applied-weight OPOB keeps the clamp-defined weights: w~ = [8, 8, e^-1, 1] -> b = (64 + e^-2) / (128 + e^-2 + 1)
  _, aux_a = _coef_jit(
    logp, beh, mask, r, jnp.zeros(4, jnp.int32), jnp.full(4, 100.0), E.method_from_preset("vcpo_applied_opob")
  )
  ba = (64 + math.exp(-2)) / (129 + math.exp(-2))
  np.testing.assert_allclose(aux_a["baseline_n"], [ba] * 4, rtol=1e-5)


def test_ess_brake_uses_the_unclipped_weights_hand_numbers():
  # Issue 12 item 15b: l = [3, 0, 0, 0], c = 8. Unclipped: w = [e^3, 1, 1, 1],
  # ESS / N = (e^3 + 3)^2 / (e^6 + 3) / 4 = 0.3279; clipped w = [8, 1, 1, 1] would give 121 / 67 / 4 = 0.4515.
  logp, beh, mask = _seq_batch([3.0, 0.0, 0.0, 0.0])
  cfg = E.method_from_preset("vcpo")
  _, aux = _coef_jit(logp, beh, mask, jnp.array([1.0, 0, 1, 0]), jnp.zeros(4, jnp.int32), jnp.ones(4), cfg)
  rho = (math.exp(3) + 3) ** 2 / (math.exp(6) + 3) / 4
  assert rho == pytest.approx(0.328, abs=5e-4)
  assert float(aux["ess_ratio"]) == pytest.approx(rho, rel=1e-5)
  assert float(aux["ess_ratio_applied"]) == pytest.approx(121 / 67 / 4, rel=1e-5)  # the clipped one, reported apart
  assert float(aux["lr_scale"]) == pytest.approx(math.sqrt(rho), rel=1e-5)


def test_grpo_group_with_std_below_eps_contributes_nothing():
  # Issue 12 item 15c: 0 < std <= std_eps -> A = 0 (a bug testing std > 0 would give A = +-1).
  r = jnp.array([0.0, 0.1, 0.0, 0.3])  # group 0: population std 0.05; group 1: 0.15
  g = jnp.array([0, 0, 1, 1])
  np.testing.assert_allclose(E.advantages(r, g, "grpo", std_eps=0.1), [0, 0, -1, 1], rtol=1e-5)
  np.testing.assert_allclose(E.advantages(r, g, "grpo", std_eps=0.01), [-1, 1, -1, 1], rtol=1e-5)
  # at the default eps 1e-6: a float32 group [1, 1 + 1.5e-6] has std ~7e-7
  r2 = jnp.array([1.0, 1.0 + 1.5e-6], jnp.float32)
  assert 0 < float(jnp.std(r2)) <= 1e-6
  np.testing.assert_allclose(E.advantages(r2, jnp.zeros(2, jnp.int32), "grpo"), [0.0, 0.0])
  # through pg_coefficients: that group's coefficients are 0, the other group's are not
  logp, beh, mask = _seq_batch(np.zeros(4))
  coef, _ = _coef_jit(logp, beh, mask, r, g, None, E.method_from_preset("sync", {"advantage.std_eps": 0.1}))
  assert np.all(np.asarray(coef)[:2] == 0) and np.all(np.asarray(coef)[2:] != 0)


def test_grpo_std_is_explicit_per_preset():
  # Issue 12 item 3: the reference's GRPO divides by torch.std (sample, ddof 1); its OPOB path by the
  # population std. At G = 2, R = [0, 1]: sample std 0.7071 -> A = +-0.7071; population 0.5 -> A = +-1.
  for name, m in E.PRESETS.items():
    want = "population" if m.baseline is not None else "sample"
    assert m.advantage.std == want, name
  logp, beh, mask = _seq_batch(np.zeros(2))
  r, g = jnp.array([0.0, 1.0]), jnp.zeros(2, jnp.int32)
  _, a_sync = _coef_jit(logp, beh, mask, r, g, None, E.method_from_preset("sync"))
  np.testing.assert_allclose(a_sync["advantage_n"], [-math.sqrt(0.5), math.sqrt(0.5)], rtol=1e-6)
  _, a_vcpo = _coef_jit(logp, beh, mask, r, g, jnp.ones(2), E.method_from_preset("vcpo"))
  np.testing.assert_allclose(a_vcpo["advantage_n"], [-1.0, 1.0], rtol=1e-6)  # equal norms: b = mean


@pytest.mark.parametrize(
  "loss_agg,normalizer,expected",
  [
    # mask [0.5, 2]: w = [1, 1.5, 4, 0.25] -> rows 2, 3 rejected. A = (R - 0.5) / 0.5774 (sample std) = +-0.866.
    # L = [2, 4, 2, 4], T = 4. coef = A * w * norm:
    ("seq-mean-token-mean", "all", [0.866 / 8, -0.866 * 1.5 / 16, 0, 0]),  # 1 / (4 L)
    ("seq-mean-token-mean", "kept", [0.866 / 4, -0.866 * 1.5 / 8, 0, 0]),  # 1 / (2 L)
    ("token-mean", "all", [0.866 / 12, -0.866 * 1.5 / 12, 0, 0]),  # 1 / 12 tokens
    ("token-mean", "kept", [0.866 / 6, -0.866 * 1.5 / 6, 0, 0]),  # 1 / 6 kept tokens
    ("seq-mean-token-sum", "kept", [0.866 / 2, -0.866 * 1.5 / 2, 0, 0]),
    ("seq-mean-token-sum-norm", "all", [0.866 / 4, -0.866 * 1.5 / 4, 0, 0]),  # 1 / T, a sum over rows
    ("seq-mean-token-sum-norm", "kept", [0.866 / 4, -0.866 * 1.5 / 4, 0, 0]),  # no count: unchanged
  ],
)
@pytest.mark.slow
def test_mask_normalizer_and_aggregations_hand_numbers(loss_agg, normalizer, expected):
  L = np.array([2, 4, 2, 4])
  l_n = np.log([1.0, 1.5, 4.0, 0.25])
  logp = np.where(np.arange(4)[None] < L[:, None], (l_n / L)[:, None], 0.0).astype(np.float32)
  mask = (np.arange(4)[None] < L[:, None]).astype(np.float32)
  cfg = E.method_from_preset("mask", {"loss.loss_agg": loss_agg, "loss.mask_normalizer": normalizer})
  r = jnp.array([1.0, 0.0, 1.0, 0.0])
  coef, _ = _coef_jit(jnp.asarray(logp), jnp.zeros((4, 4)), jnp.asarray(mask), r, jnp.zeros(4, jnp.int32), None, cfg)
  a = 0.5 / np.std([1.0, 0, 1, 0], ddof=1)
  assert a == pytest.approx(0.866, abs=1e-3)
  np.testing.assert_allclose(coef, np.asarray(expected) * a / 0.866, rtol=1e-5)


def test_surrogate_fields_bad_values():
  with pytest.raises(ValueError, match="mask_normalizer"):
    _pg({"loss.mask_normalizer": "rejected"})
  with pytest.raises(ValueError, match="loss_norm_tokens"):
    _pg({"loss.loss_norm_tokens": -1})


def test_nonfinite_log_ratios_are_masked_out_and_counted():
  # Issue 12 item 5: rows with l = NaN, +inf, -inf (a corrupt behavior log-prob, an overflow) are
  # masked out like padding, counted in nonfinite_rows; ESS stays in [1/n, 1] over the finite rows.
  _, batch = _problem(seed=1)
  beh = np.array(batch["behavior_logp"])
  beh[0, 1], beh[5, 0], beh[9, 2] = np.nan, -np.inf, np.inf  # l_0 = nan, l_5 = +inf, l_9 = -inf
  bad = dict(batch, behavior_logp=jnp.asarray(beh))
  pad = dict(batch, loss_mask=batch["loss_mask"].at[jnp.array([0, 5, 9])].set(0.0))
  params, _ = _problem(seed=1)
  for name in ("vcpo", "seq_tis", "token_tis", "mask", "sync"):
    cfg = E.method_from_preset(name)
    g_bad, m_bad = _pg_jit(logp_fn, params, bad, cfg)
    g_pad, m_pad = _pg_jit(logp_fn, params, pad, cfg)
    assert float(m_bad["nonfinite_rows"]) == 3 and float(m_pad["nonfinite_rows"]) == 0, name
    assert not np.any(np.asarray(m_bad["valid_n"])[[0, 5, 9]]), name
    for k in ("ess_ratio", "lr_scale", "pg_loss", "n_valid", "adv_std"):
      assert np.isfinite(float(m_bad[k])), (name, k)
      assert float(m_bad[k]) == pytest.approx(float(m_pad[k]), rel=1e-5, abs=1e-7), (name, k)
    assert 1 / 8 <= float(m_bad["ess_ratio"]) <= 1 and 0 <= float(m_bad["lr_scale"]) <= 1, name
    for a, b in zip(jax.tree_util.tree_leaves(g_bad), jax.tree_util.tree_leaves(g_pad)):
      assert np.all(np.isfinite(np.asarray(a))), name
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  # ess itself: a NaN / +inf log-weight is excluded, not an ESS of 0 (and lr scale 0)
  assert float(E.ess_ratio(jnp.array([0.0, 0.0, jnp.inf, jnp.nan]))) == pytest.approx(1.0)
  assert float(E.ess(jnp.array([0.0, jnp.log(2.0), jnp.inf]))) == pytest.approx(9 / 5, rel=1e-6)


def test_problem_exercises_the_weight_variants(problem):
  _, batch, logp, sq = problem
  aux = {n: _coefficients(batch, logp, sq, ALL_CONFIGS[n])[1] for n in ("seq_tis", "mask", "clip", "token_tis", "vcpo")}
  assert float(aux["seq_tis"]["frac_clipped"]) > 0  # some w > 8 on this stale batch
  assert 0 < float(aux["mask"]["frac_masked"]) < 1
  assert float(aux["clip"]["frac_clipped"]) > 0 and float(aux["token_tis"]["frac_clipped"]) > 0
  v = aux["vcpo"]
  assert float(v["ess_ratio"]) < 0.9 and 0 < float(v["lr_scale"]) < 1
  assert float(v["lr_scale"]) == pytest.approx(math.sqrt(float(v["ess_ratio"])), rel=1e-6)


def _coefs(batch, logp, sq, cfg):
  return np.asarray(_coefficients(batch, logp, sq, cfg)[0])


def test_on_policy_invariants(problem):
  params, batch, logp, sq = problem
  on = dict(batch, behavior_logp=logp)
  c = {n: _coefs(on, logp, sq, E.method_from_preset(n)) for n in E.PRESETS if n != "geo_mask"}
  _, aux = _coefficients(on, logp, sq, E.method_from_preset("vcpo"))
  assert float(aux["ess_ratio"]) == pytest.approx(1.0) and float(aux["lr_scale"]) == 1.0
  # k = 0: every IS variant is the identity; VCPO equals GRPO with the OPOB baseline
  for n in ("none", "seq_tis", "clip", "mask", "token_tis", "vcpo_no_opob"):
    np.testing.assert_allclose(c[n], c["sync"], rtol=1e-6, atol=1e-9)
  grpo_opob = _coefs(on, logp, sq, _pg({"advantage": "grpo", "baseline": "opob", "advantage.std": "population"}))
  for n in ("vcpo", "vcpo_no_esslr", "vcpo_applied_opob", "vcpo_reference"):
    np.testing.assert_allclose(c[n], grpo_opob, rtol=1e-6, atol=1e-9)
  # OPOB with equal norms and unit weights is the group mean: VCPO == GRPO with VCPO's (population) std
  sync_pop = _coefs(on, logp, sq, E.method_from_preset("sync", {"advantage.std": "population"}))
  np.testing.assert_allclose(_coefs(on, logp, np.ones(N), E.method_from_preset("vcpo")), sync_pop, rtol=1e-5, atol=1e-8)
  assert np.abs(c["vcpo"] - sync_pop).max() > 1e-4  # unequal norms do change the baseline


def test_vcpo_knobs_off_equals_base_estimator(problem):
  _, batch, logp, sq = problem
  seq_tis = _coefs(batch, logp, sq, E.method_from_preset("seq_tis"))
  off = E.method_from_preset("vcpo", {"baseline": "none", "lr": "constant", "advantage.std": "sample"})
  np.testing.assert_allclose(_coefs(batch, logp, sq, off), seq_tis)
  # the preset without OPOB runs the reference's GRPO advantage (sample std): seq_tis + the ESS brake
  np.testing.assert_allclose(_coefs(batch, logp, sq, E.method_from_preset("vcpo_no_opob")), seq_tis)


def test_coefficients_permutation_within_group(problem):
  _, batch, logp, sq = problem
  perm = np.array([3, 1, 0, 2, 4, 7, 5, 6, 11, 8, 10, 9])  # permutes within groups
  pb = jax.tree_util.tree_map(lambda x: x[perm], dict(batch))
  cfg = E.method_from_preset("vcpo_loo_opob")
  np.testing.assert_allclose(
    _coefs(pb, logp[perm], sq[perm], cfg), _coefs(batch, logp, sq, cfg)[perm], rtol=1e-6, atol=1e-9
  )


def test_pg_bad_input():
  params, batch = _problem()
  with pytest.raises(ValueError, match="group_id"):
    learner.policy_gradient("vmap")(logp_fn, params, {k: v for k, v in batch.items() if k != "group_id"}, _pg())
  with pytest.raises(ValueError, match="sq_score_norms_n"):
    E.pg_coefficients(
      batch["behavior_logp"],
      batch["behavior_logp"],
      batch["loss_mask"],
      batch["rewards"],
      batch["group_id"],
      None,
      E.method_from_preset("vcpo"),
    )


# ---------------------------------------------------------------------------
# Monte Carlo on a softmax bandit: bias of OPOB (LOO vs plug-in), variance
# ---------------------------------------------------------------------------


def _bandit_updates(cfg, theta, mu_logits, p_reward, key, n_batches, g):
  """[n_batches, K] updates sum_n coef_n * grad log pi(a_n), one group of g each."""
  k = theta.shape[0]
  logpi = jax.nn.log_softmax(theta)
  logmu = jax.nn.log_softmax(mu_logits)
  pi = jnp.exp(logpi)

  def one(key):
    ka, kr = jax.random.split(key)
    a = jax.random.categorical(ka, logmu, shape=(g,))
    rew = jax.random.bernoulli(kr, p_reward[a]).astype(jnp.float32)
    score = jax.nn.one_hot(a, k) - pi  # grad_theta log pi(a)
    sq = jnp.sum(score**2, axis=1)
    coef, _ = E.pg_coefficients(
      logpi[a][:, None], logmu[a][:, None], jnp.ones((g, 1)), rew, jnp.zeros(g, jnp.int32), sq, cfg
    )
    return coef @ score

  return jax.jit(jax.vmap(one))(jax.random.split(key, n_batches))


@pytest.mark.slow
def test_bandit_loo_opob_is_unbiased_and_plugin_bias_is_reported():
  theta = jnp.array([0.5, -0.3, 1.0, 0.0, -1.0])
  mu_logits = jnp.array([-0.5, 0.4, 0.0, 0.6, 0.2])  # behavior policy differs from the target
  p = jnp.array([0.9, 0.2, 0.6, 0.4, 0.1])
  exact = np.asarray(jax.grad(lambda t: jnp.sum(jax.nn.softmax(t) * p))(theta))
  base = {"advantage": "drgrpo", "weights": "is", "baseline": "opob", "loss.loss_agg": "seq-mean-token-sum"}
  m = 20000
  key = jax.random.PRNGKey(7)
  results = {}
  for name, loo in (("loo", True), ("plugin", False)):
    u = np.asarray(
      _bandit_updates(_pg({**base, "baseline.leave_one_out": loo}), theta, mu_logits, p, key, m, 8), np.float64
    )
    mean, se = u.mean(0), u.std(0, ddof=1) / math.sqrt(m)
    results[name] = (mean - exact) / se
    print(f"{name:7s} OPOB: mean-exact = {np.round(mean - exact, 5)}, z = {np.round(results[name], 2)}")
  assert np.all(np.abs(results["loo"]) < 3.0), results["loo"]


def test_heavy_tailed_variance_applied_opob_not_worse_than_group_mean():
  theta = jnp.array([2.0, 0.0, -1.0, 1.0, -2.0, 0.5])
  mu_logits = jnp.array([-2.0, 1.0, 1.0, -1.0, 2.0, 0.0])  # rare-under-mu arms carry big weights
  p = jnp.array([0.8, 0.3, 0.5, 0.7, 0.1, 0.4])
  base = {"advantage": "drgrpo", "weights": "tis", "weights.c": 8.0, "loss.loss_agg": "seq-mean-token-sum"}
  key = jax.random.PRNGKey(3)
  var = {}
  for name, extra in (
    ("group_mean", {"baseline": "none"}),
    ("opob_applied", {"baseline": "opob", "baseline.weights": "applied"}),
  ):
    u = np.asarray(_bandit_updates(_pg({**base, **extra}), theta, mu_logits, p, key, 8000, 8), np.float64)
    var[name] = float(np.sum(u.var(0)))
  print("total update variance:", var)
  assert var["opob_applied"] <= var["group_mean"]


def test_policy_gradient_compiles_once_per_config(problem):
  params, batch, _, _ = problem
  traces = []

  def counted(fn, params, batch, cfg):
    traces.append(cfg)  # runs only when jax traces (compiles)
    return learner.policy_gradient("vmap")(fn, params, batch, cfg)

  pg = jax.jit(counted, static_argnums=(0, 3))
  pg(logp_fn, params, batch, E.method_from_preset("vcpo"))
  new = dict(batch, rewards=1.0 - batch["rewards"])
  pg(logp_fn, params, new, E.method_from_preset("vcpo"))  # equal config by value: cache hit
  assert len(traces) == 1
  pg(logp_fn, params, new, E.method_from_preset("vcpo", {"lr.rho_on": 0.5}))
  assert len(traces) == 2


def test_every_registry_entry_has_a_doc_string():
  """Weight variants, advantage estimators, aggregations, policy losses and presets: each name documented,
  and the preset docs name exactly the presets (no drift)."""
  from vcpo_jax import policy_losses

  for registry in (E.WEIGHT_VARIANTS, E.ADVANTAGE_ESTIMATORS, E.LOSS_AGGREGATIONS, policy_losses.POLICY_LOSSES):
    empty = [name for name, entry in registry.items() if not entry.doc.strip()]
    assert not empty, empty
  assert set(E.PRESET_DOCS) <= set(E.PRESETS)  # a line for a preset that exists
  assert all(presets.preset_doc(name).strip() for name in E.PRESETS)
  assert "weights.lower" in E.PRESET_DOCS["geo_mask"]  # names its fields by their config path
