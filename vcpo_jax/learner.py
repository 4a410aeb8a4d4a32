"""One jitted learner step: Batch -> log-probs -> VCPO coefficients -> gradients -> update.

    logp_nt      = policy log-probs of the batch's tokens (one forward pass)
    coef_n, aux  = estimator.pg_coefficients(...)      (ratios, ESS, advantages, OPOB)
    grads        = d/dparams [ -sum_n coef_n sum_t tokw_nt logp_nt ]
    update       = clip -> AdamW -> x lr_scale (ESS rule, this step only)

The gradient path is chosen by name at build time (`grad_path`, `policy_gradient(path)`; this
module is the one place that chooses it):
  "ghost": exact per-example norms and the gradient from one forward and one
           backward pass to the layer outputs (vcpo_jax.grad_norms);
  "vmap":  the reference path of the estimator (vmap of per-example gradients
           for the norms, then a second backward pass).
Both give the same gradient; tests check it. Methods without OPOB need no norms
and both paths reduce to one forward + one backward.

Micro-batching (`microbatch_size` rows, whole groups each) is exact: the step
equals the single-pass step. Inside a `lax.scan` over micro-batches, each one
runs the gradient path (so the ghost path holds one micro-batch's activations
and (A, D) pairs) with its coefficients WITHOUT the loss aggregation's
whole-batch count Z (`estimator.pg_coefficients(..., divisor=1.0)`); float32
gradients and the per-row arrays are accumulated. Every coefficient term is
per row or per group (advantages, group std, OPOB from the group's own norms),
so it is the same in a micro-batch of whole groups; the whole-batch terms are
scalar factors taken from the stacked rows after the scan: Z
(`estimator.loss_divisor`: valid or kept rows / tokens) divides the
accumulated gradient, the ESS and its lr scale (`estimator.pg_metrics`) reach
the optimizer, whose global-norm clip runs once, after accumulation. Methods
whose coefficients read rows outside the group (`estimator.
batch_wide_coefficients`: the REINFORCE batch-mean baseline, minibatch-scope
OPOB) are rejected with micro-batching; no preset is one.

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

from vcpo_jax import estimator, sharding
from vcpo_jax.model import transformer

GRAD_PATHS = ("ghost", "vmap")


class TrainState(NamedTuple):
  params: Any  # nnx.State of float32 parameters
  opt_state: Any  # optax state of make_optimizer's chain
  step: jax.Array  # int32 [], number of updates applied (including skipped ones)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """The learner step's static choices.

  microbatch_size: rows per micro-batch; None or 0 runs the whole batch in one pass. It must be a
    multiple of the group size G (rows of a group are contiguous in every Batch) and divide the batch
    size N; give group_size / batch_size to have that checked here, at config time.
  """

  pg: estimator.PGConfig
  grad_path: str = "ghost"
  microbatch_size: int | None = None  # rows per micro-batch (whole groups); None / 0: one pass
  group_size: int | None = None  # G, only for the config-time check of microbatch_size
  batch_size: int | None = None  # N = P * G, only for the config-time check of microbatch_size

  def __post_init__(self):
    if self.grad_path not in GRAD_PATHS:
      raise ValueError(f"learner.grad_path={self.grad_path!r}: choose one of {GRAD_PATHS}.")
    mb = self.microbatch_size
    if mb is None or mb == 0:
      return
    if not isinstance(mb, int) or mb < 0:
      raise ValueError(f"learner.microbatch_size={mb!r}: must be an int >= 0 (0 or None: the whole batch).")
    g, n = self.group_size, self.batch_size
    if g and mb % g:
      raise ValueError(
        f"learner.microbatch_size={mb} is not a multiple of the group size {g} (task.group_size): a micro-batch "
        f"must hold whole groups; use a multiple of {g}."
      )
    if n and n % mb:
      raise ValueError(f"learner.microbatch_size={mb} does not divide the batch size N={n}; use a divisor of {n}.")
    why = estimator.batch_wide_coefficients(self.pg)
    if why:
      raise ValueError(
        f"learner.microbatch_size={mb} with {why}: micro-batches of whole groups cannot be exact; "
        "set learner.microbatch_size=0."
      )

  def microbatches(self, n: int) -> int:
    """Number of micro-batches for a batch of n rows (1: the single-pass step)."""
    mb = self.microbatch_size
    if not mb or mb >= n:
      return 1
    if n % mb:
      raise ValueError(f"learner.microbatch_size={mb} does not divide the batch size N={n}; use a divisor of {n}.")
    return n // mb


def make_logp_fn(graphdef) -> Callable:
  """logp_fn(params, batch) -> logp_nt [N, T] of batch["tokens"] under the policy."""

  def logp_fn(params, batch):
    return transformer.sequence_logprobs(graphdef, params, batch["tokens"], batch["valid_mask"])

  return logp_fn


def policy_gradient(path: str) -> Callable:
  """The gradient path by name: f(logp_fn, params, batch, pg, *, divisor=None) -> (grads, aux).

  "ghost": grad_norms.ghost_policy_gradient; "vmap": estimator.policy_gradient (same results).
  """
  if path not in GRAD_PATHS:
    raise ValueError(f"learner.grad_path={path!r}: choose one of {GRAD_PATHS}.")
  if path == "ghost":
    from vcpo_jax import grad_norms  # the fast path; imported lazily to keep this module light

    return grad_norms.ghost_policy_gradient
  return estimator.policy_gradient


def _gradient(graphdef, params, batch, cfg: LearnerConfig):
  """(grads, aux) of the whole batch: one pass, or a scan over micro-batches (same result)."""
  grad_fn = policy_gradient(cfg.grad_path)
  logp_fn = make_logp_fn(graphdef)
  n = batch["tokens"].shape[0]
  k = cfg.microbatches(n)
  if k == 1:
    return grad_fn(logp_fn, params, batch, cfg.pg)

  # [K, N / K, ...]: whole groups; each micro-batch's rows stay split over the mesh's batch axes (under a
  # mesh; a no-op without one), so per-device activation memory falls with data x fsdp.
  mbs = jax.tree.map(
    lambda x: sharding.constrain(x.reshape((k, n // k) + x.shape[1:]), (None, sharding.BATCH_AXES)), batch
  )

  def body(acc, mb):
    grads, aux = grad_fn(logp_fn, params, mb, cfg.pg, divisor=1.0)
    acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
    rows = {key: v for key, v in aux.items() if key.endswith("_n")}
    return acc, (rows, aux["pg_loss"])

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  acc, (rows, losses) = jax.lax.scan(body, zeros, mbs)
  rows = {key: v.reshape((n,) + v.shape[2:]) for key, v in rows.items()}
  z = estimator.loss_divisor(rows, cfg.pg)  # the whole batch's count, a scalar factor
  grads = jax.tree.map(lambda a, p: (a / z).astype(p.dtype), acc, params)
  return grads, dict(estimator.pg_metrics(rows, cfg.pg), **rows, pg_loss=jnp.sum(losses) / z)


def make_train_step(graphdef, tx: optax.GradientTransformationExtraArgs, cfg: LearnerConfig):
  """Returns train_step(state, batch) -> (state, metrics); jit it (donate state)."""

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    grads, aux = _gradient(graphdef, state.params, batch, cfg)
    grad_norm = optax.global_norm(grads)
    lr_scale = aux["lr_scale"]
    # clip -> AdamW -> x lr_scale, once per step (after accumulation when micro-batched)
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
