"""Steered RL samplers over a frozen flow: 'latent' (DSRL) and 'residual'.

Checks that a fresh steering head leaves the base policy's behaviour (latent: exactly;
residual: on average), that the chunk's log-prob is the steering Gaussian's density
(SciPy reference) in ``act`` and ``evaluate`` alike, that RL trains the RL heads alone
while BC still trains the network, that the head's pixel state estimator learns by its
own regression alone, that bad sampler settings name their config key,
and that a steered export loads steered while openpi's layout refuses it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from jaxvla.envs import builtin
from jaxvla.learner import learner as learner_lib
from jaxvla.learner import optimizers
from jaxvla.models import denoise, openpi_import as oi, pi0, policy as policy_lib
from tests import trajectories

STEERS = ["latent", "residual"]


def _steered(config, steer, n=4):
  config.model.train_sampler = steer
  config.model.eval_sampler = f"{steer}_mean"
  if steer == "residual":
    config.model.steer_std_init = 0.2
  env = builtin.make(config.env, n, 0)
  pol = policy_lib.make_policy(config.model, env.spec)
  return env, pol, jax.device_get(pol.init(jax.random.PRNGKey(0)))


def _perturb_heads(params, scale=0.3, seed=1):
  """Non-zero steering weights (the mean layer starts at zero)."""
  rng = np.random.default_rng(seed)
  flat = oi.flatten(params)
  return oi.unflatten({p: x + scale * rng.standard_normal(x.shape).astype(np.float32)
                       if p.startswith("rl/steer") else x for p, x in flat.items()})


@pytest.mark.parametrize("steer", STEERS)
def test_steering_head_exists_only_with_a_steered_sampler(smoke_config, steer):
  env = builtin.make(smoke_config.env, 2, 0)
  plain = oi.flatten(policy_lib.make_policy(smoke_config.model, env.spec).abstract_params())
  assert not any(p.startswith("rl/steer") for p in plain)
  _, pol, params = _steered(smoke_config, steer)
  flat = oi.flatten(params)
  h, a = pol.chunk_len, pol.action_dim
  np.testing.assert_allclose(np.exp(flat["rl/steer_log_std"]),
                             np.full((h, a), smoke_config.model.steer_std_init), rtol=1e-6)
  assert flat["rl/steer_mean/kernel"].shape[-1] == h * a
  extra = h * a if steer == "residual" else 0  # the residual head sees the base chunk
  assert flat["rl/steer_in/kernel"].shape[0] == pi0.feature_width(pol.net) + 2 + extra
  assert set(oi.flatten(pol.logical_axes())) == set(flat)
  assert pol.log_prob_terms == h * a and pol.rl_heads_only


def test_fresh_latent_steering_is_the_base_policy(smoke_config):
  """Mean 0, std 1 at init: 'latent' acts exactly as 'ode' from the same noise key, and
  'latent_mean' as 'ode' from zero noise."""
  env, pol, params = _steered(smoke_config, "latent")
  batch = pol.prepare(env.observe())
  key = jax.random.PRNGKey(3)
  steered, base = pol.act(params, batch, key, "latent"), pol.act(params, batch, key, "ode")
  np.testing.assert_allclose(steered.chain, base.chain, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(steered.value, base.value, rtol=1e-6)
  mean = pol.act(params, batch, key, "eval")
  np.testing.assert_array_equal(mean.chain[:, 0], np.zeros_like(mean.chain[:, 0]))
  assert not np.allclose(mean.actions, base.actions)


def test_fresh_residual_steering_corrects_nothing_on_average(smoke_config):
  """The base flow runs from the same noise as 'ode'; 'residual_mean' then executes the
  base chunk itself and 'residual' adds N(0, steer_std_init) to it."""
  env, pol, params = _steered(smoke_config, "residual", n=64)
  batch = pol.prepare(env.observe())
  key = jax.random.PRNGKey(3)
  base = pol.act(params, batch, key, "ode")
  mean = pol.act(params, batch, key, "residual_mean")
  np.testing.assert_allclose(mean.chain[:, :-1], base.chain, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(mean.actions, base.actions, rtol=1e-6, atol=1e-6)
  out = pol.act(params, batch, key, "residual")
  np.testing.assert_allclose(out.chain[:, :-1], base.chain, rtol=1e-6, atol=1e-6)
  delta = np.asarray(out.actions - base.actions)
  assert abs(delta.mean()) < 0.02 and abs(delta.std() - 0.2) < 0.02


@pytest.mark.parametrize("steer", STEERS)
def test_log_prob_is_the_steering_density(smoke_config, steer):
  """act's and evaluate's log-probs equal SciPy's Gaussian log-density of the steered draw
  (latent: chain[:, 0]; residual: executed minus base chunk) under the head's mean and
  std; the flow itself is the base ODE from the chain's first entry."""
  env, pol, params = _steered(smoke_config, steer)
  params = _perturb_heads(params)
  batch = pol.prepare(env.observe())
  out = pol.act(params, batch, jax.random.PRNGKey(5), "train")
  chain = np.asarray(out.chain)
  prefix = pol._prefix(params, batch)
  feats = pi0.features(pol.net, params, prefix, batch["state"])
  if steer == "latent":
    draw, base = chain[:, 0], None
  else:
    draw, base = chain[:, -1] - chain[:, -2], chain[:, -2]
  mean, std = (np.asarray(x) for x in pi0.steer(pol.net, params, feats, batch["state"], base))
  assert np.abs(mean).max() > 0.1 and np.all(np.abs(mean) <= pol.net.steer_bound)
  ref = stats.norm.logpdf(draw, mean, std).sum((1, 2))
  np.testing.assert_allclose(out.log_prob, ref, rtol=1e-4)
  ev = pol.evaluate(params, batch, out.chain)
  np.testing.assert_allclose(ev.log_prob, ref, rtol=1e-4)
  np.testing.assert_allclose(ev.value, out.value, rtol=1e-5)
  np.testing.assert_allclose(ev.entropy, stats.norm.entropy(0, std).sum(), rtol=1e-5)
  flow = chain[:, :pol.num_steps + 1]
  ode = denoise.sample_chain(pol._velocity_fn(params, prefix, batch["state"]), flow[:, 0],
                             jax.random.PRNGKey(0), num_steps=pol.num_steps, mode="ode",
                             noise_level=0.0)[0]
  np.testing.assert_allclose(flow, ode, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="entries"):
    pol.evaluate(params, batch, chain[:, 1:])


