"""EnvPool: host worker processes stepping envs, with first-ready dynamic batching.

This file owns the process side of environment stepping (the L2 asynchrony of
DESIGN.md): ``num_envs / envs_per_worker`` worker processes each own
``envs_per_worker`` single-env batches built by a picklable ``env_fn``, execute
whole action chunks (one round trip per chunk), and write observations straight
into shared memory (``images uint8 [num_envs, N_cam, H, W, 3]``,
``state float32 [num_envs, S]``); only small per-env scalars, instructions and
:class:`protocol.EpisodeStats` travel through the pipes.

Two ways to drive it:

* asynchronous: ``send(actions [b, H, A], env_ids [b])`` then
  ``recv(b_max, t_max_s) -> (env_ids [b'], ChunkStep)``, which returns once
  ``b_max`` envs are ready or ``t_max_s`` after the first of them became ready
  (the paper's trigger ``batch >= B_max or waited >= T_max``);
* synchronous: ``step_chunk(actions [num_envs, H, A])`` (the :class:`VecEnv`
  protocol), used by the baselines.

Faults: a worker that dies, or does not answer within ``step_timeout_s``, is
killed and restarted with fresh envs. Every env it owned comes back (from the
pending ``recv``, or from its next ``send`` if it was idle) with ``done``,
``truncated=True``, a fresh observation and a truncated :class:`EpisodeStats`
for the episode that was lost. A Python exception in a simulator is re-raised
in the parent as a ``RuntimeError`` naming the env ids, the task and the worker
traceback (the worker is restarted first, so the pool stays usable).

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
import math
import multiprocessing as mp
import signal
import time
import traceback
import weakref
from multiprocessing import connection
from multiprocessing import shared_memory
from typing import Any, Callable

import ml_collections
import numpy as np

from jaxvla.envs import protocol

EnvFn = Callable[[int, int, int], protocol.VecEnv]

_JOIN_TIMEOUT_S = 5.0


def env_seed(seed: int, env_id: int, generation: int = 0) -> int:
  """Seed of global env ``env_id`` for ``reset(seed)`` after ``generation`` restarts."""
  return int(np.random.SeedSequence([seed, env_id, generation]).generate_state(1)[0])


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
    from jaxvla import envs  # the registry; imported here to avoid an import cycle
    return envs.make_env(ml_collections.ConfigDict(self.env_config), count, seed,
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
  chunks: int = 0  # Env chunk steps received (faults excluded).
  env_steps: int = 0  # Actions executed by the envs.
  # Seconds the workers spent executing chunks, summed over workers (divide by
  # num_workers * wall time for the env stage's utilisation).
  worker_busy_s: float = 0.0


@dataclasses.dataclass
class _Ready:
  """One env's result, waiting in the parent to be returned by ``recv``."""
  env_id: int
  ready_at: float  # time.monotonic() at which the worker finished (same clock system-wide).
  reward: float
  terminated: bool
  truncated: bool
  success: bool
  steps: int
  episodes: list[protocol.EpisodeStats]


class _WorkerLost(Exception):
  """A worker died or timed out (internal; turned into a restart)."""


# ------------------------------------------------------------------ worker --
def _attach(names: tuple[str, str], num_envs: int, image_shape: tuple[int, ...],
            state_dim: int) -> tuple[list[shared_memory.SharedMemory], np.ndarray, np.ndarray]:
  """Attaches the observation segments; returns them and ``images``/``state`` views."""
  shms = [shared_memory.SharedMemory(name=n) for n in names]
  images = np.ndarray((num_envs, *image_shape), np.uint8, buffer=shms[0].buf)
  state = np.ndarray((num_envs, state_dim), np.float32, buffer=shms[1].buf)
  return shms, images, state


def _task_name(env: Any) -> str:
  return str(getattr(env, "task_name", type(env).__name__))


