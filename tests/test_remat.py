"""Per-block rematerialization (ModelConfig.remat) composes with the ghost-norm taps.

Under jax.checkpoint a tap recorded into the Python tape would leak the
checkpoint's tracers; the checkpointed block returns its tapped inputs instead
(`transformer._remat_block`). The ghost path must give the same per-example
norms and gradient with remat="block" (and a named policy) as with "none", and
a plain jax.grad must be unchanged too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import grad_norms as gn
from vcpo_jax.model import config, transformer as tf

pytestmark = pytest.mark.slow  # whole-model remat equivalences and compiled-memory checks: long compiles

N, T = 4, 10


def _batch():
  rng = np.random.default_rng(0)
  valid = np.ones((N, T), bool)
  valid[0, :3] = False  # left-padded prompt
  valid[1, 7:] = False  # right-padded response
  loss = valid & (np.arange(T)[None] >= 4)
  return {
    "tokens": jnp.asarray(rng.integers(0, 12, (N, T)), jnp.int32),
    "valid_mask": jnp.asarray(valid),
    "loss_mask": jnp.asarray(loss, jnp.float32),
  }


def _coef(logp_nt, sq_n):
  return jnp.asarray([0.5, -1.0, 2.0, 0.25], jnp.float32) / (1.0 + sq_n), {}


@functools.lru_cache(maxsize=None)
def _ghost(remat):
  cfg = config.tiny_qwen2(vocab_size=64, num_layers=2, remat=remat)
  graphdef, params = tf.split(tf.init(cfg, seed=1))
  batch = _batch()
  fn = jax.jit(lambda p, b: gn.ghost_sq_norms_and_grad(gn.sequence_logp_fn(graphdef), p, b, b["loss_mask"], _coef))
  res = fn(params, batch)
  loss = lambda p: jnp.sum(batch["loss_mask"] * gn.sequence_logp_fn(graphdef)(p, batch))
  plain = jax.jit(jax.grad(loss))(params)
  jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
  return res, plain, jaxpr


@pytest.mark.parametrize("remat", ["block", "dots_with_no_batch_dims_saveable"])
def test_remat_ghost_norms_and_grads_equal_no_remat(remat):
  ref, ref_plain, ref_jaxpr = _ghost("none")
  got, got_plain, jaxpr = _ghost(remat)
  assert "remat" in jaxpr and "remat" not in ref_jaxpr  # jax.checkpoint is really applied
  assert float(jnp.min(ref.sq_norms_n)) > 0
  np.testing.assert_allclose(got.sq_norms_n, ref.sq_norms_n, rtol=1e-5)
  np.testing.assert_allclose(got.logp_nt, ref.logp_nt, atol=1e-6)
  for a, b in zip(
    jax.tree.leaves(got.grads) + jax.tree.leaves(got_plain), jax.tree.leaves(ref.grads) + jax.tree.leaves(ref_plain)
  ):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_remat_config_names_choices():
  with pytest.raises(ValueError, match="remat"):
    config.tiny_qwen2(remat="save_only_these_names")  # a policy factory, not a policy


def _run_memory_script(script: str) -> str:
  """Runs `script` in a fresh CPU-only Python with the memory-minimizing XLA scheduler; returns its stdout."""
  import os
  import subprocess
  import sys

  from tests import xla_flags

  flags = f"--xla_cpu_enable_concurrency_optimized_scheduler=false {xla_flags.MEMORY_COMPILE}"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, check=True
  ).stdout


_MEMORY_SCRIPT = """
import jax, jax.numpy as jnp
from flax import nnx
from vcpo_jax.model import config, transformer as tf
base = config.ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=1024, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=32, max_position=1024, attention="chunked", attention_chunk=128)
for remat in ("none", "block"):
  gd, abstract = tf.split(nnx.eval_shape(lambda: tf.init(base.replace(remat=remat), 0)))
  loss = lambda p, tok, valid: jnp.sum(tf.sequence_logprobs(gd, p, tok, valid))
  args = (abstract, jax.ShapeDtypeStruct((4, 512), jnp.int32), jax.ShapeDtypeStruct((4, 512), jnp.bool_))
  print(remat, jax.jit(jax.grad(loss)).lower(*args).compile().memory_analysis().temp_size_in_bytes)
"""


def test_remat_block_cuts_backward_temporaries(memory_lines):
  """3 blocks: with remat=block only block inputs are saved, so the step's temporaries fall by more than half.

  Compiled in a subprocess with XLA:CPU's memory-minimizing scheduler (its default concurrency-
  optimized one keeps buffers of several blocks alive either way; see transformer._remat_block).
  """
  temp = {k: int(v) for k, v in (line.split() for line in memory_lines if len(line.split()) == 2)}
  assert set(temp) == {"none", "block"} and temp["block"] < 0.5 * temp["none"], temp


_SINK_SCRIPT = """
import jax, jax.numpy as jnp
from flax import nnx
from vcpo_jax import grad_norms as gn
from vcpo_jax.model import config, transformer as tf
n, t = 2, 512
sds = jax.ShapeDtypeStruct
batch = dict(tokens=sds((n, t), jnp.int32), valid_mask=sds((n, t), bool), loss_mask=sds((n, t), jnp.float32))
for passes in (1, 2):
  for layers in (1, 3):
    cfg = config.tiny_llama(vocab_size=256, num_layers=layers, hidden_size=64, intermediate_size=256,
                            logprob_chunk=64, remat="block", attention="chunked", attention_chunk=128)
    gd, abstract = tf.split(nnx.eval_shape(lambda: tf.Transformer(cfg, rngs=nnx.Rngs(0))))
    fn = lambda p, b: gn.ghost_sq_norms_and_grad(gn.sequence_logp_fn(gd), p, b, b["loss_mask"],
      lambda lp, sq: (sq, None), method="direct", memory_budget_bytes=1 << 20, passes=passes).grads
    print(passes, layers, jax.jit(fn).lower(abstract, batch).compile().memory_analysis().temp_size_in_bytes)
"""


@pytest.fixture(scope="module")
def memory_lines():
  """The stdout lines of _MEMORY_SCRIPT then _SINK_SCRIPT, run in one subprocess (one interpreter and jax
  start for both tests): "remat temp_bytes" (2 fields) and "passes layers temp_bytes" (3 fields)."""
  return _run_memory_script(_MEMORY_SCRIPT + _SINK_SCRIPT).strip().splitlines()


def test_two_pass_ghost_holds_one_blocks_taps(memory_lines):
  """With remat=block the one-pass ghost step keeps every block's tapped (A, D) (outputs of the checkpoint),
  the two-pass step (norm sinks) one block's: its temporaries grow far less per layer (1 -> 3 layers, T = 512).

  Per layer the one-pass step holds A and D of every tap: 2 rows x 512 tokens x (4 x 64 + 3 x 256 + 2 x 64
  + 2 x 64) floats ~ 5 MB; the two-pass step only the block input the remat saves (2 x 512 x 64 floats).
  Same scheduler as above (subprocess, memory-minimizing).
  """
  rows = [line.split() for line in memory_lines if len(line.split()) == 3]
  temp = {(int(p), int(layers)): int(v) for p, layers, v in rows}
  assert set(temp) == {(p, layers) for p in (1, 2) for layers in (1, 3)}, temp
  per_layer = {p: (temp[p, 3] - temp[p, 1]) / 2 for p in (1, 2)}
  assert per_layer[2] < 0.5 * per_layer[1], temp
