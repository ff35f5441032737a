"""ManiSkill3 tasks on the CPU simulator: ``--config=configs/maniskill.py[:VARIANT]``.

Variants:
  (none)  PPO from the initial (or a loaded) policy, RGB observations; no warm start.
  state   the same with state observations only (no camera).
  sft_rl  the SFT -> RL recipe: ManiSkill3's motion planner records 100 successful
          demonstrations (``jaxvla.data.collect``'s planner demonstrator), the policy is
          behaviour-cloned on them (state and actions z-scored with the dataset's
          statistics), then PPO on a residual head over the frozen SFT flow with the
          shaped success reward for 2M env steps (docs/results/maniskill.md).
          State observations: the task's state (joint positions and velocities, TCP, cube
          and goal poses) holds what a camera would show; the camera recipes are
          ``vision_*`` below (their throughput: docs/results/envs.md).
  sft_rl_short  the same recipe shortened to about 5 minutes on 2 cores: PushCube-v1
          from 20 demonstrations, then 80k RL env steps at a 3x larger step.
  flow_rl, flow_rl_short  ``sft_rl`` / ``sft_rl_short`` with RL on the flow's own
          weights: piRL's flow-noise (``pirl_noise`` below) with PPO's clip on each
          action term's summed chain log-prob (``model.log_prob_steps = "sum"``, where
          piRL takes the mean), the whole-flow method whose gain varies least over
          seeds (docs/results/maniskill.md). ``flow_rl_short`` runs 160k RL env steps,
          about 8 minutes on 2 cores. (The learning step's ManiSkill3 run is
          ``sft_rl_short`` at 320k env steps: tests/test_learning.py.)
  vision_rl, vision_rl_short  ``sft_rl`` / ``sft_rl_short`` from the camera: 64 px RGB
          (rendered once per chunk, the Panda drawn with decimated meshes), the
          demonstrations' images, SFT of the tiny pi0 with its vision tower, then RL.
          The state is ManiSkill's rgb-mode one (joint positions and velocities, the TCP
          pose, PickCube's goal and grasp flag): never the cube's pose, which the policy
          must find in the image (a config check refuses a state that holds it). The
          critic alone also reads the simulation state, z-scored by the demonstrations'
          statistics. RL by the ``latent`` head (DSRL, below) with PPO's KL early stop at
          0.01 (``vision_rl_short,residual`` for the residual head); either head reads
          the pixel state estimator (``model.steer_state_estimator``).
          ``vision_rl_short`` (PushCube): the Panda's wrist camera alone
          (``panda_wristcam``, ``env.cameras = "hand_camera"``), 20 demonstrations, 300k
          RL env steps; ``vision_rl`` (PickCube): 300 demonstrations, 1M RL env steps, and
          the Panda's wrist camera beside the fixed one.
  vision_multitask  PushCube-v1, PickCube-v1 and StackCube-v1 in one env pool and one
          policy: the same robot and cameras (the Panda's fixed and wrist ones), one state
          layout (a missing goal padded with zeros); only the instruction and the pixels
          tell the tasks apart.

The RL method of ``sft_rl`` / ``sft_rl_short`` and the vision variants (``VARIANT,METHOD``, e.g.
``sft_rl_short,pirl_sde``; docs/results/maniskill.md, "Methods"), every one from the same SFT:
  residual    a Gaussian residual head over the frozen flow (the default).
  latent      DSRL: a head that draws the frozen flow's initial noise.
  flow_sde    the whole flow through its 4-step SDE chain (every step stochastic,
              the joint log-prob of 4 x 5 x 8 Gaussians).
  pirl_sde    piRL's flow-SDE (RLinf): one random denoise step per sample is the SDE's,
              the log-prob that step's, token-level (per action dim) ratios, a detached
              critic with its own step size, value clip 0.2 and the Huber loss.
  pirl_noise  piRL's flow-noise: every step stochastic with a learned std in [0.08,
              0.16], the log-prob the mean over the chain's densities, the same critic.
  grpo        GRPO on pirl_sde's sampler: groups of 8 envs share an episode's start.
  fast        the policy is openpi's pi0-FAST (tiny) instead of pi0: the same demonstrations,
              its own SFT (next-token BC on FAST tokens fitted to them, openpi's quantile
              normalisation), then PPO on the whole model over the emitted tokens. From
              20 demonstrations it memorises them: 0.04 success, 96% of its greedy
              chunks malformed on new cube positions (docs/results/maniskill.md).

Pick the task with ``--config.env.task=StackCube-v1`` (tasks with a planner solution:
PickCube, PushCube, StackCube, PullCube, LiftPegUpright, PlaceSphere, PegInsertionSide).
Everything not set here is the default (``jaxvla/defaults.py``).
"""