@pytest.mark.parametrize("steer", STEERS)
def test_rl_trains_the_heads_alone_and_bc_the_network(smoke_config, steer):
  smoke_config.rl.num_minibatches = 1
  env, pol, params = _steered(smoke_config, steer)
  lrn = learner_lib.Learner(pol, smoke_config)
  flat = oi.flatten(params)
  state = learner_lib.init_state(params, lrn.ppo_tx, jax.random.PRNGKey(0))
  moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
  rl_paths = {p for p in flat if p.startswith("rl/")}
  assert len(moments) == 2 * len(rl_paths)  # Adam's mu and nu of the RL heads only
  traj = trajectories.sampled(pol, env, params)
  new, metrics = lrn.update(state, traj)
  assert metrics["nonfinite"] == 0
  after = oi.flatten(jax.device_get(new.params))
  changed = {p for p in flat if not np.array_equal(flat[p], after[p])}
  assert changed and changed <= rl_paths
  assert {"rl/steer_mean/kernel", "rl/value_out/kernel"} <= changed

  bc = lrn.shard_state(learner_lib.init_state(params, lrn.bc_tx, jax.random.PRNGKey(0)))
  bc, _ = lrn.bc_step(bc, pol.prepare(env.observe()), env.expert_chunk(pol.chunk_len))
  after = oi.flatten(jax.device_get(bc.params))
  assert not np.array_equal(flat["action_out_proj/kernel"], after["action_out_proj/kernel"])


def test_spatial_read_sees_where_in_the_image_and_never_a_masked_camera(smoke_config):
  """With ``steer_image_channels`` the residual head reads every image token side by
  side: moving an image's content moves the head's mean even where the pooled features
  barely change; a masked camera's tokens are read as 0; the flow is untouched."""
  smoke_config.model.steer_image_channels = 2
  env, pol, params = _steered(smoke_config, "residual", n=4)
  params = _perturb_heads(params)
  flat = oi.flatten(params)
  width = pi0.steer_image_width(pol.net)
  assert width == pol.net.num_cameras * pi0.tokens_per_image(pol.net) * 2 > 0
  assert flat["rl/steer_image/kernel"].shape == (pol.net.llm.width, 2)
  assert flat["rl/steer_in/kernel"].shape[0] == (pi0.feature_width(pol.net) + 2
                                                 + pol.chunk_len * pol.action_dim + width)
  batch = pol.prepare(env.observe())
  key = jax.random.PRNGKey(3)
  mean = lambda b: pol.act(params, b, key, "eval")
  out = mean(batch)
  rolled = dict(batch, images=np.roll(batch["images"], 16, axis=3))  # the scene, moved right
  moved = mean(rolled)
  assert not np.allclose(moved.actions, out.actions, atol=1e-4)
  # The base flow (the chain before the correction) reads no rl/ parameter.
  plain = dict(params, rl=dict(params["rl"], steer_image=jax.tree.map(np.zeros_like,
                                                                      params["rl"]["steer_image"])))
  np.testing.assert_array_equal(mean(batch).chain[:, :-1], pol.act(plain, batch, key,
                                                                    "eval").chain[:, :-1])
  # A masked camera: its pixels change nothing the head reads.
  masked = dict(batch, image_mask=np.zeros_like(batch["image_mask"]))
  noisy = dict(masked, images=np.random.default_rng(0).integers(
      0, 256, batch["images"].shape, dtype=np.uint8))
  np.testing.assert_allclose(mean(noisy).actions, mean(masked).actions, rtol=1e-5, atol=1e-5)


