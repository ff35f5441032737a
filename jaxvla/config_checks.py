"""Checks of a whole config before any work starts; each error names the offending key."""

import ml_collections

from jaxvla.models import denoise


def _require(ok: bool, key: str, message: str) -> None:
  if not ok:
    raise ValueError(f"config.{key}: {message}")


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises ``ValueError`` naming the first inconsistent field of ``c``."""
  _require(c.total_env_steps >= 0, "total_env_steps", f"must be >= 0, got {c.total_env_steps}")
  _require(c.num_envs >= 1, "num_envs", f"must be >= 1, got {c.num_envs}")
  _require(c.env_workers >= 0 and (c.env_workers == 0 or c.num_envs % c.env_workers == 0),
           "env_workers", f"must be >= 0 and divide num_envs={c.num_envs}, got {c.env_workers}")
  _require(c.env_step_timeout_s > 0, "env_step_timeout_s", "must be > 0")
  _require(c.rollout_len >= 1, "rollout_len", f"must be >= 1, got {c.rollout_len}")
  _require(1 <= c.model.chunk_len <= c.env.max_episode_steps, "model.chunk_len",
           f"must be in [1, env.max_episode_steps={c.env.max_episode_steps}], "
           f"got {c.model.chunk_len}")
  _require(c.model.num_denoise_steps >= 1, "model.num_denoise_steps",
           f"must be >= 1, got {c.model.num_denoise_steps}")
  _require(c.model.train_sampler in denoise.MODES and c.model.train_sampler != "ode",
           "model.train_sampler",
           f"must be 'flow_sde' or 'flow_noise' (RL needs log-probs), got {c.model.train_sampler!r}")
  _require(c.model.eval_sampler in denoise.MODES, "model.eval_sampler",
           f"must be one of {denoise.MODES}, got {c.model.eval_sampler!r}")
  _require(0 < c.model.noise_std_min < c.model.noise_std_max, "model.noise_std_min",
           "need 0 < noise_std_min < noise_std_max")
  _require(c.model.noise_level > 0, "model.noise_level", f"must be > 0, got {c.model.noise_level}")
  n = c.num_envs * c.rollout_len
  _require(n % c.ppo.num_minibatches == 0, "ppo.num_minibatches",
           f"must divide num_envs * rollout_len = {n}")
  _require(0 < c.ppo.gamma <= 1, "ppo.gamma", f"must be in (0, 1], got {c.ppo.gamma}")
  _require(0 <= c.ppo.gae_lambda <= 1, "ppo.gae_lambda", f"must be in [0, 1], got {c.ppo.gae_lambda}")
  _require(c.ppo.clip_eps > 0, "ppo.clip_eps", f"must be > 0, got {c.ppo.clip_eps}")
  _require(c.bc.num_steps >= 0, "bc.num_steps", f"must be >= 0, got {c.bc.num_steps}")
  _require(c.bc.num_steps == 0 or c.bc.num_episodes >= 1, "bc.num_episodes",
           "must be >= 1 when bc.num_steps > 0")
  _require(c.eval.every_iters >= 1, "eval.every_iters", "must be >= 1")
  _require(c.eval.num_episodes >= 1, "eval.num_episodes", "must be >= 1")
  _require(c.checkpoint.every_iters >= 1, "checkpoint.every_iters", "must be >= 1")
