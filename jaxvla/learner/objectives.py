"""What PPO and GRPO train on: each algorithm's rows, per-row weights and loss.

Owns the objectives' maths; which one a run trains with (``config.algorithm``) is
:mod:`jaxvla.learner.algorithm`'s record (its ``objective`` field builds it).

An objective turns its batch type into *rows* (arrays with a leading row axis
that the update shuffles and splits into minibatches) and defines a weighted
loss over a minibatch of rows; :mod:`jaxvla.learner.update` runs the epochs,
minibatches, KL early stop and the decoupled proximal step for either.

* :class:`PPOObjective`: a ``Trajectory [T, B]`` -> GAE (truncated episodes
  bootstrapped from their final values) -> ``N = T * B`` chunk rows; minibatch
  weights ``1 / n`` (a mean); the clipped PPO loss with a value term; advantages
  normalised per minibatch (``rl.advantage_norm``).
* :class:`GRPOObjective`: an ``EpisodeBatch [K, E]`` -> ``E`` episode rows of
  ``K`` padded chunks; per-chunk weights from ``grpo.loss_normalizer``
  (:func:`jaxvla.algorithms.grpo.chunk_weights`); the same loss without a value
  term (GRPO has no critic), advantages already normalised within each group.

Streamed micro-batches weight their rows *globally* (``streamed_weights`` with
the optimizer update's row count), so their gradients and metrics add up to
those of the whole minibatch.

Spreads (``advantage_std``, ``explained_variance``) are not means, so
``batch_metrics`` gives their rows' first and second moments (``moment/*``), which
add up over micro-batches like means do, and :func:`spreads` turns a whole update's
moments into them: a streamed update logs the whole batch's spread, not the mean of
its micro-batches' (of 20 rows each in full async from pixels, whose mean explained
variance read -0.5 to -1.5 where the sync runs' batches read about 0.5).

Staleness diagnostics (:meth:`PPOObjective.batch_metrics`, whenever the update
evaluated its rows under the params it started from, the *proximal* policy): the
behaviour -> proximal KL, how far the critic moved since the rollout
(``value_drift``) and how much that moves the advantages (``advantage_drift``),
each for the rows of the current version (``_fresh``) and the older ones
(``_stale``). With ``rl.value_targets='learner'`` the advantages and returns are
recomputed from those proximal values instead of the rollout's.
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
  """``rl.ratio``'s factor on every chunk log-prob (current, behaviour and proximal
  alike, so the ratios are of the scaled probabilities): see :data:`ppo.RATIOS`."""
  return ppo.log_prob_scale(cfg.ratio, policy.log_prob_terms)


def _log_probs(policy: contract.Policy, cfg: ml_collections.ConfigDict, log_prob: jax.Array,
               log_prob_dims: jax.Array) -> jax.Array:
  """What the loss's ratios are over: the chunk log-probs ``log_prob [...]``, or with
  a per-term ``rl.ratio`` (:func:`ppo.uses_terms`) the executed dims' ``[..., H * A]``
  of ``log_prob_dims [..., H, A_net]`` (padded dims dropped)."""
  if not ppo.uses_terms(cfg):
    return log_prob
  dims = log_prob_dims[..., :policy.action_dim]
  return dims.reshape(dims.shape[:-2] + (-1,))


def _chunk(log_prob: jax.Array) -> jax.Array:
  """PPO's chunk log-probs ``[n]`` from its rows' ``[n]`` or per-term ``[n, M]``."""
  return log_prob.sum(-1) if log_prob.ndim == 2 else log_prob


class Objective(Protocol):
  """One algorithm's view of a batch (see the module docstring)."""

  data_type: type  # types.Trajectory or types.EpisodeBatch.

  def rows(self, data) -> dict:
    """The batch as rows ``[n, ...]`` (``log_prob`` ``[n]`` or ``[n, K]``, ``batch``, ``chain``)."""

  def evaluate(self, params: contract.Params, rows: dict) -> tuple[jax.Array, jax.Array]:
    """``(log_prob, value)`` of ``rows`` under ``params``: ``[n]`` (PPO) or ``[n, K]`` (GRPO)."""

  def relabel(self, data, rows: dict) -> dict:
    """``rows`` with targets from ``rows["proximal_value"]`` where the config asks for them."""

  def weights(self, rows: dict) -> jax.Array:
    """Per-row (per-chunk) weights of one minibatch, shaped like ``rows["log_prob"]``."""

  def streamed_weights(self, rows: dict, total_rows: jax.Array) -> jax.Array:
    """Weights of a micro-batch in an optimizer update of ``total_rows`` rows."""

  def loss(self, params: contract.Params, rows: dict, weights: jax.Array
           ) -> tuple[jax.Array, dict]:
    """The weighted loss (a sum over rows) and its metrics (weighted sums too)."""

  def batch_metrics(self, data, rows: dict) -> dict:
    """Scalars describing the whole batch: means over its rows, spreads as the moments
    :func:`spreads` reads."""


