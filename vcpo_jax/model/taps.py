"""Activation taps: the hook that makes exact per-example gradient norms cheap.

Every parameterised layer of the policy reports, while a `Tape` is recording,
its input A (what multiplies the parameter) and adds a zero "perturbation" Z to
its output Y. The gradient of a loss with respect to Z is the layer's output
gradient D = dL/dY, for every example separately, without ever forming a
per-example weight gradient. From (A, D) the per-example weight gradient is
A_i^T D_i, whose squared norm (and any coefficient-weighted sum over examples)
`vcpo_jax.grad_norms` computes directly.

Outside a recording context `tap` is the identity, so the model pays nothing.
The tape lives in a context variable that is read at trace time only: it works
under jit, grad and vjp, since A and D are ordinary traced values returned from
the traced function.

Tap kinds (what A is, and which parameter the pair (A, D) belongs to):
  "linear":  Y = A @ kernel (+ bias); A [B, T, Din], D [B, T, Dout].
  "embed":   Y = embedding[A]; A int32 token ids [B, T], D [B, T, D].
  "scale":   Y = A * scale (RMSNorm); A = normalized input [B, T, D], D [B, T, D].
  "expert":  an MoE expert matmul (`vcpo_jax.model.moe`), rows r of the expert-sorted layout y_r = a_r W_{e_r};
             A = {"a": [R, Din], "expert": [R] int32, "example": [R] int32}, D [R, Dout] (`model.moe_norms`).
  "head":    logp = log-softmax(A @ W)[next token], the (chunked) LM head and its log-probs
             (`vcpo_jax.model.logprobs`); W = lm_head.kernel [D, V] or the tied embedding [V, D].
             No perturbation: its output gradient D = dlogp/dlogits = e_y - softmax would be
             [B, T, V]. Instead, while perturbations are supplied, the head records
             {h, tokens, w, lse} and its log-probs are computed from stop_gradient(h), so the
             caller forms D chunk by chunk itself and feeds dL/dh into the backward pass by hand
             (`vcpo_jax.grad_norms`).

Norm sinks (`Sink`, the two-pass ghost step): instead of perturbing "linear" and "scale" taps,
a recording with a sink wraps their outputs in a `jax.custom_vjp` identity y -> y whose backward
rule receives D = dL/dY, computes that layer's per-example squared weight-gradient norm [B] from
(A, D) right there (`Sink.norm`) and returns it as the cotangent of the sink's zeros input s [B].
A is then a residual of the layer (inside a rematerialized block: recomputed with it), not an
output of the traced function, so one vjp w.r.t. s gives sum over layers of the norms with only
one layer's (A, D) alive at a time. The head records {h, tokens, w, lse} and stays
differentiable (its log-probs come from h itself); "embed" taps are perturbed as above.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TapInfo:
  kind: str  # "linear" | "embed" | "scale" | "head" | "expert"
  param: str  # dotted path of the parameter's module, e.g. "layers.mlp.up_proj" (stacked over layers)
  has_bias: bool = False
  spec: Any = None  # "head": its logprobs.HeadSpec (tied or not, chunking, dtype)
  layers: int = 0  # > 0: a tap inside the scanned blocks, A and D stacked [L, ...] (the parameter [L, ...] too)


SINK_KINDS = ("linear", "scale", "expert")  # the tap kinds a Sink absorbs


@dataclasses.dataclass(frozen=True)
class Sink:
  """The zeros s [B] float32 whose cotangent collects norms, and norm(name, info, a, d) -> [B] float32."""

  s: jax.Array
  norm: Callable[[str, TapInfo, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass
class Tape:
  """Collects tapped inputs; supplies perturbations (or records their shapes), or sinks norms."""

  perturbations: dict[str, jax.Array] | None = None
  inputs: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
  out_shapes: dict[str, jax.ShapeDtypeStruct] = dataclasses.field(default_factory=dict)
  info: dict[str, TapInfo] = dataclasses.field(default_factory=dict)
  sink: Sink | None = None


_ACTIVE: contextvars.ContextVar[Tape | None] = contextvars.ContextVar("vcpo_tape", default=None)


def active_tape() -> Tape | None:
  """The Tape recording in this context, or None (read at trace time, as `tap` does)."""
  return _ACTIVE.get()


@contextlib.contextmanager
def recording(perturbations: dict[str, jax.Array] | None = None, sink: Sink | None = None):
  """Records taps while active. Pass perturbations (zeros) to obtain D by differentiation; with a sink,
  "linear" / "scale" taps put their norms into the cotangent of sink.s instead (perturbations then
  needed for the "embed" taps only)."""
  tape = Tape(perturbations=perturbations, sink=sink)
  token = _ACTIVE.set(tape)
  try:
    yield tape
  finally:
    _ACTIVE.reset(token)


def _record(tape: Tape, name: str, info: TapInfo, a: Any, keep: bool = True) -> None:
  if name in tape.info:
    raise ValueError(f"Tap {name!r} fired twice in one recording; layer names must be unique.")
  if keep:
    tape.inputs[name] = a
  tape.info[name] = info


def _zero_cotangent(x):
  """The zero cotangent of x: zeros of its dtype, float0 for integers (an expert tap's ids)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def _sink(norm, name: str, info: TapInfo, a: Any, y: jax.Array, s: jax.Array) -> jax.Array:
  """y, with the backward rule dL/ds += norm(name, info, a, dL/dy) (and dL/da += 0: y does not depend on a)."""

  @jax.custom_vjp
  def f(y, a, s):
    return y

  def fwd(y, a, s):
    return y, (a, s)

  def bwd(res, dy):
    a, s = res
    return dy, jax.tree.map(_zero_cotangent, a), norm(name, info, a, dy).astype(s.dtype)

  f.defvjp(fwd, bwd)
  return f(y, a, s)


def tap(name: str, info: TapInfo, a: Any, y: jax.Array) -> jax.Array:
  """Identity on y unless a Tape is recording; then stores `a` and adds the perturbation."""
  tape = _ACTIVE.get()
  if tape is None:
    return y
  sunk = tape.sink is not None and info.kind in SINK_KINDS
  _record(tape, name, info, a, keep=not sunk)
  tape.out_shapes[name] = jax.ShapeDtypeStruct(y.shape, y.dtype)
  if sunk:
    return _sink(tape.sink.norm, name, info, a, y, tape.sink.s)
  # The perturbation (and so D) has the output's dtype: D is the cotangent of y, which backprop forms
  # in y's dtype anyway, so a bfloat16 D is exact and half the bytes of a float32 copy.
  if tape.perturbations is not None:
    y = y + tape.perturbations[name].astype(y.dtype)
  return y


def tap_head(name: str, info: TapInfo, h: jax.Array, tokens: jax.Array, w: jax.Array, head_fn) -> jax.Array:
  """The LM head's log-probs, head_fn(h, w, tokens, return_lse) -> logp [B, T] or (logp, lse[, cut]).

  Outside a recording: head_fn(h, w, tokens). While recording: stores {h, tokens, w, lse[, cut]}; with
  perturbations, the log-probs come from stop_gradient(h) (see the module docstring, "head").
  """
  tape = _ACTIVE.get()
  if tape is None:
    return head_fn(h, w, tokens, False)
  if tape.perturbations is None or tape.sink is not None:  # shapes only, or the sink's differentiable head
    logp, lse, *cut = head_fn(h, w, tokens, True)
    lse = jax.lax.stop_gradient(lse)
  else:
    logp, lse, *cut = head_fn(jax.lax.stop_gradient(h), w, tokens, True)
  # cut: support replay's absolute logit cuts [B, T - 1] (model/support.py), when the head renormalises
  _record(tape, name, info, {"h": h, "tokens": tokens, "w": w, "lse": lse, **({"cut": cut[0]} if cut else {})})
  return logp


def forbid(name: str, why: str) -> None:
  """Raises if a Tape is recording: for layers whose parameters the taps cannot account for."""
  if _ACTIVE.get() is not None:
    raise ValueError(f"{name}: {why}")
