"""Rollouts: per-step batch makers (common, multiturn) and the sources the trainer draws from (source.py)."""

from vcpo_jax.rollout.source import RolloutSource, SourceFailed, build_maker, build_source

__all__ = ["RolloutSource", "SourceFailed", "build_maker", "build_source"]
