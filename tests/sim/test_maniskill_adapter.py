"""ManiSkill3 through the jaxvla env contract and the worker pool (CPU). The training loop
on ManiSkill3, from planner demonstrations through SFT and RL, is the learning step's
``tests/test_learning.py::test_sft_then_rl_raises_maniskill_success``."""

import os

import numpy as np
import pytest

from configs import maniskill as maniskill_config
from jaxvla.data import config as data_config
from jaxvla.data import demonstrators, loader, norm_stats
from jaxvla.envs import make_vec_env
from jaxvla.envs import maniskill as maniskill_env

pytestmark = [pytest.mark.sim, pytest.mark.timeout(600)]


def test_pool_rgb_chunks_shapes_and_rewards():
  c = maniskill_config.get_config()
  env = make_vec_env(c.env, 2, seed=0, num_workers=2, step_timeout_s=120)
  try:
    assert env.spec.image_shape == (64, 64, 3) and env.spec.action_dim == 8
    obs = env.reset(0)
    assert obs.images.shape == (2, len(env.spec.camera_names), 64, 64, 3)
    assert obs.images.dtype == np.uint8 and obs.images.std() > 1.0  # rendered, not blank
    assert obs.state.shape == (2, env.spec.state_dim) and np.isfinite(obs.state).all()
    assert obs.instruction[0] == "pick up the red cube and move it to the goal"
    for _ in range(2):
      r = env.step_chunk(np.random.default_rng(0).uniform(-1, 1, (2, 5, 8)))
      assert r.reward.shape == (2,) and np.isin(r.reward, [0.0, 1.0]).all()  # sparse
      assert r.steps.tolist() == [5, 5]
      assert not r.done.any()  # 10 of 50 steps, random actions do not succeed
    with pytest.raises(ValueError, match="action_dim=8"):
      env.step_chunk(np.zeros((2, 5, 7)))
  finally:
    env.close()


def test_per_chunk_rendering_gives_the_images_of_rendering_every_step():
  """The cameras rendered only where the policy reads them (a reset, a chunk's last
  step, a truncated episode's final step) give exactly what rendering at every control
  step gives at the same states: images, states, rewards, episode ends and final
  observations, over chunks that cross a time limit (12 steps: the third chunk's second
  step truncates) and a reset."""
  kw = dict(obs_mode="rgb", image_size=32, max_episode_steps=12, reward_mode="sparse_shaped")
  per_chunk = maniskill_env.ManiSkillCPU("PushCube-v1", 2, **kw)
  every_step = maniskill_env.ManiSkillCPU("PushCube-v1", 2, render_every_step=True, **kw)
  try:
    a, b = per_chunk.reset(3), every_step.reset(3)
    np.testing.assert_array_equal(a.images, b.images)
    assert a.images.std() > 1.0  # rendered, not blank
    np.testing.assert_array_equal(a.state, b.state)
    rng = np.random.default_rng(0)
    truncations = 0
    for _ in range(6):
      actions = rng.uniform(-1, 1, (2, 5, per_chunk.spec.action_dim))
      ra, rb = per_chunk.step_chunk(actions), every_step.step_chunk(actions)
      np.testing.assert_array_equal(ra.obs.images, rb.obs.images)
      np.testing.assert_array_equal(ra.obs.state, rb.obs.state)
      for field in ("reward", "terminated", "truncated", "success", "steps", "has_final_obs"):
        np.testing.assert_array_equal(getattr(ra, field), getattr(rb, field), err_msg=field)
      np.testing.assert_array_equal(ra.final_obs.images, rb.final_obs.images)
      np.testing.assert_array_equal(ra.final_obs.state, rb.final_obs.state)
      truncations += int(ra.truncated.sum())
    assert truncations >= 2, truncations  # The time limit was crossed mid-chunk.
  finally:
    per_chunk.close()
    every_step.close()


