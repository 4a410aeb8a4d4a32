"""One jitted learner step: Batch -> log-probs -> VCPO coefficients -> gradients -> update.

    logp_nt      = policy log-probs of the batch's tokens (one forward pass)
    coef_n, aux  = estimator.pg_coefficients(...)      (ratios, ESS, advantages, OPOB)
    grads        = d/dparams [ -sum_n coef_n sum_t tokw_nt logp_nt ]
    update       = clip -> AdamW -> x lr_scale (ESS rule, this step only)

The gradient path is chosen by name at build time (`grad_path`):
  "ghost": exact per-example norms and the gradient from one forward and one
           backward pass to the layer outputs (vcpo_jax.grad_norms);
  "vmap":  the reference path of the estimator (vmap of per-example gradients
           for the norms, then a second backward pass).
Both give the same gradient; tests check it. Methods without OPOB need no norms
and both paths reduce to one forward + one backward.

A step whose loss or gradient is not finite is skipped (parameters and optimizer
state unchanged, `nonfinite` = 1 in the metrics); the trainer aborts or goes on
according to its config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from vcpo_jax import estimator
from vcpo_jax.model import transformer

GRAD_PATHS = ("ghost", "vmap")

# Keys of the device batch (fixed shapes; see trainer / rollout).
BATCH_KEYS = ("tokens", "valid_mask", "loss_mask", "behavior_logp", "rewards", "group_id")


class TrainState(NamedTuple):
  params: Any  # nnx.State of float32 parameters
  opt_state: Any  # optax state of make_optimizer's chain
  step: jax.Array  # int32 [], number of updates applied (including skipped ones)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  pg: estimator.PGConfig
  grad_path: str = "ghost"

  def __post_init__(self):
    if self.grad_path not in GRAD_PATHS:
      raise ValueError(f"learner.grad_path={self.grad_path!r}: choose one of {GRAD_PATHS}.")


def make_logp_fn(graphdef) -> Callable:
  """logp_fn(params, batch) -> logp_nt [N, T] of batch["tokens"] under the policy."""

  def logp_fn(params, batch):
    return transformer.sequence_logprobs(graphdef, params, batch["tokens"], batch["valid_mask"])

  return logp_fn


def _gradient(graphdef, params, batch, cfg: LearnerConfig):
  if cfg.grad_path == "ghost":
    from vcpo_jax import grad_norms  # the fast path; imported lazily to keep this module light

    return grad_norms.ghost_policy_gradient(make_logp_fn(graphdef), params, batch, cfg.pg)
  return estimator.policy_gradient(make_logp_fn(graphdef), params, batch, cfg.pg)


def make_train_step(graphdef, tx: optax.GradientTransformationExtraArgs, cfg: LearnerConfig):
  """Returns train_step(state, batch) -> (state, metrics); jit it (donate state)."""

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    grads, aux = _gradient(graphdef, state.params, batch, cfg)
    grad_norm = optax.global_norm(grads)
    lr_scale = aux["lr_scale"]
    updates, new_opt = tx.update(grads, state.opt_state, state.params, ess_scale=lr_scale)
    new_params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(aux["pg_loss"])
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = TrainState(keep(new_params, state.params), keep(new_opt, state.opt_state), state.step + 1)
    metrics = {k: v for k, v in aux.items() if jnp.ndim(v) == 0}
    metrics.update(
      grad_norm=grad_norm, update_norm=optax.global_norm(updates), nonfinite=1.0 - finite.astype(jnp.float32)
    )
    return new_state, metrics

  return train_step


def make_plain_grad_fn(graphdef):
  """A plain policy-gradient step (fixed coefficients, no norms): the yardstick of the norm overhead.

  Returns f(params, batch) -> global gradient norm of -sum_n R_n sum_t mask_nt logp_nt: one forward and
  one backward pass, what a GRPO learner without per-example norms pays. The trainer times it next to
  the real step every `log.norm_overhead_every` steps and logs the ratio.
  """
  logp_fn = make_logp_fn(graphdef)

  def plain(params, batch):
    def loss(p):
      logp = logp_fn(p, batch)
      return -jnp.sum(batch["rewards"][:, None] * batch["loss_mask"] * logp)

    return optax.global_norm(jax.grad(loss)(params))

  return plain


def init_state(params, tx) -> TrainState:
  return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
