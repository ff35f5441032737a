"""The tiny flow VLA: shapes, the policy contract, tokenizer errors, BC and sampler modes."""

import jax
import numpy as np
import pytest

from jaxvla.envs import builtin
from jaxvla.models import policy as policy_lib, tokenizer


def _setup(config, n=4):
  env = builtin.make(config.env, n, 0)
  pol = policy_lib.make_policy(config.model, env.spec)
  return env, pol, pol.init(jax.random.PRNGKey(0))


def test_act_shapes_and_modes(smoke_config):
  env, pol, params = _setup(smoke_config)
  batch = pol.prepare(env.observe())
  k, h = smoke_config.model.num_denoise_steps, smoke_config.model.chunk_len
  out = pol.act(params, batch, jax.random.PRNGKey(1), "train")
  assert out.actions.shape == (4, h, 2) and out.chain.shape == (4, k + 1, h, 2)
  assert out.log_prob.shape == (4,) and out.value.shape == (4,)
  assert np.all(np.isfinite(out.log_prob))
  ode1 = pol.act(params, batch, jax.random.PRNGKey(1), "eval")
  ode2 = pol.act(params, batch, jax.random.PRNGKey(1), "eval")
  np.testing.assert_array_equal(ode1.actions, ode2.actions)
  sde2 = pol.act(params, batch, jax.random.PRNGKey(2), "train")
  assert not np.allclose(out.actions, sde2.actions)  # the RL sampler is stochastic


def test_policy_reads_language_and_pixels(smoke_config):
  env, pol, params = _setup(smoke_config, 1)
  obs = env.observe()
  base = pol.act(params, pol.prepare(obs), jax.random.PRNGKey(0), "eval").actions
  other_text = obs.take(np.array([0]))
  other_text.instruction = np.array(["move to the cyan target"], dtype=object)
  assert not np.allclose(base, pol.act(params, pol.prepare(other_text), jax.random.PRNGKey(0),
                                       "eval").actions)
  other_img = obs.take(np.array([0]))
  other_img.images = 255 - other_img.images
  assert not np.allclose(base, pol.act(params, pol.prepare(other_img), jax.random.PRNGKey(0),
                                       "eval").actions)


def test_bc_loss_decreases_on_fixed_batch(smoke_config):
  from jaxvla.learner import learner as learner_lib
  env, pol, params = _setup(smoke_config, 8)
  lrn = learner_lib.Learner(pol, smoke_config)
  state = learner_lib.init_state(params, lrn.bc_tx, jax.random.PRNGKey(0))
  batch, acts = pol.prepare(env.observe()), env.expert_chunk(pol.chunk_len)
  losses = []
  for _ in range(30):
    state, metrics = lrn.bc_step(state, batch, acts)
    losses.append(float(metrics["loss"]))
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
  # One program for the fresh state and the states the steps return (the mesh types them).
  assert lrn.bc_step_jit._cache_size() == 1


@pytest.mark.parametrize("name", ["pi0", "action_token_vla"])
def test_bc_loss_mask_leaves_out_padded_actions(smoke_config, name):
  """Windows past an episode's end are padded in the data; the mask keeps them out of
  the mean. (pi0's action expert still attends to the padded actions' noisy inputs, as
  openpi's does: only the token model's loss is independent of the padding.)"""
  smoke_config.model.name = name
  env, pol, params = _setup(smoke_config, 4)
  batch, acts = pol.prepare(env.observe()), env.expert_chunk(pol.chunk_len)
  key = jax.random.PRNGKey(3)
  full = np.ones(acts.shape[:2], bool)
  assert np.isclose(float(pol.bc_loss(params, batch, acts, key)),
                    float(pol.bc_loss(params, batch, acts, key, full)), rtol=1e-6)
  mask = full.copy()
  mask[:, 3:] = False
  other = acts.copy()
  other[:, 3:] = -other[:, 3:] + 0.5  # Different padding: the masked loss does not see it.
  masked = float(pol.bc_loss(params, batch, acts, key, mask))
  assert not np.isclose(masked, float(pol.bc_loss(params, batch, acts, key)))
  if name == "action_token_vla":
    # Causal decoding: the padded tokens come last and no real token's loss sees them.
    assert np.isclose(masked, float(pol.bc_loss(params, batch, other, key, mask)), rtol=1e-6)
    assert not np.isclose(float(pol.bc_loss(params, batch, acts, key)),
                          float(pol.bc_loss(params, batch, other, key)))


def test_tokenizer_too_long_is_an_error():
  tok = tokenizer.WordTokenizer(max_len=4)
  ids, mask = tok.encode(["move to red"])
  assert ids.shape == (1, 4) and mask.sum() == 4 and ids[0, 0] == tok.BOS
  with pytest.raises(ValueError, match="max_token_len"):
    tok.encode(["move to the red target"])


def test_unknown_model_and_variant(smoke_config):
  env = builtin.make(smoke_config.env, 1, 0)
  smoke_config.model.variant = "huge"
  with pytest.raises(ValueError, match="model.variant"):
    policy_lib.make_policy(smoke_config.model, env.spec)
  smoke_config.model.name = "nope"
  with pytest.raises(ValueError, match="model.name"):
    policy_lib.make_policy(smoke_config.model, env.spec)
