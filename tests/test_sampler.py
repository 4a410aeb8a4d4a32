"""Tests for vcpo_jax.sampler: equivalence with the uncached forward, on-policy log-probs,
filtering semantics, stop handling, determinism and a compile count."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import mesh as mesh_lib
from vcpo_jax import sampler as S
from vcpo_jax.model import config
from vcpo_jax.model import transformer as tf

CFG = config.tiny_qwen2()
PROMPTS = [[3, 17, 42], [7, 8, 9, 10, 11], [5]]
SMALL = dict(prompt_buckets=(8, 16), new_token_buckets=(8, 16), batch_buckets=(4, 8), max_new_tokens=16)


@functools.lru_cache(maxsize=None)
def _model():
  gd, params = tf.split(tf.init(CFG, seed=0))
  # Sharpened copy: scaling the (tied) embedding makes next-token distributions peaked, so
  # nucleus sets are small and greedy runs repeat tokens (used by the top-p and stop tests).
  sharp = jax.tree.map(lambda x: x, params)
  sharp["embed_tokens"]["embedding"].value = params["embed_tokens"]["embedding"].value * 25.0
  return gd, params, sharp


@functools.lru_cache(maxsize=None)
def _sampler(**kw):
  gd, _, _ = _model()
  return S.Sampler(gd, CFG, S.SamplerConfig(**{**SMALL, **kw}))


@functools.lru_cache(maxsize=None)
def _full_forward():
  gd = _model()[0]

  def fwd(params, tok_bt, valid_bt):
    pos, mask = tf.padded_positions_and_mask(valid_bt)
    return tf.forward(gd, params, tok_bt, pos, mask)[0]

  return jax.jit(fwd)


def _full_logits(params, seq, length=32):
  """Uncached forward of one sequence (right-padded to a fixed length: one compile): logits [T, V]."""
  tok = np.zeros((1, length), np.int32)
  tok[0, : len(seq)] = seq
  valid = np.arange(length)[None] < len(seq)
  return np.asarray(_full_forward()(params, tok, valid)[0, : len(seq)])


def _log_softmax(x):
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


def _responses(r):
  return [r.tokens[n][r.response_mask[n]].tolist() for n in range(r.tokens.shape[0])]


def test_config_validation():
  for kw, field in [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(logp_mode="x"), "logp_mode"),
    (dict(prompt_buckets=(16, 8)), "prompt_buckets"),
    (dict(max_new_tokens=64), "max_new_tokens"),
  ]:
    with pytest.raises(ValueError, match=field):
      S.SamplerConfig(**{**SMALL, **kw})
  gd, params, _ = _model()
  with pytest.raises(ValueError, match="eos_id"):
    S.Sampler(gd, CFG, S.SamplerConfig(eos_id=CFG.vocab_size))
  smp = _sampler(temperature=0.0)
  with pytest.raises(ValueError, match="prompt length"):
    smp.generate(params, [list(range(17))], jax.random.key(0), max_new_tokens=4)
  with pytest.raises(ValueError, match="empty"):
    smp.generate(params, [[1], []], jax.random.key(0), max_new_tokens=4)


@pytest.mark.slow
def test_greedy_equals_stepwise_argmax_of_full_forward_and_layout():
  gd, params, _ = _model()
  r = _sampler(temperature=0.0).generate(params, PROMPTS, jax.random.key(0), max_new_tokens=10)
  for n, prompt in enumerate(PROMPTS):
    seq = list(prompt)
    for _ in range(10):
      seq.append(int(np.argmax(_full_logits(params, seq)[-1])))
    assert _responses(r)[n] == seq[len(prompt) :]
    # Layout: left-padded prompt in the first Tp = 8 columns, response right after it.
    assert r.tokens[n, 8 - len(prompt) : 8].tolist() == prompt
    assert r.prompt_mask[n].sum() == len(prompt) and r.prompt_mask[n, 8 - len(prompt) : 8].all()
  assert r.tokens.shape == (3, 8 + 16)
  assert not (r.prompt_mask & r.response_mask).any()
  assert (r.lengths == 10).all() and not r.finished.any()
  assert (r.response_mask[:, 8:18]).all() and not r.response_mask[:, 18:].any()
  assert (r.behavior_logp == 0).all()  # greedy is a point mass under logp_mode="sampled"
  np.testing.assert_array_equal(r.group_id, [0, 1, 2])


@pytest.mark.slow
def test_top_k_1_equals_greedy():
  _, params, _ = _model()
  greedy = _sampler(temperature=0.0).generate(params, PROMPTS, jax.random.key(0), max_new_tokens=10)
  topk1 = _sampler(temperature=1.3, top_k=1).generate(params, PROMPTS, jax.random.key(5), max_new_tokens=10)
  np.testing.assert_array_equal(topk1.tokens, greedy.tokens)
  np.testing.assert_allclose(topk1.behavior_logp, 0.0, atol=1e-6)  # renormalized over one token


def test_on_policy_logp_equals_learner_logp_and_ess_is_one():
  gd, params, _ = _model()
  # A stop id makes lengths vary, so the masks after a stop are exercised too.
  smp = _sampler(temperature=1.0, eos_id=7, stop_ids=(11, 13, 17, 19, 23))
  r = smp.generate(params, PROMPTS, jax.random.key(1), num_samples=2, max_new_tokens=16)
  valid = r.prompt_mask | r.response_mask
  logp = np.asarray(
    jax.jit(tf.sequence_logprobs, static_argnums=0)(gd, params, jnp.asarray(r.tokens), jnp.asarray(valid))
  )
  np.testing.assert_allclose(np.where(r.response_mask, logp, 0.0), r.behavior_logp, atol=1e-4)
  log_w = np.sum(np.where(r.response_mask, logp - r.behavior_logp, 0.0), axis=1)
  assert np.abs(log_w).max() < 1e-3
  w = np.exp(log_w)
  ess_ratio = w.sum() ** 2 / (len(w) * (w**2).sum())
  assert abs(ess_ratio - 1.0) < 1e-3
  assert (r.behavior_logp < 0).sum() == r.response_mask.sum()  # every response token has a logp
  assert (r.behavior_logp[~r.response_mask] == 0).all()
  # Finished rows end with their first stop token; unfinished rows used the whole budget.
  stops = {7, 11, 13, 17, 19, 23}
  for n, resp in enumerate(_responses(r)):
    assert [t in stops for t in resp] == [False] * (len(resp) - 1) + [bool(r.finished[n])]
    assert r.finished[n] or len(resp) == 16


def _nucleus(logits, temperature, top_k, top_p):
  """Reference: the kept token set and the renormalized log-probs (numpy, independent code)."""
  x = logits / temperature
  order = np.argsort(-x, kind="stable")
  if top_k:
    order = order[:top_k]
  p = np.exp(x[order] - x[order].max())
  p /= p.sum()
  before = np.cumsum(p) - p
  kept = order[before < top_p]
  lp = _log_softmax(x[kept])
  return dict(zip(kept.tolist(), lp.tolist()))


@pytest.mark.parametrize("top_k,top_p", [(0, 0.6), (12, 0.8)])
@pytest.mark.slow
def test_filtered_tokens_lie_in_nucleus_and_logp_is_renormalized(top_k, top_p):
  _, _, sharp = _model()
  smp = _sampler(temperature=0.8, top_k=top_k, top_p=top_p)
  tempered = _sampler(temperature=0.8, top_k=top_k, top_p=top_p, logp_mode="tempered")
  r = smp.generate(sharp, PROMPTS, jax.random.key(2), num_samples=2, max_new_tokens=12)
  rt = tempered.generate(sharp, PROMPTS, jax.random.key(2), num_samples=2, max_new_tokens=12)
  np.testing.assert_array_equal(rt.tokens, r.tokens)  # the mode changes only what is recorded
  sizes = []
  for n in range(r.tokens.shape[0]):
    prompt = PROMPTS[r.group_id[n]]
    resp = _responses(r)[n]
    logits = _full_logits(sharp, prompt + resp)
    for t, tok in enumerate(resp):
      row = logits[len(prompt) - 1 + t]
      kept = _nucleus(row, 0.8, top_k, top_p)
      sizes.append(len(kept))
      assert tok in kept
      np.testing.assert_allclose(r.behavior_logp[n, 8 + t], kept[tok], atol=1e-4)
      np.testing.assert_allclose(rt.behavior_logp[n, 8 + t], _log_softmax(row / 0.8)[tok], atol=1e-4)
  assert np.median(sizes) < CFG.vocab_size / 4  # the filter really removed most tokens


def test_filter_logits_hand_checked():
  # probs 0.5, 0.25, 0.125, 0.125: top_p=0.7 keeps {0, 1} (mass before token 2 is 0.75 >= 0.7).
  logits = jnp.log(jnp.array([[0.5, 0.25, 0.125, 0.125]]))
  kept = np.isfinite(np.asarray(S.filter_logits(logits, 1.0, 0, 0.7)))
  np.testing.assert_array_equal(kept, [[True, True, False, False]])
  kept = np.isfinite(np.asarray(S.filter_logits(logits, 1.0, 0, 0.76)))  # ties at the cutoff kept
  np.testing.assert_array_equal(kept, [[True, True, True, True]])
  kept = np.isfinite(np.asarray(S.filter_logits(logits, 1.0, 1, 1.0)))
  np.testing.assert_array_equal(kept, [[True, False, False, False]])


@pytest.mark.slow
def test_deterministic_for_a_key():
  _, params, _ = _model()
  smp = _sampler(temperature=1.0)
  a = smp.generate(params, PROMPTS, jax.random.key(3), num_samples=2, max_new_tokens=8)
  b = smp.generate(params, PROMPTS, jax.random.key(3), num_samples=2, max_new_tokens=8)
  c = smp.generate(params, PROMPTS, jax.random.key(4), num_samples=2, max_new_tokens=8)
  for f in ("tokens", "behavior_logp", "response_mask", "lengths", "finished"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
  assert (a.tokens != c.tokens).any()
  assert (a.tokens[0] != a.tokens[1]).any()  # the G samples of one prompt differ


def test_eos_and_stop_ids_end_rows_and_mask_after():
  _, _, sharp = _model()
  free = _sampler(temperature=0.0).generate(sharp, PROMPTS, jax.random.key(0), max_new_tokens=12)
  resp = _responses(free)
  eos = resp[0][4]
  r = _sampler(temperature=0.0, eos_id=eos).generate(sharp, PROMPTS, jax.random.key(0), max_new_tokens=12)
  for n, full in enumerate(resp):
    stop = full.index(eos) + 1 if eos in full else 12
    assert r.lengths[n] == stop and r.finished[n] == (eos in full)
    assert _responses(r)[n] == full[:stop]
    assert (r.tokens[n, 8 + stop :] == 0).all() and not r.response_mask[n, 8 + stop :].any()
  assert r.finished[0] and r.lengths[0] <= 5


@pytest.mark.slow
def test_generate_continuations_matches_generate():
  gd, params, _ = _model()
  smp = _sampler(temperature=1.0, eos_id=7)
  key = jax.random.key(6)
  r = smp.generate(params, PROMPTS, key, max_new_tokens=8)
  out = smp.generate_continuations(params, PROMPTS, 8, None, key)
  for n, (ids, lps) in enumerate(out):
    assert ids.tolist() == _responses(r)[n]
    np.testing.assert_array_equal(lps, r.behavior_logp[n][r.response_mask[n]])
  # Extra stop ids end the continuation at the first one, included.
  first = out[0][0][2]
  cut = S.generate_continuations(smp, params, PROMPTS[:1], 8, [int(first)], key)[0][0]
  assert cut.tolist() == out[0][0][: list(out[0][0]).index(first) + 1].tolist()


@pytest.mark.slow
def test_chunking_over_the_largest_batch_bucket_gives_the_same_rows():
  _, params, _ = _model()
  one = S.Sampler(_model()[0], CFG, S.SamplerConfig(**{**SMALL, "batch_buckets": (4,)}))
  r = one.generate(params, PROMPTS, jax.random.key(8), num_samples=2, max_new_tokens=8)  # 6 rows: 4 + 2
  ref = _sampler(temperature=1.0).generate(params, PROMPTS, jax.random.key(8), num_samples=2, max_new_tokens=8)
  np.testing.assert_array_equal(r.tokens, ref.tokens)
  np.testing.assert_allclose(r.behavior_logp, ref.behavior_logp, atol=1e-5)


@pytest.mark.slow
def test_max_batch_caps_the_buckets_and_runs_sequential_calls_of_the_same_rows():
  """max_batch = 4: buckets above 4 become 4 (also through dataclasses.replace), 6 rows run as calls of 4 + 2
  rows (static) or 4 slots (refill), and every row is the uncapped sampler's (per-row keys)."""
  cfg = S.SamplerConfig(**{**SMALL, "batch_buckets": (1, 2, 8, 16), "max_batch": 4})
  assert cfg.batch_buckets == (1, 2, 4)
  assert dataclasses.replace(cfg, batch_buckets=(2, 64)).batch_buckets == (2, 4)
  assert S.SamplerConfig(**{**SMALL, "batch_buckets": (1, 4), "max_batch": 8}).batch_buckets == (1, 4)
  with pytest.raises(ValueError, match="max_batch"):
    S.SamplerConfig(**{**SMALL, "max_batch": -1})
  _, params, _ = _model()
  ref = _sampler(temperature=1.0).generate(params, PROMPTS, jax.random.key(8), num_samples=2, max_new_tokens=8)
  for decode, fn, rows_arg in (("static", "_device_fn", 1), ("refill", "_refill_fn", 2)):
    capped = S.Sampler(_model()[0], CFG, dataclasses.replace(cfg, temperature=1.0, decode=decode))
    calls, real = [], getattr(capped, fn)

    def spy(*a, real=real, rows_arg=rows_arg, calls=calls, **kw):  # records each call's rows (prompts / slots)
      calls.append(a[rows_arg].shape[0])
      return real(*a, **kw)

    setattr(capped, fn, spy)
    r = capped.generate(params, PROMPTS, jax.random.key(8), num_samples=2, max_new_tokens=8)
    np.testing.assert_array_equal(r.tokens, ref.tokens)
    np.testing.assert_allclose(r.behavior_logp, ref.behavior_logp, atol=1e-5)
    assert calls == [4, 2] if decode == "static" else max(calls) == 4, (decode, calls)  # refill: 4 slots


