"""What a pipeline measures, read together: one record per update window and one per run.

:class:`Meters` reads the pipeline's instruments (its :class:`jaxvla.timing.StageClock`
of stage busy intervals and wait counters, the staleness histogram of the data trained
on), the trajectory queue's and the weight broadcast's counters, the env pool's worker
seconds and fault counters, and the rollout's recent episodes. It owns the window state:
the env workers' busy seconds at each update (:class:`jaxvla.timing.Marks`) and where the
current window began, so ``train.py`` logs each update's window and the run's totals
without the pipeline assembling them.
"""

from __future__ import annotations

from typing import Any

from jaxvla import timing
from jaxvla.envs import protocol
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.runtime import queue as queue_lib


class Meters:
  """The measurements of one pipeline.

  Args:
    clock: the pipeline's stage clock.
    env: the rollout env batch (worker figures only for an ``AsyncVecEnv``, the pool).
    queue: the trajectory queue.
    server: the weight broadcast (a :class:`jaxvla.runtime.broadcast.ParamServer`), or
      None when the rollout acts with the learner's params.
    episodes: the rollout's recent finished episodes.
  """

  def __init__(self, clock: timing.StageClock, env: protocol.VecEnv,
               queue: queue_lib.TrajectoryQueue, server: Any,
               episodes: evaluate_lib.EpisodeTracker):
    self.clock, self.env, self.queue, self.server = clock, env, queue, server
    self.episodes = episodes
    self.staleness = timing.Histogram()  # Versions between the acting and the training one.
    self._workers = (timing.Marks(env.num_workers)
                     if isinstance(env, protocol.AsyncVecEnv) else None)
    self._window_start = 0.0  # Clock time of the last window() call.

  def mark_update(self) -> None:
    """Notes the env pool's worker-busy seconds at this update (for windowed fractions)."""
    if self._workers is not None:
      self._workers.add(self.clock.elapsed(), self.env.stats.worker_busy_s)

  def workers_busy(self, since: float = 0.0, until: float | None = None) -> float | None:
    """Fraction of the env workers' time spent stepping from the last update at or
    before clock time ``since`` to the last at or before ``until`` (default: until
    now); None without an env pool.

    The ``env`` stage's busy fraction says when *some* env was stepping; this says
    how much of the workers' capacity was used (first-ready batching keeps it high).
    """
    if self._workers is None:
      return None
    return self._workers.fraction(since, until,
                                  now=(self.clock.elapsed(), self.env.stats.worker_busy_s))

  def record(self, since: float | None = None) -> dict[str, float]:
    """Everything measured, in one record.

    Stage busy fractions (over the run, or since clock time ``since``), the
    rollout's wait counters, the env workers' utilisation and fault counters,
    staleness, queue and broadcast counters, and the rollout's recent episodes
    (training success).
    """
    out = dict(self.clock.fractions() if since is None else self.clock.window(since))
    out.update(self.clock.counters())
    workers = self.workers_busy(since or 0.0)
    if workers is not None:
      out["env_workers_busy"] = workers
      stats = self.env.stats  # Fault counters since the start of this process.
      out.update(env_restarts=float(stats.restarts), env_hangs=float(stats.hung),
                 episodes_lost_to_faults=float(stats.truncated_by_fault))
    out.update(self.staleness.summary("staleness"))
    out.update(self.queue.summary())
    if self.server is not None:
      out["broadcast_skipped_versions"] = float(self.server.skipped_versions)
    out.update(self.episodes.summary())
    return out

  def window(self) -> dict[str, float]:
    """:meth:`record` since the previous call (the first: since the start)."""
    out = self.record(since=self._window_start)
    self._window_start = self.clock.elapsed()
    return out
