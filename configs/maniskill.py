"""PPO on a ManiSkill3 task with the CPU simulator: ``--config=configs/maniskill.py[:state]``.

Variants: (none) RGB observations; ``state`` no camera (state only). Pick the
task with ``--config.env.task=StackCube-v1``. No scripted expert exists for these
tasks, so RL starts from the initial (or a loaded) policy: ``bc.num_steps = 0``.
Everything not set here is ``configs/default.py``.
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or ""
  if variant not in ("", "state"):
    raise ValueError(f"unknown variant {variant!r} of configs/maniskill.py; choose 'state'")
  c = default.get_config()
  c.total_env_steps = 20_000  # Budget: RL env steps of the whole run.
  c.num_envs = 4  # ManiSkill CPU instances.
  c.env_workers = 4  # One worker process per instance (the CPU simulator is single-env).
  c.rollout_len = 8  # Chunk steps per env per training iteration.
  c.env = ml_collections.ConfigDict()
  c.env.name = "maniskill"  # Environment: ManiSkill3, CPU simulator.
  c.env.task = "PickCube-v1"  # ManiSkill3 env id (offline tasks only, see envs/maniskill.py).
  c.env.obs_mode = "state" if variant == "state" else "rgb"  # 'rgb' or 'state'.
  c.env.control_mode = "pd_joint_delta_pos"  # 'pd_joint_delta_pos' or 'pd_ee_delta_pose'.
  c.env.image_size = 64  # Camera width and height (rgb).
  c.env.max_episode_steps = 50  # Time limit in env steps.
  c.env.reward_mode = "sparse"  # ManiSkill reward mode; 'sparse' is 1 on success.
  c.env.group_size = 1  # GRPO groups: envs i // G share each episode's init (1: no groups).
  c.model.image_size = 8 if variant == "state" else 0  # state: the 1x1 placeholder image -> one 8 px patch.
  c.model.chunk_len = 5  # Actions per chunk (ManiSkill default in the literature).
  c.pipeline.micro_batch_segments = 2  # Env segments per queue item (divides num_envs).
  c.bc.num_steps = 0  # No scripted expert for ManiSkill tasks.
  c.ppo.num_minibatches = 2  # Minibatches per pass (num_envs * rollout_len = 32 chunks).
  c.eval.num_episodes = 4  # Evaluation episodes (each a full episode on CPU).
  c.eval.every_iters = 5  # Evaluate every N iterations.
  c.checkpoint.every_iters = 5  # Save every N iterations.
  return c
