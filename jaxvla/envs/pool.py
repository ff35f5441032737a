"""EnvPool: host worker processes stepping envs, with first-ready dynamic batching.

This file owns the parent side of process-based env stepping: starting,
watching and restarting the workers, and the per-env bookkeeping that turns
their replies into :class:`protocol.ChunkStep` results. The worker process and
the messages it exchanges live in :mod:`jaxvla.envs.worker`.

``num_envs / envs_per_worker`` worker processes each own ``envs_per_worker``
single-env batches built by a picklable ``env_fn``, execute whole action chunks
(one round trip per chunk), and write observations straight into shared memory
(``images uint8 [num_envs, N_cam, H, W, 3]``, ``state float32 [num_envs, S]``);
only small per-env scalars, instructions, :class:`protocol.EpisodeStats` and the
last observations of episodes truncated by their time limit (``ChunkStep.final_obs``)
travel through the pipes.

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
episodes; a restarted worker's envs continue from their next episode number (the
lost episode ``k`` is reported truncated, the fresh env starts ``k + 1``), so the
members stay aligned across restarts too.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import multiprocessing as mp
import time
import weakref
from multiprocessing import connection
from multiprocessing import shared_memory
from typing import Any, Callable, NoReturn

import ml_collections
import numpy as np

from jaxvla.envs import protocol, registry, worker
from jaxvla.errors import ReplayMismatch

__all__ = ["ConfigEnvFn", "EnvFn", "EnvPool", "EnvState", "PoolStats", "RestartListener",
           "config_env_fn", "env_seed"]

EnvFn = worker.EnvFn
env_seed = worker.env_seed  # Part of the pool's API: the seeds its envs are built with.

_JOIN_TIMEOUT_S = 5.0
# Hang detection once the env's speed is known: a chunk HANG_FACTOR times slower than
# the slowest of the first HANG_MIN_CHUNKS+ chunks (and at least hang_floor_s) is a hang.
# Before that (simulator warm-up), step_timeout_s; it also stays the upper bound.
HANG_FACTOR = 10.0
HANG_MIN_CHUNKS = 16

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ConfigEnvFn:
  """Picklable factory building envs from a plain ``env`` config dict (any registered env).

  Attributes:
    env_config: the ``env`` sub-config as a dict.
    num_envs: envs in the whole run, so that env ``first_env_id`` lands in its
      GRPO group; None until an :class:`EnvPool` fills in its own ``num_envs``
      (a call with ``first_env_id > 0`` needs it).
  """
  env_config: dict
  num_envs: int | None = None

  def __call__(self, first_env_id: int, count: int, seed: int) -> protocol.VecEnv:
    return registry.make_env(ml_collections.ConfigDict(self.env_config), count, seed,
                             first_env_id=first_env_id, total_envs=self.num_envs)


def config_env_fn(env_config: ml_collections.ConfigDict | dict,
                  num_envs: int | None = None) -> ConfigEnvFn:
  """Returns the pool's ``env_fn`` for the env named in the ``env`` sub-config."""
  if isinstance(env_config, ml_collections.ConfigDict):
    env_config = env_config.to_dict()
  return ConfigEnvFn(dict(env_config), num_envs)


@dataclasses.dataclass
class PoolStats:
  """Fault and throughput counters of an :class:`EnvPool`."""
  restarts: int = 0  # Worker processes restarted (any reason).
  died: int = 0  # Restarts because the process exited.
  hung: int = 0  # Restarts because a chunk took longer than step_timeout_s.
  sim_errors: int = 0  # Exceptions raised by a simulator (re-raised in the parent).
  truncated_by_fault: int = 0  # Episodes lost to a restart, reported as truncated.
  slowest_chunk_s: float = 0.0  # Longest time a worker took for one step command.
  chunks: int = 0  # Env chunk steps received (faults excluded).
  env_steps: int = 0  # Actions executed by the envs.
  # Seconds the workers spent executing chunks, summed over workers (divide by
  # num_workers * wall time for the env stage's utilisation).
  worker_busy_s: float = 0.0


