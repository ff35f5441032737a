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
import optax

CORRECTIONS = ("none", "decoupled", "truncated_is")

# What a chunk's importance ratio is over (``rl.ratio``): "joint", the probability of
# the whole chunk (for flow policies, of the whole denoise chain: a product of
# K x H x A Gaussian transitions); "mean", the geometric mean of its per-term ratios
# (GSPO's length-normalised sequence ratio), so that the clip bounds the average
# change per transition rather than the product of all of them; "per_term", a ratio,
# an importance weight, PPO's clip and the behaviour clip for each action dimension
# of the chunk (H x A terms, each over the sampler's steps), summed over the terms, as
# token-level PPO treats the tokens of a sequence that share one advantage;
# "per_term_correction", PPO's ratio and clip over the whole chunk (the trust region
# around the proximal policy, as "joint") and the decoupled correction per term: each
# term's gradient weighted by its own behaviour -> proximal weight, and the behaviour
# clip holding only the terms that ran ahead (with another correction, "joint"). On
# fresh data both per-term variants have the joint ratio's gradient (the sum of the
# terms' log-prob gradients); on stale data a term's weight spreads as one term's
# drift, not as the product of all.
RATIOS = ("joint", "mean", "per_term", "per_term_correction")


def check_ratio(ratio: str) -> None:
  """Raises ValueError naming ``config.rl.ratio`` if it is not one of :data:`RATIOS`."""
  if ratio not in RATIOS:
    raise ValueError(f"config.rl.ratio must be one of {RATIOS}, got {ratio!r}")


def uses_terms(config: ml_collections.ConfigDict) -> bool:
  """Whether the loss takes per-term log-probs ``[N, M]`` under the ``rl`` config:
  ``ratio='per_term'``, or ``'per_term_correction'`` with the decoupled correction
  (with another correction there is no behaviour weight to take per term, and it is
  the joint ratio)."""
  return config.ratio == "per_term" or (config.ratio == "per_term_correction"
                                        and config.correction == "decoupled")


def log_prob_scale(ratio: str, terms: int) -> float:
  """The factor applied to every chunk log-prob before the loss: ``1 / terms`` for
  "mean" (``terms``: the policy's ``log_prob_terms``), ``1`` for the others.

  Raises:
    ValueError: naming ``config.rl.ratio`` if it is not one of :data:`RATIOS`.
  """
  check_ratio(ratio)
  return 1.0 / terms if ratio == "mean" else 1.0


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
  """Raises ValueError naming ``config.rl.behaviour_clip`` unless it is 0 (off) or > 1."""
  if not (behaviour_clip == 0 or behaviour_clip > 1):
    raise ValueError(f"config.rl.behaviour_clip must be 0 (off) or > 1, got {behaviour_clip}")


