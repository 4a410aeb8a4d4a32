"""Gradient-variance telemetry from the exact per-example norms the learner already has.

The surrogate's gradient is a sum of per-trajectory contributions (learner.policy_gradient):

    G = sum_n u_n,   u_n = coef_n s_n,   s_n = grad_params sum_t tokw_nt logp_nt   (G = -grads)

and the ghost path computes S_n = ||s_n||^2 exactly for every row (aux["sq_norm_n"]). So the size of
each contribution, m_n = |coef_n| sqrt(S_n), is known every step without another pass, and from the
m_n and ||G||^2 (the gradient norm the step logs anyway) follow, on [N] arrays only:

  top1_share     = max_n m_n^2 / sum_n m_n^2                     (how much one trajectory dominates)
  top5pct_share  = sum of the K = ceil(0.05 n) largest m_n^2 / sum_n m_n^2
  ess            = (sum_n m_n)^2 / sum_n m_n^2,  ess_ratio = ess / n   (the ESS of the update magnitudes)
  cov_trace      = n / (n - 1) * (sum_n m_n^2 - ||G||^2 / n)     (tr Cov(G), see `cov_trace`)
  snr            = ||G||^2 / cov_trace

n is the number of valid rows (padding and non-finite rows excluded). And, for the baseline, with
the applied multiplier k_n = w~_n per_row(L_n) / (Z sigma_n) so that coef_n = k_n (R_n - b_n):

  V(b)           = sum_n k_n^2 S_n (R_n - b_n)^2                 (the b-dependent second moment; OPOB's objective)
  b_min,g        = sum_{n in g} k_n^2 S_n R_n / sum_{n in g} k_n^2 S_n   (argmin of V over per-group constants)

logged as V(b used) (= sum_n m_n^2), V(b_min), V(group mean), their ratio and the RMS gap b_used - b_min.
OPOB (the paper) weighs by w_n^2 S_n with the UNCLIPPED w and the token-sum score; the update applies
w~_n / L_n: b_min is the baseline that is minimum-variance for the update actually applied.

Everything here is pure jnp on [N] arrays (a sort and an N x N group mask at most): negligible next to
the step. `step_telemetry` is the learner's entry point; metrics come back keyed "grad/...".

References:
  Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs, arXiv 2602.17616 (OPOB).
  Greensmith, Bartlett & Baxter, Variance reduction techniques for gradient estimates in
    reinforcement learning, JMLR 5 (2004).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from vcpo_jax import estimator

sg = jax.lax.stop_gradient
_F32 = jnp.float32
TOP_FRAC = 0.05  # the "top 5%" of top5pct_share


def contribution_sq_norms(coef_n, sq_norm_n, valid_n=None):
  """m_n^2 = coef_n^2 S_n [N] (0 on invalid rows): the squared norm of trajectory n's term u_n of G."""
  m2 = jnp.square(jnp.asarray(coef_n, _F32)) * jnp.asarray(sq_norm_n, _F32)
  if valid_n is not None:
    m2 = jnp.where(valid_n, m2, 0.0)
  return sg(m2)


def _n_valid(m2_n, valid_n):
  return jnp.sum(jnp.ones_like(m2_n) if valid_n is None else jnp.asarray(valid_n, _F32))


def top_share(m2_n, frac: float | None = None, valid_n=None):
  """Share of sum_n m_n^2 held by the largest terms: the top 1 (frac None) or the top ceil(frac * n).

  Args:
    m2_n: [N] m_n^2 >= 0 (contribution_sq_norms). frac: fraction of the n valid rows (at least 1 row).
  Returns:
    scalar in [1/n, 1]; 0 when every m_n is 0.
  """
  m2 = jnp.asarray(m2_n, _F32)
  if valid_n is not None:
    m2 = jnp.where(valid_n, m2, 0.0)
  total = jnp.sum(m2)
  if frac is None:
    top = jnp.max(m2)
  else:
    k = jnp.maximum(jnp.ceil(frac * _n_valid(m2, valid_n)), 1.0)
    desc = -jnp.sort(-m2)
    top = jnp.sum(jnp.where(jnp.arange(m2.shape[0]) < k, desc, 0.0))
  return jnp.where(total > 0, top / jnp.where(total > 0, total, 1.0), 0.0)


def magnitude_ess(m2_n, valid_n=None):
  """ESS of the update magnitudes m_n = |coef_n| ||s_n||: (sum_n m_n)^2 / sum_n m_n^2, in [1, n] (0 if all 0)."""
  m2 = jnp.asarray(m2_n, _F32)
  if valid_n is not None:
    m2 = jnp.where(valid_n, m2, 0.0)
  # scaled by the largest term, so that squares of tiny coefficients (1 / (N L) ~ 1e-6) cannot underflow
  top = jnp.max(m2)
  safe = jnp.where(top > 0, top, 1.0)
  m = jnp.sqrt(m2 / safe)
  return jnp.where(top > 0, jnp.square(jnp.sum(m)) / jnp.sum(m * m), 0.0)


