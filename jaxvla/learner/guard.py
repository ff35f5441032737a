"""The divergence guard: when non-finite updates stop a run.

Owns the host-side reading of the ``nonfinite`` metric that every guarded step reports
(its bits: :data:`jaxvla.learner.update.NONFINITE_PARTS`): :func:`describe_nonfinite`
names them, and :class:`DivergenceGuard` counts the updates that had any and decides
when the run stops. The device side (a non-finite step is not applied) is
:func:`jaxvla.learner.update.guarded_step`'s.
"""

from __future__ import annotations

import logging

from jaxvla.learner import update as update_lib

log = logging.getLogger(__name__)


def describe_nonfinite(code: float) -> str:
  """``nonfinite`` metric -> e.g. ``'loss, gradient norm'``."""
  return ", ".join(name for bit, name in update_lib.NONFINITE_PARTS
                   if int(code) & bit) or "nothing"


class DivergenceGuard:
  """Counts updates with a non-finite step; stops the run after ``max_bad`` in a row
  (``config.rl.max_bad_updates``), or at once when the params themselves went
  non-finite.

  A step whose loss or gradient norm is not finite is not applied, nor is any later
  step of the same RL update (``update.keep_unless``): the steps before it stand. Params
  that are not finite after finite losses and gradients (bit 4: an overflow or a
  non-finite step size) cannot be taken back, since the guard keeps no second copy of
  the train state, so that stops the run with the checkpoints intact
  (``train._save`` never writes non-finite params).

  Args:
    max_bad: >= 1.
    what: names the updates in messages (``'RL update'``, ``'BC step'``).
  """

  def __init__(self, max_bad: int, what: str):
    if max_bad < 1:
      raise ValueError(f"max_bad must be >= 1, got {max_bad}")
    self.max_bad, self.what = max_bad, what
    self.in_a_row = 0
    self.total = 0

  def check(self, nonfinite: float, index: int) -> None:
    """``nonfinite``: the update's metric; ``index``: its number, for messages.

    Raises:
      FloatingPointError: ``max_bad`` non-finite updates in a row, or non-finite params.
    """
    if not nonfinite:
      self.in_a_row = 0
      return
    self.in_a_row += 1
    self.total += 1
    parts = describe_nonfinite(nonfinite)
    if int(nonfinite) & 4:
      raise FloatingPointError(
          f"{self.what} {index}: non-finite {parts}; the params are not finite, the run "
          "stops (the checkpoints hold the last finite ones). Lower the learning rate")
    if self.in_a_row >= self.max_bad:
      raise FloatingPointError(
          f"{self.what} {index}: non-finite {parts}; {self.in_a_row} in a row, the run stops "
          "(its params stay those of the last finite step, which the checkpoints hold). "
          "Lower the learning rate or check the data; config.rl.max_bad_updates sets how "
          "many in a row are tolerated")
    log.warning("%s %d: non-finite %s; not applied from that step on (%d in a row; the run "
                "stops at %d)", self.what, index, parts, self.in_a_row, self.max_bad)
