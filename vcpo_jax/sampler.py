"""Jitted autoregressive generation with a KV cache: tokens, masks and behavior log-probs.

Shape legend: P prompts, G samples per prompt, N = P * G rows (trajectories), B the batch bucket (N rows
padded up to a bucket, chunked when N exceeds the largest), Tp the prompt-length bucket, Tn the new-token
bucket, T = Tp + Tn, S = T the KV-cache length, V vocab.

Layout (what the learner consumes, one row per trajectory):

    tokens[n] = [pad ... pad, prompt_0 ... prompt_{L-1}, resp_0 ... resp_{R-1}, pad ... pad]
                 |<--------------- Tp (left-padded) ---->|<-------- Tn (right-padded) ---->|

prompt_mask marks the prompt tokens, response_mask the generated tokens up to and including the stop token
(EOS or any stop id), behavior_logp[n, t] is the log-prob of tokens[n, t] under the distribution it was
sampled from (0 outside the response). `transformer.sequence_logprobs(graphdef, params, tokens,
prompt_mask | response_mask)` scores exactly these rows (positions count real tokens).

Behavior log-probs (`SamplerConfig.logp_mode`):
  * "sampled" (default): log mu(y_t), mu the distribution y_t was drawn from: softmax(logits / temperature),
    then top-k, then top-p (over the top-k-renormalized distribution), renormalized over the kept tokens:
    the denominator of the importance ratios pi / mu. Greedy (temperature 0) records 0.
  * "tempered": log softmax(logits / temperature)(y_t), no filtering (not a sampling distribution when
    filtering is on; for comparison with systems that record it). Greedy records the temperature-1 log-prob.
  The learner scores log pi(y_t) = log softmax(logits)(y_t) at temperature 1, over the full vocabulary or,
  with support replay (`record_support`), over the support the sampler kept for y_t (model/support.py).
  Equal weights on-policy iff temperature = 1 and (top_k = 0 and top_p = 1, or support replay).

Recompilation: prompt lengths, batch sizes and new-token counts are padded to fixed buckets, so after one
call per (B, Tp, Tn) bucket nothing traces again; max_new_tokens within a bucket and the stop ids are runtime
values. Randomness is per row: row n's token i uses fold_in(fold_in(rng, n), i), whatever rows share its
batch. The draw (`SamplerConfig.draw`): "inverse_cdf", an exact two-level inverse CDF with two uniforms per
row (`inverse_cdf_sample`), or "gumbel" (jax.random.categorical): the same distribution, another stream.

Decode loops (`SamplerConfig.decode`): "static" runs a batch's whole generation in one jitted while_loop
(`_generate_device`); "chunked" and "refill" are host-driven (`Sampler._run_chunked`): B slots, jitted
chunks of `chunk_tokens` steps (`_chunk_device`); between chunks finished rows are collected and, with
"refill", waiting rows start in the freed slots (`_refill_device`), and the parameters may change
(`generate(on_chunk=...)`: each token records its version in Rollout.token_version, its log-prob is that
version's; the KV cache is kept unless `recompute_kv`). Rows come back in prompt-major order; the three modes
draw the same tokens for the same key.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vcpo_jax import mesh as mesh_lib
from vcpo_jax import sharding as sh
from vcpo_jax.schema import check_field, finite
from vcpo_jax.model import moe, quant, support, transformer
from vcpo_jax.model.config import ModelConfig

LOGP_MODES = ("sampled", "tempered")
DRAWS = ("inverse_cdf", "gumbel")
PARAM_DTYPES = ("", "auto", "float32", "bfloat16", "int8")
DECODE_MODES = ("static", "chunked", "refill")
DECODE_LAYERS = ("auto", "scan", "unrolled")  # SamplerConfig.decode_layers
LOWER_PARTS = ("generate", "prefill", "decode")  # Sampler.lower: what is compiled


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Sampling settings and shape buckets.

  Attributes:
    temperature: softmax temperature; 0.0 means greedy (argmax).
    top_k: keep the k most likely tokens; 0 disables.
    top_p: nucleus mass in (0, 1]; 1.0 disables. Applied after top-k.
    eos_id: end-of-sequence token id, or None.
    stop_ids: further token ids that end a response (included in it, like EOS).
    pad_id: token written in padding positions (never attended to).
    max_new_tokens: default response budget per row.
    prompt_buckets: allowed padded prompt lengths Tp (ascending).
    new_token_buckets: allowed padded response lengths Tn (ascending).
    batch_buckets: allowed padded batch sizes B (ascending); larger N is chunked: `_run` runs rows beyond the
      largest bucket as further sequential calls (each row keeps its key, so the rows are the same), the
      chunked / refill engine keeps that many slots and starts the rest as slots free up.
    max_batch: rows per device call, 0 = no cap. Buckets above it are replaced by it (`__post_init__`, so a
      `dataclasses.replace` copy is capped too): N rows run as ceil(N / max_batch) sequential calls, which
      bounds the KV cache and all else that grows with B, at the cost of more sequential decode loops.
    logp_mode: "sampled" or "tempered", see the module docstring.
    draw: "inverse_cdf" (two uniforms per row, `inverse_cdf_sample`) or "gumbel" (Gumbel noise over [B, V]:
      earlier runs' tokens per seed). Same distribution, another stream.
    prefill_chunk: prompt tokens per prefill pass (0: the whole prompt bucket in one pass). Chunk c
      attends to the cache prefix written so far, so prefill holds [B, heads, chunk, c * chunk]
      scores instead of [B, heads, Tp, Tp] (and [B, chunk, V] logits).
    param_dtype: "" (use the parameters as given), "float32", "bfloat16", "auto" (bfloat16 when the
      sampler's devices are accelerators, the parameters as given on CPU), or "int8" (the blocks' projection
      kernels int8 with per-output-channel scales, dequantized inside the matmul, `vcpo_jax.model.quant`;
      the other floats as "auto"; the behaviour log-probs are then the int8 model's). `Sampler.prepare_params`
      casts (and places) a published version once; unprepared parameters are cast once per jitted call.
      The KV cache is always in the model's compute dtype (ModelConfig.dtype).
    mesh_shape: (data, fsdp, tensor) shape of the mesh a sampler process builds over its own devices
      (`sampler_mesh`; -1 = all remaining). The sync/lag trainer shares the learner's mesh instead.
    decode: "static" (default: one on-device loop, every row runs until the longest ends), "chunked"
      (host-driven chunks of `chunk_tokens` steps; the parameters may change between them) or "refill"
      (chunked, and a finished row's slot takes the next waiting row: continuous batching); module docstring.
    chunk_tokens: decode steps per chunk ("chunked" / "refill").
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  eos_id: int | None = None
  stop_ids: tuple[int, ...] = ()
  pad_id: int = 0
  max_new_tokens: int = 128
  prompt_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
  new_token_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
  batch_buckets: tuple[int, ...] = (1, 4, 16, 64, 256)
  max_batch: int = 0
  logp_mode: str = "sampled"
  draw: str = "inverse_cdf"
  prefill_chunk: int = 0
  param_dtype: str = ""
  mesh_shape: tuple[int, int, int] = (-1, 1, 1)
  decode: str = "static"
  # The static decode step's layer loop: "scan" (the stacked cache and weights, one scanned block: compile time
  # flat in depth) or "unrolled" (one cache buffer pair per layer and a Python loop over the layers: XLA:CPU then
  # reads each layer's cache and weights in place instead of copying its slice before every matmul, at a compile
  # time that grows with depth; transformer._run_layers_unrolled). Same tokens and log-probs. "auto" follows the
  # model's layout: unrolled for a dense model with unrolled layers (ModelConfig.scan_layers False) and static decode.
  decode_layers: str = "auto"
  chunk_tokens: int = 32
  record_topk: int = 0  # K > 0: record each token's top-K ids and post-filter log-probs (top-k score centering)
  record_support: bool = False  # record each token's kept support (model/support.py: the learner replays it)
  record_routing: bool = False  # MoE: record the experts each response token went through (Batch.expert_ids)

  def __post_init__(self):
    if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
      raise ValueError(f"SamplerConfig.temperature must be >= 0 (0 = greedy), got {self.temperature}.")
    if self.top_k < 0:
      raise ValueError(f"SamplerConfig.top_k must be >= 0 (0 disables), got {self.top_k}.")
    if not isinstance(self.record_topk, int) or self.record_topk < 0 or (self.record_topk and self.greedy):
      raise ValueError(
        f"SamplerConfig.record_topk={self.record_topk!r}: an int >= 0, and 0 when greedy (temperature 0)."
      )
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplerConfig.top_p must be in (0, 1] (1 disables), got {self.top_p}.")
    if self.record_support and (self.greedy or self.logp_mode != "sampled"):
      raise ValueError(
        "SamplerConfig.record_support: the kept support of a sampled token needs temperature > 0 and "
        f"logp_mode='sampled' (have temperature={self.temperature}, logp_mode={self.logp_mode!r})."
      )
    if self.logp_mode not in LOGP_MODES:
      raise ValueError(f"SamplerConfig.logp_mode must be one of {LOGP_MODES}, got {self.logp_mode!r}.")
    if self.draw not in DRAWS:
      raise ValueError(f"SamplerConfig.draw must be one of {DRAWS}, got {self.draw!r}.")
    if self.prefill_chunk < 0:
      raise ValueError(f"SamplerConfig.prefill_chunk must be >= 0 (0 = one pass), got {self.prefill_chunk}.")
    if self.param_dtype not in PARAM_DTYPES:
      raise ValueError(f"SamplerConfig.param_dtype must be one of {PARAM_DTYPES}, got {self.param_dtype!r}.")
    try:
      object.__setattr__(self, "mesh_shape", mesh_lib.MeshConfig(tuple(self.mesh_shape)).shape)
    except ValueError as e:
      raise ValueError(f"SamplerConfig.mesh_shape: {e}") from None
    if self.decode not in DECODE_MODES:
      raise ValueError(f"SamplerConfig.decode must be one of {DECODE_MODES}, got {self.decode!r}.")
    if self.decode_layers not in DECODE_LAYERS or (self.decode_layers == "unrolled" and self.decode != "static"):
      raise ValueError(
        f"SamplerConfig.decode_layers must be one of {DECODE_LAYERS} ('unrolled' with decode='static'), "
        f"got {self.decode_layers!r} (decode={self.decode!r})."
      )
    if self.chunk_tokens <= 0:
      raise ValueError(
        f"SamplerConfig.chunk_tokens must be positive (decode steps per chunk), got {self.chunk_tokens}."
      )
    if self.max_new_tokens <= 0:
      raise ValueError(f"SamplerConfig.max_new_tokens must be positive, got {self.max_new_tokens}.")
    for name in ("prompt_buckets", "new_token_buckets", "batch_buckets"):
      b = tuple(getattr(self, name))
      if not b or any(int(x) <= 0 for x in b) or list(b) != sorted(set(b)):
        raise ValueError(
          f"SamplerConfig.{name} must be a non-empty strictly increasing list of positive ints, got {b}."
        )
      object.__setattr__(self, name, tuple(int(x) for x in b))
    if not (isinstance(self.max_batch, int) and self.max_batch >= 0):
      raise ValueError(
        f"SamplerConfig.max_batch must be an int >= 0 (rows per call; 0 = no cap), got {self.max_batch!r}."
      )
    if self.max_batch and self.batch_buckets[-1] > self.max_batch:
      capped = tuple(x for x in self.batch_buckets if x < self.max_batch) + (self.max_batch,)
      object.__setattr__(self, "batch_buckets", capped)
    if self.max_new_tokens > self.new_token_buckets[-1]:
      raise ValueError(
        f"SamplerConfig.max_new_tokens={self.max_new_tokens} exceeds the largest "
        f"new_token_buckets entry {self.new_token_buckets[-1]}; add a bigger bucket."
      )
    object.__setattr__(self, "stop_ids", tuple(int(x) for x in self.stop_ids))

  @classmethod
  def from_tokenizer(
    cls, tokenizer, *, max_prompt_len: int, max_new_tokens: int, batch_sizes: Sequence[int], **settings
  ) -> "SamplerConfig":
    """The trainer's sampler: one prompt bucket, one response bucket, the batch sizes it will see.

    Args:
      tokenizer: gives eos_id and pad_id (its pad token, else EOS, else 0).
      max_prompt_len, max_new_tokens: the only prompt / response buckets (rollouts pad to them).
      batch_sizes: the row counts a call can have (training N, evaluation rows, 1); deduplicated, sorted.
      settings: any other field (temperature, top_p, top_k, draw, param_dtype, mesh_shape, ...).
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    return cls(
      eos_id=eos,
      pad_id=pad,
      max_new_tokens=max_new_tokens,
      prompt_buckets=(max_prompt_len,),
      new_token_buckets=(max_new_tokens,),
      batch_buckets=tuple(sorted(set(batch_sizes))),
      **settings,
    )

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def all_stop_ids(self) -> tuple[int, ...]:
    return tuple(sorted(set(self.stop_ids) | ({self.eos_id} if self.eos_id is not None else set())))


