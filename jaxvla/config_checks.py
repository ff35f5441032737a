"""Checks of a whole config before any work starts; each error names the offending key.

Rules that belong to one module are checked by that module's own function, which
this file calls (one owner per rule): mesh sizes and rules
(:func:`jaxvla.parallel.sharding.check_mesh_config`), GRPO groups
(:func:`jaxvla.envs.protocol.group_layout`), the algorithm and the rules that hold for
it alone (its record's ``check``: :mod:`jaxvla.learner.algorithm`, e.g. the GRPO loss
normaliser), the optimizer schedules (:mod:`jaxvla.learner.optimizers`), the pipeline mode
(:meth:`jaxvla.runtime.modes.Levels.from_config`), ``config.distributed``
(:func:`jaxvla.parallel.distributed.validate`), ``config.data``
(:func:`jaxvla.data.config.validate`), ``config.model.lora*``
(:func:`jaxvla.models.lora.check_config`), the samplers
(:func:`jaxvla.models.denoise.check_samplers`) and ManiSkill3's tasks and pixel state
(:func:`jaxvla.envs.maniskill.check_config`). The rest are relations between fields.
"""

import ml_collections

from jaxvla import defaults, errors
from jaxvla.algorithms import ppo
from jaxvla.data import config as data_config
from jaxvla.envs import maniskill, protocol
from jaxvla.learner import algorithm as algorithm_lib
from jaxvla.learner import optimizers
from jaxvla.models import denoise, lora
from jaxvla.parallel import distributed, sharding
from jaxvla.runtime import modes

# The PPO settings the streamer needs (the checks below): one pass over each batch, no
# minibatch advantage statistics, no KL early stop. Configs and benchmarks that turn the
# streamer on apply them with ``c.rl.update(STREAMER_PPO)``.
STREAMER_PPO = dict(num_epochs=1, advantage_norm="none", target_kl=0.0)


