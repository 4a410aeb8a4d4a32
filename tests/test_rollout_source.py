"""rollout.build_source picks the mode's source; rollout.build_maker the single- or multi-turn maker."""

import types

import jax
import pytest

from vcpo_jax import rollout
from vcpo_jax.rollout.common import RolloutConfig, RolloutMaker
from vcpo_jax.rollout.lag import LagSource
from vcpo_jax.rollout.multiturn import MultiTurnConfig, MultiTurnRolloutMaker
from vcpo_jax.sampler import SamplerConfig

ROLLOUT = RolloutConfig(task="countdown", prompts_per_step=2, group_size=2, max_prompt_len=8, max_new_tokens=8)


def test_build_source_by_mode():
  key = jax.random.key(0)
  maker = object()  # LagSource only keeps it
  lag = rollout.build_source("lag", maker, key, k=3)
  assert isinstance(lag, LagSource) and lag.k == 3 and lag.maker is maker
  assert rollout.build_source("sync", maker, key, k=3).k == 0  # sync samples with the current policy
  with pytest.raises(ValueError, match=r"config\.mode='bogus': choose one of \('sync', 'lag', 'async'\)"):
    rollout.build_source("bogus", maker, key)


def test_build_maker_single_and_multi_turn():
  from vcpo_jax.model.tokenizer import build_char_tokenizer

  tok = build_char_tokenizer()
  built = []
  make_sampler = lambda cfg: built.append(cfg) or types.SimpleNamespace(cfg=cfg)  # records its config
  base = SamplerConfig.from_tokenizer(tok, max_prompt_len=8, max_new_tokens=8, batch_sizes=(4,))
  single = rollout.build_maker(ROLLOUT, None, tok, make_sampler, base, [])
  assert type(single) is RolloutMaker and built == [base]
  mt = MultiTurnConfig(max_turns=2, max_turn_tokens=4, max_tool_output_tokens=4)
  multi = rollout.build_maker(ROLLOUT, mt, tok, make_sampler, base, [])
  assert isinstance(multi, MultiTurnRolloutMaker)
  assert built[-1] != base and built[-1].max_new_tokens == 4  # multi-turn buckets: one turn's budget
