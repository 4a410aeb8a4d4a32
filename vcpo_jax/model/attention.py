"""Causal attention over padded rows, without a materialized [B, T, S] mask.

Shape legend: B batch, T query tokens, S key tokens, N query heads, K key/value
heads, R = N // K query heads per kv head (grouped-query attention: the K/V
heads are never repeated), H head width.

Which keys a query sees (`AttentionMask`, the one masking rule of the model):
query t sits in cache slot q_offset + t and may attend key s iff

    (s <= q_offset + t  and  kv_valid[b, s])   or   s == q_offset + t.

Left padding (prompts), right padding (responses) and holes are all described by
the per-key validity kv_valid [B, S]; nothing of size T x S is stored. The diagonal
term keeps a padding query's softmax non-empty (its output is ignored).

Implementations (`ModelConfig.attention`), all exact:
  "dense":   einsum scores [B, K, R, T, S] in float32 and a softmax (the reference;
             also the path for an explicit bool [B, T, S] mask).
  "xla":     `jax.nn.dot_product_attention(implementation="xla")`; dense as well.
  "cudnn":   `jax.nn.dot_product_attention(implementation="cudnn")` (GPU flash
             attention): causal flag + an additive key bias [B, 1, 1, S] for the padding
             (a query with no valid key sees only masked keys: finite, ignored).
             Self-attention only (a cache offset or T != S falls back to "chunked").
  "chunked": pure-JAX, any backend: queries in chunks of `chunk` tokens (lax.map), each
             rematerialized in the backward pass, so at most [B, N, chunk, S] float32
             scores exist at a time. Same flops as dense (masked blocks are computed).
  "splash":  the TPU Pallas splash-attention kernel (segment ids: valid = 1, pad = 0,
             causal), imported lazily. Needs TPU, T a multiple of its block (`chunk`), and
             a shard_map over the mesh when sharded (not wired: GSPMD does not partition
             a Pallas call); self-attention only, like "cudnn".

The KV cache (`transformer.init_cache`) keeps one layer's keys as [B, K, H, S] and its
values as [B, K, S, H] (kv-head axis first, keys transposed: why, docs/design_notes.md).
Attention over a cache (`cached_attention`: an explicit mask; `decode_attention`: a
traced or non-zero slot) reads this layout; a call at slot 0 attends to its fresh
keys [B, T, K, H] through `attention`, whatever the implementation. `decode_attention`
runs blockwise with an online softmax over only the filled blocks of the cache once
the cache is longer than one block.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("dense", "xla", "cudnn", "chunked", "splash")
_NEG = float(jnp.finfo(jnp.float32).min)  # the dense reference's masked score


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
  """Causal attention over the valid keys; see the module docstring for the rule.

  Attributes:
    kv_valid: bool [B, S] key s holds a real token (False: padding, or a cache
      slot not yet written).
  """

  kv_valid: jax.Array

  @property
  def num_keys(self) -> int:
    return self.kv_valid.shape[1]

  def dense(self, t: int, q_offset=0) -> jax.Array:
    """The equivalent bool [B, T, S] mask (tests and the "dense" path; O(T S) memory)."""
    s = self.kv_valid.shape[1]
    q_pos = jnp.arange(t)[:, None] + q_offset
    k_pos = jnp.arange(s)[None, :]
    return ((k_pos <= q_pos)[None] & self.kv_valid[:, None, :]) | (k_pos == q_pos)[None]


def _block_allowed(kv_valid_bs, t: int, k_start, q_offset) -> jax.Array:
  """Mask [B, 1, 1, T, Sb] of one key block starting at slot k_start (queries at q_offset + [0, T))."""
  sb = kv_valid_bs.shape[1]
  q_pos = jnp.arange(t)[:, None] + q_offset
  k_pos = jnp.arange(sb)[None, :] + k_start
  allowed = ((k_pos <= q_pos)[None] & kv_valid_bs[:, None, :]) | (k_pos == q_pos)[None]
  return allowed[:, None, None]


def _dense(q_btnh, k_bskh, v_bskh, allowed_b11ts) -> jax.Array:
  """The reference: softmax over all S keys of float32 scores, masked with finfo.min."""
  b, t, n, h = q_btnh.shape
  kh = k_bskh.shape[2]
  q = q_btnh.reshape(b, t, kh, n // kh, h)  # [B, T, K, R, H]: grouped-query heads share a kv head
  scores = jnp.einsum("btkrh,bskh->bkrts", q, k_bskh.astype(q.dtype)).astype(jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(h))
  scores = jnp.where(allowed_b11ts, scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
  return jnp.einsum("bkrts,bskh->btkrh", probs, v_bskh).reshape(b, t, n, h)


def _chunked(q_btnh, k_bskh, v_bskh, kv_valid_bs, q_offset: int, chunk: int) -> jax.Array:
  """Query chunks in a `lax.map` (one chunk's scores live at a time), each rematerialized in the backward pass.

  A scan (not a Python loop) makes the chunks sequential for the compiler too: unrolled
  independent chunks may be scheduled side by side and hold all their scores at once.
  The price is that every chunk reads all S keys (the causally dead blocks are masked,
  not skipped).
  """
  b, t, n, h = q_btnh.shape
  c = min(chunk, t)
  num = -(-t // c)
  q = jnp.pad(q_btnh, ((0, 0), (0, num * c - t), (0, 0), (0, 0)))  # padded queries are cut below
  q = jnp.moveaxis(q.reshape(b, num, c, n, h), 1, 0)  # [num, B, c, N, H]

  @jax.checkpoint  # backward recomputes the chunk's scores instead of saving them
  def one(args):
    q_c, first = args
    return _dense(q_c, k_bskh, v_bskh, _block_allowed(kv_valid_bs, c, 0, first))

  out = jax.lax.map(one, (q, q_offset + c * jnp.arange(num)))  # [num, B, c, N, H]
  return jnp.moveaxis(out, 0, 1).reshape(b, num * c, n, h)[:, :t]


def _cudnn(q_btnh, k_bskh, v_bskh, kv_valid_bs) -> jax.Array:
  bias = jnp.where(kv_valid_bs, 0.0, -1e9).astype(q_btnh.dtype)[:, None, None, :]
  return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, bias=bias, is_causal=True, implementation="cudnn")


def _splash(q_btnh, k_bskh, v_bskh, kv_valid_bs, *, block: int = 512, interpret: bool = False) -> jax.Array:
  """TPU splash attention: per kv head an MQA kernel over its R query heads (no K/V repeat).

  `interpret=True` runs the Pallas kernel in the interpreter (any backend: the tests' CPU check).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  b, t, n, h = q_btnh.shape
  kh = k_bskh.shape[2]
  r = n // kh
  mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(r)])
  blk = min(block, t)
  sizes = sk.BlockSizes(
    block_q=blk,
    block_kv=blk,
    block_kv_compute=blk,
    block_q_dkv=blk,
    block_kv_dkv=blk,
    block_kv_dkv_compute=blk,
    block_q_dq=blk,
    block_kv_dq=blk,
  )
  kernel = sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
  seg = kv_valid_bs.astype(jnp.int32)  # pad tokens form segment 0: they see only each other
  q = (q_btnh / jnp.sqrt(jnp.float32(h)).astype(q_btnh.dtype)).reshape(b, t, kh, r, h)
  q = jnp.transpose(q, (0, 2, 3, 1, 4))  # [B, K, R, T, H]
  k = jnp.transpose(k_bskh, (0, 2, 1, 3))  # [B, K, S, H]
  v = jnp.transpose(v_bskh, (0, 2, 1, 3))

  def per_row(q_krth, k_ksh, v_ksh, seg_t):
    ids = sk.SegmentIds(q=seg_t, kv=seg_t)
    return jax.vmap(lambda qq, kk, vv: kernel(qq, kk, vv, segment_ids=ids))(q_krth, k_ksh, v_ksh)

  out = jax.vmap(per_row)(q, k, v, seg)  # [B, K, R, T, H]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


