"""GRPO in the pipeline: episodes gathered into groups, the update, and the streamed
update against the non-streamed one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from jaxvla import types
from jaxvla.envs import builtin, protocol
from jaxvla.learner import learner as learner_lib
from jaxvla.learner import optimizers as optimizers_lib
from jaxvla.learner import objectives
from jaxvla.models import contract
from jaxvla.models import policy as policy_lib
from jaxvla.rollout import groups as groups_lib
from jaxvla.rollout import rollout as rollout_lib

NUM_ENVS, GROUP_SIZE = 4, 2


# ----------------------------------------------------------- builder alone --
def _act(builder, env_ids, step, version=0):
  """Acts on ``env_ids`` with inputs ``x = 10 * env + step`` (to trace padding)."""
  env_ids = np.asarray(env_ids)
  x = (10 * env_ids + step).astype(np.float32)
  b = len(env_ids)
  out = contract.ActOutput(actions=np.zeros((b, 1, 1)), chain=x[:, None] * np.ones((b, 3)),
                           log_prob=-x, log_prob_dims=np.zeros((b, 1, 1)),
                             value=np.zeros(b))
  builder.on_act(env_ids, {"x": x[:, None]}, out, version)


def _result(env_ids, ended, episode_of, returns, group_size=GROUP_SIZE, faults=()):
  """A chunk result for ``env_ids`` where envs ``ended`` finish episode ``episode_of[i]``
  (envs in ``faults`` lost it to a worker restart)."""
  env_ids = np.asarray(env_ids)
  done = np.isin(env_ids, ended)
  stats = [protocol.EpisodeStats(env_id=int(i), group=int(i) // group_size,
                                 episode=episode_of[i], episode_return=returns[i], length=0,
                                 success=False, truncated=i in faults, fault=i in faults)
           for i in ended]
  n = len(env_ids)
  return protocol.ChunkStep(obs=None, reward=np.ones(n, np.float32), terminated=done,
                            truncated=np.zeros(n, bool), success=np.zeros(n, bool),
                            steps=np.full(n, 5, np.int32), episodes=stats,
                            has_final_obs=np.zeros(n, bool), final_obs=None)


def test_builder_gathers_groups_whose_members_finish_apart():
  """Group-mates finish at different chunks (and start their next episodes at once);
  each group is emitted once all its members are in, padded and normalised."""
  builder = groups_lib.EpisodeBuilder(NUM_ENVS, GROUP_SIZE, max_chunks=3)
  ids = np.arange(NUM_ENVS)
  returns = {0: 1.0, 1: 0.0, 2: 3.0, 3: 1.0}
  plan = [[0], [1, 2], [0, 3]]  # Envs ending an episode at each chunk step.
  episode = {i: 0 for i in ids}
  for step, ended in enumerate(plan):
    _act(builder, ids, step, version=step)
    rows = builder.on_result(ids, _result(ids, ended, episode, returns))
    assert rows.dtype == np.int64 and rows.size == 0  # No bootstrap, ever.
    for i in ended:
      episode[i] += 1
    if step == 0:
      assert builder.pop_items() == []
      # env 0's episode waits for env 1's.
      assert builder.in_flight() == types.Counts(segments=4, chunks=4, env_steps=20)
  items = builder.pop_items()
  assert len(items) == 2
  (g0, g1) = [it.data for it in items]
  np.testing.assert_array_equal(g0.group, [0, 0])
  np.testing.assert_array_equal(g0.episode, [0, 0])
  np.testing.assert_array_equal(g1.group, [1, 1])
  np.testing.assert_array_equal(g0.mask.T, [[1, 0, 0], [1, 1, 0]])
  np.testing.assert_array_equal(g1.mask.T, [[1, 1, 0], [1, 1, 1]])
  # Padding repeats the episode's last chunk, log-prob 0, no steps.
  np.testing.assert_array_equal(g0.batch["x"][:, 0, 0], [0, 0, 0])
  np.testing.assert_array_equal(g0.chain[:, 1, 0], [10, 11, 11])
  np.testing.assert_array_equal(g0.log_prob[:, 1], [-10, -11, 0])
  np.testing.assert_array_equal(g0.steps[:, 0], [5, 0, 0])
  np.testing.assert_array_equal(g1.policy_version[:, 0], [0, 1, 1])
  # Versions and counts cover played chunks only.
  assert items[0].num_chunks == 3 and items[0].versions.tolist() == [0, 0, 1]
  assert items[0].oldest_version == 0 and items[0].num_env_steps == 15
  # (R - mean) / (std + eps) per group.
  np.testing.assert_allclose(g0.advantage, [1.0, -1.0], atol=1e-5)
  np.testing.assert_allclose(g1.advantage, [1.0, -1.0], atol=1e-5)
  np.testing.assert_allclose(g1.episode_return, [3.0, 1.0])
  # Env 0's second episode waits for env 1's; envs 1 and 2 have one chunk open.
  assert builder.in_flight() == types.Counts(segments=3, chunks=4, env_steps=20)
  cat = types.concat([g0, g1])
  assert cat.num_episodes == 4 and cat.log_prob.shape == (3, 4)


def test_fault_truncated_episode_is_left_out_of_its_group():
  """A worker restart's lost episode: advantage 0, the group normalised without it."""
  builder = groups_lib.EpisodeBuilder(6, 3, max_chunks=2)
  ids = np.arange(6)
  returns = {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 1.0, 5: 0.5}
  _act(builder, ids, 0)
  builder.on_result(ids, _result(ids, list(ids), {i: 0 for i in ids}, returns, group_size=3,
                                 faults=(2, 5)))
  g0, g1 = [it.data for it in builder.pop_items()]
  # Group 0: {1.0, 0.0} without env 2's 0.0 -> +-1 (with it: 1.41, -0.71, -0.71).
  np.testing.assert_allclose(g0.advantage, [1.0, -1.0, 0.0], atol=1e-5)
  np.testing.assert_allclose(g1.advantage, [-1.0, 1.0, 0.0], atol=1e-5)
  np.testing.assert_allclose(g0.episode_return, [1.0, 0.0, 0.0])  # still reported