import ml_collections

from jaxvla import defaults

VARIANTS = ("", "state", "sft_rl", "sft_rl_short", "flow_rl", "flow_rl_short", "vision_rl",
            "vision_rl_short", "vision_multitask")
# The whole-flow recipes: their SFT variant and RL method.
FLOW_RL = {"flow_rl": ("sft_rl", "pirl_noise"), "flow_rl_short": ("sft_rl_short", "pirl_noise")}
# The camera recipes: the state recipe each one changes.
VISION = {"vision_rl": "sft_rl", "vision_rl_short": "sft_rl_short", "vision_multitask": "sft_rl"}
# vision_multitask's tasks: one robot and its cameras, told apart by the instruction and pixels.
MULTITASK = "PushCube-v1,PickCube-v1,StackCube-v1"
# Its state, laid out alike for every task (goal_pos and is_grasped zero where a task
# has none): ManiSkill's rgb-mode fields, never an object's pose.
MULTITASK_STATE = "qpos,qvel,tcp_pose,is_grasped,goal_pos"
# The camera recipes whose RL steers the frozen flow (the latent head by default), with
# the pixel state estimator and PPO's KL stop.
STEERED_VISION = ("vision_rl", "vision_rl_short")
METHODS = ("residual", "latent", "flow_sde", "pirl_sde", "pirl_noise", "grpo", "fast")
# The methods whose policy is another model: same demonstrations and budget, their own SFT.
OWN_SFT = ("fast",)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant, _, method = (arg or "").partition(",")
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r} of configs/maniskill.py; choose one of "
                     f"{[v for v in VARIANTS if v]}")
  if method and (variant not in ("sft_rl", "sft_rl_short", *VISION) or method not in METHODS):
    raise ValueError(f"unknown method {method!r} of configs/maniskill.py:{variant}; the "
                     f"sft_rl and vision variants take one of {METHODS}")
  flow_rl, vision = variant in FLOW_RL, variant if variant in VISION else ""
  if flow_rl:
    variant, method = FLOW_RL[variant]
  if vision:
    variant = VISION[vision]
  c = defaults.get_config()
  c.total_env_steps = 20_000  # Budget: RL env steps of the whole run.
  c.num_envs = 4  # ManiSkill CPU instances.
  c.env_workers = 4  # One worker process per instance (the CPU simulator is single-env).
  c.rollout_len = 8  # Chunk steps per env per training iteration.
  c.env = ml_collections.ConfigDict()
  c.env.name = "maniskill"  # Environment: ManiSkill3, CPU simulator.
  c.env.task = "PickCube-v1"  # ManiSkill3 env id (offline tasks only, see envs/maniskill.py).
  c.env.obs_mode = "rgb" if variant == "" else "state"  # 'rgb' or 'state'.
  # 'pd_joint_delta_pos', 'pd_ee_delta_pose' or 'pd_joint_pos' (absolute joint targets).
  c.env.control_mode = "pd_joint_delta_pos"
  c.env.image_size = 64  # Camera width and height (rgb).
  # rgb: render the cameras at every control step (True, ManiSkill's own step) or only for
  # the observations the policy reads, a chunk's last and a reset's (False: same images).
  c.env.render_every_step = False
  c.env.max_episode_steps = 50  # Time limit in env steps.
  # ManiSkill's ('sparse': 1 on success, 'normalized_dense', ...) or 'sparse_shaped' (the
  # success plus potential-based shaping by the normalised dense reward).
  c.env.reward_mode = "sparse"
  c.env.group_size = 1  # GRPO groups: envs i // G share each episode's init (1: no groups).
  # rgb: the state's fields in order, e.g. 'qpos,qvel,tcp_pose' ('': ManiSkill's own rgb
  # fields). Only rgb-mode fields (envs/maniskill.py PIXEL_STATE_FIELDS), never an object's pose.
  c.env.state_keys = ""
  c.env.robot = ""  # ManiSkill's robot_uids ('': the task's own; StackCube's has a wrist camera).
  # rgb: the cameras the policy reads, comma-separated sensor uids ('': all of the task's
  # and the robot's, e.g. 'base_camera,hand_camera' with panda_wristcam); the others are
  # never rendered.
  c.env.cameras = ""
  # rgb: the Panda drawn with decimated visual meshes ('lowpoly': 5% of the triangles, the
  # same physics, ~7x cheaper images on a CPU; envs/lowpoly.py) or ManiSkill's ('full').
  c.env.render_meshes = "lowpoly"
  # Every env's instruction ('': each task's own); e.g. the swapped-instruction control.
  c.env.instruction = ""
  # rgb: the critic alone also reads ManiSkill's simulation state (object poses included,
  # 70 values for the cube tasks), zero-padded to this size (0: none). The policy never does.
  c.env.critic_state_dim = 0
  # state: the 1x1 placeholder image -> one 8 px patch.
  c.model.image_size = 0 if c.env.obs_mode == "rgb" else 8
  if c.env.obs_mode == "state":
    # pi0 reads the state in its action expert, not in the prefix: a 'prefix' value head
    # would see only the placeholder image and the fixed instruction (a constant).
    c.model.value_source = "expert"
  c.model.chunk_len = 5  # Actions per chunk (ManiSkill default in the literature).
  c.pipeline.micro_batch_segments = 2  # Env segments per queue item (divides num_envs).
  c.bc.num_steps = 0  # No warm start (sft_rl: planner demonstrations).
  c.rl.num_minibatches = 2  # Minibatches per pass (num_envs * rollout_len = 32 chunks).
  c.eval.num_episodes = 4  # Evaluation episodes (each a full episode on CPU).
  c.eval.every_iters = 5  # Evaluate every N iterations.
  c.checkpoint.every_iters = 5  # Save every N iterations.
  if variant in ("sft_rl", "sft_rl_short"):
    c.num_envs = 16
    c.env_workers = 2  # Two cores: one worker process per core, 8 instances each.
    c.rollout_len = 10
    c.env.max_episode_steps = 100  # The planner takes 46-81 steps (about 70 on average).
    # 100 planner demonstrations: the SFT policy is clearly imperfect (~0.2 success).
    c.bc.num_episodes = 100
    c.bc.success_only = True  # Record the planner's successful episodes only.
    # Execution noise (radians on the arm's joint targets; the labels stay clean,
    # DART-style). Measured with 100 demonstrations, 30 evaluation episodes: 0.03 to
    # 0.07 SFT success without noise, 0.23 with 0.01; 0.03 left the planner only 11%
    # of its attempts.
    c.bc.demo_noise = 0.01
    c.bc.num_steps = 2000
    c.bc.batch_size = 64
    c.data.stride = 1  # Every step of the planner's path starts a sample.
    c.data.normalize = "zscore"
    c.pipeline.micro_batch_segments = 8
    c.rl.num_minibatches = 4  # 16 envs * 10 chunks = 160 chunks: 40 per minibatch.
    # RL trains a residual head (rl/steer_*) over the frozen SFT flow: 0.22 -> 0.80 by
    # 2M steps, where training the flow's 160-term SDE log-prob gained nothing in the
    # 320k steps it was run at any step size (docs/results/maniskill.md). 'flow_sde', 'ode',
    # lr 1e-5, 2 epochs and 'sparse' give that earlier recipe back.
    c.model.train_sampler = "residual"
    c.model.eval_sampler = "residual_mean"
    c.model.steer_bound = 1.0  # Corrections within +-1 z-scored action unit.
    c.model.steer_std_init = 0.2  # Exploration around the SFT chunk (labels vary by ~0.9).
    # KL ~0.01 per update; 1e-4 gave 0.06-0.08 with 45% of ratios clipped and lost success.
    c.rl.learning_rate = 3e-5
    c.rl.num_epochs = 4
    # The recipe's figures (docs/results/maniskill.md) were measured with the chunk's joint ratio
    # and its step size tuned with it; 'per_term' (the default) is not measured here.
    c.rl.ratio = "joint"
    # Success plus potential-based shaping by ManiSkill's normalised dense reward.
    c.env.reward_mode = "sparse_shaped"
    # The gain comes late: 0.22 -> 0.38 by 635k env steps, 0.50 by 794k (docs/results/maniskill.md).
    c.total_env_steps = 2_000_000
    c.eval.num_episodes = 100  # Fixed-seed evaluation episodes (disjoint from the demos').
    c.eval.env_workers = 2  # (building 100 ManiSkill3 envs takes ~100 s in one process)
    # Every 80k env steps: an evaluation costs about as many env steps as 12 iterations.
    c.eval.every_iters = 100
    c.checkpoint.every_iters = 50
  if variant == "sft_rl_short":
    c.env.task = "PushCube-v1"  # Gains from the start; PickCube's first 300k steps are flat.
    c.bc.num_episodes = 20  # (100 give PushCube 0.98 SFT success: nothing left for RL)
    # 3x the recipe's step: from the same SFT policy, 80k env steps gain 0.23 at 1e-4 and
    # 0.11 at 3e-5 (PickCube's 2M-step run needs the smaller one; docs/results/maniskill.md).
    c.rl.learning_rate = 1e-4
    c.total_env_steps = 80_000
    c.eval.every_iters = 1000  # At the start and the end only.
    c.checkpoint.every_iters = 1000
  if vision:
    _set_vision(c, vision)
  if vision in STEERED_VISION and not method:
    # DSRL from pixels: the head draws the frozen flow's initial noise, so it explores on
    # the flow's own actions (on PushCube from the fixed camera a residual Gaussian cost
    # the pixel policy a third of its training success, and it gained 0.00 +- 0.04 over 3
    # seeds; from the wrist camera the residual head gained +0.31 +- 0.18 over seeds 0-2,
    # not adopted until more seeds; docs/results/maniskill.md, "From pixels").
    method = "latent"
  if method:
    _set_method(c, method)
  if vision in STEERED_VISION and method in ("latent", "residual"):
    # The steering head also reads the critic state as its own network estimates it from
    # the camera (R^2 0.97 / 0.95 for the cube's x / y on held-out episodes, where the
    # head's pooled features give 0.24 / -0.14; docs/results/maniskill.md).
    c.model.steer_state_estimator = True
    if method == "latent":
      # PPO's early stop at a KL of 0.01 per update: without it one seed of three fell
      # from 0.34 to 0.22 by 159k env steps (its KL at 0.027); with it five seeds gained
      # +0.14 +- 0.09 (docs/results/maniskill.md, "From pixels").
      c.rl.target_kl = 0.01
  if flow_rl:
    # PPO's clip on the chain's own move: over ten seeds of PushCube at 80k env steps
    # +0.10 +- 0.04 (every seed gained) against the mean's +0.07 +- 0.08.
    c.model.log_prob_steps = "sum"
    if variant == "sft_rl_short":
      # Twice sft_rl_short's budget: 8 of 10 seeds gain >= 0.10 (4 of 10 at 80k), the
      # mean +0.11 (docs/results/maniskill.md).
      c.total_env_steps = 160_000
  return c


