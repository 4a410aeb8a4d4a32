"""The async mode's process boundary: what crosses between the learner and its spawned sampler.

  worker.py      the sampler process (spawn target `worker.main`, `WorkerArgs`)
  shm_queue.py   the shared-memory batch queue (`ShmQueue`, `BatchSchema`), segments, locks, liveness
  param_slot.py  the shared-memory parameter slot (weights + version + checksum)

The learner side (`rollout/async_.py`, `AsyncSource`) is a RolloutSource like the others and stays in
`rollout/`.
"""
