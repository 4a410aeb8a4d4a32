"""LoRA with multi-host async: only the adapters travel, and each host's sampler log-probs equal the learner's.

2 local processes x 2 fake CPU devices, one global (2, 2, 1) learner mesh (jax.distributed + gloo, the
launcher of tests/multiproc.py); the LoRA policy's parameters are born sharded over both processes. Each
process builds an AsyncSource (its ManyHosts topology: rollout/multihost.py) and publishes trained-looking
adapters (B != 0): the base is gathered to host-complete arrays once (a collective) and the slot holds the
adapters only; the sampler side is the real worker code (_Worker._build takes the base from the one-shot base
slot, _load applies the adapters), run in the learner's process on one local device (its generation loop left
out, as in tests/test_lora_publish.py). Its log-probs must equal those of the learner's whole model, gathered.
"""

import json
import sys

import numpy as np
import pytest

from tests import multiproc

LORA = {"model.lora_rank": 2, "model.lora_alpha": 4.0}
TOKENS = np.random.default_rng(0).integers(3, 30, (2, 7)).astype(np.int32)


def _host(process_id: int, port: int) -> dict:
  """One process of the job: publish version 0 of trained adapters, rebuild the sampler's model from the slot."""
  import os

  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  from tests import fixtures
  from tests.test_lora_publish import _trained
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import run_config
  from vcpo_jax.model import lora, policy
  from vcpo_jax.model import transformer as tf
  from vcpo_jax.rollout.common import RolloutMaker
  from vcpo_jax.rollout.async_ import AsyncSource
  from vcpo_jax.rollout.multihost import ManyHosts
  from vcpo_jax.rollout.process import worker as worker_lib
  from vcpo_jax.sampler import Sampler

  config = fixtures.tiny_countdown_config(**{"mode": "async", "lag.k": 1, "mesh.shape": (2, 2, 1), **LORA})
  spec = run_config.parse_config(config, check_prompts=False)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((2, 2, 1)), devices=jax.devices())
  model_cfg, tokenizer, graphdef, params = policy.build_policy(spec.model_cfg, mesh, seed=spec.seed)
  params = jax.jit(_trained)(params)  # sharded over both processes, as the learner's state is
  problems = spec.task.make_problems("train", spec.rollout.num_train_problems, spec.seed)
  sampler_cfg = fixtures.sampler_config(spec, tokenizer)
  maker = RolloutMaker(spec.rollout, tokenizer, Sampler(graphdef, model_cfg, sampler_cfg, mesh=mesh), problems)
  src = AsyncSource(
    spec.async_, jax.random.key(spec.seed), model_cfg, graphdef, tokenizer, maker, k=spec.k, steps=spec.steps
  )
  assert isinstance(src.topology, ManyHosts) and src.agreed_stops  # picked by jax.process_count() == 2
  src._start = lambda arrays, version: src._open_slot(arrays, version)  # no sampler process: its code below
  try:
    src.publish(params, 0)
    version, arrays = src.slot.latest(min_version=0, timeout=30.0)
    args = src._worker_args(arrays, version, devices=tuple(jax.local_devices()[:1]), **src.topology.worker_fields())
    args = src._base_channel(args)
    w = worker_lib._Worker(args, None, src.slot, None, os.getpid(), None, src.base_slot)
    w._build()
    w._load(version, arrays)
    valid = jnp.ones(TOKENS.shape, bool)
    got = np.asarray(tf.sequence_logprobs(w.sampler.graphdef, w._params, jnp.asarray(TOKENS), valid))
    whole = multihost_utils.process_allgather(params, tiled=True)  # the learner's model, on every host
    want = np.asarray(tf.sequence_logprobs(graphdef, whole, jnp.asarray(TOKENS), valid))
    base_only = np.asarray(
      tf.sequence_logprobs(
        graphdef,
        lora.combine(jax.tree.map(jnp.zeros_like, lora.adapters(whole)), lora.split(whole)[1]),
        jnp.asarray(TOKENS),
        valid,
      )
    )
    adapters = lora.adapters(whole)
    return {
      "names_adapters": sorted(arrays) == sorted(worker_lib.param_names(adapters)),
      "bytes": int(sum(a.nbytes for a in arrays.values())),
      "adapter_bytes": lora.num_bytes(adapters),
      "model_bytes": lora.num_bytes(whole),
      "checksum": int(src.publisher.checksums[0]),
      "worker_checksum": int(w._checksum),
      "max_diff": float(np.max(np.abs(got - want))),
      "adapters_matter": float(np.max(np.abs(base_only - want))),
    }
  finally:
    src.close()


@pytest.mark.slow
def test_two_hosts_publish_only_adapters_and_the_samplers_apply_them():
  procs = multiproc.launch(__file__)
  try:
    outs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    multiproc.kill(procs)
  recs = []
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
    recs.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :]))
  for r in recs:
    assert r["names_adapters"] and r["bytes"] == r["adapter_bytes"] < r["model_bytes"] / 5, r
    assert r["worker_checksum"] == r["checksum"], r  # the sampler read exactly what was published
    assert r["max_diff"] < 1e-5 and r["adapters_matter"] > 1e-3, r  # the learner's log-probs, adapters included
  assert recs[0]["checksum"] == recs[1]["checksum"]  # both hosts published the same version 0


if __name__ == "__mp_main__":
  pass
if __name__ == "__main__":
  print("RESULT " + json.dumps(_host(int(sys.argv[1]), int(sys.argv[2]))), flush=True)
