"""Multi-host async runs: which prompts each host samples, and a per-step agreement before every collective.

On a pod every host runs one learner process (one multi-host JAX program over the
learner chips of all hosts) and one sampler process on its own chips, joined by
that host's shared-memory queue and parameter slot (rollout/async_.py). This
module holds what crosses hosts:

- `prompt_block(P, host, hosts)`: host h samples prompts [h * P / H, (h + 1) * P / H)
  of each step's P prompts (the same seeded stream as a single-host run, so no
  prompt is sampled twice in a step and the problem order is the single-host one).
- `Agreement`: before a step's collectives each learner posts its status (a batch
  is ready, or why it must stop) in the coordination service's key-value store and
  reads every other host's. Only when all H hosts said "ok" does anyone enter the
  collective; if any host said "stop" (its sampler died or hung, it got a signal)
  every host stops at the same step, together, so they can still write a joint
  checkpoint. A host that posts nothing while its heartbeat (a counter a
  background thread bumps every `beat_s`) stays unchanged for `lost_after_s` is
  dead or stopped: the others raise `PeerLostError` without a checkpoint (a joint
  save would wait for the lost host) and exit. A host killed between an agreement
  and the end of that step's collectives (on CPU most of a step) leaves the others
  inside a collective that never returns (gloo does not fail on the closed socket:
  measured, the survivor waited until jax's coordination service aborted it, 60 s
  later with SIGABRT). For that the heartbeat thread is also a watchdog: a peer
  silent for `watchdog_s` (1.5 x lost_after_s), longer than the main thread's
  own PeerLostError would take, ends this process with os._exit(1); its sampler
  then dies of PR_SET_PDEATHSIG and the resource tracker removes its shared memory,
  as for a killed learner.

A process whose peer is gone must also not end through jax's exit-time `jax.distributed.shutdown()`:
that barrier waits for the lost process until the coordination service's own heartbeat timeout (100 s
by default; measured here: 100 s, then SIGABRT, exit status 134 in a shell). `end_alone` ends such a process
within seconds instead (main.py calls it for any error of a multi-process run; the lost peer's error,
PeerLostError, skips the barrier at once).

Everything goes through `jax.distributed`'s coordination service client
(key_value_set / key_value_dir_get / key_value_delete): no extra sockets. Each waiting host makes two
calls per poll (its peers' posts and heartbeats, one directory read each), every 0.25 s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time

import jax

_PREFIX = "vcpo_jax"


class PeerLostError(RuntimeError):
  """Another host's learner stopped answering (killed, stopped, hung): no joint checkpoint is possible."""


class JobStopped(Exception):
  """Every host agreed to stop at this step (a sampler failed or a signal arrived on some host).

  Raised on every host at the same step, so all of them can save the joint checkpoint; `exit_code` is 130
  when every reason was a signal (resumable by design), 1 when some host failed.
  """

  def __init__(self, msg: str, exit_code: int):
    super().__init__(msg)
    self.exit_code = exit_code


class _PeerStopping(Exception):
  """A peer has posted a stop for the step this host is waiting on: stop waiting for the local batch."""


def prompt_block(prompts_per_step: int, host: int, hosts: int) -> tuple[int, int]:
  """(lo, hi): the prompts of each step's P that host `host` of `hosts` samples (whole groups)."""
  if prompts_per_step % hosts:
    raise ValueError(
      f"task.prompts_per_step={prompts_per_step} must be divisible by the number of processes ({hosts}) in "
      "async mode: every host's sampler makes whole groups for its share of the prompts."
    )
  per = prompts_per_step // hosts
  return host * per, (host + 1) * per


def _client():
  from jax._src import distributed

  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("multi-host async mode needs jax.distributed.initialize (config distributed.enabled).")
  return client


