"""Chunked log-prob head (vcpo_jax.model.logprobs) against the dense [B, T, V] reference.

Reference: transformer.token_logprobs(logits) with logits = h @ W in float32, i.e. today's path.
Values and gradients (with respect to h and W, tied and untied layouts) must agree to 1e-5
for token chunks that do not divide T - 1 and vocab chunks that do not divide V (the clamped
last chunk overlaps the previous one and must mask the overlap).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.model import config as mconfig
from vcpo_jax.model import logprobs as lp
from vcpo_jax.model import transformer as tf

B, T, D, V = 3, 11, 16, 50


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)  # logits of order 4: a non-trivial softmax
  tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)  # a random cotangent on logp
  return h, w, tokens, cot


def _dense(h, w_dv, tokens):
  return tf.token_logprobs(jnp.einsum("btd,dv->btv", h, w_dv), tokens)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk,vocab_chunk", [(4, 0), (3, 16), (0, 7), (1, 49)])
@pytest.mark.slow
def test_chunked_values_and_grads_equal_dense(tied, chunk, vocab_chunk):
  h, w_dv, tokens, cot = _inputs()
  w = w_dv.T if tied else w_dv
  spec = lp.HeadSpec(tied, chunk, vocab_chunk)

  def loss_chunked(h, w):
    return jnp.sum(cot * lp.head_logprobs(h, w, tokens, spec))

  def loss_dense(h, w):
    return jnp.sum(cot * _dense(h, w.T if tied else w, tokens))

  got = jax.jit(lambda h, w: lp.head_logprobs(h, w, tokens, spec))(h, w)
  want = _dense(h, w_dv, tokens)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert float(jnp.min(want[:, 1:])) < -3.0 and np.all(np.asarray(got[:, 0]) == 0)
  g = jax.jit(jax.grad(loss_chunked, argnums=(0, 1)))(h, w)
  g_ref = jax.jit(jax.grad(loss_dense, argnums=(0, 1)))(h, w)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # lse is what the ghost head pass rebuilds the softmax from.
  _, lse = lp.head_logprobs(h, w, tokens, spec, return_lse=True)
  np.testing.assert_allclose(lse, jax.nn.logsumexp(jnp.einsum("btd,dv->btv", h[:, :-1], w_dv), -1), rtol=1e-5)


def test_chunk_paths_are_taken():
  assert lp.is_dense(lp.HeadSpec(False, 0, 0), T, V) and lp.is_dense(lp.HeadSpec(False, T - 1, 0), T, V)
  assert not lp.is_dense(lp.HeadSpec(False, T - 2, 0), T, V) and not lp.is_dense(lp.HeadSpec(False, 0, V - 1), T, V)
  assert lp.vocab_chunks(50, 16) == (16, 4)  # chunks start at 0, 16, 32, 34 (clamped; 34..47 masked)
  start, live = lp.chunk_columns(3, 50, 16)
  assert int(start) == 34 and int(jnp.sum(live)) == 2


def test_sequence_logprobs_chunked_equals_dense_forward():
  """The model's log-prob head (chunked by its config) equals the dense logits path, tied and untied."""
  for cfg in (mconfig.tiny_qwen2(vocab_size=64, num_layers=1), mconfig.tiny_llama(vocab_size=64, num_layers=1)):
    chunked = cfg.replace(logprob_chunk=3, logprob_vocab_chunk=24)
    graphdef, params = tf.split(tf.init(cfg, seed=0))
    graphdef_c, _ = tf.split(tf.init(chunked, seed=0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)), jnp.int32)
    valid = jnp.ones((2, 9), bool).at[0, :2].set(False)
    pos, mask = tf.padded_positions_and_mask(valid)
    dense = tf.token_logprobs(tf.forward(graphdef, params, tokens, pos, mask)[0], tokens)
    np.testing.assert_array_equal(tf.sequence_logprobs(graphdef, params, tokens, valid), dense)  # T <= 513: dense
    np.testing.assert_allclose(tf.sequence_logprobs(graphdef_c, params, tokens, valid), dense, atol=1e-5)


def test_bf16_chunked_close_to_f32():
  h, w, tokens, _ = _inputs(1)
  a = lp.head_logprobs(h, w, tokens, lp.HeadSpec(False, 4, 16))
  b = lp.head_logprobs(h, w, tokens, lp.HeadSpec(False, 4, 16, jnp.bfloat16))
  assert b.dtype == jnp.float32
  err = float(jnp.max(jnp.abs(a - b)))
  assert 0 < err < 0.1, err


def test_grad_memory_does_not_scale_with_b_t_v():
  """Compiled temp bytes of value_and_grad through the chunked head stay far below one [B, T, V] f32."""
  b, t, d, v = 4, 512, 64, 4096
  h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, v), jnp.float32)
  tok = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def temp(spec):
    f = jax.jit(jax.grad(lambda h, w, tok: jnp.sum(lp.head_logprobs(h, w, tok, spec)), argnums=(0, 1)))
    return f.lower(h, w, tok).compile().memory_analysis().temp_size_in_bytes

  btv = b * t * v * 4  # 32 MiB
  dense, chunked = temp(lp.HeadSpec(False, 0, 0)), temp(lp.HeadSpec(False, 32, 1024))
  assert dense > btv  # the dense path holds (at least) the [B, T, V] logits
  assert chunked < btv / 8, (chunked, btv)


def test_bad_chunk_names_field():
  with pytest.raises(ValueError, match="logprob_chunk"):
    mconfig.tiny_llama(logprob_chunk=-1)
  with pytest.raises(ValueError, match="logprob_vocab_chunk"):
    lp.HeadSpec(False, 0, -2)