def unrolled_decode(cfg: SamplerConfig, cfg_model: ModelConfig) -> bool:
  """Whether the static decode step loops over per-layer caches (decode_layers "unrolled", or "auto" for a dense
  model whose layers are unrolled, cfg_model.scan_layers False, under static decode)."""
  if cfg.decode_layers == "auto":
    return not cfg_model.scan_layers and cfg_model.moe is None and cfg.decode == "static"
  return cfg.decode_layers == "unrolled"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Training-rollout sampling (config.sampler); the evaluation protocol has its own (config.eval)."""

  temperature: float = SamplerConfig.temperature  # training rollouts (released runs: 1.0)
  top_p: float = SamplerConfig.top_p  # 1.0 = off (keeps behavior log-probs equal to the policy's)
  top_k: int = SamplerConfig.top_k  # 0 = off
  draw: str = SamplerConfig.draw  # token draw: inverse_cdf (2 uniforms/row) | gumbel (earlier runs' stream)
  param_dtype: str = "auto"  # sampler weights: auto (bf16 on accelerators, as given on CPU) | float32 | bfloat16 | int8
  mesh_shape: tuple = SamplerConfig.mesh_shape  # async sampler's (data, fsdp, tensor) mesh (sync/lag: learner's)
  prefill_chunk: int = SamplerConfig.prefill_chunk  # prompt tokens per prefill pass; 0 = one pass (bounds memory)
  max_batch: int = SamplerConfig.max_batch  # rows per sampler call (whole groups); 0 = all; more: sequential calls
  support_replay: str = "auto"  # learner renormalises over the sampler's kept support: auto (= a filter on) | on | off
  decode_layers: str = SamplerConfig.decode_layers  # decode's layer loop: auto (as model.scan_layers) | scan | unrolled

  def __post_init__(self):
    check_field(
      isinstance(self.max_batch, int) and self.max_batch >= 0,
      "sampler.max_batch",
      self.max_batch,
      "must be an int >= 0 (rows per sampler call; 0 = all rows of a step in one call).",
    )
    check_field(
      isinstance(self.prefill_chunk, int) and self.prefill_chunk >= 0,
      "sampler.prefill_chunk",
      self.prefill_chunk,
      "must be an int >= 0 (0 = the whole prompt bucket in one pass; e.g. 512 bounds prefill memory).",
    )
    check_field(self.draw in ("inverse_cdf", "gumbel"), "sampler.draw", self.draw, "use inverse_cdf or gumbel.")
    check_field(
      self.decode_layers in DECODE_LAYERS, "sampler.decode_layers", self.decode_layers, f"use {DECODE_LAYERS}."
    )
    check_field(
      self.param_dtype in PARAM_DTYPES,
      "sampler.param_dtype",
      self.param_dtype,
      "use auto (bf16 on accelerators), float32, bfloat16 or int8 (per-channel int8 projection kernels).",
    )
    try:
      object.__setattr__(self, "mesh_shape", mesh_lib.MeshConfig(tuple(self.mesh_shape)).shape)
    except (ValueError, TypeError) as e:
      check_field(False, "sampler.mesh_shape", self.mesh_shape, f"{e}")
    check_field(
      finite(self.temperature) and self.temperature > 0,
      "sampler.temperature",
      self.temperature,
      "training rollouts need a finite temperature > 0 (greedy behavior log-probs are degenerate); released: 1.0.",
    )
    check_field(finite(self.top_p) and 0 < self.top_p <= 1, "sampler.top_p", self.top_p, "must be in (0, 1] (1 = off).")
    check_field(self.top_k >= 0, "sampler.top_k", self.top_k, "must be >= 0 (0 = off).")
    check_field(
      self.support_replay in ("auto", "on", "off"),
      "sampler.support_replay",
      self.support_replay,
      "use auto (on when top_p < 1 or top_k > 0), on or off.",
    )

  @property
  def replays_support(self) -> bool:
    """Whether training rollouts record their kept support for the learner to replay (model/support.py)."""
    return self.support_replay == "on" or (self.support_replay == "auto" and (self.top_p < 1.0 or self.top_k > 0))

  def sampler_kwargs(self, **override) -> dict:
    """The SamplerConfig fields these settings give (an evaluation overrides temperature / top_p / top_k);
    support_replay becomes the training sampler's record_support (the trainer sets it)."""
    return {**{k: v for k, v in dataclasses.asdict(self).items() if k != "support_replay"}, **override}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
  """Generated trajectories (numpy arrays), row n = prompt n // G, sample n % G.

  Attributes:
    tokens: int32 [N, T] left-padded prompt then right-padded response.
    prompt_mask: bool [N, T] prompt tokens.
    response_mask: bool [N, T] generated tokens up to and including the stop token.
    behavior_logp: float32 [N, T] log mu(tokens[:, t]) on the response, 0 elsewhere.
    lengths: int32 [N] response lengths (sum of response_mask).
    prompt_lengths: int32 [N] prompt lengths (sum of prompt_mask).
    finished: bool [N] the response ended with EOS / a stop id (False: hit the budget).
    group_id: int32 [N] index of the prompt the row answers.
    token_version: int32 [N, T] parameter version that sampled each response token (-1 elsewhere);
      with in-flight updates (`generate(on_chunk=...)`) a row may span several versions.
  """

  tokens: np.ndarray
  prompt_mask: np.ndarray
  response_mask: np.ndarray
  behavior_logp: np.ndarray
  lengths: np.ndarray
  prompt_lengths: np.ndarray
  finished: np.ndarray
  group_id: np.ndarray
  token_version: np.ndarray | None = None
  # Per-token records over the Tn response columns only (column r is token column Tp + r); None when not recorded:
  topk_ids: np.ndarray | None = None  # int32 [N, Tn, K] (record_topk): the top-K ids response token r was drawn among
  topk_logp: np.ndarray | None = None  # float32 [N, Tn, K]: their post-filter log-probs (0 off the response)
  support_thr: np.ndarray | None = None  # float32 [N, Tn] (record_support): model/support.py (-inf off the response)
  expert_ids: np.ndarray | None = None  # int16 [N, Tn, L K] (record_routing): routing_width's record, -1 unrecorded


