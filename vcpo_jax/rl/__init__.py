"""The RL method as values: ESS and the lr rule, weight variants, advantages and OPOB, aggregations,
the surrogate and the peer losses, presets, and `Method` composing them.

Imports run one way: ess <- weights, advantages, aggregation <- losses <- surrogate <- presets <- method.
`vcpo_jax.estimator` re-exports the math for notebooks.
"""
