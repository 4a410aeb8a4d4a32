"""Tests of vcpo_jax.policy_losses: each loss against a direct numpy transcription of its source's formula
(values, and gradients against central finite differences of the transcription in float64), hand-checked
small cases, stop-gradient checks, and the reduction to the plain policy gradient when every ratio is 1.

The numpy references take the current log-probs twice: `lp` (differentiated) and `lps` (the value seen
through a stop-gradient). Finite differences move `lp` only, which is what stop_gradient means.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import policy_losses as P

# ---------------------------------------------------------------------------
# numpy transcriptions (written from the sources' formulas, float64)
# ---------------------------------------------------------------------------


def np_agg(loss_nt, mask, mode):
  mask = mask.astype(np.float64)
  L = mask.sum(1)
  valid = L > 0
  n = max(valid.sum(), 1)
  if mode == "token-mean":
    return (loss_nt * mask).sum() / max(mask.sum(), 1.0)
  if mode == "seq-mean-token-mean":
    return sum((loss_nt[i] * mask[i]).sum() / L[i] for i in range(len(L)) if valid[i]) / n
  if mode == "seq-mean-token-sum":
    return (loss_nt * mask).sum() / n
  raise AssertionError(mode)


def np_ppo_tokens(log_r, A, el, eh, c=None):
  r = np.exp(log_r)
  pg = np.maximum(-A * r, -A * np.clip(r, 1 - el, 1 + eh))
  if c is not None:
    pg = np.where(A < 0, np.minimum(pg, -A * c), pg)
  return pg


def ref_ppo_clip(lp, lps, old, beh, A, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=None, loss_agg="token-mean"):
  return np_agg(np_ppo_tokens(np.clip(lp - old, -20, 20), A, eps_low, eps_high, dual_clip_c), mask, loss_agg)


def ref_decoupled(lp, lps, prox, beh, A, mask, eps_low=0.2, eps_high=0.2, c=None, cap=None, versions=None):
  if versions is not None:
    v_mu, v_theta = versions
    v_mu = np.broadcast_to(np.asarray(v_mu, np.float64)[:, None], lp.shape)
    diff = v_theta - v_mu
    alpha = np.where(diff > 0, (v_theta - 1 - v_mu) / np.where(diff > 0, diff, 1), 0.0).clip(0, 1)
    prox = beh + alpha * (lps - beh)
  r = np.exp(lp - prox)
  pg = np.maximum(-A * r, -A * np.clip(r, 1 - eps_low, 1 + eps_high))
  if c is not None:
    pg = np.minimum(pg, np.sign(A) * c * A)
  bw = np.exp(prox - beh)
  bmask = (mask > 0) if cap is None else (mask > 0) & (bw <= cap)
  return np_agg(pg * np.where(bmask, bw, 0.0), mask, "token-mean")


def ref_gspo(lp, lps, old, beh, A, mask, eps_low=3e-4, eps_high=4e-4):
  L = np.maximum(mask.sum(1), 1)
  log_s = ((lps - old) * mask).sum(1) / L
  s_nt = np.exp(np.minimum(lp - lps + log_s[:, None], 10.0))
  return np_agg(np.maximum(-A * s_nt, -A * np.clip(s_nt, 1 - eps_low, 1 + eps_high)), mask, "seq-mean-token-mean")


def ref_cispo(lp, lps, old, beh, A, mask, eps_low=10.0, eps_high=0.2):
  w = np.clip(np.exp(np.clip(lps - old, -20, 20)), 1 - eps_low, 1 + eps_high)
  return np_agg(-w * A * lp, mask, "token-mean")


def ref_m2po_keep(m2, mask, budget):
  """AReaL _apply_m2po_masking / _get_m2po_loss_mask, a loop transcription."""
  flat_mask = mask.reshape(-1) > 0
  sel = m2.reshape(-1)[flat_mask]
  keep_sel = np.ones(sel.shape, bool)
  n = sel.size
  if n:
    order = np.argsort(-sel, kind="stable")
    s = sel[order]
    num_to_mask = n - 1
    for i in range(n):
      if s[i:].sum() / (n - i) < budget:
        num_to_mask = i
        break
    sorted_keep = np.ones(n, bool)
    sorted_keep[:num_to_mask] = False
    keep_sel[order] = sorted_keep
  keep = np.zeros(flat_mask.shape, bool)
  keep[flat_mask] = keep_sel
  return keep.reshape(mask.shape)


def ref_m2po_paper(lp, lps, old, beh, A, mask, budget=0.04):
  keep = ref_m2po_keep((old - beh) ** 2, mask, budget)
  return np_agg(np.where(keep, -np.exp(lp - beh) * A, 0.0), mask, "token-mean")


def ref_m2po_bounds(lps, beh, A, mask, budget, min_low, min_high):
  """kpo_clip_harmful_tokens + _solve_tau_from_sorted_delta2 + the miniclip floors, a loop transcription."""
  delta = beh - lps
  r = np.exp(-delta)
  harm = (mask > 0) & (((A > 1e-12) & (r > 1 + 1e-12)) | ((A < -1e-12) & (r < 1 - 1e-12)))
  v = np.sort(delta[harm] ** 2)
  n = v.size
  lo, hi = 0.0, 1e5
  if n and v.mean() > budget:
    target = budget * n
    csum = np.cumsum(v)
    tau = None
    for k in range(n):
      if v[k] * (n - k - 1) + csum[k] >= target:
        tau = 0.0 if k == 0 else math.sqrt(v[k - 1])
        break
    lo, hi = math.exp(-tau), math.exp(tau)
  el, eh = 1 - lo, hi - 1
  if min_low is not None and el < min_low:
    el = min_low
  if min_high is not None and eh < min_high:
    eh = min_high
  return el, eh


def ref_m2po_released(lp, lps, old, beh, A, mask, budget=0.04, min_eps_low=0.3, min_eps_high=0.5):
  el, eh = ref_m2po_bounds(lps, beh, A, mask, budget, min_eps_low, min_eps_high)
  r = np.exp(lp - beh)
  return np_agg(np.maximum(-A * r, -A * np.clip(r, 1 - el, 1 + eh)), mask, "token-mean")


def ref_icepop(lp, lps, old, beh, A, mask, lower=0.5, upper=5.0):
  rho = np.exp(old - beh)
  w = np.where((rho >= lower) & (rho <= upper), rho, 0.0)
  return np_agg(w * np_ppo_tokens(np.clip(lp - old, -20, 20), A, 0.2, 0.2), mask, "seq-mean-token-mean")


def ref_dppo_tv(lp, lps, old, beh, A, mask, lo=0.2, hi=0.2, kl_tau=1e-3):
  diff = np.exp(lps) - np.exp(beh)
  invalid = np.where(A > 0, diff > hi, diff < -lo)
  keep = (mask > 0) & ~invalid
  lr = lp - beh
  total = (-keep.astype(np.float64) * A * np.exp(lr) + kl_tau * (mask > 0) * lr**2).sum()
  return total / max(mask.sum(), 1)


def ref_ipo(lp, lps, old, beh, A, mask, thr=0.1, kl_tau=1e-3):
  """prime-rl ipo_loss_fn: |p - q| > thr masked (either sign), -keep A r + kl_tau (log r)^2, sum / #tokens."""
  keep = (mask > 0) & ~(np.abs(np.exp(lps) - np.exp(beh)) > thr)
  lr = lp - beh
  total = (-keep.astype(np.float64) * A * np.exp(lr) + kl_tau * (mask > 0) * lr**2).sum()
  return total / max(mask.sum(), 1)


