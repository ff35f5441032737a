"""The run config's defaults, in code: every field of a run, with a one-line comment each.

``configs/default.py`` composes the main job and its variants from :func:`get_config`, and
every other file in ``configs/`` from that; library code that needs a default (filling a
key an older run's stored config lacks, the parameter summary, the benchmarks) reads it
here, so an installed jaxvla needs no checkout. The values are the main job's:
ColorReach, the tiny pi0, a behaviour-cloning warm start, then PPO.
"""

import ml_collections

from jaxvla.data import config as data_config
from jaxvla.parallel import axes


# Keys that moved: old dotted path -> new. A config or command line that still sets an
# old key is refused with the new one named (:func:`check_moved_keys`, :func:`moved_in_argv`;
# :func:`jaxvla.config_checks.validate` and ``jaxvla.main`` call them).
MOVED_KEYS = {
    "ppo.algorithm": "algorithm",
    "ppo.loss_normalizer": "grpo.loss_normalizer",
    "ppo.grpo_scale": "grpo.scale",
    # The RL update's settings serve PPO and GRPO alike: ``ppo.*`` became ``rl.*``.
    **{f"ppo.{key}": f"rl.{key}" for key in (
        "adam_b1", "advantage_norm", "behaviour_clip", "bootstrap_truncated", "clip_eps",
        "correction", "critic_warmup_steps", "entropy_coef", "gae_lambda", "gamma",
        "huber_delta", "is_clip", "is_clip_mode", "kl_detail_rows", "learning_rate",
        "lr_schedule", "max_bad_updates", "max_grad_norm", "num_epochs", "num_minibatches",
        "ratio", "step_scale", "target_kl", "value_clip", "value_coef", "value_learning_rate",
        "value_loss", "value_targets")},
}


def _moved_message(old: str) -> str:
  return f"config.{old} has moved to config.{MOVED_KEYS[old]}; set that instead"


def check_moved_keys(c: ml_collections.ConfigDict) -> None:
  """Raises ``ValueError`` naming the new key if ``c`` sets a key of :data:`MOVED_KEYS`
  (a config file written for an older jaxvla: an unlocked ConfigDict takes any key)."""
  for old in MOVED_KEYS:
    section, key = old.rsplit(".", 1)
    if key in c.get(section, {}):
      raise ValueError(_moved_message(old))


def moved_in_argv(argv: list[str]) -> str | None:
  """The error for the first ``--config.<old key>=...`` of ``argv`` (None if none): flag
  parsing would otherwise only say that the key does not exist."""
  for arg in argv:
    name = arg.split("=", 1)[0].lstrip("-")
    if name.startswith("config.") and name[len("config."):] in MOVED_KEYS:
      return _moved_message(name[len("config."):])
  return None