_require = errors.require


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises ``ValueError`` naming the first inconsistent field of ``c``."""
  defaults.check_moved_keys(c)
  _require(c.total_env_steps >= 0, "total_env_steps", f"must be >= 0, got {c.total_env_steps}")
  _require(c.num_envs >= 1, "num_envs", f"must be >= 1, got {c.num_envs}")
  _require(c.env_workers >= 0 and (c.env_workers == 0 or c.num_envs % c.env_workers == 0),
           "env_workers", f"must be >= 0 and divide num_envs={c.num_envs}, got {c.env_workers}")
  _require(c.env_step_timeout_s > 0, "env_step_timeout_s", "must be > 0")
  _require(0 < c.env_hang_floor_s <= c.env_step_timeout_s, "env_hang_floor_s",
           f"must be in (0, env_step_timeout_s={c.env_step_timeout_s}]")
  _require(c.rollout_len >= 1, "rollout_len", f"must be >= 1, got {c.rollout_len}")
  _require(1 <= c.model.chunk_len <= c.env.max_episode_steps, "model.chunk_len",
           f"must be in [1, env.max_episode_steps={c.env.max_episode_steps}], "
           f"got {c.model.chunk_len}")
  _require(c.model.num_denoise_steps >= 1, "model.num_denoise_steps",
           f"must be >= 1, got {c.model.num_denoise_steps}")
  denoise.check_samplers(c.model)
  _require(0 < c.model.noise_std_min < c.model.noise_std_max, "model.noise_std_min",
           "need 0 < noise_std_min < noise_std_max")
  _require(c.model.noise_level > 0, "model.noise_level", f"must be > 0, got {c.model.noise_level}")
  n = c.num_envs * c.rollout_len
  _require(n % c.rl.num_minibatches == 0, "rl.num_minibatches",
           f"must divide num_envs * rollout_len = {n}")
  _require(0 < c.rl.gamma <= 1, "rl.gamma", f"must be in (0, 1], got {c.rl.gamma}")
  _require(0 <= c.rl.gae_lambda <= 1, "rl.gae_lambda", f"must be in [0, 1], got {c.rl.gae_lambda}")
  _require(c.rl.clip_eps > 0, "rl.clip_eps", f"must be > 0, got {c.rl.clip_eps}")
  _require(c.rl.max_bad_updates >= 1, "rl.max_bad_updates",
           f"must be >= 1, got {c.rl.max_bad_updates}")
  _require(c.bc.num_steps >= 0, "bc.num_steps", f"must be >= 0, got {c.bc.num_steps}")
  optimizers.bc_learning_rate(c.bc)  # (the owner of the bc.lr_schedule check; raises naming it)
  optimizers.rl_decay_steps(c)  # (the owner of the rl.lr_schedule check; raises naming it)
  _require(c.bc.num_steps == 0 or c.bc.num_episodes >= 1, "bc.num_episodes",
           "must be >= 1 when bc.num_steps > 0")
  _require(c.eval.every_iters >= 1, "eval.every_iters", "must be >= 1")
  _require(c.eval.num_episodes >= 1, "eval.num_episodes", "must be >= 1")
  _require(c.eval.env_workers >= 0 and (c.eval.env_workers == 0
                                        or c.eval.num_episodes % c.eval.env_workers == 0),
           "eval.env_workers", f"must be >= 0 and divide eval.num_episodes="
           f"{c.eval.num_episodes}, got {c.eval.env_workers}")
  _require(c.checkpoint.every_iters >= 1, "checkpoint.every_iters", "must be >= 1")
  _require(c.checkpoint.max_to_keep >= 1, "checkpoint.max_to_keep",
           f"must be >= 1, got {c.checkpoint.max_to_keep}")
  _require(not (c.model.name == "pi0" and c.model.value_source == "prefix"
                and c.env.get("obs_mode") == "state"), "model.value_source",
           "'prefix' cannot see the state of a state-only env: pi0 reads the state in its "
           "action expert, and the prefix holds only a placeholder image and the instruction; "
           "use 'expert'")
  _require(not c.model.init_checkpoint or c.model.name in ("pi0", "pi05", "pi0_fast"),
           "model.init_checkpoint", f"openpi checkpoints hold pi0 / pi0.5 / pi0-FAST trees; "
           f"model.name={c.model.name!r} cannot load {c.model.init_checkpoint!r}")
  lora.check_config(c.model)
  if c.env.name == "maniskill":
    maniskill.check_config(c.env)
  _require(not c.env.get("critic_state_dim", 0) or c.model.name in ("pi0", "pi05"),
           "env.critic_state_dim", f"the critic state is read by the flow VLAs' value head "
           f"(pi0, pi05), not model.name={c.model.name!r}'s")
  protocol.group_layout(c.env.group_size, c.num_envs)
  sharding.check_mesh_config(c.mesh)
  _validate_pipeline(c)
  distributed.validate(c.distributed)
  data_config.validate(c.data)
  _require(c.data.action_horizon in (0, c.model.chunk_len), "data.action_horizon",
           f"BC trains on chunks of model.chunk_len={c.model.chunk_len} actions; set 0 or "
           f"{c.model.chunk_len}, got {c.data.action_horizon}")


def validate_batch_shards(c: ml_collections.ConfigDict, batch_shards: int,
                          num_processes: int = 1) -> None:
  """Batch sizes the learner mesh splits ``batch_shards`` ways must divide evenly.

  Called once the mesh exists (its size depends on the devices, not the config alone).
  With ``num_processes > 1`` each process owns ``batch_shards / num_processes`` of
  the shards and feeds them from its own ``num_envs`` envs; ``bc.batch_size`` is
  the global batch, split evenly over the processes.
  """
  where = f"the {batch_shards} batch shards of config.mesh (data x fsdp)"
  _require(batch_shards % num_processes == 0, "mesh",
           f"{where} cannot be shared evenly by {num_processes} processes")
  local = batch_shards // num_processes
  if num_processes > 1:
    where = (f"the {local} batch shards of each of the {num_processes} processes "
             f"(config.mesh: data x fsdp = {batch_shards})")
  _require(c.num_envs % local == 0, "num_envs",
           f"{c.num_envs} is not divisible by {where}")
  mb = c.num_envs * c.rollout_len // c.rl.num_minibatches
  _require(mb % local == 0, "rl.num_minibatches",
           f"minibatches of num_envs * rollout_len / num_minibatches = {mb} chunks are not "
           f"divisible by {where}")
  _require(c.bc.num_steps == 0 or c.bc.batch_size % batch_shards == 0, "bc.batch_size",
           f"{c.bc.batch_size} is not divisible by the {batch_shards} batch shards of "
           "config.mesh (data x fsdp)")


def _validate_pipeline(c: ml_collections.ConfigDict) -> None:
  """``config.pipeline``, the ``rl`` fields it interacts with, and ``config.algorithm``
  with its record's own rules (:attr:`jaxvla.learner.algorithm.Algorithm.check`)."""
  p = c.pipeline
  modes.Levels.from_config(p)
  _require(p.staleness_control in ("drop", "pace"), "pipeline.staleness_control",
           f"must be 'drop' or 'pace', got {p.staleness_control!r}")
  _require(p.max_staleness >= 0, "pipeline.max_staleness", f"must be >= 0, got {p.max_staleness}")
  _require(p.queue_items >= 1, "pipeline.queue_items", f"must be >= 1, got {p.queue_items}")
  m = p.micro_batch_segments
  _require(m >= 1 and c.num_envs % m == 0, "pipeline.micro_batch_segments",
           f"must be >= 1 and divide num_envs={c.num_envs}, got {m}")
  _require(p.b_max >= 0 and p.b_max <= c.num_envs, "pipeline.b_max",
           f"must be in [0, num_envs={c.num_envs}] (0: half the envs), got {p.b_max}")
  _require(p.t_max_ms >= 0, "pipeline.t_max_ms", f"must be >= 0, got {p.t_max_ms}")
  _require(1 <= p.min_bucket <= c.num_envs, "pipeline.min_bucket",
           f"must be in [1, num_envs={c.num_envs}], got {p.min_bucket}")
  _require(p.rollout_dtype in ("", "float32", "bfloat16", "float16"), "pipeline.rollout_dtype",
           f"must be '', 'float32', 'bfloat16' or 'float16', got {p.rollout_dtype!r}")
  _require(not p.rollout_dtype or p.mode != "sync_colocated", "pipeline.rollout_dtype",
           "sync_colocated rolls out with the learner's own params (no copy to cast); "
           "leave it '' or use pipeline.mode='sync_disaggregated' / 'async'")
  _require(p.mode != "sync_colocated" or not c.mesh.rollout_devices, "mesh.rollout_devices",
           "sync_colocated runs rollout on the learner's devices; leave it '' or use "
           "pipeline.mode='sync_disaggregated' / 'async'")
  on = p.mode == "async"
  algorithm = algorithm_lib.get(c.algorithm)  # (raises naming config.algorithm)
  _require(not (on and p.rollout_async) or c.env_workers > 0, "pipeline.rollout_async",
           "first-ready env batching needs the env pool: set env_workers > 0 (or "
           "pipeline.rollout_async=False)")
  _require(c.rl.correction in ppo.CORRECTIONS, "rl.correction",
           f"must be one of {ppo.CORRECTIONS}, got {c.rl.correction!r}")
  _require(c.rl.correction != "truncated_is" or c.rl.is_clip > 0, "rl.is_clip",
           "truncated_is needs is_clip > 0")
  ppo.check_ratio(c.rl.ratio)  # (the owner of the rl.ratio check; raises naming it)
  ppo.step_scale(c.rl.step_scale, dict(is_weight=1.0, is_weight_sq=1.0, lag=0.0))  # (likewise)
  ppo.check_behaviour_clip(c.rl.behaviour_clip)  # (likewise)
  ppo.check_value_loss(c.rl.value_loss, c.rl.huber_delta, c.rl.value_clip)  # (likewise)
  ppo.check_is_clip_mode(c.rl.is_clip_mode)  # (likewise)
  _require(c.rl.value_learning_rate >= 0, "rl.value_learning_rate",
           f"must be >= 0 (0: rl.learning_rate), got {c.rl.value_learning_rate}")
  _require(c.rl.critic_warmup_steps >= 0, "rl.critic_warmup_steps",
           f"must be >= 0, got {c.rl.critic_warmup_steps}")
  _require(c.rl.target_kl_stops in ("update", "actor"), "rl.target_kl_stops",
           f"must be 'update' or 'actor', got {c.rl.target_kl_stops!r}")
  _require(c.rl.target_kl_stops == "update" or c.rl.value_learning_rate > 0
           or c.rl.critic_warmup_steps > 0, "rl.target_kl_stops",
           "'actor' keeps the critic's steps after the KL stop, which needs the critic's own "
           "Adam: set rl.value_learning_rate (or rl.critic_warmup_steps)")
  _require(0.0 <= c.rl.adam_b1 < 1.0, "rl.adam_b1", f"must be in [0, 1), got {c.rl.adam_b1}")
  _require(c.rl.value_targets in ("rollout", "learner", "vtrace"), "rl.value_targets",
           f"must be 'rollout', 'learner' or 'vtrace', got {c.rl.value_targets!r}")
  _require(c.rl.advantage_norm in ("minibatch", "none"), "rl.advantage_norm",
           f"must be 'minibatch' or 'none', got {c.rl.advantage_norm!r}")
  r = c.rl.kl_detail_rows
  _require(0 <= r <= c.num_envs * c.rollout_len, "rl.kl_detail_rows",
           f"must be in [0, num_envs * rollout_len = {c.num_envs * c.rollout_len}], got {r}")
  if r:
    _require(c.model.name in ("pi0", "pi05") and c.model.train_sampler in denoise.GAUSSIAN,
             "rl.kl_detail_rows", f"scores a flow's Gaussian steps ({denoise.GAUSSIAN} train "
             f"samplers); model {c.model.name!r} with train_sampler "
             f"{c.model.train_sampler!r} has none (set it to 0)")
    _require(not (on and p.streamer), "rl.kl_detail_rows",
             "the streamed learner never holds a whole update's rows (set it to 0)")
  if on and p.streamer:
    _require(c.rl.num_epochs == STREAMER_PPO["num_epochs"], "rl.num_epochs",
             "the streamer makes one pass over each batch as it arrives: set rl.num_epochs=1")
    _require(c.rl.advantage_norm == STREAMER_PPO["advantage_norm"], "rl.advantage_norm",
             "minibatch statistics are not known until the last micro-batch arrives; the "
             "streamer needs advantage_norm='none'")
    _require(c.rl.target_kl == STREAMER_PPO["target_kl"], "rl.target_kl", "the streamer does not support target_kl")
  # The algorithm's own rules come last: they relate fields the rules above have checked
  # alone (rl.value_targets, rl.kl_detail_rows, the streamer's settings).
  algorithm.check(c)
