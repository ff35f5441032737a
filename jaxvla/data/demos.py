"""Demonstrations from an environment's scripted expert, for the behaviour-cloning warm start."""

from __future__ import annotations

import numpy as np

from jaxvla.envs import protocol
from jaxvla.models import contract


def collect_expert_demos(env: protocol.VecEnv, policy: contract.Policy, *,
                         num_episodes: int, noise: float, speed: float,
                         seed: int) -> dict[str, np.ndarray]:
  """Rolls out the env's scripted expert until ``num_episodes`` episodes have ended.

  The executed chunks carry Gaussian ``noise`` so that the demonstrations visit
  states off the expert's path; the stored labels are the noise-free expert chunk
  planned from each visited state (DART-style), which is what BC should imitate.
  ``speed`` scales the expert's actions (a cautious demonstrator).

  Returns:
    ``batch`` (policy inputs ``[N, ...]``), ``actions`` ``[N, H, A]`` and
    ``episodes``/``success_rate``/``env_steps`` of the executed (noisy) expert.

  Raises:
    ValueError: the env has no scripted expert.
  """
  if not hasattr(env, "expert_chunk"):
    raise ValueError(f"{type(env).__name__} has no scripted expert; set "
                     "config.bc.num_steps=0 or load demonstrations")
  rng = np.random.default_rng(seed)
  obs = env.reset(seed)
  batches, labels, successes, env_steps = [], [], [], 0
  while len(successes) < num_episodes:
    labels.append(env.expert_chunk(policy.chunk_len, speed=speed))
    batches.append(policy.prepare(obs))
    executed = env.expert_chunk(policy.chunk_len, noise=noise, rng=rng, speed=speed)
    result = env.step_chunk(executed)
    env_steps += int(result.steps.sum())
    successes.extend(e.success for e in result.episodes)
    obs = result.obs
  batch = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  return dict(batch=batch, actions=np.concatenate(labels), episodes=len(successes),
              success_rate=float(np.mean(successes)), env_steps=env_steps)