def np_binary_kl(a, b, eps=1e-8):
  """AReaL compute_binary_kl_divergence (on probabilities): both clamped to [eps, 1 - eps], float64."""
  a, b = np.clip(a, eps, 1 - eps), np.clip(b, eps, 1 - eps)
  return a * np.log(a / b) + (1 - a) * np.log((1 - a) / (1 - b))


def ref_kpop(lp, lps, prox, beh, A, mask, phi=0.1, eps_low=0.2, eps_high=0.2, normalizer="loss_tokens"):
  """AReaL ppo_actor_loss_fn with rejection_sampling(level=token, action=mask, metric=binary_kl, upper=phi),
  areal/utils/functional/functional.py at 3e9f6323: loss_mask_count is taken BEFORE the mask narrows; a token
  is kept iff max(kl_fwd, kl_rev) <= upper; kept tokens carry PPO(prox) * exp(prox - beh); the sum over the
  kept tokens / loss_mask_count. normalizer="kept" divides by #kept instead (the draft of AReaL PR #1405)."""
  loss_mask_count = max((mask > 0).sum(), 1)
  p, q = np.exp(prox), np.exp(beh)
  keep = (mask > 0) & (np.maximum(np_binary_kl(p, q), np_binary_kl(q, p)) <= phi)
  r = np.exp(lp - prox)
  pg = np.maximum(-A * r, -A * np.clip(r, 1 - eps_low, 1 + eps_high)) * np.exp(prox - beh)
  count = loss_mask_count if normalizer == "loss_tokens" else max(keep.sum(), 1)
  return np.where(keep, pg, 0.0).sum() / count


REFS = {
  "ppo_clip": ref_ppo_clip,
  "decoupled_ppo": ref_decoupled,
  "gspo": ref_gspo,
  "cispo": ref_cispo,
  "m2po_paper": ref_m2po_paper,
  "m2po_released": ref_m2po_released,
  "icepop": ref_icepop,
  "dppo_tv": ref_dppo_tv,
  "ipo": ref_ipo,
  "kpop": ref_kpop,
}

# Reference keyword names, per loss, for hyper-parameters that differ from the defaults.
CASES = [
  ("ppo_clip", {}, {}),
  ("ppo_clip", dict(eps_low=0.1, eps_high=0.28, dual_clip_c=3.0), dict(eps_low=0.1, eps_high=0.28, dual_clip_c=3.0)),
  ("ppo_clip", dict(loss_agg="seq-mean-token-sum"), dict(loss_agg="seq-mean-token-sum")),
  ("decoupled_ppo", {}, {}),
  ("decoupled_ppo", dict(dual_clip_c=2.0, behav_imp_weight_cap=1.3), dict(c=2.0, cap=1.3)),
  ("gspo", {}, {}),
  ("gspo", dict(eps_low=0.05, eps_high=0.05), dict(eps_low=0.05, eps_high=0.05)),
  ("cispo", {}, {}),
  ("cispo", dict(eps_low=0.1, eps_high=0.1), dict(eps_low=0.1, eps_high=0.1)),
  ("m2po_paper", {}, {}),
  ("m2po_paper", dict(budget=0.5), dict(budget=0.5)),
  ("m2po_released", {}, {}),
  ("m2po_released", dict(min_eps_low=None, min_eps_high=None), dict(min_eps_low=None, min_eps_high=None)),
  ("m2po_released", dict(budget=10.0), dict(budget=10.0)),
  ("icepop", {}, {}),
  ("icepop", dict(lower=0.8, upper=1.25), dict(lower=0.8, upper=1.25)),
  ("dppo_tv", {}, {}),
  ("dppo_tv", dict(mask_low=0.05, mask_high=0.05, kl_tau=0.1), dict(lo=0.05, hi=0.05, kl_tau=0.1)),
  ("ipo", {}, {}),
  ("ipo", dict(ipo_threshold=0.05, kl_tau=0.1), dict(thr=0.05, kl_tau=0.1)),
  ("kpop", {}, {}),
  ("kpop", dict(phi=0.02, eps_low=0.1, eps_high=0.28), dict(phi=0.02, eps_low=0.1, eps_high=0.28)),
  ("kpop", dict(normalizer="kept"), dict(normalizer="kept")),
]


def random_batch(seed, N=5, T=7, per_token_adv=False, spread=0.4):
  rng = np.random.default_rng(seed)
  lp = np.log(rng.uniform(0.05, 0.95, (N, T)))
  old = np.minimum(lp + 0.15 * rng.normal(size=(N, T)), -1e-3)
  beh = np.minimum(lp + spread * rng.normal(size=(N, T)), -1e-3)
  A = rng.normal(size=(N, T)) if per_token_adv else rng.normal(size=N)
  lengths = rng.integers(1, T + 1, N)
  lengths[2] = 0  # a padding row
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
  return lp, old, beh, A, mask


def f32(x):
  return jnp.asarray(x, jnp.float32)