# ----------------------------------------------------------------------------- MoE routing record


def routing_width(cfg_model: ModelConfig, cfg: SamplerConfig) -> int:
  """E = L K, the routing entries recorded per token (record_routing on an MoE model), else 0.

  Response column r of the record (Rollout / Batch.expert_ids [N, R, E]) holds the experts response token r
  went through in each layer (layer-major, K per layer) when the sampler fed it to draw token r + 1: every
  response token but the last (which is never fed); -1 elsewhere. It is known one decode step after the
  column's other records (`column_records`, known when the token is drawn). The learner replays it on the
  token columns (batch.at_token_columns, -1 on the prompt: the learner's own routing there)."""
  return cfg_model.num_layers * cfg_model.num_experts_per_tok if cfg.record_routing and cfg_model.moe else 0


def _forward_routed(graphdef, params, *args, route: bool = False, layers=None, rot=None):
  """(logits, cache, ids): transformer.forward, with route the experts of the fed tokens [B, T, L K] int16.
  layers: per-layer block parameters with a per-layer cache (decode_layers="unrolled", dense only); rot: the
  fed tokens' RoPE (`transformer.rotation_at`) or None."""
  if not route:
    return (*transformer.forward(graphdef, params, *args, layers=layers, rot=rot), None)
  with moe.routing() as rec:
    logits, cache = transformer.forward(graphdef, params, *args, rot=rot)
  ids = jnp.moveaxis(rec.expert_ids, 0, 2)  # [L, B, T, K] -> [B, T, L, K]
  return logits, cache, ids.reshape(*ids.shape[:2], -1).astype(jnp.int16)


# ----------------------------------------------------------------------------- token choice


def sampled_topk(logits_bv, cfg: SamplerConfig):
  """(ids [B, K] int32, logp [B, K] f32): the top-K of the distribution `_choose` samples from, i.e.
  log softmax(filter_logits(logits, temperature, top_k, top_p)) (POST-filter: removed tokens have -inf and a
  token outside the kept set is never among them unless K exceeds it); K = cfg.record_topk."""
  lp = jax.nn.log_softmax(filter_logits(logits_bv, cfg.temperature, cfg.top_k, cfg.top_p), axis=-1)
  vals, ids = jax.lax.top_k(lp, cfg.record_topk)
  return ids.astype(jnp.int32), vals


def record_fields(cfg: SamplerConfig, e: int = 0) -> dict[str, tuple]:
  """{name: (dtype, trailing shape, fill)} of the per-column records cfg asks for (Rollout / Batch fields):
  the top-K ids and log-probs (record_topk), the kept support's threshold (record_support) and, with e > 0
  (`routing_width`), the MoE routing record. fill: the value of columns no token was drawn (or fed) in."""
  k = cfg.record_topk
  out = {"topk_ids": (jnp.int32, (k,), 0), "topk_logp": (jnp.float32, (k,), 0.0)} if k else {}
  if cfg.record_support:
    out["support_thr"] = (jnp.float32, (), support.NO_CUT)
  if e:
    out["expert_ids"] = (jnp.int16, (e,), -1)
  return out


def column_records(logits_bv, tok_b, cfg: SamplerConfig) -> dict:
  """The records of one decode column ({name: [B, ...]}, `record_fields`) for tokens tok_b drawn from logits_bv
  (all but the routing record, which the next decode step gives: `routing_width`)."""
  out = {}
  if cfg.record_topk:
    out["topk_ids"], out["topk_logp"] = sampled_topk(logits_bv, cfg)
  if cfg.record_support:
    x = logits_bv.astype(jnp.float32) / jnp.float32(cfg.temperature)
    x_f = filter_logits(logits_bv, cfg.temperature, cfg.top_k, cfg.top_p)
    out["support_thr"] = support.record_threshold(x, x_f, tok_b, cfg.temperature)
  return out


def empty_records(cfg: SamplerConfig, b: int, tn: int, e: int = 0) -> dict:
  """{name: [b, tn, ...]} of the records (e: `routing_width`), every column at its fill."""
  return {k: jnp.full((b, tn) + shp, fill, dt) for k, (dt, shp, fill) in record_fields(cfg, e).items()}


def filter_logits(logits_bv: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
  """Sampling logits: logits / temperature, then top-k, then top-p; removed tokens get -inf.

  softmax of the result is the distribution mu that tokens are drawn from. Top-p keeps
  the smallest prefix (by descending probability) whose mass reaches top_p: token j
  is kept iff the mass of strictly more likely tokens is < top_p (the most likely token
  is always kept; tokens tied with the last kept one are kept too).
  All settings are static Python values (one trace per setting).
  """
  x = logits_bv.astype(jnp.float32) / jnp.float32(temperature)
  v = x.shape[-1]
  if 0 < top_k < v:
    top_vals = jax.lax.top_k(x, top_k)[0]  # [B, k], descending
    x = jnp.where(x < top_vals[..., -1:], -jnp.inf, x)
    if top_p < 1.0:  # the nucleus lies inside the top-k set: decide it on the k sorted values
      x = jnp.where(x >= _nucleus_threshold_sorted(top_vals, top_p), x, -jnp.inf)
  elif top_p < 1.0:
    x = jnp.where(jax.nn.softmax(x, axis=-1) >= _nucleus_threshold(x, top_p), x, -jnp.inf)
  return x


def _nucleus_threshold_sorted(vals_bk: jax.Array, top_p: float) -> jax.Array:
  """The smallest kept logit [B, 1] of the nucleus over the top-k values vals_bk (descending).

  Position i is kept iff the mass of strictly larger values (ties share the mass of the first of
  their group) is < top_p, so `x >= result` keeps the same set as `_nucleus_threshold` on the
  top-k-filtered row: ties with the last kept value are kept too.
  """
  p = jax.nn.softmax(vals_bk, axis=-1)
  excl = jnp.cumsum(p, axis=-1) - p  # mass of the positions before i (sorted order)
  # For tied values the first of the group has the smallest excl: give every member its value.
  first = jnp.concatenate([jnp.ones_like(vals_bk[:, :1], bool), vals_bk[:, 1:] < vals_bk[:, :-1]], axis=-1)
  group_excl = jax.lax.cummax(jnp.where(first, excl, -1.0), axis=1)
  kept = group_excl < top_p
  return jnp.min(jnp.where(kept, vals_bk, jnp.inf), axis=-1, keepdims=True)


def _nucleus_threshold(x_bv: jax.Array, top_p: float) -> jax.Array:
  """Smallest probability tau with mass(probs > tau) < top_p, per row: [B, 1].

  Then {j : probs_j >= tau} = {j : mass of strictly more likely tokens < top_p}, the
  nucleus. Found by bisection over the int32 bit patterns of non-negative float32
  (ordered like the floats), so 31 masked sums over [B, V] give tau exactly; a full
  sort of the vocabulary per decode step is ~30x slower on CPU at V = 8192.
  """
  probs = jax.nn.softmax(x_bv, axis=-1)
  mass_above = lambda bits: jnp.sum(
    jnp.where(probs > jax.lax.bitcast_convert_type(bits, jnp.float32), probs, 0.0), axis=-1, keepdims=True
  )
  b = x_bv.shape[0]
  lo = jnp.zeros((b, 1), jnp.int32)  # bits of 0.0: mass above ~1 >= top_p
  hi = jnp.full((b, 1), np.float32(1.0).view(np.int32) + 1, jnp.int32)  # just above 1: mass 0

  def step(_, lohi):
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    below = mass_above(mid) < top_p
    return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

  _, hi = jax.lax.fori_loop(0, 31, step, (lo, hi))
  return jax.lax.bitcast_convert_type(hi, jnp.float32)


def _block_size(v: int) -> int:
  """Vocabulary block of the two-level inverse CDF: ~sqrt(V) entries, a power of two."""
  return max(8, 1 << int(round(0.5 * np.log2(max(v, 1)))))


def _last_positive(w: jax.Array) -> jax.Array:
  """Index of the last entry > 0 along the last axis (0 if none)."""
  n = w.shape[-1]
  return (n - 1 - jnp.argmax(jnp.flip(w > 0, axis=-1), axis=-1)).astype(jnp.int32)


def inverse_cdf_sample(x_bv: jax.Array, u_b2: jax.Array, block: int | None = None):
  """Exact draw from softmax(x) per row by two-level inverse CDF, without sorting.

  The vocabulary (in index order) is cut into blocks of `block` tokens: with the
  unnormalized weights w = exp(x - max x) (0 for -inf), block b is chosen with probability
  W_b / sum W (inverse CDF of the block masses at u_b2[:, 0]), then the token inside it
  with probability w_j / W_b (inverse CDF at u_b2[:, 1]), so P(j) = w_j / sum W. Two
  levels keep the uniform's float32 resolution (2^-24) relative to a block's mass rather
  than the whole vocabulary's, and touch [B, V] only for exp and one sum; the cumulative
  sums are over [B, V / block] and [B, block]. A token with w = 0 (filtered out) is never
  returned: each level picks the first index whose cumulative mass exceeds u * total,
  clamped to the last index with positive mass (against rounding at u * total ~ total).

  Args:
    x_bv: float32 [B, V] sampling logits (removed tokens -inf, at least one finite per row).
    u_b2: float32 [B, 2] uniforms in [0, 1).
    block: block size (default ~sqrt(V)).
  Returns:
    (tokens int32 [B], log mu(token) float32 [B]) with mu = softmax(x): x_tok - max - log sum W.
  """
  b, v = x_bv.shape
  c = block or _block_size(v)
  nb = -(-v // c)
  m = jnp.max(x_bv, axis=-1, keepdims=True)
  w = jnp.exp(x_bv - m)  # [B, V], exactly 0 where x = -inf
  if nb * c != v:
    w = jnp.pad(w, ((0, 0), (0, nb * c - v)))
  w_bnc = w.reshape(b, nb, c)
  mass_bn = jnp.sum(w_bnc, axis=-1)  # W_b
  cum_bn = jnp.cumsum(mass_bn, axis=-1)
  total_b = cum_bn[:, -1]
  blk = jnp.sum(cum_bn <= (u_b2[:, 0] * total_b)[:, None], axis=-1, dtype=jnp.int32)
  blk = jnp.minimum(blk, _last_positive(mass_bn))
  w_bc = jnp.take_along_axis(w_bnc, blk[:, None, None], axis=1)[:, 0]  # [B, c] the chosen block
  cum_bc = jnp.cumsum(w_bc, axis=-1)
  k = jnp.sum(cum_bc <= (u_b2[:, 1] * cum_bc[:, -1])[:, None], axis=-1, dtype=jnp.int32)
  k = jnp.minimum(k, _last_positive(w_bc))
  tok = blk * c + k
  x_tok = jnp.take_along_axis(x_bv, tok[:, None], axis=-1)[:, 0]
  return tok, x_tok - m[:, 0] - jnp.log(total_b)


def _choose(logits_bv, keys_b, cfg: SamplerConfig):
  """One token per row and its behavior log-prob: (tokens [B] int32, logp [B] float32).

  `cfg.draw` = "inverse_cdf": two uniforms per row (`inverse_cdf_sample`); "gumbel": Gumbel
  noise over [B, V] (jax.random.categorical), the draw of earlier versions (a different random
  stream for the same key). Both sample exactly softmax(filter_logits(...)).
  """
  if cfg.greedy:
    tok = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    if cfg.logp_mode == "sampled":
      return tok, jnp.zeros(tok.shape, jnp.float32)  # point mass
    ref = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
    return tok, jnp.take_along_axis(ref, tok[:, None], axis=-1)[:, 0]
  x = filter_logits(logits_bv, cfg.temperature, cfg.top_k, cfg.top_p)
  if cfg.draw == "inverse_cdf":
    u = jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys_b)
    tok, logp = inverse_cdf_sample(x, u)
    if cfg.logp_mode == "sampled":
      return tok, logp
  else:
    tok = jax.vmap(jax.random.categorical)(keys_b, x).astype(jnp.int32)
    if cfg.logp_mode == "sampled":
      return tok, jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tok[:, None], axis=-1)[:, 0]
  ref = jax.nn.log_softmax(logits_bv.astype(jnp.float32) / jnp.float32(cfg.temperature), axis=-1)
  return tok, jnp.take_along_axis(ref, tok[:, None], axis=-1)[:, 0]


