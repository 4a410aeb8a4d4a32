"""Devices -> Mesh: the mesh shape, the learner / sampler device split, multi-host init, global batches.

`build_mesh(shape, N, sampler_devices)` is the learner's ("data", "fsdp", "tensor") mesh (sharding.py
names the axes and holds the partition rules and activation constraints) over every device but an
async sampler's (`split_devices`; on several hosts `learner_devices` takes every host's sampler chips
away). Axes are created Auto (sharding.py's module docstring says why).

One accelerator, two processes: `memory_plan` is the XLA_PYTHON_CLIENT_* variables of an async run's learner
and sampler process (config async_.memory_share), which each process must have before jax starts its backends:
the learner sets its own (`apply_env`, from trainer.run), the sampler's are written into the spawned child's
environment (rollout/async_.py).

Multi-host: `maybe_initialize_distributed` wraps `jax.distributed.initialize` (with gloo CPU
collectives so that the same code runs across local CPU processes), after which `jax.devices()` lists
every process's devices and the same mesh code builds the global mesh. Each process feeds its own rows
of a global batch with `make_global_batch`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pkgutil
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from vcpo_jax.schema import check_field
from vcpo_jax.sharding import BATCH_AXES, MESH_AXES, batch_sharding

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Shape of the ("data", "fsdp", "tensor") mesh.

  Attributes:
    shape: sizes of the three axes, in MESH_AXES order. At most one entry may be
      -1, meaning "all remaining devices" (e.g. (-1, 1, 1) = pure data parallel on
      whatever is available). After resolution the product must equal the number
      of devices the mesh is built on.
  """

  shape: tuple[int, int, int] = (-1, 1, 1)  # (data, fsdp, tensor); -1 in one slot = all remaining devices

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


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """The processes of a multi-host job (config.distributed)."""

  enabled: bool = False  # call jax.distributed.initialize (multi-host)
  coordinator_address: str = ""  # host:port of process 0
  num_processes: int = 1  # processes in the job
  process_id: int = 0  # this process's index
  extra: dict = dataclasses.field(default_factory=dict, metadata={"config": False})  # keys not modelled here

  def __post_init__(self):
    check_field(self.num_processes >= 1, "distributed.num_processes", self.num_processes, "must be >= 1.")
    check_field(
      0 <= self.process_id < self.num_processes,
      "distributed.process_id",
      self.process_id,
      f"must be in [0, distributed.num_processes={self.num_processes}).",
    )
    if self.enabled:
      addr = self.coordinator_address
      check_field(
        bool(re.fullmatch(r"\S+:\d+", addr or "")),
        "distributed.coordinator_address",
        addr,
        "required when distributed.enabled=True: host:port of process 0.",
      )


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
      is the learner's). Multi-process: host-local ids, taken from every host (learner_devices).
  Raises:
    ValueError naming the config field (config.mesh.shape or config.task.prompts_per_step).
  """
  devices = jax.devices()
  if sampler_devices and (jax.process_count() > 1 or len(devices) > 1):
    # learner_devices also on one host: sampler ids that this process's CUDA_VISIBLE_DEVICES leaves out
    # (launch/multi_gpu.sh gives the learner LEARNER_GPUS) are excluded already, not an error.
    devices = learner_devices(sampler_devices, devices)
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
  div = math.prod(mesh.shape[a] for a in BATCH_AXES)
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


def learner_devices(sampler_devices, devices=None) -> list:
  """The global devices minus every host's sampler devices (`sampler_devices` are host-local ids).

  Host-local ids are the host's chip (GPU) numbers, as the sampler's TPU_VISIBLE_CHIPS /
  CUDA_VISIBLE_DEVICES take them. If this process's own visibility variable lists its chips (the
  launcher gave the learner "0,1,2", the sampler "3"), an id is removed at its position in that list
  and ids not in it are already excluded; otherwise id i is the process's i-th device. So "3" takes
  the 4th chip of every host away from the learner either way.
  """
  devices = list(jax.devices() if devices is None else devices)
  if not sampler_devices:
    return devices
  ids = [int(x) for x in str(sampler_devices).replace(" ", "").split(",") if x]
  visible = os.environ.get("TPU_VISIBLE_CHIPS") or os.environ.get("CUDA_VISIBLE_DEVICES") or ""
  visible = [int(x) for x in visible.replace(" ", "").split(",") if x.strip().isdigit()]
  if visible:
    ids = [visible.index(i) for i in ids if i in visible]  # positions among this process's devices
    if not ids:
      return devices
  out = []
  for p in sorted({d.process_index for d in devices}):
    local = [d for d in devices if d.process_index == p]
    by_local = {i: d for i, d in enumerate(local)}
    bad = [i for i in ids if i not in by_local]
    if bad:
      raise ValueError(
        f"async_.sampler_devices={sampler_devices!r}: host-local ids {bad} do not exist on process {p} "
        f"({len(local)} devices); use ids in [0, {len(local)})."
      )
    _, learn = split_devices(",".join(str(local[i].id) for i in ids), local)
    out.extend(learn)
  return out


# ----------------------------------------------------------------------------- one accelerator, two processes

# async_.memory_share="auto" on one shared GPU: (learner, sampler) fractions of its memory. The learner holds
# float32 parameters, AdamW moments and the step's activations, the sampler bf16 weights and its KV cache; the
# 0.1 left over is for what each process holds outside XLA's pool (CUDA context, cuBLAS / cuDNN workspaces).
AUTO_SHARES = (0.6, 0.3)
MEMORY_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")


def parse_memory_share(text) -> str | tuple[float, float]:
  """async_.memory_share -> "auto" | "grow" | "xla" | (learner, sampler) fractions; ValueError if malformed."""
  text = str(text).replace(" ", "").lower()
  if text in ("auto", "grow", "xla"):
    return text
  try:
    learner, sampler = (float(x) for x in text.split(","))
  except ValueError:
    raise ValueError(
      f"async_.memory_share={text!r}: use 'auto', 'grow' (no preallocation), 'xla' (XLA's defaults) or two "
      "fractions 'LEARNER,SAMPLER' such as '0.6,0.3'."
    ) from None
  if not (0 < learner < 1 and 0 < sampler < 1 and learner + sampler <= 0.95):
    raise ValueError(
      f"async_.memory_share={text!r}: each fraction in (0, 1), together at most 0.95 (each process also "
      "holds memory outside XLA's pool)."
    )
  return learner, sampler


def _platform(platform: str | None) -> str:
  p = (platform or "").lower()
  return "gpu" if p in ("gpu", "cuda", "rocm") else p


def memory_plan(share, platform: str | None, sampler_ids: tuple[int, ...] = (), visible=None) -> dict:
  """The XLA_PYTHON_CLIENT_* variables of an async run's learner and sampler process (pure; no jax call).

  Args:
    share: async_.memory_share (parse_memory_share's forms).
    platform: the accelerator ("gpu" / "cuda" / "rocm", "tpu", "cpu"; `platform_hint`).
    sampler_ids: async_.sampler_devices as ints; () = the sampler shares the learner's devices.
    visible: the learner's CUDA_VISIBLE_DEVICES as ints, or None (unset: it sees every GPU of the host).
  Returns:
    {"learner": {var: value}, "sampler": {var: value}}; a value None means "unset" (XLA's default). Empty
    dicts off GPUs (CPU: the variables do nothing; TPU: a chip belongs to one process, so the sampler needs
    its own chips) and for "xla" (whatever the environment says, in both processes). Otherwise:
      - shared devices: each process preallocates its fraction ("auto": AUTO_SHARES); "grow": neither
        preallocates (each takes memory as it goes, and the first to need much can starve the other);
      - own devices: the sampler (CUDA_VISIBLE_DEVICES = its ids) keeps XLA's default of its GPUs; the
        learner, if it sees the sampler's GPUs too (no CUDA_VISIBLE_DEVICES of its own), does not
        preallocate, since its client would take 75% of every visible GPU, the sampler's included.
    A variable the learner sets and the sampler's plan leaves alone is unset in the sampler (it would
    inherit the learner's value otherwise).
  """
  share = parse_memory_share(share) if isinstance(share, str) else tuple(share)
  if _platform(platform) != "gpu" or share == "xla":
    return {"learner": {}, "sampler": {}}
  shared = not sampler_ids
  sees_sampler = visible is None or any(i in visible for i in sampler_ids)
  if share == "grow":
    learner = sampler = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": None}
  elif shared or isinstance(share, tuple):
    fl, fs = AUTO_SHARES if share == "auto" else share
    learner, sampler = ({"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{f:g}"} for f in (fl, fs))
  else:  # "auto" on the sampler's own GPUs
    learner = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if sees_sampler else {}
    sampler = {}
  sampler = {**{k: None for k in learner if k not in sampler}, **sampler}
  return {"learner": dict(learner), "sampler": dict(sampler)}


def platform_hint() -> str:
  """The platform jax will use, without starting it: the running backend's once started; else the first of
  jax_platforms (JAX_PLATFORMS); else "gpu" if a CUDA / ROCm plugin is installed, "tpu" with libtpu, "cpu"."""
  from jax._src import xla_bridge  # backends_are_initialized: public jax has no way to ask without starting them

  if xla_bridge.backends_are_initialized():
    return jax.default_backend()
  if jax.config.jax_platforms:
    return _platform(jax.config.jax_platforms.split(",")[0])
  from importlib import metadata

  # jax finds PJRT plugins as modules of the jax_plugins namespace or "jax_plugins" entry points (cuda12 / 13,
  # rocm); listing them imports none.
  plugins = [e.name for e in metadata.entry_points(group="jax_plugins")]
  try:
    import jax_plugins  # a namespace package: importing it starts nothing

    plugins += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
  except ImportError:
    pass
  if any("cuda" in n or "rocm" in n for n in plugins):
    return "gpu"
  return "tpu" if any("tpu" in n for n in plugins) or _has_module("libtpu") else "cpu"


def _has_module(name: str) -> bool:
  import importlib.util

  return importlib.util.find_spec(name) is not None


def apply_env(env: dict) -> dict:
  """Sets (a value) or unsets (None) each variable in os.environ for this process's jax, which reads them when
  it starts its backends: a warning names what came too late if they are started already. Returns what changed."""
  from jax._src import xla_bridge

  changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
  if changed and xla_bridge.backends_are_initialized():
    log.warning(
      "jax started before the run set %s: this process keeps its memory settings; set them before the "
      "first jax call (async_.memory_share)",
      changed,
    )
    return {}
  for k, v in changed.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
  return changed
