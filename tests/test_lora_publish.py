"""LoRA publishing: only adapters travel, and the sampler's log-probs after a publish equal the learner's.

Every publish path: the lag ring (one process), the shared-memory parameter slot (shm), the device slot
(device) and the transfer server (transfer). The sampler side is the real worker code (process/worker.py's
_Worker: _build rebuilds the model, takes the frozen base from its WorkerArgs, _load applies the published
adapters); only its generation loop is left out (the first three in this process, transfer in a spawned
process, which the pull needs). A spawned sampler gets the base through a one-shot shared-memory slot, not its
pickled arguments (the last test, with a replacement sampler). The learner's adapters are trained-looking
(B != 0): with B = 0 the base alone would pass, which is exactly the silent failure (an adapter dropped) this
file exists to catch.
"""

import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_async import _shm_mapped_by, _source, _subprocesses_share_a_compilation_cache, _tiny  # noqa: F401
from vcpo_jax.model import lora
from vcpo_jax.model import transformer as tf
from vcpo_jax.rollout import async_
from vcpo_jax.rollout.lag import LagSource
from vcpo_jax.rollout.process import worker as worker_lib
from vcpo_jax.rollout.process.shm_queue import SPAWN

LORA = {"model.lora_rank": 2, "model.lora_alpha": 4.0}
TOKENS = np.random.default_rng(0).integers(3, 30, (2, 7)).astype(np.int32)


def _trained(params, seed=1):
  ad, base = lora.split(params)
  keys = iter(jax.random.split(jax.random.key(seed), 100))
  ad = jax.tree.map(lambda x: x + 0.5 * jax.random.normal(next(keys), x.shape, x.dtype), ad)
  return lora.combine(ad, base)


def _logp(graphdef, params):
  return np.asarray(tf.sequence_logprobs(graphdef, params, jnp.asarray(TOKENS), jnp.ones(TOKENS.shape, bool)))


def _check_only_adapters(arrays: dict, params):
  adapters = lora.split(params)[0]
  assert set(arrays) == set(worker_lib.param_names(adapters))
  assert all(".lora_a." in n or ".lora_b." in n for n in arrays)
  assert sum(np.asarray(a).nbytes for a in arrays.values()) == lora.num_bytes(adapters) < lora.num_bytes(params) / 5


def _worker_logp(src, arrays_version, **fields):
  """The real sampler-side reconstruction (_Worker._build + _load) of what the slot holds -> log-probs."""
  args = src._worker_args(arrays_version[1], arrays_version[0], **fields)
  w = worker_lib._Worker(args, None, src.slot, None, os.getpid())
  w._build()
  w._load(*arrays_version)
  want = src.publisher.checksums.get(arrays_version[0])
  assert want is None or int(w._checksum) == int(want)  # the checksum covers exactly the adapters read
  return _logp(w.sampler.graphdef, w._params)


def _graphdef(src):
  return worker_lib.abstract_params(src.model_cfg)[0]


@pytest.mark.slow
def test_lag_ring_keeps_adapter_versions_and_samples_with_the_learners_adapters():
  """k = 2: the ring holds adapters (+ one base copy); after the learner's buffers are donated a version
  still gives the learner's log-probs of that version."""
  src, params = _source(_tiny(**LORA))
  graphdef = _graphdef(src)
  seen = {}

  class Maker:
    def make(self, p, step, rng, version):
      seen[version] = _logp(graphdef, p)
      return {"policy_version": np.full((2,), version)}, {}

  ring = LagSource(Maker(), 2, jax.random.key(0))
  want = {}
  cur = params
  for v in range(3):
    cur = _trained(cur, seed=v)
    want[v] = _logp(graphdef, cur)
    ring.publish(cur, v)
    cur = jax.jit(lambda p: p, donate_argnums=0)(cur)  # what train_step does: every buffer donated, base too
  assert all(jax.tree.structure(x) == jax.tree.structure(lora.split(params)[0]) for x in ring.versions.values())
  vs, kept = ring.state()
  assert vs == [0, 1] and all(not lora.split(k)[1] for k in kept)  # checkpointed: adapters only
  for step in (2, 3, 4):
    ring.next(step)
  for v in range(3):
    np.testing.assert_allclose(seen[v], want[v], rtol=1e-6, atol=1e-6)
  assert len({float(np.sum(x)) for x in want.values()}) == 3  # the versions really differ


