"""Checkpointer: round trip, keep-last-N plus best, structure checks, URL directories."""

import contextlib
import importlib.util
import os

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vcpo_jax import fs
from vcpo_jax.checkpoint import Checkpointer, best_steps


def _state(seed):
  k = jax.random.key(seed)
  params = {"w": jax.random.normal(k, (3, 4)), "b": jnp.arange(4.0)}
  opt = optax.adamw(1e-3).init(params)
  return {"params": params, "opt": opt, "step": jnp.int32(seed), "rng": jax.random.key_data(k)}


def test_round_trip_restores_every_leaf(tmp_path):
  ck = Checkpointer(str(tmp_path / "ck"), async_save=False)
  state = _state(3)
  ck.save(3, state, {"data_position": 17, "note": "x"})
  ck.wait()
  restored, meta = ck.restore(3, _state(0))
  assert meta == {"data_position": 17, "note": "x"}
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  ck.close()


def test_keeps_last_n_plus_best(tmp_path):
  ck = Checkpointer(str(tmp_path / "ck"), keep_last=2, keep_best=1, best_metric="acc", async_save=False)
  accs = {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.3, 5: 0.4}
  for step, acc in accs.items():
    ck.save(step, _state(step), {}, metrics={"acc": acc})
  ck.wait()
  # Last two (4, 5) plus the best (2); a bug keeping top-N by metric only would drop 4 or keep 1.
  assert sorted(ck.all_steps()) == [2, 4, 5]
  ck.close()


def test_best_steps_is_the_one_ranking_hand_checked():
  scores = {1: 0.5, 2: 0.9, 3: 0.9, 4: float("nan"), 5: 0.1}
  assert best_steps(scores) == [2]  # ties: the earliest step
  assert best_steps(scores, 3) == [2, 3, 1]  # NaN never ranks
  assert best_steps(scores, 2, mode="min") == [5, 1]
  assert best_steps({}) == [] and best_steps({7: None}) == []


def test_retention_and_best_step_agree_across_a_resume(tmp_path):
  """One notion of best: retention keeps exactly best_steps' choice (earliest of a tie, where orbax's BestN
  kept the latest), best_step() names it, steps saved without the metric never compete, and a reopened
  Checkpointer (a resume) ranks the same from the metrics stored with the checkpoints (orbax kept them in
  memory only: after a resume its BestN dropped the old best at the next save)."""
  d = str(tmp_path / "ck")
  ck = Checkpointer(d, keep_last=1, keep_best=1, best_metric="eval/accuracy", async_save=False)
  for step, acc in {1: 0.3, 2: 0.7, 3: 0.7, 4: None}.items():
    ck.save(step, _state(step), {}, metrics=None if acc is None else {"eval/accuracy": acc})
  ck.wait()
  assert sorted(ck.all_steps()) == [2, 4] and ck.best_step() == 2
  ck.close()
  ck = Checkpointer(d, keep_last=1, keep_best=1, best_metric="eval/accuracy", async_save=False)
  assert ck.best_step() == 2
  ck.save(5, _state(5), {}, metrics={"eval/accuracy": 0.6})
  ck.save(6, _state(6), {}, metrics={"eval/accuracy": 0.8})
  ck.wait()
  assert sorted(ck.all_steps()) == [6] and ck.best_step() == 6
  ck.close()
  # a Checkpointer opened without a ranking (python -m vcpo_jax.export) ranks by the same metric
  ck = Checkpointer(d, async_save=False)
  assert ck.best_step() == 6
  ck.close()


def test_structure_mismatch_is_a_clear_error(tmp_path):
  ck = Checkpointer(str(tmp_path / "ck"), async_save=False)
  ck.save(1, {"w": jnp.ones((2, 2))}, {})
  ck.wait()
  with pytest.raises(ValueError, match="config changed"):
    ck.restore(1, {"w": jnp.ones((2, 2)), "extra": jnp.ones(3)})
  with pytest.raises(ValueError, match="shape"):
    ck.restore(1, {"w": jnp.ones((3, 2))})
  ck.close()


def test_no_partial_checkpoint_visible(tmp_path):
  ck = Checkpointer(str(tmp_path / "ck"), async_save=True)
  ck.save(1, _state(1), {})
  ck.wait()
  names = os.listdir(tmp_path / "ck")
  assert not [n for n in names if "tmp" in n.lower()], names
  assert ck.latest_step() == 1
  ck.close()


