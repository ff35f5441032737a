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
