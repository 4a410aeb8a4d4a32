"""Qwen3-MoE sparse block: a top-k softmax router and SwiGLU experts by a grouped matmul, with routing replay.

Shape legend (transformer.py's, plus): M tokens (B T flattened), E experts, K experts per token
(num_experts_per_tok), R = M K (token, expert) assignments in the expert-sorted layout, F the
expert width (moe_intermediate_size).

The block (transformers' Qwen3MoeSparseMoeBlock, models/qwen3_moe/modeling_qwen3_moe.py):

    z_m   = x_m @ W_router                         router logits [M, E] (compute dtype)
    p_m   = softmax(z_m) in float32                [M, E]
    S_m   = top-K(p_m)                             the chosen experts [M, K]
    g_mk  = p_m[S_mk] (/ sum_k p_m[S_mk] if norm_topk_prob)
    y_m   = sum_k g_mk * down_e(silu(x_m @ gate_e) * (x_m @ up_e)),   e = S_mk

Dispatch sorts the M K assignments by expert (`dispatch`) and runs each expert matmul as one
`jax.lax.ragged_dot` over the sorted rows with per-expert group sizes, so no [M, E, F] one-hot
product is formed; `combine` gathers the rows back to token order and sums over k.

Expert parallelism: under a mesh whose expert axis (`sharding.EXPERT_AXIS`) divides E, each device holds and runs
E / S experts on its tokens and the partial outputs are summed over the axis (`_expert_parallel`); the tokens are
whole on every device of that axis, so no all-to-all is needed. Selected automatically (`sharding.expert_shards`).

Routing replay (R3): given recorded expert ids S*_mk (the sampler's), the block uses them instead
of its own top-K, with the gates recomputed from the learner's router: g_mk = p_m[S*_mk]
(renormalised over the recorded set if norm_topk_prob). The experts are then the sampler's, and
the router still gets a gradient through g. `replay_m` limits replay to some tokens (the response
columns the sampler recorded); the others use their own top-K.

Parameters (kernels [in, out], as transformer.py): `gate.kernel` [D, E] (HF `mlp.gate.weight`
[E, D]), `experts.gate_proj` / `experts.up_proj` [E, D, F] and `experts.down_proj` [E, F, D]
(HF in memory: `mlp.experts.gate_up_proj` [E, 2F, D] = [gate; up] and `mlp.experts.down_proj`
[E, D, F]: `from_hf_experts`; on disk per expert, `mlp.experts.{j}.gate_proj.weight` [F, D]: `from_hf_checkpoint`).

Ghost taps (`vcpo_jax.model.taps`): the router is a "linear" tap (A = x [B, T, D]); each expert
matmul is an "expert" tap whose A is {"a": rows [R, Din], "expert": [R] int32, "example": [R] int32}
and whose output [R, Dout] is the matmul's output before the gate (so D already carries g);
`vcpo_jax.model.moe_norms` turns those into per-example squared norms and update gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vcpo_jax import sharding as sh
from vcpo_jax.model.taps import TapInfo, tap


@dataclasses.dataclass(frozen=True)
class MoESpec:
  """The MoE fields of a Qwen3-MoE config (transformers' Qwen3MoeConfig names and defaults, except the aux coef).

  router_aux_loss_coef: the checkpoint's weight of `load_balancing_loss` (transformers' default 0.001, applied by
  it only with output_router_logits; 0 here otherwise); the learner applies learner.router_aux_loss_coef instead.
  """

  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
    if not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")
    if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
      raise ValueError("moe_intermediate_size and decoder_sparse_step must be positive")
    if self.router_aux_loss_coef < 0:
      raise ValueError(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0")

  def is_sparse(self, layer: int) -> bool:
    """Qwen3MoeDecoderLayer's rule: layer i is an MoE block iff i not in mlp_only_layers, E > 0, (i + 1) % step == 0."""
    return layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0

  def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
    """The indices of the MoE layers among num_layers."""
    return tuple(i for i in range(num_layers) if self.is_sparse(i))

  @classmethod
  def from_hf(cls, hf) -> MoESpec:
    """From a transformers Qwen3MoeConfig (or its dict): the aux coef is taken only if output_router_logits."""
    get = hf.get if isinstance(hf, dict) else lambda k, d=None: getattr(hf, k, d)
    return cls(
      num_experts=int(get("num_experts", None) or get("num_local_experts")),  # to_dict() writes the alias
      num_experts_per_tok=int(get("num_experts_per_tok")),
      moe_intermediate_size=int(get("moe_intermediate_size")),
      norm_topk_prob=bool(get("norm_topk_prob", False)),
      decoder_sparse_step=int(get("decoder_sparse_step", 1)),
      mlp_only_layers=tuple(get("mlp_only_layers", None) or ()),
      router_aux_loss_coef=float(get("router_aux_loss_coef", 0.0)) if get("output_router_logits", False) else 0.0,
    )


