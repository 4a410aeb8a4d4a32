"""Decoder-only transformer policy in Flax NNX (Qwen2/Qwen2.5 and Llama families).

Shape legend: B batch, T query tokens, S key tokens (T without a cache, the cache
length with one), D model width, F MLP width, N query heads, K key/value heads,
R = N // K query heads per kv head, H head width, V vocab.

Module and parameter names mirror the Hugging Face checkpoints
(`layers.3.self_attn.q_proj.kernel` <-> `model.layers.3.self_attn.q_proj.weight`),
with kernels stored [in, out] (the transpose of torch's [out, in]).

The functional entry points (`forward`, `token_logprobs`, `sequence_logprobs`)
take (graphdef, params) so that they can be jitted, vmapped and sharded like
any pure JAX function; see `split`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from vcpo_jax.model import logprobs
from vcpo_jax.model.config import ModelConfig
from vcpo_jax.model.taps import TapInfo, forbid, tap, tap_head

_INIT = nnx.initializers.normal(stddev=0.02)

# One layer's KV cache: (k [B, S, K, H], v [B, S, K, H]) in the compute dtype.
LayerCache = tuple[jax.Array, jax.Array]


class Linear(nnx.Module):
  """y = x @ kernel (+ bias), kernel [Din, Dout] in float32, computed in `dtype`."""

  def __init__(self, din: int, dout: int, *, name: str, use_bias: bool, dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(_INIT(rngs.params(), (din, dout), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((dout,), jnp.float32)) if use_bias else None
    self.name, self.dtype = name, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    y = jnp.einsum("...i,io->...o", x, self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return tap(self.name, TapInfo("linear", self.name, self.bias is not None), x, y)


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` is the tied LM head h @ E^T."""

  def __init__(self, vocab: int, dim: int, *, name: str, dtype, rngs: nnx.Rngs):
    self.embedding = nnx.Param(_INIT(rngs.params(), (vocab, dim), jnp.float32))
    self.name, self.dtype = name, dtype

  def __call__(self, tokens_bt: jax.Array) -> jax.Array:
    y = jnp.take(self.embedding[...], tokens_bt, axis=0).astype(self.dtype)
    return tap(self.name, TapInfo("embed", self.name), tokens_bt, y)

  def attend(self, h_btd: jax.Array) -> jax.Array:
    # Ghost norms see the tied head only through the log-prob head (Transformer.head_logprobs).
    forbid(self.name, "the tied LM head is tapped only via Transformer.head_logprobs (sequence_logprobs).")
    h_btd = h_btd.astype(self.dtype)
    return jnp.einsum("btd,vd->btv", h_btd, self.embedding[...].astype(self.dtype))


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, normalised in float32 (as transformers does)."""

  def __init__(self, dim: int, eps: float, *, name: str, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps, self.name, self.dtype = eps, name, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    xhat = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    xhat = xhat.astype(self.dtype)
    y = xhat * self.scale[...].astype(self.dtype)
    return tap(self.name, TapInfo("scale", self.name), xhat, y)


def rope(x_btnh: jax.Array, positions_bt: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, rotate-half convention (Hugging Face Llama/Qwen2)."""
  h = x_btnh.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
  angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x32 = x_btnh.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x_btnh.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, name: str, rngs: nnx.Rngs):
    d, h, dt = cfg.hidden_size, cfg.head_dim, cfg.compute_dtype
    self.q_proj = Linear(d, cfg.num_heads * h, name=f"{name}.q_proj", use_bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
    self.k_proj = Linear(d, cfg.num_kv_heads * h, name=f"{name}.k_proj", use_bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
    self.v_proj = Linear(d, cfg.num_kv_heads * h, name=f"{name}.v_proj", use_bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
    self.o_proj = Linear(cfg.num_heads * h, d, name=f"{name}.o_proj", use_bias=False, dtype=dt, rngs=rngs)
    self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, h
    self.rope_theta = cfg.rope_theta

  def __call__(self, x_btd, positions_bt, mask_bts, cache: LayerCache | None, cache_index):
    b, t, _ = x_btd.shape
    n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
    q = rope(self.q_proj(x_btd).reshape(b, t, n, h), positions_bt, self.rope_theta)
    kk = rope(self.k_proj(x_btd).reshape(b, t, k, h), positions_bt, self.rope_theta)
    vv = self.v_proj(x_btd).reshape(b, t, k, h)
    if cache is not None:
      ck, cv = cache
      kk = jax.lax.dynamic_update_slice(ck, kk.astype(ck.dtype), (0, cache_index, 0, 0))
      vv = jax.lax.dynamic_update_slice(cv, vv.astype(cv.dtype), (0, cache_index, 0, 0))
      cache = (kk, vv)
    q = q.reshape(b, t, k, n // k, h)  # [B, T, K, R, H]: grouped-query heads share a kv head
    scores = jnp.einsum("btkrh,bskh->bkrts", q, kk.astype(q.dtype)).astype(jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(h))
    scores = jnp.where(mask_bts[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(vv.dtype)
    out = jnp.einsum("bkrts,bskh->btkrh", probs, vv).reshape(b, t, n * h)
    return self.o_proj(out), cache


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, name: str, rngs: nnx.Rngs):
    d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.compute_dtype
    self.gate_proj = Linear(d, f, name=f"{name}.gate_proj", use_bias=False, dtype=dt, rngs=rngs)
    self.up_proj = Linear(d, f, name=f"{name}.up_proj", use_bias=False, dtype=dt, rngs=rngs)
    self.down_proj = Linear(f, d, name=f"{name}.down_proj", use_bias=False, dtype=dt, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, name: str, rngs: nnx.Rngs):
    dt = cfg.compute_dtype
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, name=f"{name}.input_layernorm", dtype=dt)
    self.self_attn = Attention(cfg, name=f"{name}.self_attn", rngs=rngs)
    self.post_attention_layernorm = RMSNorm(
      cfg.hidden_size, cfg.rms_eps, name=f"{name}.post_attention_layernorm", dtype=dt
    )
    self.mlp = MLP(cfg, name=f"{name}.mlp", rngs=rngs)

  def __call__(self, x, positions_bt, mask_bts, cache, cache_index):
    a, cache = self.self_attn(self.input_layernorm(x), positions_bt, mask_bts, cache, cache_index)
    x = x + a
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, cache


class Transformer(nnx.Module):
  """The policy: tokens -> next-token logits (float32)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dt = cfg.compute_dtype
    self.cfg = cfg
    self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, name="embed_tokens", dtype=dt, rngs=rngs)
    self.layers = nnx.List([Block(cfg, name=f"layers.{i}", rngs=rngs) for i in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, name="norm", dtype=dt)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else Linear(cfg.hidden_size, cfg.vocab_size, name="lm_head", use_bias=False, dtype=dt, rngs=rngs)
    )

  def __call__(
    self, tokens_bt, positions_bt, mask_bts, cache: list[LayerCache] | None = None, cache_index=None, *, hidden=False
  ):
    """Returns (logits [B, T, V] float32, new cache or None); with hidden=True the final normed
    hidden states [B, T, D] instead of the logits (for `head_logprobs`).

    Args:
      tokens_bt: int32 [B, T].
      positions_bt: int32 [B, T] RoPE positions (count of real tokens before each one).
      mask_bts: bool [B, T, S]: query t may attend to key s. S = T without a cache,
        the cache length with one (keys written at cache_index..cache_index+T-1).
      cache: per-layer (k, v) [B, S, K, H] or None.
      cache_index: int32 scalar, where this call's keys go in the cache.
    """
    x = self.embed_tokens(tokens_bt)
    new_cache = [] if cache is not None else None
    for i, layer in enumerate(self.layers):
      x, c = layer(x, positions_bt, mask_bts, None if cache is None else cache[i], cache_index)
      if cache is not None:
        new_cache.append(c)
    x = self.norm(x)
    if hidden:
      return x, new_cache
    logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32), new_cache

  def head_logprobs(self, h_btd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    """logp [B, T] of tokens from the final hidden states: the LM head + float32 log-softmax in
    chunks of `cfg.logprob_chunk` positions (and `cfg.logprob_vocab_chunk` vocab entries), never
    [B, T, V] when chunked (vcpo_jax.model.logprobs). Tapped as kind "head" for ghost norms."""
    tied = self.lm_head is None
    w = self.embed_tokens.embedding[...] if tied else self.lm_head.kernel[...]
    param = self.embed_tokens.name if tied else self.lm_head.name
    spec = logprobs.HeadSpec(tied, self.cfg.logprob_chunk, self.cfg.logprob_vocab_chunk, self.cfg.compute_dtype)
    fn = lambda h, w, tok, lse: logprobs.head_logprobs(h, w, tok, spec, return_lse=lse)
    return tap_head(param + "@head", TapInfo("head", param, spec=spec), h_btd, tokens_bt, w, fn)


# ----------------------------------------------------------------------------- functional API


def init(cfg: ModelConfig, seed: int = 0) -> Transformer:
  return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def split(model: Transformer) -> tuple[Any, nnx.State]:
  """(graphdef, params): the static structure and the float32 parameter pytree."""
  return nnx.split(model, nnx.Param)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> list[LayerCache]:
  dtype = dtype or cfg.compute_dtype
  shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
  return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]


def forward(graphdef, params, tokens_bt, positions_bt, mask_bts, cache=None, cache_index=None):
  """Pure forward pass: see Transformer.__call__."""
  model = nnx.merge(graphdef, params)
  return model(tokens_bt, positions_bt, mask_bts, cache, cache_index)


def padded_positions_and_mask(valid_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """RoPE positions and causal attention mask for (possibly left- or right-) padded rows.

  Positions count real tokens before each token, so a left-padded prompt gets the
  same positions as the unpadded one. Padding keys are never attended to; padding
  queries attend to themselves only (their outputs are ignored, this keeps the
  softmax finite).
  """
  valid_bt = valid_bt.astype(bool)
  positions = jnp.maximum(jnp.cumsum(valid_bt, axis=1) - 1, 0).astype(jnp.int32)
  t = valid_bt.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))
  mask = causal[None] & valid_bt[:, None, :]
  mask = mask | jnp.eye(t, dtype=bool)[None]
  return positions, mask


def token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array) -> jax.Array:
  """logp [B, T] aligned with tokens: logp[:, t] = log p(tokens[t] | tokens[<t]); logp[:, 0] = 0.

  The dense reference (holds [B, T, V]); `sequence_logprobs` uses the chunked head instead."""
  logp = jax.nn.log_softmax(logits_btv[:, :-1].astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked, ((0, 0), (1, 0)))


def sequence_logprobs(graphdef, params, tokens_bt, valid_bt):
  """Per-token log-probs [B, T] of full sequences (prompt + response) under the policy.

  Equals token_logprobs(forward(...)[0], tokens_bt) (to float32 rounding when chunked), without
  the [B, T, V] logits: see Transformer.head_logprobs."""
  positions, mask = padded_positions_and_mask(valid_bt)
  model = nnx.merge(graphdef, params)
  h, _ = model(tokens_bt, positions, mask, hidden=True)
  return model.head_logprobs(h, tokens_bt)
