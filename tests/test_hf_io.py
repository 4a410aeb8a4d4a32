"""Hugging Face interop: parity with transformers' PyTorch models, export round trip, errors, tokenizer."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests import fixtures
from vcpo_jax.model import hf_forward, hf_io, load_hf, save_hf
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import tokenizer as tk
from vcpo_jax.model import transformer as tf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 101  # = len(build_char_tokenizer())
PARITY_TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  """family -> (dir, torch model); Llama is saved sharded to exercise the index file."""
  root = tmp_path_factory.mktemp("hf")
  out = {
    "qwen2": fixtures.make_hf_checkpoint(root / "qwen2", "qwen2", V, seed=1),
    "llama": fixtures.make_hf_checkpoint(root / "llama", "llama", V, seed=2, max_shard_size="40KB"),
  }
  return out


def _tokens(b, t, seed=0):
  return np.random.default_rng(seed).integers(0, V, size=(b, t)).astype(np.int32)


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_parity_with_transformers(ckpts, family):
  path, ref = ckpts[family]
  tokens = _tokens(3, 12, seed=3)
  ours = hf_forward(path, tokens)
  theirs = fixtures.hf_logits(ref, tokens)
  assert ours.shape == theirs.shape == (3, 12, V) and ours.dtype == np.float32
  assert np.abs(theirs).max() > 0.5  # logits of order 1: the bound below is not vacuous
  np.testing.assert_array_less(np.abs(ours - theirs).max(), PARITY_TOL)


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_parity_left_padded_batch(ckpts, family):
  path, ref = ckpts[family]
  tokens = _tokens(3, 12, seed=4)  # same shape as above: no recompile
  mask = np.ones_like(tokens)
  mask[0, :4] = 0  # left padding of different lengths; row 2 unpadded
  mask[1, :1] = 0
  tokens = np.where(mask == 1, tokens, 0)  # pad id 0 like a real batch
  ours = hf_forward(path, tokens, attention_mask=mask)
  theirs = fixtures.hf_logits(ref, tokens, mask)
  real = mask.astype(bool)
  np.testing.assert_array_less(np.abs(ours - theirs)[real].max(), PARITY_TOL)
  # Row 0 moved to the right-padded layout gives the same logits: positions count
  # real tokens, so padding on either side is invisible to the real ones.
  right = np.roll(tokens[0], -4)[None].repeat(3, 0)
  right_mask = np.roll(mask[0], -4)[None].repeat(3, 0)
  moved = hf_forward(path, right, attention_mask=right_mask)
  np.testing.assert_allclose(ours[0, 4:], moved[0, :8], atol=1e-5)


def test_hf_forward_caches_and_accepts_1d(ckpts):
  path, _ = ckpts["qwen2"]
  hf_forward(path, _tokens(1, 12))
  n = len(hf_io._LOADED)
  a = hf_forward(path, _tokens(1, 12)[0].tolist())
  assert len(hf_io._LOADED) == n and a.shape == (1, 12, V)
  with pytest.raises(ValueError, match="token_ids must lie in"):
    hf_forward(path, [[0, V]])
  with pytest.raises(ValueError, match="attention_mask shape"):
    hf_forward(path, _tokens(2, 5), attention_mask=np.ones((2, 4)))


def test_sharded_and_config(ckpts):
  path, ref = ckpts["llama"]
  assert os.path.isfile(os.path.join(path, hf_io.INDEX_FILE))
  assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
  cfg, model = load_hf(path)
  assert cfg == mconfig.tiny_llama(V, max_position=256, dtype="float32")  # fixtures.hf_config("llama")
  # Kernels are the transposes of torch's [out, in] weights.
  want = ref.model.layers[1].self_attn.k_proj.weight.detach().numpy().T
  np.testing.assert_array_equal(np.asarray(model.layers.self_attn.k_proj.kernel[...][1]), want)
  np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), ref.lm_head.weight.detach().numpy().T)


def test_bf16_checkpoint_is_upcast(tmp_path):
  path, ref = fixtures.make_hf_checkpoint(tmp_path / "bf", "qwen2", V, seed=5, bf16=True, tokenizer=False)
  from safetensors import safe_open

  with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
    assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
  cfg, model = load_hf(path)
  emb = np.asarray(model.embed_tokens.embedding[...])
  assert emb.dtype == np.float32
  np.testing.assert_array_equal(emb, ref.model.embed_tokens.weight.detach().numpy())
  tokens = _tokens(3, 12, seed=6)
  np.testing.assert_array_less(np.abs(hf_forward(path, tokens) - fixtures.hf_logits(ref, tokens)).max(), PARITY_TOL)


def test_load_straight_into_shards(ckpts, tmp_path, monkeypatch):
  """With a mesh, every parameter is born in the policy's sharding with the host load's values, and every
  read of a sharded parameter is one device block of it, never the whole tensor; replicated blocks are read
  once. Multi-file untied f32 (llama), tied with biases (qwen2), and bf16 (upcast) checkpoints."""
  import jax

  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax import sharding as sh

  bf16, _ = fixtures.make_hf_checkpoint(tmp_path / "bf", "qwen2", V, seed=5, bf16=True, tokenizer=False)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 2, 2)), jax.devices()[:4])
  reads = []
  read = hf_io._Reader.read

  def spy(self, name, dtype, index=None, transpose=False):
    out = read(self, name, dtype, index, transpose)
    reads.append((name, index, out.size))
    return out

  for path in (ckpts["llama"][0], ckpts["qwen2"][0], bf16):
    _, host = tf.split(load_hf(path)[1])
    reads.clear()
    with monkeypatch.context() as m, pytest.warns(UserWarning, match="not divisible"):  # V = 101 on 2 devices
      m.setattr(hf_io._Reader, "read", spy)
      cfg, model = load_hf(path, mesh=mesh)
    _, params = tf.split(model)
    want = sh.param_shardings(host, sh.TRANSFORMER_RULES, mesh)
    names = {}  # our path -> its HF tensors (a stacked block parameter: one per layer)
    for n, e in hf_io.hf_name_map(cfg).items():
      names.setdefault(e.path, []).append(n)
    for (p, x), y, s in zip(
      jax.tree_util.tree_leaves_with_path(host), jax.tree.leaves(params), jax.tree.leaves(want), strict=True
    ):
      assert y.sharding == s and y.dtype == np.float32
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
      path_ = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in p)[:-1]  # drop the trailing .value
      mine = [(idx, size) for n, idx, size in reads if n in names[path_]]
      blocks = {tuple((sl.start, sl.stop) for sl in i) for i in s.devices_indices_map(x.shape).values()}
      layers = len(names[path_])  # each block of a stacked parameter: one read per layer's tensor
      assert all(idx is not None for idx, _ in mine) and len(mine) == len(blocks) * layers
      if len(blocks) > 1:  # a sharded parameter: each read is a strict part of the tensor
        shard = s.shard_shape(x.shape)
        assert all(size * layers == np.prod(shard) and size < x.size // layers for _, size in mine)


def _device_buffers() -> set[int]:
  return {s.data.unsafe_buffer_pointer() for a in jax.live_arrays() for s in a.addressable_shards}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.slow
def test_sharded_load_holds_one_block_at_a_time(tmp_path, family):
  """Loading onto a mesh never holds a whole tensor on the host. Every read is one device block, no larger
  than the tensor's device shard; the blocks a host reads partition each tensor (each element read once,
  twice for the embedding of a tied checkpoint that stores lm_head.weight: the tied check compares block by
  block); and when any read of the two [V, D] tensors starts, the host memory the loader holds (traced Python
  + numpy bytes above their level at the first read, less the blocks XLA:CPU adopted as the fake devices'
  buffers) is below a quarter of one of them: one 1/8 block at most. Gathering a tensor's 8 blocks on the
  host before placing them (jax.make_array_from_callback, the loader before this test) holds 7/8 of it.
  llama: untied, lm_head transposed; qwen2: tied, lm_head.weight stored as a copy of the embedding."""
  import gc
  import tracemalloc

  from vcpo_jax import mesh as mesh_lib

  path = hf_io.make_tiny_checkpoint(tmp_path / family, family, vocab_size=32768, tokenizer=False, num_layers=1)
  if family == "qwen2":
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 4, 2)), jax.devices()[:8])
  big = ("model.embed_tokens.weight", "lm_head.weight")
  # outs: data address -> bytes of every block read; base: traced bytes at the first read (the loader's
  # bookkeeping is not weights)
  reads, outs, base = [], {}, []
  read = hf_io._Reader.read

  def spy(self, name, dtype, index=None, transpose=False):
    held = None
    if not reads or name in big:
      gc.collect()  # count what is held, not garbage awaiting collection
      adopted = _device_buffers()  # XLA:CPU keeps an adopted block's memory, not the ndarray, alive
      held = tracemalloc.get_traced_memory()[0] - sum(n for ptr, n in outs.items() if ptr in adopted)
      base.append(base[0] if base else held)
      held -= base[0]
    out = read(self, name, dtype, index, transpose)
    reads.append((name, index, out.size, held))
    outs[out.ctypes.data] = out.nbytes
    return out

  _, host = tf.split(load_hf(path)[1])
  load_hf(path, mesh=mesh)  # the first sharded load's imports and caches are not the loader's holdings
  tracemalloc.start()
  try:
    with pytest.MonkeyPatch.context() as m:
      m.setattr(hf_io._Reader, "read", spy)
      cfg, model = load_hf(path, mesh=mesh)
  finally:
    tracemalloc.stop()
  _, params = tf.split(model)
  for x, y in zip(jax.tree.leaves(host), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  flat = {tuple(p): v[...] for p, v in nnx.to_flat_state(params)}
  shapes = hf_io.hf_shapes(cfg)
  tensor_bytes = 32768 * cfg.hidden_size * 4
  for name, entry in hf_io.hf_name_map(cfg).items():
    x = flat[entry.path]
    mine = [(idx, size, held) for n, idx, size, held in reads if n == name]
    assert mine and all(idx is not None for idx, _, _ in mine), name
    assert max(size for _, size, _ in mine) <= np.prod(x.sharding.shard_shape(x.shape)), name
    times = 2 if (family == "qwen2" and name == big[0]) else 1
    assert sum(size for _, size, _ in mine) == times * np.prod(shapes[name]), name
    if name in big:
      assert max(held for _, _, held in mine) < tensor_bytes / 4, (name, [held for _, _, held in mine])
  if family == "qwen2":
    emb = flat[("embed_tokens", "embedding")]
    head = [size for n, _, size, _ in reads if n == big[1]]  # the tied check's reads: the embedding's blocks
    assert sum(head) == emb.size and max(head) == np.prod(emb.sharding.shard_shape(emb.shape))
    tensors["lm_head.weight"][-1, -1] += 1  # differs in the last block only
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tie_word_embeddings"):
      load_hf(path, mesh=mesh)


def test_bf16_compute_close_to_fp32(ckpts):
  path, _ = ckpts["qwen2"]
  tokens = _tokens(3, 12, seed=7)
  f32 = hf_forward(path, tokens)
  bf16 = hf_forward(path, tokens, dtype="bfloat16")
  assert bf16.dtype == np.float32 and np.isfinite(bf16).all()
  err = np.abs(bf16 - f32).max()
  # bf16 keeps 8 mantissa bits (~0.4% relative); two layers of it stay within a few percent.
  assert 0 < err < 0.05 * np.abs(f32).max(), err
  assert (bf16.argmax(-1) == f32.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_export_round_trip_through_transformers(tmp_path, family):
  preset = mconfig.tiny_qwen2 if family == "qwen2" else mconfig.tiny_llama
  cfg = preset(vocab_size=V)
  # Random values for every tensor (biases and scales too, which init leaves at 0 / 1).
  rng = np.random.default_rng(11)
  tensors = {
    n: (float(n.endswith("norm.weight")) + 0.1 * rng.standard_normal(sh)).astype(np.float32)
    for n, sh in hf_io.hf_shapes(cfg).items()
  }
  model = hf_io.params_from_hf(tensors, cfg)
  out = save_hf(model, cfg, tmp_path / "export", tokenizer=tk.build_char_tokenizer())
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  assert type(hf).__name__ == ("Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM")
  tokens = _tokens(3, 12, seed=8)
  ours = np.asarray(hf_io._logits(*tf.split(model), tokens, np.ones(tokens.shape, bool)))
  theirs = fixtures.hf_logits(hf, tokens)
  assert np.abs(theirs).max() > 0.5
  np.testing.assert_array_less(np.abs(ours - theirs).max(), PARITY_TOL)
  # And back: identical config and bit-identical tensors.
  cfg2, _ = load_hf(out)
  assert cfg2 == cfg
  again, _ = hf_io.read_state_dict(out)
  assert set(again) == set(tensors)
  for n in tensors:
    np.testing.assert_array_equal(again[n], tensors[n], err_msg=n)
  assert transformers.AutoTokenizer.from_pretrained(out).eos_token == tk.IM_END
  assert hf.config.eos_token_id == 2 and hf.config.pad_token_id == 0


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_hf_checkpoint_reexports_bit_identical(ckpts, tmp_path, family):
  path, _ = ckpts[family]
  cfg, model = load_hf(path)
  out = save_hf(model, cfg, tmp_path / "re")
  original, _ = hf_io.read_state_dict(path)
  again = load_file(os.path.join(out, "model.safetensors"))
  assert set(original) == set(again)  # tied Qwen2: no lm_head.weight either side
  for name in original:
    np.testing.assert_array_equal(original[name], again[name], err_msg=name)


def test_make_tiny_checkpoint(tmp_path):
  out = hf_io.make_tiny_checkpoint(tmp_path / "tiny", "llama", num_layers=1)
  cfg, _ = load_hf(out)
  tok = tk.load_tokenizer(out)
  assert cfg.vocab_size == len(tok) == V and cfg.num_layers == 1 and not cfg.tie_embeddings
  ids = tok("Use 3, 7, 25 to make 42: (25 - 7) * 3 = 54", add_special_tokens=False)["input_ids"]
  assert tok.unk_token_id not in ids
  with pytest.raises(ValueError, match="family"):
    hf_io.make_tiny_checkpoint(tmp_path / "x", "gpt2")
  with pytest.raises(ValueError, match="vocab_size"):
    hf_io.make_tiny_checkpoint(tmp_path / "x", "qwen2", vocab_size=50)


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def broken(ckpts, tmp_path):
  """A writable copy of the Qwen2 checkpoint and its tensors, to be damaged by a test."""
  path = shutil.copytree(ckpts["qwen2"][0], tmp_path / "broken")
  return path, load_file(os.path.join(path, "model.safetensors"))


def _rewrite(path, tensors):
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def test_error_missing_dir_and_config(broken, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_hf(tmp_path / "nope")
  path, _ = broken
  os.remove(os.path.join(path, "config.json"))
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(path)


def test_error_missing_tensor(broken):
  path, tensors = broken
  del tensors["model.layers.1.mlp.up_proj.weight"]
  _rewrite(path, tensors)
  with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
    load_hf(path)


def test_error_wrong_shape_names_tensor_and_file(broken):
  path, tensors = broken
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
  _rewrite(path, tensors)
  with pytest.raises(ValueError, match=r"k_proj\.weight.*model\.safetensors.*\(16, 64\).*\(32, 64\)"):
    load_hf(path)


def test_error_unsupported_model_type(broken):
  path, _ = broken
  transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(path)
  with pytest.raises(ValueError, match="gpt2"):
    load_hf(path)


def test_unexpected_and_tied_head(broken):
  path, tensors = broken
  _rewrite(path, {**tensors, "model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)})
  with pytest.raises(ValueError, match="o_proj.bias"):
    load_hf(path)
  with pytest.warns(UserWarning, match="o_proj.bias"):
    load_hf(path, strict=False)
  # A tied checkpoint may carry lm_head.weight, but only as a copy of the embedding.
  _rewrite(
    path,
    {
      **tensors,
      "lm_head.weight": tensors["model.embed_tokens.weight"].copy(),
      "model.rotary_emb.inv_freq": np.ones(8, np.float32),
    },
  )
  load_hf(path)
  _rewrite(path, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1})
  with pytest.raises(ValueError, match="tie_word_embeddings"):
    load_hf(path)


def test_error_no_weights_and_bad_index(broken):
  path, tensors = broken
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match=r"No \*\.safetensors"):
    load_hf(path)
  with open(os.path.join(path, hf_io.INDEX_FILE), "w") as f:
    json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
  with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
    load_hf(path)


def test_error_unsupported_features(broken):
  path, _ = broken
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**raw, "use_sliding_window": True, "sliding_window": 8}, f)
  with pytest.raises(ValueError, match="use_sliding_window"):
    load_hf(path)


def test_export_rejects_unrepresentable_configs(tmp_path):
  with pytest.raises(ValueError, match="qkv_bias=False"):
    hf_io.hf_config(mconfig.tiny_qwen2(qkv_bias=False))
  with pytest.raises(ValueError, match="qkv_bias=True"):
    hf_io.hf_config(mconfig.tiny_llama(qkv_bias=True))
  cfg = mconfig.tiny_llama(vocab_size=V)
  with pytest.raises(ValueError, match="does not match cfg"):
    save_hf({"embed_tokens": {"embedding": np.zeros((V, 64), np.float32)}}, cfg, tmp_path / "x")


# ----------------------------------------------------------------------------- tokenizer


def test_char_tokenizer_ids_and_round_trip(tmp_path):
  tok = tk.build_char_tokenizer(tmp_path / "tok")
  assert len(tok) == V
  assert [tok.pad_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 2, 3]
  assert tok.convert_tokens_to_ids([tk.IM_START, "\n", " ", "0", "a"]) == [1, 4, 6, 22, 71]
  text = "Compute (12 + 3) * 4 / 2 - 1 = 29\nAnswer: 29"
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert len(ids) == len(text) and tok.decode(ids) == text
  assert tok("é")["input_ids"] == [3]
  loaded = tk.load_tokenizer(tmp_path / "tok")
  assert loaded(text)["input_ids"] == ids
  with pytest.raises(FileNotFoundError, match="No tokenizer files"):
    tk.load_tokenizer(tmp_path)


# Each task's alphabet: digits, spaces, brackets, operators, newlines, letters, and unicode outside ASCII.
_ALPHABET = (
  list("0123456789")
  + [" ", "  ", "\n", "\t"]
  + list("()[],+-*/=<>:.?")
  + list("abcxyzAZ")
  + ["é", "π", "≤", "√", "中", "😀", "\u00a0"]
)


def _random_texts(n, seed):
  rng = np.random.default_rng(seed)
  return ["".join(rng.choice(_ALPHABET, size=rng.integers(0, 40))) for _ in range(n)]


def _byte_level_bpe():
  """A byte-level BPE tokenizer trained here, with its own pre-tokenizer (digits split, no Qwen regex)."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.Sequence(
    [pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
  )
  bpe.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[tk.PAD_TOKEN, tk.IM_END]
  )
  bpe.train_from_iterator(_random_texts(300, seed=5) + ["Compute (12 + 3) * 4 = 60\nAnswer: 60"] * 20, trainer)
  return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=tk.IM_END, pad_token=tk.PAD_TOKEN)


