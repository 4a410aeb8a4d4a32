"""A policy-gradient method as one value: advantage, weights, baseline, loss and lr rule, and the presets.

  Method(advantage=grpo(std="population"), weights=tis(8.0), baseline=opob(), lr=ess_lr("sqrt", 1.0))  # VCPO
  Method(loss=ppo_clip(eps_low=0.2, eps_high=0.28))                                                     # verl

Each choice is a factory whose signature is its configuration (rl.weights, rl.advantages, rl.ess,
rl.surrogate, rl.losses) and carries only its own fields. A Method is hashable (jit-static) and maps
onto the surrogate's PGConfig (`Method.pg_config`), so every PGConfig-based code path (the learner, the
telemetry, the studies) runs it unchanged and gives the same numbers (tests/test_rl_method.py).

Adding a peer loss = one `@losses.register(source)` function + one line in PRESETS.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from vcpo_jax.rl import losses
from vcpo_jax.rl.advantages import Advantage, Opob, grpo, opob
from vcpo_jax.rl.ess import DEFAULT_LOG_RATIO_CLAMP, EssLr, ess_lr
from vcpo_jax.rl.losses import PeerLoss
from vcpo_jax.rl.surrogate import PGConfig, Surrogate, pg_coefficients, pg_token_weights, surrogate
from vcpo_jax.rl.weights import Weights, clip, geo_mask, mask, none, tis, tis_ess, token_tis

sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class Method:
  """advantage, importance weights, baseline (None: the estimator's; or OPOB), loss and lr rule.

  loss: `surrogate(...)` (-sum_n coef_n sum_t tokw_nt logp_nt) or a peer loss value (`losses.ppo_clip(...)`),
  which carries its own correction (weights must be none(), baseline None). lr: None (constant) or
  `ess_lr(rule, rho_on)`.
  """

  advantage: Advantage = dataclasses.field(default_factory=grpo)
  weights: Weights = dataclasses.field(default_factory=none)
  baseline: Opob | None = None
  loss: Surrogate | PeerLoss = dataclasses.field(default_factory=surrogate)
  lr: EssLr | None = None
  log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP

  def pg_fields(self) -> dict[str, Any]:
    """The PGConfig fields this method sets (the others keep PGConfig's defaults)."""
    out: dict[str, Any] = {"log_ratio_clamp": self.log_ratio_clamp}
    for part in (self.advantage, self.weights, self.baseline, self.loss, self.lr):
      if part is not None:
        out.update(part.pg_fields())
    return out

  def pg_config(self, **overrides) -> PGConfig:
    """PGConfig(**self.pg_fields(), **overrides): checked there (one-line errors naming the field)."""
    return PGConfig(**{**self.pg_fields(), **overrides})

  def coefficients(
    self, logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n=None, *, divisor=None
  ):
    """coef_n, aux of surrogate.pg_coefficients under this method (advantages, weights, ESS metrics)."""
    cfg = self.pg_config()
    return pg_coefficients(
      logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, cfg, divisor=divisor
    )

  def loss_fn(self, logp_nt, batch, old_logp_nt=None):
    """The scalar loss to minimize at logp_nt [N, T] (differentiable), and the coefficients' aux.

    batch: behavior_logp, loss_mask [N, T]; rewards, group_id [N]; sq_norm [N] when OPOB is on.
    Surrogate: -sum_n coef_n sum_t tokw_nt logp_nt with coef_n, tokw_nt at sg(logp_nt). Peer loss: its
    bound loss at (logp_nt, pi_old = old_logp_nt or sg(logp_nt), mu, A_n, mask over the valid rows), A_n
    the advantage_n of the coefficients, as the learner's single-update path computes it.
    """
    cfg = self.pg_config()
    beh, msk = batch["behavior_logp"], batch["loss_mask"]
    old = sg(logp_nt) if old_logp_nt is None else old_logp_nt
    coef_n, aux = pg_coefficients(old, beh, msk, batch["rewards"], batch["group_id"], batch.get("sq_norm"), cfg)
    if isinstance(self.loss, Surrogate):
      tokw_nt = pg_token_weights(old, beh, msk, cfg)
      return -jnp.sum(coef_n[:, None] * tokw_nt * logp_nt), aux
    m = jnp.where(aux["valid_n"][:, None], jnp.asarray(msk, jnp.float32), 0.0)
    loss, metrics = self.loss.bind()(logp_nt, old, beh, aux["advantage_n"], m)
    return loss, dict(aux, **{f"loss/{k}": v for k, v in metrics.items()})


_VCPO = Method(advantage=grpo(std="population"), weights=tis(8.0), baseline=opob(), lr=ess_lr("sqrt", 1.0))

# The named methods as values, written once (rl.presets.PRESETS is their PGConfig-field view). GRPO's advantage is the
# reference's (sample std); VCPO's OPOB path uses the population std.
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
