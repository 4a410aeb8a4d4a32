"""Mesh axes, (regex, PartitionSpec) partition rules, activation constraints (constrain / tie), MeshJit.

One learner program runs on a 3-axis mesh (mesh.py builds it from the devices):

  data    pure data parallelism: batch rows split, parameters replicated.
  fsdp    batch rows split *and* every large parameter split along its model-width
          (D) or vocab dimension; XLA all-gathers a parameter before use and
          reduce-scatters its gradient (ZeRO-3 / FSDP).
  tensor  Megatron-style tensor parallelism: attention heads (q/k/v columns,
          o_proj rows) and the MLP width F are split; activations of a layer
          are exchanged inside the layer.

A batch [N, ...] is split over ("data", "fsdp") jointly, so N must be divisible
by data * fsdp. Parameters get their sharding from an ordered list of
(regex, PartitionSpec) rules matched (`re.search`) against dotted parameter
paths such as "layers.self_attn.q_proj.kernel" (stacked [L, ...]); the first match wins. Because
`re.search` is used and the rules are anchored at the end, the same rules also
shard an optax state, whose leaves have paths like "0.mu.layers.mlp.up_proj.kernel".

Axis types: every axis is created as `jax.sharding.AxisType.Auto` (jax >= 0.7
defaults `jax.make_mesh` to Explicit). With Explicit axes shardings become part
of array types and every op whose output sharding is ambiguous (an einsum that
contracts a sharded dimension, a reshape that merges sharded dims, `take` on a
sharded table) must be annotated by hand in the model code. The model is shared
with the sampler and the Hugging Face parity tests and carries no sharding
annotations, so we let the compiler (Shardy/GSPMD) propagate shardings from the
jit boundary instead: inputs and outputs are pinned with NamedSharding, the
inside is Auto. Results are identical to the single-device program up to
floating-point reduction order (tests check 1e-5).

This module imports no vcpo_jax module: the model, the learner and the sampler all build on it.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
# The mesh axis the MoE experts are split over (TRANSFORMER_RULES' mlp.experts.*): expert parallelism shares the
# tensor axis, so a mesh (data, fsdp, tensor = EP) holds E / tensor experts per device with no fourth axis.
EXPERT_AXIS = "tensor"
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both

Rules = Sequence[tuple[str, P]]

# Kernels are stored [in, out]. fsdp takes the model-width dimension D (or the
# vocab for the embedding table: the largest dimension of the model), tensor takes
# the head / MLP-width / vocab dimension, so that q/k/v/gate/up are column-split and
# o/down row-split (one all-reduce per attention and per MLP block). Norm scales
# are small and replicated.
TRANSFORMER_RULES: tuple[tuple[str, P], ...] = (
  (r"embed_tokens\.embedding$", P("tensor", "fsdp")),  # [V, D]
  # The decoder's blocks are stacked (transformer._stacked_blocks): a leading layer axis L, never split.
  (r"self_attn\.[qkv]_proj\.kernel$", P(None, "fsdp", "tensor")),  # [L, D, N*H] / [L, D, K*H]
  (r"self_attn\.[qkv]_proj\.bias$", P(None, "tensor")),  # [L, N*H] / [L, K*H]
  (r"self_attn\.o_proj\.kernel$", P(None, "tensor", "fsdp")),  # [L, N*H, D]
  (r"mlp\.(gate|up)_proj\.kernel$", P(None, "fsdp", "tensor")),  # [L, D, F]
  (r"mlp\.down_proj\.kernel$", P(None, "tensor", "fsdp")),  # [L, F, D]
  (r"(input_layernorm|post_attention_layernorm|norm)\.scale$", P()),  # [L, D] / [L, H] / [D]
  (r"lm_head\.kernel$", P("fsdp", "tensor")),  # [D, V]
  # Qwen3-MoE (vcpo_jax.model.moe): the expert axis E split over EXPERT_AXIS (expert parallelism folded into the
  # tensor axis), the model width over fsdp; the router [L, D, E] is small: D over fsdp only.
  (r"mlp\.experts\.(gate|up)_proj$", P(None, EXPERT_AXIS, "fsdp", None)),  # [L, E, D, F]
  (r"mlp\.experts\.down_proj$", P(None, EXPERT_AXIS, None, "fsdp")),  # [L, E, F, D]
  (r"mlp\.gate\.kernel$", P(None, "fsdp")),  # [L, D, E] router
  # LoRA factors (vcpo_jax.model.lora): the wide dimension split over fsdp (and tensor where the projection's
  # is), r never split; replicated factors and their AdamW moments would cost every device the whole adapter.
  (r"(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.lora_a\.kernel$", P(None, "fsdp")),  # A [L, D, r]
  (
    r"(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.lora_b\.kernel$",
    P(None, None, ("fsdp", "tensor")),
  ),  # B [L, r, N*H / F]
  (r"(self_attn\.o_proj|mlp\.down_proj)\.lora_a\.kernel$", P(None, ("tensor", "fsdp"))),  # A [L, N*H / F, r]
  (r"(self_attn\.o_proj|mlp\.down_proj)\.lora_b\.kernel$", P(None, None, "fsdp")),  # B [L, r, D]
)


# Activation layouts (one entry per dimension; an entry names mesh axes). Batch rows stay split
# over ("data", "fsdp") through every block, so batch-dependent memory per device falls with
# data x fsdp; with a tensor axis the heads and the MLP width are split over it, the residual
# stream is replicated over it (Megatron layout: one all-reduce after o_proj and down_proj).
RESIDUAL_BTD = (BATCH_AXES, None, None)  # [B, T, D] embeddings, block outputs
HEADS_BTNH = (BATCH_AXES, None, "tensor", None)  # [B, T, N or K, H] q, k, v
HIDDEN_BTF = (BATCH_AXES, None, "tensor")  # [B, T, F] SwiGLU hidden
LOGITS_BTV = (BATCH_AXES, None, "tensor")  # [B, T, V] vocab-parallel LM head
CACHE_BK = (BATCH_AXES, "tensor", None, None)  # KV cache: keys [B, K, H, S], values [B, K, S, H]
CACHE_LBK = (None,) + CACHE_BK  # the stacked cache of every layer: keys [L, B, K, H, S], values [L, B, K, S, H]


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of any [N, ...] array: N split over ("data", "fsdp"), other dims replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def constrain(x: jax.Array, layout: tuple) -> jax.Array:
  """`with_sharding_constraint(x, layout)` under the mesh being traced with, else the identity.

  The mesh is the one set with `jax.set_mesh(mesh)` around the jitted call (`MeshJit`; the
  sampler does so when given a mesh); without one (plain CPU tests, the HF parity tests) nothing happens. Per
  dimension, axes that are not in the mesh, not Auto/Explicit (e.g. Manual inside a
  shard_map) or that do not divide the dimension (a batch of 1 in a decode step) are
  dropped, so a constraint never fails or pads: that dimension is left to the compiler
  (unconstrained). Dimensions whose entry is None are kept whole (replicated).

  Args:
    x: an activation, e.g. [B, T, D].
    layout: one entry per leading dimension of x (None, an axis name or a tuple of names),
      e.g. RESIDUAL_BTD.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or x.ndim < len(layout):
    return x
  usable = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Manual}
  entries = []
  for dim, entry in zip(x.shape, layout):
    names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None and a in usable)
    size = math.prod(mesh.shape[a] for a in names)
    if names and size > 1 and dim % size == 0:
      entries.append(names)
    else:  # nothing to split over here: replicate a dim meant to be whole, else let the compiler choose
      entries.append(None if entry is None else P.UNCONSTRAINED)
  if all(e is None or e is P.UNCONSTRAINED for e in entries):
    return x
  return jax.lax.with_sharding_constraint(x, P(*entries))