class EnvState(enum.Enum):
  """Where one env of the pool stands between the caller and its worker."""
  NEW = "new"  # Not reset yet (or being reset): a restart loses no episode of it.
  IDLE = "idle"  # The caller holds its latest observation; it may be sent a chunk.
  IN_FLIGHT = "in flight"  # A chunk was sent to its worker; no result yet.
  READY = "ready"  # Its result arrived and waits to be returned by recv().


class _WorkerLost(Exception):
  """A worker died or timed out (internal; turned into a restart)."""


# (worker index, why: 'died' | 'hung' | 'failed', env ids in flight, env ids ready)
RestartListener = Callable[[int, str, list[int], list[int]], None]


# ---------------------------------------------------------------- processes --
@dataclasses.dataclass(frozen=True)
class _Sent:
  """A command a worker has not answered yet."""
  env_ids: list[int]  # Global ids of the envs it runs, in the command's order.
  sent_at: float  # time.monotonic() when it was sent.


@dataclasses.dataclass(eq=False)
class _Worker:
  """Parent-side handle of one worker process: its process, pipe and unanswered commands."""
  index: int
  first_env_id: int
  count: int
  process: Any = None  # multiprocessing Process, None before the first start.
  conn: connection.Connection | None = None
  generation: int = 0  # Restarts so far: new construction seeds for the fresh envs.
  outstanding: collections.deque[_Sent] = dataclasses.field(default_factory=collections.deque)
  busy_since: float = 0.0  # When the oldest outstanding command started executing.

  @property
  def env_ids(self) -> range:
    return range(self.first_env_id, self.first_env_id + self.count)

  def start(self, ctx: Any, env_fn: EnvFn, build_seed: int, obs: worker.SharedObs) -> None:
    """Starts a fresh process running :func:`worker.worker_main` for this worker's envs."""
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(
        target=worker.worker_main, name=f"jaxvla-env-worker-{self.index}", daemon=True,
        kwargs=dict(conn=child_conn, env_fn=env_fn, first_env_id=self.first_env_id,
                    count=self.count, build_seed=build_seed, obs=obs))
    try:
      process.start()
    except BaseException:
      parent_conn.close()
      raise
    finally:
      child_conn.close()  # Only the worker holds its end: its death reads as EOF here.
    self.process, self.conn = process, parent_conn

  def send(self, command: worker.Command) -> None:
    """Sends ``command``; raises ``OSError`` if the worker is gone (broken pipe)."""
    self.conn.send(command)

  def recv(self, timeout_s: float, what: str) -> worker.Reply:
    """Receives one reply within ``timeout_s`` or raises ``_WorkerLost`` (``what``: for errors)."""
    ready = connection.wait([self.conn, self.process.sentinel], timeout_s)
    if self.conn in ready or self.conn.poll():
      try:
        return self.conn.recv()
      except (EOFError, OSError) as e:
        raise _WorkerLost(f"worker {self.index} exited during {what}") from e
    if ready:
      self.process.join(_JOIN_TIMEOUT_S)
      raise _WorkerLost(f"worker {self.index} exited during {what} "
                        f"(exit code {self.process.exitcode})")
    raise _WorkerLost(f"worker {self.index} did not answer {what} within {timeout_s} s")

  def kill(self) -> None:
    """Kills the process (if alive) and closes the pipe; idempotent."""
    if self.process is not None:
      if self.process.is_alive():
        self.process.kill()
      self.process.join(_JOIN_TIMEOUT_S)
    if self.conn is not None:
      self.conn.close()
      self.conn = None

  def request_close(self) -> None:
    """Asks a live worker to close its envs and exit."""
    if self.conn is None or self.process is None or not self.process.is_alive():
      return
    try:
      self.conn.send(worker.Close())
    except OSError:  # Already gone: stop() returns at once.
      pass

  def stop(self, deadline: float) -> None:
    """Waits for the process to exit until ``deadline`` (monotonic), then terminates it."""
    if self.process is None:
      return
    self.process.join(max(0.0, deadline - time.monotonic()))
    if self.process.is_alive():
      self.process.terminate()
      self.process.join(_JOIN_TIMEOUT_S)


