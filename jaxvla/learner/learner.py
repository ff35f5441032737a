"""The learner: the train state, the behaviour-cloning step and the RL update's jits.

Owns the device side of training: :class:`TrainState`, the jitted entry points below and
their shardings. Its parts live beside it: the optimizers and step-size schedules in
:mod:`jaxvla.learner.optimizers`, the RL objective's pick in
:mod:`jaxvla.learner.algorithm`, the update loop in :mod:`jaxvla.learner.update`, and
the host-side divergence guard in :mod:`jaxvla.learner.guard`.

Jit boundaries, each with explicit shardings on the learner mesh and the train
state donated:

* ``bc_step``: one supervised step on expert chunks;
* ``update``: every epoch and minibatch of one RL batch
  (:func:`jaxvla.learner.update.epochs_update` of the configured objective, PPO
  on a ``Trajectory`` or GRPO on an ``EpisodeBatch``);
* the streamed learner's three: ``micro_grads`` of one micro-batch as it
  arrives, ``accumulate`` and ``apply`` (one optimizer update from the summed
  gradients, equal to a one-minibatch ``update`` of the same data).

The learner always has a mesh (one device when none is given), so every run,
test or production, goes through the same sharded jits: params by their
logical axes (:mod:`jaxvla.parallel.sharding`), optimizer moments like their params,
scalars and PRNG keys replicated, and data split on its env axis
(:meth:`jaxvla.types.Trajectory.env_axes`). Callers place the state with
:meth:`Learner.shard_state` (or restore it onto :meth:`Learner.state_shardings`).

LoRA (``config.model.lora``, adapters in the params tree): every step trains
:attr:`Learner.trainable` alone (the adapters, the RL heads and what openpi's
freeze filter leaves trainable); the optimizer state holds that subtree's moments
only, and the frozen weights get no gradient (:mod:`jaxvla.learner.trainable`).

Multi-process (``jax.process_count() > 1``, a mesh over every process's learner
devices): every entry point takes *this process's* rows of the batch (its own
env segments, episodes or demonstration chunks, equal in number on every
process) and assembles the global batch with
:func:`jaxvla.parallel.distributed.to_global`; sizes named in errors are per process,
the update is over all processes' data. Every process must call the same entry
points in the same order (they are collectives).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Callable, ContextManager, Iterable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct

from jaxvla import types
from jaxvla.algorithms import ppo
from jaxvla.learner import algorithm as algorithm_lib
from jaxvla.learner import objectives as objectives_lib
from jaxvla.learner import optimizers as optimizers_lib
from jaxvla.learner import trainable as trainable_lib
from jaxvla.learner import update as update_lib
from jaxvla.models import contract
from jaxvla.parallel import distributed
from jaxvla.parallel import sharding as sharding_lib


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
  params: contract.Params
  opt_state: optax.OptState
  rng: jax.Array


def init_state(params: contract.Params, tx: optax.GradientTransformation,
               rng: jax.Array) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    rng=rng)


# The streamer's programs, jitted per learner by Learner._jit_streamer. Module functions of
# the learner (not methods) so that each program keeps its name in a profile
# (``jit_micro_grads``, ``jit_micro_grads_proximal``, ``jit_snapshot``).
def micro_grads(learner: Learner, params: contract.Params, data, total: jax.Array,
                version: jax.Array) -> tuple[contract.Params, dict]:
  """One micro-batch's ``(grads, metrics)``, its rows weighted out of ``total``."""
  return update_lib.micro_grads(learner.objective, learner.ppo_config, params, data, total,
                                version, learner.rl_trainable)


def micro_grads_proximal(learner: Learner, params: contract.Params, data, total: jax.Array,
                         version: jax.Array, proximal: contract.Params
                         ) -> tuple[contract.Params, dict]:
  """:func:`micro_grads` under the update's proximal policy (``proximal``: the snapshot
  of the trained subtree the update started from)."""
  return update_lib.micro_grads(learner.objective, learner.ppo_config, params, data, total,
                                version, learner.rl_trainable,
                                learner.rl_trainable.merge(params, proximal))


def snapshot(learner: Learner, params: contract.Params) -> contract.Params:
  """The trained subtree of ``params`` in ``learner.proximal_dtype``, copied (the params
  it is taken from are donated next)."""
  return jax.tree.map(jnp.copy, trainable_lib.cast_floating(
      learner.rl_trainable.select(params), learner.proximal_dtype))


