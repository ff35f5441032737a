"""The env registry: ``config.env.name`` -> the module that builds that env.

Each registered module has ``make(config, num_envs, seed, *, group_size, first_env_id,
total_envs)`` and is imported only when its env is built, so a simulator's packages
load only for runs that use it. A leaf of the package (it names the env modules,
imports none of them): :mod:`jaxvla.envs` re-exports :func:`make_env` and
:func:`spec_from_config`, and the worker pool (:mod:`jaxvla.envs.pool`) builds its
workers' envs through it.
"""

import importlib

import ml_collections

from jaxvla.envs.protocol import EnvSpec, VecEnv

ENV_MODULES = {
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
  if config.name not in ENV_MODULES:
    raise ValueError(
        f"config.env.name={config.name!r} is not a known environment; "
        f"choose one of {sorted(ENV_MODULES)}")
  if group_size is None:
    group_size = config.group_size
  return importlib.import_module(ENV_MODULES[config.name]).make(
      config, num_envs, seed, group_size=group_size, first_env_id=first_env_id,
      total_envs=total_envs)


def spec_from_config(config: ml_collections.ConfigDict) -> EnvSpec:
  """The spec of the env ``config`` (the ``env`` sub-config) names.

  ColorReach's and LIBERO's are known without building the env (no simulator
  needed); ManiSkill3's state size depends on the task, so one env is built and
  closed to read it.
  """
  if config.name in ("builtin", "libero"):
    return importlib.import_module(ENV_MODULES[config.name]).spec_from_config(config)
  probe = make_env(config, 1, 0, group_size=1)
  try:
    return probe.spec
  finally:
    probe.close()