def jax_loss(name, hp, lp, old, beh, A, mask):
  """Loss, d loss / d logp and metrics from ONE compiled function (compiles dominate this file's time)."""
  fn = jax.jit(jax.value_and_grad(P.make_policy_loss(name, **hp), has_aux=True))
  (loss, metrics), grad = fn(f32(lp), f32(old), f32(beh), f32(A), f32(mask))
  return float(loss), np.asarray(grad, np.float64), metrics


def fd_grad(ref, lp, old, beh, A, mask, eps=1e-6, **kw):
  g = np.zeros_like(lp)
  for idx in np.ndindex(lp.shape):
    up, dn = lp.copy(), lp.copy()
    up[idx] += eps
    dn[idx] -= eps
    g[idx] = (ref(up, lp, old, beh, A, mask, **kw) - ref(dn, lp, old, beh, A, mask, **kw)) / (2 * eps)
  return g


# ---------------------------------------------------------------------------
# Values and gradients against the transcriptions
# ---------------------------------------------------------------------------


PER_TOKEN_CASES = [(n, {}, {}) for n in sorted(REFS) if n != "m2po_released"]  # M2PO code reads A[:, 0]


@pytest.mark.parametrize(
  "name,hp,ref_kw,per_token", [(*c, False) for c in CASES] + [(*c, True) for c in PER_TOKEN_CASES]
)
@pytest.mark.slow
def test_value_and_gradient_match_numpy_transcription(name, hp, ref_kw, per_token):
  lp, old, beh, A, mask = random_batch(1 if per_token else 0, per_token_adv=per_token)
  A_nt = np.broadcast_to(A[:, None], lp.shape) if A.ndim == 1 else A
  ref = REFS[name]
  loss, grad, _ = jax_loss(name, hp, lp, old, beh, A, mask)
  assert loss == pytest.approx(ref(lp, lp, old, beh, A_nt, mask, **ref_kw), rel=2e-5, abs=1e-6)
  expected = fd_grad(ref, lp, old, beh, A_nt, mask, **ref_kw)
  smooth = np.ones(lp.shape, bool)
  if name == "m2po_released":
    # the token whose delta^2 is tau's breakpoint sits exactly on the clip boundary (r = e^tau): a kink,
    # where finite differences average the two sides; compare everywhere else
    el, eh = ref_m2po_bounds(
      lp,
      beh,
      A_nt,
      mask,
      ref_kw.get("budget", 0.04),
      *[ref_kw.get(k, d) for k, d in (("min_eps_low", 0.3), ("min_eps_high", 0.5))],
    )
    r = np.exp(lp - beh)
    smooth = (np.abs(r - (1 + eh)) > 1e-4) & (np.abs(r - (1 - el)) > 1e-4)
  np.testing.assert_allclose(grad[smooth], expected[smooth], rtol=2e-3, atol=2e-6)


def test_decoupled_ppo_approximate_prox_matches_transcription():
  lp, old, beh, A, mask = random_batch(3)
  versions = np.array([3, 2, 4, 0, 1])
  A_nt = np.broadcast_to(A[:, None], lp.shape)
  hp = dict(behavior_version=jnp.asarray(versions), current_version=4)
  loss, grad, _ = jax_loss("decoupled_ppo", hp, lp, old, beh, A, mask)
  kw = dict(versions=(versions, 4))
  assert loss == pytest.approx(ref_decoupled(lp, lp, old, beh, A_nt, mask, **kw), rel=2e-5, abs=1e-6)
  # pi_prox is a stop-gradient function of pi_theta: the finite differences hold it fixed
  np.testing.assert_allclose(grad, fd_grad(ref_decoupled, lp, old, beh, A_nt, mask, **kw), rtol=2e-3, atol=2e-6)


@pytest.mark.slow
def test_loglinear_prox_hand_numbers():
  # alpha = (v_theta - 1 - v_mu) / (v_theta - v_mu): v_mu = 3 -> 0, 2 -> 1/2, 4 (on-policy) -> 0, 0 -> 3/4
  beh = jnp.zeros((4, 1))
  lp = jnp.full((4, 1), -1.0)
  out = P.loglinear_prox_logp(lp, beh, jnp.array([3, 2, 4, 0]), 4)
  np.testing.assert_allclose(np.asarray(out)[:, 0], [0.0, -0.5, 0.0, -0.75], rtol=1e-6)
  g = jax.grad(lambda x: P.loglinear_prox_logp(x, beh, jnp.array([3, 2, 4, 0]), 4).sum())(lp)
  assert np.all(np.asarray(g) == 0.0)


# ---------------------------------------------------------------------------
# Hand-checkable cases
# ---------------------------------------------------------------------------


def one_token(name, r, A, old=None, beh=None, **hp):
  """Loss and d loss / d log pi_theta for one token with pi_theta / pi_old = r (pi_old = 0.4 by default)."""
  old = math.log(0.4) if old is None else old
  beh = old if beh is None else beh
  fn = P.make_policy_loss(name, **hp)
  lp = jnp.array([[old + math.log(r)]], jnp.float32)
  args = (jnp.array([[old]]), jnp.array([[beh]]), jnp.array([A], jnp.float32), jnp.ones((1, 1)))
  loss, metrics = fn(lp, *args)
  grad = jax.grad(lambda x: fn(x, *args)[0])(lp)
  return float(loss), float(grad[0, 0]), metrics


@pytest.mark.slow
def test_ppo_clip_hand_numbers():
  loss, grad, m = one_token("ppo_clip", 1.5, 1.0)  # min(1.5, 1.2) = 1.2: clipped, no gradient
  assert loss == pytest.approx(-1.2, rel=1e-6) and grad == 0.0 and float(m["clip_frac"]) == 1.0
  loss, grad, m = one_token("ppo_clip", 0.5, 1.0)  # min(0.5, 0.8) = 0.5: unclipped, d(-r A)/dlogp = -r A
  assert loss == pytest.approx(-0.5, rel=1e-6) and grad == pytest.approx(-0.5, rel=1e-6)
  assert float(m["clip_frac"]) == 0.0
  loss, grad, _ = one_token("ppo_clip", 1.5, -1.0)  # min(-1.5, -1.2) = -1.5: the ratio term is active
  assert loss == pytest.approx(1.5, rel=1e-6) and grad == pytest.approx(1.5, rel=1e-6)
  loss, grad, m = one_token("ppo_clip", 5.0, -1.0, dual_clip_c=3.0)  # dual clip: loss capped at c |A| = 3
  assert loss == pytest.approx(3.0, rel=1e-6) and grad == 0.0 and float(m["dual_clip_frac"]) == 1.0
  loss, _, _ = one_token("ppo_clip", 5.0, -1.0)  # without it: 5
  assert loss == pytest.approx(5.0, rel=1e-5)


