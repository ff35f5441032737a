"""The worker side of the env pool: the process main loop and what it exchanges.

An :class:`jaxvla.envs.pool.EnvPool` runs :func:`worker_main` in each of its
worker processes. This module owns the contract between the two sides, so that
neither has to guess the other's layout:

* the pipe messages, one frozen dataclass each. Commands (parent -> worker) are
  answered in order: :class:`Reset` by :class:`ResetDone`, :class:`Step` by
  :class:`StepDone`; :class:`Close` makes the worker exit. A worker first sends
  :class:`Started` once its envs are built. A simulator exception is answered by
  :class:`WorkerError` instead, and the worker goes on serving.
* the observations, which never go through the pipe: the worker writes them in
  place into shared memory laid out by :class:`SharedObs` (one row per global
  env), so only small scalars, instructions and :class:`protocol.EpisodeStats`
  are pickled. The one exception is the last observation of an episode truncated
  by its time limit (:attr:`EnvOutcome.final_obs`): an env has one at most once
  per episode, and its shared-memory row already holds the next episode's first.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
import traceback
from multiprocessing import connection
from multiprocessing import shared_memory
from typing import Any, Callable

import numpy as np

from jaxvla.envs import protocol

# ``(first_env_id, count, seed) -> VecEnv``: builds global envs ``first_env_id ..
# first_env_id + count - 1``; must be picklable to reach the worker.
EnvFn = Callable[[int, int, int], protocol.VecEnv]


def env_seed(seed: int, env_id: int, generation: int = 0) -> int:
  """Seed of global env ``env_id`` for ``reset(seed)`` after ``generation`` restarts."""
  return int(np.random.SeedSequence([seed, env_id, generation]).generate_state(1)[0])


# --------------------------------------------------------------- commands --
@dataclasses.dataclass(frozen=True)
class Reset:
  """Resets every env of the worker with episode seed ``seed``."""
  seed: int
  # Per env of the worker, in env-id order: number k of its first episode after the reset.
  first_episode: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
  """Executes one action chunk on some of the worker's envs (the others stay idle)."""
  local_ids: tuple[int, ...]  # [b] indices (0 .. count - 1) of the worker's envs to step.
  actions: np.ndarray  # float32 [b, H, A], row k for env local_ids[k].


@dataclasses.dataclass(frozen=True)
class Close:
  """Closes the envs and ends the worker process."""


Command = Reset | Step | Close


# ---------------------------------------------------------------- replies --
@dataclasses.dataclass(frozen=True)
class Started:
  """The worker built its envs; the parent checks them against the pool's layout."""
  spec: protocol.EnvSpec
  task: str  # Task of the worker's first env, for messages.
  group_sizes: tuple[int, ...]  # [count] env.group_size of each env.
  groups: tuple[int, ...]  # [count] GRPO group of each env (from env.group_ids()).


@dataclasses.dataclass(frozen=True)
class ResetDone:
  """Every env of the worker was reset; the observations are in shared memory."""
  instructions: tuple[str, ...]  # [count] in env-id order.
  finished_at: float  # time.monotonic() (one clock system-wide, so the parent can compare).


@dataclasses.dataclass(frozen=True, eq=False)
class EnvOutcome:
  """One env's result of one chunk: a row of :class:`protocol.ChunkStep` less the obs."""
  reward: float = 0.0
  terminated: bool = False
  truncated: bool = False
  success: bool = False
  steps: int = 0  # Actions executed (< H when the episode ended within the chunk).
  episodes: tuple[protocol.EpisodeStats, ...] = ()  # Episodes that ended, with global env ids.
  # The last observation (a batch of one) of an episode truncated by its time limit;
  # None otherwise (a restart's truncation has none: see ChunkStep.has_final_obs).
  final_obs: protocol.Observation | None = None

  @classmethod
  def lost(cls, episodes: tuple[protocol.EpisodeStats, ...]) -> EnvOutcome:
    """The outcome of a chunk cut short by a worker restart: truncated, no steps, no
    final observation (its return is not bootstrapped)."""
    return cls(truncated=True, episodes=tuple(episodes))