# A tiny Qwen3-MoE for CPU tests: `ModelConfig` fields (tiny_qwen3's shape, 2 layers) plus "moe", a MoESpec
# (every layer sparse, 8 experts, 2 per token, normalised top-k as Qwen3-30B-A3B): the same model as
# `config.tiny_qwen3_moe()`, whose ModelConfig carries the spec's fields flat.
TINY_QWEN3_MOE = {
  "hidden_size": 64,
  "intermediate_size": 128,  # the dense MLP of mlp_only_layers (none here)
  "num_layers": 2,
  "num_heads": 4,
  "num_kv_heads": 2,
  "head_dim": 32,
  "qkv_bias": False,
  "qk_norm": True,
  "tie_embeddings": False,
  "model_type": "qwen3_moe",
  "moe": MoESpec(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}


# ----------------------------------------------------------------------------- routing


@dataclasses.dataclass
class RoutingRecord:
  """What a model forward's MoE layers replay and what they chose (the routing hook of `routing`).

  recorded: [L, B, T, K] int expert ids to replay (None: every token takes its own top-K).
  replay: [B, T] bool, the tokens that replay (None: all of them when recorded is given).
  expert_ids: after the forward, the experts each layer used, [L, B, T, K] int32 (the recorded ones where
    replayed); router_logits: [L, B, T, E] float32 (for the load-balancing loss and the mismatch metric).
  """

  recorded: jax.Array | None = None
  replay: jax.Array | None = None
  expert_ids: jax.Array | None = None
  router_logits: jax.Array | None = None


_ROUTING: contextvars.ContextVar[RoutingRecord | None] = contextvars.ContextVar("vcpo_moe_routing", default=None)


@contextlib.contextmanager
def routing(recorded=None, replay=None):
  """Within this context a model forward replays `recorded` (see RoutingRecord) and reports its routing.

  Read at trace time (as `taps.recording`): wrap the traced call, and return the record's arrays from it.
  A dense model ignores the context (expert_ids stays None).
  """
  rec = RoutingRecord(recorded, replay)
  token = _ROUTING.set(rec)
  try:
    yield rec
  finally:
    _ROUTING.reset(token)


def active_routing() -> RoutingRecord | None:
  """The RoutingRecord of the enclosing `routing` context, or None."""
  return _ROUTING.get()


class Routing(NamedTuple):
  """expert_ids_mk [M, K] int32 (the experts used), gates_mk [M, K] float32, probs_me [M, E] float32."""

  expert_ids_mk: jax.Array
  gates_mk: jax.Array
  probs_me: jax.Array


def route(logits_me, top_k: int, norm_topk_prob: bool, recorded_mk=None, replay_m=None) -> Routing:
  """Top-K softmax routing, or replay of recorded experts with gates from these logits.

  p = softmax(logits) in float32; ids = top_k(p) (lax.top_k: descending; exact ties go to the
  lower id, which torch.topk does not promise); where replayed (replay_m [M] bool, None = every token
  when recorded_mk is given), ids = recorded_mk [M, K]. g = p[ids], / sum_k g if norm_topk_prob.
  Gradients reach the logits through g either way (top_k's values are p gathered at its indices).
  """
  probs = jax.nn.softmax(logits_me.astype(jnp.float32), axis=-1)
  _, ids = jax.lax.top_k(probs, top_k)
  if recorded_mk is not None:
    recorded_mk = recorded_mk.astype(jnp.int32)
    ids = recorded_mk if replay_m is None else jnp.where(replay_m[:, None], recorded_mk, ids)
  gates = jnp.take_along_axis(probs, ids, axis=-1)
  if norm_topk_prob:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return Routing(ids.astype(jnp.int32), gates, probs)


class Dispatch(NamedTuple):
  """The expert-sorted layout of the M K assignments (row r of every grouped matmul).

  order_r [R]: flat assignment index (m K + k) of row r, stable-sorted by expert;
  token_r [R] = order_r // K; expert_r [R]: its expert (non-decreasing); group_sizes_e [E] int32.
  """

  order_r: jax.Array
  token_r: jax.Array
  expert_r: jax.Array
  group_sizes_e: jax.Array


def dispatch(expert_ids_mk: jax.Array, num_experts: int) -> Dispatch:
  """Sorts the assignments by expert: O(M K log(M K)), no [M, E] one-hot."""
  k = expert_ids_mk.shape[-1]
  flat = expert_ids_mk.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return Dispatch(order, order // k, flat[order], sizes)


def combine(out_rd: jax.Array, gates_mk: jax.Array, disp: Dispatch) -> jax.Array:
  """y_m = sum_k g_mk out_{row of (m, k)}: rows back to token order by the inverse permutation, [M, D]."""
  m, k = gates_mk.shape
  inv = jnp.zeros_like(disp.order_r).at[disp.order_r].set(jnp.arange(m * k, dtype=jnp.int32))
  out_mkd = out_rd[inv].reshape(m, k, -1)
  return jnp.einsum("mkd,mk->md", out_mkd, gates_mk.astype(out_rd.dtype))


GROUPED_MATMULS = ("ragged", "scan")


def group_bounds(group_sizes_g) -> tuple[jax.Array, jax.Array]:
  """(start, end) [G] int32 of each group's consecutive rows."""
  ends = jnp.cumsum(group_sizes_g.astype(jnp.int32))
  return ends - group_sizes_g.astype(jnp.int32), ends


def _per_example(fn):
  """fn with a batching rule that maps it over the batch (lax.map): `jax.lax.ragged_dot` has no vmap rule off
  the leading axis (jax 0.10), and per-example gradients (learner.grad_path='vmap', grad_norms.vmap_sq_norms)
  vmap the model over examples, each with its own group sizes."""
  mapped = jax.custom_batching.custom_vmap(fn)

  @mapped.def_vmap
  def rule(axis_size, in_batched, *args):
    args = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched)]
    out = jax.lax.map(lambda xs: fn(*xs), args)
    return out, jax.tree.map(lambda _: True, out)

  return mapped