def _policy_terms(new_log_prob: jax.Array, old_log_prob: jax.Array, proximal: jax.Array,
                  advantages: jax.Array, *, correction: str, clip_eps: float,
                  is_clip: float, behaviour_clip: float = 0.0,
                  is_clip_mode: str = "truncate") -> tuple[jax.Array, ...]:
  """Per-chunk (or per-term) policy loss and its diagnostics; every input and output
  is ``[N]`` (or ``[N, M]``, ``advantages`` broadcast along the terms).

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
    w, truncated = _behaviour_weight(proximal, old_log_prob, is_clip, is_clip_mode)
  else:
    log_ratio = new_log_prob - old_log_prob
    w = jnp.ones_like(log_ratio)
    truncated = jnp.zeros_like(log_ratio, bool)
  ratio = jnp.exp(log_ratio)
  surrogate = jnp.minimum(ratio * advantages,
                          jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages)
  held = jnp.zeros_like(log_ratio, bool)
  if correction == "decoupled":
    held = _held(new_log_prob - old_log_prob, advantages, behaviour_clip)
    surrogate = jnp.where(held, jax.lax.stop_gradient(surrogate), surrogate)
  return (-w * surrogate, log_ratio, w, truncated.astype(jnp.float32),
          held.astype(jnp.float32))


# What the decoupled correction does with a behaviour -> proximal weight over ``is_clip``
# (``rl.is_clip_mode``): "truncate" it to ``is_clip``, or "drop" the term from the loss
# (weight 0; RLinf's ``behave_weight_threshold``).
IS_CLIP_MODES = ("truncate", "drop")


def check_is_clip_mode(mode: str) -> None:
  """Raises ValueError naming ``config.rl.is_clip_mode`` unless it is one of
  :data:`IS_CLIP_MODES`."""
  if mode not in IS_CLIP_MODES:
    raise ValueError(f"config.rl.is_clip_mode must be one of {IS_CLIP_MODES}, got {mode!r}")


def _behaviour_weight(proximal: jax.Array, behaviour: jax.Array, is_clip: float,
                      mode: str = "truncate") -> tuple[jax.Array, jax.Array]:
  """Decoupled PPO's behaviour -> proximal weight ``pi_prox / mu`` (no gradient),
  truncated at ``is_clip`` when it is ``> 0`` (``mode='drop'``: set to 0 there), and
  where it exceeded ``is_clip`` (bool)."""
  w_raw = jax.lax.stop_gradient(jnp.exp(proximal - behaviour))
  if is_clip <= 0:
    return w_raw, jnp.zeros_like(w_raw, bool)
  over = w_raw > is_clip
  return (jnp.where(over, 0.0, w_raw) if mode == "drop" else jnp.minimum(w_raw, is_clip)), over


def _held(from_behaviour: jax.Array, advantages: jax.Array, behaviour_clip: float) -> jax.Array:
  """Where the behaviour clip holds the gradient (bool, shaped like ``from_behaviour``,
  the log-prob's change since the behaviour): moved past the factor in the direction
  the advantage asks for. All False when the clip is off (0)."""
  if behaviour_clip <= 0:
    return jnp.zeros_like(from_behaviour, bool)
  moved = jax.lax.stop_gradient(from_behaviour)
  bound = math.log(behaviour_clip)
  return ((moved > bound) & (advantages > 0)) | ((moved < -bound) & (advantages < 0))


def _term_corrected_terms(new_log_prob: jax.Array, old_log_prob: jax.Array,
                          proximal: jax.Array, advantages: jax.Array, *, clip_eps: float,
                          is_clip: float, behaviour_clip: float,
                          is_clip_mode: str = "truncate") -> tuple[jax.Array, ...]:
  """Decoupled PPO with the chunk's ratio and clip and the correction per term
  (``rl.ratio='per_term_correction'``): log-probs ``[N, M]``, advantages ``[N]``.

  Term ``m``'s gradient is ``w_m * g * grad new_m``: ``w_m = min(pi_prox,m / mu_m,
  is_clip)`` its behaviour -> proximal weight, ``g`` the chunk surrogate's derivative by
  its log-prob (``r * A`` where the unclipped branch is the minimum, else 0), and 0
  where the behaviour clip holds the term. With every ``w_m = 1`` and nothing held it is
  the joint ratio's gradient. The loss's value is ``-mean_m(w_m) * surrogate``.

  Returns:
    ``(loss [N], log_ratio [N], is_weight [N, M], truncated [N, M], held [N, M])``, as
    :func:`_policy_terms`'s.
  """
  sg = jax.lax.stop_gradient
  log_ratio = new_log_prob.sum(-1) - proximal.sum(-1)
  ratio = jnp.exp(sg(log_ratio))
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
  surrogate = jnp.minimum(unclipped, clipped)
  w, truncated = _behaviour_weight(proximal, old_log_prob, is_clip, is_clip_mode)
  held = _held(new_log_prob - old_log_prob, advantages[:, None], behaviour_clip)
  g = sg(jnp.where(held, 0.0, w * jnp.where(unclipped <= clipped, unclipped, 0.0)[:, None]))
  loss = -jnp.mean(w, -1) * surrogate - jnp.sum(g * (new_log_prob - sg(new_log_prob)), -1)
  return (loss, log_ratio, w, truncated.astype(jnp.float32), held.astype(jnp.float32))


VALUE_LOSSES = ("mse", "huber")


def check_value_loss(value_loss: str, huber_delta: float, value_clip: float) -> None:
  """Raises ValueError naming the ``config.rl`` key of a bad critic-loss setting."""
  if value_loss not in VALUE_LOSSES:
    raise ValueError(f"config.rl.value_loss must be one of {VALUE_LOSSES}, got {value_loss!r}")
  if not huber_delta > 0:
    raise ValueError(f"config.rl.huber_delta must be > 0, got {huber_delta}")
  if not value_clip >= 0:
    raise ValueError(f"config.rl.value_clip must be >= 0 (0: off), got {value_clip}")


def value_errors(new_value: jax.Array, returns: jax.Array, old_value: jax.Array | None, *,
                 value_loss: str = "mse", huber_delta: float = 10.0,
                 value_clip: float = 0.0) -> jax.Array:
  """The critic's loss per chunk ``[N]``: ``0.5 e^2`` ('mse') or the Huber loss of the
  error ``e = V - R`` (quadratic within ``huber_delta``, linear beyond); with
  ``value_clip > 0``, PPO2's pessimistic clip, the larger of that loss and the loss of
  ``old_value + clip(V - old_value, -value_clip, value_clip)`` (``old_value``: the
  rollout's values, as RLinf's and openai/baselines' critics)."""
  check_value_loss(value_loss, huber_delta, value_clip)
  if value_loss == "mse":
    err = lambda v: 0.5 * jnp.square(v - returns)
  else:
    err = lambda v: optax.huber_loss(v, returns, delta=huber_delta)
  loss = err(new_value)
  if value_clip > 0:
    if old_value is None:
      raise ValueError("config.rl.value_clip > 0 needs the rollout's values (old_value)")
    clipped = old_value + jnp.clip(new_value - old_value, -value_clip, value_clip)
    loss = jnp.maximum(loss, err(clipped))
  return loss


def ppo_loss(new_log_prob: jax.Array, old_log_prob: jax.Array, advantages: jax.Array,
             new_value: jax.Array, returns: jax.Array, entropy: jax.Array, *,
             clip_eps: float, value_coef: float, entropy_coef: float,
             weights: jax.Array | None = None, correction: str = "none",
             proximal_log_prob: jax.Array | None = None,
             is_clip: float = 0.0,
             behaviour_clip: float = 0.0,
             term_ratio: bool = True,
             old_value: jax.Array | None = None, value_loss: str = "mse",
             huber_delta: float = 10.0, value_clip: float = 0.0,
             is_clip_mode: str = "truncate") -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO loss over a (micro-)batch of ``N`` chunks, as a weighted sum.

  With ``[N]`` log-probs every ratio is between log-probabilities of the whole chunk
  (for flow policies, of the whole denoise chain). With ``[N, M]`` log-probs (the
  chunk's ``M`` terms) and ``term_ratio`` (``rl.ratio='per_term'``) every ratio, weight
  and clip is per term and a chunk's policy loss is the sum over its terms; without
  ``term_ratio`` (``'per_term_correction'``, decoupled only) PPO's ratio and clip are
  the chunk's and the importance weights and behaviour clip per term
  (:func:`_term_corrected_terms`). ``approx_kl`` is then per chunk (the sum of the
  terms' KL estimates, or the chunk ratio's), the fractions and ``is_weight`` are means
  over the terms. The loss and every metric are
  ``sum_i weights_i * l_i``; ``weights=None`` means ``1 / N`` each (means over
  the batch). Because the sum is linear in the chunks, a streamed learner that
  gives every chunk its *global* weight (e.g. ``1 / N_global``) gets the
  whole batch's loss, gradient and metrics by adding up its micro-batches'.
  Padding chunks get weight 0: they contribute exactly 0 (also to the
  gradient) whatever finite values their other inputs hold.

  Args:
    new_log_prob: ``[N]`` (or ``[N, M]`` per term) log-prob under the params being
      optimised.
    old_log_prob: ``[N]`` (``[N, M]``) behaviour log-prob (the params that sampled the
      chunk).
    advantages: ``[N]`` advantage estimates.
    new_value: ``[N]`` value predictions under the params being optimised.
    returns: ``[N]`` value targets.
    entropy: ``[N]`` entropy (estimate) of the current policy per chunk.
    clip_eps: PPO ratio clip (unused by "truncated_is" except in ``clip_frac``).
    value_coef: weight of the value loss (0 when there is no value head, GRPO).
    entropy_coef: weight of the entropy bonus.
    weights: ``[N]`` per-chunk weights, or None for ``1 / N`` each.
    correction: one of ``CORRECTIONS`` (see the module docstring).
    proximal_log_prob: ``[N]`` (``[N, M]``) log-prob under the params at the start of the
      update (no gradient flows into it); needed by "decoupled", ignored otherwise.
    is_clip: truncation of the importance weight: "decoupled" truncates at it
      when ``> 0`` (``is_clip_mode='drop'``: gives a term over it weight 0);
      "truncated_is" requires ``> 0``; "none" ignores it.
    behaviour_clip: "decoupled" only, ``0`` for off or ``> 1``: the factor of change
      from the behaviour beyond which a chunk moved in its advantage's direction
      gives no gradient (module docstring).
    term_ratio: with ``[N, M]`` log-probs, whether PPO's ratio and clip are per term
      (True) or over the chunk with the correction per term (False).
    old_value, value_loss, huber_delta, value_clip: the critic's loss per chunk
      (:func:`value_errors`; ``old_value [N]``, the rollout's values, only read with
      ``value_clip > 0``).

  Returns:
    the scalar loss and scalar diagnostics: ``policy_loss``, ``value_loss``
    (``sum w l(v - R)``, ``l`` of :func:`value_errors`), ``entropy``, ``approx_kl`` (k3
    estimate of the KL between the current policy and the ratio's reference: behaviour, or
    proximal for "decoupled"), ``clip_frac`` (weight of chunks whose ratio left
    ``[1 - clip_eps, 1 + clip_eps]``), ``is_weight`` (weighted mean importance
    weight applied: 1 for "none"), ``is_weight_sq`` (its square's weighted mean:
    with ``is_weight``, the weights' effective sample size, see
    :func:`ess_fraction`) and ``is_truncated_frac`` (weight of chunks whose
    importance weight was truncated at ``is_clip``), ``behaviour_clip_frac``
    (weight of chunks ``behaviour_clip`` held) and ``log_ratio_abs`` (the ratios' spread
    around 1: the weighted mean of ``|log ratio|`` over the chunks, or over every term of
    every chunk for per-term ratios). Like the others it adds up over micro-batches.

  Raises:
    ValueError: naming an unknown ``correction``, a missing
      ``proximal_log_prob`` for "decoupled", ``is_clip <= 0`` for "truncated_is", or a
      ``behaviour_clip`` that is neither 0 nor > 1.
  """
  _check_correction(correction, proximal_log_prob, is_clip, behaviour_clip)
  check_is_clip_mode(is_clip_mode)
  n = new_log_prob.shape[0]
  per_term = new_log_prob.ndim == 2
  if per_term and not old_log_prob.shape == new_log_prob.shape:
    raise ValueError(f"per-term log-probs: behaviour {old_log_prob.shape} and current "
                     f"{new_log_prob.shape} must have the same [N, M] shape")
  if per_term and not term_ratio and correction != "decoupled":
    raise ValueError(f"per-term log-probs with term_ratio=False correct the decoupled "
                     f"correction per term; got correction {correction!r}")
  weights = (jnp.full((n,), 1.0 / n, jnp.float32) if weights is None
             else jnp.asarray(weights, jnp.float32))
  live = weights != 0
  # Zero the inputs of weight-0 chunks *before* any exp: a masked term whose ratio
  # overflowed would otherwise put 0 * inf = NaN into the gradient.
  live_or_zero = lambda x: jnp.where(live[:, None] if x.ndim == 2 else live, x, 0.0)
  new_log_prob, old_log_prob, advantages, new_value, returns, entropy = map(
      live_or_zero, (new_log_prob, old_log_prob, advantages, new_value, returns, entropy))
  if old_value is not None:
    old_value = live_or_zero(old_value)
  proximal = (new_log_prob if proximal_log_prob is None
              else live_or_zero(jax.lax.stop_gradient(proximal_log_prob)))
  wsum = lambda x: jnp.sum(jnp.where(live, weights * x, 0.0))
  # A chunk's share of a per-term quantity: the sum over its terms (loss, KL) or the mean.
  chunk_sum = lambda x: jnp.sum(x, -1) if x.ndim == 2 else x
  chunk_mean = lambda x: jnp.mean(x, -1) if x.ndim == 2 else x

  if per_term and not term_ratio:
    pg, log_ratio, is_weight, truncated, held = _term_corrected_terms(
        new_log_prob, old_log_prob, proximal, advantages, clip_eps=clip_eps,
        is_clip=is_clip, behaviour_clip=behaviour_clip, is_clip_mode=is_clip_mode)
  else:
    pg, log_ratio, is_weight, truncated, held = _policy_terms(
        new_log_prob, old_log_prob, proximal,
        advantages[:, None] if per_term else advantages, correction=correction,
        clip_eps=clip_eps, is_clip=is_clip, behaviour_clip=behaviour_clip,
        is_clip_mode=is_clip_mode)
  ratio = jnp.exp(log_ratio)
  policy_loss = wsum(chunk_sum(pg))
  value_loss = wsum(value_errors(new_value, returns, old_value, value_loss=value_loss,
                                 huber_delta=huber_delta, value_clip=value_clip))
  entropy_sum = wsum(entropy)
  loss = policy_loss + value_coef * value_loss - entropy_coef * entropy_sum
  metrics = dict(
      policy_loss=policy_loss, value_loss=value_loss, entropy=entropy_sum,
      approx_kl=wsum(chunk_sum(jax.lax.stop_gradient(ratio - 1.0 - log_ratio))),
      clip_frac=wsum(chunk_mean((jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32))),
      is_weight=wsum(chunk_mean(is_weight)),
      is_weight_sq=wsum(chunk_mean(jnp.square(is_weight))),
      is_truncated_frac=wsum(chunk_mean(truncated)), behaviour_clip_frac=wsum(chunk_mean(held)),
      log_ratio_abs=wsum(chunk_mean(jnp.abs(jax.lax.stop_gradient(log_ratio)))))
  return loss, metrics


STEP_SCALES = ("none", "ess", "staleness")
# "staleness": the mean staleness (versions behind the learner) up to which a step is
# whole; staler steps shrink in proportion (full async learns as well as sync up to 2 at
# the default step size, docs/design/pipeline.md "Learning parity").
FULL_STEP_STALENESS = 2.0


def ess_fraction(is_weight: jax.Array, is_weight_sq: jax.Array) -> jax.Array:
  """Kish's effective sample size of the applied importance weights, as a fraction of
  the rows: ``mean(w)^2 / mean(w^2)`` in (0, 1], 1 when every weight is equal (on-policy
  data). Both arguments are weighted means (``ppo_loss``'s metrics), so they add up
  over a streamed learner's micro-batches."""
  return jnp.square(is_weight) / jnp.maximum(is_weight_sq, 1e-12)


# The metrics :func:`step_scale` reads (a step's accumulated metrics may hold more).
STEP_SCALE_READS = ("lag", "is_weight", "is_weight_sq")


def step_scale(step_scale_name: str, metrics: dict) -> jax.Array:
  """The factor on one optimizer step's update (``rl.step_scale``): ``1`` for "none";
  for "ess", :func:`ess_fraction` of the step's importance weights, so that a gradient
  estimated from stale data with the information of fewer samples moves the policy
  proportionally less (1 on fresh data: the synchronous step is unchanged); for
  "staleness", ``min(1, FULL_STEP_STALENESS / lag)`` with ``lag`` the step's
  row-weighted mean staleness (``metrics["lag"]``), as delayed-gradient methods scale
  the step by the delay (1 up to a staleness of 2).

  Raises:
    ValueError: naming ``config.rl.step_scale`` if it is not one of :data:`STEP_SCALES`.
  """
  if step_scale_name not in STEP_SCALES:
    raise ValueError(f"config.rl.step_scale must be one of {STEP_SCALES}, "
                     f"got {step_scale_name!r}")
  if step_scale_name == "none":
    return jnp.ones((), jnp.float32)
  if step_scale_name == "staleness":
    lag = jnp.asarray(metrics["lag"], jnp.float32)
    return FULL_STEP_STALENESS / jnp.maximum(lag, FULL_STEP_STALENESS)
  return jax.lax.stop_gradient(ess_fraction(metrics["is_weight"], metrics["is_weight_sq"]))


def loss_kwargs(config: ml_collections.ConfigDict) -> dict:
  """The ``rl`` sub-config's loss coefficients and correction as keyword arguments."""
  return dict(clip_eps=config.clip_eps, value_coef=config.value_coef,
              entropy_coef=config.entropy_coef,
              correction=config.correction,
              is_clip=config.is_clip, behaviour_clip=config.behaviour_clip,
              term_ratio=config.ratio == "per_term", value_loss=config.value_loss,
              huber_delta=config.huber_delta, value_clip=config.value_clip,
              is_clip_mode=config.is_clip_mode)