def test_group_members_share_initial_states():
  env = maniskill_env.ManiSkillCPU("PickCube-v1", 2, obs_mode="state", max_episode_steps=3,
                                   group_size=2)
  try:
    assert env.group_ids().tolist() == [0, 0]
    obs = env.reset(5)
    np.testing.assert_array_equal(obs.state[0], obs.state[1])
    actions = np.random.default_rng(0).uniform(-1, 1, (2, 5, 8))  # Different per env.
    r = env.step_chunk(actions)  # Both time out after 3 steps and auto-reset: episode 1.
    assert r.steps.tolist() == [3, 3]
    assert [(e.group, e.episode) for e in r.episodes] == [(0, 0), (0, 0)]
    np.testing.assert_array_equal(r.obs.state[0], r.obs.state[1])
    assert not np.array_equal(r.obs.state[0], obs.state[0])  # A new cube and goal.
    # The last observations before the auto-reset: each member's own (they acted apart).
    assert r.has_final_obs.tolist() == [True, True] and r.final_obs.state.shape == (2, env.spec.state_dim)
    assert not np.array_equal(r.final_obs.state[0], r.final_obs.state[1])
    assert not np.array_equal(r.final_obs.state[0], r.obs.state[0])
  finally:
    env.close()


@pytest.mark.parametrize("control_mode", ["pd_joint_delta_pos", "pd_joint_pos"])
def test_planner_demonstrations_replay_to_success(tmp_path, control_mode):
  """ManiSkill3's motion planner recorded through the collector: its labels, in the
  policy's control mode and [-1, 1] space, replayed open loop from the same seed in
  that control mode reach the goal as the planner did (the conversion is exact), and one
  process records what two do."""
  from jaxvla.data import collect, config as data_config, loader  # pylint: disable=import-outside-toplevel
  c = maniskill_config.get_config("sft_rl")
  c.env.control_mode = control_mode
  out = str(tmp_path / "demos")
  summary = collect.collect(c, out, 2, num_envs=2, success_only=True)
  assert summary["episodes"] == 2 and summary["planner_attempts"] >= 2
  assert summary["planner_success_rate"] > 0.5 and summary["label_clipped_fraction"] < 0.01
  table = loader.open_reader(data_config.recorded(c.data, out, ("none",))).table
  assert table.num_episodes == 2 and table.actions.shape[1] == 8
  assert np.abs(table.actions).max() <= 1.0
  assert table.tasks == ("pick up the red cube and move it to the goal",)
  starts = np.concatenate([[0], np.cumsum(table.lengths)])
  first = demonstrators.demo_seed(c.seed)
  for e, seed in enumerate([first, first + 1]):  # (the planner succeeds on both seeds)
    env = maniskill_env.make_gym_env(c.env.task, obs_mode="state", control_mode=control_mode,
                                     image_size=64, max_episode_steps=c.env.max_episode_steps,
                                     reward_mode="sparse")
    low, high = env.action_space.low.reshape(-1), env.action_space.high.reshape(-1)
    obs, _ = env.reset(seed=seed)
    np.testing.assert_allclose(maniskill_env.state_vector(obs), table.state[starts[e]],
                               atol=1e-5)  # The recorded episode starts from this seed's state.
    success = False
    for a in table.actions[starts[e]:starts[e + 1]]:
      _, _, _, _, info = env.step(low + (a + 1.0) / 2.0 * (high - low))
      success = bool(np.asarray(info["success"]).reshape(-1)[0])
    env.close()
    assert success, f"seed {seed}: the replayed labels did not reach the goal"
  if control_mode != "pd_joint_delta_pos":
    return
  # One process in turn records what two processes do: each attempt starts in a freshly
  # built scene. (After a plain reset the second attempt observed the contacts the first
  # one ended with, is_grasped = 1 with the gripper open, and from its grasp on the
  # physics went otherwise; so did 9 of 16 PushCube attempts from their push on.)
  alone = str(tmp_path / "one_process")
  collect.collect(c, alone, 2, num_envs=1, success_only=True)
  serial = loader.open_reader(data_config.recorded(c.data, alone, ("none",))).table
  np.testing.assert_array_equal(serial.lengths, table.lengths)
  np.testing.assert_array_equal(serial.state, table.state)
  np.testing.assert_array_equal(serial.actions, table.actions)
  # DART-style execution noise: the same start and first label, then states off the clean
  # path, each labelled with the clean target measured from where the arm really is.
  noisy = collect.collect(c, str(tmp_path / "noisy"), 1, noise=0.01, num_envs=1)
  assert noisy["planner_attempts"] == 1
  other = loader.open_reader(data_config.recorded(c.data, str(tmp_path / "noisy"),
                                                    ("none",))).table
  np.testing.assert_array_equal(other.state[0], table.state[0])
  np.testing.assert_allclose(other.actions[0], table.actions[0], atol=1e-6)
  n = min(other.lengths[0], table.lengths[0])
  assert np.abs(other.state[5:n, :7] - table.state[5:n, :7]).max() > 1e-3


