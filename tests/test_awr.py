"""Advantage-weighted regression (``config.algorithm='awr'``) of a flow policy.

Checks the weights' maths, that an AWR update moves the flow towards the chunks the
advantages favour (and away when the advantages are swapped: the direction is the
critic's, not the data's), that it trains the whole network, and that settings AWR cannot
honour are refused naming their key.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from configs import maniskill
from jaxvla import config_checks, types
from jaxvla.algorithms import awr
from jaxvla.envs import builtin
from jaxvla.learner import learner as learner_lib
from jaxvla.models import openpi_import as oi, policy as policy_lib


def test_weights_exp_is_capped_and_binary_keeps_the_better_half():
  a = np.array([-2.0, 0.0, 0.5, 10.0], np.float32)
  w = awr.weights(a, weighting="exp", beta=0.5, max_weight=20.0)
  np.testing.assert_allclose(w, [np.exp(-4.0), 1.0, np.exp(1.0), 20.0], rtol=1e-6)
  np.testing.assert_array_equal(awr.weights(a, weighting="binary", beta=1.0, max_weight=20.0),
                                [0.0, 0.0, 1.0, 1.0])


def _awr(config, weighting="exp"):
  config.algorithm = "awr"
  config.model.train_sampler, config.model.eval_sampler = "flow_sde", "ode"
  config.rl.correction = "none"
  config.rl.num_minibatches, config.rl.num_epochs = 1, 1
  config.rl.learning_rate = 3e-3
  config.awr.weighting = weighting
  config_checks.validate(config)
  return config


def _two_chunk_trajectory(pol, env, params, sign: float, t: int = 2) -> types.Trajectory:
  """Every env acts from its current observation; half of the envs' executed chunks are
  replaced by ``+0.8`` everywhere, the other half's by ``-0.8``; one-chunk episodes whose
  reward is ``sign`` for the ``+0.8`` chunks and ``-sign`` for the others."""
  batch = pol.prepare(env.observe())
  chains, rewards = [], []
  for i in range(t):
    chain = np.array(pol.act(params, batch, jax.random.PRNGKey(i), "train").chain)
    b = chain.shape[0]
    up = np.arange(b) % 2 == 0
    chain[:, pol.num_steps, :, :pol.action_dim] = np.where(up, 0.8, -0.8)[:, None, None]
    chains.append(chain)
    rewards.append(np.where(up, sign, -sign).astype(np.float32))
  zeros = np.zeros((t, b), np.float32)
  return types.Trajectory(
      batch=jax.tree.map(lambda x: np.stack([x] * t), batch), chain=np.stack(chains),
      log_prob=zeros, log_prob_dims=np.zeros(np.stack(chains).shape[:2] + chain.shape[2:4],
                                            np.float32),
      value=zeros, reward=np.stack(rewards), done=np.ones((t, b), bool),
      terminated=np.ones((t, b), bool), final_value=zeros, steps=np.ones((t, b), np.int32),
      bootstrap_value=np.zeros((b,), np.float32), policy_version=np.zeros((t, b), np.int32))


def test_awr_moves_the_flow_towards_the_favoured_chunks(smoke_config):
  config = _awr(smoke_config)
  env = builtin.make(config.env, 8, 0)
  pol = policy_lib.make_policy(config.model, env.spec)
  params = jax.device_get(pol.init(jax.random.PRNGKey(0)))
  lrn = learner_lib.Learner(pol, config)
  batch = pol.prepare(env.observe())
  before = np.asarray(pol.act(params, batch, jax.random.PRNGKey(7), "eval").actions)
  moved = {}
  for sign in (1.0, -1.0):
    state = lrn.shard_state(learner_lib.init_state(params, lrn.ppo_tx, jax.random.PRNGKey(0)))
    for _ in range(15):
      state, metrics = lrn.update(state, _two_chunk_trajectory(pol, env, params, sign))
      assert metrics["nonfinite"] == 0
    after = np.asarray(pol.act(jax.device_get(state.params), batch, jax.random.PRNGKey(7),
                               "eval").actions)
    moved[sign] = float(np.mean(after - before))
  # The flow's deterministic chunk moves towards the rewarded chunk, +0.8 or -0.8.
  assert moved[1.0] > 0.1 and moved[-1.0] < -0.1, moved
  flat, after = oi.flatten(params), oi.flatten(jax.device_get(state.params))
  changed = {p for p in flat if not np.array_equal(flat[p], after[p])}
  assert any(p.startswith("PaliGemma/img/") for p in changed)  # the vision tower trains too
  assert {"action_out_proj/kernel", "rl/value_out/kernel"} <= changed


@pytest.mark.parametrize("changes,match", [
    (dict(train_sampler="residual", eval_sampler="residual_mean"), "model.train_sampler"),
    (dict(correction="decoupled"), "rl.correction"),
    (dict(target_kl=0.02), "rl.target_kl"),
    (dict(weighting="softmax"), "awr.weighting"),
    (dict(beta=0.0), "awr.beta"),
])
def test_bad_awr_settings_name_the_key(changes, match):
  config = maniskill.get_config("vision_rl_short,awr")
  config_checks.validate(config)
  for key, value in changes.items():
    sub = (config.model if key in ("train_sampler", "eval_sampler") else
           config.awr if key in ("weighting", "beta") else config.rl)
    sub[key] = value
  with pytest.raises(ValueError, match=match):
    config_checks.validate(config)
