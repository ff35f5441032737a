"""The environment contract every simulator adapter implements.

A jaxvla environment is a *batch* of ``num_envs`` independent episodes that is
stepped one **action chunk** at a time: the policy emits ``[B, H, A]`` actions,
the environment executes up to ``H`` of them per env (stopping early when the
episode ends), auto-resets finished envs, and reports what happened. One chunk
is one RL decision step; env steps are counted per executed action.

Observations have one structure whatever the simulator (:class:`Observation`):
images per camera, proprioceptive state, and the language instruction as text
(tokenisation belongs to the policy).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

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
  """
  camera_names: tuple[str, ...]
  image_shape: tuple[int, int, int]
  state_dim: int
  action_dim: int
  max_episode_steps: int


@dataclasses.dataclass
class Observation:
  """A batch of observations.

  Attributes:
    images: ``uint8 [B, N_cam, H, W, 3]``, cameras in ``EnvSpec.camera_names`` order.
    state: ``float32 [B, S]`` proprioceptive state.
    instruction: ``object [B]`` array of instruction strings.
  """
  images: np.ndarray
  state: np.ndarray
  instruction: np.ndarray

  @property
  def batch_size(self) -> int:
    return self.state.shape[0]

  def take(self, idx: np.ndarray) -> "Observation":
    """Returns the sub-batch at integer indices ``idx`` ``[b]``."""
    return Observation(self.images[idx], self.state[idx], self.instruction[idx])


@dataclasses.dataclass
class EpisodeStats:
  """Book-keeping of one finished episode."""
  env_id: int
  episode_return: float
  length: int
  success: bool
  truncated: bool


@dataclasses.dataclass
class ChunkStep:
  """What one chunk step produced, per env.

  Attributes:
    obs: observation after the chunk; for envs whose episode ended, the first
      observation of the next (auto-reset) episode.
    reward: ``float32 [B]`` reward summed over the executed steps.
    terminated: ``bool [B]`` the episode ended by success or failure.
    truncated: ``bool [B]`` the episode hit the time limit.
    success: ``bool [B]`` the episode ended in success during this chunk.
    steps: ``int32 [B]`` env steps executed (``<= H``).
    episodes: stats of every episode that ended during this chunk.
  """
  obs: Observation
  reward: np.ndarray
  terminated: np.ndarray
  truncated: np.ndarray
  success: np.ndarray
  steps: np.ndarray
  episodes: list[EpisodeStats]

  @property
  def done(self) -> np.ndarray:
    return np.logical_or(self.terminated, self.truncated)


class VecEnv(Protocol):
  """A batch of environments stepped by action chunks, with auto-reset."""

  spec: EnvSpec
  num_envs: int

  def reset(self, seed: int) -> Observation:
    """Resets every env; env ``i`` draws its episodes from ``seed`` and ``i``."""

  def step_chunk(self, actions: np.ndarray) -> ChunkStep:
    """Executes ``actions`` ``float [B, H, A]`` (clipped to ``[-1, 1]``)."""

  def close(self) -> None:
    """Releases simulator resources."""


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
