"""GAE and the PPO loss against plain NumPy references."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from jaxvla.algorithms import gae, ppo
from jaxvla.learner import algorithm as algorithm_lib
from jaxvla.learner import objectives
from jaxvla.learner import update as update_lib
from jaxvla.models import contract

# ppo's critic-loss and weight-clip keys (hand-built configs below)
CRITIC = dict(value_loss="mse", huber_delta=10.0, value_clip=0.0, is_clip_mode="truncate")


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


def numpy_vtrace(rewards, values, dones, bootstrap, log_rhos, gamma, lam, rho_bar, c_bar):
  """IMPALA's V-trace, one env column and one step at a time (every end terminal)."""
  t_len, b = rewards.shape
  vs, adv = np.zeros((t_len, b)), np.zeros((t_len, b))
  for j in range(b):
    for t in range(t_len):  # vs_t by its definition: a sum over the steps to the end.
      total, trace = values[t, j], 1.0
      for u in range(t, t_len):
        ratio = np.exp(log_rhos[u, j])
        next_v = 0.0 if dones[u, j] else (bootstrap[j] if u == t_len - 1 else values[u + 1, j])
        total += gamma ** (u - t) * trace * min(rho_bar, ratio) * (
            rewards[u, j] + gamma * next_v - values[u, j])
        if dones[u, j]:
          break
        trace *= lam * min(c_bar, ratio)
      vs[t, j] = total
    for t in range(t_len):
      next_vs = 0.0 if dones[t, j] else (bootstrap[j] if t == t_len - 1 else vs[t + 1, j])
      adv[t, j] = rewards[t, j] + gamma * next_vs - values[t, j]
  return adv, vs


@pytest.mark.parametrize("lam", [0.8, 1.0])
def test_vtrace_matches_numpy(lam):
  rng = np.random.default_rng(7)
  t_len, b = 6, 4
  r, v = rng.normal(size=(t_len, b)), rng.normal(size=(t_len, b))
  dones = rng.random((t_len, b)) < 0.25
  boot, log_rhos = rng.normal(size=b), rng.normal(size=(t_len, b))
  want = numpy_vtrace(r, v, dones, boot, log_rhos, 0.9, lam, 1.0, 0.9)
  got = gae.compute_vtrace(*map(jnp.asarray, (r, v, dones, boot, log_rhos)), gamma=0.9,
                           lam=lam, rho_bar=1.0, c_bar=0.9)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  # On-policy with lam = 1: the targets are the returns to the segment's end (bootstrapped).
  _, vs = gae.compute_vtrace(*map(jnp.asarray, (r, v, dones, boot, np.zeros_like(r))),
                             gamma=0.9, lam=1.0)
  np.testing.assert_allclose(vs, numpy_gae(r, v, dones, boot, 0.9, 1.0)[1], rtol=1e-5,
                             atol=1e-5)


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


def numpy_gae_by_episode(rewards, values, dones, terminated, final_values, bootstrap, gamma,
                         lam):
  """The truncation-aware reference, written forwards: ``A_t`` is the (gamma * lam)-
  discounted sum of the TD errors from ``t`` to the end of its episode (or segment).

  A step's TD error looks at the next observation's value: none after a termination,
  the episode's last observation's (``final_values``) after a truncation, the next
  step's value inside an episode, ``bootstrap`` after the segment's last step.
  """
  t_len, b = rewards.shape
  adv = np.zeros((t_len, b))
  for j in range(b):
    deltas = []
    for t in range(t_len):
      if terminated[t, j]:
        next_v = 0.0
      elif dones[t, j]:
        next_v = final_values[t, j]
      else:
        next_v = bootstrap[j] if t == t_len - 1 else values[t + 1, j]
      deltas.append(rewards[t, j] + gamma * next_v - values[t, j])
    for t in range(t_len):
      total, weight = 0.0, 1.0
      for u in range(t, t_len):
        total += weight * deltas[u]
        if dones[u, j]:
          break
        weight *= gamma * lam
      adv[t, j] = total
  return adv, adv + values


# Columns of one segment (T = 4), each a case:
#   0: terminated at t = 1;        1: truncated at t = 1 (final value 5);
#   2: truncated at the last step (final value 7, not the bootstrap 3);
#   3: terminated at t = 0 and truncated at t = 2 (final value -2);
#   4: lost to a worker fault at t = 1 (truncated, no final observation: value 0);
#   5: no episode end.
_DONE = np.array([[0, 0, 0, 1, 0, 0],
                  [1, 1, 0, 0, 1, 0],
                  [0, 0, 0, 1, 0, 0],
                  [0, 0, 1, 0, 0, 0]], bool)
_TERMINATED = np.array([[0, 0, 0, 1, 0, 0],
                        [1, 0, 0, 0, 0, 0],
                        [0, 0, 0, 0, 0, 0],
                        [0, 0, 0, 0, 0, 0]], bool)
_FINAL = np.array([[0, 0, 0, 0, 0, 0],
                   [0, 5, 0, 0, 0, 0],
                   [0, 0, 0, -2, 0, 0],
                   [0, 0, 7, 0, 0, 0]], np.float32)


def _gae(rewards, values, bootstrap, gamma, lam, **truncation):
  adv, ret = gae.compute_gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(_DONE),
                             jnp.asarray(bootstrap), gamma=gamma, lam=lam, **truncation)
  return np.asarray(adv), np.asarray(ret)


