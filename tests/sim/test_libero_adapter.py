"""LIBERO through the jaxvla env contract, the worker pool and the training loop (CPU)."""

import numpy as np
import pytest

from configs import libero as libero_config
from jaxvla import config_checks, train
from jaxvla.envs import libero as libero_env
from jaxvla.envs import make_vec_env

pytestmark = [pytest.mark.sim, pytest.mark.timeout(600)]

SPATIAL0 = ("pick up the black bowl between the plate and the ramekin and place it on the "
            "plate")


def test_bad_task_names_the_field_and_suites():
  for bad in ("libero_11/0", "libero_spatial", "libero_spatial/x"):
    with pytest.raises(ValueError, match=r"env\.task=.*libero_spatial"):
      libero_config.get_config(bad)
  with pytest.raises(ValueError, match=r"env\.task='libero_10/10'.*\[0, 10\)"):
    libero_env.LiberoEnv("libero_10/10", 1)


def test_quat2axisangle():
  np.testing.assert_allclose(libero_env.quat2axisangle([0, 0, 0, 1]), 0.0)
  s = np.sqrt(0.5)  # 90 degrees about z
  np.testing.assert_allclose(libero_env.quat2axisangle([0, 0, s, s]), [0, 0, np.pi / 2],
                             atol=1e-6)


def test_pool_chunks_shapes_rewards_and_upright_images():
  c = libero_config.get_config()
  env = make_vec_env(c.env, 2, seed=0, num_workers=2, step_timeout_s=120)
  try:
    spec = env.spec
    assert spec.camera_names == ("agentview", "robot0_eye_in_hand")
    assert spec.image_shape == (64, 64, 3) and spec.state_dim == 8 and spec.action_dim == 7
    assert spec.max_episode_steps == 220
    obs = env.reset(0)
    assert obs.images.shape == (2, 2, 64, 64, 3) and obs.images.dtype == np.uint8
    assert obs.images.std() > 1.0  # rendered, not blank
    assert obs.state.shape == (2, 8) and np.isfinite(obs.state).all()
    assert list(obs.instruction) == [SPATIAL0, SPATIAL0]
    # Right way up: agentview looks across the table at the robot, so the light wooden
    # table fills the bottom rows and the grey floor behind the robot the top rows
    # (LIBERO's raw render has them the other way round).
    agent = obs.images[:, 0].astype(np.float32)  # [B, H, W, 3]
    top, bottom = agent[:, :12].mean(axis=(1, 2)), agent[:, -12:].mean(axis=(1, 2))  # [B, 3]
    assert (bottom.mean(-1) > top.mean(-1) + 20).all(), (top, bottom)
    assert ((bottom[:, 0] - bottom[:, 2]) > (top[:, 0] - top[:, 2]) + 10).all(), (top, bottom)
    still = np.zeros((2, c.model.chunk_len, 7))
    still[..., -1] = -1.0  # gripper open
    for _ in range(2):
      r = env.step_chunk(still)
      assert r.steps.tolist() == [c.model.chunk_len] * 2
      assert r.reward.tolist() == [0.0, 0.0] and not r.done.any() and not r.episodes
    with pytest.raises(ValueError, match="action_dim=7"):
      env.step_chunk(np.zeros((2, c.model.chunk_len, 8)))
  finally:
    env.close()


