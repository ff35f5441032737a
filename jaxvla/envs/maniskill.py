"""ManiSkill3 adapter on the CPU simulator: ``count`` single-env instances behind the VecEnv contract.

ManiSkill3's CPU backend simulates one env per instance (and is best run one
instance per process: see :mod:`jaxvla.envs.pool`). Each instance is a
``gymnasium.make(task, sim_backend="cpu", num_envs=1)`` env; this class steps
them one chunk at a time, auto-resets finished episodes, and maps observations to
the common structure: RGB per camera (``obs_mode="rgb"``) or no image
(``obs_mode="state"``: a 1x1 black placeholder keeps shapes uniform), state =
the agent's ``qpos`` and ``qvel`` and the task's ``extra`` fields (``state``
mode: ManiSkill's flat state vector), or the fields ``env.state_keys`` names, and a
fixed instruction per task. Actions in ``[-1, 1]`` are mapped linearly onto the
controller's action bounds.

With cameras, only the observations the policy reads are rendered: a reset's, a
chunk's last and a truncated episode's final one. The control steps inside a chunk
run with ManiSkill's ``state_dict`` observations (no sensors), and the cameras are
rendered from the state reached: the same image as rendering at every step (tested),
for one render per chunk instead of one per control step, most of an RGB step's cost.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from jaxvla.envs import instances, lowpoly, protocol

# Instructions for the tasks that run offline (no asset download).
INSTRUCTIONS = {
    "PickCube-v1": "pick up the red cube and move it to the goal",
    "PushCube-v1": "push the cube to the goal",
    "StackCube-v1": "stack the red cube on the green cube",
    "PullCube-v1": "pull the cube to the goal",
    "PokeCube-v1": "poke the cube with the peg",
    "PlaceSphere-v1": "place the sphere into the bin",
    "RollBall-v1": "roll the ball to the goal",
    "LiftPegUpright-v1": "lift the peg upright",
    "PegInsertionSide-v1": "insert the peg into the hole",
    "PushT-v1": "push the t block onto the target",
}
OBS_MODES = ("rgb", "state")
# ManiSkill's own reward modes, and 'sparse_shaped': the sparse success reward plus the
# change of ManiSkill's normalised dense reward used as a potential (see ManiSkillCPU).
REWARD_MODES = ("sparse", "dense", "normalized_dense", "sparse_shaped")
CONTROL_MODES = ("pd_joint_delta_pos", "pd_ee_delta_pose", "pd_joint_pos")
# What a control step inside a chunk observes when the cameras are rendered per chunk:
# the agent's and the task's state, no sensors (ManiSkill's own obs mode of that name).
_STEP_OBS_MODE = "state_dict"
# The state fields ManiSkill's rgb mode gives (the agent's, then the task's ``extra`` ones
# for the offline tasks): proprioception, the TCP pose and where the task's goal is. The
# object's pose and the object-to-TCP / object-to-goal vectors are in its state modes
# only, for the camera to show: a pixel observation must not hold them.
PIXEL_STATE_FIELDS = ("qpos", "qvel", "tcp_pose", "is_grasped", "goal_pos", "bin_pos")
# Fields a task may lack, zero-padded to these sizes when ``env.state_keys`` names them,
# so that several tasks share one state layout (PushCube's rgb mode has no goal_pos).
PADDED_FIELDS = {"goal_pos": 3, "is_grasped": 1, "bin_pos": 3}
# Where a completed raw observation carries its critic state (privileged_state).
_CRITIC_KEY = "jaxvla_critic_state"


def _np(x) -> np.ndarray:
  """Torch tensor (CPU) or array -> NumPy."""
  return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def simulator_reward_mode(reward_mode: str) -> str:
  """The reward mode ManiSkill simulates for ``env.reward_mode`` (one of
  :data:`REWARD_MODES`): 'sparse_shaped' is computed from 'normalized_dense'.

  Raises:
    ValueError: naming ``env.reward_mode``.
  """
  if reward_mode not in REWARD_MODES:
    raise ValueError(f"env.reward_mode={reward_mode!r} is not one of {REWARD_MODES}")
  return "normalized_dense" if reward_mode == "sparse_shaped" else reward_mode


def make_gym_env(task: str, *, obs_mode: str, control_mode: str, image_size: int,
                 max_episode_steps: int, reward_mode: str, robot: str = "",
                 render_meshes: str = "full", cameras: str = ""):
  """One ManiSkill3 CPU env (``num_envs=1``) as every jaxvla user of the task builds it;
  its reward is ManiSkill's :func:`simulator_reward_mode` of ``reward_mode``, its robot
  ``robot`` ('': the task's default), drawn with ``render_meshes``
  (:func:`jaxvla.envs.lowpoly.use_panda_meshes`), and in ``rgb`` mode the cameras
  ``cameras`` names (comma-separated; '': all of the task's and the robot's,
  :func:`keep_cameras`).

  Raises:
    ValueError: naming ``env.task``, ``env.obs_mode``, ``env.control_mode``,
      ``env.reward_mode``, ``env.render_meshes`` or ``env.cameras``.
  """
  check_task(task)
  if obs_mode not in OBS_MODES:
    raise ValueError(f"env.obs_mode={obs_mode!r} is not one of {OBS_MODES}")
  if control_mode not in CONTROL_MODES:
    raise ValueError(f"env.control_mode={control_mode!r} is not one of {CONTROL_MODES}")
  import gymnasium as gym
  import mani_skill.envs  # noqa: F401  (registers the tasks)

  lowpoly.use_panda_meshes(render_meshes)

  kwargs = dict(obs_mode=obs_mode, sim_backend="cpu", num_envs=1, control_mode=control_mode,
                reward_mode=simulator_reward_mode(reward_mode),
                max_episode_steps=max_episode_steps)
  if robot:
    kwargs["robot_uids"] = robot
  if obs_mode == "rgb":
    kwargs["sensor_configs"] = dict(width=image_size, height=image_size)
  else:
    kwargs["render_backend"] = "none"
  env = gym.make(task, **kwargs)
  selected = parse_names(cameras)
  if obs_mode == "rgb" and selected:
    keep_cameras(env, selected)
  return env


def keep_cameras(env, cameras: tuple[str, ...]) -> None:
  """Makes ``env`` observe through ``cameras`` alone (a subset of its sensors' uids,
  e.g. ``("hand_camera",)`` of ``panda_wristcam``'s ``base_camera`` and
  ``hand_camera``), now and after every reconfiguring reset. The others are never
  captured, so they cost nothing per observation (a render is mostly a fixed cost per
  camera); they stay in the scene, built once per reconfigure.

  Raises:
    ValueError: naming ``env.cameras`` when a camera is not one of the env's.
  """
  u = env.unwrapped
  built = u._setup_sensors  # pylint: disable=protected-access

  def select() -> None:
    missing = [c for c in cameras if c not in u._sensors]  # pylint: disable=protected-access
    if missing:
      raise ValueError(f"config.env.cameras={','.join(cameras)!r}: {missing} is not a camera "
                       f"of {type(u).__name__} with this robot (it has "
                       f"{sorted(u._sensors)})")  # pylint: disable=protected-access
    u._sensors = {c: s for c, s in u._sensors.items() if c in cameras}  # pylint: disable=protected-access
    u.scene.sensors = u._sensors  # pylint: disable=protected-access

  def setup_sensors(options: dict) -> None:  # ManiSkill calls it on each reconfigure.
    built(options)
    select()

  u._setup_sensors = setup_sensors  # pylint: disable=protected-access
  select()


def tasks(task: str) -> tuple[str, ...]:
  """``env.task``'s tasks: one env id, or several joined by commas (one env pool)."""
  return tuple(t.strip() for t in task.split(","))


def parse_names(names: str) -> tuple[str, ...]:
  """A comma-separated list of names (``env.state_keys``, ``env.cameras``; '' for none,
  i.e. ManiSkill's own) as a tuple."""
  return tuple(k.strip() for k in names.split(",") if k.strip())


def check_task(task: str) -> None:
  """Raises ``ValueError`` naming ``env.task`` when ``task`` is not an offline task."""
  if task not in INSTRUCTIONS:
    raise ValueError(f"config.env.task: {task!r} is not one of the offline ManiSkill3 tasks "
                     f"{sorted(INSTRUCTIONS)}")


def check_config(env: ml_collections.ConfigDict) -> None:
  """The ``env`` sub-config's ManiSkill3 rules, before any simulator is built.

  Raises:
    ValueError: naming ``env.task`` (unknown, repeated, or several tasks without one
      state layout), ``env.state_keys`` (a field a camera policy must not see) or
      ``env.cameras`` (in ``state`` mode, or a camera named twice).
  """
  names = tasks(env.task)
  for t in names:
    check_task(t)
  if len(set(names)) != len(names):
    raise ValueError(f"config.env.task={env.task!r} names a task twice")
  keys = parse_names(env.get("state_keys", ""))
  if len(names) > 1 and (env.obs_mode != "rgb" or not keys):
    raise ValueError(f"config.env.task={env.task!r}: several tasks share one policy only with "
                     f"env.obs_mode='rgb' and env.state_keys naming one state layout")
  if env.get("critic_state_dim", 0) and env.obs_mode != "rgb":
    raise ValueError(f"config.env.critic_state_dim={env.critic_state_dim}: a critic state is "
                     f"for camera policies (env.obs_mode='rgb'); a state policy's critic "
                     f"already sees the whole state")
  cameras = parse_names(env.get("cameras", ""))
  if cameras and env.obs_mode != "rgb":
    raise ValueError(f"config.env.cameras={env.cameras!r} selects cameras of "
                     f"env.obs_mode='rgb'; env.obs_mode={env.obs_mode!r} renders none")
  if len(set(cameras)) != len(cameras):
    raise ValueError(f"config.env.cameras={env.cameras!r} names a camera twice")
  if env.obs_mode == "rgb":
    leaked = [k for k in keys if k not in PIXEL_STATE_FIELDS]
    if leaked:
      raise ValueError(f"config.env.state_keys={env.state_keys!r}: {leaked} is not a field of "
                       f"ManiSkill's rgb observation {PIXEL_STATE_FIELDS}; a pixel policy "
                       f"must find the objects in its cameras, not in its state")


def step_without_sensors(env) -> None:
  """Makes an rgb env's ``reset`` and ``step`` observe without rendering its cameras
  (ManiSkill's ``state_dict`` observations); :func:`rendered_obs` renders on demand."""
  env.unwrapped._obs_mode = _STEP_OBS_MODE  # pylint: disable=protected-access


def rendered_obs(env) -> dict:
  """The rgb observation of a :func:`step_without_sensors` env's current state: what its
  ``step`` would have returned with the cameras on (the same images, tested)."""
  env = env.unwrapped
  # ManiSkill picks what get_obs returns by this private field (its constructor's
  # obs_mode); its public get_obs renders the sensors in "rgb" mode.
  env._obs_mode = "rgb"  # pylint: disable=protected-access
  try:
    return env.get_obs()
  finally:
    env._obs_mode = _STEP_OBS_MODE  # pylint: disable=protected-access


def privileged_state(env, size: int) -> np.ndarray:
  """``float32 [size]``: ManiSkill's simulation state of the env (``get_state``: every
  actor's pose and velocities, the robot's root pose, joint positions and velocities;
  70 values for PushCube, PickCube and StackCube), zero-padded to ``size``. For the
  critic alone (``Observation.critic_state``).

  Raises:
    ValueError: the task's state is longer than ``size`` (``env.critic_state_dim``).
  """
  flat = _np(env.unwrapped.get_state()).reshape(-1).astype(np.float32)
  if flat.size > size:
    raise ValueError(f"config.env.critic_state_dim={size}: {type(env.unwrapped).__name__}'s "
                     f"simulation state has {flat.size} values")
  return np.pad(flat, (0, size - flat.size))


def with_critic_state(raw: dict, env, size: int) -> dict:
  """The raw rgb observation ``raw`` of ``env`` with its :func:`privileged_state` beside
  it, where :func:`observation` finds it (``Observation.critic_state``)."""
  return {**raw, _CRITIC_KEY: privileged_state(env, size)}


def state_vector(obs, keys: tuple[str, ...] = ()) -> np.ndarray:
  """``float32 [S]``: the flat state of a ``state`` observation, or of an rgb one the
  fields ``keys`` names in that order (missing :data:`PADDED_FIELDS` as zeros), by
  default the agent's ``qpos``/``qvel`` and the task's ``extra`` fields, sorted.

  Raises:
    ValueError: an rgb observation holds a field outside :data:`PIXEL_STATE_FIELDS`
      that would go into the state, or lacks a named field that cannot be padded.
  """
  if not isinstance(obs, dict):  # obs_mode="state": already the flat state [1, D]
    return _np(obs).reshape(-1).astype(np.float32)
  fields = {**obs["agent"], **obs["extra"]}
  if not keys:
    keys = tuple(sorted(obs["agent"])) + tuple(sorted(obs["extra"]))
  parts = []
  for k in keys:
    if k not in PIXEL_STATE_FIELDS:
      raise ValueError(f"the rgb observation's state field {k!r} is not one of "
                       f"{PIXEL_STATE_FIELDS}; name the fields with env.state_keys")
    if k in fields:
      parts.append(_np(fields[k]).reshape(-1))
    elif k in PADDED_FIELDS:
      parts.append(np.zeros(PADDED_FIELDS[k]))
    else:
      raise ValueError(f"config.env.state_keys names {k!r}, which this task's rgb observation "
                       f"lacks (it has {sorted(fields)})")
  return np.concatenate(parts).astype(np.float32)


def camera_names(obs, obs_mode: str) -> tuple[str, ...]:
  """The cameras of a raw observation (``("none",)`` in ``state`` mode: the placeholder)."""
  return tuple(sorted(obs["sensor_data"])) if obs_mode == "rgb" else ("none",)


def observation(raw: list, obs_mode: str, cameras: tuple[str, ...], task: str | list[str],
                state_keys: tuple[str, ...] = ()) -> protocol.Observation:
  """A list of raw observations ``[b]`` of ``task`` (one, or one per observation) as
  jaxvla's :class:`protocol.Observation` ``[b]`` (the state of :func:`state_vector`)."""
  row_tasks = [task] * len(raw) if isinstance(task, str) else list(task)
  if obs_mode == "rgb":
    images = np.stack([np.stack([_np(o["sensor_data"][c]["rgb"])[0] for c in cameras])
                       for o in raw]).astype(np.uint8)
  else:
    images = np.zeros((len(raw), 1, 1, 1, 3), np.uint8)
  critic = (np.stack([o[_CRITIC_KEY] for o in raw]) if raw and isinstance(raw[0], dict)
            and _CRITIC_KEY in raw[0] else None)
  return protocol.Observation(images=images, critic_state=critic,
                              state=np.stack([state_vector(o, state_keys) for o in raw]),
                              instruction=np.array([INSTRUCTIONS[t] for t in row_tasks], dtype=object))


class ManiSkillCPU(instances.InstanceBatch):
  """``count`` ManiSkill3 CPU envs (implements :class:`protocol.VecEnv`).

  Args:
    task: a ManiSkill3 env id, e.g. ``"PickCube-v1"``, or several joined by commas: one
      policy for several tasks. Task ``g % n`` of the ``n`` runs in GRPO group ``g``
      (with ``group_size`` 1, in env ``g``); the instruction tells them apart.
    count: number of instances in this process.
    obs_mode: ``"rgb"`` or ``"state"``.
    control_mode: one of :data:`CONTROL_MODES` (``"pd_joint_pos"``: absolute joint
      targets, ``[-1, 1]`` spanning the joint limits).
    image_size: camera width and height (``rgb``).
    max_episode_steps: time limit in env steps.
    reward_mode: one of :data:`REWARD_MODES`. ManiSkill's ``"sparse"`` is 1 on success,
      which ends the episode. ``"sparse_shaped"`` adds potential-based shaping (Ng et
      al. 1999) to it: ``phi(s') - phi(s)`` per step, with ``phi`` ManiSkill's normalised
      dense reward of the state reached (1 at success, 0 before the first step). An
      episode's shaping sums to ``phi`` of where it ended, so a success (1 + 1) always
      beats an episode that times out near the goal (< 1), and hovering earns nothing
      (the plain dense reward pays up to 0.8 per step for it: docs/results/maniskill.md).
    seed: episode seeds are ``seed + group + num_groups * episode number``
      (:meth:`episode_index`; with ``group_size`` 1 the group is the env index).
    group_size: GRPO group size G; envs ``i // G`` share every episode's seed.
    first_env_id: global id of this batch's instance 0 (pool workers).
    total_envs: envs in the whole run (default: this batch is the run).
    render_every_step: render the cameras at every control step, as ManiSkill's own
      ``step`` does (``rgb`` only; for comparisons: the default renders what the policy
      reads, the same images).
    state_keys: ``rgb``: the state's fields in order (:func:`state_vector`; empty:
      ManiSkill's own). Several tasks need one layout.
    robot: ManiSkill's ``robot_uids`` ('': each task's default; StackCube's is
      ``panda_wristcam``, a Panda with a second, wrist camera).
    render_meshes: ``"lowpoly"`` or ``"full"`` (:mod:`jaxvla.envs.lowpoly`).
    cameras: ``rgb``: the cameras the policy reads, comma-separated (:func:`keep_cameras`;
      '': all of the task's and the robot's).
    instruction: every env's instruction ('': each task's own, :data:`INSTRUCTIONS`); a
      control for a policy of several tasks: a task's episodes under another's words.
    critic_state_dim: ``rgb``: size of each observation's ``critic_state``, ManiSkill's
      full state (:func:`privileged_state`) for the critic alone (0: none).
  """

  def __init__(self, task: str, count: int, *, obs_mode: str = "rgb",
               control_mode: str = "pd_joint_delta_pos", image_size: int = 64,
               max_episode_steps: int = 50, reward_mode: str = "sparse", seed: int = 0,
               group_size: int = 1, first_env_id: int = 0, total_envs: int | None = None,
               render_every_step: bool = False, state_keys: tuple[str, ...] = (),
               robot: str = "", render_meshes: str = "full", cameras: str = "",
               instruction: str = "", critic_state_dim: int = 0):
    self.num_envs = count
    self._init_groups(group_size, first_env_id, total_envs)
    names = tasks(task)
    self.task_name = task
    self.env_tasks = [names[g % len(names)] for g in self._groups]  # Each instance's task.
    self.obs_mode = obs_mode
    self._state_keys = tuple(state_keys)
    self._instruction = instruction
    self._critic_dim = critic_state_dim
    self._shaped = reward_mode == "sparse_shaped"
    self._phi = np.zeros(count)  # sparse_shaped: the potential of each env's state
    self._envs = [make_gym_env(t, obs_mode=obs_mode, control_mode=control_mode,
                               image_size=image_size, max_episode_steps=max_episode_steps,
                               reward_mode=reward_mode, robot=robot,
                               render_meshes=render_meshes, cameras=cameras)
                  for t in self.env_tasks]
    # Steps observe without sensors; _complete renders the observations the policy reads.
    self._render_in_complete = obs_mode == "rgb" and not render_every_step
    if self._render_in_complete:
      for env in self._envs:
        step_without_sensors(env)
    space = self._envs[0].action_space
    self._low, self._high = space.low.reshape(-1), space.high.reshape(-1)
    self._seed = seed
    self._reset_all()
    first = self._last[0]
    shape = (image_size, image_size, 3) if obs_mode == "rgb" else (1, 1, 3)
    self.spec = protocol.EnvSpec(camera_names=camera_names(first, obs_mode), image_shape=shape,
                                 state_dim=state_vector(first, self._state_keys).shape[0],
                                 action_dim=self._low.shape[0],
                                 max_episode_steps=max_episode_steps,
                                 critic_state_dim=critic_state_dim)

  def _reset_one(self, i: int) -> dict:
    obs, _ = self._envs[i].reset(seed=self.episode_index(i))
    self._phi[i] = 0.0
    return obs

  def _complete(self, i: int, raw):
    """The observation of instance ``i``'s current state with its cameras rendered (and
    its critic state)."""
    if self._render_in_complete:
      raw = rendered_obs(self._envs[i])
    if self._critic_dim:
      raw = with_critic_state(raw, self._envs[i], self._critic_dim)
    return raw

  def _map_actions(self, actions: np.ndarray) -> np.ndarray:
    return self._low + (np.clip(actions, -1.0, 1.0) + 1.0) * 0.5 * (self._high - self._low)

  def _step_one(self, i: int, action: np.ndarray):
    obs, r, term, trunc, info = self._envs[i].step(action[None])
    first = lambda x: _np(x).reshape(-1)[0]
    reward, success = float(first(r)), bool(first(info["success"]))
    if self._shaped:  # r is the normalised dense reward: the new state's potential
      reward, self._phi[i] = float(success) + reward - self._phi[i], reward
    return obs, reward, bool(first(term)), bool(first(trunc)), success

  def _observe(self, raw: list, env_ids: list[int]) -> protocol.Observation:
    obs = observation(raw, self.obs_mode, self.spec.camera_names,
                      [self.env_tasks[i] for i in env_ids], self._state_keys)
    if self._instruction:
      obs.instruction[:] = self._instruction
    return obs


def make(config: ml_collections.ConfigDict, num_envs: int, seed: int, *,
         group_size: int | None = None, first_env_id: int = 0,
         total_envs: int | None = None) -> ManiSkillCPU:
  """Builds ``num_envs`` CPU instances in this process from the ``env`` sub-config.

  ``group_size`` None reads ``env.group_size`` (1 when absent).
  """
  return ManiSkillCPU(config.task, num_envs, obs_mode=config.obs_mode,
                      control_mode=config.control_mode, image_size=config.image_size,
                      max_episode_steps=config.max_episode_steps,
                      reward_mode=config.reward_mode, seed=seed,
                      group_size=config.group_size if group_size is None
                      else group_size, first_env_id=first_env_id, total_envs=total_envs,
                      render_every_step=config.get("render_every_step", False),
                      state_keys=parse_names(config.get("state_keys", "")),
                      instruction=config.get("instruction", ""),
                      critic_state_dim=config.get("critic_state_dim", 0), **gym_options(config))


def gym_options(config: ml_collections.ConfigDict) -> dict:
  """The ``env`` sub-config's robot, render meshes and cameras, as :func:`make_gym_env`
  takes them."""
  return dict(robot=config.get("robot", ""), render_meshes=config.get("render_meshes", "full"),
              cameras=config.get("cameras", ""))
