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

Steered modes: the flow itself stays deterministic (``ode``) and frozen, and RL
trains a small Gaussian head (:func:`jaxvla.models.pi0.steer`) and the value head
alone; the chunk's log-prob is that Gaussian's. The policy
(:class:`jaxvla.models.policy.FlowPolicy`) owns them; this module's functions see
their flows as ``ode`` chains.

* ``latent`` (DSRL, Wagenmaker et al. 2025, "Steering Your Diffusion Policy with
  Latent Space Reinforcement Learning"): the head draws the flow's *initial noise*
  (``chain[:, 0]``); ``latent_mean`` starts the ODE at its mean (evaluation).
* ``residual`` (residual RL on a frozen chunked policy, as ResiP, Ankile et al. 2024):
  the base flow runs from ``N(0, 1)`` noise and the head adds a Gaussian correction
  to its action chunk, seeing that chunk; the chain gets the executed chunk as one
  more entry (``[B, K + 2, H, A]``). ``residual_mean`` adds the correction's mean.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

# Steered mode -> the RL sampler whose head it uses (see the module docstring).
STEERED = {"latent": "latent", "latent_mean": "latent",
           "residual": "residual", "residual_mean": "residual"}
MODES = ("ode", "flow_sde", "flow_noise", *STEERED)
DETERMINISTIC = ("ode", "latent_mean", "residual_mean")  # no log-probability

# velocity_fn(x_t [B, H, A], t [B]) -> (velocity [B, H, A], learned_std [B, H, A] | None)
VelocityFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array | None]]


def check_mode(mode: str, *, needs_log_prob: bool) -> None:
  if mode not in MODES:
    raise ValueError(f"sampler mode {mode!r} is not one of {MODES}")
  if needs_log_prob and mode in DETERMINISTIC:
    raise ValueError(f"the {mode!r} sampler is deterministic and has no log-probability; "
                     "use 'flow_sde', 'flow_noise', 'latent' or 'residual' for RL")


def check_samplers(model) -> None:
  """The ``config.model`` sampler fields together; ValueError naming the key.

  ``train_sampler`` must have a log-prob (RL), ``eval_sampler`` may be any mode, and
  a steered evaluation mode needs its head (``train_sampler`` of :data:`STEERED`).
  """
  for key, needs in (("train_sampler", True), ("eval_sampler", False)):
    try:
      check_mode(model[key], needs_log_prob=needs)
    except ValueError as e:
      raise ValueError(f"config.model.{key}: {e}") from None
  head = STEERED.get(model.eval_sampler)
  if head and model.train_sampler != head:
    raise ValueError(f"config.model.eval_sampler: {model.eval_sampler!r} uses the {head!r} "
                     f"sampler's head; it needs config.model.train_sampler={head!r}")
  if model.train_sampler in STEERED:
    if model.steer_hidden < 1:
      raise ValueError(f"config.model.steer_hidden: must be >= 1, got {model.steer_hidden}")
    if not model.steer_bound > 0:
      raise ValueError(f"config.model.steer_bound: must be > 0, got {model.steer_bound}")
    if not 0 < model.steer_std_min <= model.steer_std_init:
      raise ValueError("config.model.steer_std_min: need 0 < steer_std_min <= steer_std_init, "
                       f"got {model.steer_std_min} and {model.steer_std_init}")


def _not_steered(mode: str) -> None:
  if mode in STEERED:
    raise ValueError(f"the {mode!r} sampler's flow is an 'ode' chain; the policy steers it "
                     "and passes mode='ode' here")


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


def gaussian_entropy(std: jax.Array) -> jax.Array:
  """Elementwise entropy of ``N(., std^2)``, same shape as ``std``."""
  return jnp.log(std) + 0.5 * math.log(2.0 * math.pi * math.e)


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
  _not_steered(mode)
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
  _not_steered(mode)
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
