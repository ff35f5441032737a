"""The sampler's chain log-probability against an independent Gaussian density computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxvla.envs import builtin
from jaxvla.models import denoise, pi0, policy as policy_lib

K = 4


def _linear_velocity(w, c):
  def fn(x, t):
    v = jnp.einsum("bha,ad->bhd", x, w) + c * t[:, None, None]
    std = 0.1 + 0.05 * jnp.tanh(x) ** 2
    return v, std
  return fn


def _numpy_log_prob(chain, w, c, mode, noise_level):
  """Re-derives every transition in NumPy and sums scipy's normal log-densities."""
  total = np.zeros(chain.shape[0])
  ts = np.linspace(1.0, 0.0, K + 1)
  for k in range(K):
    x, x_next, t, dt = chain[:, k], chain[:, k + 1], ts[k], ts[k + 1] - ts[k]
    v = np.einsum("bha,ad->bhd", x, w) + c * t
    if mode == "flow_noise":
      mean, std = x + v * dt, 0.1 + 0.05 * np.tanh(x) ** 2
    else:  # Flow-GRPO's SDE step, sigma capped at t = 1 - 1/K
      sigma = noise_level * np.sqrt(t / (1 - min(t, 1 - 1 / K)))
      mean = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
      std = np.full_like(x, sigma * np.sqrt(-dt))
    total += stats.norm.logpdf(x_next, mean, std).sum((1, 2))
  return total


@pytest.mark.parametrize("mode", ["flow_sde", "flow_noise"])
def test_chain_log_prob_matches_scipy(mode):
  rng = np.random.default_rng(0)
  w = rng.normal(scale=0.3, size=(2, 2)).astype(np.float32)
  fn = _linear_velocity(jnp.asarray(w), 0.5)
  noise = jnp.asarray(rng.normal(size=(6, 3, 2)), jnp.float32)
  chain, logp = denoise.sample_chain(fn, noise, jax.random.PRNGKey(1), num_steps=K, mode=mode,
                                     noise_level=0.7)
  ref = _numpy_log_prob(np.asarray(chain, np.float64), w, 0.5, mode, 0.7)
  np.testing.assert_allclose(np.asarray(logp).sum((1, 2)), ref, rtol=1e-4, atol=1e-3)
  # Scoring the stored chain again gives the same density.
  logp2, _ = denoise.chain_log_prob(fn, chain, num_steps=K, mode=mode, noise_level=0.7)
  np.testing.assert_allclose(logp2, logp, rtol=1e-5, atol=1e-4)


def test_chain_log_prob_changes_with_the_model():
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(2, 2)), jnp.float32)
  chain, logp = denoise.sample_chain(_linear_velocity(w, 0.5), jnp.ones((2, 3, 2)),
                                     jax.random.PRNGKey(0), num_steps=K, mode="flow_sde",
                                     noise_level=0.5)
  other, _ = denoise.chain_log_prob(_linear_velocity(w * 0.0, 0.5), chain, num_steps=K,
                                    mode="flow_sde", noise_level=0.5)
  assert not np.allclose(other, logp)


def test_ode_has_no_log_prob():
  with pytest.raises(ValueError, match="no log-probability"):
    denoise.chain_log_prob(_linear_velocity(jnp.eye(2), 0.0), jnp.zeros((1, K + 1, 3, 2)),
                           num_steps=K, mode="ode", noise_level=0.5)


@pytest.mark.parametrize("name,sampler", [("pi0", "flow_sde"), ("pi0", "flow_noise"),
                                          ("pi05", "flow_sde"), ("pi05", "flow_noise")])
