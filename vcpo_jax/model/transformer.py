"""Decoder-only transformer policy in Flax NNX (Qwen2/Qwen2.5, Qwen3 dense and MoE, and Llama families).

Shape legend: B batch, T query tokens, S key tokens (T without a cache, the cache
length with one), D model width, F MLP width, N query heads, K key/value heads,
R = N // K query heads per kv head, H head width, V vocab.

Module and parameter names mirror the Hugging Face checkpoints, with the decoder's layers stacked
(`layers.self_attn.q_proj.kernel[3]` <-> `model.layers.3.self_attn.q_proj.weight`: every block
parameter has a leading layer axis L and the blocks run as one scan, `_run_layers`), with kernels
stored [in, out] (the transpose of torch's [out, in]).

Qwen3-MoE (cfg.moe set): every layer's `mlp` is a `moe.MoEBlock` (parameters `layers.mlp.gate.kernel`
[L, D, E], `layers.mlp.experts.{gate,up,down}_proj` [L, E, D, F] / [L, E, F, D]) inside the same scan;
a `moe.routing` context replays recorded experts and reports each layer's routing.

The functional entry points (`forward`, `token_logprobs`, `sequence_logprobs`)
take (graphdef, params) so that they can be jitted, vmapped and sharded like
any pure JAX function; see `split`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from vcpo_jax import sharding as sh
from vcpo_jax.model import attention as attn
from vcpo_jax.model import logprobs, moe, quant, support, taps
from vcpo_jax.model import rope as rope_lib
from vcpo_jax.model.config import ModelConfig
from vcpo_jax.model.taps import TapInfo, forbid, tap, tap_head


def _INIT(key, shape, dtype):
  """N(0, 0.02^2) weights, the same bits eagerly and under jit (policy.init_sharded, born sharded).

  The barrier keeps XLA from folding the 0.02 into the normal's own scaling when the initializer is
  fused under jit (that changes the last bit of ~25% of the entries); eagerly it is the identity.
  """
  return jax.lax.optimization_barrier(jax.random.normal(key, shape, dtype)) * jnp.array(0.02, dtype)


AttentionMask = attn.AttentionMask  # the mask type `forward` takes (re-exported for callers)

# The KV cache in the compute dtype (the layout: attention.py), stacked over layers: (k [L, B, K, H, S],
# v [L, B, K, S, H]). The scanned blocks carry it whole and each writes its own layer in place.
LayerCache = tuple[jax.Array, jax.Array]
# The sampler's unrolled decode (SamplerConfig.decode_layers="unrolled"): one (k [B, K, H, S], v [B, K, S, H])
# buffer pair per layer, a list (`split_cache`), run by `_run_layers_unrolled`.
PerLayerCache = list[tuple[jax.Array, jax.Array]]


class Linear(nnx.Module):
  """y = x @ kernel (+ bias), kernel [Din, Dout] in float32, computed in `dtype`.

  frozen: the base is not trained (LoRA on): kernel and bias are stored in `dtype` and not tapped.
  lora_rank > 0: a LoRA pair on top, y += lora_scale * (x @ A) @ B (`LoRAFactor` A [Din, r], B [r, Dout]),
  each factor its own "linear" tap, so the exact per-example norms see ||g_A||^2 + ||g_B||^2.
  """

  def __init__(
    self,
    din: int,
    dout: int,
    *,
    name: str,
    use_bias: bool,
    dtype,
    rngs: nnx.Rngs,
    frozen: bool = False,
    lora_rank: int = 0,
    lora_scale: float = 0.0,
  ):
    pdt = dtype if frozen else jnp.float32  # a frozen base is kept in the compute dtype
    self.kernel = nnx.Param(_INIT(rngs.params(), (din, dout), jnp.float32).astype(pdt))
    self.bias = nnx.Param(jnp.zeros((dout,), pdt)) if use_bias else None
    self.name, self.dtype, self.frozen, self.lora_scale = name, dtype, frozen, lora_scale
    self.lora_a, self.lora_b = _lora_pair(din, dout, lora_rank, name, dtype, rngs) if lora_rank else (None, None)

  def __call__(self, x: jax.Array) -> jax.Array:
    x, kernel = sh.tie(x.astype(self.dtype), self.kernel[...])  # gather the kernel here, not hoisted
    y = quant.matmul(x, kernel, self.dtype)  # an int8 sampler's QArray kernel: dequantized inside the matmul
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    if not self.frozen:
      y = tap(self.name, TapInfo("linear", self.name, self.bias is not None), x, y)
    if self.lora_a is not None:  # B = 0 at init: the same y as the base model
      y = y + self.lora_b(self.lora_a(x)) * jnp.asarray(self.lora_scale, self.dtype)
    return y


def _lora_pair(din: int, dout: int, rank: int, name: str, dtype, rngs: nnx.Rngs):
  """(A [Din, r], B [r, Dout] = 0) of a LoRA pair; A from the "lora" RNG stream, so the base weights are the
  same bits with LoRA on or off. A ~ U(-1/sqrt(Din), 1/sqrt(Din)), PEFT's kaiming_uniform(a=sqrt(5))."""
  bound = 1.0 / din**0.5
  a = jax.random.uniform(rngs.lora(), (din, rank), jnp.float32, -bound, bound)
  b = jnp.zeros((rank, dout), jnp.float32)
  return LoRAFactor(a, name=f"{name}.lora_a", dtype=dtype), LoRAFactor(b, name=f"{name}.lora_b", dtype=dtype)


