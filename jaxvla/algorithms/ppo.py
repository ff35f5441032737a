"""PPO's clipped surrogate, off-policy corrections, value loss and entropy bonus (pure).

One loss over action chunks, with three ways to treat data that was not
sampled by the current parameters (``CORRECTIONS``):

* ``"none"``: the standard clipped surrogate around the behaviour policy.
* ``"decoupled"``: decoupled PPO (Hilton et al. 2021, "Batch size-invariance
  for policy optimization"): the trust region is around the *proximal* policy
  (the params at the start of the update) and the behaviour-to-proximal gap
  is corrected by a stop-gradient importance weight, optionally truncated.
* ``"truncated_is"``: an off-policy policy gradient with truncated importance
  weights (IMPALA's rho-bar), no clipping.

With ``"decoupled"``, ``behaviour_clip = c > 1`` adds a trust region around the
*behaviour* that acts even in an update of one optimizer step (where the ratio to
the proximal policy is 1 and PPO's clip cannot act): a chunk whose probability the
current policy has already moved by more than a factor ``c`` from the behaviour, in
the direction its advantage asks for (up for ``A > 0``, down for ``A < 0``), gives no
gradient. Chunks that moved against their advantage keep theirs.

Every term is a weighted *sum* over chunks, so that a streamed learner can add
up micro-batch gradients: with global weights (e.g. ``1 / N_global`` on each
chunk) the sum of the micro-batch losses is the loss of the whole batch.
"""

import math

import jax
import jax.numpy as jnp
import ml_collections

CORRECTIONS = ("none", "decoupled", "truncated_is")

# What a chunk's importance ratio is over (``ppo.ratio``): "joint", the probability of
# the whole chunk (for flow policies, of the whole denoise chain: a product of
# K x H x A Gaussian transitions); "mean", the geometric mean of its per-term ratios
# (GSPO's length-normalised sequence ratio), so that the clip bounds the average
# change per transition rather than the product of all of them.
RATIOS = ("joint", "mean")


def log_prob_scale(ratio: str, terms: int) -> float:
  """The factor applied to every chunk log-prob before the loss: ``1`` for "joint",
  ``1 / terms`` for "mean" (``terms``: the policy's ``log_prob_terms``).

  Raises:
    ValueError: naming ``config.ppo.ratio`` if it is not one of :data:`RATIOS`.
  """
  if ratio not in RATIOS:
    raise ValueError(f"config.ppo.ratio must be one of {RATIOS}, got {ratio!r}")
  return 1.0 if ratio == "joint" else 1.0 / terms


def _check_correction(correction: str, proximal_log_prob: jax.Array | None,
                      is_clip: float, behaviour_clip: float = 0.0) -> None:
  """Raises ValueError naming what is wrong with the correction's arguments."""
  if correction not in CORRECTIONS:
    raise ValueError(f"unknown ppo correction {correction!r}; choose one of {CORRECTIONS}")
  if correction == "decoupled" and proximal_log_prob is None:
    raise ValueError("ppo correction 'decoupled' needs proximal_log_prob (the log-prob under "
                     "the params at the start of the update)")
  if correction == "truncated_is" and not is_clip > 0:
    raise ValueError(f"ppo correction 'truncated_is' needs is_clip > 0, got is_clip={is_clip}")
  check_behaviour_clip(behaviour_clip)


def check_behaviour_clip(behaviour_clip: float) -> None:
  """Raises ValueError naming ``config.ppo.behaviour_clip`` unless it is 0 (off) or > 1."""
  if not (behaviour_clip == 0 or behaviour_clip > 1):
    raise ValueError(f"config.ppo.behaviour_clip must be 0 (off) or > 1, got {behaviour_clip}")


