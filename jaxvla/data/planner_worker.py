"""The process that runs ManiSkill3's motion-planning solutions (child of :mod:`maniskill_planner`).

mplib 0.1.1 (mani-skill 3.0.1's pin; 0.2.1 alike) is built against NumPy 1 and
crashes in ``mplib.Planner`` under NumPy 2, which jax needs. This process runs
with NumPy 1 first on its path (``launch/setup.sh`` installs it into
``.venv/planner-site``) and imports neither jax nor TFDS: only
NumPy, gymnasium, mani-skill and :mod:`jaxvla.envs.maniskill`.

``python -m jaxvla.data.planner_worker --tasks T0,T1,... --obs_mode M --label_mode L
--image_size N --max_episode_steps N --reward_mode R --seeds S0,S1,... --out DIR
[--noise S] [--state_keys K0,K1,...] [--robot R] [--render_meshes M] [--cameras C0,C1,...] [--critic_state_dim C]``
attempts each seed on its task (``--tasks`` holds one per seed) and, per attempt, writes ``DIR/<seed>.npz`` (``images [T, N_cam,
H, W, 3]``, ``state [T, S]``, ``actions [T, A]``, ``rewards [T]``, ``success``,
``clipped``, ``error``; with ``--critic_state_dim``, ``critic_state [T, C]``: each recorded
observation's simulation state, as the RL env gives the asymmetric critic) and then prints one JSON line ``{"seed": S, "file": ...}``
on the stdout it was given (the solutions' own prints go to stderr).

Every attempt runs in a freshly built scene (a reconfiguring reset), so an attempt's
recording depends on its seed alone, not on the attempts before it in the process nor on
how many processes share the seeds.

Recording (:class:`Recorder`): each step's observation before the planner's
action (with cameras, rendered for the recorded steps only: the planner's own steps run
without sensors, as the RL env's inside a chunk do), and the action as a label in the policy's control mode, as ManiSkill's
``replay_trajectory`` converts ``pd_joint_pos`` trajectories:

* ``pd_joint_delta_pos``: ``(target - qpos) / 0.1`` per arm joint (that controller
  drives to ``qpos + 0.1 * action``), so the label reproduces the planner's drive
  target exactly unless it is clipped to ``[-1, 1]`` (counted in ``clipped``);
* ``pd_joint_pos``: the target itself.

The gripper command (``1`` open, ``-1`` closed) is the same in both.

With ``--noise S`` (DART-style, as :class:`jaxvla.data.demonstrators.ExpertDemonstrator`'s
execution noise), the env executes the planner's arm targets plus Gaussian noise of
std ``S`` radians, while the label stays the clean target: in
``pd_joint_delta_pos`` it is measured from the perturbed joint positions, so the
recorded episodes show the way back to the planner's path from states off it. Labels are in
the policy's ``[-1, 1]`` space (the env adapter maps it onto the controller's
bounds). An attempt is recorded until the task reports success (the RL env
terminates there), ``max_episode_steps`` (a time-out) or the planner's end (it
gave up): only the first is a success, as in RL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import gymnasium as gym
import numpy as np

from jaxvla.envs import maniskill

PLANNER_CONTROL_MODE = "pd_joint_pos"  # What the solutions step.
LABEL_CONTROL_MODES = ("pd_joint_delta_pos", "pd_joint_pos")
_ARM_DOF = 7  # Panda arm joints; the 8th action is the gripper.
_DELTA_SCALE = 0.1  # pd_joint_delta_pos: radians per unit action (mani-skill's panda.py).


def solutions() -> dict:
  """ManiSkill task id -> its motion-planning ``solve(env, seed)`` (mani-skill's table)."""
  from mani_skill.examples.motionplanning.panda import \
      run  # pylint: disable=import-outside-toplevel
  return dict(run.MP_SOLUTIONS)


class Labeler:
  """Planner actions -> policy actions in ``[-1, 1]`` for ``label_mode``'s action bounds."""

  def __init__(self, label_mode: str, low: np.ndarray, high: np.ndarray):
    self.label_mode, self.low, self.high = label_mode, low, high
    self.clipped = 0  # Label entries clipped to [-1, 1].

  def __call__(self, target: np.ndarray, qpos: np.ndarray) -> np.ndarray:
    """``target [8]`` (joint targets + gripper) at joint positions ``qpos`` -> ``[8]``."""
    env_action = np.array(target, np.float64)
    if self.label_mode == "pd_joint_delta_pos":
      env_action[:_ARM_DOF] = (env_action[:_ARM_DOF] - qpos[:_ARM_DOF]) / _DELTA_SCALE
    unit = 2.0 * (env_action - self.low) / (self.high - self.low) - 1.0
    self.clipped += int(np.sum(np.abs(unit) > 1.0 + 1e-6))
    return np.clip(unit, -1.0, 1.0).astype(np.float32)


class Recorder(gym.Wrapper):
  """Records ``(raw observation, label, reward)`` per step the planner takes, until the
  episode ends for RL (success or the time limit); later steps run unrecorded."""

  def __init__(self, env, labeler: Labeler, max_episode_steps: int, noise: float = 0.0,
               rng: np.random.Generator | None = None, render: bool = False,
               critic_state_dim: int = 0):
    super().__init__(env)
    # rgb: each recorded observation also carries the simulation state the asymmetric
    # critic reads (maniskill.privileged_state), so the run's normalisation covers it.
    self.critic_state_dim = critic_state_dim
    self.labeler, self.max_episode_steps = labeler, max_episode_steps
    # rgb: the env steps without its cameras (the planner's path and whatever it runs
    # after the recording ends), and the cameras are rendered for the recorded steps only.
    self.render = render
    if render:
      maniskill.step_without_sensors(env)
    self.noise, self.rng = noise, rng or np.random.default_rng(0)
    self.steps: list[list] = []
    self.success = self.ended = False
    self._obs = None

  def reset(self, **kwargs):
    self._obs, info = self.env.reset(**kwargs)
    self.steps, self.success, self.ended = [], False, False
    return self._obs, info

  def step(self, action):
    if not self.ended:
      qpos = maniskill._np(self.env.unwrapped.agent.robot.get_qpos()).reshape(-1)
      obs = maniskill.rendered_obs(self.env) if self.render else self._obs
      if self.critic_state_dim:
        obs = maniskill.with_critic_state(obs, self.env, self.critic_state_dim)
      self.steps.append([obs, self.labeler(np.asarray(action).reshape(-1), qpos)])
    if self.noise > 0 and not self.ended:  # (the label above is the clean target)
      action = np.array(action, np.float64).reshape(-1)
      action[:_ARM_DOF] += self.rng.normal(0.0, self.noise, _ARM_DOF)
    obs, reward, terminated, truncated, info = self.env.step(action)
    if not self.ended:
      self.steps[-1].append(float(maniskill._np(reward).reshape(-1)[0]))
      self.success = bool(maniskill._np(info["success"]).reshape(-1)[0])
      self.ended = self.success or len(self.steps) >= self.max_episode_steps
    self._obs = obs
    return obs, reward, terminated, truncated, info


def main(argv: list[str]) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name in ("tasks", "obs_mode", "label_mode", "reward_mode", "out", "seeds"):
    p.add_argument(f"--{name}", required=True)
  p.add_argument("--image_size", type=int, required=True)
  p.add_argument("--max_episode_steps", type=int, required=True)
  p.add_argument("--noise", type=float, default=0.0)
  p.add_argument("--state_keys", default="")
  p.add_argument("--robot", default="")
  p.add_argument("--render_meshes", default="full")
  p.add_argument("--cameras", default="")
  p.add_argument("--critic_state_dim", type=int, default=0)
  a = p.parse_args(argv)
  protocol_out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
  sys.stdout = sys.stderr  # The solutions print; only this protocol goes to stdout.
  state_keys = maniskill.parse_names(a.state_keys)
  recorders: dict[str, tuple[Recorder, tuple[str, ...]]] = {}

  def recorder(task: str) -> tuple[Recorder, tuple[str, ...]]:
    """The task's recording env (built on its first attempt) and its camera names."""
    if task not in recorders:
      options = dict(robot=a.robot, render_meshes=a.render_meshes, cameras=a.cameras)
      policy_env = maniskill.make_gym_env(task, obs_mode="state", control_mode=a.label_mode,
                                          image_size=a.image_size, max_episode_steps=1,
                                          reward_mode=a.reward_mode, **options)
      space = policy_env.action_space  # Labels are mapped into [-1, 1] over these bounds.
      labeler = Labeler(a.label_mode, space.low.reshape(-1).astype(np.float64),
                        space.high.reshape(-1).astype(np.float64))
      policy_env.close()
      # The planner steps on past the RL time limit (the recorder stops there).
      env = Recorder(maniskill.make_gym_env(
          task, obs_mode=a.obs_mode, control_mode=PLANNER_CONTROL_MODE,
          image_size=a.image_size, max_episode_steps=10 * a.max_episode_steps,
          reward_mode=a.reward_mode, **options), labeler, a.max_episode_steps, a.noise,
          render=a.obs_mode == "rgb", critic_state_dim=a.critic_state_dim)
      env.reset(seed=0)
      raw = maniskill.rendered_obs(env) if env.render else env._obs  # pylint: disable=protected-access
      recorders[task] = env, maniskill.camera_names(raw, a.obs_mode)
    return recorders[task]

  seeds = [int(s) for s in a.seeds.split(",")]
  tasks = a.tasks.split(",")
  if len(tasks) != len(seeds):
    raise SystemExit(f"--tasks holds {len(tasks)} tasks for {len(seeds)} --seeds")
  for seed, task in zip(seeds, tasks):
    env, cameras = recorder(task)
    labeler = env.labeler
    solve = solutions()[task]
    error, before = "", labeler.clipped
    env.rng = np.random.default_rng(seed)  # (an attempt's noise depends on its seed alone)
    # Each attempt in a freshly built scene (about 0.2 CPU-s), as if first in its process:
    # after a plain reset PhysX still holds the episode before (its last contacts, which
    # ManiSkill's grasp tests read: PickCube's reset observed is_grasped = 1 with the
    # gripper open after an attempt that ended holding the cube, and from the contact
    # phase on, the push or the grasp, an attempt went otherwise). The solution's own
    # reset then starts the episode.
    env.reset(seed=seed, options=dict(reconfigure=True))
    try:
      solve(env, seed=seed)
    except Exception as e:  # pylint: disable=broad-except  (mplib and the solutions raise
      # assorted errors when no plan exists; ManiSkill's run.py counts them as failures)
      error = (str(e).splitlines() or [type(e).__name__])[0]
    file = os.path.join(a.out, f"{seed}.npz")
    steps = [s for s in env.steps if len(s) == 3]  # (a step that raised has no reward)
    if steps:
      raws, labels, rewards = zip(*steps)
      obs = maniskill.observation(list(raws), a.obs_mode, cameras, task, state_keys)
      np.savez(file, images=obs.images, state=obs.state, actions=np.stack(labels),
               rewards=np.asarray(rewards, np.float32), success=env.success,
               clipped=labeler.clipped - before, error=error,
               **({"critic_state": obs.critic_state} if a.critic_state_dim else {}))
    else:  # (the solution raised before its first step)
      np.savez(file, success=False, clipped=0, error=error or "no step taken")
    protocol_out.write(json.dumps(dict(seed=seed, file=file)) + "\n")
  for env, _ in recorders.values():
    env.close()


if __name__ == "__main__":
  main(sys.argv[1:])