@pytest.mark.parametrize("family", fixtures.FAMILIES)
@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.slow
def test_exported_tokenizer_gives_the_training_ids(tmp_path, family, kind):
  """AutoTokenizer (with and without trust_remote_code) and load_tokenizer on an export give the ids of the
  tokenizer the run trained with, on 1,000 random strings; decode(encode(s)) == s where s is representable.
  (A qwen2 config.json used to make AutoTokenizer rebuild a byte-level Qwen2 tokenizer: spaces dropped.)"""
  tok = tk.build_char_tokenizer() if kind == "char" else _byte_level_bpe()
  preset = mconfig.tiny_qwen2 if family == "qwen2" else mconfig.tiny_llama
  cfg = preset(vocab_size=len(tok), num_layers=1)
  out = save_hf(tf.init(cfg, seed=0), cfg, tmp_path / "export", tokenizer=tok)
  loaded = {
    "AutoTokenizer": transformers.AutoTokenizer.from_pretrained(out),
    "AutoTokenizer(trust_remote_code)": transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True),
    "load_tokenizer": tk.load_tokenizer(out),
  }
  texts = _random_texts(1000, seed=1) + ["[3, 1, 6]>4:", "Use 3, 7, 25 to make 42: (25 - 7) * 3 = 54"]
  want = tok(texts, add_special_tokens=False)["input_ids"]
  assert want[-2] == tok("[3, 1, 6]>4:", add_special_tokens=False)["input_ids"]
  for name, other in loaded.items():
    assert other(texts, add_special_tokens=False)["input_ids"] == want, name
    assert (other.eos_token, other.pad_token) == (tok.eos_token, tok.pad_token), name
    for s, ids in zip(texts, want):
      if kind == "bpe" or all(c in tk.CHARS for c in s):
        assert other.decode(ids) == s, (name, s)
  if kind == "char":  # the space is a token of its own, as in training
    assert want[-2] == [65, 25, 18, 6, 23, 18, 6, 28, 67, 36, 26, 32]