def _cleanup(workers: list[_Worker], shms: list[shared_memory.SharedMemory]) -> None:
  """Kills what is still running and unlinks the segments (idempotent; also at exit)."""
  for w in workers:
    w.kill()
  for shm in shms:
    try:
      shm.unlink()
    except FileNotFoundError:
      pass


# -------------------------------------------------------------- bookkeeping --
@dataclasses.dataclass(frozen=True)
class _Ready:
  """One env's outcome, waiting in the parent to be returned by ``recv``."""
  ready_at: float  # time.monotonic() at which the worker finished (or the fault was seen).
  outcome: worker.EnvOutcome
  # The env's episode counters before this outcome was recorded ``(episode, return,
  # length)``: a replay that must lose this chunk, as the recorded run did, restores them.
  before: tuple[int, float, int] | None = None


class _EnvBook:
  """Per-env bookkeeping of the pool: states, results waiting for ``recv``, episode counters.

  Knows nothing of processes: the pool tells it what happened (a reset, a chunk
  sent, a result received, a worker restarted) and takes the ready results.
  """

  def __init__(self, num_envs: int):
    self.state = [EnvState.NEW] * num_envs
    self.ready: dict[int, _Ready] = {}
    # Idle envs whose episode a restart ended: reported as the result of their next send.
    self.lost: dict[int, worker.EnvOutcome] = {}
    self.instruction = np.full(num_envs, "", dtype=object)  # [num_envs] of the latest obs.
    self.episode = np.zeros(num_envs, np.int64)  # Number k of each env's current episode.
    self._ep_return = np.zeros(num_envs, np.float64)
    self._ep_length = np.zeros(num_envs, np.int64)

  def all_idle(self) -> bool:
    """Whether the caller holds every env's latest observation (none is in flight or ready)."""
    return all(s is EnvState.IDLE for s in self.state)

  def start_reset(self, first_episode: np.ndarray | None = None) -> None:
    """Forgets every result and starts counting episodes from ``first_episode`` (0)."""
    self.ready.clear()
    self.lost.clear()
    self.state = [EnvState.NEW] * len(self.state)
    self.episode[:] = 0 if first_episode is None else first_episode

  def finish_reset(self) -> None:
    """Every env holds the first observation of an episode."""
    self.state = [EnvState.IDLE] * len(self.state)
    self._ep_return[:] = 0.0
    self._ep_length[:] = 0

  def start_chunk(self, env_id: int, now: float) -> bool:
    """Marks ``env_id`` sent a chunk; returns whether its worker must step it.

    An env whose episode a restart ended does not step: the fault is its result.
    """
    if env_id in self.lost:
      self.ready[env_id] = _Ready(ready_at=now, outcome=self.lost.pop(env_id))
      self.state[env_id] = EnvState.READY
      return False
    self.state[env_id] = EnvState.IN_FLIGHT
    return True

  def record(self, env_id: int, outcome: worker.EnvOutcome, instruction: str,
             ready_at: float) -> None:
    """Stores a worker's result for ``env_id`` and advances its episode counters."""
    before = (int(self.episode[env_id]), float(self._ep_return[env_id]),
              int(self._ep_length[env_id]))
    self.ready[env_id] = _Ready(ready_at=ready_at, outcome=outcome, before=before)
    self.state[env_id] = EnvState.READY
    self.instruction[env_id] = instruction
    if outcome.terminated or outcome.truncated:  # The env auto-reset into its next episode.
      self._ep_return[env_id], self._ep_length[env_id] = 0.0, 0
      self.episode[env_id] += 1
    else:
      self._ep_return[env_id] += outcome.reward
      self._ep_length[env_id] += outcome.steps

  def unrecord(self, env_id: int) -> None:
    """Puts ``env_id``'s received result back in flight, its episode counters as
    before it (a replay's restart that must lose this chunk, as the recorded run did)."""
    r = self.ready.pop(env_id)
    if r.before is None:
      raise ValueError(f"env {env_id}'s result is a fault, not a chunk that can be undone")
    self.episode[env_id], self._ep_return[env_id], self._ep_length[env_id] = r.before
    self.state[env_id] = EnvState.IN_FLIGHT

  def worker_restarted(self, env_ids: range, groups: np.ndarray, now: float) -> int:
    """Turns each env's next result into a fault after its worker restarted.

    An episode under way is lost (reported truncated with its number ``k``); the
    fresh env starts episode ``k + 1``, or ``k`` again if episode ``k`` had not
    taken a step yet, so its episode numbers stay aligned with its group's.

    Returns:
      The number of episodes lost.
    """
    num_lost = 0
    for i in env_ids:
      state = self.state[i]
      if state is EnvState.NEW:
        continue
      lost = self._end_episode(i, int(groups[i]), in_flight=state is EnvState.IN_FLIGHT)
      num_lost += len(lost)
      if state is EnvState.READY:  # Its obs row is about to be overwritten.
        # A result that ended its episode lost none and keeps its final observation;
        # one that did not has none: the lost episode is not bootstrapped.
        r = self.ready[i]
        outcome = dataclasses.replace(r.outcome, truncated=True,
                                      episodes=r.outcome.episodes + lost)
        self.ready[i] = _Ready(ready_at=r.ready_at, outcome=outcome)
      elif state is EnvState.IN_FLIGHT:
        self.ready[i] = _Ready(ready_at=now, outcome=worker.EnvOutcome.lost(lost))
        self.state[i] = EnvState.READY
      else:  # Idle, maybe already lost by an earlier restart: reported by its next send.
        earlier = self.lost[i].episodes if i in self.lost else ()
        self.lost[i] = worker.EnvOutcome.lost(earlier + lost)
    return num_lost

  def _end_episode(self, env_id: int, group: int,
                   in_flight: bool) -> tuple[protocol.EpisodeStats, ...]:
    """Ends ``env_id``'s episode under way, if it took a step or was stepping."""
    lost = ()
    if in_flight or self._ep_length[env_id] > 0:
      lost = (protocol.EpisodeStats(
          env_id=env_id, group=group, episode=int(self.episode[env_id]),
          episode_return=float(self._ep_return[env_id]),
          length=int(self._ep_length[env_id]), success=False, truncated=True, fault=True),)
      self.episode[env_id] += 1
    self._ep_return[env_id], self._ep_length[env_id] = 0.0, 0
    return lost

  def first_ready_at(self) -> float:
    """When the earliest of the ready results finished (monotonic)."""
    return min(r.ready_at for r in self.ready.values())

  def earliest_ready(self, n: int) -> list[int]:
    """Up to ``n`` ready env ids, the earliest finished first (ties by id)."""
    return sorted(self.ready, key=lambda i: (self.ready[i].ready_at, i))[:n]

  def take(self, env_ids: list[int]) -> list[worker.EnvOutcome]:
    """Pops the ready outcomes of ``env_ids``; the caller now holds their observations."""
    for i in env_ids:
      self.state[i] = EnvState.IDLE
    return [self.ready.pop(i).outcome for i in env_ids]