@dataclasses.dataclass(frozen=True)
class StepDone:
  """The envs of a :class:`Step` executed their chunks; their obs are in shared memory."""
  outcomes: tuple[EnvOutcome, ...]  # [b] in the order of Step.local_ids.
  instructions: tuple[str, ...]  # [b] instruction of each env's new observation.
  finished_at: float  # time.monotonic() at the end of the last env's chunk.


@dataclasses.dataclass(frozen=True)
class WorkerError:
  """A Python exception in a simulator (or in building the envs)."""
  env_ids: tuple[int, ...]  # Global ids of the env(s) it happened in.
  task: str
  traceback: str  # Formatted in the worker.


Reply = Started | ResetDone | StepDone | WorkerError


# ---------------------------------------------------------- shared memory --
@dataclasses.dataclass(frozen=True)
class SharedObs:
  """Where the pool's observations live: two shared-memory segments, one row per global env.

  Attributes:
    segments: names of the ``images`` and ``state`` segments.
    num_envs: rows of each array.
    image_shape: ``(N_cam, H, W, 3)`` of one env's images.
    state_dim: size of one env's state.
    critic_state_dim: size of its critic state, stored after the state in the same row.
  """
  segments: tuple[str, str]
  num_envs: int
  image_shape: tuple[int, ...]
  state_dim: int
  critic_state_dim: int = 0

  @classmethod
  def create(cls, num_envs: int, image_shape: tuple[int, ...], state_dim: int,
             critic_state_dim: int = 0) -> tuple[SharedObs, list[shared_memory.SharedMemory]]:
    """Creates the segments; the caller owns them (closes and unlinks them)."""
    sizes = (num_envs * math.prod(image_shape),
             num_envs * (state_dim + critic_state_dim) * 4)  # uint8, float32.
    shms = [shared_memory.SharedMemory(create=True, size=max(1, size)) for size in sizes]
    layout = cls(segments=(shms[0].name, shms[1].name), num_envs=num_envs,
                 image_shape=tuple(image_shape), state_dim=state_dim,
                 critic_state_dim=critic_state_dim)
    return layout, shms

  def attach(self) -> list[shared_memory.SharedMemory]:
    """Opens the segments created by :meth:`create` (in another process)."""
    return [shared_memory.SharedMemory(name=name) for name in self.segments]

  def views(self, shms: list[shared_memory.SharedMemory]) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [num_envs, *image_shape], state float32 [num_envs, state_dim +
    critic_state_dim])``: each row the state, then the critic state.

    The views must be dropped before the segments are closed.
    """
    images = np.ndarray((self.num_envs, *self.image_shape), np.uint8, buffer=shms[0].buf)
    state = np.ndarray((self.num_envs, self.state_dim + self.critic_state_dim), np.float32,
                       buffer=shms[1].buf)
    return images, state


# ----------------------------------------------------------------- worker --
def _task_name(env: Any) -> str:
  return str(getattr(env, "task_name", type(env).__name__))


class _WorkerEnvs:
  """The envs of one worker and the shared-memory rows they write their observations to."""

  def __init__(self, env_ids: tuple[int, ...], envs: list[protocol.VecEnv], images: np.ndarray,
               state: np.ndarray):
    self.env_ids, self.envs = env_ids, envs
    self._images, self._state = images, state
    # The env(s) a simulator exception is blamed on: the one being run when it was raised.
    self._current = env_ids

  def started(self) -> Started:
    """The reply announcing the built envs."""
    return Started(spec=self.envs[0].spec, task=_task_name(self.envs[0]),
                   group_sizes=tuple(int(env.group_size) for env in self.envs),
                   groups=tuple(int(np.asarray(env.group_ids())[0]) for env in self.envs))

  def run(self, command: Reset | Step) -> ResetDone | StepDone:
    """Executes ``command``; its observations go to shared memory, the rest is returned."""
    self._current = self.env_ids
    if isinstance(command, Reset):
      return self._reset(command)
    if isinstance(command, Step):
      return self._step(command)
    raise TypeError(f"unknown command {command!r}")

  def error(self) -> WorkerError:
    """The exception being handled, blamed on the env that raised it."""
    task = _task_name(self.envs[self.env_ids.index(self._current[0])])
    return WorkerError(env_ids=self._current, task=task, traceback=traceback.format_exc())

  def close(self) -> None:
    """Closes the envs and drops the views (so that the segments can close)."""
    for env in self.envs:
      env.close()
    self._images = self._state = None

  def _reset(self, command: Reset) -> ResetDone:
    instructions = []
    for j, env in enumerate(self.envs):
      self._current = (self.env_ids[j],)
      obs = env.reset(command.seed,
                      first_episode=np.array(command.first_episode[j:j + 1], np.int64))
      instructions.append(self._write(j, obs))
    return ResetDone(instructions=tuple(instructions), finished_at=time.monotonic())

  def _step(self, command: Step) -> StepDone:
    outcomes, instructions = [], []
    for k, j in enumerate(command.local_ids):
      env_id = self.env_ids[j]
      self._current = (env_id,)
      out = self.envs[j].step_chunk(command.actions[k:k + 1])
      instructions.append(self._write(j, out.obs))
      outcomes.append(EnvOutcome(
          reward=float(out.reward[0]), terminated=bool(out.terminated[0]),
          truncated=bool(out.truncated[0]), success=bool(out.success[0]),
          steps=int(out.steps[0]),
          episodes=tuple(dataclasses.replace(e, env_id=env_id) for e in out.episodes),
          final_obs=out.final_obs if out.has_final_obs[0] else None))
    return StepDone(outcomes=tuple(outcomes), instructions=tuple(instructions),
                    finished_at=time.monotonic())

  def _write(self, j: int, obs: protocol.Observation) -> str:
    """Writes local env ``j``'s observation (a batch of one) to its row; returns its text."""
    row = self.env_ids[j]
    self._images[row] = obs.images[0]
    self._state[row] = np.concatenate([obs.state[0], obs.critic_state[0]])
    return str(obs.instruction[0])


