"""Truncation-correct returns end to end: the value of a time-limit truncation's last
observation reaches the learner's GAE, in lockstep and first-ready rollouts, in-process
and through the env pool.

A scripted env whose observation *is* its position (env id, episode, step) and a value
function that reads it back make every value checkable: a chunk that truncated episode
``k`` of env ``i`` at its limit ``L_i`` must carry the value of ``[i, k, L_i]``.
"""

import dataclasses
import time

import jax
import ml_collections
import numpy as np
import pytest

from jaxvla.envs import pool as pool_lib
from jaxvla.envs import protocol
from jaxvla.learner import objectives
from jaxvla.models import contract
from jaxvla.rollout import rollout as rollout_lib
from jaxvla.rollout import segments as segments_lib

CHUNK, SEGMENT, NUM_ENVS = 4, 3, 4
SPEC = protocol.EnvSpec(camera_names=("none",), image_shape=(1, 1, 3), state_dim=3,
                        action_dim=1, max_episode_steps=8)


def time_limit(env_id: int) -> int:
  """``L_i``: 6, 7 or 8 steps, so truncations fall at different chunks of a segment."""
  return 6 + env_id % 3


def terminates(episode: int) -> bool:
  """Every third episode ends by termination after 3 steps instead."""
  return episode % 3 == 2


class CountingEnv:
  """Envs whose state is ``[global env id, episode k, step t]`` (a ``protocol.VecEnv``)."""
  spec = SPEC
  group_size = 1

  def __init__(self, num_envs: int, first_env_id: int = 0, sleep_s: float = 0.0):
    self.num_envs, self.sleep_s = num_envs, sleep_s
    self.ids = np.arange(first_env_id, first_env_id + num_envs)
    self.episode = np.zeros(num_envs, np.int64)
    self.t = np.zeros(num_envs, np.int64)

  def group_ids(self) -> np.ndarray:
    return self.ids.copy()

  def observe(self, rows: np.ndarray) -> protocol.Observation:
    state = np.stack([self.ids[rows], self.episode[rows], self.t[rows]], -1).astype(np.float32)
    return protocol.Observation(np.zeros((len(rows), 1, 1, 1, 3), np.uint8), state,
                                np.array(["count"] * len(rows), dtype=object))

  def reset(self, seed, first_episode=None) -> protocol.Observation:
    self.episode = protocol.check_first_episode(first_episode, self.num_envs)
    self.t[:] = 0
    return self.observe(np.arange(self.num_envs))

  def step_chunk(self, actions: np.ndarray) -> protocol.ChunkStep:
    n = self.num_envs
    protocol.check_actions(actions, n, 1)
    time.sleep(self.sleep_s * float(self.ids[0] + 1))  # Ragged readiness in a pool.
    steps = np.zeros(n, np.int32)
    terminated, truncated = np.zeros(n, bool), np.zeros(n, bool)
    for j, i in enumerate(self.ids):
      for _ in range(actions.shape[1]):
        self.t[j] += 1
        steps[j] += 1
        if terminates(self.episode[j]) and self.t[j] == 3:
          terminated[j] = True
          break
        if self.t[j] == time_limit(i):
          truncated[j] = True
          break
    final_obs = self.observe(np.flatnonzero(truncated))  # Before the auto-reset.
    ended = np.flatnonzero(terminated | truncated)
    episodes = [protocol.EpisodeStats(env_id=int(j), group=int(self.ids[j]),
                                      episode=int(self.episode[j]), episode_return=0.0,
                                      length=int(self.t[j]), success=bool(terminated[j]),
                                      truncated=bool(truncated[j])) for j in ended]
    self.episode[ended] += 1
    self.t[ended] = 0
    return protocol.ChunkStep(
        obs=self.observe(np.arange(n)), reward=steps.astype(np.float32),
        terminated=terminated, truncated=truncated, success=terminated.copy(), steps=steps,
        episodes=episodes, has_final_obs=truncated.copy(), final_obs=final_obs)

  def close(self) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class CountingFn:
  """Picklable pool ``env_fn``: env ``first_env_id`` alone, sleeping per chunk."""
  sleep_s: float = 0.0

  def __call__(self, first_env_id: int, count: int, seed: int) -> CountingEnv:
    return CountingEnv(count, first_env_id, self.sleep_s)


def value_of(state: np.ndarray) -> np.ndarray:
  """``[n, 3]`` -> ``[n]``: a value that names the observation it was computed on."""
  return (100 * state[:, 0] + 10 * state[:, 1] + state[:, 2]).astype(np.float32)