def _chunk_step(obs: protocol.Observation, outcomes: list[worker.EnvOutcome],
                spec: protocol.EnvSpec) -> protocol.ChunkStep:
  """The ChunkStep of ``outcomes`` ``[b]`` with observations ``obs`` ``[b]``."""
  finals = [o.final_obs for o in outcomes if o.final_obs is not None]
  return protocol.ChunkStep(
      obs=obs, reward=np.array([o.reward for o in outcomes], np.float32),
      terminated=np.array([o.terminated for o in outcomes], bool),
      truncated=np.array([o.truncated for o in outcomes], bool),
      success=np.array([o.success for o in outcomes], bool),
      steps=np.array([o.steps for o in outcomes], np.int32),
      episodes=[e for o in outcomes for e in o.episodes],
      has_final_obs=np.array([o.final_obs is not None for o in outcomes], bool),
      final_obs=(protocol.concat_observations(finals) if finals
                 else protocol.Observation.empty(spec)))


def _in_env_order(parts: list[tuple[np.ndarray, protocol.ChunkStep]]) -> protocol.ChunkStep:
  """Concatenates ``recv`` results ``(env_ids, ChunkStep)`` covering every env once, by env id."""
  order = np.argsort(np.concatenate([ids for ids, _ in parts]))
  step = protocol.concat_chunk_steps([step for _, step in parts]).take(order)
  step.episodes.sort(key=lambda e: e.env_id)
  return step