def _policy_terms(new_log_prob: jax.Array, old_log_prob: jax.Array, proximal: jax.Array,
                  advantages: jax.Array, *, correction: str, clip_eps: float,
                  is_clip: float, behaviour_clip: float = 0.0) -> tuple[jax.Array, ...]:
  """Per-chunk policy loss and its diagnostics; every input and output is ``[N]``.

  Returns:
    ``(loss, log_ratio, is_weight, truncated, held)``: the policy loss of each chunk,
    the log-ratio of the current to the ratio's reference policy (behaviour, or
    proximal for "decoupled"), the importance weight applied, whether that
    weight was truncated at ``is_clip`` and whether ``behaviour_clip`` held the chunk's
    gradient at 0 (floats 0/1).
  """
  if correction == "truncated_is":
    log_ratio = new_log_prob - old_log_prob
    rho_raw = jax.lax.stop_gradient(jnp.exp(log_ratio))
    rho = jnp.minimum(rho_raw, is_clip)
    return (-rho * advantages * new_log_prob, log_ratio, rho,
            (rho_raw > is_clip).astype(jnp.float32), jnp.zeros_like(rho))
  if correction == "decoupled":
    log_ratio = new_log_prob - proximal
    w_raw = jax.lax.stop_gradient(jnp.exp(proximal - old_log_prob))
    w = jnp.minimum(w_raw, is_clip) if is_clip > 0 else w_raw
    truncated = (w_raw > is_clip) if is_clip > 0 else jnp.zeros_like(w_raw, bool)
  else:
    log_ratio = new_log_prob - old_log_prob
    w = jnp.ones_like(log_ratio)
    truncated = jnp.zeros_like(log_ratio, bool)
  ratio = jnp.exp(log_ratio)
  surrogate = jnp.minimum(ratio * advantages,
                          jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages)
  held = jnp.zeros_like(log_ratio, bool)
  if correction == "decoupled" and behaviour_clip > 0:
    from_behaviour = jax.lax.stop_gradient(new_log_prob - old_log_prob)
    bound = math.log(behaviour_clip)
    held = (((from_behaviour > bound) & (advantages > 0))
            | ((from_behaviour < -bound) & (advantages < 0)))
    surrogate = jnp.where(held, jax.lax.stop_gradient(surrogate), surrogate)
  return (-w * surrogate, log_ratio, w, truncated.astype(jnp.float32),
          held.astype(jnp.float32))