# ----------------------------------------------------------------------------- the device loop


def _prefill(graphdef, cfg_model: ModelConfig, cfg: SamplerConfig, params, prompt_bt, prompt_valid_bt, num_new: int):
  """Fills the KV cache with the prompt bucket; returns (logits [B, V] f32 of the last column, cache, kv_valid).

  Chunks of `cfg.prefill_chunk` tokens. With at least two whole chunks they run as a `lax.scan`
  whose carry is the cache (updated in place, `dynamic_update_slice` at the traced slot c * chunk):
  each chunk's queries attend to the cache through the model's traced-slot path
  (`attention.decode_attention`: online softmax over the filled key blocks only), and a remainder
  of Tp mod chunk tokens follows at its static slot. Prefill memory is then one cache plus one
  chunk's temporaries, whatever the number of chunks (a Python loop of 32 chunks at static
  slots kept a copy of the cache per chunk alive, 39.5 GiB a layer on multiturn). One chunk, or one
  whole chunk and a remainder, run as before: at static slots, each attending to the cache prefix
  written so far through the configured attention (nothing beyond it is read). Only the final hidden
  state of the last column goes through the LM head (left padding: it is every row's last prompt
  token), so prefill never holds [B, Tp, V] (or [B, chunk, V]) logits.
  """
  b, tp = prompt_bt.shape
  s = tp + num_new
  model = nnx.merge(graphdef, params)
  cache = tuple(sh.constrain(x, sh.CACHE_LBK) for x in transformer.init_cache(cfg_model, b, s))
  positions, _ = transformer.padded_positions_and_mask(prompt_valid_bt)
  kv_valid = jnp.pad(prompt_valid_bt.astype(bool), ((0, 0), (0, num_new)))  # [B, S]
  mask = transformer.AttentionMask(kv_valid)
  chunk = min(cfg.prefill_chunk or tp, tp)
  lo = 0
  if tp // chunk >= 2:  # whole chunks in a scan, the cache as its carry
    lo = tp // chunk * chunk

    def body(cache, i):
      # The barrier ties the weights to the loop index: XLA:CPU computes bf16 dots in float32, and the
      # float32 weight copies were hoisted out of the loop, all layers alive at once (+0.9 GiB a layer
      # at 7B: math's 64 rows per device at 28 layers, temp 32.4 GiB without the barrier, 6.2 with it);
      # tied here they are made per chunk. An identity on every backend.
      p, i = jax.lax.optimization_barrier((params, i))
      start = i * chunk
      tok = jax.lax.dynamic_slice_in_dim(prompt_bt, start, chunk, axis=1)
      pos = jax.lax.dynamic_slice_in_dim(positions, start, chunk, axis=1)
      h, cache = nnx.merge(graphdef, p)(tok, pos, mask, cache, start, hidden=True)
      return cache, h[:, -1]

    cache, h_nbd = jax.lax.scan(body, cache, jnp.arange(tp // chunk, dtype=jnp.int32))
    h = h_nbd[-1][:, None]  # [B, 1, D]: the last whole chunk's last column
  for lo in range(lo, tp, chunk):  # at static slots: prefix-only attention
    hi = min(tp, lo + chunk)
    h, cache = model(prompt_bt[:, lo:hi], positions[:, lo:hi], mask, cache, lo, hidden=True)
  h_last = h[:, -1:]  # [B, 1, D]
  logits = model.embed_tokens.attend(h_last) if model.lm_head is None else model.lm_head(h_last)
  return logits[:, 0].astype(jnp.float32), cache, kv_valid


def _generate_device(
  graphdef,
  cfg_model: ModelConfig,
  cfg: SamplerConfig,
  num_new: int,
  params,
  prompt_bt,
  prompt_valid_bt,
  active_b,
  row_ids_b,
  stop_v,
  max_new,
  rng,
):
  """The whole generation, one jit: prefill the prompt bucket, then a while_loop of decode steps.

  Args:
    num_new: static Tn, the response buffer length.
    prompt_bt: int32 [B, Tp] left-padded prompts; prompt_valid_bt bool [B, Tp].
    active_b: bool [B] real rows (batch padding rows start finished).
    row_ids_b: int32 [B] global row index (seeds the row's random stream).
    stop_v: bool [V] stop-token set (runtime, so changing it does not recompile).
    max_new: int32 scalar <= Tn, response budget.
    rng: PRNG key.
  Returns:
    (resp_tokens [B, Tn] int32, resp_logp [B, Tn] f32, lengths [B] int32, finished [B] bool, records: the
    `record_fields` {name: [B, Tn, ...]}, empty when none are recorded).
  The loop exits as soon as every row is finished or max_new tokens were drawn.
  """
  b, tp = prompt_bt.shape
  pad = jnp.int32(cfg.pad_id)
  row_keys = _row_keys(rng, row_ids_b)
  step_keys = lambda i: _step_keys(row_keys, i)

  last_logits, cache, kv_valid = _prefill(graphdef, cfg_model, cfg, params, prompt_bt, prompt_valid_bt, num_new)
  layers = None
  if unrolled_decode(cfg, cfg_model):  # per-layer cache buffers and weights (copied once per call), read in place
    cache, layers = transformer.split_cache(cache), transformer.layer_params(graphdef, params)
  prompt_len = jnp.sum(prompt_valid_bt, axis=1, dtype=jnp.int32)
  rope = transformer.rotation_table(cfg_model, tp + num_new)  # positions < S: read per step, not recomputed

  e = routing_width(cfg_model, cfg)
  fields = record_fields(cfg, e)
  record = bool(record_fields(cfg))  # the records known when a token is drawn (column_records)

  def emit(i, tok, logp, state, rec):  # response column i: pad / 0 for finished rows; a stop token finishes a row
    toks, logps, lengths, done, recs = state
    tok = jnp.where(done, pad, tok)
    logp = jnp.where(done, 0.0, logp)
    toks = toks.at[:, i].set(tok)
    logps = logps.at[:, i].set(logp)
    fin = lambda x: done.reshape(done.shape + (1,) * (x.ndim - 1))
    recs = {**recs, **{k: recs[k].at[:, i].set(jnp.where(fin(x), fields[k][2], x)) for k, x in rec.items()}}
    lengths = lengths + (~done).astype(jnp.int32)
    stopped = ~done & stop_v[tok]
    return (toks, logps, lengths, done | stopped, recs), stopped

  toks0 = jnp.full((b, num_new), pad, jnp.int32)
  state = (toks0, jnp.zeros((b, num_new), jnp.float32), jnp.zeros((b,), jnp.int32), ~active_b)
  state += (empty_records(cfg, b, num_new, e),)
  tok0, logp0 = _choose(last_logits, step_keys(0), cfg)
  state, finished = emit(0, tok0, logp0, state, column_records(last_logits, tok0, cfg))

  def cond(carry):
    i, _, _, state, _ = carry
    return (i < max_new) & ~jnp.all(state[3])

  def body(carry):  # feeds token i - 1 at cache slot Tp + i - 1, draws token i
    i, cache, kv_valid, state, finished = carry
    prev, pos, idx = state[0][:, i - 1], prompt_len + i - 1, tp + i - 1
    keys = step_keys(i)
    out = _decode_step(
      graphdef,
      cfg,
      params,
      cache,
      kv_valid,
      prev,
      pos,
      idx,
      keys,
      record=record,
      route=bool(e),
      layers=layers,
      rope=rope,
    )
    tok, logp, cache, kv_valid = out[:4]
    if e:  # the experts of token i - 1 (a response token of rows still running when it was emitted): column i - 1
      fed, recs = (i - 1 < state[2])[:, None], state[4]
      state = (*state[:4], {**recs, "expert_ids": recs["expert_ids"].at[:, i - 1].set(jnp.where(fed, out[-1], -1))})
    state, stopped = emit(i, tok, logp, state, out[4] if record else {})
    return i + 1, cache, kv_valid, state, finished | stopped

  carry = (jnp.int32(1), cache, kv_valid, state, finished)
  _, _, _, state, finished = jax.lax.while_loop(cond, body, carry)
  toks, logps, lengths, _, recs = state
  return toks, logps, lengths, finished, recs


# ----------------------------------------------------------------------------- chunked decode, continuous batching


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Slots:
  """Device state of B decode slots for the host-driven engine (`Sampler._run_chunked`).

  Each slot runs one row at a time; a finished slot can be refilled with another row
  between chunks. Cache columns [0, Tp) hold the slot's prompt; the response keys go
  to a ring over the Tn response columns: decode step j (counted over the whole batch)
  writes column Tp + j % Tn for every slot. A row started at step j0 feeds at most
  Tn - 1 tokens, at columns (j0 ... j0 + Tn - 2) % Tn, so it never overwrites itself;
  attention takes an explicit mask (kv_valid, not causal-by-column), so the order of
  the columns does not matter. Refilling a slot clears its response columns.

  Attributes:
    cache: per-layer (k [B, K, H, S], v [B, K, S, H]) (the cache layout, model/attention.py).
    kv_valid: bool [B, S] columns holding this row's keys.
    col_tok, col_pos: int32 [B, S] the token and position whose keys each column holds (recompute_kv).
    toks, logps: [B, Tn] response so far (pad / 0 after it); vers: int32 [B, Tn] version per token (-1 after).
    lengths: int32 [B] tokens emitted; done: bool [B] (stop token, budget, or an empty slot);
    finished: bool [B] ended with a stop token; prompt_len, row_id, budget: int32 [B].
    j: int32 scalar, decode steps run so far.
  """

  cache: tuple  # (k [L, B, K, H, S], v [L, B, K, S, H]): every layer's, stacked
  kv_valid: jax.Array
  col_tok: jax.Array
  col_pos: jax.Array
  toks: jax.Array
  logps: jax.Array
  vers: jax.Array
  lengths: jax.Array
  done: jax.Array
  finished: jax.Array
  prompt_len: jax.Array
  row_id: jax.Array
  budget: jax.Array
  j: jax.Array
  recs: dict  # record_fields {name: [B, Tn, ...]} (top-k, support, routing records) of each column; {} if none


def _empty_slots(cfg_model: ModelConfig, cfg: SamplerConfig, b: int, tp: int, tn: int) -> _Slots:
  s = tp + tn
  zi = lambda *shape: jnp.zeros(shape, jnp.int32)
  cache = tuple(sh.constrain(x, sh.CACHE_LBK) for x in transformer.init_cache(cfg_model, b, s))
  return _Slots(
    cache=cache,
    kv_valid=jnp.zeros((b, s), bool),
    col_tok=zi(b, s),
    col_pos=zi(b, s),
    toks=jnp.full((b, tn), cfg.pad_id, jnp.int32),
    logps=jnp.zeros((b, tn), jnp.float32),
    vers=jnp.full((b, tn), -1, jnp.int32),
    lengths=zi(b),
    done=jnp.ones((b,), bool),
    finished=jnp.zeros((b,), bool),
    prompt_len=zi(b),
    row_id=zi(b),
    budget=zi(b),
    j=jnp.int32(0),
    recs=empty_records(cfg, b, tn, routing_width(cfg_model, cfg)),
  )


def _row_keys(rng, row_ids):
  """fold_in(rng, row) for every row id (int32 [B]): the row's random stream."""
  return jax.vmap(lambda r: jax.random.fold_in(rng, r))(row_ids)


def _step_keys(row_keys, steps):
  """fold_in(row_key, i) per row: steps is one token index for every row (scalar) or one per row ([B])."""
  steps = jnp.broadcast_to(jnp.asarray(steps, jnp.int32), row_keys.shape)
  return jax.vmap(jax.random.fold_in)(row_keys, steps)


def token_keys(rng, row_ids, steps):
  """The key of row n's token i, fold_in(fold_in(rng, n), i), for every row (row_ids int32 [B]; steps: a
  scalar or int32 [B]): the one formula of every decode loop, so a row's sample depends on neither its slot
  nor the loop that drew it."""
  return _step_keys(_row_keys(rng, row_ids), steps)


def _refill_device(
  graphdef, cfg_model, cfg, params, st: _Slots, slots_r, prompt_rt, valid_rt, row_ids_r, budget_r, stop_v, version, rng
):
  """Starts R rows in slots `slots_r` (int32 [R]; an index >= B is a padding row, dropped): prefill + first token.

  The first token uses the key fold_in(fold_in(rng, row_id), 0), as in `_generate_device`.
  """
  tn = st.toks.shape[1]
  r = prompt_rt.shape[0]
  last_logits, cache_r, kv_valid_r = _prefill(graphdef, cfg_model, cfg, params, prompt_rt, valid_rt, tn)
  prompt_len_r = jnp.sum(valid_rt, axis=1, dtype=jnp.int32)
  keys = token_keys(rng, row_ids_r, 0)
  tok, logp = _choose(last_logits, keys, cfg)
  stopped = stop_v[tok]
  positions, _ = transformer.padded_positions_and_mask(valid_rt)
  put = lambda full, part: full.at[slots_r].set(part.astype(full.dtype), mode="drop")
  toks_r = jnp.full((r, tn), cfg.pad_id, jnp.int32).at[:, 0].set(tok)
  rec0 = column_records(last_logits, tok, cfg)
  return _Slots(
    cache=tuple(full.at[:, slots_r].set(part.astype(full.dtype), mode="drop") for full, part in zip(st.cache, cache_r)),
    kv_valid=put(st.kv_valid, kv_valid_r),
    col_tok=put(st.col_tok, jnp.pad(prompt_rt, ((0, 0), (0, tn)))),
    col_pos=put(st.col_pos, jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, tn)))),
    toks=put(st.toks, toks_r),
    logps=put(st.logps, jnp.zeros((r, tn), jnp.float32).at[:, 0].set(logp)),
    vers=put(st.vers, jnp.full((r, tn), -1, jnp.int32).at[:, 0].set(version)),
    lengths=put(st.lengths, jnp.ones((r,), jnp.int32)),
    done=put(st.done, stopped | (budget_r <= 1)),
    finished=put(st.finished, stopped),
    prompt_len=put(st.prompt_len, prompt_len_r),
    row_id=put(st.row_id, row_ids_r),
    budget=put(st.budget, budget_r),
    j=st.j,
    recs={
      k: put(st.recs[k], x.at[:, 0].set(rec0[k]) if k in rec0 else x)  # the routing record starts empty
      for k, x in empty_records(cfg, r, tn, routing_width(cfg_model, cfg)).items()
    },
  )


