"""Async mode on several hosts: one sampler per learner process, an agreement before each step's collectives.

    host h learner (one process of the multi-host JAX program)       host h sampler (spawned, process/worker.py)
    publish(params, v): gather to host-complete arrays ------ParamSlot------> newest params, once v >= b - k
    next(b): local batch b (this host's prompt block) <--------ShmQueue------- prompts [h P/H, (h+1) P/H) of step b
             -> Agreement: every host posts ok / stop for step b (coordination-service key-value store)
             -> process_allgather: every host holds the global batch [N, T] (host order = prompt order)

`ManyHosts` is the topology (rollout/topology.py) AsyncSource (async_.py) composes when
`jax.process_count() > 1`; it changes four things, whatever the source's publisher (only the shm one runs on
several hosts: the device and transfer publishers refuse several processes with a one-line error):

- Prompts: host h's sampler makes whole groups for prompts [h P/H, (h + 1) P/H) of each step's P
  (`distributed.prompt_block`) from the single-host run's seeded stream, its rows seeded as rows
  [h N/H, (h + 1) N/H) of the whole batch, so with the same parameters the samples are the single-host run's.
- The global batch: after the agreement `multihost_utils.process_allgather` concatenates every host's rows in
  process order (group ids offset by the host's first prompt); metrics are global; `info["hosts"]` holds
  each host's version, checksum, sampler pid and problem ids.
- Weights: publish() dispatches one program that casts and reshards every leaf so that each host holds the
  whole array (an all-gather); the background thread writes the host copy from the local shards. The checksum
  echo of version v must be equal on every host that sampled with v, and the lag bound k is checked on the
  global batch. Delta records and LoRA's one-shot base channel work per host as in AsyncSource.
- Failures (`distributed.Agreement`): a dead or hung sampler is replaced by its own host, within that host's
  budget and with no collective, while the other hosts wait in the agreement (`agreement_timeout_s` covers
  every replacement a budget allows). A failure past a host's budget or a signal on any host posts a stop;
  every host then raises `distributed.JobStopped` at that step and the trainer writes the joint checkpoint
  and exits (130 for signals, 1 for failures). A lost learner process (async_.peer_lost_s) makes the others
  raise PeerLostError without a checkpoint.

Checkpoints keep each host's queued batches (`pack_queued` / `unpack_queued`): a resume on the same number of
hosts gives each host its own rows back; on another number only the batches complete on every host are
restored, re-split into the new prompt blocks. The details: docs/design_notes.md "rollout/multihost.py".
"""

from __future__ import annotations

import json
import logging
import time

import jax
import numpy as np

from vcpo_jax import batch as batch_lib
from vcpo_jax import distributed
from vcpo_jax.rollout import publish as publish_lib
from vcpo_jax.rollout import topology
from vcpo_jax.rollout.common import lag_stats, token_lag_stats

log = logging.getLogger("vcpo_jax")


class _Signalled(Exception):
  """The trainer's interrupt() raised (SIGINT / SIGTERM on this host)."""


def sampler_platform_env(sampler_devices: str, backend: str) -> dict[str, str]:
  """Environment for a sampler on `sampler_devices` (host-local ids) of this host.

  GPU: CUDA_VISIBLE_DEVICES. TPU: the libtpu variables that make the child a single-process runtime
  over those chips, apart from the host's learner process (chips per process bounds for 1, 2, 4, 8
  chips). Not run on TPU hardware here: `async_.sampler_env` entries take precedence.
  """
  ids = [x for x in str(sampler_devices or "").replace(" ", "").split(",") if x]
  if not ids:
    return {}
  if backend == "tpu":
    bounds = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
    if len(ids) not in bounds:
      raise ValueError(
        f"async_.sampler_devices={sampler_devices!r}: {len(ids)} TPU chips; use 1, 2, 4 or 8 chips, or set the "
        "TPU runtime variables yourself in async_.sampler_env."
      )
    return {
      "TPU_VISIBLE_CHIPS": ",".join(ids),
      "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds[len(ids)],
      "TPU_PROCESS_BOUNDS": "1,1,1",
      "TPU_PROCESS_PORT": "8479",
      "TPU_PROCESS_ADDRESSES": "localhost:8479",
      "CLOUD_TPU_TASK_ID": "0",
    }
  return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}


