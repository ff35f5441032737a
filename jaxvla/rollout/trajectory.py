"""The trajectory type passed from rollout to the learner."""

from __future__ import annotations

import jax
import numpy as np
from flax import struct


@struct.dataclass
class Trajectory:
  """``T`` chunk steps of ``B`` envs, time-major, in host memory.

  Attributes:
    batch: policy inputs (``Policy.prepare``) of each step, arrays ``[T, B, ...]``.
    chain: ``[T, B, K + 1, H, A]`` stored sampler chains.
    log_prob: ``[T, B]`` behaviour log-probabilities of the chains.
    value: ``[T, B]`` behaviour values.
    reward: ``[T, B]`` chunk rewards.
    done: ``[T, B]`` episode ended in the step (terminated or truncated).
    steps: ``[T, B]`` env steps executed in the step.
    bootstrap_value: ``[B]`` value after the last step.
    policy_version: ``int32 [T, B]`` version of the parameters that produced each chunk
      (one version per chunk; asynchronous rollout may switch between chunks).
  """
  batch: dict
  chain: np.ndarray
  log_prob: np.ndarray
  value: np.ndarray
  reward: np.ndarray
  done: np.ndarray
  steps: np.ndarray
  bootstrap_value: np.ndarray
  policy_version: np.ndarray

  @property
  def num_env_steps(self) -> int:
    return int(np.sum(self.steps))


def stack_steps(steps: list[dict]) -> dict:
  """Stacks per-step pytrees ``[B, ...]`` into time-major ``[T, B, ...]``."""
  return jax.tree.map(lambda *xs: np.stack(xs), *steps)