def _chunk_device(graphdef, cfg, num_steps: int, params, st: _Slots, stop_v, version, rng):
  """Up to `num_steps` decode steps of every slot (fewer once all are done). Row n's token i uses the key
  fold_in(fold_in(rng, n), i), as in `_generate_device`, so a row's sample does not depend on its slot."""
  b, s = st.kv_valid.shape
  tn = st.toks.shape[1]
  tp = s - tn
  rows = jnp.arange(b)

  def body(carry):
    n, st = carry
    col = tp + st.j % tn
    last = jnp.maximum(st.lengths - 1, 0)
    prev = jnp.take_along_axis(st.toks, last[:, None], axis=1)  # [B, 1]
    pos = (st.prompt_len + last)[:, None]
    kv_valid = jax.lax.dynamic_update_slice(st.kv_valid, jnp.ones((b, 1), bool), (0, col))
    route = "expert_ids" in st.recs
    logits, cache, ids = _forward_routed(graphdef, params, prev, pos, kv_valid[:, None, :], st.cache, col, route=route)
    keys = token_keys(rng, st.row_id, st.lengths)
    tok, logp = _choose(logits[:, -1], keys, cfg)
    live = ~st.done
    at = jnp.where(live, st.lengths, tn)  # out of range: dropped
    stopped = live & stop_v[tok]
    lengths = st.lengths + live.astype(jnp.int32)
    rec = column_records(logits[:, -1], tok, cfg)
    recs = {**st.recs, **{k: st.recs[k].at[rows, at].set(x, mode="drop") for k, x in rec.items()}}
    if route:  # the experts of the fed token (column `last`) of the rows still running
      recs["expert_ids"] = recs["expert_ids"].at[rows, jnp.where(live, last, tn)].set(ids[:, 0], mode="drop")
    st = dataclasses.replace(st, recs=recs)
    st = dataclasses.replace(
      st,
      cache=cache,
      kv_valid=kv_valid,
      col_tok=jax.lax.dynamic_update_slice(st.col_tok, prev, (0, col)),
      col_pos=jax.lax.dynamic_update_slice(st.col_pos, pos, (0, col)),
      toks=st.toks.at[rows, at].set(tok, mode="drop"),
      logps=st.logps.at[rows, at].set(logp, mode="drop"),
      vers=st.vers.at[rows, at].set(version, mode="drop"),
      lengths=lengths,
      done=st.done | stopped | (lengths >= st.budget),
      finished=st.finished | stopped,
      j=st.j + 1,
    )
    return n + 1, st

  cond = lambda carry: (carry[0] < num_steps) & ~jnp.all(carry[1].done)
  _, st = jax.lax.while_loop(cond, body, (jnp.int32(0), st))
  return st


