"""Episode outcomes: the training rollout's recent success and fixed-seed evaluation.

* :class:`EpisodeTracker`: the most recent finished episodes of a rollout
  (training success rate, return, length).
* :func:`evaluate`: one episode per env of a fixed-seed env batch, to its end,
  with the evaluation sampler; the same episodes every call, so evaluations of
  different params compare paired.
"""

from __future__ import annotations

import collections
from typing import Callable

import jax
import numpy as np

from jaxvla.envs import protocol
from jaxvla.models import contract


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


# The keys of evaluate()'s result.
EVAL_KEYS = ("success_rate", "episode_return", "episode_length", "num_episodes",
             "eval_env_steps")
# A run's evaluations reset their envs with config.seed + this: the same episodes at
# every evaluation of the run, and for its export evaluated later (jaxvla.exported).
EVAL_SEED_OFFSET = 12345


def evaluate(env: protocol.VecEnv, policy: contract.Policy, act_fn: Callable, params,
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
