"""The schedule log: what timing decided in a run, written as it goes, and read to replay it.

An asynchronous run's data depend on timing: which envs were in each first-ready
batch, which policy version acted on them, which queue items each update took and
which it dropped as too stale, where a worker restart cut an env's chunk. Everything
else (the envs' episodes, the sampler's keys, the learner's arithmetic) follows from
the config and the seed. So a log of those decisions is enough to run the same
computation again: :class:`Recorder` writes it, :class:`Session` reads it back and
the pipeline follows it (``config.replay``).

One file per session (a run's start or resume) and process:
``<workdir>/schedule/session-<iteration>.jsonl`` (``...-process-<i>.jsonl`` with
several processes), one JSON object per line, appended and flushed as the run goes
(a run killed mid-line leaves a torn last line, which the reader drops). Kinds
(``"k"``):

* ``session``: the header: ``iteration``, ``version`` (policy version), ``env_steps``,
  ``seed`` (the env reset seed), ``mode``, ``process``, ``platform`` (:func:`platform`:
  a replay is exact only on the same XLA build, flags and device kind) and ``format``.
* ``step``: one rollout step (one inference batch), in order. ``recv``: env ids
  received, in order (first-ready only; lockstep receives every env). ``act``: env ids
  acted on, if not every env the step held (ids the pacer parked are left out).
  ``v``: the policy version acted with (absent when nothing was acted on).
  ``values``: versions of the step's value calls (GAE bootstraps), if any.
* ``restart``: an env worker restart during step ``n``, in its ``phase`` (``recv``,
  ``send``, ``step`` or ``reset``): ``worker``, ``why``, and its env ids whose chunks it
  lost (``lost``: in flight) or whose results had arrived (``ready``).
* ``update``: one learner update: ``u`` (its policy version before it), ``items`` (the
  queue items it trained on, by their sequence numbers, in order), ``dropped`` (items
  dropped as too stale while it waited) and ``metrics`` (the learner's, exact).
* ``save``: a checkpoint written at ``iteration``.
* ``end``: the session ended (``reason``: ``budget`` or ``interrupted``). A log without
  one was cut short (the process was killed).

Nothing derivable is written: an item's contents, the envs' resets (``(seed, env,
episode)`` fixes each) and the keys (counted from the seed) are not.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from typing import Any

import jax
import jaxlib

from jaxvla.errors import ReplayMismatch
from jaxvla.rollout import steps as steps_lib
from jaxvla.storage import jsonl

FORMAT = 1
KINDS = ("session", "step", "restart", "update", "save", "end")


def directory(workdir: str) -> str:
  return os.path.join(workdir, "schedule")


def session_path(workdir: str, iteration: int, process: int = 0,
                 num_processes: int = 1) -> str:
  """The log of the session that started at ``iteration``."""
  suffix = f"-process-{process}" if num_processes > 1 else ""
  return os.path.join(directory(workdir), f"session-{iteration}{suffix}.jsonl")


def sessions(workdir: str) -> list[int]:
  """The iterations at which ``workdir``'s run started a session (single-process logs)."""
  try:
    names = os.listdir(directory(workdir))
  except FileNotFoundError:
    return []
  out = []
  for name in names:
    stem = name[len("session-"):-len(".jsonl")] if (
        name.startswith("session-") and name.endswith(".jsonl")) else ""
    if stem.isdigit():
      out.append(int(stem))
  return sorted(out)


