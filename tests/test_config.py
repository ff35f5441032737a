"""Config errors: unknown keys, wrong types and inconsistent values fail before any work."""

import os
import re
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from configs import default
from jaxvla import config_checks
from tests.conftest import ROOT


def run_main(*args):
  return subprocess.run([sys.executable, "-m", "jaxvla.main", "--workdir=/nonexistent/x", *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _leaf_paths(tree: dict, prefix: str = "") -> list[str]:
  paths = []
  for key, value in tree.items():
    path = prefix + key
    paths += _leaf_paths(value, path + ".") if isinstance(value, dict) else [path]
  return paths


def _commented_assignment(lines: list[str], var: str, path: str) -> str | None:
  """None if ``var.path`` is assigned in ``lines`` with a comment on that line or the
  line above it; else an error naming the field."""
  pattern = re.compile(rf"^\s*{var}\.{re.escape(path)} = ")
  for i, line in enumerate(lines):
    if pattern.match(line):
      if "#" in line or (i and lines[i - 1].strip().startswith("#")):
        return None
      return f"{var}.{path} has no comment: {line.strip()}"
  return f"{var}.{path} is set nowhere"


def test_every_default_field_is_set_with_a_comment():
  """Every leaf of the run config is set in jaxvla/defaults.py (the ``data`` section in
  jaxvla/data/config.py, a mapping such as ``data.cameras`` as a whole) with a comment
  on its line or the line above: the package's defaults are the field reference."""
  defaults_src = open(os.path.join(ROOT, "jaxvla", "defaults.py")).read().splitlines()
  data_src = open(os.path.join(ROOT, "jaxvla", "data", "config.py")).read().splitlines()
  paths = _leaf_paths(default.get_config().to_dict())
  assert len(paths) > 100 and "rl.clip_eps" in paths, len(paths)
  errors = []
  for path in paths:
    if path.startswith("data."):
      rel = path[len("data."):]
      error = _commented_assignment(data_src, "d", rel)
      if error and "." in rel:  # A mapping's entry: its field is the mapping.
        error = _commented_assignment(data_src, "d", rel.rsplit(".", 1)[0])
    else:
      error = _commented_assignment(defaults_src, "c", path)
    if error:
      errors.append(error)
  assert not errors, errors


def test_unknown_key_fails_naming_it():
  r = run_main("--config=configs/default.py", "--config.rl.learnin_rate=0.1")
  assert r.returncode != 0
  assert "learnin_rate" in r.stderr


def test_moved_key_fails_naming_the_new_one():
  r = run_main("--config=configs/default.py", "--config.ppo.algorithm=grpo")
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
      "error: config.ppo.algorithm has moved to config.algorithm; set that instead")
  r = run_main("--config=configs/default.py", "--config.ppo.learning_rate=1e-5")
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
      "error: config.ppo.learning_rate has moved to config.rl.learning_rate; set that instead")
  for old, new in (("grpo_scale", r"grpo\.scale"), ("num_epochs", r"rl\.num_epochs")):
    c = default.get_config()  # A config file written for the old layout.
    with c.unlocked():
      c.ppo = ml_collections.ConfigDict({old: 1})
    with pytest.raises(ValueError, match=rf"^config\.ppo\.{old} has moved to config\.{new}"):
      config_checks.validate(c)


def test_wrong_type_fails_naming_it():
  r = run_main("--config=configs/default.py", "--config.num_envs=many")
  assert r.returncode != 0
  assert "num_envs" in r.stderr


def test_unknown_variant_fails():
  r = run_main("--config=configs/default.py:turbo")
  assert r.returncode != 0 and "turbo" in r.stderr


def test_locked_config_rejects_new_fields():
  c = default.get_config()
  c.lock()
  with pytest.raises(AttributeError):
    c.rl.learnin_rate = 0.1


