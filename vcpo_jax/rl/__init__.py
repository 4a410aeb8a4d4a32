"""The RL method as values: ESS and the lr rule, weight variants, advantages and OPOB, aggregations,
the surrogate and the peer losses, presets, and `Method` composing them.

Imports run one way (no module here imports vcpo_jax.estimator or vcpo_jax.policy_losses):
  ess, aggregation <- weights, advantages, losses <- surrogate <- method <- choices (the config's method tree)
  <- presets.
`vcpo_jax.estimator` re-exports the math for notebooks.
"""
