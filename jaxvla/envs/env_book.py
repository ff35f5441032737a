"""The pool's per-env bookkeeping: where each env stands, its waiting result, its episodes.

This file owns the parent's record of every env of an :class:`jaxvla.envs.pool.EnvPool`
(:class:`EnvBook`): its :class:`EnvState`, the result that waits to be returned
by ``recv``, the fault a worker restart left for it, and its episode counters;
and turns the results handed out into a :class:`protocol.ChunkStep`
(:func:`chunk_step`, :func:`in_env_order`). It knows nothing of processes: the
pool tells it what happened (a reset, a chunk sent, a result received, a worker
restarted).

Episode numbers: the parent counts each env's episodes, so that a restarted
worker's fresh envs continue from their next episode number (the lost episode
``k`` is reported truncated, the fresh env starts ``k + 1``) and the members of a
GRPO group stay aligned across restarts.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterable, Sequence

import numpy as np

from jaxvla.envs import protocol, worker
from jaxvla.errors import ReplayMismatch


class EnvState(enum.Enum):
  """Where one env of the pool stands between the caller and its worker."""
  NEW = "new"  # Not reset yet (or being reset): a restart loses no episode of it.
  IDLE = "idle"  # The caller holds its latest observation; it may be sent a chunk.
  IN_FLIGHT = "in flight"  # A chunk was sent to its worker; no result yet.
  READY = "ready"  # Its result arrived and waits to be returned by recv().


@dataclasses.dataclass(frozen=True)
class Ready:
  """One env's outcome, waiting in the parent to be returned by ``recv``."""
  ready_at: float  # time.monotonic() at which the worker finished (or the fault was seen).
  outcome: worker.EnvOutcome
  # The env's episode counters before this outcome was recorded ``(episode, return,
  # length)``: a replay that must lose this chunk, as the recorded run did, restores them.
  before: tuple[int, float, int] | None = None