def cov_trace(m2_n, grad_sq_norm, valid_n=None):
  """tr Cov(G) of G = sum_n u_n from the per-example norms and the batch gradient.

  Treating the n valid u_n as i.i.d. draws, the unbiased sample covariance of one term is
  (1 / (n - 1)) sum_n ||u_n - u_bar||^2 with u_bar = G / n, and sum_n ||u_n - u_bar||^2 =
  sum_n ||u_n||^2 - ||G||^2 / n; G sums n terms, so

    tr Cov(G) ~= n / (n - 1) * (sum_n m_n^2 - ||G||^2 / n)           (>= 0 by Cauchy-Schwarz)

  The rows of a group share their baseline and std, so they are not exactly independent: this is the
  i.i.d. plug-in estimate, the one a batch of per-example gradients gives (np.cov of the u_n, times n).

  Args:
    m2_n: [N] ||u_n||^2; grad_sq_norm: ||G||^2 (the pre-clip gradient's squared global norm).
  Returns:
    scalar >= 0 (0 with fewer than 2 valid rows).
  """
  m2 = jnp.asarray(m2_n, _F32)
  if valid_n is not None:
    m2 = jnp.where(valid_n, m2, 0.0)
  n = _n_valid(m2, valid_n)
  tr = n / jnp.maximum(n - 1.0, 1.0) * (jnp.sum(m2) - jnp.asarray(grad_sq_norm, _F32) / jnp.maximum(n, 1.0))
  return jnp.where(n >= 2, jnp.maximum(tr, 0.0), 0.0)


def min_variance_baseline(rewards_n, k_n, sq_norm_n, group_id_n, valid_n=None):
  """b_min [N]: per group, sum_j k_j^2 S_j R_j / sum_j k_j^2 S_j (j in the row's group, valid).

  The minimiser over baselines constant within a group of V(b) = sum_n k_n^2 S_n (R_n - b)^2, i.e. the
  OPOB formula with the weights the update applies (k_n, see the module docstring). Where the group's
  k^2 S is all 0 (a zero-std group) it falls back to the group's mean reward (V does not depend on b there).
  """
  r = jnp.asarray(rewards_n, _F32)
  a = jnp.square(jnp.asarray(k_n, _F32)) * jnp.asarray(sq_norm_n, _F32)
  valid = jnp.ones(r.shape, bool) if valid_n is None else jnp.asarray(valid_n, bool)
  g = jnp.asarray(group_id_n)
  same = (g[:, None] == g[None, :]) & valid[None, :] & valid[:, None]
  a = jnp.where(valid, a, 0.0)
  # normalised by the group's largest a, so tiny k^2 S cannot underflow to a 0 / 0
  amax = jnp.max(jnp.where(same, a[None, :], 0.0), axis=1, keepdims=True)
  an = jnp.where(same, a[None, :] / jnp.where(amax > 0, amax, 1.0), 0.0)
  den = jnp.sum(an, axis=1)
  cnt = jnp.sum(same, axis=1)
  mean = jnp.sum(jnp.where(same, r[None, :], 0.0), axis=1) / jnp.maximum(cnt, 1)
  b = jnp.where(den > 0, jnp.sum(an * r[None, :], axis=1) / jnp.where(den > 0, den, 1.0), mean)
  return sg(jnp.where(valid, b, 0.0))


def baseline_variance(rewards_n, baseline_n, k_n, sq_norm_n, valid_n=None):
  """V(b) = sum_n k_n^2 S_n (R_n - b_n)^2 [scalar]: sum_n ||u_n||^2 had the update used baseline b_n."""
  v = jnp.square(jnp.asarray(k_n, _F32) * (jnp.asarray(rewards_n, _F32) - jnp.asarray(baseline_n, _F32)))
  v = v * jnp.asarray(sq_norm_n, _F32)
  if valid_n is not None:
    v = jnp.where(valid_n, v, 0.0)
  return jnp.sum(v)