@pytest.mark.slow
def test_row_offset_draws_the_rows_of_the_whole_batch():
  """A host sampling prompts [1, 3) of 3 with row_offset = 1 * G draws the whole batch's rows 2..5 (static and
  refill decode): what makes a multi-host async run's samples a single-host run's."""
  _, params, _ = _model()
  smp = _sampler(temperature=1.0, **CHUNKED)
  ref = smp.generate(params, PROMPTS, jax.random.key(8), num_samples=2, max_new_tokens=8)
  for mode in ("static", "refill"):
    part = smp.generate(
      params, PROMPTS[1:], jax.random.key(8), num_samples=2, max_new_tokens=8, decode=mode, row_offset=2
    )
    np.testing.assert_array_equal(part.tokens, ref.tokens[2:], err_msg=mode)
    np.testing.assert_allclose(part.behavior_logp, ref.behavior_logp[2:], atol=1e-5)
  shifted = smp.generate(params, PROMPTS[1:], jax.random.key(8), num_samples=2, max_new_tokens=8)
  assert not np.array_equal(shifted.tokens, ref.tokens[2:])  # without the offset: rows 0..3's draws


@pytest.mark.slow
def test_no_recompile_after_warmup_within_buckets():
  # jax's C++ dispatch cache is one LRU for the whole process (8192 entries); late in the full
  # suite it is full, so this function's entry can be evicted between calls. Empty it first so
  # `_cache_size()` counts this sampler's compilations only.
  jax.clear_caches()
  _, params, _ = _model()
  smp = S.Sampler(_model()[0], CFG, S.SamplerConfig(**{**SMALL, "eos_id": 7}))
  rng = np.random.default_rng(0)
  prompts = lambda n, lo, hi: [rng.integers(1, 200, rng.integers(lo, hi + 1)).tolist() for _ in range(n)]
  smp.generate(params, prompts(2, 1, 8), jax.random.key(0), max_new_tokens=8)  # warm-up: B=4, Tp=8, Tn=8
  warm = smp.num_traces
  assert warm == 1 and smp._device_fn._cache_size() == 1
  for i in range(4):  # prompt lengths 1..8, 1..4 rows, budgets 1..8, stop sets: all inside the bucket
    smp.generate(params, prompts(1 + i % 4, 1, 8), jax.random.key(i), max_new_tokens=1 + 2 * i)
    smp.generate(params, prompts(2, 1, 8), jax.random.key(i), num_samples=2, max_new_tokens=8 - i)
    smp.generate_continuations(params, prompts(3, 2, 7), 5 + i, [i + 20, i + 30], jax.random.key(i))
  assert smp.num_traces == warm and smp._device_fn._cache_size() == 1
  smp.generate(params, prompts(2, 9, 16), jax.random.key(0), max_new_tokens=8)  # a new bucket: Tp=16
  assert smp.num_traces == warm + 1