def test_sparse_shaped_reward_is_success_plus_the_dense_potentials_change():
  """'sparse_shaped' against ManiSkill's own normalised dense reward from the same seed
  and actions: each step pays success + phi(s') - phi(s), phi the dense reward of the
  state reached (0 before the first step)."""
  rng = np.random.default_rng(0)
  kwargs = dict(obs_mode="state", control_mode="pd_joint_delta_pos", max_episode_steps=100)
  shaped = maniskill_env.ManiSkillCPU("PickCube-v1", 1, reward_mode="sparse_shaped", **kwargs)
  dense = maniskill_env.ManiSkillCPU("PickCube-v1", 1, reward_mode="normalized_dense",
                                     **kwargs)
  try:
    phi = 0.0
    for _ in range(4):
      a = rng.uniform(-1, 1, (1, 1, 8))
      rs, rd = shaped.step_chunk(a), dense.step_chunk(a)
      assert rs.reward[0] == pytest.approx(float(rd.success[0]) + rd.reward[0] - phi, abs=1e-6)
      phi = rd.reward[0]
    with pytest.raises(ValueError, match="env.reward_mode"):
      maniskill_env.ManiSkillCPU("PickCube-v1", 1, reward_mode="shaped", **kwargs)
  finally:
    shaped.close()
    dense.close()


@pytest.mark.parametrize("robot", ["", "panda_wristcam"])
def test_lowpoly_meshes_keep_the_physics_and_the_picture(robot):
  """The decimated Panda (env.render_meshes='lowpoly'), with and without the wrist camera:
  the same states, rewards and episode ends as ManiSkill's own meshes under the same
  actions (only the looks change), and camera images that differ from the full meshes' by
  little: mean abs < 2 of 255 for the fixed camera, < 6 for the wrist one, whose view the
  fingers cross up close (their 624 triangles kept at 5% draw them thinner)."""
  kw = dict(obs_mode="rgb", image_size=64, max_episode_steps=20, reward_mode="sparse_shaped",
            robot=robot)
  low = maniskill_env.ManiSkillCPU("PickCube-v1", 1, render_meshes="lowpoly", **kw)
  full = maniskill_env.ManiSkillCPU("PickCube-v1", 1, render_meshes="full", **kw)
  try:
    a, b = low.reset(4), full.reset(4)
    rng = np.random.default_rng(1)
    for _ in range(3):
      np.testing.assert_array_equal(a.state, b.state)
      diff = np.abs(a.images.astype(np.int16) - b.images.astype(np.int16)).mean((0, 2, 3, 4))
      assert diff[0] < 2.0 and (robot == "" or diff[1] < 6.0), diff
      assert a.images.std() > 1.0
      actions = rng.uniform(-1, 1, (1, 5, low.spec.action_dim))
      ra, rb = low.step_chunk(actions), full.step_chunk(actions)
      np.testing.assert_array_equal(ra.reward, rb.reward)
      a, b = ra.obs, rb.obs
  finally:
    low.close()
    full.close()


