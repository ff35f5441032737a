"""GRPO updates of a :class:`Learner`'s policy on whole episodes (``EpisodeBatch [K, E]``).

The loss is PPO's (:func:`jaxvla.algorithms.ppo.ppo_loss`, same correction,
clip and entropy bonus) with no value term (GRPO has no critic:
``value_coef=0``), every chunk taking its episode's group-normalised advantage
and the per-chunk weights of ``ppo.loss_normalizer``
(:func:`jaxvla.algorithms.grpo.chunk_weights`). ``ppo.advantage_norm`` is not
applied: the advantages are already normalised within each group (and a
minibatch normalisation would keep streamed micro-batches from adding up).

Two jitted entry points, each built from a :class:`Learner` (its policy,
``ppo_tx`` and ``ppo_config``):

* :func:`grpo_update`: ``ppo.num_epochs`` passes of ``ppo.num_minibatches``
  minibatches of *episodes* (shuffled per epoch), like ``Learner.ppo_update``.
* :func:`grpo_micro_grads`: the streamed learner's gradient of one
  micro-batch of episodes with *global* weights, so that the micro-batches'
  ``(grads, metrics)``, added with ``Learner.accumulate`` and applied with
  ``Learner.apply``, equal a one-minibatch :func:`grpo_update` of their union.

With a learner mesh both are jitted with the learner's output shardings (state
and gradients laid out like the params, metrics replicated); inputs keep their
placement and XLA propagates it. In a multi-process run both take this
process's episodes (and episode count) and assemble the global batch
(``Learner.to_global_episodes``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from jaxvla.algorithms import grpo, ppo
from jaxvla.learner import learner as learner_lib
from jaxvla.runtime import episodes as episodes_lib

# Normalizers whose weights a micro-batch can compute alone (given the update's episode count).
STREAMABLE_NORMALIZERS = ("trajectory", "constant")


def _check_normalizer(cfg: ml_collections.ConfigDict) -> None:
  if cfg.loss_normalizer not in grpo.NORMALIZERS:
    raise ValueError(f"config.ppo.loss_normalizer={cfg.loss_normalizer!r} must be one of "
                     f"{grpo.NORMALIZERS}")


def _episode_major(eb: episodes_lib.EpisodeBatch) -> dict:
  """``EpisodeBatch [K, E]`` -> arrays ``[E, K, ...]`` (and ``adv [E]``) to split by episode."""
  swap = lambda x: jnp.swapaxes(jnp.asarray(x), 0, 1)
  return dict(batch=jax.tree.map(swap, eb.batch), chain=swap(eb.chain),
              log_prob=swap(eb.log_prob), mask=swap(eb.mask),
              adv=jnp.asarray(eb.advantage, jnp.float32))


def _evaluate(policy, params, data: dict):
  """Log-prob and entropy ``[e * K]`` of episode-major chunks ``data`` ``[e, K, ...]``."""
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  return policy.evaluate(params, jax.tree.map(flat, data["batch"]), flat(data["chain"]))


def _loss(policy, cfg: ml_collections.ConfigDict, params, data: dict, weights: jax.Array):
  """Weighted GRPO loss of episodes ``data`` ``[e, K, ...]``, ``weights [e, K]`` (a sum).

  ``data["proximal"]`` ``[e, K]``, when present, is the decoupled correction's
  proximal log-prob; otherwise the current params are the proximal policy.
  """
  ev = _evaluate(policy, params, data)
  e, k = data["mask"].shape
  adv = jnp.broadcast_to(data["adv"][:, None], (e, k)).reshape(-1)
  proximal = (data["proximal"].reshape(-1) if "proximal" in data
              else jax.lax.stop_gradient(ev.log_prob))
  zeros = jnp.zeros_like(ev.log_prob)  # No critic: value and target both 0.
  loss, metrics = ppo.ppo_loss(
      ev.log_prob, data["log_prob"].reshape(-1), adv, zeros, zeros, ev.entropy,
      weights=weights.reshape(-1), proximal_log_prob=proximal,
      **dict(ppo.loss_kwargs(cfg), value_coef=0.0))
  del metrics["value_loss"]
  return loss, dict(metrics, loss=loss)


def _batch_metrics(eb: episodes_lib.EpisodeBatch) -> dict:
  """Advantage spread, mean return and mean played chunks per episode of ``eb``."""
  return dict(advantage_std=jnp.std(eb.advantage),
              episode_return_mean=jnp.mean(eb.episode_return),
              episode_length_mean=jnp.mean(jnp.sum(eb.mask, axis=0).astype(jnp.float32)))


def grpo_update(learner: learner_lib.Learner) -> Callable:
  """The jitted GRPO update of ``learner``'s policy.

  Returns:
    ``fn(state, eb) -> (state, metrics)``: ``ppo.num_epochs`` epochs of
    ``ppo.num_minibatches`` minibatches of ``E / num_minibatches`` episodes of
    ``eb`` ``[K, E]``, shuffled per epoch with the state's key; one optimizer
    step per minibatch (the rest of the update skipped once approx. KL passes
    ``ppo.target_kl > 0``). ``state`` is donated; ``state.step`` grows by 1.
    ``metrics``: means over minibatches of the loss terms, ``grad_norm`` and
    ``skipped``, plus ``advantage_std``, ``episode_return_mean`` and
    ``episode_length_mean`` (played chunks) of ``eb``.

  Raises:
    ValueError: an unknown ``ppo.loss_normalizer``; when called, ``E`` not
      divisible by ``ppo.num_minibatches``.
  """
  policy, tx, cfg = learner.policy, learner.ppo_tx, learner.ppo_config
  _check_normalizer(cfg)
  nm = cfg.num_minibatches
  decoupled_proximal = (ppo.loss_kwargs(cfg)["correction"] == "decoupled"
                        and (cfg.num_epochs > 1 or nm > 1))

  def update(state: learner_lib.TrainState, eb: episodes_lib.EpisodeBatch):
    data = _episode_major(eb)
    e = eb.log_prob.shape[1]
    if e % nm:
      raise ValueError(f"GRPO batch of {e} episodes is not divisible by "
                       f"ppo.num_minibatches={nm}")
    mb = e // nm
    split = lambda x: x.reshape((nm, mb) + x.shape[1:])
    if decoupled_proximal:  # The params before this update's epochs, per minibatch of episodes.
      proximal = jax.lax.map(
          lambda m: _evaluate(policy, state.params, m).log_prob.reshape(mb, -1),
          dict(batch=jax.tree.map(split, data["batch"]), chain=split(data["chain"])))
      data["proximal"] = jax.lax.stop_gradient(proximal.reshape(e, -1))

    def minibatch_step(carry, minibatch):
      params, opt_state, stop = carry
      weights = grpo.chunk_weights(minibatch["mask"], cfg.loss_normalizer)
      (_, metrics), grads = jax.value_and_grad(
          lambda p: _loss(policy, cfg, p, minibatch, weights), has_aux=True)(params)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(stop, b, a), new, old)
      params, opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
      if cfg.target_kl > 0:
        stop = stop | (metrics["approx_kl"] > cfg.target_kl)
      metrics = dict(metrics, grad_norm=optax.tree.norm(grads), skipped=stop.astype(jnp.float32))
      return (params, opt_state, stop), metrics

    def epoch(carry, key):
      perm = jax.random.permutation(key, e)
      return jax.lax.scan(minibatch_step, carry, jax.tree.map(lambda x: split(x[perm]), data))

    rng, key = jax.random.split(state.rng)
    (params, opt_state, _), metrics = jax.lax.scan(
        epoch, (state.params, state.opt_state, jnp.zeros((), bool)),
        jax.random.split(key, cfg.num_epochs))
    metrics = dict(jax.tree.map(jnp.mean, metrics), **_batch_metrics(eb))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         rng=rng), metrics

  # With a mesh, outputs keep the learner's layouts (the state goes on to other jits).
  out = (None if learner.mesh is None
         else (learner.ppo_state_shardings, learner.replicated_sharding))
  jitted = jax.jit(update, donate_argnums=0, out_shardings=out)
  # Multi-process: this process's episodes -> the global batch (identity otherwise).
  return lambda state, eb: jitted(state, learner.to_global_episodes(eb))


def _check_streamable(normalizer: str) -> None:
  if normalizer not in STREAMABLE_NORMALIZERS:
    raise ValueError(f"config.ppo.loss_normalizer={normalizer!r} cannot be streamed (its "
                     "weights need the whole update's chunk count); use one of "
                     f"{STREAMABLE_NORMALIZERS} with pipeline.streamer")


def streamed_weights(mask: jax.Array, normalizer: str, num_episodes_total: jax.Array) -> jax.Array:
  """Global per-chunk weights ``[e, K]`` of a micro-batch's episodes ``mask [e, K]``.

  * "trajectory": ``mask / (|tau_e| * E_total)``;
  * "constant": ``mask / (K * E_total)``,

  so that the weights of all the micro-batches of an update of ``E_total``
  episodes are :func:`grpo.chunk_weights` of the whole (every episode has a chunk).

  Raises:
    ValueError: naming ``config.ppo.loss_normalizer`` when it is not streamable
      ("chunks" needs the update's total chunk count, known only at its end).
  """
  _check_streamable(normalizer)
  m = jnp.asarray(mask, bool).astype(jnp.float32)
  if normalizer == "trajectory":
    per_episode = jnp.maximum(m.sum(axis=1, keepdims=True), 1.0)
  else:
    per_episode = jnp.float32(m.shape[1])
  return m / (per_episode * num_episodes_total)


def grpo_micro_grads(learner: learner_lib.Learner) -> Callable:
  """The streamed learner's gradient of one micro-batch of episodes.

  Returns:
    ``fn(params, eb, num_episodes_total) -> (grads, metrics)`` for ``eb``
    ``[K, e]``, one of the micro-batches of an optimizer update of
    ``num_episodes_total`` episodes. Gradients and metrics are weighted sums
    with global weights (:func:`streamed_weights`), so the micro-batches' add
    up (``Learner.accumulate``) to those of the whole update, which
    ``Learner.apply`` applies. ``advantage_std`` is the episode-weighted mean
    of the micro-batches' (not the whole batch's) std; ``episode_return_mean``
    and ``episode_length_mean`` add up to the whole batch's.

  Raises:
    ValueError: ``ppo.loss_normalizer`` unknown or not streamable ("chunks").
  """
  policy, cfg = learner.policy, learner.ppo_config
  _check_normalizer(cfg)
  _check_streamable(cfg.loss_normalizer)

  def micro_grads(params, eb: episodes_lib.EpisodeBatch, num_episodes_total: jax.Array):
    data = _episode_major(eb)
    weights = streamed_weights(data["mask"], cfg.loss_normalizer, num_episodes_total)
    (_, metrics), grads = jax.value_and_grad(
        lambda p: _loss(policy, cfg, p, data, weights), has_aux=True)(params)
    share = eb.log_prob.shape[1] / num_episodes_total  # This micro-batch's share of episodes.
    metrics.update({k: share * v for k, v in _batch_metrics(eb).items()})
    return grads, metrics

  # Gradients laid out like the params, as Learner.accumulate / apply expect.
  out = (None if learner.mesh is None
         else (learner.param_shardings, learner.replicated_sharding))
  jitted = jax.jit(micro_grads, out_shardings=out)
  # Multi-process: eb and num_episodes_total are this process's share.
  return lambda params, eb, num_episodes_total: jitted(
      params, learner.to_global_episodes(eb),
      jnp.float32(num_episodes_total * learner.num_processes))
