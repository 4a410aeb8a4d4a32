# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of `vcpo_jax.estimator`
#
# VCPO (arXiv 2602.17616) keeps asynchronous RL stable with two pieces of math:
# an **ESS-scaled learning rate** and the **off-policy optimal baseline (OPOB)**.
# This notebook builds synthetic stale rollouts with a growing lag k and shows
#
# 1. the effective sample size (ESS) collapsing as k grows,
# 2. what each named importance-weight variant does to the same weights,
# 3. the learning-rate scale the ESS rule gives,
# 4. the OPOB baseline against the plain group mean,
# 5. the whole update through `pg_coefficients` with the `vcpo` preset.
#
# Everything here works on your own arrays: the functions take plain
# `[N]` / `[N, T]` arrays (N trajectories, T tokens).
#
# Regenerate the `.ipynb` from the `.py` twin with
# `jupytext --to ipynb examples/estimator_tour.py`.

# %%
import sys

try:
  import vcpo_jax  # noqa: F401
except ImportError:  # running from examples/ without `pip install -e .`
  sys.path.insert(0, "..")

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from vcpo_jax import estimator as E
from vcpo_jax import grad_norms

# %% [markdown]
# ## A toy policy that drifts
#
# The policy emits T tokens from a vocabulary of V; position t has its own
# logits `theta[t]` (a "positional unigram" policy, so log-probs and score
# norms are exact and cheap). Each learner step moves theta a little (a
# random walk). A rollout that is k steps stale was sampled
# from `theta_{s-k}` and is scored by the learner at `theta_s`.

# %%
T, V = 24, 12  # tokens per response, vocabulary
P, G = 8, 8  # prompts x group size
N = P * G
STEP = 0.08  # size of one learner step in logit space

key = jax.random.PRNGKey(0)
k_init, k_walk = jax.random.split(key)
theta0 = jax.random.normal(k_init, (T, V))
# parameter trajectory, a random walk: theta_s = theta0 + STEP * sum_{u<s} noise_u
# (a steady drift would make the policy ever more peaked and hide the effect)
thetas = theta0 + STEP * jnp.cumsum(jax.random.normal(k_walk, (64, T, V)), axis=0)


def sample(theta, key, n=N):
  """tokens [n, T] from the positional policy theta [T, V]."""
  return jax.random.categorical(key, theta[None], axis=-1, shape=(n, T))


def token_logp(theta, tokens):
  """log-probs [n, T] of tokens under theta."""
  logp_tv = jax.nn.log_softmax(theta, axis=-1)
  return jnp.take_along_axis(logp_tv[None], tokens[..., None], axis=-1)[..., 0]


def stale_batch(step, lag, key, length=T):
  """Rollouts sampled at version step - lag, scored at version step."""
  mu, pi = thetas[step - lag], thetas[step]
  tokens = sample(mu, key)
  mask = (jnp.arange(T) < length).astype(jnp.float32)[None].repeat(N, 0)
  return tokens, token_logp(pi, tokens), token_logp(mu, tokens), mask


# %% [markdown]
# ## 1. The ESS ratio collapses with lag
#
# `sequence_log_ratio` sums `sg(logp) - behavior_logp` over the loss mask;
# `ess_ratio` turns log-weights into ESS / N, in log space (no overflow).
# Longer responses make the sequence ratio heavier-tailed, so the same lag
# hurts more.

# %%
lags = [0, 1, 2, 4, 8, 12, 16, 24, 32]
step = 40
rho = {}
for length in (6, 24):
  rho[length] = []
  for lag in lags:
    vals = []
    for r in range(5):
      tokens, logp, beh, mask = stale_batch(step, lag, jax.random.PRNGKey(1000 * lag + r), length)
      l_n = E.sequence_log_ratio(logp, beh, mask)
      vals.append(float(E.ess_ratio(l_n)))
    rho[length].append(np.median(vals))

fig, ax = plt.subplots(figsize=(5, 3.2))
for length, ys in rho.items():
  ax.plot(lags, ys, "o-", label=f"T = {length} tokens")
