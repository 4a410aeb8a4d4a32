"""Exact per-example squared gradient norms (and the coefficient-weighted update) through an MoE block's weights.

The ghost-norm identity of `vcpo_jax.grad_norms`, for grouped matmuls. An expert matmul (an "expert" tap
of `vcpo_jax.model.moe`) maps rows r of the expert-sorted layout, y_r = a_r W_{e_r}, with a_r [Din] the
row's input, e_r its expert and n_r its example (sequence); d_r = dL/dy_r [Dout] is its output gradient,
which already carries the row's gate g (the tap sits before the gate product). Example n's gradient for
expert e is

    G_{n,e} = sum_{r: n_r = n, e_r = e} a_r^T d_r                  [Din, Dout]
    S_n     = sum_e ||G_{n,e}||_F^2 = sum_{r, s in n} [e_r = e_s] (a_r . a_s)(d_r . d_s)

"gram" forms the right-hand side per example ([N, T K, T K] values, T K = rows per example):
N (T K)^2 (Din + Dout) flops. "direct" forms G_{n,e} by one ragged contraction over the rows sorted by
(example, expert) (`jax.lax.ragged_dot_general`, ragged contracting dimension) and squares it:
T K Din Dout flops and b E Din Dout floats for a block of b examples. The router is a plain linear layer
over all tokens ("linear" tap: `linear_sq_norms`). The update is sum_n w_n G_{n,e} = sum_r w_{n_r} a_r^T d_r
per expert (`expert_weighted_grad`), the same contraction with w-scaled rows, no second backward pass.

Shape legend: N examples, T tokens per example, R rows (N T K), E experts, Din / Dout a matmul's widths.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from vcpo_jax.model.moe import group_bounds

_F32 = jnp.float32
_RAGGED_CONTRACT = jax.lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)  # [R, Din] x [R, Dout] -> [G, Din, Dout]: one a^T d per group of consecutive rows


def _grouped_outer(a_ri, d_ro, group_sizes_g, impl: str = "ragged") -> jax.Array:
  """sum_{r in group g} a_r^T d_r for consecutive row groups, [G, Din, Dout] float32.

  impl: "ragged", one ragged_dot_general; "scan", one masked contraction per group (lax.map: the memory of
  one [Din, Dout] at a time; `moe.grouped_matmul`'s CPU-sizing stand-in)."""
  if impl == "ragged":
    return jax.lax.ragged_dot_general(a_ri, d_ro, group_sizes_g, _RAGGED_CONTRACT, preferred_element_type=_F32)
  rows = jnp.arange(a_ri.shape[0], dtype=jnp.int32)[:, None]

  def one(bounds):
    lo, hi = bounds
    return jnp.einsum("ri,ro->io", jnp.where((rows >= lo) & (rows < hi), a_ri, 0), d_ro, preferred_element_type=_F32)

  return jax.lax.map(one, group_bounds(group_sizes_g))


def _by_example(x, example_r, n: int):
  """Rows stably sorted by example and split [R, ...] -> [N, R / N, ...] (every example has R / N rows)."""
  r = example_r.shape[0]
  if r % n:
    raise ValueError(f"{r} rows do not split evenly over {n} examples (every token routes to K experts)")
  order = jnp.argsort(example_r, stable=True)
  return jax.tree.map(lambda v: v[order].reshape(n, r // n, *v.shape[1:]), x)


def expert_sq_norms(
  a_ri, d_ro, expert_r, example_r, *, n: int, num_experts: int, method: str = "gram", block: int = 0, impl="ragged"
) -> jax.Array:
  """S_n = sum_e ||G_{n,e}||_F^2 of one expert matmul's weights [E, Din, Dout], [N] float32.

  Args:
    a_ri: [R, Din] row inputs; d_ro: [R, Dout] row output gradients (rows in any order).
    expert_r, example_r: [R] int, each row's expert and example (0 <= example < n, R / n rows each).
    method: "gram" (sum_{r,s} [e_r = e_s] (a_r . a_s)(d_r . d_s) per example) or "direct" (form G_{n,e}).
    block: "direct": examples per step of a lax.map (0 = all at once); must divide n.
    impl: the grouped contraction of "direct" (`_grouped_outer`).
  """
  rows = _by_example({"a": a_ri.astype(_F32), "d": d_ro.astype(_F32), "e": expert_r.astype(jnp.int32)}, example_r, n)
  if method == "gram":
    same = rows["e"][:, :, None] == rows["e"][:, None, :]
    aa = jnp.einsum("nri,nsi->nrs", rows["a"], rows["a"])
    dd = jnp.einsum("nro,nso->nrs", rows["d"], rows["d"])
    return jnp.sum(jnp.where(same, aa * dd, 0.0), axis=(1, 2))
  if method != "direct":
    raise ValueError(f"Unknown method {method!r}: 'gram' | 'direct'.")
  b = n if block <= 0 else block
  if n % b:
    raise ValueError(f"block={block} must divide n={n}")

  def one_block(x):  # x: b examples' rows [b, R / N, ...] -> [b]
    key = (jnp.arange(b, dtype=jnp.int32)[:, None] * num_experts + x["e"]).reshape(-1)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=b * num_experts).astype(jnp.int32)
    a, d = x["a"].reshape(-1, x["a"].shape[-1])[order], x["d"].reshape(-1, x["d"].shape[-1])[order]
    g = _grouped_outer(a, d, sizes, impl)
    return jnp.sum(g * g, axis=(1, 2)).reshape(b, num_experts).sum(-1)

  blocks = jax.tree.map(lambda v: v.reshape(n // b, b, *v.shape[1:]), rows)
  return jax.lax.map(one_block, blocks).reshape(n)


def expert_weighted_grad(a_ri, d_ro, expert_r, example_r, w_n, *, num_experts: int, impl="ragged") -> jax.Array:
  """sum_n w_n G_{n,e} = sum_r w_{n_r} a_r^T d_r for every expert: the update of [E, Din, Dout], float32."""
  order = jnp.argsort(expert_r, stable=True)
  sizes = jnp.bincount(expert_r.astype(jnp.int32), length=num_experts).astype(jnp.int32)
  d_w = d_ro.astype(_F32) * jnp.asarray(w_n, _F32)[example_r][:, None]
  return _grouped_outer(a_ri.astype(_F32)[order], d_w[order], sizes, impl)


def linear_sq_norms(a_nti, d_nto) -> jax.Array:
  """||A_n^T D_n||_F^2 of a plain linear layer (the router, x [N, T, D] -> logits [N, T, E]) by the gram form, [N]."""
  a, d = a_nti.astype(_F32), d_nto.astype(_F32)
  return jnp.einsum("nts,nts->n", jnp.einsum("nti,nsi->nts", a, a), jnp.einsum("nto,nso->nts", d, d))


def block_sq_norms(
  inputs: dict[str, Any], outgrads: dict[str, jax.Array], name: str, *, n: int, num_experts: int, method: str = "gram"
) -> jax.Array:
  """S_n through one tapped `moe.MoEBlock` named `name`: its router plus its three expert matmuls, [N].

  inputs / outgrads: a recording's tapped inputs (taps.Tape.inputs) and the output gradients of its
  perturbations, keyed by tap name ("{name}.gate", "{name}.experts.{gate,up,down}_proj").
  """
  gate = f"{name}.gate"
  sq = linear_sq_norms(
    inputs[gate].reshape(n, -1, inputs[gate].shape[-1]), outgrads[gate].reshape(n, -1, outgrads[gate].shape[-1])
  )
  for w in ("gate_proj", "up_proj", "down_proj"):
    tap = inputs[f"{name}.experts.{w}"]
    d = outgrads[f"{name}.experts.{w}"]
    sq = sq + expert_sq_norms(tap["a"], d, tap["expert"], tap["example"], n=n, num_experts=num_experts, method=method)
  return sq
