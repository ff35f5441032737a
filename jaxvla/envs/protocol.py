"""The environment contract every simulator adapter implements.

A jaxvla environment is a *batch* of ``num_envs`` independent episodes that is
stepped one **action chunk** at a time: the policy emits ``[B, H, A]`` actions,
the environment executes up to ``H`` of them per env (stopping early when the
episode ends), auto-resets finished envs, and reports what happened. One chunk
is one RL decision step; env steps are counted per executed action.

Observations have one structure whatever the simulator (:class:`Observation`):
images per camera, proprioceptive state, and the language instruction as text
(tokenisation belongs to the policy).

Episode ends: a *terminated* episode (success or failure) has no future; a
*truncated* one (time limit) was cut while it could still go on, so PPO's returns
bootstrap it from the value of its last observation. Auto-reset replaces that
observation in ``ChunkStep.obs``, so every env reports it in ``ChunkStep.final_obs``.

Group resets (GRPO): global env ``i`` of a run belongs to group ``i // G`` (``G``
is ``env.group_size``, which must divide the number of envs). Every env counts its
own episodes from 0, and its ``k``-th episode starts from an initial state that is
a function of ``(reset seed, group, k)`` only, so the ``k``-th episodes of all the
members of a group start alike, whenever each of them happens to auto-reset and
whichever process steps it. :class:`EpisodeStats` carries ``group`` and
``episode`` (``k``) so that a learner can gather each group's finished episodes.
With ``G = 1`` every env is its own group: all episodes differ.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """Static description of an environment batch.

  Attributes:
    camera_names: names of the cameras, in the order of ``Observation.images``.
    image_shape: ``(H, W, 3)`` of every camera image (uint8).
    state_dim: size of the proprioceptive state vector.
    action_dim: size of one action; actions are expected in ``[-1, 1]``.
    max_episode_steps: time limit in env steps (episodes are truncated there).
    critic_state_dim: size of ``Observation.critic_state`` (0: none).
  """
  camera_names: tuple[str, ...]
  image_shape: tuple[int, int, int]
  state_dim: int
  action_dim: int
  max_episode_steps: int
  critic_state_dim: int = 0


@dataclasses.dataclass
class Observation:
  """A batch of observations.

  Attributes:
    images: ``uint8 [B, N_cam, H, W, 3]``, cameras in ``EnvSpec.camera_names`` order.
    state: ``float32 [B, S]`` proprioceptive state.
    instruction: ``object [B]`` array of instruction strings.
    image_mask: ``bool [B, N_cam]``: whether each camera image is real. A masked
      camera (a placeholder where a robot or dataset has no such camera) is left out
      of the policy's attention and position numbering, as openpi masks one (its
      LIBERO setup masks pi0's right-wrist camera). ``None`` (the default) is read
      as every camera valid, which is what every simulator adapter reports.
    critic_state: ``float32 [B, C]``: privileged simulator state for the critic alone
      (asymmetric actor-critic, Pinto et al. 2018): the value head reads it, the
      policy's actions never do. ``None`` (the default) is read as ``[B, 0]``.
  """
  images: np.ndarray
  state: np.ndarray
  instruction: np.ndarray
  image_mask: np.ndarray | None = None
  critic_state: np.ndarray | None = None

  def __post_init__(self):
    if self.critic_state is None:
      self.critic_state = np.zeros((self.state.shape[0], 0), np.float32)
    if self.image_mask is None:
      self.image_mask = np.ones(self.images.shape[:2], bool)
    else:
      self.image_mask = np.asarray(self.image_mask, bool)
      if self.image_mask.shape != self.images.shape[:2]:
        raise ValueError(f"Observation.image_mask has shape {self.image_mask.shape}; "
                         f"the images need [B, N_cam] = {self.images.shape[:2]}")

  @property
  def batch_size(self) -> int:
    return self.state.shape[0]

  def take(self, idx: np.ndarray) -> "Observation":
    """Returns the sub-batch at integer indices ``idx`` ``[b]``."""
    return Observation(self.images[idx], self.state[idx], self.instruction[idx],
                       self.image_mask[idx], self.critic_state[idx])

  @classmethod
  def empty(cls, spec: EnvSpec) -> "Observation":
    """A batch of no observations shaped like ``spec``'s (``[0, ...]``)."""
    return cls(np.zeros((0, len(spec.camera_names), *spec.image_shape), np.uint8),
               np.zeros((0, spec.state_dim), np.float32), np.zeros((0,), object),
               critic_state=np.zeros((0, spec.critic_state_dim), np.float32))


