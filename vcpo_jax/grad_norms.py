"""Exact per-example squared gradient norms, and the VCPO gradient from the same backward pass.

VCPO's OPOB baseline weighs trajectory n by S_n = ||s_n||^2, the squared norm of
its token-SUM score s_n = grad_params sum_t tokw_nt * logp_nt (tokw_nt: the loss
mask, or per-token weights for token-TIS). The update is then the gradient of the
surrogate

    loss = -sum_n coef_n * sum_t tokw_nt * logp_nt,      coef_n = coef_fn(logp_nt, S_n)

where coef_n is a stop-gradient scalar per trajectory that depends on all S_n.

Three ways to get S_n, all exact:

* `ghost_sq_norms_and_grad` (the fast path). The model's layers are tapped
  (`vcpo_jax.model.taps`): every parameterised layer records its input A and adds
  a zero perturbation Z to its output. ONE forward pass and ONE vjp with respect
  to the perturbations only, with cotangent tokw_nt on logp_nt, give every
  layer's per-example output gradient D_n (examples do not interact in the
  forward pass, so D_n is exactly example n's). The vjp is not taken with
  respect to the parameters, so the backward pass skips the weight-gradient
  matmuls. Per-example weight gradients are A_n^T D_n, and:

    linear kernel [Din, Dout]:  ||A_n^T D_n||_F^2, by one of
        "gram":        sum_{t,s} (a_t . a_s)(d_t . d_s)           T^2 (Din + Dout) flops
        "direct":      form A_n^T D_n, square, discard             T Din Dout + Din Dout
        "materialize": form A_n^T D_n and KEEP it, so the update is
                       sum_n coef_n (A_n^T D_n), a weighted sum     T Din Dout + 2 Din Dout,
                       instead of another T Din Dout contraction;  N Din Dout floats kept
    linear bias:        ||sum_t d_t||^2
    RMSNorm scale:      ||sum_t xhat_t * d_t||^2
    embedding lookup:   sum_{t,s: tok_t = tok_s} d_t . d_s         (rows shared by tokens)
    tied LM head:       the table gets lookup part B_n = onehot_n^T D^emb_n and head part
                        C_n = D^head_n^T H_n; ||B_n + C_n||^2 = ||B_n||^2 + ||C_n||^2 + 2<B_n, C_n>,
                        <B_n, C_n> = sum_{t,s} D^head_n[s, tok_t] (d^emb_t . h_s).

  Backprop is linear in the per-example cotangents, so the update gradient is
  formed from the same (A, D) by contracting with coef_n (e.g. kernel:
  -sum_n coef_n A_n^T D_n = -einsum('nti,nto->io', A, coef_n D)) -- no second
  backward pass. With "gram"/"direct" the update costs the weight-gradient
  matmuls the plain backward would have done; with "materialize" it costs a
  weighted sum. `method="auto"` materializes the layers that fit a memory budget
  (most flops saved per byte first) and picks the cheaper of gram/direct for the
  rest.

* `vmap_sq_norms`: the reference, `estimator.per_example_sq_grad_norms` (vmap of
  a per-example grad).

* `loop_sq_norms`: the released reference's method, one backward pass per
  trajectory (lax.map), for benchmarks.

Shape legend: N trajectories, T tokens, V vocab, D model width, Din/Dout a
linear layer's input/output widths.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from vcpo_jax.model import taps
from vcpo_jax.sharding import path_str  # dotted parameter names, shared with the partition rules

# logp_fn(params, batch) -> logp_nt [N, T] float32; built from tapped layers.
LogpFn = Callable[[Any, Any], jax.Array]
# coef_fn(logp_nt, sq_norms_n) -> (coef_n [N], aux pytree); inputs are stop-gradient.
CoefFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, Any]]
# tokw: an array [N, T], or a function of the (stop-gradient) logp_nt, e.g. token-TIS weights.
TokW = jax.Array | Callable[[jax.Array], jax.Array]

METHODS = ("auto", "gram", "direct", "materialize")
_F32 = jnp.float32


class GhostResult(NamedTuple):
  """Output of `ghost_sq_norms_and_grad`.

  logp_nt: [N, T] per-token log-probs from the forward pass (no gradient flows from them).
  tokw_nt: [N, T] the token weights used.
  sq_norms_n: [N] exact ||grad_params sum_t tokw_nt logp_nt||^2.
  coef_n: [N] coefficients returned by coef_fn.
  loss: scalar -sum_n coef_n sum_t tokw_nt logp_nt.
  grads: gradient of `loss` wrt params, same pytree structure as params.
  aux: whatever coef_fn returned beside coef_n.
  """

  logp_nt: jax.Array
  tokw_nt: jax.Array
  sq_norms_n: jax.Array
  coef_n: jax.Array
  loss: jax.Array
  grads: Any
  aux: Any


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How one tapped matmul (linear or tied head) computes its norm and gradient."""

  name: str
  method: str  # "gram" | "direct" | "materialize"
  t: int
  din: int
  dout: int