class LoRAFactor(nnx.Module):
  """One factor of a LoRA pair: y = x @ kernel, kernel an nnx.LoRAParam (float32), tapped as "linear".

  Written here rather than taken from nnx.LoRA / qwix because the ghost norms need both factors tapped
  (input and output of each matmul: x -> u = x A for A, u -> u B for B).
  """

  def __init__(self, kernel: jax.Array, *, name: str, dtype):
    self.kernel = nnx.LoRAParam(kernel)
    self.name, self.dtype = name, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x, kernel = sh.tie(x.astype(self.dtype), self.kernel[...])
    y = quant.dot(x, kernel.astype(self.dtype))
    return tap(self.name, TapInfo("linear", self.name), x, y)


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` is the tied LM head h @ E^T."""

  def __init__(self, vocab: int, dim: int, *, name: str, dtype, rngs: nnx.Rngs, frozen: bool = False):
    pdt = dtype if frozen else jnp.float32
    self.embedding = nnx.Param(_INIT(rngs.params(), (vocab, dim), jnp.float32).astype(pdt))
    self.name, self.dtype, self.frozen = name, dtype, frozen

  def __call__(self, tokens_bt: jax.Array) -> jax.Array:
    y = jnp.take(self.embedding[...], tokens_bt, axis=0).astype(self.dtype)
    return y if self.frozen else tap(self.name, TapInfo("embed", self.name), tokens_bt, y)

  def attend(self, h_btd: jax.Array) -> jax.Array:
    # Ghost norms see the tied head only through the log-prob head (Transformer.head_logprobs).
    forbid(self.name, "the tied LM head is tapped only via Transformer.head_logprobs (sequence_logprobs).")
    h_btd = h_btd.astype(self.dtype)
    return quant.dot(h_btd, self.embedding[...].astype(self.dtype), w_out_first=True)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, normalised in float32 (as transformers does)."""

  def __init__(self, dim: int, eps: float, *, name: str, dtype, frozen: bool = False):
    self.scale = nnx.Param(jnp.ones((dim,), dtype if frozen else jnp.float32))
    self.eps, self.name, self.dtype, self.frozen = eps, name, dtype, frozen

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    xhat = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    xhat = xhat.astype(self.dtype)
    y = xhat * self.scale[...].astype(self.dtype)
    return y if self.frozen else tap(self.name, TapInfo("scale", self.name), xhat, y)


def _lora_kw(cfg: ModelConfig, proj: str) -> dict:
  """Linear's LoRA arguments for projection `proj` ("q_proj", ...): frozen base, adapters if targeted."""
  if not cfg.lora:
    return {}
  rank = cfg.lora_rank if proj in cfg.lora_targets else 0
  return dict(frozen=True, lora_rank=rank, lora_scale=cfg.lora_scale)


def _rotation(h: int, theta: float, scaling: rope_lib.RopeScaling, positions_bt: jax.Array):
  inv, m = rope_lib.inv_freq(h, theta, scaling, positions_bt)
  return rope_lib.tables(positions_bt, inv, m)


def rotation(cfg: ModelConfig, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The RoPE (cos, sin) [B, T, 1, H] of a forward's positions under cfg's theta and scaling (`rope_lib.tables`).

  A cached forward (the sampler's) computes it once for all layers, outside the layer scan; a forward without
  a cache (the learner) leaves it to each layer, as before (its programs unchanged)."""
  return _rotation(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, positions_bt)


def rotation_table(cfg: ModelConfig, num_positions: int) -> tuple[jax.Array, jax.Array] | None:
  """(cos, sin) [P, 1, H] of positions 0 .. P - 1, for `rotation_at`; None for rope_type "dynamic" (its
  frequencies depend on the call's largest position).

  The sampler's decode loop makes it once per call: inside the loop XLA:CPU fuses a step's sin and cos into
  every layer's q and k fusion, evaluated once per head, where a table is only read."""
  if cfg.rope_scaling.rope_type == "dynamic":
    return None
  cos, sin = rotation(cfg, jnp.arange(num_positions, dtype=jnp.int32)[None])
  return cos[0], sin[0]


def rotation_at(table: tuple[jax.Array, jax.Array], positions_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`rotation` of positions_bt [B, T] read from `rotation_table` (equal to it: the same float32 ops)."""
  return tuple(jnp.take(t, positions_bt, axis=0) for t in table)


def rope(x_btnh: jax.Array, positions_bt: jax.Array, theta: float) -> jax.Array:
  """Default rotary embedding, rotate-half convention (Hugging Face Llama/Qwen2); see `rope_lib`."""
  inv, _ = rope_lib.inv_freq(x_btnh.shape[-1], theta, rope_lib.RopeScaling(), positions_bt)
  return rope_lib.apply(x_btnh, positions_bt, inv)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, name: str, rngs: nnx.Rngs):
    d, h, dt = cfg.hidden_size, cfg.head_dim, cfg.compute_dtype

    def proj(din, dout, which, bias):
      return Linear(din, dout, name=f"{name}.{which}", use_bias=bias, dtype=dt, rngs=rngs, **_lora_kw(cfg, which))

    self.q_proj = proj(d, cfg.num_heads * h, "q_proj", cfg.qkv_bias)
    self.k_proj = proj(d, cfg.num_kv_heads * h, "k_proj", cfg.qkv_bias)
    self.v_proj = proj(d, cfg.num_kv_heads * h, "v_proj", cfg.qkv_bias)
    self.o_proj = proj(cfg.num_heads * h, d, "o_proj", False)
    self.q_norm = RMSNorm(h, cfg.rms_eps, name=f"{name}.q_norm", dtype=dt, frozen=cfg.lora) if cfg.qk_norm else None
    self.k_norm = RMSNorm(h, cfg.rms_eps, name=f"{name}.k_norm", dtype=dt, frozen=cfg.lora) if cfg.qk_norm else None
    self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, h
    self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
    self.implementation, self.chunk = cfg.attention, cfg.attention_chunk

  def __call__(self, x_btd, positions_bt, mask, cache: LayerCache | None, cache_index, layer=None, rot=None):
    """rot: the forward's RoPE (cos, sin) (`rotation`), or None: computed here from positions_bt.

    cache: None, or the stacked cache of every layer (k [L, B, K, H, S], v [L, B, K, S, H]) of which this
    block is layer `layer` (an int32 scalar: the scan's index); the keys go in at (layer, cache_index) in
    place and the stacked cache is returned (see `_run_layers`). layer None: cache is this layer's own
    (k [B, K, H, S], v [B, K, S, H]) (a per-layer cache, `_run_layers_unrolled`), updated and returned."""
    b, t, _ = x_btd.shape
    n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
    q = self.q_proj(x_btd).reshape(b, t, n, h)
    kk = self.k_proj(x_btd).reshape(b, t, k, h)
    if self.q_norm is not None:  # Qwen3: per-head RMSNorm over H before RoPE
      q, kk = self.q_norm(q), self.k_norm(kk)
    if rot is None:
      rot = _rotation(h, self.rope_theta, self.rope_scaling, positions_bt)
    q, kk = rope_lib.rotate(q, *rot), rope_lib.rotate(kk, *rot)
    vv = self.v_proj(x_btd).reshape(b, t, k, h)
    q, kk, vv = (sh.constrain(a, sh.HEADS_BTNH) for a in (q, kk, vv))
    kw = {"implementation": self.implementation, "chunk": self.chunk}
    if cache is None:
      out = attn.attention(q, kk, vv, mask, **kw)
    else:
      ck_all, cv_all = cache  # keys [L, B, K, H, S], values [L, B, K, S, H] (the cache layout, attention.py)
      kk, vv = kk.astype(ck_all.dtype), vv.astype(cv_all.dtype)
      k_new, v_new = jnp.transpose(kk, (0, 2, 3, 1)), jnp.transpose(vv, (0, 2, 1, 3))
      if layer is None:  # this layer's own buffers (k [B, K, H, S], v [B, K, S, H]: a per-layer cache)
        ck = jax.lax.dynamic_update_slice(ck_all, k_new, (0, 0, 0, cache_index))
        cv = jax.lax.dynamic_update_slice(cv_all, v_new, (0, 0, cache_index, 0))
        ck, cv = cache = (sh.constrain(ck, sh.CACHE_BK), sh.constrain(cv, sh.CACHE_BK))
      else:
        ck_all = jax.lax.dynamic_update_slice(ck_all, k_new[None], (layer, 0, 0, 0, cache_index))
        cv_all = jax.lax.dynamic_update_slice(cv_all, v_new[None], (layer, 0, 0, cache_index, 0))
        cache = (sh.constrain(ck_all, sh.CACHE_LBK), sh.constrain(cv_all, sh.CACHE_LBK))
        ck, cv = (sh.constrain(jax.lax.dynamic_index_in_dim(c, layer, 0, False), sh.CACHE_BK) for c in cache)
      first = isinstance(cache_index, int) and cache_index == 0  # static slot 0: this call's keys are the prefix
      if not isinstance(mask, attn.AttentionMask):  # an explicit [B, T, S] mask over the whole cache
        if first and t == ck.shape[3]:  # the whole cache written now (recompute_kv)
          out = attn.attention(q, kk, vv, mask, **kw)
        else:
          out = attn.cached_attention(q, ck, cv, jnp.asarray(mask, bool))
      elif first:  # prefill (its first chunk): the fresh keys, with the configured implementation
        out = attn.attention(q, kk, vv, attn.AttentionMask(mask.kv_valid[:, :t]), **kw)
      else:  # decode, a later prefill chunk: blockwise over the filled blocks of the cache
        out = attn.decode_attention(q, ck, cv, mask, cache_index, block=self.chunk)
    return self.o_proj(out.reshape(b, t, n * h)), cache


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, name: str, rngs: nnx.Rngs):
    d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.compute_dtype
    self.gate_proj = Linear(
      d, f, name=f"{name}.gate_proj", use_bias=False, dtype=dt, rngs=rngs, **_lora_kw(cfg, "gate_proj")
    )
    self.up_proj = Linear(d, f, name=f"{name}.up_proj", use_bias=False, dtype=dt, rngs=rngs, **_lora_kw(cfg, "up_proj"))
    self.down_proj = Linear(
      f, d, name=f"{name}.down_proj", use_bias=False, dtype=dt, rngs=rngs, **_lora_kw(cfg, "down_proj")
    )

  def __call__(self, x):
    hidden = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
    return self.down_proj(sh.constrain(hidden, sh.HIDDEN_BTF))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, name: str, rngs: nnx.Rngs):
    dt = cfg.compute_dtype
    self.name = name
    self.input_layernorm = RMSNorm(
      cfg.hidden_size, cfg.rms_eps, name=f"{name}.input_layernorm", dtype=dt, frozen=cfg.lora
    )
    self.self_attn = Attention(cfg, name=f"{name}.self_attn", rngs=rngs)
    self.post_attention_layernorm = RMSNorm(
      cfg.hidden_size, cfg.rms_eps, name=f"{name}.post_attention_layernorm", dtype=dt, frozen=cfg.lora
    )
    spec = cfg.moe
    if spec is None:
      self.mlp = MLP(cfg, name=f"{name}.mlp", rngs=rngs)
    else:
      self.mlp = moe.MoEBlock(cfg.hidden_size, spec, name=f"{name}.mlp", dtype=dt, rngs=rngs, matmul=cfg.moe_matmul)
    self.sparse = spec is not None

  def __call__(self, x, positions_bt, mask, cache, cache_index, layer=None, recorded=None, replay=None, rot=None):
    """(x, cache, routing): routing is None for a dense block, else (expert_ids [B, T, K], router_logits
    [B, T, E]) of its MoE block, which replays `recorded` [B, T, K] where `replay` [B, T] (moe.MoEBlock).
    cache, layer: the stacked cache and this block's layer in it; rot: the forward's RoPE (Attention)."""
    a, cache = self.self_attn(self.input_layernorm(x), positions_bt, mask, cache, cache_index, layer, rot)
    x = sh.constrain(x + a, sh.RESIDUAL_BTD)
    h = self.post_attention_layernorm(x)
    if self.sparse:
      out = self.mlp(h, recorded, replay)
      y, routed = out.y, (out.expert_ids, out.router_logits)
    else:
      y, routed = self.mlp(h), None
    x = x + y
    return sh.constrain(x, sh.RESIDUAL_BTD), cache, routed


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
  """The decoder's cfg.num_layers blocks as ONE Block whose parameters carry a leading layer axis [L, ...].

  One block's initializer runs in a lax.map over per-layer keys of each RNG stream (MaxText's scan_layers,
  levanter's Stacked): the program draws one layer's tensors, whatever the depth. (A vmap over the keys
  gives a program of the same size, but XLA:CPU's compile time then grows with the batched tensors.)"""
  n = cfg.num_layers
  keys = {name: jax.random.split(getattr(rngs, name)(), n) for name in ("params", "lora")}
  make = lambda r: Block(cfg, name="layers", rngs=r)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  state = jax.lax.map(lambda k: nnx.state(make(nnx.Rngs(**k))), keys)
  return nnx.merge(graphdef, state)


def _loop(step, carry, xs, scan: bool):
  """jax.lax.scan(step, carry, xs), or the same steps unrolled in Python (scan=False, for debugging)."""
  if scan:
    return jax.lax.scan(step, carry, xs)
  n = jax.tree.leaves(xs)[0].shape[0]
  ys = []
  for i in range(n):
    carry, y = step(carry, jax.tree.map(lambda a, i=i: a[i], xs))
    ys.append(y)
  return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def _run_layers(layers: Block, cfg: ModelConfig, x, positions_bt, mask, cache, cache_index, rot=None):
  """x through the stacked blocks (one scan over the layer axis); (x, new stacked cache or None).
  rot: the forward's RoPE (cos, sin) shared by the layers (`rotation`), or None: each layer computes it.

  Remat: without a cache, each block runs under jax.checkpoint(cfg.remat_policy) inside the scan body.

  Taps: a tape records inputs into a Python object at trace time; inside the scan body (and a
  checkpoint) those would be the body's own tracers and leak. So the body runs its own recording (with
  this layer's slice of the stacked zero perturbations passed in, so the vjp with respect to them still
  flows through) and returns the tapped inputs as scan outputs, stacked [L, ...]; they are written to the
  outer tape here with TapInfo.layers = L (`vcpo_jax.grad_norms` maps its per-layer norms over that
  axis). A tap inside the blocks is named like its parameter, "layers.mlp.up_proj", and its
  perturbation is [L, B, T, Dout]. With a norm sink (`taps.Sink`, the two-pass ghost step) the sink's s
  goes in as an argument too and the blocks' "linear" / "scale" taps return no inputs: their norms are
  formed inside the body's backward pass, one layer at a time.
  """
  graphdef, state = nnx.split(layers)
  tape = taps.active_tape()  # the recording context, if any (read at trace time, like taps.tap)
  perts = None
  if tape is not None and tape.perturbations is not None:
    perts = {k: v for k, v in tape.perturbations.items() if k.startswith(layers.name + ".")}
  sink_s = None if tape is None or tape.sink is None else tape.sink.s
  meta = {}
  # MoE routing hook (moe.routing): the recorded experts go in per layer, each layer's routing comes out.
  routing = moe.active_routing() if cfg.moe is not None else None
  recorded = None if routing is None else routing.recorded
  replay = None if routing is None else routing.replay

  def run(state, x, perts, sink_s, cache, layer, rec):
    block = nnx.merge(graphdef, state)
    if tape is None:
      y, c, routed = block(x, positions_bt, mask, cache, cache_index, layer, rec, replay, rot)
      return y, c, routed, []
    sink = None if sink_s is None else taps.Sink(sink_s, tape.sink.norm)
    with taps.recording(perts, sink) as inner:
      y, c, routed = block(x, positions_bt, mask, cache, cache_index, layer, rec, replay, rot)
    # Each distinct input once (q / k / v share theirs, as do gate / up): one stacked output per array.
    uniq = {id(a): a for a in inner.inputs.values()}
    slot = {name: list(uniq).index(id(a)) for name, a in inner.inputs.items()}
    meta.update(info=dict(inner.info), out_shapes=dict(inner.out_shapes), slot=slot)  # static metadata only
    return y, c, routed, list(uniq.values())

  policy = cfg.remat_policy
  if cache is None and policy is not None:
    run = jax.checkpoint(run, policy=policy)

  # The stacked cache rides in the carry, each layer writing its new keys into it in place. As a scanned input
  # and output (one layer's slice per step) XLA:CPU copied every layer's slice in, then out, then the whole
  # cache once more per call: ~5 cache-sized copies per decode step, more memory traffic than the weights.
  def step(carry, xs):
    x, cache = carry
    state_l, perts_l, layer, rec_l = xs
    y, cache, routed, inputs = run(state_l, x, perts_l, sink_s, cache, layer, rec_l)
    return (y, cache), (routed, inputs)

  layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
  xs = (state, perts, layer_ids, recorded)
  (x, new_cache), (routed, inputs) = _loop(step, (x, cache), xs, cfg.scan_layers)
  if routing is not None:
    routing.expert_ids, routing.router_logits = routed  # [L, B, T, K], [L, B, T, E]
  if tape is not None:
    n = cfg.num_layers
    # The tapped inputs first (sorted names, as the unrolled step recorded them), then the sunk taps.
    slot = meta["slot"]
    for name in sorted(slot) + [k for k in meta["info"] if k not in slot]:
      if name in tape.info:
        raise ValueError(f"Tap {name!r} fired twice in one recording; layer names must be unique.")
      if name in slot:
        tape.inputs[name] = inputs[slot[name]]
      tape.info[name] = dataclasses.replace(meta["info"][name], layers=n)
      shape = meta["out_shapes"][name]
      tape.out_shapes[name] = jax.ShapeDtypeStruct((n, *shape.shape), shape.dtype)
  return x, new_cache


def _run_layers_unrolled(
  layers: Block,
  cfg: ModelConfig,
  x,
  positions_bt,
  mask,
  caches: PerLayerCache,
  cache_index,
  layer_params=None,
  rot=None,
):
  """x through the blocks one layer at a time in Python, each with its own cache buffers; (x, new caches).

  The sampler's unrolled decode step (SamplerConfig.decode_layers="unrolled"). XLA:CPU hands a matmul only a
  whole buffer: in the scan (`_run_layers`) every layer's slice of the stacked cache, and of the stacked
  weights, is copied out before its dot (dynamic-slice; a static slice of the stacked cache is copied too).
  Separate per-layer cache buffers are read and written in place (Attention with layer None).
  layer_params: each layer's block parameters (`layer_params`), sliced once outside the sampler's while_loop
  (XLA does not hoist the slices out of it: sliced inside the step, they are copied every step); None slices
  them here. The program grows with depth (no scan): a decode-only path, without taps, remat or MoE routing."""
  if taps.active_tape() is not None or cfg.moe is not None:
    raise ValueError("per-layer caches (the sampler's unrolled decode) take a dense model and no taps.")
  if len(caches) != cfg.num_layers:
    raise ValueError(f"per-layer cache of {len(caches)} layers for a model of {cfg.num_layers}.")
  graphdef, state = nnx.split(layers)
  if layer_params is None:
    layer_params = [jax.tree.map(lambda a, i=i: a[i], state) for i in range(cfg.num_layers)]
  new = []
  for (ck, cv), p in zip(caches, layer_params, strict=True):
    block = nnx.merge(graphdef, p)
    x, layer_cache, _ = block(x, positions_bt, mask, (ck, cv), cache_index, None, rot=rot)
    new.append(layer_cache)
  return x, new


def layer_params(graphdef, params) -> list:
  """Each decoder layer's block parameters (static slices of the stacked [L, ...] ones: copies), for
  `forward(..., layers=...)` with a per-layer cache."""
  _, state = nnx.split(nnx.merge(graphdef, params).layers)
  return [jax.tree.map(lambda a, i=i: a[i], state) for i in range(jax.tree.leaves(state)[0].shape[0])]


def split_cache(cache: LayerCache) -> PerLayerCache:
  """The stacked cache (k [L, B, K, H, S], v [L, B, K, S, H]) as one buffer pair per layer (copies)."""
  return [(cache[0][i], cache[1][i]) for i in range(cache[0].shape[0])]


class Transformer(nnx.Module):
  """The policy: tokens -> next-token logits (float32)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dt = cfg.compute_dtype
    self.cfg = cfg
    self.embed_tokens = Embed(
      cfg.vocab_size, cfg.hidden_size, name="embed_tokens", dtype=dt, rngs=rngs, frozen=cfg.lora
    )
    self.layers = _stacked_blocks(cfg, rngs)  # parameters [L, ...]
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, name="norm", dtype=dt, frozen=cfg.lora)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else Linear(cfg.hidden_size, cfg.vocab_size, name="lm_head", use_bias=False, dtype=dt, rngs=rngs, frozen=cfg.lora)
    )

  def __call__(
    self,
    tokens_bt,
    positions_bt,
    mask,
    cache: LayerCache | None = None,
    cache_index=None,
    *,
    hidden=False,
    layers=None,
    rot=None,
  ):
    """Returns (logits [B, T, V] float32, new cache or None); with hidden=True the final normed
    hidden states [B, T, D] instead of the logits (for `head_logprobs`).

    Args:
      tokens_bt: int32 [B, T].
      positions_bt: int32 [B, T] RoPE positions (count of real tokens before each one).
      mask: an `attention.AttentionMask` (kv_valid [B, S]: causal attention over the valid
        keys, see `vcpo_jax.model.attention`), or an explicit bool [B, T, S] mask (run
        densely). S = T without a cache, the cache length with one (keys written at
        cache_index..cache_index+T-1).
      cache: the stacked cache (k [L, B, K, H, S], v [L, B, K, S, H]) (`init_cache`) or None; or a list of
        per-layer (k [B, K, H, S], v [B, K, S, H]) (`split_cache`): the layers then run unrolled
        (`_run_layers_unrolled`, the sampler's decode_layers="unrolled").
      layers: with a per-layer cache, each layer's block parameters (`layer_params`), or None (sliced here).
      rot: the RoPE (cos, sin) of positions_bt (`rotation_at`), or None: with a cache computed once here
        (`rotation`), without one by each layer.
      cache_index: where this call's keys go in the cache: a Python int (static: at 0 the call
        attends to its own keys with the configured implementation; later, a prefill chunk, to the
        filled blocks of the cache), or an int32 scalar (traced: the decode path, blockwise over
        the filled blocks).
    """
    x = sh.constrain(self.embed_tokens(tokens_bt), sh.RESIDUAL_BTD)
    if rot is None and cache is not None:
      rot = rotation(self.cfg, positions_bt)  # once for every layer
    if isinstance(cache, list):
      x, new_cache = _run_layers_unrolled(
        self.layers, self.cfg, x, positions_bt, mask, cache, cache_index, layers, rot=rot
      )
    else:
      x, new_cache = _run_layers(self.layers, self.cfg, x, positions_bt, mask, cache, cache_index, rot)
    x = self.norm(x)
    if hidden:
      return x, new_cache
    logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32), new_cache

  def head_logprobs(self, h_btd: jax.Array, tokens_bt: jax.Array, support_thr=None) -> jax.Array:
    """logp [B, T] of tokens from the final hidden states: the LM head + float32 log-softmax in
    chunks of `cfg.logprob_chunk` positions (and `cfg.logprob_vocab_chunk` vocab entries), never
    [B, T, V] when chunked (vcpo_jax.model.logprobs). Tapped as kind "head" for ghost norms.
    support_thr: None, or the sampler's support record [B, R] (Batch.support_thr): the softmax is renormalised
    over each response token's recorded support (model/support.py)."""
    tied = self.lm_head is None
    w = self.embed_tokens.embedding[...] if tied else self.lm_head.kernel[...]
    param = self.embed_tokens.name if tied else self.lm_head.name
    spec = logprobs.HeadSpec(tied, self.cfg.logprob_chunk, self.cfg.logprob_vocab_chunk, self.cfg.compute_dtype)
    thr = None if support_thr is None else support.position_thresholds(support_thr, tokens_bt.shape[1])
    fn = lambda h, w, tok, lse: logprobs.head_logprobs(h, w, tok, spec, return_lse=lse, support_thr=thr)
    if self.cfg.lora:  # a frozen head: not tapped, its dL/dh comes from plain autodiff
      return fn(h_btd, w, tokens_bt, False)
    return tap_head(param + "@head", TapInfo("head", param, spec=spec), h_btd, tokens_bt, w, fn)


# ----------------------------------------------------------------------------- functional API


def init(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """The model with weights from `seed`; LoRA A factors draw from a stream of their own (B = 0), so the base
  weights are the same bits with LoRA on or off."""
  return Transformer(cfg, rngs=nnx.Rngs(params=seed, lora=jax.random.fold_in(jax.random.key(seed), 0x10A)))


def split(model: Transformer) -> tuple[Any, nnx.State]:
  """(graphdef, params): the static structure and the float32 parameter pytree."""
  return nnx.split(model, nnx.Param)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> LayerCache:
  """The zero KV cache of every layer, stacked: (k [L, B, K, H, S], v [L, B, K, S, H])."""
  dtype = dtype or cfg.compute_dtype
  n, k, h = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  return jnp.zeros((n, batch, k, h, length), dtype), jnp.zeros((n, batch, k, length, h), dtype)


def forward(graphdef, params, tokens_bt, positions_bt, mask, cache=None, cache_index=None, layers=None, rot=None):
  """Pure forward pass: see Transformer.__call__."""
  model = nnx.merge(graphdef, params)
  return model(tokens_bt, positions_bt, mask, cache, cache_index, layers=layers, rot=rot)


def padded_positions_and_mask(valid_bt: jax.Array) -> tuple[jax.Array, attn.AttentionMask]:
  """RoPE positions and the causal attention mask for (possibly left- or right-) padded rows.

  Positions count real tokens before each token, so a left-padded prompt gets the
  same positions as the unpadded one. Padding keys are never attended to; padding
  queries attend to themselves only (their outputs are ignored, this keeps the
  softmax finite). The mask is the per-key validity (`attention.AttentionMask`),
  O(B T); `mask.dense(T)` is the equivalent [B, T, T] bool array.
  """
  valid_bt = valid_bt.astype(bool)
  positions = jnp.maximum(jnp.cumsum(valid_bt, axis=1) - 1, 0).astype(jnp.int32)
  return positions, attn.AttentionMask(valid_bt)


def token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array) -> jax.Array:
  """logp [B, T] aligned with tokens: logp[:, t] = log p(tokens[t] | tokens[<t]); logp[:, 0] = 0.

  The dense reference (holds [B, T, V]); `sequence_logprobs` uses the chunked head instead."""
  logp = jax.nn.log_softmax(logits_btv[:, :-1].astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked, ((0, 0), (1, 0)))


def sequence_logprobs(graphdef, params, tokens_bt, valid_bt, support_thr=None, expert_ids=None):
  """Per-token log-probs [B, T] of full sequences (prompt + response) under the policy.

  Equals token_logprobs(forward(...)[0], tokens_bt) (to float32 rounding when chunked), without
  the [B, T, V] logits: see Transformer.head_logprobs (support_thr [B, R]: support replay).

  expert_ids: an MoE model's routing record on the token columns [B, T, L K] int (the Batch's response-column
  record placed by batch.at_token_columns, `replay_routing`), replayed when cfg.routing_replay; ignored
  otherwise."""
  positions, mask = padded_positions_and_mask(valid_bt)
  model = nnx.merge(graphdef, params)
  with replay_routing(model.cfg, expert_ids):
    h, _ = model(tokens_bt, positions, mask, hidden=True)
  return model.head_logprobs(h, tokens_bt, support_thr)


def replay_routing(cfg: ModelConfig, expert_ids, force: bool | None = None):
  """The `moe.routing` context replaying a routing record, or a null context (dense, off, no record).

  expert_ids: [B, T, L K] int on the token columns (batch.at_token_columns of Batch.expert_ids [B, R, L K]),
  column t: the experts token t went through in each MoE layer as the sampler ran it (layer-major, K per
  layer), -1 where nothing was recorded (prompt columns, the last response token): those tokens take their own
  top-K. force: replay (True) or not (False) whatever cfg.routing_replay says.
  """
  on = cfg.routing_replay if force is None else force
  if cfg.moe is None or expert_ids is None or not on:
    return contextlib.nullcontext()
  b, t, _ = expert_ids.shape
  rec = jnp.moveaxis(expert_ids.reshape(b, t, cfg.num_layers, cfg.num_experts_per_tok), 2, 0)  # [L, B, T, K]
  return moe.routing(rec.astype(jnp.int32), rec[0, :, :, 0] >= 0)
