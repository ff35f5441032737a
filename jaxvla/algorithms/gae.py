"""Generalised advantage estimation over chunk steps (pure functions)."""

import jax
import jax.numpy as jnp


def compute_gae(rewards: jax.Array, values: jax.Array, dones: jax.Array,
                bootstrap_value: jax.Array, *, gamma: float, lam: float,
                terminated: jax.Array | None = None,
                final_values: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """GAE(gamma, lambda), time-major, bootstrapping episodes cut by a time limit.

  An episode ends by *termination* (success or failure: it has no future) or by
  *truncation* (the time limit cut a future it still had: its TD target
  bootstraps from the value of its last observation). Per step ``t``::

    next_t  = final_values_t if dones_t else V_{t+1}   (bootstrap_value after the last)
    delta_t = r_t + gamma * (1 - terminated_t) * next_t - V_t
    A_t     = delta_t + gamma * lam * (1 - dones_t) * A_{t+1}

  so the advantage recursion stops at every episode end, and only truncations
  look past theirs. Without ``terminated`` and ``final_values`` every episode end
  is a termination (nothing bootstrapped at any of them).

  Args:
    rewards: ``[T, B]`` reward of each chunk step.
    values: ``[T, B]`` value of the observation each step acted on.
    dones: ``[T, B]`` the episode ended during the step (terminated or truncated).
    bootstrap_value: ``[B]`` value of the observation after the last step.
    terminated: ``[T, B]`` the episode ended by termination during the step.
    final_values: ``[T, B]`` value of the last observation of an episode truncated
      during the step; 0 where there is none, e.g. an episode lost to a worker
      fault, which is then not bootstrapped (like a termination).

  Returns:
    advantages ``[T, B]`` and returns (value targets) ``[T, B]``.

  Raises:
    ValueError: only one of ``terminated`` and ``final_values`` is given.
  """
  if (terminated is None) != (final_values is None):
    raise ValueError("compute_gae: pass terminated and final_values together (or neither)")
  if terminated is None:
    terminated, final_values = dones, jnp.zeros_like(values)
  not_done = 1.0 - dones.astype(values.dtype)
  next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
  next_values = jnp.where(dones, final_values, next_values)
  not_terminated = 1.0 - terminated.astype(values.dtype)
  deltas = rewards + gamma * not_terminated * next_values - values

  def step(carry, x):
    delta, nd = x
    adv = delta + gamma * lam * nd * carry
    return adv, adv

  _, adv = jax.lax.scan(step, jnp.zeros_like(bootstrap_value), (deltas, not_done),
                        reverse=True)
  return adv, adv + values