class CountingPolicy:
  """The policy-side callables a Rollout needs, recording the value batches' sizes."""

  def __init__(self):
    self.value_sizes = []

  def prepare(self, obs: protocol.Observation) -> dict:
    return {"state": obs.state.copy()}

  def act(self, params, batch, key) -> contract.ActOutput:
    n = batch["state"].shape[0]
    zeros = np.zeros((n, CHUNK, 1), np.float32)
    return contract.ActOutput(actions=zeros, chain=zeros[:, None], log_prob=np.zeros(n),
                              log_prob_dims=zeros, value=value_of(batch["state"]))

  def value(self, params, batch) -> np.ndarray:
    self.value_sizes.append(batch["state"].shape[0])
    return value_of(batch["state"])


def _collect(env, first_ready, num_segments) -> tuple[list, CountingPolicy]:
  """Steps a rollout until every env has filled ``num_segments`` segments."""
  policy = CountingPolicy()
  builder = segments_lib.SegmentBuilder(NUM_ENVS, SEGMENT, 1)
  ro = rollout_lib.Rollout(env, policy, policy.act, policy.value, lambda: (None, 0), builder,
                           jax.random.PRNGKey(0), seed=0, first_ready=first_ready)
  items = []
  deadline = time.monotonic() + 60
  while len(items) < NUM_ENVS * num_segments and time.monotonic() < deadline:
    ro.step()
    items += ro.pop_items()
  return items, policy


def _check_final_values(items) -> None:
  """Every chunk's final value is that of its episode's true last observation."""
  counts = dict(truncated=0, truncated_last=0, terminated=0)
  for item in items:
    traj = item.data  # [T, 1]
    state = traj.batch["state"][:, 0]  # [T, 3]: the observation each chunk acted on.
    for t in range(SEGMENT):
      i, k, _ = state[t].astype(int)
      cut = bool(traj.done[t, 0] and not traj.terminated[t, 0])
      want = value_of(np.array([[i, k, time_limit(i)]]))[0] if cut else 0.0
      assert traj.final_value[t, 0] == want, (i, k, t, traj.final_value[:, 0])
      assert traj.terminated[t, 0] == (traj.done[t, 0] and terminates(k))
      counts["truncated"] += cut
      counts["truncated_last"] += cut and t == SEGMENT - 1
      counts["terminated"] += bool(traj.terminated[t, 0])
    # The learner's GAE: a truncated chunk's return is its reward plus gamma times the
    # final value (the recursion is cut there, whatever lambda).
    cfg = ml_collections.ConfigDict(dict(gamma=0.9, gae_lambda=0.5, bootstrap_truncated=True,
                                         ratio="joint", correction="decoupled"))
    returns = np.asarray(objectives.PPOObjective(None, cfg).rows(traj)["returns"])
    cut = traj.done[:, 0] & ~traj.terminated[:, 0]
    np.testing.assert_allclose(returns[cut], (traj.reward + 0.9 * traj.final_value)[cut, 0],
                               rtol=1e-6)
    # rl.bootstrap_truncated off (the time limit is part of the task): every end is terminal.
    cfg.bootstrap_truncated = False
    plain = np.asarray(objectives.PPOObjective(None, cfg).rows(traj)["returns"])
    np.testing.assert_allclose(plain[cut], traj.reward[cut, 0], rtol=1e-6)
  # Truncations inside segments and at their last chunk, and terminations, all seen.
  assert counts["truncated"] > counts["truncated_last"] > 0 and counts["terminated"] > 0, counts


def test_lockstep_rollout_carries_final_values_in_process():
  items, policy = _collect(CountingEnv(NUM_ENVS), None, num_segments=4)
  assert len(items) == 4 * NUM_ENVS
  _check_final_values(items)
  assert set(policy.value_sizes) == {NUM_ENVS}  # Lockstep's one compiled size.


@pytest.mark.parametrize("first_ready", [None, (2, 0.001)], ids=["lockstep", "first_ready"])
def test_env_pool_rollout_carries_final_values(first_ready):
  # Two workers of two envs (fewer processes start faster); env i sleeps (i + 1) * 2 ms.
  pool = pool_lib.EnvPool(CountingFn(sleep_s=0.002), NUM_ENVS, 2, SPEC, step_timeout_s=60.0)
  try:
    items, policy = _collect(pool, first_ready, num_segments=4)
  finally:
    pool.close()
  assert len(items) >= 4 * NUM_ENVS
  _check_final_values(items)
  sizes = {NUM_ENVS} if first_ready is None else set(rollout_lib.bucket_sizes(NUM_ENVS))
  assert set(policy.value_sizes) <= sizes, policy.value_sizes
