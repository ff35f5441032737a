"""Full-size pi0 / pi0.5 on a TPU slice or GPU nodes: ``--config=configs/tpu.py[:MODEL[,TASK]]``.

One process per TPU VM (4 chips) or per 8-GPU node, started on every host by
``launch/tpu_pod.sh`` or ``launch/slurm.sbatch`` (which add
``--config.distributed.cluster_auto=True`` and the shared ``--workdir``). MODEL
and TASK are those of ``configs/openpi.py`` (default ``pi0,libero_spatial/0``),
whose network this is: openpi's sizes, bfloat16 compute with float32 master
weights, rematerialised layers; set ``--config.model.tokenizer_path`` (PaliGemma's
SentencePiece file) and, to fine-tune openpi's weights,
``--config.model.init_checkpoint=<ckpt>/params``.

What this file changes for a slice:

* Mesh from the device count at run time: ``fsdp=-1`` spans every chip of the
  slice (the train state is split over all of them). SigLIP's width, 1152, is
  divisible by 128 chips but not by 256; on a 256-chip slice pass
  ``--config.mesh.data=-1 --config.mesh.fsdp=128`` or SigLIP's 412M parameters
  (with their Adam moments) stay unsharded on every chip.
* Per-host env pools: every TPU VM steps its own ``num_envs`` LIBERO instances
  in ``env_workers`` processes on its CPUs (a 4-chip v5e / v5p VM has 112 / 208
  vCPUs); ``num_envs`` and the PPO minibatches are per process, each split over
  the host's 4 chips (or 8 GPUs).
* The asynchronous pipeline with a bfloat16 rollout copy and decoupled PPO (the
  copy's rounding makes the behaviour policy differ slightly from the learner's).

Memory: the weight broadcast gathers the float32 params to every learner chip
(12.95 GB for pi0) before each host casts its rollout copy (6.48 GB in bfloat16) on
its first chip, which with the current copy, the train state's share and the
activations needs about 30 GB there: v5p (95 GB HBM) fits; v5e (16 GB) and v6e / v4
(32 GB) do not (docs/guides/multihost.md, "Toward 64+ hosts").
Everything not set here is ``configs/openpi.py``.
"""

import ml_collections

from configs import openpi


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = openpi.get_config(arg)  # ValueError naming the model or task if unknown
  c.total_env_steps = 10_000_000  # Budget: RL env steps of all hosts together.
  c.num_envs = 32  # LIBERO instances per host (process); each host feeds its own rows.
  c.env_workers = 32  # Env worker processes per host (MuJoCo steps one env per process).
  c.rollout_len = 8  # Chunk steps per env per update: 256 chunks per host per update.
  c.env.image_size = 224  # Camera side: the model's 224 px input, no resize.
  c.mesh.data = 1  # Data-parallel axis (set -1 with a fixed fsdp on 256+ chips).
  c.mesh.fsdp = -1  # FSDP over every chip of the slice, counted at start-up.
  c.mesh.tensor = 1  # No tensor parallelism: FSDP alone shards a 3.3B model enough.
  c.pipeline.mode = "async"  # Rollout on each host in parallel with the SPMD learner.
  c.pipeline.streamer = False  # Whole-batch PPO updates (minibatch advantage statistics).
  c.pipeline.micro_batch_segments = 8  # Env segments per queue item (divides num_envs).
  c.pipeline.rollout_dtype = "bfloat16"  # Half-size rollout copy (6 GiB instead of 12).
  c.rl.correction = "decoupled"  # Corrects for the bfloat16 copy's rounding and staleness.
  c.rl.num_minibatches = 8  # 32 chunks per host per minibatch: 8 per chip on 4-chip VMs.
  c.eval.num_episodes = 64  # Evaluation episodes (process 0 plays them, on its own CPUs).
  c.eval.env_workers = 32  # Worker processes for the evaluation envs.
  c.eval.every_iters = 20  # Evaluate every N updates.
  c.checkpoint.every_iters = 10  # Save every N updates (what a preemption can lose).
  # Every VM must have run launch/setup.sh before the job starts; 64 hosts also take
  # longer than one to bring up libtpu.
  c.distributed.initialization_timeout_s = 900  # Seconds to wait for every host to join.
  return c