def test_gae_bootstraps_truncations_like_the_numpy_reference():
  rng = np.random.default_rng(2)
  rewards = rng.normal(size=_DONE.shape).astype(np.float32)
  values = rng.normal(size=_DONE.shape).astype(np.float32)
  bootstrap = np.full((_DONE.shape[1],), 3.0, np.float32)
  adv, ret = _gae(rewards, values, bootstrap, 0.9, 0.8, terminated=jnp.asarray(_TERMINATED),
                  final_values=jnp.asarray(_FINAL))
  ref_adv, ref_ret = numpy_gae_by_episode(rewards, values, _DONE, _TERMINATED, _FINAL,
                                          bootstrap, 0.9, 0.8)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)
  # Worked by hand with lambda = 1: the return is the rewards to the episode's end,
  # then gamma^k times what lies past it.
  r, v, g = np.ones((4, 6), np.float32), np.zeros((4, 6), np.float32), 0.5
  v[2, [0, 4]] = 9.0  # The value after an episode's end must not leak back into it.
  _, ret = _gae(r, v, bootstrap, g, 1.0, terminated=jnp.asarray(_TERMINATED),
                final_values=jnp.asarray(_FINAL))
  np.testing.assert_allclose(ret[:, 0], [1.5, 1.0, 1.5 + 0.25 * 3.0, 1.0 + 0.5 * 3.0])  # Ends at 1.
  np.testing.assert_allclose(ret[:2, 1], [1.5 + 0.25 * 5, 1.0 + 0.5 * 5])  # Truncated at 1.
  np.testing.assert_allclose(ret[3, 2], 1.0 + 0.5 * 7)  # Its final value, not the bootstrap.
  np.testing.assert_allclose(ret[:3, 3], [1.0, 1.5 + 0.25 * -2, 1.0 + 0.5 * -2])
  np.testing.assert_allclose(ret[:, 4], ret[:, 0])  # A fault is cut like a termination.
  np.testing.assert_allclose(ret[0, 5], 1 + 0.5 + 0.25 + 0.125 + 0.0625 * 3.0)


def test_gae_without_truncations_is_unchanged():
  """Every end a termination (final values 0): bit-identical to GAE without them."""
  rng = np.random.default_rng(3)
  rewards = rng.normal(size=_DONE.shape).astype(np.float32)
  values = rng.normal(size=_DONE.shape).astype(np.float32)
  bootstrap = rng.normal(size=(_DONE.shape[1],)).astype(np.float32)
  plain = _gae(rewards, values, bootstrap, 0.97, 0.9)
  explicit = _gae(rewards, values, bootstrap, 0.97, 0.9, terminated=jnp.asarray(_DONE),
                  final_values=jnp.zeros(_DONE.shape))
  np.testing.assert_array_equal(plain[0], explicit[0])
  np.testing.assert_array_equal(plain[1], explicit[1])
  with pytest.raises(ValueError, match="terminated and final_values together"):
    _gae(rewards, values, bootstrap, 0.97, 0.9, terminated=jnp.asarray(_DONE))


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


@pytest.mark.parametrize("value_loss,value_clip", [("mse", 0.2), ("huber", 0.0),
                                                   ("huber", 0.2)])
def test_value_loss_huber_and_clip_match_numpy(value_loss, value_clip):
  """RLinf's critic loss: max(huber(R - V), huber(R - V_clip)), V_clip = V_old +
  clip(V - V_old, +-c); Huber 0.5 e^2 within delta, delta (|e| - delta / 2) beyond."""
  rng = np.random.default_rng(2)
  n, delta = 64, 1.5
  val, ret, old = rng.normal(size=n), 3 * rng.normal(size=n), rng.normal(size=n)
  if value_loss == "mse":
    err = lambda e: 0.5 * e**2
  else:
    err = lambda e: np.where(np.abs(e) <= delta, 0.5 * e**2, delta * (np.abs(e) - 0.5 * delta))
  ref = err(val - ret)
  if value_clip:
    ref = np.maximum(ref, err(old + np.clip(val - old, -value_clip, value_clip) - ret))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  zeros = jnp.zeros(n)
  _, metrics = ppo.ppo_loss(zeros, zeros, zeros, f32(val), f32(ret), zeros, clip_eps=0.2,
                            value_coef=0.5, entropy_coef=0.0, old_value=f32(old),
                            value_loss=value_loss, huber_delta=delta, value_clip=value_clip)
  np.testing.assert_allclose(metrics["value_loss"], ref.mean(), rtol=1e-5)
  with pytest.raises(ValueError, match="needs the rollout's values"):
    ppo.ppo_loss(zeros, zeros, zeros, f32(val), f32(ret), zeros, clip_eps=0.2, value_coef=0.5,
                 entropy_coef=0.0, value_clip=0.2)


def test_critic_learning_rate_and_warmup():
  """rl.value_learning_rate and rl.critic_warmup_steps: the critic (rl/value_*) has its
  own Adam and step size, and the actor stands still for the warm-up's steps."""
  from jaxvla.learner import optimizers  # pylint: disable=import-outside-toplevel
  params = {"rl": {"value_out": {"kernel": jnp.zeros(3)}, "std_out": {"kernel": jnp.zeros(3)}},
            "action_out_proj": {"kernel": jnp.zeros(3)}}
  grads = jax.tree.map(lambda x: x + 1e-3, params)
  tx = optimizers.make_optimizer(1e-5, 1.0, critic_learning_rate=1e-3, critic_warmup_steps=2)
  state = tx.init(params)
  moved = []
  for _ in range(3):
    updates, state = tx.update(grads, state, params)
    moved.append(jax.tree.map(lambda u: float(jnp.abs(u).max()), updates))
  for step, m in enumerate(moved):
    np.testing.assert_allclose(m["rl"]["value_out"]["kernel"], 1e-3, rtol=1e-3)  # Adam: ~lr
    actor = 0.0 if step < 2 else 1e-5
    for leaf in (m["rl"]["std_out"]["kernel"], m["action_out_proj"]["kernel"]):
      np.testing.assert_allclose(leaf, actor, rtol=1e-3, atol=1e-12)
  # Neither: one Adam over all, the optimizer state of earlier checkpoints.
  one_adam = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-5))
  assert jax.tree.structure(optimizers.make_optimizer(1e-5, 1.0).init(params)) == (
      jax.tree.structure(one_adam.init(params)))