def _square_images(rng, n, size):
  """``n`` black ``size``-px images, each with a white 4-px square at a random place, and
  the critic state ``[n, 3]``: the square's row and column, and a constant."""
  pos = rng.integers(0, size - 4, (n, 2))
  images = np.zeros((n, 1, size, size, 3), np.uint8)
  for i, (r, col) in enumerate(pos):
    images[i, 0, r:r + 4, col:col + 4] = 255
  critic = np.concatenate([pos, np.full((n, 1), 5.0)], axis=1).astype(np.float32)
  return images, critic


def test_state_estimator_reads_the_critic_state_off_the_pixels(smoke_config):
  """``model.steer_state_estimator``: the head's own network learns where a square is from the
  pixels by its regression on the critic state alone (about 1 for a constant guess, under
  0.1 after 300 Adam steps); the actor's loss never reaches it and its loss reaches
  nothing else; the head reads it; a masked camera's pixels change nothing."""
  smoke_config.model.steer_state_estimator = True
  env = builtin.make(smoke_config.env, 4, 0)
  spec = dataclasses.replace(env.spec, critic_state_dim=3)
  smoke_config.model.train_sampler, smoke_config.model.eval_sampler = "residual", "residual_mean"
  pol = policy_lib.make_policy(smoke_config.model, spec)
  params = _perturb_heads(jax.device_get(pol.init(jax.random.PRNGKey(0))))
  flat = oi.flatten(params)
  assert flat["rl/estimator/out/kernel"].shape == (pi0.ESTIMATOR_HIDDEN, 3)
  assert flat["rl/steer_in/kernel"].shape[0] == (pi0.feature_width(pol.net) + 2
                                                 + pol.chunk_len * pol.action_dim + 3)
  assert set(oi.flatten(pol.logical_axes())) == set(flat)
  rng = np.random.default_rng(0)
  size = spec.image_shape[0]
  images, critic = _square_images(rng, 4, size)
  obs = env.observe()
  obs.images, obs.critic_state = images, critic
  batch = pol.prepare(obs)
  act = jax.jit(pol.act, static_argnums=3)
  out = act(params, batch, jax.random.PRNGKey(1), "train")

  # Which parameters each loss reaches (one Jacobian: [2, ...] per leaf).
  losses = lambda p: (lambda ev: jnp.stack([ev.log_prob.sum(), ev.state_estimate_loss.sum()]))(
      pol.evaluate(p, batch, out.chain))
  jac = oi.flatten(jax.device_get(jax.jit(jax.jacrev(losses))(params)))
  reached = lambda i: {k for k, v in jac.items() if np.abs(v[i]).max() > 0}
  actor, estimator = reached(0), reached(1)
  assert estimator and all(k.startswith("rl/estimator/") for k in estimator)
  assert "rl/steer_in/kernel" in actor and not any(k.startswith("rl/estimator/") for k in actor)
  assert optimizers._actor_critic_labels(params)["rl"]["estimator"]["out"]["kernel"] == "critic"

  # The head reads the estimate: another estimator moves the mean, not the base flow.
  zeroed = dict(params, rl=dict(params["rl"], estimator=jax.tree.map(
      np.zeros_like, params["rl"]["estimator"])))
  key = jax.random.PRNGKey(3)
  a, b = act(params, batch, key, "eval"), act(zeroed, batch, key, "eval")
  assert not np.allclose(a.actions, b.actions, atol=1e-4)
  np.testing.assert_array_equal(a.chain[:, :-1], b.chain[:, :-1])
  masked = dict(batch, image_mask=np.zeros_like(batch["image_mask"]))
  noisy = dict(masked, images=rng.integers(0, 256, images.shape, dtype=np.uint8))
  est = lambda p, b: pi0.estimate_state(pol.net, p, b["images"], b["image_mask"])
  np.testing.assert_allclose(est(params, noisy), est(params, masked), rtol=1e-6, atol=1e-6)

  # The regression alone learns where the square is.
  tx = optax.adam(1e-3)
  q = params["rl"]["estimator"]
  loss = lambda q, im, cs: pi0.state_estimate_loss(est(dict(params, rl=dict(
      params["rl"], estimator=q)), dict(images=im, image_mask=np.ones((len(im), 1), bool))),
      cs).mean()
  step = jax.jit(lambda q, s, im, cs: _adam_step(tx, loss, q, s, im, cs))
  opt = tx.init(q)
  test_images, test_critic = _square_images(rng, 256, size)
  before = float(loss(q, test_images, test_critic))
  for _ in range(300):
    q, opt = step(q, opt, *_square_images(rng, 64, size))
  after = float(loss(q, test_images, test_critic))
  assert before > 0.5 and after < 0.1, (before, after)

  # The learner trains it (with the critic's Adam) and reports its loss.
  smoke_config.rl.num_minibatches = 1
  smoke_config.rl.value_learning_rate = 1e-3
  lrn = learner_lib.Learner(pol, smoke_config)
  state = learner_lib.init_state(params, lrn.ppo_tx, jax.random.PRNGKey(0))
  new, metrics = lrn.update(state, trajectories.sampled(pol, env, params))
  assert metrics["nonfinite"] == 0 and metrics["state_estimate_loss"] > 0
  after = oi.flatten(jax.device_get(new.params))
  assert not np.array_equal(after["rl/estimator/patch/kernel"], flat["rl/estimator/patch/kernel"])