def ppo_loss(new_log_prob: jax.Array, old_log_prob: jax.Array, advantages: jax.Array,
             new_value: jax.Array, returns: jax.Array, entropy: jax.Array, *,
             clip_eps: float, value_coef: float, entropy_coef: float,
             weights: jax.Array | None = None, correction: str = "none",
             proximal_log_prob: jax.Array | None = None,
             is_clip: float = 0.0,
             behaviour_clip: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO loss over a (micro-)batch of ``N`` chunks, as a weighted sum.

  Every ratio is between log-probabilities of the whole chunk (for flow
  policies, of the whole denoise chain). The loss and every metric are
  ``sum_i weights_i * l_i``; ``weights=None`` means ``1 / N`` each (means over
  the batch). Because the sum is linear in the chunks, a streamed learner that
  gives every chunk its *global* weight (e.g. ``1 / N_global``) gets the
  whole batch's loss, gradient and metrics by adding up its micro-batches'.
  Padding chunks get weight 0: they contribute exactly 0 (also to the
  gradient) whatever finite values their other inputs hold.

  Args:
    new_log_prob: ``[N]`` log-prob under the params being optimised.
    old_log_prob: ``[N]`` behaviour log-prob (the params that sampled the chunk).
    advantages: ``[N]`` advantage estimates.
    new_value: ``[N]`` value predictions under the params being optimised.
    returns: ``[N]`` value targets.
    entropy: ``[N]`` entropy (estimate) of the current policy per chunk.
    clip_eps: PPO ratio clip (unused by "truncated_is" except in ``clip_frac``).
    value_coef: weight of the value loss (0 when there is no value head, GRPO).
    entropy_coef: weight of the entropy bonus.
    weights: ``[N]`` per-chunk weights, or None for ``1 / N`` each.
    correction: one of ``CORRECTIONS`` (see the module docstring).
    proximal_log_prob: ``[N]`` log-prob under the params at the start of the
      update (no gradient flows into it); needed by "decoupled", ignored otherwise.
    is_clip: truncation of the importance weight: "decoupled" truncates at it
      when ``> 0``; "truncated_is" requires ``> 0``; "none" ignores it.
    behaviour_clip: "decoupled" only, ``0`` for off or ``> 1``: the factor of change
      from the behaviour beyond which a chunk moved in its advantage's direction
      gives no gradient (module docstring).

  Returns:
    the scalar loss and scalar diagnostics: ``policy_loss``, ``value_loss``
    (``0.5 * sum w (v - R)^2``), ``entropy``, ``approx_kl`` (k3 estimate of the
    KL between the current policy and the ratio's reference: behaviour, or
    proximal for "decoupled"), ``clip_frac`` (weight of chunks whose ratio left
    ``[1 - clip_eps, 1 + clip_eps]``), ``is_weight`` (weighted mean importance
    weight applied: 1 for "none"), ``is_weight_sq`` (its square's weighted mean:
    with ``is_weight``, the weights' effective sample size, see
    :func:`ess_fraction`) and ``is_truncated_frac`` (weight of chunks whose
    importance weight was truncated at ``is_clip``) and ``behaviour_clip_frac``
    (weight of chunks ``behaviour_clip`` held).

  Raises:
    ValueError: naming an unknown ``correction``, a missing
      ``proximal_log_prob`` for "decoupled", ``is_clip <= 0`` for "truncated_is", or a
      ``behaviour_clip`` that is neither 0 nor > 1.
  """
  _check_correction(correction, proximal_log_prob, is_clip, behaviour_clip)
  n = new_log_prob.shape[0]
  weights = (jnp.full((n,), 1.0 / n, jnp.float32) if weights is None
             else jnp.asarray(weights, jnp.float32))
  live = weights != 0
  # Zero the inputs of weight-0 chunks *before* any exp: a masked term whose ratio
  # overflowed would otherwise put 0 * inf = NaN into the gradient.
  live_or_zero = lambda x: jnp.where(live, x, 0.0)
  new_log_prob, old_log_prob, advantages, new_value, returns, entropy = map(
      live_or_zero, (new_log_prob, old_log_prob, advantages, new_value, returns, entropy))
  proximal = (new_log_prob if proximal_log_prob is None
              else live_or_zero(jax.lax.stop_gradient(proximal_log_prob)))
  wsum = lambda x: jnp.sum(jnp.where(live, weights * x, 0.0))

  pg, log_ratio, is_weight, truncated, held = _policy_terms(
      new_log_prob, old_log_prob, proximal, advantages, correction=correction,
      clip_eps=clip_eps, is_clip=is_clip, behaviour_clip=behaviour_clip)
  ratio = jnp.exp(log_ratio)
  policy_loss = wsum(pg)
  value_loss = 0.5 * wsum(jnp.square(new_value - returns))
  entropy_sum = wsum(entropy)
  loss = policy_loss + value_coef * value_loss - entropy_coef * entropy_sum
  metrics = dict(
      policy_loss=policy_loss, value_loss=value_loss, entropy=entropy_sum,
      approx_kl=wsum(jax.lax.stop_gradient(ratio - 1.0 - log_ratio)),
      clip_frac=wsum((jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)),
      is_weight=wsum(is_weight), is_weight_sq=wsum(jnp.square(is_weight)),
      is_truncated_frac=wsum(truncated), behaviour_clip_frac=wsum(held))
  return loss, metrics


STEP_SCALES = ("none", "ess", "staleness")
# "staleness": the mean staleness (versions behind the learner) up to which a step is
# whole; staler steps shrink in proportion (full async learns as well as sync up to 2 at
# the default step size, docs/pipeline.md "Learning parity").
FULL_STEP_STALENESS = 2.0


def ess_fraction(is_weight: jax.Array, is_weight_sq: jax.Array) -> jax.Array:
  """Kish's effective sample size of the applied importance weights, as a fraction of
  the rows: ``mean(w)^2 / mean(w^2)`` in (0, 1], 1 when every weight is equal (on-policy
  data). Both arguments are weighted means (``ppo_loss``'s metrics), so they add up
  over a streamed learner's micro-batches."""
  return jnp.square(is_weight) / jnp.maximum(is_weight_sq, 1e-12)


def step_scale(step_scale_name: str, metrics: dict) -> jax.Array:
  """The factor on one optimizer step's update (``ppo.step_scale``): ``1`` for "none";
  for "ess", :func:`ess_fraction` of the step's importance weights, so that a gradient
  estimated from stale data with the information of fewer samples moves the policy
  proportionally less (1 on fresh data: the synchronous step is unchanged); for
  "staleness", ``min(1, FULL_STEP_STALENESS / lag)`` with ``lag`` the step's
  row-weighted mean staleness (``metrics["lag"]``), as delayed-gradient methods scale
  the step by the delay (1 up to a staleness of 2).

  Raises:
    ValueError: naming ``config.ppo.step_scale`` if it is not one of :data:`STEP_SCALES`.
  """
  if step_scale_name not in STEP_SCALES:
    raise ValueError(f"config.ppo.step_scale must be one of {STEP_SCALES}, "
                     f"got {step_scale_name!r}")
  if step_scale_name == "none":
    return jnp.ones((), jnp.float32)
  if step_scale_name == "staleness":
    lag = jnp.asarray(metrics["lag"], jnp.float32)
    return FULL_STEP_STALENESS / jnp.maximum(lag, FULL_STEP_STALENESS)
  return jax.lax.stop_gradient(ess_fraction(metrics["is_weight"], metrics["is_weight_sq"]))


def loss_kwargs(config: ml_collections.ConfigDict) -> dict:
  """The ``ppo`` sub-config's loss coefficients and correction as keyword arguments."""
  return dict(clip_eps=config.clip_eps, value_coef=config.value_coef,
              entropy_coef=config.entropy_coef,
              correction=config.correction,
              is_clip=config.is_clip, behaviour_clip=config.behaviour_clip)