def _ids(values) -> tuple[int, ...]:
  """Env ids (any integer array) as JSON integers."""
  return tuple(int(i) for i in values)


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One rollout step (a ``step`` line; see the module docstring for the fields)."""
  n: int
  recv: tuple[int, ...] | None = None  # First-ready only.
  act: tuple[int, ...] | None = None  # Only when the step held some envs back.
  version: int | None = None  # ``v``: None when nothing was acted on.
  values: tuple[int, ...] = ()

  @classmethod
  def from_json(cls, rec: dict) -> "StepRecord":
    opt = lambda key: None if key not in rec else _ids(rec[key])
    return cls(n=int(rec["n"]), recv=opt("recv"), act=opt("act"),
               version=None if "v" not in rec else int(rec["v"]),
               values=_ids(rec.get("values", ())))

  def to_json(self) -> dict[str, Any]:
    rec: dict[str, Any] = dict(n=self.n)
    if self.recv is not None:
      rec["recv"] = list(self.recv)
    if self.act is not None:
      rec["act"] = list(self.act)
    if self.version is not None:
      rec["v"] = self.version
    if self.values:
      rec["values"] = list(self.values)
    return rec


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
  """One learner update (an ``update`` line): ``u`` its policy version before it, the
  queue items it trained on and those it dropped as too stale (``Item.seq``), and its
  metrics (exact)."""
  u: int
  items: tuple[int, ...]
  dropped: tuple[int, ...] = ()
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_json(cls, rec: dict) -> "UpdateRecord":
    return cls(u=int(rec["u"]), items=_ids(rec["items"]), dropped=_ids(rec.get("dropped", ())),
               metrics=dict(rec["metrics"]))

  def to_json(self) -> dict[str, Any]:
    return dict(u=self.u, items=list(self.items), dropped=list(self.dropped),
                metrics=self.metrics)


class Recorder:
  """Appends a session's log (thread-safe: the rollout and learner threads both write).

  Args:
    path: the session's file (created with its directory; an existing one is
      replaced: a session that restarts at the same iteration replaces the log of
      the one that did not get past it).
    header: the ``session`` record's fields.
  """

  def __init__(self, path: str, **header: Any):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    self.path = path
    self._lock = threading.Lock()
    self._file = open(path, "w", encoding="utf-8", buffering=1)  # Line-buffered.
    self.write("session", format=FORMAT, **header)

  def write(self, kind: str, **fields: Any) -> None:
    line = json.dumps(dict(k=kind, **fields), separators=(",", ":"))
    with self._lock:
      if self._file is not None:
        self._file.write(line + "\n")

  def step(self, n: int, recv=None, act=None, version: int | None = None,
           values: list[int] | None = None) -> None:
    """Step ``n``'s record (``act``: only when the rollout held some envs back)."""
    self.write("step", **StepRecord(
        n=n, recv=None if recv is None else _ids(recv), act=None if act is None else _ids(act),
        version=None if version is None else int(version), values=_ids(values or ())).to_json())

  def update(self, record: UpdateRecord) -> None:
    self.write("update", **record.to_json())

  def restart(self, n: int, phase: str, worker: int, why: str, lost, ready) -> None:
    """A worker restart in ``phase`` of step ``n`` (``lost``: env ids whose chunks it
    cut; ``ready``: those whose results had arrived)."""
    self.write("restart", n=n, phase=phase, worker=worker, why=why, lost=list(_ids(lost)),
               ready=list(_ids(ready)))

  def close(self) -> None:
    with self._lock:
      if self._file is not None:
        self._file.close()
        self._file = None


@dataclasses.dataclass(frozen=True)
class Restart:
  """One recorded worker restart (see the module docstring)."""
  worker: int
  why: str
  lost: list[int]
  ready: list[int]


class Session:
  """One session's log, read back for a replay.

  The rollout thread takes :meth:`next_step` and :meth:`restarts` in order, the
  learner thread :meth:`next_update`; each side keeps its own place.

  Raises:
    FileNotFoundError / ValueError: naming the file, for a missing log or a bad line.
  """

  def __init__(self, path: str):
    self.path = path
    self.steps: list[StepRecord] = []
    self.updates: list[UpdateRecord] = []
    self.saves: set[int] = set()
    self.end: str | None = None
    self.restart_records: list[Restart] = []  # Every restart, in order.
    self._restarts: dict[tuple[int, str], list[Restart]] = collections.defaultdict(list)
    records = jsonl.read(path)  # (without a torn last line: the run may be killed mid-line)
    if not records or records[0].get("k") != "session":
      raise ValueError(f"{path}: no session header on its first line")
    self.header = records[0]
    if self.header.get("format") != FORMAT:
      raise ValueError(f"{path}: schedule log format {self.header.get('format')!r}, this "
                       f"jaxvla reads format {FORMAT}")
    for number, rec in enumerate(records[1:], 2):
      kind = rec.get("k")
      if kind == "step":
        if rec.get("n") != len(self.steps):
          raise ValueError(f"{path}, line {number}: step {rec.get('n')} where step "
                           f"{len(self.steps)} was due")
        self.steps.append(StepRecord.from_json(rec))
      elif kind == "restart":
        restart = Restart(rec["worker"], rec["why"], rec["lost"], rec["ready"])
        self._restarts[(rec["n"], rec["phase"])].append(restart)
        self.restart_records.append(restart)
      elif kind == "update":
        self.updates.append(UpdateRecord.from_json(rec))
      elif kind == "save":
        self.saves.add(int(rec["iteration"]))
      elif kind == "end":
        self.end = rec["reason"]
      else:
        raise ValueError(f"{path}, line {number}: unknown record kind {kind!r} "
                         f"(one of {KINDS})")
    self._next_step = 0
    self._next_update = 0

  @property
  def iteration(self) -> int:
    return int(self.header["iteration"])

  def next_step(self) -> StepRecord:
    """The next rollout step's record.

    Raises:
      ReplayMismatch: the log has no more steps (the replay asks for more than
        the recorded run made: it differs from it).
    """
    if self._next_step >= len(self.steps):
      raise ReplayMismatch(f"rollout step {self._next_step}: the log ({self.path}) has "
                           f"only {len(self.steps)} steps")
    rec = self.steps[self._next_step]
    self._next_step += 1
    return rec

  def has_step(self) -> bool:
    """Whether the log holds another rollout step (the recorded run made it)."""
    return self._next_step < len(self.steps)

  def restarts(self, step: int, phase: str) -> list[Restart]:
    """The worker restarts recorded in ``phase`` of rollout step ``step``."""
    return self._restarts.get((step, phase), [])

  def next_update(self) -> UpdateRecord | None:
    """The next update's record, or None past the last one the log holds."""
    if self._next_update >= len(self.updates):
      return None
    rec = self.updates[self._next_update]
    self._next_update += 1
    return rec

  @property
  def updates_left(self) -> int:
    return len(self.updates) - self._next_update


