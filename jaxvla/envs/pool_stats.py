"""The env pool's counters, and the hang timeout it derives from them.

This file owns :class:`PoolStats`, the fault and throughput counters of an
:class:`jaxvla.envs.pool.EnvPool` (what the rollout reads as
:class:`protocol.WorkerStats`), and the rule that turns the chunk times measured
so far into the time a worker may spend on a step command before the pool
counts it as hung (:meth:`PoolStats.hang_timeout_s`).
"""

from __future__ import annotations

import dataclasses

# Hang detection once the env's speed is known: a chunk HANG_FACTOR times slower than
# the slowest of the first HANG_MIN_CHUNKS+ chunks (and at least hang_floor_s) is a hang.
# Before that (simulator warm-up), step_timeout_s; it also stays the upper bound.
HANG_FACTOR = 10.0
HANG_MIN_CHUNKS = 16


@dataclasses.dataclass
class PoolStats:
  """Fault and throughput counters of an :class:`jaxvla.envs.pool.EnvPool`."""
  restarts: int = 0  # Worker processes restarted (any reason).
  died: int = 0  # Restarts because the process exited.
  hung: int = 0  # Restarts because a chunk took longer than step_timeout_s.
  sim_errors: int = 0  # Exceptions raised by a simulator (re-raised in the parent).
  truncated_by_fault: int = 0  # Episodes lost to a restart, reported as truncated.
  slowest_chunk_s: float = 0.0  # Longest time a worker took for one step command.
  chunks: int = 0  # Env chunk steps received (faults excluded).
  env_steps: int = 0  # Actions executed by the envs.
  # Seconds the workers spent executing chunks, summed over workers (divide by
  # num_workers * wall time for the env stage's utilisation).
  worker_busy_s: float = 0.0

  def hang_timeout_s(self, step_timeout_s: float, hang_floor_s: float) -> float:
    """Seconds a worker may spend on a step command before it counts as hung.

    ``step_timeout_s`` until ``HANG_MIN_CHUNKS`` chunks have been measured (the
    simulator's warm-up), then ``HANG_FACTOR`` times the slowest chunk so far, at
    least ``hang_floor_s`` and at most ``step_timeout_s``.
    """
    if self.chunks < HANG_MIN_CHUNKS:
      return step_timeout_s
    return min(step_timeout_s, max(hang_floor_s, HANG_FACTOR * self.slowest_chunk_s))
