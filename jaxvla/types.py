"""The data that travels from the rollout through the queue to the learner.

A leaf module: it imports nothing from jaxvla, so every stage of the data path
(rollout -> queue -> learner) can import it without importing the others.

* :class:`Trajectory` ``[T, B]``: PPO's env segments (GAE needs the bootstrap, and
  the final values of episodes truncated by the time limit).
* :class:`EpisodeBatch` ``[K, E]``: GRPO's whole episodes, padded to ``K`` chunks.
* :class:`Item`: one queue entry (either of the two, with its chunks' versions).
* :class:`Closed`: raised by the thread primitives (queue, pacer) once closed.

Both payload types declare their *env axis* per field (:meth:`Trajectory.env_axes`),
so that concatenating batches (:func:`concat`), stacking segments (:func:`stack`)
and choosing the learner's data shardings are tree operations over one
declaration instead of field-by-field code.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple, Sequence, TypeVar

import jax
import numpy as np
from flax import struct


class Counts(NamedTuple):
  """Rollout data in the ledger's units (``jaxvla.runtime.ledger``), by name, so that no
  caller depends on an order. ``segments``: PPO segments or GRPO episodes (what is in
  flight in a builder); the ledger itself counts env steps and chunks."""
  env_steps: int = 0
  chunks: int = 0
  segments: int = 0


class Closed(Exception):
  """A queue or pacer was closed while (or before) a caller waited on it."""


@struct.dataclass
class Trajectory:
  """``T`` chunk steps of ``B`` envs, time-major, in host memory.

  Attributes:
    batch: policy inputs (``Policy.prepare``) of each step, arrays ``[T, B, ...]``.
    chain: ``[T, B, K + 1, H, A]`` stored sampler chains.
    log_prob: ``[T, B]`` behaviour log-probabilities of the chains.
    log_prob_dims: ``[T, B, H, A_net]`` the same per action dimension (summed over the
      sampler's steps; 0 on padded dims), what a per-term ratio (``rl.ratio``) needs.
    value: ``[T, B]`` behaviour values.
    reward: ``[T, B]`` chunk rewards.
    done: ``[T, B]`` episode ended in the step (terminated or truncated): GAE's
      recursion is cut there.
    terminated: ``bool [T, B]`` ... by success or failure: no future to bootstrap.
    final_value: ``float32 [T, B]`` where an episode was truncated by its time limit,
      the value of its last observation (its return's bootstrap; computed with
      ``bootstrap_value``, at the segment's end); 0 elsewhere, and for an episode
      lost to a worker fault (no final observation: not bootstrapped).
    steps: ``[T, B]`` env steps executed in the step.
    bootstrap_value: ``[B]`` value after the last step.
    policy_version: ``int32 [T, B]`` version of the parameters that produced each
      chunk (one version per chunk; an asynchronous rollout may switch between chunks).
  """
  batch: dict
  chain: np.ndarray
  log_prob: np.ndarray
  log_prob_dims: np.ndarray
  value: np.ndarray
  reward: np.ndarray
  done: np.ndarray
  terminated: np.ndarray
  final_value: np.ndarray
  steps: np.ndarray
  bootstrap_value: np.ndarray
  policy_version: np.ndarray

  @classmethod
  def env_axes(cls) -> "Trajectory":
    """The env axis of every field (a tree prefix of any ``Trajectory``)."""
    return cls(batch=1, chain=1, log_prob=1, log_prob_dims=1, value=1, reward=1, done=1,
               terminated=1, final_value=1, steps=1, bootstrap_value=0, policy_version=1)

  @property
  def num_env_steps(self) -> int:
    return int(np.sum(self.steps))

  @property
  def num_rows(self) -> int:
    """Rows the learner trains on: chunks ``T * B``."""
    return int(np.size(self.log_prob))


@struct.dataclass
class EpisodeBatch:
  """``E`` whole episodes padded to ``K`` chunks, chunk-major, in host memory.

  Attributes:
    batch: policy inputs (``Policy.prepare``) of each chunk, arrays ``[K, E, ...]``.
    chain: ``[K, E, ...]`` stored sampler chains.
    log_prob: ``[K, E]`` behaviour log-probabilities (0 on padding).
    log_prob_dims: ``[K, E, H, A_net]`` the same per action dimension (0 on padding).
    mask: ``bool [K, E]`` the chunk was played (False: padding).
    advantage: ``float32 [E]`` group-normalised advantage of each episode (0 for
      an episode lost to a worker restart, which its group's statistics leave out).
    episode_return: ``float32 [E]`` episode returns (from the env's EpisodeStats).
    group: ``int32 [E]`` GRPO group of each episode.
    episode: ``int32 [E]`` episode number ``k`` (``(group, episode)`` fixes the init).
    policy_version: ``int32 [K, E]`` version that produced each chunk (padding
      repeats the last chunk's).
    steps: ``int32 [K, E]`` env steps each chunk executed (0 on padding).
  """
  batch: dict
  chain: np.ndarray
  log_prob: np.ndarray
  log_prob_dims: np.ndarray
  mask: np.ndarray
  advantage: np.ndarray
  episode_return: np.ndarray
  group: np.ndarray
  episode: np.ndarray
  policy_version: np.ndarray
  steps: np.ndarray

  @classmethod
  def env_axes(cls) -> "EpisodeBatch":
    """The episode axis of every field (a tree prefix of any ``EpisodeBatch``)."""
    return cls(batch=1, chain=1, log_prob=1, log_prob_dims=1, mask=1, advantage=0,
               episode_return=0, group=0, episode=0, policy_version=1, steps=1)

  @property
  def num_episodes(self) -> int:
    return self.log_prob.shape[1]

  @property
  def num_env_steps(self) -> int:
    return int(np.sum(self.steps))

  @property
  def num_rows(self) -> int:
    """Rows the learner trains on: episodes ``E``."""
    return self.num_episodes


Batch = TypeVar("Batch", Trajectory, EpisodeBatch)


def concat(parts: Sequence[Batch]) -> Batch:
  """Batches with envs (episodes) ``B_i`` -> one batch of ``sum B_i`` along the env axis."""
  if not parts:
    raise ValueError("concat needs at least one Trajectory or EpisodeBatch")
  return _along_env_axes(np.concatenate, parts)


def stack(parts: Sequence[Batch]) -> Batch:
  """Single-env batches (no env axis) -> one batch with a new env axis of ``len(parts)``."""
  if not parts:
    raise ValueError("stack needs at least one Trajectory or EpisodeBatch")
  return _along_env_axes(np.stack, parts)


def _along_env_axes(join, parts: Sequence[Batch]) -> Batch:
  """``join(leaves, axis=env axis)`` of every field (a subtree such as ``batch`` leaf-wise)."""
  def field(axis, *subtrees):
    return jax.tree.map(lambda *xs: join(xs, axis=axis), *subtrees)
  return jax.tree.map(field, type(parts[0]).env_axes(), *parts)


def env_axis_tree(cls: type, per_axis: dict[int, Any]) -> Any:
  """``cls.env_axes()`` with each axis replaced by ``per_axis[axis]`` (e.g. a sharding)."""
  return jax.tree.map(lambda axis: per_axis[axis], cls.env_axes())


@dataclasses.dataclass
class Item:
  """One unit of rollout data in the trajectory queue.

  Attributes:
    data: the payload: a ``Trajectory [T, M]`` of ``M`` env segments (PPO) or an
      ``EpisodeBatch [K, G]`` of one GRPO group.
    versions: ``[...]`` int policy version of every played chunk in ``data``.
    num_chunks: chunks in the item (padding excluded).
    num_env_steps: env steps the chunks executed.
    num_segments: the env segments (PPO) or episodes (GRPO) it holds: the unit the
      pacer counts starts in.
    created: ``time.perf_counter()`` when it was made.
    seq: its number in the order the rollout made items (from 0 in each session; the
      schedule log names items by it), -1 before the rollout hands it on.
  """
  data: Any
  versions: np.ndarray
  num_chunks: int
  num_env_steps: int
  num_segments: int = 1
  created: float = dataclasses.field(default_factory=time.perf_counter)
  seq: int = -1

  @property
  def oldest_version(self) -> int:
    return int(np.min(self.versions))
