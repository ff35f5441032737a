"""PPO's unit of rollout data: fixed-length env segments, cut into queue items.

:class:`SegmentBuilder` keeps, per env, the chunks of its current segment (policy
inputs, sampler chain, behaviour log-prob and value, the policy version that
acted, then reward / done / terminated / executed steps when the chunk's result
arrives, and the last observation of an episode the chunk truncated at its time
limit). When an env has ``T`` finished chunks its segment is complete; with the
value of the observation after it (the GAE bootstrap) and the values of its
truncated episodes' last observations (their ``final_value``) it becomes one
column of a ``Trajectory [T, M]``, and ``M`` columns make one queue :class:`Item`.

The final observations are valued when their segment completes, together with
its bootstrap observation (one inference batch for both, with the same params),
not at each truncation: a lockstep rollout would otherwise run an extra,
full-size value batch at almost every chunk while episodes end by time limit.

It implements the builder interface :class:`jaxvla.rollout.rollout.Rollout`
drives (``starts``, ``on_act``, ``on_result``, ``final_obs``, ``complete``,
``pop_items``, ``in_flight``); :class:`jaxvla.rollout.groups.EpisodeBuilder`
is GRPO's.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxvla import types
from jaxvla.envs import protocol
from jaxvla.models import contract


def rows(tree, idx):
  """``tree``'s leaves indexed by ``idx`` on their first axis."""
  return jax.tree.map(lambda x: x[idx], tree)


def stack_time(records: list) -> object:
  """Per-chunk pytrees -> one pytree with a leading time axis ``[T, ...]``."""
  return jax.tree.map(lambda *xs: np.stack(xs), *records)


class SegmentBuilder:
  """Per-env chunk records -> ``Trajectory [T, M]`` items of complete segments.

  Args:
    num_envs: envs of the batch (ids ``0..num_envs - 1``).
    segment_len: ``T`` chunks per segment.
    segments_per_item: ``M`` segments per item (the streamer's micro-batch).
  """

  def __init__(self, num_envs: int, segment_len: int, segments_per_item: int):
    self.num_envs, self.segment_len, self.per_item = num_envs, segment_len, segments_per_item
    self._open: list[list[dict]] = [[] for _ in range(num_envs)]  # Chunks of each env.
    self._done_segments: list[types.Trajectory] = []  # Single-env segments ``[T]``.

  def starts(self, env_ids: np.ndarray) -> np.ndarray:
    """``[b]`` bool: which of ``env_ids`` start a new segment with their next chunk."""
    return np.array([not self._open[i] for i in env_ids], bool)

  def on_act(self, env_ids: np.ndarray, batch: dict, out: contract.ActOutput,
             version: int) -> None:
    """Records the chunk each of ``env_ids`` ``[b]`` is about to execute."""
    for row, i in enumerate(env_ids):
      self._open[i].append(dict(batch=rows(batch, row), chain=out.chain[row],
                                log_prob=out.log_prob[row], log_prob_dims=out.log_prob_dims[row],
                                value=out.value[row],
                                policy_version=np.int32(version)))

  def on_result(self, env_ids: np.ndarray, result: protocol.ChunkStep) -> np.ndarray:
    """Completes the chunks of ``env_ids``; returns the rows whose segment is full."""
    full = []
    final_at = np.cumsum(result.has_final_obs) - 1  # [b] row's index in result.final_obs.
    for row, i in enumerate(env_ids):
      chunks = self._open[i]
      if not chunks or "reward" in chunks[-1]:
        raise RuntimeError(f"env {i}: a result arrived with no chunk acted on")
      # final_value stays 0 unless an episode was truncated with a final observation.
      chunks[-1].update(reward=result.reward[row], done=result.done[row],
                        terminated=result.terminated[row], final_value=np.float32(0),
                        steps=result.steps[row])
      if result.has_final_obs[row]:  # Valued with the segment's bootstrap (complete).
        chunks[-1]["final_obs"] = result.final_obs.take(final_at[row:row + 1])
      if len(chunks) == self.segment_len:
        full.append(row)
    return np.asarray(full, np.int64)

  def final_obs(self, env_ids: np.ndarray) -> list[protocol.Observation]:
    """The last observations (batches of one) of the episodes truncated in the full
    segments of ``env_ids`` ``[f]``, segment by segment, in chunk order."""
    return [c["final_obs"] for i in env_ids for c in self._full(i) if "final_obs" in c]

  def complete(self, env_ids: np.ndarray, bootstrap_values: np.ndarray,
               final_values: np.ndarray) -> None:
    """Closes the full segments of ``env_ids`` ``[f]`` with their bootstrap values
    ``[f]`` and the values ``[k]`` of their :meth:`final_obs` (in its order)."""
    segments = [self._full(i) for i in env_ids]
    finals = [c for chunks in segments for c in chunks if "final_obs" in c]
    if len(finals) != len(final_values):
      raise RuntimeError(f"complete: {len(final_values)} final values for the {len(finals)} "
                         f"final observations of envs {np.asarray(env_ids).tolist()}")
    for c, v in zip(finals, final_values):
      del c["final_obs"]
      c["final_value"] = np.float32(v)
    for i, chunks, v in zip(env_ids, segments, bootstrap_values):
      self._done_segments.append(
          types.Trajectory(bootstrap_value=np.float32(v), **stack_time(chunks)))
      self._open[i] = []

  def _full(self, i: int) -> list[dict]:
    """Env ``i``'s full segment (every chunk's result in)."""
    chunks = self._open[i]
    if len(chunks) != self.segment_len or "reward" not in chunks[-1]:
      raise RuntimeError(f"env {i}: segment is not complete ({len(chunks)} chunks)")
    return chunks

  def pop_items(self) -> list[types.Item]:
    """Items of ``M`` complete segments each, in completion order (the rest wait)."""
    items = []
    while len(self._done_segments) >= self.per_item:
      segs, self._done_segments = (self._done_segments[:self.per_item],
                                   self._done_segments[self.per_item:])
      traj = types.stack(segs)  # [T, M, ...]
      items.append(types.Item(data=traj, versions=traj.policy_version,
                              num_chunks=traj.num_rows, num_env_steps=traj.num_env_steps,
                              num_segments=len(segs)))
    return items

  def in_flight(self) -> types.Counts:
    """Segments, chunks and env steps started but not emitted (lost if the run stops
    now); chunks and env steps of chunks whose result arrived."""
    back = [c for chunks in self._open for c in chunks if "steps" in c]
    return types.Counts(
        segments=sum(1 for c in self._open if c) + len(self._done_segments),
        chunks=len(back) + len(self._done_segments) * self.segment_len,
        env_steps=sum(int(c["steps"]) for c in back)
        + sum(seg.num_env_steps for seg in self._done_segments))
