"""A VecEnv seen through a run's state/action normalisation (the policy's side of the env).

:func:`wrap` returns ``env`` itself when there is no normalisation; otherwise a
wrapper whose observations carry normalised state and critic state (``obs`` and
``final_obs`` of every result) and whose ``step_chunk`` / ``send`` take the policy's normalised
actions and un-normalise them before the env clips them to ``[-1, 1]``. The
rollout, the learner and evaluation then work in the policy's space only. An
env pool stays an :class:`protocol.AsyncVecEnv` (``send`` / ``recv``); anything
else (``spec``, ``stats``, ``group_ids``, ``close``, ...) is the env's own.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jaxvla.envs import protocol


class Transform(Protocol):
  """What the wrapper applies (:class:`jaxvla.data.norm_stats.Normalizer` is one)."""

  def state(self, x: np.ndarray) -> np.ndarray:
    """Env state ``[..., S]`` -> the policy's input."""

  def actions(self, a: np.ndarray) -> np.ndarray:
    """The policy's actions ``[..., A]`` -> the env's."""

  def critic_state(self, x: np.ndarray) -> np.ndarray:
    """The env's critic state ``[..., C]`` -> the value head's input."""


class NormalizedEnv:
  """``env`` with normalised state in and un-normalised actions out (see module doc)."""

  def __init__(self, env: protocol.VecEnv, transform: Transform):
    self.env, self.transform = env, transform

  def __getattr__(self, name: str):
    return getattr(self.env, name)  # (only reached for what this class does not define)

  def _obs(self, obs: protocol.Observation) -> protocol.Observation:
    if obs.batch_size == 0:
      return obs
    return dataclasses.replace(obs, state=self.transform.state(obs.state),
                               critic_state=self.transform.critic_state(obs.critic_state))

  def _result(self, result: protocol.ChunkStep) -> protocol.ChunkStep:
    return dataclasses.replace(result, obs=self._obs(result.obs),
                               final_obs=self._obs(result.final_obs))

  def reset(self, seed: int, first_episode: np.ndarray | None = None) -> protocol.Observation:
    return self._obs(self.env.reset(seed, first_episode))

  def step_chunk(self, actions: np.ndarray) -> protocol.ChunkStep:
    return self._result(self.env.step_chunk(self.transform.actions(np.asarray(actions))))


class NormalizedAsyncEnv(NormalizedEnv):
  """:class:`NormalizedEnv` of an :class:`protocol.AsyncVecEnv`."""

  def send(self, actions: np.ndarray, env_ids: np.ndarray) -> None:
    self.env.send(self.transform.actions(np.asarray(actions)), env_ids)

  def recv(self, b_max: int, t_max_s: float) -> tuple[np.ndarray, protocol.ChunkStep]:
    env_ids, result = self.env.recv(b_max, t_max_s)
    return env_ids, self._result(result)

  def recv_ids(self, env_ids: np.ndarray) -> tuple[np.ndarray, protocol.ChunkStep]:
    env_ids, result = self.env.recv_ids(env_ids)
    return env_ids, self._result(result)


def wrap(env: protocol.VecEnv, transform: Transform | None) -> protocol.VecEnv:
  """``env`` seen through ``transform`` (``env`` itself when ``transform`` is None)."""
  if transform is None:
    return env
  if isinstance(env, protocol.AsyncVecEnv):
    return NormalizedAsyncEnv(env, transform)
  return NormalizedEnv(env, transform)
