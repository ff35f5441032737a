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

Which steps are stochastic and how their log-densities combine (``config.model``):

* ``sde_steps='all'``: every step is a Gaussian transition (the default).
  ``sde_steps='one'`` (πRL's flow-SDE with ``joint_logprob: False``, RLinf's
  ``openpi_action_model.py``): per sample one step ``k``, drawn uniformly from
  ``0 .. K-1``, is the Gaussian one and the others are the ODE's Euler steps; the
  chain's log-density is that one step's. ``k`` is stored with the chain, as one more
  entry ``chain[:, K + 1]`` filled with ``k`` (a float), so the learner re-scores the
  same step: one network pass instead of ``K``.
* ``log_prob_steps='sum'``: the chain's per-dimension log-density is the sum over its
  Gaussian steps (the exact density). ``'mean'`` (πRL's flow-noise with
  ``joint_logprob: True``): the mean over the chain's ``K + 1`` densities, the initial
  ``N(0, 1)`` noise's and the ``K`` transitions', so a ratio is the geometric mean of
  the per-step ratios (the noise's term does not depend on the parameters and divides
  the log-ratio by ``K + 1``, as RLinf's does). With ``sde_steps='one'`` there is one
  term and the two agree.

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
GAUSSIAN = ("flow_sde", "flow_noise")  # the flow's own steps are stochastic
SDE_STEPS = ("all", "one")  # config.model.sde_steps (module docstring)
LOG_PROB_STEPS = ("sum", "mean")  # config.model.log_prob_steps (module docstring)

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
  _check_steps(model.train_sampler, model.sde_steps, model.log_prob_steps)
  head = STEERED.get(model.eval_sampler)
  if head and model.train_sampler != head:
    raise ValueError(f"config.model.eval_sampler: {model.eval_sampler!r} uses the {head!r} "
                     f"sampler's head; it needs config.model.train_sampler={head!r}")
  if model.train_sampler in STEERED:
    if model.steer_hidden < 1:
      raise ValueError(f"config.model.steer_hidden: must be >= 1, got {model.steer_hidden}")
    if model.steer_image_channels < 0:
      raise ValueError("config.model.steer_image_channels: must be >= 0, got "
                       f"{model.steer_image_channels}")
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
    x: current sample ``[B, H, A]`` at time ``t``.
    v: predicted velocity ``[B, H, A]``.
    learned_std: ``[B, H, A]`` for ``flow_noise``.
    t: current time, a scalar or per sample ``[B, 1, 1]``; ``dt < 0`` the step (same).
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
                 num_steps: int, mode: str, noise_level: float, sde_steps: str = "all",
                 log_prob_steps: str = "sum") -> tuple[jax.Array, jax.Array]:
  """Runs the sampler from ``noise`` ``[B, H, A]``.

  Args:
    sde_steps, log_prob_steps: see the module docstring (Gaussian modes only;
      ``mode='ode'`` takes the defaults).

  Returns:
    chain ``[B, K + 1, H, A]`` (``chain[:, 0]`` is the noise, ``chain[:, K]`` the
    action; with ``sde_steps='one'`` ``[B, K + 2, H, A]``, the stochastic step's index
    last) and per-dimension log-probs ``[B, H, A]`` of the chain (zeros for ``ode``).
  """
  check_mode(mode, needs_log_prob=False)
  _not_steered(mode)
  _check_steps(mode, sde_steps, log_prob_steps)
  ts = time_grid(num_steps)
  t_cap = 1.0 - 1.0 / num_steps
  batch = noise.shape[0]
  one = sde_steps == "one"
  if one:  # The step each sample takes stochastically (the default keeps its key stream).
    step_key, rng = jax.random.split(rng)
    chosen = jax.random.randint(step_key, (batch,), 0, num_steps)

  def step(carry, inputs):
    x, logp = carry
    i, t, t_next, key = inputs
    v, learned_std = velocity_fn(x, jnp.full((batch,), t))
    mean, std = transition(x, v, learned_std, t, t_next - t, mode=mode,
                           noise_level=noise_level, t_cap=t_cap)
    if mode == "ode":
      return (mean, logp), mean
    if one:  # The other samples take the ODE's Euler step here.
      sde = (chosen == i)[:, None, None]
      mean = jnp.where(sde, mean, x + v * (t_next - t))
      x_next = mean + jnp.where(sde, std, 0.0) * jax.random.normal(key, x.shape, x.dtype)
      return (x_next, logp + jnp.where(sde, gaussian_log_prob(x_next, mean, std), 0.0)), x_next
    x_next = mean + std * jax.random.normal(key, x.shape, x.dtype)
    return (x_next, logp + gaussian_log_prob(x_next, mean, std)), x_next

  keys = jax.random.split(rng, num_steps)
  (_, logp), xs = jax.lax.scan(step, (noise, jnp.zeros_like(noise)),
                               (jnp.arange(num_steps), ts[:-1], ts[1:], keys))
  entries = [noise[:, None], jnp.moveaxis(xs, 0, 1)]
  if one:
    entries.append(jnp.broadcast_to(chosen.astype(noise.dtype)[:, None, None, None],
                                    (batch, 1) + noise.shape[1:]))
  chain = jnp.concatenate(entries, axis=1)
  return chain, _reduce(logp, noise, mode, num_steps, sde_steps, log_prob_steps)