@pytest.mark.parametrize("key,value,match", [
    ("num_envs", 0, "config.num_envs"),
    ("model.train_sampler", "ode", "config.model.train_sampler"),
    ("model.train_sampler", "latent_mean", "config.model.train_sampler"),
    ("model.eval_sampler", "latent_mean", "config.model.eval_sampler"),
    ("model.eval_sampler", "residual_mean", "config.model.eval_sampler"),
    ("model.eval_sampler", "sde", "config.model.eval_sampler"),
    ("rl.num_minibatches", 7, "config.rl.num_minibatches"),
    ("model.chunk_len", 500, "config.model.chunk_len"),
    ("env.group_size", 3, "config.env.group_size"),
    ("mesh.tensor", 0, "config.mesh.tensor"),
    ("rl.ratio", "token", "config.rl.ratio"),
    ("rl.value_targets", "critic", "config.rl.value_targets"),
    ("rl.step_scale", "adaptive", "config.rl.step_scale"),
    ("rl.adam_b1", 1.0, "config.rl.adam_b1"),
    ("rl.behaviour_clip", 0.5, "config.rl.behaviour_clip"),
    ("bc.lr_schedule", "linear", "config.bc.lr_schedule"),
    ("model.sde_steps", "two", "config.model.sde_steps"),
    ("model.log_prob_steps", "max", "config.model.log_prob_steps"),
    ("rl.value_loss", "l1", "config.rl.value_loss"),
    ("rl.is_clip_mode", "clip", "config.rl.is_clip_mode"),
    ("rl.huber_delta", 0.0, "config.rl.huber_delta"),
    ("rl.value_clip", -0.2, "config.rl.value_clip"),
    ("rl.value_learning_rate", -1e-4, "config.rl.value_learning_rate"),
    ("rl.critic_warmup_steps", -1, "config.rl.critic_warmup_steps"),
    ("rl.target_kl_stops", "critic", "config.rl.target_kl_stops"),
    ("rl.target_kl_stops", "actor", "config.rl.target_kl_stops.*critic's own Adam"),
    ("rl.lr_schedule", "cosine", "config.rl.lr_schedule"),
    ("pipeline.min_bucket", 0, "config.pipeline.min_bucket"),
    ("pipeline.min_bucket", 99, "config.pipeline.min_bucket"),
])
def test_inconsistent_values_name_the_key(key, value, match):
  c = default.get_config()
  node = c
  *path, last = key.split(".")
  for p in path:
    node = node[p]
  node[last] = value
  with pytest.raises(ValueError, match=match):
    config_checks.validate(c)


def test_a_linear_rl_schedule_needs_ppo():
  c = default.get_config()
  c.algorithm, c.rl.lr_schedule = "grpo", "linear"
  with pytest.raises(ValueError, match="config.rl.lr_schedule='linear' needs PPO"):
    config_checks.validate(c)


def test_one_sde_step_needs_a_gaussian_flow_sampler():
  c = default.get_config()
  c.model.train_sampler, c.model.eval_sampler, c.model.sde_steps = "residual", "ode", "one"
  with pytest.raises(ValueError, match="config.model.sde_steps='one'.*flow_sde"):
    config_checks.validate(c)


def test_kl_detail_needs_ppo_on_a_gaussian_flow_and_the_epochs_update():
  c = default.get_config()
  c.rl.kl_detail_rows = c.num_envs * c.rollout_len  # (every row: allowed)
  config_checks.validate(c)
  bad = [(dict(kl_detail_rows=c.num_envs * c.rollout_len + 1), "must be in \\[0, num_envs"),
         (dict(algorithm="grpo"), "GRPO's rows"),
         (dict(train_sampler="residual"), "train_sampler 'residual' has none"),
         (dict(streamer=True), "streamed learner")]
  for change, match in bad:
    c = default.get_config()
    c.rl.kl_detail_rows = change.pop("kl_detail_rows", 4)
    if change.pop("algorithm", None):
      c.algorithm, c.env.group_size = "grpo", 2
    if change.pop("train_sampler", None):
      c.model.train_sampler, c.model.eval_sampler = "residual", "residual_mean"
    if change.pop("streamer", None):
      c.pipeline.update(mode="async", streamer=True, rollout_async=False)
      c.rl.update(num_epochs=1, advantage_norm="none")
    with pytest.raises(ValueError, match="config.rl.kl_detail_rows.*" + match):
      config_checks.validate(c)


def test_init_checkpoint_needs_a_pi0_family_model():
  c = default.get_config()
  c.model.name, c.model.init_checkpoint = "action_token_vla", "ckpt/params"
  with pytest.raises(ValueError, match="config.model.init_checkpoint"):
    config_checks.validate(c)