def test_chat_template_or_plain():
  tok = tk.build_char_tokenizer()
  s = tk.apply_chat_template_or_plain(tok, "1+1?", system="Be brief.")
  assert s == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")
  ids = tok(s, add_special_tokens=False)["input_ids"]
  assert ids[0] == 1 and ids.count(2) == 2
  tok.chat_template = None
  assert tk.apply_chat_template_or_plain(tok, "1+1?") == "1+1?"
  with pytest.raises(ValueError, match="system"):
    tk.apply_chat_template_or_plain(tok, "1+1?", system="x")
  with pytest.raises(ValueError, match="chat_template"):
    tk.apply_chat_template_or_plain(tok, [{"role": "user", "content": "hi"}])


# The non-tool branch of Qwen2.5-Instruct's tokenizer_config.json chat_template (Qwen3's adds thinking blocks).
QWEN25_CHAT_TEMPLATE = (
  "{%- if messages[0]['role'] == 'system' %}"
  "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
  "{%- else %}"
  "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
  "{%- endif %}"
  "{%- for message in messages %}"
  "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
  "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
  "{%- endif %}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_qwen25_chat_template_from_tokenizer_config(tmp_path):
  """A BPE tokenizer built here, saved with Qwen2.5's chat template in tokenizer_config.json (as the Qwen2.5 /
  Qwen3 tokenizer files carry it), is loaded by load_tokenizer (model.tokenizer / model.checkpoint) and its
  template, default system prompt included, wraps task prompts when task.chat_template is on."""
  tok = _byte_level_bpe()
  tok.add_special_tokens({"additional_special_tokens": [tk.IM_START]})
  out = str(tmp_path / "qwen_tok")
  tok.save_pretrained(out)
  for name in os.listdir(out):  # transformers 5 writes chat_template.jinja; Qwen's files use the json field
    if name.endswith(".jinja"):
      os.remove(os.path.join(out, name))
  with open(os.path.join(out, "tokenizer_config.json")) as f:
    cfg = json.load(f)
  cfg["chat_template"] = QWEN25_CHAT_TEMPLATE
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(cfg, f)
  loaded = tk.load_tokenizer(out)
  want = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
  )
  assert tk.apply_chat_template_or_plain(loaded, "1+1?") == want
  assert tk.apply_chat_template_or_plain(loaded, "1+1?", system="Be brief.").startswith(
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
  )
  prob = type("P", (), {"prompt": "1+1?"})()
  [ids] = tk.encode_prompts(loaded, [prob], chat_template=True)
  assert ids == loaded(want, add_special_tokens=False)["input_ids"]
  start = loaded.convert_tokens_to_ids(tk.IM_START)
  assert ids[0] == start and ids.count(start) == 3 and loaded.decode(ids) == want
  assert tk.encode_prompts(loaded, [prob], chat_template=False) == [
    loaded("1+1?", add_special_tokens=False)["input_ids"]
  ]