def test_decoupled_ppo_hand_numbers():
  # pi_prox / mu = 2, r' = 1.5, A = 1: 2 * min(1.5, 1.2) = 2.4
  loss, grad, _ = one_token("decoupled_ppo", 1.5, 1.0, beh=math.log(0.2))
  assert loss == pytest.approx(-2.4, rel=1e-5) and grad == 0.0
  loss, grad, _ = one_token("decoupled_ppo", 1.1, 1.0, beh=math.log(0.2))
  assert loss == pytest.approx(-2.2, rel=1e-5) and grad == pytest.approx(-2.2, rel=1e-5)
  loss, grad, m = one_token("decoupled_ppo", 1.1, 1.0, beh=math.log(0.2), behav_imp_weight_cap=1.5)
  assert loss == 0.0 and grad == 0.0 and float(m["frac_masked"]) == 1.0  # weight 2 > cap: dropped


def test_cispo_hand_numbers():
  # w = sg(clip(1.5, -9, 1.2)) = 1.2: the gradient is -w A even though the ratio is clipped (PPO gives 0)
  loss, grad, m = one_token("cispo", 1.5, 1.0)
  assert grad == pytest.approx(-1.2, rel=1e-6) and float(m["clip_frac"]) == 1.0
  assert loss == pytest.approx(-1.2 * (math.log(0.4) + math.log(1.5)), rel=1e-5)  # value: -w A log pi
  _, grad, _ = one_token("cispo", 0.01, 1.0)  # eps_low = 10: no lower clip
  assert grad == pytest.approx(-0.01, rel=1e-4)


@pytest.mark.slow
def test_gspo_hand_numbers():
  mask = jnp.ones((1, 2))
  old = jnp.log(jnp.array([[0.5, 0.5]]))
  fn = P.make_policy_loss("gspo")
  # log-ratios +0.1 / -0.1: s = exp(0) = 1, unclipped: loss = -A, gradient -A s / L per token
  lp = old + jnp.array([[0.1, -0.1]])
  loss, m = fn(lp, old, old, jnp.array([2.0]), mask)
  g = jax.grad(lambda x: fn(x, old, old, jnp.array([2.0]), mask)[0])(lp)
  assert float(loss) == pytest.approx(-2.0, rel=1e-6) and float(m["clip_frac"]) == 0.0
  np.testing.assert_allclose(np.asarray(g), [[-1.0, -1.0]], rtol=1e-6)
  # both +0.1: s = e^0.1 > 1 + 4e-4 with A > 0: clipped at 1 + 4e-4, no gradient
  lp = old + 0.1
  loss, m = fn(lp, old, old, jnp.array([1.0]), mask)
  g = jax.grad(lambda x: fn(x, old, old, jnp.array([1.0]), mask)[0])(lp)
  assert float(loss) == pytest.approx(-(1 + 4e-4), rel=1e-6) and float(m["clip_frac"]) == 1.0
  assert np.all(np.asarray(g) == 0.0)


def test_icepop_hand_numbers():
  # rho = pi_old / mu = 6 > 5: popped
  loss, grad, m = one_token("icepop", 1.0, 1.0, old=math.log(0.6), beh=math.log(0.1))
  assert loss == 0.0 and grad == 0.0 and float(m["frac_masked"]) == 1.0
  # rho = 2: the PPO token loss (-1 at r = 1) times 2
  loss, grad, m = one_token("icepop", 1.0, 1.0, old=math.log(0.6), beh=math.log(0.3))
  assert loss == pytest.approx(-2.0, rel=1e-5) and grad == pytest.approx(-2.0, rel=1e-5)
  assert float(m["frac_masked"]) == 0.0


@pytest.mark.slow
def test_ipo_hand_numbers():
  # q = 0.5; p = 0.55: |p - q| = 0.05 <= 0.1, kept: loss = -A r = -1.1, d/dlogp = -A r = -1.1
  loss, grad, m = one_token("ipo", 1.0, 1.0, old=math.log(0.55), beh=math.log(0.5), kl_tau=0.0)
  assert loss == pytest.approx(-1.1, rel=1e-5) and grad == pytest.approx(-1.1, rel=1e-5)
  assert float(m["frac_masked"]) == 0.0
  # p = 0.7, q = 0.5: moved up by 0.2 > 0.1 -> dropped for A > 0 AND for A < 0 (DPPO keeps the A < 0 one)
  for A in (1.0, -1.0):
    loss, grad, m = one_token("ipo", 1.0, A, old=math.log(0.7), beh=math.log(0.5), kl_tau=0.0)
    assert loss == 0.0 and grad == 0.0 and float(m["frac_masked_high"]) == 1.0
  _, _, m = one_token("dppo_tv", 1.0, -1.0, old=math.log(0.7), beh=math.log(0.5), kl_tau=0.0)
  assert float(m["frac_masked"]) == 0.0
  # p = 0.3, q = 0.5: moved down by 0.2 -> dropped for either sign of A; the KL term stays:
  # kl_tau (log r)^2 with log r = log 0.6, gradient 2 kl_tau log r
  loss, grad, m = one_token("ipo", 1.0, 1.0, old=math.log(0.3), beh=math.log(0.5), kl_tau=0.1)
  assert loss == pytest.approx(0.1 * math.log(0.6) ** 2, rel=1e-5)
  assert grad == pytest.approx(0.2 * math.log(0.6), rel=1e-5) and float(m["frac_masked_low"]) == 1.0