def test_linear_rl_schedule_decays_the_actor_to_zero_over_the_budget():
  """rl.lr_schedule='linear': the budget's optimizer steps counted from the config, the
  actor's Adam step falling from the learning rate to 0 over them after the critic's
  warm-up, the critic's at its own constant step."""
  from jaxvla import defaults  # pylint: disable=import-outside-toplevel
  from jaxvla.learner import optimizers  # pylint: disable=import-outside-toplevel
  c = defaults.get_config()
  c.num_envs, c.rollout_len, c.model.chunk_len = 4, 3, 5  # 60 env steps per update
  c.total_env_steps, c.rl.num_epochs, c.rl.num_minibatches = 590, 2, 3  # 10 updates
  assert optimizers.rl_optimizer_steps(c) == 10 * 2 * 3
  assert optimizers.rl_optimizer_steps(c, num_processes=2) == 5 * 2 * 3
  assert optimizers.rl_decay_steps(c) == 0  # 'constant'
  c.rl.lr_schedule, c.rl.critic_warmup_steps = "linear", 20
  assert optimizers.rl_decay_steps(c) == 40
  params = {"rl": {"value_out": {"kernel": jnp.zeros(3)}}, "action_out_proj": {"kernel": jnp.zeros(3)}}
  grads = jax.tree.map(lambda x: x + 1e-3, params)
  tx = optimizers.make_optimizer(1e-5, 1.0, critic_learning_rate=1e-3, critic_warmup_steps=2,
                                 decay_steps=4)
  state = tx.init(params)
  actor, critic = [], []
  for _ in range(8):
    updates, state = tx.update(grads, state, params)
    actor.append(float(jnp.abs(updates["action_out_proj"]["kernel"]).max()))
    critic.append(float(jnp.abs(updates["rl"]["value_out"]["kernel"]).max()))
  np.testing.assert_allclose(actor, [0, 0, 1e-5, 0.75e-5, 0.5e-5, 0.25e-5, 0, 0], rtol=1e-3,
                             atol=1e-12)
  np.testing.assert_allclose(critic, 1e-3, rtol=1e-3)
  # One Adam over all (no critic settings): everything decays.
  tx = optimizers.make_optimizer(1e-5, 1.0, decay_steps=2)
  state, moved = tx.init(params), []
  for _ in range(3):
    updates, state = tx.update(grads, state, params)
    moved.append(float(jnp.abs(updates["rl"]["value_out"]["kernel"]).max()))
  np.testing.assert_allclose(moved, [1e-5, 0.5e-5, 0], rtol=1e-3, atol=1e-12)


def test_ppo_clipping_stops_gradient_beyond_clip():
  adv = jnp.ones(4)
  grad = jax.grad(lambda lp: ppo.ppo_loss(lp, jnp.zeros(4), adv, jnp.zeros(4), jnp.zeros(4),
                                          jnp.zeros(4), clip_eps=0.2, value_coef=0.0,
                                          entropy_coef=0.0)[0])(jnp.full(4, 0.5))
  np.testing.assert_allclose(grad, 0.0)  # ratio e^0.5 > 1.2 with positive advantage: clipped


class _FixedLogProbs:
  """A policy whose chunk log-probs are its params (``log_prob_terms`` 160, as the
  ManiSkill3 pi0: 4 denoise steps x 5 actions x 8 dims)."""
  log_prob_terms = 160

  def evaluate(self, params, batch, chain):
    del batch, chain
    lp = params["lp"]
    return contract.Evaluation(log_prob=lp, log_prob_dims=lp[:, None, None],
                               value=jnp.zeros_like(lp), entropy=jnp.zeros_like(lp))


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_mean_ratio_is_the_geometric_mean_of_the_terms(algorithm):
  """``rl.ratio='mean'``: the loss and its gradient are PPO's on log-probs / terms."""
  rng = np.random.default_rng(3)
  n = 8
  new_lp = jnp.asarray(rng.normal(size=n) * 30, jnp.float32)  # Joint log-ratios of ~30.
  old_lp, adv = (jnp.asarray(rng.normal(size=n), jnp.float32) for _ in range(2))
  cfg = ml_collections.ConfigDict(dict(
      ratio="mean", advantage_norm="none", gamma=0.99, gae_lambda=0.95,
      clip_eps=0.2, value_coef=0.0, entropy_coef=0.0, correction="none", is_clip=0.0,
      behaviour_clip=0.0, **CRITIC))
  objective = algorithm_lib.get(algorithm).objective(
      _FixedLogProbs(), ml_collections.ConfigDict(dict(
          algorithm=algorithm, rl=cfg, grpo=dict(loss_normalizer="chunks"))))
  if algorithm == "ppo":
    rows = dict(batch={}, chain=jnp.zeros(n), log_prob=old_lp, adv=adv, returns=jnp.zeros(n),
                value=jnp.zeros(n))
    weights = objective.weights(rows)
  else:  # Episodes of one chunk each.
    rows = dict(batch={}, chain=jnp.zeros((n, 1)), log_prob=old_lp[:, None],
                mask=jnp.ones((n, 1), bool), adv=adv)
    weights = objective.weights(rows)
  loss_fn = lambda lp: objective.loss(dict(lp=lp), rows, weights)[0]
  ref_fn = lambda lp: ppo.ppo_loss(lp / 160, old_lp / 160, adv, jnp.zeros(n), jnp.zeros(n),
                                   jnp.zeros(n), clip_eps=0.2, value_coef=0.0,
                                   entropy_coef=0.0)[0]
  np.testing.assert_allclose(loss_fn(new_lp), ref_fn(new_lp), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(loss_fn)(new_lp), jax.grad(ref_fn)(new_lp), rtol=1e-5)
  _, metrics = objective.loss(dict(lp=new_lp), rows, weights)
  # Per-term log-ratios of ~0.2: some inside the clip (a joint ratio would clip them all).
  assert 0.0 < float(metrics["clip_frac"]) < 1.0
  with pytest.raises(ValueError, match="config.rl.ratio"):
    ppo.log_prob_scale("token", 160)


