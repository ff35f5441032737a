"""Environments: the chunked VecEnv protocol, the built-in env and simulator adapters."""

import importlib

import ml_collections

from jaxvla.envs.protocol import ChunkStep, EnvSpec, EpisodeStats, Observation, VecEnv

_ENV_MODULES = {"builtin": "jaxvla.envs.builtin"}


def make_env(config: ml_collections.ConfigDict, num_envs: int, seed: int) -> VecEnv:
  """Builds the env batch named by ``config.name`` from the ``env`` sub-config."""
  if config.name not in _ENV_MODULES:
    raise ValueError(
        f"config.env.name={config.name!r} is not a known environment; "
        f"choose one of {sorted(_ENV_MODULES)}")
  return importlib.import_module(_ENV_MODULES[config.name]).make(config, num_envs, seed)


__all__ = ["ChunkStep", "EnvSpec", "EpisodeStats", "Observation", "VecEnv", "make_env"]
