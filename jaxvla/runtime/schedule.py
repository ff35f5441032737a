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


def _ids(values) -> list[int]:
  """Env ids (any integer array) as JSON integers."""
  return [int(i) for i in values]


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
    rec: dict[str, Any] = dict(n=n)
    if recv is not None:
      rec["recv"] = _ids(recv)
    if act is not None:
      rec["act"] = _ids(act)
    if version is not None:
      rec["v"] = int(version)
    if values:
      rec["values"] = [int(v) for v in values]
    self.write("step", **rec)

  def restart(self, n: int, phase: str, worker: int, why: str, lost, ready) -> None:
    """A worker restart in ``phase`` of step ``n`` (``lost``: env ids whose chunks it
    cut; ``ready``: those whose results had arrived)."""
    self.write("restart", n=n, phase=phase, worker=worker, why=why, lost=_ids(lost),
               ready=_ids(ready))

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
    self.steps: list[dict] = []
    self.updates: list[dict] = []
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
        self.steps.append(rec)
      elif kind == "restart":
        restart = Restart(rec["worker"], rec["why"], rec["lost"], rec["ready"])
        self._restarts[(rec["n"], rec["phase"])].append(restart)
        self.restart_records.append(restart)
      elif kind == "update":
        self.updates.append(rec)
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

  def next_step(self) -> dict:
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

  def next_update(self) -> dict | None:
    """The next update's record, or None past the last one the log holds."""
    if self._next_update >= len(self.updates):
      return None
    rec = self.updates[self._next_update]
    self._next_update += 1
    return rec

  @property
  def updates_left(self) -> int:
    return len(self.updates) - self._next_update


def check_update(recorded: dict, version: int, items: list[int], dropped: list[int],
                 metrics: dict[str, float], path: str) -> None:
  """Raises :class:`ReplayMismatch` naming the first way update ``version`` of the replay
  differs from its record: its items, its drops or a metric (exactly)."""
  where = f"update {version} (policy version {version} -> {version + 1}), {path}"
  if recorded["u"] != version:
    raise ReplayMismatch(f"{where}: the log's update is at version {recorded['u']}")
  for name, want, got in (("items", recorded["items"], items),
                          ("dropped items", recorded.get("dropped", []), dropped)):
    if list(want) != list(got):
      raise ReplayMismatch(f"{where}: {name} {got} replayed, {list(want)} recorded")
  for name, want in recorded["metrics"].items():
    got = metrics.get(name)
    if not same_float(want, got):
      raise ReplayMismatch(f"{where}: {name} = {got!r} replayed, {want!r} recorded")


def same_float(a, b) -> bool:
  """Exact equality of two metric values (NaN equals NaN; None only None)."""
  if a is None or b is None:
    return a is b
  a, b = float(a), float(b)
  return a == b or (a != a and b != b)  # NaN equals NaN here.


def plain_metrics(metrics: dict) -> dict[str, float]:
  """The learner's metrics as exact JSON floats (Python floats round-trip exactly)."""
  return {k: float(v) for k, v in sorted(metrics.items())}


# Keys a replay may set differently from its recorded run: where it runs and what
# it writes besides the run itself.
REPLAY_FREE_KEYS = ("replay", "resume", "log", "pipeline.schedule_log", "pipeline.timeline")


def _flat(tree: dict) -> dict[str, Any]:
  """``{"a": {"b": x}}`` -> ``{"a.b": x}`` (a config as its dotted keys)."""
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: not isinstance(x, dict))
  return {".".join(str(k.key) for k in path): value for path, value in leaves}


def config_differences(recorded: dict, now: dict) -> list[str]:
  """``config.KEY: recorded -> now`` for every key a replay must not change."""
  free = lambda k: any(k == f or k.startswith(f + ".") for f in REPLAY_FREE_KEYS)
  a, b = _flat(recorded), _flat(now)
  return [f"config.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
          if not free(k) and a.get(k) != b.get(k)]


def platform() -> dict[str, str]:
  """What decides a program's floating-point results besides its inputs: the JAX and
  XLA build, ``XLA_FLAGS`` and the device kind (a session header's ``platform``)."""
  return dict(jax=jax.__version__, jaxlib=jaxlib.__version__,
              xla_flags=os.environ.get("XLA_FLAGS", ""),
              device=f"{jax.default_backend()}: {jax.devices()[0].device_kind}")


def platform_differences(recorded: dict, now: dict) -> list[str]:
  """``name: recorded -> now`` for every part of :func:`platform` that differs."""
  return [f"{k}: {recorded.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(recorded) | set(now))
          if recorded.get(k) != now.get(k)]


def replay_session(original: str, workdir: str, resume: bool) -> int:
  """The iteration of the recorded session a replay in ``workdir`` runs next.

  A fresh replay runs the recorded run's first session; a resumed one
  (``config.resume``) the first recorded session after those ``workdir`` has replayed.

  Raises:
    FileNotFoundError / ValueError: no log to replay, or none left (named).
  """
  recorded = sessions(original)
  if not recorded and os.path.isdir(directory(original)) and any(
      "-process-" in name for name in os.listdir(directory(original))):
    raise ValueError(f"config.replay={original!r} is a multi-process run's (one schedule "
                     "log per process): it cannot be replayed, only read")
  if not recorded:
    raise FileNotFoundError(f"config.replay={original!r} holds no schedule log "
                            f"({directory(original)}/session-*.jsonl): the run was made "
                            "with pipeline.schedule_log=False, or is not a run's workdir")
  if not resume:
    return recorded[0]
  done = sessions(workdir)
  left = [s for s in recorded if not done or s > done[-1]]
  if not left:
    raise ValueError(f"every recorded session of {original} (at iterations {recorded}) is "
                     f"replayed in {workdir} already")
  return left[0]
