"""A run's policy export used on its own: fixed-seed evaluation, and episodes for a video.

An export (``<workdir>/export``, written by :func:`jaxvla.storage.checkpoint.export_policy`)
holds the policy's params, the run's config (``config.json``) and, for a run with
``data.normalize``, its normalisation (``norm_stats.json``). This module loads it
through :func:`jaxvla.storage.policy_io.load`, builds the env from the export's config,
and plays episodes through jaxvla's own evaluation
(:func:`jaxvla.evaluation.success.evaluate`, the config's evaluation sampler). By
default they are the episodes the run's evaluations played (the same reset seed),
so the figures compare with the run's; the sampler's noise key is this call's own.

* :func:`evaluate_export`: the evaluation figures.
* :func:`record_export`: the same for a few episodes, with every step's camera image
  (:mod:`jaxvla.envs.frames`; ColorReach only).
"""

from __future__ import annotations

import jax

from jaxvla.envs import frames as frames_lib
from jaxvla.envs import make_vec_env, normalized
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.storage import policy_io


def _play(export_dir: str, num_episodes: int | None, seed: int | None, record: bool
          ) -> tuple[dict[str, float], list[frames_lib.Episode] | None]:
  loaded = policy_io.load(export_dir)
  config = loaded.config
  n = config.eval.num_episodes if num_episodes is None else num_episodes
  env_config = config.env.copy_and_resolve_references()
  env_config.group_size = 1  # Independent episodes, as the run's evaluations play them.
  # Recording needs the env in this process (its per-step frames); otherwise the run's.
  env = make_vec_env(env_config, n, config.seed + 1,
                     num_workers=0 if record else config.eval.env_workers,
                     step_timeout_s=config.env_step_timeout_s,
                     hang_floor_s=config.env_hang_floor_s)
  try:
    recorder = frames_lib.FirstEpisodeFrames(env) if record else None
    result = evaluate_lib.evaluate(
        normalized.wrap(recorder or env, loaded.normalizer), loaded.policy, evaluate_lib.row_keyed_act(loaded.policy),
        loaded.params, jax.random.PRNGKey(config.seed),
        seed=config.seed + evaluate_lib.EVAL_SEED_OFFSET if seed is None else seed,
        chunk_len=config.model.chunk_len)
  finally:
    env.close()
  return result, (recorder.episodes() if record else None)


def evaluate_export(export_dir: str, num_episodes: int | None = None,
                    seed: int | None = None) -> dict[str, float]:
  """Evaluates the policy exported to ``export_dir`` (see the module doc).

  Args:
    export_dir: a run's ``export/`` directory.
    num_episodes: episodes to play, one per env (default: the run's
      ``eval.num_episodes``; the first ``n`` of the run's evaluation episodes).
    seed: the envs' reset seed (default: the run's evaluation seed).

  Returns:
    :func:`jaxvla.evaluation.success.evaluate`'s figures (``success_rate``, ...).
  """
  return _play(export_dir, num_episodes, seed, record=False)[0]


def record_export(export_dir: str, num_episodes: int = 4, seed: int | None = None
                  ) -> tuple[dict[str, float], list[frames_lib.Episode]]:
  """:func:`evaluate_export` of ``num_episodes`` episodes, with each one's frames.

  Returns:
    ``(figures, episodes)``: one :class:`jaxvla.envs.frames.Episode` per env, in
    order; :func:`jaxvla.envs.frames.tile` makes them one clip.

  Raises:
    TypeError: the export's env reports no per-step frames (only ColorReach does).
  """
  return _play(export_dir, num_episodes, seed, record=True)
