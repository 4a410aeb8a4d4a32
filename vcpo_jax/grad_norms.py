"""Every per-example squared gradient norm method, and the gradient from the same backward pass.

Knows nothing of VCPO: the coefficients come in as a function `coef_fn(logp_nt, S_n)`
(`learner.policy_gradient("ghost")` passes a closure over `estimator.pg_coefficients`).
VCPO's OPOB baseline weighs trajectory n by S_n = ||s_n||^2, the squared norm of its token-SUM score
s_n = grad_params sum_t tokw_nt * logp_nt (tokw_nt: the loss mask, or token-TIS weights). The update is the
gradient of the surrogate

    loss = -sum_n coef_n * sum_t tokw_nt * logp_nt,      coef_n = coef_fn(logp_nt, S_n) (stop-gradient)

Methods, all exact:
* `ghost_sq_norms_and_grad` (the fast path): the layers are tapped (`vcpo_jax.model.taps`: input A, a zero
  perturbation Z on the output); ONE forward and ONE vjp with respect to the perturbations give each layer's
  per-example output gradient D_n, and per-example weight gradients are A_n^T D_n:
    linear kernel [Din, Dout]  ||A_n^T D_n||_F^2 by "gram" sum_{t,s} (a_t . a_s)(d_t . d_s), "direct" (form,
                               square, discard; b examples at a time) or "materialize" (form and keep it)
    linear bias                ||sum_t d_t||^2
    RMSNorm scale              ||sum_t xhat_t * d_t||^2
    embedding lookup           sum_{t,s: tok_t = tok_s} d_t . d_s, or ||onehot_n^T D_n||^2 (`embed_plan`)
    LM head (chunked)          d_t = c_t (e_{y_t} - p_t) rebuilt per vocab chunk from h, W and the logsumexp;
                               tied embeddings add the exact cross term 2 <B_n, C_n> (no [N, T, V])
  The update is contracted from the same (A, D) with coef_n (no second backward); `plan_layers` picks the
  method per layer against a per-device memory budget.
* `ghost_sq_norms_and_grad(..., passes=2)` (`learner.ghost_passes`): norm sinks (`taps.Sink`) form each
  layer's S_n in a first vjp with one layer's (A, D) alive at a time, then an ordinary backward with
  -coef_n tokw_nt gives the update; "auto" takes one pass when `one_pass_bytes` fits `one_pass_budget_bytes`.
* `vmap_sq_norms` / `per_example_sq_grad_norms`: the reference (vmap of a per-example grad).
* `loop_sq_norms`: the released reference's method, one backward pass per trajectory (lax.map).
* `taps_grad`: the taps-based backward with fixed coefficients and no norms (the yardstick of the norms' cost).

The derivations (head, tied embeddings, planning order) are in docs/design_notes.md "grad_norms.py".

Shape legend: N trajectories, T tokens, M = T - 1 predicting positions, V vocab, Vc vocab
entries per chunk, D model width, Din/Dout a linear layer's input/output widths.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vcpo_jax import sharding
from vcpo_jax.model import logprobs, moe_norms, support, taps
from vcpo_jax.sharding import path_str  # dotted parameter names, shared with the partition rules

# logp_fn(params, batch) -> logp_nt [N, T] float32; built from tapped layers.
LogpFn = Callable[[Any, Any], jax.Array]
# coef_fn(logp_nt, sq_norms_n) -> (coef_n [N], aux pytree); inputs are stop-gradient.
CoefFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, Any]]
# tokw: an array [N, T], or a function of the (stop-gradient) logp_nt, e.g. token-TIS weights.
TokW = jax.Array | Callable[[jax.Array], jax.Array]


class HeadCoefficients(NamedTuple):
  """Extra coefficients e_tv on the LM head's full log-probs: the score gains sum_{t,v} e_tv log p_tv.

  The head's per-token output gradient (wrt its logits z_t, c_t = tokw_{t+1}) is then dense:

      d_t = c_t (onehot(y_t) - p_t) + e_t - (sum_v e_tv) p_t

  (score centering passes e = -sg[c] of vcpo_jax.score_centering; this module knows nothing of it). Every
  input is stop-gradient; e must be 0 at positions outside the loss (the functions mask them).
    chunk(start, vc, logp_nmv) -> e [N, M, Vc] at vocab columns start .. start + vc - 1, given the
      learner's log-probs there, logp_nmv [N, M, Vc] (M = T - 1 predicting positions);
    at(ids_nk, logp_nmk) -> e [N, M, K] at per-row vocab ids ids_nk [N, K] (the same for every position),
      given the learner's log-probs there: only a tied head's cross term calls it.
  """

  chunk: Callable
  at: Callable | None = None
  diag: dict | None = None  # optional [N, M] per-position diagnostics of the coefficients, passed to head_sums


METHODS = ("auto", "gram", "direct", "materialize")
DEFAULT_BUDGET_BYTES = 4 << 30  # per device, for the norms' temporaries and kept per-example gradients
# A budget set for everything traced inside `memory_budget(...)` (benchmarks pin it); None: the default.
_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar("vcpo_norm_budget", default=None)


@contextlib.contextmanager
def memory_budget(nbytes: int):
  """Traced inside this context, the ghost paths called without memory_budget_bytes plan with nbytes."""
  token = _BUDGET.set(int(nbytes))
  try:
    yield
  finally:
    _BUDGET.reset(token)


def _budget(nbytes: int | None) -> int:
  if nbytes is not None:
    return nbytes
  ambient = _BUDGET.get()
  return DEFAULT_BUDGET_BYTES if ambient is None else ambient


_F32 = jnp.float32
_B = 4  # bytes per float32
_MIN_VOCAB_CHUNK = 128


class GhostResult(NamedTuple):
  """Output of `ghost_sq_norms_and_grad`.

  logp_nt: [N, T] per-token log-probs from the forward pass (no gradient flows from them).
  tokw_nt: [N, T] the token weights used.
  sq_norms_n: [N] exact ||grad_params sum_t tokw_nt logp_nt||^2 (None from `taps_grad`).
  coef_n: [N] coefficients returned by coef_fn.
  loss: scalar -sum_n coef_n sum_t tokw_nt logp_nt.
  grads: gradient of `loss` wrt params, same pytree structure as params.
  aux: whatever coef_fn returned beside coef_n.
  head_sums: with head_coefs, {"e_total", "e_logp", "e_abs"} [N, M]: sum_v e_tv, sum_v e_tv log p_tv and
    sum_v |e_tv| per predicting position (the loss includes -sum_n coef_n sum_m e_logp); else None.
  """

  logp_nt: jax.Array
  tokw_nt: jax.Array
  sq_norms_n: jax.Array | None
  coef_n: jax.Array
  loss: jax.Array
  grads: Any
  aux: Any
  head_sums: Any = None


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How one tapped matmul (a linear kernel or the LM head) computes its norm and gradient.

  n: examples per device; t: tokens per example (M = T - 1 for the head); din/dout: the matmul's
  widths (D, V for the head). block: "direct" on a linear layer: examples per block (n = all at
  once); the head: vocabulary entries per chunk. temp_bytes: transient float32 bytes while this
  layer's norm is formed; kept_bytes: bytes kept until the update ("materialize").
  """

  name: str
  kind: str  # "linear" | "head"
  method: str  # "gram" | "direct" | "materialize"
  n: int
  t: int
  din: int
  dout: int
  block: int
  temp_bytes: int
  kept_bytes: int


def sequence_logp_fn(graphdef) -> LogpFn:
  """logp_fn for `vcpo_jax.model.transformer`: batch = {"tokens": [N, T] int32, "valid_mask": [N, T] bool}."""
  from vcpo_jax.model import transformer  # local: keep this module importable without the model

  return lambda params, batch: transformer.sequence_logprobs(graphdef, params, batch["tokens"], batch["valid_mask"])


