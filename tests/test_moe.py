"""The Qwen3-MoE block (vcpo_jax.model.moe): parity with transformers, routing replay, the aux loss, the layer rule.

References: transformers' Qwen3MoeSparseMoeBlock and load_balancing_loss_func (torch CPU, float32, random
weights), and a brute-force numpy block that loops over tokens and their experts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vcpo_jax.model import moe

D, F, E, K = 16, 8, 6, 2
SPEC = moe.MoESpec(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F, norm_topk_prob=True)


def _params(seed=0, scale=0.3):
  ks = jax.random.split(jax.random.key(seed), 4)
  return {
    "gate.kernel": jax.random.normal(ks[0], (D, E)) * scale,
    "experts.gate_proj": jax.random.normal(ks[1], (E, D, F)) * scale,
    "experts.up_proj": jax.random.normal(ks[2], (E, D, F)) * scale,
    "experts.down_proj": jax.random.normal(ks[3], (E, F, D)) * scale,
  }


def _moe(p, x, spec=SPEC, **kw):
  return moe.sparse_moe(
    x,
    p["gate.kernel"],
    p["experts.gate_proj"],
    p["experts.up_proj"],
    p["experts.down_proj"],
    top_k=spec.num_experts_per_tok,
    norm_topk_prob=spec.norm_topk_prob,
    **kw,
  )


def _dense_reference(p, x_md, ids_mk, norm_topk_prob):
  """Per token, per chosen expert, in float64 numpy: sum_k g_k down_e(silu(x gate_e) * x up_e)."""
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  x_md = np.asarray(x_md, np.float64)
  y = np.zeros_like(x_md)
  for m, x in enumerate(x_md):
    z = x @ p["gate.kernel"]
    prob = np.exp(z - z.max())
    prob /= prob.sum()
    g = prob[ids_mk[m]]
    g = g / g.sum() if norm_topk_prob else g
    for gk, e in zip(g, ids_mk[m]):
      h = x @ p["experts.gate_proj"][e]
      h = h / (1 + np.exp(-h)) * (x @ p["experts.up_proj"][e])
      y[m] += gk * (h @ p["experts.down_proj"][e])
  return y


def _x(m=10, seed=1):
  return jax.random.normal(jax.random.key(seed), (m, D))


# ----------------------------------------------------------------------------- layer rule, spec


def test_sparse_layer_rule_matches_transformers():
  spec = moe.MoESpec(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, decoder_sparse_step=2, mlp_only_layers=[3]
  )
  assert spec.sparse_layers(8) == (1, 5, 7)  # (i + 1) % 2 == 0, minus 3
  assert moe.MoESpec(4, 1, 8).sparse_layers(3) == (0, 1, 2)
  with pytest.raises(ValueError):
    moe.MoESpec(num_experts=2, num_experts_per_tok=3, moe_intermediate_size=4)


def test_spec_from_hf_config():
  from transformers import Qwen3MoeConfig

  hf = Qwen3MoeConfig(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0]
  )
  spec = moe.MoESpec.from_hf(hf)
  assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 2, 32)
  assert (
    spec.norm_topk_prob and spec.mlp_only_layers == (0,) and spec.router_aux_loss_coef == 0.0
  )  # off: no router logits
  assert (
    moe.MoESpec.from_hf({**hf.to_dict(), "output_router_logits": True}).router_aux_loss_coef == hf.router_aux_loss_coef
  )
  assert moe.TINY_QWEN3_MOE["moe"].num_experts_per_tok == 2


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("norm", [True, False])
def test_forward_matches_dense_reference(norm):
  spec = moe.MoESpec(E, K, F, norm_topk_prob=norm)
  p, x = _params(), _x()
  out = _moe(p, x, spec)
  ids = np.asarray(out.expert_ids)
  assert out.expert_ids.dtype == jnp.int32 and ids.shape == (10, K)
  z = np.asarray(x, np.float64) @ np.asarray(p["gate.kernel"], np.float64)
  np.testing.assert_array_equal(np.sort(ids, -1), np.sort(np.argsort(-z, -1)[:, :K], -1))  # the top-K of p
  np.testing.assert_allclose(out.router_logits, z, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out.y, _dense_reference(p, x, ids, norm), rtol=1e-5, atol=1e-6)


def test_leading_shape_and_jit():
  p, x = _params(), _x(12).reshape(3, 4, D)
  out = jax.jit(lambda p, x: _moe(p, x))(p, x)
  assert out.y.shape == (3, 4, D) and out.router_logits.shape == (3, 4, E) and out.expert_ids.shape == (3, 4, K)
  np.testing.assert_allclose(out.y.reshape(12, D), _moe(p, x.reshape(12, D)).y, rtol=1e-6, atol=1e-7)


def test_grouped_matmul_is_ragged_dot_without_one_hot():
  """The jaxpr holds ragged_dot and no [M, E, F]-sized intermediate (no dense one-hot product)."""
  p, x = _params(), _x(40)
  eqns = _all_eqns(jax.make_jaxpr(lambda p, x: _moe(p, x).y)(p, x).jaxpr)
  prims = {e.primitive.name for e in eqns}
  assert "ragged_dot_general" in prims or "ragged_dot" in prims, prims
  sizes = [np.prod(v.aval.shape) for e in eqns for v in e.outvars]
  assert max(sizes) < 40 * E * F


def _all_eqns(jaxpr) -> list:
  """Every equation of a jaxpr and of the jaxprs inside its equations (custom_vjp / custom_vmap calls, scans)."""
  out = []
  for e in jaxpr.eqns:
    out.append(e)
    for v in e.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns"):
          out += _all_eqns(sub)
  return out


def test_ragged_dot_vmaps_with_gradients():
  """moe.ragged_dot under vmap over rows AND group sizes (per-example gradients), values and gradients equal to
  jax.lax.ragged_dot example by example."""
  a = jax.random.normal(jax.random.key(0), (3, 6, 4))
  w = jax.random.normal(jax.random.key(1), (2, 4, 5))
  g = jnp.asarray([[2, 4], [3, 3], [6, 0]], jnp.int32)
  np.testing.assert_allclose(
    jax.vmap(moe.ragged_dot, in_axes=(0, None, 0))(a, w, g),
    np.stack([jax.lax.ragged_dot(a[i], w, g[i]) for i in range(3)]),
    atol=1e-6,
  )
  loss = lambda dot: lambda w, a, g: jnp.sum(jnp.sin(dot(a, w, g)))
  got = jax.jit(jax.vmap(jax.grad(loss(moe.ragged_dot), argnums=(0, 1)), in_axes=(None, 0, 0)))(w, a, g)
  for i in range(3):
    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(w, a[i], g[i])
    np.testing.assert_allclose(got[0][i], want[0], atol=1e-5)
    np.testing.assert_allclose(got[1][i], want[1], atol=1e-5)


def test_parity_with_transformers_block():
  torch = pytest.importorskip("torch")
  from transformers import Qwen3MoeConfig
  from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

  hf = Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F, norm_topk_prob=True)
  torch.manual_seed(0)
  block = Qwen3MoeSparseMoeBlock(hf).float()
  with torch.no_grad():
    for t in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
      t.normal_(0.0, 0.3)
  sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
  p = {
    k: jnp.asarray(v)
    for k, v in moe.from_hf_experts(sd["gate.weight"], sd["experts.gate_up_proj"], sd["experts.down_proj"]).items()
  }
  back = moe.to_hf_experts({k: np.asarray(v) for k, v in p.items()})
  for k in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
    np.testing.assert_array_equal(back[k], sd[k])

  x = np.random.default_rng(0).standard_normal((2, 7, D)).astype(np.float32)
  with torch.no_grad():
    y_hf = block(torch.from_numpy(x)).numpy()
    logits_hf, _, ids_hf = block.gate(torch.from_numpy(x.reshape(-1, D)))
  out = _moe(p, jnp.asarray(x), moe.MoESpec.from_hf(hf))
  np.testing.assert_allclose(out.y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())
  np.testing.assert_allclose(out.router_logits.reshape(-1, E), logits_hf.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.sort(out.expert_ids.reshape(-1, K), -1), np.sort(ids_hf.numpy(), -1))


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked):
  torch = pytest.importorskip("torch")
  from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

  rng = np.random.default_rng(3)
  logits = rng.standard_normal((3, 2 * 5, E)).astype(np.float32)  # L = 3 layers, [B T, E]
  mask = (rng.random((2, 5)) > 0.3).astype(np.int64)
  ref = load_balancing_loss_func(
    tuple(torch.from_numpy(l) for l in logits), E, K, torch.from_numpy(mask) if masked else None
  ).item()
  got = moe.load_balancing_loss(jnp.asarray(logits), K, jnp.asarray(mask.reshape(-1)) if masked else None)
  np.testing.assert_allclose(float(got), ref, rtol=1e-5)
  g = jax.grad(lambda z: moe.load_balancing_loss(z, K))(jnp.asarray(logits))
  assert float(jnp.abs(g).sum()) > 0  # the router learns from it (through the mean probabilities)


# ----------------------------------------------------------------------------- routing replay


def test_replaying_own_routing_is_identity():
  p, x = _params(), _x()
  out = _moe(p, x)
  rep = _moe(p, x, recorded=out.expert_ids[:, ::-1].astype(jnp.int16))  # order within a token does not matter
  np.testing.assert_allclose(rep.y, out.y, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.sort(rep.expert_ids, -1), np.sort(out.expert_ids, -1))
  assert float(moe.routing_mismatch(out.expert_ids, rep.expert_ids)) == 0.0


def _other_experts(ids_mk, seed=0):
  """A recorded set per token disjoint from the learner's top-K (so every token is re-routed)."""
  rng = np.random.default_rng(seed)
  rows = [rng.permutation([e for e in range(E) if e not in set(row)])[:K] for row in np.asarray(ids_mk)]
  return jnp.asarray(np.stack(rows), jnp.int32)


