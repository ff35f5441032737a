"""The one RL update loop, for any :class:`jaxvla.learner.objectives.Objective`.

:func:`epochs_update`: ``rl.num_epochs`` passes over the rows of one batch,
each shuffled with the state's key and split into ``rl.num_minibatches``
minibatches, one optimizer step per minibatch (``lax.scan`` over epochs and
minibatches). Once approx. KL passes ``rl.target_kl > 0`` the remaining
minibatches are skipped (``rl.target_kl_stops='update'``), or only their actor
steps (``'actor'``: the critic's own Adam steps on). With the decoupled correction
and more than one optimizer step, the proximal policy is the params before the
update (their log-probs are computed once, per minibatch of rows).

Every optimizer step is guarded: it checks its loss and gradient norm before it applies
anything, and a non-finite step keeps the params and moments it started from, as do the
later steps of the same update (:func:`keep_unless`; the ``nonfinite`` metric's bits are
:data:`NONFINITE_PARTS`).

:func:`grad_norms`: the gradient's norm, whole and per part of the network (the
metrics ``grad_norm`` and ``grad_norm/<part>`` of both updates), to see where an RL
gradient goes.

:func:`update_kl_detail`: how far one update moved the flow's density, per denoise
step and per action dimension (``rl.kl_detail_rows``).

:func:`micro_grads`: the streamed learner's gradient of one micro-batch with
global row weights; the micro-batches' gradients and metrics add up to those of
a one-minibatch, one-epoch :func:`epochs_update` of their union.

Both differentiate with respect to the trained parameters only
(:class:`jaxvla.learner.trainable.Trainable`: the LoRA adapters and what openpi's
freeze filter leaves trainable, or everything); the frozen rest is a constant of
the loss. Both are pure functions of their arguments;
:class:`jaxvla.learner.learner.Learner` jits them with the mesh's shardings.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util

from jaxvla.algorithms import ppo
from jaxvla.learner import optimizers
from jaxvla.learner.objectives import Objective, spreads
from jaxvla.learner.trainable import ALL, Trainable


# Bits of an update's ``nonfinite`` metric (0: every optimizer step finite and applied).
NONFINITE_PARTS = ((1, "loss"), (2, "gradient norm"), (4, "updated parameters"))


def all_finite(tree) -> jax.Array:
  """Whether every element of every leaf of ``tree`` is finite (a scalar bool)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def nonfinite_code(loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
  """Bits 1 (loss) and 2 (gradient norm) of :data:`NONFINITE_PARTS`, an int32 scalar:
  what a step checks *before* it applies its update."""
  return ((~jnp.isfinite(loss)).astype(jnp.int32) * 1
          + (~jnp.isfinite(grad_norm)).astype(jnp.int32) * 2)


def params_code(params) -> jax.Array:
  """Bit 4 of :data:`NONFINITE_PARTS` (int32 scalar): ``params`` after the update are
  not finite although its loss and gradient were (an overflow, a non-finite step size)."""
  return (~all_finite(params)).astype(jnp.int32) * 4


def keep_unless(skip: jax.Array, new, old):
  """``old`` where the scalar ``skip``, else ``new``, leaf by leaf.

  The divergence guard of every optimizer step: a step whose loss or gradient is not
  finite (:func:`nonfinite_code`) is not applied. One select per element, on a scalar
  known before the update, fuses into the elementwise optimizer update, so XLA updates
  the donated params and moments in place. (A check of the *new* params, or a branch
  between whole old and new states, keeps both alive: full pi0's 4-minibatch update then
  needed 86 GiB on an 80 GB H100.)
  """
  return jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)


def guarded_step(tx: optax.GradientTransformation, grads, opt_state, sub, loss: jax.Array,
                 grad_norm: jax.Array, scale: jax.Array | float = 1.0,
                 stop: jax.Array | bool = False):
  """One optimizer step of ``grads`` on the trained ``sub``, its update times ``scale``,
  not applied if ``stop`` or if its loss or gradient norm is not finite.

  Returns:
    ``(sub, opt_state, code, skipped)``: the new (or kept) params and optimizer state,
    the step's bits 1 and 2 of :data:`NONFINITE_PARTS` (int32) and whether it was not
    applied.
  """
  code = nonfinite_code(loss, grad_norm)
  skip = jnp.logical_or(stop, code != 0)
  updates, new_opt_state = tx.update(grads, opt_state, sub)
  new_sub = optax.apply_updates(sub, jax.tree.map(lambda u: scale * u, updates))
  return (keep_unless(skip, new_sub, sub), keep_unless(skip, new_opt_state, opt_state), code,
          skip)


