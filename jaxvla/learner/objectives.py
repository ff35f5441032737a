"""What PPO and GRPO train on: each algorithm's rows, per-row weights and loss.

An objective turns its batch type into *rows* (arrays with a leading row axis
that the update shuffles and splits into minibatches) and defines a weighted
loss over a minibatch of rows; :mod:`jaxvla.learner.update` runs the epochs,
minibatches, KL early stop and the decoupled proximal step for either.

* :class:`PPOObjective`: a ``Trajectory [T, B]`` -> GAE (truncated episodes
  bootstrapped from their final values) -> ``N = T * B`` chunk rows; minibatch
  weights ``1 / n`` (a mean); the clipped PPO loss with a value term; advantages
  normalised per minibatch (``ppo.advantage_norm``).
* :class:`GRPOObjective`: an ``EpisodeBatch [K, E]`` -> ``E`` episode rows of
  ``K`` padded chunks; per-chunk weights from ``ppo.loss_normalizer``
  (:func:`jaxvla.algorithms.grpo.chunk_weights`); the same loss without a value
  term (GRPO has no critic), advantages already normalised within each group.

Streamed micro-batches weight their rows *globally* (``streamed_weights`` with
the optimizer update's row count), so their gradients and metrics add up to
those of the whole minibatch.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import ml_collections

from jaxvla import types
from jaxvla.algorithms import gae, grpo, ppo
from jaxvla.models import contract


def _log_prob_scale(policy: contract.Policy, cfg: ml_collections.ConfigDict) -> float:
  """``ppo.ratio``'s factor on every chunk log-prob (current, behaviour and proximal
  alike, so the ratios are of the scaled probabilities): see :data:`ppo.RATIOS`."""
  return ppo.log_prob_scale(cfg.ratio, policy.log_prob_terms)


class Objective(Protocol):
  """One algorithm's view of a batch (see the module docstring)."""

  data_type: type  # types.Trajectory or types.EpisodeBatch.

  def rows(self, data) -> dict:
    """The batch as rows ``[n, ...]`` (``log_prob`` ``[n]`` or ``[n, K]``, ``batch``, ``chain``)."""

  def log_prob(self, params: contract.Params, rows: dict) -> jax.Array:
    """Log-probs of ``rows``' chains under ``params``: ``[n]`` (PPO) or ``[n, K]`` (GRPO)."""

  def weights(self, rows: dict) -> jax.Array:
    """Per-row (per-chunk) weights of one minibatch, shaped like ``rows["log_prob"]``."""

  def streamed_weights(self, rows: dict, total_rows: jax.Array) -> jax.Array:
    """Weights of a micro-batch in an optimizer update of ``total_rows`` rows."""

  def loss(self, params: contract.Params, rows: dict, weights: jax.Array
           ) -> tuple[jax.Array, dict]:
    """The weighted loss (a sum over rows) and its metrics (weighted sums too)."""

  def batch_metrics(self, data, rows: dict) -> dict:
    """Scalars describing the whole batch (means over its rows)."""


class PPOObjective:
  """PPO on chunk rows of env segments.

  Args:
    policy: the policy contract.
    cfg: the ``ppo`` sub-config.
  """

  data_type = types.Trajectory

  def __init__(self, policy: contract.Policy, cfg: ml_collections.ConfigDict):
    self.policy, self.cfg = policy, cfg

  def rows(self, traj: types.Trajectory) -> dict:
    """GAE over ``traj [T, B]`` (per env column), flattened to ``N = T * B`` chunks."""
    cfg = self.cfg
    # ppo.bootstrap_truncated: a time limit that only schedules resets cuts an episode
    # the policy could have gone on with, so truncations bootstrap from the value of
    # their last observation (terminations and worker faults from nothing). Where the
    # limit is part of the task (reach the goal in time, a sparse success reward), a
    # time-out is a failure: every episode end is terminal.
    truncation = (dict(terminated=traj.terminated, final_values=traj.final_value)
                  if cfg.get("bootstrap_truncated", False) else {})
    adv, returns = gae.compute_gae(traj.reward, traj.value, traj.done, traj.bootstrap_value,
                                   gamma=cfg.gamma, lam=cfg.gae_lambda, **truncation)
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    return dict(batch=jax.tree.map(flat, traj.batch), chain=flat(traj.chain),
                log_prob=flat(traj.log_prob), adv=flat(adv), returns=flat(returns))

  def log_prob(self, params: contract.Params, rows: dict) -> jax.Array:
    return self.policy.evaluate(params, rows["batch"], rows["chain"]).log_prob

  def weights(self, rows: dict) -> jax.Array:
    n = rows["log_prob"].shape[0]
    return jnp.full((n,), 1.0 / n, jnp.float32)

  def streamed_weights(self, rows: dict, total_rows: jax.Array) -> jax.Array:
    return jnp.full(rows["log_prob"].shape, 1.0 / total_rows, jnp.float32)

  def loss(self, params: contract.Params, rows: dict, weights: jax.Array
           ) -> tuple[jax.Array, dict]:
    ev = self.policy.evaluate(params, rows["batch"], rows["chain"])
    a = rows["adv"]
    if self.cfg.advantage_norm == "minibatch":
      a = (a - a.mean()) / (a.std() + 1e-8)
    proximal = rows.get("proximal")
    if proximal is None:  # The params at the start of this update are the current ones.
      proximal = jax.lax.stop_gradient(ev.log_prob)
    s = _log_prob_scale(self.policy, self.cfg)
    loss, metrics = ppo.ppo_loss(s * ev.log_prob, s * rows["log_prob"], a, ev.value,
                                 rows["returns"], ev.entropy, weights=weights,
                                 proximal_log_prob=s * proximal, **ppo.loss_kwargs(self.cfg))
    return loss, dict(metrics, loss=loss)

  def batch_metrics(self, traj: types.Trajectory, rows: dict) -> dict:
    return dict(value_mean=jnp.mean(traj.value), advantage_std=jnp.std(rows["adv"]))