def sequence_logp_fn(graphdef) -> LogpFn:
  """logp_fn for `vcpo_jax.model.transformer`: batch = {"tokens": [N, T] int32, "valid": [N, T] bool}."""
  from vcpo_jax.model import transformer  # local: keep this module importable without the model

  return lambda params, batch: transformer.sequence_logprobs(graphdef, params, batch["tokens"], batch["valid"])


# ----------------------------------------------------------------------------- parameter paths


def _param_paths(params) -> dict[str, jax.ShapeDtypeStruct]:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return {path_str(p): jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in leaves}


def _tap_params(info: taps.TapInfo) -> list[str]:
  if info.kind == "linear":
    return [info.param + ".kernel"] + ([info.param + ".bias"] if info.has_bias else [])
  if info.kind in ("embed", "unembed"):
    return [info.param + ".embedding"]
  if info.kind == "scale":
    return [info.param + ".scale"]
  raise ValueError(f"Unknown tap kind {info.kind!r} for {info.param!r}.")


# ----------------------------------------------------------------------------- planning


def _matmul_dims(info: taps.TapInfo, in_shape, out_shape) -> tuple[int, int, int]:
  t = 1
  for s in in_shape[1:-1]:
    t *= s
  return t, in_shape[-1], out_shape[-1]