def _build(env_fn: EnvFn, env_ids: tuple[int, ...], build_seed: int) -> list[protocol.VecEnv]:
  """Builds each env alone, as global env ``i`` (so it knows its group and episodes)."""
  envs = []
  try:
    for i in env_ids:
      envs.append(env_fn(i, 1, env_seed(build_seed, i)))
  except BaseException:
    for env in envs:
      env.close()
    raise
  return envs


def _serve(conn: connection.Connection, envs: _WorkerEnvs) -> None:
  """Answers commands until :class:`Close` or until the parent is gone."""
  while True:
    try:
      command = conn.recv()
    except EOFError:  # The parent is gone.
      return
    if isinstance(command, Close):
      return
    try:
      conn.send(envs.run(command))
    except Exception:  # Reported to the parent, which raises it.
      conn.send(envs.error())


def worker_main(conn: connection.Connection, env_fn: EnvFn, first_env_id: int, count: int,
                build_seed: int, obs: SharedObs) -> None:
  """Worker process: owns global envs ``first_env_id .. first_env_id + count - 1``.

  Env ``first_env_id + j`` is built alone by ``env_fn(first_env_id + j, 1, seed)``
  and reports its global group and episode numbers itself. Sends :class:`Started`
  (or a :class:`WorkerError` if the build fails), then answers commands.
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
  env_ids = tuple(range(first_env_id, first_env_id + count))
  shms = obs.attach()
  envs = None
  try:
    try:
      envs = _WorkerEnvs(env_ids, _build(env_fn, env_ids, build_seed), *obs.views(shms))
      started = envs.started()
    except Exception:  # Reported to the parent, which raises it.
      conn.send(WorkerError(env_ids=env_ids, task=type(env_fn).__name__,
                            traceback=traceback.format_exc()))
      return
    conn.send(started)
    _serve(conn, envs)
  finally:
    if envs is not None:
      envs.close()
    for shm in shms:
      shm.close()