def test_lowpoly_urdfs_decimate_every_visual_mesh():
  """Both Panda URDFs' copies point every visual mesh at a decimated file, the wrist
  camera's RealSense housing (425k triangles, 640 ms per observation) included, and leave
  the collision meshes ManiSkill's own."""
  import re  # pylint: disable=import-outside-toplevel
  import trimesh  # pylint: disable=import-outside-toplevel
  from mani_skill.agents.robots.panda import panda, panda_wristcam  # pylint: disable=import-outside-toplevel
  from jaxvla.envs import lowpoly  # pylint: disable=import-outside-toplevel
  collision = re.compile(r'<collision>(?:(?!</collision>).)*?<mesh filename="([^"]+)"', re.S)
  lowpoly.use_panda_meshes("full")
  for cls in (panda.Panda, panda_wristcam.PandaWristCam):
    own, copy = cls.urdf_path, lowpoly.lowpoly_urdf(cls.urdf_path)
    text = open(copy, encoding="utf-8").read()
    visual = lowpoly._VISUAL_MESH.findall(text)  # pylint: disable=protected-access
    assert visual and all(v.startswith("lowpoly_visual/") for v in visual), visual
    assert collision.findall(text) == collision.findall(open(own, encoding="utf-8").read())
  (d415,) = [v for v in visual if "d415" in v]  # (the wrist-camera Panda's, the last)
  mesh = trimesh.load(os.path.join(os.path.dirname(copy), d415), force="mesh")
  assert len(mesh.faces) < 0.1 * 425_160


def test_several_tasks_share_one_pool_told_apart_by_instruction():
  """configs/maniskill.py:vision_multitask's env: envs take the tasks in turn, each with its
  instruction; the same two cameras (the fixed one and the Panda's wrist camera) and one
  state layout (ManiSkill's rgb fields, a missing goal zero-padded), and no object pose
  anywhere in the state."""
  c = maniskill_config.get_config("vision_multitask")
  env = make_vec_env(c.env, 3, seed=0, num_workers=1, step_timeout_s=120)
  try:
    obs = env.reset(0)
    assert env.spec.camera_names == ("base_camera", "hand_camera")
    assert obs.images.shape == (3, 2, 64, 64, 3)
    assert obs.instruction.tolist() == [maniskill_env.INSTRUCTIONS[t] for t in
                                        ("PushCube-v1", "PickCube-v1", "StackCube-v1")]
    assert env.spec.state_dim == 9 + 9 + 7 + 1 + 3  # qpos, qvel, tcp_pose, is_grasped, goal_pos
    np.testing.assert_array_equal(obs.state[[0, 2], -4:], 0.0)  # Push, Stack: no grasp, no goal
    assert np.abs(obs.state[1, -3:]).max() > 0  # PickCube's goal position
    r = env.step_chunk(np.zeros((3, 5, 8)))
    assert r.obs.instruction.tolist() == obs.instruction.tolist()
    # The critic state (asymmetric critic) comes through the pool's shared memory: the
    # simulation state, the cube's pose included, as the env itself reports it.
    assert env.spec.critic_state_dim == 70 and r.obs.critic_state.shape == (3, 70)
    alone = maniskill_env.make(c.env, 1, 0)
    try:
      np.testing.assert_allclose(alone.reset(0).critic_state[0], obs.critic_state[0], atol=1e-6)
    finally:
      alone.close()
  finally:
    env.close()
  c.env.task, c.env.instruction = "PushCube-v1", maniskill_env.INSTRUCTIONS["StackCube-v1"]
  swapped = maniskill_env.make(c.env, 1, 0)  # The swapped-instruction control's env.
  try:
    assert swapped.reset(0).instruction.tolist() == [c.env.instruction]
    np.testing.assert_array_equal(swapped.observe().images[0], obs.images[0])  # PushCube's scene
  finally:
    swapped.close()


