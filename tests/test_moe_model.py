"""Qwen3-MoE in the model: the config, the MoE block inside the layer scan, and Hugging Face interop.

References: transformers' Qwen3MoeForCausalLM (torch CPU, float32, random weights, save_pretrained), and the
pure block `vcpo_jax.model.moe.sparse_moe` layer by layer.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests import fixtures
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import hf_io, moe
from vcpo_jax.model import transformer as tf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 101
PARITY_TOL = 1e-4  # x std of the logits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """(dir, torch model) of a tiny Qwen3-MoE written by transformers, in several safetensors shards."""
  root = tmp_path_factory.mktemp("moe")
  return fixtures.make_hf_checkpoint(root / "qwen3_moe", "qwen3_moe", V, seed=3, max_shard_size="100KB")


def _tokens(b, t, seed=0):
  return np.random.default_rng(seed).integers(0, V, size=(b, t)).astype(np.int32)


def test_config_from_transformers(ckpt):
  cfg = mconfig.ModelConfig.from_hf(ckpt[0])
  assert cfg.model_type == "qwen3_moe" and cfg.qk_norm and not cfg.qkv_bias
  assert cfg.moe == moe.MoESpec(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
  assert cfg.router_aux_loss_coef == 0.0  # transformers' 0.001 applies only with output_router_logits
  assert cfg.num_params == sum(p.numel() for p in ckpt[1].parameters())
  assert mconfig.tiny_qwen2().moe is None


def test_config_rejects_mixed_stacks_and_mismatched_type():
  with pytest.raises(ValueError, match="mixed dense/sparse"):
    mconfig.tiny_qwen3_moe(num_layers=4, decoder_sparse_step=2)
  with pytest.raises(ValueError, match="mixed dense/sparse"):
    mconfig.tiny_qwen3_moe(mlp_only_layers=(0,))
  with pytest.raises(ValueError, match="qwen3_moe"):
    mconfig.tiny_qwen3(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    mconfig.tiny_qwen3_moe(num_experts_per_tok=9)


def test_scanned_moe_blocks_report_routing_and_match_unrolled():
  """The scan's MoE layers report their routing (the top-K of their router logits); unrolled gives the same."""
  cfg = mconfig.tiny_qwen3_moe(vocab_size=V)
  graphdef, params = tf.split(tf.init(cfg, seed=1))
  tokens = jnp.asarray(_tokens(2, 9, seed=1))
  pos, mask = tf.padded_positions_and_mask(jnp.ones(tokens.shape, bool))
  with moe.routing() as rec:
    logits, _ = tf.forward(graphdef, params, tokens, pos, mask)
  assert rec.expert_ids.shape == (2, 2, 9, 2) and rec.router_logits.shape == (2, 2, 9, 8)
  np.testing.assert_array_equal(rec.expert_ids, jax.lax.top_k(rec.router_logits, 2)[1])
  assert len(np.unique(np.asarray(rec.expert_ids))) == 8  # every expert used somewhere: a real routing
  graphdef_u, _ = tf.split(tf.init(cfg.replace(scan_layers=False), seed=1))
  unrolled, _ = tf.forward(graphdef_u, params, tokens, pos, mask)
  np.testing.assert_allclose(unrolled, logits, rtol=1e-5, atol=1e-6)
  plain, _ = tf.forward(graphdef, params, tokens, pos, mask)  # no routing context: the same model
  np.testing.assert_array_equal(plain, logits)


def test_parity_with_transformers(ckpt):
  path, ref = ckpt
  for seed, mask in ((3, None), (4, np.array([[0] * 4 + [1] * 8, [0] + [1] * 11, [1] * 12]))):
    tokens = _tokens(3, 12, seed=seed)
    ours = hf_io.hf_forward(path, tokens, attention_mask=mask)
    theirs = fixtures.hf_logits(ref, tokens, mask)
    keep = np.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
    assert np.abs(theirs).max() > 0.5
    np.testing.assert_array_less(np.abs(ours - theirs)[keep].max(), PARITY_TOL * theirs[keep].std())


def test_export_round_trip_through_transformers(ckpt, tmp_path):
  path, ref = ckpt
  cfg, model = hf_io.load_hf(path)
  out = hf_io.save_hf(model, cfg, tmp_path / "out")
  back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert type(back).__name__ == "Qwen3MoeForCausalLM"
  tokens = _tokens(2, 10, seed=5)
  theirs = fixtures.hf_logits(ref, tokens)
  np.testing.assert_array_less(np.abs(fixtures.hf_logits(back, tokens) - theirs).max(), PARITY_TOL * theirs.std())
  # The re-exported tensors are the checkpoint's, bit for bit (float32), experts unfused under the same names.
  orig = {}
  for f in sorted(pathlib.Path(path).glob("*.safetensors")):
    orig.update(load_file(f))
  mine = load_file(out + "/model.safetensors")
  assert sorted(mine) == sorted(orig)
  for n, t in orig.items():
    np.testing.assert_array_equal(mine[n], t)
  cfg2, _ = hf_io.load_hf(out)
  assert cfg2 == cfg


def test_make_tiny_checkpoint_moe(tmp_path):
  path = hf_io.make_tiny_checkpoint(tmp_path / "t", "qwen3_moe", seed=2)
  cfg, _ = hf_io.load_hf(path)
  assert cfg.moe is not None and cfg.num_experts == 8
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  tokens = _tokens(2, 8, seed=1)
  theirs = fixtures.hf_logits(hf, tokens)
  np.testing.assert_array_less(np.abs(hf_io.hf_forward(path, tokens) - theirs).max(), PARITY_TOL * theirs.std())


def test_load_straight_into_expert_shards_and_sharded_forward(ckpt, monkeypatch):
  """With a mesh, the experts are born split over the expert axis (E over sharding.EXPERT_AXIS, D over fsdp), each
  device block read from the per-expert tensors as slices; the sharded forward equals the host one."""
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding as sh

  path, _ = ckpt
  _, host = tf.split(hf_io.load_hf(path)[1])
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 2, 2)), jax.devices()[:4])
  reads = []
  read = hf_io._Reader.read

  def spy(self, name, dtype, index=None, transpose=False):
    out = read(self, name, dtype, index, transpose)
    reads.append((name, out.shape))
    return out

  with monkeypatch.context() as m, pytest.warns(UserWarning, match="not divisible"):  # V = 101 on 2 devices
    m.setattr(hf_io._Reader, "read", spy)
    cfg, model = hf_io.load_hf(path, mesh=mesh)
  graphdef, params = tf.split(model)
  gate = params["layers"]["mlp"]["experts"]["gate_proj"].value
  assert gate.sharding.spec == jax.sharding.PartitionSpec(None, sh.EXPERT_AXIS, "fsdp")
  assert gate.sharding.shard_shape(gate.shape) == (2, 4, 32, 32)  # [L, E / 2, D / 2, F]
  assert all(shape == (32, 32) for n, shape in reads if ".experts." in n and "gate_proj" in n)  # [D / 2, F] slices
  for x, y in zip(jax.tree.leaves(host), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  tokens = jnp.asarray(_tokens(4, 8, seed=7))
  pos, mask = tf.padded_positions_and_mask(jnp.ones(tokens.shape, bool))
  want = tf.forward(graphdef, host, tokens, pos, mask)[0]
  with jax.set_mesh(mesh):
    got = jax.jit(tf.forward, static_argnums=0)(
      graphdef, params, jax.device_put(tokens, sh.batch_sharding(mesh)), pos, mask
    )[0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
