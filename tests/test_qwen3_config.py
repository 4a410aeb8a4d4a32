"""configs/math.py:qwen3_8b: the Qwen3-8B architecture block against transformers' own parameter count."""

import pytest

from benchmarks import memory

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_qwen3_8b_shape_has_the_published_parameter_count():
  s = memory.load_setting("math:qwen3_8b")
  cfg = s.model_cfg
  assert (cfg.model_type, cfg.qk_norm, cfg.qkv_bias, cfg.num_layers) == ("qwen3", True, False, 36)
  hf = transformers.Qwen3Config(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.hidden_size,
    intermediate_size=cfg.intermediate_size,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    tie_word_embeddings=False,
  )
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf).parameters())
  assert cfg.num_params == theirs
  embed = 2 * cfg.vocab_size * cfg.hidden_size
  assert cfg.num_params == pytest.approx(8.19e9, rel=0.002)  # Qwen3-8B model card: 8.2B, 6.95B non-embedding
  assert cfg.num_params - embed == pytest.approx(6.95e9, rel=0.002)
