"""Environments: the chunked VecEnv protocol, the built-in env and simulator adapters.

This module gathers the package's entry points: the registry's :func:`make_env` and
:func:`spec_from_config` (owned by :mod:`jaxvla.envs.registry`), the env spec's JSON
form, and :func:`make_vec_env`, which builds envs in this process or in a worker pool.
"""

import dataclasses

import ml_collections

from jaxvla.envs import pool, protocol
from jaxvla.envs.protocol import ChunkStep, EnvSpec, EpisodeStats, Observation, VecEnv
from jaxvla.envs.registry import make_env, spec_from_config


def spec_to_json(spec: EnvSpec) -> dict:
  """``spec`` as a JSON-able dict (an export's ``env_spec.json``)."""
  return dataclasses.asdict(spec)


def spec_from_json(body: dict, where: str) -> EnvSpec:
  """The inverse of :func:`spec_to_json`; ``where`` (a file) is named in errors."""
  fields = {f.name for f in dataclasses.fields(EnvSpec)}
  optional = {"critic_state_dim"}  # (exports written before it existed have none: 0)
  if not isinstance(body, dict) or not fields - optional <= set(body) <= fields:
    raise ValueError(f"{where}: expected the keys {sorted(fields)}, got "
                     f"{sorted(body) if isinstance(body, dict) else type(body).__name__}")
  return EnvSpec(camera_names=tuple(body["camera_names"]),
                 image_shape=tuple(body["image_shape"]), state_dim=int(body["state_dim"]),
                 action_dim=int(body["action_dim"]),
                 max_episode_steps=int(body["max_episode_steps"]),
                 critic_state_dim=int(body.get("critic_state_dim", 0)))


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
  probe = make_env(config, 1, seed, group_size=1)
  spec = probe.spec
  probe.close()
  return pool.EnvPool(pool.config_env_fn(config, num_envs), num_envs, num_envs // num_workers,
                      spec, step_timeout_s=step_timeout_s, seed=seed, hang_floor_s=hang_floor_s)


__all__ = ["ChunkStep", "EnvSpec", "EpisodeStats", "Observation", "VecEnv", "make_env",
           "make_vec_env", "spec_from_config", "spec_from_json", "spec_to_json"]