_ragged_forward = _per_example(lambda a, w, g: jax.lax.ragged_dot(a, w, g))
_ragged_backward = _per_example(lambda a, w, g, dy: jax.vjp(lambda a, w: jax.lax.ragged_dot(a, w, g), a, w)[1](dy))


@jax.custom_vjp
def ragged_dot(a_ri, w_eio, group_sizes_e) -> jax.Array:
  """`jax.lax.ragged_dot` that also vmaps (over any batch of rows and group sizes) under reverse-mode autodiff:
  the forward and its vjp (ragged_dot's own) each carry a lax.map batching rule; custom_vmap alone does not
  differentiate, so the vjp is given here."""
  return _ragged_forward(a_ri, w_eio, group_sizes_e)


def _ragged_dot_fwd(a_ri, w_eio, group_sizes_e):
  return _ragged_forward(a_ri, w_eio, group_sizes_e), (a_ri, w_eio, group_sizes_e)


def _ragged_dot_bwd(res, dy):
  da, dw = _ragged_backward(*res, dy)
  return da, dw, None


ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def grouped_matmul(a_ri, w_eio, group_sizes_e, impl: str = "ragged") -> jax.Array:
  """y_r = a_r @ w_{e_r} for rows sorted by expert (expert e: group_sizes_e[e] consecutive rows), [R, Dout].

  "ragged": one `jax.lax.ragged_dot` (`ragged_dot`: vmappable), a grouped GEMM on TPU / GPU (XLA:CPU expands it into a masked dense product
  over [R, E Din] values). "scan": a lax.scan over the experts, every row times W_e, kept on expert e's rows:
  exact on any backend at E times the flops, with a grouped GEMM's memory (one [R, Dout] product at a time); the
  stand-in benchmarks/memory.py compiles on fake CPU devices (ModelConfig.moe_matmul).
  """
  if impl == "ragged":
    return ragged_dot(a_ri, w_eio, group_sizes_e)
  if impl != "scan":
    raise ValueError(f"grouped matmul impl {impl!r}: choose one of {GROUPED_MATMULS}.")
  rows = jnp.arange(a_ri.shape[0], dtype=jnp.int32)[:, None]
  starts, ends = group_bounds(group_sizes_e)

  def body(y, x):
    w, lo, hi = x
    return y + jnp.where((rows >= lo) & (rows < hi), a_ri @ w, 0).astype(y.dtype), None

  y0 = jnp.zeros((a_ri.shape[0], w_eio.shape[-1]), jnp.result_type(a_ri, w_eio))
  return jax.lax.scan(body, y0, (w_eio, starts, ends))[0]


