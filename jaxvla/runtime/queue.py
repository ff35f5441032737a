"""The versioned, bounded, staleness-checked trajectory queue between rollout and learner.

Every :class:`Item` carries the policy versions of its chunks. The learner at
version ``u`` takes items with :meth:`TrajectoryQueue.get`; an item whose oldest
chunk was produced by version ``v < u - max_staleness`` is dropped there and
counted (items, chunks and env steps), never trained on and never dropped
silently. Producers block in :meth:`TrajectoryQueue.put` while the queue is full.

Staleness is kept in bounds one of two ways (``pipeline.staleness_control``):

* ``drop``: rollout runs freely ahead; too-old items are dropped at ``get``.
* ``pace``: :class:`jaxvla.rollout.pacer.Pacer` makes the rollout wait before
  *starting* a segment that would be consumed more than ``max_staleness``
  versions after the version it starts with. Items still pass the ``get`` check:
  under first-ready batching a straggler env can finish its segment after
  segments started later, so a paced run can still drop a few; the run reports them,
  and each dropped segment's start is given back to the pacer (``on_drop``).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

from jaxvla.types import Closed, Item


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
    on_drop: called with each item dropped as too stale, as it is dropped (the
      queue's lock held: it must not call back into the queue).
  """

  def __init__(self, capacity: int, max_staleness: int,
               on_drop: Callable[[Item], None] | None = None):
    if capacity < 1:
      raise ValueError(f"trajectory queue capacity must be >= 1, got {capacity}")
    self.capacity, self.max_staleness = capacity, max_staleness
    self._on_drop = on_drop
    self._items: collections.deque[Item] = collections.deque()
    self._cond = threading.Condition()
    self._closed = False
    self.stats = QueueStats()
    self._dropped_seqs: list[int] = []  # Items dropped since take_dropped() (Item.seq).

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
              self._dropped_seqs.append(item.seq)
              if self._on_drop is not None:
                self._on_drop(item)
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

  def take_dropped(self) -> list[int]:
    """The sequence numbers (:attr:`Item.seq`) of the items dropped since the last call."""
    with self._cond:
      out, self._dropped_seqs = self._dropped_seqs, []
      return out

  def snapshot(self) -> list[Item]:
    """The queued items (not removed)."""
    with self._cond:
      return list(self._items)

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
