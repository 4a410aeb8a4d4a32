"""Device mesh, (regex, PartitionSpec) partition rules, sharded init, multi-host setup.

One learner program runs on a 3-axis mesh:

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
paths such as "layers.3.self_attn.q_proj.kernel"; the first match wins. Because
`re.search` is used and the rules are anchored at the end, the same rules also
shard an optax state, whose leaves have paths like "0.mu.layers.3.mlp.up_proj.kernel".

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

Multi-host: `maybe_initialize_distributed` wraps `jax.distributed.initialize`
(with gloo CPU collectives so that the same code runs across local CPU
processes), after which `jax.devices()` lists every process's devices and the
same mesh code builds the global mesh. Each process feeds its own rows of a
global batch with `make_global_batch`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from vcpo_jax.model.config import ModelConfig

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both

Rules = Sequence[tuple[str, P]]

# Kernels are stored [in, out]. fsdp takes the model-width dimension D (or the
# vocab for the embedding table: the largest dimension of the model), tensor takes
# the head / MLP-width / vocab dimension, so that q/k/v/gate/up are column-split and
# o/down row-split (one all-reduce per attention and per MLP block). Norm scales
# are small and replicated.
TRANSFORMER_RULES: tuple[tuple[str, P], ...] = (
  (r"embed_tokens\.embedding$", P("tensor", "fsdp")),  # [V, D]
  (r"self_attn\.[qkv]_proj\.kernel$", P("fsdp", "tensor")),  # [D, N*H] / [D, K*H]
  (r"self_attn\.[qkv]_proj\.bias$", P("tensor")),  # [N*H] / [K*H]
  (r"self_attn\.o_proj\.kernel$", P("tensor", "fsdp")),  # [N*H, D]
  (r"mlp\.(gate|up)_proj\.kernel$", P("fsdp", "tensor")),  # [D, F]
  (r"mlp\.down_proj\.kernel$", P("tensor", "fsdp")),  # [F, D]
  (r"(input_layernorm|post_attention_layernorm|norm)\.scale$", P()),  # [D]
  (r"lm_head\.kernel$", P("fsdp", "tensor")),  # [D, V]
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

# ----------------------------------------------------------------------------- mesh


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Shape of the ("data", "fsdp", "tensor") mesh.

  Attributes:
    shape: sizes of the three axes, in MESH_AXES order. At most one entry may be
      -1, meaning "all remaining devices" (e.g. (-1, 1, 1) = pure data parallel on
      whatever is available). After resolution the product must equal the number
      of devices the mesh is built on.
  """

  shape: tuple[int, int, int] = (-1, 1, 1)

  def __post_init__(self):
    shape = tuple(self.shape)
    object.__setattr__(self, "shape", shape)
    if len(shape) != len(MESH_AXES):
      raise ValueError(
        f"mesh.shape must have {len(MESH_AXES)} entries for axes {MESH_AXES}, got {shape}; "
        "e.g. --config.mesh.shape='(-1, 1, 1)'."
      )
    for name, s in zip(MESH_AXES, shape):
      if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or (s < 1 and s != -1):
        raise ValueError(f"mesh.shape entry for axis {name!r} must be a positive int or -1, got {s!r}.")
    if sum(s == -1 for s in shape) > 1:
      raise ValueError(f"mesh.shape may contain at most one -1 (inferred axis), got {shape}.")

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    """The concrete shape for `num_devices` devices (fills in the -1 entry)."""
    known = math.prod(s for s in self.shape if s != -1)
    if -1 in self.shape:
      if num_devices % known:
        raise ValueError(
          f"mesh.shape={self.shape}: {num_devices} devices are not divisible by the fixed axes "
          f"(product {known}); choose axis sizes that divide the device count."
        )
      return tuple(num_devices // known if s == -1 else s for s in self.shape)
    if known != num_devices:
      raise ValueError(
        f"mesh.shape={self.shape} has {known} devices but {num_devices} are available: the "
        f"product of the axis sizes {MESH_AXES} must equal the device count (use -1 for one axis "
        "to infer it)."
      )
    return self.shape


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the ("data", "fsdp", "tensor") mesh with Auto axis types (see module docstring).

  Args:
    mesh_cfg: the mesh shape.
    devices: the devices to use (default: `jax.devices()`, every process's devices
      after `jax.distributed.initialize`). Pass the learner half of `split_devices`
      to keep the sampler's devices out of the learner mesh.
  """
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("make_mesh got an empty device list.")
  shape = mesh_cfg.resolve(len(devices))
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  try:
    # make_mesh orders devices by the physical topology (TPU torus, hosts) for us.
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    # Topology-aware placement can reject a device subset (e.g. half a TPU slice);
    # fall back to the given order, which is what the caller asked for.
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)


def build_mesh(shape: tuple, batch_size: int, sampler_devices: str = "") -> Mesh:
  """The learner's mesh of `shape` (config mesh.shape) over every device but the async sampler's.

  Args:
    shape: (data, fsdp, tensor), at most one -1 (see MeshConfig).
    batch_size: the step's N = P * G rows; must be divisible by data * fsdp.
    sampler_devices: config async_.sampler_devices of an async run ("" for sync / lag: every device
      is the learner's). Multi-process: host-local ids, taken from every host (distributed.learner_devices).
  Raises:
    ValueError naming the config field (config.mesh.shape or config.task.prompts_per_step).
  """
  devices = jax.devices()
  if sampler_devices and jax.process_count() > 1:
    from vcpo_jax import distributed  # local: distributed imports this module

    devices = distributed.learner_devices(sampler_devices, devices)
  elif sampler_devices and len(devices) > 1:
    devices = split_devices(sampler_devices, devices)[1]
  try:
    mesh = make_mesh(MeshConfig(shape), devices=devices)
  except ValueError as e:
    raise ValueError(f"config.mesh.shape: {e}") from None
  data_par = mesh.shape["data"] * mesh.shape["fsdp"]
  if batch_size % data_par:
    raise ValueError(
      f"config.task.prompts_per_step: the batch N = P*G = {batch_size} must be "
      f"divisible by data*fsdp = {data_par} of the mesh {dict(mesh.shape)}."
    )
  return mesh


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


class MeshJit:
  """`jax.jit(fn, **jit_kwargs)` whose calls and lowerings run under `jax.set_mesh(mesh)`.

  Tracing under the mesh is what activates the model's activation constraints
  (`constrain`); without it they are no-ops. Use it for every jitted function that runs
  the model on a mesh: `train_step = sharding.MeshJit(mesh, step_fn, in_shardings=...,
  donate_argnums=0)`, then `train_step(state, batch)` or `train_step.lower(...)`.
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


def init_sharded(cfg: ModelConfig, seed: int, mesh: Mesh, rules: Rules = TRANSFORMER_RULES):
  """Creates the model's parameters directly in their sharded layout.

  eval_shape traces the initializer without allocating, the rules turn the
  abstract parameters into shardings, and jit(init, out_shardings) materializes
  each shard on its own device, so no device ever holds the full model. The
  values equal `transformer.split(transformer.init(cfg, seed))[1]`.

  Returns:
    (graphdef, params): params an nnx.State of nnx.Param holding sharded jax.Arrays.
  """

  from vcpo_jax.model import transformer as tf  # local: the model imports this module (activation constraints)

  def init_params():
    return tf.split(tf.init(cfg, seed))[1]

  abstract_model = nnx.eval_shape(lambda: tf.init(cfg, seed))
  graphdef, abstract_params = tf.split(abstract_model)
  shardings = param_shardings(abstract_params, rules, mesh)
  params = jax.jit(init_params, out_shardings=shardings)()
  return graphdef, params


# ----------------------------------------------------------------------------- global batches


def process_rows(global_n: int, sharding: NamedSharding) -> slice:
  """The rows of a global [global_n, ...] batch that this process must supply.

  Under a ("data", "fsdp") batch sharding each process owns one contiguous block of
  rows (the mesh places a process's devices next to each other along the batch
  axes). Raises ValueError if that is not the case for this mesh.
  """
  starts, stops = [], []
  for idx in sharding.addressable_devices_indices_map((global_n,)).values():
    sl = idx[0]
    starts.append(0 if sl.start is None else sl.start)
    stops.append(global_n if sl.stop is None else sl.stop)
  covered = sorted(set(zip(starts, stops)))  # devices along "tensor" repeat the same rows
  for (_, b), (a, _) in zip(covered, covered[1:]):
    if a != b:
      raise ValueError(
        f"This process's batch rows are not contiguous ({covered}); order the mesh "
        "devices so that each process's devices are adjacent along ('data', 'fsdp')."
      )
  lo, hi = covered[0][0], covered[-1][1]
  return slice(lo, hi)


def make_global_batch(local_batch, mesh: Mesh, global_n: int):
  """Assembles per-process host arrays into global jax.Arrays sharded over ("data", "fsdp").

  Args:
    local_batch: pytree of numpy arrays [n_local, ...], this process's rows
      `process_rows(global_n, batch_sharding(mesh))` of the global batch.
    global_n: N, rows of the global batch (divisible by data * fsdp).
  """
  sharding = batch_sharding(mesh)
  div = _axis_size(mesh, BATCH_AXES)
  if global_n % div:
    raise ValueError(
      f"Global batch size N={global_n} must be divisible by data*fsdp={div}; change the batch size or mesh.shape."
    )

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(sharding, x, (global_n,) + x.shape[1:])

  return jax.tree.map(one, local_batch)


# ----------------------------------------------------------------------------- devices and processes


def split_devices(sampler_devices: int | str | Sequence[int], devices: Sequence[jax.Device] | None = None):
  """Splits devices into disjoint (sampler_devices, learner_devices).

  Args:
    sampler_devices: which devices generate (config `async_.sampler_devices`):
      an int n takes the last n devices (the learner keeps the rest, so its mesh
      starts at device 0); a string of device ids "6,7" or a sequence of ids takes
      those devices. 0 or "" means colocated: both get all devices (the sync and
      lag modes, or a single accelerator).
    devices: default `jax.local_devices()`: on a multi-host pod every host splits
      its own chips the same way.

  Returns:
    (sampler, learner) lists of jax.Device, disjoint unless colocated.
  """
  devices = list(jax.local_devices() if devices is None else devices)
  if isinstance(sampler_devices, str):
    try:
      sampler_devices = [int(x) for x in sampler_devices.replace(" ", "").split(",") if x]
    except ValueError:
      raise ValueError(
        f"async_.sampler_devices={sampler_devices!r} must be a comma-separated list of "
        "device ids such as '6,7' (or '' to share all devices)."
      ) from None
  if isinstance(sampler_devices, bool):
    raise ValueError(f"async_.sampler_devices must be an int or device ids, got {sampler_devices!r}.")
  if isinstance(sampler_devices, (int, np.integer)):
    n = int(sampler_devices)
    if n == 0:
      return devices, devices
    if not 0 < n < len(devices):
      raise ValueError(
        f"async_.sampler_devices={n} must be between 0 and {len(devices) - 1}: the learner needs at "
        f"least one of the {len(devices)} devices (0 = share all devices)."
      )
    return devices[-n:], devices[:-n]
  if not isinstance(sampler_devices, Sequence):
    raise ValueError(f"async_.sampler_devices must be an int or device ids, got {sampler_devices!r}.")
  ids = list(sampler_devices)
  if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
    raise ValueError(f"async_.sampler_devices must be an int or device ids, got {sampler_devices!r}.")
  if not ids:
    return devices, devices
  by_id = {d.id: d for d in devices}
  unknown = [i for i in ids if i not in by_id]
  if unknown or len(set(ids)) != len(ids):
    raise ValueError(
      f"async_.sampler_devices={ids}: ids must be distinct and among the available "
      f"device ids {sorted(by_id)}; unknown: {unknown}."
    )
  sampler = [by_id[i] for i in ids]
  learner = [d for d in devices if d.id not in set(ids)]
  if not learner:
    raise ValueError(f"async_.sampler_devices={ids} takes every device; leave at least one for the learner.")
  return sampler, learner


def maybe_initialize_distributed(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  cpu_collectives: str | None = "gloo",
) -> bool:
  """Joins a multi-process JAX job (config `distributed.*`); call before anything touches devices.

  With a coordinator address, all three values are explicit (local CPU processes,
  GPU hosts, or a TPU pod where the launch script computes them); num_processes
  == 1 is then a no-op. Without one (None or ""), JAX detects the cluster from
  its environment (TPU VM pods, SLURM, Open MPI); num_processes and process_id
  are forwarded only when num_processes > 1, so the config defaults (1, 0) do
  not override the detected values. Calling it again after a successful
  initialization is a no-op.

  Args:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: total processes in the job.
    process_id: this process's rank in [0, num_processes).
    cpu_collectives: cross-process collectives for CPU devices ("gloo" or "mpi");
      None leaves JAX's setting alone. Ignored by TPU/GPU backends.

  Returns:
    True if this call initialized the distributed runtime.
  """
  if jax.distributed.is_initialized():
    return False
  coordinator_address = coordinator_address or None
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"distributed.num_processes must be >= 1, got {num_processes}.")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"distributed.process_id={process_id} must be in [0, {num_processes}).")
  if coordinator_address is not None:
    if ":" not in coordinator_address:
      raise ValueError(f"distributed.coordinator_address={coordinator_address!r} must be 'host:port'.")
    if num_processes is None or process_id is None:
      raise ValueError(
        "distributed.coordinator_address is set: also set distributed.num_processes "
        "and distributed.process_id (or leave the address empty to auto-detect)."
      )
    if num_processes == 1:
      return False
  elif num_processes is None or num_processes <= 1:
    num_processes = process_id = None  # let the cluster environment say
  if cpu_collectives is not None:
    # Must happen before the CPU backend is created; without it CPU devices of
    # other processes are visible but collectives across them fail.
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )
  return True