def plan_layers(
  infos: dict[str, taps.TapInfo],
  in_shapes: dict[str, Any],
  out_shapes: dict[str, Any],
  method: str = "auto",
  materialize_budget_bytes: int = 2 << 30,
) -> dict[str, LayerPlan]:
  """Chooses gram / direct / materialize per tapped matmul (static, from shapes only).

  Per-example flop counts (fp32): gram T^2 (Din + Dout); direct T Din Dout + Din Dout, both
  followed by the T Din Dout update contraction; materialize T Din Dout + 2 Din Dout with
  N Din Dout * 4 bytes kept until the coefficients are known. "auto" materializes layers in order
  of flops saved per byte until `materialize_budget_bytes` is used, the rest take min(gram, direct).
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  plans, candidates = {}, []
  for name, info in infos.items():
    if info.kind not in ("linear", "unembed"):
      continue
    t, din, dout = _matmul_dims(info, in_shapes[name], out_shapes[name])
    gram, direct = t * t * (din + dout), t * din * dout + din * dout
    cheap = "gram" if gram < direct else "direct"
    plans[name] = LayerPlan(name, cheap if method == "auto" else method, t, din, dout)
    n = in_shapes[name][0]
    saved_per_byte = (min(gram, direct) + t * din * dout - (t * din * dout + 2 * din * dout)) / (din * dout * 4)
    candidates.append((saved_per_byte, name, n * din * dout * 4))
  if method == "auto":
    used = 0
    for _, name, nbytes in sorted(candidates, reverse=True):
      if used + nbytes <= materialize_budget_bytes:
        used += nbytes
        plans[name] = dataclasses.replace(plans[name], method="materialize")
  return plans


# ----------------------------------------------------------------------------- the fast path


def _tapped_forward(logp_fn: LogpFn, params, batch):
  """Shapes and infos of every tap, from an abstract (eval_shape) forward pass."""
  with taps.recording() as tape:
    inputs = jax.eval_shape(lambda: (logp_fn(params, batch), dict(tape.inputs))[1])
  return tape.info, inputs, tape.out_shapes


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


def ghost_sq_norms_and_grad(
  logp_fn: LogpFn,
  params,
  batch,
  tokw: TokW,
  coef_fn: CoefFn,
  *,
  method: str = "auto",
  materialize_budget_bytes: int = 2 << 30,
) -> GhostResult:
  """Exact per-example S_n and the gradient of -sum_n coef_n sum_t tokw_nt logp_nt, one backward pass.

  Args:
    logp_fn: (params, batch) -> logp_nt [N, T]; every parameter must belong to a tapped layer
      (`vcpo_jax.model.taps`), else ValueError. Examples must not interact (no batch norm etc.).
    params: parameter pytree (nnx.State of the policy).
    batch: pytree with a leading N axis, passed to logp_fn.
    tokw: token weights [N, T] (loss mask, or token-TIS weights), or a function logp_nt -> tokw_nt.
      Treated as stop-gradient.
    coef_fn: (logp_nt, sq_norms_n) -> (coef_n [N], aux), e.g. a closure over
      `estimator.pg_coefficients`. Its inputs are stop-gradient; coef_n is treated as a constant.
    method: "auto" | "gram" | "direct" | "materialize" for linear kernels and the tied head (see
      module docstring); biases, scales and embedding lookups are always exact closed forms.
    materialize_budget_bytes: for "auto", memory allowed for kept per-example kernel gradients.

  Returns:
    GhostResult(logp_nt, tokw_nt, sq_norms_n, coef_n, loss, grads, aux); grads has params' structure.
  """
  infos, in_shapes, out_shapes = _tapped_forward(logp_fn, params, batch)
  if not infos:
    raise ValueError("logp_fn recorded no taps: build it from vcpo_jax.model layers (Linear, Embed, RMSNorm).")
  # Coverage: every parameter leaf is owned by a tap and every tap names a parameter.
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
  plans = plan_layers(
    infos,
    {k: v.shape for k, v in in_shapes.items()},
    {k: v.shape for k, v in out_shapes.items()},
    method,
    materialize_budget_bytes,
  )

  # One forward pass, one vjp with respect to the zero perturbations only.
  zeros = {k: jnp.zeros(v.shape, v.dtype) for k, v in out_shapes.items()}

  def tapped(perts):
    with taps.recording(perts) as tape:
      logp = logp_fn(params, batch)
    return logp, dict(tape.inputs)

  logp_nt, vjp_fn, acts = jax.vjp(tapped, zeros, has_aux=True)
  logp_nt = jax.lax.stop_gradient(logp_nt)
  n = logp_nt.shape[0]
  tokw_nt = _resolve_tokw(tokw, logp_nt)
  (outgrads,) = vjp_fn(tokw_nt.astype(logp_nt.dtype))

  # Per-example squared norms, parameter by parameter; keep what the update needs.
  sq_n = jnp.zeros((n,), _F32)
  kept = {}  # tap name -> per-example gradient [N, ...] for "materialize"
  for p, names in owners.items():
    kinds = sorted(infos[k].kind for k in names)
    if len(names) == 1:
      name = names[0]
      info, a, d = infos[name], acts[name], outgrads[name]
      if info.kind in ("linear", "unembed"):
        a_nt, d_nt = _flat(a, n), _flat(d, n)
        if p.endswith(".bias"):
          sq_n += jnp.sum(jnp.sum(d_nt, axis=1) ** 2, axis=-1)
          continue
        plan = plans[name]
        if plan.method == "gram":
          sq_n += _gram_sq_norm(a_nt, d_nt)
        else:
          g = jnp.einsum("nti,nto->nio", a_nt, d_nt)  # per-example kernel gradient
          sq_n += jnp.sum(g * g, axis=(1, 2))
          if plan.method == "materialize":
            kept[name] = g
      elif info.kind == "scale":
        sq_n += jnp.sum(jnp.sum(_flat(a, n) * _flat(d, n), axis=1) ** 2, axis=-1)
      elif info.kind == "embed":
        sq_n += _embed_sq_norm(a.reshape(n, -1), _flat(d, n))
      else:
        raise ValueError(f"Unsupported tap kind {info.kind!r} for parameter {p!r}.")
    elif kinds == ["embed", "unembed"]:  # tied embeddings: lookup + LM head share the table
      emb = next(k for k in names if infos[k].kind == "embed")
      head = next(k for k in names if infos[k].kind == "unembed")
      tok_nt = acts[emb].reshape(n, -1)
      d_emb, h_nt, d_head = _flat(outgrads[emb], n), _flat(acts[head], n), _flat(outgrads[head], n)
      sq_n += _embed_sq_norm(tok_nt, d_emb)
      if plans[head].method == "gram":
        sq_n += _gram_sq_norm(h_nt, d_head)
      else:
        g = jnp.einsum("nti,nto->nio", h_nt, d_head)  # [N, D, V]
        sq_n += jnp.sum(g * g, axis=(1, 2))
        if plans[head].method == "materialize":
          kept[head] = g
      # 2 <B_n, C_n> = 2 sum_{t,s} D^head[s, tok_t] (d^emb_t . h_s)
      m_nts = jnp.einsum("ntd,nsd->nts", d_emb, h_nt)
      p_nst = jnp.take_along_axis(
        d_head, jnp.broadcast_to(tok_nt[:, None, :], d_head.shape[:2] + tok_nt.shape[1:]), axis=2
      )
      sq_n += 2.0 * jnp.einsum("nts,nst->n", m_nts, p_nst)
    else:
      raise ValueError(
        f"Parameter {p!r} is used by taps {names} of kinds {kinds}; only a tied "
        "embed + unembed pair may share a parameter."
      )

  coef_n, aux = coef_fn(logp_nt, jax.lax.stop_gradient(sq_n))
  coef_n = jax.lax.stop_gradient(jnp.asarray(coef_n, _F32))
  if coef_n.shape != (n,):
    raise ValueError(f"coef_fn returned coef_n of shape {coef_n.shape}; expected ({n},).")
  # where(): padding tokens may carry logp = -inf; they have weight 0 and must not give nan.
  loss = -jnp.sum(coef_n * jnp.sum(jnp.where(tokw_nt != 0, tokw_nt * logp_nt, 0.0), axis=1))

  # The update: backprop is linear in the per-example cotangents, so contract with -coef_n.
  w_n = -coef_n
  grads_by_path: dict[str, jax.Array] = {}

  def add(path, g):
    g = g.astype(param_shapes[path].dtype)
    grads_by_path[path] = grads_by_path[path] + g if path in grads_by_path else g

  for name, info in infos.items():
    a, d = acts[name], outgrads[name]
    if info.kind == "linear":
      if name in kept:
        add(info.param + ".kernel", jnp.einsum("n,nio->io", w_n, kept[name]))
      else:
        add(info.param + ".kernel", jnp.einsum("nti,nto->io", _flat(a, n), _flat(d, n) * w_n[:, None, None]))
      if info.has_bias:
        add(info.param + ".bias", jnp.einsum("n,nto->o", w_n, _flat(d, n)))
    elif info.kind == "unembed":
      if name in kept:
        add(info.param + ".embedding", jnp.einsum("n,ndv->vd", w_n, kept[name]))
      else:
        add(info.param + ".embedding", jnp.einsum("ntv,ntd->vd", _flat(d, n) * w_n[:, None, None], _flat(a, n)))
    elif info.kind == "scale":
      add(info.param + ".scale", jnp.einsum("n,ntd->d", w_n, _flat(a, n) * _flat(d, n)))
    elif info.kind == "embed":
      table = param_shapes[info.param + ".embedding"]
      rows = (
        jnp.zeros(table.shape, _F32)
        .at[a.reshape(-1)]
        .add((_flat(d, n) * w_n[:, None, None]).reshape(-1, table.shape[-1]))
      )
      add(info.param + ".embedding", rows)

  grads = jax.tree_util.tree_map_with_path(lambda path, _: grads_by_path[path_str(path)], params)
  return GhostResult(logp_nt, tokw_nt, sq_n, coef_n, loss, grads, aux)


def _embed_sq_norm(tok_nt: jax.Array, d_ntd: jax.Array) -> jax.Array:
  """||onehot_n^T D_n||^2 = sum_{t,s: tok_t = tok_s} d_t . d_s, [N] (T^2 D flops, no [V, D] buffer)."""
  same = tok_nt[:, :, None] == tok_nt[:, None, :]
  return jnp.sum(jnp.where(same, jnp.einsum("ntd,nsd->nts", d_ntd, d_ntd), 0.0), axis=(1, 2))


def ghost_policy_gradient(
  logp_fn: LogpFn,
  params,
  batch,
  cfg,
  *,
  method: str = "auto",
  materialize_budget_bytes: int = 2 << 30,
  divisor=None,
):
  """Drop-in fast path for `estimator.policy_gradient(logp_fn, params, batch, cfg)`.

  Same arguments and result (grads, metrics): tokw_nt = estimator.pg_token_weights(...),
  coef_n = estimator.pg_coefficients(..., sq_score_norms_n=S_n, cfg) with S_n from the ghost norms
  (S_n is the norm of the tokw-weighted score; OPOB only runs with sequence-level weights, where
  tokw_nt = loss_mask), and the gradient from the same single backward pass. metrics also holds
  sq_norm_n [N] (the exact S_n, whether or not cfg uses it). divisor: as in pg_coefficients (a
  micro-batch passes 1.0).
  """
  from vcpo_jax import estimator

  missing = [k for k in estimator.BATCH_KEYS if k not in batch]
  if missing:
    raise ValueError(f"batch: missing keys {missing}; need {list(estimator.BATCH_KEYS)}")
  beh, mask = batch["behavior_logp"], batch["loss_mask"]

  def tokw(logp_nt):
    return estimator.pg_token_weights(logp_nt, beh, mask, cfg)

  def coef_fn(logp_nt, sq_n):
    return estimator.pg_coefficients(
      logp_nt, beh, mask, batch["rewards"], batch["group_id"], sq_n, cfg, divisor=divisor
    )

  res = ghost_sq_norms_and_grad(
    logp_fn, params, batch, tokw, coef_fn, method=method, materialize_budget_bytes=materialize_budget_bytes
  )
  return res.grads, dict(res.aux, pg_loss=res.loss, sq_norm_n=res.sq_norms_n)


# ----------------------------------------------------------------------------- references


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
  """S_n via `estimator.per_example_sq_grad_norms` (vmap of per-example grads), [N]."""
  from vcpo_jax import estimator  # local: the estimator imports nothing from here, keep it that way

  tokw_nt = _tokw_array(logp_fn, params, batch, tokw)
  return estimator.per_example_sq_grad_norms(_per_example_fn(logp_fn), params, {"batch": batch, "tokw_nt": tokw_nt})


def loop_sq_norms(logp_fn: LogpFn, params, batch, tokw: TokW) -> jax.Array:
  """S_n with one backward pass per trajectory (lax.map: sequential, micro-batch 1), [N]."""
  tokw_nt = _tokw_array(logp_fn, params, batch, tokw)
  grad_fn = jax.grad(_per_example_fn(logp_fn))

  def one(example):
    g = grad_fn(params, example)
    return sum(jnp.sum(jnp.square(x.astype(_F32))) for x in jax.tree.leaves(g))

  return jax.lax.map(one, {"batch": batch, "tokw_nt": tokw_nt})
