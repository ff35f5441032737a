"""Progress where a run is logged: lines at a steady pace when no terminal shows a bar.

A leaf module (logging, sys and time only), so that every phase, the data collector's
included, can report through it: :mod:`jaxvla.metrics`'s bar asks it whether a terminal shows.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger(__name__)


def on_terminal() -> bool:
  """Whether stderr is a terminal: the progress bar's place; elsewhere (a log file under
  SLURM, a pod or ``nohup``) progress goes to the log as :class:`PhaseLog` lines."""
  return sys.stderr.isatty()


class PhaseLog:
  """A phase's progress as log lines at a steady pace (``log.progress_every_s``), for runs
  whose output goes to a file (SLURM, a pod, ``nohup``), where no bar is drawn.

  ``tick(step, **fields)`` logs ``<phase>: step S/T (P%), k=v ..., R steps/s, ~L s left``
  when ``every_s`` seconds have passed since the last line (and at the last step).
  """

  def __init__(self, phase: str, total: int, every_s: float, clock=time.monotonic,
               initial: int = 0):
    self.phase, self.total, self.every_s, self._clock = phase, total, every_s, clock
    self._start = self._last = clock()
    self._initial = initial  # (a resumed phase: the rate counts this session's steps)
    self.done = initial  # The last step ticked.

  def tick(self, step: int, **fields: float) -> bool:
    """Logs a line if one is due; returns whether it did."""
    now, self.done = self._clock(), step
    if self.every_s <= 0 or (now - self._last < self.every_s and step < self.total):
      return False
    self._last = now
    rate = (step - self._initial) / max(now - self._start, 1e-9)
    left = max(self.total - step, 0) / rate if rate > 0 else float("inf")
    shown = "".join(f", {k} {v:.4g}" for k, v in fields.items())
    log.info("%s: step %d/%d (%.0f%%)%s, %.3g steps/s, ~%.0f s left", self.phase, step,
             self.total, 100.0 * step / max(self.total, 1), shown, rate, left)
    return True

