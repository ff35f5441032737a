"""Generalised advantage estimation over chunk steps (pure functions)."""

import jax
import jax.numpy as jnp


def compute_gae(rewards: jax.Array, values: jax.Array, dones: jax.Array,
                bootstrap_value: jax.Array, *, gamma: float,
                lam: float) -> tuple[jax.Array, jax.Array]:
  """GAE(gamma, lambda), time-major.

  Args:
    rewards: ``[T, B]`` reward of each chunk step.
    values: ``[T, B]`` value of the observation each step acted on.
    dones: ``[T, B]`` the episode ended during the step (no bootstrap across it).
    bootstrap_value: ``[B]`` value of the observation after the last step.

  Returns:
    advantages ``[T, B]`` and returns (value targets) ``[T, B]``.
  """
  not_done = 1.0 - dones.astype(values.dtype)
  next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
  deltas = rewards + gamma * not_done * next_values - values

  def step(carry, x):
    delta, nd = x
    adv = delta + gamma * lam * nd * carry
    return adv, adv

  _, adv = jax.lax.scan(step, jnp.zeros_like(bootstrap_value), (deltas, not_done),
                        reverse=True)
  return adv, adv + values