def batch_shards(n: int | None = None) -> int:
  """Devices the batch axis is split over under the mesh being traced with: data x fsdp (1 without one).

  Counts the BATCH_AXES that `constrain` would use (present, not Manual); with n given, 1 when n is
  not divisible by that product (constrain then leaves the batch dimension to the compiler).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  kinds = dict(zip(mesh.axis_names, mesh.axis_types))
  size = math.prod(mesh.shape[a] for a in BATCH_AXES if a in kinds and kinds[a] != AxisType.Manual)
  return 1 if n is not None and n % size else size


def batch_local(fn, args: tuple, batched: tuple, n: int, reduce: bool = False):
  """fn(index, *args) on each device's rows of the batch, or fn(0, *args) without a batch-split mesh.

  Under a mesh whose BATCH_AXES split the n rows (`batch_shards(n)` > 1): a shard_map over the mesh (every axis
  manual); an argument with batched[i] is split over the batch axes on its leading axis (each device its contiguous
  block of rows), the others are replicated (a sharded weight is gathered at the boundary); index is the device's
  linear position along the batch axes (its block is the index-th). Outputs are split on their leading axis,
  or, with reduce, summed over the devices (psum) and replicated. For work that must stay on a device's own
  rows: a sort or a grouping of its tokens (the MoE dispatch), which the partitioner would otherwise gather.
  """
  shards = batch_shards(n)
  if shards == 1:
    return fn(0, *args)
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)

  def local(*a):
    out = fn(jax.lax.axis_index(axes), *a)
    return jax.tree.map(lambda x: jax.lax.psum(x, axes), out) if reduce else out

  specs = tuple(P(axes) if b else P() for b in batched)
  out_specs = P() if reduce else P(axes)
  # Every mesh axis manual (a partially manual shard_map inside the layer scan crashes XLA's partitioner); an
  # argument not split over the batch axes is gathered whole on entry (the tensor axis included).
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(*args)


def expert_shards(num_experts: int) -> int:
  """Devices the MoE experts are split over under the mesh being traced with: EXPERT_AXIS's size, or 1.

  1 without a mesh, when the axis is 1, Manual, or does not divide num_experts (`spec_for` then replicates the
  experts, and each device runs them all: `batch_local`).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
    return 1
  if dict(zip(mesh.axis_names, mesh.axis_types))[EXPERT_AXIS] == AxisType.Manual:
    return 1
  size = mesh.shape[EXPERT_AXIS]
  return size if size > 1 and num_experts % size == 0 else 1