def _worker_main(conn: connection.Connection, env_fn: EnvFn, first_env_id: int, count: int,
                 build_seed: int, shm_names: tuple[str, str], num_envs: int,
                 image_shape: tuple[int, ...], state_dim: int) -> None:
  """Worker process: owns global envs ``first_env_id .. first_env_id + count - 1``.

  Env ``first_env_id + j`` is built alone by ``env_fn(first_env_id + j, 1, ...)``
  and reports its global group and episode numbers itself.

  Commands (parent -> worker), answered in order:
    ("reset", seed, first_episode [count]) -> ("reset", instructions [count], ready_at)
    ("step", local [b], actions [b, H, A]) -> ("step", results, instructions [b], ready_at)
    ("close",) -> exits.
  Any simulator exception is answered by ("error", env_ids, task, traceback).
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
  ids = list(range(first_env_id, first_env_id + count))
  shms, images, state = _attach(shm_names, num_envs, image_shape, state_dim)
  envs: list[Any] = []
  try:
    try:
      envs = [env_fn(i, 1, env_seed(build_seed, i)) for i in ids]
      sizes = [int(env.group_size) for env in envs]
      groups = [int(np.asarray(env.group_ids())[0]) for env in envs]
    except Exception:  # Reported to the parent, which raises it.
      conn.send(("error", ids, type(env_fn).__name__, traceback.format_exc()))
      return
    conn.send(("ready", envs[0].spec, _task_name(envs[0]), sizes, groups))
    while True:
      try:
        msg = conn.recv()
      except EOFError:  # The parent is gone.
        return
      if msg[0] == "close":
        return
      current = ids
      try:
        if msg[0] == "reset":
          _, seed, first_episode = msg
          instr = []
          for j, env in enumerate(envs):
            current = [ids[j]]
            obs = env.reset(seed, first_episode=np.array(first_episode[j:j + 1], np.int64))
            images[ids[j]], state[ids[j]] = obs.images[0], obs.state[0]
            instr.append(str(obs.instruction[0]))
          conn.send(("reset", instr, time.monotonic()))
        else:
          _, local, actions = msg
          results, instr = [], []
          for k, j in enumerate(local):
            current = [ids[j]]
            out = envs[j].step_chunk(actions[k:k + 1])
            images[ids[j]], state[ids[j]] = out.obs.images[0], out.obs.state[0]
            instr.append(str(out.obs.instruction[0]))
            eps = [dataclasses.replace(e, env_id=ids[j]) for e in out.episodes]
            results.append((float(out.reward[0]), bool(out.terminated[0]),
                            bool(out.truncated[0]), bool(out.success[0]), int(out.steps[0]),
                            eps))
          conn.send(("step", results, instr, time.monotonic()))
      except Exception:  # Reported to the parent, which raises it.
        task = _task_name(envs[ids.index(current[0])])
        conn.send(("error", current, task, traceback.format_exc()))
  finally:
    for env in envs:
      env.close()
    del images, state  # Views must go before the segments close.
    for shm in shms:
      shm.close()


# ------------------------------------------------------------------ parent --
@dataclasses.dataclass
class _Worker:
  """Parent-side handle of one worker process."""
  index: int
  first_env_id: int
  count: int
  process: Any = None
  conn: connection.Connection | None = None
  generation: int = 0  # Restarts so far: new construction seeds for the fresh envs.
  # Commands sent and not answered yet: (global env ids, monotonic time sent).
  outstanding: collections.deque = dataclasses.field(default_factory=collections.deque)
  busy_since: float = 0.0  # When the oldest outstanding command started executing.

  @property
  def env_ids(self) -> range:
    return range(self.first_env_id, self.first_env_id + self.count)


def _cleanup(workers: list[_Worker], shms: list[shared_memory.SharedMemory]) -> None:
  """Kills what is still running and unlinks the segments (idempotent; also at exit)."""
  for w in workers:
    if w.process is not None and w.process.is_alive():
      w.process.kill()
      w.process.join(_JOIN_TIMEOUT_S)
    if w.conn is not None:
      w.conn.close()
      w.conn = None
  for shm in shms:
    try:
      shm.unlink()
    except FileNotFoundError:
      pass


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
  """

  def __init__(self, env_fn: EnvFn, num_envs: int, envs_per_worker: int,
               spec: protocol.EnvSpec, *, step_timeout_s: float,
               start_method: str = "spawn", seed: int = 0, start_timeout_s: float = 120.0):
    if num_envs < 1 or envs_per_worker < 1 or num_envs % envs_per_worker:
      raise ValueError(f"envs_per_worker={envs_per_worker} must divide num_envs={num_envs} "
                       "(both >= 1)")
    if start_method not in ("spawn", "forkserver"):
      raise ValueError(f"start_method={start_method!r} is not 'spawn' or 'forkserver'")
    if step_timeout_s <= 0:
      raise ValueError(f"step_timeout_s={step_timeout_s} must be > 0")
    if isinstance(env_fn, ConfigEnvFn):
      if env_fn.num_envs is None:
        env_fn = dataclasses.replace(env_fn, num_envs=num_envs)
      elif env_fn.num_envs != num_envs:
        raise ValueError(f"env_fn was made for num_envs={env_fn.num_envs}, but the pool has "
                         f"num_envs={num_envs}")
    self.spec, self.num_envs = spec, num_envs
    self.group_size = 0  # Read from the workers' envs (env.group_size) at start.
    self._groups = np.zeros(num_envs, np.int64)
    self.stats = PoolStats()
    self._env_fn, self._seed = env_fn, seed
    self._step_timeout_s, self._start_timeout_s = step_timeout_s, start_timeout_s
    self._ctx = mp.get_context(start_method)
    self._image_shape = (len(spec.camera_names), *spec.image_shape)
    self._shms = [
        shared_memory.SharedMemory(create=True, size=max(1, num_envs * math.prod(shape) * item))
        for shape, item in ((self._image_shape, 1), ((spec.state_dim,), 4))]
    self._workers = [_Worker(w, w * envs_per_worker, envs_per_worker)
                     for w in range(num_envs // envs_per_worker)]
    # Kills workers and unlinks shared memory even if close() is never called.
    self._finalizer = weakref.finalize(self, _cleanup, self._workers, self._shms)
    self._images = np.ndarray((num_envs, *self._image_shape), np.uint8, buffer=self._shms[0].buf)
    self._state = np.ndarray((num_envs, spec.state_dim), np.float32, buffer=self._shms[1].buf)
    self._instruction = np.full(num_envs, "", dtype=object)
    self._owner = np.repeat(np.arange(len(self._workers)), envs_per_worker)
    # Per env: 'new' (before reset), 'idle' (caller holds its obs), 'flight', 'ready'.
    self._status = np.full(num_envs, "new", dtype=object)
    self._ready: dict[int, _Ready] = {}
    self._pending_fault: dict[int, _Ready] = {}  # Idle envs whose episode a restart ended.
    self._ep_return = np.zeros(num_envs, np.float64)
    self._ep_length = np.zeros(num_envs, np.int64)
    self._episode = np.zeros(num_envs, np.int64)  # Number k of each env's current episode.
    self._reset_seed: int | None = None
    self._closed = False
    try:
      for w in self._workers:
        self._spawn(w)
      for w in self._workers:
        self._await_ready(w)
    except _WorkerLost as e:
      self.close()
      raise RuntimeError(f"an env worker failed to start: {e}") from e
    except BaseException:
      self.close()
      raise

  # -------------------------------------------------------------- lifecycle --
  @property
  def pids(self) -> list[int]:
    """Process ids of the workers, by worker index."""
    return [w.process.pid for w in self._workers]

  @property
  def num_workers(self) -> int:
    return len(self._workers)

  def worker_env_ids(self, worker: int) -> list[int]:
    """Global env ids owned by worker ``worker``."""
    return list(self._workers[worker].env_ids)

  def group_ids(self) -> np.ndarray:
    """``int64 [num_envs]``: the GRPO group of each env (``env id // group_size``)."""
    return self._groups.copy()

  def _spawn(self, w: _Worker) -> None:
    parent_conn, child_conn = self._ctx.Pipe(duplex=True)
    process = self._ctx.Process(
        target=_worker_main, name=f"jaxvla-env-worker-{w.index}", daemon=True,
        args=(child_conn, self._env_fn, w.first_env_id, w.count,
              env_seed(self._seed, w.index, w.generation),
              tuple(s.name for s in self._shms), self.num_envs, self._image_shape,
              self.spec.state_dim))
    try:
      process.start()
    except BaseException:
      parent_conn.close()
      raise
    finally:
      child_conn.close()  # Only the worker holds its end: its death reads as EOF here.
    w.process, w.conn = process, parent_conn

  def _await_ready(self, w: _Worker) -> None:
    msg = self._recv_one(w, self._start_timeout_s, "start")
    if msg[0] != "ready":
      self._raise_worker_error(w, msg, restart=False)
    _, spec, task, sizes, groups = msg
    if spec != self.spec:
      raise ValueError(f"worker {w.index} ({task}) built envs with spec {spec}, "
                       f"but the pool was given {self.spec}")
    if not self.group_size:  # The first worker to answer sets the pool's groups.
      protocol.group_layout(sizes[0], self.num_envs)  # ValueError naming env.group_size.
      self.group_size = sizes[0]
      self._groups = np.arange(self.num_envs, dtype=np.int64) // self.group_size
    expected = self._groups[list(w.env_ids)].tolist()
    if any(g != self.group_size for g in sizes) or groups != expected:
      raise ValueError(
          f"worker {w.index} ({task}) built env ids {list(w.env_ids)} in groups {groups} "
          f"with env.group_size={sizes}, but the pool expects groups {expected} "
          f"(env.group_size={self.group_size}): env_fn(first_env_id, 1, seed) must build "
          f"global env first_env_id of num_envs={self.num_envs}")

  def _recv_one(self, w: _Worker, timeout_s: float, what: str) -> tuple:
    """Receives one message from ``w`` within ``timeout_s`` or raises ``_WorkerLost``."""
    ready = connection.wait([w.conn, w.process.sentinel], timeout_s)
    if w.conn in ready or w.conn.poll():
      try:
        return w.conn.recv()
      except (EOFError, OSError) as e:
        raise _WorkerLost(f"worker {w.index} exited during {what}") from e
    if ready:
      w.process.join(_JOIN_TIMEOUT_S)
      raise _WorkerLost(f"worker {w.index} exited during {what} "
                        f"(exit code {w.process.exitcode})")
    raise _WorkerLost(f"worker {w.index} did not answer {what} within {timeout_s} s")

  def close(self) -> None:
    """Stops every worker (join with timeout, then kill) and unlinks the shared memory."""
    if self._closed:
      return
    self._closed = True
    for w in self._workers:
      if w.conn is not None and w.process is not None and w.process.is_alive():
        try:
          w.conn.send(("close",))
        except OSError:  # Already gone: the join below returns at once.
          pass
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    for w in self._workers:
      if w.process is not None:
        w.process.join(max(0.0, deadline - time.monotonic()))
        if w.process.is_alive():
          w.process.terminate()
          w.process.join(_JOIN_TIMEOUT_S)
    del self._images, self._state  # Views must go before the segments close.
    for shm in self._shms:
      shm.close()
    self._finalizer()

  def __enter__(self) -> "EnvPool":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("EnvPool is closed")

  # ------------------------------------------------------------------ reset --
  def reset(self, seed: int) -> protocol.Observation:
    """Resets every env; returns all ``[num_envs]`` observations.

    Chunks still in flight are waited for and discarded. A worker that dies or
    hangs during the reset is restarted (and reset) like during a step.
    """
    self._check_open()
    while any(w.outstanding for w in self._workers):  # Let in-flight chunks finish.
      self._poll(None)
    self._ready.clear()
    self._pending_fault.clear()
    self._status[:] = "new"  # No episode is lost when a worker fails during the reset.
    self._episode[:] = 0
    self._reset_seed = seed
    lost = []
    for w in self._workers:
      try:
        self._send_reset(w)
      except OSError:  # Broken pipe: the worker is dead.
        lost.append(w)
    errors = []
    for w in [w for w in self._workers if w not in lost]:
      try:
        msg = self._recv_one(w, self._step_timeout_s, "reset")
        if msg[0] == "reset":
          self._instruction[list(w.env_ids)] = msg[1]
        else:
          errors.append((w, msg))
      except _WorkerLost:
        lost.append(w)
      w.outstanding.clear()
    for w in lost:
      alive = w.process.is_alive()
      self._restart(w, died=not alive, hung=alive)
    if errors:  # Every reply is read first, so that no stale answer stays in a pipe.
      self._reset_seed = None
      self._raise_worker_error(*errors[0], restart=True)
    self._status[:] = "idle"
    self._ep_return[:] = 0.0
    self._ep_length[:] = 0
    return protocol.Observation(self._images.copy(), self._state.copy(), self._instruction.copy())

  def _send_reset(self, w: _Worker) -> None:
    w.conn.send(("reset", self._reset_seed, self._episode[list(w.env_ids)].tolist()))
    w.outstanding.append((list(w.env_ids), time.monotonic()))

  # ---------------------------------------------------------------- restart --
  def _restart(self, w: _Worker, *, died: bool = False, hung: bool = False) -> None:
    """Kills ``w``, starts a fresh one and turns each of its envs' next result into a fault.

    An episode under way is lost (reported truncated with its number ``k``); the
    fresh env starts episode ``k + 1``, or ``k`` again if episode ``k`` had not
    taken a step yet, so its episode numbers stay aligned with its group's.
    """
    self.stats.restarts += 1
    self.stats.died += int(died)
    self.stats.hung += int(hung)
    if w.process.is_alive():
      w.process.kill()
    w.process.join(_JOIN_TIMEOUT_S)
    w.conn.close()
    w.outstanding.clear()
    w.generation += 1
    now = time.monotonic()
    for i in w.env_ids:
      if self._status[i] == "new":
        continue
      lost = []
      if self._status[i] == "flight" or self._ep_length[i] > 0:
        lost = [protocol.EpisodeStats(env_id=i, group=int(self._groups[i]),
                                      episode=int(self._episode[i]),
                                      episode_return=float(self._ep_return[i]),
                                      length=int(self._ep_length[i]), success=False,
                                      truncated=True, fault=True)]
        self._episode[i] += 1
        self.stats.truncated_by_fault += 1
      self._ep_return[i], self._ep_length[i] = 0.0, 0
      if self._status[i] == "ready":  # Its obs row is about to be overwritten.
        r = self._ready[i]
        r.truncated, r.episodes = True, r.episodes + lost
      elif self._status[i] == "flight":
        self._ready[i] = _Ready(i, now, 0.0, False, True, False, 0, lost)
        self._status[i] = "ready"
      else:  # Idle or already pending: reported by its next send.
        prev = self._pending_fault.get(i)
        self._pending_fault[i] = _Ready(i, now, 0.0, False, True, False, 0,
                                        (prev.episodes if prev else []) + lost)
    self._spawn(w)
    try:
      self._await_ready(w)
      if self._reset_seed is not None:
        self._send_reset(w)
        msg = self._recv_one(w, self._step_timeout_s, "reset after restart")
        if msg[0] != "reset":
          self._raise_worker_error(w, msg, restart=False)
        self._instruction[list(w.env_ids)] = msg[1]
        w.outstanding.clear()
    except _WorkerLost as e:
      raise RuntimeError(f"worker {w.index} (env ids {list(w.env_ids)}) failed again right "
                         f"after a restart: {e}") from e

  def _raise_worker_error(self, w: _Worker, msg: tuple, *, restart: bool) -> None:
    """Raises the simulator exception reported by ``msg`` (restarting ``w`` first)."""
    _, env_ids, task, tb = msg
    self.stats.sim_errors += 1
    if restart:
      self._restart(w)
    raise RuntimeError(f"simulator error in env id(s) {env_ids} (task {task}, worker "
                       f"{w.index}):\n{tb}")

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
    env_ids = np.asarray(env_ids)
    if env_ids.ndim != 1 or not np.issubdtype(env_ids.dtype, np.integer):
      raise ValueError(f"env_ids must be a 1-D integer array, got {env_ids.dtype} "
                       f"{env_ids.shape}")
    bad = env_ids[(env_ids < 0) | (env_ids >= self.num_envs)]
    if bad.size:
      raise ValueError(f"unknown env ids {bad.tolist()} (pool has ids 0..{self.num_envs - 1})")
    if np.unique(env_ids).size != env_ids.size:
      raise ValueError(f"env ids repeated in one send: {env_ids.tolist()}")
    busy = [int(i) for i in env_ids if self._status[i] != "idle"]
    if busy:
      raise ValueError(f"env ids {busy} already have a chunk in flight or a result not "
                       "received yet")
    actions = protocol.check_actions(actions, env_ids.size, self.spec.action_dim)
    now = time.monotonic()
    for w in self._workers:
      rows = np.nonzero(self._owner[env_ids] == w.index)[0]
      ids = [int(i) for i in env_ids[rows]]
      for i in [i for i in ids if i in self._pending_fault]:  # Episode already ended by a fault.
        self._ready[i] = self._pending_fault.pop(i)
        self._ready[i].ready_at = now
        self._status[i] = "ready"
      keep = [k for k, i in zip(rows, ids) if self._status[i] == "idle"]
      if not keep:
        continue
      ids = [int(env_ids[k]) for k in keep]
      self._status[ids] = "flight"
      if not w.outstanding:
        w.busy_since = now
      w.outstanding.append((ids, now))
      try:
        w.conn.send(("step", [i - w.first_env_id for i in ids], actions[keep]))
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
    while len(self._ready) < b_max:
      in_flight = any(w.outstanding for w in self._workers)
      if self._ready and not in_flight:  # Nothing else can become ready: do not wait.
        break
      if self._ready:
        remaining = min(r.ready_at for r in self._ready.values()) + t_max_s - time.monotonic()
        if remaining <= 0:
          break
      elif not in_flight:
        raise RuntimeError("recv() with no chunk in flight: send() first")
      else:
        remaining = None
      self._poll(remaining)
    ids = sorted(self._ready, key=lambda i: (self._ready[i].ready_at, i))[:b_max]
    return np.array(ids, np.int64), self._take(ids)

  def step_chunk(self, actions: np.ndarray) -> protocol.ChunkStep:
    """Steps every env by ``actions`` ``float [num_envs, H, A]``; results in env-id order."""
    self._check_open()
    if self._reset_seed is not None and np.any(self._status != "idle"):
      raise RuntimeError("step_chunk() while chunks from send() are in flight or not received")
    self.send(actions, np.arange(self.num_envs))
    parts = []
    while sum(len(p[0]) for p in parts) < self.num_envs:
      parts.append(self.recv(self.num_envs, math.inf))
    ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(ids)

    def cat(field: str) -> np.ndarray:
      return np.concatenate([getattr(p[1], field) for p in parts])[order]

    obs = protocol.Observation(*(np.concatenate([getattr(p[1].obs, f) for p in parts])[order]
                                 for f in ("images", "state", "instruction")))
    return protocol.ChunkStep(
        obs=obs, reward=cat("reward"), terminated=cat("terminated"), truncated=cat("truncated"),
        success=cat("success"), steps=cat("steps"),
        episodes=sorted((e for p in parts for e in p[1].episodes), key=lambda e: e.env_id))

  def _take(self, ids: list[int]) -> protocol.ChunkStep:
    """Pops the ready results of ``ids`` ``[b]`` into a ChunkStep (obs rows copied)."""
    rs = [self._ready.pop(i) for i in ids]
    self._status[ids] = "idle"
    obs = protocol.Observation(self._images[ids], self._state[ids], self._instruction[ids])
    return protocol.ChunkStep(
        obs=obs, reward=np.array([r.reward for r in rs], np.float32),
        terminated=np.array([r.terminated for r in rs], bool),
        truncated=np.array([r.truncated for r in rs], bool),
        success=np.array([r.success for r in rs], bool),
        steps=np.array([r.steps for r in rs], np.int32),
        episodes=[e for r in rs for e in r.episodes])

  # ------------------------------------------------------------------- poll --
  def _poll(self, timeout_s: float | None) -> None:
    """Waits up to ``timeout_s`` (None: until something happens) for worker replies.

    Handles every reply that arrived and restarts dead or hung workers; never
    waits past the earliest hang deadline.
    """
    busy = [w for w in self._workers if w.outstanding]
    if not busy:
      return
    hang_at = min(w.busy_since for w in busy) + self._step_timeout_s
    wait_s = max(0.0, hang_at - time.monotonic())
    if timeout_s is not None:
      wait_s = min(wait_s, max(0.0, timeout_s))
    connection.wait([o for w in busy for o in (w.conn, w.process.sentinel)], wait_s)
    for w in busy:
      try:
        while w.outstanding and w.conn.poll():
          self._handle(w, w.conn.recv())
        if w.outstanding and not w.process.is_alive():
          raise _WorkerLost(f"worker {w.index} exited")
      except (_WorkerLost, EOFError, OSError):
        self._restart(w, died=True)
        continue
      if w.outstanding and time.monotonic() - w.busy_since > self._step_timeout_s:
        self._restart(w, hung=True)

  def _handle(self, w: _Worker, msg: tuple) -> None:
    """Applies one reply of ``w`` to the ready buffer."""
    if msg[0] == "error":
      self._raise_worker_error(w, msg, restart=True)
    ids, _ = w.outstanding.popleft()
    if msg[0] != "step":
      raise RuntimeError(f"worker {w.index} answered {msg[0]!r} to a step command")
    _, results, instr, ready_at = msg
    self.stats.worker_busy_s += max(0.0, ready_at - w.busy_since)
    if w.outstanding:  # The next queued command started when this one finished.
      w.busy_since = max(ready_at, w.outstanding[0][1])
    for i, res, text in zip(ids, results, instr):
      reward, terminated, truncated, success, steps, eps = res
      self._ready[i] = _Ready(i, ready_at, reward, terminated, truncated, success, steps, eps)
      self._status[i] = "ready"
      self._instruction[i] = text
      self.stats.chunks += 1
      self.stats.env_steps += steps
      if terminated or truncated:  # The env auto-reset into its next episode.
        self._ep_return[i], self._ep_length[i] = 0.0, 0
        self._episode[i] += 1
      else:
        self._ep_return[i] += reward
        self._ep_length[i] += steps