class PPOObjective:
  """PPO on chunk rows of env segments.

  Args:
    policy: the policy contract.
    cfg: the ``rl`` sub-config.
  """

  data_type = types.Trajectory

  def __init__(self, policy: contract.Policy, cfg: ml_collections.ConfigDict):
    self.policy, self.cfg = policy, cfg

  def rows(self, traj: types.Trajectory) -> dict:
    """GAE over ``traj [T, B]`` (per env column), flattened to ``N = T * B`` chunks
    (``log_prob``: ``[N]``, or ``[N, M]`` per term, see :func:`_log_probs`)."""
    adv, returns = self._gae(traj, traj.value)
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    return dict(batch=jax.tree.map(flat, traj.batch), chain=flat(traj.chain),
                log_prob=_log_probs(self.policy, self.cfg, flat(traj.log_prob),
                                    flat(traj.log_prob_dims)),
                adv=flat(adv), returns=flat(returns),
                value=flat(traj.value), version=flat(traj.policy_version))

  def _gae(self, traj: types.Trajectory, value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """GAE over ``traj [T, B]`` with ``value [T, B]`` (its bootstrap values as recorded)."""
    cfg = self.cfg
    # rl.bootstrap_truncated: a time limit that only schedules resets cuts an episode
    # the policy could have gone on with, so truncations bootstrap from the value of
    # their last observation (terminations and worker faults from nothing). Where the
    # limit is part of the task (reach the goal in time, a sparse success reward), a
    # time-out is a failure: every episode end is terminal.
    truncation = (dict(terminated=traj.terminated, final_values=traj.final_value)
                  if cfg.get("bootstrap_truncated", False) else {})
    return gae.compute_gae(traj.reward, value, traj.done, traj.bootstrap_value,
                           gamma=cfg.gamma, lam=cfg.gae_lambda, **truncation)

  def evaluate(self, params: contract.Params, rows: dict) -> tuple[jax.Array, jax.Array]:
    ev = self.policy.evaluate(params, rows["batch"], rows["chain"])
    return _log_probs(self.policy, self.cfg, ev.log_prob, ev.log_prob_dims), ev.value

  def step_log_probs(self, params: contract.Params, rows: dict) -> tuple[jax.Array, jax.Array]:
    """Each Gaussian step of the rows' chains scored on its own: ``(logps [n, S, H, A],
    steps [n, S])`` (the policy's ``step_log_probs``; flow policies only)."""
    return self.policy.step_log_probs(params, rows["batch"], rows["chain"])

  def relabel(self, traj: types.Trajectory, rows: dict) -> dict:
    """Targets from the proximal pass (``rl.value_targets``): 'learner', GAE from the
    proximal critic's values of the rows; 'vtrace', V-trace from those values and the
    behaviour -> proximal ratios. The bootstrap and final values stay the rollout's
    (their observations are not in the trajectory). ``rows["adv_learner"]`` is the
    GAE from the proximal values (for the diagnostics); ``rows["adv_rollout"]``
    keeps the rollout's advantages where they are replaced."""
    value = rows["proximal_value"].reshape(traj.value.shape)
    adv, returns = self._gae(traj, value)
    rows = dict(rows, adv_learner=adv.reshape(-1))
    if self.cfg.value_targets == "vtrace":
      s = _log_prob_scale(self.policy, self.cfg)
      log_rhos = (s * _chunk(rows["proximal"] - rows["log_prob"])).reshape(traj.value.shape)
      truncation = (dict(terminated=traj.terminated, final_values=traj.final_value)
                    if self.cfg.get("bootstrap_truncated", False) else {})
      adv, returns = gae.compute_vtrace(traj.reward, value, traj.done, traj.bootstrap_value,
                                        log_rhos, gamma=self.cfg.gamma,
                                        lam=self.cfg.gae_lambda, **truncation)
    if self.cfg.value_targets != "rollout":
      rows.update(adv_rollout=rows["adv"], adv=adv.reshape(-1), returns=returns.reshape(-1))
    return rows

  def weights(self, rows: dict) -> jax.Array:
    n = rows["log_prob"].shape[0]
    return jnp.full((n,), 1.0 / n, jnp.float32)

  def streamed_weights(self, rows: dict, total_rows: jax.Array) -> jax.Array:
    return jnp.full(rows["log_prob"].shape[:1], 1.0 / total_rows, jnp.float32)

  def loss(self, params: contract.Params, rows: dict, weights: jax.Array
           ) -> tuple[jax.Array, dict]:
    ev = self.policy.evaluate(params, rows["batch"], rows["chain"])
    log_prob = _log_probs(self.policy, self.cfg, ev.log_prob, ev.log_prob_dims)
    a = rows["adv"]
    if self.cfg.advantage_norm == "minibatch":
      a = (a - a.mean()) / (a.std() + 1e-8)
    proximal = rows.get("proximal")
    if proximal is None:  # The params at the start of this update are the current ones.
      proximal = jax.lax.stop_gradient(log_prob)
    s = _log_prob_scale(self.policy, self.cfg)
    loss, metrics = ppo.ppo_loss(s * log_prob, s * rows["log_prob"], a, ev.value,
                                 rows["returns"], ev.entropy, weights=weights,
                                 proximal_log_prob=s * proximal, old_value=rows["value"],
                                 **ppo.loss_kwargs(self.cfg))
    loss, metrics = _with_state_estimate(loss, metrics, ev, weights, self.cfg)
    return loss, dict(metrics, loss=loss)

  def batch_metrics(self, traj: types.Trajectory, rows: dict) -> dict:
    """Value scale, the moments of the advantages, returns and value residuals
    (:func:`spreads`); with a proximal pass, the staleness diagnostics (module
    docstring): per-row means over all rows, the fresh ones (the learner's current
    version) and the stale ones, 0 for a subset with no rows."""
    returns, value = rows["returns"], rows["value"]
    metrics = dict(value_mean=jnp.mean(traj.value),
                   **_moments(adv=rows["adv"], returns=returns, residual=returns - value))
    if "proximal_value" not in rows:
      return metrics
    s = _log_prob_scale(self.policy, self.cfg)
    d = s * _chunk(rows["proximal"] - rows["log_prob"])
    adv_rollout = rows.get("adv_rollout", rows["adv"])
    per_row = dict(
        # k3 estimate of KL(behaviour || proximal) on the behaviour's samples.
        kl_behaviour_proximal=jnp.exp(d) - 1.0 - d,
        value_drift=jnp.abs(rows["proximal_value"] - rows["value"]),
        # In units of the rollout advantages' std (what the normalised loss sees).
        advantage_drift=(jnp.abs(rows["adv_learner"] - adv_rollout)
                         / (jnp.std(adv_rollout) + 1e-8)))
    stale = rows["lag"] > 0
    mean_over = lambda x, m: jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(jnp.sum(m), 1)
    for name, x in per_row.items():
      metrics[name] = jnp.mean(x)
      metrics[name + "_fresh"] = mean_over(x, ~stale)
      metrics[name + "_stale"] = mean_over(x, stale)
    metrics["stale_frac"] = jnp.mean(stale.astype(jnp.float32))
    return metrics


def _moments(**xs: jax.Array) -> dict[str, jax.Array]:
  """``moment/<name>`` and ``moment/<name>_sq``: the row means of each x and x**2."""
  out = {}
  for name, x in xs.items():
    x = x.astype(jnp.float32)
    out[f"moment/{name}"], out[f"moment/{name}_sq"] = jnp.mean(x), jnp.mean(jnp.square(x))
  return out


def spreads(metrics: dict) -> dict:
  """``metrics`` with its ``moment/*`` (the whole update's, :func:`_moments`) replaced by
  ``advantage_std`` and, where the returns' are there, ``explained_variance``: the share
  of the returns' variance that the rollout's values account for (1: a perfect critic,
  0 or less: no better than a constant), the usual health sign of a critic
  (tests/test_learner_check.py holds a floor on it)."""
  m = {k: v for k, v in metrics.items() if not k.startswith("moment/")}
  var = lambda name: jnp.maximum(metrics[f"moment/{name}_sq"] - metrics[f"moment/{name}"] ** 2, 0.0)
  if "moment/adv" in metrics:
    m["advantage_std"] = jnp.sqrt(var("adv"))
  if "moment/returns" in metrics:
    m["explained_variance"] = 1.0 - var("residual") / jnp.maximum(var("returns"), 1e-8)
  return m


def _with_state_estimate(loss: jax.Array, metrics: dict, ev: contract.Evaluation,
                         weights: jax.Array, cfg: ml_collections.ConfigDict
                         ) -> tuple[jax.Array, dict]:
  """The loss plus ``rl.state_estimate_coef`` times the policy's state-estimator
  regression (``Evaluation.state_estimate_loss``, weighted as the chunks are, so it adds
  up over micro-batches like the PPO terms); the metric ``state_estimate_loss``. Unchanged
  for a policy without an estimator."""
  if ev.state_estimate_loss is None:
    return loss, metrics
  est = jnp.sum(jnp.where(weights != 0, weights * ev.state_estimate_loss, 0.0))
  return loss + cfg.state_estimate_coef * est, dict(metrics, state_estimate_loss=est)


class GRPOObjective:
  """GRPO on episode rows (every chunk takes its episode's group-normalised advantage).

  Args:
    policy: the policy contract.
    cfg: the ``rl`` sub-config (clip, correction, entropy).
    loss_normalizer: ``config.grpo.loss_normalizer``, the chunks' weights.

  Raises:
    ValueError: naming ``config.grpo.loss_normalizer`` if it is unknown (the streamed
      learner checks that it can be streamed when it asks for streamed weights).
  """

  data_type = types.EpisodeBatch

  def __init__(self, policy: contract.Policy, cfg: ml_collections.ConfigDict,
               loss_normalizer: str):
    grpo.check_normalizer(loss_normalizer, streamed=False)
    self.policy, self.cfg, self.loss_normalizer = policy, cfg, loss_normalizer

  def rows(self, eb: types.EpisodeBatch) -> dict:
    """``EpisodeBatch [K, E]`` -> episode-major rows ``[E, K, ...]`` and ``adv [E]``
    (``log_prob``: ``[E, K]``, or ``[E, K, M]`` per term, see :func:`_log_probs`)."""
    swap = lambda x: jnp.swapaxes(jnp.asarray(x), 0, 1)
    return dict(batch=jax.tree.map(swap, eb.batch), chain=swap(eb.chain),
                log_prob=_log_probs(self.policy, self.cfg, swap(eb.log_prob),
                                    swap(eb.log_prob_dims)),
                mask=swap(eb.mask),
                adv=jnp.asarray(eb.advantage, jnp.float32), version=swap(eb.policy_version))

  def _evaluate(self, params: contract.Params, rows: dict) -> contract.Evaluation:
    """The policy's evaluation of every chunk of ``rows`` ``[e, K, ...]``, flattened ``[e * K]``."""
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    return self.policy.evaluate(params, jax.tree.map(flat, rows["batch"]), flat(rows["chain"]))

  def evaluate(self, params: contract.Params, rows: dict) -> tuple[jax.Array, jax.Array]:
    ev = self._evaluate(params, rows)
    shape = rows["chain"].shape[:2]
    log_prob = _log_probs(self.policy, self.cfg, ev.log_prob, ev.log_prob_dims)
    return log_prob.reshape(shape + log_prob.shape[1:]), ev.value.reshape(shape)

  def relabel(self, eb: types.EpisodeBatch, rows: dict) -> dict:
    """GRPO has no critic: its targets are group-normalised returns."""
    del eb
    return rows

  def weights(self, rows: dict) -> jax.Array:
    return grpo.chunk_weights(rows["mask"], self.loss_normalizer)

  def streamed_weights(self, rows: dict, total_rows: jax.Array) -> jax.Array:
    return grpo.streamed_weights(rows["mask"], self.loss_normalizer, total_rows)

  def loss(self, params: contract.Params, rows: dict, weights: jax.Array
           ) -> tuple[jax.Array, dict]:
    """``rows["proximal"]`` ``[e, K]``, when present, is the decoupled correction's
    proximal log-prob; otherwise the current params are the proximal policy."""
    ev = self._evaluate(params, rows)
    e, k = rows["mask"].shape
    adv = jnp.broadcast_to(rows["adv"][:, None], (e, k)).reshape(-1)
    log_prob = _log_probs(self.policy, self.cfg, ev.log_prob, ev.log_prob_dims)  # [e * K(, M)]
    flat = lambda x: x.reshape(log_prob.shape)
    proximal = (flat(rows["proximal"]) if "proximal" in rows
                else jax.lax.stop_gradient(log_prob))
    zeros = jnp.zeros_like(ev.log_prob)  # No critic: value and target both 0.
    s = _log_prob_scale(self.policy, self.cfg)
    loss, metrics = ppo.ppo_loss(
        s * log_prob, s * flat(rows["log_prob"]), adv, zeros, zeros, ev.entropy,
        weights=weights.reshape(-1), proximal_log_prob=s * proximal,
        **dict(ppo.loss_kwargs(self.cfg), value_coef=0.0, value_clip=0.0))
    del metrics["value_loss"]
    loss, metrics = _with_state_estimate(loss, metrics, ev, weights.reshape(-1), self.cfg)
    return loss, dict(metrics, loss=loss)

  def batch_metrics(self, eb: types.EpisodeBatch, rows: dict) -> dict:
    """The advantages' moments (:func:`spreads`), mean return and mean played chunks
    per episode."""
    return dict(**_moments(adv=eb.advantage),
                episode_return_mean=jnp.mean(eb.episode_return),
                episode_length_mean=jnp.mean(jnp.sum(eb.mask, axis=0).astype(jnp.float32)))

