"""The learner: train state, the behaviour-cloning step and the PPO update.

Two jit boundaries live here: ``bc_step`` (one supervised step) and
``ppo_update`` (all epochs and minibatches of one rollout, as ``lax.scan``s).
Both donate the train state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from jaxvla.algorithms import gae, ppo
from jaxvla.models import policy as policy_lib
from jaxvla.rollout import trajectory as trajectory_lib


@struct.dataclass
class TrainState:
  """Everything a resume needs on the device side.

  Attributes:
    step: optimizer updates applied (the policy version).
    params: policy parameters.
    opt_state: optax state of the current phase's optimizer.
    rng: the learner's PRNG key.
  """
  step: jax.Array
  params: policy_lib.Params
  opt_state: optax.OptState
  rng: jax.Array


def make_optimizer(learning_rate: float, max_grad_norm: float) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(learning_rate))


def init_state(params: policy_lib.Params, tx: optax.GradientTransformation,
               rng: jax.Array) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    rng=rng)


class Learner:
  """Owns the optimizers and the jitted update functions for one policy.

  Args:
    policy: the policy contract.
    bc_config: the ``bc`` sub-config; ppo_config: the ``ppo`` sub-config.
  """

  def __init__(self, policy: policy_lib.Policy, bc_config: ml_collections.ConfigDict,
               ppo_config: ml_collections.ConfigDict):
    self.policy = policy
    self.ppo_config = ppo_config
    self.bc_tx = make_optimizer(bc_config.learning_rate, ppo_config.max_grad_norm)
    self.ppo_tx = make_optimizer(ppo_config.learning_rate, ppo_config.max_grad_norm)
    self.bc_step = jax.jit(self._bc_step, donate_argnums=0)
    self.ppo_update = jax.jit(self._ppo_update, donate_argnums=0)

  # --------------------------------------------------------------------- BC --
  def _bc_step(self, state: TrainState, batch: dict,
               actions: jax.Array) -> tuple[TrainState, jax.Array]:
    """One flow-matching step on expert chunks ``actions`` ``[N, H, A]``."""
    rng, key = jax.random.split(state.rng)
    loss, grads = jax.value_and_grad(self.policy.bc_loss)(state.params, batch, actions, key)
    updates, opt_state = self.bc_tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         rng=rng), loss

  # -------------------------------------------------------------------- PPO --
  def _ppo_update(self, state: TrainState,
                  traj: trajectory_lib.Trajectory) -> tuple[TrainState, dict]:
    """PPO epochs over one trajectory ``[T, B]``; returns mean diagnostics."""
    cfg = self.ppo_config
    # done = terminated | truncated: the time limit is part of the task (the
    # objective is success within it), so a truncated episode is not bootstrapped.
    adv, returns = gae.compute_gae(traj.reward, traj.value, traj.done, traj.bootstrap_value,
                                   gamma=cfg.gamma, lam=cfg.gae_lambda)
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    data = dict(batch=jax.tree.map(flat, traj.batch), chain=flat(traj.chain),
                log_prob=flat(traj.log_prob), adv=flat(adv), returns=flat(returns))
    n = data["log_prob"].shape[0]
    if n % cfg.num_minibatches:
      raise ValueError(f"rollout size {n} (num_envs x rollout_len) is not divisible by "
                       f"ppo.num_minibatches={cfg.num_minibatches}")
    mb = n // cfg.num_minibatches

    def loss_fn(params, minibatch):
      ev = self.policy.evaluate(params, minibatch["batch"], minibatch["chain"])
      a = minibatch["adv"]
      a = (a - a.mean()) / (a.std() + 1e-8)
      return ppo.ppo_loss(ev.log_prob, minibatch["log_prob"], a, ev.value,
                          minibatch["returns"], ev.entropy, **ppo.loss_kwargs(cfg))

    def minibatch_step(carry, minibatch):
      params, opt_state, stop = carry
      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, minibatch)
      updates, new_opt_state = self.ppo_tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      # Once approx. KL passes ppo.target_kl, the remaining minibatches are skipped.
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(stop, b, a), new, old)
      params, opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
      if cfg.target_kl > 0:
        stop = stop | (metrics["approx_kl"] > cfg.target_kl)
      metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                     skipped=stop.astype(jnp.float32))
      return (params, opt_state, stop), metrics

    def epoch(carry, key):
      perm = jax.random.permutation(key, n)
      shuffled = jax.tree.map(lambda x: x[perm].reshape((cfg.num_minibatches, mb) + x.shape[1:]),
                              data)
      return jax.lax.scan(minibatch_step, carry, shuffled)

    rng, key = jax.random.split(state.rng)
    (params, opt_state, _), metrics = jax.lax.scan(
        epoch, (state.params, state.opt_state, jnp.zeros((), bool)),
        jax.random.split(key, cfg.num_epochs))
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["value_mean"] = traj.value.mean()
    metrics["advantage_std"] = adv.std()
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         rng=rng), metrics
