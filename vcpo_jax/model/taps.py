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
  "unembed": Y = A @ embedding^T (tied LM head); A [B, T, D], D [B, T, V].
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TapInfo:
  kind: str  # "linear" | "embed" | "scale" | "unembed"
  param: str  # dotted path of the parameter's module, e.g. "layers.0.mlp.up_proj"
  has_bias: bool = False


@dataclasses.dataclass
class Tape:
  """Collects tapped inputs; supplies perturbations (or records their shapes)."""

  perturbations: dict[str, jax.Array] | None = None
  inputs: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
  out_shapes: dict[str, jax.ShapeDtypeStruct] = dataclasses.field(default_factory=dict)
  info: dict[str, TapInfo] = dataclasses.field(default_factory=dict)


_ACTIVE: contextvars.ContextVar[Tape | None] = contextvars.ContextVar("vcpo_tape", default=None)


@contextlib.contextmanager
def recording(perturbations: dict[str, jax.Array] | None = None):
  """Records taps while active. Pass perturbations (zeros) to obtain D by differentiation."""
  tape = Tape(perturbations=perturbations)
  token = _ACTIVE.set(tape)
  try:
    yield tape
  finally:
    _ACTIVE.reset(token)


def tap(name: str, info: TapInfo, a: Any, y: jax.Array) -> jax.Array:
  """Identity on y unless a Tape is recording; then stores `a` and adds the perturbation."""
  tape = _ACTIVE.get()
  if tape is None:
    return y
  if name in tape.inputs:
    raise ValueError(f"Tap {name!r} fired twice in one recording; layer names must be unique.")
  tape.inputs[name] = a
  tape.info[name] = info
  tape.out_shapes[name] = jax.ShapeDtypeStruct(y.shape, jnp.float32)
  if tape.perturbations is not None:
    y = y + tape.perturbations[name].astype(y.dtype)
  return y
