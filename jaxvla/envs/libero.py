"""LIBERO adapter: ``count`` single-env instances of one LIBERO task behind the VecEnv contract.

Each instance is a robosuite/LIBERO ``OffScreenRenderEnv`` (MuJoCo, one env per
instance; run one or a few per worker process, see :mod:`jaxvla.envs.pool`)
built with ``hard_reset=False`` (0.1 s resets instead of seconds). The task is
``"<suite>/<index>"``, e.g. ``"libero_spatial/0"``. This class owns:

* episodes: every reset restores one of the suite's fixed init states (env
  ``i``'s ``k``-th episode uses ``(seed + g + num_groups * k) % num_init_states``,
  ``g = i // group_size`` its GRPO group; with ``group_size`` 1, ``g = i``: the
  members of a group start each ``k``-th episode from the same init state; the
  fixtures, whose poses LIBERO samples at each reset outside the init states, are
  placed from the same number), then runs ``settle_steps`` no-op steps with the
  gripper open, which are not counted as env steps (objects drop onto the table);
* observations: the ``agentview`` and ``robot0_eye_in_hand`` cameras turned the
  right way up (LIBERO renders them upside down; both axes are flipped, as in
  openpi's LIBERO example), state = end-effector position (3), end-effector
  axis-angle (3) and gripper finger positions (2), and the task's language
  instruction;
* actions: 7-dim OSC deltas plus gripper (``-1`` open, ``+1`` close), clipped to
  ``[-1, 1]`` (the controller's own range);
* rendering: LIBERO's own (``render_quality="full"``: 4x multisampling and the floor's
  reflection), or ``"fast"``, both off: a step on a CPU (Mesa's llvmpipe) costs about
  0.07 s instead of 0.19 at 32 px, and the images differ (edges, the floor), so a policy
  trained or evaluated on LIBERO's renders should keep ``"full"``;
* rewards and ends: LIBERO's ``done`` is task success: reward 1 and terminated;
  episodes are truncated at the suite's time limit (``max_episode_steps``).
"""

from __future__ import annotations

import math
import os

import ml_collections
import numpy as np

from jaxvla.envs import instances, protocol

# Time limits in env steps used in the literature (openpi / RLinf), settle steps excluded.
SUITE_MAX_STEPS = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
CAMERAS = ("agentview_image", "robot0_eye_in_hand_image")
STATE_DIM = 8
ACTION_DIM = 7
SETTLE_ACTION = np.array([0.0] * 6 + [-1.0])  # no motion, gripper open
RENDER_QUALITIES = ("full", "fast")  # (the first: LIBERO's own, the default)


def parse_task(task: str) -> tuple[str, int]:
  """Splits ``"<suite>/<index>"`` into ``(suite, index)``.

  Raises:
    ValueError: naming ``env.task`` and the valid suites when malformed.
  """
  suite, sep, index = str(task).partition("/")
  if not sep or suite not in SUITE_MAX_STEPS or not index.isdigit():
    raise ValueError(f"env.task={task!r} must be '<suite>/<index>' with suite one of "
                     f"{sorted(SUITE_MAX_STEPS)}, e.g. 'libero_spatial/0'")
  return suite, int(index)


def suite_tasks(suite: str) -> list[str]:
  """Every task of ``suite`` as ``'<suite>/<index>'``, in LIBERO's order.

  Raises:
    ValueError: naming the suite and the valid ones when it is not a suite.
  """
  if suite not in SUITE_MAX_STEPS:
    raise ValueError(f"--suite={suite!r} is not a LIBERO suite; choose one of "
                     f"{sorted(SUITE_MAX_STEPS)}")
  from libero.libero import benchmark  # pylint: disable=import-outside-toplevel
  return [f"{suite}/{i}" for i in range(benchmark.get_benchmark_dict()[suite]().get_num_tasks())]


def quat2axisangle(quat: np.ndarray) -> np.ndarray:
  """Quaternion ``(x, y, z, w)`` ``[4]`` -> axis-angle ``[3]`` (as robosuite / openpi)."""
  quat = np.asarray(quat, np.float64).copy()
  quat[3] = min(max(quat[3], -1.0), 1.0)
  den = math.sqrt(1.0 - quat[3] * quat[3])
  if math.isclose(den, 0.0):
    return np.zeros(3)
  return quat[:3] * 2.0 * math.acos(quat[3]) / den


def spec_from_config(config: ml_collections.ConfigDict) -> protocol.EnvSpec:
  """The spec of the env :func:`make` builds from the ``env`` sub-config, without
  building it (nor importing LIBERO): a policy server or an export check needs it
  on machines without the simulator."""
  suite, _ = parse_task(config.task)
  return protocol.EnvSpec(
      camera_names=tuple(c[:-len("_image")] for c in CAMERAS),
      image_shape=(config.image_size, config.image_size, 3), state_dim=STATE_DIM,
      action_dim=ACTION_DIM, max_episode_steps=config.max_episode_steps or SUITE_MAX_STEPS[suite])


