"""PPO on one LIBERO task with MuJoCo on CPU: ``--config=configs/libero.py[:SUITE/INDEX]``.

The argument picks the task (default ``libero_spatial/0``) and sets
``env.max_episode_steps`` to that suite's limit (libero_spatial 220,
libero_object 280, libero_goal 300, libero_10 520, libero_90 400), because the
config checks compare ``model.chunk_len`` with it. Overriding ``env.task`` alone
keeps that number; set ``--config.env.max_episode_steps=0`` for the suite limit
(the adapter reads 0 as "the suite's"), as long as ``model.chunk_len`` passes the
checks. No scripted expert exists, so RL starts from the initial (or a loaded)
policy: ``bc.num_steps = 0``. Everything not set here is the default (``jaxvla/defaults.py``).
"""

import ml_collections

from jaxvla import defaults
from jaxvla.envs import libero as libero_env


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  task = arg or "libero_spatial/0"
  suite, _ = libero_env.parse_task(task)  # ValueError naming env.task and the suites
  c = defaults.get_config()
  c.total_env_steps = 2_000  # Budget: RL env steps of the whole run (settle steps excluded).
  c.num_envs = 2  # LIBERO instances.
  c.env_workers = 2  # One worker process per instance (MuJoCo is single-env).
  c.rollout_len = 4  # Chunk steps per env per training iteration.
  c.env = ml_collections.ConfigDict()
  c.env.name = "libero"  # Environment: LIBERO (robosuite / MuJoCo).
  c.env.task = task  # '<suite>/<index>', suite in libero_{spatial,object,goal,10,90}.
  c.env.image_size = 64  # Camera width and height (agentview and wrist).
  c.env.max_episode_steps = libero_env.SUITE_MAX_STEPS[suite]  # Time limit; 0: suite's.
  c.env.settle_steps = 10  # Uncounted no-op steps after each reset (objects settle).
  # 'full': LIBERO's rendering; 'fast': no multisampling nor reflections (a CPU step
  # ~2.8x cheaper, other images: jaxvla/envs/libero.py).
  c.env.render_quality = "full"
  c.env.group_size = 1  # GRPO groups: envs i // G share each episode's init (1: no groups).
  c.model.chunk_len = 10  # Actions per chunk (LIBERO default in the literature).
  c.model.max_token_len = 32  # Instruction tokens with <bos> (longest LIBERO one: 20).
  c.pipeline.micro_batch_segments = 1  # Env segments per queue item (divides num_envs).
  c.bc.num_steps = 0  # No scripted expert for LIBERO tasks.
  c.rl.num_minibatches = 2  # Minibatches per pass (num_envs * rollout_len = 8 chunks).
  c.eval.num_episodes = 2  # Evaluation episodes (each a full episode on CPU).
  c.eval.every_iters = 5  # Evaluate every N iterations.
  c.checkpoint.every_iters = 5  # Save every N iterations.
  return c