def test_policy_log_prob_matches_scipy(smoke_config, name, sampler):
  """The real network: its act() log-prob equals scipy's density of the stored chain."""
  smoke_config.model.name = name
  smoke_config.model.train_sampler = sampler
  env = builtin.make(smoke_config.env, 3, 0)
  pol = policy_lib.make_policy(smoke_config.model, env.spec)
  params = pol.init(jax.random.PRNGKey(0))
  batch = pol.prepare(env.observe())
  out = pol.act(params, batch, jax.random.PRNGKey(1), "train")
  prefix = pi0.encode_prefix(pol.net, params, batch["images"], batch["tokens"],
                            batch["token_mask"], batch["image_mask"])
  chain = np.asarray(out.chain, np.float64)
  ts = np.linspace(1.0, 0.0, pol.num_steps + 1)
  ref = np.zeros(3)
  for k in range(pol.num_steps):
    t, dt = ts[k], ts[k + 1] - ts[k]
    v, lstd = pi0.velocity(pol.net, params, prefix, batch["state"], out.chain[:, k],
                           jnp.full((3,), t))
    v, lstd, x = np.asarray(v, np.float64), np.asarray(lstd, np.float64), chain[:, k]
    if sampler == "flow_noise":
      mean, std = x + v * dt, lstd
    else:
      sigma = pol.noise_level * np.sqrt(t / (1 - min(t, 1 - 1 / pol.num_steps)))
      mean = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
      std = sigma * np.sqrt(-dt)
    ref += stats.norm.logpdf(chain[:, k + 1], mean, std).sum((1, 2))
  np.testing.assert_allclose(out.log_prob, ref, rtol=1e-4, atol=1e-3)
  ev = pol.evaluate(params, batch, out.chain)
  np.testing.assert_allclose(ev.log_prob, out.log_prob, rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(ev.value, out.value, rtol=1e-5, atol=1e-5)


# --- sde_steps='one' (piRL's flow-SDE) and log_prob_steps='mean' ------------------------

def _numpy_one_step(chain, w, c, noise_level):
  """The one-step chain in NumPy: every step but the stored one is an Euler ODE step,
  and the log-density is the stored step's SDE transition (scipy), written as RLinf's
  ``openpi_action_model.py`` writes it (x0 / x1 predictions and their weights)."""
  ks = np.rint(chain[:, K + 1, 0, 0]).astype(int)
  ts = np.linspace(1.0, 0.0, K + 1)
  logp = np.zeros(chain.shape[:1] + chain.shape[2:])
  for b, k in enumerate(ks):
    for i in range(K):
      x, x_next, t, dt = chain[b, i], chain[b, i + 1], ts[i], ts[i + 1] - ts[i]
      v = x @ w + c * t
      if i != k:
        np.testing.assert_allclose(x_next, x + v * dt, rtol=1e-5, atol=1e-5)
        continue
      delta = -dt
      sigma = noise_level * np.sqrt(t / (1 - (ts[1] if t == 1 else t)))
      x0_pred, x1_pred = x - v * t, x + v * (1 - t)
      x0_weight = 1 - (t - delta)
      x1_weight = t - delta - sigma**2 * delta / (2 * t)
      mean = x0_pred * x0_weight + x1_pred * x1_weight
      logp[b] = stats.norm.logpdf(x_next, mean, np.sqrt(delta) * sigma)
  return ks, logp


def test_one_sde_step_matches_numpy():
  """One uniformly drawn step per sample is the SDE's, its index is stored with the
  chain, and the log-density is that step's: at sampling and when re-scored."""
  rng = np.random.default_rng(0)
  w = rng.normal(scale=0.3, size=(2, 2)).astype(np.float32)
  fn = _linear_velocity(jnp.asarray(w), 0.5)
  noise = jnp.asarray(rng.normal(size=(64, 3, 2)), jnp.float32)
  chain, logp = denoise.sample_chain(fn, noise, jax.random.PRNGKey(1), num_steps=K,
                                     mode="flow_sde", noise_level=0.7, sde_steps="one")
  assert chain.shape == (64, K + 2, 3, 2) == (64, denoise.chain_entries(K, "one"), 3, 2)
  ks, ref = _numpy_one_step(np.asarray(chain, np.float64), w.astype(np.float64), 0.5, 0.7)
  assert set(ks) == set(range(K)), ks  # every step is drawn (uniform over 0 .. K-1)
  np.testing.assert_allclose(logp, ref, rtol=1e-4, atol=1e-3)
  logp2, stds = denoise.chain_log_prob(fn, chain, num_steps=K, mode="flow_sde",
                                       noise_level=0.7, sde_steps="one")
  assert stds.shape == (64, 1, 3, 2)
  np.testing.assert_allclose(logp2, logp, rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError, match="has 6 entries, got 5"):
    denoise.chain_log_prob(fn, chain[:, :K + 1], num_steps=K, mode="flow_sde",
                           noise_level=0.7, sde_steps="one")
  with pytest.raises(ValueError, match="no Gaussian steps"):
    denoise.sample_chain(fn, noise, jax.random.PRNGKey(1), num_steps=K, mode="ode",
                         noise_level=0.7, sde_steps="one")


@pytest.mark.parametrize("mode", ["flow_sde", "flow_noise"])
def test_mean_over_steps_matches_numpy(mode):
  """log_prob_steps='mean': the mean of the chain's K + 1 densities (the initial
  N(0, 1) noise's and the K transitions'), per dimension, as RLinf's joint_logprob."""
  rng = np.random.default_rng(1)
  w = rng.normal(scale=0.3, size=(2, 2)).astype(np.float32)
  fn = _linear_velocity(jnp.asarray(w), 0.5)
  noise = jnp.asarray(rng.normal(size=(6, 3, 2)), jnp.float32)
  chain, total = denoise.sample_chain(fn, noise, jax.random.PRNGKey(1), num_steps=K, mode=mode,
                                      noise_level=0.7)
  _, mean = denoise.sample_chain(fn, noise, jax.random.PRNGKey(1), num_steps=K, mode=mode,
                                 noise_level=0.7, log_prob_steps="mean")
  prior = stats.norm.logpdf(np.asarray(noise, np.float64))
  np.testing.assert_allclose(mean, (np.asarray(total) + prior) / (K + 1), rtol=1e-5, atol=1e-5)
  rescored, _ = denoise.chain_log_prob(fn, chain, num_steps=K, mode=mode, noise_level=0.7,
                                       log_prob_steps="mean")
  np.testing.assert_allclose(rescored, mean, rtol=1e-5, atol=1e-4)


def test_sde_samplers_keep_the_flow_marginal():
  """For 1-D Gaussian data the flow's exact velocity is linear, E[noise - a | x_t]; the
  ODE, the all-step SDE and the one-step SDE must all carry N(0, 1) to the data's
  N(MU, S^2) (the SDE has the ODE's marginals; with K = 50 steps the Euler error
  is about 0.01 in the std), and agree with each other."""
  mu, s, steps = 0.7, 0.3, 50

  def exact_velocity(x, t):
    t = t[:, None, None]
    cov, var = t - (1 - t) * s**2, t**2 + (1 - t)**2 * s**2
    return -mu + cov / var * (x - (1 - t) * mu), None

  noise = jax.random.normal(jax.random.PRNGKey(0), (20000, 1, 2))
  finals = {}
  for mode, sde_steps in (("ode", "all"), ("flow_sde", "all"), ("flow_sde", "one")):
    chain, _ = denoise.sample_chain(exact_velocity, noise, jax.random.PRNGKey(1),
                                    num_steps=steps, mode=mode, noise_level=0.5,
                                    sde_steps=sde_steps)
    finals[mode, sde_steps] = np.asarray(chain[:, steps])
  for key, a in finals.items():
    assert abs(a.mean() - mu) < 0.01 and abs(a.std() - s) < 0.015, (key, a.mean(), a.std())
    ode = finals["ode", "all"]
    assert abs(a.std() - ode.std()) < 0.01, (key, a.std(), ode.std())


def test_policy_one_sde_step_and_detached_value(smoke_config):
  """The real network with piRL's flow-SDE and a detached critic: the chain stores its
  stochastic step, the executed chunk is the flow's last state, the learner re-scores
  the act's log-prob exactly, and the value loss's gradient stays in the value head."""
  m = smoke_config.model
  m.train_sampler, m.sde_steps, m.value_detach = "flow_sde", "one", True
  env = builtin.make(smoke_config.env, 3, 0)
  pol = policy_lib.make_policy(m, env.spec)
  assert pol.log_prob_terms == pol.chunk_len * pol.action_dim
  params = pol.init(jax.random.PRNGKey(0))
  batch = pol.prepare(env.observe())
  out = pol.act(params, batch, jax.random.PRNGKey(1), "train")
  assert out.chain.shape[1] == pol.num_steps + 2
  np.testing.assert_array_equal(out.actions, out.chain[:, pol.num_steps, :, :pol.action_dim])
  ev = pol.evaluate(params, batch, out.chain)
  np.testing.assert_allclose(ev.log_prob, out.log_prob, rtol=1e-4, atol=1e-3)
  grads = jax.grad(lambda p: pol.evaluate(p, batch, out.chain).value.sum())(params)
  norms = {path: float(jnp.abs(g).max()) for path, g in
           zip(("/".join(str(k.key) for k in path) for path, _ in
                jax.tree_util.tree_flatten_with_path(grads)[0]), jax.tree.leaves(grads))}
  assert all(v == 0 for p, v in norms.items() if not p.startswith("rl/value_")), norms
  assert any(v > 0 for p, v in norms.items() if p.startswith("rl/value_")), norms


@pytest.mark.parametrize("sde_steps", ["all", "one"])
def test_step_log_probs_are_the_chains_scipy_terms(sde_steps):
  """``chain_step_log_probs``: each scored step's density per dim (scipy's, from the
  NumPy re-derivation), which step it is, and ``chain_log_prob`` as their sum."""
  rng = np.random.default_rng(2)
  w = rng.normal(scale=0.3, size=(2, 2)).astype(np.float32)
  fn = _linear_velocity(jnp.asarray(w), 0.5)
  noise = jnp.asarray(rng.normal(size=(8, 3, 2)), jnp.float32)
  chain, _ = denoise.sample_chain(fn, noise, jax.random.PRNGKey(1), num_steps=K,
                                  mode="flow_sde", noise_level=0.7, sde_steps=sde_steps)
  logps, stds, steps = denoise.chain_step_log_probs(fn, chain, num_steps=K, mode="flow_sde",
                                                    noise_level=0.7, sde_steps=sde_steps)
  c = np.asarray(chain, np.float64)
  if sde_steps == "one":
    ks, ref = _numpy_one_step(c, w.astype(np.float64), 0.5, 0.7)
    assert logps.shape == stds.shape == (8, 1, 3, 2)
    np.testing.assert_array_equal(steps[:, 0], ks)
    np.testing.assert_allclose(logps[:, 0], ref, rtol=1e-4, atol=1e-3)
  else:
    assert logps.shape == (8, K, 3, 2)
    np.testing.assert_array_equal(steps, np.tile(np.arange(K), (8, 1)))
    for k in range(K):  # step k alone: the chain cut to [x_k, x_k+1] on the time grid
      ts = np.linspace(1.0, 0.0, K + 1)
      x, t, dt = c[:, k], ts[k], ts[k + 1] - ts[k]
      v = np.einsum("bha,ad->bhd", x, w) + 0.5 * t
      sigma = 0.7 * np.sqrt(t / (1 - min(t, 1 - 1 / K)))
      mean = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
      np.testing.assert_allclose(logps[:, k], stats.norm.logpdf(c[:, k + 1], mean,
                                                                sigma * np.sqrt(-dt)),
                                 rtol=1e-4, atol=1e-3)
  whole, _ = denoise.chain_log_prob(fn, chain, num_steps=K, mode="flow_sde", noise_level=0.7,
                                    sde_steps=sde_steps)
  np.testing.assert_allclose(np.asarray(logps).sum(1), whole, rtol=1e-5, atol=1e-5)