# How `expert_local` splits an argument or an output over the mesh (leading axis; other axes whole):
#   "batch"    split over the batch axes (when they split the n rows), replicated over the expert axis: a token array
#   "rows"     split over the batch axes and the expert axis: each device its own block (expert-sorted rows)
#   "experts"  split over the expert axis: each device its E / shards experts (an expert weight [E, ...])
#   "partial"  an output only: [shards, ...] stacked over the expert axis, the batch axes on its second axis; sum
#              over axis 0 for the total (each device's contribution from its own experts)
EXPERT_LOCAL_KINDS = ("batch", "rows", "experts", "partial")


def expert_local(fn, args: tuple, kinds: tuple, n: int, out_kinds):
  """fn(batch_index, expert_index, *args) on each device of a mesh whose EXPERT_AXIS splits the experts.

  Expert parallelism (`expert_shards` > 1): a shard_map over the mesh (every axis manual), arguments and outputs laid
  out by kind (EXPERT_LOCAL_KINDS); batch_index is the device's position along the batch axes (0 when they do not
  split the n rows: the tokens are then whole on every device), expert_index its position along EXPERT_AXIS. The
  body holds no collective: a "partial" output is summed by the caller outside (an all-reduce over the expert axis,
  whose gradient the compiler transposes), and a "batch" input's cotangents are summed over the expert axis by
  shard_map's transpose.
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1) if batch_shards(n) > 1 else ()
  batch = axes or None
  spec = {
    "batch": P(batch),
    "rows": P(axes + (EXPERT_AXIS,)),
    "experts": P(EXPERT_AXIS),
    "partial": P(EXPERT_AXIS, batch),
  }

  def local(*a):
    return fn(jax.lax.axis_index(axes) if axes else 0, jax.lax.axis_index(EXPERT_AXIS), *a)

  out_specs = jax.tree.map(spec.__getitem__, out_kinds)
  in_specs = tuple(spec[k] for k in kinds)
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def tie(x: jax.Array, w):
  """(x, w) through `lax.optimization_barrier` under the mesh being traced with; as given without one.

  An FSDP-sharded weight w is all-gathered where it is used. Inside a loop (the learner's
  micro-batch scan) XLA hoists that all-gather out of the loop as loop-invariant code, and every
  weight of the model then stays gathered for the whole step (about 0.9 GiB per Qwen2.5-7B block in
  float32 on XLA:CPU). Tying w to the loop-varying activation x keeps the gather inside, next to its
  use, so it is transient (and rematerialized blocks gather again in the backward pass). Values and
  gradients are unchanged (the barrier is the identity). Without a mesh, or on a mesh without an
  "fsdp" axis of more than one device (nothing is gathered), x and w are returned as given.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or dict(zip(mesh.axis_names, mesh.axis_sizes)).get("fsdp", 1) == 1:
    return x, w
  return jax.lax.optimization_barrier((x, w))


