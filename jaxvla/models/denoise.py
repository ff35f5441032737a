"""Stochastic flow-matching samplers and the exact log-probability of their chains.

Convention (openpi's): ``x_t = t * noise + (1 - t) * action`` and the network
predicts the velocity ``v = noise - action``; sampling integrates from ``t = 1``
(pure noise) to ``t = 0`` (the action) in ``K`` equal steps.

Each denoise step ``x_{t} -> x_{t + dt}`` (``dt = -1/K``) is a Gaussian transition
``N(mean, std^2)``; the chain ``[x_1, ..., x_0]`` therefore has an exact
log-density, the sum of the per-step Gaussian log-densities (the initial noise
does not depend on the parameters and is left out). Modes:

* ``ode``: deterministic Euler steps (``std = 0``) — evaluation only, no log-prob.
* ``flow_sde``: the SDE with the same marginals as the flow ODE (Flow-GRPO's
  form), ``sigma_t = noise_level * sqrt(t / (1 - t))`` and an Euler-Maruyama step.
* ``flow_noise``: Euler mean with a learned, bounded std per action dimension.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

MODES = ("ode", "flow_sde", "flow_noise")

# velocity_fn(x_t [B, H, A], t [B]) -> (velocity [B, H, A], learned_std [B, H, A] | None)
VelocityFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array | None]]


def check_mode(mode: str, *, needs_log_prob: bool) -> None:
  if mode not in MODES:
    raise ValueError(f"sampler mode {mode!r} is not one of {MODES}")
  if needs_log_prob and mode == "ode":
    raise ValueError("the 'ode' sampler is deterministic and has no log-probability; "
                     "use 'flow_sde' or 'flow_noise' for RL")


def time_grid(num_steps: int) -> jax.Array:
  """Times ``t_0 = 1 > t_1 > ... > t_K = 0``, ``[K + 1]``."""
  return jnp.linspace(1.0, 0.0, num_steps + 1)


def transition(x: jax.Array, v: jax.Array, learned_std: jax.Array | None, t: jax.Array,
               dt: jax.Array, *, mode: str, noise_level: float,
               t_cap: float) -> tuple[jax.Array, jax.Array]:
  """Mean and std of one Gaussian denoise step.

  Args:
    x: current sample ``[B, H, A]`` at time ``t`` (scalar).
    v: predicted velocity ``[B, H, A]``.
    learned_std: ``[B, H, A]`` for ``flow_noise``.
    t: current time (scalar); ``dt < 0`` the step.
    t_cap: the largest ``t`` used inside ``sqrt(t / (1 - t))`` (``1 - 1/K``) so
      the first SDE step stays finite.

  Returns:
    ``(mean, std)``, both ``[B, H, A]``.
  """
  if mode == "ode":
    return x + v * dt, jnp.zeros_like(x)
  if mode == "flow_noise":
    return x + v * dt, learned_std
  # flow_sde: Flow-GRPO's discretisation of the marginal-preserving SDE.
  sigma = noise_level * jnp.sqrt(t / (1.0 - jnp.minimum(t, t_cap)))
  mean = (x * (1.0 + sigma**2 / (2.0 * t) * dt)
          + v * (1.0 + sigma**2 * (1.0 - t) / (2.0 * t)) * dt)
  std = sigma * jnp.sqrt(-dt)
  return mean, jnp.broadcast_to(std, x.shape)


def gaussian_log_prob(x: jax.Array, mean: jax.Array, std: jax.Array) -> jax.Array:
  """Elementwise Gaussian log-density, same shape as ``x``."""
  z = (x - mean) / std
  return -0.5 * z * z - jnp.log(std) - 0.5 * math.log(2.0 * math.pi)


def sample_chain(velocity_fn: VelocityFn, noise: jax.Array, rng: jax.Array, *,
                 num_steps: int, mode: str,
                 noise_level: float) -> tuple[jax.Array, jax.Array]:
  """Runs the sampler from ``noise`` ``[B, H, A]``.

  Returns:
    chain ``[B, K + 1, H, A]`` (``chain[:, 0]`` is the noise, ``chain[:, -1]``
    the action) and per-dimension log-probs ``[B, H, A]`` of the chain summed
    over steps (zeros for ``ode``).
  """
  check_mode(mode, needs_log_prob=False)
  ts = time_grid(num_steps)
  t_cap = 1.0 - 1.0 / num_steps
  batch = noise.shape[0]

  def step(carry, inputs):
    x, logp = carry
    t, t_next, key = inputs
    v, learned_std = velocity_fn(x, jnp.full((batch,), t))
    mean, std = transition(x, v, learned_std, t, t_next - t, mode=mode,
                           noise_level=noise_level, t_cap=t_cap)
    if mode == "ode":
      return (mean, logp), mean
    x_next = mean + std * jax.random.normal(key, x.shape, x.dtype)
    return (x_next, logp + gaussian_log_prob(x_next, mean, std)), x_next

  keys = jax.random.split(rng, num_steps)
  (_, logp), xs = jax.lax.scan(step, (noise, jnp.zeros_like(noise)), (ts[:-1], ts[1:], keys))
  chain = jnp.concatenate([noise[:, None], jnp.moveaxis(xs, 0, 1)], axis=1)
  return chain, logp


def chain_log_prob(velocity_fn: VelocityFn, chain: jax.Array, *, num_steps: int, mode: str,
                   noise_level: float) -> tuple[jax.Array, jax.Array]:
  """Exact log-density of a stored chain ``[B, K + 1, H, A]`` under the current model.

  Returns:
    per-dimension log-probs ``[B, H, A]`` summed over the K steps, and the
    per-step transition stds ``[B, K, H, A]`` (for entropy terms).
  """
  check_mode(mode, needs_log_prob=True)
  if chain.shape[1] != num_steps + 1:
    raise ValueError(f"chain has {chain.shape[1] - 1} steps, the sampler {num_steps}")
  ts = time_grid(num_steps)
  t_cap = 1.0 - 1.0 / num_steps
  batch = chain.shape[0]

  def step(_, inputs):
    x, x_next, t, t_next = inputs
    v, learned_std = velocity_fn(x, jnp.full((batch,), t))
    mean, std = transition(x, v, learned_std, t, t_next - t, mode=mode,
                           noise_level=noise_level, t_cap=t_cap)
    return None, (gaussian_log_prob(x_next, mean, std), std)

  xs = jnp.moveaxis(chain, 1, 0)
  _, (logps, stds) = jax.lax.scan(step, None, (xs[:-1], xs[1:], ts[:-1], ts[1:]))
  return logps.sum(0), jnp.moveaxis(stds, 0, 1)