def _uses_proximal(cfg: ml_collections.ConfigDict) -> bool:
  """Whether an update first evaluates its rows under the params it starts from: decoupled
  PPO needs those log-probs once an update has several steps, and learner-side value
  targets need the values."""
  return ((ppo.loss_kwargs(cfg)["correction"] == "decoupled"
           and (cfg.num_epochs > 1 or cfg.num_minibatches > 1))
          or cfg.value_targets != "rollout")


def _mean_lag(weights: jax.Array, rows: dict, version: jax.Array | int) -> jax.Array:
  """The rows' weighted mean staleness (versions behind ``version``): a weighted sum,
  so a streamed update's micro-batches add up to the whole batch's."""
  return jnp.sum(weights * (version - rows["version"]).astype(jnp.float32))


def _with_proximal(objective: Objective, params, data, rows: dict, version: jax.Array,
                   split: Callable[[jax.Array], jax.Array] = lambda x: x[None]) -> dict:
  """``rows`` with ``proximal`` / ``proximal_value`` (``rows`` under ``params``, no
  gradient), each row's ``lag`` behind ``version``, and the objective's relabelled
  targets. ``split`` cuts the rows into the minibatches evaluated one at a time."""
  log_prob, value = jax.lax.map(
      lambda m: objective.evaluate(params, m),
      dict(batch=jax.tree.map(split, rows["batch"]), chain=split(rows["chain"])))
  merge = lambda x: jax.lax.stop_gradient(x.reshape((-1,) + x.shape[2:]))  # Undoes ``split``.
  rows = dict(rows, proximal=merge(log_prob), proximal_value=merge(value),
              lag=version - rows["version"])
  return objective.relabel(data, rows)


def epochs_update(objective: Objective, tx: optax.GradientTransformation,
                  cfg: ml_collections.ConfigDict, params, opt_state, data, rng: jax.Array,
                  constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
                  version: jax.Array | int = 0, trainable: Trainable = ALL,
                  behaviour_is_proximal: bool = False):
  """Every epoch and minibatch of one batch ``data``.

  Args:
    objective: the algorithm (rows, weights, loss).
    tx: the optimizer over ``trainable.select(params)``; cfg: the ``rl`` sub-config.
    params, opt_state: before the update.
    data: the batch (``objective.data_type``).
    rng: the shuffling key.
    constrain: applied to every minibatch array ``[num_minibatches, mb, ...]``
      (the learner's sharding constraint of the row axis).
    version: the learner's policy version (``state.step``): rows older than it are
      the stale ones of the diagnostics.
    trainable: the parameters the steps change (the rest stays as given).
    behaviour_is_proximal: the rows were sampled with exactly ``params``
      (``sync_colocated``): their behaviour log-probs are the proximal ones, and the
      proximal pass is skipped (unless the value targets need its values).

  Returns:
    ``(params, opt_state, metrics)``: metrics are means over minibatches of the
    loss terms, ``grad_norm`` (whole and per part, :func:`grad_norms`) and
    ``skipped``, plus ``objective.batch_metrics`` and ``nonfinite`` (the bits of
    :data:`NONFINITE_PARTS` of any step, or'd).

  Raises:
    ValueError: the row count is not divisible by ``rl.num_minibatches``.
  """
  nm = cfg.num_minibatches
  rows = objective.rows(data)
  n = rows["log_prob"].shape[0]
  if n % nm:
    raise ValueError(f"an update of {n} rows (PPO: num_envs x rollout_len chunks; GRPO: "
                     f"episodes) is not divisible by rl.num_minibatches={nm}")
  mb = n // nm
  split = lambda x: x.reshape((nm, mb) + x.shape[1:])
  if behaviour_is_proximal and cfg.value_targets == "rollout":
    rows = dict(rows, proximal=rows["log_prob"])  # (decoupled PPO is then plain PPO)
  elif _uses_proximal(cfg):  # The params before this update's steps, per minibatch of rows.
    rows = _with_proximal(objective, params, data, rows, version, split)

  # The scans carry the trained subtree only; the frozen rest is read from ``params``.
  loss_of = lambda sub, minibatch, weights: objective.loss(trainable.merge(params, sub),
                                                           minibatch, weights)

  critic_steps_on = cfg.target_kl > 0 and cfg.get("target_kl_stops", "update") == "actor"

  def minibatch_step(carry, minibatch):
    sub, opt_state, stop, actor_stop = carry
    weights = objective.weights(minibatch)
    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(
        sub, minibatch, weights)
    metrics = dict(metrics, lag=_mean_lag(weights, minibatch, version), **grad_norms(grads))
    scale = ppo.step_scale(cfg.step_scale, metrics)
    # A non-finite step is not applied, and none after it in this update is.
    new_sub, new_opt_state, code, stop = guarded_step(tx, grads, opt_state, sub, loss,
                                                      metrics["grad_norm"], scale, stop)
    skipped = stop | actor_stop  # This step's actor part was not applied.
    if critic_steps_on:
      # After the KL stop the actor's params and Adam state stay; the critic's step on.
      keep = lambda new, old: jax.tree.map(
          lambda c, n, o: n if c else jnp.where(actor_stop, o, n),
          optimizers.critic_leaves(new), new, old)
      new_sub, new_opt_state = keep(new_sub, sub), keep(new_opt_state, opt_state)
    if cfg.target_kl > 0:  # (the KL this step measured, before it moved: the later steps)
      actor_stop = actor_stop | (metrics["approx_kl"] > cfg.target_kl)
      if not critic_steps_on:
        stop = stop | actor_stop
    metrics = dict(metrics, skipped=skipped.astype(jnp.float32), step_scale=scale,
                   nonfinite=code)
    return (new_sub, new_opt_state, stop, actor_stop), metrics

  def epoch(carry, key):
    perm = jax.random.permutation(key, n)
    shuffled = jax.tree.map(lambda x: constrain(split(x[perm])), rows)
    return jax.lax.scan(minibatch_step, carry, shuffled)

  (sub, opt_state, _, _), metrics = jax.lax.scan(
      epoch, (trainable.select(params), opt_state, jnp.zeros((), bool), jnp.zeros((), bool)),
      jax.random.split(rng, cfg.num_epochs))
  code = jax.lax.reduce(metrics.pop("nonfinite").ravel(), 0, jax.lax.bitwise_or, (0,))
  code = code | params_code(sub)
  metrics = dict(spreads(dict(jax.tree.map(jnp.mean, metrics),
                              **objective.batch_metrics(data, rows))),
                 nonfinite=code.astype(jnp.float32))
  new_params = trainable.merge(params, sub)
  if cfg.get("kl_detail_rows", 0):
    metrics.update(update_kl_detail(objective, params, new_params, rows, cfg.kl_detail_rows))
  return new_params, opt_state, metrics