def host_complete_sharding(x: jax.Array):
  """A sharding of `x`'s devices under which every process's devices hold all of `x`.

  The devices are grouped by process into a (hosts, local) mesh; the first dimension divisible by the
  local device count is split over "local" (else the leaf is replicated), nothing over "hosts".
  """
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  flat = list(getattr(x.sharding, "mesh", None).devices.flat) if hasattr(x.sharding, "mesh") else []
  flat = flat or sorted(x.sharding.device_set, key=lambda d: (d.process_index, d.id))
  procs = sorted({d.process_index for d in flat})
  grid = [[d for d in flat if d.process_index == p] for p in procs]
  if len({len(g) for g in grid}) != 1:
    raise ValueError(
      f"multi-host publish: processes hold different numbers of learner devices: {[len(g) for g in grid]}"
    )
  mesh = Mesh(np.array(grid, dtype=object), ("hosts", "local"))
  nlocal = len(grid[0])
  spec = [None] * x.ndim
  for i, d in enumerate(x.shape):
    if d % nlocal == 0 and nlocal > 1:
      spec[i] = "local"
      break
  return NamedSharding(mesh, PartitionSpec(*spec))


def local_copy(x) -> np.ndarray:
  """The whole of `x` as a numpy array, from this process's shards only (no collective)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  out = np.empty(x.shape, x.dtype)
  done, seen = 0, set()
  for s in x.addressable_shards:
    key = tuple((sl.start, sl.stop) for sl in s.index)
    if key in seen:
      continue
    seen.add(key)
    block = np.asarray(s.data)
    out[s.index] = block
    done += block.size
  if done != x.size:
    raise ValueError(f"multi-host publish: this process holds {done} of {x.size} elements of a {x.shape} leaf.")
  return out


class ManyHosts(topology.Topology):
  """The topology of one process of a multi-host job (module docstring).

  Args:
    cfg: AsyncConfig (sampler_devices, peer_lost_s, the timeouts and restart budget the agreement waits for).
    rollout: the RolloutConfig (prompts per step, group size). k: the staleness budget (checked on the global
      batch). publish_dtype: of floating leaves. run_id: names the agreement's keys.
    host, hosts, agreement, allgather: this process's index, the process count, a distributed.Agreement and
      multihost_utils.process_allgather's stand-in (tests: several hosts in one process); jax's by default.
  """

  agreed_stops = True  # next() agrees on every stop (signal, failure) with the other hosts
  gathers = True  # the publish snapshot (a collective) is dispatched by every host at every publish

  def __init__(
    self, cfg, rollout, k: int, publish_dtype, run_id: str, *, host=None, hosts=None, agreement=None, allgather=None
  ):
    self.cfg, self.k, self.publish_dtype = cfg, int(k), publish_dtype
    self.host = jax.process_index() if host is None else int(host)
    self.hosts = jax.process_count() if hosts is None else int(hosts)
    self.group_size = int(rollout.group_size)
    self.blocks = [distributed.prompt_block(rollout.prompts_per_step, h, self.hosts) for h in range(self.hosts)]
    self.block = self.blocks[self.host]
    if agreement is None:
      agreement = distributed.Agreement(run_id, lost_after_s=float(cfg.peer_lost_s))
    self.agreement = agreement
    self.allgather = _process_allgather if allgather is None else allgather
    self._outer_interrupt = None
    self._waiting: int | None = None  # the step next() agrees on, while it waits for this host's batch
    self._gather = None  # jit: cast + reshard to host-complete arrays, built at the first publish
    self._deferred: Exception | None = None  # a sampler failure seen at publish(), reported at the next step

  def rows(self, batch_size):
    return (self.block[1] - self.block[0]) * self.group_size

  def sampler_env(self, env):
    for name, v in sampler_platform_env(self.cfg.sampler_devices, jax.default_backend()).items():
      env.setdefault(name, v)  # async_.sampler_env wins
    if jax.default_backend() == "tpu":
      env.pop("CUDA_VISIBLE_DEVICES", None)
    return env

  def worker_fields(self):
    return {"prompt_block": self.block, "host": self.host}

  # -- weights

  def snapshot(self, leaves):
    """The one-host snapshot (the same cast) resharded so that each host's devices hold whole arrays."""
    if self._gather is None:
      out = [host_complete_sharding(x) for x in leaves]
      dtype = self.publish_dtype
      self._gather = jax.jit(lambda ls: [publish_lib.snapshot_leaf(x, dtype) for x in ls], out_shardings=out)
    return self._gather(leaves)

  def host_arrays(self, leaves, names):
    if not all(_host_complete(x) for x in leaves):
      leaves = self.snapshot(leaves)  # raw parameters: gather first
    return {n: local_copy(a) for n, a in zip(names, leaves)}

  def host_copy(self, leaves):
    """Gathered to host-complete arrays first (LoRA's base: a collective, dispatched by every host at its first
    publish), then copied from this host's shards."""
    gather = jax.jit(lambda ls: list(ls), out_shardings=[host_complete_sharding(x) for x in leaves])
    return [local_copy(x) for x in gather(leaves)]

  def publish(self, write):
    """Runs `write`, but a failure of this host's sampler is kept for the next agreement instead of raised here,
    alone (AsyncSource replaces a failed sampler first, within this host's budget: host-local, no collective).
    The gather was dispatched before (Publisher.prepare, every host, every publish: a host that skipped it
    would leave the others' copies waiting)."""
    if self._deferred is not None:
      return
    try:
      write()
    except RuntimeError as e:  # async_.SamplerDiedError included
      self._deferred = e

  # -- batches

  def interrupt(self, outer):
    self._outer_interrupt = outer
    return self._interrupt_or_peer

  def _interrupt_or_peer(self):
    if self._outer_interrupt is not None and self._waiting is None:
      self._outer_interrupt()  # outside next() (publish): the trainer's Interrupted, handled as in one process
    elif self._outer_interrupt is not None:
      try:
        self._outer_interrupt()
      except Exception as e:  # noqa: BLE001 -- the trainer's Interrupted: agreed on with the other hosts
        raise _Signalled(str(e)) from None
    if self._waiting is not None:
      self.agreement.check(self._waiting)

  def next(self, step, local, requeue):
    """This host's batch `step` (`local(step)`), agreed on with every host, gathered into the global batch;
    `requeue()` puts the host batch back for the joint checkpoint when the hosts agree to stop."""
    t0 = time.monotonic()
    got = None
    self._waiting = step
    try:
      if self._deferred is not None:
        e, self._deferred = self._deferred, None
        raise e
      self._interrupt_or_peer()  # a signal or a peer's stop, also when the batch is in host memory (no queue wait)
      got = local(step)
      batch, info = got
      payload = {
        "ok": True,
        "version": int(batch["policy_version"][0]),  # one version per host batch
        "checksum": info["params_checksum"],
        "pid": info["producer"][0],
        "seq": info["producer"][1],  # with pid: which sampler made the host batch, its n-th
        "problem_ids": list(info["problem_ids"]),
        "response_len_mean": info["response_len_mean"],
        "finished_frac": info["finished_frac"],
        "gen_s": info["sampler_gen_s"],
        "idle_frac": info["sampler_idle_frac"],
        "restarts": info["metrics"]["async/sampler_restarts"],  # this host's replacements so far
      }
    except _Signalled as e:
      payload = {"ok": False, "signal": True, "reason": f"interrupted ({e})"}
    except distributed._PeerStopping as e:
      payload = {"ok": False, "follow": True, "signal": True, "reason": str(e)}
    except distributed.PeerLostError as e:
      payload = {"ok": False, "lost": True, "reason": str(e)}
    except (TimeoutError, RuntimeError) as e:  # async_.SamplerDiedError included
      log.error("multi-host: the sampler of host %d failed at step %d: %s", self.host, step, e)
      payload = {"ok": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    finally:
      self._waiting = None
    payloads = self.agreement.exchange(step, payload, timeout_s=agreement_timeout_s(self.cfg))
    self.agreement.forget(step - 2)
    lost = [p["reason"] for p in payloads if p.get("lost")]
    if lost:
      raise distributed.PeerLostError(lost[0])
    try:
      distributed.decide(payloads, step)
    except distributed.JobStopped:
      if got is not None:  # received, not consumed: back to the front, so the joint checkpoint keeps it
        requeue()
      raise
    return self._global(step, batch, info, payloads, time.monotonic() - t0)

  def _global(self, step, batch, info, payloads, wait_s):
    by_version: dict[int, set] = {}
    for p in payloads:
      if p["checksum"] is not None:
        by_version.setdefault(p["version"], set()).add(p["checksum"])
    split = {v: c for v, c in by_version.items() if len(c) > 1}
    if split:
      raise RuntimeError(f"multi-host: hosts sampled step {step} from different parameters of one version: {split}")
    local = {f: np.asarray(batch[f]) for f in batch}
    local["group_id"] = local["group_id"] + self.block[0]  # the host's prompts are [lo, hi) of the step's P
    full = {f: np.asarray(a) for f, a in self.allgather(local, tiled=True).items()}
    lag = step - full["policy_version"]
    if lag.min() < 0 or lag.max() > self.k:
      raise RuntimeError(f"async source: batch {step} has lags [{lag.min()}, {lag.max()}] outside [0, {self.k}].")
    out = dict(
      info,
      texts=None,  # every host's texts stay on that host
      problem_ids=[i for p in payloads for i in p["problem_ids"]],
      response_len_mean=float(np.mean([p["response_len_mean"] for p in payloads])),
      finished_frac=float(np.mean([p["finished_frac"] for p in payloads])),
      sampler_gen_s=float(max(p["gen_s"] for p in payloads)),
      sampler_idle_frac=float(np.mean([p["idle_frac"] for p in payloads])),
      learner_wait_s=wait_s,
      hosts=payloads,
      **lag_stats(step, full["policy_version"]),
      metrics={
        **token_lag_stats(step, full["token_version"]),
        "async/sampler_restarts": sum(int(p.get("restarts", 0)) for p in payloads),  # every host's
      },
    )
    return batch_lib.Batch.from_arrays(full), out

  # -- checkpointing, lifetime

  def pack(self, local, schema):
    """Every host's received-but-unconsumed batches as global batches (`pack_queued`); a collective: every
    process calls it at the same save (the trainer's _save)."""
    return pack_queued(_allgather_queued(local, schema, self.allgather), self.blocks, self.group_size)

  def unpack(self, arrays, metas):
    """This host's rows of a checkpoint's queued global batches (`unpack_queued`)."""
    return unpack_queued(arrays, metas, self.host, self.hosts, self.group_size, self.blocks)

  def close(self):
    self.agreement.close()


def agreement_timeout_s(cfg) -> float:
  """How long a host that posted waits for the others (their heartbeats say they are alive): a peer may find
  its sampler failed (within the longer of timeout_s and heartbeat_timeout_s) and wait for a replacement's
  first batch (startup_timeout_s), once per replacement its budget allows, and once more past it. cfg: AsyncConfig."""
  timeout = float(cfg.timeout_s)
  attempt = float(cfg.startup_timeout_s) + max(timeout, float(cfg.heartbeat_timeout_s) or timeout)
  return (int(cfg.max_sampler_restarts) + 1) * attempt + 60.0


def _process_allgather(x, tiled: bool):
  from jax.experimental import multihost_utils  # jax's multi-process helpers: loaded on several hosts only

  return multihost_utils.process_allgather(x, tiled=tiled)


def _host_complete(x) -> bool:
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return True
  sh = x.sharding
  return hasattr(sh, "mesh") and tuple(sh.mesh.axis_names) == ("hosts", "local")


# ----------------------------------------------------------------------------- queued batches in checkpoints


def pack_queued(per_host: list[list[tuple[dict, dict]]], blocks, group_size: int) -> tuple[list[dict], list[dict]]:
  """Every host's unconsumed batches -> (arrays, metas) of global batches, as a checkpoint stores them.

  Args:
    per_host: per_host[h] = host h's received-but-unconsumed batches, oldest first: (arrays with
      (hi - lo) * G rows and host-local group ids, the sampler's metadata). Every host's list starts at the
      same step (all hosts consumed the same steps); lists may differ in length.
    blocks: blocks[h] = (lo, hi), host h's prompts.
  Returns:
    arrays[i] = {field: [N, ...]} of step s + i, host h's rows at rows [lo G, hi G) with global group ids,
    zeros where host h holds no batch i; metas[i] = {"step", "hosts": [host h's metadata or None], and the
    fields a single-host source reads (problem_ids, version, ...) over the hosts present}.
  """
  count = max((len(b) for b in per_host), default=0)
  out_arrays, out_metas = [], []
  for i in range(count):
    present = [(h, b[i]) for h, b in enumerate(per_host) if i < len(b)]
    steps = {int(m["step"]) for _, (_, m) in present}
    if len(steps) != 1:
      raise RuntimeError(f"multi-host checkpoint: the hosts' queued batch {i} has steps {sorted(steps)}.")
    ref = present[0][1][0]
    n = blocks[-1][1] * group_size
    arrays = {f: np.zeros((n, *a.shape[1:]), a.dtype) for f, a in ref.items()}
    for h, (a, _) in present:
      lo, hi = blocks[h]
      for f, x in a.items():
        arrays[f][lo * group_size : hi * group_size] = x
      arrays["group_id"][lo * group_size : hi * group_size] += lo  # global group ids
    metas = [m for _, (_, m) in present]
    hosts = [b[i][1] if i < len(b) else None for b in per_host]
    out_arrays.append(arrays)
    out_metas.append(
      {
        "step": steps.pop(),
        "hosts": [None if m is None else dict(m, texts=None) for m in hosts],  # texts stay out of the JSON
        "version": min(int(m["version"]) for m in metas),
        "problem_ids": [p for m in metas for p in m["problem_ids"]],
        "response_len_mean": float(np.mean([m["response_len_mean"] for m in metas])),
        "finished_frac": float(np.mean([m["finished_frac"] for m in metas])),
        "gen_s": float(max(m["gen_s"] for m in metas)),
        "idle_s_total": 0.0,  # a restored batch reports no idle fraction
        "elapsed_s_total": 0.0,
        "sampler_pid": [m.get("sampler_pid") for m in metas],
        "seq": [m.get("seq") for m in metas],
        "grading_failures": int(sum(m.get("grading_failures", 0) for m in metas)),
      }
    )
  return out_arrays, out_metas


def unpack_queued(arrays, metas, host: int, hosts: int, group_size: int, blocks) -> list[tuple[dict, dict]]:
  """This host's (arrays, meta) of a checkpoint's queued batches, oldest first, for AsyncSource.load_queued.

  Same number of hosts as wrote them (pack_queued's metas, one entry per host): host h gets back its own
  rows of every batch it held, however many the other hosts held. Otherwise (another host count, or a
  single-host checkpoint, whose batches are whole): the batches complete on every writing host, cut to this
  host's prompt block. Group ids become host-local again.
  """
  lo, hi = blocks[host]
  rows = slice(lo * group_size, hi * group_size)
  same = bool(metas) and all(len(m.get("hosts") or ()) == hosts for m in metas)
  out = []
  for a, m in zip(arrays, metas):
    local = {f: np.asarray(x)[rows] for f, x in a.items()}
    local["group_id"] = local["group_id"] - lo
    if same:
      if m["hosts"][host] is None:
        break  # this host had not received batch `step` (nor any later one): its sampler makes them
      out.append((local, dict(m["hosts"][host])))
      continue
    if None in (m.get("hosts") or ()):
      break  # incomplete on the writing hosts: made again
    meta = {k: v for k, v in m.items() if k != "hosts"}
    meta.update(
      problem_ids=list(m["problem_ids"])[lo:hi],
      version=int(local["policy_version"].min()),
      params_checksum=None,  # the writing run's echo, not checked after a resume
      params_checksums={},
      texts=list(m["texts"])[rows] if m.get("texts") else None,
    )
    out.append((local, meta))
  return out


def _allgather_queued(local: list[tuple[dict, dict]], schema, allgather) -> list[list[tuple[dict, dict]]]:
  """Every host's `local` list of batches of `schema` (a collective: counts, the stacked arrays, the JSON)."""
  gather = lambda x: np.asarray(allgather(x, tiled=False))
  counts = gather(np.int32(len(local))).reshape(-1).tolist()
  hosts, count = len(counts), max(counts)
  if count == 0:
    return [[] for _ in range(hosts)]
  stacked = {f: np.zeros((count, *x.shape), x.dtype) for f, x in schema.fields.items()}
  for i, (a, _) in enumerate(local):
    for f in stacked:
      stacked[f][i] = a[f]
  every = {f: gather(x) for f, x in stacked.items()}  # [H, count, ...]
  text = np.frombuffer(json.dumps([m for _, m in local]).encode(), np.uint8)
  size = int(gather(np.int32(text.size)).max())
  metas = gather(np.pad(text, (0, size - text.size)))
  out = []
  for h in range(hosts):
    ms = json.loads(bytes(metas[h]).rstrip(b"\0").decode())
    out.append([({f: every[f][h, i] for f in every}, ms[i]) for i in range(counts[h])])
  return out
