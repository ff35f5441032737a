"""The RL phase in every pipeline mode: who runs the rollout, when, and with which params.

The modes and asynchrony levels are :mod:`jaxvla.runtime.modes`'s table. Data path (one
direction): env pool -> :class:`jaxvla.rollout.rollout.Rollout` (acts, cuts items) ->
:class:`jaxvla.runtime.queue.TrajectoryQueue` (staleness check) ->
:class:`jaxvla.learner.learner.Learner` (update) ->
:class:`jaxvla.runtime.broadcast.ParamServer` (new params to the rollout). The learner
takes items from a *feed*: with L1 on, a rollout thread fills the queue
(:class:`jaxvla.runtime.feeds.ThreadFeed`); with L1 off, the learner's own thread steps
the rollout until the next item is ready (:class:`jaxvla.runtime.feeds.InlineFeed`). Everything else is the same code in every mode.

Units: an update consumes ``items_per_update`` queue items, as the algorithm's builder
cuts them (:mod:`jaxvla.learner.algorithm`: PPO env segments of ``rollout_len`` chunks,
GRPO groups of whole episodes). The policy version is the number of updates; every chunk
carries the version that acted, and the learner at version ``u`` trains on an item only
if ``u - oldest chunk version <= max_staleness`` (see :mod:`jaxvla.runtime.queue`).

Instrumentation: one :class:`jaxvla.timing.StageClock` (stages' busy intervals, the
rollout's waits), read by :class:`jaxvla.runtime.meters.Meters` (``Pipeline.meters``).
Accounting: every env step the rollout produces is trained on, dropped (too stale),
discarded by a resume or still in flight (:class:`jaxvla.runtime.ledger.Ledger`, summed
over processes at each update; :meth:`Pipeline.settle` checks it at the end). The run's
env-step count (its budget) is trained plus dropped steps, counted here only and handed
to the caller with each update.

Schedule: what timing decides (which envs, which versions, which items) goes through a
schedule, :class:`jaxvla.runtime.schedule.LiveSchedule` (written to the schedule log if
there is one) or :class:`jaxvla.runtime.replay.ReplaySchedule` (a recorded session
followed, and checked). The pipeline asks it and never branches on which.

Stopping: one signal, :attr:`Pipeline.stopped` (:class:`Stop`). Errors: an exception in
the rollout or broadcaster thread stops the run and is re-raised in the caller with its
traceback; KeyboardInterrupt stops the threads and propagates (``train.py`` saves a
checkpoint). Nothing is left running.

Multi-process (``jax.distributed``): every process runs this pipeline over its own env
pool and rollout devices; learner steps and the broadcast are collectives, so every
process makes the same updates. After each update the processes sum their env-step
counts and stop requests (:func:`jaxvla.parallel.distributed.sum_over_hosts`): the
budget and a Ctrl-C on any one process are decided alike everywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Callable, Iterator

import jax
import ml_collections
import numpy as np

from jaxvla import timing, types
from jaxvla.envs import protocol
from jaxvla.learner import learner as learner_lib
from jaxvla.models import contract
from jaxvla.parallel import distributed
from jaxvla.rollout import pacer as pacer_lib
from jaxvla.rollout import rollout as rollout_lib
from jaxvla.runtime import broadcast as broadcast_lib
from jaxvla.runtime import feeds as feeds_lib
from jaxvla.runtime import ledger as ledger_lib
from jaxvla.runtime import meters as meters_lib
from jaxvla.runtime import modes as modes_lib
from jaxvla.runtime import queue as queue_lib
from jaxvla.runtime import schedule as schedule_lib

log = logging.getLogger(__name__)

STAGES = rollout_lib.STAGES + ("learner", "broadcast")


class Stop(enum.Enum):
  """Why the pipeline stops before its budget (:attr:`Pipeline.stopped`)."""
  REQUESTED = "requested"  # Ctrl-C noted; the run stops after the current update.
  INTERRUPTED = "interrupted"  # Stopped by Ctrl-C: the last state yielded is the run's.
  LOG_ENDED = "log_ended"  # A replay reached the end of its recorded session.


@dataclasses.dataclass(frozen=True)
class Acting:
  """The rollout's side of the pipeline.

  ``env``: the rollout env batch (an ``AsyncVecEnv`` when L2 is on); ``act_fn`` and
  ``value_fn``: the jitted training sampler and value function; ``builder``: where chunks
  go, and ``items_per_update`` of its items make one update (the algorithm's,
  :mod:`jaxvla.learner.algorithm`); ``rng``: the sampler's key; ``seed``: the env reset seed.
  """
  env: protocol.VecEnv
  policy: contract.Policy
  act_fn: Callable
  value_fn: Callable
  builder: rollout_lib.Builder
  items_per_update: int
  rng: jax.Array
  seed: int


@dataclasses.dataclass
class UpdateInfo:
  """What the learner reports after each update (yielded by :meth:`Pipeline.updates`)."""
  state: learner_lib.TrainState
  metrics: dict[str, float]
  env_steps: int  # Env steps of the data this update consumed (all processes).
  dropped_env_steps: int  # ... and of the data dropped as too stale since the last update.
  run_env_steps: int  # The run's env steps after it (its budget's count): trained + dropped.


class Pipeline:
  """Runs the RL phase.

  Args:
    settings: ``config.pipeline`` (the mode, its levels and their knobs).
    learner: the :class:`Learner`.
    acting: the rollout's env batch, policy, functions and builder (:class:`Acting`).
    rollout_shardings: where the rollout's params live (a sharding for every
      leaf, or a tree); used unless the mode is ``sync_colocated``.
    version: the policy version it starts at (a resumed run's; pacing counts from it).
    ledger: the run's history so far (a resumed run's, with the checkpoint's in-flight
      data already discarded: :meth:`Ledger.resumed`).
    schedule: :class:`schedule.LiveSchedule` (default: live, unlogged) or
      :class:`jaxvla.runtime.replay.ReplaySchedule`.
  """

  def __init__(self, settings: ml_collections.ConfigDict, learner: learner_lib.Learner,
               acting: Acting, rollout_shardings: Any, version: int = 0,
               ledger: ledger_lib.Ledger | None = None, schedule: Any = None):
    p = settings
    self.learner, self.env = learner, acting.env
    self.schedule = schedule_lib.LiveSchedule() if schedule is None else schedule
    self.stopped: Stop | None = None
    self.levels = modes_lib.Levels.from_config(p)
    self.mode_name = self.levels.name(p.mode)
    self.items_per_update = acting.items_per_update
    self.clock = timing.StageClock(STAGES)
    num_envs = acting.env.num_envs
    self.pacer = None
    if p.staleness_control == "pace" and self.levels.train_async and self.schedule.pace:
      # PPO: env segments per update; GRPO: one episode per env per update.
      # A resumed run (at policy ``version``) has consumed ``version`` updates' segments:
      # the staleness bound counts from there, as in an uninterrupted run.
      self.pacer = pacer_lib.Pacer(num_envs, p.max_staleness, version=version)
    # A dropped item's segments are never consumed: their starts go back to the pacer.
    on_drop = None if self.pacer is None else (lambda it: self.pacer.release(it.num_segments))
    self.queue = queue_lib.TrajectoryQueue(
        p.queue_items if self.levels.train_async else 1 << 30, p.max_staleness, on_drop=on_drop)
    self.server = None
    self._colocated: tuple[Any, int] | None = None  # sync_colocated: the learner's params.
    self._published = version  # The newest version the learner published.
    if self.levels.separate_params:
      self.server = broadcast_lib.ParamServer(
          rollout_shardings, learner.mesh, on_ready=self._on_broadcast,
          gather=learner.mesh.size > 1, cast=p.rollout_dtype or None,
          keep_versions=self.schedule.keep_versions)
      params_fn, params_at = self.server.latest, self.server.at
    else:
      params_fn, params_at = (lambda: self._colocated), (lambda version: self._colocated)
    first_ready = None
    if self.levels.rollout_async:
      first_ready = (p.b_max or max(1, num_envs // 2), p.t_max_ms / 1000.0)
    steps = self.schedule.steps(params_fn, params_at, lambda: self._published,
                                threaded=self.levels.train_async)
    self.rollout = rollout_lib.Rollout(
        acting.env, acting.policy, acting.act_fn, acting.value_fn, params_fn, acting.builder,
        acting.rng, acting.seed, clock=self.clock, pacer=self.pacer, first_ready=first_ready,
        min_bucket=p.min_bucket, schedule=steps)
    feed = feeds_lib.ThreadFeed if self.levels.train_async else feeds_lib.InlineFeed
    self.feed = feed(self.rollout, self.queue)
    self.multi_process = distributed.multi_process()
    # The run's history, summed over every process at each update (and by settle()).
    self.ledger = dataclasses.replace(ledger) if ledger is not None else ledger_lib.Ledger()
    self._ledger_start = dataclasses.replace(self.ledger)
    # This process's counts already entered in the ledger.
    self._seen = dict(produced=types.Counts(), dropped=types.Counts())
    self._taken: list[types.Item] = []  # Items of the update in progress (not yet trained).
    self.meters = meters_lib.Meters(self.clock, acting.env, self.queue, self.server,
                                    self.rollout.episodes)

  @property
  def interrupted(self) -> bool:
    return self.stopped is Stop.INTERRUPTED

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

  # ------------------------------------------------------------------- feed --
  def request_stop(self) -> None:
    """Stops the run before the next update (Ctrl-C); :meth:`updates` returns after
    yielding the last finished one.

    Multi-process, or with the streamed learner (whose update applies an optimizer step
    per minibatch as its items arrive, so a half-done update has already replaced the
    state): only noted here; the run stops after the current update.
    """
    if self.multi_process or self.levels.streamer:
      self.stopped = Stop.REQUESTED
      return
    self.stopped = Stop.INTERRUPTED
    self.queue.close()
    if self.pacer is not None:
      self.pacer.close()

  def _take(self, version: int) -> types.Item:
    """The next item for learner ``version``; its chunks' staleness is recorded."""
    if self.interrupted:
      raise _Interrupted()
    try:
      item = self.schedule.get(self.feed, self.queue, version)
      self._taken.append(item)
      self.schedule.took(version, item, self.queue.take_dropped())
    except types.Closed:
      self._raise_thread_error()
      if self.interrupted:
        raise _Interrupted() from None
      self.schedule.out_of_data(version)
      raise
    self.meters.staleness.add(version - item.versions.reshape(-1))
    return item

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

    It ends early when the run is stopped (:attr:`stopped`): the last state yielded is
    then the run's. Close it (``contextlib.closing``) or call :meth:`stop` when done:
    the rollout thread and the broadcaster stop.
    """
    self.clock.start()
    self._publish(state, wait=True)
    self.feed.start()
    env_steps = start_env_steps
    try:
      while env_steps < total_env_steps:
        version = int(state.step)
        if not self.schedule.begin_update(version):
          self.stopped = Stop.LOG_ENDED  # The recorded session was cut short here.
          return
        try:
          state, metrics = self._update(state)
        except _Interrupted:
          return  # (nothing donated: the state yielded last stands)
        self.schedule.finish_update(version, [it.seq for it in self._taken], metrics)
        self._publish(state, wait=not self.levels.train_async)
        # Every process: the same totals, hence the same stop decision (a collective).
        delta, stop = self._account(trained=self._taken)
        self._taken = []
        self.meters.mark_update()
        env_steps += delta.trained_env_steps + delta.dropped_env_steps
        yield UpdateInfo(state=state, metrics=metrics, env_steps=delta.trained_env_steps,
                         dropped_env_steps=delta.dropped_env_steps, run_env_steps=env_steps)
        if stop:  # Ctrl-C noted during the update (multi-process: on every process).
          self.stopped = Stop.INTERRUPTED
          return
      self._raise_thread_error()
      self.schedule.note("end", reason="budget")
    finally:
      if self.interrupted:
        self.schedule.note("end", reason="interrupted")
      self.stop()

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
        [local.to_array(), [self.stopped is Stop.REQUESTED if stop is None else stop]]))
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
