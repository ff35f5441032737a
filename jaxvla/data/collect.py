"""Records demonstrations of a config's env as an RLDS dataset (TFDS ArrayRecord, TFDS's writer).

``python -m jaxvla.data.collect --config=configs/default.py --out=DIR --episodes=N``
rolls out the env's demonstrator and writes ``DIR`` as a TFDS version directory
that :class:`jaxvla.data.rlds.RldsReader` (and TFDS itself) reads. Per step:
``observation/<camera>`` (PNG, lossless), ``observation/state``, ``action``,
``reward``, ``discount``, ``is_first / is_last / is_terminal`` (terminal: the
episode ended by success or failure, not by the time limit) and
``language_instruction``; per episode ``episode_metadata/success``. The default
config's ``data`` block reads it back with ``--config.data.path=DIR``.

Demonstrators: an env with a scripted expert (``expert_chunk``, e.g. ColorReach)
gets :class:`ExpertDemonstrator`. Others plug in through :data:`DEMONSTRATORS`
(env name -> factory): ManiSkill3's motion-planning solutions
(:mod:`jaxvla.data.maniskill_planner`). ``--success_only`` records only the
episodes that succeed (as ManiSkill's ``--only-count-success``), attempting up to
:data:`MAX_ATTEMPTS_PER_EPISODE` times as many.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import ml_collections
import numpy as np
import PIL.Image

from jaxvla import envs
from jaxvla.data import rlds
from jaxvla.data.episodes import ONE_LINE_ERRORS
from jaxvla.envs import protocol


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
  """
  images: np.ndarray
  state: np.ndarray
  actions: np.ndarray
  rewards: np.ndarray
  instruction: str
  terminated: bool
  success: bool


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
                       "demonstrator for its env name in jaxvla.data.collect.DEMONSTRATORS")
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


def expert_demonstrator(config: ml_collections.ConfigDict, num_envs: int, *,
                        noise: float) -> Demonstrator:
  """The scripted expert of ``config.env`` on ``num_envs`` envs."""
  env = envs.make_env(config.env, num_envs, config.seed, group_size=1)
  return ExpertDemonstrator(env, noise=noise, speed=config.bc.expert_speed, seed=config.seed,
                            horizon=config.model.chunk_len)


# config.env.name -> factory (config, num_envs, noise=) -> Demonstrator, for envs whose
# demonstrations come from elsewhere than an ``expert_chunk`` (ManiSkill3's motion planner).
def _maniskill_planner(config: ml_collections.ConfigDict, num_envs: int, *,
                       noise: float) -> Demonstrator:
  from jaxvla.data import maniskill_planner  # pylint: disable=import-outside-toplevel
  return maniskill_planner.make(config, num_envs, noise=noise)


DEMONSTRATORS: dict[str, Callable[..., Demonstrator]] = {"maniskill": _maniskill_planner}
MAX_ATTEMPTS_PER_EPISODE = 4  # success_only: attempts per episode asked for, at most.


def make_demonstrator(config: ml_collections.ConfigDict, num_envs: int, *,
                      noise: float) -> Demonstrator:
  """The registered demonstrator of ``config.env.name``, else the env's scripted expert."""
  factory = DEMONSTRATORS.get(config.env.name, expert_demonstrator)
  return factory(config, num_envs, noise=noise)


def rlds_example(episode: Episode, cameras: tuple[str, ...]) -> dict:
  """An :class:`Episode` as the nested example :func:`rlds.step_features` describes."""
  t = len(episode.actions)
  steps = []
  for i in range(t):
    last = i == t - 1
    steps.append(dict(
        observation={**{c: PIL.Image.fromarray(episode.images[i, k])
                        for k, c in enumerate(cameras)}, "state": episode.state[i]},
        action=episode.actions[i], reward=episode.rewards[i], discount=np.float32(1.0),
        is_first=i == 0, is_last=last, is_terminal=last and episode.terminated,
        language_instruction=episode.instruction))
  return dict(steps=steps, episode_metadata=dict(success=episode.success))