def test_filter_logits_matches_sort_based_nucleus_on_random_rows():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, 300)).astype(np.float32) * rng.uniform(0.5, 6.0, (6, 1)).astype(np.float32)
  for top_k, top_p in [(0, 0.3), (0, 0.9), (40, 0.7)]:
    kept = np.isfinite(np.asarray(jax.jit(S.filter_logits, static_argnums=(1, 2, 3))(logits, 0.9, top_k, top_p)))
    for row in range(6):
      assert set(np.flatnonzero(kept[row]).tolist()) == set(_nucleus(logits[row], 0.9, top_k, top_p))


# ----------------------------------------------------------------------------- at scale: chunked prefill, mesh, bf16


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_rows():
  """Prefill in chunks of 3 tokens (the 8- and 16-token prompt buckets: uneven last chunks) = one pass."""
  _, params, _ = _model()
  prompts = PROMPTS + [list(range(20, 31))]  # 11 tokens: the 16-token bucket
  kw = dict(num_samples=2, max_new_tokens=8)
  ref = _sampler(temperature=1.0).generate(params, prompts, jax.random.key(3), **kw)
  r = _sampler(temperature=1.0, prefill_chunk=3).generate(params, prompts, jax.random.key(3), **kw)
  np.testing.assert_array_equal(r.tokens, ref.tokens)
  np.testing.assert_allclose(r.behavior_logp, ref.behavior_logp, atol=1e-5)


