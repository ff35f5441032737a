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

Units: a PPO *update* consumes ``num_envs`` env segments of ``rollout_len``
chunks (what one lockstep rollout yields), as ``num_envs / micro_batch_segments``
queue items. A GRPO update (``ppo.algorithm='grpo'``) consumes ``num_envs``
whole episodes, one queue item per group of ``env.group_size`` episodes that
started from the same init (:mod:`jaxvla.runtime.episodes`). The policy version is the number of updates; every chunk carries the
version that acted, and the learner at version ``u`` trains on an item only if
``u - oldest chunk version <= max_staleness`` (see :mod:`jaxvla.runtime.queue`).

Errors: an exception in the rollout or broadcaster thread stops the run and is
re-raised in the caller with its traceback; KeyboardInterrupt stops the threads
and propagates (``train.py`` saves a checkpoint). Nothing is left running.

Multi-process (``jax.distributed``): every process runs this pipeline over its
own env pool and rollout devices; the learner steps and the weight broadcast are
collectives over every process's learner devices, so every process makes the same
number of updates of the same shape. After each update the processes sum their
env-step counts and stop requests (:func:`jaxvla.distributed.sum_over_hosts`), so
the budget, the stop and a Ctrl-C on any one process (which then takes effect at
the end of the current update) are decided alike everywhere.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from jaxvla import distributed
from jaxvla.learner import grpo_update as grpo_update_lib
from jaxvla.learner import learner as learner_lib
from jaxvla.models import policy as policy_lib
from jaxvla.rollout import trajectory as trajectory_lib
from jaxvla.runtime import episodes as episodes_lib
from jaxvla.runtime import params as params_lib
from jaxvla.runtime import queue as queue_lib
from jaxvla.runtime import rollout as rollout_lib
from jaxvla.runtime import stages

log = logging.getLogger(__name__)

MODES = ("sync_colocated", "sync_disaggregated", "async")
STAGES = ("env", "inference", "learner", "broadcast")


@dataclasses.dataclass(frozen=True)
class Levels:
  """Which asynchrony levels are on (all off: a synchronous baseline)."""
  train_async: bool
  rollout_async: bool
  streamer: bool
  separate_params: bool  # The rollout acts with broadcast copies (not the learner's arrays).

  @classmethod
  def from_config(cls, pipeline: ml_collections.ConfigDict) -> "Levels":
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


def concat_items(items: list[queue_lib.Item]) -> trajectory_lib.Trajectory:
  """Items ``[T, M_i]`` -> one ``Trajectory [T, sum M_i]`` (env axis 1)."""
  trajs = [it.data for it in items]
  cat1 = lambda *xs: np.concatenate(xs, axis=1)
  return trajectory_lib.Trajectory(
      batch=jax.tree.map(cat1, *[t.batch for t in trajs]),
      chain=cat1(*[t.chain for t in trajs]), log_prob=cat1(*[t.log_prob for t in trajs]),
      value=cat1(*[t.value for t in trajs]), reward=cat1(*[t.reward for t in trajs]),
      done=cat1(*[t.done for t in trajs]), steps=cat1(*[t.steps for t in trajs]),
      bootstrap_value=np.concatenate([t.bootstrap_value for t in trajs]),
      policy_version=cat1(*[t.policy_version for t in trajs]))


@dataclasses.dataclass
class UpdateInfo:
  """What the learner reports after each update (to ``on_update``)."""
  state: learner_lib.TrainState
  metrics: dict[str, float]
  env_steps: int  # Env steps of the data this update consumed (all processes).
  dropped_env_steps: int  # ... and of the data dropped as too stale since the last update.


