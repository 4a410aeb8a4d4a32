"""Attention implementations against the dense reference, on left- and right-padded rows.

The reference is the model's attention before `AttentionMask` existed: float32
scores [B, K, R, T, S] masked by an explicit [B, T, S] bool array (causal, valid
keys, and the diagonal for padding queries), softmax, weighted sum. Every
implementation must give the same output at every query (padding queries
included) to float32 rounding, and the same gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.model import attention as attn
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import transformer as tf

B, T, N, K, H = 3, 40, 4, 2, 8


def _valid():
  """Row 0 left-padded (prompt), row 1 right-padded (response), row 2 both (a sampled trajectory)."""
  v = np.ones((B, T), bool)
  v[0, :7] = False
  v[1, 29:] = False
  v[2, :5] = False
  v[2, 33:] = False
  return jnp.asarray(v)


def _qkv(seed=0, t=T, s=T):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, t, N, H)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, s, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, s, K, H)), jnp.float32)
  return q, k, v


def _reference(q, k, v, mask_bts):
  """The pre-existing dense attention (explicit mask), written out independently."""
  r = q.shape[2] // k.shape[2]
  k_rep, v_rep = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)  # head j uses kv head j // R
  scores = jnp.einsum("btnh,bsnh->bnts", q, k_rep) / np.sqrt(q.shape[-1])
  scores = jnp.where(mask_bts[:, None], scores, jnp.finfo(jnp.float32).min)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v_rep)


def test_mask_rule_hand_checked():
  m = attn.AttentionMask(jnp.asarray([[False, True, True, False]]))
  # Pad query 0 sees itself only; pad query 3 (right padding) sees the valid keys 1, 2 and itself.
  want = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
  np.testing.assert_array_equal(m.dense(4)[0], np.asarray(want, bool))
  # Two queries at cache slots 2, 3 of a 4-slot cache.
  np.testing.assert_array_equal(m.dense(2, q_offset=2)[0], np.asarray([[0, 1, 1, 0], [0, 1, 1, 1]], bool))


@pytest.mark.parametrize("impl, chunk", [("dense", 512), ("xla", 512), ("chunked", 512), ("chunked", 16)])
def test_parity_with_reference(impl, chunk):
  q, k, v = _qkv()
  mask = attn.AttentionMask(_valid())
  want = _reference(q, k, v, mask.dense(T))
  fn = jax.jit(lambda q, k, v, m: attn.attention(q, k, v, m, implementation=impl, chunk=chunk))
  got = fn(q, k, v, mask)
  assert float(jnp.abs(want).max()) > 0.3
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # Gradients with respect to q, k, v (the chunked path rematerializes each chunk).
  cot = jnp.asarray(np.random.default_rng(1).standard_normal(want.shape), jnp.float32)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * cot)
  g_want = jax.grad(loss(lambda q, k, v: _reference(q, k, v, mask.dense(T))), argnums=(0, 1, 2))(q, k, v)
  g_got = jax.jit(jax.grad(loss(lambda q, k, v: fn(q, k, v, mask)), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_prefix_with_offset_matches_reference():
  """Queries at slots 24..39 of a cache whose first 24 slots are filled: chunked over the prefix."""
  q, k, v = _qkv(seed=2)
  mask = attn.AttentionMask(_valid())
  want = _reference(q, k, v, mask.dense(T))[:, 24:]
  got = attn.attention(q[:, 24:], k, v, mask, q_offset=24, implementation="chunked", chunk=8)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _cache_layout(k_bskh, v_bskh):
  """[B, S, K, H] keys and values -> the cache layout (keys [B, K, H, S], values [B, K, S, H])."""
  return jnp.transpose(k_bskh, (0, 2, 3, 1)), jnp.transpose(v_bskh, (0, 2, 1, 3))


@pytest.mark.parametrize("slot", [0, 5, 15, 16, 39])
def test_decode_reads_only_filled_blocks(slot):
  """Blockwise online softmax equals the dense one; cache blocks after the slot's block are never read."""
  s, block = 48, 16
  q, k, v = _qkv(seed=3, t=1, s=s)
  valid = jnp.zeros((B, s), bool).at[:, : slot + 1].set(True).at[0, :3].set(False)
  mask = attn.AttentionMask(valid)
  want = _reference(q, k, v, mask.dense(1, q_offset=slot))
  first_unread = (slot // block + 1) * block
  k_nan, v_nan = (x.at[:, first_unread:].set(jnp.nan) for x in (k, v))  # would poison any read
  fn = jax.jit(lambda q, k, v, m, i: attn.decode_attention(q, k, v, m, i, block=block))
  got = fn(q, *_cache_layout(k_nan, v_nan), mask, jnp.int32(slot))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("s, block", [(48, 16), (40, 512)])
@pytest.mark.slow
def test_decode_attention_of_a_prefill_chunk_at_a_static_slot(s, block):
  """T = 8 queries at static slots 16..23 (a later prefill chunk): blockwise (48 / 16) and one block (40)."""
  q, k, v = _qkv(seed=5, t=24, s=s)
  valid = jnp.ones((B, s), bool).at[0, :4].set(False)
  mask = attn.AttentionMask(valid)
  want = _reference(q, k, v, mask.dense(24))[:, 16:]
  k_nan, v_nan = (x.at[:, 32:].set(jnp.nan) for x in (k, v)) if s == 48 else (k, v)  # block 2 never read
  got = attn.decode_attention(q[:, 16:], *_cache_layout(k_nan, v_nan), mask, 16, block=block)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_cached_attention_matches_reference_with_an_explicit_mask():
  """The dense path over a cache (explicit [B, T, S] masks: the refill engine, recompute, pure_lag)."""
  q, k, v = _qkv(seed=6, t=3, s=20)
  allowed = jnp.asarray(np.random.default_rng(0).random((B, 3, 20)) < 0.5).at[:, :, 0].set(True)
  want = _reference(q, k, v, allowed)
  got = attn.cached_attention(q, *_cache_layout(k, v), allowed)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_decode_block_divides_cache():
  assert attn._decode_block(3072, 512) == 512
  assert attn._decode_block(96, 512) == 96  # S <= block: one block, the dense softmax
  assert attn._decode_block(1200, 512) == 400  # the largest divisor <= block: blocks never overlap
  assert attn._decode_block(48, 16) == 16
  assert attn._decode_block(1031, 512) == 1031  # a prime: no useful divisor, one block


def test_unknown_implementation_names_choices():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="chunked"):
    attn.attention(q, k, v, attn.AttentionMask(_valid()), implementation="flash")
  with pytest.raises(ValueError, match="attention"):
    mconfig.tiny_qwen2(attention="flash")