def test_kpop_hand_numbers():
  # D_B(0.5 || 0.4) = 0.5 log(0.5/0.4) + 0.5 log(0.5/0.6) = 0.0204; D_B(0.4 || 0.5) = 0.0201: both < 0.1
  kf = 0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6)
  kr = 0.4 * math.log(0.4 / 0.5) + 0.6 * math.log(0.6 / 0.5)
  np.testing.assert_allclose(float(P.binary_kl(jnp.log(0.5), jnp.log(0.4))), kf, rtol=1e-4)
  np.testing.assert_allclose(float(P.binary_kl(jnp.log(0.4), jnp.log(0.5))), kr, rtol=1e-4)
  # kept: pi_prox = 0.5, mu = 0.4, r = 1 -> loss = -(0.5 / 0.4) A = -1.25, gradient -1.25 (unclipped)
  loss, grad, m = one_token("kpop", 1.0, 1.0, old=math.log(0.5), beh=math.log(0.4))
  assert loss == pytest.approx(-1.25, rel=1e-5) and grad == pytest.approx(-1.25, rel=1e-5)
  assert float(m["frac_masked"]) == 0.0
  # phi = 0.02 < 0.0201 (the reverse KL): dropped, a zero over the one loss token (either normaliser)
  for normalizer in ("loss_tokens", "kept"):
    loss, grad, m = one_token("kpop", 1.0, 1.0, old=math.log(0.5), beh=math.log(0.4), phi=0.02, normalizer=normalizer)
    assert loss == 0.0 and grad == 0.0 and float(m["frac_masked"]) == 1.0
  # the band adapts to the probability: a 0.2 move is dropped at p ~ 0.99 (D_B large), a 10x ratio kept at 1e-4
  _, _, m = one_token("kpop", 1.0, 1.0, old=math.log(0.99), beh=math.log(0.79))
  assert float(m["frac_masked"]) == 1.0
  _, _, m = one_token("kpop", 1.0, 1.0, old=math.log(1e-3), beh=math.log(1e-4))
  assert float(m["frac_masked"]) == 0.0
  # the ratio to pi_prox is clipped as in PPO: r = 1.5, A = 1 -> clip at 1.2, no gradient
  loss, grad, m = one_token("kpop", 1.5, 1.0, old=math.log(0.5), beh=math.log(0.5))
  assert loss == pytest.approx(-1.2, rel=1e-5) and grad == 0.0 and float(m["clip_frac"]) == 1.0


