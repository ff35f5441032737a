"""LIBERO env steps/s next to a policy: ``--config=configs/libero_bench.py[:MODEL[,TASK]]``.

The config of the LIBERO throughput benchmark (docs/design/pipeline.md, "LIBERO next to a
policy")::

  source launch/env.sh
  python -m jaxvla.bench.pipeline --config=configs/libero_bench.py \\
      --modes=sync_colocated,+streamer --updates=6 --warmup=2

MODEL is ``pi0`` (default) or ``pi05`` at openpi's full size (``configs/openpi.py``:
bfloat16 compute, remat, 224 px, 32-dim padded state and actions), or ``tiny``: the
tiny pi0 at 64 px on 2 envs, the same command on a CPU. TASK is a
LIBERO task (default ``libero_spatial/0``).

* The weights are a fresh init: env steps/s do not depend on them. The word
  tokenizer with PaliGemma's vocabulary size stands in for PaliGemma's (the same
  shapes and prompt length, no tokenizer file to carry).
* Full size: 32 LIBERO instances in 16 worker processes (two per process; a
  16-core machine), rendered at the model's 224 px, so nothing is resized. MuJoCo
  renders through ``MUJOCO_GL=egl`` (``launch/env.sh``): the GPU's EGL driver where
  the vendor's libEGL is installed, Mesa's llvmpipe otherwise (``MUJOCO_EGL_DEVICE_ID``
  picks the GPU). Rollout and learner share one device; the rollout acts with a
  bfloat16 copy of the params, corrected for by decoupled PPO.
* An update is 32 envs x 4 chunks x 10 actions = 1280 env steps, in 4 streamed
  micro-batches of 8 segments. Inference batches are padded to at least 8 rows
  (``pipeline.min_bucket``), so full pi0's ``act`` and ``value`` compile for 3 sizes.
"""

import ml_collections

from configs import libero, openpi
from jaxvla import config_checks

MODELS = (*openpi.MODELS, "tiny")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name, _, task = (arg or "pi0").partition(",")
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r} of configs/libero_bench.py; choose one of {MODELS}")
  if name == "tiny":
    c = libero.get_config(task or None)  # tiny pi0, 64 px, 2 envs in 2 workers
    c.rollout_len = 2
    c.pipeline.micro_batch_segments = 1
  else:
    c = openpi.get_config(f"{name},{task}" if task else name)
    c.model.tokenizer = "builtin"  # Same shapes as PaliGemma's (vocab_size stays 257152).
    c.env.image_size = c.model.image_size  # Render at the ViT's size: no resize.
    c.num_envs = 32
    c.env_workers = 16  # One per core of a 16-core machine.
    c.rollout_len = 4
    c.pipeline.micro_batch_segments = 8
    c.rl.num_minibatches = 4
    c.pipeline.rollout_dtype = "bfloat16"  # The rollout's copy (6.5 GB for pi0).
    # First-ready batches of 8, 16 or 32 rows: three act / value programs to compile
    # instead of six (a batch of 1 costs the GPU about what a batch of 8 does).
    c.pipeline.min_bucket = 8
  # What a training run of this config would use (the benchmark sets each mode's switches).
  c.pipeline.mode, c.pipeline.streamer = "async", True
  c.rl.update(config_checks.STREAMER_PPO)
  c.total_env_steps = 0  # The benchmark runs its own number of updates.
  c.bc.num_steps = 0
  c.log.progress = False
  return c