class LiberoEnv(instances.InstanceBatch):
  """``count`` instances of one LIBERO task (implements :class:`protocol.VecEnv`).

  Args:
    task: ``"<suite>/<index>"``, suite in :data:`SUITE_MAX_STEPS`.
    count: number of instances in this process.
    image_size: camera width and height.
    max_episode_steps: time limit in env steps; ``0`` takes the suite's limit.
    settle_steps: uncounted no-op steps after each reset.
    seed: offset of the init-state indices (see the module docstring).
    group_size: GRPO group size G; envs ``i // G`` share every episode's init state.
    first_env_id: global id of this batch's instance 0 (pool workers).
    total_envs: envs in the whole run (default: this batch is the run).
    render_quality: ``"full"`` (LIBERO's) or ``"fast"`` (see the module docstring).
  """

  def __init__(self, task: str, count: int, *, image_size: int = 64,
               max_episode_steps: int = 0, settle_steps: int = 10, seed: int = 0,
               group_size: int = 1, first_env_id: int = 0, total_envs: int | None = None,
               render_quality: str = "full"):
    suite_name, index = parse_task(task)
    if max_episode_steps < 0 or settle_steps < 0:
      raise ValueError(f"env.max_episode_steps={max_episode_steps} and "
                       f"env.settle_steps={settle_steps} must be >= 0")
    if render_quality not in RENDER_QUALITIES:
      raise ValueError(f"env.render_quality={render_quality!r} must be one of "
                       f"{list(RENDER_QUALITIES)}")
    self.num_envs = count
    self._init_groups(group_size, first_env_id, total_envs)
    # Imported here: LIBERO reads its config file and robosuite logs at import time.
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv

    suite = benchmark.get_benchmark_dict()[suite_name]()
    if not 0 <= index < suite.get_num_tasks():
      raise ValueError(f"env.task={task!r}: index must be in [0, {suite.get_num_tasks()}) "
                       f"for suite {suite_name!r}")
    lib_task = suite.get_task(index)
    bddl = os.path.join(get_libero_path("bddl_files"), lib_task.problem_folder,
                        lib_task.bddl_file)
    self.task_name = task
    self.instruction = str(lib_task.language)
    self.settle_steps = settle_steps
    self._init_states = np.asarray(suite.get_task_init_states(index))  # [num_inits, D]
    self._envs = []
    for i in range(count):
      env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=image_size,
                               camera_widths=image_size, hard_reset=False)
      env.seed(int(seed + i) % 2**32)
      if render_quality == "fast":
        _fast_render(env)
      self._envs.append(env)
    self.spec = spec_from_config(ml_collections.ConfigDict(dict(
        task=task, image_size=image_size, max_episode_steps=max_episode_steps)))
    self._seed = seed
    self._reset_all()

  def init_state_index(self, i: int, episode: int | None = None) -> int:
    """Index of the init state of env ``i``'s episode ``episode`` (default: the current)."""
    return self.episode_index(i, episode) % len(self._init_states)

  def _reset_one(self, i: int) -> dict:
    env = self._envs[i]
    # LIBERO's reset places the fixtures (fixed bodies: cabinets, stoves; their poses
    # are not in the init states) with the global np.random. Seed it per episode, so the
    # members of a group see the same scene, and leave the caller's stream as it was.
    saved = np.random.get_state()
    np.random.seed(self.episode_index(i) % 2**32)
    try:
      env.reset()
    finally:
      np.random.set_state(saved)
    obs = env.set_init_state(self._init_states[self.init_state_index(i)])
    for _ in range(self.settle_steps):
      obs, _, _, _ = env.step(SETTLE_ACTION)
    return obs

  def _step_one(self, i: int, action: np.ndarray):
    obs, _, done, _ = self._envs[i].step(action.astype(np.float64))
    # LIBERO's done is the task's success predicate: reward 1 and terminated.
    return obs, float(done), bool(done), self.t[i] >= self.spec.max_episode_steps, bool(done)

  @staticmethod
  def _state(obs: dict) -> np.ndarray:
    """``float32 [8]``: eef pos (3), eef axis-angle (3), gripper qpos (2)."""
    return np.concatenate([np.asarray(obs["robot0_eef_pos"]),
                           quat2axisangle(obs["robot0_eef_quat"]),
                           np.asarray(obs["robot0_gripper_qpos"])]).astype(np.float32)

  def _observe(self, raw: list, env_ids: list[int]) -> protocol.Observation:
    del env_ids  # (one task per batch)
    images = np.stack([np.stack([np.asarray(o[c])[::-1, ::-1] for c in CAMERAS])
                       for o in raw]).astype(np.uint8)  # [b, 2, H, W, 3]
    return protocol.Observation(
        images=np.ascontiguousarray(images), state=np.stack([self._state(o) for o in raw]),
        instruction=np.array([self.instruction] * len(raw), dtype=object))


def _fast_render(env) -> None:
  """Turns multisampling and reflections off in ``env``'s offscreen renderer.

  robosuite 1.4 builds the render context once (``hard_reset=False`` keeps it), with
  the model's sample count: the context is rebuilt after setting it, as robosuite's
  own ``update_offscreen_size`` does."""
  import mujoco  # pylint: disable=import-outside-toplevel
  sim = env.env.sim
  sim.model._model.vis.quality.offsamples = 0
  ctx = sim._render_context_offscreen
  ctx.gl_ctx.make_current()
  ctx.con.free()
  ctx._set_mujoco_context_and_buffers()
  ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0


def make(config: ml_collections.ConfigDict, num_envs: int, seed: int, *,
         group_size: int | None = None, first_env_id: int = 0,
         total_envs: int | None = None) -> LiberoEnv:
  """Builds ``num_envs`` LIBERO instances in this process from the ``env`` sub-config.

  ``group_size`` None reads ``env.group_size`` (1 when absent).
  """
  return LiberoEnv(config.task, num_envs, image_size=config.image_size,
                   max_episode_steps=config.max_episode_steps,
                   settle_steps=config.settle_steps, seed=seed,
                   group_size=config.group_size if group_size is None else group_size,
                   first_env_id=first_env_id, total_envs=total_envs,
                   # (absent from configs written before the key existed: LIBERO's own)
                   render_quality=config.get("render_quality", RENDER_QUALITIES[0]))
