"""The RL algorithms, one record each: the one place ``config.algorithm`` is dispatched on.

Owns everything that differs between PPO and GRPO outside their objectives' maths: which
objective trains (:mod:`jaxvla.learner.objectives`), which rollout builder cuts the
queue items and how many of them one update takes (:mod:`jaxvla.rollout.segments`,
:mod:`jaxvla.rollout.groups`), how many optimizer steps the RL budget takes (what a
'linear' ``rl.lr_schedule`` decays over) and the config rules that hold for one
algorithm only. Callers ask :func:`get` for ``config.algorithm``'s :class:`Algorithm` and
read its fields: the learner (objective), :mod:`jaxvla.learner.optimizers` (steps),
:mod:`jaxvla.config_checks` (check) and the pipeline (builder).

Adding an algorithm:

1. its objective class (an :class:`jaxvla.learner.objectives.Objective`: its batch
   type's rows, their weights and the loss) in :mod:`jaxvla.learner.objectives`;
2. an :class:`Algorithm` here: ``name`` (the ``config.algorithm`` value), ``objective``
   (``(policy, config) -> Objective``), ``builder`` (``(config, spec) -> (builder,
   items_per_update)``, a :class:`jaxvla.rollout.rollout.Builder` whose items hold the
   objective's ``data_type``), ``optimizer_steps`` (the budget's step count, or None
   with ``no_step_budget`` saying why) and ``check`` (its config rules, each error naming
   its key);
3. its entry in :data:`ALGORITHMS`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import ml_collections

from jaxvla import errors
from jaxvla.algorithms import grpo
from jaxvla.envs import protocol
from jaxvla.learner import objectives
from jaxvla.models import contract
from jaxvla.rollout import groups as groups_lib
from jaxvla.rollout import rollout as rollout_lib
from jaxvla.rollout import segments as segments_lib

Config = ml_collections.ConfigDict


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """What the rest of the code asks of one RL algorithm.

  Attributes:
    name: its ``config.algorithm`` value.
    objective: ``(policy, config) -> Objective``: what its update trains on and minimises.
    builder: ``(config, spec) -> (builder, items_per_update)``: the rollout's builder of
      queue items and how many of them one update takes (per process).
    optimizer_steps: ``(config, num_processes) -> steps``: the RL budget's optimizer
      steps; None when they are not known in advance.
    no_step_budget: why ``optimizer_steps`` is None (the end of the error a 'linear'
      ``rl.lr_schedule`` raises); '' when it is not.
    check: ``config -> None``: the rules that hold for this algorithm only; raises
      ``ValueError`` naming the first offending key. Called by
      :func:`jaxvla.config_checks.validate` after the rules common to every algorithm
      (so the fields it relates are known to be valid on their own).
  """
  name: str
  objective: Callable[[contract.Policy, Config], objectives.Objective]
  builder: Callable[[Config, protocol.EnvSpec], tuple[rollout_lib.Builder, int]]
  optimizer_steps: Callable[[Config, int], int] | None
  check: Callable[[Config], None]
  no_step_budget: str = ""


_require = errors.require


def _streamed(config: Config) -> bool:
  """Whether the streamed learner (L3) runs: ``pipeline.streamer`` counts in the 'async'
  mode only, as :meth:`jaxvla.runtime.modes.Levels.from_config` reads it (the runtime
  sits above the learner, so it is read here directly)."""
  return config.pipeline.mode == "async" and config.pipeline.streamer


# ------------------------------------------------------------------------- PPO --
def _ppo_objective(policy: contract.Policy, config: Config) -> objectives.Objective:
  return objectives.PPOObjective(policy, config.rl)


def _ppo_builder(config: Config, spec: protocol.EnvSpec
                 ) -> tuple[rollout_lib.Builder, int]:
  """Segments of ``rollout_len`` chunks, ``pipeline.micro_batch_segments`` per item."""
  del spec  # (a segment's length is rollout_len, whatever the episodes' lengths)
  m = config.pipeline.micro_batch_segments
  return (segments_lib.SegmentBuilder(config.num_envs, config.rollout_len, m),
          config.num_envs // m)


def ppo_optimizer_steps(config: Config, num_processes: int = 1) -> int:
  """PPO's budget: its updates (``total_env_steps`` over the env steps of one update,
  ``num_envs * rollout_len * chunk_len`` per process, rounded up) times
  ``rl.num_epochs * rl.num_minibatches``. An update that ``rl.target_kl`` cuts short
  takes fewer, so a run can end a little before this count.
  """
  per_update = num_processes * config.num_envs * config.rollout_len * config.model.chunk_len
  updates = -(-config.total_env_steps // per_update)
  return updates * config.rl.num_epochs * config.rl.num_minibatches


def _check_ppo(config: Config) -> None:
  nm = config.rl.num_minibatches
  if _streamed(config):
    items = config.num_envs // config.pipeline.micro_batch_segments
    _require(items % nm == 0, "rl.num_minibatches",
             f"the streamer's minibatches are groups of queue items: num_envs / "
             f"micro_batch_segments = {items} items must divide into {nm}")


PPO = Algorithm(name="ppo", objective=_ppo_objective, builder=_ppo_builder,
                optimizer_steps=ppo_optimizer_steps, check=_check_ppo)


# ------------------------------------------------------------------------ GRPO --
def _grpo_objective(policy: contract.Policy, config: Config) -> objectives.Objective:
  return objectives.GRPOObjective(policy, config.rl, config.grpo.loss_normalizer)


def _grpo_builder(config: Config, spec: protocol.EnvSpec
                  ) -> tuple[rollout_lib.Builder, int]:
  """One item per group of ``env.group_size`` whole episodes (padded to the longest an
  episode of ``spec.max_episode_steps`` can be)."""
  g = config.env.group_size
  max_chunks = groups_lib.max_chunks_per_episode(spec.max_episode_steps,
                                                 config.model.chunk_len)
  return (groups_lib.EpisodeBuilder(config.num_envs, g, max_chunks, scale=config.grpo.scale),
          config.num_envs // g)


def _check_grpo(config: Config) -> None:
  g, nm = config.env.group_size, config.rl.num_minibatches
  _require(g >= 2, "env.group_size", f"GRPO compares G >= 2 episodes per group, got {g}")
  streamed = _streamed(config)
  grpo.check_normalizer(config.grpo.loss_normalizer, streamed=streamed)
  groups = config.num_envs // g
  _require(groups % nm == 0 if streamed else config.num_envs % nm == 0,
           "rl.num_minibatches",
           f"must divide the update's {groups} groups (streamer) / {config.num_envs} episodes")
  _require(config.rl.value_targets == "rollout", "rl.value_targets",
           "'learner' and 'vtrace' recompute the advantages from the critic; GRPO has none "
           "(leave it 'rollout')")
  _require(not config.rl.kl_detail_rows, "rl.kl_detail_rows",
           "scores PPO's chunk rows; GRPO's rows are whole episodes (set it to 0)")


GRPO = Algorithm(name="grpo", objective=_grpo_objective, builder=_grpo_builder,
                 optimizer_steps=None, check=_check_grpo,
                 no_step_budget="a GRPO update takes whole episodes, so the budget's "
                                "optimizer steps are not known in advance")


# -------------------------------------------------------------------- registry --
ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (PPO, GRPO)}


def get(name: str) -> Algorithm:
  """The record of ``config.algorithm`` = ``name``.

  Raises:
    ValueError: naming ``config.algorithm`` and the choices if ``name`` is none of them.
  """
  if name not in ALGORITHMS:
    raise ValueError(f"config.algorithm: must be {' or '.join(map(repr, ALGORITHMS))}, "
                     f"got {name!r}")
  return ALGORITHMS[name]