ax.axhline(1 / N, color="gray", ls=":", label="1/N (one sample)")
ax.set(
  xlabel="lag k (learner steps)", ylabel="ESS / N (median of 5)", yscale="log", title="ESS collapses with staleness"
)
ax.legend()
plt.show()
print({length: np.round(ys, 3).tolist() for length, ys in rho.items()})

# %% [markdown]
# ## 2. Importance-weight variants on one stale batch
#
# One registry, one definition each (`E.WEIGHT_VARIANTS`). Upper-only TIS keeps
# small weights and truncates large ones; two-sided clipping also raises small
# ones; masking drops sequences outside the interval; `geo_mask` looks at the
# per-token geometric mean exp(l / L).

# %%
for name, v in E.WEIGHT_VARIANTS.items():
  print(f"{name:10s} [{v.level:8s}] {v.doc}")

tokens, logp, beh, mask = stale_batch(step, 8, jax.random.PRNGKey(7))
l_n = E.sequence_log_ratio(logp, beh, mask)
L_n = mask.sum(-1)
variants = {
  "is": E.importance_weights(l_n, "is"),
  "tis (c=8)": E.importance_weights(l_n, "tis", c=8.0),
  "clip [0.5, 2]": E.importance_weights(l_n, "clip", lower=0.5, upper=2.0),
  "mask [0.5, 2]": E.importance_weights(l_n, "mask", lower=0.5, upper=2.0),
  "geo_mask [0.9, 1.1]": E.importance_weights(l_n, "geo_mask", lower=0.9, upper=1.1, lengths_n=L_n),
}
order = np.argsort(np.asarray(l_n))
fig, ax = plt.subplots(figsize=(6, 3.2))
for name, w in variants.items():
  ax.plot(np.asarray(w)[order], ".-", label=name, alpha=0.8)
ax.set(yscale="symlog", xlabel="trajectory (sorted by l)", ylabel="weight", title="k = 8: weights of each variant")
ax.legend(fontsize=7)
plt.show()
for name, w in variants.items():
  w = np.asarray(w)
  print(
    f"{name:20s} max {w.max():10.3g}  zero {np.mean(w == 0):.2f}  "
    f"ESS/N {float(E.ess_ratio(np.log(np.maximum(w, 1e-38)), w > 0)):.3f}"
  )

# %% [markdown]
# ## 3. The learning-rate scale
#
# `ess_lr_scale(rho, reference=rho_on, rule)` = rule(min(1, rho / rho_on)),
# capped at 1. rho_on = 1.0 for GSM8K/MATH in the paper; 0.55 for the
# multi-turn task (see `docs/rho_on_protocol.md` for how to measure it).

# %%
fig, ax = plt.subplots(figsize=(5, 3.2))
for rho_on in (1.0, 0.55):
  for rule in ("sqrt", "linear"):
    scale = [float(E.ess_lr_scale(r, reference=rho_on, rule=rule)) for r in rho[24]]
    ax.plot(lags, scale, "o-", label=f"rho_on={rho_on}, {rule}")
ax.set(xlabel="lag k", ylabel="lr multiplier", title="ESS-scaled learning rate (T = 24)")
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# ## 4. OPOB against the group mean
#
# `opob_baseline(R, w, ||s||^2, group)` weights each reward by w^2 ||s||^2.
# The squared score norms come from `grad_norms.per_example_sq_grad_norms`, the exact
# reference path (vmap of per-example gradients). Rewards here: 1 when the
# response holds more low-id tokens than the batch median (about half the
# samples), so they depend on the sampled tokens.