def _recompute_kv_device(graphdef, cfg_model, params, st: _Slots) -> _Slots:
  """The cache recomputed under `params`: every written column from (col_tok, col_pos), causal by position."""
  b, s = st.kv_valid.shape
  allowed = st.kv_valid[:, None, :] & (st.col_pos[:, None, :] <= st.col_pos[:, :, None])  # [B, S(query), S(key)]
  allowed = allowed | jnp.eye(s, dtype=bool)[None]  # unwritten columns attend to themselves (no empty rows)
  fresh = tuple(sh.constrain(x, sh.CACHE_LBK) for x in transformer.init_cache(cfg_model, b, s))
  model = nnx.merge(graphdef, params)
  _, cache = model(st.col_tok, st.col_pos, allowed, fresh, 0, hidden=True)
  return dataclasses.replace(st, cache=cache)


def _bucket(value: int, buckets: Sequence[int], field: str) -> int:
  i = bisect.bisect_left(buckets, value)
  if i == len(buckets):
    raise ValueError(f"{field}={value} exceeds the largest SamplerConfig bucket {buckets[-1]}; add a larger bucket.")
  return buckets[i]


def resolve_param_dtype(name: str, platform: str):
  """SamplerConfig.param_dtype on `platform` ("cpu", "gpu", "tpu"): a jnp dtype, or None (as given).

  "auto" is bfloat16 on accelerators and None on CPU, where bf16 matmuls are emulated (slower than
  float32) and the CPU default keeps its float32 results. "int8": the dtype of the floats it does not
  quantize, as "auto" (`_sampler_weights` quantizes the projection kernels).
  """
  if name in ("auto", "int8"):
    return None if platform == "cpu" else jnp.dtype(jnp.bfloat16)
  return jnp.dtype(name) if name else None


def _sampler_weights(params, dtype, int8: bool):
  """The weights as the sampler computes with them: floats cast to `dtype`, then with int8 the projection
  kernels quantized from those values (`quant.quantize_params`; as `Sampler.prepare_params` does, and as the
  async sampler sees them, published in its publish dtype). A no-op on prepared parameters."""
  is_q = lambda x: isinstance(x, quant.QArray)
  if dtype is not None:
    cast = lambda x: x if is_q(x) or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)
    params = jax.tree.map(cast, params, is_leaf=is_q)
  return quant.quantize_params(params) if int8 else params


def sampler_mesh(cfg: SamplerConfig, devices=None):
  """The ("data", "fsdp", "tensor") mesh of shape `cfg.mesh_shape` over a sampler process's devices
  (default: all of `jax.devices()`, e.g. the GPUs CUDA_VISIBLE_DEVICES left to the async worker)."""
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(cfg.mesh_shape), devices=devices)


def _layout_sharding(mesh, shape: tuple[int, ...], entries: tuple):
  """A NamedSharding of `shape` from activation-layout entries (as `sharding.constrain` reads them):
  per dimension the entry's mesh axes where their product divides it, else replicated."""
  spec = []
  for dim, entry in zip(shape, tuple(entries) + (None,) * (len(shape) - len(entries))):
    names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in mesh.shape)
    size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    spec.append(names if names and size > 1 and dim % size == 0 else None)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _decode_step(
  graphdef,
  cfg: SamplerConfig,
  params,
  cache,
  kv_valid,
  prev_b,
  pos_b,
  idx,
  keys_b,
  record=False,
  route=False,
  layers=None,
  rope=None,
):
  """One decode step: the body of `_generate_device`'s loop (and `Sampler.lower(part="decode")`'s program).

  Feeds token prev_b [B] at position pos_b [B] into cache slot idx (the cache: per-layer (k [B, K, H, S],
  v [B, K, S, H]); kv_valid: bool [B, S], the slot marked valid here), attends over the cache blocks up to
  it, draws the next token of row n with keys_b[n] (the loop's fold_in(fold_in(rng, row), i));
  returns (tokens [B], logp [B], cache, kv_valid), with record the column's `column_records`, and last with
  route the fed tokens' experts [B, L K] int16 (`routing_width`). With decode_layers="unrolled" the cache is
  per layer (`transformer.split_cache`) and layers each layer's parameters (`transformer.layer_params`).
  rope: the call's `transformer.rotation_table` (read at pos_b), or None (computed from pos_b).
  """
  b = prev_b.shape[0]
  kv_valid = jax.lax.dynamic_update_slice(kv_valid, jnp.ones((b, 1), bool), (0, idx))
  mask = transformer.AttentionMask(kv_valid)  # decode reads only the cache blocks up to slot idx
  args = (prev_b[:, None], pos_b[:, None], mask, cache, idx)
  rot = None if rope is None else transformer.rotation_at(rope, pos_b[:, None])
  logits, cache, ids = _forward_routed(graphdef, params, *args, route=route, layers=layers, rot=rot)
  tok, logp = _choose(logits[:, -1], keys_b, cfg)
  out = (tok, logp, cache, kv_valid)
  if record:
    out += (column_records(logits[:, -1], tok, cfg),)
  return out + ((ids[:, 0],) if route else ())