def test_time_limit_auto_reset_and_group_members_share_init_states():
  # Two members of one GRPO group (G = 2): same init state (and fixtures) at every episode.
  env = libero_env.LiberoEnv("libero_spatial/0", 2, image_size=32, max_episode_steps=12,
                             settle_steps=2, group_size=2)
  try:
    assert env.spec.max_episode_steps == 12
    assert env.group_ids().tolist() == [0, 0] and env.num_groups == 1
    obs = env.reset(3)
    assert env.init_state_index(0) == env.init_state_index(1) == 3  # seed + g + 1 * k, k = 0
    assert env.init_state_index(0, 1) == 4  # episode 1
    np.testing.assert_array_equal(obs.state[0], obs.state[1])
    np.testing.assert_array_equal(obs.images[0], obs.images[1])
    still = np.zeros((2, 10, 7))
    still[..., -1] = -1.0
    moves = still.copy()
    moves[1, :, 0] = 1.0  # env 1 moves its arm, env 0 stays
    assert env.step_chunk(moves).steps.tolist() == [10, 10]
    r = env.step_chunk(still * 5.0)  # clipped to [-1, 1]
    assert r.steps.tolist() == [2, 2] and r.truncated.tolist() == [True, True]
    assert not r.terminated.any() and not r.success.any()
    assert [(e.env_id, e.group, e.episode, e.length) for e in r.episodes] == [
        (0, 0, 0, 12), (1, 0, 0, 12)]
    assert all(e.truncated and not e.success and e.episode_return == 0.0 for e in r.episodes)
    assert env.t.tolist() == [0, 0]
    assert env.init_state_index(0) == env.init_state_index(1) == 4  # auto-reset: episode 1
    np.testing.assert_array_equal(r.obs.state[0], r.obs.state[1])
    np.testing.assert_array_equal(r.obs.images[0], r.obs.images[1])
    assert not np.array_equal(r.obs.images[0], obs.images[0])  # another init state
    # The last observations before the auto-reset: env 1's arm moved, env 0's did not.
    assert r.has_final_obs.tolist() == [True, True]
    assert r.final_obs.images.shape == (2, 2, 32, 32, 3)
    np.testing.assert_allclose(r.final_obs.state[0, :3], obs.state[0, :3], atol=0.02)
    assert np.abs(r.final_obs.state[1, :3] - obs.state[1, :3]).max() > 0.02
    assert not np.array_equal(r.final_obs.images[1], r.obs.images[1])
  finally:
    env.close()


def test_fast_render_turns_multisampling_and_reflections_off():
  import mujoco  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=r"env\.render_quality='low'.*'full', 'fast'"):
    libero_env.LiberoEnv("libero_spatial/0", 1, render_quality="low")
  obs, flags = {}, {}
  # One env at a time: robosuite renders in whichever GL context was made last.
  for quality in libero_env.RENDER_QUALITIES:
    env = libero_env.LiberoEnv("libero_spatial/0", 1, image_size=32, render_quality=quality)
    try:
      obs[quality] = env.reset(0)
      sim = env._envs[0].env.sim
      flags[quality] = (sim.model._model.vis.quality.offsamples, int(
          sim._render_context_offscreen.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION]))
    finally:
      env.close()
  assert flags == {"full": (4, 1), "fast": (0, 0)}, flags
  a, b = obs["full"], obs["fast"]
  np.testing.assert_array_equal(a.state, b.state)  # the same scene and robot
  diff = np.abs(a.images.astype(np.float32) - b.images).mean(axis=(0, 2, 3, 4))  # [cam]
  assert (diff > 0.5).all() and (diff < 20).all(), diff  # other edges, the same picture


@pytest.mark.run_first  # (started first: the step's tests run in parallel)
def test_training_loop_runs_on_libero(tmp_path):
  """Training on LIBERO in the full-async pipeline (first-ready batches of the worker
  pool, the streamed learner), as configs/libero_bench.py runs it next to full pi0."""
  c = libero_config.get_config()
  c.pipeline.mode, c.pipeline.streamer = "async", True
  c.rl.update(config_checks.STREAMER_PPO)
  c.rl.num_minibatches = 1  # (one streamed step per update: fewer programs to compile)
  c.total_env_steps = 40
  c.rollout_len = 2
  c.env.max_episode_steps = 10  # one-chunk evaluation episodes (eval runs in-process)
  c.env.settle_steps = 2
  c.env.render_quality = "fast"  # (the pipeline under test, not LIBERO's renderer)
  c.eval.num_episodes = 2
  c.log.progress = False
  summary = train.train_and_evaluate(c, str(tmp_path / "run"))
  assert summary["env_steps"] >= 40 and summary["iterations"] >= 1
  assert 0.0 <= summary["success_rate"] <= 1.0
  assert summary["pipeline"] == "async[L1+L2+L3]"
