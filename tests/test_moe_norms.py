"""Per-example squared gradient norms through the MoE block (vcpo_jax.model.moe_norms) against brute force.

Brute force: example by example, jax.grad of that example's loss w.r.t. every parameter of the block and
its squared norm (a Python loop: ragged_dot has no vmap rule over a non-leading axis in this jax).
Ghost: one recording of the block's taps (vcpo_jax.model.taps) with zero perturbations, one grad w.r.t. them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vcpo_jax.model import moe, moe_norms, taps

N, T, D, E, K, F = 3, 5, 12, 6, 2, 8
SPEC = moe.MoESpec(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F, norm_topk_prob=True)
NAME = "layers.0.mlp"


def _setup(seed=0):
  block = moe.MoEBlock(D, SPEC, name=NAME, dtype=jnp.float32, rngs=nnx.Rngs(params=seed))
  graphdef, state = nnx.split(block, nnx.Param)
  state = jax.tree.map(lambda v: v * 15.0, state)  # O(0.3) weights: routing and gates far from uniform
  ks = jax.random.split(jax.random.key(seed + 1), 3)
  x = jax.random.normal(ks[0], (N, T, D))
  v = jax.random.normal(ks[1], (N, T, D))
  c = (jax.random.uniform(ks[2], (N, T)) > 0.2).astype(jnp.float32)  # per-token loss weights (0 = padding)
  return graphdef, state, x, v, c


def _loss(graphdef, state, x, v, c, recorded):
  """sum_{n,t} c_nt <y_nt, v_nt>, y = the block's output."""
  y = nnx.merge(graphdef, state)(x, recorded).y
  return jnp.sum(c[..., None] * y * v)


def _brute(graphdef, state, x, v, c, recorded):
  out = []
  for i in range(N):
    rec = None if recorded is None else recorded[i : i + 1]
    g = jax.grad(_loss, argnums=1)(graphdef, state, x[i : i + 1], v[i : i + 1], c[i : i + 1], rec)
    out.append(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)))
  return jnp.stack(out)


def _ghost(graphdef, state, x, v, c, recorded):
  """(tapped inputs, their output gradients) of one recording."""
  with taps.recording() as shapes:
    nnx.merge(graphdef, state)(x, recorded)
  zeros = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.out_shapes.items()}

  def f(perts):
    with taps.recording(perts) as tape:
      loss = _loss(graphdef, state, x, v, c, recorded)
    return loss, dict(tape.inputs)

  d, inputs = jax.grad(f, has_aux=True)(zeros)
  return inputs, d


def _recorded(graphdef, state, x):
  """Recorded experts disjoint from the block's own top-K on every token."""
  own = np.asarray(nnx.merge(graphdef, state)(x).expert_ids).reshape(-1, K)
  rng = np.random.default_rng(0)
  rows = [rng.permutation([e for e in range(E) if e not in set(r)])[:K] for r in own]
  return jnp.asarray(np.stack(rows).reshape(N, T, K), jnp.int32)


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("method", ["gram", "direct"])
def test_block_sq_norms_match_brute_force(method, replay):
  graphdef, state, x, v, c = _setup()
  recorded = _recorded(graphdef, state, x) if replay else None
  inputs, d = _ghost(graphdef, state, x, v, c, recorded)
  assert {info for info in inputs} == {f"{NAME}.gate"} | {
    f"{NAME}.experts.{w}" for w in ("gate_proj", "up_proj", "down_proj")
  }
  norms = functools.partial(moe_norms.block_sq_norms, name=NAME, n=N, num_experts=E, method=method)
  got = jax.jit(norms)(inputs, d)
  ref = _brute(graphdef, state, x, v, c, recorded)
  assert float(ref.min()) > 0
  np.testing.assert_allclose(got, ref, rtol=2e-4)


def test_direct_in_blocks_equals_gram_per_matmul():
  graphdef, state, x, v, c = _setup(3)
  inputs, d = _ghost(graphdef, state, x, v, c, None)
  for w in ("gate_proj", "up_proj", "down_proj"):
    tap = inputs[f"{NAME}.experts.{w}"]
    args = (tap["a"], d[f"{NAME}.experts.{w}"], tap["expert"], tap["example"])
    gram = moe_norms.expert_sq_norms(*args, n=N, num_experts=E)
    direct = moe_norms.expert_sq_norms(*args, n=N, num_experts=E, method="direct", block=1)
    np.testing.assert_allclose(direct, gram, rtol=1e-5)


def test_router_norm_alone_matches_brute_force():
  """The router's share: brute force restricted to the gate kernel."""
  graphdef, state, x, v, c = _setup(1)
  inputs, d = _ghost(graphdef, state, x, v, c, None)
  gate = f"{NAME}.gate"
  got = moe_norms.linear_sq_norms(inputs[gate], d[gate])
  ref = []
  for i in range(N):
    g = jax.grad(_loss, argnums=1)(graphdef, state, x[i : i + 1], v[i : i + 1], c[i : i + 1], None)
    ref.append(jnp.sum(g["gate"]["kernel"][...] ** 2))
  np.testing.assert_allclose(got, jnp.stack(ref), rtol=2e-4)


@pytest.mark.parametrize("replay", [False, True])
def test_weighted_update_equals_autodiff(replay):
  """sum_n w_n G_n from the same taps equals jax.grad of sum_n w_n L_n (no second backward needed)."""
  graphdef, state, x, v, c = _setup(2)
  recorded = _recorded(graphdef, state, x) if replay else None
  w = jnp.array([0.5, -1.0, 2.0])
  cw = c * w[:, None]
  inputs, d = _ghost(graphdef, state, x, v, cw, recorded)  # D is linear in the per-example cotangent
  ref = jax.grad(_loss, argnums=1)(graphdef, state, x, v, c * w[:, None], recorded)
  ones = jnp.ones((N,))
  for wname in ("gate_proj", "up_proj", "down_proj"):
    tap = inputs[f"{NAME}.experts.{wname}"]
    g = moe_norms.expert_weighted_grad(
      tap["a"], d[f"{NAME}.experts.{wname}"], tap["expert"], tap["example"], ones, num_experts=E
    )
    np.testing.assert_allclose(g, ref["experts"][wname][...], rtol=1e-5, atol=1e-6)
  # And the weights themselves: unweighted cotangents, w applied by the contraction.
  inputs, d = _ghost(graphdef, state, x, v, c, recorded)
  tap = inputs[f"{NAME}.experts.down_proj"]
  g = moe_norms.expert_weighted_grad(
    tap["a"], d[f"{NAME}.experts.down_proj"], tap["expert"], tap["example"], w, num_experts=E
  )
  np.testing.assert_allclose(g, ref["experts"]["down_proj"][...], rtol=1e-5, atol=1e-6)


def test_rows_must_split_over_examples():
  with pytest.raises(ValueError):
    moe_norms.expert_sq_norms(
      jnp.ones((5, 2)), jnp.ones((5, 2)), jnp.zeros(5, int), jnp.zeros(5, int), n=2, num_experts=2
    )
