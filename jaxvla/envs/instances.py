"""The chunk loop shared by adapters that own ``count`` single-env simulator instances.

ManiSkill3's CPU backend and LIBERO both simulate one env per instance. An
adapter subclasses :class:`InstanceBatch` and supplies only what is simulator
specific: resetting one instance, stepping it once, and building observations.
This class owns the rest of the VecEnv contract: action checks, executing a chunk
per instance until its episode ends, per-episode book-keeping, auto-reset.
"""

from __future__ import annotations

import numpy as np

from jaxvla.envs import protocol


class InstanceBatch:
  """Base class. Subclasses set ``num_envs``, ``spec``, ``_envs`` and ``_seed``.

  Subclass hooks:
    _reset_one(i) -> raw observation: starts instance ``i``'s next episode
      (``self._episode[i]`` is its episode number).
    _step_one(i, action [A]) -> (raw obs, reward, terminated, truncated, success):
      one env step; ``self.t[i]`` already counts it.
    _map_actions(actions [B, H, A]) -> [B, H, A]: policy actions to the
      simulator's (default: clip to ``[-1, 1]``).
    observe() -> Observation from ``self._last`` (raw observations, one per env).
  """

  num_envs: int
  spec: protocol.EnvSpec
  _envs: list
  _seed: int

  def _reset_all(self) -> None:
    """Starts a fresh episode in every instance and clears the book-keeping."""
    self._episode = np.zeros(self.num_envs, np.int64)
    self.t = np.zeros(self.num_envs, np.int32)
    self.ep_return = np.zeros(self.num_envs, np.float32)
    self._last = [None] * self.num_envs
    for i in range(self.num_envs):
      self._new_episode(i)

  def _new_episode(self, i: int) -> None:
    self._last[i] = self._reset_one(i)
    self._episode[i] += 1
    self.t[i], self.ep_return[i] = 0, 0.0

  def _map_actions(self, actions: np.ndarray) -> np.ndarray:
    return np.clip(actions, -1.0, 1.0)

  def reset(self, seed: int) -> protocol.Observation:
    self._seed = seed
    self._reset_all()
    return self.observe()

  def step_chunk(self, actions: np.ndarray) -> protocol.ChunkStep:
    actions = self._map_actions(
        protocol.check_actions(actions, self.num_envs, self.spec.action_dim))
    n = self.num_envs
    reward, steps = np.zeros(n, np.float32), np.zeros(n, np.int32)
    terminated, truncated, success = (np.zeros(n, bool) for _ in range(3))
    episodes = []
    for i in range(n):
      for a in actions[i]:
        self.t[i] += 1
        steps[i] += 1
        self._last[i], r, term, trunc, succ = self._step_one(i, a)
        reward[i] += r
        success[i] = succ
        if term or trunc:
          terminated[i], truncated[i] = term, trunc and not term
          break
      self.ep_return[i] += reward[i]
      if terminated[i] or truncated[i]:
        episodes.append(protocol.EpisodeStats(
            env_id=i, episode_return=float(self.ep_return[i]), length=int(self.t[i]),
            success=bool(success[i]), truncated=bool(truncated[i])))
        self._new_episode(i)
    success &= terminated | truncated  # success is reported when the episode ends
    return protocol.ChunkStep(obs=self.observe(), reward=reward, terminated=terminated,
                              truncated=truncated, success=success, steps=steps,
                              episodes=episodes)

  def close(self) -> None:
    for env in self._envs:
      env.close()
