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


def compute_vtrace(rewards: jax.Array, values: jax.Array, dones: jax.Array,
                   bootstrap_value: jax.Array, log_rhos: jax.Array, *, gamma: float,
                   lam: float, rho_bar: float = 1.0, c_bar: float = 1.0,
                   terminated: jax.Array | None = None,
                   final_values: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """V-trace (Espeholt et al. 2018, "IMPALA") value targets and policy-gradient advantages.

  The value targets of the policy being trained from steps a *behaviour* policy took:
  each TD error and trace is weighted by the truncated importance ratio of the
  action, so the targets follow the target policy's values (up to the truncation)
  however far the behaviour lagged. Per step ``t`` (``rho_t = min(rho_bar, e^{log_rhos_t})``,
  ``c_t = lam * min(c_bar, e^{log_rhos_t})``, ``next_t`` as in :func:`compute_gae`)::

    delta_t = rho_t * (r_t + gamma * (1 - terminated_t) * next_t - V_t)
    vs_t    = V_t + delta_t + gamma * c_t * (1 - dones_t) * (vs_{t+1} - V_{t+1})
    A_t     = r_t + gamma * (1 - terminated_t) * vs_next_t - V_t

  where ``vs_next_t`` is ``vs_{t+1}``, or ``next_t`` at an episode end and after the
  last step. With ``log_rhos = 0`` and ``lam = 1``, ``vs`` are the n-step returns.
  ``A_t`` carries no ``rho_t``: the loss's own importance weight applies it.

  Args:
    rewards, values, dones, bootstrap_value, terminated, final_values: as in
      :func:`compute_gae`; ``values`` are the target policy's critic.
    log_rhos: ``[T, B]`` log(target / behaviour probability) of each step's action.
    gamma, lam: discount and trace decay.
    rho_bar, c_bar: truncation of the TD-error and trace weights.

  Returns:
    advantages ``[T, B]`` and value targets ``vs`` ``[T, B]``.
  """
  if (terminated is None) != (final_values is None):
    raise ValueError("compute_vtrace: pass terminated and final_values together (or neither)")
  if terminated is None:
    terminated, final_values = dones, jnp.zeros_like(values)
  rhos = jnp.exp(log_rhos)
  rho = jnp.minimum(rho_bar, rhos)
  c = lam * jnp.minimum(c_bar, rhos)
  not_done = 1.0 - dones.astype(values.dtype)
  not_terminated = 1.0 - terminated.astype(values.dtype)
  next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
  next_values = jnp.where(dones, final_values, next_values)
  deltas = rho * (rewards + gamma * not_terminated * next_values - values)

  def step(carry, x):
    delta, nd, c_t = x
    acc = delta + gamma * c_t * nd * carry
    return acc, acc

  _, acc = jax.lax.scan(step, jnp.zeros_like(bootstrap_value), (deltas, not_done, c),
                        reverse=True)
  vs = values + acc
  vs_next = jnp.concatenate([vs[1:], bootstrap_value[None]], axis=0)
  vs_next = jnp.where(dones, next_values, vs_next)
  return rewards + gamma * not_terminated * vs_next - values, vs