@pytest.mark.slow
def test_prefill_temp_memory_does_not_grow_with_the_chunk_count():
  """Compiled prefill temporaries at 8 chunks <= at 2 chunks (2 layers, bf16, one KV cache layer = 4 MiB).

  The whole chunks run in a lax.scan with the cache as carry. Before (a Python loop of chunks at static
  slots) XLA kept cache copies per chunk alive: 10.6 MiB at 2 chunks, 19.4 MiB at 8 on this shape
  (XLA:CPU, jax 0.10.2); the scan gives 14.5 and 10.2 MiB. Memory from compilation is deterministic.
  """
  cm = CFG.replace(
    num_heads=2, head_dim=128, max_position=2048, attention="chunked", attention_chunk=32, dtype="bfloat16"
  )
  gd, params = tf.split(tf.init(cm, seed=0))
  b, tp, tn = 2, 1024, 1024
  temp = {}
  for n in (2, 8):
    scfg = S.SamplerConfig(
      prompt_buckets=(tp,), new_token_buckets=(tn,), batch_buckets=(b,), max_new_tokens=tn, prefill_chunk=tp // n
    )
    compiled = S.Sampler(gd, cm, scfg).lower(jax.eval_shape(lambda: params), b, tp, tn, part="prefill").compile()
    temp[n] = compiled.memory_analysis().temp_size_in_bytes
  assert temp[8] <= temp[2], temp