def get_config() -> ml_collections.ConfigDict:
  """The default run config (``configs/default.py`` without a variant)."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seed of parameters, sampling and env episodes.
  c.total_env_steps = 250_000  # Budget: RL env steps (executed actions) of the whole run.
  c.num_envs = 64  # Envs stepped in parallel for RL rollouts.
  c.rollout_len = 10  # Chunk steps per env per training iteration.
  c.env_workers = 0  # Env worker processes for rollouts (0: step envs in the trainer process).
  # Pool only, hang detection. Once 16 chunks are measured, a hang is a chunk 10x slower
  # than the slowest so far (and at least env_hang_floor_s); before that, env_step_timeout_s.
  c.env_step_timeout_s = 120.0  # Seconds a worker may take for a chunk: warm-up and cap.
  c.env_hang_floor_s = 10.0  # Least seconds a chunk may take before it counts as a hang.
  c.resume = False  # Continue from the latest checkpoint in the workdir.
  # Replay the run in this workdir from its schedule log (docs/design/reproducibility.md).
  c.replay = ""

  c.env = ml_collections.ConfigDict()
  c.env.name = "builtin"  # Environment: 'builtin' (ColorReach).
  c.env.image_size = 32  # Camera image side in pixels.
  c.env.num_targets = 3  # Coloured targets per episode; the instruction names one.
  c.env.num_colours = 4  # Size of the colour palette targets are drawn from.
  c.env.max_episode_steps = 10  # Time limit in env steps.
  c.env.max_speed = 0.1  # Distance moved per step at full action.
  c.env.goal_radius = 0.2  # Success distance to the named target.
  c.env.wrong_target_radius = 0.2  # Touching another target within this ends in failure.
  c.env.min_separation = 0.55  # Minimum distance between targets and the start.
  c.env.layout = "ring"  # 'ring': agent starts at the centre, targets around it; 'uniform'.
  c.env.ring_radius = (0.45, 0.85)  # 'ring': (min, max) distance of targets from the centre.
  c.env.latency_ms = 0.0  # Median simulated per-step latency (slept), 0 for none.
  c.env.group_size = 1  # GRPO groups: envs i // G share each episode's init (1: no groups).
  c.env.latency_sigma = 1.0  # Log-normal shape of that latency (long tail when large).

  c.model = ml_collections.ConfigDict()
  c.model.name = "pi0"  # Policy family: 'pi0', 'pi05' (flow), 'action_token_vla' or 'pi0_fast'.
  c.model.variant = "tiny"  # Size: 'tiny' (CPU tests), 'small' or 'full' (openpi's ~3.3B).
  c.model.dtype = "float32"  # Compute dtype ('bfloat16' on accelerators); params stay float32.
  c.model.remat = False  # Recompute layer activations in the backward pass (saves memory).
  c.model.image_size = 0  # Side the ViT sees; images are resized to it (0: the env's size).
  c.model.posemb = "sincos2d"  # ViT position embedding: 'learn' (openpi's) or 'sincos2d' (fixed).
  c.model.action_dim = 0  # Network action size, >= the env's (0: the env's; openpi: 32).
  c.model.state_dim = 0  # Network state size, >= the env's (0: the env's; openpi: 32).
  c.model.vocab_size = 0  # Embedding rows, >= the tokenizer's (0: the tokenizer's; full: 257152).
  c.model.init_checkpoint = ""  # openpi params dir (<ckpt>/params) to start from ('': fresh init).
  # LoRA (openpi's gemma_2b_lora / gemma_300m_lora): adapters on the Gemma attention and MLP
  # weights; the adapted experts' other weights are frozen (openpi's freeze filter).
  c.model.lora = "none"  # Adapters on: 'none', 'llm' (PaliGemma), 'expert' (action) or 'both'.
  c.model.lora_rank_llm = 16  # Rank (= alpha) of the LLM's adapters (openpi's gemma_2b_lora).
  c.model.lora_rank_expert = 32  # Rank (= alpha) of the expert's (openpi's gemma_300m_lora).
  c.model.value_source = "prefix"  # Value head input: 'prefix' tokens or pi0's 'expert' state token.
  c.model.value_hidden = 64  # Hidden units of the value head.
  c.model.tokenizer = "builtin"  # Instruction tokenizer: 'builtin' (words) or 'paligemma'.
  c.model.tokenizer_path = ""  # 'paligemma': path of paligemma_tokenizer.model (no download here).
  c.model.max_token_len = 12  # Prompt length in tokens (with <bos>); longer is an error.
  c.model.discrete_state_input = True  # pi05 only: write the discretised state into the prompt.
  c.model.chunk_len = 5  # Actions per chunk H (one RL step executes a chunk).
  c.model.num_denoise_steps = 4  # Denoise steps K of the sampler.
  # Steered samplers: RL trains a small Gaussian head (rl/steer_*) and the value head over
  # the frozen flow: 'latent' (DSRL) draws its initial noise, 'residual' corrects its
  # chunk (docs/design/policy.md, "Steered RL").
  c.model.train_sampler = "flow_sde"  # RL sampler: 'flow_sde', 'flow_noise', 'latent', 'residual'.
  # 'latent_mean' / 'residual_mean' (with that train_sampler): the steering head's mean.
  c.model.eval_sampler = "ode"  # Evaluation: 'ode', 'latent_mean', 'residual_mean' or an RL one.
  c.model.noise_level = 0.5  # flow_sde noise scale a in sigma_t = a sqrt(t / (1 - t)).
  c.model.noise_std_min = 0.05  # flow_noise: lower bound of the learned std.
  c.model.noise_std_max = 0.5  # flow_noise: upper bound of the learned std.
  # flow_sde / flow_noise (jaxvla/models/denoise.py): 'all' steps stochastic, or 'one'
  # step per sample drawn at random (piRL's flow-SDE), the others the ODE's; and the
  # chain's log-prob per dim as the 'sum' over its Gaussian steps or their 'mean'.
  c.model.sde_steps = "all"  # Stochastic denoise steps: 'all' or 'one'.
  c.model.log_prob_steps = "sum"  # Chain log-prob over steps: 'sum' or 'mean'.
  c.model.value_detach = False  # Value head on stop-gradient features (no critic grads in).
  c.model.steer_hidden = 256  # Steered: hidden width of the steering head's two layers.
  c.model.steer_bound = 2.0  # Steered: bound of its mean (noise stds / normalised action units).
  c.model.steer_std_init = 1.0  # Steered: its initial std (latent: 1 is the base policy's noise).
  c.model.steer_std_min = 0.05  # Steered: floor of its std.
  # Steered: the head also reads every image token through this many channels each
  # (the camera's spatial layout; 0: the pooled features only).
  c.model.steer_image_channels = 0
  # Steered: the head also reads the critic state as its own small network estimates it from
  # the cameras, trained by regression on the env's critic state (env.critic_state_dim)
  # with weight rl.state_estimate_coef at the critic's step (jaxvla/models/pi0.py).
  c.model.steer_state_estimator = False
  c.model.num_bins = 256  # action_token_vla: bins per action dimension (tokens per bin).
  # pi0_fast: FAST tokenizer directory (fast_tokenizer.save's or HuggingFace's files); '':
  # fitted on the warm start's demonstrations at fast_scale and fast_vocab_size.
  c.model.fast_tokenizer_path = ""
  c.model.fast_scale = 10.0  # pi0_fast fit: DCT coefficients rounded to 1 / fast_scale (openpi's).
  c.model.fast_vocab_size = 1024  # pi0_fast fit: BPE vocabulary (openpi's universal one: 2048).
  # pi0_fast fit: every chunk within [-r, r] (normalised) gets ids, beyond the demonstrations'
  # own range, so RL can act past them (0: the demonstrations' range only, HF's fit).
  c.model.fast_fit_range = 1.0
  c.model.max_action_tokens = 256  # pi0_fast: most tokens decoded per chunk (openpi's max_decoding_steps).
  c.model.temperature = 1.0  # pi0_fast: sampling temperature of act('train') and its log-probs.
  # pi0_fast: RoPE positions of decoded tokens: 'openpi' (its sample_actions: one past the
  # training positions) or 'train' (the positions the BC loss trains at).
  c.model.fast_positions = "openpi"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # Learner mesh: data-parallel axis size.
  c.mesh.fsdp = -1  # Learner mesh: FSDP axis size (-1: every device data and tensor leave).
  c.mesh.tensor = 1  # Learner mesh: tensor-parallel axis size (heads / MLP hidden).
  c.mesh.rollout_devices = ""  # Rollout devices: '' the learner's, 'N' the last N, '0.25', '6,7'.
  c.mesh.rules = axes.DEFAULT_RULES  # Logical axis -> mesh axes (see jaxvla/parallel/sharding.py).

  c.bc = ml_collections.ConfigDict()
  c.bc.num_episodes = 3000  # Scripted-expert episodes collected for the warm start.
  c.bc.demo_noise = 0.3  # Gaussian noise added to the expert's executed actions.
  c.bc.success_only = False  # Record only the demonstrator's successful episodes.
  c.bc.expert_speed = 0.4  # Demonstrator speed (fraction of max): cautious, like teleoperation.
  c.bc.num_steps = 7000  # Gradient steps of the warm start (0: start RL from scratch).
  c.bc.batch_size = 64  # Warm-start batch size (chunks).
  c.bc.learning_rate = 1e-3  # Warm-start Adam learning rate.
  c.bc.lr_schedule = "constant"  # 'constant', or 'cosine' decay to 0.1x by bc.num_steps.

  # Demonstrations on disk (RLDS / LeRobot; docs/guides/data.md). Fields in jaxvla/data/config.py.
  c.data = data_config.get_config()  # Demonstrations on disk ('' path: record the expert).
  # BC samples at chunk starts, where the policy acts (every chunk_len steps). Measured
  # with the tiny pi0, 3,000 episodes, 3,500 steps: 0.375 warm-start success against 0.03
  # when every step starts a sample (windows from mid-chunk states, which the policy
  # never acts from, took the small model's capacity).
  c.data.stride = 0  # 0: the chunk length.

  # The RL objective. Both are clipped policy-gradient updates with the settings in
  # ``rl`` (clip, epochs, minibatches, corrections, and PPO's critic); GRPO's own are in
  # ``grpo``.
  c.algorithm = "ppo"  # 'ppo' (GAE, value head) or 'grpo' (group-normalised episode returns).
  c.grpo = ml_collections.ConfigDict()
  c.grpo.loss_normalizer = "trajectory"  # 'chunks', 'trajectory' (1/|tau|) or 'constant' (1/K).
  c.grpo.scale = True  # Divide by the group's return std (False: Dr. GRPO).

  # The RL update's settings, PPO's and GRPO's (the gamma, GAE and value_* keys are PPO's
  # critic; GRPO has none). Formerly ``ppo.*`` (:data:`MOVED_KEYS`).
  c.rl = ml_collections.ConfigDict()
  c.rl.learning_rate = 1e-4  # Adam learning rate of the RL phase.
  c.rl.gamma = 0.99  # Discount per chunk step.
  c.rl.gae_lambda = 0.95  # GAE lambda.
  # True when the time limit only schedules resets; False when reaching the goal in time
  # is the task, as in ColorReach (with True, tests/test_learning.py's PPO lost its push
  # to hurry: 1.0 -> 0.445 success).
  c.rl.bootstrap_truncated = False  # Bootstrap truncations from their final obs's value.
  c.rl.clip_eps = 0.2  # PPO ratio clip.
  # 'per_term_correction': PPO's ratio and clip over the chunk, the decoupled correction
  # (importance weight, behaviour clip) per action dim of the chunk (H x A terms): on
  # fresh data the 'joint' ratio's PPO; full async at staleness 4 ended 0.026 below sync
  # over five ColorReach seeds, where 'joint' (one weight for the chunk's K x H x A
  # transitions) lost 0.06-0.12 (docs/results/pipeline.md). 'per_term': ratio and clip per term
  # too (token-level PPO); 'mean': the geometric mean over the terms, GSPO-style.
  c.rl.ratio = "per_term_correction"  # 'per_term_correction', 'joint', 'per_term' or 'mean'.
  c.rl.value_coef = 0.5  # Weight of the value loss.
  c.rl.state_estimate_coef = 1.0  # Weight of the state estimator's loss (model.steer_state_estimator).
  c.rl.value_loss = "mse"  # Critic loss of the error: 'mse' (0.5 e^2) or 'huber'.
  c.rl.huber_delta = 10.0  # 'huber': quadratic within this error, linear beyond.
  c.rl.value_clip = 0.0  # Clip the value's move from the rollout's, PPO2-style (0: off).
  c.rl.value_learning_rate = 0.0  # Critic (rl/value_*) Adam learning rate (0: learning_rate).
  c.rl.critic_warmup_steps = 0  # First RL optimizer steps that train the critic alone.
  # 'constant', or 'linear': the actor's step falls to 0 at the budget's last optimizer
  # step (optimizers.rl_optimizer_steps; after the critic's warm-up; PPO only).
  c.rl.lr_schedule = "constant"
  c.rl.entropy_coef = 0.0  # Weight of the sampler-entropy bonus (matters for flow_noise).
  c.rl.num_epochs = 2  # Passes over each rollout.
  c.rl.num_minibatches = 4  # Minibatches per pass.
  c.rl.max_grad_norm = 1.0  # Global gradient-norm clip.
  c.rl.adam_b1 = 0.9  # Adam's first-moment decay (momentum) in the RL phase.
  # Divergence guard: an update (or BC step) whose loss, gradients or new params are not
  # finite is not applied (counted, logged).
  c.rl.max_bad_updates = 3  # This many non-finite updates in a row stop the run.
  c.rl.target_kl = 0.0  # Skip the rest of an update once approx. KL exceeds this (0: off).
  # What the KL stop ends: the rest of the update ("update"), or only the actor's steps
  # ("actor": the critic and the state estimator keep their steps; needs their own Adam,
  # rl.value_learning_rate or rl.critic_warmup_steps).
  c.rl.target_kl_stops = "update"
  c.rl.advantage_norm = "minibatch"  # Advantage normalisation: 'minibatch' stats or 'none'.
  # 'decoupled' (the default) is plain PPO on fresh data (behaviour = proximal policy) at
  # the cost of one forward pass per update, and corrects stale (async) or bf16-rollout
  # data; 'none' clips around the behaviour, which lost 0.25 success at staleness 4.
  c.rl.correction = "decoupled"  # Off-policy correction: 'none', 'decoupled', 'truncated_is'.
  c.rl.is_clip = 2.0  # Truncation of importance weights (decoupled: 0 for none; truncated_is).
  c.rl.is_clip_mode = "truncate"  # Decoupled, a weight over is_clip: 'truncate' or 'drop'.
  # Decoupled only: a chunk the policy has moved by more than this factor from the
  # behaviour, in its advantage's direction, gives no gradient (0: off). What keeps the
  # streamed learner from running away on stale data (docs/design/pipeline.md, learning parity).
  c.rl.behaviour_clip = 2.0  # Trust region around the behaviour (0 or > 1).
  # 'learner': recompute GAE from the learner's critic at the start of each update (one
  # more forward pass) instead of the values the (possibly stale) rollout recorded;
  # 'vtrace': V-trace targets and advantages from that critic and the importance ratios.
  c.rl.value_targets = "rollout"  # Advantages from: 'rollout', 'learner' or 'vtrace'.
  # 'ess': scale each optimizer step by the effective sample size fraction of its
  # importance weights, mean(w)^2 / mean(w^2) (1 on fresh data, less the staler it is).
  c.rl.step_scale = "none"  # Step size under staleness: 'none', 'ess' or 'staleness'.
  # Diagnostics: score this many of each update's rows under the params before and after
  # it, per denoise step and action dim (update_kl/step<k>, /dim<a>; flow samplers, PPO's
  # epochs update; two forward passes of the chain over these rows per update). 0: off.
  c.rl.kl_detail_rows = 0

  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.mode = "sync_colocated"  # 'sync_colocated', 'sync_disaggregated' or 'async'.
  c.pipeline.train_async = True  # async L1: rollout runs in parallel with training.
  c.pipeline.rollout_async = True  # async L2: first-ready env batching (needs env_workers > 0).
  c.pipeline.streamer = False  # async L3: streamed micro-batch learner (gradient accumulation).
  c.pipeline.max_staleness = 1  # Train only on chunks at most this many versions old.
  c.pipeline.staleness_control = "pace"  # Too-stale data: 'pace' the rollout or 'drop' (counted).
  c.pipeline.queue_items = 8  # Trajectory queue capacity in items (a full queue blocks rollout).
  c.pipeline.micro_batch_segments = 8  # Env segments per queue item (the streamer's micro-batch).
  c.pipeline.b_max = 0  # L2: inference batch size trigger (0: half the envs).
  c.pipeline.t_max_ms = 5.0  # L2: max wait after the first ready env before inferring.
  c.pipeline.min_bucket = 1  # L2: smallest padded inference batch (fewer act compiles).
  c.pipeline.rollout_dtype = ""  # Rollout copy and streamed proximal snapshot: "" exact, "bfloat16" (use a correction).
  c.pipeline.timeline = True  # Write workdir/timeline.json (stage intervals; plot with stages).
  c.pipeline.schedule_log = True  # Write workdir/schedule/ (what timing decided: for replay).

  c.eval = ml_collections.ConfigDict()
  c.eval.every_iters = 10  # Evaluate every N RL iterations (and at the start and end).
  c.eval.num_episodes = 128  # Episodes per evaluation (eval_sampler, one fixed seed).
  c.eval.env_workers = 0  # Worker processes for the evaluation envs (0: in the trainer process).

  c.log = ml_collections.ConfigDict()
  c.log.progress = True  # Show a progress bar on stderr.
  c.log.progress_every_s = 30.0  # Seconds between a phase's progress lines in the log (0: none).

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_iters = 10  # Save the train state every N RL iterations (and at the end).
  c.checkpoint.max_to_keep = 2  # The newest checkpoints kept on disk.
  # Keep checkpoint 0, the warm start (e.g. the SFT policy), beside them: evaluating the
  # policy before and after RL on the same episodes (jaxvla.eval --step=0) needs it.
  # One train state more on disk (about 36 GiB for full pi0 with Adam's moments).
  c.checkpoint.keep_warm_start = True

  # Multi-host (jax.distributed): one process per host, same config and (shared) workdir.
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ""  # 'host:port' of process 0 ('': one process).
  c.distributed.num_processes = 1  # Processes in the job (with coordinator_address).
  c.distributed.process_id = 0  # This process's rank in [0, num_processes).
  c.distributed.cluster_auto = False  # Let JAX detect the cluster (TPU pod, SLURM, Open MPI).
  c.distributed.local_device_ids = ""  # This process's devices, e.g. '0,1' ('': all visible).
  c.distributed.initialization_timeout_s = 300  # Seconds to wait for every process to join.
  c.distributed.heartbeat_timeout_s = 100  # A silent process fails the job after this.

  return c
