"""model.policy.build_policy: the trainer's policy, born sharded with the host initializer's values."""

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax import mesh as mesh_lib
from vcpo_jax import sharding as sh
from vcpo_jax.model import config, policy
from vcpo_jax.model import transformer as tf


def test_random_policy_is_born_sharded_with_the_host_values(monkeypatch):
  real_init, eager_calls = tf.init, []

  def init(cfg, seed=0):  # the initializer may only be traced (eval_shape, jit), never run on the host
    eager_calls.append(not isinstance(jnp.zeros(()) + 0, jax.core.Tracer))
    return real_init(cfg, seed)

  monkeypatch.setattr(tf, "init", init)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 4, 1)), devices=jax.devices()[:4])
  # one block has every kind of leaf; vocab_size 16 is below the char tokenizer's: the table must grow
  base = config.tiny_qwen2().replace(vocab_size=16, num_layers=1)
  cfg, tok, graphdef, params = policy.build_policy(base, mesh, seed=5)
  assert eager_calls and not any(eager_calls)
  assert cfg.vocab_size == len(tok) > 16  # the table grows to the tokenizer
  ref = real_init(cfg, 5)
  assert graphdef == tf.split(ref)[0]
  for x, r in zip(jax.tree.leaves(params), jax.tree.leaves(tf.split(ref)[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(r))
  leaves = jax.tree.leaves(params)
  for x, s in zip(leaves, jax.tree.leaves(sh.param_shardings(params, sh.TRANSFORMER_RULES, mesh))):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  on_device_0 = sum(x.addressable_shards[0].data.size for x in leaves)
  assert on_device_0 < 0.5 * sum(x.size for x in leaves)  # no device holds the whole model


def test_checkpoint_policy_is_read_into_its_shards(tmp_path, monkeypatch):
  """A HF checkpoint goes straight into TRANSFORMER_RULES' shardings with the file's values; no host-side
  whole-model copy is placed afterwards (jax.device_put only ever puts one numpy block on one device)."""
  from vcpo_jax.model import hf_io

  path = hf_io.make_tiny_checkpoint(str(tmp_path / "ck"), family="llama", vocab_size=128, num_layers=1)
  _, host = tf.split(hf_io.load_hf(path)[1])
  put = jax.device_put

  def one_block(x, device=None, **kw):
    if not isinstance(x, np.ndarray) or not isinstance(device, jax.Device):
      raise AssertionError(f"device_put({type(x).__name__}, {device!r}): not one host block onto one device")
    return put(x, device, **kw)

  monkeypatch.setattr(jax, "device_put", one_block)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 2, 2)), devices=jax.devices()[:4])
  cfg, tok, graphdef, params = policy.build_policy(config.tiny_llama(), mesh, seed=0, checkpoint=path)
  assert cfg.vocab_size == 128 and cfg.num_layers == 1
  shardings = jax.tree.leaves(sh.param_shardings(host, sh.TRANSFORMER_RULES, mesh))
  for x, r, s in zip(jax.tree.leaves(params), jax.tree.leaves(host), shardings, strict=True):
    assert x.sharding == s
    np.testing.assert_array_equal(np.asarray(x), np.asarray(r))