def constrain_param(x: jax.Array, name: str, rules: Rules | None = None, lead: tuple = ()) -> jax.Array:
  """`constrain` x to the layout the partition rules give parameter `name` (e.g. a gradient of it).

  Under the mesh being traced with; the identity without one or when no rule matches `name`.
  lead: layout entries of extra leading dimensions (e.g. (BATCH_AXES,) for per-example gradients
  [N, ...] of the parameter); mesh axes they use are dropped from the parameter's own entries.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  for pattern, spec in TRANSFORMER_RULES if rules is None else rules:
    if re.search(pattern, name):
      break
  else:
    return x
  used = {a for e in lead for a in (e if isinstance(e, tuple) else (e,)) if a is not None}
  drop = lambda e: tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a not in used) or None
  layout = tuple(lead) + tuple(None if e is None else drop(e) for e in spec)  # an axis maps to one dim only
  layout = layout + (None,) * (x.ndim - len(layout))
  return constrain(x, layout[: x.ndim])


def require_mesh(tree, what: str) -> None:
  """Raises unless `tree`'s arrays are traced under the mesh they live on (or live on one device).

  A program whose inputs are laid out on a multi-device mesh but that is traced without a mesh in
  context (a plain `jax.jit(step)` outside `jax.set_mesh`) makes every `constrain` / `tie` a no-op:
  the compiler then keeps the batch replicated on every device (at Qwen2.5-7B widths, 64 x 1024
  tokens on 64 devices: f32[64, 512, 152064] head-chunk logits, 18.6 GiB, on each). The inputs'
  types still name their mesh (jax.typeof(x).sharding.mesh, Auto axes included), so this check
  reads it at trace time; it costs nothing when the program runs. (jax 0.10: an array moved off its
  mesh with `jax.device_put(x, device)` keeps the mesh in its type; rebuild it from host values.)

  Args:
    tree: the program's inputs (arrays, tracers or jax.ShapeDtypeStructs; other leaves are skipped).
    what: the program's name for the message, e.g. "learner.make_train_step's step".
  Raises:
    ValueError naming the mesh and the fix (sharding.MeshJit, or `with jax.set_mesh(mesh):`).
  """
  if not jax.sharding.get_abstract_mesh().empty:
    return
  for leaf in jax.tree.leaves(tree):
    try:
      mesh = jax.typeof(leaf).sharding.mesh
    except (AttributeError, TypeError):
      continue
    if not mesh.empty and math.prod(mesh.axis_sizes) > 1:
      raise ValueError(
        f"{what} is traced without a mesh but its inputs live on the mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))}: "
        "its activation constraints would be no-ops and the batch replicated on every device; jit it with "
        "sharding.MeshJit(mesh, step, ...) or trace it under `with jax.set_mesh(mesh):`."
      )


class MeshJit:
  """`jax.jit(fn, **jit_kwargs)` whose calls and lowerings run under `jax.set_mesh(mesh)`.

  Tracing under the mesh is what activates the model's activation constraints
  (`constrain`); without it they are no-ops (and the learner's step refuses to trace: `require_mesh`).
  Use it for every jitted function that runs the model on a mesh: `train_step =
  sharding.MeshJit(mesh, step_fn, in_shardings=..., donate_argnums=0)`, then `train_step(state, batch)`
  or `train_step.lower(...)`.
  """

  def __init__(self, mesh: Mesh, fn, **jit_kwargs):
    self.mesh, self.jitted = mesh, jax.jit(fn, **jit_kwargs)

  def __call__(self, *args, **kwargs):
    with jax.set_mesh(self.mesh):
      return self.jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args, **kwargs)


# ----------------------------------------------------------------------------- partition rules


def path_str(path) -> str:
  """Dotted name of a pytree key path; nnx.Variable's trailing '.value' is dropped."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  if parts and parts[-1] == "value":
    parts = parts[:-1]
  return ".".join(parts)


def _axis_size(mesh: Mesh, entry) -> int:
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names)


