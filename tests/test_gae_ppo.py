"""GAE and the PPO loss against plain NumPy references."""

import jax.numpy as jnp
import numpy as np

from jaxvla.algorithms import gae, ppo


def numpy_gae(rewards, values, dones, bootstrap, gamma, lam):
  t_len, b = rewards.shape
  adv = np.zeros((t_len, b))
  for j in range(b):
    last = 0.0
    for t in reversed(range(t_len)):
      next_v = bootstrap[j] if t == t_len - 1 else values[t + 1, j]
      nonterminal = 1.0 - dones[t, j]
      delta = rewards[t, j] + gamma * next_v * nonterminal - values[t, j]
      last = delta + gamma * lam * nonterminal * last
      adv[t, j] = last
  return adv, adv + values


def test_gae_matches_numpy():
  rng = np.random.default_rng(0)
  t_len, b = 7, 5
  rewards = rng.normal(size=(t_len, b)).astype(np.float32)
  values = rng.normal(size=(t_len, b)).astype(np.float32)
  dones = rng.random((t_len, b)) < 0.3
  bootstrap = rng.normal(size=(b,)).astype(np.float32)
  adv, ret = gae.compute_gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(dones),
                             jnp.asarray(bootstrap), gamma=0.97, lam=0.9)
  ref_adv, ref_ret = numpy_gae(rewards, values, dones.astype(np.float32), bootstrap, 0.97, 0.9)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_does_not_bootstrap_across_done():
  rewards = np.zeros((2, 1), np.float32)
  values = np.zeros((2, 1), np.float32)
  dones = np.array([[True], [False]])
  adv, _ = gae.compute_gae(rewards, values, dones, np.array([10.0], np.float32),
                           gamma=1.0, lam=1.0)
  assert float(adv[0, 0]) == 0.0  # the episode ended: step 1's bootstrap must not leak back
  assert float(adv[1, 0]) == 10.0


def test_ppo_loss_matches_numpy():
  rng = np.random.default_rng(1)
  n = 64
  new_lp, old_lp = rng.normal(size=n), rng.normal(size=n)
  adv, val, ret, ent = (rng.normal(size=n) for _ in range(4))
  loss, metrics = ppo.ppo_loss(*(jnp.asarray(x, jnp.float32) for x in
                                 (new_lp, old_lp, adv, val, ret, ent)),
                               clip_eps=0.2, value_coef=0.5, entropy_coef=0.01)
  ratio = np.exp(new_lp - old_lp)
  pg = -np.mean(np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv))
  vl = 0.5 * np.mean((val - ret) ** 2)
  ref = pg + 0.5 * vl - 0.01 * np.mean(ent)
  np.testing.assert_allclose(loss, ref, rtol=1e-5)
  np.testing.assert_allclose(metrics["policy_loss"], pg, rtol=1e-5)
  np.testing.assert_allclose(metrics["clip_frac"], np.mean(np.abs(ratio - 1) > 0.2), rtol=1e-6)


def test_ppo_clipping_stops_gradient_beyond_clip():
  import jax
  adv = jnp.ones(4)
  grad = jax.grad(lambda lp: ppo.ppo_loss(lp, jnp.zeros(4), adv, jnp.zeros(4), jnp.zeros(4),
                                          jnp.zeros(4), clip_eps=0.2, value_coef=0.0,
                                          entropy_coef=0.0)[0])(jnp.full(4, 0.5))
  np.testing.assert_allclose(grad, 0.0)  # ratio e^0.5 > 1.2 with positive advantage: clipped
