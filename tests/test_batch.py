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


def _with_records(n=4, t=6, r=4, k=3):
  a = _arrays(n, t)
  rng = np.random.default_rng(1)
  a.update(
    topk_ids=rng.integers(0, 9, (n, r, k)).astype(np.int32),
    topk_logp=rng.normal(size=(n, r, k)).astype(np.float32),
    support_thr=np.where(rng.random((n, r)) < 0.5, -np.inf, -rng.random((n, r))).astype(np.float32),
  )
  return a


def test_records_cover_the_response_columns_only():
  s = batch_lib.schema(n=4, t=6, k=3, r=4, support=True)
  assert s["topk_ids"] == (np.int32, (4, 4, 3)) and s["topk_logp"] == (np.float32, (4, 4, 3))
  assert s["support_thr"] == (np.float32, (4, 4)) and s["tokens"] == (np.int32, (4, 6))
  b = Batch.from_arrays(_with_records())
  assert (b.topk, b.r, b.support) == (3, 4, True) and len(b) == 12 and len(jax.tree.leaves(b)) == 12
  assert tuple(b.device()) == batch_lib.DEVICE_KEYS + ("topk_ids", "topk_logp", "support_thr")
  only_support = {k: v for k, v in _with_records().items() if not k.startswith("topk")}
  b = Batch.from_arrays(only_support)
  assert (b.topk, b.r, b.support) == (0, 4, True) and "topk_ids" not in b.device()
  bad = _with_records()
  bad["support_thr"] = np.zeros((4, 5), np.float32)  # another R than the top-k record's
  with pytest.raises(ValueError, match=r"Batch.support_thr: shape \(4, 5\), want \[N, R\]"):
    Batch.from_arrays(bad)
  with pytest.raises(ValueError, match=r"r=6 response columns must be in \[1, t - 1 = 5\]"):
    batch_lib.schema(n=4, t=6, k=3, r=6)
  # the queue's schema is the Batch's, records included
  q = async_.batch_schema(4, 6, 3, 4, True)
  assert {k: (np.dtype(f.dtype), tuple(f.shape)) for k, f in q.fields.items()} == {
    k: (np.dtype(d), shp) for k, (d, shp) in s.items()
  }
  # a consumer that indexes by token column places the record on the last R columns
  x = np.arange(8, dtype=np.float32).reshape(2, 4)
  np.testing.assert_array_equal(batch_lib.at_token_columns(x, 6, -1.0)[0], [-1, -1, 0, 1, 2, 3])


def test_math_configs_topk_record_is_512_mib_per_batch():
  """configs/math.py (N = 32 x 16 = 512 rows, T = 1024 + 2048) with top-k centering at K = 64
  (configs/stability.py's vcpo_sc_top64): ids + log-probs over the 2048 response columns are
  512 x 2048 x 64 x (4 + 4) B = 512 MiB per batch; over all 3072 columns they were 768 MiB."""
  import importlib

  c = importlib.import_module("configs.math").get_config()
  n, tp, r = c.task.prompts_per_step * c.task.group_size, c.task.max_prompt_len, c.task.max_new_tokens
  topk = tuple(batch_lib.TOPK_FIELDS)
  now = batch_lib.nbytes(batch_lib.schema(n, tp + r, k=64, r=r), topk)
  before = n * (tp + r) * 64 * (4 + 4)  # the [N, T, K] layout: every token column
  assert (now / 2**20, before / 2**20) == (512, 768)
  # the support record (one float per response token) is 4 MiB
  assert batch_lib.nbytes(batch_lib.schema(n, tp + r, r=r, support=True), ("support_thr",)) == 4 * 2**20