def test_builder_errors():
  builder = groups_lib.EpisodeBuilder(NUM_ENVS, GROUP_SIZE, max_chunks=2)
  ids = np.arange(NUM_ENVS)
  with pytest.raises(RuntimeError, match="env 0: a result arrived with no chunk"):
    builder.on_result(ids, _result(ids, [], {}, {}))
  _act(builder, ids, 0)
  bad = _result(ids, [1], {1: 0}, {1: 0.0})
  bad.episodes.clear()
  with pytest.raises(RuntimeError, match="env 1: its episode ended but .* no EpisodeStats"):
    builder.on_result(ids, bad)

  builder = groups_lib.EpisodeBuilder(NUM_ENVS, GROUP_SIZE, max_chunks=2)
  for step in range(2):
    _act(builder, ids, step)
    if step == 1:
      with pytest.raises(RuntimeError, match="max_chunks=2"):
        builder.on_result(ids, _result(ids, [], {}, {}))
    else:
      builder.on_result(ids, _result(ids, [], {}, {}))

  builder = groups_lib.EpisodeBuilder(NUM_ENVS, GROUP_SIZE, max_chunks=2)
  _act(builder, ids, 0)
  with pytest.raises(ValueError, match="group_size"):  # Env built with G = 1.
    builder.on_result(ids, _result(ids, [3], {3: 0}, {3: 0.0}, group_size=1))
  with pytest.raises(RuntimeError, match="no bootstrap"):
    builder.complete(ids[:1], np.zeros(1), np.zeros(0))
  with pytest.raises(RuntimeError, match="no bootstrap"):
    builder.final_obs(ids[:1])
  with pytest.raises(ValueError, match="env.group_size=3"):
    groups_lib.EpisodeBuilder(NUM_ENVS, 3, max_chunks=2)


# ------------------------------------------------------------ with the env --
def _config(loss_normalizer="trajectory", **ppo):
  c = default.get_config("smoke")
  c.num_envs, c.env.group_size = NUM_ENVS, GROUP_SIZE
  c.model.num_denoise_steps = 2
  # Easy reaches, 3 chunks at most: an untrained policy's returns and lengths vary.
  c.env.max_episode_steps, c.env.max_speed = 15, 0.5
  c.env.goal_radius = c.env.wrong_target_radius = 0.35
  c.algorithm, c.grpo.loss_normalizer = "grpo", loss_normalizer
  c.rl.update(ppo)
  return c


@functools.lru_cache(maxsize=1)
def _collect():
  """Two GRPO items from a lockstep rollout of the built-in env (cached: read-only use)."""
  c = _config()
  env = builtin.make(c.env, c.num_envs, 0)
  pol = policy_lib.make_policy(c.model, env.spec)
  params = pol.init(jax.random.PRNGKey(0))
  act = jax.jit(functools.partial(pol.act, mode="train"))
  k = groups_lib.max_chunks_per_episode(c.env.max_episode_steps, c.model.chunk_len)
  builder = groups_lib.EpisodeBuilder(c.num_envs, c.env.group_size, k,
                                        scale=c.grpo.scale)

  def no_values(*_):
    raise AssertionError("GRPO asked for bootstrap values")

  ro = rollout_lib.Rollout(env, pol, act, no_values, lambda: (params, 3), builder,
                           jax.random.PRNGKey(1), seed=0)
  items = []
  for _ in range(20):
    ro.step_all()
    items += ro.pop_items()
    if len(items) >= 2:
      break
  env.close()
  stats = {(e.env_id, e.episode): e for e in ro.episodes.recent}
  return c, pol, params, items, stats


