"""The tiny action-token VLA: shapes, bin categoricals, KV-cached vs teacher-forced decoding,
sampling modes, config errors, and that BC and a PPO update train it."""

import functools

import jax
import numpy as np
import pytest

from jaxvla.envs import builtin
from jaxvla.learner import learner as learner_lib
from jaxvla.models import action_token_vla, policy as policy_lib
from jaxvla.rollout import rollout as rollout_lib

_CACHE = {}


def _setup(config, n=4):
  """Env, policy, params, a batch and jitted functions, built once per config (compiles are slow)."""
  config.model.name = "action_token_vla"
  key = (config.to_json(), n)
  if key not in _CACHE:
    env = builtin.make(config.env, n, 0)
    pol = policy_lib.make_policy(config.model, env.spec)
    act = jax.jit(pol.act, static_argnames="mode")
    _CACHE[key] = dict(
        env=env, pol=pol, params=pol.init(jax.random.PRNGKey(0)), batch=pol.prepare(env.observe()),
        act=act, evaluate=jax.jit(pol.evaluate), token_log_probs=jax.jit(pol.token_log_probs),
        decode=jax.jit(functools.partial(action_token_vla.decode, pol.net),
                       static_argnames="greedy"),
        teacher_forced=jax.jit(functools.partial(action_token_vla.teacher_forced, pol.net)))
  return _CACHE[key]


def _decode(s, rng, greedy):
  b = s["batch"]
  return s["decode"](s["params"], b["images"], b["tokens"], b["token_mask"], b["image_mask"], rng,
                     greedy=greedy)


def test_act_shapes_bins_and_normalised(smoke_config):
  s = _setup(smoke_config)
  pol, h, a, nb = s["pol"], smoke_config.model.chunk_len, 2, smoke_config.model.num_bins
  out = s["act"](s["params"], s["batch"], jax.random.PRNGKey(1), mode="train")
  assert out.actions.shape == (4, h, a) and out.chain.shape == (4, 1, h, a)
  assert out.log_prob.shape == (4,) and out.log_prob_dims.shape == (4, h, a)
  assert out.value.shape == (4,) and out.chain.dtype == np.float32
  np.testing.assert_allclose(out.log_prob, np.asarray(out.log_prob_dims).sum((1, 2)), rtol=1e-6)
  idx = np.asarray(out.chain[:, 0])
  np.testing.assert_array_equal(idx, np.round(idx))
  assert idx.min() >= 0 and idx.max() < nb
  np.testing.assert_allclose(out.actions, -1.0 + (2 * idx + 1) / nb, atol=1e-6)  # bin centres
  # Bin centres discretise back to their own bin.
  np.testing.assert_array_equal(action_token_vla.discretize(out.actions, nb), idx)
  # Both paths give normalised categoricals over the bins.
  tf, _ = s["token_log_probs"](s["params"], s["batch"], out.chain)
  _, dec, _, _ = _decode(s, jax.random.PRNGKey(1), True)
  for lp in (tf, dec):
    assert lp.shape == (4, h * a, nb)
    np.testing.assert_allclose(np.exp(np.asarray(lp, np.float64)).sum(-1), 1.0, atol=1e-5)
  assert pol.net.bin_offset == pol.net.vocab_size - nb == pol.tokenizer.vocab_size


def test_cached_decoding_matches_teacher_forced(smoke_config):
  s = _setup(smoke_config)
  out = s["act"](s["params"], s["batch"], jax.random.PRNGKey(1), mode="train")
  ev = s["evaluate"](s["params"], s["batch"], out.chain)
  np.testing.assert_allclose(ev.log_prob, out.log_prob, rtol=1e-5)
  np.testing.assert_allclose(ev.log_prob_dims, out.log_prob_dims, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ev.value, out.value, rtol=1e-5, atol=1e-6)
  assert ev.entropy.shape == (4,) and np.all(np.asarray(ev.entropy) > 0)
  # Greedy: the cached decode's tokens are the argmax of the teacher-forced distributions,
  # and the whole per-position distributions agree.
  tokens, dec, _, _ = _decode(s, jax.random.PRNGKey(3), True)
  greedy = s["act"](s["params"], s["batch"], jax.random.PRNGKey(3), mode="eval")
  tf, _ = s["token_log_probs"](s["params"], s["batch"], greedy.chain)
  np.testing.assert_array_equal(np.asarray(tf).argmax(-1), tokens)
  np.testing.assert_array_equal(greedy.chain[:, 0].reshape(4, -1), tokens)
  np.testing.assert_allclose(dec, tf, rtol=1e-5, atol=1e-5)
  ev = s["evaluate"](s["params"], s["batch"], greedy.chain)
  np.testing.assert_allclose(ev.log_prob, greedy.log_prob, rtol=1e-5)


