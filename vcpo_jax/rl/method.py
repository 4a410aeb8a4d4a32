"""A policy-gradient method as one value: advantage, weights, baseline, loss and lr rule, and the presets.

  Method(advantage=grpo(std="population"), weights=tis(8.0), baseline=opob(), lr=ess_lr("sqrt", 1.0))  # VCPO
  Method(loss=ppo_clip(eps_low=0.2, eps_high=0.28))                                                     # verl

Each part is a factory whose signature is its configuration (rl.weights, rl.advantages, rl.ess,
rl.surrogate, rl.losses) and carries only its own fields. A Method is hashable (jit-static); the learner,
the telemetry and score centering take it and ask it (coefficients, token_weights, needs_sq_norms,
peer_loss, bind_loss, centering, ...), never a flag by name.

Adding an importance-weight variant = one `@weights.variant(level)` function; a peer loss = one
`@losses.register(source)` function + one line in PRESETS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from vcpo_jax.rl import losses
from vcpo_jax.rl import surrogate as surrogate_lib
from vcpo_jax.rl.advantages import Advantage, Opob, grpo, opob
from vcpo_jax.rl.ess import DEFAULT_LOG_RATIO_CLAMP, EssLr, ess_lr
from vcpo_jax.rl.losses import PeerLoss
from vcpo_jax.rl.surrogate import Surrogate, surrogate
from vcpo_jax.rl.weights import Weights, clip, geo_mask, mask, none, tis, tis_ess, token_tis

sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class Method:
  """advantage, importance weights, baseline (None: the estimator's; or OPOB), loss and lr rule.

  loss: `surrogate(...)` (-sum_n coef_n sum_t tokw_nt logp_nt) or a peer loss value (`losses.ppo_clip(...)`),
  which carries its own correction (weights must be none(), baseline None). lr: None (constant) or
  `ess_lr(rule, rho_on)`. log_ratio_clamp: the applied weights use exp(clamp(l, -c, c)).
  """

  advantage: Advantage = dataclasses.field(default_factory=grpo)
  weights: Weights = dataclasses.field(default_factory=none)
  baseline: Opob | None = None
  loss: Surrogate | PeerLoss = dataclasses.field(default_factory=surrogate)
  lr: EssLr | None = None
  log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP

  def __post_init__(self):
    if not self.log_ratio_clamp > 0:
      raise ValueError(f"log_ratio_clamp={self.log_ratio_clamp!r}: must be > 0")
    if self.peer_loss is not None and (self.weights.variant != "none" or self.baseline is not None):
      raise ValueError(
        f"loss={self.peer_loss.name!r} with weights={self.weights.variant!r}, baseline={self.baseline}: the loss "
        "carries its own correction; use weights=none() and no baseline"
      )
    if self.baseline is not None and self.weights.level == "token":
      raise ValueError(
        f"baseline=opob() with weights={self.weights.variant!r}: OPOB is derived for sequence-level weights; "
        "use a sequence variant"
      )

  # -- what the learner asks -------------------------------------------------------------------------------

  @property
  def peer_loss(self) -> PeerLoss | None:
    """The peer loss that replaces the surrogate (its own ratio, clip and aggregation), or None."""
    return self.loss if isinstance(self.loss, PeerLoss) else None

  @property
  def needs_sq_norms(self) -> bool:
    """Whether the coefficients read the per-example squared score norms (OPOB)."""
    return surrogate_lib.needs_sq_norms(self)

  @property
  def batch_wide(self) -> str | None:
    """Why a row's coefficient reads rows outside its group (no micro-batching by groups), or None."""
    return surrogate_lib.batch_wide_coefficients(self)

  @property
  def centering(self) -> tuple[str, float | None] | None:
    """(score centering 'exact' | 'topk', the token-weight cap C matching the weights, or None), or None (off)."""
    if self.peer_loss is not None or self.loss.score_centering == "off":
      return None
    return self.loss.score_centering, self.weights.token_cap

  @property
  def record_topk(self) -> int:
    """Ids per token the sampler must record for this method (top-k score centering), else 0."""
    return 0 if self.peer_loss is not None else self.loss.sc_topk

  def coefficients(
    self, logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n=None, *, divisor=None
  ):
    """coef_n, aux of surrogate.pg_coefficients under this method (advantages, weights, ESS metrics)."""
    return surrogate_lib.pg_coefficients(
      logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, self, divisor=divisor
    )

  def token_weights(self, logp_nt, behavior_logp_nt, mask_nt):
    """tokw_nt [N, T] of the surrogate (surrogate.pg_token_weights)."""
    return surrogate_lib.pg_token_weights(logp_nt, behavior_logp_nt, mask_nt, self)

  def loss_divisor(self, rows: Mapping[str, jax.Array]) -> jax.Array:
    """Z of the aggregation from a whole batch's per-row arrays (surrogate.loss_divisor)."""
    return surrogate_lib.loss_divisor(rows, self)

  def metrics(self, rows: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The scalar metrics from a whole batch's per-row arrays (surrogate.pg_metrics)."""
    return surrogate_lib.pg_metrics(rows, self)

  def bind_loss(self, inputs: Mapping[str, object]):
    """The peer loss's f(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt), with the step inputs it
    declares (PeerLoss.needs; losses.STEP_INPUTS) taken from `inputs` by name."""
    return self.peer_loss.bind(**inputs)

  def loss_fn(self, logp_nt, batch, old_logp_nt=None):
    """The scalar loss to minimize at logp_nt [N, T] (differentiable), and the coefficients' aux.

    batch: behavior_logp, loss_mask [N, T]; rewards, group_id [N]; sq_norm [N] when OPOB is on.
    Surrogate: -sum_n coef_n sum_t tokw_nt logp_nt with coef_n, tokw_nt at sg(logp_nt). Peer loss: its
    bound loss at (logp_nt, pi_old = old_logp_nt or sg(logp_nt), mu, A_n, mask over the valid rows), A_n
    the advantage_n of the coefficients, as the learner's single-update path computes it.
    """
    beh, msk = batch["behavior_logp"], batch["loss_mask"]
    old = sg(logp_nt) if old_logp_nt is None else old_logp_nt
    coef_n, aux = self.coefficients(old, beh, msk, batch["rewards"], batch["group_id"], batch.get("sq_norm"))
    if self.peer_loss is None:
      tokw_nt = self.token_weights(old, beh, msk)
      return -jnp.sum(coef_n[:, None] * tokw_nt * logp_nt), aux
    m = jnp.where(aux["valid_n"][:, None], jnp.asarray(msk, jnp.float32), 0.0)
    loss, metrics = self.bind_loss(batch)(logp_nt, old, beh, aux["advantage_n"], m)
    return loss, dict(aux, **{f"loss/{k}": v for k, v in metrics.items()})


_VCPO = Method(advantage=grpo(std="population"), weights=tis(8.0), baseline=opob(), lr=ess_lr("sqrt", 1.0))

# The named methods as values, written once. GRPO's advantage is the reference's (sample std); VCPO's OPOB path
# uses the population std.
PRESETS: dict[str, Method] = {
  "sync": Method(),  # synchronous GRPO (run with k = 0)
  "none": Method(),  # stale data, no correction
  "seq_tis": Method(weights=tis(8.0)),
  "clip": Method(weights=clip()),
  "mask": Method(weights=mask(), loss=surrogate(mask_normalizer="all")),
  "token_tis": Method(weights=token_tis()),
  "geo_mask": Method(weights=geo_mask(), loss=surrogate(mask_normalizer="all")),
  "vcpo": _VCPO,
  "vcpo_no_esslr": dataclasses.replace(_VCPO, lr=None),
  "vcpo_no_opob": dataclasses.replace(_VCPO, baseline=None, advantage=grpo(std="sample")),
  "vcpo_applied_opob": dataclasses.replace(_VCPO, baseline=opob(weights="applied")),
  "vcpo_loo_opob": dataclasses.replace(_VCPO, baseline=opob(leave_one_out=True)),
  "vcpo_reference": dataclasses.replace(_VCPO, baseline=opob(reference_mode=True)),
  "ppo_clip": Method(loss=losses.ppo_clip()),
  "decoupled_ppo": Method(loss=losses.decoupled_ppo()),
  "gspo": Method(loss=losses.gspo()),
  "cispo": Method(loss=losses.cispo()),
  "m2po_paper": Method(loss=losses.m2po_paper()),
  "m2po_released": Method(loss=losses.m2po_released()),
  "icepop": Method(loss=losses.icepop()),
  "dppo_tv": Method(loss=losses.dppo_tv()),
  "ipo": Method(loss=losses.ipo()),
  "kpop": Method(loss=losses.kpop()),
  "vcpo_tis_ess": dataclasses.replace(_VCPO, weights=tis_ess(0.5)),  # VCPO with the ESS-targeted cap
  "vcpo_sc": dataclasses.replace(_VCPO, loss=surrogate(score_centering="exact")),
  "tis_sc": Method(weights=token_tis(), loss=surrogate(score_centering="exact")),
}

__all__ = ["PRESETS", "Method", "grpo", "none", "opob", "surrogate", "tis"]
