"""Rotary position embeddings and their scaling rules, as transformers 5.24 defines them.

Source: transformers/modeling_rope_utils.py (`ROPE_INIT_FUNCTIONS`). With base theta and
rotary width H, the default inverse frequencies are inv_freq_i = theta^(-2i/H), i < H/2, and
a token at position p is rotated by angles p * inv_freq (rotate-half convention, cos and sin
of [angles, angles]) and then scaled by the attention factor m (q and k both, so the scores
by m^2). The scaled types change inv_freq (and m):

  "default": unchanged, m = 1.
  "linear":  inv_freq / factor.
  "dynamic": NTK-aware, base theta' = theta * (factor * L / M - (factor - 1))^(H / (H - 2)),
             L = max(seq_len, M), M = max_position_embeddings; seq_len = max(positions) + 1
             of the call (transformers: the forward's position_ids). For L = M it is the
             default RoPE.
  "llama3":  wavelengths w = 2 pi / inv_freq; w > O / low_freq_factor: inv_freq / factor;
             w < O / high_freq_factor: unchanged; in between the smooth mix
             (1 - s) inv_freq / factor + s inv_freq, s = (O / w - low) / (high - low);
             O = original_max_position_embeddings.
  "yarn":    inv_freq = interp * (1 - e) + extrap * e, interp = inv_freq / factor, extrap =
             inv_freq, e = 1 - ramp over the correction range [low, high] of dims from
             beta_fast / beta_slow rotations in O (floored / ceiled when truncate);
             m = attention_factor, else mscale(factor, mscale) / mscale(factor,
             mscale_all_dim) when both are set, else mscale(factor) = 0.1 ln(factor) + 1
             (1 for factor <= 1). factor defaults to M / O.

KV-cache decode and "dynamic": transformers recomputes the frequencies in each forward from
that call's largest position (it only grows them past M), so during generation each step's
new keys are rotated with the frequencies of that step, and cached keys keep the rotation
they were written with. `inv_freq` takes the call's positions and does the same: a full
forward of length T uses L = T, a prefill its prompt length, each decode step its position
+ 1 (the largest over the batch, as transformers' torch.max(position_ids)). One departure: a
prefill split into chunks (SamplerConfig.prefill_chunk) rotates each chunk with that chunk's
largest position, where transformers' one-pass prefill uses the prompt's; the two agree while
the prompt fits in M or in one chunk. A checkpoint's ModelConfig.max_position is M x factor
for "dynamic" (the longest sequence it is meant for), M itself stays in `original_max_position`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """One RoPE scaling rule and its parameters (the fields of HF `rope_parameters` it uses).

  Attributes:
    rope_type: one of ROPE_TYPES.
    factor: context extension factor (linear, dynamic, llama3, yarn).
    original_max_position: pre-extension context length O (llama3, yarn); for "dynamic" the
      config's max_position_embeddings M (its reference length).
    low_freq_factor, high_freq_factor: llama3's band edges.
    beta_fast, beta_slow: yarn's correction-range rotations.
    attention_factor: yarn's m (None: derived from factor / mscale / mscale_all_dim).
    mscale, mscale_all_dim: yarn's (DeepSeek-style) attention-factor inputs.
    truncate: yarn floors / ceils the correction range.
  """

  rope_type: str = "default"
  factor: float | None = None
  original_max_position: int | None = None
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  beta_fast: float | None = None
  beta_slow: float | None = None
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope_parameters.rope_type={self.rope_type!r} is not supported; supported: {ROPE_TYPES}.")
    need = {
      "linear": ("factor",),
      "dynamic": ("factor", "original_max_position"),
      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position"),
      "yarn": ("factor", "original_max_position"),
    }.get(self.rope_type, ())
    for name in need:
      if getattr(self, name) is None:
        raise ValueError(f"RopeScaling.{name} is required for rope_type={self.rope_type!r}, got None.")

  @classmethod
  def from_hf(cls, params: dict | None, max_position: int) -> RopeScaling:
    """From transformers' `config.rope_parameters` (or a legacy `rope_scaling` dict).

    max_position is the config's max_position_embeddings M: "dynamic" keeps it as its
    original_max_position (its reference length), "yarn" without a factor takes M / O."""
    p = dict(params or {})
    kind = p.get("rope_type", p.get("type")) or "default"
    if kind not in ROPE_TYPES:
      raise ValueError(f"rope_parameters.rope_type={kind!r} is not supported; supported: {ROPE_TYPES}.")
    get = lambda k: None if p.get(k) is None else float(p[k])
    omp = max_position if kind == "dynamic" else p.get("original_max_position_embeddings")
    factor = get("factor")
    if kind == "yarn" and factor is None and omp:
      factor = max_position / int(omp)
    return cls(
      rope_type=kind,
      factor=factor,
      original_max_position=None if omp is None else int(omp),
      low_freq_factor=get("low_freq_factor"),
      high_freq_factor=get("high_freq_factor"),
      beta_fast=get("beta_fast"),
      beta_slow=get("beta_slow"),
      attention_factor=get("attention_factor"),
      mscale=get("mscale"),
      mscale_all_dim=get("mscale_all_dim"),
      truncate=bool(p.get("truncate", True)),
    )

  def to_hf(self, theta: float) -> dict:
    """The HF `rope_parameters` dict (rope_theta included), only the fields this type uses."""
    out = {"rope_type": self.rope_type, "rope_theta": float(theta)}
    fields = {
      "factor": self.factor,
      "original_max_position_embeddings": self.original_max_position,
      "low_freq_factor": self.low_freq_factor,
      "high_freq_factor": self.high_freq_factor,
      "beta_fast": self.beta_fast,
      "beta_slow": self.beta_slow,
      "attention_factor": self.attention_factor,
      "mscale": self.mscale,
      "mscale_all_dim": self.mscale_all_dim,
    }
    if self.rope_type == "dynamic":  # its reference length is the config's max_position_embeddings
      fields.pop("original_max_position_embeddings")
    if self.rope_type != "default":
      out.update({k: v for k, v in fields.items() if v is not None})
    if self.rope_type == "yarn":
      out["truncate"] = self.truncate
    return out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def static_inv_freq(h: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
  """(inv_freq float32 [H/2], attention factor m) of every type but "dynamic" (float32 as torch)."""
  if s.rope_type == "dynamic":
    raise ValueError("static_inv_freq: rope_type='dynamic' depends on the sequence length; use inv_freq.")
  exps = np.arange(0, h, 2, dtype=np.float32) / np.float32(h)
  inv = (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)
  if s.rope_type == "default":
    return inv, 1.0
  if s.rope_type == "linear":
    return (inv / np.float32(s.factor)).astype(np.float32), 1.0
  if s.rope_type == "llama3":
    o, lo, hi, f = s.original_max_position, s.low_freq_factor, s.high_freq_factor, s.factor
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    llama = np.where(wavelen > o / lo, inv / np.float32(f), inv).astype(np.float32)
    smooth = ((o / wavelen - lo) / (hi - lo)).astype(np.float32)
    smoothed = ((1 - smooth) * llama / np.float32(f) + smooth * llama).astype(np.float32)
    medium = ~(wavelen < o / hi) & ~(wavelen > o / lo)
    return np.where(medium, smoothed, llama).astype(np.float32), 1.0
  if s.rope_type == "yarn":
    o = s.original_max_position
    factor = s.factor
    m = s.attention_factor
    if m is None:
      if s.mscale and s.mscale_all_dim:
        m = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
      else:
        m = _yarn_mscale(factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1
    corr = lambda rot: (h * math.log(o / (rot * 2 * math.pi))) / (2 * math.log(theta))
    low, high = corr(beta_fast), corr(beta_slow)
    if s.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, h - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(h // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrap = (1 - ramp).astype(np.float32)
    pos_freqs = (np.float32(theta) ** exps).astype(np.float32)
    inv_ex, inv_in = (1.0 / pos_freqs).astype(np.float32), (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    return (inv_in * (1 - extrap) + inv_ex * extrap).astype(np.float32), float(m)
  raise AssertionError(s.rope_type)  # RopeScaling validates rope_type


def inv_freq(h: int, theta: float, s: RopeScaling, positions_bt: jax.Array):
  """(inv_freq float32 [H/2], m): `static_inv_freq`, or for "dynamic" the call's NTK base (traced)."""
  if s.rope_type == "default":  # computed in jnp, bitwise the model's RoPE before scaling existed
    return 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)), 1.0
  if s.rope_type != "dynamic":
    inv, m = static_inv_freq(h, theta, s)
    return jnp.asarray(inv), m
  big_m = s.original_max_position
  seq_len = jnp.maximum(jnp.max(positions_bt) + 1, big_m).astype(jnp.float32)
  base = theta * ((s.factor * seq_len / big_m) - (s.factor - 1)) ** (h / (h - 2))
  exps = jnp.arange(0, h, 2, dtype=jnp.float32) / h
  return 1.0 / (base**exps), 1.0


def tables(positions_bt: jax.Array, inv_freq_h: jax.Array, m: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(cos, sin), float32 [B, T, 1, H]: the rotation of tokens at `positions_bt` (rotate-half layout), times m."""
  angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq_h  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if m != 1.0:
    cos, sin = cos * m, sin * m
  return cos, sin


def rotate(x_btnh: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, N, H] rotated by `tables`' (cos, sin); computed in float32, returned in x's dtype."""
  x32 = x_btnh.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x_btnh.dtype)


def apply(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq_h: jax.Array, m: float = 1.0) -> jax.Array:
  """x rotated by positions * inv_freq (rotate-half), times m; computed in float32, returned in x's dtype."""
  return rotate(x_btnh, *tables(positions_bt, inv_freq_h, m))