def concat_observations(parts: list[Observation]) -> Observation:
  """The batches ``parts`` one after another (``[sum b_i, ...]``)."""
  if not parts:
    raise ValueError("concat_observations needs at least one Observation")
  return Observation(np.concatenate([p.images for p in parts]),
                     np.concatenate([p.state for p in parts]),
                     np.concatenate([p.instruction for p in parts]),
                     np.concatenate([p.image_mask for p in parts]),
                     np.concatenate([p.critic_state for p in parts]))


@dataclasses.dataclass
class EpisodeStats:
  """Book-keeping of one finished episode.

  Attributes:
    env_id: the env that played it (index in the batch; global id in a pool).
    group: the env's GRPO group (``env_id // group_size`` in a run's global ids).
    episode: the episode's number ``k`` in that env (from 0 at ``reset``). The
      ``k``-th episodes of a group's members start from the same initial state.
    episode_return: summed reward.
    length: env steps executed.
    success: ended in success.
    truncated: hit the time limit (or was lost to a worker restart).
    fault: lost to a worker restart (``truncated`` too): its return is not an
      outcome of the policy, so GRPO leaves it out of its group's statistics.
  """
  env_id: int
  group: int
  episode: int
  episode_return: float
  length: int
  success: bool
  truncated: bool
  fault: bool = False


@dataclasses.dataclass
class ChunkStep:
  """What one chunk step produced, per env.

  Attributes:
    obs: observation after the chunk; for envs whose episode ended, the first
      observation of the next (auto-reset) episode.
    reward: ``float32 [B]`` reward summed over the executed steps.
    terminated: ``bool [B]`` the episode ended by success or failure.
    truncated: ``bool [B]`` the episode hit the time limit (or, in an env pool, was
      lost to a worker restart).
    success: ``bool [B]`` the episode ended in success during this chunk.
    steps: ``int32 [B]`` env steps executed (``<= H``).
    episodes: stats of every episode that ended during this chunk.
    has_final_obs: ``bool [B]`` the episode was truncated by its time limit and
      ``final_obs`` holds its last observation. False for a truncation by a worker
      fault: that episode has no final observation, so its return is not
      bootstrapped (it is cut like a termination).
    final_obs: the last observations of those episodes (before the auto-reset),
      ``[n]`` for the ``n`` rows of ``np.flatnonzero(has_final_obs)``, in row order.
      Only the truncated rows are kept: a full batch would double the memory of
      every result (224 px cameras) for the few rows that need it. A truncated
      return is bootstrapped from its value.
  """
  obs: Observation
  reward: np.ndarray
  terminated: np.ndarray
  truncated: np.ndarray
  success: np.ndarray
  steps: np.ndarray
  episodes: list[EpisodeStats]
  has_final_obs: np.ndarray
  final_obs: Observation

  @property
  def done(self) -> np.ndarray:
    return np.logical_or(self.terminated, self.truncated)

  def take(self, idx: np.ndarray) -> "ChunkStep":
    """The rows at integer indices ``idx`` ``[b]``, ``final_obs`` following them.

    ``episodes`` is kept whole: its stats name env ids, not rows (a caller that
    drops rows filters them itself).
    """
    idx = np.asarray(idx, np.int64)
    return ChunkStep(obs=self.obs.take(idx), reward=self.reward[idx],
                     terminated=self.terminated[idx], truncated=self.truncated[idx],
                     success=self.success[idx], steps=self.steps[idx],
                     episodes=list(self.episodes), has_final_obs=self.has_final_obs[idx],
                     final_obs=self.final_obs.take(final_obs_index(self.has_final_obs, idx)))