def test_replay_uses_the_recorded_experts():
  p, x = _params(), _x()
  own = _moe(p, x)
  recorded = _other_experts(own.expert_ids)
  rep = _moe(p, x, recorded=recorded)
  np.testing.assert_array_equal(rep.expert_ids, recorded)
  np.testing.assert_allclose(rep.y, _dense_reference(p, x, np.asarray(recorded), True), rtol=1e-5, atol=1e-6)
  assert not np.allclose(rep.y, own.y, atol=1e-3)  # a test that fails without replay
  assert float(moe.routing_mismatch(own.expert_ids, recorded)) == 1.0


def test_replay_mask_and_mismatch_fraction():
  p, x = _params(), _x()
  own = _moe(p, x)
  recorded = _other_experts(own.expert_ids)
  replay = jnp.arange(10) >= 6  # response tokens only
  out = _moe(p, x, recorded=recorded, replay=replay)
  ids = np.where(np.asarray(replay)[:, None], np.asarray(recorded), np.asarray(own.expert_ids))
  np.testing.assert_array_equal(out.expert_ids, ids)
  np.testing.assert_allclose(out.y, _dense_reference(p, x, ids, True), rtol=1e-5, atol=1e-6)
  assert float(moe.routing_mismatch(own.expert_ids, recorded, mask=replay)) == 1.0
  half = jnp.where(jnp.arange(10)[:, None] < 5, own.expert_ids, recorded)
  np.testing.assert_allclose(float(moe.routing_mismatch(own.expert_ids, half)), 0.5)