def test_a_state_only_env_needs_a_value_that_sees_the_state():
  from configs import maniskill  # pylint: disable=import-outside-toplevel
  c = maniskill.get_config("state")
  assert c.model.value_source == "expert"
  config_checks.validate(c)
  c.model.value_source = "prefix"
  with pytest.raises(ValueError, match="config.model.value_source: 'prefix' cannot see the state"):
    config_checks.validate(c)
  assert maniskill.get_config().model.value_source == "prefix"  # rgb: the camera is there


def test_maniskill_rl_methods():
  """configs/maniskill.py:sft_rl[_short],METHOD: each method of the method table is a valid
  config on the same SFT recipe; piRL's flow-SDE takes one stochastic step per sample."""
  from configs import maniskill  # pylint: disable=import-outside-toplevel
  for variant in ("sft_rl", "sft_rl_short"):
    base = maniskill.get_config(variant)
    for method in maniskill.METHODS:
      c = maniskill.get_config(f"{variant},{method}")
      config_checks.validate(c)
      if method in maniskill.OWN_SFT:  # another model: its own SFT on the same demonstrations
        assert c.model.name != base.model.name, method
        assert (c.bc.num_episodes, c.bc.demo_noise, c.bc.success_only, c.env.task,
                c.total_env_steps) == (base.bc.num_episodes, base.bc.demo_noise,
                                       base.bc.success_only, base.env.task,
                                       base.total_env_steps), method
        continue
      assert (c.bc.to_dict(), c.data.to_dict(), c.env.task) == (
          base.bc.to_dict(), base.data.to_dict(), base.env.task), method  # the same SFT
  assert maniskill.get_config("sft_rl_short,residual").to_dict() == base.to_dict()
  pirl = maniskill.get_config("sft_rl_short,pirl_sde")
  assert (pirl.model.train_sampler, pirl.model.sde_steps, pirl.model.eval_sampler) == (
      "flow_sde", "one", "ode")
  for bad in ("sft_rl_short,dsrl", "state,pirl_sde"):
    with pytest.raises(ValueError, match="unknown method"):
      maniskill.get_config(bad)


def test_pixel_recipes_hold_no_object_pose_in_their_state():
  """configs/maniskill.py:vision_*: cameras, ManiSkill's rgb-mode state, and a check that
  refuses a pixel recipe whose state names an object's pose or an object-relative vector."""
  from configs import maniskill  # pylint: disable=import-outside-toplevel
  for variant in maniskill.VISION:
    c = maniskill.get_config(variant)
    config_checks.validate(c)
    assert (c.env.obs_mode, c.model.image_size, c.bc.num_steps > 0) == ("rgb", 0, True)
  multi = maniskill.get_config("vision_multitask")
  assert multi.env.task == "PushCube-v1,PickCube-v1,StackCube-v1"
  assert multi.env.state_keys == "qpos,qvel,tcp_pose,is_grasped,goal_pos"
  assert multi.env.robot == "panda_wristcam"  # one robot and its two cameras for every task
  for leak in ("obj_pose", "tcp_to_obj_pos", "obj_to_goal_pos", "cubeA_pose"):
    c = maniskill.get_config("vision_rl_short")
    c.env.state_keys = f"qpos,qvel,{leak}"
    with pytest.raises(ValueError, match=f"config.env.state_keys=.*'{leak}'.*find the objects"):
      config_checks.validate(c)
  c = maniskill.get_config("vision_multitask")
  c.env.state_keys = ""  # several tasks, each with ManiSkill's own (different) layout
  with pytest.raises(ValueError, match="config.env.task=.*one state layout"):
    config_checks.validate(c)
  c = maniskill.get_config("sft_rl_short")
  c.env.cameras = "base_camera"
  with pytest.raises(ValueError, match="config.env.cameras='base_camera' selects cameras of "
                                       "env.obs_mode='rgb'"):
    config_checks.validate(c)
  c = maniskill.get_config("vision_rl")
  c.env.cameras = "hand_camera, hand_camera"
  with pytest.raises(ValueError, match="config.env.cameras=.* names a camera twice"):
    config_checks.validate(c)
  c = maniskill.get_config("vision_rl_short")
  c.env.task = "PushCube-v1,PushBlock-v9"
  with pytest.raises(ValueError, match="config.env.task: 'PushBlock-v9' is not one of"):
    config_checks.validate(c)
  assert maniskill.get_config("vision_rl_short,pirl_noise").model.train_sampler == "flow_noise"
  # The pixel recipes steer the flow's noise (DSRL, KL early stop) unless a method is
  # named; their steering heads read the pixel state estimator.
  for arg, sampler, kl in (("vision_rl_short", "latent", 0.01),
                           ("vision_rl_short,residual", "residual", 0.0),
                           ("vision_rl", "latent", 0.01), ("vision_rl,residual", "residual", 0.0)):
    c = maniskill.get_config(arg)
    assert (c.model.train_sampler, c.model.steer_state_estimator, c.rl.target_kl) == (
        sampler, True, kl), arg
  # PickCube from pixels sees through the wrist camera too (the fixed one shows the cube
  # as 2 x 2 pixels); PushCube through the wrist camera alone, from 20 demonstrations.
  pick, push = maniskill.get_config("vision_rl"), maniskill.get_config("vision_rl_short")
  assert (pick.env.robot, pick.env.cameras) == ("panda_wristcam", "")
  assert (push.env.robot, push.env.cameras, push.bc.num_episodes) == (
      "panda_wristcam", "hand_camera", 20)


