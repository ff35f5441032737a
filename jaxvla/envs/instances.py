"""The chunk loop shared by adapters that own ``count`` single-env simulator instances.

ManiSkill3's CPU backend and LIBERO both simulate one env per instance. An
adapter subclasses :class:`InstanceBatch` and supplies only what is simulator
specific: resetting one instance, stepping it once, and building observations.
This class owns the rest of the VecEnv contract: action checks, executing a chunk
per instance until its episode ends, per-episode book-keeping, auto-reset, and
the GRPO groups: :meth:`InstanceBatch.episode_index` numbers env ``i``'s ``k``-th
episode ``seed + g + num_groups * k`` (``g`` its group), which the adapters turn
into a simulator seed (ManiSkill) or an init-state index (LIBERO), so the members
of a group start their ``k``-th episodes alike.
"""

from __future__ import annotations

import numpy as np

from jaxvla.envs import protocol


class InstanceBatch:
  """Base class. Subclasses set ``num_envs``, ``spec``, ``_envs`` and ``_seed``, and call
  :meth:`_init_groups` before :meth:`_reset_all`.

  Subclass hooks:
    _reset_one(i) -> raw observation: starts instance ``i``'s current episode
      (``self._episode[i]`` is its episode number; :meth:`episode_index` its index).
    _step_one(i, action [A]) -> (raw obs, reward, terminated, truncated, success):
      one env step; ``self.t[i]`` already counts it.
    _map_actions(actions [B, H, A]) -> [B, H, A]: policy actions to the
      simulator's (default: clip to ``[-1, 1]``).
    _observe(raw [b], env_ids [b]) -> Observation ``[b]``: raw observations of the
      instances ``env_ids`` as a batch.
      :meth:`observe` is that of ``self._last`` (each env's latest); a chunk also
      turns the last raw observation of a truncated episode into its ``final_obs``.
    _complete(i, raw) -> raw observation: ``raw`` (instance ``i``'s latest) made whole
      for the policy. Called only for the observations the policy reads: a reset's, a
      chunk's last, a truncated episode's final one. Default: ``raw`` as it is; an
      adapter whose steps skip the cameras inside a chunk renders them here.
  """

  num_envs: int
  spec: protocol.EnvSpec
  _envs: list
  _seed: int
  group_size: int
  num_groups: int  # Groups in the whole run (all workers of a pool).
  _groups: np.ndarray  # int64 [B] global group of each instance.

  def _init_groups(self, group_size: int, first_env_id: int, total_envs: int | None) -> None:
    """Places this batch's instances in the run's GRPO groups (see ``protocol.group_layout``)."""
    self._groups, self.num_groups = protocol.group_layout(group_size, self.num_envs,
                                                          first_env_id, total_envs)
    self.group_size = int(group_size)

  def group_ids(self) -> np.ndarray:
    """``int64 [B]``: the GRPO group of each env."""
    return self._groups.copy()

  def episode_index(self, i: int, episode: int | None = None) -> int:
    """``seed + group + num_groups * k`` of env ``i``'s episode ``k`` (default: current).

    Distinct for every (group, episode) of a run, the same for a group's members.
    """
    k = int(self._episode[i]) if episode is None else int(episode)
    return int(self._seed + self._groups[i] + self.num_groups * k)

  def _reset_all(self, first_episode: np.ndarray | None = None) -> None:
    """Starts a fresh episode in every instance and clears the book-keeping."""
    self._episode = protocol.check_first_episode(first_episode, self.num_envs)
    self.t = np.zeros(self.num_envs, np.int32)
    self.ep_return = np.zeros(self.num_envs, np.float32)
    self._last = [None] * self.num_envs
    for i in range(self.num_envs):
      self._new_episode(i)

  def _new_episode(self, i: int) -> None:
    """Starts episode ``self._episode[i]`` of instance ``i``."""
    self._last[i] = self._complete(i, self._reset_one(i))
    self.t[i], self.ep_return[i] = 0, 0.0

  def _complete(self, i: int, raw):  # pylint: disable=unused-argument
    return raw

  def _map_actions(self, actions: np.ndarray) -> np.ndarray:
    return np.clip(actions, -1.0, 1.0)

  def observe(self) -> protocol.Observation:
    """Every env's latest observation ``[B]``."""
    return self._observe(self._last, list(range(self.num_envs)))

  def reset(self, seed: int,
            first_episode: np.ndarray | None = None) -> protocol.Observation:
    self._seed = seed
    self._reset_all(first_episode)
    return self.observe()

  def step_chunk(self, actions: np.ndarray) -> protocol.ChunkStep:
    actions = self._map_actions(
        protocol.check_actions(actions, self.num_envs, self.spec.action_dim))
    n = self.num_envs
    reward, steps = np.zeros(n, np.float32), np.zeros(n, np.int32)
    terminated, truncated, success = (np.zeros(n, bool) for _ in range(3))
    episodes, final_obs = [], []
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
            env_id=i, group=int(self._groups[i]), episode=int(self._episode[i]),
            episode_return=float(self.ep_return[i]), length=int(self.t[i]),
            success=bool(success[i]), truncated=bool(truncated[i])))
        if truncated[i]:  # Converted now: the reset may reuse the simulator's buffers.
          final_obs.append(self._observe([self._complete(i, self._last[i])], [i]))
        self._episode[i] += 1  # Auto-reset: the env's own next episode.
        self._new_episode(i)
      else:  # The chunk's last observation: the one the policy reads next.
        self._last[i] = self._complete(i, self._last[i])
    success &= terminated | truncated  # success is reported when the episode ends
    return protocol.ChunkStep(
        obs=self.observe(), reward=reward, terminated=terminated, truncated=truncated,
        success=success, steps=steps, episodes=episodes, has_final_obs=truncated.copy(),
        final_obs=protocol.concat_observations(final_obs) if final_obs
        else protocol.Observation.empty(self.spec))

  def close(self) -> None:
    for env in self._envs:
      env.close()