def _check_pool_args(num_envs: int, envs_per_worker: int, start_method: str,
                     step_timeout_s: float) -> None:
  if num_envs < 1 or envs_per_worker < 1 or num_envs % envs_per_worker:
    raise ValueError(f"envs_per_worker={envs_per_worker} must divide num_envs={num_envs} "
                     "(both >= 1)")
  if start_method not in ("spawn", "forkserver"):
    raise ValueError(f"start_method={start_method!r} is not 'spawn' or 'forkserver'")
  if step_timeout_s <= 0:
    raise ValueError(f"step_timeout_s={step_timeout_s} must be > 0")


def _for_pool(env_fn: EnvFn, num_envs: int) -> EnvFn:
  """``env_fn``, with a :class:`ConfigEnvFn` given the pool's ``num_envs``."""
  if not isinstance(env_fn, ConfigEnvFn):
    return env_fn
  if env_fn.num_envs is None:
    return dataclasses.replace(env_fn, num_envs=num_envs)
  if env_fn.num_envs != num_envs:
    raise ValueError(f"env_fn was made for num_envs={env_fn.num_envs}, but the pool has "
                     f"num_envs={num_envs}")
  return env_fn


# --------------------------------------------------------------------- pool --
class EnvPool:
  """``num_envs`` envs stepped by worker processes (implements :class:`protocol.VecEnv`).

  Args:
    env_fn: picklable ``(first_env_id, count, seed) -> VecEnv``, called in the
      worker once per env with ``count=1`` (so a chunk can step any subset of a
      worker's envs while the rest stay idle). The env must be global env
      ``first_env_id`` of ``num_envs``: its ``group_ids()`` are checked against
      ``first_env_id // group_size`` (a :class:`ConfigEnvFn` without ``num_envs``
      gets this pool's).
    num_envs: global env ids are ``0 .. num_envs - 1``.
    envs_per_worker: envs per process; must divide ``num_envs``.
    spec: the envs' spec; a worker whose env reports another spec is an error.
    step_timeout_s: a chunk (or reset) taking longer is a hung worker: restart.
    start_method: 'spawn' or 'forkserver' (never fork: the parent runs JAX threads).
    seed: seed of the envs' construction (episodes come from ``reset(seed)``).
    start_timeout_s: time allowed for a worker to build its envs.
    hang_floor_s: the least time a chunk may take before it is a hang, once the
      env's chunk times are known (see :meth:`hang_timeout_s`).
  """

  def __init__(self, env_fn: EnvFn, num_envs: int, envs_per_worker: int,
               spec: protocol.EnvSpec, *, step_timeout_s: float,
               start_method: str = "spawn", seed: int = 0, start_timeout_s: float = 120.0,
               hang_floor_s: float = 10.0):
    _check_pool_args(num_envs, envs_per_worker, start_method, step_timeout_s)
    self.spec, self.num_envs = spec, num_envs
    self.group_size = 0  # Read from the workers' envs (env.group_size) at start.
    self._groups = np.zeros(num_envs, np.int64)
    self.stats = PoolStats()
    self._env_fn, self._seed = _for_pool(env_fn, num_envs), seed
    self._step_timeout_s, self._start_timeout_s = step_timeout_s, start_timeout_s
    self._hang_floor_s = hang_floor_s
    self._ctx = mp.get_context(start_method)
    self._obs_layout, self._shms = worker.SharedObs.create(
        num_envs, (len(spec.camera_names), *spec.image_shape), spec.state_dim,
        spec.critic_state_dim)
    self._workers = [_Worker(index=w, first_env_id=w * envs_per_worker, count=envs_per_worker)
                     for w in range(num_envs // envs_per_worker)]
    # Kills workers and unlinks shared memory even if close() is never called.
    self._finalizer = weakref.finalize(self, _cleanup, self._workers, self._shms)
    self._images, self._state = self._obs_layout.views(self._shms)
    self._owner = np.repeat(np.arange(len(self._workers)), envs_per_worker)  # Worker of env i.
    self._book = _EnvBook(num_envs)
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

  def group_ids(self) -> np.ndarray:
    """``int64 [num_envs]``: the GRPO group of each env (``env id // group_size``)."""
    return self._groups.copy()

  def close(self) -> None:
    """Stops every worker (join with timeout, then kill) and unlinks the shared memory."""
    if self._closed:
      return
    self._closed = True
    for w in self._workers:
      w.request_close()
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
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
    except _WorkerLost as e:
      self.close()
      raise RuntimeError(f"an env worker failed to start: {e}") from e
    except BaseException:
      self.close()
      raise

  def _spawn(self, w: _Worker) -> None:
    w.start(self._ctx, self._env_fn, env_seed(self._seed, w.index, w.generation),
            self._obs_layout)

  def _await_started(self, w: _Worker) -> None:
    """Waits for ``w``'s :class:`worker.Started` and checks its spec and groups."""
    started = self._expect(w, w.recv(self._start_timeout_s, "start"), worker.Started)
    if started.spec != self.spec:
      raise ValueError(f"worker {w.index} ({started.task}) built envs with spec "
                       f"{started.spec}, but the pool was given {self.spec}")
    sizes, groups = list(started.group_sizes), list(started.groups)
    if not self.group_size:  # The first worker to answer sets the pool's groups.
      protocol.group_layout(sizes[0], self.num_envs)  # ValueError naming env.group_size.
      self.group_size = sizes[0]
      self._groups = np.arange(self.num_envs, dtype=np.int64) // self.group_size
    expected = self._groups[list(w.env_ids)].tolist()
    if any(g != self.group_size for g in sizes) or groups != expected:
      raise ValueError(
          f"worker {w.index} ({started.task}) built env ids {list(w.env_ids)} in groups "
          f"{groups} with env.group_size={sizes}, but the pool expects groups {expected} "
          f"(env.group_size={self.group_size}): env_fn(first_env_id, 1, seed) must build "
          f"global env first_env_id of num_envs={self.num_envs}")

  # ---------------------------------------------------------------- restart --
  def hang_timeout_s(self) -> float:
    """Seconds a worker may spend on a step command before it counts as hung.

    ``step_timeout_s`` until ``HANG_MIN_CHUNKS`` chunks have been measured (the
    simulator's warm-up), then ``HANG_FACTOR`` times the slowest chunk so far, at
    least ``hang_floor_s`` and at most ``step_timeout_s``.
    """
    if self.stats.chunks < HANG_MIN_CHUNKS:
      return self._step_timeout_s
    return min(self._step_timeout_s,
               max(self._hang_floor_s, HANG_FACTOR * self.stats.slowest_chunk_s))

  def set_restart_listener(self, listener: RestartListener | None) -> None:
    """Calls ``listener(worker, why, in_flight, ready)`` at every worker restart, before
    it: the worker's index, ``'died'``, ``'hung'`` or ``'failed'``, and its env ids whose
    chunk the restart loses (in flight) or whose result had arrived (ready).
    What a schedule log records to replay the restart (:meth:`replay_restart`)."""
    self._restart_listener = listener

  def replay_restart(self, worker_index: int, why: str, in_flight: list[int],
                     ready: list[int]) -> None:
    """Restarts worker ``worker_index`` as a recorded run's restart did.

    The results of ``ready`` are waited for; results of ``in_flight`` that arrived
    since are undone (the recorded run lost those chunks); then the worker restarts,
    so each env's next result is the fault the recorded run got.

    Raises:
      ReplayMismatch: an env of the worker stands where the recorded run's did not
        (say, idle here and in flight there).
    """
    w = self._workers[worker_index]
    lost, kept = set(map(int, in_flight)), set(map(int, ready))
    for i in w.env_ids:
      state = self._book.state[i]
      if (i in lost or i in kept) != (state in (EnvState.IN_FLIGHT, EnvState.READY)):
        raise ReplayMismatch(
            f"worker {worker_index}'s recorded restart: env {i} was "
            f"{'in flight' if i in lost else 'ready' if i in kept else 'idle'} then, "
            f"and is {state.value} in the replay")
    while any(self._book.state[i] is EnvState.IN_FLIGHT for i in kept):
      self._poll(None)
    for i in sorted(lost):
      if self._book.state[i] is EnvState.READY:
        self._book.unrecord(i)
    self._restart(w, died=why == "died", hung=why == "hung", replayed=True)

  def _restart(self, w: _Worker, *, died: bool = False, hung: bool = False,
               replayed: bool = False) -> None:
    """Kills ``w``, starts a fresh one and turns each of its envs' next result into a fault."""
    if self._restart_listener is not None and not replayed:
      why = "died" if died else "hung" if hung else "failed"
      states = [(i, self._book.state[i]) for i in w.env_ids]
      self._restart_listener(w.index, why, [i for i, s in states if s is EnvState.IN_FLIGHT],
                             [i for i, s in states if s is EnvState.READY])
    self.stats.restarts += 1
    self.stats.died += int(died)
    self.stats.hung += int(hung)
    w.kill()
    w.outstanding.clear()
    w.generation += 1
    lost = self._book.worker_restarted(w.env_ids, self._groups, time.monotonic())
    self.stats.truncated_by_fault += lost
    why = ("died" if died else
           f"hung (no answer within {self.hang_timeout_s():.1f} s)" if hung else "failed")
    log.warning("env worker %d (env ids %d-%d) %s: restarted; %d episode(s) cut short "
                "(restarts so far: %d)", w.index, w.env_ids[0], w.env_ids[-1], why, lost,
                self.stats.restarts)
    try:
      self._spawn(w)
      self._await_started(w)
      if self._reset_seed is not None:  # Fresh envs start their next episode.
        self._send_reset(w)
        self._apply_reset(w, w.recv(self._step_timeout_s, "reset after restart"))
    except _WorkerLost as e:
      raise RuntimeError(f"worker {w.index} (env ids {list(w.env_ids)}) failed again right "
                         f"after a restart: {e}") from e

  def _expect(self, w: _Worker, reply: worker.Reply, kind: type) -> Any:
    """Returns ``reply`` if it is a ``kind``, else raises what it reports (no restart)."""
    if not isinstance(reply, kind):
      self._raise_worker_error(w, reply, restart=False)
    return reply

  def _raise_worker_error(self, w: _Worker, reply: worker.Reply, *, restart: bool) -> NoReturn:
    """Raises the simulator exception reported by ``reply`` (restarting ``w`` first)."""
    if not isinstance(reply, worker.WorkerError):
      raise RuntimeError(f"worker {w.index} sent an unexpected {type(reply).__name__}")
    self.stats.sim_errors += 1
    if restart:
      self._restart(w)
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
      alive = w.process.is_alive()
      self._restart(w, died=not alive, hung=alive)
    if errors:  # Every reply is read first, so that no stale answer stays in a pipe.
      self._reset_seed = None
      self._raise_worker_error(*errors[0], restart=True)
    self._book.finish_reset()
    return self._observation(np.arange(self.num_envs))

  def _reset_workers(self) -> tuple[list[_Worker], list[tuple[_Worker, worker.Reply]]]:
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
      except _WorkerLost:
        lost.append(w)
      w.outstanding.clear()
    return lost, errors

  def _send_reset(self, w: _Worker) -> None:
    first_episode = tuple(self._book.episode[list(w.env_ids)].tolist())
    w.send(worker.Reset(seed=self._reset_seed, first_episode=first_episode))
    w.outstanding.append(_Sent(env_ids=list(w.env_ids), sent_at=time.monotonic()))

  def _apply_reset(self, w: _Worker, reply: worker.Reply) -> None:
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
    actions, env_ids = self._check_send(actions, env_ids)
    now = time.monotonic()
    for w in self._workers:
      mine = np.nonzero(self._owner[env_ids] == w.index)[0]
      # An env whose episode a restart ended gets that fault as its result, without a step.
      rows = [int(k) for k in mine if self._book.start_chunk(int(env_ids[k]), now)]
      if rows:
        self._send_step(w, [int(i) for i in env_ids[rows]], actions[rows], now)

  def _check_send(self, actions: np.ndarray,
                  env_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validates a send; returns ``(actions float32 [b, H, A], env_ids [b])``."""
    env_ids = np.asarray(env_ids)
    if env_ids.ndim != 1 or not np.issubdtype(env_ids.dtype, np.integer):
      raise ValueError(f"env_ids must be a 1-D integer array, got {env_ids.dtype} "
                       f"{env_ids.shape}")
    bad = env_ids[(env_ids < 0) | (env_ids >= self.num_envs)]
    if bad.size:
      raise ValueError(f"unknown env ids {bad.tolist()} (pool has ids 0..{self.num_envs - 1})")
    if np.unique(env_ids).size != env_ids.size:
      raise ValueError(f"env ids repeated in one send: {env_ids.tolist()}")
    busy = [int(i) for i in env_ids if self._book.state[i] is not EnvState.IDLE]
    if busy:
      raise ValueError(f"env ids {busy} already have a chunk in flight or a result not "
                       "received yet")
    return protocol.check_actions(actions, env_ids.size, self.spec.action_dim), env_ids

  def _send_step(self, w: _Worker, env_ids: list[int], actions: np.ndarray,
                 now: float) -> None:
    """Sends ``w`` the chunks ``actions [b, H, A]`` of its envs ``env_ids [b]``."""
    if not w.outstanding:
      w.busy_since = now
    w.outstanding.append(_Sent(env_ids=env_ids, sent_at=now))
    step = worker.Step(local_ids=tuple(i - w.first_env_id for i in env_ids), actions=actions)
    try:
      w.send(step)
    except OSError:  # Broken pipe: the worker is dead.
      self._restart(w, died=True)

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
    return np.array(ids, np.int64), _chunk_step(obs, self._book.take(ids), self.spec)

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
    idle = [i for i in ids if self._book.state[i] not in (EnvState.IN_FLIGHT, EnvState.READY)]
    if idle:
      raise ReplayMismatch(f"env ids {idle} were received by the recorded run, but have no "
                           "chunk in flight here")
    self._poll(0.0)
    while any(self._book.state[i] is not EnvState.READY for i in ids):
      self._poll(None)
    obs = self._observation(ids)
    return np.array(ids, np.int64), _chunk_step(obs, self._book.take(ids), self.spec)

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
    return _in_env_order(parts)

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

  def _collect(self, w: _Worker) -> None:
    """Handles every reply ``w`` has sent; restarts it if it died or hung."""
    try:
      while w.outstanding and w.conn.poll():
        self._handle(w, w.conn.recv())
      if w.outstanding and not w.process.is_alive():
        raise _WorkerLost(f"worker {w.index} exited")
    except (_WorkerLost, EOFError, OSError):
      self._restart(w, died=True)
      return
    if w.outstanding and time.monotonic() - w.busy_since > self.hang_timeout_s():
      self._restart(w, hung=True)

  def _handle(self, w: _Worker, reply: worker.Reply) -> None:
    """Applies one reply of ``w`` to a step command to the ready results."""
    if isinstance(reply, worker.WorkerError):
      self._raise_worker_error(w, reply, restart=True)
    sent = w.outstanding.popleft()
    if not isinstance(reply, worker.StepDone):
      raise RuntimeError(f"worker {w.index} answered {type(reply).__name__} to a step command")
    chunk_s = max(0.0, reply.finished_at - w.busy_since)
    self.stats.worker_busy_s += chunk_s
    self.stats.slowest_chunk_s = max(self.stats.slowest_chunk_s, chunk_s)
    if w.outstanding:  # The next queued command started when this one finished.
      w.busy_since = max(reply.finished_at, w.outstanding[0].sent_at)
    for i, outcome, text in zip(sent.env_ids, reply.outcomes, reply.instructions):
      self._book.record(i, outcome, text, reply.finished_at)
      self.stats.chunks += 1
      self.stats.env_steps += outcome.steps