def uses_proximal_snapshot(cfg: ml_collections.ConfigDict) -> bool:
  """Whether a streamed update needs the params it started from after its first optimizer
  step: when :func:`epochs_update` evaluates its rows under them (decoupled PPO's
  proximal policy, learner-side value targets) and there are several minibatches, the
  later ones must be evaluated under them too."""
  return _uses_proximal(cfg) and cfg.num_minibatches > 1


def micro_grads(objective: Objective, cfg: ml_collections.ConfigDict, params, data,
                total_rows: jax.Array, version: jax.Array | int = 0,
                trainable: Trainable = ALL, proximal_params=None):
  """``(grads, metrics)`` of micro-batch ``data`` in an optimizer update of ``total_rows``.

  ``grads`` is a tree like ``trainable.select(params)``.

  Gradients and metrics are weighted sums with global weights, so the
  micro-batches' add up to the whole minibatch's; ``objective.batch_metrics``
  are weighted by this micro-batch's share of the rows (means add up, and so do
  the ``moment/*`` that ``objectives.spreads`` turns into the update's spreads).
  With learner-side value targets (``cfg.value_targets``), the micro-batch is first
  evaluated under ``params`` (its whole trajectory: GAE runs along its time axis).

  ``proximal_params``: the params the update started from, once an earlier minibatch
  of the update has stepped (:func:`uses_proximal_snapshot`): the micro-batch is then
  evaluated under them (proximal log-probs and values) instead of under ``params``, so
  that the ratio, PPO's clip and the behaviour weights are those of
  :func:`epochs_update`'s later minibatches.
  """
  rows = objective.rows(data)
  if proximal_params is not None:
    rows = _with_proximal(objective, proximal_params, data, rows, version)
  elif cfg.value_targets != "rollout":
    rows = _with_proximal(objective, params, data, rows, version)
  weights = objective.streamed_weights(rows, total_rows)
  loss_of = lambda sub: objective.loss(trainable.merge(params, sub), rows, weights)
  (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable.select(params))
  metrics = dict(metrics, lag=_mean_lag(weights, rows, version))
  share = rows["log_prob"].shape[0] / total_rows
  metrics.update({k: share * v for k, v in objective.batch_metrics(data, rows).items()})
  return grads, metrics


