"""Int8 weights for the sampler: per-output-channel symmetric quantization, dequantized inside the matmul.

A kernel w [..., Din, Dout] (any leading axes, e.g. the stacked layer axis L) is stored as
    q = clip(round(w / s), -127, 127)  int8 [..., Din, Dout],   s = max_i |w[..., i, o]| / 127  float32 [..., Dout]
(s = 1 where a column is all zero, so q = 0 there), and applied as y = (x @ q.astype(dt)) * s.astype(dt): the
weights are read as 1 byte each, the scale once per output channel. Per entry |w - q s| <= s / 2 =
max_i |w[:, o]| / 254 (round to nearest; no entry clips, |w / s| <= 127).

What is quantized (`quantize_params`): the decoder blocks' projection kernels (`QUANTIZED`: q/k/v/o and the
dense MLP's gate/up/down, almost all of a block's weights). Kept in the sampler's float dtype: the token
embedding and the LM head (their error reaches every logit directly, and LLM.int8 / GPTQ-style weight-only
schemes keep them in 16 bits too), norms, biases, LoRA factors (trained, small) and an MoE block's router
and expert tensors (applied by their own einsums, not `matmul`). The learner never sees a `QArray`: its
parameters stay in their own dtype; only the sampler's copy is quantized (`vcpo_jax.sampler`).

Source: per-channel absmax weight quantization as in LLM.int8 (Dettmers et al. 2022, arXiv 2208.07339)
without its outlier decomposition, and AQT / qwix's weight-only int8 ("w8a16") matmul.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

# The parameters `quantize_params` turns into QArrays: the projections Linear applies (transformer.py).
QUANTIZED = r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.kernel$"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
  """An int8 kernel and its per-output-channel scales: w ~= q * scale[..., None, :].

  q: int8 [..., Din, Dout]; scale: float32 [..., Dout]. A pytree (scans slice both over a leading layer
  axis); `qa[...]` is `qa` itself, so an nnx.Variable holding it reads like one holding an array.
  """

  q: jax.Array
  scale: jax.Array

  def __getitem__(self, index):
    if index is not Ellipsis:
      raise TypeError(f"QArray supports only [...] (the whole kernel), got [{index!r}]; dequantize() first.")
    return self

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.q.shape)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """q * scale in `dtype`: the weights the int8 sampler computes with."""
    return self.q.astype(dtype) * self.scale[..., None, :].astype(dtype)


def quantize(w: jax.Array) -> QArray:
  """Symmetric per-output-channel int8 quantization of w [..., Din, Dout] (the module docstring's formula)."""
  w = jnp.asarray(w, jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=-2)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w / scale[..., None, :]), -127, 127).astype(jnp.int8)
  return QArray(q, scale)


def matmul(x: jax.Array, kernel, dtype) -> jax.Array:
  """x [..., Din] @ kernel [Din, Dout] in `dtype`; a QArray kernel is dequantized inside the matmul,
  (x @ q.astype(dtype)) * scale (the scale is per output column, so it commutes out of the sum)."""
  if isinstance(kernel, QArray):
    return dot(x, kernel.q.astype(dtype)) * kernel.scale.astype(dtype)
  return dot(x, kernel.astype(dtype))


def dot(x: jax.Array, w: jax.Array, *, w_out_first: bool = False) -> jax.Array:
  """x [..., Din] @ w [Din, Dout] (w [Dout, Din] with w_out_first: a tied head) as one 2-D matmul over the
  leading axes flattened, [..., Dout].

  The values of jnp.einsum("...i,io->...o", x, w); for the batched einsum's backward XLA:CPU lays the weight
  gradient's operand out transposed (a strided copy fused into the elementwise backward before it), for the
  2-D form as it is (benchmarks/README.md, "learner step").
  """
  dims = (((1,), (1,)), ((), ())) if w_out_first else (((1,), (0,)), ((), ()))
  y = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), w, dims)
  return y.reshape(*x.shape[:-1], y.shape[-1])


def _path_str(path) -> str:
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  return ".".join(n for n in names if n != "value")


def quantize_params(params):
  """The parameter tree with every `QUANTIZED` kernel replaced by its QArray (other leaves as given)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QArray))
  pattern = re.compile(QUANTIZED)
  leaves = []
  for path, x in flat:
    hit = not isinstance(x, QArray) and jnp.issubdtype(x.dtype, jnp.floating) and pattern.search(_path_str(path))
    leaves.append(quantize(x) if hit else x)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def dequantize_params(params, dtype=jnp.float32):
  """Every QArray of the tree as its dense q * scale in `dtype` (the int8 sampler's weights, for the learner
  to score with, e.g. in tests)."""
  return jax.tree.map(
    lambda x: x.dequantize(dtype) if isinstance(x, QArray) else x, params, is_leaf=lambda x: isinstance(x, QArray)
  )
