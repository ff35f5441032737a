"""Episode outcomes: the training rollout's recent success and fixed-seed evaluation.

* :class:`EpisodeTracker`: the most recent finished episodes of a rollout
  (training success rate, return, length).
* :func:`play_episodes`: each env's next episodes of a fixed-seed env batch, to
  their ends, replanning every ``replan_steps`` actions; an episode's env state
  and sampler noise depend on the episode alone (:func:`row_keyed_act`), so the
  same call gives the same outcomes and a resumed one continues it exactly.
  ``python -m jaxvla.eval`` and the training loop's evaluation both run it.
* :func:`evaluate`: the first episode of every env, summarised (the training
  loop's periodic evaluation).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Callable

import jax
import numpy as np

from jaxvla.envs import protocol
from jaxvla.models import contract


class EpisodeTracker:
  """Keeps the most recent finished episodes for success-rate reporting.

  Thread-safe: the rollout thread adds while the learner's thread summarises.
  """

  def __init__(self, window: int = 256):
    self.recent: collections.deque[protocol.EpisodeStats] = collections.deque(maxlen=window)
    self.total = 0
    self._lock = threading.Lock()

  def add(self, episodes: list[protocol.EpisodeStats]) -> None:
    with self._lock:
      self.recent.extend(episodes)
      self.total += len(episodes)

  def summary(self) -> dict[str, float]:
    with self._lock:
      recent, total = list(self.recent), self.total
    if not recent:
      return {}
    return dict(
        success_rate=float(np.mean([e.success for e in recent])),
        episode_return=float(np.mean([e.episode_return for e in recent])),
        episode_length=float(np.mean([e.length for e in recent])),
        episodes=float(total))


# The keys of evaluate()'s result.
EVAL_KEYS = ("success_rate", "episode_return", "episode_length", "num_episodes",
             "eval_env_steps")
# A run's evaluations reset their envs with config.seed + this: the same episodes at
# every evaluation of the run, and for its export evaluated later (jaxvla.evaluation.exported).
EVAL_SEED_OFFSET = 12345


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
  """One evaluated episode: env ``env_id``'s ``episode``-th since the reset (its ``k``)."""
  env_id: int
  episode: int
  success: bool
  length: int
  episode_return: float
  truncated: bool


def row_keyed_act(policy: contract.Policy, mode: str = "eval") -> Callable:
  """``act(params, batch, rng, ids) -> ActOutput``, jitted, each row with its own key.

  Row ``b`` samples with ``rng`` folded with each of ``ids[b]`` in turn (``ids``
  ``int [B, n]``, ``n >= 0``; ``n = 0``: every row samples with ``rng`` itself). The
  evaluation passes (env id, episode number, chunk number in the episode), so an
  episode's noise is a function of the episode alone, not of which other episodes share
  the batch: a resumed or re-batched evaluation plays the same episodes. The policy
  server passes a request counter or nothing. The policy runs per row (``vmap``).
  """
  def one(params, row: dict, key: jax.Array):
    out = policy.act(params, jax.tree.map(lambda x: x[None], row), key, mode=mode)
    return jax.tree.map(lambda x: x[0], out)

  def act(params, batch: dict, rng: jax.Array, ids: jax.Array):
    keys = jax.vmap(lambda i: functools.reduce(jax.random.fold_in, i, rng))(ids)
    return jax.vmap(one, in_axes=(None, 0, 0))(params, batch, keys)

  return jax.jit(act)


