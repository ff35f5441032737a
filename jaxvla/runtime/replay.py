"""Replay: a recorded session's schedule log decides what timing decided, and every
difference from it raises ``ReplayMismatch`` at the first step or update it shows in.

This module owns every replay check. :class:`ReplaySchedule` is the pipeline's schedule
when ``config.replay`` is set (:class:`jaxvla.runtime.schedule.LiveSchedule` otherwise):

* the rollout follows the log through :class:`ReplayedSteps`: it receives exactly the
  recorded envs (the pool's ``recv_ids``), acts on the recorded ones with the recorded
  versions, restarts workers where the recorded run's restarted, and has no pacer;
* the broadcast keeps every version the log says the rollout acted with;
* each update's items, drops and metrics are checked against its record
  (:func:`check_update`), and a learner and a rollout thread that wait for each other
  (the replay departed from the log) are named instead of hanging;
* the pipeline stops after the last recorded update (``ended``).

Before any of that, :func:`check_request` and :func:`open_session` refuse what cannot be
replayed: several processes, the replay's own workdir, another config or platform.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

import jax
import numpy as np

from jaxvla import types
from jaxvla.envs import protocol
from jaxvla.errors import ReplayMismatch
from jaxvla.rollout import steps as steps_lib
from jaxvla.runtime import schedule as schedule_lib

log = logging.getLogger(__name__)

# Keys a replay may set differently from its recorded run: where it runs and what
# it writes besides the run itself.
REPLAY_FREE_KEYS = ("replay", "resume", "log", "pipeline.schedule_log", "pipeline.timeline")


class ReplayedSteps:
  """The rollout's :class:`jaxvla.rollout.steps.StepSchedule` that follows a session's log.

  Args:
    session: the recorded session.
    params_at: ``version -> (params, version)``: the params of a recorded version
      (waited for while the learner has not made it yet).
    published: ``() -> version`` the learner published last.
    threaded: whether the rollout has its own thread (otherwise a version the learner
      has not made yet can never come: the learner's thread would wait for itself).
  """

  def __init__(self, session: schedule_lib.Session,
               params_at: Callable[[int], tuple[Any, int]], published: Callable[[], int],
               threaded: bool):
    self.session, self.params_at = session, params_at
    self.published, self.threaded = published, threaded
    self.waits_for: int | None = None  # The version the rollout waits for, if it does.
    self._env: protocol.VecEnv | None = None
    self.n = 0  # The rollout step being replayed.
    self._want: schedule_lib.StepRecord | None = None
    self._values_done = 0
    self._received = False

  def attach(self, env: protocol.VecEnv) -> None:
    self._env = env
    if isinstance(env, protocol.ReplayableEnv):
      env.set_restart_listener(self._on_restart)

  def _on_restart(self, worker: int, why: str, in_flight: list[int], ready: list[int]
                  ) -> None:
    raise ReplayMismatch(f"rollout step {self.n}: env worker {worker} {why} in the "
                         "replay, where the recorded run's did not; replayed up to here")

  def _restarts(self, phase: str) -> None:
    """The worker restarts the recorded run had in ``phase`` of this step."""
    for r in self.session.restarts(self.n, phase):
      self._env.replay_restart(r.worker, r.why, r.lost, r.ready)

  def begin(self, n: int) -> None:
    if not self.session.has_step():  # The recorded rollout stopped here (its run ended).
      raise types.Closed(f"the schedule log {self.session.path} has no rollout step {n}")
    self.n, self._want = n, self.session.next_step()
    self._values_done, self._received = 0, False

  def end(self, n: int) -> None:
    want = self._want
    if self._values_done != len(want.values):
      raise ReplayMismatch(f"rollout step {n}: {self._values_done} value calls replayed, "
                           f"{len(want.values)} recorded")
    if want.recv is not None and not self._received:
      raise ReplayMismatch(f"rollout step {n}: no env was in flight, but the log receives "
                           "in this step")

  def params(self, for_values: bool) -> tuple[Any, int]:
    want = self._want
    if for_values:
      if self._values_done >= len(want.values):
        raise ReplayMismatch(f"rollout step {self.n}: a value call the log does not record")
      version = want.values[self._values_done]
      self._values_done += 1
    else:
      if want.version is None:
        raise ReplayMismatch(f"rollout step {self.n}: acts where the recorded run did not")
      version = want.version
    if not self.threaded and version > self.published():
      raise ReplayMismatch(f"rollout step {self.n}: the log acts with version {version}, "
                           f"the learner is at {self.published()}")
    self.waits_for = version
    try:
      params, got = self.params_at(version)
    finally:
      self.waits_for = None
    if got != version:
      raise ReplayMismatch(f"rollout step {self.n}: the rollout acts with version {got}, "
                           f"the log with {version}")
    return params, got

  def admit(self, env_ids: np.ndarray, pace: steps_lib.PaceFn) -> tuple[np.ndarray, None]:
    """The rows the recorded step acted on (every one where it names none); the pacer
    is not asked (the log says which envs started when)."""
    del pace
    want = self._want
    if want.act is None:
      rows = np.arange(len(env_ids)) if want.version is not None else np.zeros((0,), np.int64)
      return rows, None
    row = {int(e): k for k, e in enumerate(env_ids)}
    missing = [e for e in want.act if e not in row]
    if missing:
      raise ReplayMismatch(f"rollout step {self.n}: the log acts on env ids {missing}, "
                           f"which are not ready here (ready: {sorted(row)})")
    return np.array(sorted(row[e] for e in want.act), np.int64), None

  def reset(self, env: protocol.VecEnv, seed: int) -> protocol.Observation:
    obs = env.reset(seed)
    self._restarts("reset")
    return obs

  def step_chunk(self, env: protocol.VecEnv, actions: np.ndarray) -> protocol.ChunkStep:
    if not isinstance(env, protocol.ReplayableEnv):  # In-process envs: nothing to time.
      return env.step_chunk(actions)
    ids = np.arange(env.num_envs)
    env.send(actions, ids)  # (as a pool's step_chunk does, with the restarts in between)
    self._restarts("step")
    return env.recv_ids(ids)[1]

  def send(self, env: protocol.AsyncVecEnv, actions: np.ndarray, env_ids: np.ndarray) -> None:
    env.send(actions, env_ids)
    self._restarts("send")

  def recv(self, env: protocol.AsyncVecEnv, b_max: int, t_max_s: float
           ) -> tuple[np.ndarray, protocol.ChunkStep]:
    """The recorded batch: its restarts first, then exactly its envs."""
    del b_max, t_max_s
    if self._want.recv is None:
      raise ReplayMismatch(f"rollout step {self.n}: envs in flight, but the log does not "
                           "receive in this step")
    self._received = True
    self._restarts("recv")
    return env.recv_ids(np.asarray(self._want.recv, np.int64))


class ReplaySchedule:
  """The pipeline's schedule for a replay of ``session`` (the module docstring).

  Args:
    session: the recorded session to follow.
    recorder: the replay's own log (a replay records as a live run does), or None.
  """

  pace = False
  keep_versions = True

  def __init__(self, session: schedule_lib.Session,
               recorder: schedule_lib.Recorder | None = None):
    self.session = session
    self.live = schedule_lib.LiveSchedule(recorder)  # (its own log, written alike)
    self.ended = False  # The log has no more updates: the recorded session ended here.
    self._steps: ReplayedSteps | None = None
    self._published: Callable[[], int] = lambda: 0
    self._want: schedule_lib.UpdateRecord | None = None
    self._taken: list[int] = []
    self._dropped: list[int] = []

  def steps(self, params_fn: steps_lib.ParamsFn, params_at: Callable[[int], tuple[Any, int]],
            published: Callable[[], int], threaded: bool) -> ReplayedSteps:
    del params_fn
    self._published = published
    self._steps = ReplayedSteps(self.session, params_at, published, threaded)
    return self._steps

  def begin_update(self, version: int) -> bool:
    self._want = self.session.next_update()
    if self._want is None:
      self.ended = True
      return False
    self._taken, self._dropped = [], []
    return True

  def get(self, feed: Any, queue: Any, version: int) -> types.Item:
    """The next item; with a rollout thread, each waiting for the other (the replay has
    departed from its log) raises instead of hanging."""
    if not self._steps.threaded:
      return feed.get(version)[0]
    while True:
      try:
        return queue.get(version, timeout=0.5)[0]
      except TimeoutError:
        waits = self._steps.waits_for
        if waits is not None and waits > self._published():
          try:  # (unless an item arrived just before the rollout began to wait)
            return queue.get(version, timeout=0.0)[0]
          except TimeoutError:
            self._dropped += queue.take_dropped()
            self._check_drops(version)  # (the likelier cause, named if it is one)
            raise ReplayMismatch(
                f"update {version}: the learner waits for an item while the rollout, at "
                f"step {self._steps.n}, waits for version {waits}: the replay "
                f"has departed from its log (items taken {self._taken}, dropped "
                f"{self._dropped})") from None

  def took(self, version: int, item: types.Item, dropped: list[int]) -> None:
    """The item just taken, and the drops before it, are the recorded ones."""
    self.live.took(version, item, dropped)
    self._dropped += dropped
    self._taken.append(item.seq)
    self._check_drops(version)
    k = len(self._taken) - 1
    want = self._want.items
    if k >= len(want) or want[k] != item.seq:
      raise ReplayMismatch(f"update {version}: took item {item.seq} (its oldest version "
                           f"{item.oldest_version}), the recorded update took "
                           f"{list(want[k:k + 1]) or 'no more'} there")

  def _check_drops(self, version: int) -> None:
    recorded = list(self._want.dropped)
    if self._dropped != recorded[:len(self._dropped)]:
      raise ReplayMismatch(f"update {version}: dropped items {self._dropped} as too stale, "
                           f"the recorded update dropped {recorded}")

  def out_of_data(self, version: int) -> None:
    raise ReplayMismatch(f"update {version}: the learner needs more data than the recorded "
                         f"rollout made ({len(self.session.steps)} steps in "
                         f"{self.session.path})")

  def finish_update(self, version: int, items: list[int], metrics: dict) -> None:
    plain = schedule_lib.plain_metrics(metrics)
    check_update(self._want, schedule_lib.UpdateRecord(
        u=version, items=tuple(items), dropped=tuple(self._dropped), metrics=plain),
                 self.session.path)
    self.live.finish_update(version, items, metrics)

  def note(self, kind: str, **fields: Any) -> None:
    self.live.note(kind, **fields)


def check_update(recorded: schedule_lib.UpdateRecord, replayed: schedule_lib.UpdateRecord,
                 path: str) -> None:
  """Raises :class:`ReplayMismatch` naming the first way the ``replayed`` update differs
  from its record: its version, its items, its drops or a metric (exactly)."""
  version = replayed.u
  where = f"update {version} (policy version {version} -> {version + 1}), {path}"
  if recorded.u != version:
    raise ReplayMismatch(f"{where}: the log's update is at version {recorded.u}")
  for name, want, got in (("items", recorded.items, replayed.items),
                          ("dropped items", recorded.dropped, replayed.dropped)):
    if list(want) != list(got):
      raise ReplayMismatch(f"{where}: {name} {list(got)} replayed, {list(want)} recorded")
  for name, want in recorded.metrics.items():
    got = replayed.metrics.get(name)
    if not schedule_lib.same_float(want, got):
      raise ReplayMismatch(f"{where}: {name} = {got!r} replayed, {want!r} recorded")


# ------------------------------------------------------------ before a replay --
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


def platform_differences(recorded: dict, now: dict) -> list[str]:
  """``name: recorded -> now`` for every part of :func:`schedule.platform` that differs."""
  return [f"{k}: {recorded.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(recorded) | set(now))
          if recorded.get(k) != now.get(k)]


def replay_session(original: str, workdir: str, resume: bool) -> int:
  """The iteration of the recorded session a replay in ``workdir`` runs next.

  A fresh replay runs the recorded run's first session; a resumed one
  (``config.resume``) the first recorded session after those ``workdir`` has replayed.

  Raises:
    FileNotFoundError / ValueError: no log to replay, or none left (named).
  """
  recorded = schedule_lib.sessions(original)
  directory = schedule_lib.directory(original)
  if not recorded and os.path.isdir(directory) and any(
      "-process-" in name for name in os.listdir(directory)):
    raise ValueError(f"config.replay={original!r} is a multi-process run's (one schedule "
                     "log per process): it cannot be replayed, only read")
  if not recorded:
    raise FileNotFoundError(f"config.replay={original!r} holds no schedule log "
                            f"({directory}/session-*.jsonl): the run was made "
                            "with pipeline.schedule_log=False, or is not a run's workdir")
  if not resume:
    return recorded[0]
  done = schedule_lib.sessions(workdir)
  left = [s for s in recorded if not done or s > done[-1]]
  if not left:
    raise ValueError(f"every recorded session of {original} (at iterations {recorded}) is "
                     f"replayed in {workdir} already")
  return left[0]


def check_request(config: Any, workdir: str) -> int:
  """What ``config.replay`` asks is possible; returns the recorded session's iteration.

  Raises:
    ValueError / FileNotFoundError: naming what stands in the way (several processes,
      the replay's own workdir, a config that differs from the recorded one, no log).
  """
  if jax.process_count() > 1:
    raise ValueError("config.replay: a multi-process run cannot be replayed (each process "
                     "records its own schedule log, to read; replay follows one process)")
  if os.path.abspath(config.replay) == os.path.abspath(workdir):
    raise ValueError(f"config.replay={config.replay!r} is the --workdir: replay into "
                     "another workdir (the recorded run's is read, never written)")
  path = os.path.join(config.replay, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"config.replay: {path} is missing (not a run's workdir?)")
  with open(path, encoding="utf-8") as f:
    recorded = json.load(f)
  diffs = config_differences(recorded, json.loads(config.to_json_best_effort()))
  if diffs:
    raise ValueError(f"config.replay: a replay runs the recorded config ({path}), and this "
                     f"one differs: {'; '.join(diffs)}")
  return replay_session(config.replay, workdir, config.resume)


def open_session(original: str, iteration: int, version: int, seed: int
                 ) -> schedule_lib.Session:
  """The recorded session of ``original`` that started at ``iteration``, checked to start
  where the replay does (policy ``version``, env ``seed``) on the same platform."""
  session = schedule_lib.Session(schedule_lib.session_path(original, iteration))
  header = session.header
  changed = platform_differences(header.get("platform", {}), schedule_lib.platform())
  if changed:
    raise ValueError(f"config.replay: {session.path} was recorded on another platform "
                     f"({'; '.join(changed)}); a replay repeats a run bit for bit only with "
                     "the same JAX and XLA build, XLA_FLAGS and device kind")
  if (header["version"], header["seed"]) != (version, seed):
    raise ReplayMismatch(f"{session.path}: the recorded session starts at policy version "
                         f"{header['version']} with env seed {header['seed']}, the replay at "
                         f"{version} with {seed}")
  log.info("replaying %s (%d updates, %d rollout steps%s)", session.path,
           len(session.updates), len(session.steps),
           "" if session.end else "; the recorded run was cut short after them")
  return session
