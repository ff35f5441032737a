"""Synchronous rollout: step an env batch with the current policy for T chunk steps."""

from __future__ import annotations

import collections
import time
from typing import Callable

import jax
import numpy as np

from jaxvla.envs import protocol
from jaxvla.models import policy as policy_lib
from jaxvla.rollout import trajectory


class EpisodeTracker:
  """Keeps the most recent finished episodes for success-rate reporting."""

  def __init__(self, window: int = 256):
    self.recent: collections.deque[protocol.EpisodeStats] = collections.deque(maxlen=window)
    self.total = 0

  def add(self, episodes: list[protocol.EpisodeStats]) -> None:
    self.recent.extend(episodes)
    self.total += len(episodes)

  def summary(self) -> dict[str, float]:
    if not self.recent:
      return {}
    return dict(
        success_rate=float(np.mean([e.success for e in self.recent])),
        episode_return=float(np.mean([e.episode_return for e in self.recent])),
        episode_length=float(np.mean([e.length for e in self.recent])),
        episodes=float(self.total))


class Collector:
  """Collects fixed-length trajectories from a :class:`protocol.VecEnv`.

  Args:
    env: the env batch (already built); it is reset with ``seed``.
    policy: the policy contract.
    act_fn: jitted ``(params, batch, rng) -> ActOutput`` (the training sampler).
    value_fn: jitted ``(params, batch) -> value [B]`` for the bootstrap.
  """

  def __init__(self, env: protocol.VecEnv, policy: policy_lib.Policy,
               act_fn: Callable, value_fn: Callable, seed: int):
    self.env, self.policy = env, policy
    self.act_fn, self.value_fn = act_fn, value_fn
    self.obs = env.reset(seed)
    self.episodes = EpisodeTracker()
    self.timing = collections.defaultdict(float)

  def collect(self, params, num_steps: int, rng: jax.Array,
              policy_version: int = 0) -> trajectory.Trajectory:
    """Runs ``num_steps`` chunk steps of every env; returns ``[T, B]`` data."""
    steps, outs, rewards, dones, executed = [], [], [], [], []
    for key in jax.random.split(rng, num_steps):
      batch = self.policy.prepare(self.obs)
      t0 = time.perf_counter()
      out = jax.device_get(self.act_fn(params, batch, key))
      t1 = time.perf_counter()
      result = self.env.step_chunk(np.asarray(out.actions))
      self.timing["inference_s"] += t1 - t0
      self.timing["env_s"] += time.perf_counter() - t1
      steps.append(batch)
      outs.append(out)
      rewards.append(result.reward)
      dones.append(result.done)
      executed.append(result.steps)
      self.episodes.add(result.episodes)
      self.obs = result.obs
    bootstrap = np.asarray(self.value_fn(params, self.policy.prepare(self.obs)))
    return trajectory.Trajectory(
        batch=trajectory.stack_steps(steps),
        chain=np.stack([o.chain for o in outs]),
        log_prob=np.stack([o.log_prob for o in outs]),
        value=np.stack([o.value for o in outs]),
        reward=np.stack(rewards), done=np.stack(dones), steps=np.stack(executed),
        bootstrap_value=bootstrap,
        policy_version=np.full((num_steps, self.env.num_envs), policy_version, np.int32))


# The keys of evaluate()'s result.
EVAL_KEYS = ("success_rate", "episode_return", "episode_length", "num_episodes",
             "eval_env_steps")


def evaluate(env: protocol.VecEnv, policy: policy_lib.Policy, act_fn: Callable, params,
             rng: jax.Array, seed: int, chunk_len: int) -> dict[str, float]:
  """Runs the first episode of every env in ``env`` to its end (fixed ``seed``).

  Every env contributes exactly one episode, so short (failed or successful)
  episodes are not over-represented. ``act_fn(params, batch, rng)`` is the
  evaluation sampler.

  Returns:
    ``success_rate``, ``episode_return``, ``episode_length``, ``num_episodes``,
    ``eval_env_steps``.
  """
  obs = env.reset(seed)
  finished: dict[int, protocol.EpisodeStats] = {}
  env_steps = 0
  max_chunks = -(-env.spec.max_episode_steps // chunk_len)
  for key in jax.random.split(rng, max_chunks):
    out = jax.device_get(act_fn(params, policy.prepare(obs), key))
    result = env.step_chunk(np.asarray(out.actions))
    alive = np.array([i not in finished for i in range(env.num_envs)])
    env_steps += int(result.steps[alive].sum())
    for ep in result.episodes:
      finished.setdefault(ep.env_id, ep)
    obs = result.obs
    if len(finished) == env.num_envs:
      break
  if len(finished) != env.num_envs:
    raise RuntimeError(f"evaluation ended with {env.num_envs - len(finished)} episodes "
                       "unfinished; the env does not enforce its time limit")
  eps = list(finished.values())
  return dict(success_rate=float(np.mean([e.success for e in eps])),
              episode_return=float(np.mean([e.episode_return for e in eps])),
              episode_length=float(np.mean([e.length for e in eps])),
              num_episodes=float(len(eps)), eval_env_steps=float(env_steps))