class EnvBook:
  """Per-env bookkeeping of the pool: states, results waiting for ``recv``, episode counters.

  Knows nothing of processes: the pool tells it what happened (a reset, a chunk
  sent, a result received, a worker restarted) and takes the ready results.
  """

  def __init__(self, num_envs: int):
    self.state = [EnvState.NEW] * num_envs
    self.ready: dict[int, Ready] = {}
    # Idle envs whose episode a restart ended: reported as the result of their next send.
    self.lost: dict[int, worker.EnvOutcome] = {}
    self.instruction = np.full(num_envs, "", dtype=object)  # [num_envs] of the latest obs.
    self.episode = np.zeros(num_envs, np.int64)  # Number k of each env's current episode.
    self._ep_return = np.zeros(num_envs, np.float64)
    self._ep_length = np.zeros(num_envs, np.int64)
    # The GRPO layout, read from the workers' envs as they start (check_groups): G, and
    # each env's group, which the episodes a restart cuts short are reported in.
    self.group_size = 0
    self.groups = np.zeros(num_envs, np.int64)

  def check_groups(self, who: str, env_ids: range, group_sizes: Sequence[int],
                   groups: Sequence[int]) -> None:
    """Checks the ``env.group_size`` and groups reported by ``env_ids``' envs (built by
    ``who``, named in errors); the first report sets the layout.

    Raises:
      ValueError: naming ``env.group_size`` if it does not divide the envs, or the
        envs if their groups are not those of their global ids.
    """
    sizes, groups, num_envs = list(group_sizes), list(groups), len(self.state)
    if not self.group_size:  # The first worker to answer sets the pool's groups.
      protocol.group_layout(sizes[0], num_envs)  # ValueError naming env.group_size.
      self.group_size = sizes[0]
      self.groups = np.arange(num_envs, dtype=np.int64) // self.group_size
    expected = self.groups[list(env_ids)].tolist()
    if any(g != self.group_size for g in sizes) or groups != expected:
      raise ValueError(
          f"{who} built env ids {list(env_ids)} in groups "
          f"{groups} with env.group_size={sizes}, but the pool expects groups {expected} "
          f"(env.group_size={self.group_size}): env_fn(first_env_id, 1, seed) must build "
          f"global env first_env_id of num_envs={num_envs}")

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

  def check_sendable(self, env_ids: np.ndarray) -> np.ndarray:
    """``env_ids`` ``[b]`` as an array, once checked that each env may be sent a chunk.

    Raises:
      ValueError: not a 1-D integer array, an unknown or repeated env id, or an env
        whose previous chunk has not been received yet.
    """
    env_ids, num_envs = np.asarray(env_ids), len(self.state)
    if env_ids.ndim != 1 or not np.issubdtype(env_ids.dtype, np.integer):
      raise ValueError(f"env_ids must be a 1-D integer array, got {env_ids.dtype} "
                       f"{env_ids.shape}")
    bad = env_ids[(env_ids < 0) | (env_ids >= num_envs)]
    if bad.size:
      raise ValueError(f"unknown env ids {bad.tolist()} (pool has ids 0..{num_envs - 1})")
    if np.unique(env_ids).size != env_ids.size:
      raise ValueError(f"env ids repeated in one send: {env_ids.tolist()}")
    busy = [int(i) for i in env_ids if self.state[i] is not EnvState.IDLE]
    if busy:
      raise ValueError(f"env ids {busy} already have a chunk in flight or a result not "
                       "received yet")
    return env_ids

  def in_flight_and_ready(self, env_ids: Iterable[int]) -> tuple[list[int], list[int]]:
    """``(in flight, ready)``: which of ``env_ids`` have a chunk under way, which a result."""
    states = [(i, self.state[i]) for i in env_ids]
    return ([i for i, s in states if s is EnvState.IN_FLIGHT],
            [i for i, s in states if s is EnvState.READY])

  def check_recorded_restart(self, worker_index: int, env_ids: range, lost: set[int],
                             kept: set[int]) -> None:
    """Checks that of worker ``worker_index``'s ``env_ids``, those with a chunk in flight
    or a result are ``lost`` and ``kept``: those of a recorded run's restart.

    Raises:
      ReplayMismatch: naming the first env that stands otherwise here.
    """
    for i in env_ids:
      state = self.state[i]
      if (i in lost or i in kept) != (state in (EnvState.IN_FLIGHT, EnvState.READY)):
        raise ReplayMismatch(
            f"worker {worker_index}'s recorded restart: env {i} was "
            f"{'in flight' if i in lost else 'ready' if i in kept else 'idle'} then, "
            f"and is {state.value} in the replay")

  def check_recorded_recv(self, env_ids: list[int]) -> None:
    """Checks that each of ``env_ids``, which a recorded run received, has a chunk in
    flight or a result here.

    Raises:
      ReplayMismatch: naming the envs that have neither.
    """
    idle = [i for i in env_ids if self.state[i] not in (EnvState.IN_FLIGHT, EnvState.READY)]
    if idle:
      raise ReplayMismatch(f"env ids {idle} were received by the recorded run, but have no "
                           "chunk in flight here")

  def start_chunk(self, env_id: int, now: float) -> bool:
    """Marks ``env_id`` sent a chunk; returns whether its worker must step it.

    An env whose episode a restart ended does not step: the fault is its result.
    """
    if env_id in self.lost:
      self.ready[env_id] = Ready(ready_at=now, outcome=self.lost.pop(env_id))
      self.state[env_id] = EnvState.READY
      return False
    self.state[env_id] = EnvState.IN_FLIGHT
    return True

  def record(self, env_id: int, outcome: worker.EnvOutcome, instruction: str,
             ready_at: float) -> None:
    """Stores a worker's result for ``env_id`` and advances its episode counters."""
    before = (int(self.episode[env_id]), float(self._ep_return[env_id]),
              int(self._ep_length[env_id]))
    self.ready[env_id] = Ready(ready_at=ready_at, outcome=outcome, before=before)
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

  def worker_restarted(self, env_ids: range, now: float) -> int:
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
      lost = self._end_episode(i, int(self.groups[i]), in_flight=state is EnvState.IN_FLIGHT)
      num_lost += len(lost)
      if state is EnvState.READY:  # Its obs row is about to be overwritten.
        # A result that ended its episode lost none and keeps its final observation;
        # one that did not has none: the lost episode is not bootstrapped.
        r = self.ready[i]
        outcome = dataclasses.replace(r.outcome, truncated=True,
                                      episodes=r.outcome.episodes + lost)
        self.ready[i] = Ready(ready_at=r.ready_at, outcome=outcome)
      elif state is EnvState.IN_FLIGHT:
        self.ready[i] = Ready(ready_at=now, outcome=worker.EnvOutcome.lost(lost))
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


def chunk_step(obs: protocol.Observation, outcomes: list[worker.EnvOutcome],
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


def in_env_order(parts: list[tuple[np.ndarray, protocol.ChunkStep]]) -> protocol.ChunkStep:
  """Concatenates ``recv`` results ``(env_ids, ChunkStep)`` covering every env once, by env id."""
  order = np.argsort(np.concatenate([ids for ids, _ in parts]))
  step = protocol.concat_chunk_steps([step for _, step in parts]).take(order)
  step.episodes.sort(key=lambda e: e.env_id)
  return step