def final_obs_index(has_final_obs: np.ndarray, rows: np.ndarray) -> np.ndarray:
  """``int64 [n]``: where in ``final_obs`` the rows ``rows`` ``[b]`` that have one are."""
  position = np.cumsum(has_final_obs, dtype=np.int64) - 1  # [B] its index, where it has one.
  rows = np.asarray(rows, np.int64)
  return position[rows[has_final_obs[rows]]]


def concat_chunk_steps(parts: list[ChunkStep]) -> ChunkStep:
  """The results ``parts`` one after another (``[sum b_i]`` rows, episodes in order)."""
  if not parts:
    raise ValueError("concat_chunk_steps needs at least one ChunkStep")
  cat = lambda name: np.concatenate([getattr(p, name) for p in parts])
  return ChunkStep(
      obs=concat_observations([p.obs for p in parts]), reward=cat("reward"),
      terminated=cat("terminated"), truncated=cat("truncated"), success=cat("success"),
      steps=cat("steps"), episodes=[e for p in parts for e in p.episodes],
      has_final_obs=cat("has_final_obs"),
      final_obs=concat_observations([p.final_obs for p in parts]))


class VecEnv(Protocol):
  """A batch of environments stepped by action chunks, with auto-reset."""

  spec: EnvSpec
  num_envs: int
  group_size: int  # G: envs i // G (global ids) share each episode's initial state.

  def group_ids(self) -> np.ndarray:
    """``int64 [B]``: the GRPO group of each env (``global env id // group_size``)."""

  def reset(self, seed: int, first_episode: np.ndarray | None = None) -> Observation:
    """Resets every env; env ``i``'s ``k``-th episode is fixed by ``(seed, group, k)``.

    Args:
      seed: episode seed (>= 0).
      first_episode: ``int [B]`` number ``k`` of each env's first episode after
        the reset (default 0; a pool restarting a worker continues its envs'
        numbering, so that their later episodes still match their group's).
    """

  def step_chunk(self, actions: np.ndarray) -> ChunkStep:
    """Executes ``actions`` ``float [B, H, A]`` (clipped to ``[-1, 1]``)."""

  def close(self) -> None:
    """Releases simulator resources."""


class WorkerStats(Protocol):
  """What the rollout reads of an :class:`AsyncVecEnv`'s counters."""
  worker_busy_s: float  # Seconds the workers spent stepping, summed over workers.
  restarts: int  # Worker processes restarted (died, hung or a simulator error).
  hung: int  # ... of which because a step command outlasted the hang timeout.
  truncated_by_fault: int  # Episodes cut short by those restarts.


@runtime_checkable
class AsyncVecEnv(VecEnv, Protocol):
  """A :class:`VecEnv` whose envs step in worker processes, driven first-ready.

  ``send`` hands chunks to some envs and returns at once; ``recv`` returns the
  envs that have finished theirs. The env pool (:class:`jaxvla.envs.pool.EnvPool`)
  implements it; ``step_chunk`` remains the lockstep path.
  """

  num_workers: int
  stats: WorkerStats

  def send(self, actions: np.ndarray, env_ids: np.ndarray) -> None:
    """Starts chunk ``actions`` ``float [b, H, A]`` on envs ``env_ids`` ``[b]`` (idle ones)."""

  def recv(self, b_max: int, t_max_s: float) -> tuple[np.ndarray, ChunkStep]:
    """``(env_ids [b'], ChunkStep [b'])`` of finished envs: returns once ``b_max`` are
    ready or ``t_max_s`` after the first of them was."""