@pytest.mark.slow
def test_shm_slot_carries_only_adapters_and_the_worker_applies_them(monkeypatch):
  src, params = _source(_tiny(**LORA))
  params = _trained(params)
  monkeypatch.setattr(src, "_start", lambda arrays, version: src._open_slot(arrays, version))
  try:
    src.publish(params, 0)
    version, arrays = src.slot.latest(min_version=0, timeout=10.0)
    _check_only_adapters(arrays, params)
    assert set(src._base) == set(worker_lib.param_names(lora.split(params)[1]))  # the base: once, in WorkerArgs
    got = _worker_logp(src, (version, arrays))
  finally:
    src.slot.close()
  np.testing.assert_allclose(got, _logp(_graphdef(src), params), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_device_slot_carries_only_adapters_and_the_worker_applies_them(monkeypatch):
  over = {**LORA, "lag.k": 1, "async_.publish_path": "device", "async_.sampler_devices": "2,3"}
  src, params = _source(_tiny(**over), devices=jax.devices()[:2])
  params = _trained(params)
  monkeypatch.setattr(src, "_start", lambda arrays, version: src._open_slot(arrays, version))
  src.publish(params, 0)
  version, arrays = src.slot.latest(min_version=0, timeout=10.0)
  _check_only_adapters(arrays, params)
  got = _worker_logp(src, (version, arrays), devices=tuple(src.publisher.sampler_devices))
  np.testing.assert_allclose(got, _logp(_graphdef(src), params), rtol=1e-6, atol=1e-6)


def _transfer_child(args, slot, out):
  """A spawned sampler stand-in: the real _Worker set-up and load of version 0, then its log-probs."""
  w = worker_lib._Worker(args, None, slot, None, os.getppid())
  w._build()
  w._load(*slot.latest(min_version=0, timeout=120.0))
  out.send((sorted(slot.names), w._checksum, _logp(w.sampler.graphdef, w._params)))
  slot.close()
  out.close()


@pytest.mark.slow
def test_transfer_path_pulls_only_adapters_and_the_worker_applies_them():
  src, params = _source(_tiny(**LORA, **{"lag.k": 1, "async_.publish_path": "transfer"}))
  params = _trained(params)
  recv, send = SPAWN.Pipe(duplex=False)

  def start(arrays, version):
    src._open_slot(arrays, version)
    args = src._worker_args(arrays, version)
    src.proc = SPAWN.Process(target=_transfer_child, args=(args, src.slot, send))
    src.proc.start()
    send.close()
    src.publisher.started()

  src._start = start
  try:
    src.publish(params, 0)
    names, csum, got = recv.recv() if recv.poll(240.0) else pytest.fail("no pull of version 0")
    assert set(names) == set(worker_lib.param_names(lora.split(params)[0]))
    assert csum == int(src.publisher.checksums[0])
    src.proc.join(30.0)
  finally:
    src.close()
  np.testing.assert_allclose(got, _logp(_graphdef(src), params), rtol=1e-6, atol=1e-6)


def test_worker_without_the_base_refuses_to_sample_the_adapters_alone(monkeypatch):
  """A LoRA worker whose WorkerArgs lack the base raises instead of sampling with something else."""
  src, params = _source(_tiny(**LORA))
  monkeypatch.setattr(src, "_start", lambda arrays, version: src._open_slot(arrays, version))
  try:
    src.publish(params, 0)
    src._base = None
    with pytest.raises(ValueError, match="sent no matching frozen base"):
      _worker_logp(src, src.slot.latest(min_version=0, timeout=10.0))
  finally:
    src.slot.close()


def _spawned_child(args_path, queue, slot, conn, *rest):
  """worker.main's start (attached, read the pickled WorkerArgs) and the real _Worker set-up and load of the
  newest version, then (pickled bytes, the base's slot names still mapped here, checksum, log-probs)."""
  *_, base_slot, out = (None, *rest)  # (eval_slot, base_slot, out); without the base slot: (eval_slot, out)
  conn.send(("attached", os.getpid()))
  size = os.path.getsize(args_path)
  with open(args_path, "rb") as f:
    args = pickle.load(f)
  os.unlink(args_path)
  base_paths = [p for p in base_slot.resource_paths() if "/sem." not in p] if base_slot is not None else []
  w = worker_lib._Worker(args, None, slot, None, os.getppid(), **({"base_slot": base_slot} if base_slot else {}))
  w._build()
  w._load(*slot.latest(min_version=0, timeout=120.0))
  left = sorted(_shm_mapped_by(os.getpid()) & set(base_paths))
  out.send((size, args.base is None, left, int(w._checksum), _logp(w.sampler.graphdef, w._params)))
  out.close()
  conn.recv()  # "stop"


@pytest.mark.slow
def test_spawned_sampler_gets_the_base_once_through_shared_memory_not_its_arguments(monkeypatch):
  """The frozen base reaches a spawned sampler through a one-shot slot: the pickled WorkerArgs are a fraction
  of the base's bytes (before: the whole base rode in them), the slot is gone from /dev/shm once the sampler
  attached and from its mappings once it read it, and its log-probs equal the learner's. A replacement
  sampler (_replace -> _spawn) gets the base again, from the learner's host copy."""
  over = {**LORA, "model.hidden_size": 256, "model.intermediate_size": 512}  # base bytes >> the other arguments
  src, params = _source(_tiny(**over))
  params = _trained(params)
  recv, send = SPAWN.Pipe(duplex=False)
  real = async_.SPAWN.Process

  def process(target, args, **kw):  # the sampler's own arguments (path, channels), the stand-in child
    return real(target=_spawned_child, args=(*args, send), **kw)

  monkeypatch.setattr(async_.SPAWN, "Process", process)
  base_bytes = lora.num_bytes(lora.split(params)[1])
  want = _logp(_graphdef(src), params)
  try:
    src.publish(params, 0)
    for spawn in range(2):
      size, no_base, left, csum, got = recv.recv() if recv.poll(240.0) else pytest.fail("no report from the sampler")
      print(f"spawn {spawn}: pickled WorkerArgs {size} bytes, frozen base {base_bytes} bytes")
      assert no_base and size < base_bytes / 4, (size, base_bytes)
      first_base = src.base_slot.resource_paths()
      assert left == []  # read once and closed: the sampler no longer maps it
      assert csum == int(src.publisher.checksums[0])
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
      src._poll_error()  # "attached": this side closes (and unlinks) the base slot
      assert src.base_slot is None and not [p for p in first_base if os.path.exists(p)]
      if spawn == 0:
        assert src._replace(RuntimeError("injected failure"))
  finally:
    src.close()