class Agreement:
  """Per-step status exchange of every process through the coordination service's key-value store.

  Args:
    run_id: names this run's keys (the coordination service is per job; the id keeps jobs apart in tests).
    lost_after_s: a peer whose heartbeat does not change for this long, and that has not posted, is lost.
    beat_s: heartbeat period of the background thread.
    watchdog_s: a peer whose heartbeat does not change for this long ends this process from the heartbeat
      thread, wherever the main thread is (inside a collective); default 1.5 * lost_after_s, 0: never.
    client, host, hosts: the coordination client and this process's index / the process count (tests).
  """

  def __init__(
    self,
    run_id: str,
    *,
    lost_after_s: float = 30.0,
    beat_s: float = 0.5,
    watchdog_s: float | None = None,
    client=None,
    host=None,
    hosts=None,
  ):
    if not lost_after_s > 4 * beat_s:
      raise ValueError(f"async_.peer_lost_s={lost_after_s} must exceed 4 heartbeats ({4 * beat_s} s).")
    self.client = client if client is not None else _client()
    self.host = jax.process_index() if host is None else int(host)
    self.hosts = jax.process_count() if hosts is None else int(hosts)
    self.prefix = f"{_PREFIX}/{run_id}"
    self.lost_after_s, self.beat_s = float(lost_after_s), float(beat_s)
    now = time.monotonic()
    self._seen = {h: (None, now) for h in range(self.hosts) if h != self.host}  # peer -> (beat, when it changed)
    self.watchdog_s = 1.5 * self.lost_after_s if watchdog_s is None else float(watchdog_s)
    self._watched = dict(self._seen)  # the heartbeat thread's own copy
    self._stop = threading.Event()
    self._beats = 0
    self._beat()
    self._thread = threading.Thread(target=self._beat_loop, name="vcpo-heartbeat", daemon=True)
    self._thread.start()

  # -- heartbeat

  def _beat(self):
    self._beats += 1
    self.client.key_value_set(f"{self.prefix}/hb/{self.host}", str(self._beats), allow_overwrite=True)

  def _beat_loop(self):
    n = 0
    while not self._stop.wait(self.beat_s):
      n += 1
      try:
        self._beat()
      except Exception:  # noqa: BLE001 -- the service is gone (process 0 exited): the peers notice our silence
        pass
      if self.watchdog_s > 0 and n % 4 == 0:  # the watchdog reads the counters every 4 beats
        # only peers it has seen beat: one still starting up (its source not built yet) is not lost
        lost = [h for h in self._silent(self._watched, self.watchdog_s) if self._watched[h][0] is not None]
        if lost and not self._stop.is_set():
          self._watchdog_exit(lost)

  def _watchdog_exit(self, lost: list[int]):
    logging.getLogger("vcpo_jax").critical(
      "multi-host: process(es) %s silent for %g s (killed, stopped or hung) while this process is busy (inside a "
      "step's collectives?): exiting with code 1; the sampler ends with this process (PR_SET_PDEATHSIG) and the "
      "resource tracker removes its shared memory.",
      lost,
      self.watchdog_s,
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)

  def lost_peers(self) -> list[int]:
    """Peers whose heartbeat has not changed for lost_after_s (reads every peer's counter once)."""
    return self._silent(self._seen, self.lost_after_s)

  def _silent(self, seen: dict, after_s: float) -> list[int]:
    """Updates `seen` (peer -> (counter, when it last changed)) from one read; peers unchanged for `after_s`."""
    now, lost = time.monotonic(), []
    try:  # one call for every host's counter (not one per peer: the coordinator serves every host)
      beats = {k.rsplit("/", 1)[1]: v for k, v in self.client.key_value_dir_get(f"{self.prefix}/hb/")}
    except Exception:  # noqa: BLE001 -- the service is unreachable: every counter looks unchanged
      beats = {}
    for h, (beat, since) in seen.items():
      cur = beats.get(str(h), beat)
      if cur != beat:
        seen[h] = (cur, now)
      elif now - since > after_s:
        lost.append(h)
    return lost

  # -- per-step exchange

  def _posted(self, step: int) -> dict[int, dict]:
    try:
      items = self.client.key_value_dir_get(f"{self.prefix}/step/{step}/")
    except Exception as e:  # noqa: BLE001 -- process 0 (the service) is gone
      raise PeerLostError(f"multi-host: the coordination service stopped answering ({e}); process 0 has exited.")
    return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in items}

  def check(self, step: int):
    """Non-blocking, between the slices of a local wait: raises if a peer posted a stop or is lost."""
    posted = self._posted(step)
    stops = [h for h, p in posted.items() if not p["ok"]]
    if stops:
      raise _PeerStopping(f"host {stops[0]} posted a stop at step {step}: {posted[stops[0]]['reason']}")
    self._raise_lost(step, posted)

  def _raise_lost(self, step, posted):
    lost = [h for h in self.lost_peers() if h not in posted]
    if lost:
      raise PeerLostError(
        f"multi-host: process(es) {lost} posted nothing for step {step} and their heartbeat has not changed for "
        f"{self.lost_after_s:g} s (killed, stopped or hung); exiting without a joint checkpoint."
      )

  def exchange(self, step: int, payload: dict, poll=None, timeout_s: float | None = None) -> list[dict]:
    """Posts this host's `payload` ({"ok": bool, "reason": str, ...}) for `step`; returns every host's, in order.

    Waits (in 0.1 s slices; `poll()` runs between them) until all hosts posted. Raises PeerLostError for a
    lost peer, TimeoutError past `timeout_s` (peers alive but silent: a bug, not a slow sampler, whose own
    timeouts end its wait).
    """
    self.client.key_value_set(f"{self.prefix}/step/{step}/{self.host}", json.dumps(payload))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      posted = self._posted(step)
      if len(posted) == self.hosts:
        return [posted[h] for h in range(self.hosts)]
      self._raise_lost(step, posted)
      if deadline is not None and time.monotonic() > deadline:
        missing = sorted(set(range(self.hosts)) - set(posted))
        raise TimeoutError(f"multi-host: processes {missing} posted nothing for step {step} within {timeout_s:g} s.")
      if poll is not None:
        poll()
      time.sleep(0.1)

  def forget(self, step: int):
    """Deletes this host's entry of an old step (the store would otherwise grow by H entries per step)."""
    with contextlib.suppress(Exception):  # best effort
      self.client.key_value_delete(f"{self.prefix}/step/{step}/{self.host}")

  def close(self):
    self._stop.set()
    self._thread.join(5.0)