@runtime_checkable
class ReplayableEnv(Protocol):
  """An env whose worker schedule a run's schedule log can record and replay.

  The env pool (:class:`jaxvla.envs.pool.EnvPool`) implements it: recording, a
  listener is told of every worker restart; replaying, ``recv_ids`` returns exactly
  the envs the recorded run received and ``replay_restart`` restarts a worker where
  the recorded run's did. ``why`` is ``'died'``, ``'hung'`` or ``'failed'`` (the
  schedule log's strings).
  """

  def recv_ids(self, env_ids: np.ndarray) -> tuple[np.ndarray, ChunkStep]:
    """``(env_ids, ChunkStep)`` of exactly ``env_ids`` ``[b]``, in that order, once each
    has finished its chunk (a replay's ``recv``)."""

  def replay_restart(self, worker_index: int, why: str, in_flight: list[int],
                     ready: list[int]) -> None:
    """Restarts worker ``worker_index`` as a recorded run's restart did, which lost the
    chunks of env ids ``in_flight`` and found the results of ``ready`` arrived."""

  def set_restart_listener(
      self, listener: Callable[[int, str, list[int], list[int]], None] | None) -> None:
    """Calls ``listener(worker_index, why, in_flight, ready)`` before every worker restart."""


def group_layout(group_size: int, num_envs: int, first_env_id: int = 0,
                 total_envs: int | None = None) -> tuple[np.ndarray, int]:
  """The GRPO groups of a batch of envs.

  The batch's env ``j`` is global env ``first_env_id + j`` of ``total_envs``
  (default: the batch is the whole run, ``first_env_id`` 0), in group
  ``(first_env_id + j) // group_size``.

  Returns:
    ``(group ids int64 [num_envs], number of groups in the run)``.

  Raises:
    ValueError: naming ``env.group_size`` when it is not a positive divisor of
      the run's env count, or when the batch does not fit in the run.
  """
  total = num_envs if total_envs is None else int(total_envs)
  if (isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer))
      or group_size < 1):
    raise ValueError(f"config.env.group_size={group_size!r} must be an integer >= 1")
  group_size = int(group_size)
  if total % group_size:
    raise ValueError(f"config.env.group_size={group_size} must divide the number of envs "
                     f"(num_envs={total})")
  if total_envs is None and first_env_id != 0:
    raise ValueError(f"first_env_id={first_env_id} needs total_envs (the run's env count) "
                     "to place the batch's envs in their groups")
  if first_env_id < 0 or first_env_id + num_envs > total:
    raise ValueError(f"envs {first_env_id}..{first_env_id + num_envs - 1} are not all in "
                     f"0..{total - 1} (total_envs={total})")
  groups = (first_env_id + np.arange(num_envs, dtype=np.int64)) // group_size
  return groups, total // group_size


def check_first_episode(first_episode: np.ndarray | None, num_envs: int) -> np.ndarray:
  """``first_episode`` of :meth:`VecEnv.reset` as ``int64 [B]`` (zeros when None)."""
  if first_episode is None:
    return np.zeros(num_envs, np.int64)
  out = np.asarray(first_episode, np.int64).reshape(-1)
  if out.shape != (num_envs,) or (out < 0).any():
    raise ValueError(f"first_episode must be {num_envs} episode numbers >= 0, got "
                     f"{np.asarray(first_episode).tolist()}")
  return out.copy()


def check_actions(actions: np.ndarray, num_envs: int, action_dim: int) -> np.ndarray:
  """Validates a chunk of actions and returns it as float32 ``[B, H, A]``.

  Raises:
    ValueError: naming the expected and received shapes, or non-finite values.
  """
  actions = np.asarray(actions, dtype=np.float32)
  if actions.ndim != 3 or actions.shape[0] != num_envs or actions.shape[2] != action_dim:
    raise ValueError(
        f"actions must have shape [num_envs={num_envs}, chunk, action_dim={action_dim}], "
        f"got {actions.shape}")
  if not np.all(np.isfinite(actions)):
    bad = np.unique(np.nonzero(~np.isfinite(actions))[0])
    raise ValueError(f"actions contain NaN/inf for env ids {bad.tolist()}")
  return actions
