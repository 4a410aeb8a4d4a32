"""Two local processes, one global mesh: the multi-host path on CPU with gloo collectives.

The test starts 2 fresh interpreters (this file run as a script), each with 2 fake
CPU devices. Each joins the job through `mesh.maybe_initialize_distributed`
(`jax.distributed.initialize` on 127.0.0.1:<free port>, gloo CPU collectives),
builds the global (data=2, fsdp=2, tensor=1) mesh over the 4 devices of both
processes, feeds its own rows of a global batch with
`jax.make_array_from_process_local_data`, runs one sharded learner step (grad +
clipped AdamW on the tiny model) and prints a checksum. Both processes must print
the same numbers, equal to the same step run in this (single) process on a
4-device mesh. A process that only saw its local half of the batch, or a
gradient not all-reduced across processes, changes the loss and the parameters
at the 1e-2 level.
"""

import json
import sys

import numpy as np
import pytest

from tests import multiproc

MESH_SHAPE = (2, 2, 1)
N, T = 8, 10
TIMEOUT_S = 240  # per process; the test fails (never hangs) past it


def _batch(vocab):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (N, T), dtype=np.int32)
  valid = np.arange(T)[None] < rng.integers(T // 2, T + 1, N)[:, None]
  coef = rng.normal(size=N).astype(np.float32)
  return dict(tokens=tokens, valid=valid, coef=coef)


def _run_step(mesh, batch_fn):
  """One sharded learner-style step on `mesh`; returns a dict of checksum floats.

  batch_fn(mesh) -> the global batch (dict of jax.Arrays sharded over ("data", "fsdp")).
  """
  import jax
  import jax.numpy as jnp
  import optax

  from vcpo_jax import sharding as sh
  from vcpo_jax.model import config, policy
  from vcpo_jax.model import transformer as tf

  cfg = config.tiny_qwen2(num_layers=1)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-6, weight_decay=0.01))
  graphdef, params = policy.init_sharded(cfg, 0, mesh)
  opt_state = jax.jit(
    tx.init, out_shardings=sh.param_shardings(jax.eval_shape(tx.init, params), sh.TRANSFORMER_RULES, mesh)
  )(params)
  state = (params, opt_state)
  s_shard = sh.param_shardings(state, sh.TRANSFORMER_RULES, mesh)
  rep = sh.replicated(mesh)

  def loss_fn(p, batch):
    logp_nt = tf.sequence_logprobs(graphdef, p, batch["tokens"], batch["valid"])
    return -jnp.mean(batch["coef"] * jnp.sum(logp_nt * batch["valid"], axis=1))

  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    leaves = jax.tree.leaves(params)
    # Position-weighted sums: a permuted or mis-assembled shard changes them.
    checks = jnp.stack([jnp.sum(x * jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)) for x in leaves])
    return (params, opt_state), dict(loss=loss, grad_norm=optax.global_norm(grads), param_checks=checks)

  batch = batch_fn(mesh)
  step = jax.jit(step, in_shardings=(s_shard, sh.batch_sharding(mesh)), out_shardings=(s_shard, rep), donate_argnums=0)
  _, metrics = step(state, batch)
  return {k: np.asarray(v).astype(np.float64).ravel().tolist() for k, v in metrics.items()}


def _worker(process_id: int, port: int) -> None:
  """Entry point of one spawned process (XLA_FLAGS set by the parent before jax loads)."""
  import jax

  jax.config.update("jax_default_matmul_precision", "highest")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding as sh

  assert mesh_lib.maybe_initialize_distributed(f"127.0.0.1:{port}", 2, process_id, cpu_collectives="gloo")
  assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(MESH_SHAPE))

  def batch_fn(mesh):
    from vcpo_jax.model import config

    full = _batch(config.tiny_qwen2().vocab_size)
    rows = mesh_lib.process_rows(N, sh.batch_sharding(mesh))
    assert rows.stop - rows.start == N // 2, rows  # each process supplies only its half
    return mesh_lib.make_global_batch({k: v[rows] for k, v in full.items()}, mesh, N)

  out = _run_step(mesh, batch_fn)
  out["process_id"] = process_id
  print("CHECKSUM " + json.dumps(out), flush=True)
  jax.distributed.shutdown()


@pytest.mark.slow
def test_two_processes_agree_with_single_process():
  import jax

  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding as sh
  from vcpo_jax.model import config

  procs = multiproc.launch(__file__)
  outputs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=TIMEOUT_S)
      outputs.append(out)
  finally:
    multiproc.kill(procs)
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-4000:]}"
  results = []
  for out in outputs:
    lines = [l for l in out.splitlines() if l.startswith("CHECKSUM ")]
    assert len(lines) == 1, out[-4000:]
    results.append(json.loads(lines[0][len("CHECKSUM ") :]))
  assert [r.pop("process_id") for r in results] == [0, 1]
  assert results[0] == results[1]  # every process holds the same replicated numbers

  # Reference: the same step in this process on a 4-device mesh, whole batch local.
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(MESH_SHAPE), devices=jax.devices()[:4])
  full = _batch(config.tiny_qwen2().vocab_size)
  ref = _run_step(mesh, lambda m: jax.device_put(full, sh.batch_sharding(m)))
  for k in ref:
    np.testing.assert_allclose(results[0][k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]))