def attention(q_btnh, k_bskh, v_bskh, mask, *, q_offset: int = 0, implementation: str = "dense", chunk: int = 512):
  """Attention output [B, T, N, H] for queries at cache slots q_offset + [0, T).

  Args:
    q_btnh: queries [B, T, N, H] (RoPE applied), in the compute dtype.
    k_bskh, v_bskh: keys and values [B, S, K, H]; N is a multiple of K.
    mask: an `AttentionMask` (kv_valid [B, S]), or an explicit bool [B, T, S] mask
      (always run densely: callers that build their own masks keep working).
    q_offset: static int, slot of the first query (0 without a cache).
    implementation: one of IMPLEMENTATIONS (see the module docstring).
    chunk: query chunk of "chunked", block size of "splash".
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {implementation!r}: choose one of {IMPLEMENTATIONS}.")
  if not isinstance(mask, AttentionMask):
    return _dense(q_btnh, k_bskh, v_bskh, jnp.asarray(mask, bool)[:, None, None])
  t, kv_valid = q_btnh.shape[1], mask.kv_valid
  if implementation == "dense":
    return _dense(q_btnh, k_bskh, v_bskh, _block_allowed(kv_valid, t, 0, q_offset))
  if implementation in ("cudnn", "splash") and (q_offset or t != mask.num_keys):
    implementation = "chunked"  # the fused kernels take self-attention only (chunked prefill does not)
  if implementation == "chunked":
    return _chunked(q_btnh, k_bskh, v_bskh, kv_valid, q_offset, chunk)
  if implementation == "xla":
    allowed = _block_allowed(kv_valid, t, 0, q_offset)[:, 0]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(
      q_btnh, k_bskh.astype(q_btnh.dtype), v_bskh.astype(q_btnh.dtype), mask=allowed, implementation="xla"
    )
  if implementation == "cudnn":
    return _cudnn(q_btnh, k_bskh, v_bskh, kv_valid)
  return _splash(q_btnh, k_bskh, v_bskh, kv_valid, block=chunk)


def _decode_block(s: int, block: int) -> int:
  """The key block of `decode_attention`: the whole cache when S <= block, else the largest divisor
  of S that is <= block (blocks never overlap); a cache with no divisor >= 16 is one block."""
  if s <= block:
    return s
  d = max(d for d in range(1, block + 1) if s % d == 0)
  return d if d >= 16 else s


def _q_major(q_btnh, kh: int) -> jax.Array:
  """[B, T, N, H] -> [B, K, T R, H]: the batch axes (B, K) lead, so each (b, k) is one [T R, H] x [H, S]
  matmul against the cache (XLA:CPU otherwise puts the cache on the left and runs an [S, H] x [H, R]
  product per (b, k), 1.5x slower per decode step at S = 160)."""
  b, t, n, h = q_btnh.shape
  return jnp.transpose(q_btnh.reshape(b, t, kh, n // kh, h), (0, 2, 1, 3, 4)).reshape(b, kh, t * (n // kh), h)


def _q_major_mask(allowed_bts, r: int) -> jax.Array:
  """bool [B, T, S] -> [B, 1, T R, S], the rows of `_q_major`'s queries."""
  b, t, s = allowed_bts.shape
  return jnp.broadcast_to(allowed_bts[:, None, :, None, :], (b, 1, t, r, s)).reshape(b, 1, t * r, s)