def _set_vision(c: ml_collections.ConfigDict, vision: str) -> None:
  """The camera recipe's settings over its state recipe (the module docstring)."""
  c.env.obs_mode = "rgb"
  c.model.image_size = 0  # The ViT sees the camera's 64 px: 8 x 8 patches of 8 px.
  # An asymmetric critic: the value head also reads the simulation state (the policy only
  # pixels and proprioception). From pixels alone its explained variance stayed near 0 and
  # RL gained nothing (docs/results/maniskill.md, "From pixels").
  c.env.critic_state_dim = 70
  # The critic's own step and a warm-up: at the actor's step it barely moved in 50k env
  # steps. The actor's step keeps the KL near 0.01 per update (1e-4: 0.06-0.10, 45% clipped).
  c.rl.learning_rate = 3e-5
  c.rl.value_learning_rate = 1e-3
  c.rl.critic_warmup_steps = 160
  # (value_source stays 'expert': pi0's state token, which attends to the image tokens.)
  if vision == "vision_multitask":
    c.env.task = MULTITASK
    c.env.state_keys = MULTITASK_STATE
    # One robot and its cameras for all three: the Panda with its wrist camera beside the
    # fixed one. From the fixed camera alone SFT reached 0.22 / 0.02 / 0.00 on PushCube /
    # PickCube / StackCube, with the wrist camera 0.52 / 0.02 / 0.00 (docs/results/maniskill.md).
    c.env.robot = "panda_wristcam"
    c.bc.num_episodes = 180  # The tasks take turns: 60 each (PushCube's SFT from 60: 0.28).
  if vision == "vision_rl":
    # PickCube from pixels. From 100 state demonstrations SFT reached 0.22, and from pixels
    # PushCube needed 150 where its state SFT took 20; 300 take about 4 minutes on 2 cores.
    c.bc.num_episodes = 300
    # The Panda's wrist camera beside the fixed one: at 64 px the fixed camera shows the
    # 4 cm cube as 2 x 2 pixels, and from it alone SFT succeeded in 0 of 100 episodes; with
    # the wrist camera, which sees the cube large through the grasp, 0.30 (seed 0), and RL
    # raised it to 0.58 by 1M env steps (docs/results/maniskill.md, "PickCube from pixels").
    c.env.robot = "panda_wristcam"
    # 1M RL env steps (the state recipe's PickCube gain came by 800k) keep the whole run
    # near an hour alone on 2 cores; an evaluation every 160k.
    c.total_env_steps = 1_000_000
    c.eval.every_iters = 200
  if vision == "vision_rl_short":
    # PushCube through the Panda's wrist camera alone (the fixed one never rendered): it
    # sees the cube large and the goal. From the fixed 64 px camera 150 demonstrations gave
    # SFT 0.21-0.47, and the latent head ended at 0.35-0.56 from any of them, what that
    # flow could do from its camera; from the wrist camera 150 gave 0.99 (nothing left for
    # RL), the state recipe's 20 gave 0.43, and RL raised it to 0.59 by 300k
    # (docs/results/maniskill.md, "From the wrist camera").
    c.env.robot = "panda_wristcam"
    c.env.cameras = "hand_camera"
    c.bc.num_episodes = 20
    # RL at about 500 env steps/s alone on 2 cores: 300k fit the 25 minutes with the
    # demonstrations and BC; an evaluation every 80k gives the curve.
    c.total_env_steps = 300_000
    c.eval.every_iters = 100