def experts_forward(
  x_md, gate_edf, up_edf, down_efd, routing: Routing, *, dtype=None, name=None, tokens_per_example=0, impl="ragged"
):
  """The experts' weighted sum y [M, D] for the given routing (see the module docstring).

  name: tap the three matmuls as "{name}.gate_proj" / "up_proj" / "down_proj" (kind "expert"), with
  example_r = token_r // tokens_per_example (the row's sequence, tokens flattened from [B, T]).
  impl: the grouped matmul (`grouped_matmul`).

  Under a mesh whose expert axis splits the experts (`sharding.expert_shards` > 1) the experts run expert-parallel
  (`_expert_parallel`). Otherwise, under a mesh that splits the tokens' batch, every device dispatches its own
  tokens (`sharding.batch_local`: a sort of its M / shards tokens and grouped matmuls over its rows, with every
  expert; a global sort would gather every token on every device): the rows are then device-major,
  expert-sorted within each device's block.
  """
  dtype = dtype or x_md.dtype
  m, e = x_md.shape[0], gate_edf.shape[0]
  shards = sh.expert_shards(e)
  if shards > 1:
    return _expert_parallel(x_md, (gate_edf, up_edf, down_efd), routing, shards, dtype, name, tokens_per_example, impl)
  local = lambda fn, args, batched: sh.batch_local(fn, args, batched, m)

  def dispatch_local(index, x, ids):  # this device's tokens sorted by expert; example ids of the whole batch
    disp = dispatch(ids, e)
    example = (index * x.shape[0] + disp.token_r) // max(tokens_per_example, 1)
    return x[disp.token_r], disp.order_r, disp.expert_r, disp.group_sizes_e[None], example

  x_rd, order_r, expert_r, sizes, example_r = local(dispatch_local, (x_md.astype(dtype), routing.expert_ids_mk), (1, 1))

  def grouped(which, a_rd, w):
    y = local(lambda _, a, s, w: grouped_matmul(a, w, s[0], impl), (a_rd, sizes, w.astype(dtype)), (1, 1, 0))
    return _tap_expert(name, which, impl, a_rd, expert_r, example_r, y)

  h = jax.nn.silu(grouped("gate_proj", x_rd, gate_edf)) * grouped("up_proj", x_rd, up_edf)
  out_rd = grouped("down_proj", h, down_efd)
  combine_local = lambda _, out, g, order: combine(out, g, Dispatch(order, None, None, None))
  return local(combine_local, (out_rd, routing.gates_mk.astype(dtype), order_r), (1, 1, 1))


def _tap_expert(name, which, impl, a_rd, expert_r, example_r, y):
  """y tapped as the "expert" matmul "{name}.{which}" (the identity when name is None)."""
  if name is None:
    return y
  tname = f"{name}.{which}"
  return tap(tname, TapInfo("expert", tname, spec=impl), {"a": a_rd, "expert": expert_r, "example": example_r}, y)


