"""The GRPO side of the rollout: whole episodes, gathered into groups, as queue items.

GRPO's baseline is the group: env ``i`` is in group ``i // G`` and the ``k``-th
episodes of a group's ``G`` envs start alike (:mod:`jaxvla.envs.protocol`), so
those ``G`` episodes form one GRPO group and each one's advantage is its return
against theirs (:func:`jaxvla.algorithms.grpo.group_advantages`).

:class:`EpisodeBuilder` has :class:`jaxvla.rollout.segments.SegmentBuilder`'s
interface, so :class:`jaxvla.rollout.rollout.Rollout` drives either. It keeps,
per env, the chunks of its current episode; when a chunk ends the episode it
closes it with the env's :class:`EpisodeStats` and files it under
``(group, episode number)``. Group-mates finish at different times and an env
starts its next episode at once (auto-reset), so finished episodes wait there
until all ``G`` are in; the group then becomes one queue :class:`Item` holding
an :class:`EpisodeBatch` ``[K, G]``. GRPO bootstraps nothing: ``on_result``
never asks for values, and an episode's return is its own (a time-limit
truncation's final observation, ``ChunkStep.final_obs``, is not used).

Episodes are padded to ``K`` chunks (``K = ceil(max_episode_steps / chunk_len)``,
:func:`max_chunks_per_episode`): padding repeats the episode's last chunk's
inputs and chain (finite values for the policy to evaluate) with log-prob 0,
``mask`` False and 0 steps; losses give it weight 0.
"""

from __future__ import annotations

import math

import numpy as np

from jaxvla import types
from jaxvla.algorithms import grpo
from jaxvla.envs import protocol
from jaxvla.models import contract
from jaxvla.rollout.segments import rows, stack_time


def max_chunks_per_episode(max_episode_steps: int, chunk_len: int) -> int:
  """``K``: chunks of the longest episode, ``ceil(max_episode_steps / chunk_len)``."""
  return math.ceil(max_episode_steps / chunk_len)