def collect(config: ml_collections.ConfigDict, out: str, num_episodes: int, *,
            noise: float = 0.0, num_envs: int = 0, max_episodes_per_shard: int = 1000,
            success_only: bool = False) -> dict:
  """Records ``num_episodes`` demonstrations of ``config.env`` into the RLDS dataset ``out``.

  Args:
    num_envs: envs stepped together (0: ``min(config.num_envs, num_episodes)``).
    success_only: record only successful episodes, attempting at most
      ``MAX_ATTEMPTS_PER_EPISODE * num_episodes``.

  Returns:
    a summary: ``out``, ``episodes`` (recorded), ``attempted``, ``steps``,
    ``success_rate`` (over the attempted episodes), ``wall_s`` and the
    demonstrator's own figures.

  Raises:
    ValueError: ``success_only`` and too few of the attempts succeeded (no dataset
      is left at ``out``).
  """
  if num_episodes < 1:
    raise ValueError(f"--episodes must be >= 1, got {num_episodes}")
  t0 = time.perf_counter()
  attempts = num_episodes * (MAX_ATTEMPTS_PER_EPISODE if success_only else 1)
  demonstrator = make_demonstrator(config, num_envs or min(config.num_envs, attempts),
                                   noise=noise)
  spec = demonstrator.spec
  features = rlds.step_features({c: spec.image_shape for c in spec.camera_names},
                                spec.state_dim, spec.action_dim)
  steps, outcomes = [], []

  def examples():
    produced = demonstrator.episodes(attempts)
    for episode in produced:
      outcomes.append(episode.success)
      if success_only and not episode.success:
        continue
      steps.append(len(episode.actions))
      yield rlds_example(episode, spec.camera_names)
      if len(steps) == num_episodes:
        break
    produced.close()
    if len(steps) < num_episodes:
      raise ValueError(f"--success_only: only {len(steps)} of {len(outcomes)} attempted "
                       f"episodes of {config.env.name!r} succeeded, {num_episodes} were asked for")

  try:
    rlds.write_dataset(out, features, examples(), name=f"{config.env.name}_demos",
                       description=f"jaxvla.data.collect demonstrations of env "
                       f"{config.env.name!r} (noise {noise}"
                       f"{', successful episodes only' if success_only else ''})",
                       max_examples_per_shard=max_episodes_per_shard)
  finally:
    demonstrator.close()
  return dict(out=out, episodes=len(steps), attempted=len(outcomes), steps=int(sum(steps)),
              success_rate=float(np.mean(outcomes)), wall_s=round(time.perf_counter() - t0, 2),
              **demonstrator.report())


def main(argv: list[str]) -> None:
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_flag = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                                lock_config=True)
  out_flag = flags.DEFINE_string("out", None, "Directory of the new RLDS dataset.")
  episodes_flag = flags.DEFINE_integer("episodes", None, "Episodes to record.")
  noise_flag = flags.DEFINE_float("noise", 0.0, "Std of the noise added to executed actions.")
  envs_flag = flags.DEFINE_integer("num_envs", 0, "Envs stepped together (0: min(num_envs, "
                                   "episodes)).")
  shard_flag = flags.DEFINE_integer("episodes_per_shard", 1000, "Episodes per ArrayRecord file.")
  success_flag = flags.DEFINE_bool("success_only", False, "Record only successful episodes.")
  flags.mark_flags_as_required(["config", "out", "episodes"])

  def run(_):
    absl_logging.set_verbosity(absl_logging.WARNING)  # TFDS's INFO lines
    try:
      summary = collect(config_flag.value, out_flag.value, episodes_flag.value,
                        noise=noise_flag.value, num_envs=envs_flag.value,
                        max_episodes_per_shard=shard_flag.value,
                        success_only=success_flag.value)
    except ONE_LINE_ERRORS as e:
      sys.exit(f"error: {e}")
    print(json.dumps(summary))

  app.run(run, argv)


if __name__ == "__main__":
  main(sys.argv)