# ----------------------------------------------------------------------------- parameter paths


def _param_paths(params) -> dict[str, jax.ShapeDtypeStruct]:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return {path_str(p): jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in leaves}


def _tap_params(info: taps.TapInfo) -> list[str]:
  if info.kind == "linear":
    return [info.param + ".kernel"] + ([info.param + ".bias"] if info.has_bias else [])
  if info.kind == "embed":
    return [info.param + ".embedding"]
  if info.kind == "head":
    return [info.param + (".embedding" if info.spec.tied else ".kernel")]
  if info.kind == "scale":
    return [info.param + ".scale"]
  if info.kind == "expert":  # the stacked expert weights [(L,) E, Din, Dout] themselves
    return [info.param]
  raise ValueError(f"Unknown tap kind {info.kind!r} for {info.param!r}.")


# ----------------------------------------------------------------------------- planning


def _linear_option(method: str, n: int, t: int, din: int, dout: int, avail: int) -> tuple[int, int, int, int]:
  """(flops per example beyond the plain backward, block, temp bytes, kept bytes) of one linear layer."""
  if method == "gram":
    return t * t * (din + dout), n, 2 * n * t * t * _B, 0
  if method == "direct":
    block = int(min(n, max(1, avail // (din * dout * _B))))
    return t * din * dout + din * dout, block, block * din * dout * _B, 0
  # materialize: forming A^T D is the norm's cost; the update's T Din Dout contraction is saved.
  return 2 * din * dout - t * din * dout, n, 0, n * din * dout * _B


def _head_option(method: str, n: int, m: int, d: int, v: int, avail: int) -> tuple[int, int, int, int]:
  """(flops per example beyond the plain backward, vocab chunk, temp bytes, kept bytes) of the head.

  Per vocab chunk Vc the pass holds logits, softmax and D^v [N, M, Vc] (3 N M Vc floats), dL/dh
  [N, M, D] throughout, plus [N, M, M] twice (gram) or G^v [N, D, Vc] (direct). Non-materialized
  heads pay a second scan for the update (recompute the logits, contract): 2 M D V.
  """
  fixed = n * m * d * _B + (2 * n * m * m * _B if method == "gram" else 0)
  per_vc = 3 * n * m * _B + (n * d * _B if method != "gram" else 0)
  vc = max(min(v, _MIN_VOCAB_CHUNK), min(v, (avail - fixed) // per_vc if avail > fixed else 0))
  if vc < v and vc >= _MIN_VOCAB_CHUNK:
    vc -= vc % _MIN_VOCAB_CHUNK
  temp = fixed + per_vc * vc
  if method == "gram":
    return m * m * (d + v) + 2 * m * d * v, vc, temp, 0
  if method == "direct":
    return m * d * v + 2 * m * d * v, vc, temp, 0
  return m * d * v + d * v, vc, temp, n * d * v * _B


def plan_layers(
  infos: dict[str, taps.TapInfo],
  in_shapes: dict[str, Any],
  out_shapes: dict[str, Any],
  method: str = "auto",
  memory_budget_bytes: int = DEFAULT_BUDGET_BYTES,
  batch_shards: int = 1,
  keep: bool = True,
) -> dict[str, LayerPlan]:
  """Chooses gram / direct / materialize per tapped matmul, from shapes only (per (micro-)batch).

  Args:
    infos, in_shapes, out_shapes: per tap (in/out shapes of the matmul, one layer's for a tap inside the
      stacked blocks, TapInfo.layers > 0; for a "head" tap the shape of its input h [N, T, D],
      out_shapes[name] = (V,)).
    method: "auto", or one method forced on every layer ("direct" still blocks by the budget).
    memory_budget_bytes: per-device bytes for the norms: kept per-example gradients of the
      materialized layers plus the largest transient of the others must fit.
    batch_shards: devices the batch axis is split over (data x fsdp); N per device = N / shards.
    keep: whether per-example gradients may be kept ("materialize"); False for the two-pass step,
      whose norms are formed one layer at a time inside the backward pass ("auto" then never
      materializes and every layer's transient gets the whole budget).

  Per-example flops beyond the plain backward (which includes the T Din Dout weight-gradient
  contraction): gram T^2 (Din + Dout); direct T Din Dout; materialize 2 Din Dout - T Din Dout
  (the update becomes a weighted sum). "auto" first materializes layers in order of flops saved
  per kept byte while the kept bytes plus the largest minimal transient of the rest fit, then
  gives every other layer the cheaper of gram/direct among those whose temporaries fit what is
  left (direct in blocks of examples, the head in vocab chunks); if none fits, the smallest.
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  if not keep and method == "materialize":
    raise ValueError("method='materialize' keeps per-example gradients; the two-pass step (passes=2) keeps none.")
  if batch_shards < 1:
    raise ValueError(f"batch_shards={batch_shards}: must be >= 1 (data x fsdp devices).")
  dims = {}
  for name, info in infos.items():
    n = -(-in_shapes[name][0] // batch_shards)
    if info.kind == "linear":
      t, din, dout = _matmul_dims(in_shapes[name], out_shapes[name])
      dims[name] = ("linear", n, t, din, dout)
    elif info.kind == "head":
      dims[name] = ("head", n, in_shapes[name][1] - 1, in_shapes[name][2], out_shapes[name][0])
  option = lambda kind, meth, n, t, a, b, avail: (_linear_option if kind == "linear" else _head_option)(
    meth, n, t, a, b, avail
  )

  def plan(name, meth, avail):  # a stacked tap's plan is per layer; it keeps L layers' gradients
    kind, n, t, a, b = dims[name]
    _, block, temp, kept = option(kind, meth, n, t, a, b, avail)
    return LayerPlan(name, kind, meth, n, t, a, b, block, temp, kept * max(infos[name].layers, 1))

  if method != "auto":
    return {k: plan(k, method, memory_budget_bytes) for k in dims}

  def min_temp(name):  # the smallest transient a non-materialized layer can get by with
    kind, n, t, a, b = dims[name]
    return min(option(kind, m, n, t, a, b, 0)[2] for m in ("gram", "direct"))

  def best(name, avail):  # the cheaper of gram/direct that fits, else the smaller
    kind, n, t, a, b = dims[name]
    opts = [(option(kind, m, n, t, a, b, avail), m) for m in ("gram", "direct")]
    fits = [(o[0], m) for o, m in opts if o[2] <= avail]
    return min(fits)[1] if fits else min((o[2], m) for o, m in opts)[1]

  saved = {}
  for name, (kind, n, t, a, b) in dims.items():
    cheap = min(option(kind, m, n, t, a, b, memory_budget_bytes)[0] for m in ("gram", "direct"))
    mat = option(kind, "materialize", n, t, a, b, memory_budget_bytes)
    saved[name] = ((cheap - mat[0]) / max(mat[3] / n, 1), name)
  kept_used, materialized = 0, set()
  for s, name in sorted(saved.values(), reverse=True):
    if s <= 0 or not keep:
      break
    mat = plan(name, "materialize", memory_budget_bytes - kept_used)
    rest = [min_temp(k) for k in dims if k not in materialized and k != name]
    if kept_used + mat.kept_bytes + max(rest + [mat.temp_bytes]) <= memory_budget_bytes:
      kept_used += mat.kept_bytes
      materialized.add(name)
  avail = memory_budget_bytes - kept_used
  return {k: plan(k, "materialize" if k in materialized else best(k, avail), avail) for k in dims}


def _matmul_dims(in_shape, out_shape) -> tuple[int, int, int]:
  t = 1
  for s in in_shape[1:-1]:
    t *= s
  return t, in_shape[-1], out_shape[-1]


def embed_plan(n: int, t: int, d: int, v: int, avail: int, kept: bool = False) -> tuple[str, int]:
  """(method, examples per block) for an embedding lookup's ||onehot_n^T D_n||^2.

  "gram": sum_{t,s: tok_t = tok_s} d_t . d_s, T^2 D flops and [N, T, T] floats; "scatter": form
  the per-example row gradient B_n [V, D] (segment sum, T D + V D flops) for `block` examples at
  a time, b V D floats. Scatter when it is cheaper (T^2 > T + V), one example's rows fit, and
  they are no more floats than gram's [T, T] (V D <= T^2) -- or `kept`: a tied head whose
  per-example [V, D] gradients are materialized anyway, so B_n + C_n is summed directly. (At a
  real vocabulary V D >> T^2, and gram's T^2 D flops are a rounding error of the step.)
  """
  if t * t > t + v and v * d * _B <= avail and (kept or v * d <= t * t):
    return "scatter", int(min(n, max(1, avail // (v * d * _B))))
  return "gram", n


# ----------------------------------------------------------------------------- the fast path


def _tapped_forward(logp_fn: LogpFn, params, batch):
  """Infos, input shapes and output shapes of every tap, from an abstract (eval_shape) forward."""
  with taps.recording() as tape:
    inputs = jax.eval_shape(lambda: (logp_fn(params, batch), dict(tape.inputs))[1])
  in_shapes, out_shapes = {}, {}
  for name, info in tape.info.items():
    if info.kind == "head":
      w = inputs[name]["w"]
      in_shapes[name], out_shapes[name] = inputs[name]["h"].shape, (logprobs.vocab_size(w, info.spec),)
    else:  # a tap inside the stacked blocks: one layer's shapes (its arrays are [L, ...])
      lead = 1 if info.layers else 0
      a = inputs[name]["a"] if info.kind == "expert" else inputs[name]
      in_shapes[name], out_shapes[name] = a.shape[lead:], tape.out_shapes[name].shape[lead:]
  return tape.info, in_shapes, tape.out_shapes, out_shapes


def _over_layers(info: taps.TapInfo, fn, *xs):
  """fn(*xs) -> (sq_n [N], extra) of one layer's arrays; for a tap inside the stacked blocks
  (info.layers > 0) mapped over their layer axis one layer at a time (lax.map: one layer's temporaries
  alive, a program that does not grow with depth), sq_n summed over the layers and extra stacked [L, ...]."""
  if not info.layers:
    return fn(*xs)
  sq, extra = jax.lax.map(lambda x: fn(*x), xs)
  return jnp.sum(sq, axis=0), extra


def _per_layer(info: taps.TapInfo, fn, *xs):
  """fn(*xs) of one layer's arrays, vmapped over a stacked tap's layer axis (a gradient [L, ...])."""
  return jax.vmap(fn)(*xs) if info.layers else fn(*xs)


def _resolve_tokw(tokw: TokW, logp_nt: jax.Array) -> jax.Array:
  tokw_nt = tokw(logp_nt) if callable(tokw) else tokw
  tokw_nt = jax.lax.stop_gradient(jnp.asarray(tokw_nt, _F32))
  if tokw_nt.shape != logp_nt.shape:
    raise ValueError(
      f"tokw_nt has shape {tokw_nt.shape}; it must match logp_nt {logp_nt.shape} "
      "(one weight per token, 0 outside the loss mask)."
    )
  return tokw_nt


def _flat(a: jax.Array, n: int) -> jax.Array:
  """[N, ..., C] -> [N, T, C] in float32 (all leading token axes folded into T)."""
  return a.reshape(n, -1, a.shape[-1]).astype(_F32)


def _gram_sq_norm(a_ntk: jax.Array, d_nto: jax.Array) -> jax.Array:
  """sum_{t,s} (a_t . a_s)(d_t . d_s) = ||A_n^T D_n||_F^2, [N]."""
  return jnp.einsum("nts,nts->n", jnp.einsum("nti,nsi->nts", a_ntk, a_ntk), jnp.einsum("nto,nso->nts", d_nto, d_nto))


def _map_rows(fn, xs, block: int, shards: int) -> jax.Array:
  """fn(rows) -> [rows] over the leading (batch) axis, `block` rows per device at a time, [N].

  The batch axis is split over `shards` devices (contiguous rows per device). A plain
  `lax.map(..., batch_size=block)` would scan over that sharded axis and make the partitioner
  gather every row on every device; here the rows are regrouped [N] -> [steps, shards, block'] so
  that each step takes block' <= block rows of every device at once (block' divides N / shards)
  and the scan runs over an unsharded axis.
  """
  n = jax.tree.leaves(xs)[0].shape[0]
  shards = shards if shards >= 1 and n % shards == 0 else 1
  per = n // shards
  if block >= per:
    return fn(xs)
  b = max(d for d in range(1, max(1, block) + 1) if per % d == 0)
  steps = per // b

  def regroup(x):  # [N, ...] -> [steps, shards * b, ...], axis 1 split over the batch axes
    x = x.reshape((shards, steps, b) + x.shape[1:]).swapaxes(0, 1)
    x = sharding.constrain(x, (None, sharding.BATCH_AXES))
    return x.reshape((steps, shards * b) + x.shape[3:])

  out = jax.lax.map(fn, jax.tree.map(regroup, xs))  # [steps, shards * b]
  return out.reshape(steps, shards, b).swapaxes(0, 1).reshape(n)


def _direct_sq_norm(a_nti: jax.Array, d_nto: jax.Array, block: int, shards: int = 1) -> jax.Array:
  """||A_n^T D_n||_F^2 by forming the per-example gradient, `block` examples per device at a time, [N]."""

  def rows(ad):
    g = jnp.einsum("nti,nto->nio", ad[0], ad[1])
    return jnp.sum(g * g, axis=(1, 2))

  return _map_rows(rows, (a_nti, d_nto), block, shards)


def _embed_sq_norm(
  tok_nt: jax.Array, d_ntd: jax.Array, v: int = 0, block: int = 0, kept_nvd=None, shards: int = 1
) -> jax.Array:
  """||B_n||^2 with B_n = onehot_n^T D_n [V, D] the lookup's row gradient, [N].

  block = 0: sum_{t,s: tok_t = tok_s} d_t . d_s (T^2 D flops, no [V, D] buffer). block > 0: B_n by a
  segment sum, `block` examples per device at a time (`_map_rows`); with kept_nvd (the tied head's materialized per-example
  gradient C_n [N, V, D]) returns ||B_n + C_n||^2 - ||C_n||^2 = ||B_n||^2 + 2 <B_n, C_n>, the
  lookup's part of the tied table's norm, cross term included.
  """
  if block <= 0:
    same = tok_nt[:, :, None] == tok_nt[:, None, :]
    return jnp.sum(jnp.where(same, jnp.einsum("ntd,nsd->nts", d_ntd, d_ntd), 0.0), axis=(1, 2))

  def one(x):
    b = jax.ops.segment_sum(x["d"], x["tok"], num_segments=v)  # [V, D]
    sq = jnp.sum(b * b)
    return sq + 2.0 * jnp.sum(b * x["c"]) if "c" in x else sq

  xs = {"tok": tok_nt, "d": d_ntd} | ({"c": kept_nvd} if kept_nvd is not None else {})
  return _map_rows(jax.vmap(one), xs, block, shards)


def _head_extra_sums(rec, spec, head_coefs: HeadCoefficients, block: int) -> dict:
  """{"e_total", "e_logp", "e_abs"} [N, M] of HeadCoefficients (see GhostResult.head_sums): one scan over the
  head's vocab chunks (`block` entries each), logits rebuilt from h, W and the forward's lse."""
  h, w, lse = rec["h"], rec["w"].astype(spec.dtype), rec["lse"]
  h_m = h[:, :-1]
  v = logprobs.vocab_size(w, spec)
  vc, nv = logprobs.vocab_chunks(v, block)

  def body(carry, i):
    start, live = logprobs.chunk_columns(i, v, vc)
    lp = _head_logp_chunk(rec, h_m, logprobs.vocab_slice(w, spec, start, vc), spec, start, vc)
    e = jnp.where(live, head_coefs.chunk(start, vc, lp), 0.0)
    lp = jnp.where(live & jnp.isfinite(lp), lp, 0.0)  # off the replayed support p = 0 (and e = 0)
    return tuple(a + b for a, b in zip(carry, (jnp.sum(e, -1), jnp.sum(e * lp, -1), jnp.sum(jnp.abs(e), -1)))), None

  z = jnp.zeros(lse.shape, _F32)
  (tot, elp, eabs), _ = jax.lax.scan(body, (z, z, z), jnp.arange(nv))
  return {"e_total": tot, "e_logp": elp, "e_abs": eabs}


def _head_logp_chunk(rec, h_m, w_c, spec, start, vc: int):
  """log p [N, M, Vc] of a vocab chunk from the head's record: logits - lse, and with support replay (the record's
  "cut", model/support.py) -inf off each position's replayed support, so p = 0 there."""
  lg = logprobs.logits(h_m, w_c, spec)
  lp = lg - rec["lse"][..., None]
  if "cut" not in rec:
    return lp
  return jnp.where(support.keep(lg, start + jnp.arange(vc), rec["tokens"][:, 1:], rec["cut"]), lp, -jnp.inf)


def _head_scan(rec, spec, c_nm, plan: LayerPlan, *, want_dh: bool, want_sq: bool, w_n=None, path: str = "", extra=None):
  """One scan over the head's vocab chunks, recomputing logits from h, W and the forward's lse.

  With D^v = c * (onehot(y) - softmax)[:, :, chunk v] ([N, M, Vc], the head's output gradient; with
  extra = (HeadCoefficients, e_total [N, M]) plus e^v - e_total softmax^v, the dense extra part):
    want_dh: dL/dh [N, T, D] = sum_v D^v W_v^T (0 at the last position, which predicts nothing);
    want_sq: the head's S_n (gram or direct by plan.method) and, for "materialize", the kept
      per-example gradients G_n [N, D, V] (tied: [N, V, D]);
    w_n [N]: the update gradient sum_n w_n H_n^T D_n in w's layout.
  path: the head parameter's dotted name; under a mesh the kept and update buffers take its
    partition-rule layout (`sharding.constrain_param`), so they stay sharded like the weights.
  Returns (dh or None, sq_n or None, kept or None, grad_w or None).
  """
  h, w, y = rec["h"], rec["w"], rec["tokens"][:, 1:]
  h, w = sharding.tie(h, w)  # the head's gather stays here, not hoisted out of a micro-batch loop
  w = w.astype(spec.dtype)  # once: an FSDP-sharded head is all-gathered in the compute dtype
  n, t, d = h.shape
  h_m = h[:, :-1]
  h32 = h_m.astype(_F32)
  v = logprobs.vocab_size(w, spec)
  vc, nv = logprobs.vocab_chunks(v, plan.block)
  gram = want_sq and plan.method == "gram"
  keep = want_sq and plan.method == "materialize"
  hh = jnp.einsum("ntd,nsd->nts", h32, h32) if gram else None
  # The layout of a [.., D] x [.., Vc] product in w's orientation (tied w is [V, D]).
  g_eq = "ntd,ntv->nvd" if spec.tied else "ntd,ntv->ndv"
  axis = 1 if spec.tied else 2  # vocab axis of G_n
  carry = (
    jnp.zeros((n, t - 1, d), _F32) if want_dh else None,
    jnp.zeros((n,), _F32) if want_sq else None,
    sharding.constrain_param(jnp.zeros((n,) + w.shape, _F32), path, lead=(sharding.BATCH_AXES,)) if keep else None,
    sharding.constrain_param(jnp.zeros(w.shape, _F32), path) if w_n is not None else None,
  )
  gw_eq = "ntd,ntv->vd" if spec.tied else "ntd,ntv->dv"

  def add_cols(buf, part, start, ax):
    cur = jax.lax.dynamic_slice_in_dim(buf, start, vc, axis=ax)
    return jax.lax.dynamic_update_slice_in_dim(buf, cur + part, start, axis=ax)

  def body(carry, i):
    dh, sq, kept, gw = carry
    start, live = logprobs.chunk_columns(i, v, vc)
    w_c = logprobs.vocab_slice(w, spec, start, vc)
    lp = _head_logp_chunk(rec, h_m, w_c, spec, start, vc)
    p = jnp.exp(lp)
    onehot = (start + jnp.arange(vc)) == y[..., None]
    d_c = c_nm[..., None] * (onehot.astype(_F32) - p)
    if extra is not None:  # the dense part: e - (sum_v e) p
      d_c = d_c + extra[0].chunk(start, vc, lp) - extra[1][..., None] * p
    d_c = jnp.where(live, d_c, 0.0)  # [N, M, Vc]
    if dh is not None:
      eq = "nmv,vd->nmd" if spec.tied else "nmv,dv->nmd"
      dh = dh + jnp.einsum(eq, d_c.astype(spec.dtype), w_c.astype(spec.dtype), preferred_element_type=_F32)
    if gram:
      sq = sq + jnp.einsum("nts,nts->n", hh, jnp.einsum("ntv,nsv->nts", d_c, d_c))
    elif sq is not None:
      g = jnp.einsum(g_eq, h32, d_c)
      sq = sq + jnp.sum(g * g, axis=(1, 2))
      if kept is not None:
        kept = sharding.constrain_param(add_cols(kept, g, start, axis), path, lead=(sharding.BATCH_AXES,))
    if gw is not None:
      gw = add_cols(gw, jnp.einsum(gw_eq, h32, d_c * w_n[:, None, None]), start, axis - 1)
      gw = sharding.constrain_param(gw, path)
    return (dh, sq, kept, gw), None

  (dh, sq, kept, gw), _ = jax.lax.scan(body, carry, jnp.arange(nv))
  if dh is not None:
    dh = jnp.pad(dh, ((0, 0), (0, 1), (0, 0))).astype(h.dtype)
  return dh, sq, kept, gw


def _tied_cross_term(rec, spec, c_nm, tok_nt, d_emb, extra=None) -> jax.Array:
  """2 <B_n, C_n> = 2 sum_{s,t} d_s[tok_t] (h_s . d^emb_t), [N]; [N, M, T] values, no [N, T, V].
  extra: (HeadCoefficients, e_total) as in `_head_scan`; d_s[tok_t] gains e_s[tok_t] - e_total_s p_s[tok_t]."""
  h, w, lse, y = rec["h"], rec["w"], rec["lse"], rec["tokens"][:, 1:]
  h_m = h[:, :-1]
  e_tok = jnp.take(w, tok_nt, axis=0)  # [N, T, D]: the table rows of the looked-up tokens
  lg = jnp.einsum("nsd,ntd->nst", h_m.astype(spec.dtype), e_tok.astype(spec.dtype)).astype(_F32)
  p_st = jnp.exp(lg - lse[..., None])
  if "cut" in rec:  # support replay: p = 0 at looked-up tokens off position s's replayed support
    p_st = jnp.where(support.keep(lg, tok_nt[:, None, :], y, rec["cut"]), p_st, 0.0)
  d_st = c_nm[..., None] * ((y[..., None] == tok_nt[:, None, :]).astype(_F32) - p_st)
  if extra is not None:
    if extra[0].at is None:
      raise ValueError("HeadCoefficients.at is None: a tied head's cross term needs e at the looked-up ids")
    d_st = d_st + extra[0].at(tok_nt, lg - lse[..., None]) - extra[1][..., None] * p_st
  m_st = jnp.einsum("nsd,ntd->nst", h_m.astype(_F32), d_emb)
  return 2.0 * jnp.sum(d_st * m_st, axis=(1, 2))


def _owners(infos: dict[str, taps.TapInfo], params) -> tuple[dict[str, jax.ShapeDtypeStruct], dict[str, list[str]]]:
  """(parameter shapes by path, the taps owning each path); raises unless taps and parameters cover each other."""
  if not infos:
    raise ValueError("logp_fn recorded no taps: build it from vcpo_jax.model layers (Linear, Embed, RMSNorm).")
  param_shapes = _param_paths(params)
  owners: dict[str, list[str]] = {}
  for name, info in infos.items():
    for p in _tap_params(info):
      if p not in param_shapes:
        raise ValueError(f"Tap {name!r} refers to parameter {p!r}, which is not in params.")
      owners.setdefault(p, []).append(name)
  missing = sorted(set(param_shapes) - set(owners))
  if missing:
    raise ValueError(
      f"Parameters {missing} are not covered by any tap; their per-example norms would be "
      "missing. Tap the layers that use them."
    )
  return param_shapes, owners


def _kernel_sq_norm(plan: LayerPlan, batch_shards: int, a: jax.Array, d: jax.Array):
  """(||A_n^T D_n||^2 [N], the per-example gradients [N, Din, Dout] if materialized else None), one layer."""
  n = a.shape[0]
  a_nt, d_nt = _flat(a, n), _flat(d, n)
  if plan.method == "gram":
    return _gram_sq_norm(a_nt, d_nt), None
  if plan.method == "direct":
    return _direct_sq_norm(a_nt, d_nt, plan.block, batch_shards), None
  g = jnp.einsum("nti,nto->nio", a_nt, d_nt)
  return jnp.sum(g * g, axis=(1, 2)), g


def _param_sq_norms(infos, owners, acts, outgrads, plans, param_shapes, kept, c_nm, extra, batch_shards, avail):
  """sum over the non-head parameters of the per-example squared gradient norms, [N] float32.

  The head's own S_n comes from the head scan; here: linear kernels (gram / direct / materialize, the
  materialized per-example gradients stored in `kept` for the update), biases, scales, embedding lookups
  (gram or scatter form within `avail` bytes) and the tied embedding + head pair's cross term.
  """
  n = c_nm.shape[0]
  sq_n = jnp.zeros((n,), _F32)

  def embed_block(tok, d_emb, v, kept=False):  # 0: the gram form; else examples per block of the scatter form
    t = tok.size // n
    meth, block = embed_plan(-(-n // batch_shards), t, d_emb.shape[-1], v, avail, kept)
    return block if meth == "scatter" else 0

  for p, names in owners.items():
    kinds = sorted(infos[k].kind for k in names)
    if len(names) == 1:
      name = names[0]
      info = infos[name]
      if info.kind == "head":
        continue  # its S_n came from the head scan
      a, d = acts[name], outgrads[name]
      if info.kind == "linear":
        if p.endswith(".bias"):
          sq_n += _over_layers(info, lambda d: (jnp.sum(jnp.sum(_flat(d, n), axis=1) ** 2, axis=-1), None), d)[0]
          continue
        sq, g = _over_layers(info, functools.partial(_kernel_sq_norm, plans[name], batch_shards), a, d)
        sq_n += sq
        if g is not None:  # per-example kernel gradients, kept ([L, N, Din, Dout] when stacked)
          kept[name] = g
      elif info.kind == "scale":
        scale_sq = lambda a, d: (jnp.sum(jnp.sum(_flat(a, n) * _flat(d, n), axis=1) ** 2, axis=-1), None)
        sq_n += _over_layers(info, scale_sq, a, d)[0]
      elif info.kind == "embed":
        v = param_shapes[p].shape[0]
        sq_n += _embed_sq_norm(a.reshape(n, -1), _flat(d, n), v, embed_block(a, d, v), shards=batch_shards)
      elif info.kind == "expert":
        e = param_shapes[p].shape[-3]
        impl = info.spec or "ragged"
        sq_n += _over_layers(info, lambda a, d, e=e: (_expert_sq_norm(a, d, n, e, impl), None), a, d)[0]
      else:
        raise ValueError(f"Unsupported tap kind {info.kind!r} for parameter {p!r}.")
    elif kinds == ["embed", "head"]:  # tied embeddings: lookup + LM head share the table
      emb = next(k for k in names if infos[k].kind == "embed")
      head = next(k for k in names if infos[k].kind == "head")
      tok_nt, d_emb = acts[emb].reshape(n, -1), _flat(outgrads[emb], n)
      v = param_shapes[p].shape[0]
      block = embed_block(acts[emb], outgrads[emb], v, head in kept)
      if head in kept and block:  # ||B_n||^2 + 2 <B_n, C_n> from B_n and the kept C_n
        sq_n += _embed_sq_norm(tok_nt, d_emb, v, block, kept[head], batch_shards)
      else:  # ||B_n||^2, and the cross term from [N, M, T] values; ||C_n||^2 came from the head scan
        sq_n += _embed_sq_norm(tok_nt, d_emb, v, block, shards=batch_shards)
        sq_n += _tied_cross_term(acts[head], infos[head].spec, c_nm, tok_nt, d_emb, extra.get(head))
    else:
      raise ValueError(
        f"Parameter {p!r} is used by taps {names} of kinds {kinds}; only a tied "
        "embed + head pair may share a parameter."
      )

  return sq_n


def _expert_sq_norm(a: dict, d: jax.Array, n: int, num_experts: int, impl: str = "ragged") -> jax.Array:
  """One expert matmul's S_n [N] (`moe_norms.expert_sq_norms`): the gram form while an example's rows r = R / N
  cost fewer flops than its experts' gradients (r (Din + Dout) <= Din Dout, as for a linear layer), else the
  direct form one example at a time (E Din Dout floats transient). Each device its own examples' rows (the
  model dispatches per device: `moe.experts_forward`), `sharding.batch_local`."""
  r, din, dout = a["a"].shape[0] // n, a["a"].shape[-1], d.shape[-1]
  method = "gram" if r * (din + dout) <= din * dout else "direct"
  n_loc = n // sharding.batch_shards(n)
  kw = dict(n=n_loc, num_experts=num_experts, method=method, block=1 if method == "direct" else 0, impl=impl)
  fn = lambda _, a_, d_, e_, ex_: moe_norms.expert_sq_norms(a_, d_, e_, ex_, **kw)
  return sharding.batch_local(fn, (a["a"], d, a["expert"], a["example"]), (1, 1, 1, 1), n)


def _expert_grad(a: dict, d: jax.Array, w_n: jax.Array, num_experts: int, impl: str = "ragged") -> jax.Array:
  """sum_r w_{n_r} a_r^T d_r per expert (`moe_norms.expert_weighted_grad`), each device over its own rows, summed."""
  n = w_n.shape[0]
  n_loc = n // sharding.batch_shards(n)

  def fn(index, a_, d_, e_, ex_, w_):
    return moe_norms.expert_weighted_grad(a_, d_, e_, ex_ - index * n_loc, w_, num_experts=num_experts, impl=impl)

  return sharding.batch_local(fn, (a["a"], d, a["expert"], a["example"], w_n), (1, 1, 1, 1, 1), n, reduce=True)


def _update_grads(infos, acts, outgrads, plans, param_shapes, kept, grads_by_path, c_nm, extra, w_n):
  """{parameter path: gradient} of sum_n w_n * (the row's score): backprop is linear in the per-example
  cotangents, so every tap contracts its activations and output gradients with w_n (the head from its
  scan or its kept per-example gradient, kept linear kernels as sum_n w_n g_n). Each gradient takes its
  parameter's layout under a mesh."""
  n = w_n.shape[0]
  grads: dict[str, jax.Array] = {}

  def add(path, g):  # under a mesh, each gradient takes its parameter's layout (reduce-scattered, not replicated)
    g = g.astype(param_shapes[path].dtype)
    grads[path] = sharding.constrain_param(grads[path] + g if path in grads else g, path)

  for name, info in infos.items():
    if info.kind == "head":
      path = _tap_params(info)[0]
      if name in grads_by_path:  # taps_grad: formed in the head scan
        add(path, grads_by_path[name])
      elif name in kept:
        add(path, jnp.einsum("n,n...->...", w_n, kept[name]))
      else:
        add(
          path,
          _head_scan(
            acts[name],
            info.spec,
            c_nm,
            plans[name],
            want_dh=False,
            want_sq=False,
            w_n=w_n,
            path=path,
            extra=extra.get(name),
          )[3],
        )
      continue
    a, d = acts[name], outgrads[name]
    if info.kind == "linear":  # (a stacked tap's contractions vmapped over its layer axis)
      if name in kept:
        add(info.param + ".kernel", _per_layer(info, lambda g: jnp.einsum("n,nio->io", w_n, g), kept[name]))
      else:
        contract = lambda a, d: jnp.einsum("nti,nto->io", _flat(a, n), _flat(d, n) * w_n[:, None, None])
        add(info.param + ".kernel", _per_layer(info, contract, a, d))
      if info.has_bias:
        add(info.param + ".bias", _per_layer(info, lambda d: jnp.einsum("n,nto->o", w_n, _flat(d, n)), d))
    elif info.kind == "scale":
      scale_g = lambda a, d: jnp.einsum("n,ntd->d", w_n, _flat(a, n) * _flat(d, n))
      add(info.param + ".scale", _per_layer(info, scale_g, a, d))
    elif info.kind == "expert":  # sum_r w_{n_r} a_r^T d_r per expert
      e = param_shapes[info.param].shape[-3]
      grad = lambda a, d, e=e, impl=info.spec or "ragged": _expert_grad(a, d, w_n, e, impl)
      add(info.param, _per_layer(info, grad, a, d))
    elif info.kind == "embed":
      table = param_shapes[info.param + ".embedding"]
      rows = (
        jnp.zeros(table.shape, _F32)
        .at[a.reshape(-1)]
        .add((_flat(d, n) * w_n[:, None, None]).reshape(-1, table.shape[-1]))
      )
      add(info.param + ".embedding", rows)

  return grads


def _ghost(logp_fn, params, batch, tokw, coef_fn, coef_n, method, memory_budget_bytes, batch_shards, head_coefs=None):
  """The shared body of `ghost_sq_norms_and_grad` (coef_fn given) and `taps_grad` (coef_n given)."""
  norms = coef_fn is not None
  infos, in_shapes, pert_shapes, out_shapes = _tapped_forward(logp_fn, params, batch)
  # Coverage: every parameter leaf is owned by a tap and every tap names a parameter.
  param_shapes, owners = _owners(infos, params)
  memory_budget_bytes = _budget(memory_budget_bytes)  # None: the ambient `memory_budget`, else the default
  if batch_shards is None:  # the devices the traced mesh splits this (micro-)batch over
    batch_shards = sharding.batch_shards(jax.tree.leaves(batch)[0].shape[0])
  plans = plan_layers(infos, in_shapes, out_shapes, method, memory_budget_bytes, batch_shards)
  heads = [k for k, info in infos.items() if info.kind == "head"]

  # One forward pass; the head's log-probs come from stop_gradient(h), h is an output of its own.
  zeros = {k: jnp.zeros(v.shape, v.dtype) for k, v in pert_shapes.items()}

  def tapped(perts):
    with taps.recording(perts) as tape:
      logp = logp_fn(params, batch)
    acts = dict(tape.inputs)
    return (logp, {k: acts[k]["h"] for k in heads}), acts

  (logp_nt, _), vjp_fn, acts = jax.vjp(tapped, zeros, has_aux=True)
  logp_nt = jax.lax.stop_gradient(logp_nt)
  n = logp_nt.shape[0]
  tokw_nt = _resolve_tokw(tokw, logp_nt)
  if not norms:
    coef_n = jax.lax.stop_gradient(jnp.asarray(coef_n, _F32))
  # The head's pass over vocab chunks: dL/dh for the backward below, and its norm (or, without
  # norms, its weight gradient in the same pass).
  c_nm = tokw_nt[:, 1:]
  sq_n = jnp.zeros((n,), _F32)
  dh, kept, grads_by_path = {}, {}, {}
  # head_coefs: the head's dense extra coefficients (one head); their row sums first, a vocab pass
  head_sums = {}
  if head_coefs is not None and not isinstance(head_coefs, HeadCoefficients):  # built from the head's record
    rec = acts[heads[0]]
    head_coefs = head_coefs(rec["h"], rec["w"], rec["lse"], infos[heads[0]].spec, cut=rec.get("cut"))
  if head_coefs is not None:
    head_sums = {
      k: {**_head_extra_sums(acts[k], infos[k].spec, head_coefs, plans[k].block), **(head_coefs.diag or {})}
      for k in heads[:1]
    }
  extra = {k: (head_coefs, hs["e_total"]) for k, hs in head_sums.items()}
  for k in heads:
    dh[k], sq_k, kept_k, gw = _head_scan(
      acts[k],
      infos[k].spec,
      c_nm,
      plans[k],
      want_dh=True,
      want_sq=norms,
      w_n=None if norms else -coef_n,
      path=_tap_params(infos[k])[0],
      extra=extra.get(k),
    )
    if norms:
      sq_n += sq_k
    if kept_k is not None:
      kept[k] = kept_k
    if gw is not None:
      grads_by_path[k] = gw
  (outgrads,) = vjp_fn((tokw_nt.astype(logp_nt.dtype), dh))

  # What the kept per-example gradients leave of the budget goes to the embedding lookups' norms.
  kept_bytes = sum(pl.kept_bytes for pl in plans.values() if pl.method == "materialize")
  avail = memory_budget_bytes - kept_bytes

  if norms:  # per-example squared norms, parameter by parameter; keeps what the update needs in `kept`
    sq_n += _param_sq_norms(infos, owners, acts, outgrads, plans, param_shapes, kept, c_nm, extra, batch_shards, avail)

  aux = None
  if norms:
    coef_n, aux = coef_fn(logp_nt, jax.lax.stop_gradient(sq_n))
    coef_n = jax.lax.stop_gradient(jnp.asarray(coef_n, _F32))
  if coef_n.shape != (n,):
    raise ValueError(f"coef_n has shape {coef_n.shape}; expected ({n},), one coefficient per trajectory.")
  # where(): padding tokens may carry logp = -inf; they have weight 0 and must not give nan.
  loss = -jnp.sum(coef_n * jnp.sum(jnp.where(tokw_nt != 0, tokw_nt * logp_nt, 0.0), axis=1))
  for hs in head_sums.values():  # the extra term of the score, sum_m sum_v e log p
    loss = loss - jnp.sum(coef_n * jnp.sum(hs["e_logp"], axis=1))

  # The update: backprop is linear in the per-example cotangents, so contract with -coef_n.
  grads = _update_grads(infos, acts, outgrads, plans, param_shapes, kept, grads_by_path, c_nm, extra, -coef_n)
  grads = jax.tree_util.tree_map_with_path(lambda path, _: grads[path_str(path)], params)
  return GhostResult(
    logp_nt, tokw_nt, sq_n if norms else None, coef_n, loss, grads, aux, head_sums.get(heads[0]) if head_sums else None
  )


def _sink_norm(plans: dict[str, LayerPlan], batch_shards: int, n_rows: int = 0, param_shapes=None):
  """taps.Sink's norm(name, info, a, d) -> [N]: one "linear" (kernel + bias), "scale" or "expert" tap's S_n part
  (an expert tap's examples: n_rows, its experts: from param_shapes)."""

  def norm(name, info, a, d):
    if info.kind == "expert":
      return _expert_sq_norm(a, d, n_rows, param_shapes[info.param].shape[-3], info.spec or "ragged")
    n = a.shape[0]
    a_nt, d_nt = _flat(a, n), _flat(d, n)
    if info.kind == "scale":
      return jnp.sum(jnp.sum(a_nt * d_nt, axis=1) ** 2, axis=-1)
    plan = plans[name]
    if plan.method == "gram":
      sq = _gram_sq_norm(a_nt, d_nt)
    else:
      sq = _direct_sq_norm(a_nt, d_nt, plan.block, batch_shards)
    if info.has_bias:
      sq = sq + jnp.sum(jnp.sum(d_nt, axis=1) ** 2, axis=-1)
    return sq

  return norm


def _ghost_two_pass(logp_fn, params, batch, tokw, coef_fn, method, memory_budget_bytes, batch_shards):
  """`ghost_sq_norms_and_grad` with passes=2: norms block by block in a first backward, then the update.

    logp_nt, vjp = jax.vjp(tapped logp_fn, params, s = 0 [N], Z_embed = 0)   one forward, norm sinks on
                                                                                every linear / scale tap
    (_, S_lin_n, D_emb) = vjp(tokw_nt)       the sinks' norms summed over layers, one layer's (A, D) at a time
    S_n = S_lin_n + head (vocab-chunk scan) + embedding lookup (+ tied cross term) from D_emb
    coef_n = coef_fn(logp_nt, S_n);   (grads, _, _) = vjp(-coef_n tokw_nt)   the update, an ordinary backward

  Memory: the forward's residuals (with block remat: the block inputs) plus ONE layer's (A, D) and its
  norm temporaries; nothing per example is kept across layers (no "materialize"). Cost: a second
  backward pass (with remat, the blocks are recomputed twice) instead of contractions with kept (A, D).
  """
  infos, in_shapes, pert_shapes, out_shapes = _tapped_forward(logp_fn, params, batch)
  param_shapes, owners = _owners(infos, params)
  memory_budget_bytes = _budget(memory_budget_bytes)
  if batch_shards is None:
    batch_shards = sharding.batch_shards(jax.tree.leaves(batch)[0].shape[0])
  plans = plan_layers(infos, in_shapes, out_shapes, method, memory_budget_bytes, batch_shards, keep=False)
  heads = [k for k, info in infos.items() if info.kind == "head"]
  embeds = [k for k, info in infos.items() if info.kind == "embed"]
  n = jax.tree.leaves(batch)[0].shape[0]
  zeros = {k: jnp.zeros(pert_shapes[k].shape, pert_shapes[k].dtype) for k in embeds}
  norm = _sink_norm(plans, batch_shards, n, param_shapes)

  def tapped(p, s, perts):
    with taps.recording(perts, taps.Sink(s, norm)) as tape:
      logp = logp_fn(p, batch)
    return logp, dict(tape.inputs)

  logp_nt, vjp_fn, acts = jax.vjp(tapped, params, jnp.zeros((n,), _F32), zeros, has_aux=True)
  tokw_nt = _resolve_tokw(tokw, jax.lax.stop_gradient(logp_nt))
  _, sq_n, d_out = vjp_fn(tokw_nt.astype(logp_nt.dtype))  # pass 1: its parameter cotangent is dead code
  c_nm = tokw_nt[:, 1:]
  for k in heads:
    sq_n += _head_scan(acts[k], infos[k].spec, c_nm, plans[k], want_dh=False, want_sq=True)[1]
  for k in embeds:
    p = _tap_params(infos[k])[0]
    v = param_shapes[p].shape[0]
    tok_nt, d_emb = acts[k].reshape(n, -1), _flat(d_out[k], n)
    meth, block = embed_plan(-(-n // batch_shards), tok_nt.shape[1], d_emb.shape[-1], v, memory_budget_bytes)
    sq_n += _embed_sq_norm(tok_nt, d_emb, v, block if meth == "scatter" else 0, shards=batch_shards)
    head = [h for h in owners[p] if infos[h].kind == "head"]
    if head:  # tied: the cross term 2 <B_n, C_n>; ||C_n||^2 came from the head scan
      sq_n += _tied_cross_term(acts[head[0]], infos[head[0]].spec, c_nm, tok_nt, d_emb)
  logp_nt = jax.lax.stop_gradient(logp_nt)
  coef_n, aux = coef_fn(logp_nt, jax.lax.stop_gradient(sq_n))
  coef_n = jax.lax.stop_gradient(jnp.asarray(coef_n, _F32))
  if coef_n.shape != (n,):
    raise ValueError(f"coef_n has shape {coef_n.shape}; expected ({n},), one coefficient per trajectory.")
  loss = -jnp.sum(coef_n * jnp.sum(jnp.where(tokw_nt != 0, tokw_nt * logp_nt, 0.0), axis=1))
  grads, _, _ = vjp_fn((-coef_n[:, None] * tokw_nt).astype(logp_nt.dtype))  # pass 2: its norms are dead code
  return GhostResult(logp_nt, tokw_nt, sq_n, coef_n, loss, grads, aux)


PASSES = (1, 2)
DEFAULT_ONE_PASS_BUDGET_BYTES = 24 << 30  # passes="auto": one pass while its (A, D) fit this, per device


def one_pass_bytes(logp_fn: LogpFn, params, batch, batch_shards: int | None = None) -> int:
  """Per-device bytes of the (A, D) the one-pass ghost backward keeps alive together (abstract trace).

  The one-pass step returns every tapped layer's input A as a traced output (so block remat cannot drop
  it) and takes the vjp to every layer's output at once (every D alive together) before the update is
  contracted: sum over the linear / scale / embedding taps of A (each distinct array once: q, k and v
  share their input) and D, for this (micro-)batch, divided over the `batch_shards` devices its rows are
  split over (None: read off the traced mesh). The LM head is left out: both passes treat it alike (a scan
  over vocab chunks). This is what the two-pass step saves, up to one layer's worth. An estimate, not
  a compiled figure: the norms' own temporaries are not in it.
  """
  if batch_shards is None:
    batch_shards = sharding.batch_shards(jax.tree.leaves(batch)[0].shape[0])
  out: dict[str, jax.ShapeDtypeStruct] = {}

  def forward(params, batch):
    with taps.recording() as tape:
      logp_fn(params, batch)
    body = [k for k, info in tape.info.items() if info.kind != "head"]
    out.update({k: tape.out_shapes[k] for k in body})
    return list({id(tape.inputs[k]): tape.inputs[k] for k in body if k in tape.inputs}.values())

  inputs = jax.eval_shape(forward, params, batch)  # concrete or abstract (ShapeDtypeStruct) inputs
  nbytes = lambda x: x.size * jnp.dtype(x.dtype).itemsize
  nb = sum(nbytes(a) for a in jax.tree.leaves(inputs)) + sum(nbytes(d) for d in out.values())
  return int(nb) // max(1, batch_shards)


def choose_passes(
  logp_fn: LogpFn, params, batch, method: str, budget_bytes: int | None, batch_shards: int | None = None
) -> int:
  """passes="auto": 1 if `one_pass_bytes` fits budget_bytes (None: DEFAULT_ONE_PASS_BUDGET_BYTES) or the
  method is "materialize" (one pass only), else 2. Logged once per trace."""
  from absl import logging

  budget = DEFAULT_ONE_PASS_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
  need = one_pass_bytes(logp_fn, params, batch, batch_shards)
  passes = 1 if need <= budget or method == "materialize" else 2
  logging.info(
    "ghost step: one pass keeps %.2f GiB of (A, D) per device, budget %.2f GiB: %d pass(es)",
    need / 2**30,
    budget / 2**30,
    passes,
  )
  return passes


def ghost_sq_norms_and_grad(
  logp_fn: LogpFn,
  params,
  batch,
  tokw: TokW,
  coef_fn: CoefFn,
  *,
  method: str = "auto",
  memory_budget_bytes: int | None = None,
  batch_shards: int | None = None,
  passes: int | str = 1,
  one_pass_budget_bytes: int | None = None,
  head_coefs: HeadCoefficients | Callable | None = None,
) -> GhostResult:
  """Exact per-example S_n and the gradient of -sum_n coef_n sum_t tokw_nt logp_nt, one backward pass.

  With head_coefs (HeadCoefficients e_tv) the score of example n is sum_t tokw_nt logp_nt + sum_tv e_ntv
  log p_ntv (a dense per-token head output gradient): S_n, the gradient and the loss are those of it.

  Args:
    logp_fn: (params, batch) -> logp_nt [N, T]; every parameter must belong to a tapped layer
      (`vcpo_jax.model.taps`), else ValueError. Examples must not interact (no batch norm etc.).
    params: parameter pytree (nnx.State of the policy).
    batch: pytree with a leading N axis, passed to logp_fn.
    tokw: token weights [N, T] (loss mask, or token-TIS weights), or a function logp_nt -> tokw_nt.
      Treated as stop-gradient.
    coef_fn: (logp_nt, sq_norms_n) -> (coef_n [N], aux), e.g. a closure over
      `estimator.pg_coefficients`. Its inputs are stop-gradient; coef_n is treated as a constant.
    method: "auto" | "gram" | "direct" | "materialize" for linear kernels and the LM head (see
      `plan_layers`); biases, scales and embedding lookups are always exact closed forms.
    memory_budget_bytes: per-device bytes for the norms' temporaries and kept gradients (None: the
      `memory_budget` context's, else DEFAULT_BUDGET_BYTES).
    batch_shards: devices the batch axis is split over (data x fsdp), for the per-device budget and the
      per-device blocks of the direct / scatter forms; None: read off the mesh being traced with
      (`sharding.batch_shards`, 1 without one).
    passes: 1: one backward to every layer's output at once, the update contracted from the same
      (A, D) (all layers' (A, D) alive together); 2: `_ghost_two_pass`, the norms formed layer by
      layer inside a first backward (norm sinks, `taps.Sink`), then an ordinary backward for the
      update: one layer's (A, D) alive at a time, for long sequences; "materialize" not allowed;
      "auto": `choose_passes` from this (micro-)batch's shapes against one_pass_budget_bytes (None:
      DEFAULT_ONE_PASS_BUDGET_BYTES).
    head_coefs: None, or the head's extra coefficients (HeadCoefficients; one pass only, a tied head
      needs its `at`), or a function (h [N, T, D], w, lse [N, M], HeadSpec) -> HeadCoefficients of the
      forward's own head record (coefficients that depend on the learner's log-probs at given ids).

  Returns:
    GhostResult(logp_nt, tokw_nt, sq_norms_n, coef_n, loss, grads, aux, head_sums); grads has params'
    structure.
  """
  if passes == "auto":
    passes = choose_passes(logp_fn, params, batch, method, one_pass_budget_bytes, batch_shards)
  if passes not in PASSES:
    raise ValueError(f"passes={passes!r}: choose one of {PASSES} or 'auto'.")
  if passes == 2:
    if head_coefs is not None:
      raise ValueError("passes=2 with head_coefs: the two-pass path has no dense head term; use passes=1")
    return _ghost_two_pass(logp_fn, params, batch, tokw, coef_fn, method, memory_budget_bytes, batch_shards)
  return _ghost(logp_fn, params, batch, tokw, coef_fn, None, method, memory_budget_bytes, batch_shards, head_coefs)


def taps_grad(
  logp_fn: LogpFn, params, batch, tokw: TokW, coef_n: jax.Array, *, memory_budget_bytes=None
) -> GhostResult:
  """The same taps-based backward with fixed coef_n [N] and no norms (sq_norms_n = None, aux = None).

  One forward, the vjp to the layer outputs, the head's dL/dh and weight gradient in one scan over
  vocab chunks, then the weight-gradient contractions: the fair plain step next to the VCPO step.
  """
  return _ghost(logp_fn, params, batch, tokw, None, coef_n, "direct", memory_budget_bytes, None)


# ----------------------------------------------------------------------------- references


def _tree_sq_norm(tree) -> jax.Array:
  """sum over the leaves of ||leaf||_F^2, in float32: a scalar."""
  return sum(jnp.sum(jnp.square(x.astype(_F32))) for x in jax.tree.leaves(tree))


@functools.partial(jax.jit, static_argnames=("fn", "batch_size"))
def per_example_sq_grad_norms(fn, params, batch, *, batch_size=None) -> jax.Array:
  """||grad_params fn(params, example_n)||^2 for every example: the exact reference, [N] float32.

    S_n = sum_leaves ||d fn(params, x_n) / d params||_F^2,   x_n = batch with its leading N axis indexed at n

  One vmap of `jax.grad` (jitted with fn static: pass the same function object to reuse the
  compilation). Memory is N x params; batch_size processes the examples in chunks of that many
  (lax.map). The ghost norms (`ghost_sq_norms_and_grad`) are tested against this.

  Args:
    fn: fn(params, example) -> scalar, where `example` is `batch` with the leading N axis removed
      from every leaf.
    params: parameter pytree (not vmapped).
    batch: pytree whose leaves all have a leading N axis.
    batch_size: optional chunk size for lax.map (None: one vmap over N).
  Returns:
    [N] float32.

  References:
    Goodfellow, "Efficient per-example gradient computations", arXiv 1510.01799 (2015).
  """

  def one(example):
    return _tree_sq_norm(jax.grad(fn)(params, example))

  if batch_size is None:
    return jax.vmap(one)(batch)
  return jax.lax.map(one, batch, batch_size=batch_size)


def _per_example_fn(logp_fn: LogpFn):
  """fn(params, example) = sum_t tokw_t logp_t for one example (leaves without the N axis)."""

  def fn(params, example):
    one = jax.tree.map(lambda x: x[None], example["batch"])
    return jnp.sum(example["tokw_nt"] * logp_fn(params, one)[0])

  return fn


def _tokw_array(logp_fn: LogpFn, params, batch, tokw: TokW) -> jax.Array:
  if callable(tokw):
    return _resolve_tokw(tokw, jax.lax.stop_gradient(logp_fn(params, batch)))
  return jnp.asarray(tokw, _F32)


def vmap_sq_norms(logp_fn: LogpFn, params, batch, tokw: TokW) -> jax.Array:
  """S_n = ||grad sum_t tokw_nt logp_nt||^2 via `per_example_sq_grad_norms` (vmap of per-example grads), [N]."""
  tokw_nt = _tokw_array(logp_fn, params, batch, tokw)
  return per_example_sq_grad_norms(_per_example_fn(logp_fn), params, {"batch": batch, "tokw_nt": tokw_nt})


def loop_sq_norms(logp_fn: LogpFn, params, batch, tokw: TokW) -> jax.Array:
  """S_n with one backward pass per trajectory (lax.map: sequential, micro-batch 1), [N]."""
  tokw_nt = _tokw_array(logp_fn, params, batch, tokw)
  grad_fn = jax.grad(_per_example_fn(logp_fn))
  return jax.lax.map(lambda example: _tree_sq_norm(grad_fn(params, example)), {"batch": batch, "tokw_nt": tokw_nt})