def _adam_step(tx, loss, q, state, *args):
  g = jax.grad(loss)(q, *args)
  updates, state = tx.update(g, state, q)
  return optax.apply_updates(q, updates), state


@pytest.mark.parametrize("changes,match", [
    (dict(eval_sampler="latent_mean"), "config.model.eval_sampler: 'latent_mean'"),
    (dict(train_sampler="latent", eval_sampler="residual_mean"),
     "config.model.train_sampler='residual'"),
    (dict(train_sampler="residual_mean"), "config.model.train_sampler: .*deterministic"),
    (dict(train_sampler="latent", steer_std_min=1.5), "config.model.steer_std_min"),
    (dict(train_sampler="residual", steer_hidden=0), "config.model.steer_hidden"),
    (dict(train_sampler="residual", steer_bound=0.0), "config.model.steer_bound"),
    (dict(train_sampler="residual", steer_state_estimator=True),
     "config.model.steer_state_estimator .*critic_state_dim, got 0"),
    (dict(steer_state_estimator=True), "config.model.steer_state_estimator needs a steered"),
])
def test_bad_sampler_settings_name_the_key(smoke_config, changes, match):
  """The policy refuses them too (one owner, denoise.check_samplers), not only the run."""
  env = builtin.make(smoke_config.env, 2, 0)
  smoke_config.model.update(changes)
  with pytest.raises(ValueError, match=match):
    policy_lib.make_policy(smoke_config.model, env.spec)


def test_a_steered_export_loads_steered_and_openpi_export_refuses_it(tmp_path, smoke_config):
  """policy_io rebuilds the steering from the export's config (its eval acts with the
  head's mean); openpi's tree cannot hold the head, so that export needs --base_only."""
  from jaxvla.storage import checkpoint, policy_io
  from jaxvla.data import norm_stats
  from jaxvla.models import openpi_export
  env, pol, params = _steered(smoke_config, "residual")
  params = _perturb_heads(params)
  src = tmp_path / "export"
  checkpoint.export_policy(str(src), params, smoke_config.to_json())
  policy_io.write_spec(str(src), env.spec)
  stats_ = {k: norm_stats.compute_array(np.random.default_rng(0).normal(size=(50, 2)))
            for k in ("state", "actions")}
  norm_stats.save_normalizer(str(src), norm_stats.Normalizer(stats_, "zscore"))
  loaded = policy_io.load(str(src))
  batch = pol.prepare(env.observe())
  key = jax.random.PRNGKey(0)
  steered = pol.act(params, batch, key, "residual_mean").actions
  np.testing.assert_allclose(loaded.policy.act(loaded.params, batch, key, "eval").actions,
                             steered, rtol=1e-5)
  assert not np.allclose(pol.act(params, batch, key, "ode").actions, steered)
  with pytest.raises(ValueError, match="--base_only"):
    openpi_export.export_loaded(str(tmp_path / "openpi"), loaded, "colorreach")
  out = openpi_export.export_loaded(str(tmp_path / "openpi"), loaded, "colorreach",
                                    base_only=True)
  assert out["num_arrays"] == len(openpi_export._spec("pi0"))  # openpi's whole tree
