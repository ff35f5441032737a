"""A small discrete-event engine: processes as generators, events, processor-sharing resources.

A process is a generator that yields :class:`Event` objects and resumes, with the event's
value, when that event fires. :class:`Resource` is a processor-sharing server: a host's
CPU cores, or one accelerator. Each task on it has an *alone* duration (its time with the
resource to itself) and a *demand* (the cores it keeps busy when alone: 1 for a
single-threaded computation, 0.3 for an env step that sleeps 70% of its time, 2 for a
renderer that spreads over two cores). While the summed demand exceeds the capacity,
every task progresses at ``capacity / demand`` of its alone speed. All tasks on a resource
share one rate, so the resource keeps a virtual clock (the service each task has had)
and a heap of finishing points: an event costs ``O(log n)``.

SimPy has events and processes but no processor-sharing resource, whose rates change
at every arrival and departure; that is most of what this engine is for.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator
from typing import Any


class Event:
  """Something a process can wait for; fires once, with a value."""

  __slots__ = ("sim", "fired", "value", "_waiters")

  def __init__(self, sim: "Sim"):
    self.sim = sim
    self.fired = False
    self.value: Any = None
    self._waiters: list[Callable[[Any], None]] = []

  def succeed(self, value: Any = None) -> "Event":
    """Fires now (its waiters run at the current time, in order)."""
    if not self.fired:
      self.fired, self.value = True, value
      for waiter in self._waiters:
        self.sim.call(0.0, waiter, value)
      self._waiters = []
    return self

  def then(self, fn: Callable[[Any], None]) -> None:
    if self.fired:
      self.sim.call(0.0, fn, self.value)
    else:
      self._waiters.append(fn)


Process = Generator[Event, Any, Any]


class Sim:
  """The clock and the calendar."""

  def __init__(self):
    self.now = 0.0
    self._calendar: list[tuple[float, int, Callable, Any]] = []
    self._seq = itertools.count()
    self.events = 0

  def call(self, delay: float, fn: Callable[[Any], None], value: Any = None) -> None:
    heapq.heappush(self._calendar, (self.now + delay, next(self._seq), fn, value))

  def timeout(self, delay: float) -> Event:
    event = Event(self)
    self.call(max(0.0, delay), event.succeed)
    return event

  def event(self) -> Event:
    return Event(self)

  def any_of(self, *events: Event) -> Event:
    """Fires when the first of ``events`` does."""
    first = Event(self)
    for event in events:
      event.then(first.succeed)
    return first

  def spawn(self, process: Process) -> Event:
    """Starts ``process``; returns the event of its end (its return value)."""
    done = Event(self)

    def resume(value: Any) -> None:
      try:
        event = process.send(value)
      except StopIteration as stop:
        done.succeed(stop.value)
        return
      event.then(resume)

    self.call(0.0, resume, None)
    return done

  def run(self, stop: Callable[[], bool], max_events: int = 50_000_000) -> None:
    """Runs events until ``stop()`` holds, the calendar is empty or ``max_events`` ran.

    Raises:
      RuntimeError: ``max_events`` ran without ``stop()``: a model that cannot progress.
    """
    while self._calendar and not stop():
      self.now, _, fn, value = heapq.heappop(self._calendar)
      fn(value)
      self.events += 1
      if self.events >= max_events:
        raise RuntimeError(f"the simulation ran {max_events} events at t = {self.now:.1f} s "
                           "without finishing")


class Resource:
  """Processor sharing with ``capacity`` (cores; 1 for an accelerator).

  Also keeps the union of its busy time (any task running), for busy fractions.
  """

  def __init__(self, sim: Sim, name: str, capacity: float):
    if capacity <= 0:
      raise ValueError(f"resource {name!r}: capacity must be > 0, got {capacity}")
    self.sim, self.name, self.capacity = sim, name, float(capacity)
    self._virtual = 0.0  # Service (alone-seconds) each task has had so far.
    self._stamp = 0.0  # When _virtual was last brought up to date.
    self._demand = 0.0
    self._heap: list[tuple[float, int, float, Event]] = []  # (finish point, seq, demand, done)
    self._seq = itertools.count()
    self._generation = 0
    self.busy_s = 0.0
    self._busy_since: float | None = None

  @property
  def rate(self) -> float:
    """Alone-seconds of progress per second for each task now."""
    return min(1.0, self.capacity / self._demand) if self._demand > 0 else 1.0

  def run(self, alone_s: float, demand: float = 1.0) -> Event:
    """A task of ``alone_s`` seconds alone, keeping ``demand`` cores busy; fires when done."""
    done = Event(self.sim)
    if alone_s <= 0:
      return done.succeed()
    self._advance()
    if not self._heap:
      self._busy_since = self.sim.now
    heapq.heappush(self._heap, (self._virtual + alone_s, next(self._seq), demand, done))
    self._demand += demand
    self._schedule()
    return done

  def _advance(self) -> None:
    now = self.sim.now
    self._virtual += (now - self._stamp) * self.rate
    self._stamp = now

  def _schedule(self) -> None:
    self._generation += 1
    if not self._heap:
      return
    generation = self._generation
    delay = max(0.0, (self._heap[0][0] - self._virtual) / self.rate)
    self.sim.call(delay, lambda _: self._finish(generation))

  def _finish(self, generation: int) -> None:
    if generation != self._generation:
      return  # Rescheduled since (the rate changed).
    self._advance()
    finished = []
    while self._heap and self._heap[0][0] <= self._virtual + 1e-12:
      _, _, demand, done = heapq.heappop(self._heap)
      self._demand -= demand
      finished.append(done)
    if not self._heap:
      self._demand = 0.0  # (no float residue)
      self.busy_s += self.sim.now - self._busy_since
      self._busy_since = None
    self._schedule()
    for done in finished:
      done.succeed()

  def busy_seconds(self) -> float:
    extra = self.sim.now - self._busy_since if self._busy_since is not None else 0.0
    return self.busy_s + extra