@pytest.mark.parametrize("norm", [True, False])
def test_router_gets_gradients_under_replay(norm):
  spec = moe.MoESpec(E, K, F, norm_topk_prob=norm)
  p, x = _params(), _x()
  recorded = _other_experts(_moe(p, x, spec).expert_ids)
  v = jax.random.normal(jax.random.key(9), (10, D))
  loss = lambda p: jnp.sum(_moe(p, x, spec, recorded=recorded).y * v)
  g = jax.grad(loss)(p)
  assert float(jnp.abs(g["gate.kernel"]).sum()) > 0
  # The gradient of the replayed block equals that of the dense reference's gates (finite differences on the router).
  eps, dw = 1e-3, jax.random.normal(jax.random.key(4), (D, E))
  num = (
    loss({**p, "gate.kernel": p["gate.kernel"] + eps * dw}) - loss({**p, "gate.kernel": p["gate.kernel"] - eps * dw})
  ) / (2 * eps)
  np.testing.assert_allclose(float(jnp.sum(g["gate.kernel"] * dw)), float(num), rtol=1e-3)
  # Unused experts get no gradient.
  used = np.zeros(E, bool)
  used[np.asarray(recorded).ravel()] = True
  assert np.all(np.asarray(g["experts.up_proj"])[~used] == 0)