def test_log_prob_matches_numpy_log_softmax(smoke_config):
  s = _setup(smoke_config)
  nb, h = smoke_config.model.num_bins, smoke_config.model.chunk_len
  out = s["act"](s["params"], s["batch"], jax.random.PRNGKey(2), mode="train")
  tokens = np.asarray(out.chain[:, 0]).astype(np.int64).reshape(4, -1)  # (h, a) order
  b = s["batch"]
  hidden, _, _ = s["teacher_forced"](s["params"], b["images"], b["tokens"], b["token_mask"],
                                     b["image_mask"], tokens)
  table = np.asarray(s["params"]["PaliGemma"]["llm"]["embedder"]["input_embedding"], np.float64)
  logits = (np.asarray(hidden, np.float64) @ table.T)[..., -nb:]  # the LAST num_bins ids
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  expected = np.take_along_axis(logp, tokens[..., None], -1)[..., 0].reshape(4, h, 2)
  ev = s["evaluate"](s["params"], s["batch"], out.chain)
  np.testing.assert_allclose(ev.log_prob_dims, expected, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out.log_prob_dims, expected, rtol=1e-4, atol=1e-4)


def test_eval_deterministic_train_stochastic(smoke_config):
  s = _setup(smoke_config)
  run = lambda seed, mode: s["act"](s["params"], s["batch"], jax.random.PRNGKey(seed), mode=mode)
  np.testing.assert_array_equal(run(1, "eval").chain, run(2, "eval").chain)
  np.testing.assert_array_equal(run(1, "train").chain, run(1, "train").chain)
  assert not np.array_equal(run(1, "train").chain, run(2, "train").chain)
  with pytest.raises(ValueError, match="mode"):
    s["pol"].act(s["params"], s["batch"], jax.random.PRNGKey(0), "ode")


def test_config_errors(smoke_config):
  env = builtin.make(smoke_config.env, 1, 0)
  m = smoke_config.model
  m.name = "action_token_vla"
  for key, bad, match in (("vocab_size", 400, "model.vocab_size=400"),
                          ("vocab_size", 100, "smaller than the tokenizer"),
                          ("num_bins", 1, "model.num_bins"),
                          ("action_dim", 4, "model.action_dim"),
                          ("variant", "huge", "model.variant")):
    c = m.copy_and_resolve_references()
    c[key] = bad
    with pytest.raises(ValueError, match=match):
      policy_lib.make_policy(c, env.spec)
  c = m.copy_and_resolve_references()
  c.variant = "full"
  with pytest.raises(ValueError, match="257152"):
    policy_lib.make_policy(c, env.spec)


def test_bc_loss_decreases_on_fixed_batch(smoke_config):
  s = _setup(smoke_config)
  pol, env = s["pol"], s["env"]
  lrn = learner_lib.Learner(pol, smoke_config)
  # A host copy: bc_step donates the state, and the cached params are shared by other tests.
  state = learner_lib.init_state(jax.tree.map(np.array, s["params"]), lrn.bc_tx,
                                 jax.random.PRNGKey(0))
  acts = env.expert_chunk(pol.chunk_len)
  losses = []
  for _ in range(30):
    state, metrics = lrn.bc_step(state, s["batch"], acts)
    losses.append(float(metrics["loss"]))
  assert np.isfinite(losses).all()
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_ppo_update_changes_params(smoke_config):
  s = _setup(smoke_config)
  smoke_config.rl.num_minibatches = 2
  smoke_config.rl.num_epochs = 1
  pol = s["pol"]
  env = builtin.make(smoke_config.env, 4, 1)
  traj = rollout_lib.collect_segments(
      env, pol, lambda p, b, k: s["act"](p, b, k, mode="train"), jax.jit(pol.value),
      s["params"], 2, jax.random.PRNGKey(0), seed=0)
  assert traj.chain.shape == (2, 4, 1, pol.chunk_len, 2)
  before = jax.tree.map(np.array, s["params"])
  lrn = learner_lib.Learner(pol, smoke_config)
  state = learner_lib.init_state(jax.tree.map(np.array, s["params"]), lrn.ppo_tx,
                                 jax.random.PRNGKey(0))
  state, metrics = lrn.update(state, traj)
  assert all(np.isfinite(float(v)) for v in jax.tree.leaves(metrics))
  # The first minibatch evaluates the behaviour params: ratio 1, so approx_kl ~ 0 on average.
  assert float(metrics["approx_kl"]) < 0.1
  changed = jax.tree.map(lambda x, y: not np.array_equal(x, np.asarray(y)), before, state.params)
  assert changed["PaliGemma"]["llm"]["embedder"]["input_embedding"]
  assert changed["PaliGemma"]["img"]["head"]["kernel"] and changed["rl"]["value_out"]["kernel"]
  # A second update takes the state the first returned: the same program, no new compile
  # (a fresh state's scalars must be placed on the learner's mesh, which types them).
  lrn.update(state, traj)
  assert lrn.update_jit._cache_size() == 1
