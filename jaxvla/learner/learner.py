"""The learner: train state, the behaviour-cloning step and the PPO update.

Jit boundaries: ``bc_step`` (one supervised step), ``ppo_update`` (all epochs
and minibatches of one rollout, as ``lax.scan``s), and the streamed learner's
three (``micro_grads`` of one micro-batch as it arrives, ``accumulate``, and
``apply``, one optimizer update from the summed gradients, equal to a
one-minibatch ``ppo_update`` of the same data). Updates donate the train state.

With a mesh (``Learner(..., mesh=, rules=)``) both are jitted with explicit
shardings: params by their logical axes (:mod:`jaxvla.sharding`), optimizer
moments like their params, scalars and PRNG keys replicated, and data split on
its batch dimension (the env dimension of a time-major trajectory). Callers
place the state with :meth:`Learner.shard_state` (or restore it onto
:meth:`Learner.state_shardings`). Without a mesh nothing changes.

Multi-process (``jax.process_count() > 1``, a mesh over every process's learner
devices): every entry point takes *this process's* rows of the batch (its own
env segments, episodes or demonstration chunks, equal in number on every
process) and assembles the global batch with
:func:`jaxvla.distributed.to_global`; sizes named in errors and counts such as
``num_chunks`` are per process, the update is over all processes' data. Every
process must call the same entry points in the same order (they are collectives).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from jaxvla import distributed
from jaxvla import sharding as sharding_lib
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
    policy: the policy contract (with ``logical_axes()`` when a mesh is given).
    bc_config: the ``bc`` sub-config; ppo_config: the ``ppo`` sub-config.
    mesh: the learner mesh (``jaxvla.sharding.make_mesh``); None: unsharded jit.
    rules: ``config.mesh.rules`` (required with a mesh).
  """

  def __init__(self, policy: policy_lib.Policy, bc_config: ml_collections.ConfigDict,
               ppo_config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None = None,
               rules: sharding_lib.Rules | None = None):
    self.policy = policy
    self.ppo_config = ppo_config
    self.bc_tx = make_optimizer(bc_config.learning_rate, ppo_config.max_grad_norm)
    self.ppo_tx = make_optimizer(ppo_config.learning_rate, ppo_config.max_grad_norm)
    self.mesh, self.rules = mesh, rules
    self.num_processes = jax.process_count()
    if mesh is None:
      if self.num_processes > 1:
        raise ValueError("Learner: a multi-process run needs a learner mesh over every "
                         "process's devices (config.mesh)")
      self.bc_step = jax.jit(self._bc_step, donate_argnums=0)
      self.ppo_update = jax.jit(self._ppo_update, donate_argnums=0)
      self._micro_grads_jit = jax.jit(self._micro_grads)
      self._add_jit = jax.jit(self._add, donate_argnums=0)
      self._apply_jit = jax.jit(self._apply, donate_argnums=0, static_argnums=2)
      return
    if rules is None:
      raise ValueError("Learner: a mesh needs sharding rules (config.mesh.rules)")
    self.batch_shards = sharding_lib.num_batch_shards(mesh, rules)
    if self.batch_shards % self.num_processes:
      raise ValueError(
          f"the learner mesh {dict(mesh.shape)} splits the batch {self.batch_shards} ways, "
          f"which {self.num_processes} processes cannot share evenly; each process feeds its "
          "own batch shards, so config.mesh.data * config.mesh.fsdp must be a multiple of the "
          "process count")
    self._abstract_params = abstract_params = policy.abstract_params()
    self.param_shardings = sharding_lib.param_shardings(policy.logical_axes(), abstract_params,
                                                        mesh, rules)
    abstract_state = lambda tx: jax.eval_shape(
        lambda p, k: init_state(p, tx, k), abstract_params, jax.random.PRNGKey(0))
    bc_sh = self.state_shardings(abstract_state(self.bc_tx))
    ppo_sh = self.state_shardings(abstract_state(self.ppo_tx))
    rep = sharding_lib.replicated(mesh)
    data = sharding_lib.batch_sharding(mesh, rules)  # [N, ...]: N split.
    steps = sharding_lib.batch_sharding(mesh, rules, batch_dim=1)  # [T, B, ...]: B split.
    traj_sh = trajectory_lib.Trajectory(
        batch=steps, chain=steps, log_prob=steps, value=steps, reward=steps, done=steps,
        steps=steps, bootstrap_value=data, policy_version=steps)
    self._data_sh, self._traj_sh = data, traj_sh
    # For updates jitted elsewhere (GRPO): outputs laid out like this learner's.
    self.ppo_state_shardings, self.replicated_sharding = ppo_sh, rep
    self._episodes_sh = (data, steps)  # ([E] arrays, [K, E] arrays) of an EpisodeBatch.
    self._bc_step_jit = jax.jit(self._bc_step, in_shardings=(bc_sh, data, data),
                                out_shardings=(bc_sh, rep), donate_argnums=0)
    self._ppo_update_jit = jax.jit(self._ppo_update, in_shardings=(ppo_sh, traj_sh),
                                   out_shardings=(ppo_sh, rep), donate_argnums=0)
    # Streamer: gradients live like the params; metrics and the weight replicated.
    params_sh = self.param_shardings
    grads_sh = (params_sh, rep)
    self._micro_grads_jit = jax.jit(self._micro_grads, in_shardings=(params_sh, traj_sh, rep),
                                    out_shardings=grads_sh)
    self._add_jit = jax.jit(self._add, in_shardings=(grads_sh, params_sh, rep),
                            out_shardings=grads_sh, donate_argnums=0)
    self._apply_jit = jax.jit(self._apply, in_shardings=(ppo_sh, grads_sh),
                              out_shardings=(ppo_sh, rep), donate_argnums=0,
                              static_argnums=2)
    self.bc_step = self._sharded_bc_step
    self.ppo_update = self._sharded_ppo_update

  # --------------------------------------------------------------- sharding --
  def state_shardings(self, abstract_state: TrainState):
    """Shardings of a train state (arrays or ``ShapeDtypeStruct``s), same tree.

    Params and every optimizer-state subtree that mirrors them (Adam's ``mu``,
    ``nu``) take the params' logical shardings; step, counts and PRNG key are
    replicated. Without a mesh: the default device, for every leaf.
    """
    if self.mesh is None:
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      return jax.tree.map(lambda _: device, abstract_state)
    return sharding_lib.mirror_shardings(abstract_state, self._abstract_params,
                                         self.param_shardings,
                                         sharding_lib.replicated(self.mesh))

  def shard_state(self, state: TrainState) -> TrainState:
    """``state`` placed on :meth:`state_shardings` (what ``bc_step``/``ppo_update`` take)."""
    return distributed.device_put(state, self.state_shardings(state))

  def _check_batch(self, n: int, what: str, key: str) -> None:
    """``n``: this process's share; the mesh splits ``n * num_processes`` rows."""
    local_shards = self.batch_shards // self.num_processes
    if n % local_shards:
      where = (f"the {self.batch_shards} batch shards of the learner mesh "
               f"{dict(self.mesh.shape)}")
      if self.num_processes > 1:
        where = f"this process's {local_shards} of {where} ({self.num_processes} processes)"
      raise ValueError(f"{what} {n} is not divisible by {where}; adjust {key} or config.mesh")

  def _to_global_traj(self, traj: trajectory_lib.Trajectory) -> trajectory_lib.Trajectory:
    return distributed.to_global(traj, self._traj_sh)

  def to_global_episodes(self, eb):
    """This process's ``EpisodeBatch [K, E_local]`` -> global ``[K, E]`` arrays.

    Single process or no mesh: ``eb`` unchanged.
    """
    if self.mesh is None or self.num_processes == 1:
      return eb
    self._check_batch(eb.log_prob.shape[1], "GRPO episodes per update (or micro-batch)",
                      "config.num_envs or config.pipeline.micro_batch_segments")
    per_episode, per_chunk = self._episodes_sh
    shardings = jax.tree.map(lambda x: per_episode if x.ndim == 1 else per_chunk, eb)
    return distributed.to_global(eb, shardings)

  def _sharded_bc_step(self, state: TrainState, batch: dict, actions):
    self._check_batch(actions.shape[0], "BC batch size", "config.bc.batch_size")
    batch, actions = distributed.to_global((batch, actions), self._data_sh)
    return self._bc_step_jit(state, batch, actions)

  def _sharded_ppo_update(self, state: TrainState, traj: trajectory_lib.Trajectory):
    num_envs = traj.log_prob.shape[1]
    self._check_batch(num_envs, "rollout envs", "config.num_envs")
    n = traj.log_prob.shape[0] * num_envs
    if n % self.ppo_config.num_minibatches == 0:  # (else _ppo_update raises)
      self._check_batch(n // self.ppo_config.num_minibatches, "PPO minibatch size (chunks)",
                        "config.ppo.num_minibatches")
    return self._ppo_update_jit(state, self._to_global_traj(traj))

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
  def _chunks(self, traj: trajectory_lib.Trajectory) -> dict:
    """GAE over ``traj [T, B]`` (per env column), flattened to ``N = T * B`` chunks."""
    cfg = self.ppo_config
    # done = terminated | truncated: the time limit is part of the task (the
    # objective is success within it), so a truncated episode is not bootstrapped.
    adv, returns = gae.compute_gae(traj.reward, traj.value, traj.done, traj.bootstrap_value,
                                   gamma=cfg.gamma, lam=cfg.gae_lambda)
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    return dict(batch=jax.tree.map(flat, traj.batch), chain=flat(traj.chain),
                log_prob=flat(traj.log_prob), adv=flat(adv), returns=flat(returns))

  def _loss(self, params, minibatch: dict, weights: jax.Array):
    """Weighted PPO loss (a weighted sum: micro-batch losses add up to the batch's)."""
    cfg = self.ppo_config
    ev = self.policy.evaluate(params, minibatch["batch"], minibatch["chain"])
    a = minibatch["adv"]
    if cfg.advantage_norm == "minibatch":
      a = (a - a.mean()) / (a.std() + 1e-8)
    proximal = minibatch.get("proximal")
    if proximal is None:  # The params at the start of this update are the current ones.
      proximal = jax.lax.stop_gradient(ev.log_prob)
    return ppo.ppo_loss(ev.log_prob, minibatch["log_prob"], a, ev.value, minibatch["returns"],
                        ev.entropy, weights=weights, proximal_log_prob=proximal,
                        **ppo.loss_kwargs(cfg))

  def _ppo_update(self, state: TrainState,
                  traj: trajectory_lib.Trajectory) -> tuple[TrainState, dict]:
    """PPO epochs over one trajectory ``[T, B]``; returns mean diagnostics."""
    cfg = self.ppo_config
    data = self._chunks(traj)
    n = data["log_prob"].shape[0]
    if n % cfg.num_minibatches:
      raise ValueError(f"rollout size {n} (num_envs x rollout_len) is not divisible by "
                       f"ppo.num_minibatches={cfg.num_minibatches}")
    mb = n // cfg.num_minibatches
    if ppo.loss_kwargs(cfg)["correction"] == "decoupled" and (cfg.num_epochs > 1
                                                              or cfg.num_minibatches > 1):
      # Decoupled PPO's proximal policy: the params before this update's epochs.
      split = lambda x: x.reshape((cfg.num_minibatches, mb) + x.shape[1:])
      proximal = jax.lax.map(
          lambda m: self.policy.evaluate(state.params, m["batch"], m["chain"]).log_prob,
          dict(batch=jax.tree.map(split, data["batch"]), chain=split(data["chain"])))
      data["proximal"] = jax.lax.stop_gradient(proximal.reshape(n))
    weights = jnp.full((mb,), 1.0 / mb, jnp.float32)

    def minibatch_step(carry, minibatch):
      params, opt_state, stop = carry
      (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
          params, minibatch, weights)
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
      if self.mesh is not None:  # Each minibatch split over the batch shards.
        shuffled = jax.tree.map(
            lambda x: sharding_lib.with_logical_constraint(x, (None, "batch"), self.rules,
                                                           self.mesh), shuffled)
      return jax.lax.scan(minibatch_step, carry, shuffled)

    rng, key = jax.random.split(state.rng)
    (params, opt_state, _), metrics = jax.lax.scan(
        epoch, (state.params, state.opt_state, jnp.zeros((), bool)),
        jax.random.split(key, cfg.num_epochs))
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["value_mean"] = traj.value.mean()
    metrics["advantage_std"] = data["adv"].std()
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         rng=rng), metrics

  # --------------------------------------------------------------- streamed --
  def _micro_grads(self, params, traj: trajectory_lib.Trajectory,
                   weight: jax.Array) -> tuple[object, dict]:
    """Gradient of one micro-batch ``[T, M]``, every chunk weighted ``weight``.

    With ``weight = 1 / N`` (``N`` chunks in the update) the gradients and metrics
    of the update's micro-batches sum to those of the whole batch.
    """
    data = self._chunks(traj)
    weights = jnp.full(data["log_prob"].shape, weight, jnp.float32)
    (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(params, data, weights)
    scale = weight * data["log_prob"].shape[0]  # This micro-batch's share of the update.
    metrics = dict(metrics, loss=loss, value_mean=scale * traj.value.mean(),
                   advantage_std=scale * data["adv"].std())
    return grads, metrics

  def _add(self, acc, grads, metrics):
    """Accumulates ``(grads, metrics)`` into ``acc`` (donated)."""
    return jax.tree.map(jnp.add, acc, (grads, metrics))

  def _apply(self, state: TrainState, acc, bump_version: bool) -> tuple[TrainState, dict]:
    """One optimizer update with accumulated gradients; ``bump_version`` ends the batch."""
    grads, metrics = acc
    updates, opt_state = self.ppo_tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads), skipped=jnp.zeros(()))
    step = state.step + (1 if bump_version else 0)
    return state.replace(step=step, params=params, opt_state=opt_state), metrics

  def micro_grads(self, params, traj: trajectory_lib.Trajectory, num_chunks: int):
    """Streamer: ``(grads, metrics)`` of micro-batch ``traj`` in an update of
    ``num_chunks`` chunks (add them with :meth:`accumulate`).

    Multi-process: ``traj`` and ``num_chunks`` are this process's; the micro-batch
    is every process's ``traj`` together.
    """
    if self.mesh is not None:
      self._check_batch(traj.log_prob.shape[1], "streamed micro-batch segments",
                        "config.pipeline.micro_batch_segments")
      traj = self._to_global_traj(traj)
    return self._micro_grads_jit(params, traj,
                                 jnp.float32(1.0 / (num_chunks * self.num_processes)))

  def accumulate(self, acc, grads_metrics):
    """``acc + grads_metrics`` (``acc`` None: the first micro-batch)."""
    if acc is None:
      return grads_metrics
    return self._add_jit(acc, *grads_metrics)

  def apply(self, state: TrainState, acc, bump_version: bool = True):
    """Applies accumulated micro-batch gradients: one optimizer update."""
    return self._apply_jit(state, acc, bump_version)
