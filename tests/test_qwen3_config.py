"""configs/math.py:qwen3_8b: the Qwen3-8B architecture block against transformers' own parameter count."""

import pytest

from benchmarks import memory
from vcpo_jax.model import hf_io

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_qwen3_8b_shape_has_the_published_parameter_count():
  s = memory.load_setting("math:qwen3_8b")
  cfg = s.model_cfg
  assert (cfg.model_type, cfg.qk_norm, cfg.qkv_bias, cfg.num_layers) == ("qwen3", True, False, 36)
  hf = hf_io.hf_config(cfg)  # the exporter's transformers.Qwen3Config; the model card anchors the count below
  assert type(hf) is transformers.Qwen3Config and not hf.tie_word_embeddings
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf).parameters())
  assert cfg.num_params == theirs
  embed = 2 * cfg.vocab_size * cfg.hidden_size
  assert cfg.num_params == pytest.approx(8.19e9, rel=0.002)  # Qwen3-8B model card: 8.2B, 6.95B non-embedding
  assert cfg.num_params - embed == pytest.approx(6.95e9, rel=0.002)