def spec_for(name: str, shape: tuple[int, ...], rules: Rules, mesh: Mesh) -> P:
  """The PartitionSpec of one array: the first matching rule, made safe for `shape`.

  Rank-0 arrays (optimizer step counts, scalars) are always replicated. A dimension
  whose size is not divisible by its mesh axes is replicated instead, with a warning
  (sharding it would need padding and is almost always a mis-sized mesh).

  Raises:
    ValueError: no rule matches `name`, or the rule's spec has more entries than
      the array has dimensions.
  """
  if len(shape) == 0:
    return P()
  for pattern, spec in rules:
    if re.search(pattern, name):
      break
  else:
    raise ValueError(
      f"No partition rule matches parameter {name!r} (shape {shape}); add a (regex, PartitionSpec) "
      "pair for it to the rules (use P() to replicate it)."
    )
  for entry in spec:
    for axis in entry if isinstance(entry, tuple) else (entry,):
      if axis is not None and axis not in mesh.shape:
        raise ValueError(f"Partition rule {pattern!r} uses axis {axis!r} not in mesh axes {tuple(mesh.shape)}.")
  if len(spec) > len(shape):
    raise ValueError(
      f"Partition rule {pattern!r} gives {spec} ({len(spec)} dims) for {name!r} "
      f"of rank {len(shape)}; the spec may not have more entries than the array dims."
    )
  entries = list(spec)
  for d, entry in enumerate(entries):
    size = _axis_size(mesh, entry)
    if size > 1 and shape[d] % size:
      warnings.warn(
        f"{name}: dim {d} of size {shape[d]} is not divisible by mesh axes {entry} (size {size}); "
        "replicating that dim instead.",
        stacklevel=3,
      )
      entries[d] = None
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def param_specs(params_or_abstract, rules: Rules, mesh: Mesh):
  """PartitionSpec pytree with the structure of `params_or_abstract` (arrays or ShapeDtypeStructs)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: spec_for(path_str(path), tuple(x.shape), rules, mesh), params_or_abstract
  )


def param_shardings(params_or_abstract, rules: Rules, mesh: Mesh):
  """NamedSharding pytree with the structure of `params_or_abstract`.

  Works on parameters (an nnx.State), on abstract parameters from `jax.eval_shape`,
  and on optimizer states that embed the parameter tree (see module docstring).
  """
  return jax.tree.map(
    lambda s: NamedSharding(mesh, s), param_specs(params_or_abstract, rules, mesh), is_leaf=lambda x: isinstance(x, P)
  )
