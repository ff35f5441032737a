"""PPO's clipped surrogate, value loss and entropy bonus on action chunks (pure)."""

import jax
import jax.numpy as jnp
import ml_collections


def ppo_loss(new_log_prob: jax.Array, old_log_prob: jax.Array, advantages: jax.Array,
             new_value: jax.Array, returns: jax.Array, entropy: jax.Array, *,
             clip_eps: float, value_coef: float,
             entropy_coef: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO loss over a minibatch; every input is ``[N]`` (one entry per chunk).

  The ratio is between the current and the behaviour log-probability of the
  whole chunk (for flow policies, of the whole denoise chain).

  Returns:
    the scalar loss and a dict of diagnostics (also scalars).
  """
  log_ratio = new_log_prob - old_log_prob
  ratio = jnp.exp(log_ratio)
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
  policy_loss = -jnp.mean(jnp.minimum(unclipped, clipped))
  value_loss = 0.5 * jnp.mean(jnp.square(new_value - returns))
  entropy_mean = jnp.mean(entropy)
  loss = policy_loss + value_coef * value_loss - entropy_coef * entropy_mean
  metrics = dict(
      policy_loss=policy_loss, value_loss=value_loss, entropy=entropy_mean,
      approx_kl=jnp.mean(ratio - 1.0 - log_ratio),
      clip_frac=jnp.mean((jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)))
  return loss, metrics


def loss_kwargs(config: ml_collections.ConfigDict) -> dict:
  """The ``ppo`` sub-config's loss coefficients as keyword arguments."""
  return dict(clip_eps=config.clip_eps, value_coef=config.value_coef,
              entropy_coef=config.entropy_coef)