class EpisodeBuilder:
  """Per-env chunk records -> one ``EpisodeBatch [K, G]`` item per finished group.

  Args:
    num_envs: envs of the batch (ids ``0..num_envs - 1``, the run's global ids).
    group_size: ``G`` (``env.group_size``); env ``i`` is in group ``i // G``.
    max_chunks: ``K``, chunks of the longest episode (:func:`max_chunks_per_episode`).
    scale: divide advantages by the group's return std (False: Dr. GRPO's ``R - mean``).
  """

  def __init__(self, num_envs: int, group_size: int, max_chunks: int, *, scale: bool = True):
    protocol.group_layout(group_size, num_envs)  # Raises naming env.group_size.
    if max_chunks < 1:
      raise ValueError(f"EpisodeBuilder: max_chunks must be >= 1, got {max_chunks}")
    self.num_envs, self.group_size, self.max_chunks = num_envs, int(group_size), max_chunks
    self.scale = scale
    # Chunks of each env's current episode (empty: its next chunk starts a new one).
    self._open: list[list[dict]] = [[] for _ in range(num_envs)]
    # Finished episodes waiting for their group-mates: (group, episode) -> {env_id: episode}.
    self._waiting: dict[tuple[int, int], dict[int, dict]] = {}
    self._ready: list[list[dict]] = []  # Complete groups (env order), not yet popped.

  def starts(self, env_ids: np.ndarray) -> np.ndarray:
    """``[b]`` bool: which of ``env_ids`` start a new episode with their next chunk."""
    return np.array([not self._open[i] for i in env_ids], bool)

  def on_act(self, env_ids: np.ndarray, batch: dict, out: contract.ActOutput,
             version: int) -> None:
    """Records the chunk each of ``env_ids`` ``[b]`` is about to execute."""
    for row, i in enumerate(env_ids):
      self._open[i].append(dict(batch=rows(batch, row), chain=np.asarray(out.chain[row]),
                                log_prob=np.float32(out.log_prob[row]),
                                log_prob_dims=np.asarray(out.log_prob_dims[row], np.float32),
                                version=np.int32(version)))

  def on_result(self, env_ids: np.ndarray, result: protocol.ChunkStep) -> np.ndarray:
    """Completes the chunks of ``env_ids`` ``[b]`` and closes the episodes that ended.

    Returns:
      ``int64 [0]``: GRPO needs no bootstrap values, so no row is ever full.

    Raises:
      RuntimeError: a result for an env with no chunk acted on; an episode longer
        than ``max_chunks``; an ended episode without (or with ambiguous)
        EpisodeStats; a group or episode reported twice.
      ValueError: stats whose group is not ``env_id // group_size``.
    """
    stats = {}
    for s in result.episodes:
      if s.env_id in stats:
        raise RuntimeError(f"env {s.env_id}: two episodes ({stats[s.env_id].episode} and "
                           f"{s.episode}) ended in one chunk result")
      stats[s.env_id] = s
    done = result.done
    for row, i in enumerate(env_ids):
      chunks = self._open[i]
      if not chunks or "steps" in chunks[-1]:
        raise RuntimeError(f"env {i}: a result arrived with no chunk acted on")
      chunks[-1].update(reward=np.float32(result.reward[row]),
                        steps=np.int32(result.steps[row]))
      if done[row]:
        if int(i) not in stats:
          raise RuntimeError(f"env {i}: its episode ended but the chunk result has no "
                             f"EpisodeStats for it (got env ids {sorted(stats)})")
        self._close(int(i), stats[int(i)])
      elif len(chunks) >= self.max_chunks:
        raise RuntimeError(f"env {i}: episode has {len(chunks)} chunks and has not ended; "
                           f"max_chunks={self.max_chunks} must be ceil(env.max_episode_steps / "
                           "model.chunk_len)")
    return np.zeros((0,), np.int64)

  def _close(self, i: int, stats: protocol.EpisodeStats) -> None:
    """Files env ``i``'s finished episode under its ``(group, episode)``."""
    if stats.group != i // self.group_size:
      raise ValueError(f"env {i}: EpisodeStats group {stats.group} is not env_id // "
                       f"group_size = {i // self.group_size}; the builder's group_size "
                       f"({self.group_size}) must be the env's env.group_size")
    key = (int(stats.group), int(stats.episode))
    members = self._waiting.setdefault(key, {})
    if i in members:
      raise RuntimeError(f"env {i}: episode {key[1]} of group {key[0]} finished twice")
    members[i] = dict(chunks=self._open[i], episode_return=np.float32(stats.episode_return),
                      fault=bool(stats.fault))
    self._open[i] = []
    if len(members) == self.group_size:
      del self._waiting[key]
      self._ready.append([dict(members[j], env_id=j, group=key[0], episode=key[1])
                          for j in sorted(members)])

  def final_obs(self, env_ids: np.ndarray) -> list[protocol.Observation]:
    """Not used: GRPO bootstraps no truncated episode (``on_result`` asks for no values)."""
    raise RuntimeError("EpisodeBuilder.final_obs: GRPO episodes take no bootstrap values "
                       f"(asked for envs {np.asarray(env_ids).tolist()})")

  def complete(self, env_ids: np.ndarray, bootstrap_values: np.ndarray,
               final_values: np.ndarray) -> None:
    """Not used: GRPO episodes need no bootstrap values (``on_result`` asks for none)."""
    raise RuntimeError("EpisodeBuilder.complete: GRPO episodes take no bootstrap values "
                       f"(asked for envs {np.asarray(env_ids).tolist()})")

  def _episode_batch(self, members: list[dict]) -> types.EpisodeBatch:
    """One group's ``G`` episodes padded to ``K`` chunks -> ``EpisodeBatch [K, G]``."""
    returns = np.array([m["episode_return"] for m in members], np.float32)
    # An episode lost to a worker restart is no outcome: it is left out of the group's
    # mean and std and gets advantage 0 (its chunks then carry no policy gradient).
    valid = np.array([not m["fault"] for m in members])
    adv = grpo.group_advantages(returns, np.zeros(len(members), np.int32), 1, scale=self.scale,
                                valid=valid)
    return types.stack([self._episode(m, a, r) for m, a, r in zip(members, adv, returns)])

  def _episode(self, member: dict, advantage: float, episode_return: float
               ) -> types.EpisodeBatch:
    """One finished episode padded to ``K`` chunks (no episode axis: fields ``[K, ...]``)."""
    chunks = member["chunks"]
    n, k = len(chunks), self.max_chunks
    # Padding repeats the last chunk's inputs (finite for the policy; weight 0 anyway).
    padded = chunks + [chunks[-1]] * (k - n)
    played = stack_time([dict(batch=c["batch"], chain=c["chain"], policy_version=c["version"])
                         for c in padded])
    return types.EpisodeBatch(
        **played,
        log_prob=np.array([c["log_prob"] for c in chunks] + [0.0] * (k - n), np.float32),
        log_prob_dims=np.stack([c["log_prob_dims"] for c in chunks]
                               + [np.zeros_like(chunks[0]["log_prob_dims"])] * (k - n)),
        mask=np.arange(k) < n,
        steps=np.array([c["steps"] for c in chunks] + [0] * (k - n), np.int32),
        advantage=np.float32(advantage), episode_return=np.float32(episode_return),
        group=np.int32(member["group"]), episode=np.int32(member["episode"]))

  def pop_items(self) -> list[types.Item]:
    """One item per complete group, in completion order (unfinished groups wait).

    ``Item.versions`` holds the played chunks' versions only (``[num_chunks]``),
    so staleness and the queue's drop counts ignore padding.
    """
    items = []
    for members in self._ready:
      eb = self._episode_batch(members)
      versions = eb.policy_version[eb.mask]
      items.append(types.Item(data=eb, versions=versions, num_chunks=int(versions.size),
                              num_env_steps=eb.num_env_steps, num_segments=len(members)))
    self._ready = []
    return items

  def in_flight(self) -> types.Counts:
    """Episodes (``segments``), chunks and env steps started but not emitted: open, or
    waiting for group-mates; chunks and env steps of chunks whose result arrived."""
    waiting = [m for members in self._waiting.values() for m in members.values()]
    waiting += [m for members in self._ready for m in members]
    back = [c for chunks in self._open for c in chunks if "steps" in c]
    back += [c for m in waiting for c in m["chunks"]]
    return types.Counts(segments=sum(1 for c in self._open if c) + len(waiting),
                        chunks=len(back), env_steps=sum(int(c["steps"]) for c in back))
