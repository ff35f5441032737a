"""Demonstrators: what produces the episodes :mod:`jaxvla.data.collect` records.

* :class:`Episode` and :class:`Demonstrator`: what a demonstrator hands the collector.
* :class:`ExpertDemonstrator`: an env's scripted expert (``expert_chunk``, e.g. ColorReach).
* :data:`DEMONSTRATORS`: env name -> the module of the demonstrator for envs whose
  demonstrations come from elsewhere: ManiSkill3's motion-planning solutions
  (:mod:`jaxvla.data.maniskill_planner`). :func:`make_demonstrator` picks the registered
  one, else the scripted expert.

The registry names its demonstrators' modules and imports them only when their env's
demonstrations are made, so this module is a leaf below the collector and the
demonstrators it names, which take :class:`Episode` from here.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from typing import Protocol

import ml_collections
import numpy as np

from jaxvla.envs import protocol, registry


@dataclasses.dataclass
class Episode:
  """One recorded episode of T steps.

  Attributes:
    images: ``uint8 [T, N_cam, H, W, 3]`` the observation before each action.
    state: ``float32 [T, S]``.
    actions: ``float32 [T, A]`` the demonstrator's action at each step (its label:
      with execution noise, what it meant, not what was executed).
    rewards: ``float32 [T]`` reward received after each action.
    instruction: the episode's instruction.
    terminated: the episode ended by success or failure (False: time limit).
    success: the episode ended in success.
    critic_state: ``float32 [T, C]`` the simulation state the asymmetric critic reads
      beside each observation (``EnvSpec.critic_state_dim``), or None where the env has none.
  """
  images: np.ndarray
  state: np.ndarray
  actions: np.ndarray
  rewards: np.ndarray
  instruction: str
  terminated: bool
  success: bool
  critic_state: np.ndarray | None = None


class Demonstrator(Protocol):
  """Produces demonstration episodes of one env configuration."""
  spec: protocol.EnvSpec

  def episodes(self, num_episodes: int) -> Iterator[Episode]:
    """Yields (up to) ``num_episodes`` episodes as they finish."""

  def report(self) -> dict:
    """Demonstrator-specific figures for the collection summary (may be empty)."""

  def close(self) -> None:
    """Releases the simulators."""


class ExpertDemonstrator:
  """Steps a batch of envs with their scripted expert (``expert_chunk``), one action at a time.

  The expert plans ``horizon``-step chunks open loop, as a chunked policy acts: every
  ``horizon`` steps of an episode it plans a clean chunk from the current state, and
  each step's label is that chunk's action for the step (what the demonstrator meant).
  With ``noise > 0`` the env executes the noisy version of the plan (DART-style:
  ``config.bc.demo_noise`` in the warm start), so the demonstrations visit states off
  the expert's path while a window of labels starting at a chunk boundary is exactly
  the clean plan from that state (``config.data.stride = 0`` samples exactly those).

  To keep the dataset free of a bias towards short episodes, each env records
  the episodes it starts until ``num_episodes`` have been started in all, and every
  started episode is recorded to its end.

  Args:
    env: a ``VecEnv`` with ``expert_chunk(horizon, noise=, rng=, speed=)``.
    noise: std of the execution noise.
    speed: the expert's speed (``config.bc.expert_speed``).
    seed: reset and noise seed.
    horizon: steps the expert plans at once (the policy's ``model.chunk_len``).
  """

  def __init__(self, env: protocol.VecEnv, *, noise: float, speed: float, seed: int,
               horizon: int = 1):
    if not hasattr(env, "expert_chunk"):
      raise ValueError(f"{type(env).__name__} has no scripted expert (expert_chunk); register a "
                       "demonstrator for its env name in jaxvla.data.demonstrators.DEMONSTRATORS")
    self.env, self.spec = env, env.spec
    self.noise, self.speed, self.seed, self.horizon = noise, speed, seed, horizon

  def episodes(self, num_episodes: int) -> Iterator[Episode]:
    env, b, h = self.env, self.env.num_envs, self.horizon
    rows = np.arange(b)
    rng = np.random.default_rng(self.seed)
    obs = env.reset(self.seed)
    buffers: list[list | None] = [[] if i < num_episodes else None for i in range(b)]
    started, finished = min(b, num_episodes), 0
    plan = np.zeros((b, h, self.spec.action_dim), np.float32)  # Clean chunks (labels).
    noisy = np.zeros_like(plan)  # What the env executes.
    k = np.full(b, h)  # Each env's step within its chunk (h: plan a new one).
    while finished < num_episodes:
      replan = k >= h
      if replan.any():
        plan[replan] = env.expert_chunk(h, speed=self.speed)[replan]
        noisy[replan] = env.expert_chunk(h, noise=self.noise, rng=rng, speed=self.speed)[replan]
        k[replan] = 0
      label = plan[rows, k]  # [B, A]
      result = env.step_chunk(noisy[rows, k][:, None])
      k += 1
      k[result.done] = h  # A new episode starts with a new plan.
      for i in range(b):
        if buffers[i] is None:
          continue
        buffers[i].append((obs.images[i], obs.state[i], label[i], float(result.reward[i]),
                           str(obs.instruction[i])))
        if result.done[i]:
          yield _episode(buffers[i], bool(result.terminated[i]), bool(result.success[i]))
          finished += 1
          buffers[i] = None  # this env's next episodes are not recorded ...
          if started < num_episodes:  # ... unless episodes remain to be started
            buffers[i], started = [], started + 1
      obs = result.obs

  def report(self) -> dict:
    return {}

  def close(self) -> None:
    self.env.close()


def _episode(steps: list[tuple], terminated: bool, success: bool) -> Episode:
  images, state, actions, rewards, texts = zip(*steps)
  return Episode(images=np.stack(images), state=np.stack(state).astype(np.float32),
                 actions=np.stack(actions).astype(np.float32),
                 rewards=np.asarray(rewards, np.float32), instruction=texts[0],
                 terminated=terminated, success=success)


# Demonstrations are recorded on episodes a run's RL envs do not play. Those reset with
# config.seed (plus a stride per host, jaxvla.parallel.distributed.host_seed) and its
# evaluations with config.seed + jaxvla.evaluation.success.EVAL_SEED_OFFSET. Recorded at
# config.seed, env i's first episodes in RL were the demonstrations' own (ColorReach: the same
# layouts, 3,000 / 64 = 47 per env; ManiSkill3: the same episode seeds). A warm start that had
# memorised them succeeded there in 0.65 of its sampled episodes and in 0.33 once the envs
# moved on (pi0-FAST, docs/results/default_run.md), which read as RL making the policy worse.
# 500,000 is far from both: a run's RL episodes would need that many episodes per host to reach it.
DEMO_SEED_OFFSET = 500_000
# Run seeds' demonstrations lie this far apart. At seed + offset, the episodes of attempt k
# (seed + offset + k) made seeds 0, 1 and 2 record 148 of their 150 ManiSkill3
# demonstrations alike, so a spread over seeds left out the demonstrations' own. Disjoint
# for up to 10,000 attempts per run; below host 1's RL seeds (1,000,003 on) for seeds 0-49.
DEMO_SEED_STRIDE = 10_000


def demo_seed(seed: int) -> int:
  """The first episode seed demonstrations are recorded with for the run seed ``seed``."""
  return DEMO_SEED_OFFSET + DEMO_SEED_STRIDE * seed


def expert_demonstrator(config: ml_collections.ConfigDict, num_envs: int, *,
                        noise: float) -> Demonstrator:
  """The scripted expert of ``config.env`` on ``num_envs`` envs, at :func:`demo_seed`."""
  seed = demo_seed(config.seed)
  env = registry.make_env(config.env, num_envs, seed, group_size=1)
  return ExpertDemonstrator(env, noise=noise, speed=config.bc.expert_speed, seed=seed,
                            horizon=config.model.chunk_len)


# config.env.name -> the module of the demonstrator for envs whose demonstrations come from
# elsewhere than an ``expert_chunk`` (ManiSkill3's motion planner). Each module has
# ``make(config, num_envs, *, noise) -> Demonstrator`` and is imported only when its env's
# demonstrations are made, so a demonstrator's packages load only for the runs that use it.
DEMONSTRATORS: dict[str, str] = {"maniskill": "jaxvla.data.maniskill_planner"}


def make_demonstrator(config: ml_collections.ConfigDict, num_envs: int, *,
                      noise: float) -> Demonstrator:
  """The registered demonstrator of ``config.env.name``, else the env's scripted expert."""
  if config.env.name not in DEMONSTRATORS:
    return expert_demonstrator(config, num_envs, noise=noise)
  module = importlib.import_module(DEMONSTRATORS[config.env.name])
  return module.make(config, num_envs, noise=noise)