def grad_norms(grads) -> dict[str, jax.Array]:
  """The gradient's norm, whole (``grad_norm``) and per part of the trained tree.

  Where a whole-network RL gradient goes: a part is a top-level module
  (``action_out_proj``, ``state_proj``, ``rl``, ...) or, under openpi's ``PaliGemma``,
  ``img`` and ``llm``; the ``llm``'s leaves named with openpi's ``_1`` suffix (the
  action expert's weights) are the part ``llm_expert``. A part's stacked ``layers``
  (leading axis: the layer) is also split per layer. The whole is the parts' squares
  summed, so each leaf is reduced once.

  Args:
    grads: a nested dict of gradient arrays (the trained subtree's).

  Returns:
    ``grad_norm``, ``grad_norm/<part>`` and ``grad_norm/<part>/layer<i>``, scalars.
  """
  parts: dict[str, jax.Array] = {}
  layers: dict[str, jax.Array] = {}  # part -> [L] squared norms
  for path, g in traverse_util.flatten_dict(grads).items():
    g = jnp.square(g.astype(jnp.float32))
    part = path[1] if path[0] == "PaliGemma" and len(path) > 2 else path[0]
    if part == "llm" and any(str(key).endswith("_1") for key in path[2:]):
      part = "llm_expert"
    if "layers" in path and g.ndim >= 1:
      per_layer = jnp.sum(g, axis=tuple(range(1, g.ndim)))
      layers[part] = layers.get(part, 0.0) + per_layer
      parts[part] = parts.get(part, 0.0) + jnp.sum(per_layer)
    else:
      parts[part] = parts.get(part, 0.0) + jnp.sum(g)
  out = {"grad_norm": jnp.sqrt(sum(parts.values()))}
  out.update({f"grad_norm/{part}": jnp.sqrt(sq) for part, sq in parts.items()})
  for part, sq in layers.items():
    out.update({f"grad_norm/{part}/layer{i}": jnp.sqrt(sq[i]) for i in range(sq.shape[0])})
  return out


def update_kl_detail(objective: Objective, before, after, rows: dict,
                     num_rows: int) -> dict[str, jax.Array]:
  """How far one update moved a flow policy, per denoise step and per action dimension.

  ``num_rows`` of the update's ``N`` rows, evenly spaced over them, are scored under the
  params ``before`` and ``after`` the update, each Gaussian step of each chain on its own
  (``objective.step_log_probs``); with ``d`` the after/before log-ratio of one step of
  one executed dim, ``d``'s k3 term ``e^d - 1 - d`` estimates that transition's
  KL(before || after) on the chains the rollout sampled (unbiased for sync data, whose
  behaviour is ``before``).

  Args:
    objective: an objective with ``step_log_probs(params, rows) -> (logps [n, S, H, A],
      steps [n, S])`` and ``policy.num_steps`` (PPO on a Gaussian flow sampler).
    before, after: the params at the start and the end of the update.
    rows: the update's rows (``batch`` and ``chain`` are read).
    num_rows: how many rows to score (at most ``N``).

  Returns:
    ``update_kl`` (per chunk: the sum over its scored steps, positions and dims, a
    mean over rows), ``update_kl/step<k>`` (the sum over positions and dims of step
    ``k``, a mean over the rows that scored it; 0 where none did, as with
    ``model.sde_steps='one'``'s random step), ``update_kl/dim<a>`` (the sum over scored
    steps and positions of dim ``a``) and ``update_log_ratio_abs/step<k>`` (the mean
    ``|d|`` of step ``k``'s terms: the ratios' spread around 1).
  """
  n = rows["chain"].shape[0]
  if not 1 <= num_rows <= n:
    raise ValueError(f"rl.kl_detail_rows={num_rows} must be in [1, {n}] (the update's rows)")
  pick = (jnp.arange(num_rows) * n) // num_rows
  sub = dict(batch=jax.tree.map(lambda x: x[pick], rows["batch"]), chain=rows["chain"][pick])
  old, steps = objective.step_log_probs(before, sub)
  new, _ = objective.step_log_probs(after, sub)
  d = jax.lax.stop_gradient(new - old)  # [r, S, H, A]
  k3 = jnp.expm1(d) - d
  num_steps = objective.policy.num_steps
  hits = jax.nn.one_hot(steps, num_steps)  # [r, S, K]
  count = jnp.maximum(hits.sum((0, 1)), 1.0)  # rows that scored each step
  per_step = jnp.einsum("rs,rsk->k", k3.sum((2, 3)), hits) / count
  terms = d.shape[2] * d.shape[3]
  abs_step = jnp.einsum("rs,rsk->k", jnp.abs(d).sum((2, 3)), hits) / (count * terms)
  per_dim = k3.sum((1, 2)).mean(0)  # [A]
  out = {"update_kl": k3.sum((1, 2, 3)).mean()}
  out.update({f"update_kl/step{k}": per_step[k] for k in range(num_steps)})
  out.update({f"update_kl/dim{a}": per_dim[a] for a in range(per_dim.shape[0])})
  out.update({f"update_log_ratio_abs/step{k}": abs_step[k] for k in range(num_steps)})
  return out
