"""pi0 / pi0.5 networks: openpi's tree, KV-cached vs joint passes, value sources, import."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxvla.envs import builtin, protocol
from jaxvla.models import openpi_import, pi0, policy as policy_lib, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = summary.DEFAULT_SPEC  # openpi's trees, shipped with the package


def _spec() -> dict:
  if not os.path.exists(SPEC):
    pytest.fail(f"openpi parameter spec not found at {SPEC}")
  with open(SPEC) as f:
    return json.load(f)


def _policy(config, name, n=3, **model):
  config.model.name = name
  for k, v in model.items():
    config.model[k] = v
  env = builtin.make(config.env, n, 0)
  pol = policy_lib.make_policy(config.model, env.spec)
  return env, pol, pol.init(jax.random.PRNGKey(0))


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_tiny_tree_has_openpi_paths(smoke_config, name):
  """With the learned posemb the tiny tree has exactly openpi's paths (+ rl/), ranks equal."""
  _, pol, _ = _policy(smoke_config, name, posemb="learn")
  ours = openpi_import.flatten(pol.abstract_params())
  theirs = _spec()["models"][name]["params"]
  assert sorted(k for k in ours if not k.startswith("rl/")) == sorted(theirs)
  for k, v in theirs.items():
    assert len(ours[k].shape) == len(v["shape"]), k
  axes = openpi_import.flatten(pol.logical_axes())
  assert axes.keys() == ours.keys()
  assert all(len(axes[k]) == len(ours[k].shape) for k in ours)


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_full_tree_matches_openpi_checkpoint_abstractly(name):
  """The full variant's tree (abstract, nothing allocated) passes the importer's checks."""
  from configs import default
  c = default.get_config()
  c.model.update(name=name, variant="full", posemb="learn", image_size=224, action_dim=32,
                 state_dim=32, vocab_size=pi0.PALIGEMMA_VOCAB_SIZE, dtype="bfloat16")
  spec = protocol.EnvSpec(("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"),
                          (224, 224, 3), 32, 32, 100)
  pol = policy_lib.make_policy(c.model, spec)
  ours = openpi_import.flatten(pol.abstract_params())
  theirs = {k: jax.ShapeDtypeStruct(tuple(v["shape"]), jnp.float32)
            for k, v in _spec()["models"][name]["params"].items()}
  openpi_import.check_compatible(theirs, ours, skip_prefixes=("rl",))
  other = "pi05" if name == "pi0" else "pi0"
  theirs_other = {k: jax.ShapeDtypeStruct(tuple(v["shape"]), jnp.float32)
                  for k, v in _spec()["models"][other]["params"].items()}
  with pytest.raises(ValueError, match="path"):
    openpi_import.check_compatible(theirs_other, ours, skip_prefixes=("rl",))


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_cached_denoising_equals_joint_pass(smoke_config, name):
  """The action expert over the prefix KV cache equals openpi's one joint forward pass."""
  env, pol, params = _policy(smoke_config, name)
  batch = pol.prepare(env.observe())
  x_t = jax.random.normal(jax.random.PRNGKey(3), (3, pol.chunk_len, pol.net.action_dim))
  t = jnp.array([0.9, 0.5, 0.1])
  # Perturb the zero-initialised adaRMS modulation so that pi0.5's time path matters.
  params = jax.tree.map(lambda x: x + 0.02 * jnp.sin(jnp.arange(x.size).reshape(x.shape)),
                        params)
  prefix = pi0.encode_prefix(pol.net, params, batch["images"], batch["tokens"],
                             batch["token_mask"], batch["image_mask"])
  v_cached, std_cached = pi0.velocity(pol.net, params, prefix, batch["state"], x_t, t)
  v_joint, std_joint = pi0.velocity_uncached(pol.net, params, batch["images"], batch["tokens"],
                                             batch["token_mask"], batch["image_mask"],
                                             batch["state"], x_t, t)
  np.testing.assert_allclose(v_cached, v_joint, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(std_cached, std_joint, rtol=1e-4, atol=1e-5)
  # Time and language both reach the velocity.
  v_t, _ = pi0.velocity(pol.net, params, prefix, batch["state"], x_t, 1.0 - t)
  assert not np.allclose(v_cached, v_t)


def test_padding_tokens_do_not_change_the_velocity(smoke_config):
  """Masked (padding) language tokens are invisible: changing their ids changes nothing."""
  env, pol, params = _policy(smoke_config, "pi0")
  batch = pol.prepare(env.observe())
  assert not batch["token_mask"].all()
  other = dict(batch, tokens=np.where(batch["token_mask"], batch["tokens"], 5))
  x_t, t = jnp.ones((3, pol.chunk_len, pol.net.action_dim)), jnp.full((3,), 0.5)
  v = [pi0.velocity(pol.net, params, pi0.encode_prefix(pol.net, params, b["images"], b["tokens"],
                                                       b["token_mask"], b["image_mask"]),
                    b["state"], x_t, t)[0]
       for b in (batch, other)]
  np.testing.assert_allclose(v[0], v[1], rtol=1e-5, atol=1e-6)


def test_expert_value_reads_the_state_token(smoke_config):
  """pi0's 'expert' value is the state token's output: independent of noise, sensitive to state."""
  env, pol, params = _policy(smoke_config, "pi0", value_source="expert")
  batch = pol.prepare(env.observe())
  a = pol.act(params, batch, jax.random.PRNGKey(1), "train")
  b = pol.act(params, batch, jax.random.PRNGKey(2), "train")
  np.testing.assert_array_equal(a.value, b.value)
  moved = dict(batch, state=batch["state"] + 0.5)
  assert not np.allclose(pol.value(params, moved), a.value)
  assert "value_hidden" in params["rl"] and params["rl"]["value_hidden"]["kernel"].shape[0] == 64


@pytest.mark.parametrize("train_sampler", ["flow_sde", "residual"])
def test_critic_state_moves_the_value_and_never_the_actions(smoke_config, train_sampler):
  """An asymmetric critic (EnvSpec.critic_state_dim): the value head reads the critic state,
  the actions and their log-probs do not; a dataset's observation without one (BC) gets
  zeros; a wrong size is refused. The pool carries it like the state (test_pool)."""
  env, _, _ = _policy(smoke_config, "pi0", value_source="expert")
  spec = dataclasses.replace(env.spec, critic_state_dim=6)
  smoke_config.model.train_sampler = train_sampler
  pol = policy_lib.make_policy(smoke_config.model, spec)
  params = pol.init(jax.random.PRNGKey(0))
  assert params["rl"]["value_hidden"]["kernel"].shape[0] == 64 + 6
  obs = env.observe()
  obs.critic_state = np.ones((obs.batch_size, 6), np.float32)
  batch = pol.prepare(obs)
  other = dict(batch, critic_state=batch["critic_state"] * -3.0)
  key = jax.random.PRNGKey(1)
  a, b = pol.act(params, batch, key, "train"), pol.act(params, other, key, "train")
  np.testing.assert_array_equal(a.actions, b.actions)
  np.testing.assert_array_equal(a.log_prob, b.log_prob)
  assert not np.allclose(a.value, b.value)
  ea, eb = pol.evaluate(params, batch, a.chain), pol.evaluate(params, other, a.chain)
  np.testing.assert_array_equal(ea.log_prob, eb.log_prob)
  np.testing.assert_allclose(ea.value, a.value, rtol=1e-5, atol=1e-6)
  assert not np.allclose(ea.value, eb.value)
  assert pol.prepare(env.observe())["critic_state"].shape == (obs.batch_size, 6)  # zeros
  obs.critic_state = np.ones((obs.batch_size, 5), np.float32)
  with pytest.raises(ValueError, match="critic_state has 5 dims"):
    pol.prepare(obs)


def test_pi05_rejects_expert_value(smoke_config):
  with pytest.raises(ValueError, match="value_source"):
    _policy(smoke_config, "pi05", value_source="expert")


def test_padded_action_dims_are_not_executed_or_scored(smoke_config):
  """openpi pads actions to 32: only the env's dims are executed and enter the log-prob."""
  env, pol, params = _policy(smoke_config, "pi0", action_dim=8, state_dim=6)
  batch = pol.prepare(env.observe())
  assert batch["state"].shape == (3, 6)
  out = pol.act(params, batch, jax.random.PRNGKey(1), "train")
  assert out.actions.shape == (3, pol.chunk_len, 2) and out.chain.shape[-1] == 8
  assert np.all(np.asarray(out.log_prob_dims)[..., 2:] == 0)
  np.testing.assert_allclose(out.log_prob, np.asarray(out.log_prob_dims).sum((1, 2)), rtol=1e-6)
  with pytest.raises(ValueError, match="action_dim"):
    _policy(smoke_config, "pi0", action_dim=1)


def test_openpi_checkpoint_round_trip(smoke_config, tmp_path):
  """Params written in openpi's layout (no rl/) load into the policy and act identically."""
  env, pol, params = _policy(smoke_config, "pi0", posemb="learn")
  openpi_tree = {k: v for k, v in params.items() if k != "rl"}
  with ocp.PyTreeCheckpointer() as ckptr:
    ckptr.save(str(tmp_path / "params"), {"params": openpi_tree})
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  loaded, skipped = openpi_import.load_openpi_params(str(tmp_path / "params"), target)
  assert skipped and all(p.startswith("rl/") for p in skipped)
  # What the training loop does (model.init_checkpoint): openpi weights + fresh RL heads.
  restored = openpi_import.init_params(pol, jax.random.PRNGKey(0), str(tmp_path / "params"))
  jax.tree.map(np.testing.assert_array_equal, restored, dict(loaded, rl=params["rl"]))
  batch = pol.prepare(env.observe())
  a = pol.act(params, batch, jax.random.PRNGKey(1), "train")
  b = pol.act(restored, batch, jax.random.PRNGKey(1), "train")
  np.testing.assert_array_equal(a.actions, b.actions)
  np.testing.assert_array_equal(a.log_prob, b.log_prob)
  # A tree of another size fails, naming the first bad path and both shapes.
  _, small, _ = _policy(smoke_config, "pi0", posemb="learn", variant="small")
  with pytest.raises(ValueError, match=r"has shape \(\d+.*but the model expects"):
    openpi_import.load_openpi_params(str(tmp_path / "params"), small.abstract_params())


# Training each variant end to end: tests/test_pipeline.py::test_every_mode_trains_end_to_end.


@pytest.mark.run_first
def test_init_checkpoint_starts_the_run(tmp_path, smoke_config):
  """``model.init_checkpoint``: the run starts from the openpi-layout weights (its
  step-0 checkpoint holds them exactly) with fresh RL heads."""
  from jaxvla.storage import checkpoint as checkpoint_lib
  from jaxvla import train
  from jaxvla.learner import learner as learner_lib
  from jaxvla.learner import optimizers as optimizers_lib
  _, pol, written = _policy(smoke_config, "pi0", posemb="learn")
  written = jax.tree.map(lambda x: x + 0.01, written)  # Not what init(PRNGKey) gives.
  with ocp.PyTreeCheckpointer() as ckptr:
    ckptr.save(str(tmp_path / "params"), {"params": {k: v for k, v in written.items()
                                                     if k != "rl"}})
  smoke_config.model.init_checkpoint = str(tmp_path / "params")
  smoke_config.bc.num_steps = 0
  smoke_config.total_env_steps = 0  # (the step-0 checkpoint is written before any RL)
  summary = train.train_and_evaluate(smoke_config, str(tmp_path / "run"))
  assert summary["iterations"] == 0 and summary["warm_start_success_rate"] is not None
  abstract = jax.eval_shape(lambda: learner_lib.init_state(
      written, optimizers_lib.make_optimizer(1e-3, 1.0), jax.random.PRNGKey(0)))
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "run" / "checkpoints"), 5)
  state, _ = ckpt.restore(0, abstract)
  ckpt.close()
  got = openpi_import.flatten(jax.device_get(state.params))
  want = openpi_import.flatten(written)
  for path, value in want.items():
    if not path.startswith("rl/"):
      np.testing.assert_array_equal(got[path], value, err_msg=path)
  assert any(not np.array_equal(got[p], want[p]) for p in want if p.startswith("rl/"))