@pytest.mark.slow
def test_tensor_parallel_sampler_compiles_and_matches_one_device():
  """The sampler on its own 2-device ("tensor") mesh: compiles, splits weights and cache, same rows."""
  gd, params, _ = _model()
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 1, 2)), jax.devices()[:2])
  smp = S.Sampler(gd, CFG, S.SamplerConfig(**{**SMALL, "temperature": 1.0}), mesh=mesh)
  compiled = smp.lower(jax.eval_shape(lambda: params), 4, 8, 8).compile()
  text = compiled.as_text()
  assert "all-reduce" in text  # Megatron layout: o_proj / down_proj partial sums are reduced
  q = smp.prepare_params(params)["layers"]["self_attn"]["q_proj"]["kernel"][...]  # stacked [L, D, N*H]
  assert q.addressable_shards[0].data.shape == (CFG.num_layers, CFG.hidden_size, CFG.num_heads * CFG.head_dim // 2)
  r = smp.generate(smp.prepare_params(params), PROMPTS, jax.random.key(4), num_samples=2, max_new_tokens=8)
  ref = _sampler(temperature=1.0).generate(params, PROMPTS, jax.random.key(4), num_samples=2, max_new_tokens=8)
  np.testing.assert_array_equal(r.tokens, ref.tokens)
  np.testing.assert_allclose(r.behavior_logp, ref.behavior_logp, atol=1e-5)


@pytest.mark.slow
def test_bf16_params_and_cache():
  gd_bf, _ = tf.split(tf.init(CFG.replace(dtype="bfloat16"), seed=0))
  _, params, _ = _model()
  smp = S.Sampler(gd_bf, CFG.replace(dtype="bfloat16"), S.SamplerConfig(**{**SMALL, "param_dtype": "bfloat16"}))
  prepared = smp.prepare_params(params)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(prepared))
  assert all(x.dtype == jnp.bfloat16 for x in tf.init_cache(CFG.replace(dtype="bfloat16"), 2, 8))
  r = smp.generate(prepared, PROMPTS, jax.random.key(0), max_new_tokens=6)
  assert (r.lengths == 6).all() and np.isfinite(r.behavior_logp).all()
  with pytest.raises(ValueError, match="param_dtype"):
    S.SamplerConfig(param_dtype="float16")


# ----------------------------------------------------------------------------- the draw: exact inverse CDF