def test_kpop_divides_by_every_loss_token_as_areal_does():
  """N = 1, T = 2: token 0 kept (pi_prox = 0.5, mu = 0.4, A = 1, r = 1), token 1 dropped (pi_prox = 0.9,
  mu = 0.5: D_B = 0.368 > 0.1). AReaL divides the kept token's -A r pi_prox / mu = -1.25 by the 2 loss tokens:
  loss and gradient -0.625; dividing by the 1 kept token (the old normaliser) doubles both, N / N_kept = 2."""
  lp = np.log([[0.5, 0.9]])
  args = (np.log([[0.5, 0.9]]), np.log([[0.4, 0.5]]), np.array([1.0]), np.ones((1, 2)))
  for normalizer, expect in (("loss_tokens", -0.625), ("kept", -1.25)):
    loss, grad, m = jax_loss("kpop", dict(normalizer=normalizer), lp, *args)
    assert float(m["frac_masked"]) == 0.5
    assert loss == pytest.approx(expect, rel=1e-5)
    np.testing.assert_allclose(grad, [[expect, 0.0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss, ref_kpop(lp, lp, *args, normalizer=normalizer), rtol=1e-5)
  # random cases: the gradients differ by exactly N_loss / N_kept
  lp, old, beh, A, mask = random_batch(3, spread=0.8)
  _, g_all, m = jax_loss("kpop", {}, lp, old, beh, A, mask)
  _, g_kept, _ = jax_loss("kpop", dict(normalizer="kept"), lp, old, beh, A, mask)
  kept_frac = 1.0 - float(m["frac_masked"])
  assert 0.0 < kept_frac < 1.0
  np.testing.assert_allclose(g_kept * kept_frac, g_all, rtol=1e-4, atol=1e-7)


def test_binary_kl_is_finite_for_float32_certain_tokens():
  """AReaL's probability-space clamp at 1e-8 rounds to 1 in float32 (NaN / inf for p > 1 - 6e-8, then the
  token is dropped); binary_kl clamps the log-probs and takes exact complements: finite, >= 0, and equal to
  the float64 formula on the clamped probabilities."""
  lp = jnp.array([0.0, -1e-8, -3e-8, -1e-7, -1e-3], jnp.float32)
  lq = jnp.array([0.0, -2e-8, -1e-8, -2e-7, -2e-3], jnp.float32)
  kl = np.asarray(P.binary_kl(lp, lq), np.float64)
  assert np.isfinite(kl).all() and (kl >= -1e-12).all()
  lo, hi = math.log(1e-8), math.log1p(-1e-8)
  a, b = np.clip(np.asarray(lp, np.float64), lo, hi), np.clip(np.asarray(lq, np.float64), lo, hi)
  ref = np.exp(a) * (a - b) + -np.expm1(a) * (np.log(-np.expm1(a)) - np.log(-np.expm1(b)))
  np.testing.assert_allclose(kl, ref, rtol=2e-3, atol=1e-9)
  # a certain token against itself is inside any band: kept
  _, _, m = one_token("kpop", 1.0, 1.0, old=0.0, beh=0.0)
  assert float(m["frac_masked"]) == 0.0


def test_icepop_band_edges_are_inclusive_as_in_slime():
  """slime keeps rho = pi_old / mu when tis_clip_low <= rho <= tis_clip: a ratio exactly on either edge keeps
  its weight, one float32 step outside is popped. (An exclusive band, lower < rho < upper, fails here.)"""
  for old in (math.log(0.5), math.log(5.0), math.log(0.8), math.log(1.25)):
    rho = float(jnp.exp(jnp.float32(old)))  # as icepop computes it: exp(old - beh) in float32, beh = 0
    for lower, upper in [(rho, rho * 4), (rho / 4, rho)]:
      _, grad, m = one_token("icepop", 1.0, 1.0, old=old, beh=0.0, lower=lower, upper=upper)
      assert float(m["frac_masked"]) == 0.0 and grad == pytest.approx(-rho, rel=1e-5), (rho, lower, upper)
    above = float(np.nextafter(np.float32(rho), np.float32(np.inf)))
    below = float(np.nextafter(np.float32(rho), np.float32(0)))
    for lower, upper in [(above, above * 4), (below / 4, below)]:
      _, grad, m = one_token("icepop", 1.0, 1.0, old=old, beh=0.0, lower=lower, upper=upper)
      assert float(m["frac_masked"]) == 1.0 and grad == 0.0, (rho, lower, upper)


def test_ppo_clip_dual_clip_default_is_off_and_verls_is_an_option():
  """The documented departure from verl: a token with A < 0 and r > 3 (N = T = 1, the issue's case)."""
  lp, old, A = -0.00531, -2.16321, -0.44721
  fn = lambda **hp: P.make_policy_loss("ppo_clip", **hp)
  args = (jnp.array([[old]]), jnp.array([[old]]), jnp.array([A], jnp.float32), jnp.ones((1, 1)))
  g = lambda f: float(jax.grad(lambda x: f(x, *args)[0])(jnp.array([[lp]], jnp.float32))[0, 0])
  r = math.exp(lp - old)
  assert r > 3 and g(fn()) == pytest.approx(-r * A, rel=1e-5) and g(fn()) == pytest.approx(3.87, abs=5e-3)
  assert g(fn(dual_clip_c=3.0)) == 0.0  # verl's clip_ratio_c = 3: the loss is capped at 3 |A|, no gradient


def test_dppo_tv_hand_numbers():
  # prime-rl's own case: p = 1, q = 0.5, A = 1: p - q = 0.5 > 0.2, dropped; only the KL term remains
  loss, grad, m = one_token("dppo_tv", 1.0, 1.0, old=0.0, beh=math.log(0.5), kl_tau=0.0)
  assert loss == 0.0 and grad == 0.0 and float(m["frac_masked_high"]) == 1.0
  # same token with A = -1: the low test (p - q < -0.2) is false, kept: -A r = 2, d/dlogp = 2
  loss, grad, m = one_token("dppo_tv", 1.0, -1.0, old=0.0, beh=math.log(0.5), kl_tau=0.0)
  assert loss == pytest.approx(2.0, rel=1e-6) and grad == pytest.approx(2.0, rel=1e-6)
  assert float(m["frac_masked"]) == 0.0
  # KL term: tau (log r)^2 with log r = log 2, gradient 2 tau log r (on a dropped token too)
  loss, grad, _ = one_token("dppo_tv", 1.0, 1.0, old=0.0, beh=math.log(0.5), kl_tau=0.1)
  assert loss == pytest.approx(0.1 * math.log(2) ** 2, rel=1e-5)
  assert grad == pytest.approx(0.2 * math.log(2), rel=1e-5)
  # the probability difference, not the ratio: r = 2 at tiny probabilities (1e-3 vs 5e-4) is kept
  _, grad, m = one_token("dppo_tv", 1.0, 1.0, old=math.log(1e-3), beh=math.log(5e-4), kl_tau=0.0)
  assert float(m["frac_masked"]) == 0.0 and grad == pytest.approx(-2.0, rel=1e-5)


@pytest.mark.slow
def test_m2po_mask_hand_numbers():
  m2 = jnp.array([[1.0, 0.01, 0.01, 0.01]])
  mask = jnp.ones((1, 4))
  # suffix means: 1.03 / 4 = 0.2575, then 0.01 < 0.04: mask only the largest
  np.testing.assert_array_equal(np.asarray(P.m2po_mask(m2, mask, 0.04)), [[False, True, True, True]])
  # no suffix mean below the budget: mask all but one (the last in sorted order)
  np.testing.assert_array_equal(np.asarray(P.m2po_mask(jnp.ones((1, 3)), jnp.ones((1, 3)), 0.04)), [[0, 0, 1]])
  # masked tokens never count, never kept
  mask = jnp.array([[1, 0, 1, 1]])
  np.testing.assert_array_equal(np.asarray(P.m2po_mask(m2, mask, 0.04)), [[False, False, True, True]])
  # everything below the budget: nothing masked
  np.testing.assert_array_equal(np.asarray(P.m2po_mask(m2 * 0.01, jnp.ones((1, 4)), 0.04)), [[1, 1, 1, 1]])


@pytest.mark.slow
def test_m2po_tau_hand_numbers():
  d2 = jnp.array([0.01, 0.04, 0.25, 1.0, 9.0])
  harmful = jnp.array([True, True, True, True, False])
  # n = 4, S = 0.4: capped sums at v_k: 0.04, 0.13, 0.55 >= 0.4 at k = 2 -> breakpoint tau^2 = v_1 = 0.04
  tau, m2, need = P.m2po_tau(d2, harmful, 0.1)
  assert float(tau) == pytest.approx(0.2, rel=1e-6) and float(m2) == pytest.approx(1.3 / 4) and bool(need)
  # exact: (0.4 - 0.05) / 2 = 0.175 = tau^2, and mean min(v, tau^2) = 0.1 exactly
  tau, _, _ = P.m2po_tau(d2, harmful, 0.1, exact=True)
  assert float(tau) ** 2 == pytest.approx(0.175, rel=1e-5)
  assert np.mean(np.minimum([0.01, 0.04, 0.25, 1.0], float(tau) ** 2)) == pytest.approx(0.1, rel=1e-5)
  _, _, need = P.m2po_tau(d2, harmful, 1.0)  # mean 0.325 <= 1: no clip needed
  assert not bool(need)
  _, _, need = P.m2po_tau(d2, jnp.zeros(5, bool), 0.1)  # no harmful token
  assert not bool(need)


@pytest.mark.slow
def test_m2po_released_bounds_match_transcription_and_floors():
  lp, old, beh, A, mask = random_batch(4, spread=0.6)
  A_nt = np.broadcast_to(A[:, None], lp.shape)
  for floors in [(0.3, 0.5), (None, None)]:
    fn = P.make_policy_loss("m2po_released", min_eps_low=floors[0], min_eps_high=floors[1])
    _, m = fn(f32(lp), f32(old), f32(beh), f32(A), f32(mask))
    el, eh = ref_m2po_bounds(lp, beh, A_nt, mask, 0.04, *floors)
    assert float(m["eps_low"]) == pytest.approx(el, rel=1e-4) and float(m["eps_high"]) == pytest.approx(eh, rel=1e-4)
    assert float(m["m2_after"]) <= 0.04 + 1e-6 < float(m["m2"])
  assert el < 0.3 and eh < 0.5  # without floors the budget's own bounds are tighter than 0.3 / 0.5


# ---------------------------------------------------------------------------
# Stop-gradients, reduction to the policy gradient, padding and garbage
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(P.POLICY_LOSSES))
@pytest.mark.slow
def test_stop_gradients_policy_gradient_reduction_and_masked_garbage(name):
  lp, old, beh, A, mask = (f32(x) for x in random_batch(5))
  fn = P.make_policy_loss(name)
  # one compiled function for all three checks: (loss, metrics) and the gradients wrt all four inputs
  both = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3), has_aux=True))

  # 1. only log pi_theta is differentiated; masked tokens get nothing
  (_, _), (g_lp, g_old, g_beh, g_adv) = both(lp, old, beh, A, mask)
  for g in (g_old, g_beh, g_adv):
    assert np.all(np.asarray(g) == 0.0)
  assert np.any(np.asarray(g_lp) != 0.0)
  assert np.all(np.asarray(g_lp)[np.asarray(mask) == 0] == 0.0)

  # 2. pi_theta = pi_old = mu: the plain policy gradient -A grad log pi under the method's aggregation
  (_, metrics), (g_lp, *_) = both(lp, lp, lp, A, mask)
  agg = P.POLICY_LOSSES[name].defaults["loss_agg"]
  g_pg = jax.grad(lambda x: P.aggregate(-A[:, None] * x, mask, agg))(lp)
  np.testing.assert_allclose(np.asarray(g_lp), np.asarray(g_pg), rtol=1e-5, atol=1e-7)
  assert float(metrics["ess_ratio"]) == pytest.approx(1.0)
  for key in ("clip_frac", "frac_masked"):
    if key in metrics:
      assert float(metrics[key]) == 0.0

  # 3. -inf / NaN at masked positions change nothing
  pad = jnp.asarray(mask) == 0
  (clean, _), _ = both(lp, old, beh, A, mask)
  (dirty, metrics), (g_lp, *_) = both(
    jnp.where(pad, -jnp.inf, lp), jnp.where(pad, jnp.nan, old), jnp.where(pad, -jnp.inf, beh), A, mask
  )
  assert float(dirty) == pytest.approx(float(clean), rel=1e-6)
  assert np.all(np.isfinite(np.asarray(g_lp)))
  assert all(np.isfinite(float(v)) for v in metrics.values())


