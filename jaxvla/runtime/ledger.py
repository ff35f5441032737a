"""The ledger of rollout data: where every env step the rollout produced went.

An env step (and the chunk it belongs to) is *produced* when its chunk's result
reaches the rollout (steps a worker executed but never returned, because it died
or the run stopped, were never produced). From then on it is exactly one of:

* **trained** on by an update;
* **dropped** by the trajectory queue as too stale (counted there);
* **discarded** by a resume: in flight when the checkpoint the run resumed from
  was written (the killed process's later work is not part of the run's history);
* **in flight**: being collected, queued, or handed between threads.

:class:`Ledger` keeps the first four totals for a run's whole history (across
resumes, summed over processes); it is stored in every checkpoint, and in flight
is what is left: ``produced - trained - dropped - discarded``. At the end of a run
the pipeline counts what really is in flight (its builder, queue and hand-offs)
and the difference from the ledger's figure is ``unaccounted``: 0 when nothing
was lost or counted twice (``tests/test_checkpoint.py`` checks it through worker
kills, a hung worker and a killed and resumed main process).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Units the ledger counts; every total below is kept per unit.
UNITS = ("env_steps", "chunks")
FATES = ("produced", "trained", "dropped", "discarded")


@dataclasses.dataclass
class Ledger:
  """Totals of rollout data by fate, ``<fate>_<unit>`` (a run's whole history)."""
  produced_env_steps: int = 0
  produced_chunks: int = 0
  trained_env_steps: int = 0
  trained_chunks: int = 0
  dropped_env_steps: int = 0
  dropped_chunks: int = 0
  discarded_env_steps: int = 0
  discarded_chunks: int = 0

  def in_flight(self, unit: str) -> int:
    """Produced, and neither trained on, dropped nor discarded (yet)."""
    return (getattr(self, f"produced_{unit}") - getattr(self, f"trained_{unit}")
            - getattr(self, f"dropped_{unit}") - getattr(self, f"discarded_{unit}"))

  def add(self, deltas: "Ledger") -> None:
    """Adds ``deltas`` field by field (one update's counts, summed over processes)."""
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + int(getattr(deltas, f.name)))

  def minus(self, other: "Ledger") -> "Ledger":
    """Field-by-field difference (what happened since ``other``)."""
    return Ledger(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                     for f in dataclasses.fields(self)})

  def resumed(self) -> "Ledger":
    """The ledger a resume continues from this checkpointed one: what was in flight
    when it was written is discarded (the resumed run collects afresh)."""
    out = Ledger(**dataclasses.asdict(self))
    for unit in UNITS:
      setattr(out, f"discarded_{unit}", getattr(self, f"discarded_{unit}") + self.in_flight(unit))
    return out

  def to_array(self) -> np.ndarray:
    """``int64 [8]`` in field order (for a sum over processes)."""
    return np.asarray([getattr(self, f.name) for f in dataclasses.fields(self)], np.int64)

  @classmethod
  def from_array(cls, values) -> "Ledger":
    return cls(*(int(v) for v in values))

  @classmethod
  def from_meta(cls, meta: dict | None) -> "Ledger":
    """From a checkpoint's JSON (``{}`` or None: an empty ledger).

    Raises:
      ValueError: an unknown field (named).
    """
    meta = dict(meta or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(meta) - names)
    if unknown:
      raise ValueError(f"checkpoint ledger has unknown fields {unknown}")
    return cls(**{k: int(v) for k, v in meta.items()})

  def report(self, in_flight_counted: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """Per unit: every fate, ``in_flight`` and, given what was really counted in
    flight at the end, ``in_flight_counted`` and ``unaccounted`` (must be 0)."""
    out = {}
    for unit in UNITS:
      row = {fate: getattr(self, f"{fate}_{unit}") for fate in FATES}
      row["in_flight"] = self.in_flight(unit)
      if in_flight_counted is not None:
        row["in_flight_counted"] = int(in_flight_counted[unit])
        row["unaccounted"] = row["in_flight"] - row["in_flight_counted"]
      out[unit] = row
    return out