def _chi2(counts, probs):
  """Pearson's statistic over the cells with probs > 0, and the degrees of freedom."""
  keep = probs > 0
  n = counts.sum()
  return float((((counts - n * probs) ** 2)[keep] / (n * probs[keep])).sum()), int(keep.sum() - 1)


@pytest.mark.parametrize("v,block", [(12, 4), (50, 8), (50, None)])
@pytest.mark.slow
def test_inverse_cdf_draws_the_exact_distribution(v, block):
  """200k draws from one row (some tokens removed, -inf): chi-square within 5 sigma of its mean (fixed seed),
  removed tokens never drawn, recorded logp = the exact log-probability. V=50 with blocks of 8 pads the last."""
  rng = np.random.default_rng(v)
  x = (rng.normal(size=v) * 2.0).astype(np.float32)
  x[rng.choice(v, v // 4, replace=False)] = -np.inf
  p = np.exp(x - x.max())
  p /= p.sum()
  n = 200_000
  u = jax.random.uniform(jax.random.key(0), (n, 2))
  tok, logp = jax.jit(S.inverse_cdf_sample, static_argnums=2)(jnp.broadcast_to(x, (n, v)), u, block)
  tok, logp = np.asarray(tok), np.asarray(logp)
  assert np.isfinite(x[tok]).all()
  np.testing.assert_allclose(logp, np.log(p[tok]), atol=2e-6)
  stat, df = _chi2(np.bincount(tok, minlength=v), p)
  assert stat < df + 5 * np.sqrt(2 * df), (stat, df)


def test_inverse_cdf_edges_never_pick_a_removed_token():
  """u = 0 picks the first kept token, u just below 1 the last kept one, across block boundaries."""
  x = np.full((4, 20), -np.inf, np.float32)
  x[:, [3, 9]] = 0.0  # kept: 3 (block 0 of 8) and 9 (block 1); blocks 2 (16..19) are empty
  u = np.array([[0.0, 0.0], [np.float32(1 - 2**-24)] * 2, [0.49, 0.0], [0.51, 0.999]], np.float32)
  tok, logp = S.inverse_cdf_sample(jnp.asarray(x), jnp.asarray(u), 8)
  np.testing.assert_array_equal(tok, [3, 9, 3, 9])
  np.testing.assert_allclose(logp, np.log(0.5), atol=1e-6)


@functools.lru_cache(maxsize=None)
def _step_keys(n):
  """Decode-step keys of rows 0..n-1 as generate derives them (fold_in row, then step)."""
  return jax.jit(jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(jax.random.key(2), r), 5)))(jnp.arange(n))


@pytest.mark.parametrize(
  "draw,top_k,top_p",
  [
    ("inverse_cdf", 0, 1.0),
    ("inverse_cdf", 0, 0.7),
    ("inverse_cdf", 6, 0.9),
    ("inverse_cdf", 4, 1.0),
    ("gumbel", 0, 0.7),
  ],
)
@pytest.mark.slow
def test_choose_samples_the_filtered_distribution_and_records_its_logp(draw, top_k, top_p):
  """The token choice of a decode step (per-row keys as in generate) on one row of 40 logits: the support is
  exactly the reference nucleus (top-k, then top-p), the draws follow its renormalized probabilities (chi-square),
  and the recorded logp is that distribution's (logp_mode sampled) or the tempered full softmax (tempered)."""
  rng = np.random.default_rng(1)
  row = (rng.normal(size=40) * 1.5).astype(np.float32)
  ref = _nucleus(row, 0.7, top_k, top_p)
  n = 20_000
  keys = _step_keys(n)
  cfg = S.SamplerConfig(temperature=0.7, top_k=top_k, top_p=top_p, draw=draw)
  x = jnp.broadcast_to(jnp.asarray(row), (n, 40))
  tok, logp = jax.jit(lambda x, k: S._choose(x, k, cfg))(x, keys)
  tok, logp = np.asarray(tok), np.asarray(logp)
  assert set(np.unique(tok).tolist()) == set(ref)  # every kept token appears, no other
  np.testing.assert_allclose(logp, [ref[t] for t in tok.tolist()], atol=2e-5)
  probs = np.zeros(40)
  probs[list(ref)] = np.exp(list(ref.values()))
  stat, df = _chi2(np.bincount(tok, minlength=40), probs)
  assert stat < df + 5 * np.sqrt(2 * df) + 1, (stat, df)
  tempered = dataclasses.replace(cfg, logp_mode="tempered")
  tok_t, logp_t = jax.jit(lambda x, k: S._choose(x, k, tempered))(x[:64], keys[:64])
  np.testing.assert_array_equal(tok_t, tok[:64])
  np.testing.assert_allclose(logp_t, _log_softmax(row / 0.7)[np.asarray(tok_t)], atol=2e-5)