class GRPOObjective:
  """GRPO on episode rows (every chunk takes its episode's group-normalised advantage).

  Args:
    policy: the policy contract.
    cfg: the ``ppo`` sub-config (``loss_normalizer``, clip, correction, entropy).
    streamed: the streamed learner will call it (the normaliser must allow it).

  Raises:
    ValueError: naming ``config.ppo.loss_normalizer`` if it is unknown or cannot
      be streamed.
  """

  data_type = types.EpisodeBatch

  def __init__(self, policy: contract.Policy, cfg: ml_collections.ConfigDict,
               streamed: bool = False):
    grpo.check_normalizer(cfg.loss_normalizer, streamed)
    self.policy, self.cfg = policy, cfg

  def rows(self, eb: types.EpisodeBatch) -> dict:
    """``EpisodeBatch [K, E]`` -> episode-major rows ``[E, K, ...]`` and ``adv [E]``."""
    swap = lambda x: jnp.swapaxes(jnp.asarray(x), 0, 1)
    return dict(batch=jax.tree.map(swap, eb.batch), chain=swap(eb.chain),
                log_prob=swap(eb.log_prob), mask=swap(eb.mask),
                adv=jnp.asarray(eb.advantage, jnp.float32))

  def _evaluate(self, params: contract.Params, rows: dict) -> contract.Evaluation:
    """The policy's evaluation of every chunk of ``rows`` ``[e, K, ...]``, flattened ``[e * K]``."""
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    return self.policy.evaluate(params, jax.tree.map(flat, rows["batch"]), flat(rows["chain"]))

  def log_prob(self, params: contract.Params, rows: dict) -> jax.Array:
    return self._evaluate(params, rows).log_prob.reshape(rows["chain"].shape[:2])

  def weights(self, rows: dict) -> jax.Array:
    return grpo.chunk_weights(rows["mask"], self.cfg.loss_normalizer)

  def streamed_weights(self, rows: dict, total_rows: jax.Array) -> jax.Array:
    return grpo.streamed_weights(rows["mask"], self.cfg.loss_normalizer, total_rows)

  def loss(self, params: contract.Params, rows: dict, weights: jax.Array
           ) -> tuple[jax.Array, dict]:
    """``rows["proximal"]`` ``[e, K]``, when present, is the decoupled correction's
    proximal log-prob; otherwise the current params are the proximal policy."""
    ev = self._evaluate(params, rows)
    e, k = rows["mask"].shape
    adv = jnp.broadcast_to(rows["adv"][:, None], (e, k)).reshape(-1)
    proximal = (rows["proximal"].reshape(-1) if "proximal" in rows
                else jax.lax.stop_gradient(ev.log_prob))
    zeros = jnp.zeros_like(ev.log_prob)  # No critic: value and target both 0.
    s = _log_prob_scale(self.policy, self.cfg)
    loss, metrics = ppo.ppo_loss(
        s * ev.log_prob, s * rows["log_prob"].reshape(-1), adv, zeros, zeros, ev.entropy,
        weights=weights.reshape(-1), proximal_log_prob=s * proximal,
        **dict(ppo.loss_kwargs(self.cfg), value_coef=0.0))
    del metrics["value_loss"]
    return loss, dict(metrics, loss=loss)

  def batch_metrics(self, eb: types.EpisodeBatch, rows: dict) -> dict:
    """Advantage spread, mean return and mean played chunks per episode."""
    return dict(advantage_std=jnp.std(eb.advantage),
                episode_return_mean=jnp.mean(eb.episode_return),
                episode_length_mean=jnp.mean(jnp.sum(eb.mask, axis=0).astype(jnp.float32)))


def make_objective(policy: contract.Policy, cfg: ml_collections.ConfigDict,
                   streamed: bool = False) -> Objective:
  """The objective of ``cfg.algorithm`` (the ``ppo`` sub-config): 'ppo' or 'grpo'."""
  if cfg.algorithm == "ppo":
    return PPOObjective(policy, cfg)
  if cfg.algorithm == "grpo":
    return GRPOObjective(policy, cfg, streamed)
  raise ValueError(f"config.ppo.algorithm={cfg.algorithm!r} must be 'ppo' or 'grpo'")
