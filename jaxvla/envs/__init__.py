"""Environments: the chunked VecEnv protocol, the built-in env and simulator adapters."""

import dataclasses
import importlib

import ml_collections

from jaxvla.envs import protocol
from jaxvla.envs.protocol import ChunkStep, EnvSpec, EpisodeStats, Observation, VecEnv

_ENV_MODULES = {
    "builtin": "jaxvla.envs.builtin",
    "maniskill": "jaxvla.envs.maniskill",
    "libero": "jaxvla.envs.libero",
}


def make_env(config: ml_collections.ConfigDict, num_envs: int, seed: int, *,
             group_size: int | None = None, first_env_id: int = 0,
             total_envs: int | None = None) -> VecEnv:
  """Builds the env batch named by ``config.name`` from the ``env`` sub-config.

  Args:
    config: the ``env`` sub-config.
    num_envs: envs in this batch.
    seed: episode seed until the first ``reset``.
    group_size: GRPO group size; None reads ``env.group_size``.
      Pass 1 for batches that should not be grouped (e.g. evaluation).
    first_env_id: global id of the batch's env 0 (a pool's worker envs).
    total_envs: envs in the whole run (default: the batch is the run).
  """
  if config.name not in _ENV_MODULES:
    raise ValueError(
        f"config.env.name={config.name!r} is not a known environment; "
        f"choose one of {sorted(_ENV_MODULES)}")
  if group_size is None:
    group_size = config.group_size
  return importlib.import_module(_ENV_MODULES[config.name]).make(
      config, num_envs, seed, group_size=group_size, first_env_id=first_env_id,
      total_envs=total_envs)


def spec_from_config(config: ml_collections.ConfigDict) -> EnvSpec:
  """The spec of the env ``config`` (the ``env`` sub-config) names.

  ColorReach's and LIBERO's are known without building the env (no simulator
  needed); ManiSkill3's state size depends on the task, so one env is built and
  closed to read it.
  """
  if config.name in ("builtin", "libero"):
    return importlib.import_module(_ENV_MODULES[config.name]).spec_from_config(config)
  probe = make_env(config, 1, 0, group_size=1)
  try:
    return probe.spec
  finally:
    probe.close()


def spec_to_json(spec: EnvSpec) -> dict:
  """``spec`` as a JSON-able dict (an export's ``env_spec.json``)."""
  return dataclasses.asdict(spec)


def spec_from_json(body: dict, where: str) -> EnvSpec:
  """The inverse of :func:`spec_to_json`; ``where`` (a file) is named in errors."""
  fields = {f.name for f in dataclasses.fields(EnvSpec)}
  if not isinstance(body, dict) or set(body) != fields:
    raise ValueError(f"{where}: expected the keys {sorted(fields)}, got "
                     f"{sorted(body) if isinstance(body, dict) else type(body).__name__}")
  return EnvSpec(camera_names=tuple(body["camera_names"]),
                 image_shape=tuple(body["image_shape"]), state_dim=int(body["state_dim"]),
                 action_dim=int(body["action_dim"]),
                 max_episode_steps=int(body["max_episode_steps"]))


def make_vec_env(config: ml_collections.ConfigDict, num_envs: int, seed: int, *,
                 num_workers: int, step_timeout_s: float,
                 hang_floor_s: float = 10.0) -> VecEnv:
  """``num_envs`` envs in this process (``num_workers == 0``) or in a worker pool.

  With workers, each of the ``num_workers`` processes owns ``num_envs /
  num_workers`` envs (:class:`jaxvla.envs.pool.EnvPool`); the spec is read from a
  one-env probe built here. Either way env ``i`` is in GRPO group ``i //
  env.group_size`` and plays the same episodes for the same ``reset`` seed.

  Raises:
    ValueError: naming ``env.group_size`` if it does not divide ``num_envs``, or
      ``env_workers`` if ``num_workers`` does not.
  """
  protocol.group_layout(config.group_size, num_envs)  # Fails before any build.
  if num_workers == 0:
    return make_env(config, num_envs, seed)
  if num_workers < 0 or num_envs % num_workers:
    raise ValueError(f"config.env_workers={num_workers} must be >= 0 and divide "
                     f"num_envs={num_envs}")
  from jaxvla.envs import pool  # pylint: disable=import-outside-toplevel
  probe = make_env(config, 1, seed, group_size=1)
  spec = probe.spec
  probe.close()
  return pool.EnvPool(pool.config_env_fn(config, num_envs), num_envs, num_envs // num_workers,
                      spec, step_timeout_s=step_timeout_s, seed=seed, hang_floor_s=hang_floor_s)


__all__ = ["ChunkStep", "EnvSpec", "EpisodeStats", "Observation", "VecEnv", "make_env",
           "make_vec_env", "spec_from_config", "spec_from_json", "spec_to_json"]
