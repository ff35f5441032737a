"""Smoke tests of the real simulators on CPU: build, reset, step once, render.

Run by the third step of launch/test.sh (`pytest -m sim tests/sim`), which first exports
launch/env.sh (lavapipe ICD for SAPIEN, MUJOCO_GL for LIBERO, LIBERO_CONFIG_PATH).
A missing simulator is a failure with the reason, never a skip: this step exists to
prove that the set-up produced working simulators.

Both simulators share one process here: SAPIEN's Vulkan (lavapipe) and MuJoCo's EGL
(llvmpipe) were checked to coexist in either order.
"""

import importlib
import os

import numpy as np
import pytest

pytestmark = [pytest.mark.sim, pytest.mark.timeout(300)]

_HINT = "run through launch/test.sh, or `bash launch/setup.sh && source launch/env.sh` first"


def _require(module: str):
  """Imports `module`, failing the test (not skipping it) when it is missing."""
  try:
    return importlib.import_module(module)
  except Exception as e:  # ImportError, or a simulator failing at import time
    pytest.fail(f"cannot import {module}: {type(e).__name__}: {e}\n({_HINT})", pytrace=False)


def _make_maniskill(**kwargs):
  gym = _require("gymnasium")
  _require("mani_skill.envs")  # registers PickCube-v1 & co with gymnasium
  try:
    return gym.make("PickCube-v1", sim_backend="cpu", num_envs=1, **kwargs)
  except RuntimeError as e:  # SAPIEN: no Vulkan device
    pytest.fail(
        f"ManiSkill env creation failed: {e}\n"
        f"VK_ICD_FILENAMES={os.environ.get('VK_ICD_FILENAMES')!r} ({_HINT})",
        pytrace=False,
    )


def _zero_action(space):
  return np.zeros(space.shape, dtype=space.dtype)


def test_maniskill_pickcube_state():
  env = _make_maniskill(obs_mode="state", render_backend="none")
  try:
    obs, _ = env.reset(seed=0)
    obs, reward, terminated, truncated, _ = env.step(_zero_action(env.action_space))
    obs = np.asarray(obs)
    # The CPU backend still batches: [num_envs=1, obs_dim].
    assert obs.ndim == 2 and obs.shape[0] == 1 and obs.shape[1] > 0, obs.shape
    assert obs.shape == tuple(env.observation_space.shape), (obs.shape, env.observation_space)
    assert np.isfinite(obs).all()
    assert np.asarray(reward).shape == (1,)
    assert np.isfinite(np.asarray(reward)).all()
    assert np.asarray(terminated).dtype == bool and np.asarray(truncated).dtype == bool
  finally:
    env.close()


def test_maniskill_pickcube_rgb_renders_on_cpu():
  """Camera rendering goes through SAPIEN's Vulkan renderer, i.e. lavapipe here."""
  env = _make_maniskill(obs_mode="rgb", sensor_configs=dict(width=64, height=64))
  try:
    env.reset(seed=0)
    obs, *_ = env.step(_zero_action(env.action_space))
    rgb = np.asarray(obs["sensor_data"]["base_camera"]["rgb"])  # [1, H, W, 3]
    assert rgb.shape == (1, 64, 64, 3), rgb.shape
    assert rgb.dtype == np.uint8
    assert rgb.std() > 1.0, "camera image is constant: the renderer drew nothing"
  finally:
    env.close()


def test_libero_spatial_task0_offscreen():
  libero = _require("libero.libero")
  benchmark = _require("libero.libero.benchmark")
  envs = _require("libero.libero.envs")

  suite = benchmark.get_benchmark_dict()["libero_spatial"]()
  task = suite.get_task(0)
  bddl = os.path.join(libero.get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
  assert os.path.isfile(bddl), bddl
  init_states = suite.get_task_init_states(0)  # [num_inits, state_dim]
  assert init_states.ndim == 2 and len(init_states) > 0

  env = envs.OffScreenRenderEnv(
      bddl_file_name=bddl, camera_heights=64, camera_widths=64, hard_reset=False)
  try:
    env.seed(0)
    env.reset()
    env.set_init_state(init_states[0])
    obs, reward, done, _ = env.step(np.zeros(7))
    img = obs["agentview_image"]  # [H, W, 3], upside down
    assert img.shape == (64, 64, 3), img.shape
    assert img.dtype == np.uint8
    assert img.std() > 1.0, "agentview image is constant: the renderer drew nothing"
    assert isinstance(reward, float), type(reward)
    assert isinstance(done, bool), type(done)
  finally:
    env.close()