class Sampler:
  """Host-side padding/bucketing around one jitted generation function.

  Usage:
    sampler = Sampler(graphdef, model_cfg, SamplerConfig(temperature=1.0, eos_id=2))
    rollout = sampler.generate(params, [[5, 6, 7], [8, 9]], jax.random.key(0), num_samples=4)
  """

  def __init__(
    self, graphdef, cfg_model: ModelConfig, sampler_cfg: SamplerConfig, mesh=None, rules=sh.TRANSFORMER_RULES
  ):
    """Args:
    graphdef, cfg_model: the policy (`transformer.split`) and its config.
    sampler_cfg: sampling settings and buckets.
    mesh: optional ("data", "fsdp", "tensor") mesh over the sampler's own devices
      (`mesh.make_mesh(..., devices=sampler_devices)`): parameters are split by `rules`
      (tensor parallel over "tensor" when one device cannot hold the model and its cache),
      batch rows over ("data", "fsdp"), the KV cache's kv heads over "tensor". None: one device.
    rules: (regex, PartitionSpec) parameter rules (default: the learner's).
    """
    if not isinstance(sampler_cfg, SamplerConfig):
      raise ValueError(f"sampler_cfg must be a SamplerConfig, got {type(sampler_cfg).__name__}.")
    for sid in sampler_cfg.all_stop_ids + (sampler_cfg.pad_id,):
      if not 0 <= sid < cfg_model.vocab_size:
        raise ValueError(
          f"SamplerConfig token id {sid} (eos_id/stop_ids/pad_id) is outside the "
          f"vocabulary [0, {cfg_model.vocab_size})."
        )
    if sampler_cfg.decode_layers == "unrolled" and cfg_model.moe is not None:
      raise ValueError("SamplerConfig.decode_layers='unrolled' takes a dense model; use 'scan' for MoE.")
    self.graphdef, self.cfg_model, self.cfg = graphdef, cfg_model, sampler_cfg
    self.num_traces = 0  # incremented at trace time: the compile-count test reads it
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    self.param_dtype = resolve_param_dtype(sampler_cfg.param_dtype, platform)
    self.int8 = sampler_cfg.param_dtype == "int8"
    self.last_decode_steps = 0
    self.last_records = {}  # record_fields {name: [N, Tn, ...]} of the last run (top-k, support, routing records)
    self.routing = routing_width(cfg_model, sampler_cfg)  # E of the routing record (0: none)

    def device_fn(params, prompt_bt, prompt_valid_bt, active_b, row_ids_b, stop_v, max_new, rng, *, num_new):
      self.num_traces += 1
      params = _sampler_weights(params, self.param_dtype, self.int8)  # a no-op on prepared parameters
      return _generate_device(
        graphdef,
        cfg_model,
        sampler_cfg,
        num_new,
        params,
        prompt_bt,
        prompt_valid_bt,
        active_b,
        row_ids_b,
        stop_v,
        max_new,
        rng,
      )

    self._device_fn = jax.jit(device_fn, static_argnames=("num_new",))
    self.mesh, self.rules = mesh, rules

    # The chunked engine ("chunked" / "refill" decode): one jit per (B, Tp, Tn) for the empty slots and the
    # chunk, per (R, B, Tp, Tn) for a refill; the slot state is donated (updated in place).
    def traced(fn):
      def wrapped(*a, **kw):
        self.num_traces += 1
        return fn(*a, **kw)

      return wrapped

    self._empty_fn = jax.jit(
      traced(lambda b, tp, tn: _empty_slots(cfg_model, sampler_cfg, b, tp, tn)), static_argnums=(0, 1, 2)
    )
    self._refill_fn = jax.jit(
      traced(functools.partial(_refill_device, graphdef, cfg_model, sampler_cfg)), donate_argnums=(1,)
    )
    self._chunk_fn = jax.jit(
      traced(functools.partial(_chunk_device, graphdef, sampler_cfg)), static_argnums=(0,), donate_argnums=(2,)
    )
    self._recompute_fn = jax.jit(
      traced(functools.partial(_recompute_kv_device, graphdef, cfg_model)), donate_argnums=(1,)
    )

  def _mesh_context(self):
    # Traced under the sampler's mesh, the model's activation constraints (batch, heads, cache) apply.
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def prepare_params(self, params):
    """The parameters as the sampler keeps them: cast to `param_dtype`, placed on the sampler mesh, and with
    int8 the projection kernels quantized there (q and its scales keep the kernel's sharding).

    Call once per published parameter version (not per generate call): the cast and the
    transfer then happen once, and bf16 halves the weight memory and per-step bandwidth (int8 quarters it).
    """
    params = _sampler_weights(params, self.param_dtype, False)
    if self.mesh is not None:
      params = jax.device_put(params, sh.param_shardings(params, self.rules, self.mesh))
    return quant.quantize_params(params) if self.int8 else params

  def lower(self, params, batch: int, prompt_len: int, num_new: int, part: str = "generate"):
    """One jitted program of the (B, Tp, Tn) bucket, lowered (not run): `.compile().memory_analysis()`.

    part: "generate" (the whole generation as `generate` runs it: prefill, then the decode
    while_loop, one jit), "prefill" (`_prefill`: the prompt bucket into a fresh KV cache (k [L, B, K, H, S],
    v [L, B, K, S, H]), S = Tp + Tn, and the last column's logits) or "decode" (one decode step as the loop
    body runs it, `_decode_step`: the token fed at the last cache slot, attention over the full
    cache, the next token drawn; the cache is donated, as the loop updates it in place).
    params may be abstract (ShapeDtypeStructs, e.g. from `jax.eval_shape`); with a mesh they are
    given the sampler's parameter shardings, and the cache its CACHE_LBK layout, so the compiled
    program is the sharded one.
    """
    if part not in LOWER_PARTS:
      raise ValueError(f"Sampler.lower part must be one of {LOWER_PARTS}, got {part!r}.")
    layout = lambda shape, entries: None  # no mesh: one device
    if self.mesh is not None:
      shardings = sh.param_shardings(params, self.rules, self.mesh)
      params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
      layout = functools.partial(_layout_sharding, self.mesh)
    b, tp, v = batch, prompt_len, self.cfg_model.vocab_size
    sds = lambda shape, dtype, entries=(sh.BATCH_AXES,): jax.ShapeDtypeStruct(
      shape, dtype, sharding=layout(shape, entries)
    )
    rng = jax.eval_shape(lambda: jax.random.key(0))
    with self._mesh_context():
      if part == "generate":
        args = (
          params,
          jax.ShapeDtypeStruct((b, tp), jnp.int32),
          jax.ShapeDtypeStruct((b, tp), jnp.bool_),
          jax.ShapeDtypeStruct((b,), jnp.bool_),
          jax.ShapeDtypeStruct((b,), jnp.int32),
          jax.ShapeDtypeStruct((v,), jnp.bool_),
          jax.ShapeDtypeStruct((), jnp.int32),
          rng,
        )
        return self._device_fn.lower(*args, num_new=num_new)
      cast = lambda p: _sampler_weights(p, self.param_dtype, self.int8)  # as device_fn: a no-op when prepared
      g, cm, cfg = self.graphdef, self.cfg_model, self.cfg
      if part == "prefill":
        fn = jax.jit(lambda p, tok, valid: _prefill(g, cm, cfg, cast(p), tok, valid, num_new))
        return fn.lower(params, sds((b, tp), jnp.int32), sds((b, tp), jnp.bool_))
      s = tp + num_new
      n = cm.num_layers
      k = sds((n, b, cm.num_kv_heads, cm.head_dim, s), cm.compute_dtype, sh.CACHE_LBK)
      v = sds((n, b, cm.num_kv_heads, s, cm.head_dim), cm.compute_dtype, sh.CACHE_LBK)
      cache = (k, v)
      if unrolled_decode(cfg, cm):
        k1 = sds(k.shape[1:], k.dtype, sh.CACHE_BK)
        cache = [(k1, sds(v.shape[1:], v.dtype, sh.CACHE_BK)) for _ in range(n)]
      fn = jax.jit(lambda p, *a, rope: _decode_step(g, cfg, cast(p), *a, rope=rope), donate_argnums=(1, 2))
      scalar = jax.ShapeDtypeStruct((), jnp.int32)
      keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), b))  # one key per row
      rope = jax.eval_shape(lambda: transformer.rotation_table(cm, s))  # made once per call, as the loop reads it
      args = (params, cache, sds((b, s), jnp.bool_), sds((b,), jnp.int32), sds((b,), jnp.int32), scalar, keys)
      return fn.lower(*args, rope=rope)

  # -- host side

  def _stop_mask(self, stop_ids) -> np.ndarray:
    stop_v = np.zeros((self.cfg_model.vocab_size,), bool)
    ids = np.asarray(list(stop_ids), np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= self.cfg_model.vocab_size):
      raise ValueError(f"stop_ids {sorted(set(ids.tolist()))} must lie in [0, {self.cfg_model.vocab_size}).")
    stop_v[ids] = True
    return stop_v

  def _pad_prompts(self, rows: list[Sequence[int]], max_new_tokens: int):
    """Checks the rows and budget; returns (Tp, Tn, prompt int32 [N, Tp] left-padded, valid bool [N, Tp])."""
    if not rows:
      raise ValueError("prompt_token_lists is empty: pass at least one prompt.")
    lens = [len(r) for r in rows]
    if min(lens) == 0:
      raise ValueError(
        f"prompt {lens.index(0)} is empty: every prompt needs at least one token (e.g. BOS) to condition on."
      )
    if not 0 < max_new_tokens <= self.cfg.new_token_buckets[-1]:
      raise ValueError(
        f"max_new_tokens={max_new_tokens} must be in [1, {self.cfg.new_token_buckets[-1]}] "
        "(SamplerConfig.new_token_buckets)."
      )
    tp = _bucket(max(lens), self.cfg.prompt_buckets, "prompt length")
    tn = _bucket(max_new_tokens, self.cfg.new_token_buckets, "max_new_tokens")
    if tp + tn > self.cfg_model.max_position:
      raise ValueError(
        f"prompt bucket {tp} + new-token bucket {tn} exceeds ModelConfig.max_position="
        f"{self.cfg_model.max_position}; use smaller buckets or prompts."
      )
    n = len(rows)
    prompt = np.full((n, tp), self.cfg.pad_id, np.int32)
    valid = np.zeros((n, tp), bool)
    for i, r in enumerate(rows):
      prompt[i, tp - len(r) :] = np.asarray(r, np.int32)
      valid[i, tp - len(r) :] = True
    if prompt.min() < 0 or prompt.max() >= self.cfg_model.vocab_size:
      raise ValueError(f"prompt token ids must lie in [0, {self.cfg_model.vocab_size}).")
    return tp, tn, prompt, valid

  def _run(self, params, rows: list[Sequence[int]], max_new_tokens: int, stop_v: np.ndarray, rng, row_offset: int = 0):
    """Generates one response per row (row i seeded as row row_offset + i). Returns host arrays (prompt [N,Tp],
    valid, toks, logps, lengths, finished)."""
    tp, tn, prompt, valid = self._pad_prompts(rows, max_new_tokens)
    n = len(rows)
    outs = []
    max_b = self.cfg.batch_buckets[-1]
    for start in range(0, n, max_b):  # rows beyond the largest bucket run in further chunks
      m = min(max_b, n - start)
      b = _bucket(m, self.cfg.batch_buckets, "batch size")
      pb = np.full((b, tp), self.cfg.pad_id, np.int32)
      vb = np.zeros((b, tp), bool)
      pb[:m], vb[:m] = prompt[start : start + m], valid[start : start + m]
      vb[m:, -1] = True  # padding rows: one dummy token keeps their attention rows non-empty
      active = np.arange(b) < m
      row_ids = np.arange(row_offset + start, row_offset + start + b, dtype=np.int32)
      with self._mesh_context():
        out = self._device_fn(params, pb, vb, active, row_ids, stop_v, np.int32(max_new_tokens), rng, num_new=tn)
      outs.append(jax.tree.map(lambda o: np.asarray(o)[:m], jax.device_get(out)))
    cols = jax.tree.map(lambda *x: np.concatenate(x), *outs)  # toks, logps, lengths, finished, records
    self.last_records = cols[4]
    return prompt, valid, *cols[:4]

  def _run_chunked(
    self,
    params,
    rows: list[Sequence[int]],
    budgets: np.ndarray,
    stop_v: np.ndarray,
    rng,
    *,
    refill: bool,
    version: int = 0,
    on_chunk=None,
    recompute_kv: bool = False,
    row_offset: int = 0,
  ):
    """The host-driven engine: jitted chunks of `chunk_tokens` decode steps over B slots.

    Args:
      budgets: int [N] response budget per row (each in [1, Tn]).
      refill: between chunks, start waiting rows in finished slots (continuous batching); False: the next
        B rows start once the whole batch is done (static batching, chunk by chunk).
      version: the parameter version recorded for the tokens `params` samples.
      on_chunk: called after every chunk as on_chunk(steps) -> None or (params, version): the new parameters
        sample every later token (in-flight update; the KV cache is kept unless recompute_kv).
    Returns host arrays (prompt [N,Tp], valid, toks [N,Tn], logps, versions [N,Tn] (-1 after the response),
    lengths [N], finished [N]).
    """
    budgets = np.asarray(budgets, np.int64).reshape(-1)
    tp, tn, prompt, valid = self._pad_prompts(rows, int(budgets.max()))
    if budgets.shape != (len(rows),) or budgets.min() < 1:
      raise ValueError(f"budgets must hold one positive response budget per row, got shape {budgets.shape}.")
    n = len(rows)
    b = _bucket(min(n, self.cfg.batch_buckets[-1]), self.cfg.batch_buckets, "batch size")
    out_toks = np.full((n, tn), self.cfg.pad_id, np.int32)
    out_logps = np.zeros((n, tn), np.float32)
    out_vers = np.full((n, tn), -1, np.int32)
    out_len = np.zeros((n,), np.int32)
    out_fin = np.zeros((n,), bool)
    out_rec = {
      k: np.full((n, tn) + shp, fill, dt) for k, (dt, shp, fill) in record_fields(self.cfg, self.routing).items()
    }
    waiting = collections.deque(range(n))
    slot_row = np.full((b,), -1, np.int64)  # row each slot runs (-1: free)
    with self._mesh_context():
      st = self._empty_fn(b, tp, tn)

      def start(st, free):
        take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        r = _bucket(len(take), self.cfg.batch_buckets, "batch size")
        slots = np.full((r,), b, np.int32)  # padding rows target slot b: dropped
        slots[: len(take)] = free[: len(take)]
        pb = np.full((r, tp), self.cfg.pad_id, np.int32)
        vb = np.zeros((r, tp), bool)
        pb[: len(take)], vb[: len(take)] = prompt[take], valid[take]
        vb[len(take) :, -1] = True  # padding rows: one dummy token keeps their attention rows non-empty
        ids = np.zeros((r,), np.int32)
        ids[: len(take)] = np.asarray(take, np.int32) + row_offset
        bud = np.ones((r,), np.int32)
        bud[: len(take)] = budgets[take]
        slot_row[free[: len(take)]] = take
        return self._refill_fn(params, st, slots, pb, vb, ids, bud, stop_v, np.int32(version), rng)

      st = start(st, np.arange(b))
      while (slot_row >= 0).any():
        st = self._chunk_fn(self.cfg.chunk_tokens, params, st, stop_v, np.int32(version), rng)
        done = np.asarray(jax.device_get(st.done))
        ended = np.flatnonzero(done & (slot_row >= 0))
        if ended.size:
          toks, logps, vers, lengths, fin = jax.device_get((st.toks, st.logps, st.vers, st.lengths, st.finished))
          rr = slot_row[ended]
          out_toks[rr], out_logps[rr], out_vers[rr] = toks[ended], logps[ended], vers[ended]
          out_len[rr], out_fin[rr] = lengths[ended], fin[ended]
          for k, x in jax.device_get(st.recs).items():
            out_rec[k][rr] = x[ended]
          slot_row[ended] = -1
        if on_chunk is not None and (slot_row >= 0).any() | bool(waiting):
          update = on_chunk(self.cfg.chunk_tokens)
          if update is not None:
            params, version = update
            if recompute_kv and (slot_row >= 0).any():
              st = self._recompute_fn(params, st)
        free = np.flatnonzero(slot_row < 0)
        if waiting and free.size and (refill or free.size == b):
          st = start(st, free)
    self.last_decode_steps = int(jax.device_get(st.j))  # decode steps of the last chunked run (tests, benchmarks)
    self.last_records = out_rec
    return prompt, valid, out_toks, out_logps, out_vers, out_len, out_fin

  def generate(
    self,
    params,
    prompt_token_lists: Sequence[Sequence[int]],
    rng,
    num_samples: int = 1,
    max_new_tokens: int | None = None,
    *,
    decode: str | None = None,
    version: int = 0,
    on_chunk=None,
    recompute_kv: bool = False,
    budgets: Sequence[int] | None = None,
    row_offset: int = 0,
  ) -> Rollout:
    """Samples num_samples (G) responses per prompt; rows are prompt-major (n = p * G + g).

    Args:
      params: the policy parameters (nnx.State from transformer.split).
      prompt_token_lists: P lists of token ids (no padding).
      rng: PRNG key; the result is a deterministic function of (params, prompts, rng, config).
      num_samples: G >= 1.
      max_new_tokens: response budget (default SamplerConfig.max_new_tokens).
      decode: "static" / "chunked" / "refill" (default SamplerConfig.decode; on_chunk needs a chunked one:
        "static" then runs "chunked").
      version: parameter version of `params`, recorded per token (Rollout.token_version).
      on_chunk: in-flight updates, see `_run_chunked`: on_chunk(steps) -> None | (params, version).
      recompute_kv: after an in-flight update, recompute the KV cache under the new parameters (default: keep
        it, PipelineRL-style: later tokens attend to keys the older version computed).
      budgets: optional per-row response budgets [N] (<= max_new_tokens), e.g. for benchmarks; chunked only.
      row_offset: row n is seeded as row row_offset + n (its key fold_in(rng, row_offset + n)), so a host that
        samples rows [o, o + N) of a larger batch draws what one sampler of the whole batch draws for them.
    Returns:
      Rollout with N = P * G rows of length T = Tp + Tn (buckets). Groups stay together and in order
      whatever order the refilling engine finished them in.
    """
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
    max_new = self.cfg.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    decode = self.cfg.decode if decode is None else decode
    if decode not in DECODE_MODES:
      raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}.")
    if decode == "static" and (on_chunk is not None or budgets is not None):
      decode = "chunked"
    rows = [list(p) for p in prompt_token_lists for _ in range(num_samples)]
    stop_v = self._stop_mask(self.cfg.all_stop_ids)
    if decode == "static":
      prompt, valid, toks, logps, lengths, finished = self._run(params, rows, max_new, stop_v, rng, row_offset)
      vers = np.where(np.arange(toks.shape[1])[None, :] < lengths[:, None], np.int32(version), np.int32(-1))
    else:
      bud = np.full((len(rows),), max_new, np.int64) if budgets is None else np.asarray(budgets, np.int64)
      if bud.shape != (len(rows),) or bud.min() < 1 or bud.max() > max_new:
        raise ValueError(f"budgets must be {len(rows)} ints in [1, max_new_tokens={max_new}].")
      prompt, valid, toks, logps, vers, lengths, finished = self._run_chunked(
        params,
        rows,
        bud,
        stop_v,
        rng,
        refill=decode == "refill",
        version=version,
        on_chunk=on_chunk,
        recompute_kv=recompute_kv,
        row_offset=row_offset,
      )
      if toks.shape[1] != _bucket(max_new, self.cfg.new_token_buckets, "max_new_tokens"):
        pad = _bucket(max_new, self.cfg.new_token_buckets, "max_new_tokens") - toks.shape[1]
        toks = np.pad(toks, ((0, 0), (0, pad)), constant_values=self.cfg.pad_id)
        logps, vers = np.pad(logps, ((0, 0), (0, pad))), np.pad(vers, ((0, 0), (0, pad)), constant_values=-1)
        fills = {k: f[2] for k, f in record_fields(self.cfg, self.routing).items()}
        widen = lambda k, x: np.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=fills[k])
        self.last_records = {k: widen(k, x) for k, x in self.last_records.items()}
    tn = toks.shape[1]
    resp_mask = np.arange(tn)[None, :] < lengths[:, None]
    return Rollout(
      tokens=np.concatenate([prompt, toks], axis=1),
      prompt_mask=np.concatenate([valid, np.zeros_like(resp_mask)], axis=1),
      response_mask=np.concatenate([np.zeros_like(valid), resp_mask], axis=1),
      behavior_logp=np.concatenate([np.zeros(valid.shape, np.float32), logps], axis=1),
      lengths=lengths.astype(np.int32),
      prompt_lengths=valid.sum(1).astype(np.int32),
      finished=finished.astype(bool),
      group_id=np.repeat(np.arange(len(prompt_token_lists), dtype=np.int32), num_samples),
      token_version=np.concatenate([np.full(valid.shape, -1, np.int32), vers.astype(np.int32)], axis=1),
      **self.last_records,  # [N, Tn, ...]: response columns only
    )

  def generate_continuations(
    self, params, token_id_lists: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int] | None, rng
  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """One continuation per context, for multi-turn tool use.

    Stops at EOS (SamplerConfig.eos_id) or any of `stop_ids` (None: the config's stop_ids),
    the stop token included. Returns [(new_ids int32 [R_n], new_logps float32 [R_n])]
    with behavior log-probs as in `generate`.
    """
    extra = self.cfg.stop_ids if stop_ids is None else tuple(stop_ids)
    eos = () if self.cfg.eos_id is None else (self.cfg.eos_id,)
    _, _, toks, logps, lengths, _ = self._run(
      params, [list(r) for r in token_id_lists], int(max_new_tokens), self._stop_mask(eos + extra), rng
    )
    return [(toks[i, : lengths[i]].copy(), logps[i, : lengths[i]].copy()) for i in range(len(lengths))]


def generate_continuations(sampler: Sampler, params, token_id_lists, max_new_tokens, stop_ids, rng):
  """Function form of Sampler.generate_continuations (bind `sampler` with functools.partial)."""
  return sampler.generate_continuations(params, token_id_lists, max_new_tokens, stop_ids, rng)