def test_greedy_choice_is_the_argmax_for_both_draws():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 33)).astype(np.float32))
  keys = jax.random.split(jax.random.key(0), 5)
  for draw in S.DRAWS:
    tok, logp = S._choose(x, keys, S.SamplerConfig(temperature=0.0, draw=draw))
    np.testing.assert_array_equal(tok, np.argmax(np.asarray(x), -1))
    np.testing.assert_array_equal(logp, 0.0)


# ----------------------------------------------------------------------------- construction: dtype, mesh, config


def test_param_dtype_auto_and_config_fields():
  assert S.resolve_param_dtype("auto", "cpu") is None  # the CPU default keeps float32 (its results per seed)
  assert S.resolve_param_dtype("auto", "gpu") == jnp.bfloat16 and S.resolve_param_dtype("auto", "tpu") == jnp.bfloat16
  assert S.resolve_param_dtype("", "gpu") is None and S.resolve_param_dtype("float32", "tpu") == jnp.float32
  with pytest.raises(ValueError, match="mesh_shape"):
    S.SamplerConfig(mesh_shape=(1, 2))
  from vcpo_jax import run_spec

  for field, value in [("param_dtype", "fp16"), ("mesh_shape", (1, 2)), ("draw", "argmax")]:
    with pytest.raises(run_spec.ConfigError, match=f"config.sampler.{field}="):
      run_spec.SamplingConfig(**{field: value})
  mesh = S.sampler_mesh(S.SamplerConfig(mesh_shape=(2, 1, -1)), jax.devices()[:4])
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}


@pytest.mark.slow
def test_unprepared_params_are_cast_inside_the_call():
  """param_dtype=bfloat16 with float32 params passed as they are = the same rows as prepared bf16 params."""
  gd, params, _ = _model()
  smp = S.Sampler(gd, CFG, S.SamplerConfig(**{**SMALL, "param_dtype": "bfloat16"}))
  key = jax.random.key(1)
  a = smp.generate(params, PROMPTS, key, max_new_tokens=6)
  b = smp.generate(smp.prepare_params(params), PROMPTS, key, max_new_tokens=6)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.behavior_logp, b.behavior_logp)


# ----------------------------------------------------------------------------- chunked decode, refill (helper inflight)

CHUNKED = dict(batch_buckets=(1, 2, 4), chunk_tokens=3, stop_ids=tuple(range(0, 256, 16)))


@pytest.mark.slow
def test_chunked_and_refill_decode_give_the_static_rows():
  """Same key per (row, token index) in every mode: the refilling engine (4 slots, 12 rows, stop ids ending
  rows at varied lengths) gives the static rows, in the static (prompt-major) order."""
  _, params, _ = _model()
  smp = _sampler(temperature=1.0, **CHUNKED)
  prompts = PROMPTS * 2
  ref = smp.generate(params, prompts, jax.random.key(5), num_samples=2, max_new_tokens=12)
  assert len(set(ref.lengths.tolist())) > 3 and ref.finished.any() and not ref.finished.all()
  for mode in ("chunked", "refill"):
    r = smp.generate(params, prompts, jax.random.key(5), num_samples=2, max_new_tokens=12, decode=mode, version=7)
    for f in ("tokens", "response_mask", "prompt_mask", "lengths", "finished", "group_id"):
      np.testing.assert_array_equal(getattr(r, f), getattr(ref, f), err_msg=f"{mode}: {f}")
    np.testing.assert_allclose(r.behavior_logp, ref.behavior_logp, atol=1e-5)
    np.testing.assert_array_equal(r.token_version, np.where(ref.response_mask, 7, -1))
  np.testing.assert_array_equal(ref.token_version, np.where(ref.response_mask, 0, -1))


def _slot_schedule(budgets, b, chunk, refill):
  """Reference schedule of the chunked engine: total decode steps for rows with these budgets on b slots.

  A started row has budget - 1 tokens left (its first comes from the prefill); a chunk runs min(chunk, most
  left) steps; after it, ended rows free their slots, which take waiting rows (refill) or, without refill,
  the next b rows start once every slot is free."""
  waiting, left, steps = list(budgets), [None] * b, 0
  fill = lambda: [waiting.pop(0) - 1 if x is None and waiting else x for x in left]
  left = fill()
  while any(x is not None for x in left):
    n = min(chunk, max(x for x in left if x is not None))
    steps += n
    left = [None if x is None or x - n <= 0 else x - n for x in left]
    if refill or all(x is None for x in left):
      left = fill()
  return steps