# %%
tokens, logp, beh, mask = stale_batch(step, 8, jax.random.PRNGKey(11))
score = jnp.mean(tokens < V // 3, axis=-1)
rewards = (score > jnp.median(score)).astype(jnp.float32)
group = jnp.repeat(jnp.arange(P), G)
l_n = E.sequence_log_ratio(logp, beh, mask)


def seq_logp(theta, example):
  """sum_t mask_t log pi(y_t): its gradient is the token-sum score s_n."""
  return jnp.sum(token_logp(theta, example["tokens"][None])[0] * example["mask"])


sq = grad_norms.per_example_sq_grad_norms(seq_logp, thetas[step], {"tokens": tokens, "mask": mask})
w_tis = E.importance_weights(l_n, "tis", c=8.0)
b_group = rewards - E.advantages(rewards, group, "drgrpo")  # drgrpo: A = R - group mean
b_opob = E.opob_baseline(rewards, E.importance_weights(l_n, "is"), sq, group)
b_opob_applied = E.opob_baseline(rewards, w_tis, sq, group)
b_opob_loo = E.opob_baseline(rewards, E.importance_weights(l_n, "is"), sq, group, leave_one_out=True)

fig, ax = plt.subplots(figsize=(6, 3.2))
x = np.arange(N)
ax.plot(x, rewards, "k.", label="reward")
ax.step(x, b_group, where="mid", label="group mean")
ax.plot(x, b_opob, "s", ms=3, label="OPOB (unclipped w)")
ax.plot(x, b_opob_applied, "^", ms=3, label="OPOB (applied TIS w)")
ax.plot(x, b_opob_loo, "x", ms=4, label="OPOB leave-one-out")
for p in range(1, P):
  ax.axvline(p * G - 0.5, color="gray", lw=0.5)
ax.set(xlabel="trajectory (grouped by prompt)", ylabel="baseline", title="k = 8 baselines")
ax.legend(fontsize=7, ncol=2)
plt.show()

# %% [markdown]
# ## 5. The whole update: `pg_coefficients` of a method (a preset)
#
# The surrogate loss is `-sum_n coef_n * sum_t tokw_nt * logp_nt`; `coef_n`
# holds advantage, applied IS weight and the aggregation normalizer, all
# stop-gradient. `aux` carries the metrics a learner logs, and `lr_scale` is
# what `vcpo_jax.optim.make_optimizer(...).update(..., ess_scale=...)` takes.
# A method is one value (`E.Method`: advantage, weights, baseline, loss, lr
# rule), each part built by a factory of its own options.

# %%
cfg = E.method_from_preset("vcpo")
print(cfg)
coef_n, aux = E.pg_coefficients(logp, beh, mask, rewards, group, sq, cfg)
for k, v in aux.items():
  if not k.endswith("_n"):
    print(f"{k:18s} {float(v):.4g}")

# %% [markdown]
# The same batch with every preset (on-policy data would make all of them
# agree with plain GRPO, up to the OPOB baseline). `coef_n` is only the
# surrogate's side: the policy-loss presets (ppo_clip, gspo, icepop, ...)
# bring their own ratio, clip, mask and aggregation, so they are compared by
# what the learner differentiates, `d loss / d logp_nt` at pi_theta = pi_old
# (the first update of a step, as `learner._policy_loss_gradient` does), and
# its cosine with the uncorrected `none` preset's. ppo_clip, gspo and cispo
# equal `none` here: they ignore mu and correct only the drift within a step
# (r = pi_theta / pi_old = 1 at its first update; see learner.ppo_epochs).

# %%
def loss_gradient(cfg):
  """d loss / d logp_nt [N, T] of a preset on this batch."""
  c, a = E.pg_coefficients(logp, beh, mask, rewards, group, sq, cfg)
  if cfg.peer_loss is None:
    return -c[:, None] * E.pg_token_weights(logp, beh, mask, cfg), a
  fn = cfg.bind_loss({})
  return jax.grad(lambda x: fn(x, logp, beh, a["advantage_n"], mask)[0])(logp), a


g_none, _ = loss_gradient(E.method_from_preset("none"))
for name in E.PRESETS:
  g, a = loss_gradient(E.method_from_preset(name))
  cos = float(jnp.sum(g * g_none) / (jnp.linalg.norm(g) * jnp.linalg.norm(g_none) + 1e-30))
  print(
    f"{name:18s} |dL/dlogp|_1 = {float(jnp.abs(g).sum()):.4f}  cos(none) = {cos:+.3f}"
    f"  lr_scale = {float(a['lr_scale']):.3f}  ESS/N applied = {float(a['ess_ratio_applied']):.3f}"
  )