def test_rollout_items_are_whole_groups():
  c, _, _, items, stats = _collect()
  assert len(items) >= 2
  k = groups_lib.max_chunks_per_episode(c.env.max_episode_steps, c.model.chunk_len)
  for it in items:
    eb = it.data
    assert eb.log_prob.shape == (k, GROUP_SIZE) and eb.mask.shape == (k, GROUP_SIZE)
    # One group: the same (group, episode) for its G envs, which started alike.
    assert len(set(eb.group.tolist())) == 1 and len(set(eb.episode.tolist())) == 1
    np.testing.assert_array_equal(eb.batch["images"][0, 0], eb.batch["images"][0, 1])
    np.testing.assert_array_equal(eb.batch["state"][0, 0], eb.batch["state"][0, 1])
    envs = eb.group[0] * GROUP_SIZE + np.arange(GROUP_SIZE)
    for col, env_id in enumerate(envs):
      s = stats[(int(env_id), int(eb.episode[col]))]
      assert eb.steps[:, col].sum() == s.length
      assert eb.mask[:, col].sum() == -(-s.length // c.model.chunk_len)
      assert eb.episode_return[col] == np.float32(s.episode_return)
      assert eb.mask[:, col].tolist() == sorted(eb.mask[:, col].tolist(), reverse=True)
    r = eb.episode_return
    np.testing.assert_allclose(eb.advantage, (r - r.mean()) / (r.std() + 1e-6), atol=1e-5)
    assert abs(eb.advantage.sum()) < 1e-5
    assert all(np.isfinite(x).all() for x in jax.tree.leaves((eb.batch, eb.chain, eb.log_prob)))
    assert (eb.log_prob[~eb.mask] == 0).all() and (eb.steps[~eb.mask] == 0).all()
    for col in range(GROUP_SIZE):  # Padding repeats the last played chunk.
      last = eb.mask[:, col].sum() - 1
      np.testing.assert_array_equal(eb.chain[last:, col], np.broadcast_to(
          eb.chain[last, col], eb.chain[last:, col].shape))
    assert it.num_chunks == eb.mask.sum() and (it.versions == 3).all()
    assert it.num_env_steps == eb.steps.sum()
  assert any((~it.data.mask).any() for it in items)  # (Some episode ended early: padded.)


@pytest.mark.run_first
def test_grpo_update_changes_params():
  c, pol, params, items, _ = _collect()
  c = _config(num_epochs=2, num_minibatches=2, correction="decoupled")
  lrn = learner_lib.Learner(pol, c)
  state = learner_lib.init_state(jax.tree.map(np.array, params), lrn.ppo_tx,
                                 jax.random.PRNGKey(2))
  eb = types.concat([it.data for it in items[:2]])
  assert np.abs(eb.advantage).max() > 0.5  # (Else there would be no gradient.)
  new_state, metrics = lrn.update(state, eb)
  metrics = jax.device_get(metrics)
  assert int(new_state.step) == 1
  for k in ("loss", "policy_loss", "approx_kl", "grad_norm", "advantage_std",
            "episode_return_mean", "episode_length_mean"):
    assert np.isfinite(metrics[k]), k
  assert "value_loss" not in metrics
  assert metrics["episode_length_mean"] == eb.mask.sum(0).mean()
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), new_state.params, params)
  assert max(jax.tree.leaves(moved)) > 0
  with pytest.raises(ValueError, match="rl.num_minibatches=3"):
    bad = _config(num_minibatches=3)
    learner_lib.Learner(pol, bad).update(new_state, eb)


class _LinearGaussian:
  """A cheap stand-in policy for the streamed-vs-update checks (they do not depend on
  the network): executed actions ``~ N(tanh(state W), exp(log_std)^2)``."""

  def __init__(self, state_dim, chunk_shape):
    self.state_dim, self.chunk_shape = state_dim, tuple(chunk_shape)  # (H, A)
    self.action_size = int(np.prod(chunk_shape))
    self.action_dim = self.chunk_shape[1]
    self.log_prob_terms = self.action_size
    self.rl_heads_only = False  # (the policy contract: RL trains every parameter)

  def init(self, rng=None):
    del rng
    w = 0.3 * jax.random.normal(jax.random.PRNGKey(7), (self.state_dim, self.action_size))
    return dict(w=w, log_std=jnp.full((self.action_size,), -0.5))

  def abstract_params(self):
    return jax.eval_shape(self.init)

  def logical_axes(self):
    return dict(w=(None, None), log_std=(None,))

  def evaluate(self, params, batch, chain):
    x = chain[:, -1].reshape(chain.shape[0], -1)  # [N, H * A] executed chunk.
    mean = jnp.tanh(batch["state"] @ params["w"])
    std = jnp.exp(params["log_std"])
    logp = jax.scipy.stats.norm.logpdf(x, mean, std)
    entropy = jnp.sum(params["log_std"] + 0.5 * jnp.log(2 * jnp.pi * jnp.e)) * jnp.ones(len(x))
    return contract.Evaluation(log_prob=logp.sum(-1),
                               log_prob_dims=logp.reshape((len(x),) + self.chunk_shape),
                               value=jnp.zeros(len(x)), entropy=entropy)


