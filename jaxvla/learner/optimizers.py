"""The learner's optimizers and step-size schedules, from the run config.

Owns: the warm start's step size (``bc.lr_schedule``: :func:`bc_learning_rate`), the
RL budget's optimizer steps and the actor's decay over them (``rl.lr_schedule``:
:func:`rl_optimizer_steps`, :func:`rl_decay_steps`), and the optax chain both phases
train with (:func:`make_optimizer`: global-norm clipping, then Adam, with the critic's
own Adam when ``ppo.value_*`` ask for it). :func:`bc_optimizer` and :func:`rl_optimizer`
are the two optimizers :class:`jaxvla.learner.learner.Learner` builds from a config.

The RL budget's step count is the algorithm's rule
(:attr:`jaxvla.learner.algorithm.Algorithm.optimizer_steps`); the schedules' own
checks raise naming their keys, and :mod:`jaxvla.config_checks` calls them to check a
config before any work starts.
"""

from __future__ import annotations

import jax
import ml_collections
import optax

from jaxvla.learner import algorithm as algorithm_lib
from jaxvla.learner import trainable as trainable_lib
from jaxvla.models import contract


BC_SCHEDULES = ("constant", "cosine")
BC_COSINE_FLOOR = 0.1  # 'cosine' ends at this fraction of bc.learning_rate


def bc_learning_rate(bc_config: ml_collections.ConfigDict) -> float | optax.Schedule:
  """The warm start's step size: ``bc.learning_rate`` throughout ('constant'), or decayed
  along a cosine to :data:`BC_COSINE_FLOOR` of it at ``bc.num_steps`` ('cosine').

  Raises:
    ValueError: naming ``config.bc.lr_schedule`` if it is not one of :data:`BC_SCHEDULES`.
  """
  if bc_config.lr_schedule not in BC_SCHEDULES:
    raise ValueError(f"config.bc.lr_schedule must be one of {BC_SCHEDULES}, got "
                     f"{bc_config.lr_schedule!r}")
  if bc_config.lr_schedule == "constant" or bc_config.num_steps < 1:
    return bc_config.learning_rate
  return optax.cosine_decay_schedule(bc_config.learning_rate, bc_config.num_steps,
                                     alpha=BC_COSINE_FLOOR)


CRITIC_PREFIX = "rl/value_"  # the value head's parameters (every policy family's)
# The steering head's state estimator (jaxvla.models.pi0.estimate_state) trains with the
# critic's Adam: a regression on the critic state, as the value head's, which the actor's
# loss does not reach (the head reads its output without a gradient).
ESTIMATOR_PREFIX = "rl/estimator/"
RL_SCHEDULES = ("constant", "linear")


def rl_optimizer_steps(config: ml_collections.ConfigDict, num_processes: int = 1
                       ) -> int | None:
  """The optimizer steps of the RL budget, by ``config.algorithm``'s rule
  (:attr:`jaxvla.learner.algorithm.Algorithm.optimizer_steps`; PPO's:
  :func:`jaxvla.learner.algorithm.ppo_optimizer_steps`); None for an algorithm whose
  count is not known in advance (GRPO).

  Raises:
    ValueError: naming ``config.algorithm`` if it is not a known one.
  """
  rule = algorithm_lib.get(config.algorithm).optimizer_steps
  return None if rule is None else rule(config, num_processes)


def rl_decay_steps(config: ml_collections.ConfigDict, num_processes: int = 1) -> int:
  """Over how many optimizer steps the actor's RL step size falls to 0: none (0) for
  ``rl.lr_schedule='constant'``; for 'linear' the budget's steps
  (:func:`rl_optimizer_steps`) after the critic's warm-up (PPO's learning-rate annealing,
  as in Schulman et al.'s Atari and MuJoCo runs).

  Raises:
    ValueError: naming ``config.rl.lr_schedule`` if it is not one of
      :data:`RL_SCHEDULES`, or 'linear' for an algorithm without a step budget (GRPO:
      its updates take whole episodes, so the budget's step count is not known in
      advance).
  """
  schedule = config.rl.lr_schedule
  if schedule not in RL_SCHEDULES:
    raise ValueError(f"config.rl.lr_schedule must be one of {RL_SCHEDULES}, got {schedule!r}")
  if schedule == "constant":
    return 0
  algorithm = algorithm_lib.get(config.algorithm)
  if algorithm.optimizer_steps is None:
    with_budget = " or ".join(a.name.upper() for a in algorithm_lib.ALGORITHMS.values()
                              if a.optimizer_steps is not None)
    raise ValueError(f"config.rl.lr_schedule='linear' needs {with_budget}: "
                     f"{algorithm.no_step_budget}")
  return max(1, algorithm.optimizer_steps(config, num_processes)
             - config.rl.critic_warmup_steps)