def _from_q_major(out_bkqh, t: int) -> jax.Array:
  """[B, K, T R, H] -> [B, T, N, H]."""
  b, kh, q, h = out_bkqh.shape
  return jnp.transpose(out_bkqh.reshape(b, kh, t, q // t, h), (0, 2, 1, 3, 4)).reshape(b, t, q // t * kh, h)


def cached_attention(q_btnh, k_bkhs, v_bksh, allowed_bts) -> jax.Array:
  """`_dense` over a cache in its layout (keys [B, K, H, S], values [B, K, S, H]; module docstring):
  float32 scores masked with finfo.min where `allowed_bts` (bool [B, T, S]) is False, a softmax,
  and the weighted values [B, T, N, H]."""
  _, t, n, h = q_btnh.shape
  kh = k_bkhs.shape[1]
  q = _q_major(q_btnh, kh)
  scores = jnp.einsum("bkqh,bkhs->bkqs", q, k_bkhs.astype(q.dtype)).astype(jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(h))
  scores = jnp.where(_q_major_mask(allowed_bts, n // kh), scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_bksh.dtype)
  return _from_q_major(jnp.einsum("bkqs,bksh->bkqh", probs, v_bksh), t)


def decode_attention(q_btnh, k_bkhs, v_bksh, mask: AttentionMask, q_offset, *, block: int = 512) -> jax.Array:
  """Attention for T new queries at cache slot q_offset, reading only the filled cache.

  Keys are visited in blocks of `_decode_block(S, block)` slots with an online
  softmax (running max m, normalizer l, weighted sum acc, all float32), up to the
  block holding slot q_offset + T - 1: a decode step at slot i reads
  ceil((i + T) / block) blocks, not S. Equal to the dense softmax up to rounding.
  A cache of one block (S <= block, or no divisor of S >= 16) runs the dense softmax
  (`cached_attention`) over all S slots, with no loop.

  Args:
    q_btnh: [B, T, N, H]; k_bkhs [B, K, H, S], v_bksh [B, K, S, H]: the cache (this step's keys written).
    mask: AttentionMask over the S cache slots.
    q_offset: slot of the first query: an int32 scalar (traced, decode) or a Python int (a prefill chunk).
  """
  b, t, n, h = q_btnh.shape
  kh, s = k_bkhs.shape[1], k_bkhs.shape[3]
  r = n // kh
  blk = _decode_block(s, block)
  if blk == s:  # one block (short caches, e.g. on CPU): the dense softmax, no loop
    return cached_attention(q_btnh, k_bkhs, v_bksh, _block_allowed(mask.kv_valid, t, 0, q_offset)[:, 0, 0])
  q = _q_major(q_btnh.astype(jnp.float32) / jnp.sqrt(jnp.float32(h)), kh)  # [B, K, T R, H]
  num_blocks = jnp.minimum((q_offset + t + blk - 1) // blk, s // blk)

  def body(j, carry):
    m, l, acc = carry
    start = j * blk
    kb = jax.lax.dynamic_slice_in_dim(k_bkhs, start, blk, axis=3).astype(jnp.float32)
    vb = jax.lax.dynamic_slice_in_dim(v_bksh, start, blk, axis=2).astype(jnp.float32)
    valid = jax.lax.dynamic_slice_in_dim(mask.kv_valid, start, blk, axis=1)
    scores = jnp.einsum("bkqh,bkhs->bkqs", q, kb)
    scores = jnp.where(_q_major_mask(_block_allowed(valid, t, start, q_offset)[:, 0, 0], r), scores, _NEG)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    p = jnp.exp(scores - m_new[..., None])
    corr = jnp.exp(m - m_new)  # 0 once a real key was seen after only masked ones
    l = l * corr + jnp.sum(p, axis=-1)
    acc = acc * corr[..., None] + jnp.einsum("bkqs,bksh->bkqh", p, vb)
    return m_new, l, acc

  init = (
    jnp.full((b, kh, t * r), _NEG, jnp.float32),
    jnp.zeros((b, kh, t * r), jnp.float32),
    jnp.zeros((b, kh, t * r, h), jnp.float32),
  )
  _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
  return _from_q_major(acc / l[..., None], t).astype(q_btnh.dtype)