def _expert_parallel(x_md, weights, routing: Routing, shards: int, dtype, name, tokens_per_example, impl):
  """Expert parallelism: device j of the expert axis holds experts [j E / S, (j + 1) E / S) and runs them only.

  S = shards. The tokens are whole on every device of the expert axis (the residual stream is replicated over it,
  split over the batch axes), so routing a token to the device of its expert needs no all-to-all: each device
  sorts its tokens' assignments to its own experts first (the others last, zero rows that no group covers),
  runs the grouped matmuls over its E / S experts' weights (never gathered: `sharding.expert_local`), and combines
  its gated rows into a partial y; the partials are summed over the expert axis (an all-reduce of [M, D] float32,
  as a tensor-parallel MLP's). Rows per device: its M K assignments (dropless; the local ones first).
  Tapped rows are the devices' blocks (batch-major, then expert axis), expert ids global; a row another device
  runs has a = 0 and d = 0 here, so it adds nothing to any norm or update.
  """
  m, k = routing.expert_ids_mk.shape
  e = weights[0].shape[0]
  el = e // shards
  local = lambda fn, args, kinds, out: sh.expert_local(fn, args, kinds, m, out)

  def mine(t, ids):  # [M, K] bool, this device holds the expert; the local expert index
    lid = ids - t * el
    return (lid >= 0) & (lid < el), lid

  def dispatch_local(b, t, x, ids):
    own, lid = mine(t, ids)
    disp = dispatch(jnp.where(own, lid, el), el + 1)  # group el: the other devices' assignments, sorted last
    kept = disp.expert_r < el
    example = (b * x.shape[0] + disp.token_r) // max(tokens_per_example, 1)
    rows = jnp.where(kept[:, None], x[disp.token_r], 0)
    expert = jnp.minimum(disp.expert_r, el - 1) + t * el  # global ids; a foreign row takes the last local id
    return rows, disp.order_r, expert, disp.group_sizes_e[None, :el], example

  kinds = ("batch", "batch")
  x_rd, order_r, expert_r, sizes, example_r = local(
    dispatch_local, (x_md.astype(dtype), routing.expert_ids_mk), kinds, ("rows",) * 5
  )

  def grouped(which, a_rd, w):
    mm = lambda _b, _t, a, s, w: grouped_matmul(a, w, s[0], impl)
    y = local(mm, (a_rd, sizes, w.astype(dtype)), ("rows", "rows", "experts"), "rows")
    return _tap_expert(name, which, impl, a_rd, expert_r, example_r, y)

  gate_edf, up_edf, down_efd = weights
  h = jax.nn.silu(grouped("gate_proj", x_rd, gate_edf)) * grouped("up_proj", x_rd, up_edf)
  out_rd = grouped("down_proj", h, down_efd)

  def combine_local(_b, t, out, g, ids, order):
    own, _ = mine(t, ids)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(g.shape[0] * k, dtype=jnp.int32))
    out_mkd = jnp.where(own[..., None], out[inv].reshape(*own.shape, -1), 0)
    return jnp.einsum("mkd,mk->md", out_mkd, jnp.where(own, g, 0), preferred_element_type=jnp.float32)[None]

  args = (out_rd, routing.gates_mk.astype(dtype), routing.expert_ids_mk, order_r)
  partial = local(combine_local, args, ("rows", "batch", "batch", "rows"), "partial")
  return jnp.sum(partial, axis=0).astype(dtype)


class MoEOutput(NamedTuple):
  """y [..., D] (x's leading shape), router_logits [..., E] float32, expert_ids [..., K] int32 (the routing record)."""

  y: jax.Array
  router_logits: jax.Array
  expert_ids: jax.Array


def sparse_moe(
  x, router_de, gate_edf, up_edf, down_efd, *, top_k: int, norm_topk_prob: bool, recorded=None, replay=None, dtype=None
) -> MoEOutput:
  """The Qwen3-MoE block on x [..., D] (pure, untapped): see the module docstring.

  recorded: [..., K] expert ids to replay (None: own top-K); replay: [...] bool, which tokens replay
  (None: all of them when recorded is given). dtype: the compute dtype (default x's); the router's
  softmax is float32.
  """
  dtype = dtype or x.dtype
  lead = x.shape[:-1]
  x_md = x.reshape(-1, x.shape[-1]).astype(dtype)
  logits = jnp.einsum("md,de->me", x_md, router_de.astype(dtype))
  rec = None if recorded is None else recorded.reshape(-1, top_k)
  rep = None if replay is None else replay.reshape(-1)
  routing = route(logits, top_k, norm_topk_prob, rec, rep)
  y = experts_forward(x_md, gate_edf, up_edf, down_efd, routing, dtype=dtype)
  e = router_de.shape[-1]
  return MoEOutput(
    y.reshape(*lead, -1), logits.astype(jnp.float32).reshape(*lead, e), routing.expert_ids_mk.reshape(*lead, top_k)
  )


# ----------------------------------------------------------------------------- losses and metrics