def make_optimizer(learning_rate: float | optax.Schedule, max_grad_norm: float,
                   b1: float = 0.9, *, critic_learning_rate: float = 0.0,
                   critic_warmup_steps: int = 0,
                   decay_steps: int = 0) -> optax.GradientTransformation:
  """Global-norm clipping, then Adam (``b1``: its first-moment decay, the momentum).

  With ``critic_learning_rate > 0`` or ``critic_warmup_steps > 0`` (``ppo.value_*``,
  RLinf's ``value_lr`` and critic warm-up) the critic (:data:`CRITIC_PREFIX`) and the
  actor (every other trained parameter) have Adams of their own: the critic's at
  ``critic_learning_rate`` (0: ``learning_rate``), the actor's at ``learning_rate``
  after its first ``critic_warmup_steps`` optimizer steps, at 0 before them (the
  global-norm clip still sees both gradients). Without either, one Adam over all.
  With ``decay_steps > 0`` the actor's step falls
  linearly from ``learning_rate`` to 0 over that many steps after the warm-up, and
  stays at 0 beyond them (one Adam over all: the critic's falls with it).
  """
  clip = optax.clip_by_global_norm(max_grad_norm)
  actor_lr = learning_rate
  if decay_steps:
    actor_lr = optax.linear_schedule(learning_rate, 0.0, decay_steps)
  if not critic_learning_rate and not critic_warmup_steps:
    return optax.chain(clip, optax.adam(actor_lr, b1=b1))
  if critic_warmup_steps:
    after = actor_lr if decay_steps else optax.constant_schedule(learning_rate)
    actor_lr = optax.join_schedules([optax.constant_schedule(0.0), after],
                                    [critic_warmup_steps])
  critic = optax.adam(critic_learning_rate or learning_rate, b1=b1)
  return optax.chain(clip, optax.multi_transform(
      {"actor": optax.adam(actor_lr, b1=b1), "critic": critic}, _actor_critic_labels))


def _actor_critic_labels(params: contract.Params) -> contract.Params:
  """``'critic'`` for the value head's and the state estimator's leaves
  (:data:`CRITIC_PREFIX`, :data:`ESTIMATOR_PREFIX`), ``'actor'`` else."""
  return jax.tree.map(lambda c: "critic" if c else "actor", critic_leaves(params))


def critic_leaves(tree) -> contract.Params:
  """True for each leaf of the critic: a parameter under :data:`CRITIC_PREFIX` or
  :data:`ESTIMATOR_PREFIX`, or a leaf of :func:`make_optimizer`'s critic Adam state
  (``tree`` is the trained params or that optimizer's state); False for the actor's.

  With ``rl.target_kl_stops='actor'`` the KL stop keeps the actor's leaves and lets
  the critic's step on (:func:`jaxvla.learner.update.epochs_update`).
  """
  path_of = lambda path: "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
  critic = (CRITIC_PREFIX, ESTIMATOR_PREFIX)
  # (the critic Adam's state sits under optax.multi_transform's inner_states['critic'])
  def is_critic(path) -> bool:
    name = path_of(path)
    return name.startswith(critic) or "/inner_states/critic/" in f"/{name}/"

  return jax.tree_util.tree_map_with_path(lambda path, _: is_critic(path), tree)


# The two optimizers a Learner trains with. Both call make_optimizer through this
# module's global at call time, so a test that replaces ``optimizers.make_optimizer``
# (e.g. with a better-conditioned Adam) changes what the Learner builds.
def bc_optimizer(config: ml_collections.ConfigDict,
                 trainable: trainable_lib.Trainable) -> optax.GradientTransformation:
  """The warm start's optimizer over ``trainable``: :func:`bc_learning_rate`, clipped at
  ``rl.max_grad_norm``."""
  return trainable_lib.train_only(
      make_optimizer(bc_learning_rate(config.bc), config.rl.max_grad_norm), trainable)


def rl_optimizer(config: ml_collections.ConfigDict, trainable: trainable_lib.Trainable,
                 num_processes: int = 1) -> optax.GradientTransformation:
  """The RL update's optimizer over ``trainable``: ``rl.learning_rate`` (decayed over
  :func:`rl_decay_steps`), ``rl.adam_b1``, and the critic's Adam of ``ppo.value_*``.

  Raises:
    ValueError: as :func:`rl_decay_steps`.
  """
  ppo_config = config.rl
  return trainable_lib.train_only(
      make_optimizer(ppo_config.learning_rate, ppo_config.max_grad_norm,
                     b1=ppo_config.adam_b1,
                     critic_learning_rate=ppo_config.value_learning_rate,
                     critic_warmup_steps=ppo_config.critic_warmup_steps,
                     decay_steps=rl_decay_steps(config, num_processes)),
      trainable)