class Pipeline:
  """Runs the RL phase for one config.

  Args:
    config: the whole config (``pipeline``, ``ppo``, ``num_envs``, ``rollout_len``).
    policy, learner: the policy contract and its :class:`Learner`.
    env: the rollout env batch (an :class:`EnvPool` when L2 is on).
    act_fn, value_fn: jitted training sampler and value function.
    rollout_shardings: where the rollout's params live (a sharding for every
      leaf, or a tree); used unless the mode is ``sync_colocated``.
    rng: the sampler's key; seed: the env reset seed.
  """

  def __init__(self, config: ml_collections.ConfigDict, policy: policy_lib.Policy,
               learner: learner_lib.Learner, env, act_fn: Callable, value_fn: Callable,
               rollout_shardings: Any, rng: jax.Array, seed: int):
    p = config.pipeline
    self.config, self.policy, self.learner, self.env = config, policy, learner, env
    self.levels = Levels.from_config(p)
    self.mode_name = self.levels.name(p.mode)
    self.segments_per_update = config.num_envs  # PPO: segments; GRPO: one episode per env.
    self.grpo = config.ppo.algorithm == "grpo"
    self.b_max = p.b_max or max(1, config.num_envs // 2)
    self.t_max_s = p.t_max_ms / 1000.0
    if self.levels.rollout_async and not hasattr(env, "recv"):
      raise ValueError("config.pipeline.rollout_async (first-ready batching) needs an env pool: "
                       "set config.env_workers > 0")
    self.clock = stages.StageClock(STAGES)
    self.staleness = stages.Histogram()
    self.queue = queue_lib.TrajectoryQueue(
        p.queue_items if self.levels.train_async else 1 << 30, p.max_staleness)
    self.pacer = None
    if p.staleness_control == "pace" and self.levels.train_async:
      self.pacer = queue_lib.Pacer(self.segments_per_update, p.max_staleness)
    self._state_for_rollout: learner_lib.TrainState | None = None
    self.server = None
    if self.levels.separate_params:
      self.server = params_lib.ParamServer(
          rollout_shardings, learner.mesh, on_ready=self._on_broadcast,
          gather=_is_sharded(learner), cast=p.rollout_dtype or None)
      params_fn = self.server.latest
    else:
      params_fn = self._colocated_params
    if self.grpo:  # One item per GRPO group of G episodes with the same init.
      g = config.env.group_size
      self.items_per_update = config.num_envs // g
      builder = episodes_lib.EpisodeBuilder(
          config.num_envs, g,
          episodes_lib.max_chunks_per_episode(env.spec.max_episode_steps,
                                              config.model.chunk_len),
          scale=config.ppo.grpo_scale)
      self._grpo_update = grpo_update_lib.grpo_update(learner)
      self._grpo_micro = (grpo_update_lib.grpo_micro_grads(learner) if self.levels.streamer
                          else None)
    else:
      self.items_per_update = config.num_envs // p.micro_batch_segments
      builder = rollout_lib.SegmentBuilder(config.num_envs, config.rollout_len,
                                           p.micro_batch_segments)
    self.rollout = rollout_lib.Rollout(env, policy, act_fn, value_fn, params_fn, builder, rng,
                                       seed, clock=self.clock, pacer=self.pacer)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.interrupted = False
    self.multi_process = distributed.multi_process()
    self._stop_requested = False  # Multi-process: a Ctrl-C here, agreed at the next update.
    self._local_params = None  # Multi-process sync_colocated: this host's replica.
    # Summed over every process at each update (this process's own counts when alone).
    self.hosts_rollout_env_steps = 0
    self.hosts_dropped_env_steps = 0
    # Per update, in time order: clock seconds and the pool's worker-busy seconds then.
    self._mark_times, self._mark_busy = [0.0], [0.0]

  # ------------------------------------------------------------------ params --
  def _colocated_params(self):
    if self._local_params is not None:
      return self._local_params
    state = self._state_for_rollout
    return state.params, int(state.step)

  def _on_broadcast(self, version: int, start: float, end: float) -> None:
    self.clock.add("broadcast", start, end)
    if self.pacer is not None:
      self.pacer.set_version(version)

  def _publish(self, state: learner_lib.TrainState, wait: bool) -> None:
    if self.server is None:
      self._state_for_rollout = state
      if self.multi_process:  # The learner's arrays span hosts: act on this host's replica.
        self._local_params = (distributed.local_replica(state.params, self.learner.mesh),
                              int(state.step))
    else:
      self.server.publish(state.params, int(state.step), wait=wait)

  # ----------------------------------------------------------------- rollout --
  def _rollout_step(self) -> None:
    if self.levels.rollout_async:
      self.rollout.step_ready(self.b_max, self.t_max_s)
    else:
      self.rollout.step_all()

  def _rollout_thread(self) -> None:
    try:
      while not self._stop.is_set():
        self._rollout_step()
        for item in self.rollout.builder.pop_items():
          self.queue.put(item)
    except queue_lib.Closed:
      pass
    except BaseException as e:  # Re-raised by the learner (with this traceback).
      self._error = e
      self.queue.close()

  def request_stop(self) -> None:
    """Stops the run before the next update (Ctrl-C); :meth:`run` returns its state.

    Multi-process: only noted here; every process stops after the current update.
    """
    if self.multi_process:
      self._stop_requested = True
      return
    self.interrupted = True
    self._stop.set()
    self.queue.close()
    if self.pacer is not None:
      self.pacer.close()

  def _get(self, version: int) -> tuple[queue_lib.Item, int]:
    """The next item for learner ``version`` (runs the rollout inline when L1 is off)."""
    if self.interrupted:
      raise _Interrupted()
    if self.levels.train_async:
      try:
        return self.queue.get(version)
      except queue_lib.Closed:
        self._raise_thread_error()
        if self.interrupted:
          raise _Interrupted() from None
        raise
    while True:
      if self.interrupted:
        raise _Interrupted()
      if len(self.queue):
        # Inline rollout: nothing is too stale unless first-ready segments straddle updates.
        item, staleness = self._try_get(version)
        if item is not None:
          return item, staleness
      self._rollout_step()
      for item in self.rollout.builder.pop_items():
        self.queue.put(item)

  def _try_get(self, version: int):
    try:
      return self.queue.get(version, timeout=0.0)
    except TimeoutError:
      return None, 0

  def _raise_thread_error(self) -> None:
    if self._error is not None:
      raise RuntimeError(f"the rollout thread failed: {self._error!r}") from self._error
    if self.server is not None and self.server.error is not None:
      raise RuntimeError("the weight broadcast failed") from self.server.error

  # ----------------------------------------------------------------- learner --
  def _update(self, state: learner_lib.TrainState) -> tuple[learner_lib.TrainState, dict, int]:
    """Consumes one update's items and trains; returns ``(state, metrics, env_steps)``."""
    version = int(state.step)
    cfg = self.config.ppo
    env_steps = 0
    if not self.levels.streamer:
      items = []
      for _ in range(self.items_per_update):
        item, staleness = self._get(version)
        self.staleness.add(np.full(item.num_chunks, version) - item.versions.reshape(-1))
        items.append(item)
        env_steps += item.num_env_steps
      with self.clock.busy("learner"):
        if self.grpo:
          eb = episodes_lib.concat_episode_batches([it.data for it in items])
          state, metrics = self._grpo_update(state, eb)
        else:
          state, metrics = self.learner.ppo_update(state, concat_items(items))
        metrics = jax.device_get(metrics)
      return state, metrics, env_steps
    per_minibatch = self.items_per_update // cfg.num_minibatches
    if self.grpo:
      episodes = per_minibatch * self.config.env.group_size  # Episodes per optimizer update.
      micro = lambda params, data: self._grpo_micro(params, data, episodes)
    else:
      chunks = (per_minibatch * self.config.pipeline.micro_batch_segments
                * self.config.rollout_len)
      micro = lambda params, data: self.learner.micro_grads(params, data, chunks)
    acc, sums = None, collections.defaultdict(float)
    for j in range(self.items_per_update):
      item, staleness = self._get(version)
      self.staleness.add(np.full(item.num_chunks, version) - item.versions.reshape(-1))
      env_steps += item.num_env_steps
      with self.clock.busy("learner"):
        acc = self.learner.accumulate(acc, micro(state.params, item.data))
        if (j + 1) % per_minibatch == 0:
          last = j + 1 == self.items_per_update
          state, metrics = self.learner.apply(state, acc, bump_version=last)
          acc = None
          for k, v in jax.device_get(metrics).items():
            sums[k] += float(v) / cfg.num_minibatches
    return state, dict(sums), env_steps

  def run(self, state: learner_lib.TrainState, start_env_steps: int, total_env_steps: int,
          on_update: Callable[[UpdateInfo], None]) -> learner_lib.TrainState:
    """Trains until ``total_env_steps``; calls ``on_update`` after every update.

    ``on_update`` runs in this (the learner's) thread between updates: metrics,
    evaluation and checkpoints. Returns the final state.
    """
    self.clock.start()
    self._publish(state, wait=True)
    if self.levels.train_async:
      self._thread = threading.Thread(target=self._rollout_thread, name="rollout", daemon=True)
      self._thread.start()
    env_steps = start_env_steps
    dropped_seen = rollout_seen = 0
    try:
      while env_steps < total_env_steps:
        try:
          state, metrics, steps = self._update(state)
        except _Interrupted:
          return state  # The state before the interrupted update (nothing donated yet).
        self._publish(state, wait=not self.levels.train_async)
        dropped = self.queue.stats.dropped_env_steps - dropped_seen
        dropped_seen += dropped
        rollout = self.rollout.env_steps - rollout_seen
        rollout_seen += rollout
        # Every process: the same totals, hence the same stop decision (a collective).
        steps, dropped, rollout, stop = (int(v) for v in distributed.sum_over_hosts(
            np.asarray([steps, dropped, rollout, self._stop_requested], np.int64)))
        self.hosts_rollout_env_steps += rollout
        self.hosts_dropped_env_steps += dropped
        busy = self._workers_busy_s()
        if busy is not None:
          self._mark_times.append(self.clock.elapsed())
          self._mark_busy.append(busy)
        env_steps += steps + dropped
        on_update(UpdateInfo(state=state, metrics=metrics, env_steps=steps,
                             dropped_env_steps=dropped))
        if stop:  # Multi-process Ctrl-C, after this update on every process.
          self.interrupted = True
          return state
      self._raise_thread_error()
    finally:
      self.stop()
    return state

  def stop(self) -> None:
    """Stops the rollout thread and the broadcaster; safe to call twice."""
    self._stop.set()
    self.queue.close()
    if self.pacer is not None:
      self.pacer.close()
    if self._thread is not None:
      self._thread.join(timeout=60.0)
      if self._thread.is_alive():
        log.error("the rollout thread did not stop within 60 s")
      self._thread = None
    if self.server is not None:
      self.server.close()
    self._state_for_rollout = self._local_params = None  # The caller holds the state.

  # ----------------------------------------------------------------- metrics --
  def total_rollout_env_steps(self) -> int:
    """Env steps every process's rollout executed (multi-process: as of the last update)."""
    return self.hosts_rollout_env_steps if self.multi_process else self.rollout.env_steps

  def total_dropped_env_steps(self) -> int:
    """Env steps dropped as too stale on every process (multi-process: as of the last update)."""
    return (self.hosts_dropped_env_steps if self.multi_process
            else self.queue.stats.dropped_env_steps)

  def in_flight(self) -> dict[str, int]:
    """Data produced but not trained on (discarded if the run stops now)."""
    segments, chunks = self.rollout.in_flight()
    queued = list(self.queue.snapshot())
    return dict(in_flight_segments=segments + sum(it.data.log_prob.shape[1] for it in queued),
                in_flight_chunks=chunks + sum(it.num_chunks for it in queued))

  def _workers_busy_s(self) -> float | None:
    """Seconds the env pool's workers spent stepping (None without a pool)."""
    stats = getattr(self.env, "stats", None)
    return getattr(stats, "worker_busy_s", None)

  def workers_busy(self, since: float = 0.0) -> float | None:
    """Fraction of the env workers' time spent stepping since the last update at or
    before clock time ``since`` (None without an env pool).

    The ``env`` stage's busy fraction says when *some* env was stepping; this says
    how much of the workers' capacity was used (first-ready batching keeps it high).
    """
    busy = self._workers_busy_s()
    if busy is None:
      return None
    mark = max(bisect.bisect_right(self._mark_times, since) - 1, 0)
    t0, b0 = self._mark_times[mark], self._mark_busy[mark]
    span = self.clock.elapsed() - t0
    return (busy - b0) / (self.env.num_workers * span) if span > 0 else 0.0

  def metrics(self, since: float | None = None) -> dict[str, float]:
    """Stage busy/idle fractions, staleness, queue and rollout counters."""
    out = dict(self.clock.fractions() if since is None else self.clock.window(since))
    workers = self.workers_busy(since or 0.0)
    if workers is not None:
      out["env_workers_busy"] = workers
    out.update(self.staleness.summary("staleness"))
    out.update(self.queue.summary())
    out.update({f"rollout_{k}": float(v) for k, v in self.rollout.timing.items()})
    if self.pacer is not None:
      out["pace_wait_s"] = self.pacer.wait_s
    if self.server is not None:
      out.update(broadcast_copy_s=self.server.copy_s,
                 broadcast_skipped_versions=float(self.server.skipped_versions))
    return out


class _Interrupted(Exception):
  """request_stop() while the learner waited for data."""


def _is_sharded(learner: learner_lib.Learner) -> bool:
  return learner.mesh is not None and learner.mesh.size > 1
