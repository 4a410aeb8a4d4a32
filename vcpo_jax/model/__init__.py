"""The policy model: config, NNX transformer, Hugging Face interop, tokenizers."""

from vcpo_jax.model.config import ModelConfig
from vcpo_jax.model.hf_io import hf_forward, load_hf, make_tiny_checkpoint, save_hf
from vcpo_jax.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer", "hf_forward", "load_hf", "make_tiny_checkpoint", "save_hf"]