# ---------------------------------------------------------------------------
# ESS-targeted truncation
# ---------------------------------------------------------------------------


def np_rho(w):
  return w.sum() ** 2 / (len(w) * (w**2).sum())


def test_ess_truncation_hand_numbers():
  lw = jnp.log(jnp.array([1.0, 1.0, 1.0, 100.0]))
  # (3 + c)^2 / (4 (3 + c^2)) = 1/2  <=>  c^2 - 6c - 3 = 0  <=>  c = 3 + 2 sqrt(3)
  out = P.ess_target_truncation(lw, 0.5)
  assert float(out["c"]) == pytest.approx(3 + 2 * math.sqrt(3), rel=1e-5)
  assert float(out["ess_ratio"]) >= 0.5 and float(out["ess_ratio"]) == pytest.approx(0.5, abs=1e-5)
  assert float(out["ess_ratio_raw"]) == pytest.approx(np_rho(np.array([1, 1, 1, 100.0])), rel=1e-5)
  assert float(out["reached"]) == 1.0
  # the raw weights already reach the target: no truncation, c = max weight
  out = P.ess_target_truncation(lw, 0.2)
  assert float(out["c"]) == pytest.approx(100.0, rel=1e-5)
  # unreachable with c >= c_min = 50: rho(50) = 53^2 / (4 * 2503) < 0.5 -> c = c_min, reached = 0
  out = P.ess_target_truncation(lw, 0.5, c_min=50.0)
  assert float(out["c"]) == pytest.approx(50.0, rel=1e-6) and float(out["reached"]) == 0.0
  assert float(out["ess_ratio"]) == pytest.approx(53**2 / (4 * 2503), rel=1e-5)
  # target 1 needs every weight equal: c = c_min = 1 = min w (to float32's resolution of rho near 1)
  assert float(P.ess_target_truncation(lw, 1.0)["c"]) == pytest.approx(1.0, abs=2e-3)


def test_ess_truncation_log_space_invalid_rows_and_weights():
  # a log-weight of 1e4 (exp overflows float32) gives the same c as 100 did: only the top weight is cut
  out = P.ess_target_truncation(jnp.array([0.0, 0.0, 0.0, 1e4]), 0.5)
  assert float(out["log_c"]) == pytest.approx(math.log(3 + 2 * math.sqrt(3)), rel=1e-5)
  # invalid rows are ignored
  lw = jnp.array([0.0, 0.0, 0.0, math.log(100.0), 50.0])
  out = P.ess_target_truncation(lw, 0.5, valid_n=jnp.array([1, 1, 1, 1, 0]))
  assert float(out["c"]) == pytest.approx(3 + 2 * math.sqrt(3), rel=1e-5)
  # no valid row: c = c_min, ratio 1
  out = P.ess_target_truncation(lw, 0.5, valid_n=jnp.zeros(5, bool))
  assert float(out["c"]) == 1.0 and float(out["ess_ratio"]) == 1.0
  logw, _ = P.tis_ess_log_weights(jnp.log(jnp.array([1.0, 1.0, 1.0, 100.0])), 0.5)
  np.testing.assert_allclose(np.exp(np.asarray(logw)), [1, 1, 1, 3 + 2 * math.sqrt(3)], rtol=1e-5)
  with pytest.raises(ValueError, match="target=1.5"):
    P.ess_target_truncation(lw, 1.5)


@pytest.mark.slow
def test_ess_truncation_monotone_and_meets_target_on_random_weights():
  rng = np.random.default_rng(0)
  lw = rng.normal(0.0, 2.0, 64)
  # rho(min(w, c)) is non-increasing in c (the property the bisection relies on)
  cs = np.exp(np.linspace(lw.min(), lw.max(), 200))
  rhos = [np_rho(np.minimum(np.exp(lw), c)) for c in cs]
  assert np.all(np.diff(rhos) <= 1e-12)
  prev = np.inf
  for target in [0.1, 0.3, 0.5, 0.7, 0.9, 0.99]:
    out = P.ess_target_truncation(jnp.asarray(lw, jnp.float32), target, c_min=1e-3)
    c = float(out["c"])
    rho = np_rho(np.minimum(np.exp(lw), c))
    assert rho >= target - 1e-4  # meets the target
    assert np_rho(np.minimum(np.exp(lw), c * 1.01)) < target + 1e-4 or c >= np.exp(lw).max()  # largest such c
    assert c <= prev * (1 + 1e-5)  # a higher target never allows a larger cap
    prev = c