@pytest.mark.slow
def test_refill_runs_fewer_decode_steps_with_long_tailed_budgets():
  """Budgets 1,1,1,12 per 4 rows: static batching runs every batch for 11 decode steps (44); refilling
  slots as rows end needs far fewer (the reference schedule's count). Rows keep their budgets (no stop ids),
  their order and their tokens."""
  _, params, _ = _model()
  smp = _sampler(temperature=1.0, batch_buckets=(1, 2, 4), chunk_tokens=2)
  budgets = [1, 1, 1, 12] * 4
  out = {}
  for mode in ("chunked", "refill"):
    r = smp.generate(params, [[5, 6]] * 16, jax.random.key(2), max_new_tokens=12, decode=mode, budgets=budgets)
    np.testing.assert_array_equal(r.lengths, budgets)
    assert smp.last_decode_steps == _slot_schedule(budgets, 4, 2, refill=mode == "refill"), mode
    out[mode] = r
  np.testing.assert_array_equal(out["refill"].tokens, out["chunked"].tokens)
  assert _slot_schedule(budgets, 4, 2, refill=False) == 4 * 11  # a chunk ends early once every row is done
  assert _slot_schedule(budgets, 4, 2, refill=True) == 23


@pytest.mark.slow
def test_inflight_update_records_versions_and_logp_of_the_version_that_sampled():
  """on_chunk swaps in version 1 after the first chunk: tokens 0..3 (prefill + 3 decode steps) are version 0,
  the rest version 1. With recompute_kv the behaviour log-prob of every token equals the full-forward
  log-prob under the version recorded for it (temperature 1, no filtering: log softmax of the logits)."""
  _, params, sharp = _model()
  smp = _sampler(temperature=1.0, batch_buckets=(1, 2, 4), chunk_tokens=3)
  calls = []

  def on_chunk(steps):
    calls.append(steps)
    return (sharp, 1) if len(calls) == 1 else None

  r = smp.generate(
    params, PROMPTS, jax.random.key(9), max_new_tokens=10, decode="refill", on_chunk=on_chunk, recompute_kv=True
  )
  assert calls[0] == 3 and (r.lengths == 10).all()
  resp_v = r.token_version[:, 8:]
  np.testing.assert_array_equal(resp_v[:, :4], 0)
  np.testing.assert_array_equal(resp_v[:, 4:10], 1)
  for n in range(len(PROMPTS)):
    seq = r.tokens[n][r.prompt_mask[n] | r.response_mask[n]].tolist()
    lp = {v: np.stack([_log_softmax(x) for x in _full_logits(p, seq)]) for v, p in ((0, params), (1, sharp))}
    p_len = int(r.prompt_lengths[n])
    for i in range(10):
      v = int(resp_v[n, i])
      want = lp[v][p_len + i - 1, seq[p_len + i]]
      np.testing.assert_allclose(r.behavior_logp[n, 8 + i], want, atol=2e-4, err_msg=f"row {n} token {i} v{v}")


def test_sampler_config_from_tokenizer():
  """The trainer's buckets: one prompt and one response bucket, batch sizes deduplicated and sorted;
  pad falls back to EOS, then to 0."""

  class Tok:
    def __init__(self, eos, pad):
      self.eos_token_id, self.pad_token_id = eos, pad

  cfg = S.SamplerConfig.from_tokenizer(
    Tok(5, 9), max_prompt_len=24, max_new_tokens=16, batch_sizes=(1, 8, 4, 8), temperature=0.7, draw="gumbel"
  )
  assert (cfg.eos_id, cfg.pad_id, cfg.max_new_tokens) == (5, 9, 16)
  assert (cfg.prompt_buckets, cfg.new_token_buckets, cfg.batch_buckets) == ((24,), (16,), (1, 4, 8))
  assert (cfg.temperature, cfg.draw, cfg.top_p) == (0.7, "gumbel", 1.0)
  kw = dict(max_prompt_len=8, max_new_tokens=4, batch_sizes=(2,))
  assert S.SamplerConfig.from_tokenizer(Tok(5, None), **kw).pad_id == 5  # no pad token: EOS
  assert S.SamplerConfig.from_tokenizer(Tok(None, None), **kw).pad_id == 0  # neither
  with pytest.raises(ValueError, match="top_p"):
    S.SamplerConfig.from_tokenizer(Tok(5, 9), top_p=0.0, **kw)
