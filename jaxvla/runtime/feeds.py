"""The learner's feeds: where :class:`jaxvla.runtime.pipeline.Pipeline`'s learner takes
its queue items from.

With L1 (``pipeline.train_async``) on, a rollout thread fills the queue while the learner
trains (:class:`ThreadFeed`); with it off, the learner's own thread steps the rollout until
the next item is ready (:class:`InlineFeed`). Both hand the rollout's finished items to the
queue the same way (:func:`hand_on`), and keep the items a closed queue refused (still in
flight, for the ledger).
"""

from __future__ import annotations

import logging
import threading

from jaxvla import types
from jaxvla.rollout import rollout as rollout_lib
from jaxvla.runtime import queue as queue_lib

log = logging.getLogger(__name__)


def hand_on(rollout: rollout_lib.Rollout, queue: queue_lib.TrajectoryQueue,
             refused: list[types.Item]) -> None:
  """Moves the rollout's finished items into the queue (blocking while it is full).

  Items a closed queue refuses go to ``refused``: still in flight, for the ledger.

  Raises:
    Closed: the queue was closed.
  """
  items = rollout.pop_items()
  for k, item in enumerate(items):
    try:
      queue.put(item)
    except types.Closed:
      refused.extend(items[k:])
      raise


class InlineFeed:
  """L1 off: the learner's thread steps the rollout until an item is ready, then trains."""

  def __init__(self, rollout: rollout_lib.Rollout, queue: queue_lib.TrajectoryQueue):
    self.rollout, self.queue = rollout, queue
    self.refused: list[types.Item] = []  # Items a closed queue did not take.

  def start(self) -> None:
    pass

  def get(self, version: int) -> tuple[types.Item, int]:
    """The next fresh-enough item (raises ``Closed`` once the run is stopping)."""
    while True:
      try:  # Nothing is too stale here unless first-ready segments straddle updates.
        return self.queue.get(version, timeout=0.0)
      except TimeoutError:
        pass
      self.rollout.step()
      hand_on(self.rollout, self.queue, self.refused)

  def stop(self) -> None:
    pass


class ThreadFeed:
  """L1 on: a rollout thread fills the queue while the learner trains."""

  def __init__(self, rollout: rollout_lib.Rollout, queue: queue_lib.TrajectoryQueue):
    self.rollout, self.queue = rollout, queue
    self.refused: list[types.Item] = []  # Items a closed queue did not take.
    self.error: BaseException | None = None
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="rollout", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        self.rollout.step()
        hand_on(self.rollout, self.queue, self.refused)
    except types.Closed:  # The queue closed, or a replay's log has no more steps.
      self.queue.close()  # (the learner takes what is queued, then stops)
    except BaseException as e:  # Re-raised by the learner (with this traceback).
      self.error = e
      self.queue.close()

  def get(self, version: int) -> tuple[types.Item, int]:
    """The next fresh-enough item (raises ``Closed`` once the run is stopping)."""
    return self.queue.get(version)

  def stop(self) -> None:
    """Ends the thread (the caller closed the queue and the pacer first)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=60.0)
      if self._thread.is_alive():
        log.error("the rollout thread did not stop within 60 s")
      self._thread = None
