"""The versioned, bounded, staleness-checked trajectory queue between rollout and learner.

Every :class:`Item` carries the policy versions of its chunks. The learner at
version ``u`` takes items with :meth:`TrajectoryQueue.get`; an item whose oldest
chunk was produced by version ``v < u - max_staleness`` is dropped there and
counted (items, chunks and env steps), never trained on and never dropped
silently. Producers block in :meth:`TrajectoryQueue.put` while the queue is full.

Staleness is kept in bounds one of two ways (``pipeline.staleness_control``):

* ``drop``: rollout runs freely ahead; too-old items are dropped at ``get``.
* ``pace``: :class:`Pacer` makes the rollout wait before *starting* a segment
  that would be consumed more than ``max_staleness`` versions after the version
  it starts with (segments started ``< (v + k + 1) * segments_per_update``, the
  rule of bounded-staleness systems). Items still pass the ``get`` check: under
  first-ready batching a straggler env can finish its segment after segments
  started later, so a paced run can still drop a few; the run reports them.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

import numpy as np


class Closed(Exception):
  """The queue (or pacer) was closed while a caller waited on it."""


@dataclasses.dataclass
class Item:
  """One unit of rollout data.

  Attributes:
    data: the payload (a ``Trajectory [T, M]`` of ``M`` env segments).
    versions: ``[...]`` int policy version of every chunk in ``data``.
    num_chunks: chunks in the item (``T * M``).
    num_env_steps: env steps the chunks executed.
    created: ``time.perf_counter()`` when it was made.
  """
  data: Any
  versions: np.ndarray
  num_chunks: int
  num_env_steps: int
  created: float = dataclasses.field(default_factory=time.perf_counter)

  @property
  def oldest_version(self) -> int:
    return int(np.min(self.versions))


@dataclasses.dataclass
class QueueStats:
  """Running totals of a :class:`TrajectoryQueue`."""
  put_items: int = 0
  got_items: int = 0
  dropped_items: int = 0
  dropped_chunks: int = 0
  dropped_env_steps: int = 0
  put_wait_s: float = 0.0  # Producers blocked on a full queue.
  get_wait_s: float = 0.0  # The learner waiting for data.
  max_depth: int = 0


class TrajectoryQueue:
  """Bounded FIFO of :class:`Item` with a staleness check on the way out.

  Args:
    capacity: items it holds at most (``put`` blocks beyond).
    max_staleness: ``k``: an item is trained on by learner version ``u`` only if
      ``u - oldest_version <= k``; ``k < 0`` disables the check.
  """

  def __init__(self, capacity: int, max_staleness: int):
    if capacity < 1:
      raise ValueError(f"trajectory queue capacity must be >= 1, got {capacity}")
    self.capacity, self.max_staleness = capacity, max_staleness
    self._items: collections.deque[Item] = collections.deque()
    self._cond = threading.Condition()
    self._closed = False
    self.stats = QueueStats()

  def __len__(self) -> int:
    with self._cond:
      return len(self._items)

  def put(self, item: Item, timeout: float | None = None) -> None:
    """Appends ``item``, blocking while the queue is full.

    Raises:
      Closed: the queue was closed (before or while waiting).
      TimeoutError: still full after ``timeout`` seconds.
    """
    t0 = time.perf_counter()
    with self._cond:
      ok = self._cond.wait_for(lambda: self._closed or len(self._items) < self.capacity, timeout)
      self.stats.put_wait_s += time.perf_counter() - t0
      if self._closed:
        raise Closed("trajectory queue closed")
      if not ok:
        raise TimeoutError(f"trajectory queue full ({self.capacity} items) for {timeout} s")
      self._items.append(item)
      self.stats.put_items += 1
      self.stats.max_depth = max(self.stats.max_depth, len(self._items))
      self._cond.notify_all()

  def get(self, learner_version: int, timeout: float | None = None) -> tuple[Item, int]:
    """The oldest fresh-enough item and its staleness (``learner_version - oldest``).

    Items staler than ``max_staleness`` are dropped here and counted in ``stats``.

    Raises:
      Closed: the queue was closed and is empty.
      TimeoutError: nothing fresh arrived within ``timeout`` seconds.
    """
    t0 = time.perf_counter()
    deadline = None if timeout is None else t0 + timeout
    with self._cond:
      try:
        while True:
          while self._items:
            item = self._items.popleft()
            self._cond.notify_all()
            staleness = learner_version - item.oldest_version
            if 0 <= self.max_staleness < staleness:
              self.stats.dropped_items += 1
              self.stats.dropped_chunks += item.num_chunks
              self.stats.dropped_env_steps += item.num_env_steps
              continue
            self.stats.got_items += 1
            return item, staleness
          if self._closed:
            raise Closed("trajectory queue closed")
          remaining = None if deadline is None else deadline - time.perf_counter()
          if remaining is not None and remaining <= 0:
            raise TimeoutError(f"no trajectory arrived within {timeout} s")
          self._cond.wait(remaining)
      finally:
        self.stats.get_wait_s += time.perf_counter() - t0

  def snapshot(self) -> list[Item]:
    """The queued items (not removed)."""
    with self._cond:
      return list(self._items)

  def drain(self) -> list[Item]:
    """Removes and returns every queued item (for shutdown accounting)."""
    with self._cond:
      items = list(self._items)
      self._items.clear()
      self._cond.notify_all()
      return items

  def close(self) -> None:
    """Wakes every waiter; later ``put`` raises, ``get`` raises once empty."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def summary(self) -> dict[str, float]:
    """Depth and totals for the metrics."""
    with self._cond:
      return dict(queue_depth=float(len(self._items)),
                  **{f"queue_{k}": float(v) for k, v in dataclasses.asdict(self.stats).items()})


class Pacer:
  """``staleness_control='pace'``: the rollout waits before starting a segment
  that would be trained on more than ``max_staleness`` versions after its own.

  Segment ``s`` (counted from the run's start) is consumed by update
  ``s // segments_per_update`` in FIFO order, so starting it with version ``v``
  is allowed while ``s < (v + max_staleness + 1) * segments_per_update``.

  Args:
    segments_per_update: env segments one learner update consumes.
    max_staleness: ``k >= 0``.
    started: segments already started (resume: the consumed count).
  """

  def __init__(self, segments_per_update: int, max_staleness: int, started: int = 0):
    if max_staleness < 0:
      raise ValueError(f"pacing needs max_staleness >= 0, got {max_staleness}")
    self.segments_per_update, self.max_staleness = segments_per_update, max_staleness
    self.started = started
    self._version = 0
    self._cond = threading.Condition()
    self._closed = False
    self.wait_s = 0.0

  def set_version(self, version: int) -> None:
    """The newest policy version the rollout can act with (from the broadcast)."""
    with self._cond:
      self._version = max(self._version, version)
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
    t0 = time.perf_counter()
    with self._cond:
      self._version = max(self._version, version)
      self._cond.wait_for(lambda: self._closed
                          or self.started + count <= self.limit(self._version))
      self.wait_s += time.perf_counter() - t0
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
    t0 = time.perf_counter()
    with self._cond:
      self._version = max(self._version, version)
      available = lambda: self.limit(self._version) - self.started
      if block and count:
        self._cond.wait_for(lambda: self._closed or available() > 0)
      self.wait_s += time.perf_counter() - t0
      if self._closed:
        raise Closed("pacer closed")
      granted = max(0, min(count, available()))
      self.started += granted
      return granted, self._version

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()
