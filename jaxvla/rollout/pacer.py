"""Bounded staleness by pacing: the rollout waits before starting a segment the
learner would consume too late (``pipeline.staleness_control='pace'``).

Segment ``s`` (counted from the run's start) is consumed by update
``s // segments_per_update`` in FIFO order, so starting it with policy version
``v`` is allowed while ``s < (v + max_staleness + 1) * segments_per_update``, the
rule of bounded-staleness systems. The learner's new versions arrive through
:meth:`Pacer.set_version` (called when a weight broadcast lands).

A segment the queue drops as too stale (a first-ready straggler overtaken by
segments started after it) is never consumed: every segment after it is consumed
one place sooner than its start count says. :meth:`Pacer.release` gives its start
back. Without that, each drop would narrow the bound by one segment for the rest of
the run (an env parked at every update), and at most ``(max_staleness + 1) *
segments_per_update`` drops would leave no start to grant while the learner waits for
data: a stalled run.
"""

from __future__ import annotations

import threading

from jaxvla.types import Closed


class Pacer:
  """Grants segment starts while they stay within ``max_staleness`` of the version.

  Args:
    segments_per_update: env segments one learner update consumes.
    max_staleness: ``k >= 0``.
    version: the policy version the run starts at (a resume: the checkpoint's);
      the segments of its ``version`` updates count as consumed.
  """

  def __init__(self, segments_per_update: int, max_staleness: int, version: int = 0):
    if max_staleness < 0:
      raise ValueError(f"pacing needs max_staleness >= 0, got {max_staleness}")
    self.segments_per_update, self.max_staleness = segments_per_update, max_staleness
    self.started = version * segments_per_update
    self._version = version
    self._cond = threading.Condition()
    self._closed = False

  def set_version(self, version: int) -> None:
    """The newest policy version the rollout can act with (from the broadcast)."""
    with self._cond:
      self._version = max(self._version, version)
      self._cond.notify_all()

  def release(self, count: int) -> None:
    """Gives back the starts of ``count`` segments that will never be consumed (the
    queue dropped them as too stale)."""
    if count < 0:
      raise ValueError(f"release needs count >= 0, got {count}")
    with self._cond:
      self.started -= count
      self._cond.notify_all()

  def limit(self, version: int) -> int:
    return (version + self.max_staleness + 1) * self.segments_per_update

  def start(self, count: int, version: int) -> int:
    """Blocks until ``count`` new segments may start; returns the version to use.

    The rollout should act with the returned version (the newest known; it may
    have advanced while waiting).

    Raises:
      Closed: the run is stopping.
    """
    with self._cond:
      self._version = max(self._version, version)
      self._cond.wait_for(lambda: self._closed
                          or self.started + count <= self.limit(self._version))
      if self._closed:
        raise Closed("pacer closed")
      self.started += count
      return self._version

  def acquire(self, count: int, version: int, block: bool) -> tuple[int, int]:
    """Grants up to ``count`` segment starts now; returns ``(granted, version)``.

    First-ready rollouts use this instead of :meth:`start`: envs that may not
    start yet wait (parked) while the others keep stepping, so the segments the
    learner waits for are never held up behind a refused start. ``block``: wait
    until at least one start is granted (only safe when nothing is in flight).

    Raises:
      Closed: the run is stopping.
    """
    with self._cond:
      self._version = max(self._version, version)
      available = lambda: self.limit(self._version) - self.started
      if block and count:
        self._cond.wait_for(lambda: self._closed or available() > 0)
      if self._closed:
        raise Closed("pacer closed")
      granted = max(0, min(count, available()))
      self.started += granted
      return granted, self._version

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()