def test_bad_options():
  with pytest.raises(ValueError, match="keep_last"):
    Checkpointer("/tmp/unused_ck", keep_last=0)


def test_file_url_directory(tmp_path):
  """A file:// workdir checkpoints into the local directory it names (not ./file:/...)."""
  ck = Checkpointer(f"file://{tmp_path}/ck", async_save=False)
  ck.save(2, _state(2), {"n": 1})
  ck.wait()
  assert ck.latest_step() == 2 and os.path.isdir(tmp_path / "ck" / "2")
  restored, meta = ck.restore(2, _state(0))
  np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(_state(2)["params"]["w"]))
  assert meta == {"n": 1}
  ck.close()


def test_unusable_url_is_a_clear_error():
  with pytest.raises(ValueError, match="orbax cannot write to memory://"):
    Checkpointer("memory://run/checkpoints")
  if importlib.util.find_spec("gcsfs") is None:  # the real case here: no gcsfs installed
    with pytest.raises(fs.MissingDependency, match="pip install gcsfs"):
      Checkpointer("gs://bucket/run/checkpoints")


@contextlib.contextmanager
def count_compiles():
  """Counts XLA backend compiles inside the block (jax.monitoring's compile-duration event)."""
  seen = []

  def listener(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      seen.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_saving_replicated_and_sharded_arrays_compiles_nothing(tmp_path):
  """A replicated array is saved without orbax's replica-parallel slicing, whose per-shape programs would
  compile at the run's first checkpoint; a sharded one keeps its sharding; both restore exactly."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  rep = jax.device_put(jnp.arange(64.0 * len(jax.devices())).reshape(-1, 8), NamedSharding(mesh, P()))
  shd = jax.device_put(jnp.arange(8.0 * len(jax.devices())).reshape(-1, 2), NamedSharding(mesh, P("data")))
  assert len(jax.devices()) > 1 and rep.is_fully_replicated and not shd.is_fully_replicated
  ck = Checkpointer(str(tmp_path / "ck"), async_save=True)
  with count_compiles() as compiles:
    ck.save(1, {"rep": rep, "shd": shd}, {})
    ck.wait()
  assert compiles == []
  restored, _ = ck.restore(1, {"rep": rep, "shd": shd})
  np.testing.assert_array_equal(np.asarray(restored["rep"]), np.asarray(rep))
  np.testing.assert_array_equal(np.asarray(restored["shd"]), np.asarray(shd))
  assert restored["shd"].sharding == shd.sharding and restored["rep"].sharding == rep.sharding
  ck.close()


def test_restore_is_born_sharded_into_the_target_layout(tmp_path, monkeypatch):
  """On 4 devices (a 2 x 2 mesh): arrays saved sharded one way (and one replicated) restore from an abstract
  template (ShapeDtypeStruct with a sharding, no array materialised) into the template's other sharding,
  equal to what was saved; every host-to-device transfer of the restore carries one shard, never the whole
  array (what a read on the host followed by a device_put would do)."""
  devices = jax.devices()[:4]
  assert len(devices) == 4  # conftest: 8 fake CPU devices
  mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("data", "fsdp"))
  w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "fsdp")))
  b = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P()))  # replicated: saved from the host copy
  ck = Checkpointer(str(tmp_path / "ck"), async_save=False)
  ck.save(1, {"w": w, "b": b}, {})
  ck.wait()
  target = {
    "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", "data"))),
    "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp")))),
  }
  placed = []
  device_put = jax.device_put

  def spy(x, *a, **kw):
    placed.append(tuple(np.shape(x)))
    return device_put(x, *a, **kw)

  monkeypatch.setattr(jax, "device_put", spy)
  restored, _ = ck.restore(1, target)
  monkeypatch.undo()
  assert placed and (8, 8) not in placed and (8,) not in placed, placed  # orbax places each shard it reads
  for name, want in (("w", w), ("b", b)):
    got = restored[name]
    assert got.sharding == target[name].sharding, name
    shard_shape = target[name].sharding.shard_shape(target[name].shape)  # w: (4, 4); b: (2,)
    assert all(s.data.shape == shard_shape for s in got.addressable_shards), name
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  ck.close()
