"""EnvPool: host worker processes stepping envs, with first-ready dynamic batching.

This file owns the pool: starting, watching and restarting its workers, routing
chunks to them and handing their results out. The parent's handle on one worker
process is :mod:`jaxvla.envs.worker_handle`; the per-env bookkeeping that turns
replies into :class:`protocol.ChunkStep` results, :mod:`jaxvla.envs.env_book`; the
config-built ``env_fn``, :mod:`jaxvla.envs.env_factory`; the worker process and the
messages it exchanges, :mod:`jaxvla.envs.worker`.

``num_envs / envs_per_worker`` worker processes each own ``envs_per_worker``
single-env batches built by a picklable ``env_fn`` and execute whole action chunks
(one round trip per chunk). Observations do not travel through the pipes: the
workers write them into shared memory (:class:`worker.SharedObs`).

Two ways to drive it:

* asynchronous: ``send(actions [b, H, A], env_ids [b])`` then
  ``recv(b_max, t_max_s) -> (env_ids [b'], ChunkStep)``, which returns once
  ``b_max`` envs are ready or ``t_max_s`` after the first of them became ready
  (the dynamic-batching trigger ``batch >= B_max or waited >= T_max``);
* synchronous: ``step_chunk(actions [num_envs, H, A])`` (the :class:`VecEnv`
  protocol), used by the baselines.

Faults: a worker that dies, or does not answer within ``step_timeout_s``, is
killed and restarted with fresh envs. Every env it owned comes back (from the
pending ``recv``, or from its next ``send`` if it was idle) with ``done``,
``truncated=True``, a fresh observation and a truncated :class:`EpisodeStats`
for the episode that was lost; it has no final observation (``has_final_obs``
False), so its return is not bootstrapped. A Python exception in a simulator is
re-raised in the parent as a ``RuntimeError`` naming the env ids, the task and the
worker traceback (the worker is restarted first, so the pool stays usable).

Episodes and GRPO groups: a worker builds env ``i`` as global env ``i`` of
``num_envs`` (``env_fn(i, 1, ...)``), so the env knows its group ``i //
env.group_size``, and resets it with the caller's seed. Env ``i``'s ``k``-th
episode is therefore fixed by ``(seed, i // group_size, k)`` as in the in-process
batch ``make_env(config, num_envs, seed)``, whatever ``envs_per_worker`` is: a
pooled run can be replayed in-process, and group members in different workers
share their ``k``-th episodes' initial states. The parent counts each env's
episodes, so that a restarted worker's envs continue the numbering and the members
stay aligned across restarts too (:mod:`jaxvla.envs.env_book`).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import time
import weakref
from multiprocessing import connection
from typing import Any, Callable, NoReturn

import numpy as np

from jaxvla.envs import env_book, protocol, worker
from jaxvla.envs.env_book import EnvBook, EnvState
# Also the pool's API, re-exported: jaxvla.envs and the tests use config_env_fn, HANG_*
# and ReplayMismatch (what the replay hooks raise) from here.
from jaxvla.envs.env_factory import config_env_fn, for_pool
from jaxvla.envs.pool_stats import HANG_FACTOR, HANG_MIN_CHUNKS, PoolStats
from jaxvla.envs.worker_handle import (JOIN_TIMEOUT_S, RestartCause, Sent, WorkerHandle,
                                       WorkerLost, cleanup)
from jaxvla.errors import ReplayMismatch

__all__ = ["EnvFn", "EnvPool", "HANG_FACTOR", "HANG_MIN_CHUNKS", "PoolStats", "ReplayMismatch",
           "RestartListener", "config_env_fn", "env_seed"]

EnvFn = worker.EnvFn
env_seed = worker.env_seed  # Part of the pool's API: the seeds its envs are built with.

log = logging.getLogger(__name__)


# (worker index, why: 'died' | 'hung' | 'failed', env ids in flight, env ids ready)
RestartListener = Callable[[int, str, list[int], list[int]], None]


def start_timeout(envs_per_worker: int) -> float:
  """Seconds a worker may take to build ``envs_per_worker`` envs before it counts as lost.

  Building grows with the count: a ManiSkill3 env takes about 1 s alone on a 2-core
  machine and 3 s with two other runs on the cores, so the evaluation pool's 50 envs per
  worker (100 episodes on 2 workers) overran a flat 120 s there. 60 s for the process
  and its imports, 6 s per env.
  """
  return 60.0 + 6.0 * envs_per_worker


def _check_pool_args(num_envs: int, envs_per_worker: int, start_method: str,
                     step_timeout_s: float) -> None:
  if num_envs < 1 or envs_per_worker < 1 or num_envs % envs_per_worker:
    raise ValueError(f"envs_per_worker={envs_per_worker} must divide num_envs={num_envs} "
                     "(both >= 1)")
  if start_method not in ("spawn", "forkserver"):
    raise ValueError(f"start_method={start_method!r} is not 'spawn' or 'forkserver'")
  if step_timeout_s <= 0:
    raise ValueError(f"step_timeout_s={step_timeout_s} must be > 0")


# --------------------------------------------------------------------- pool --
class EnvPool:
  """``num_envs`` envs stepped by worker processes (implements :class:`protocol.VecEnv`).

  Args:
    env_fn: picklable ``(first_env_id, count, seed) -> VecEnv``, called in the
      worker once per env with ``count=1`` (so a chunk can step any subset of a
      worker's envs while the rest stay idle). The env must be global env
      ``first_env_id`` of ``num_envs``: its ``group_ids()`` are checked against
      ``first_env_id // group_size`` (a :class:`jaxvla.envs.env_factory.ConfigEnvFn`
      without ``num_envs`` gets this pool's).
    num_envs: global env ids are ``0 .. num_envs - 1``.
    envs_per_worker: envs per process; must divide ``num_envs``.
    spec: the envs' spec; a worker whose env reports another spec is an error.
    step_timeout_s: a chunk (or reset) taking longer is a hung worker: restart.
    start_method: 'spawn' or 'forkserver' (never fork: the parent runs JAX threads).
    seed: seed of the envs' construction (episodes come from ``reset(seed)``).
    start_timeout_s: time allowed for a worker to build its envs (None: 60 s plus 6 s
      per env, :func:`start_timeout`).
    hang_floor_s: the least time a chunk may take before it is a hang, once the
      env's chunk times are known (see :meth:`hang_timeout_s`).
  """

  def __init__(self, env_fn: EnvFn, num_envs: int, envs_per_worker: int,
               spec: protocol.EnvSpec, *, step_timeout_s: float,
               start_method: str = "spawn", seed: int = 0, start_timeout_s: float | None = None,
               hang_floor_s: float = 10.0):
    _check_pool_args(num_envs, envs_per_worker, start_method, step_timeout_s)
    self.spec, self.num_envs = spec, num_envs
    self.stats = PoolStats()
    self._env_fn, self._seed = for_pool(env_fn, num_envs), seed
    self._step_timeout_s = step_timeout_s
    self._start_timeout_s = (start_timeout(envs_per_worker) if start_timeout_s is None
                             else start_timeout_s)
    self._hang_floor_s = hang_floor_s
    self._ctx = mp.get_context(start_method)
    self._obs_layout, self._shms = worker.SharedObs.create(
        num_envs, (len(spec.camera_names), *spec.image_shape), spec.state_dim,
        spec.critic_state_dim)
    self._workers = [WorkerHandle(index=w, first_env_id=w * envs_per_worker, count=envs_per_worker)
                     for w in range(num_envs // envs_per_worker)]
    # Kills workers and unlinks shared memory even if close() is never called.
    self._finalizer = weakref.finalize(self, cleanup, self._workers, self._shms)
    self._images, self._state = self._obs_layout.views(self._shms)
    self._owner = np.repeat(np.arange(len(self._workers)), envs_per_worker)  # Worker of env i.
    self._book = EnvBook(num_envs)
    self._reset_seed: int | None = None  # None until reset(): send() is refused.
    self._closed = False
    # Told of every restart, before it (a run's schedule log: see set_restart_listener).
    self._restart_listener: RestartListener | None = None
    self._start_workers()

  # -------------------------------------------------------------- lifecycle --
  @property
  def pids(self) -> list[int]:
    """Process ids of the workers, by worker index."""
    return [w.process.pid for w in self._workers]

  @property
  def num_workers(self) -> int:
    return len(self._workers)

  def worker_env_ids(self, worker: int) -> list[int]:  # pylint: disable=redefined-outer-name
    """Global env ids owned by worker ``worker``."""
    return list(self._workers[worker].env_ids)

  @property
  def group_size(self) -> int:
    """G (``env.group_size``, read from the workers' envs as they start): env ``i`` is in
    GRPO group ``i // G``."""
    return self._book.group_size

  def group_ids(self) -> np.ndarray:
    """``int64 [num_envs]``: the GRPO group of each env (``env id // group_size``)."""
    return self._book.groups.copy()

  def close(self) -> None:
    """Stops every worker (join with timeout, then kill) and unlinks the shared memory."""
    if self._closed:
      return
    self._closed = True
    for w in self._workers:
      w.request_close()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for w in self._workers:
      w.stop(deadline)
    del self._images, self._state  # Views must go before the segments close.
    for shm in self._shms:
      shm.close()
    self._finalizer()

  def __enter__(self) -> EnvPool:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("EnvPool is closed")

  def _start_workers(self) -> None:
    """Starts every worker (in parallel) and checks its envs; closes the pool on failure."""
    try:
      for w in self._workers:
        self._spawn(w)
      for w in self._workers:
        self._await_started(w)
    except WorkerLost as e:
      self.close()
      raise RuntimeError(f"an env worker failed to start: {e}") from e
    except BaseException:
      self.close()
      raise

  def _spawn(self, w: WorkerHandle) -> None:
    w.start(self._ctx, self._env_fn, env_seed(self._seed, w.index, w.generation),
            self._obs_layout)

  def _await_started(self, w: WorkerHandle) -> None:
    """Waits for ``w``'s :class:`worker.Started` and checks its spec and groups."""
    started = self._expect(w, w.recv(self._start_timeout_s, "start"), worker.Started)
    if started.spec != self.spec:
      raise ValueError(f"worker {w.index} ({started.task}) built envs with spec "
                       f"{started.spec}, but the pool was given {self.spec}")
    self._book.check_groups(f"worker {w.index} ({started.task})", w.env_ids,
                            started.group_sizes, started.groups)

  # ---------------------------------------------------------------- restart --
  def hang_timeout_s(self) -> float:
    """Seconds a worker may spend on a step command before it counts as hung:
    ``step_timeout_s`` during the warm-up, then a multiple of the slowest chunk so
    far, at least ``hang_floor_s`` (:meth:`PoolStats.hang_timeout_s`)."""
    return self.stats.hang_timeout_s(self._step_timeout_s, self._hang_floor_s)

  def set_restart_listener(self, listener: RestartListener | None) -> None:
    """Calls ``listener(worker, why, in_flight, ready)`` at every worker restart, before
    it: the worker's index, ``'died'``, ``'hung'`` or ``'failed'``, and its env ids whose
    chunk the restart loses (in flight) or whose result had arrived (ready).
    What a schedule log records to replay the restart (:meth:`replay_restart`)."""
    self._restart_listener = listener

  def replay_restart(self, worker_index: int, why: str | RestartCause, in_flight: list[int],
                     ready: list[int]) -> None:
    """Restarts worker ``worker_index`` as a recorded run's restart did.

    ``why`` is the recorded cause (its schedule-log string, or the :class:`RestartCause`).
    The results of ``ready`` are waited for; results of ``in_flight`` that arrived
    since are undone (the recorded run lost those chunks); then the worker restarts,
    so each env's next result is the fault the recorded run got.

    Raises:
      ReplayMismatch: an env of the worker stands where the recorded run's did not
        (say, idle here and in flight there).
      ValueError: ``why`` is not one of :class:`RestartCause`'s strings.
    """
    cause = RestartCause(why)  # Fails before anything is waited for or undone.
    w = self._workers[worker_index]
    lost, kept = set(map(int, in_flight)), set(map(int, ready))
    self._book.check_recorded_restart(worker_index, w.env_ids, lost, kept)
    while any(self._book.state[i] is EnvState.IN_FLIGHT for i in kept):
      self._poll(None)
    for i in sorted(lost):
      if self._book.state[i] is EnvState.READY:
        self._book.unrecord(i)
    self._restart(w, cause, replayed=True)

  def _restart(self, w: WorkerHandle, cause: RestartCause, *, replayed: bool = False) -> None:
    """Kills ``w``, starts a fresh one and turns each of its envs' next result into a fault."""
    if self._restart_listener is not None and not replayed:
      # The listener gets the cause as the string a schedule log records.
      self._restart_listener(w.index, cause.value, *self._book.in_flight_and_ready(w.env_ids))
    self.stats.restarts += 1
    self.stats.died += int(cause is RestartCause.DIED)
    self.stats.hung += int(cause is RestartCause.HUNG)
    w.replace()
    lost = self._book.worker_restarted(w.env_ids, time.monotonic())
    self.stats.truncated_by_fault += lost
    why = (f"hung (no answer within {self.hang_timeout_s():.1f} s)"
           if cause is RestartCause.HUNG else cause.value)
    log.warning("env worker %d (env ids %d-%d) %s: restarted; %d episode(s) cut short "
                "(restarts so far: %d)", w.index, w.env_ids[0], w.env_ids[-1], why, lost,
                self.stats.restarts)
    try:
      self._spawn(w)
      self._await_started(w)
      if self._reset_seed is not None:  # Fresh envs start their next episode.
        self._send_reset(w)
        self._apply_reset(w, w.recv(self._step_timeout_s, "reset after restart"))
    except WorkerLost as e:
      raise RuntimeError(f"worker {w.index} (env ids {list(w.env_ids)}) failed again right "
                         f"after a restart: {e}") from e

  def _expect(self, w: WorkerHandle, reply: worker.Reply, kind: type) -> Any:
    """Returns ``reply`` if it is a ``kind``, else raises what it reports (no restart)."""
    if not isinstance(reply, kind):
      self._raise_worker_error(w, reply, restart=False)
    return reply

  def _raise_worker_error(self, w: WorkerHandle, reply: worker.Reply, *, restart: bool) -> NoReturn:
    """Raises the simulator exception reported by ``reply`` (restarting ``w`` first)."""
    if not isinstance(reply, worker.WorkerError):
      raise RuntimeError(f"worker {w.index} sent an unexpected {type(reply).__name__}")
    self.stats.sim_errors += 1
    if restart:
      self._restart(w, RestartCause.FAILED)
    raise RuntimeError(f"simulator error in env id(s) {list(reply.env_ids)} (task "
                       f"{reply.task}, worker {w.index}):\n{reply.traceback}")

  # ------------------------------------------------------------------ reset --
  def reset(self, seed: int, first_episode: np.ndarray | None = None) -> protocol.Observation:
    """Resets every env; returns all ``[num_envs]`` observations.

    ``first_episode`` ``int [num_envs]``: each env's first episode number ``k`` (default 0;
    see :meth:`jaxvla.envs.protocol.VecEnv.reset`). Chunks still in flight are waited
    for and discarded. A worker that dies or hangs during the reset is restarted (and
    reset) like during a step.
    """
    self._check_open()
    if first_episode is not None:
      first_episode = np.asarray(first_episode, np.int64)
      if first_episode.shape != (self.num_envs,) or (first_episode < 0).any():
        raise ValueError(f"first_episode must be {self.num_envs} numbers >= 0, got "
                         f"{first_episode.tolist()}")
    while any(w.outstanding for w in self._workers):  # Let in-flight chunks finish.
      self._poll(None)
    self._book.start_reset(first_episode)  # No episode is lost when a worker fails during the reset.
    self._reset_seed = seed
    lost, errors = self._reset_workers()
    for w in lost:
      self._restart(w, RestartCause.HUNG if w.process.is_alive() else RestartCause.DIED)
    if errors:  # Every reply is read first, so that no stale answer stays in a pipe.
      self._reset_seed = None
      self._raise_worker_error(*errors[0], restart=True)
    self._book.finish_reset()
    return self._observation(np.arange(self.num_envs))

  def _reset_workers(self) -> tuple[list[WorkerHandle], list[tuple[WorkerHandle, worker.Reply]]]:
    """Resets every worker; returns those lost and the errors the others reported."""
    lost, errors = [], []
    for w in self._workers:
      try:
        self._send_reset(w)
      except OSError:  # Broken pipe: the worker is dead.
        lost.append(w)
    for w in [w for w in self._workers if w not in lost]:
      try:
        reply = w.recv(self._step_timeout_s, "reset")
        if isinstance(reply, worker.ResetDone):
          self._apply_reset(w, reply)
        else:
          errors.append((w, reply))
      except WorkerLost:
        lost.append(w)
      w.outstanding.clear()
    return lost, errors

  def _send_reset(self, w: WorkerHandle) -> None:
    first_episode = tuple(self._book.episode[list(w.env_ids)].tolist())
    w.send(worker.Reset(seed=self._reset_seed, first_episode=first_episode))
    w.outstanding.append(Sent(env_ids=list(w.env_ids), sent_at=time.monotonic()))

  def _apply_reset(self, w: WorkerHandle, reply: worker.Reply) -> None:
    """Takes ``w``'s reset reply (instructions; the obs are in shared memory)."""
    reply = self._expect(w, reply, worker.ResetDone)
    self._book.instruction[list(w.env_ids)] = reply.instructions
    w.outstanding.clear()

  # ------------------------------------------------------------- send / recv --
  def send(self, actions: np.ndarray, env_ids: np.ndarray) -> None:
    """Dispatches chunks ``actions`` ``float [b, H, A]`` to envs ``env_ids`` ``int [b]``.

    Raises:
      ValueError: a wrong action shape, an unknown or repeated env id, or an env
        whose previous chunk has not been received yet.
    """
    self._check_open()
    if self._reset_seed is None:
      raise RuntimeError("call reset() before send()")
    env_ids = self._book.check_sendable(env_ids)
    actions = protocol.check_actions(actions, env_ids.size, self.spec.action_dim)
    now = time.monotonic()
    for w in self._workers:
      mine = np.nonzero(self._owner[env_ids] == w.index)[0]
      # An env whose episode a restart ended gets that fault as its result, without a step.
      rows = [int(k) for k in mine if self._book.start_chunk(int(env_ids[k]), now)]
      if rows:
        self._send_step(w, [int(i) for i in env_ids[rows]], actions[rows], now)

  def _send_step(self, w: WorkerHandle, env_ids: list[int], actions: np.ndarray,
                 now: float) -> None:
    """Sends ``w`` the chunks ``actions [b, H, A]`` of its envs ``env_ids [b]``."""
    w.queue(env_ids, now)
    step = worker.Step(local_ids=tuple(i - w.first_env_id for i in env_ids), actions=actions)
    try:
      w.send(step)
    except OSError:  # Broken pipe: the worker is dead.
      self._restart(w, RestartCause.DIED)

  def recv(self, b_max: int, t_max_s: float) -> tuple[np.ndarray, protocol.ChunkStep]:
    """Returns ``(env_ids [b], ChunkStep [b])`` for 1 <= b <= ``b_max`` ready envs.

    Returns as soon as ``b_max`` envs are ready, or ``t_max_s`` after the first
    ready one finished; blocks until at least one is ready (a hung or dead
    worker is restarted after ``step_timeout_s`` and its envs come back as faults).
    """
    self._check_open()
    if b_max < 1 or t_max_s < 0:
      raise ValueError(f"need b_max >= 1 and t_max_s >= 0, got {b_max}, {t_max_s}")
    self._poll(0.0)
    while len(self._book.ready) < b_max:
      wait_s = self._recv_wait_s(t_max_s)
      if wait_s is not None and wait_s <= 0:
        break
      self._poll(wait_s)
    ids = self._book.earliest_ready(b_max)
    obs = self._observation(ids)
    return np.array(ids, np.int64), env_book.chunk_step(obs, self._book.take(ids), self.spec)

  def _observation(self, ids) -> protocol.Observation:
    """The observations of envs ``ids`` (copies of their shared-memory rows)."""
    rows, s = self._state[ids], self.spec.state_dim
    return protocol.Observation(self._images[ids], rows[:, :s].copy(),
                                self._book.instruction[ids].copy(), critic_state=rows[:, s:].copy())

  def recv_ids(self, env_ids: np.ndarray) -> tuple[np.ndarray, protocol.ChunkStep]:
    """``(env_ids, ChunkStep)`` of exactly ``env_ids`` ``[b]``, in that order, once each
    has finished its chunk: a replay's ``recv`` (the batch a recorded run received).

    Raises:
      ReplayMismatch: one of ``env_ids`` has no chunk in flight or ready.
    """
    self._check_open()
    ids = [int(i) for i in env_ids]
    self._book.check_recorded_recv(ids)
    self._poll(0.0)
    while any(self._book.state[i] is not EnvState.READY for i in ids):
      self._poll(None)
    obs = self._observation(ids)
    return np.array(ids, np.int64), env_book.chunk_step(obs, self._book.take(ids), self.spec)

  def _recv_wait_s(self, t_max_s: float) -> float | None:
    """How long ``recv`` may still wait for replies: None for no limit, <= 0 for none."""
    in_flight = any(w.outstanding for w in self._workers)
    if not self._book.ready:
      if not in_flight:
        raise RuntimeError("recv() with no chunk in flight: send() first")
      return None
    if not in_flight:  # Nothing else can become ready: do not wait.
      return 0.0
    return self._book.first_ready_at() + t_max_s - time.monotonic()

  def step_chunk(self, actions: np.ndarray) -> protocol.ChunkStep:
    """Steps every env by ``actions`` ``float [num_envs, H, A]``; results in env-id order."""
    self._check_open()
    if self._reset_seed is not None and not self._book.all_idle():
      raise RuntimeError("step_chunk() while chunks from send() are in flight or not received")
    self.send(actions, np.arange(self.num_envs))
    parts = []
    while sum(len(ids) for ids, _ in parts) < self.num_envs:
      parts.append(self.recv(self.num_envs, math.inf))
    return env_book.in_env_order(parts)

  # ------------------------------------------------------------------- poll --
  def _poll(self, timeout_s: float | None) -> None:
    """Waits up to ``timeout_s`` (None: until something happens) for worker replies.

    Handles every reply that arrived and restarts dead or hung workers; never
    waits past the earliest hang deadline.
    """
    busy = [w for w in self._workers if w.outstanding]
    if not busy:
      return
    hang_at = min(w.busy_since for w in busy) + self.hang_timeout_s()
    wait_s = max(0.0, hang_at - time.monotonic())
    if timeout_s is not None:
      wait_s = min(wait_s, max(0.0, timeout_s))
    connection.wait([o for w in busy for o in (w.conn, w.process.sentinel)], wait_s)
    for w in busy:
      self._collect(w)

  def _collect(self, w: WorkerHandle) -> None:
    """Handles every reply ``w`` has sent; restarts it if it died or hung."""
    try:
      while w.outstanding and w.conn.poll():
        self._handle(w, w.conn.recv())
      if w.outstanding and not w.process.is_alive():
        raise WorkerLost(f"worker {w.index} exited")
    except (WorkerLost, EOFError, OSError):
      self._restart(w, RestartCause.DIED)
      return
    if w.outstanding and time.monotonic() - w.busy_since > self.hang_timeout_s():
      self._restart(w, RestartCause.HUNG)

  def _handle(self, w: WorkerHandle, reply: worker.Reply) -> None:
    """Applies one reply of ``w`` to a step command to the ready results."""
    if isinstance(reply, worker.WorkerError):
      self._raise_worker_error(w, reply, restart=True)
    sent = w.outstanding.popleft()
    if not isinstance(reply, worker.StepDone):
      raise RuntimeError(f"worker {w.index} answered {type(reply).__name__} to a step command")
    chunk_s = w.started_next(reply.finished_at)
    self.stats.worker_busy_s += chunk_s
    self.stats.slowest_chunk_s = max(self.stats.slowest_chunk_s, chunk_s)
    for i, outcome, text in zip(sent.env_ids, reply.outcomes, reply.instructions):
      self._book.record(i, outcome, text, reply.finished_at)
      self.stats.chunks += 1
      self.stats.env_steps += outcome.steps
