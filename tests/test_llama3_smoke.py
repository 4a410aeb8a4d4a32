"""Smoke: a Llama 3.1-style checkpoint written by transformers (llama3 RoPE, untied) trains through the real
trainer; the trained weights sample with the KV cache as the full forward predicts, and export back to
transformers with equal logits."""

import jax
import numpy as np
import pytest

from tests import fixtures
from tests.test_qwen3_smoke import train_checkpoint
from tests.test_rope_parity import T_LONG, V
from vcpo_jax.model import hf_forward, hf_io, save_hf
from vcpo_jax.model import transformer as tf
from vcpo_jax.sampler import Sampler, SamplerConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_llama3_checkpoint_trains_samples_and_exports(tmp_path, monkeypatch):
  ckpt, final = train_checkpoint(tmp_path, monkeypatch, "llama", "llama3", seed=11)
  cfg, start = hf_io.load_hf(ckpt)
  assert cfg.rope_scaling.rope_type == "llama3" and not cfg.tie_embeddings
  graphdef, before = tf.split(start)
  kernel = lambda p: np.asarray(p["lm_head"]["kernel"][...])
  assert np.abs(kernel(final) - kernel(before)).max() > 1e-4  # trained
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(final))

  # Export the trained weights; transformers' logits past original_max_position_embeddings equal ours.
  out = save_hf(final, cfg, tmp_path / "export")
  back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  assert back.config.rope_parameters["rope_type"] == "llama3"
  tokens = np.random.default_rng(4).integers(1, V, size=(2, T_LONG)).astype(np.int32)
  theirs, ours = fixtures.hf_logits(back, tokens), hf_forward(out, tokens)
  assert np.abs(ours - theirs).max() <= 1e-4 * theirs.std()

  # Greedy decoding with the KV cache picks, at every step, the argmax of the full forward of the sequence.
  params = jax.tree.map(jax.numpy.asarray, final)
  smp = Sampler(graphdef, cfg, SamplerConfig(temperature=0.0, eos_id=None, pad_id=0, max_new_tokens=24))
  prompts = [list(map(int, p)) for p in tokens[:, :8]]
  gen = smp.generate(params, prompts, jax.random.key(0), max_new_tokens=24)
  toks, resp = np.asarray(gen.tokens), np.asarray(gen.response_mask)
  for prompt, row, mask in zip(prompts, toks, resp):
    seq = np.asarray(prompt + list(map(int, row[mask])), np.int32)  # 8 prompt + 24 new tokens
    assert len(seq) == 32
    full = hf_forward(out, seq[None])[0]
    assert full[7:-1].argmax(-1).tolist() == seq[8:].tolist()