def load_balancing_loss(router_logits_lme, top_k: int, mask_m=None, expert_ids_lmk=None) -> jax.Array:
  """The Switch-Transformer auxiliary loss as transformers' load_balancing_loss_func computes it, a scalar.

      f_e = sum_{l, m} mask_m [e in S_lm] / (L sum_m mask_m),   P_e = sum_{l, m} mask_m p_lm[e] / (L sum_m mask_m)
      loss = E sum_e f_e P_e

  pooled over the L MoE layers (not a mean of per-layer losses); S_lm = top-K of p_lm = softmax(logits)
  unless expert_ids_lmk [L, M, K] gives them (the replayed experts). Gradient through P only.
  Scaled by learner.router_aux_loss_coef in the learner's loss (`learner.router_aux_loss`; off by default).
  """
  logits = jnp.asarray(router_logits_lme, jnp.float32)
  if logits.ndim == 2:
    logits = logits[None]
  n_layers, m, e = logits.shape
  probs = jax.nn.softmax(logits, axis=-1)
  ids = (
    jax.lax.top_k(probs, top_k)[1] if expert_ids_lmk is None else jnp.asarray(expert_ids_lmk).reshape(n_layers, m, -1)
  )
  w = jnp.ones((m,), jnp.float32) if mask_m is None else jnp.asarray(mask_m, jnp.float32).reshape(m)
  counts = jnp.zeros((e,), jnp.float32).at[ids.reshape(-1)].add(jnp.repeat(jnp.tile(w, n_layers), ids.shape[-1]))
  rows = n_layers * jnp.sum(w)
  p_sum = jnp.einsum("lme,m->e", probs, w)
  return e * jnp.sum((counts / rows) * (p_sum / rows))