def test_module_matches_pure_function():
  block = moe.MoEBlock(D, SPEC, name="layers.0.mlp", dtype=jnp.float32, rngs=nnx.Rngs(params=0))
  x = jax.random.normal(jax.random.key(2), (2, 5, D))
  state = nnx.state(block, nnx.Param)
  p = {path: v[...] for path, v in [(".".join(map(str, k)), v) for k, v in nnx.to_flat_state(state)]}
  assert set(p) == {"gate.kernel", "experts.gate_proj", "experts.up_proj", "experts.down_proj"}
  out, ref = block(x), _moe(p, x)
  np.testing.assert_allclose(out.y, ref.y, rtol=1e-6, atol=1e-8)
  np.testing.assert_array_equal(out.expert_ids, ref.expert_ids)
  rec = _other_experts(ref.expert_ids.reshape(-1, K)).reshape(2, 5, K)
  np.testing.assert_allclose(block(x, rec).y, _moe(p, x, recorded=rec).y, rtol=1e-6, atol=1e-8)


def test_runs_inside_a_scan_over_stacked_layers():
  """Stacked [L, ...] expert weights under lax.scan (the scanned decoder's shape), recorded ids scanned too."""
  layers = [_params(seed) for seed in (0, 1, 2)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  x = _x(8)
  recorded = jnp.stack([_other_experts(_moe(p, x).expert_ids, seed) for seed, p in enumerate(layers)])

  def body(h, layer):
    p, rec = layer
    out = _moe(p, h, recorded=rec)
    return h + out.y, out.expert_ids

  h, ids = jax.jit(lambda s, r: jax.lax.scan(body, x, (s, r)))(stacked, recorded)
  ref = x
  for p, rec in zip(layers, recorded):
    ref = ref + _moe(p, ref, recorded=rec).y
  np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(ids, recorded)


def test_checkpoint_layout_round_trip(tmp_path):
  """A checkpoint written by transformers' save_pretrained (experts unfused on disk) loads and exports bit for bit."""
  torch = pytest.importorskip("torch")
  from safetensors.numpy import load_file
  from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

  hf = Qwen3MoeConfig(
    vocab_size=32,
    hidden_size=D,
    intermediate_size=24,
    moe_intermediate_size=F,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    num_experts=E,
    num_experts_per_tok=K,
    norm_topk_prob=True,
    decoder_sparse_step=2,
  )
  torch.manual_seed(1)
  model = Qwen3MoeForCausalLM(hf).float()
  with torch.no_grad():
    for t in model.model.layers[1].mlp.parameters():
      t.normal_(0.0, 0.3)
  model.save_pretrained(tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  spec = moe.MoESpec.from_hf(hf)
  assert spec.sparse_layers(2) == (1,) and "model.layers.0.mlp.gate_proj.weight" in tensors
  prefix = "model.layers.1.mlp"
  p = moe.from_hf_checkpoint(tensors, prefix, E)
  back = moe.to_hf_checkpoint(p, prefix)
  assert set(back) == {k for k in tensors if k.startswith(prefix + ".")}
  for k, v in back.items():
    np.testing.assert_array_equal(v, tensors[k])
  x = np.random.default_rng(1).standard_normal((1, 6, D)).astype(np.float32)
  with torch.no_grad():
    y_hf = model.model.layers[1].mlp(torch.from_numpy(x)).numpy()
  y = _moe({k: jnp.asarray(v) for k, v in p.items()}, jnp.asarray(x), spec).y
  np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())