def _set_method(c: ml_collections.ConfigDict, method: str) -> None:
  """The RL method's settings over the ``sft_rl`` recipe (the module docstring)."""
  m, rl = c.model, c.rl
  if method == "residual":
    return
  if method == "fast":
    _set_fast(c)
    return
  if method == "latent":
    m.train_sampler, m.eval_sampler = "latent", "latent_mean"
    m.steer_std_init = 1.0  # The base policy's N(0, 1) noise.
    rl.learning_rate = 1e-4
    return
  # The whole flow trains, evaluated with its deterministic ODE sampler.
  m.eval_sampler = "ode"
  if method == "flow_sde":
    m.train_sampler = "flow_sde"
    rl.learning_rate = 1e-5  # (KL 0.014 per update at 1e-5; docs/results/maniskill.md)
    return
  # piRL's recipe (RLinf's maniskill_ppo_openpi*.yaml and openpi_action_model.py): the
  # executed dims' token-level ratios, a critic on detached features with a 20x larger
  # step, value clip 0.2 and the Huber loss (delta 10).
  rl.ratio = "per_term"
  m.value_detach = True
  rl.value_learning_rate = 1e-4
  rl.learning_rate = 1e-5
  rl.value_clip = 0.2
  rl.value_loss = "huber"
  rl.huber_delta = 10.0
  if method in ("pirl_sde", "grpo"):
    m.train_sampler, m.sde_steps = "flow_sde", "one"
  if method == "pirl_noise":
    m.train_sampler, m.log_prob_steps = "flow_noise", "mean"
    m.noise_std_min, m.noise_std_max = 0.08, 0.16
    rl.entropy_coef = 0.005
  if method == "grpo":
    c.algorithm = "grpo"
    c.env.group_size = 8  # 16 envs: 2 groups of 8 per update.
    rl.value_clip = 0.0  # (GRPO has no critic)