def same_float(a, b) -> bool:
  """Exact equality of two metric values (NaN equals NaN; None only None)."""
  if a is None or b is None:
    return a is b
  a, b = float(a), float(b)
  return a == b or (a != a and b != b)  # NaN equals NaN here.


def plain_metrics(metrics: dict) -> dict[str, float]:
  """The learner's metrics as exact JSON floats (Python floats round-trip exactly)."""
  return {k: float(v) for k, v in sorted(metrics.items())}


def platform() -> dict[str, str]:
  """What decides a program's floating-point results besides its inputs: the JAX and
  XLA build, ``XLA_FLAGS`` and the device kind (a session header's ``platform``)."""
  return dict(jax=jax.__version__, jaxlib=jaxlib.__version__,
              xla_flags=os.environ.get("XLA_FLAGS", ""),
              device=f"{jax.default_backend()}: {jax.devices()[0].device_kind}")


class LiveSchedule:
  """A live run's schedule: timing decides, and with a :class:`Recorder` the log is written.

  The pipeline asks its schedule (this, or :class:`jaxvla.runtime.replay.ReplaySchedule`)
  for the rollout's :class:`jaxvla.rollout.steps.StepSchedule` and tells it what each
  update took, dropped and computed; it never asks whether it is replaying.
  """

  pace = True  # The pacer may hold envs back (a replay's log says which it held).
  keep_versions = False  # The broadcast keeps only the newest params.
  ended = False  # (a replay's log can end before the budget; a live run's never does)

  def __init__(self, recorder: Recorder | None = None):
    self.recorder = recorder
    self._dropped: list[int] = []  # Items dropped as too stale in the update in progress.

  def steps(self, params_fn: steps_lib.ParamsFn, params_at: Any, published: Any,
            threaded: bool) -> steps_lib.StepSchedule:
    """The rollout's step schedule (``params_at``, ``published`` and ``threaded``: what a
    replay needs to follow its log; unused here)."""
    del params_at, published, threaded
    return steps_lib.LiveSteps(params_fn, self.recorder)

  def begin_update(self, version: int) -> bool:
    """Whether update ``version`` runs (always, live)."""
    del version
    return True

  def get(self, feed: Any, queue: Any, version: int) -> Any:
    """The next queue item for update ``version`` (from the pipeline's feed)."""
    del queue
    return feed.get(version)[0]

  def took(self, version: int, item: Any, dropped: list[int]) -> None:
    """Update ``version`` took ``item``; ``dropped``: items dropped as too stale before it."""
    del version, item
    self._dropped += dropped

  def out_of_data(self, version: int) -> None:
    """The feed closed while update ``version`` waited for data (the caller re-raises)."""
    del version

  def finish_update(self, version: int, items: list[int], metrics: dict) -> None:
    """Update ``version`` trained on ``items`` (``Item.seq``) with ``metrics``."""
    dropped, self._dropped = self._dropped, []
    if self.recorder is not None:
      self.recorder.update(UpdateRecord(u=version, items=tuple(items), dropped=tuple(dropped),
                                        metrics=plain_metrics(metrics)))

  def note(self, kind: str, **fields: Any) -> None:
    """A ``save`` or ``end`` record, if there is a log."""
    if self.recorder is not None:
      self.recorder.write(kind, **fields)