def _near_policy(pol, params, eb, seed):
  """``eb`` with behaviour log-probs near ``pol``'s at ``params`` (ratios off 1, finite),
  per dimension and per chunk (their sum)."""
  k, e = eb.log_prob.shape
  flat = lambda x: x.reshape((k * e,) + x.shape[2:])
  dims = np.asarray(pol.evaluate(params, jax.tree.map(flat, eb.batch),
                                 flat(eb.chain)).log_prob_dims).reshape(eb.log_prob_dims.shape)
  dims = dims + 0.1 * np.random.default_rng(seed).normal(size=dims.shape)
  dims = np.where(eb.mask[..., None, None], dims, 0.0).astype(np.float32)
  return eb.replace(log_prob_dims=dims, log_prob=dims.sum((2, 3)))


@pytest.mark.parametrize("normalizer,ratio", [("trajectory", "joint"), ("constant", "per_term"),
                                              ("trajectory", "per_term_correction")])
def test_streamed_grpo_equals_the_update(monkeypatch, normalizer, ratio):
  """Micro-batch gradients (one group each), accumulated and applied once, equal
  one single-minibatch GRPO update of the concatenated groups.

  The rollout's groups are scored by a linear-Gaussian policy (the accumulation
  does not depend on the network, and its compiles take a second, not 20).
  Adam's eps is 1e-3 (see test_pipeline's streamer test for why).
  """
  monkeypatch.setattr(optimizers_lib, "make_optimizer", lambda lr, clip, b1=0.9, **_: optax.chain(
      optax.clip_by_global_norm(clip), optax.adam(lr, b1=b1, eps=1e-3)))
  _, _, _, items, _ = _collect()
  eb0 = items[0].data
  pol = _LinearGaussian(eb0.batch["state"].shape[-1], eb0.chain.shape[-2:])
  params = pol.init()
  groups = [_near_policy(pol, params, it.data, seed) for seed, it in enumerate(items[:2])]
  c = _config(num_epochs=1, num_minibatches=1, loss_normalizer=normalizer,
              correction="decoupled", learning_rate=1e-2, ratio=ratio)
  lrn = learner_lib.Learner(pol, c)
  copy = lambda t: jax.tree.map(np.array, jax.device_get(t))
  state0 = copy(learner_lib.init_state(params, lrn.ppo_tx, jax.random.PRNGKey(2)))
  eb = types.concat(groups)
  assert np.abs(eb.advantage).max() > 0.5  # (Else there would be no gradient.)
  if ratio != "joint":  # Rows of the executed dims' log-probs: [E, K, H * A].
    rows = objectives.GRPOObjective(pol, c.rl, c.grpo.loss_normalizer).rows(eb)
    assert rows["log_prob"].shape == eb.log_prob.T.shape + (pol.action_size,)
  ref_state, ref_metrics = lrn.update(jax.device_put(state0), eb)
  state = jax.device_put(state0)
  acc = None
  for g in groups:
    acc = lrn.accumulate(acc, lrn.micro_grads(state.params, g, eb.num_episodes))
  new_state, metrics = lrn.apply(state, acc)
  close = functools.partial(np.testing.assert_allclose, rtol=2e-5, atol=1e-6)
  jax.tree.map(close, jax.device_get(new_state.params), jax.device_get(ref_state.params))
  jax.tree.map(close, jax.device_get(new_state.opt_state), jax.device_get(ref_state.opt_state))
  assert int(new_state.step) == int(ref_state.step) == 1
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), copy(new_state.params), state0.params)
  assert min(jax.tree.leaves(moved)) > 1e-4
  for k in ("loss", "policy_loss", "entropy", "approx_kl", "clip_frac", "is_weight",
            "grad_norm", "episode_return_mean", "episode_length_mean"):
    close(metrics[k], ref_metrics[k], atol=1e-5, err_msg=k)  # (loss ~ 0: sums cancel.)


def test_streamed_chunks_normalizer_is_an_error():
  _, pol, params, items, _ = _collect()
  c = _config(loss_normalizer="chunks")
  lrn = learner_lib.Learner(pol, c)
  with pytest.raises(ValueError, match="config.grpo.loss_normalizer='chunks' cannot be streamed"):
    lrn.micro_grads(jax.device_put(params), items[0].data, items[0].data.num_episodes)