class _TableCritic:
  """A policy whose value of a row is ``params["v"]`` at that row's ``batch["i"]`` and
  whose log-prob is ``params["lp"]`` there: the proximal pass reads known numbers."""
  log_prob_terms = 1

  def evaluate(self, params, batch, chain):
    del chain
    lp, v = params["lp"][batch["i"]], params["v"][batch["i"]]
    return contract.Evaluation(log_prob=lp, log_prob_dims=lp[:, None, None], value=v,
                               entropy=jnp.zeros_like(lp))


@pytest.mark.parametrize("value_targets", ["rollout", "learner", "vtrace"])
def test_learner_value_targets_and_staleness_diagnostics(value_targets):
  """``rl.value_targets='learner'``: GAE from the proximal critic (the rollout's
  bootstrap values kept); either way the update logs the behaviour -> proximal KL,
  value and advantage drift, split into fresh (current version) and stale rows."""
  from jaxvla import types  # pylint: disable=import-outside-toplevel
  from jaxvla.learner import update  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(5)
  t_len, b = 4, 6
  f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
  done = rng.random((t_len, b)) < 0.3
  traj = types.Trajectory(
      batch=dict(i=np.arange(t_len * b).reshape(t_len, b)), chain=np.zeros((t_len, b, 1)),
      log_prob=f32(t_len, b), log_prob_dims=np.zeros((t_len, b, 1, 1), np.float32),
      value=f32(t_len, b), reward=f32(t_len, b), done=done,
      terminated=done, final_value=np.zeros((t_len, b), np.float32),
      steps=np.ones((t_len, b), np.int32), bootstrap_value=f32(b),
      # Columns 0-2 acted with version 7 (the learner's: fresh), 3-5 with 5 (stale).
      policy_version=np.repeat(np.array([[7, 7, 7, 5, 5, 5]], np.int32), t_len, 0))
  cfg = ml_collections.ConfigDict(dict(
      algorithm="ppo", ratio="joint", gamma=0.9, gae_lambda=0.8, value_targets=value_targets,
      correction="decoupled", num_epochs=2, num_minibatches=2, clip_eps=0.2, value_coef=0.5,
      entropy_coef=0.0, is_clip=2.0, behaviour_clip=0.0, **CRITIC))
  objective = objectives.PPOObjective(_TableCritic(), cfg)
  params = dict(lp=jnp.asarray(f32(t_len * b)), v=jnp.asarray(f32(t_len * b)))
  rows = update._with_proximal(objective, params, traj, objective.rows(traj),  # pylint: disable=protected-access
                               version=7)
  v_learner = np.asarray(params["v"]).reshape(t_len, b)
  want_adv, want_ret = numpy_gae(traj.reward, v_learner, done, traj.bootstrap_value, 0.9, 0.8)
  rollout_adv, rollout_ret = numpy_gae(traj.reward, traj.value, done, traj.bootstrap_value,
                                       0.9, 0.8)
  if value_targets == "rollout":
    want_adv, want_ret = rollout_adv, rollout_ret
  elif value_targets == "vtrace":  # Ratios of the proximal to the behaviour log-probs.
    log_rhos = np.asarray(params["lp"]).reshape(t_len, b) - traj.log_prob
    want_adv, want_ret = numpy_vtrace(traj.reward, v_learner, done, traj.bootstrap_value,
                                      log_rhos, 0.9, 0.8, 1.0, 1.0)
  np.testing.assert_allclose(rows["adv"], want_adv.reshape(-1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rows["returns"], want_ret.reshape(-1), rtol=1e-5, atol=1e-5)
  m = objective.batch_metrics(traj, rows)
  stale = np.tile(np.arange(b) >= 3, t_len)
  np.testing.assert_allclose(m["stale_frac"], 0.5)
  drift = np.abs(np.asarray(params["v"]) - traj.value.reshape(-1))
  np.testing.assert_allclose(m["value_drift_stale"], drift[stale].mean(), rtol=1e-5)
  np.testing.assert_allclose(m["value_drift_fresh"], drift[~stale].mean(), rtol=1e-5)
  d = np.asarray(params["lp"]) - traj.log_prob.reshape(-1)
  np.testing.assert_allclose(m["kl_behaviour_proximal"], np.mean(np.exp(d) - 1 - d), rtol=1e-5)
  learner_adv = numpy_gae(traj.reward, v_learner, done, traj.bootstrap_value, 0.9, 0.8)[0]
  adv_drift = np.abs(learner_adv - rollout_adv).reshape(-1) / rollout_adv.std()
  np.testing.assert_allclose(m["advantage_drift_stale"], adv_drift[stale].mean(), rtol=1e-4)


class _OneStep:
  """One decoupled-PPO optimizer step (plain SGD) of a table critic on a fixed batch:
  ``(params change, metrics)`` for a ``rl.step_scale``, the behaviour log-probs and the
  rows' policy versions, at the learner's ``version``."""

  def __init__(self, seed: int):
    rng = np.random.default_rng(seed)
    self.t_len, self.b = 2, 8
    self.f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    n = self.t_len * self.b
    self.params = dict(lp=jnp.asarray(self.f32(n)), v=jnp.asarray(self.f32(n)))
    self.value, self.reward = self.f32(self.t_len, self.b), self.f32(self.t_len, self.b)
    self.bootstrap = self.f32(self.b)

  def __call__(self, step_scale, behaviour_log_prob, policy_version=None, version=0):
    import optax  # pylint: disable=import-outside-toplevel
    from jaxvla import types  # pylint: disable=import-outside-toplevel
    from jaxvla.learner import update  # pylint: disable=import-outside-toplevel
    t_len, b = self.t_len, self.b
    zeros = np.zeros((t_len, b), bool)
    traj = types.Trajectory(
        batch=dict(i=np.arange(t_len * b).reshape(t_len, b)), chain=np.zeros((t_len, b, 1)),
        log_prob=behaviour_log_prob, log_prob_dims=behaviour_log_prob[..., None, None],
        value=self.value, reward=self.reward, done=zeros,
        terminated=zeros, final_value=np.zeros((t_len, b), np.float32),
        steps=np.ones((t_len, b), np.int32), bootstrap_value=self.bootstrap,
        policy_version=(np.zeros((t_len, b), np.int32) if policy_version is None
                        else policy_version))
    traj = jax.tree.map(jnp.asarray, traj)  # (on the device, as the learner passes it)
    cfg = ml_collections.ConfigDict(dict(
        algorithm="ppo", ratio="joint", gamma=0.9, gae_lambda=0.8, value_targets="rollout",
        correction="decoupled", num_epochs=1, num_minibatches=1, clip_eps=0.2,
        value_coef=0.5, entropy_coef=0.0, is_clip=2.0, behaviour_clip=0.0, advantage_norm="none",
        target_kl=0.0, step_scale=step_scale, **CRITIC))
    tx = optax.sgd(0.1)
    new, _, metrics = update.epochs_update(objectives.PPOObjective(_TableCritic(), cfg), tx,
                                           cfg, self.params, tx.init(self.params), traj,
                                           jax.random.PRNGKey(0), version=version)
    return jax.tree.map(lambda a, b: np.asarray(a - b), new, self.params), metrics


def test_ess_step_scale_shrinks_the_step_by_the_weights_effective_sample_size():
  """``rl.step_scale='ess'``: one optimizer step moves the params by
  ``mean(w)^2 / mean(w^2)`` of the step 'none' takes (w: the applied decoupled
  weights), and by exactly that step on fresh data (all weights 1)."""
  step = _OneStep(11)
  params, t_len, b = step.params, step.t_len, step.b
  stale = np.asarray(params["lp"]).reshape(t_len, b) + step.f32(t_len, b)  # Weights e^{-noise}.
  plain, _ = step("none", stale)
  scaled, metrics = step("ess", stale)
  w = np.minimum(np.exp(np.asarray(params["lp"]) - stale.reshape(-1)), 2.0)
  ess = w.mean() ** 2 / np.mean(w ** 2)
  assert 0.2 < ess < 0.95
  np.testing.assert_allclose(metrics["step_scale"], ess, rtol=1e-5)
  for k in plain:
    np.testing.assert_allclose(scaled[k], ess * plain[k], rtol=1e-4, atol=1e-7)
  fresh = np.asarray(params["lp"]).reshape(t_len, b)  # Behaviour = proximal: w = 1.
  for a, b_ in zip(jax.tree.leaves(step("none", fresh)[0]), jax.tree.leaves(step("ess", fresh)[0])):
    np.testing.assert_allclose(a, b_, rtol=1e-6)
  with pytest.raises(ValueError, match="config.rl.step_scale"):
    ppo.step_scale("adaptive", dict(is_weight=1.0, is_weight_sq=1.0))


def test_staleness_step_scale_shrinks_steps_staler_than_two_versions():
  """``rl.step_scale='staleness'``: a step whose rows are on average ``lag`` versions
  behind the learner moves the params by ``min(1, 2 / lag)`` of the step 'none' takes;
  ``lag`` is logged per step."""
  step = _OneStep(12)
  t_len, b = step.t_len, step.b
  behaviour = np.asarray(step.params["lp"]).reshape(t_len, b) + step.f32(t_len, b)
  for lags, expected in (([9, 8, 7, 4, 4, 4, 3, 1], 5.0), ([1, 2, 1, 2, 1, 2, 1, 2], 1.5)):
    versions = np.tile(10 - np.array(lags, np.int32), (t_len, 1))
    plain, _ = step("none", behaviour, versions, version=10)
    scaled, metrics = step("staleness", behaviour, versions, version=10)
    np.testing.assert_allclose(metrics["lag"], expected, rtol=1e-6)
    scale = min(1.0, 2.0 / expected)
    np.testing.assert_allclose(metrics["step_scale"], scale, rtol=1e-6)
    for k in plain:
      np.testing.assert_allclose(scaled[k], scale * plain[k], rtol=1e-4, atol=1e-7)


def test_fresh_data_skips_the_proximal_pass_and_is_the_same_update():
  """``behaviour_is_proximal`` (sync_colocated): with the behaviour log-probs taken as the
  proximal ones, two epochs of two minibatches of decoupled PPO on fresh data move the
  params as the update with its proximal pass does."""
  import optax  # pylint: disable=import-outside-toplevel
  from jaxvla import types  # pylint: disable=import-outside-toplevel
  from jaxvla.learner import update  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(12)
  t_len, b = 2, 8
  f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
  params = dict(lp=jnp.asarray(f32(t_len * b)), v=jnp.asarray(f32(t_len * b)))
  zeros = np.zeros((t_len, b), bool)
  traj = jax.tree.map(jnp.asarray, types.Trajectory(
      batch=dict(i=np.arange(t_len * b).reshape(t_len, b)), chain=np.zeros((t_len, b, 1)),
      log_prob=np.asarray(params["lp"]).reshape(t_len, b),
      log_prob_dims=np.asarray(params["lp"]).reshape(t_len, b, 1, 1), value=f32(t_len, b),
      reward=f32(t_len, b), done=zeros, terminated=zeros,
      final_value=np.zeros((t_len, b), np.float32), steps=np.ones((t_len, b), np.int32),
      bootstrap_value=f32(b), policy_version=np.zeros((t_len, b), np.int32)))
  cfg = ml_collections.ConfigDict(dict(
      algorithm="ppo", ratio="joint", gamma=0.9, gae_lambda=0.8, value_targets="rollout",
      correction="decoupled", num_epochs=2, num_minibatches=2, clip_eps=0.2,
      value_coef=0.5, entropy_coef=0.0, is_clip=2.0, behaviour_clip=2.0,
      advantage_norm="minibatch", target_kl=0.0, step_scale="none", **CRITIC))
  tx = optax.sgd(1.0)  # (large: the later steps' ratios leave the clip range)
  run = lambda fresh: update.epochs_update(
      objectives.PPOObjective(_TableCritic(), cfg), tx, cfg, params, tx.init(params), traj,
      jax.random.PRNGKey(0), behaviour_is_proximal=fresh)
  new, _, metrics = run(True)
  ref, _, ref_metrics = run(False)
  for k in params:
    np.testing.assert_allclose(new[k], ref[k], rtol=1e-5, atol=1e-6)
  assert float(ref_metrics["clip_frac"]) > 0  # The clip acted: the proximal ones matter.
  assert "kl_behaviour_proximal" in ref_metrics and "kl_behaviour_proximal" not in metrics


class _SplitTableCritic(_TableCritic):
  """:class:`_TableCritic` with its tables where the optimizer's labels put them: the
  log-probs under the actor (``rl/steer_lp``), the values under the critic (``rl/value_v``)."""

  def evaluate(self, params, batch, chain):
    tables = dict(lp=params["rl"]["steer_lp"], v=params["rl"]["value_v"])
    return super().evaluate(tables, batch, chain)


def test_kl_stop_of_the_actor_alone_lets_the_critic_step_on():
  """``rl.target_kl_stops``: once approx. KL passes ``rl.target_kl``, 'update' skips the
  rest of the update; 'actor' keeps the actor's params and Adam state as 'update' leaves
  them while the critic takes every step, as with no KL stop at all."""
  from jaxvla import types  # pylint: disable=import-outside-toplevel
  from jaxvla.learner import optimizers  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(13)
  t_len, b = 2, 8
  f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
  params = dict(rl=dict(steer_lp=jnp.asarray(f32(t_len * b)), value_v=jnp.asarray(f32(t_len * b))))
  zeros = np.zeros((t_len, b), bool)
  traj = jax.tree.map(jnp.asarray, types.Trajectory(
      batch=dict(i=np.arange(t_len * b).reshape(t_len, b)), chain=np.zeros((t_len, b, 1)),
      log_prob=np.asarray(params["rl"]["steer_lp"]).reshape(t_len, b),
      log_prob_dims=np.zeros((t_len, b, 1, 1), np.float32), value=f32(t_len, b),
      reward=f32(t_len, b), done=zeros, terminated=zeros,
      final_value=np.zeros((t_len, b), np.float32), steps=np.ones((t_len, b), np.int32),
      bootstrap_value=f32(b), policy_version=np.zeros((t_len, b), np.int32)))
  # No global-norm clip to speak of: the critic's steps must not depend on the actor's.
  tx = optimizers.make_optimizer(0.05, 1e6, critic_learning_rate=0.1)

  def run(target_kl, stops):
    cfg = ml_collections.ConfigDict(dict(
        algorithm="ppo", ratio="joint", gamma=0.9, gae_lambda=0.8, value_targets="rollout",
        correction="decoupled", num_epochs=2, num_minibatches=2, clip_eps=0.2,
        value_coef=0.5, entropy_coef=0.0, is_clip=2.0, behaviour_clip=0.0,
        advantage_norm="minibatch", target_kl=target_kl, target_kl_stops=stops,
        step_scale="none", **CRITIC))
    return update_lib.epochs_update(objectives.PPOObjective(_SplitTableCritic(), cfg), tx,
                                    cfg, params, tx.init(params), traj, jax.random.PRNGKey(0))

  # A table's step moves only its minibatch's rows: the first epoch's two steps see a KL of
  # 0, the second epoch's first one passes 1e-6 (it is applied) and the last is not.
  (free, free_opt, free_m), (whole, whole_opt, whole_m), (actor, actor_opt, actor_m) = (
      run(0.0, "update"), run(1e-6, "update"), run(1e-6, "actor"))
  assert float(free_m["skipped"]) == 0
  np.testing.assert_allclose(whole_m["skipped"], 0.25)
  np.testing.assert_allclose(actor_m["skipped"], 0.25)  # (of the actor's steps)
  np.testing.assert_array_equal(actor["rl"]["steer_lp"], whole["rl"]["steer_lp"])
  assert np.abs(np.asarray(actor["rl"]["steer_lp"] - free["rl"]["steer_lp"])).max() > 1e-3
  np.testing.assert_allclose(actor["rl"]["value_v"], free["rl"]["value_v"], rtol=1e-6)
  assert np.abs(np.asarray(actor["rl"]["value_v"] - whole["rl"]["value_v"])).max() > 1e-3
  critic_count = lambda s: int(s[1].inner_states["critic"].inner_state[0].count)
  actor_count = lambda s: int(s[1].inner_states["actor"].inner_state[0].count)
  assert (actor_count(actor_opt), critic_count(actor_opt)) == (3, 4)
  assert (actor_count(whole_opt), critic_count(whole_opt)) == (3, 3)
  assert (actor_count(free_opt), critic_count(free_opt)) == (4, 4)
  jax.tree.map(np.testing.assert_array_equal, actor_opt[1].inner_states["actor"],
               whole_opt[1].inner_states["actor"])


def test_per_term_rows_and_their_fresh_gradient_equal_the_joint_ones(smoke_config):
  """The per-term ratios with the tiny pi0 (network actions padded past the env's):
  the rows hold the executed dims' behaviour log-probs ``[N, H * A]`` (summing to the
  chunk's), and on fresh data the learner's gradient is the joint ratio's. (Checked for
  the default, ``per_term_correction``; ``per_term`` reads the same rows, and its loss's
  fresh gradient is the joint one in test_offpolicy.py.)"""
  import trajectories  # pylint: disable=import-outside-toplevel
  from jaxvla.envs import builtin  # pylint: disable=import-outside-toplevel
  from jaxvla.learner import learner as learner_lib  # pylint: disable=import-outside-toplevel
  from jaxvla.models import policy as policy_lib  # pylint: disable=import-outside-toplevel
  smoke_config.model.num_denoise_steps = 2  # (compile time; the chain is not the point)
  smoke_config.model.action_dim = 4  # Two padded dims, which the terms leave out.
  env = builtin.make(smoke_config.env, 4, 0)
  pol = policy_lib.make_policy(smoke_config.model, env.spec)
  params = pol.init(jax.random.PRNGKey(0))
  traj = trajectories.sampled(pol, env, params)
  grads = {}
  for ratio in ("joint", "per_term_correction"):
    smoke_config.rl.ratio = ratio
    rows = objectives.PPOObjective(pol, smoke_config.rl).rows(traj)
    lrn = learner_lib.Learner(pol, smoke_config)
    grads[ratio], metrics = lrn.micro_grads(params, traj, traj.num_rows)
    assert np.isfinite(float(metrics["loss"]))
  n = traj.num_rows
  assert rows["log_prob"].shape == (n, pol.chunk_len * env.spec.action_dim)
  np.testing.assert_allclose(rows["log_prob"].sum(-1), traj.log_prob.reshape(-1), rtol=1e-5,
                             atol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5),
               grads["per_term_correction"], grads["joint"])
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads["joint"])) > 1e-3
  # A whole update of two minibatches: the proximal pass's per-term log-probs line up
  # with the rows (the second minibatch's ratio is off 1, the first's weights are 1).
  # With rl.kl_detail_rows, the update's KL per denoise step and per executed dim.
  smoke_config.rl.update(num_epochs=1, num_minibatches=2, kl_detail_rows=n // 2)
  lrn = learner_lib.Learner(pol, smoke_config)
  state = learner_lib.init_state(params, lrn.ppo_tx, jax.random.PRNGKey(1))
  _, metrics = lrn.update(state, traj)
  assert metrics["nonfinite"] == 0 and float(metrics["approx_kl"]) > 0
  np.testing.assert_allclose(float(metrics["is_weight"]), 1.0, atol=1e-3)
  steps = [float(metrics[f"update_kl/step{k}"]) for k in range(pol.num_steps)]
  dims = [float(metrics[f"update_kl/dim{a}"]) for a in range(env.spec.action_dim)]
  assert f"update_kl/dim{env.spec.action_dim}" not in metrics  # (padded dims left out)
  assert float(metrics["update_kl"]) > 0 and min(steps) > 0
  np.testing.assert_allclose(sum(steps), float(metrics["update_kl"]), rtol=1e-4)
  np.testing.assert_allclose(sum(dims), float(metrics["update_kl"]), rtol=1e-4)


class _StepGaussians:
  """A stand-in flow objective whose chain entries are Gaussian draws: step ``k``'s dim
  ``a`` has mean ``params["mu"][k, a]`` and std ``params["std"]``, scored per stored step."""

  def __init__(self, num_steps: int, one: bool):
    self.policy = SimpleNamespace(num_steps=num_steps)
    self.one = one

  def step_log_probs(self, params, rows):
    chain = rows["chain"]  # [n, S, H, A]; with one, the step index is in batch["k"]
    steps = (rows["batch"]["k"][:, None] if self.one
             else jnp.broadcast_to(jnp.arange(chain.shape[1]), chain.shape[:2]))
    mean = params["mu"][steps][:, :, None, :]
    z = (chain - mean) / params["std"]
    return -0.5 * z * z - jnp.log(params["std"]) - 0.5 * np.log(2 * np.pi), steps


@pytest.mark.parametrize("one", [False, True])
def test_update_kl_detail_per_step_and_dim_against_numpy(one):
  """``update_kl_detail`` against NumPy: the evenly spaced rows, the k3 terms of the
  after/before log-ratio summed per step (a mean over the rows that scored it: with one
  stochastic step per row, a step no row chose is 0) and per dim, and |log-ratio|."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(3)
  n, num_steps, h, a, r = 12, 3, 2, 2, 4
  chain = rng.normal(size=(n, 1 if one else num_steps, h, a)).astype(np.float32)
  k = np.array([0, 1, 0, 2, 0, 1, 0, 2, 0, 1, 0, 0])  # rows 0, 3, 6, 9 scored: k 0, 2, 0, 1
  if one:
    k[9] = 0  # ... and with one step per row, step 1 by none of them
  before = dict(mu=rng.normal(size=(num_steps, a)).astype(np.float32), std=np.float32(0.7))
  after = dict(mu=before["mu"] + 0.2 * rng.normal(size=(num_steps, a)).astype(np.float32),
               std=np.float32(0.8))
  rows = dict(chain=jnp.asarray(chain), batch=dict(k=jnp.asarray(k)))
  got = jax.device_get(update_lib.update_kl_detail(
      _StepGaussians(num_steps, one), jax.tree.map(jnp.asarray, before),
      jax.tree.map(jnp.asarray, after), rows, r))
  picked = [0, 3, 6, 9]
  kl_step, abs_step, count = np.zeros(num_steps), np.zeros(num_steps), np.zeros(num_steps)
  kl_dim, total = np.zeros(a), 0.0
  for i in picked:
    for s in range(chain.shape[1]):
      step = k[i] if one else s
      x = chain[i, s].astype(np.float64)
      d = (stats.norm.logpdf(x, after["mu"][step], after["std"])
           - stats.norm.logpdf(x, before["mu"][step], before["std"]))
      k3 = np.exp(d) - 1 - d
      kl_step[step] += k3.sum()
      abs_step[step] += np.abs(d).mean()
      count[step] += 1
      kl_dim += k3.sum(0) / r
      total += k3.sum() / r
  safe = np.maximum(count, 1)
  np.testing.assert_allclose(got["update_kl"], total, rtol=1e-4)
  for s in range(num_steps):
    np.testing.assert_allclose(got[f"update_kl/step{s}"], kl_step[s] / safe[s], rtol=1e-4)
    np.testing.assert_allclose(got[f"update_log_ratio_abs/step{s}"], abs_step[s] / safe[s],
                               rtol=1e-4)
  for d in range(a):
    np.testing.assert_allclose(got[f"update_kl/dim{d}"], kl_dim[d], rtol=1e-4)
  if one:
    assert got["update_kl/step1"] == 0 and count[1] == 0
  with pytest.raises(ValueError, match=r"rl.kl_detail_rows=13 must be in \[1, 12\]"):
    update_lib.update_kl_detail(_StepGaussians(num_steps, one), before, after, rows, 13)


def test_grad_norms_split_the_whole_norm_by_module_expert_and_layer():
  """Parts in openpi's pi0 layout against NumPy: ``PaliGemma``'s second level, the
  ``_1`` (action expert) leaves of the ``llm`` apart, stacked layers per layer; the
  parts' squares add up to the whole norm's."""
  rng = np.random.default_rng(0)
  a = lambda *shape: rng.normal(size=shape).astype(np.float32)
  g = {"PaliGemma": {"img": {"head": {"kernel": a(3, 4)}},
                     "llm": {"embedder": {"input_embedding": a(6, 4)},
                             "final_norm_1": {"scale": a(4)},
                             "layers": {"attn": {"q_einsum": {"w": a(2, 3, 4)},
                                                 "q_einsum_1": {"w": a(2, 3, 4)}},
                                        "mlp_1": {"linear": a(2, 5)}}}},
       "action_out_proj": {"kernel": a(4, 3), "bias": a(3)},
       "rl": {"value_out": {"kernel": a(4, 1)}}}
  got = jax.device_get(update_lib.grad_norms(jax.tree.map(jnp.asarray, g)))
  llm, layers = g["PaliGemma"]["llm"], g["PaliGemma"]["llm"]["layers"]
  sq = lambda *xs: sum(float(np.sum(np.square(x, dtype=np.float64))) for x in xs)
  want = {
      "grad_norm/img": sq(g["PaliGemma"]["img"]["head"]["kernel"]),
      "grad_norm/llm": sq(llm["embedder"]["input_embedding"], layers["attn"]["q_einsum"]["w"]),
      "grad_norm/llm_expert": sq(llm["final_norm_1"]["scale"], layers["attn"]["q_einsum_1"]["w"],
                                 layers["mlp_1"]["linear"]),
      "grad_norm/action_out_proj": sq(*g["action_out_proj"].values()),
      "grad_norm/rl": sq(g["rl"]["value_out"]["kernel"]),
  }
  for i in range(2):
    want[f"grad_norm/llm/layer{i}"] = sq(layers["attn"]["q_einsum"]["w"][i])
    want[f"grad_norm/llm_expert/layer{i}"] = sq(layers["attn"]["q_einsum_1"]["w"][i],
                                                layers["mlp_1"]["linear"][i])
  assert set(got) == set(want) | {"grad_norm"}
  for k, v in want.items():
    np.testing.assert_allclose(got[k], np.sqrt(v), rtol=1e-5, err_msg=k)
  parts = [k for k in want if "/layer" not in k]
  whole = float(optax.tree.norm(jax.tree.map(jnp.asarray, g)))
  np.testing.assert_allclose(got["grad_norm"], whole, rtol=1e-5)
  np.testing.assert_allclose(np.sqrt(sum(got[k] ** 2 for k in parts)), whole, rtol=1e-5)