def test_planner_records_the_cameras_the_rl_env_shows(tmp_path):
  """Camera demonstrations: the planner's first recorded frame of a seed is the image the
  RL env (per-chunk rendering, lowpoly meshes) shows at that seed's reset, and its state
  is ManiSkill's rgb-mode state and its critic state the asymmetric critic's; TFDS reads the
  dataset back without jaxvla, and the run's statistics cover the critic state."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  from jaxvla.data import collect  # pylint: disable=import-outside-toplevel
  c = maniskill_config.get_config("vision_rl_short")
  out = str(tmp_path / "demos")
  summary = collect.collect(c, out, 1, num_envs=1, success_only=True)
  assert summary["episodes"] == 1
  steps = list(tfds.builder_from_directory(out).as_data_source()["train"][0]["steps"])
  first = steps[0]["observation"]
  seed = demonstrators.demo_seed(c.seed)  # (the first attempt's episode seed)
  env = maniskill_env.make(c.env, 1, seed, group_size=1)
  camera = env.spec.camera_names[0]  # (the recipe's first camera)
  try:
    obs = env.reset(seed)
    np.testing.assert_array_equal(first[camera], obs.images[0, 0])
    np.testing.assert_allclose(first["state"], obs.state[0], atol=1e-6)
    assert c.env.critic_state_dim == 70
    np.testing.assert_allclose(first["critic_state"], obs.critic_state[0], atol=1e-6)
  finally:
    env.close()
  assert all(s["observation"][camera].std() > 1.0 for s in steps)  # every frame rendered
  table = loader.open_reader(data_config.recorded(c.data, out, env.spec.camera_names)).table
  assert table.critic_state.shape == (len(steps), 70)
  stats = norm_stats.compute(table)[norm_stats.CRITIC_STATE]
  assert stats.std[13] > 0.0  # the cube moves (x, dim 13)


def test_camera_selection_renders_the_named_cameras_alone():
  """``env.cameras``: the policy reads the named cameras only, with the images the env
  with every camera gives them; the others are not captured, also after a reconfiguring
  reset (the planner's per attempt); an unknown camera is refused by name."""
  c = maniskill_config.get_config("vision_rl_short")
  c.env.robot, c.env.cameras, c.env.critic_state_dim = "panda_wristcam", "", 0
  both = maniskill_env.make(c.env, 1, 0)
  c.env.cameras = "hand_camera"
  wrist = maniskill_env.make(c.env, 1, 0)
  try:
    assert both.spec.camera_names == ("base_camera", "hand_camera")
    assert wrist.spec.camera_names == ("hand_camera",)
    np.testing.assert_array_equal(wrist.reset(0).images[:, 0], both.reset(0).images[:, 1])
    actions = np.random.default_rng(0).uniform(-1, 1, (1, 5, 8))
    np.testing.assert_array_equal(wrist.step_chunk(actions).obs.images[:, 0],
                                  both.step_chunk(actions).obs.images[:, 1])
    gym_env = wrist._envs[0]  # pylint: disable=protected-access
    gym_env.reset(seed=3, options=dict(reconfigure=True))
    assert list(gym_env.unwrapped.scene.sensors) == ["hand_camera"]
    assert list(maniskill_env.rendered_obs(gym_env)["sensor_data"]) == ["hand_camera"]
  finally:
    both.close()
    wrist.close()
  c.env.robot = ""  # PushCube's own Panda has no wrist camera
  with pytest.raises(ValueError, match=r"config.env.cameras='hand_camera': \['hand_camera'\] "
                                       r"is not a camera of PushCubeEnv.*\['base_camera'\]"):
    maniskill_env.make(c.env, 1, 0)
