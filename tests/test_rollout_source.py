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


def test_every_source_has_the_members_the_trainer_uses_with_no_op_defaults():
  """The trainer calls these on any source (no hasattr): a lag source answers with the base class's defaults."""
  from vcpo_jax.rollout import async_, device_publish, multihost, publish, topology, transfer_publish

  lag = rollout.build_source("lag", object(), jax.random.key(0), k=1)
  assert isinstance(lag, rollout.RolloutSource)
  assert lag.agreed_stops is False and lag.take_copy_s() is None
  assert lag.queued_state() == ([], []) and lag.queued_template(0) == [] and lag.eval_results() == []
  lag.load_queued([], [])  # nothing to restore: fine
  with pytest.raises(ValueError, match=r"holds 2 queued async batches; resume it with mode='async'"):
    lag.queued_template(2)
  with pytest.raises(ValueError, match=r"eval\.background=True needs mode='async'"):
    lag.enable_background_eval(None)
  # One async source class; the publish path and the topology are parts it composes (publish.py, topology.py).
  assert issubclass(async_.AsyncSource, rollout.RolloutSource)
  assert topology.OneHost.agreed_stops is False and multihost.ManyHosts.agreed_stops is True
  for cls in (device_publish.DevicePublisher, transfer_publish.TransferPublisher, publish.ShmPublisher):
    assert issubclass(cls, publish.Publisher) and not issubclass(cls, rollout.RolloutSource)
  for cls in (topology.OneHost, multihost.ManyHosts):
    assert issubclass(cls, topology.Topology) and not issubclass(cls, rollout.RolloutSource)
  # Every path replaces a failed sampler (the device path a crashed thread only; tests/test_recovery.py).
  assert async_.AsyncSource.replaceable
  assert issubclass(async_.SamplerDiedError, rollout.SourceFailed)
