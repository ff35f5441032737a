"""The RL phase in every pipeline mode: who runs the rollout, when, and with which params.

``config.pipeline.mode``:

* ``sync_colocated``: one set of devices; collect a full batch with the current
  params (every env lockstep, ``rollout_len`` chunks), train on it, repeat.
* ``sync_disaggregated``: the same lockstep, but the rollout acts with its own
  copy of the params on the rollout devices, refreshed by a (waited-for) weight
  broadcast after every update.
* ``async`` with three independent switches:

  - L1 ``train_async``: the rollout runs in its own thread, feeding the
    :class:`TrajectoryQueue` while the learner trains; params reach it through
    the asynchronous :class:`ParamServer` broadcast.
  - L2 ``rollout_async``: first-ready env batching over the env pool
    (``recv(b_max, t_max)``) instead of lockstep.
  - L3 ``streamer``: the learner computes the gradient of each micro-batch
    (``micro_batch_segments`` env segments) as soon as it is dequeued and applies
    one optimizer update per minibatch from the summed gradients.

  With every switch off, ``async`` is the synchronous baseline again (with the
  broadcast path), so each switch's gain is one run each.

Data path (one direction): env pool -> :class:`jaxvla.rollout.rollout.Rollout`
(acts, cuts items) -> :class:`jaxvla.runtime.queue.TrajectoryQueue` (staleness
check) -> :class:`jaxvla.learner.learner.Learner` (update) ->
:class:`jaxvla.runtime.broadcast.ParamServer` (new params to the rollout). The
learner takes items from a *feed*: with L1 on, a rollout thread fills the queue
(:class:`_ThreadFeed`); with L1 off, the learner's own thread steps the rollout
until the next item is ready (:class:`_InlineFeed`). Everything else is the same
code in every mode.

Units: a PPO *update* consumes ``num_envs`` env segments of ``rollout_len``
chunks (what one lockstep rollout yields), as ``num_envs / micro_batch_segments``
queue items. A GRPO update (``algorithm='grpo'``) consumes ``num_envs``
whole episodes, one queue item per group of ``env.group_size`` episodes that
started from the same init (:mod:`jaxvla.rollout.groups`). The policy
version is the number of updates; every chunk carries the version that acted,
and the learner at version ``u`` trains on an item only if
``u - oldest chunk version <= max_staleness`` (see :mod:`jaxvla.runtime.queue`).

Instrumentation: one :class:`jaxvla.timing.StageClock` records the stages' busy
intervals and the rollout's waits (counters); :class:`jaxvla.runtime.meters.Meters`
(``Pipeline.meters``) reads it together with the queue, the broadcast, the env pool's
workers and the rollout's recent episodes, per update window and for the run.

Accounting: every env step the rollout produces is trained on, dropped (too
stale), discarded by a resume or still in flight; :class:`jaxvla.runtime.ledger.Ledger`
keeps the totals (summed over processes at each update), and
:meth:`Pipeline.settle` checks them at the end against what is really in flight.

Schedule log and replay (:mod:`jaxvla.runtime.schedule`): with a ``recorder`` the
rollout writes what timing decided at each step and the learner what each update
took and dropped, with its metrics. With a ``replay`` the pipeline follows a
recorded session: the rollout as :class:`jaxvla.rollout.rollout.Rollout` describes,
the broadcast keeping every version the log says the rollout acted with, no pacer
(the log says which envs started when), and each update checked against its record
(items, drops, metrics: the first difference raises ``ReplayMismatch``). It stops
after the last recorded update.

Errors: an exception in the rollout or broadcaster thread stops the run and is
re-raised in the caller with its traceback; KeyboardInterrupt stops the threads
and propagates (``train.py`` saves a checkpoint). Nothing is left running.

Multi-process (``jax.distributed``): every process runs this pipeline over its
own env pool and rollout devices; the learner steps and the weight broadcast are
collectives over every process's learner devices, so every process makes the same
number of updates of the same shape. After each update the processes sum their
env-step counts and stop requests (:func:`jaxvla.parallel.distributed.sum_over_hosts`), so
the budget, the stop and a Ctrl-C on any one process (which then takes effect at
the end of the current update) are decided alike everywhere.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any, Callable, Iterator

import jax
import ml_collections
import numpy as np

from jaxvla import timing, types
from jaxvla.envs import protocol
from jaxvla.errors import ReplayMismatch
from jaxvla.learner import learner as learner_lib
from jaxvla.models import contract
from jaxvla.parallel import distributed
from jaxvla.rollout import groups as groups_lib
from jaxvla.rollout import pacer as pacer_lib
from jaxvla.rollout import rollout as rollout_lib
from jaxvla.rollout import segments as segments_lib
from jaxvla.runtime import broadcast as broadcast_lib
from jaxvla.runtime import ledger as ledger_lib
from jaxvla.runtime import meters as meters_lib
from jaxvla.runtime import queue as queue_lib
from jaxvla.runtime import schedule as schedule_lib

log = logging.getLogger(__name__)

MODES = ("sync_colocated", "sync_disaggregated", "async")
STAGES = rollout_lib.STAGES + ("learner", "broadcast")


@dataclasses.dataclass(frozen=True)
class Levels:
  """Which asynchrony levels are on (all off: a synchronous baseline)."""
  train_async: bool
  rollout_async: bool
  streamer: bool
  separate_params: bool  # The rollout acts with broadcast copies (not the learner's arrays).

  @classmethod
  def from_config(cls, pipeline: ml_collections.ConfigDict) -> "Levels":
    """The levels of ``config.pipeline``; the owner of the ``pipeline.mode`` check.

    Raises:
      ValueError: naming ``config.pipeline.mode`` if it is not one of :data:`MODES`.
    """
    if pipeline.mode not in MODES:
      raise ValueError(f"config.pipeline.mode must be one of {MODES}, got {pipeline.mode!r}")
    on = pipeline.mode == "async"
    return cls(train_async=on and pipeline.train_async,
               rollout_async=on and pipeline.rollout_async,
               streamer=on and pipeline.streamer,
               separate_params=pipeline.mode != "sync_colocated")

  def name(self, mode: str) -> str:
    if mode != "async":
      return mode
    parts = [n for n, on in (("L1", self.train_async), ("L2", self.rollout_async),
                             ("L3", self.streamer)) if on]
    return "async[" + "+".join(parts or ["none"]) + "]"


def make_builder(config: ml_collections.ConfigDict, spec: protocol.EnvSpec
                 ) -> tuple[rollout_lib.Builder, int]:
  """The rollout's builder for ``config.algorithm`` and the items one update takes.

  PPO: segments of ``rollout_len`` chunks, ``pipeline.micro_batch_segments`` per
  item. GRPO: one item per group of ``env.group_size`` whole episodes.
  """
  if config.algorithm == "grpo":
    g = config.env.group_size
    max_chunks = groups_lib.max_chunks_per_episode(spec.max_episode_steps,
                                                     config.model.chunk_len)
    return (groups_lib.EpisodeBuilder(config.num_envs, g, max_chunks,
                                      scale=config.grpo.scale), config.num_envs // g)
  m = config.pipeline.micro_batch_segments
  return (segments_lib.SegmentBuilder(config.num_envs, config.rollout_len, m),
          config.num_envs // m)


@dataclasses.dataclass
class UpdateInfo:
  """What the learner reports after each update (yielded by :meth:`Pipeline.updates`)."""
  state: learner_lib.TrainState
  metrics: dict[str, float]
  env_steps: int  # Env steps of the data this update consumed (all processes).
  dropped_env_steps: int  # ... and of the data dropped as too stale since the last update.


def _hand_on(rollout: rollout_lib.Rollout, queue: queue_lib.TrajectoryQueue,
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


class _InlineFeed:
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
      _hand_on(self.rollout, self.queue, self.refused)

  def stop(self) -> None:
    pass


class _ThreadFeed:
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
        _hand_on(self.rollout, self.queue, self.refused)
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


class Pipeline:
  """Runs the RL phase for one config.

  Args:
    config: the whole config (``pipeline``, ``ppo``, ``num_envs``, ``rollout_len``).
    policy, learner: the policy contract and its :class:`Learner`.
    env: the rollout env batch (an ``AsyncVecEnv`` when L2 is on).
    act_fn, value_fn: jitted training sampler and value function.
    rollout_shardings: where the rollout's params live (a sharding for every
      leaf, or a tree); used unless the mode is ``sync_colocated``.
    rng: the sampler's key; seed: the env reset seed.
    version: the policy version it starts at (a resumed run's; pacing counts from it).
    ledger: the run's history so far (a resumed run's, with the checkpoint's in-flight
      data already discarded: :meth:`Ledger.resumed`).
    recorder: where the schedule log goes (:class:`schedule.Recorder`), or None.
    replay: the recorded session to follow (:class:`schedule.Session`), or None.
  """

  def __init__(self, config: ml_collections.ConfigDict, policy: contract.Policy,
               learner: learner_lib.Learner, env: protocol.VecEnv, act_fn: Callable,
               value_fn: Callable, rollout_shardings: Any, rng: jax.Array, seed: int,
               version: int = 0, ledger: ledger_lib.Ledger | None = None,
               recorder: schedule_lib.Recorder | None = None,
               replay: schedule_lib.Session | None = None):
    p = config.pipeline
    self.recorder, self.replay = recorder, replay
    self.replay_ended = False  # The replay reached the end of its log.
    self.config, self.learner, self.env = config, learner, env
    self.levels = Levels.from_config(p)
    self.mode_name = self.levels.name(p.mode)
    self.clock = timing.StageClock(STAGES)
    self.pacer = None
    if p.staleness_control == "pace" and self.levels.train_async and replay is None:
      # PPO: env segments per update; GRPO: one episode per env per update.
      # A resumed run (at policy ``version``) has consumed ``version`` updates' segments:
      # the staleness bound counts from there, as in an uninterrupted run.
      self.pacer = pacer_lib.Pacer(config.num_envs, p.max_staleness, version=version)
    # A dropped item's segments are never consumed: their starts go back to the pacer.
    on_drop = None if self.pacer is None else (lambda it: self.pacer.release(it.num_segments))
    self.queue = queue_lib.TrajectoryQueue(
        p.queue_items if self.levels.train_async else 1 << 30, p.max_staleness, on_drop=on_drop)
    self.server = None
    self._colocated: tuple[Any, int] | None = None  # sync_colocated: the learner's params.
    if self.levels.separate_params:
      self.server = broadcast_lib.ParamServer(
          rollout_shardings, learner.mesh, on_ready=self._on_broadcast,
          gather=learner.mesh.size > 1, cast=p.rollout_dtype or None,
          keep_versions=replay is not None)
      params_fn, self._server_at = self.server.latest, self.server.at
      params_at = self._replayed_params
    else:
      params_fn, params_at = (lambda: self._colocated), self._colocated_at
    builder, self.items_per_update = make_builder(config, env.spec)
    first_ready = None
    if self.levels.rollout_async:
      first_ready = (p.b_max or max(1, config.num_envs // 2), p.t_max_ms / 1000.0)
    self.rollout = rollout_lib.Rollout(env, policy, act_fn, value_fn, params_fn, builder, rng,
                                       seed, clock=self.clock, pacer=self.pacer,
                                       first_ready=first_ready, min_bucket=p.min_bucket,
                                       recorder=recorder, replay=replay,
                                       params_at=params_at if replay is not None else None)
    feed = _ThreadFeed if self.levels.train_async else _InlineFeed
    self.feed = feed(self.rollout, self.queue)
    self.interrupted = False
    self.multi_process = distributed.multi_process()
    self._stop_requested = False  # Multi-process: a Ctrl-C here, agreed at the next update.
    # The run's history, summed over every process at each update (and by settle()).
    self.ledger = dataclasses.replace(ledger) if ledger is not None else ledger_lib.Ledger()
    self._ledger_start = dataclasses.replace(self.ledger)
    # This process's counts already entered in the ledger.
    self._seen = dict(produced=types.Counts(), dropped=types.Counts())
    self._taken: list[types.Item] = []  # Items of the update in progress (not yet trained).
    self._dropped: list[int] = []  # ... and those it dropped as too stale (Item.seq).
    # Replaying: the update's record, the newest version the learner published and the
    # version the rollout waits for (None: not waiting), for the deadlock check.
    self._want_update: dict | None = None
    self._published = version
    self._rollout_waits_for: int | None = None
    self.meters = meters_lib.Meters(self.clock, env, self.queue, self.server,
                                    self.rollout.episodes)

  # ------------------------------------------------------------------ params --
  def _on_broadcast(self, version: int, start: float, end: float) -> None:
    self.clock.add("broadcast", start, end)
    if self.pacer is not None:
      self.pacer.set_version(version)

  def _publish(self, state: learner_lib.TrainState, wait: bool) -> None:
    """Makes ``state``'s params the rollout's (a broadcast unless colocated)."""
    self._published = int(state.step)
    if self.server is not None:
      self.server.publish(state.params, int(state.step), wait=wait)
    elif self.multi_process:  # The learner's arrays span hosts: act on this host's replica.
      self._colocated = (distributed.local_replica(state.params, self.learner.mesh),
                         int(state.step))
    else:
      self._colocated = (state.params, int(state.step))

  def _replayed_params(self, version: int) -> tuple[Any, int]:
    """Replaying: the broadcast's copy of the recorded ``version`` (waited for).

    Raises:
      ReplayMismatch: without a rollout thread, a version the learner has not made
        (the learner's thread would wait for itself).
    """
    if not self.levels.train_async and version > self._published:
      raise ReplayMismatch(f"rollout step {self.rollout.num_steps}: the log acts with version "
                           f"{version}, the learner is at {self._published}")
    self._rollout_waits_for = version
    try:
      return self._server_at(version)
    finally:
      self._rollout_waits_for = None

  def _colocated_at(self, version: int) -> tuple[Any, int]:
    """Replaying ``sync_colocated``: the learner's params, which must be ``version``."""
    params, current = self._colocated
    if current != version:
      raise ReplayMismatch(f"the rollout acts with version {current}, the log with {version}")
    return params, current

  # ------------------------------------------------------------------- feed --
  def request_stop(self) -> None:
    """Stops the run before the next update (Ctrl-C); :meth:`updates` returns after
    yielding the last finished one.

    Multi-process, or with the streamed learner (whose update applies an optimizer step
    per minibatch as its items arrive, so a half-done update has already replaced the
    state): only noted here; the run stops after the current update.
    """
    if self.multi_process or self.levels.streamer:
      self._stop_requested = True
      return
    self.interrupted = True
    self.queue.close()
    if self.pacer is not None:
      self.pacer.close()

  def _take(self, version: int) -> types.Item:
    """The next item for learner ``version``; its chunks' staleness is recorded."""
    if self.interrupted:
      raise _Interrupted()
    try:
      item, _ = self._get(version)
      self._taken.append(item)
      self._dropped += self.queue.take_dropped()
      if self._want_update is not None:
        self._check_take(version, item)
    except types.Closed:
      self._raise_thread_error()
      if self.interrupted:
        raise _Interrupted() from None
      if self.replay is not None:
        raise ReplayMismatch(f"update {version}: the learner needs more data than the "
                             f"recorded rollout made ({len(self.replay.steps)} steps in "
                             f"{self.replay.path})") from None
      raise
    self.meters.staleness.add(version - item.versions.reshape(-1))
    return item

  def _get(self, version: int) -> tuple[types.Item, int]:
    """The feed's next item; replaying with a rollout thread, a deadlock with it (each
    waiting for the other: the replay has departed from its log) raises."""
    if self.replay is None or not self.levels.train_async:
      return self.feed.get(version)
    while True:
      try:
        return self.queue.get(version, timeout=0.5)
      except TimeoutError:
        waits = self._rollout_waits_for
        if waits is not None and waits > self._published:
          try:  # (unless an item arrived just before the rollout began to wait)
            return self.queue.get(version, timeout=0.0)
          except TimeoutError:
            self._dropped += self.queue.take_dropped()
            self._check_drops(version)  # (the likelier cause, named if it is one)
            raise ReplayMismatch(
                f"update {version}: the learner waits for an item while the rollout, at "
                f"step {self.rollout.num_steps}, waits for version {waits}: the replay "
                f"has departed from its log (items taken {[it.seq for it in self._taken]}, "
                f"dropped {self._dropped})") from None

  def _check_take(self, version: int, item: types.Item) -> None:
    """Replaying: the item just taken, and the drops before it, are the recorded ones."""
    want = self._want_update
    self._check_drops(version)
    k = len(self._taken) - 1
    if k >= len(want["items"]) or want["items"][k] != item.seq:
      raise ReplayMismatch(f"update {version}: took item {item.seq} (its oldest version "
                           f"{item.oldest_version}), the recorded update took "
                           f"{want['items'][k:k + 1] or 'no more'} there")

  def _check_drops(self, version: int) -> None:
    """Replaying: the items dropped so far in this update are the recorded drops' start."""
    recorded = self._want_update.get("dropped", [])
    if self._dropped != recorded[:len(self._dropped)]:
      raise ReplayMismatch(f"update {version}: dropped items {self._dropped} as too stale, "
                           f"the recorded update dropped {recorded}")

  def _raise_thread_error(self) -> None:
    error = getattr(self.feed, "error", None)
    if error is not None:
      raise RuntimeError(f"the rollout thread failed: {error!r}") from error
    if self.server is not None and self.server.error is not None:
      raise RuntimeError("the weight broadcast failed") from self.server.error

  # ----------------------------------------------------------------- learner --
  def _update(self, state: learner_lib.TrainState) -> tuple[learner_lib.TrainState, dict]:
    """Consumes one update's items (``self._taken``) and trains; returns ``(state, metrics)``."""
    version = int(state.step)
    if self.levels.streamer:
      items = (self._take(version) for _ in range(self.items_per_update))
      return self.learner.streamed_update(state, items, self.items_per_update,
                                          busy=lambda: self.clock.busy("learner"))
    items = [self._take(version) for _ in range(self.items_per_update)]
    with self.clock.busy("learner"):
      state, metrics = self.learner.update(state, types.concat([it.data for it in items]))
      metrics = jax.device_get(metrics)
    return state, metrics

  def updates(self, state: learner_lib.TrainState, start_env_steps: int,
              total_env_steps: int) -> Iterator[UpdateInfo]:
    """Trains until ``total_env_steps``, yielding after every update (the caller's
    metrics, evaluation and checkpoints run then, in this, the learner's, thread).

    It ends early when the run is interrupted (Ctrl-C, :meth:`request_stop`): the last
    state yielded is then the run's. Close it (``contextlib.closing``) or call
    :meth:`stop` when done: the rollout thread and the broadcaster stop.
    """
    self.clock.start()
    self._publish(state, wait=True)
    self.feed.start()
    env_steps = start_env_steps
    try:
      while env_steps < total_env_steps:
        if self.replay is not None and not self.replay.updates_left:
          self.replay_ended = True  # The recorded session was cut short here.
          return
        if self.replay is not None:
          self._want_update = self.replay.next_update()
        try:
          version = int(state.step)
          state, metrics = self._update(state)
        except _Interrupted:
          return  # (nothing donated: the state yielded last stands)
        self._log_update(version, metrics)
        self._publish(state, wait=not self.levels.train_async)
        # Every process: the same totals, hence the same stop decision (a collective).
        delta, stop = self._account(trained=self._taken)
        self._taken = []
        self.meters.mark_update()
        env_steps += delta.trained_env_steps + delta.dropped_env_steps
        yield UpdateInfo(state=state, metrics=metrics, env_steps=delta.trained_env_steps,
                         dropped_env_steps=delta.dropped_env_steps)
        if stop:  # Ctrl-C noted during the update (multi-process: on every process).
          self.interrupted = True
          return
      self._raise_thread_error()
      self.note("end", reason="budget")
    finally:
      if self.interrupted:
        self.note("end", reason="interrupted")
      self.stop()

  def _log_update(self, version: int, metrics: dict) -> None:
    """The update's record in the schedule log; replaying, checked against the log's."""
    items, dropped = [it.seq for it in self._taken], self._dropped
    self._dropped = []
    if self.recorder is None and self.replay is None:
      return
    plain = schedule_lib.plain_metrics(metrics)
    if self.replay is not None:
      schedule_lib.check_update(self._want_update, version, items, dropped, plain,
                                self.replay.path)
    if self.recorder is not None:
      self.recorder.write("update", u=version, items=items, dropped=dropped, metrics=plain)

  def note(self, kind: str, **fields) -> None:
    """Writes a record of ``kind`` (``save``, ``end``) to the schedule log, if any."""
    if self.recorder is not None:
      self.recorder.write(kind, **fields)

  def stop(self) -> None:
    """Stops the rollout thread and the broadcaster; safe to call twice."""
    self.queue.close()
    if self.pacer is not None:
      self.pacer.close()
    if self.server is not None:  # (first: a replay's rollout may wait for a version)
      self.server.close()
    self.feed.stop()
    self._colocated = None  # The caller holds the state.

  # ------------------------------------------------------------------ ledger --
  def _account(self, trained: list[types.Item], stop: bool | None = None
               ) -> tuple[ledger_lib.Ledger, bool]:
    """Enters this process's counts since the last call, summed over every process,
    in the ledger (a collective: every process calls it at the same point).

    Returns the summed deltas and whether any process asked to stop.
    """
    produced = self.rollout.produced  # (one consistent pair; the thread may go on)
    stats = self.queue.stats
    dropped = types.Counts(env_steps=stats.dropped_env_steps, chunks=stats.dropped_chunks)
    seen_produced, seen_dropped = self._seen["produced"], self._seen["dropped"]
    local = ledger_lib.Ledger(
        produced_env_steps=produced.env_steps - seen_produced.env_steps,
        produced_chunks=produced.chunks - seen_produced.chunks,
        trained_env_steps=sum(it.num_env_steps for it in trained),
        trained_chunks=sum(it.num_chunks for it in trained),
        dropped_env_steps=dropped.env_steps - seen_dropped.env_steps,
        dropped_chunks=dropped.chunks - seen_dropped.chunks)
    self._seen.update(produced=produced, dropped=dropped)
    summed = distributed.sum_over_hosts(np.concatenate(
        [local.to_array(), [self._stop_requested if stop is None else stop]]))
    delta = ledger_lib.Ledger.from_array(summed[:-1])
    self.ledger.add(delta)
    return delta, bool(summed[-1])

  def _count_in_flight(self) -> dict[str, int]:
    """This process's data really in flight: the builder's, the queue's, items a
    closed queue refused and items taken by an update that did not finish. Exact
    once the threads have stopped."""
    building = self.rollout.in_flight()
    held = self.queue.snapshot() + self.feed.refused + self._taken
    return dict(env_steps=building.env_steps + sum(it.num_env_steps for it in held),
                chunks=building.chunks + sum(it.num_chunks for it in held))

  def settle(self) -> dict[str, dict[str, int]]:
    """Closes the ledger after :meth:`stop`: enters the counts since the last update
    and compares its in-flight figures with what is really in flight (summed over
    processes; a collective). Returns :meth:`Ledger.report`; ``unaccounted`` is 0
    unless data was lost or counted twice (then an error is logged).
    """
    self._account(trained=[], stop=False)
    counted = self._count_in_flight()
    summed = distributed.sum_over_hosts(np.asarray([counted["env_steps"], counted["chunks"]],
                                                   np.int64))
    report = self.ledger.report(dict(env_steps=int(summed[0]), chunks=int(summed[1])))
    for unit, row in report.items():
      if row["unaccounted"]:
        log.error("ledger: %d %s unaccounted for (produced %d, trained %d, dropped %d, "
                  "discarded %d, counted in flight %d)", row["unaccounted"], unit,
                  row["produced"], row["trained"], row["dropped"], row["discarded"],
                  row["in_flight_counted"])
    return report

  # ----------------------------------------------------------------- metrics --
  def totals(self) -> dict[str, int]:
    """Env steps every process's rollout produced and dropped as too stale since
    this pipeline started (multi-process: as of the last update)."""
    if self.multi_process:
      since = self.ledger.minus(self._ledger_start)
      return dict(rollout_env_steps=since.produced_env_steps,
                  dropped_env_steps=since.dropped_env_steps)
    return dict(rollout_env_steps=self.rollout.env_steps,
                dropped_env_steps=self.queue.stats.dropped_env_steps)

  def save_timeline(self, path: str) -> None:
    """Writes every stage's busy intervals as JSON (``python -m jaxvla.plot_timeline``)."""
    self.clock.to_json(path)


class _Interrupted(Exception):
  """request_stop() while the learner waited for data."""