def routing_mismatch(learner_ids, recorded_ids, mask=None) -> jax.Array:
  """The fraction of (masked) tokens whose learner top-K set differs from the recorded set, a float32 scalar.

  learner_ids, recorded_ids: [..., K] int (order within a token ignored); mask [...] (None = all).
  """
  same = jnp.all(
    jnp.sort(learner_ids, axis=-1) == jnp.sort(jnp.asarray(recorded_ids).astype(learner_ids.dtype), -1), -1
  )
  w = jnp.ones(same.shape, jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
  return jnp.sum(w * (1.0 - same)) / jnp.maximum(jnp.sum(w), 1.0)


# ----------------------------------------------------------------------------- the module


def _init(key, shape):
  return jax.random.normal(key, shape, jnp.float32) * 0.02


class Router(nnx.Module):
  def __init__(self, d: int, e: int, rngs: nnx.Rngs):
    self.kernel = nnx.Param(_init(rngs.params(), (d, e)))


class Experts(nnx.Module):
  def __init__(self, e: int, d: int, f: int, rngs: nnx.Rngs):
    self.gate_proj = nnx.Param(_init(rngs.params(), (e, d, f)))
    self.up_proj = nnx.Param(_init(rngs.params(), (e, d, f)))
    self.down_proj = nnx.Param(_init(rngs.params(), (e, f, d)))


class MoEBlock(nnx.Module):
  """The sparse block as a layer's `mlp` (parameters as in the module docstring), tapped for ghost norms.

  __call__(x [B, T, D], recorded [B, T, K] | None, replay [B, T] | None) -> MoEOutput (y [B, T, D],
  router_logits [B, T, E], expert_ids [B, T, K]). The router tap is "linear" under "{name}.gate"
  (its kernel: "{name}.gate.kernel"); the experts' taps are "expert" under "{name}.experts.{w}", whose
  TapInfo.param is the parameter's own path.
  """

  def __init__(self, d: int, spec: MoESpec, *, name: str, dtype, rngs: nnx.Rngs, matmul: str = "ragged"):
    self.gate = Router(d, spec.num_experts, rngs)
    self.experts = Experts(spec.num_experts, d, spec.moe_intermediate_size, rngs)
    self.name, self.dtype, self.matmul = name, dtype, matmul
    self.top_k, self.norm_topk_prob = spec.num_experts_per_tok, spec.norm_topk_prob

  def __call__(self, x_btd, recorded=None, replay=None) -> MoEOutput:
    b, t, d = x_btd.shape
    x = x_btd.astype(self.dtype)
    logits = jnp.einsum("btd,de->bte", x, self.gate.kernel[...].astype(self.dtype))
    logits = tap(f"{self.name}.gate", TapInfo("linear", f"{self.name}.gate"), x, logits)
    rec = None if recorded is None else recorded.reshape(b * t, self.top_k)
    rep = None if replay is None else replay.reshape(b * t)
    routing = route(logits.reshape(b * t, -1), self.top_k, self.norm_topk_prob, rec, rep)
    ex = self.experts
    y = experts_forward(
      x.reshape(b * t, d),
      ex.gate_proj[...],
      ex.up_proj[...],
      ex.down_proj[...],
      routing,
      dtype=self.dtype,
      name=f"{self.name}.experts",
      tokens_per_example=t,
      impl=self.matmul,
    )
    ids = routing.expert_ids_mk.reshape(b, t, self.top_k)
    return MoEOutput(y.reshape(b, t, d), logits.astype(jnp.float32), ids)


# ----------------------------------------------------------------------------- Hugging Face layouts


def from_hf_experts(gate_weight, gate_up_proj, down_proj) -> dict[str, np.ndarray]:
  """transformers 5.x in-memory tensors -> this module's layout (numpy float32).

  gate_weight [E, D] -> gate.kernel [D, E]; gate_up_proj [E, 2F, D] = [gate; up] -> experts.gate_proj,
  experts.up_proj [E, D, F]; down_proj [E, D, F] -> experts.down_proj [E, F, D]. A checkpoint on disk
  holds experts.{j}.{gate,up,down}_proj.weight [F, D] / [D, F]: np.stack them over j and concatenate
  gate and up on axis 1 first (transformers' conversion_mapping "qwen2_moe" rule).
  """
  gu = np.asarray(gate_up_proj, np.float32)
  f = gu.shape[1] // 2
  return {
    "gate.kernel": np.asarray(gate_weight, np.float32).T,
    "experts.gate_proj": gu[:, :f].transpose(0, 2, 1),
    "experts.up_proj": gu[:, f:].transpose(0, 2, 1),
    "experts.down_proj": np.asarray(down_proj, np.float32).transpose(0, 2, 1),
  }


def to_hf_experts(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The inverse of `from_hf_experts`: {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}."""
  g, u = (np.asarray(params[f"experts.{w}"]).transpose(0, 2, 1) for w in ("gate_proj", "up_proj"))
  return {
    "gate.weight": np.asarray(params["gate.kernel"]).T,
    "experts.gate_up_proj": np.concatenate([g, u], axis=1),
    "experts.down_proj": np.asarray(params["experts.down_proj"]).transpose(0, 2, 1),
  }


def from_hf_checkpoint(tensors, prefix: str, num_experts: int) -> dict[str, np.ndarray]:
  """One MoE block's tensors as a checkpoint written by transformers holds them -> this module's layout.

  tensors: name -> array (a safetensors shard's, numpy); prefix: the block's, e.g. "model.layers.3.mlp".
  On disk: "{prefix}.gate.weight" [E, D] and "{prefix}.experts.{j}.{gate,up,down}_proj.weight"
  ([F, D], [F, D], [D, F]) for j < E (save_pretrained writes experts unfused; transformers fuses them on load).
  """
  per = {
    w: np.stack([np.asarray(tensors[f"{prefix}.experts.{j}.{w}.weight"]) for j in range(num_experts)])
    for w in ("gate_proj", "up_proj", "down_proj")
  }
  return from_hf_experts(
    tensors[f"{prefix}.gate.weight"], np.concatenate([per["gate_proj"], per["up_proj"]], 1), per["down_proj"]
  )


def to_hf_checkpoint(params: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
  """The inverse of `from_hf_checkpoint`: checkpoint names -> float32 numpy arrays, experts unfused."""
  hf = to_hf_experts(params)
  f = hf["experts.gate_up_proj"].shape[1] // 2
  out = {f"{prefix}.gate.weight": hf["gate.weight"]}
  for j in range(hf["experts.down_proj"].shape[0]):
    out[f"{prefix}.experts.{j}.gate_proj.weight"] = hf["experts.gate_up_proj"][j, :f]
    out[f"{prefix}.experts.{j}.up_proj.weight"] = hf["experts.gate_up_proj"][j, f:]
    out[f"{prefix}.experts.{j}.down_proj.weight"] = hf["experts.down_proj"][j]
  return out
