"""The picklable env factory an :class:`jaxvla.envs.pool.EnvPool` builds envs with.

This file owns :class:`ConfigEnvFn`, the ``env_fn`` that builds any registered env
from a run's plain ``env`` config dict (what :func:`jaxvla.envs.make_vec_env`
gives the pool), and :func:`for_pool`, which gives it the pool's ``num_envs`` so
that each worker's envs land in their GRPO groups. Any other picklable
:data:`jaxvla.envs.worker.EnvFn` works too.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from jaxvla.envs import protocol, registry, worker


@dataclasses.dataclass(frozen=True)
class ConfigEnvFn:
  """Picklable factory building envs from a plain ``env`` config dict (any registered env).

  Attributes:
    env_config: the ``env`` sub-config as a dict.
    num_envs: envs in the whole run, so that env ``first_env_id`` lands in its
      GRPO group; None until a pool fills in its own ``num_envs`` (:func:`for_pool`;
      a call with ``first_env_id > 0`` needs it).
  """
  env_config: dict
  num_envs: int | None = None

  def __call__(self, first_env_id: int, count: int, seed: int) -> protocol.VecEnv:
    return registry.make_env(ml_collections.ConfigDict(self.env_config), count, seed,
                             first_env_id=first_env_id, total_envs=self.num_envs)


def config_env_fn(env_config: ml_collections.ConfigDict | dict,
                  num_envs: int | None = None) -> ConfigEnvFn:
  """Returns the pool's ``env_fn`` for the env named in the ``env`` sub-config."""
  if isinstance(env_config, ml_collections.ConfigDict):
    env_config = env_config.to_dict()
  return ConfigEnvFn(dict(env_config), num_envs)


def for_pool(env_fn: worker.EnvFn, num_envs: int) -> worker.EnvFn:
  """``env_fn``, with a :class:`ConfigEnvFn` given the pool's ``num_envs``."""
  if not isinstance(env_fn, ConfigEnvFn):
    return env_fn
  if env_fn.num_envs is None:
    return dataclasses.replace(env_fn, num_envs=num_envs)
  if env_fn.num_envs != num_envs:
    raise ValueError(f"env_fn was made for num_envs={env_fn.num_envs}, but the pool has "
                     f"num_envs={num_envs}")
  return env_fn