class Learner:
  """Owns the optimizers and the jitted update functions for one policy.

  Args:
    policy: the policy contract.
    config: the run config: ``bc`` (the warm start's optimizer), ``rl`` (the RL
      update) and ``algorithm`` / ``grpo`` (the RL objective, picked once, here).
    mesh: the learner mesh (``jaxvla.parallel.sharding.make_mesh``); None: one device.
    rules: ``config.mesh.rules`` (default :data:`jaxvla.parallel.sharding.DEFAULT_RULES`).
    behaviour_is_proximal: every RL batch was sampled with the params the update starts
      from (``sync_colocated``): the decoupled correction's proximal pass is skipped
      (``update.epochs_update``).
  """

  def __init__(self, policy: contract.Policy, config: ml_collections.ConfigDict,
               mesh: jax.sharding.Mesh | None = None, rules: sharding_lib.Rules | None = None,
               behaviour_is_proximal: bool = False):
    self.policy = policy
    self.algorithm, self.ppo_config = config.algorithm, config.rl
    self.behaviour_is_proximal = behaviour_is_proximal
    # A streamed update's proximal snapshot is kept in the precision the rollout acts in
    # (its behaviour log-probs already come from weights rounded so): full pi0's float32
    # copy alone would take 12 of an 80 GB GPU's GiB beside the train state.
    self.proximal_dtype = config.pipeline.rollout_dtype or None
    self.objective = algorithm_lib.get(config.algorithm).objective(policy, config)
    self._abstract_params = policy.abstract_params()
    self.trainable = trainable_lib.Trainable.of(self._abstract_params)
    # What RL trains: the same, or the RL heads alone over a frozen flow (steered samplers).
    self.rl_trainable = (trainable_lib.Trainable.rl_heads() if policy.rl_heads_only
                         else self.trainable)
    self.bc_tx = optimizers_lib.bc_optimizer(config, self.trainable)
    self.ppo_tx = optimizers_lib.rl_optimizer(config, self.rl_trainable, jax.process_count())
    self.num_processes = jax.process_count()
    self._set_mesh(mesh, rules)
    self._jit_all()

  def _set_mesh(self, mesh: jax.sharding.Mesh | None, rules: sharding_lib.Rules | None
                ) -> None:
    """The learner mesh (one device when none is given) and how it splits a batch."""
    if mesh is None:
      if self.num_processes > 1:
        raise ValueError("Learner: a multi-process run needs a learner mesh over every "
                         "process's devices (config.mesh)")
      mesh = sharding_lib.single_device_mesh()
    self.mesh = mesh
    self.rules = sharding_lib.DEFAULT_RULES if rules is None else rules
    self.batch_shards = sharding_lib.num_batch_shards(mesh, self.rules)
    if self.batch_shards % self.num_processes:
      raise ValueError(
          f"the learner mesh {dict(mesh.shape)} splits the batch {self.batch_shards} ways, "
          f"which {self.num_processes} processes cannot share evenly; each process feeds its "
          "own batch shards, so config.mesh.data * config.mesh.fsdp must be a multiple of the "
          "process count")

  # --------------------------------------------------------------- sharding --
  def _jit_all(self) -> None:
    """The jits of every entry point, with the mesh's in/out shardings.

    ``bc_step_jit`` and ``update_jit`` take global arrays (no batch checks): the
    jit boundaries themselves, for AOT lowering (``jaxvla.bench.policy``).
    """
    self._set_shardings()
    self._jit_steps()
    self._jit_streamer()

  def _abstract_state(self, tx: optax.GradientTransformation) -> TrainState:
    """The shapes of a fresh train state for ``tx`` (nothing allocated)."""
    return jax.eval_shape(lambda p, k: init_state(p, tx, k), self._abstract_params,
                          jax.random.PRNGKey(0))

  def _set_shardings(self) -> None:
    """The mesh's shardings of the params, both phases' train states and the RL data."""
    mesh, rules = self.mesh, self.rules
    self.param_shardings = sharding_lib.param_shardings(self.policy.logical_axes(),
                                                        self._abstract_params, mesh, rules)
    # The trained subtree's gradients and optimizer moments live like its params.
    self._trained_shardings = self.rl_trainable.select(self.param_shardings)
    self._bc_state_sh = self.state_shardings(self._abstract_state(self.bc_tx))
    self._ppo_state_sh = self.state_shardings(self._abstract_state(self.ppo_tx))
    self._rep = sharding_lib.replicated(mesh)
    # The env (episode) axis of every field is split over the batch shards.
    self._rows_sh = sharding_lib.batch_sharding(mesh, rules)  # [N, ...]: N split.
    self._data_sh = types.env_axis_tree(self.objective.data_type, {
        0: self._rows_sh, 1: sharding_lib.batch_sharding(mesh, rules, batch_dim=1)})

  def _jit_steps(self) -> None:
    """The whole-batch entry points: a BC step and an RL update, the state donated."""
    bc_sh, ppo_sh, rows_sh, rep = self._bc_state_sh, self._ppo_state_sh, self._rows_sh, self._rep
    self.bc_step_jit = jax.jit(self._bc_step, in_shardings=(bc_sh, rows_sh, rows_sh, rows_sh),
                               out_shardings=(bc_sh, rep), donate_argnums=0)
    self.update_jit = jax.jit(self._update, in_shardings=(ppo_sh, self._data_sh),
                               out_shardings=(ppo_sh, rep), donate_argnums=0)

  def _jit_streamer(self) -> None:
    """The streamed learner's entry points: one micro-batch's gradients (under the
    proximal snapshot or not), the snapshot, their sum and one optimizer update."""
    rep, trained_sh = self._rep, self._trained_shardings
    # Gradients live like the trained params; metrics and the row count replicated.
    grads_sh = (trained_sh, rep)
    in_sh = (self.param_shardings, self._data_sh, rep, rep)
    # (functools.partial keeps the module functions' names: the programs' names in a profile)
    self._micro_grads_jit = jax.jit(functools.partial(micro_grads, self), in_shardings=in_sh,
                                    out_shardings=grads_sh)
    self._micro_grads_proximal_jit = jax.jit(
        functools.partial(micro_grads_proximal, self), in_shardings=in_sh + (trained_sh,),
        out_shardings=grads_sh)
    self._snapshot_jit = jax.jit(functools.partial(snapshot, self),
                                 in_shardings=(self.param_shardings,), out_shardings=trained_sh)
    self._add_jit = jax.jit(self._add, in_shardings=(grads_sh, trained_sh, rep),
                            out_shardings=grads_sh, donate_argnums=0)
    # (bump_version traced, not static: one program for every step of an update)
    self._apply_jit = jax.jit(self._apply, in_shardings=(self._ppo_state_sh, grads_sh, rep),
                              out_shardings=(self._ppo_state_sh, rep), donate_argnums=0)

  def state_shardings(self, abstract_state: TrainState):
    """Shardings of a train state (arrays or ``ShapeDtypeStruct``s), same tree.

    Params take their logical shardings, and every optimizer-state subtree that
    mirrors the trained params (Adam's ``mu``, ``nu``; BC's trained subtree or RL's)
    takes theirs; step, counts and PRNG key are replicated.
    """
    rep = sharding_lib.replicated(self.mesh)
    trained = lambda t: (t.select(self._abstract_params), t.select(self.param_shardings))
    return abstract_state.replace(
        step=rep, rng=rep,
        params=sharding_lib.mirror_shardings(abstract_state.params, self._abstract_params,
                                             self.param_shardings, rep),
        opt_state=sharding_lib.mirror_shardings(abstract_state.opt_state,
                                                *trained(self.trainable), rep,
                                                trained(self.rl_trainable)))

  def shard_state(self, state: TrainState) -> TrainState:
    """``state`` placed on :meth:`state_shardings` (what ``bc_step`` / ``update`` take)."""
    return distributed.device_put(state, self.state_shardings(state))

  @staticmethod
  def _placed(tree, shardings):
    """``tree`` on ``shardings`` (a no-op for arrays already there).

    An array's type includes its mesh, so a state not yet on the learner's mesh (a
    fresh ``init_state``) would otherwise compile every entry point twice: once for
    it and once for the on-mesh state the step returns.
    """
    return distributed.device_put(tree, shardings)

  def _check_batch(self, n: int, what: str, key: str) -> None:
    """``n``: this process's share; the mesh splits ``n * num_processes`` rows."""
    local_shards = self.batch_shards // self.num_processes
    if n % local_shards:
      where = (f"the {self.batch_shards} batch shards of the learner mesh "
               f"{dict(self.mesh.shape)}")
      if self.num_processes > 1:
        where = f"this process's {local_shards} of {where} ({self.num_processes} processes)"
      raise ValueError(f"{what} {n} is not divisible by {where}; adjust {key} or config.mesh")

  def _to_global(self, data, what: str):
    """This process's RL batch -> the global batch (checked against the batch shards)."""
    if not isinstance(data, self.objective.data_type):
      raise TypeError(f"config.algorithm={self.algorithm!r} trains on "
                      f"{self.objective.data_type.__name__}, got {type(data).__name__}")
    self._check_batch(data.log_prob.shape[1], what,
                      "config.num_envs or config.pipeline.micro_batch_segments")
    return distributed.to_global(data, self._data_sh)

  # --------------------------------------------------------------------- BC --
  def bc_step(self, state: TrainState, batch: dict, actions,
              mask=None) -> tuple[TrainState, jax.Array]:
    """One supervised step on this process's expert chunks ``actions [N, H, A]``;
    ``mask [N, H]`` (bool, default all True) marks the real actions of each chunk."""
    self._check_batch(actions.shape[0], "BC batch size", "config.bc.batch_size")
    if mask is None:
      mask = np.ones(actions.shape[:2], bool)
    batch, actions, mask = distributed.to_global((batch, actions, mask), self._rows_sh)
    return self.bc_step_jit(self._placed(state, self._bc_state_sh), batch, actions, mask)

  def _bc_step(self, state: TrainState, batch: dict, actions: jax.Array,
               mask: jax.Array) -> tuple[TrainState, jax.Array]:
    rng, key = jax.random.split(state.rng)
    trained = self.trainable.select(state.params)
    loss, grads = jax.value_and_grad(
        lambda sub: self.policy.bc_loss(self.trainable.merge(state.params, sub), batch, actions,
                                        key, mask))(trained)
    trained, opt_state, code, _ = update_lib.guarded_step(
        self.bc_tx, grads, state.opt_state, trained, loss, optax.tree.norm(grads))
    nonfinite = (code | update_lib.params_code(trained)).astype(jnp.float32)
    new = state.replace(step=state.step + 1, params=self.trainable.merge(state.params, trained),
                        opt_state=opt_state, rng=rng)
    return new, dict(loss=loss, nonfinite=nonfinite)

  # --------------------------------------------------------------------- RL --
  def update(self, state: TrainState, data) -> tuple[TrainState, dict]:
    """One RL update on this process's batch (PPO: ``Trajectory [T, B]``; GRPO:
    ``EpisodeBatch [K, E]``); ``state.step`` (the policy version) grows by 1."""
    rows = data.num_rows
    nm = self.ppo_config.num_minibatches
    if rows % nm == 0:  # (else the update raises, naming rl.num_minibatches)
      self._check_batch(rows // nm, "RL minibatch size (rows)", "config.rl.num_minibatches")
    return self.update_jit(self._placed(state, self._ppo_state_sh),
                           self._to_global(data, "RL batch envs / episodes"))

  def _update(self, state: TrainState, data) -> tuple[TrainState, dict]:
    rng, key = jax.random.split(state.rng)
    constrain = lambda x: sharding_lib.with_logical_constraint(x, (None, "batch"), self.rules,
                                                               self.mesh)
    params, opt_state, metrics = update_lib.epochs_update(
        self.objective, self.ppo_tx, self.ppo_config, state.params, state.opt_state, data, key,
        constrain, version=state.step, trainable=self.rl_trainable,
        behaviour_is_proximal=self.behaviour_is_proximal)
    # (epochs_update's steps are guarded: its ``nonfinite`` metric says which failed.)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
    return new, metrics

  # --------------------------------------------------------------- streamed --
  @property
  def streamed_proximal(self) -> bool:
    """Whether a streamed update must keep :meth:`snapshot` of the params it starts from
    for its later minibatches (``update.uses_proximal_snapshot``)."""
    return update_lib.uses_proximal_snapshot(self.ppo_config)

  def snapshot(self, params):
    """A copy of the trained subtree of ``params`` (the frozen rest never changes), kept
    across the optimizer steps of a streamed update, which donate ``params``; its
    floating leaves in ``config.pipeline.rollout_dtype`` when that is set (a bfloat16
    rollout: the proximal policy's weights rounded as the behaviour policy's are)."""
    return self._snapshot_jit(self._placed(params, self.param_shardings))

  def micro_grads(self, params, data, total_rows: int, version: int = 0, proximal=None):
    """Streamer: ``(grads, metrics)`` of micro-batch ``data`` in an optimizer update of
    ``total_rows`` rows (chunks for PPO, episodes for GRPO); add them with
    :meth:`accumulate`. ``version``: the learner's policy version (for the staleness
    diagnostics). ``proximal``: :meth:`snapshot` of the params the update started
    from, for micro-batches after its first optimizer step (None before).

    Multi-process: ``data`` and ``total_rows`` are this process's; the micro-batch
    is every process's ``data`` together.
    """
    data = self._to_global(data, "streamed micro-batch envs / episodes")
    args = (self._placed(params, self.param_shardings), data,
            jnp.float32(total_rows * self.num_processes), jnp.int32(version))
    if proximal is None:
      return self._micro_grads_jit(*args)
    return self._micro_grads_proximal_jit(*args, proximal)

  def _add(self, acc, grads, metrics):
    """Accumulates ``(grads, metrics)`` into ``acc`` (donated)."""
    return jax.tree.map(jnp.add, acc, (grads, metrics))

  def accumulate(self, acc, grads_metrics):
    """``acc + grads_metrics`` (``acc`` None: the first micro-batch)."""
    if acc is None:
      return grads_metrics
    return self._add_jit(acc, *grads_metrics)

  # The accumulated metrics ``_apply`` reads: the loss (for the guard) and what
  # ``rl.step_scale`` reads. Only these enter its program, so one program serves every
  # minibatch (a later minibatch's metrics carry the proximal pass's diagnostics too).
  _APPLY_READS = ("loss",) + ppo.STEP_SCALE_READS

  def _apply(self, state: TrainState, acc, bump_version: jax.Array
             ) -> tuple[TrainState, dict]:
    grads, metrics = acc
    trained = self.rl_trainable.select(state.params)
    out = update_lib.grad_norms(grads)
    scale = ppo.step_scale(self.ppo_config.step_scale, metrics)
    trained, opt_state, code, _ = update_lib.guarded_step(
        self.ppo_tx, grads, state.opt_state, trained, metrics["loss"], out["grad_norm"], scale)
    nonfinite = code | update_lib.params_code(trained)
    step = state.step + bump_version.astype(state.step.dtype)
    new = state.replace(step=step, params=self.rl_trainable.merge(state.params, trained),
                        opt_state=opt_state)
    return new, dict(out, skipped=jnp.zeros(()), step_scale=scale,
                     nonfinite=nonfinite.astype(jnp.float32))

  def apply(self, state: TrainState, acc, bump_version: bool = True):
    """Applies accumulated micro-batch gradients: one optimizer update
    (``bump_version``: it ends the RL batch, the policy version grows by 1).

    Returns ``(state, metrics)``: the accumulated metrics with ``grad_norm``,
    ``skipped``, ``step_scale`` and ``nonfinite`` added.
    """
    grads, metrics = acc
    read = {k: metrics[k] for k in self._APPLY_READS if k in metrics}
    state, out = self._apply_jit(self._placed(state, self._ppo_state_sh), (grads, read),
                                 jnp.asarray(bump_version, bool))
    return state, dict(metrics, **out)

  def streamed_update(self, state: TrainState, items: Iterable[types.Item], num_items: int,
                      busy: Callable[[], ContextManager] = contextlib.nullcontext
                      ) -> tuple[TrainState, dict]:
    """L3's update: each item's gradient as it arrives, one optimizer step per minibatch
    of items; the policy version grows by 1 at the last.

    ``items`` yields the update's ``num_items`` items (lazily: the next is only asked for
    once the previous one's gradient is taken), ``rl.num_minibatches`` of them per
    optimizer step. With several minibatches and a proximal pass
    (:attr:`streamed_proximal`), the params the update starts from are kept (their trained
    subtree) and the later minibatches are evaluated under them, so PPO's clip acts
    around the proximal policy from the second step on, as in :meth:`update`.
    ``busy()`` wraps the learner's compute (not the waits for items), for the caller's
    stage clock.

    Returns ``(state, metrics)``: the metrics averaged over the minibatches (the
    spreads those of the whole update, ``objectives.spreads``), ``nonfinite`` any
    minibatch's.
    """
    version = int(state.step)
    num_minibatches = self.ppo_config.num_minibatches
    per_minibatch = num_items // num_minibatches
    acc, sums = None, collections.defaultdict(float)
    start = self.snapshot(state.params) if self.streamed_proximal else None
    for j, item in enumerate(items):
      with busy():
        # Items are alike, so the minibatch's rows are known from its first.
        grads = self.micro_grads(state.params, item.data, per_minibatch * item.data.num_rows,
                                 version, proximal=start if j >= per_minibatch else None)
        acc = self.accumulate(acc, grads)
        if (j + 1) % per_minibatch == 0:
          state, metrics = self.apply(state, acc, bump_version=j + 1 == num_items)
          acc = None
          for k, v in jax.device_get(metrics).items():
            if k == "nonfinite":  # Bits: any minibatch's failure is the update's.
              sums[k] = float(int(sums[k]) | int(v))
            else:
              sums[k] += float(v) / num_minibatches
    return state, {k: float(v) for k, v in objectives_lib.spreads(sums).items()}