def _temp_bytes(impl, t):
  q = jax.ShapeDtypeStruct((1, t, N, H), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, K, H), jnp.float32)
  mask = attn.AttentionMask(jax.ShapeDtypeStruct((1, t), jnp.bool_))
  loss = lambda q, k, v, m: jnp.sum(attn.attention(q, k, v, m, implementation=impl, chunk=64))
  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return fn.lower(q, kv, kv, mask).compile().memory_analysis().temp_size_in_bytes


def test_chunked_never_holds_t_by_t_scores():
  """Forward + backward temporaries: dense keeps [N, T, T] float32 scores/probs, chunked a few [N, 64, T]."""
  t = 1024
  dense, chunked = _temp_bytes("dense", t), _temp_bytes("chunked", t)
  scores = N * t * t * 4  # one [1, N, T, T] float32 array: 16 MiB
  assert dense >= scores, (dense, scores)
  assert chunked < scores / 2, (chunked, scores)


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_model_logprobs_equal_dense_reference(impl):
  """Whole-model log-probs (left- and right-padded rows) with each implementation vs the explicit mask."""
  cfg = mconfig.tiny_qwen2(vocab_size=64, num_layers=2, attention_chunk=16)
  graphdef, params = tf.split(tf.init(cfg, seed=1))
  graphdef_impl, _ = tf.split(tf.init(cfg.replace(attention=impl), seed=1))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (B, T)), jnp.int32)
  pos, mask = tf.padded_positions_and_mask(_valid())
  want = jax.jit(tf.forward, static_argnums=0)(graphdef, params, tokens, pos, mask.dense(T))[0]
  got = jax.jit(tf.forward, static_argnums=0)(graphdef_impl, params, tokens, pos, mask)[0]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_splash_kernel_in_interpret_mode():
  """The TPU splash path (segment ids: valid 1 / pad 0, causal), run by the Pallas interpreter on CPU.

  Padding queries differ by design (they attend within the padding segment), so outputs and
  the cotangent are compared on valid queries only.
  """
  t, h = 128, 128  # the kernel's block granularity and lane width
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((2, t, N, h)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((2, t, K, h)), jnp.float32) for _ in range(2))
  valid = np.ones((2, t), bool)
  valid[0, :10] = False  # left padding
  valid[1, 100:] = False  # right padding
  mask = attn.AttentionMask(jnp.asarray(valid))
  keep = jnp.asarray(valid)[:, :, None, None]
  splash = lambda q, k, v: attn._splash(q, k, v, mask.kv_valid, block=128, interpret=True)
  dense = lambda q, k, v: attn.attention(q, k, v, mask, implementation="dense")
  np.testing.assert_allclose(np.asarray(splash(q, k, v))[valid], np.asarray(dense(q, k, v))[valid], atol=1e-5)
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.where(keep, f(q, k, v), 0.0) ** 2)
  for a, b in zip(jax.grad(loss(splash), (0, 1, 2))(q, k, v), jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()) + 1e-6)