def end_alone(error: BaseException, code: int = 1, timeout_s: float = 10.0):
  """Ends this process of a multi-process job after `error`, within about `timeout_s` (never returns).

  The atexit handlers run (the grader pool, jax's backends and its distributed shutdown, whose barrier
  completes when every process is exiting, e.g. after an error all of them raised) in a daemon thread
  given `timeout_s`; after a PeerLostError (the lost process never reaches the barrier) none run. Then the
  logs are flushed and the process exits with `code` (os._exit: nothing else waits for the lost peer).
  """
  import atexit

  if not isinstance(error, PeerLostError):
    t = threading.Thread(target=atexit._run_exitfuncs, name="vcpo-exit", daemon=True)
    t.start()
    t.join(timeout_s)
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def decide(payloads: list[dict], step: int):
  """Raises JobStopped naming every host's reason if any host posted a stop; all hosts decide alike."""
  stops = [(h, p) for h, p in enumerate(payloads) if not p["ok"]]
  if not stops:
    return
  causes = [(h, p) for h, p in stops if not p.get("follow")] or stops  # "follow": stopped for a peer's stop
  why = "; ".join(f"host {h}: {p['reason']}" for h, p in causes)
  code = 130 if all(p.get("signal") for _, p in causes) else 1
  raise JobStopped(f"multi-host: every process stops at step {step} ({why})", code)