def _check_steps(mode: str, sde_steps: str, log_prob_steps: str) -> None:
  """ValueError naming ``config.model.sde_steps`` / ``log_prob_steps`` when unknown, or
  set away from their defaults for a ``mode`` without Gaussian steps."""
  if sde_steps not in SDE_STEPS:
    raise ValueError(f"config.model.sde_steps must be one of {SDE_STEPS}, got {sde_steps!r}")
  if log_prob_steps not in LOG_PROB_STEPS:
    raise ValueError(f"config.model.log_prob_steps must be one of {LOG_PROB_STEPS}, got "
                     f"{log_prob_steps!r}")
  if mode not in GAUSSIAN and (sde_steps, log_prob_steps) != ("all", "sum"):
    raise ValueError(f"config.model.sde_steps={sde_steps!r} and config.model.log_prob_steps="
                     f"{log_prob_steps!r} choose among the flow's own Gaussian steps (the "
                     f"{GAUSSIAN} samplers); the {mode!r} sampler has no Gaussian steps")


def _reduce(logp: jax.Array, noise: jax.Array, mode: str, num_steps: int, sde_steps: str,
            log_prob_steps: str) -> jax.Array:
  """The chain's per-dimension log-density ``[B, H, A]`` from its Gaussian steps' summed
  densities ``logp`` and its initial ``noise`` (module docstring: ``log_prob_steps``)."""
  if mode == "ode" or log_prob_steps == "sum" or sde_steps == "one":
    return logp
  prior = gaussian_log_prob(noise, jnp.zeros_like(noise), jnp.ones_like(noise))
  return (logp + prior) / (num_steps + 1)


def chain_entries(num_steps: int, sde_steps: str) -> int:
  """Entries of a Gaussian mode's stored chain: ``K + 1`` states, and the stochastic
  step's index with ``sde_steps='one'``."""
  return num_steps + (2 if sde_steps == "one" else 1)


def chain_step_log_probs(velocity_fn: VelocityFn, chain: jax.Array, *, num_steps: int,
                          mode: str, noise_level: float, sde_steps: str = "all",
                          log_prob_steps: str = "sum"
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The Gaussian log-density of each scored step of a stored chain (:func:`sample_chain`'s)
  under the current model, before the steps are combined.

  Returns:
    ``(logps, stds, steps)``: per-step, per-dimension log-densities ``[B, S, H, A]``, the
    transitions' stds ``[B, S, H, A]`` and which denoise step each is ``[B, S]``
    (int32): ``S = K`` and ``steps[b] = 0 .. K-1``, or with ``sde_steps='one'`` ``S = 1``
    and the chain's stored stochastic step (one network pass).
  """
  check_mode(mode, needs_log_prob=True)
  _not_steered(mode)
  _check_steps(mode, sde_steps, log_prob_steps)
  want = chain_entries(num_steps, sde_steps)
  if chain.shape[1] != want:
    raise ValueError(f"a {mode!r} chain with sde_steps={sde_steps!r} and {num_steps} denoise "
                     f"steps has {want} entries, got {chain.shape[1]}")
  ts = time_grid(num_steps)
  t_cap = 1.0 - 1.0 / num_steps
  batch = chain.shape[0]
  if sde_steps == "one":
    # The stored index (a float of a small integer: exact), clipped for safety's sake.
    k = jnp.clip(jnp.round(chain[:, -1, 0, 0]).astype(jnp.int32), 0, num_steps - 1)
    pick = lambda i: jnp.take_along_axis(chain, i[:, None, None, None], axis=1)[:, 0]
    x, x_next = pick(k), pick(k + 1)
    t, t_next = ts[k], ts[k + 1]
    v, learned_std = velocity_fn(x, t)
    mean, std = transition(x, v, learned_std, t[:, None, None], (t_next - t)[:, None, None],
                           mode=mode, noise_level=noise_level, t_cap=t_cap)
    return gaussian_log_prob(x_next, mean, std)[:, None], std[:, None], k[:, None]

  def step(_, inputs):
    x, x_next, t, t_next = inputs
    v, learned_std = velocity_fn(x, jnp.full((batch,), t))
    mean, std = transition(x, v, learned_std, t, t_next - t, mode=mode,
                           noise_level=noise_level, t_cap=t_cap)
    return None, (gaussian_log_prob(x_next, mean, std), std)

  xs = jnp.moveaxis(chain, 1, 0)
  _, (logps, stds) = jax.lax.scan(step, None, (xs[:-1], xs[1:], ts[:-1], ts[1:]))
  steps = jnp.broadcast_to(jnp.arange(num_steps, dtype=jnp.int32), (batch, num_steps))
  return jnp.moveaxis(logps, 0, 1), jnp.moveaxis(stds, 0, 1), steps


def chain_log_prob(velocity_fn: VelocityFn, chain: jax.Array, *, num_steps: int, mode: str,
                   noise_level: float, sde_steps: str = "all",
                   log_prob_steps: str = "sum") -> tuple[jax.Array, jax.Array]:
  """Exact log-density of a stored chain (:func:`sample_chain`'s) under the current model.

  Returns:
    per-dimension log-probs ``[B, H, A]`` (:func:`chain_step_log_probs`' steps reduced as
    ``log_prob_steps`` says), and the transition stds of the scored steps ``[B, S, H, A]``
    (for entropy terms): ``S = K``, or ``1`` with ``sde_steps='one'``.
  """
  logps, stds, _ = chain_step_log_probs(velocity_fn, chain, num_steps=num_steps, mode=mode,
                                        noise_level=noise_level, sde_steps=sde_steps,
                                        log_prob_steps=log_prob_steps)
  logp = _reduce(logps.sum(1), chain[:, 0], mode, num_steps, sde_steps, log_prob_steps)
  return logp, stds
