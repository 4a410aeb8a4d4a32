"""vcpo_jax/batch.py: the one Batch definition and the key sets derived from it."""

import jax
import numpy as np
import pytest

from vcpo_jax import batch as batch_lib
from vcpo_jax import estimator, learner
from vcpo_jax.batch import Batch
from vcpo_jax.rollout import async_


def _arrays(n=4, t=3):
  rng = np.random.default_rng(0)
  return {k: rng.integers(0, 2, s).astype(d) for k, (d, s) in batch_lib.schema(n, t).items()}


def test_schema_shapes_and_dtypes_by_hand():
  s = batch_lib.schema(n=4, t=3)
  assert list(s) == [
    "tokens",
    "valid_mask",
    "loss_mask",
    "behavior_logp",
    "rewards",
    "correct",
    "group_id",
    "policy_version",
    "token_version",
  ]
  assert s["tokens"] == (np.int32, (4, 3)) and s["valid_mask"] == (np.bool_, (4, 3))
  assert s["behavior_logp"] == (np.float32, (4, 3)) and s["rewards"] == (np.float32, (4,))
  assert s["group_id"] == (np.int32, (4,)) and s["policy_version"] == (np.int32, (4,))
  assert s["token_version"] == (np.int32, (4, 3))


def test_key_sets_are_subsets_of_the_one_definition():
  assert set(batch_lib.DEVICE_KEYS) <= set(batch_lib.FIELDS)
  assert set(batch_lib.PG_KEYS) <= set(batch_lib.DEVICE_KEYS)
  # the gradient paths check batch.PG_KEYS themselves: no second hand-kept list (the estimator reads no batch)
  assert not hasattr(learner, "BATCH_KEYS") and not hasattr(estimator, "BATCH_KEYS")
  # The async queue's schema is the Batch's: same names, dtypes and shapes.
  q = async_.batch_schema(4, 3)
  assert {k: (np.dtype(f.dtype), tuple(f.shape)) for k, f in q.fields.items()} == {
    k: (np.dtype(d), s) for k, (d, s) in batch_lib.schema(4, 3).items()
  }


def test_batch_is_a_pytree_and_a_mapping():
  a = _arrays()
  b = Batch.from_arrays(a)
  assert b.n == 4 and b.t == 3 and len(b) == 9 and list(b) == list(batch_lib.FIELDS)
  np.testing.assert_array_equal(b["rewards"], a["rewards"])
  assert set(dict(b)) == set(a)
  assert len(jax.tree.leaves(b)) == 9
  doubled = jax.tree.map(lambda x: x * 2, b)
  assert isinstance(doubled, Batch)
  np.testing.assert_array_equal(doubled.group_id, 2 * a["group_id"])
  dev = b.device()
  assert tuple(dev) == batch_lib.DEVICE_KEYS and "correct" not in dev
  with pytest.raises(KeyError):
    b["valid"]  # the one spelling is valid_mask


def test_from_arrays_casts_and_rejects_bad_input():
  a = _arrays()
  a["rewards"] = a["rewards"].astype(np.float64)
  assert Batch.from_arrays(a).rewards.dtype == np.float32
  with pytest.raises(ValueError, match=r"missing fields \['valid_mask'\].*unknown fields \['valid'\]"):
    Batch.from_arrays({("valid" if k == "valid_mask" else k): v for k, v in _arrays().items()})
  bad = _arrays()
  bad["loss_mask"] = np.zeros((4, 5), bool)
  with pytest.raises(ValueError, match=r"Batch.loss_mask: shape \(4, 5\), want \[N, T\]"):
    Batch.from_arrays(bad)
  bad = _arrays()
  bad["rewards"] = np.zeros((3,), np.float32)
  with pytest.raises(ValueError, match=r"Batch.rewards: shape \(3,\), want \[N\]"):
    Batch.from_arrays(bad)
