"""One jitted learner step: Batch -> log-probs -> VCPO coefficients -> gradients -> update.

    logp_nt      = policy log-probs of the batch's tokens (one forward pass)
    coef_n, aux  = method.coefficients(...)            (ratios, ESS, advantages, OPOB)
    grads        = d/dparams [ -sum_n coef_n sum_t tokw_nt logp_nt ]
    update       = clip -> AdamW -> x lr_scale (ESS rule, this step only)

The gradient path is chosen by name at build time (`grad_path`, `policy_gradient(path)`; this
module is the one place that chooses it):
  "ghost": exact per-example norms and the gradient from one forward and one
           backward pass to the layer outputs (vcpo_jax.grad_norms);
  "vmap":  the reference path (vmap of per-example gradients for the norms,
           grad_norms.per_example_sq_grad_norms, then a second backward pass).
Both give the same gradient; tests check it. A step that computes no norms (no OPOB, no "norms" telemetry,
no score centering) takes the plain gradient whatever the path: one forward and one backward.

Micro-batching (`microbatch_size` rows, whole groups each) is exact: the step equals the single-pass step.
A `lax.scan` over micro-batches runs the gradient path on each with the coefficients WITHOUT the whole-batch
count Z (`method.coefficients(..., divisor=1.0)`) and accumulates float32 gradients and per-row arrays; the
whole-batch scalars (Z = `method.loss_divisor`, the ESS and its lr scale) are applied after the scan, and the
global-norm clip runs once. Methods whose coefficients read rows outside the group (`method.batch_wide`) are
rejected with micro-batching (why this is exact: docs/design_notes.md "learner.py").

The peers' stabilizers (a method whose `peer_loss` is set: PPO clip, GSPO, CISPO, ...; vcpo_jax/rl/losses.py)
replace the surrogate by their own loss of (log pi_theta, log pi_old, log mu, A, mask), with the step inputs
the loss declares (PeerLoss.needs) bound by name: one forward, the loss's cotangent d loss / d logp_nt, one
backward (`_policy_loss_gradient`). With `ppo_epochs * minibatches` > 1 a trainer step makes that many
optimizer updates on minibatches of whole groups, pi_old recomputed once at the start (`_multi_update_step`).
Neither combines with micro-batching (rejected at config time).

LoRA (model.lora_rank > 0, vcpo_jax.model.lora): state.params is the whole model; the step splits it into the
adapters (what is differentiated, what the per-example norms cover, what the optimizer updates and holds state
for) and the frozen base (closed over by logp_fn, returned unchanged): `lora.split` / `lora.combine`.

A step whose loss or gradient is not finite is skipped (parameters and optimizer state unchanged,
`nonfinite` = 1 in the metrics); the trainer aborts or goes on according to its config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from vcpo_jax import batch as batch_lib
from vcpo_jax import grad_norms, sharding, telemetry
from vcpo_jax import score_centering as sc_lib
from vcpo_jax.model import lora, moe, transformer
from vcpo_jax.rl import ess as ess_lib
from vcpo_jax.rl import losses as policy_losses
from vcpo_jax.rl.method import Method
from vcpo_jax.schema import check_field

sg = jax.lax.stop_gradient


class TrainState(NamedTuple):
  params: Any  # nnx.State of the whole model (with LoRA: frozen base in the compute dtype + float32 adapters)
  opt_state: Any  # optax state of make_optimizer's chain, over the trainable parameters (lora.split)[0]
  step: jax.Array  # int32 [], number of updates applied (including skipped ones)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """The learner step's static choices; config.learner is this class (its fields but method, group_size and
  batch_size, which run_config.parse_config sets: the checks that need them run then).

  microbatch_size: rows per micro-batch; None or 0 runs the whole batch in one pass. It must be a
    multiple of the group size G (rows of a group are contiguous in every Batch) and divide the batch
    size N; give group_size / batch_size to have that checked here, at config time.
  ghost_passes: the ghost path's backward passes (grad_norms.ghost_sq_norms_and_grad's passes): 1, one
    backward with every layer's (A, D) kept for the update; 2, the norms formed block by block inside a
    first backward and the update from a second one (one layer's (A, D) alive at a time: long sequences);
    "auto", one pass while what it keeps alive (grad_norms.one_pass_bytes, per device and micro-batch)
    fits one_pass_budget_gib, else two (chosen at trace time from the shapes, logged).
  ppo_epochs, minibatches: ppo_epochs * minibatches optimizer updates per trainer step, each on N /
    minibatches rows of whole groups, with pi_old recomputed once per step (_multi_update_step); only for
    a peer loss (method.peer_loss). 1 and 1: today's single update, the same computation.
  grad_telemetry: the grad/ metrics of vcpo_jax.telemetry, which read the step's per-example norms S_n. True:
    when the method computes them anyway (method.needs_sq_norms: OPOB), else none, so that a method
    without norms pays nothing (XLA drops the ghost path's unused norms); "norms": also for such a method,
    which then computes them for the telemetry (the plain ghost step's cost, ~1% of its flops on the CPU
    default); False: no grad/ metrics.
  router_aux_loss_coef: an MoE model's loss gains router_aux_loss_coef x `router_aux_loss` (transformers'
    load-balancing loss, Qwen3MoeForCausalLM's aux_loss; `_add_router_aux`); 0, RL's default, leaves it out.
    A checkpoint's own router_aux_loss_coef (ModelConfig's, read from its config.json) is never applied by itself:
    set this field (e.g. to that value) to train with it.
  on_nonfinite: what the trainer does with a step whose update is not finite: "skip" it (and log) or "abort".
  """

  # Set by run_config.parse_config (out of config.learner): the method and the batch layout its checks need.
  method: Method | None = dataclasses.field(default=None, metadata={"config": False})
  grad_path: str = "ghost"  # ghost (fast exact norms) | vmap (reference path)
  # ghost backward passes: 1 (all layers' (A, D) kept) | 2 (norms block by block, long T) | "auto" (by memory)
  ghost_passes: int | str = 1  # int 1 | 2, or the str "auto"
  one_pass_budget_gib: float = 24.0  # "auto": per-device GiB one pass may keep
  # grad/ metrics every step. True: when the method computes per-example norms (OPOB), else none (no cost);
  # "norms": computes them for the telemetry (the plain ghost step pays for them); False: off (math learner -1.8 GiB)
  grad_telemetry: bool | str = True  # True (if the method has norms: OPOB) | "norms" | False
  microbatch_size: int | None = 0  # rows per micro-batch, whole groups (a multiple of task.group_size); 0: one pass
  group_size: int | None = dataclasses.field(default=None, metadata={"config": False})  # G
  batch_size: int | None = dataclasses.field(default=None, metadata={"config": False})  # N = P * G
  ppo_epochs: int = 1  # passes over each batch per step (policy-loss methods only)
  minibatches: int = 1  # updates per pass, each on whole groups; pi_old once per step
  router_aux_loss_coef: float = 0.0  # MoE: weight of the router balance loss (0: off)
  on_nonfinite: str = "skip"  # skip the update and log | abort with the step range

  def __post_init__(self):
    if self.grad_path not in GRAD_PATHS:
      raise ValueError(f"learner.grad_path={self.grad_path!r}: choose one of {GRAD_PATHS}.")
    if self.ghost_passes not in grad_norms.PASSES + ("auto",) or isinstance(self.ghost_passes, bool):
      raise ValueError(
        f"learner.ghost_passes={self.ghost_passes!r}: choose one of {grad_norms.PASSES} or 'auto' "
        "(1: one backward; 2: norms block by block, then the update, for long sequences; auto: by memory)."
      )
    if isinstance(self.one_pass_budget_gib, bool) or not (
      isinstance(self.one_pass_budget_gib, (int, float)) and self.one_pass_budget_gib > 0
    ):
      raise ValueError(
        f"learner.one_pass_budget_gib={self.one_pass_budget_gib!r}: give a positive number of GiB per device."
      )
    ok = self.on_nonfinite in ("skip", "abort")
    check_field(ok, "learner.on_nonfinite", self.on_nonfinite, "choose 'skip' or 'abort'.")
    self._check_updates()
    self._check_telemetry()
    c = self.router_aux_loss_coef
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not c >= 0:
      raise ValueError(
        f"learner.router_aux_loss_coef={c!r}: give a number >= 0 (0: off; transformers' default weight is 0.001)."
      )
    if (
      self.method is not None
      and self.method.centering is not None
      and self.grad_path == "ghost"
      and self.ghost_passes != 1
    ):
      raise ValueError(
        f"learner.ghost_passes={self.ghost_passes!r} with method.loss.score_centering={self.method.centering[0]!r}: the "
        "centered score's dense head term runs in the one-pass ghost step only; set learner.ghost_passes=1."
      )
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
    why = self.method is not None and self.method.batch_wide
    if why:
      raise ValueError(
        f"learner.microbatch_size={mb} with the method's {why}: micro-batches of whole groups cannot be exact; "
        "set learner.microbatch_size=0."
      )

  def _check_updates(self):
    """ppo_epochs / minibatches: ints >= 1; several updates need a policy loss and whole groups."""
    for f in ("ppo_epochs", "minibatches"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"learner.{f}={v!r}: must be an int >= 1 (1: one update per trainer step).")
    if self.updates_per_step == 1 or self.method is None:
      return
    if self.method.peer_loss is None:
      f = "minibatches" if self.minibatches > 1 else "ppo_epochs"
      raise ValueError(
        f"learner.{f}={getattr(self, f)}: several updates per step need a policy-loss method (ppo_clip, gspo, ...); "
        "this method's surrogate has no ratio to pi_old. Set learner.ppo_epochs=1 and learner.minibatches=1."
      )
    if self.microbatch_size:
      raise ValueError(
        f"learner.microbatch_size={self.microbatch_size} with ppo_epochs * minibatches = {self.updates_per_step} "
        "updates per step: set learner.microbatch_size=0."
      )
    m, g, n = self.minibatches, self.group_size, self.batch_size
    if n and n % m:
      raise ValueError(f"learner.minibatches={m} does not divide the batch size N={n}; use a divisor of {n}.")
    if n and g and (n // m) % g:
      raise ValueError(
        f"learner.minibatches={m}: a minibatch of N / {m} = {n // m} rows is not whole groups of G={g}; "
        f"use a divisor of the number of prompts {n // g}."
      )

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates per trainer step: ppo_epochs * minibatches (1: the single update)."""
    return self.ppo_epochs * self.minibatches

  def microbatches(self, n: int) -> int:
    """Number of micro-batches for a batch of n rows (1: the single-pass step)."""
    mb = self.microbatch_size
    if not mb or mb >= n:
      return 1
    if n % mb:
      raise ValueError(f"learner.microbatch_size={mb} does not divide the batch size N={n}; use a divisor of {n}.")
    return n // mb

  @property
  def telemetry_norms(self) -> bool:
    """Whether the step's telemetry reads the per-example norms (see grad_telemetry)."""
    return self.grad_telemetry == "norms" or (self.grad_telemetry is True and self.method.needs_sq_norms)

  @property
  def computes_norms(self) -> bool:
    """Whether the step computes per-example norms (the method's OPOB, or the "norms" telemetry). Without them
    the ghost path's taps and plans buy nothing, and the step takes the plain gradient (one forward, one
    backward; `_gradient_rows`)."""
    return self.method.needs_sq_norms or self.telemetry_norms

  def _check_telemetry(self):
    t = self.grad_telemetry
    if not (isinstance(t, bool) or t == "norms"):
      raise ValueError(
        f"learner.grad_telemetry={t!r}: choose True (the grad/ metrics when the method computes per-example "
        "norms), 'norms' (compute them for the telemetry too) or False."
      )
    if self.method is None:
      return
    peer = self.method.peer_loss
    if t == "norms" and (self.grad_path != "ghost" or peer is not None):
      loss = "surrogate" if peer is None else repr(peer.name)
      raise ValueError(
        f"learner.grad_telemetry='norms' with learner.grad_path={self.grad_path!r} and the {loss} loss: only the "
        "ghost path of the surrogate has per-example norms to add; use True."
      )


def make_logp_fn(graphdef, frozen=None) -> Callable:
  """logp_fn(params, batch) -> logp_nt [N, T] of batch["tokens"] under the policy (renormalised over the
  sampler's recorded support where the batch carries one, Batch.support_thr).

  frozen: the frozen base (LoRA, `lora.split`): then params are the adapters only, and the gradient paths
  differentiate (and take per-example norms over) nothing else."""

  def logp_fn(params, batch):
    params = lora.combine(params, frozen)
    # Support replay (model/support.py): a batch carrying the sampler's kept support (Batch.support_thr) is
    # scored renormalised over it, so on-policy log(pi / mu) = 0 with top-k / top-p sampling.
    thr = batch.get("support_thr")
    # MoE routing replay: the sampler's recorded experts, when the batch carries them (model.routing_replay),
    # placed on the token columns (prompt columns -1: the learner routes them itself)
    experts = _token_experts(batch)
    return transformer.sequence_logprobs(graphdef, params, batch["tokens"], batch["valid_mask"], thr, experts)

  return logp_fn


def _token_experts(batch):
  """Batch.expert_ids [N, R, E] on the token columns [N, T, E] (-1 on the prompt columns), or None."""
  experts = batch.get("expert_ids")
  return None if experts is None else batch_lib.at_token_columns(experts, batch["tokens"].shape[1], fill=-1)


# ---------------------------------------------------------------------------
# Gradient paths: f(logp_fn, params, batch, method) -> (grads, aux), one per name
# ---------------------------------------------------------------------------


def _check_batch(batch) -> None:
  missing = [k for k in batch_lib.PG_KEYS if k not in batch]
  if missing:
    raise ValueError(f"batch: missing keys {missing}; need {list(batch_lib.PG_KEYS)}")


def _coefficients(logp_nt, batch, method: Method, sq_n, divisor):
  return method.coefficients(
    logp_nt, batch["behavior_logp"], batch["loss_mask"], batch["rewards"], batch["group_id"], sq_n, divisor=divisor
  )


def _vmap_gradient(logp_fn, params, batch, method: Method, *, divisor=None, current_version=None, centering=None):
  """The reference path: one forward (jax.vjp), norms by vmap of per-example grads, one backward.

  logp_nt, vjp = jax.vjp(logp_fn(., batch), params)
  S_n          = ||grad_params sum_t mask_nt logp_nt||^2      (grad_norms.per_example_sq_grad_norms; OPOB only)
  coef_n, aux  = method.coefficients(sg(logp_nt), ..., S_n)
  grads        = vjp(-coef_n tokw_nt)                       (tokw_nt = method.token_weights)

  centering (a score_centering.StepCentering, or None): every score is centered (`_centered_vmap_gradient`).
  """
  _check_batch(batch)
  if method.peer_loss is not None:
    return _policy_loss_gradient(logp_fn, params, batch, method, current_version=current_version)
  if centering is not None:
    return _centered_vmap_gradient(centering, params, batch, method, divisor)
  logp_nt, vjp = jax.vjp(lambda p: logp_fn(p, batch), params)
  sq = None
  if method.needs_sq_norms:

    def score(p, example):
      ex1 = jax.tree_util.tree_map(lambda x: x[None], example)
      return jnp.sum(logp_fn(p, ex1)[0].astype(jnp.float32) * ex1["loss_mask"][0].astype(jnp.float32))

    sq = grad_norms.per_example_sq_grad_norms(score, params, dict(batch))
  coef_n, aux = _coefficients(logp_nt, batch, method, sq, divisor)
  tokw_nt = method.token_weights(logp_nt, batch["behavior_logp"], batch["loss_mask"])
  cot_nt = -coef_n[:, None] * tokw_nt  # d loss / d logp_nt
  (grads,) = vjp(cot_nt.astype(logp_nt.dtype))
  # where(): masked-out positions may hold logp = -inf; their cotangent is 0 and must not give nan.
  pg_loss = jnp.sum(jnp.where(tokw_nt != 0, cot_nt * sg(logp_nt).astype(jnp.float32), 0.0))
  rows = dict(coef_n=coef_n) if sq is None else dict(coef_n=coef_n, sq_norm_n=sq)  # for vcpo_jax.telemetry
  return grads, dict(aux, pg_loss=pg_loss, **rows)


def _centered_vmap_gradient(centering, params, batch, method: Method, divisor):
  """The vmap path with centered scores: score_t = tokw_t log p(y_t) - corr_t, corr_t = sum_v sg[c_tv] log p_tv.

    (logp_nt, corr_nt), vjp = jax.vjp(centering.logp_fn(., batch), params)
    S_n   = ||grad_params sum_t mask_nt (logp_nt - corr_nt)||^2     (OPOB only: the CENTERED score's norm)
    grads = vjp(-coef_n tokw_nt, +coef_n mask_nt)  =  grad of -sum_n coef_n sum_t (tokw log p - corr)

  As score_centering.centered_gradient, with the drift diagnostics as per-row sums (drift_rows).
  """
  mask = jnp.asarray(batch["loss_mask"], jnp.float32)
  (logp_nt, corr_nt, diag), vjp = jax.vjp(lambda p: centering.logp_fn(p, batch), params)
  sq = None
  if method.needs_sq_norms:

    def score(p, example):
      ex1 = jax.tree_util.tree_map(lambda x: x[None], example)
      lp, corr, _ = centering.logp_fn(p, ex1)
      return jnp.sum((lp[0].astype(jnp.float32) - corr[0]) * ex1["loss_mask"][0].astype(jnp.float32))

    sq = grad_norms.per_example_sq_grad_norms(score, params, dict(batch))
  coef_n, aux = _coefficients(sg(logp_nt), batch, method, sq, divisor)
  tokw_nt = method.token_weights(sg(logp_nt), batch["behavior_logp"], mask)
  cot_lp = -coef_n[:, None] * tokw_nt
  cot_corr = coef_n[:, None] * mask
  (grads,) = vjp((cot_lp.astype(logp_nt.dtype), cot_corr, jax.tree.map(jnp.zeros_like, diag)))
  lp_val = jnp.where(tokw_nt != 0, sg(logp_nt).astype(jnp.float32), 0.0)
  pg_loss = jnp.sum(cot_lp * lp_val + cot_corr * sg(corr_nt))
  rows = dict(coef_n=coef_n) if sq is None else dict(coef_n=coef_n, sq_norm_n=sq)
  masses = {k: diag[k] for k in ("p_head_mass", "q_head_mass") if k in diag}  # top-k centering's
  rows.update(
    sc_lib.drift_rows(sg(logp_nt), batch["behavior_logp"], mask, diag["coef_l1"], diag.get("kl_qp"), **masses)
  )
  return grads, dict(aux, pg_loss=pg_loss, **rows)


def _ghost_gradient(
  logp_fn,
  params,
  batch,
  method: Method,
  *,
  divisor=None,
  current_version=None,
  norm_method: str = "auto",
  memory_budget_bytes: int | None = None,
  batch_shards: int | None = None,
  passes: int | str = 1,
  one_pass_budget_bytes: int | None = None,
  centering=None,
):
  """The fast path: exact S_n and the gradient from one forward and one backward to the layer outputs.

    tokw_nt     = method.token_weights(sg(logp_nt), ...)
    coef_n, aux = method.coefficients(sg(logp_nt), ..., S_n)         S_n: the ghost norms of the
                                                                       tokw-weighted score
    grads       = -sum_n coef_n sum_t tokw_nt grad logp_nt            from the same (A, D) pairs

  (grad_norms.ghost_sq_norms_and_grad). OPOB only runs with sequence-level weights, where tokw_nt =
  loss_mask, so S_n is the norm it needs. aux also holds sq_norm_n [N] (the exact S_n, whether or not
  the method uses it). norm_method / memory_budget_bytes / batch_shards: the norms' plan (grad_norms.plan_layers),
  chosen from this (micro-)batch's shapes; passes / one_pass_budget_bytes: 1, 2 or "auto"
  (grad_norms.ghost_sq_norms_and_grad). centering (a score_centering.StepCentering, or None): the scores are
  centered, the head's per-token output gradient gains the dense term of `centering.head_coefs(batch)`
  (one stop-gradient forward of the behaviour parameters), and aux the per-row drift sums.
  """
  _check_batch(batch)
  if method.peer_loss is not None:
    return _policy_loss_gradient(logp_fn, params, batch, method, current_version=current_version)
  beh, mask = batch["behavior_logp"], batch["loss_mask"]
  head_coefs = None if centering is None else centering.head_coefs(batch)
  res = grad_norms.ghost_sq_norms_and_grad(
    logp_fn,
    params,
    batch,
    lambda logp_nt: method.token_weights(logp_nt, beh, mask),
    lambda logp_nt, sq_n: _coefficients(logp_nt, batch, method, sq_n, divisor),
    method=norm_method,
    memory_budget_bytes=memory_budget_bytes,
    batch_shards=batch_shards,
    passes=passes,
    one_pass_budget_bytes=one_pass_budget_bytes,
    head_coefs=head_coefs,
  )
  out = dict(res.aux, pg_loss=res.loss, sq_norm_n=res.sq_norms_n, coef_n=res.coef_n)
  if centering is not None:  # e_abs [N, M] sits at the position predicting token m + 1
    at_token = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
    masses = {k: at_token(res.head_sums[k]) for k in ("p_head_mass", "q_head_mass") if k in res.head_sums}
    out.update(sc_lib.drift_rows(res.logp_nt, beh, mask, at_token(res.head_sums["e_abs"]), **masses))
  return res.grads, out


def _bound_policy_loss(method: Method, batch, current_version=None):
  """The method's peer loss with the step inputs it declares (PeerLoss.needs, rl.losses.STEP_INPUTS) bound.

  current_version: the version the update produces (the learner's step + 1), so that AReaL's proximal
  version current_version - 1 is the learner's parameters at the start of the step (what "exact" uses).
  """
  inputs = {} if current_version is None else {"current_version": current_version}
  if "policy_version" in batch:
    inputs["behavior_version"] = batch["policy_version"]
  return method.bind_loss(inputs)


def _policy_loss_gradient(logp_fn, params, batch, method: Method, *, current_version=None):
  """Gradient of the method's peer loss in one update: one forward, one backward.

    logp_nt, vjp = jax.vjp(logp_fn(., batch), params)
    pi_old       = sg(logp_nt)          (the step's single update starts at pi_old: r_t = 1 in value)
    A_n          = pg_coefficients(pi_old, ...)["advantage_n"]   (GRPO advantage, std as configured)
    cot_nt       = d loss(logp_nt, pi_old, mu, A, mask) / d logp_nt;   grads = vjp(cot_nt)

  The ESS metrics are pg_coefficients' (of l_n = sum_t log pi_old - log mu, as for every method); the loss
  brings its own ratio, clip / mask and aggregation, and its metrics come back under "loss/<name>". Rows
  with a non-finite log-ratio are masked out, as in the surrogate. No norms, so both paths are this one.
  Several updates per step (ppo_epochs / minibatches) are _multi_update_step.
  """
  logp_nt, vjp = jax.vjp(lambda p: logp_fn(p, batch), params)
  old = sg(logp_nt)
  _, aux = _coefficients(old, batch, method, None, None)
  mask = jnp.where(aux["valid_n"][:, None], jnp.asarray(batch["loss_mask"], jnp.float32), 0.0)
  fn = _bound_policy_loss(method, batch, current_version)
  args = (old, batch["behavior_logp"], aux["advantage_n"], mask)
  (loss, m), cot_nt = jax.value_and_grad(lambda lp: fn(lp, *args), has_aux=True)(logp_nt)
  (grads,) = vjp(cot_nt.astype(logp_nt.dtype))
  return grads, dict(aux, pg_loss=loss, **{f"loss/{k}": v for k, v in m.items()})


_GRAD_PATHS: dict[str, Callable] = {"ghost": _ghost_gradient, "vmap": _vmap_gradient}
GRAD_PATHS = tuple(_GRAD_PATHS)


def policy_gradient(path: str) -> Callable:
  """The gradient path by name: f(logp_fn, params, batch, method, *, divisor=None, current_version=None).

  f returns (grads, aux): grads of the configured loss with the structure of params, aux the dict of
  method.coefficients (scalar metrics and "_n" rows) plus pg_loss (the loss's value). For the
  surrogate (method.peer_loss None)

    loss(params) = -sum_n coef_n * sum_t tokw_nt * logp_nt(params),   coef_n = method.coefficients

  "ghost": exact per-example norms and the gradient from one backward pass to the layer outputs
           (vcpo_jax.grad_norms); also takes norm_method / memory_budget_bytes / batch_shards / passes;
  "vmap":  the reference: norms by vmap of per-example grads, then the surrogate's backward.
  Both also take centering= (a score_centering.StepCentering): the method's score centering is applied only through
  it (`_gradient` builds it; without it f is the uncentered surrogate, which Method.loss_fn matches).
  Both give the same gradient (tested). A peer loss (method.peer_loss) needs no norms:
  on either path one forward and the loss's own cotangent; current_version (the version the update
  produces) is bound when the loss declares it (PeerLoss.needs: decoupled_ppo's log-linear pi_prox).

  Args (of f):
    logp_fn: logp_fn(params, batch) -> [N, T] log-probs of batch["tokens"] (aligned with loss_mask);
      must also work on a batch with N = 1.
    params: parameter pytree.
    batch: has batch.PG_KEYS (tokens, behavior_logp, loss_mask [N, T], rewards, group_id [N]) plus
      what logp_fn reads; every leaf has a leading N axis.
    method: rl.method.Method (static under jit).
    divisor: the loss aggregation's Z (see surrogate.pg_coefficients); a micro-batch passes 1.0.

  References:
    Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs, arXiv 2602.17616.
  """
  if path not in _GRAD_PATHS:
    raise ValueError(f"learner.grad_path={path!r}: choose one of {GRAD_PATHS}.")
  return _GRAD_PATHS[path]


def _step_centering(graphdef, params, cfg: LearnerConfig, behavior_params):
  """The step's score centering (score_centering.StepCentering / TopkCentering) or None (the method's is off)."""
  if cfg.method.centering is None:
    return None
  source, cap = cfg.method.centering
  if source == "topk":
    return sc_lib.TopkCentering(graphdef, cap)
  return sc_lib.StepCentering(graphdef, cap, params if behavior_params is None else behavior_params)


def _gradient(graphdef, params, batch, cfg: LearnerConfig, step=None, behavior_params=None, frozen=None):
  """(grads, aux) of the whole batch: one pass, or a scan over micro-batches (same result).

  step: the learner's step (state.step), read only by decoupled_ppo's log-linear pi_prox.
  behavior_params: 'exact' score centering only: the parameters that sampled the batch (lag mode's
  version step - k); None: `params` (sync, k = 0: p = q and every centering coefficient is 0). The drift
  diagnostics come back as `drift/*` scalars (score_centering.drift_scalars).
  frozen: the frozen base with LoRA (params = the adapters), else None.
  """
  grads, aux = _gradient_rows(graphdef, params, batch, cfg, step, behavior_params, frozen)
  if "drift_tokens_n" in aux:
    aux = dict(aux, **sc_lib.drift_scalars(aux))
  return _add_router_aux(graphdef, params, batch, cfg, grads, aux, frozen, cfg.microbatches(batch["tokens"].shape[0]))


def _gradient_rows(graphdef, params, batch, cfg: LearnerConfig, step, behavior_params, frozen):
  """`_gradient` before the drift scalars: one pass, or a scan over micro-batches."""
  logp_fn = make_logp_fn(graphdef, frozen)
  path = cfg.grad_path
  if path == "ghost" and not cfg.computes_norms and cfg.method.centering is None:
    path = "vmap"  # no per-example norms wanted: without them "vmap" is one forward and one backward
  grad_fn = policy_gradient(path)
  if path == "ghost" and cfg.ghost_passes != 1:
    budget = int(cfg.one_pass_budget_gib * 2**30)
    grad_fn = functools.partial(grad_fn, passes=cfg.ghost_passes, one_pass_budget_bytes=budget)
  centering = _step_centering(graphdef, params, cfg, behavior_params)
  if centering is not None:
    grad_fn = functools.partial(grad_fn, centering=centering)
  n = batch["tokens"].shape[0]
  k = cfg.microbatches(n)
  if k == 1:
    version = None if step is None else step + 1  # the version this update produces
    return grad_fn(logp_fn, params, batch, cfg.method, current_version=version)

  # [K, N / K, ...]: whole groups; each micro-batch's rows stay split over the mesh's batch axes (under a
  # mesh; a no-op without one), so per-device activation memory falls with data x fsdp.
  mbs = jax.tree.map(
    lambda x: sharding.constrain(x.reshape((k, n // k) + x.shape[1:]), (None, sharding.BATCH_AXES)), batch
  )

  def body(acc, mb):
    grads, aux = grad_fn(logp_fn, params, mb, cfg.method, divisor=1.0)
    acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
    rows = {key: v for key, v in aux.items() if key.endswith("_n")}
    return acc, (rows, aux["pg_loss"])

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  acc, (rows, losses) = jax.lax.scan(body, zeros, mbs)
  rows = {key: v.reshape((n,) + v.shape[2:]) for key, v in rows.items()}
  z = cfg.method.loss_divisor(rows)  # the whole batch's count, a scalar factor
  if "coef_n" in rows:  # the micro-batches' coefficients were made with Z = 1
    rows["coef_n"] = rows["coef_n"] / z
  grads = jax.tree.map(lambda a, p: (a / z).astype(p.dtype), acc, params)
  return grads, dict(cfg.method.metrics(rows), **rows, pg_loss=jnp.sum(losses) / z)


def router_aux_loss(graphdef, params, batch) -> jax.Array:
  """transformers' load-balancing loss of an MoE model on the batch (`moe.load_balancing_loss`), a float32 scalar.

  Over every MoE layer and the batch's valid tokens (batch["valid_mask"], transformers' attention_mask), the
  router logits of the forward the learner's log-probs make: with model.routing_replay and a routing record,
  the replayed experts are the ones counted (its gradient flows through the router probabilities only).
  """
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  if cfg.moe is None:
    raise ValueError("learner.router_aux_loss_coef > 0 on a dense model: it has no router; set it to 0.")
  positions, mask = transformer.padded_positions_and_mask(batch["valid_mask"])
  replay = transformer.replay_routing(cfg, _token_experts(batch))
  with moe.routing() if isinstance(replay, contextlib.nullcontext) else replay as rec:
    model(batch["tokens"], positions, mask, hidden=True)
  n_layers, b, t, e = rec.router_logits.shape
  logits, ids = rec.router_logits.reshape(n_layers, b * t, e), rec.expert_ids.reshape(n_layers, b * t, -1)
  return moe.load_balancing_loss(logits, cfg.num_experts_per_tok, batch["valid_mask"].reshape(-1), ids)


def _add_router_aux(graphdef, params, batch, cfg: LearnerConfig, grads, aux, frozen, k: int):
  """grads + c grad(router_aux_loss) and aux["router_aux_loss"], c = cfg.router_aux_loss_coef; as given when c = 0.

  k > 1 micro-batches (whole groups, as `_gradient_rows` splits them): the mean over them of each one's loss
  (transformers computes it per forward call), one forward and backward of a micro-batch at a time.
  """
  c = cfg.router_aux_loss_coef
  if not c:
    return grads, aux
  value_grad = jax.value_and_grad(lambda p, b: router_aux_loss(graphdef, lora.combine(p, frozen), b))
  n = batch["tokens"].shape[0]
  if k == 1:
    value, g = value_grad(params, batch)
  else:
    mbs = jax.tree.map(lambda x: x.reshape((k, n // k) + x.shape[1:]), batch)
    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    body = lambda acc, mb: (jax.tree.map(lambda a, x: a + x.astype(jnp.float32) / k, acc, value_grad(params, mb)), None)
    value, g = jax.lax.scan(body, zeros, mbs)[0]
  grads = jax.tree.map(lambda a, x: (a + c * x).astype(a.dtype), grads, g)
  return grads, dict(aux, router_aux_loss=value)


def _guarded_update(tx, params, opt_state, grads, loss, lr_scale):
  """One optimizer update (clip -> AdamW -> x lr_scale), skipped when the loss or the gradient is not finite.

  Returns (params, opt_state, metrics): the updated pair, or the inputs unchanged when not finite, and
  grad_norm, update_norm and nonfinite (1.0 when skipped). Every update the learner applies goes through
  here: the single update of a step and each of the ppo_epochs x minibatches updates.
  """
  grad_norm = optax.global_norm(grads)
  updates, new_opt = tx.update(grads, opt_state, params, ess_scale=lr_scale)
  new_params = optax.apply_updates(params, updates)
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  metrics = {
    "grad_norm": grad_norm,
    "update_norm": optax.global_norm(updates),
    "nonfinite": 1.0 - finite.astype(jnp.float32),
  }
  return keep(new_params, params), keep(new_opt, opt_state), metrics


def _multi_update_step(graphdef, tx, cfg: LearnerConfig, state: TrainState, batch: dict):
  """ppo_epochs x minibatches optimizer updates on one batch; pi_old recomputed ONCE, at the start.

    pi_old   = sg(logp_fn(state.params, batch))                       one extra forward per trainer step
    A_n, ESS = pg_coefficients(pi_old, ...) over the WHOLE batch       (advantages, ESS metrics, lr scale)
    for epoch in range(ppo_epochs): for mb in the minibatches (whole groups, contiguous, same split each
      epoch): grads = grad of the policy loss on mb (its own aggregation, as verl / AReaL) -> optimizer

  pi_old is also decoupled PPO's exact pi_prox: the learner's parameters at the start of the step (in lag
  mode the newest version of the ring, in async mode the version last published); its log-linear
  approximation uses the version each update produces, state.step + 1 (AReaL's v_theta). A non-finite
  update is skipped (the others apply; `nonfinite` is the max over updates). state.step counts trainer
  steps (the policy version); the optimizer's count advances once per update, so a schedule advances
  ppo_epochs * minibatches times per trainer step. Metrics: the whole-batch ones at pi_old, the per-update
  ones (pg_loss, grad_norm, update_norm, loss/*) averaged over the updates, and loss/*_first / grad_norm_first
  of the first update.
  """
  trainable, frozen = lora.split(state.params)
  logp_fn = make_logp_fn(graphdef, frozen)
  old_logp = jax.lax.stop_gradient(logp_fn(trainable, batch))
  _, aux0 = cfg.method.coefficients(
    old_logp, batch["behavior_logp"], batch["loss_mask"], batch["rewards"], batch["group_id"], None
  )
  mask = jnp.where(aux0["valid_n"][:, None], jnp.asarray(batch["loss_mask"], jnp.float32), 0.0)
  full = dict(batch, loss_mask=mask, old_logp=old_logp, advantage=aux0["advantage_n"])
  n, m = batch["tokens"].shape[0], cfg.minibatches
  if n % m:
    raise ValueError(f"learner.minibatches={m} does not divide the batch size N={n}; use a divisor of {n}.")
  # [M, N / M, ...]: minibatch i holds rows i * N / M ... (whole groups: rows of a group are contiguous)
  mbs = jax.tree.map(lambda x: x.reshape((m, n // m) + x.shape[1:]), full)
  lr_scale = aux0["lr_scale"]
  version = state.step + 1

  def update(carry, mb):
    params, opt_state = carry
    fn = _bound_policy_loss(cfg.method, mb, version)
    grads, loss, lm = policy_losses.loss_gradient(fn, logp_fn, params, mb, mb["advantage"], mb["old_logp"])
    grads, lm = _add_router_aux(graphdef, params, mb, cfg, grads, lm, frozen, 1)
    params, opt_state, out = _guarded_update(tx, params, opt_state, grads, loss, lr_scale)
    out.update({f"loss/{k}": v for k, v in lm.items()}, pg_loss=loss)
    return (params, opt_state), out

  def epoch(carry, _):
    return jax.lax.scan(update, carry, mbs)

  (params, opt_state), per_update = jax.lax.scan(epoch, (trainable, state.opt_state), None, cfg.ppo_epochs)
  params = lora.combine(params, frozen)
  per_update = jax.tree.map(lambda v: v.reshape((-1,) + v.shape[2:]), per_update)  # [epochs * M]
  metrics = {k: v for k, v in aux0.items() if jnp.ndim(v) == 0}
  metrics.update({k: jnp.mean(v) for k, v in per_update.items()})
  metrics.update({f"{k}_first": v[0] for k, v in per_update.items() if k.startswith("loss/") or k == "grad_norm"})
  metrics["nonfinite"] = jnp.max(per_update["nonfinite"])
  metrics["updates"] = jnp.float32(cfg.updates_per_step)
  return TrainState(params, opt_state, state.step + 1), metrics


def make_train_step(graphdef, tx: optax.GradientTransformationExtraArgs, cfg: LearnerConfig):
  """Returns train_step(state, batch, behavior_params=None) -> (state, metrics); jit it under its mesh:
  sharding.MeshJit (donate state). behavior_params: 'exact' score centering in lag mode, the version that
  sampled the batch (see `_gradient`); None otherwise.

  Traced without a mesh while its inputs live on a multi-device mesh it raises (sharding.require_mesh).
  """

  def train_step(state: TrainState, batch: dict, behavior_params=None) -> tuple[TrainState, dict]:
    sharding.require_mesh((state, batch), "learner.make_train_step's step")
    if cfg.updates_per_step > 1:
      return _multi_update_step(graphdef, tx, cfg, state, batch)
    params, frozen = lora.split(state.params)  # with LoRA: the adapters train, the base is frozen
    grads, aux = _gradient(graphdef, params, batch, cfg, state.step, behavior_params, frozen)
    # clip -> AdamW -> x lr_scale, once per step (after accumulation when micro-batched)
    params, opt_state, upd = _guarded_update(tx, params, state.opt_state, grads, aux["pg_loss"], aux["lr_scale"])
    new_state = TrainState(lora.combine(params, frozen), opt_state, state.step + 1)
    metrics = {k: v for k, v in aux.items() if jnp.ndim(v) == 0}
    metrics.update(upd)
    metrics.update(routing_replay_metrics(graphdef, state.params, batch))  # MoE routing record: moe/ metrics
    # gradient-variance telemetry ("grad/..."): [N]-array arithmetic on the norms the step already has; a method
    # that does not need them does not hand them over, so XLA drops the ghost path's norm computation
    if cfg.grad_telemetry:
      t, g2 = batch["tokens"].shape[1], upd["grad_norm"] ** 2
      rows = aux if cfg.telemetry_norms else {k: v for k, v in aux.items() if k != "sq_norm_n"}
      metrics.update(telemetry.step_telemetry(rows, g2, batch["rewards"], batch["group_id"], cfg.method, t))
    return new_state, metrics

  return train_step


# --------------------------------------------------------------------------- MoE routing replay


def routing_replay_metrics(graphdef, params, batch) -> dict:
  """moe/ metrics of a batch carrying the sampler's MoE routing record (Batch.expert_ids); {} without one.

  The same batch and parameters through the learner's own routing and through the replayed one (two extra
  forwards, only in runs that record routing, SamplerConfig.record_routing):
    moe/route_mismatch      fraction of recorded (token, MoE layer) pairs whose own top-K set differs from the
                            recorded set (order ignored; `moe.routing_mismatch`)
    moe/log_ratio_std       std over loss tokens of log pi - log mu with the learner's own routing
    moe/log_ratio_std_replay  the same with the recorded experts replayed
    moe/ess, moe/ess_replay   ESS / N of the sequence weights, own routing / replayed
  """
  model_cfg = getattr(nnx.merge(graphdef, params), "cfg", None)
  experts = _token_experts(batch)  # [N, T, E]
  if experts is None or model_cfg is None or model_cfg.moe is None:
    return {}
  params = sg(params)
  tokens, valid = batch["tokens"], batch["valid_mask"]
  mask, mu = batch["loss_mask"], batch["behavior_logp"]
  positions, attn_mask = transformer.padded_positions_and_mask(valid)
  with moe.routing() as own:
    transformer.forward(graphdef, params, tokens, positions, attn_mask)
  b, t, _ = experts.shape
  rec = jnp.moveaxis(experts.reshape(b, t, model_cfg.num_layers, -1), 2, 0)  # [L, N, T, K]
  out = {"moe/route_mismatch": moe.routing_mismatch(own.expert_ids, rec, rec[..., 0] >= 0)}
  for suffix, force in (("", False), ("_replay", True)):
    with transformer.replay_routing(model_cfg, experts, force=force):
      logp = transformer.sequence_logprobs(graphdef, params, tokens, valid, batch.get("support_thr"))
    m = mask.astype(jnp.float32)
    d = (logp - mu) * m
    mean = jnp.sum(d) / jnp.maximum(jnp.sum(m), 1.0)
    out[f"moe/log_ratio_std{suffix}"] = jnp.sqrt(jnp.sum(m * (d - mean) ** 2) / jnp.maximum(jnp.sum(m), 1.0))
    out[f"moe/ess{suffix}"] = ess_lib.ess_ratio(ess_lib.sequence_log_ratio(logp, mu, mask))
  return out


def make_plain_grad_fn(graphdef):
  """A plain policy-gradient step (fixed coefficients, no norms): the yardstick of the norm overhead.

  Returns f(params, batch) -> global gradient norm of -sum_n R_n sum_t mask_nt logp_nt: one forward and
  one backward pass, what a GRPO learner without per-example norms pays. The trainer times it next to
  the real step every `log.norm_overhead_every` steps and logs the ratio.
  """

  def plain(params, batch):
    params, frozen = lora.split(params)  # with LoRA, the adapters only (what the real step differentiates)
    logp_fn = make_logp_fn(graphdef, frozen)

    def loss(p):
      logp = logp_fn(p, batch)
      return -jnp.sum(batch["rewards"][:, None] * batch["loss_mask"] * logp)

    return optax.global_norm(jax.grad(loss)(params))

  return plain


def init_state(params, tx) -> TrainState:
  """Step 0; the optimizer's state covers the trainable parameters only (with LoRA: the adapters)."""
  return TrainState(params, tx.init(lora.split(params)[0]), jnp.zeros((), jnp.int32))