# ---------------------------------------------------------------------------
# Through a model: one forward + cotangent + one backward = jax.grad of the composed loss
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gspo", "dppo_tv"])
@pytest.mark.slow
def test_loss_gradient_through_a_model_equals_autodiff(name):
  rng = np.random.default_rng(9)
  N, T, D = 4, 5, 3
  x = f32(rng.normal(size=(N, T, D)))
  params = {"w": f32(rng.normal(size=(D,))), "b": f32(0.3)}

  def logp_fn(p, batch):  # log sigmoid of a per-token logit: a valid log-probability
    return jax.nn.log_sigmoid(batch["x"] @ p["w"] + p["b"])

  mask = f32(np.arange(T)[None, :] < np.array([5, 3, 0, 4])[:, None])
  batch = {"x": x, "behavior_logp": logp_fn(params, {"x": x}) + f32(0.3 * rng.normal(size=(N, T))), "loss_mask": mask}
  adv = f32(rng.normal(size=N))
  old = logp_fn(params, {"x": x}) + 0.1
  fn = P.make_policy_loss(name)
  grads, loss, _ = P.loss_gradient(fn, logp_fn, params, batch, adv, old)
  want = jax.grad(lambda p: fn(logp_fn(p, batch), old, batch["behavior_logp"], adv, mask)[0])(params)
  for k in params:
    np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-7)
  assert float(loss) == pytest.approx(float(fn(logp_fn(params, batch), old, batch["behavior_logp"], adv, mask)[0]))
  # old_logp_nt=None: pi_old is this forward's value (the single-update case)
  g_none, _, _ = P.loss_gradient(fn, logp_fn, params, batch, adv)
  lp0 = jax.lax.stop_gradient(logp_fn(params, batch))
  want = jax.grad(lambda p: fn(logp_fn(p, batch), lp0, batch["behavior_logp"], adv, mask)[0])(params)
  np.testing.assert_allclose(np.asarray(g_none["w"]), np.asarray(want["w"]), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# Registry and bad input
# ---------------------------------------------------------------------------


def test_registry_names_and_source_defaults():
  assert set(P.POLICY_LOSSES) == {
    "ppo_clip",
    "decoupled_ppo",
    "gspo",
    "cispo",
    "m2po_paper",
    "m2po_released",
    "icepop",
    "dppo_tv",
    "ipo",
    "kpop",
  }
  d = {k: v.defaults for k, v in P.POLICY_LOSSES.items()}
  assert (d["ipo"]["ipo_threshold"], d["ipo"]["kl_tau"], d["ipo"]["loss_agg"]) == (0.1, 1e-3, "token-mean")
  assert (d["kpop"]["phi"], d["kpop"]["eps_low"], d["kpop"]["eps_high"]) == (0.1, 0.2, 0.2)
  assert (d["gspo"]["eps_low"], d["gspo"]["eps_high"], d["gspo"]["loss_agg"]) == (3e-4, 4e-4, "seq-mean-token-mean")
  assert (d["cispo"]["eps_low"], d["cispo"]["eps_high"], d["cispo"]["loss_agg"]) == (10.0, 0.2, "token-mean")
  assert (d["icepop"]["lower"], d["icepop"]["upper"]) == (0.5, 5.0)
  assert (d["dppo_tv"]["mask_low"], d["dppo_tv"]["mask_high"], d["dppo_tv"]["kl_tau"]) == (0.2, 0.2, 1e-3)
  assert d["m2po_paper"]["budget"] == d["m2po_released"]["budget"] == 0.04
  assert (d["m2po_released"]["min_eps_low"], d["m2po_released"]["min_eps_high"]) == (0.3, 0.5)
  for p in P.POLICY_LOSSES.values():
    assert p.source and p.fn.__doc__ and "Source" in p.fn.__doc__


@pytest.mark.parametrize(
  "name,hp,match",
  [
    ("nope", {}, "policy loss 'nope'"),
    ("ppo_clip", dict(eps=0.2), "unknown hyper-parameters \\['eps'\\]"),
    ("ppo_clip", dict(eps_low=-0.1), "eps_low=-0.1"),
    ("ppo_clip", dict(dual_clip_c=0.5), "dual_clip_c=0.5"),
    ("gspo", dict(loss_agg="mean"), "loss_agg='mean'"),
    ("m2po_paper", dict(budget=0.0), "budget=0.0"),
    ("icepop", dict(lower=2.0, upper=1.0), "lower=\\(2.0, 1.0\\)"),
    ("dppo_tv", dict(kl_tau=-1.0), "kl_tau=-1.0"),
    ("ipo", dict(ipo_threshold=-0.1), "ipo_threshold=-0.1"),
    ("kpop", dict(phi=0.0), "phi=0.0"),
    ("kpop", dict(normalizer="all"), "normalizer='all'"),
    ("decoupled_ppo", dict(current_version=3), "current_version=3"),
  ],
)
def test_bad_hyper_parameters_fail_at_build_time(name, hp, match):
  with pytest.raises(ValueError, match=match):
    P.make_policy_loss(name, **hp)


@pytest.mark.slow
def test_building_the_presets_starts_no_backend():
  # Config parsing builds every policy loss (its values are checked by an abstract trace) BEFORE
  # jax.distributed.initialize, which fails once a backend exists: building must not start one.
  import subprocess
  import sys

  code = (
    "from jax._src import xla_bridge as xb\n"
    "from vcpo_jax import estimator as E\n"
    "for n in E.PRESETS: E.method_from_preset(n)\n"
    "assert not xb._backends, xb._backends\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]


def test_every_policy_loss_has_its_preset():
  from vcpo_jax import estimator

  for name in P.POLICY_LOSSES:
    assert estimator.method_from_preset(name).peer_loss.name == name
  assert estimator.method_from_preset("vcpo_tis_ess").weights.variant == "tis_ess"