def _set_fast(c: ml_collections.ConfigDict) -> None:
  """pi0-FAST over the ``sft_rl`` recipe: the same demonstrations, env and RL budget."""
  m = c.model
  m.name = "pi0_fast"
  # openpi normalises pi0-FAST's state and actions by quantiles: the prompt cuts the state
  # into 256 bins over [-1, 1] and the FAST fit covers chunks in [-1, 1]; z-scores would
  # put every value beyond one std into an end bin.
  c.data.normalize = "quantile"
  # The prefix: the instruction's words and one bin per state value (PushCube: 10 + 35 = 45
  # tokens, PickCube 10 + 42). Every BC and RL pass runs the padded length.
  m.max_token_len = 56
  # PushCube's chunks (5 x 8) take 15 FAST tokens on average, 18 at p95 and at most 20 with
  # the tokenizer fitted on 20 demonstrations; with "action", "|" and eos a postfix is at
  # most 23. 28 bounds a wandering sample; the BC pass pads every postfix to it.
  m.max_action_tokens = 28
  # Decode at the positions BC trained at (configs/default.py:fast; docs/design/policy.md).
  m.fast_positions = "train"
  # PPO over tokens: each token's own ratio (as the LLM systems and configs/default.py:fast),
  # not the chunk's joint one the flow recipes clip.
  c.rl.ratio = "per_term_correction"
  # The whole model trains, as in piRL's whole-flow methods: their actor step. At the
  # recipe's 1e-4 (a head's) the first update's approx. KL was 256, 74% of ratios clipped.
  c.rl.learning_rate = 1e-5