def applied_multiplier(aux_n: Mapping[str, jax.Array], rewards_n, group_id_n, method, num_tokens):
  """k_n [N] with coef_n = k_n (R_n - b_n): w~_n per_row(L_n, T) / (Z sigma_n), 0 where the row counts nothing.

  w~_n is the applied sequence weight (1 for token-level variants: theirs is inside s_n), sigma_n the
  estimator's scale (estimator.baseline_and_scale: the group std for GRPO, 1 otherwise), Z the loss
  aggregation's whole-batch count (estimator.loss_divisor). Only for group-scope baselines (OPOB scope
  "group" or no OPOB), where A_n = (R_n - b_n) / sigma_n.

  Args:
    aux_n: the learner's per-row arrays of the whole batch (valid_n, kept_n, length_n, weight_n).
    method: the step's rl.method.Method (its advantage's scale, weights' level, the surrogate's aggregation).
    num_tokens: T of the batch (the token axis), used when the surrogate's loss_norm_tokens is 0.
  """
  valid = jnp.asarray(aux_n["valid_n"], bool)
  a, agg = method.advantage, method.loss
  _, scale = estimator.baseline_and_scale(
    rewards_n, group_id_n, a.estimator, valid_n=valid, std=a.std, std_eps=a.std_eps
  )
  if method.weights.level == "token":
    w = jnp.where(valid, 1.0, 0.0)
  else:
    w = jnp.asarray(aux_n["weight_n"], _F32)
  L = jnp.asarray(aux_n["length_n"], _F32)
  per_row = estimator.LOSS_AGGREGATIONS[agg.loss_agg].per_row(L, jnp.float32(agg.loss_norm_tokens or num_tokens))
  z = method.loss_divisor(aux_n)
  ok = valid & (scale > 0)
  return sg(jnp.where(ok, w * per_row / (z * jnp.where(ok, scale, 1.0)), 0.0))


def has_baseline_telemetry(method) -> bool:
  """Whether the baseline comparison applies: the surrogate with a per-group baseline of raw rewards."""
  return method.peer_loss is None and not (method.baseline is not None and method.baseline.scope == "minibatch")


def step_telemetry(aux: Mapping[str, jax.Array], grad_sq_norm, rewards_n, group_id_n, method, num_tokens) -> dict:
  """The "grad/..." metrics of one step from its aux (needs coef_n, sq_norm_n, valid_n; see module doc).

  Returns {} when the step has no per-example norms (vmap path without OPOB, policy losses), or hands none over:
  the learner passes sq_norm_n only when the method needs the norms (OPOB) or learner.grad_telemetry="norms".

  Keys: grad/top1_share, grad/top5pct_share, grad/ess, grad/ess_ratio, grad/cov_trace, grad/sq_norm
  (||G||^2), grad/snr; with has_baseline_telemetry(method): grad/var_b_used (V of the applied baseline),
  grad/var_b_min, grad/var_b_mean (the group mean reward as baseline), grad/var_ratio (used / min, >= 1
  for a per-group constant baseline; a per-row one, leave-one-out, can fall below it in-sample),
  grad/baseline_gap_rms (RMS of b_used - b_min over counted rows, reward units).
  """
  if aux.get("sq_norm_n") is None or aux.get("coef_n") is None:
    return {}
  valid = jnp.asarray(aux["valid_n"], bool)
  m2 = contribution_sq_norms(aux["coef_n"], aux["sq_norm_n"], valid)
  n = jnp.maximum(jnp.sum(valid.astype(_F32)), 1.0)
  ess = magnitude_ess(m2, valid)
  tr = cov_trace(m2, grad_sq_norm, valid)
  g2 = jnp.asarray(grad_sq_norm, _F32)
  out = {
    "grad/top1_share": top_share(m2, None, valid),
    "grad/top5pct_share": top_share(m2, TOP_FRAC, valid),
    "grad/ess": ess,
    "grad/ess_ratio": ess / n,
    "grad/cov_trace": tr,
    "grad/sq_norm": g2,
    "grad/snr": jnp.where(tr > 0, g2 / jnp.where(tr > 0, tr, 1.0), 0.0),
  }
  if not has_baseline_telemetry(method):
    return out
  r = jnp.asarray(rewards_n, _F32)
  k = applied_multiplier(aux, r, group_id_n, method, num_tokens)
  s = aux["sq_norm_n"]
  b_used = aux["baseline_n"]
  b_min = min_variance_baseline(r, k, s, group_id_n, valid)
  b_mean, _ = estimator.baseline_and_scale(r, group_id_n, "grpo", valid_n=valid)
  v_used, v_min = baseline_variance(r, b_used, k, s, valid), baseline_variance(r, b_min, k, s, valid)
  counted = valid & (k != 0)
  gap2 = jnp.sum(jnp.where(counted, jnp.square(b_used - b_min), 0.0)) / jnp.maximum(jnp.sum(counted), 1)
  out.update(
    {
      "grad/var_b_used": v_used,
      "grad/var_b_min": v_min,
      "grad/var_b_mean": baseline_variance(r, b_mean, k, s, valid),
      "grad/var_ratio": jnp.where(v_min > 0, v_used / jnp.where(v_min > 0, v_min, 1.0), 1.0),
      "grad/baseline_gap_rms": jnp.sqrt(gap2),
    }
  )
  return out


def cosine(a, b):
  """<a, b> / (||a|| ||b||) of two pytrees of the same structure (0 if either is 0), float32."""
  dot = sum(
    jnp.vdot(x.astype(_F32).ravel(), y.astype(_F32).ravel()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  na = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(_F32))) for x in jax.tree.leaves(a)))
  nb = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(_F32))) for x in jax.tree.leaves(b)))
  den = na * nb
  return jnp.where(den > 0, dot / jnp.where(den > 0, den, 1.0), 0.0)
