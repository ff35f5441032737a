"""Records demonstrations of a config's env as an RLDS dataset (TFDS ArrayRecord, TFDS's writer).

``python -m jaxvla.data.collect --config=configs/default.py --out=DIR --episodes=N``
rolls out the env's demonstrator and writes ``DIR`` as a TFDS version directory
that :class:`jaxvla.data.rlds.RldsReader` (and TFDS itself) reads. Per step:
``observation/<camera>`` (PNG, lossless), ``observation/state``, ``action``,
``reward``, ``discount``, ``is_first / is_last / is_terminal`` (terminal: the
episode ended by success or failure, not by the time limit) and
``language_instruction`` (and ``observation/critic_state`` for an env whose critic
reads the simulation state); per episode ``episode_metadata/success``. The default
config's ``data`` block reads it back with ``--config.data.path=DIR``.

Demonstrators (:mod:`jaxvla.data.demonstrators`): an env with a scripted expert
(``expert_chunk``, e.g. ColorReach) gets ``ExpertDemonstrator``. Others plug in
through ``DEMONSTRATORS`` (env name -> module): ManiSkill3's motion-planning
solutions (:mod:`jaxvla.data.maniskill_planner`). ``--success_only`` records only the
episodes that succeed (as ManiSkill's ``--only-count-success``), attempting up to
:data:`MAX_ATTEMPTS_PER_EPISODE` times as many.
"""

from __future__ import annotations

import json
import sys
import time

import ml_collections
import numpy as np
import PIL.Image

from jaxvla import progress
from jaxvla.data import rlds
from jaxvla.data.demonstrators import Episode, make_demonstrator
from jaxvla.data.episodes import ONE_LINE_ERRORS

MAX_ATTEMPTS_PER_EPISODE = 4  # success_only: attempts per episode asked for, at most.


def rlds_example(episode: Episode, cameras: tuple[str, ...], critic_state_dim: int = 0) -> dict:
  """An :class:`Episode` as the nested example :func:`rlds.step_features` describes
  (with ``critic_state_dim``: the episode's critic state too).

  Raises:
    ValueError: the env has a critic state (``critic_state_dim``) and the episode's
      demonstrator did not record one of that size.
  """
  t = len(episode.actions)
  critic = episode.critic_state
  if critic_state_dim and (critic is None or np.shape(critic) != (t, critic_state_dim)):
    raise ValueError(f"the demonstrator recorded critic_state of shape "
                     f"{None if critic is None else np.shape(critic)}, the env's "
                     f"critic_state_dim needs [{t}, {critic_state_dim}]")
  steps = []
  for i in range(t):
    last = i == t - 1
    observation = {**{c: PIL.Image.fromarray(episode.images[i, k])
                      for k, c in enumerate(cameras)}, "state": episode.state[i]}
    if critic_state_dim:
      observation[rlds.CRITIC_STATE_FIELD] = critic[i].astype(np.float32)
    steps.append(dict(
        observation=observation,
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
                                spec.state_dim, spec.action_dim,
                                critic_state_dim=spec.critic_state_dim)
  steps, outcomes = [], []
  lines = progress.PhaseLog("demonstrations", num_episodes,
                           config.get("log", {}).get("progress_every_s", 30.0))

  def examples():
    produced = demonstrator.episodes(attempts)
    for episode in produced:
      outcomes.append(episode.success)
      if success_only and not episode.success:
        continue
      steps.append(len(episode.actions))
      yield rlds_example(episode, spec.camera_names, spec.critic_state_dim)
      lines.tick(len(steps), attempted=len(outcomes))
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