def test_pixel_state_takes_named_fields_pads_missing_goals_and_refuses_others():
  """The state of an rgb observation: the fields named in order, a task's missing goal
  zero-padded, an object's pose refused (a raw ManiSkill observation's layout)."""
  from jaxvla.envs import maniskill  # pylint: disable=import-outside-toplevel
  obs = dict(agent=dict(qpos=np.arange(9.0)[None], qvel=np.ones((1, 9))),
             extra=dict(tcp_pose=np.full((1, 7), 2.0)))
  v = maniskill.state_vector(obs, ("qpos", "qvel", "tcp_pose", "is_grasped", "goal_pos"))
  np.testing.assert_array_equal(v, np.concatenate([np.arange(9.0), np.ones(9), np.full(7, 2.0),
                                                   np.zeros(4)]))
  assert maniskill.state_vector(obs).shape == (25,)  # ManiSkill's own: agent, then extra
  with pytest.raises(ValueError, match="names 'tcp_pose', which this task's rgb observation lacks"):
    maniskill.state_vector(dict(agent=obs["agent"], extra={}), ("qpos", "tcp_pose"))
  obs["extra"]["obj_pose"] = np.zeros((1, 7))
  with pytest.raises(ValueError, match="'obj_pose' is not one of"):
    maniskill.state_vector(obs)


def test_libero_bench_config():
  """configs/libero_bench.py: full-size pi0 / pi0.5 next to 32 LIBERO envs, or the tiny pi0."""
  from configs import libero_bench
  from jaxvla.models import pi0
  for model in ("pi0", "pi05", "tiny", "pi0,libero_10/3"):
    config_checks.validate(libero_bench.get_config(model))
  full = libero_bench.get_config("pi05,libero_goal/2")
  assert (full.model.name, full.model.variant, full.model.dtype) == ("pi05", "full", "bfloat16")
  assert full.model.vocab_size == pi0.PALIGEMMA_VOCAB_SIZE and full.model.tokenizer == "builtin"
  assert full.env.image_size == full.model.image_size == 224 and full.env.task == "libero_goal/2"
  assert (full.num_envs, full.env_workers, full.pipeline.rollout_dtype) == (32, 16, "bfloat16")
  assert full.pipeline.min_bucket == 8
  tiny = libero_bench.get_config("tiny")
  assert (tiny.model.variant, tiny.env.name, tiny.pipeline.streamer) == ("tiny", "libero", True)
  with pytest.raises(ValueError, match="unknown model 'big' of configs/libero_bench.py"):
    libero_bench.get_config("big")


def test_main_parses_flags_without_importing_jax():
  """Each spawned env worker re-imports ``jaxvla.main`` (multiprocessing's ``spawn``), so
  what it imports at the top is paid once per worker: flags and configs only, not jax."""
  code = "import sys, jaxvla.main; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=True).stdout
  assert out.strip() == "[]", out