def play_episodes(env: protocol.VecEnv, policy: contract.Policy, act_fn: Callable, params,
                  rng: jax.Array, *, seed: int, episodes_per_env: np.ndarray,
                  first_episode: np.ndarray | None = None, replan_steps: int,
                  on_chunk: Callable | None = None,
                  on_episode: Callable[[EpisodeResult], None] | None = None
                  ) -> list[EpisodeResult]:
  """Plays each env's next ``episodes_per_env[i]`` episodes to their ends.

  Env ``i`` starts at its episode ``first_episode[i]`` (default 0) of
  ``env.reset(seed, first_episode)``, so every episode is fixed by ``(seed, i, k)``
  and, with :func:`row_keyed_act`'s ``act_fn``, its sampler noise by ``(rng, i, k,
  chunk)``: the same call gives the same outcomes, and a resumed one (``first_episode``
  past the episodes already played) the outcomes the uninterrupted call would have.
  The policy acts on the observation every ``replan_steps`` env steps: the first
  ``replan_steps`` actions of each chunk are executed. An env with no episodes left
  keeps stepping (the batch is stepped whole) but its episodes are not counted.

  Args:
    act_fn: ``act(params, batch, rng, ids)`` (:func:`row_keyed_act`).
    episodes_per_env: ``int [B]``; first_episode: ``int [B]``.
    on_chunk: ``on_chunk(obs, result, playing)`` after the reset (``result`` None) and
      after each chunk step (``playing`` ``int [B]``: the episode number each env was
      playing in it, -1 once it has no more to play).
    on_episode: called with each counted episode as it ends.

  Returns:
    The counted episodes, in the order they ended.

  Raises:
    RuntimeError: an episode outlives the env's time limit (the env does not enforce it).
  """
  n = env.num_envs
  remaining = np.asarray(episodes_per_env, np.int64).copy()
  k = (np.zeros(n, np.int64) if first_episode is None
       else np.asarray(first_episode, np.int64).copy())
  chunk = np.zeros(n, np.int64)
  obs = env.reset(seed, None if first_episode is None else k.copy())
  results: list[EpisodeResult] = []
  if on_chunk is not None:
    on_chunk(obs, None, np.where(remaining > 0, k, -1))
  # Each counted episode ends within max_episode_steps env steps (+1 chunk of slack).
  budget = (int(remaining.max(initial=0)) * (-(-env.spec.max_episode_steps // replan_steps) + 1))
  for _ in range(budget):
    if not remaining.any():
      break
    ids = np.stack([np.arange(n), k, chunk], axis=1).astype(np.int32)
    out = jax.device_get(act_fn(params, policy.prepare(obs), rng, ids))
    result = env.step_chunk(np.asarray(out.actions)[:, :replan_steps])
    playing = np.where(remaining > 0, k, -1)
    chunk += 1
    for ep in result.episodes:
      i = ep.env_id
      if ep.episode != k[i]:
        raise RuntimeError(f"env {i} ended episode {ep.episode} while episode {k[i]} was "
                           "expected (the env does not number its episodes from the reset)")
      if remaining[i] > 0:
        remaining[i] -= 1
        res = EpisodeResult(env_id=i, episode=int(k[i]), success=bool(ep.success),
                            length=int(ep.length), episode_return=float(ep.episode_return),
                            truncated=bool(ep.truncated))
        results.append(res)
        if on_episode is not None:
          on_episode(res)
      k[i] += 1
      chunk[i] = 0
    if on_chunk is not None:
      on_chunk(result.obs, result, playing)
    obs = result.obs
  if remaining.any():
    raise RuntimeError(f"evaluation ended with {int(remaining.sum())} episodes unfinished; "
                       "the env does not enforce its time limit")
  return results


def summarize(results: list[EpisodeResult]) -> dict[str, float]:
  """:data:`EVAL_KEYS` of ``results`` (means over episodes; env steps summed)."""
  return dict(success_rate=float(np.mean([e.success for e in results])),
              episode_return=float(np.mean([e.episode_return for e in results])),
              episode_length=float(np.mean([e.length for e in results])),
              num_episodes=float(len(results)),
              eval_env_steps=float(sum(e.length for e in results)))


def evaluate(env: protocol.VecEnv, policy: contract.Policy, act_fn: Callable, params,
             rng: jax.Array, seed: int, chunk_len: int) -> dict[str, float]:
  """The first episode of every env in ``env`` (fixed ``seed``), whole chunks executed.

  Every env contributes exactly one episode, so short (failed or successful)
  episodes are not over-represented. ``act_fn`` is :func:`row_keyed_act`'s.
  This is :func:`play_episodes`, the code ``python -m jaxvla.eval`` runs.

  Returns:
    ``success_rate``, ``episode_return``, ``episode_length``, ``num_episodes``,
    ``eval_env_steps`` (the counted episodes' steps).
  """
  return summarize(play_episodes(env, policy, act_fn, params, rng, seed=seed,
                                 episodes_per_env=np.ones(env.num_envs, np.int64),
                                 replan_steps=chunk_len))
