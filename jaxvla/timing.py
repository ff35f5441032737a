"""Pipeline instrumentation: stage busy time, free-form counters, the staleness histogram.

A leaf module: it imports nothing from jaxvla, so every component (rollout,
learner, broadcast, benchmarks) can record into one clock without importing the
others.

:class:`StageClock` records when each named stage of the pipeline (``env``,
``inference``, ``learner``, ``broadcast``) is busy, from any thread. Idle is not
recorded; it is derived (``idle = 1 - busy``), so waiting is never mistaken for
work. A stage's busy time is the *union* of its intervals: two env workers
stepping at once keep the ``env`` stage busy once, and a fraction never exceeds 1.
Besides the stages, the clock holds free-form *counters* (:meth:`StageClock.count`,
:meth:`StageClock.timed`): summed seconds of waits, compiles and the like, so that
components keep no timing dicts of their own.

:class:`Histogram` counts small non-negative integers (policy-version staleness
of the chunks the learner trains on). :class:`Marks` samples a cumulative busy counter
(the env workers' stepping seconds) at marks on the timeline, for busy fractions over
windows between marks.

Every :meth:`StageClock.busy` and :meth:`StageClock.timed` block is also a ``jax.profiler.TraceAnnotation``
named :data:`TRACE_PREFIX` + the stage or counter, so a profiler trace shows the stages beside
the XLA programs (``python -m jaxvla.bench.trace_summary`` reads them back).

The timeline record is saved with :meth:`StageClock.to_json`; plot it with
:mod:`jaxvla.plot_timeline`::

  python -m jaxvla.plot_timeline --intervals=WORKDIR/timeline.json --out=timeline.png

Times: the recording API (:meth:`StageClock.busy`, :meth:`StageClock.add`)
takes readings of the clock (``time.perf_counter`` by default). The query API
(``now``, ``since``, :meth:`StageClock.intervals`, the JSON file, the plot) uses
positions on the run's timeline: seconds since :meth:`StageClock.start`, as
:meth:`StageClock.elapsed` returns them.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np

Interval = tuple[float, float]

# Name prefix of the pipeline's spans in a jax.profiler trace.
TRACE_PREFIX = "jaxvla/"

# The union of a stage keeps at least this many disjoint busy pieces for window()
# even when the timeline record is small or off (keep_intervals=0).
_MIN_UNION_PIECES = 4096
# Histogram keys: one per value below this, then one "ge" bucket.
_HIST_CAP = 16


class _Union:
  """The union of one stage's busy intervals: an exact total and the newest pieces.

  ``starts``/``ends`` are the sorted, disjoint (non-touching) pieces of the
  union. When there are more than ``cap`` of them the oldest are *folded*: they
  leave the lists but stay in ``total``, and ``horizon`` (the end of the newest
  folded piece) moves forward. An interval inserted later is clipped to start
  at ``horizon``: the folded part of the timeline is no longer known piece by
  piece, so time before it can no longer be added without risking counting it
  twice.
  """

  def __init__(self, cap: int):
    self.cap = cap
    self.starts: list[float] = []
    self.ends: list[float] = []
    self.total = 0.0
    self.horizon = -math.inf

  def insert(self, start: float, end: float) -> None:
    start = max(start, self.horizon)
    if end <= start:
      return
    starts, ends = self.starts, self.ends
    i = bisect.bisect_left(ends, start)  # First piece that ends at or after ``start``.
    j = bisect.bisect_right(starts, end, lo=i)  # Pieces i..j-1 overlap or touch it.
    if i == j:
      starts.insert(i, start)
      ends.insert(i, end)
      self.total += end - start
      return
    merged_start, merged_end = min(start, starts[i]), max(end, ends[j - 1])
    covered = sum(ends[k] - starts[k] for k in range(i, j))
    starts[i:j] = [merged_start]
    ends[i:j] = [merged_end]
    self.total += (merged_end - merged_start) - covered

  def fold(self, keep_from: float) -> None:
    """Folds the oldest pieces (never one ending after ``keep_from``) if over ``cap``."""
    if len(self.starts) <= self.cap:
      return
    # Fold down to cap / 2 so that folding is amortised over many inserts.
    k = min(len(self.starts) - self.cap // 2, bisect.bisect_right(self.ends, keep_from))
    if k <= 0:
      return
    self.horizon = self.ends[k - 1]
    del self.starts[:k]
    del self.ends[:k]

  def covered(self, lo: float, hi: float) -> float:
    """Length of the kept pieces inside ``[lo, hi)``."""
    out = 0.0
    k = bisect.bisect_right(self.ends, lo)
    while k < len(self.starts) and self.starts[k] < hi:
      out += min(self.ends[k], hi) - max(self.starts[k], lo)
      k += 1
    return out


class StageClock:
  """Thread-safe recorder of the busy intervals of named pipeline stages.

  Call :meth:`start` when the run starts, then record from any thread with
  ``with clock.busy("learner"): ...`` or, for an interval measured elsewhere,
  :meth:`add`. A stage's busy time is the union of its intervals, so
  overlapping intervals of one stage (several env workers) count once.

  Counters are summed values under free-form names (not the stages), e.g.
  ``with clock.timed("pace_wait_s"): ...`` or ``clock.count("dropped", 1)``;
  unlike the stages they need no :meth:`start`, and overlapping ``timed``
  blocks of one name add up (they are totals, not a union).

  Exactness: busy totals (:meth:`busy_seconds`, :meth:`fractions`) are exact
  for the whole run. The timeline record (:meth:`intervals`, :meth:`to_json`)
  keeps only the newest ``keep_intervals`` intervals per stage; dropping older
  ones from it never changes the totals. To stay bounded in memory the union
  itself keeps only its newest disjoint pieces (at least
  ``max(keep_intervals, 4096) / 2`` per stage, never one that an open
  :meth:`busy` block might still overlap), so:

  * :meth:`window` is exact when ``since`` lies in that kept part, which holds
    for per-iteration windows; busy time older than it counts as idle;
  * an :meth:`add` interval is exact unless it starts before that kept part
    (recorded that late, its older part is clipped off). :meth:`busy` blocks
    are always exact.

  Args:
    stages: the stage names, e.g. ``("env", "inference", "learner", "broadcast")``.
    keep_intervals: intervals per stage kept for the timeline record.
    clock: returns the current time in seconds; injectable for tests.
  """

  def __init__(self, stages: Sequence[str], keep_intervals: int = 100_000,
               clock: Callable[[], float] = time.perf_counter):
    if isinstance(stages, str):
      raise TypeError(f"stages must be a sequence of names, got the string {stages!r}")
    if len(set(stages)) != len(stages):
      raise ValueError(f"duplicate stage names in {list(stages)}")
    if keep_intervals < 0:
      raise ValueError(f"keep_intervals must be >= 0, got {keep_intervals}")
    self.stages = tuple(stages)
    self.keep_intervals = keep_intervals
    self._clock = clock
    self._lock = threading.Lock()
    self._tokens = itertools.count()
    # Open busy() blocks: stage -> {token: start}. Kept across start() calls.
    self._open: dict[str, dict[int, float]] = {s: {} for s in self.stages}
    self._t0: float | None = None
    self._reset_records()

  def _reset_records(self) -> None:
    cap = max(self.keep_intervals, _MIN_UNION_PIECES)
    self._union = {s: _Union(cap) for s in self.stages}
    self._timeline = {s: collections.deque(maxlen=self.keep_intervals) for s in self.stages}
    self._recorded = {s: 0 for s in self.stages}
    self._counters: dict[str, float] = {}

  # --------------------------------------------------------------- recording --
  def start(self) -> None:
    """Marks the start of the run (t0) and clears everything recorded before, counters too."""
    with self._lock:
      self._t0 = self._clock()
      self._reset_records()

  def _check(self, stage: str) -> None:
    if stage not in self._union:
      raise ValueError(f"unknown stage {stage!r}; the known stages are {list(self.stages)}")
    if self._t0 is None:
      raise RuntimeError("StageClock.start() was not called")

  @contextlib.contextmanager
  def busy(self, stage: str) -> Iterator[None]:
    """Records the block's run time ``[enter, exit)`` as busy time of ``stage``.

    Raises:
      ValueError: ``stage`` is not one of the clock's stages.
      RuntimeError: :meth:`start` was not called.
    """
    token = next(self._tokens)
    with self._lock:
      self._check(stage)
      # Read inside the lock: the union never folds past an open block's start.
      self._open[stage][token] = self._clock()
    try:
      with jax.profiler.TraceAnnotation(TRACE_PREFIX + stage):
        yield
    finally:
      end = self._clock()
      with self._lock:
        start = self._open[stage].pop(token)
        self._record(stage, start, end)

  def add(self, stage: str, start: float, end: float) -> None:
    """Records ``[start, end)`` (clock readings, not timeline positions) for ``stage``.

    Raises:
      ValueError: unknown ``stage``, or ``end < start``.
      RuntimeError: :meth:`start` was not called.
    """
    if end < start:
      raise ValueError(f"interval of stage {stage!r} ends before it starts: [{start}, {end})")
    with self._lock:
      self._check(stage)
      self._record(stage, start, end)

  def count(self, name: str, value: float) -> None:
    """Adds ``value`` to counter ``name`` (created at 0 on first use); any thread."""
    with self._lock:
      self._counters[name] = self._counters.get(name, 0.0) + float(value)

  @contextlib.contextmanager
  def timed(self, name: str) -> Iterator[None]:
    """Adds the block's run time to counter ``name``, in seconds of the clock.

    With the default clock that is ``time.perf_counter`` seconds; counters do
    not need :meth:`start`.

    The time is added even when the block raises: a wait cut short by an error
    was still spent waiting.
    """
    start = self._clock()
    try:
      with jax.profiler.TraceAnnotation(TRACE_PREFIX + name):
        yield
    finally:
      self.count(name, self._clock() - start)

  def _record(self, stage: str, start: float, end: float) -> None:
    """Adds one interval; the caller holds the lock."""
    t0 = self._t0
    self._recorded[stage] += 1
    if end > t0:  # Time before start() belongs to no run.
      self._timeline[stage].append((max(start, t0) - t0, end - t0))
    union = self._union[stage]
    union.insert(max(start, t0), end)
    union.fold(min(self._open[stage].values(), default=math.inf))

  # ----------------------------------------------------------------- queries --
  def elapsed(self, now: float | None = None) -> float:
    """Seconds since :meth:`start` (``now`` is a clock reading; default: the clock)."""
    t0 = self._started()
    return (self._clock() if now is None else now) - t0

  def _started(self) -> float:
    if self._t0 is None:
      raise RuntimeError("StageClock.start() was not called")
    return self._t0

  def _busy_between(self, stage: str, lo: float, hi: float) -> float:
    """Union busy seconds of ``stage`` in absolute ``[lo, hi)``; open blocks run to ``hi``.

    The caller holds the lock; ``lo >= t0``.
    """
    if hi <= lo:
      return 0.0
    union = self._union[stage]
    if lo <= self._t0:  # The whole run: the exact total, less anything after ``hi``.
      out = union.total - union.covered(hi, math.inf)
    else:
      out = union.covered(lo, hi)
    # Every open block runs until ``hi``: together they cover [earliest start, hi).
    opened = min(self._open[stage].values(), default=math.inf)
    opened = max(opened, lo)
    if opened < hi:
      out += (hi - opened) - union.covered(opened, hi)
    return out

  def _absolute(self, position: float | None) -> float:
    return self._clock() if position is None else self._t0 + position

  def busy_seconds(self, now: float | None = None) -> dict[str, float]:
    """Union busy seconds per stage from :meth:`start` to ``now``.

    Args:
      now: a timeline position (seconds since start); default: the clock.
        Open :meth:`busy` blocks count up to ``now``.
    """
    with self._lock:
      t0 = self._started()
      hi = self._absolute(now)
      return {s: self._busy_between(s, t0, hi) for s in self.stages}

  def fractions(self, now: float | None = None) -> dict[str, float]:
    """``{stage}_busy`` and ``{stage}_idle`` fractions of the time since :meth:`start`.

    Args:
      now: a timeline position (seconds since start); default: the clock.
    """
    return self.window(0.0, now)

  def window(self, since: float, now: float | None = None) -> dict[str, float]:
    """Like :meth:`fractions`, but over the timeline window ``[since, now]``.

    Args:
      since: a timeline position (seconds since start, e.g. an earlier
        :meth:`elapsed`); clipped to 0.
      now: a timeline position; default: the clock.

    Returns:
      ``{stage}_busy`` and ``{stage}_idle`` per stage; for an empty window every
      stage is 0 busy, 1 idle.
    """
    with self._lock:
      t0 = self._started()
      lo, hi = t0 + max(since, 0.0), self._absolute(now)
      out = {}
      for s in self.stages:
        busy = self._busy_between(s, lo, hi) / (hi - lo) if hi > lo else 0.0
        busy = min(max(busy, 0.0), 1.0)  # Only float rounding can leave [0, 1].
        out[f"{s}_busy"], out[f"{s}_idle"] = busy, 1.0 - busy
      return out

  def counters(self) -> dict[str, float]:
    """A copy of the counters: name -> sum since :meth:`start` (or since creation)."""
    with self._lock:
      return dict(self._counters)

  def recorded(self) -> dict[str, int]:
    """Intervals recorded per stage since :meth:`start`, including those the timeline dropped."""
    with self._lock:
      return dict(self._recorded)

  def intervals(self) -> dict[str, list[Interval]]:
    """The timeline record: the newest ``keep_intervals`` intervals per stage.

    Intervals are ``(start, end)`` timeline positions (seconds since start),
    sorted by start; open :meth:`busy` blocks are not included.
    """
    with self._lock:
      self._started()
      return {s: sorted(self._timeline[s]) for s in self.stages}

  def to_json(self, path: str) -> None:
    """Writes the timeline record, the exact busy totals and the counters to ``path``.

    The file is replaced atomically (written aside, then renamed).
    """
    with self._lock:
      hi = self._clock()
      t0 = self._started()
      record = dict(
          stages=list(self.stages),
          elapsed_s=hi - t0,
          busy_seconds={s: self._busy_between(s, t0, hi) for s in self.stages},
          recorded=dict(self._recorded),
          counters=dict(self._counters),
          intervals={s: [list(iv) for iv in sorted(self._timeline[s])] for s in self.stages},
      )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(record, f)
    os.replace(tmp, path)

  @staticmethod
  def from_json(path: str) -> dict[str, list[Interval]]:
    """Loads the intervals written by :meth:`to_json` (stage -> ``[(start, end)]``).

    The file's other fields (``elapsed_s``, exact ``busy_seconds``,
    ``recorded``, ``counters``) are plain JSON for whoever needs them.
    """
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
    if not isinstance(record, dict) or "intervals" not in record:
      raise ValueError(f"{path} is not a StageClock timeline (no 'intervals' field)")
    return {s: [(float(a), float(b)) for a, b in ivs] for s, ivs in record["intervals"].items()}


class Histogram:
  """Thread-safe histogram of small non-negative integers (e.g. staleness in versions)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: collections.Counter[int] = collections.Counter()

  def add(self, values: Iterable[int] | np.ndarray,
          count_weights: Iterable[int] | np.ndarray | None = None) -> None:
    """Counts ``values`` (any shape), each ``count_weights`` times (default once).

    Args:
      values: non-negative integers, any shape ``[...]``.
      count_weights: non-negative integers broadcastable to ``values``' shape
        (e.g. env steps per chunk).

    Raises:
      TypeError: non-integer values or weights.
      ValueError: negative values or weights.
    """
    v = np.asarray(values)
    if v.size == 0:
      return
    if not np.issubdtype(v.dtype, np.integer):
      raise TypeError(f"Histogram values must be integers, got dtype {v.dtype}")
    if count_weights is None:
      w = np.ones(v.shape, np.int64)
    else:
      w = np.asarray(count_weights)
      if not np.issubdtype(w.dtype, np.integer):
        raise TypeError(f"Histogram count_weights must be integers, got dtype {w.dtype}")
      w = np.broadcast_to(w, v.shape)
    if v.min() < 0 or w.min() < 0:
      raise ValueError(f"Histogram values and weights must be >= 0, got min value {v.min()}, "
                       f"min weight {w.min()}")
    keys, inverse = np.unique(v.reshape(-1), return_inverse=True)
    sums = np.zeros(len(keys), np.int64)
    np.add.at(sums, inverse.reshape(-1), w.reshape(-1).astype(np.int64))
    with self._lock:
      for key, count in zip(keys.tolist(), sums.tolist()):
        if count:
          self._counts[key] += count

  def counts(self) -> dict[int, int]:
    """Value -> count, sorted by value."""
    with self._lock:
      return dict(sorted(self._counts.items()))

  def reset(self) -> None:
    """Forgets everything counted."""
    with self._lock:
      self._counts.clear()

  def summary(self, prefix: str) -> dict[str, float]:
    """``{prefix}_mean``, ``{prefix}_max`` and the fraction of each value.

    Fractions are ``{prefix}_{v}`` for ``v`` in ``0..min(max, 15)`` and, when
    ``max >= 16``, ``{prefix}_ge16`` for all values from 16 up; mean and max
    use the exact values. Empty when nothing was counted.
    """
    counts = self.counts()
    total = sum(counts.values())
    if not total:
      return {}
    top = max(counts)
    out = {f"{prefix}_mean": sum(v * c for v, c in counts.items()) / total,
           f"{prefix}_max": float(top)}
    for v in range(min(top, _HIST_CAP - 1) + 1):
      out[f"{prefix}_{v}"] = counts.get(v, 0) / total
    if top >= _HIST_CAP:
      out[f"{prefix}_ge{_HIST_CAP}"] = sum(c for v, c in counts.items() if v >= _HIST_CAP) / total
    return out


class Marks:
  """A cumulative busy counter (e.g. the env workers' summed stepping seconds) sampled
  at marks on a clock (e.g. after each update), so its busy fraction can be read over
  any window between two marks.

  Args:
    capacity: how many things the counter sums (the busy fraction of ``capacity``
      workers is busy seconds / (capacity x span)).
  """

  def __init__(self, capacity: int):
    self.capacity = capacity
    self._times, self._busy = [0.0], [0.0]

  def add(self, time: float, busy: float) -> None:
    """The counter read ``busy`` at clock ``time`` (marks come in time order)."""
    self._times.append(time)
    self._busy.append(busy)

  def fraction(self, since: float, until: float | None, now: tuple[float, float]) -> float:
    """The busy fraction from the last mark at or before ``since`` to the last at or
    before ``until`` (None: to ``now``, the clock time and counter read at the call)."""
    start = max(bisect.bisect_right(self._times, since) - 1, 0)
    t0, b0 = self._times[start], self._busy[start]
    if until is None:
      t1, b1 = now
    else:
      end = max(bisect.bisect_right(self._times, until) - 1, start)
      t1, b1 = self._times[end], self._busy[end]
    span = t1 - t0
    return (b1 - b0) / (self.capacity * span) if span > 0 else 0.0
