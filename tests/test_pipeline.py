"""The asynchronous pipeline: queue, pacing, weight broadcast, segment building,
the streamed learner against the non-streamed one, and every mode end to end."""

import functools
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from jaxvla import train, types
from jaxvla.envs import builtin, make_vec_env, protocol
from jaxvla.learner import learner as learner_lib
from jaxvla.learner import objectives as objectives_lib
from jaxvla.learner import optimizers as optimizers_lib
from jaxvla.models import fast_tokenizer as fast_lib
from jaxvla.models import policy as policy_lib
from jaxvla.rollout import pacer as pacer_lib
from jaxvla.rollout import rollout as rollout_lib
from jaxvla.rollout import segments as segments_lib
from jaxvla.runtime import broadcast as broadcast_lib
from jaxvla.runtime import pipeline as pipeline_lib
from jaxvla.runtime import queue as queue_lib
from jaxvla.storage import policy_io
from tests import end_to_end


def _item(versions, steps=5):
  versions = np.asarray(versions, np.int32)
  return types.Item(data=None, versions=versions, num_chunks=versions.size,
                        num_env_steps=steps * versions.size)


# -------------------------------------------------------------------- queue --
def test_queue_drops_stale_items_and_counts_them():
  q = queue_lib.TrajectoryQueue(capacity=4, max_staleness=1)
  q.put(_item([0, 0]))
  q.put(_item([1, 2]))
  q.put(_item([2, 2]))
  item, staleness = q.get(learner_version=2)  # [0, 0] is 2 versions old: dropped.
  assert item.oldest_version == 1 and staleness == 1
  assert q.stats.dropped_items == 1 and q.stats.dropped_chunks == 2
  assert q.stats.dropped_env_steps == 10
  assert q.get(learner_version=2)[1] == 0
  with pytest.raises(TimeoutError):
    q.get(learner_version=2, timeout=0.01)


def test_queue_hands_each_dropped_item_to_on_drop():
  dropped = []
  q = queue_lib.TrajectoryQueue(capacity=4, max_staleness=0, on_drop=dropped.append)
  q.put(_item([0, 0]))
  q.put(_item([1]))
  item, _ = q.get(learner_version=1)
  assert item.oldest_version == 1 and [d.oldest_version for d in dropped] == [0]


def test_queue_full_blocks_producer_until_get():
  q = queue_lib.TrajectoryQueue(capacity=1, max_staleness=-1)
  q.put(_item([0]))
  with pytest.raises(TimeoutError, match="full"):
    q.put(_item([0]), timeout=0.05)
  done = threading.Event()

  def producer():
    q.put(_item([1]))
    done.set()

  t = threading.Thread(target=producer)
  t.start()
  time.sleep(0.05)
  assert not done.is_set()  # Blocked: nothing was dropped to make room.
  q.get(0)
  t.join(5)
  assert done.is_set() and len(q) == 1 and q.stats.dropped_items == 0


def test_queue_close_wakes_waiters():
  q = queue_lib.TrajectoryQueue(capacity=1, max_staleness=-1)
  errors = []

  def consumer():
    try:
      q.get(0)
    except queue_lib.Closed:
      errors.append("closed")

  t = threading.Thread(target=consumer)
  t.start()
  q.close()
  t.join(5)
  assert errors == ["closed"]
  with pytest.raises(queue_lib.Closed):
    q.put(_item([0]))


def test_pacer_bounds_started_segments_by_version():
  pacer = pacer_lib.Pacer(segments_per_update=4, max_staleness=1)
  assert pacer.start(4, version=0) == 0
  assert pacer.start(4, version=0) == 0  # (0 + 1 + 1) * 4 = 8 may start with version 0.
  started = []
  t = threading.Thread(target=lambda: started.append(pacer.start(2, version=0)))
  t.start()
  time.sleep(0.05)
  assert not started  # The 9th segment must wait for version 1.
  pacer.set_version(1)
  t.join(5)
  assert started == [1] and pacer.started == 10
  pacer.close()
  with pytest.raises(queue_lib.Closed):
    pacer.start(100, version=1)


def test_pacer_acquire_grants_what_the_limit_allows():
  pacer = pacer_lib.Pacer(segments_per_update=4, max_staleness=0)
  assert pacer.acquire(3, version=0, block=False) == (3, 0)
  assert pacer.acquire(3, version=0, block=False) == (1, 0)  # (0 + 0 + 1) * 4 = 4 in all.
  assert pacer.acquire(2, version=0, block=False) == (0, 0)
  got = []
  t = threading.Thread(target=lambda: got.append(pacer.acquire(2, version=0, block=True)))
  t.start()
  time.sleep(0.05)
  assert not got
  pacer.set_version(1)
  t.join(5)
  assert got == [(2, 1)] and pacer.started == 6
  pacer.close()
  with pytest.raises(queue_lib.Closed):
    pacer.acquire(1, version=1, block=True)


def test_pacer_release_gives_back_the_starts_of_dropped_segments():
  # 2 envs, k = 1: 4 starts with version 0. Without the release, each dropped segment
  # would keep its start for the rest of the run; four would stall it for good.
  pacer = pacer_lib.Pacer(segments_per_update=2, max_staleness=1)
  assert pacer.acquire(5, version=0, block=False) == (4, 0)
  pacer.set_version(1)  # Update 0 consumed 2 segments...
  assert pacer.acquire(3, version=1, block=False) == (2, 1)
  pacer.release(1)  # ... and the queue dropped one of the rest.
  assert pacer.acquire(3, version=1, block=False) == (1, 1) and pacer.started == 6
  with pytest.raises(ValueError, match="count >= 0"):
    pacer.release(-1)


# ------------------------------------------------------------------- params --
def test_param_server_copies_and_versions():
  landed = []
  server = broadcast_lib.ParamServer(jax.devices()[0], on_ready=lambda v, a, b: landed.append(v))
  params = {"w": jax.numpy.ones((3,))}
  server.publish(params, 0, wait=True)
  got, version = server.latest()
  assert version == 0 and landed == [0]
  # A copy, not an alias: deleting (donating) the learner's array leaves it valid.
  params["w"].delete()
  np.testing.assert_array_equal(got["w"], np.ones(3))
  server.publish({"w": jax.numpy.full((3,), 2.0)}, 1)
  deadline = time.time() + 10
  while server.version() < 1 and time.time() < deadline:
    time.sleep(0.01)
  np.testing.assert_array_equal(server.latest()[0]["w"], np.full(3, 2.0))
  server.close()


def test_param_server_cast_copy():
  server = broadcast_lib.ParamServer(jax.devices()[0], cast="bfloat16")
  params = {"w": jax.numpy.full((3,), 1.00001), "step": jax.numpy.array(3, jax.numpy.int32)}
  server.publish(params, 0, wait=True)
  got, _ = server.latest()
  assert got["w"].dtype == jax.numpy.bfloat16 and got["step"].dtype == jax.numpy.int32
  np.testing.assert_array_equal(np.asarray(got["w"], np.float32), np.ones(3))
  params["w"].delete()  # The learner's buffers may be donated: the copy is independent.
  assert np.asarray(got["w"], np.float32).sum() == 3.0
  server.close()
  with pytest.raises(ValueError, match="not a floating dtype"):
    broadcast_lib.ParamServer(jax.devices()[0], cast="int32")


# ----------------------------------------------------------------- segments --
def _setup(num_envs=4, **overrides):
  c = default.get_config("smoke")
  c.num_envs, c.rollout_len = num_envs, 3
  c.model.num_denoise_steps = 2
  for k, v in overrides.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  env = builtin.make(c.env, c.num_envs, 0)
  pol = policy_lib.make_policy(c.model, env.spec)
  params = pol.init(jax.random.PRNGKey(0))
  act = jax.jit(functools.partial(pol.act, mode="train"))
  return c, env, pol, params, act, jax.jit(pol.value)


def _reference_collect(env, pol, act, value, params, num_steps, rng, policy_version, seed):
  """The plainest lockstep loop: ``num_steps`` chunks of every env -> ``Trajectory [T, B]``."""
  obs = env.reset(seed)
  steps, outs, results, finals = [], [], [], []
  for key in jax.random.split(rng, num_steps):
    batch = pol.prepare(obs)
    out = jax.device_get(act(params, batch, key))
    result = env.step_chunk(np.asarray(out.actions))
    # The value of each truncated episode's last observation, at the full batch size:
    # those observations put in their rows of the next ones.
    last = protocol.Observation(result.obs.images.copy(), result.obs.state.copy(),
                                result.obs.instruction.copy())
    cut = np.flatnonzero(result.has_final_obs)
    last.images[cut], last.state[cut] = result.final_obs.images, result.final_obs.state
    last.instruction[cut] = result.final_obs.instruction
    finals.append(np.where(result.has_final_obs, value(params, pol.prepare(last)), 0.0))
    steps.append(batch)
    outs.append(out)
    results.append(result)
    obs = result.obs
  stack = lambda xs: np.stack(xs)
  return types.Trajectory(
      batch=jax.tree.map(lambda *xs: np.stack(xs), *steps),
      chain=stack([o.chain for o in outs]), log_prob=stack([o.log_prob for o in outs]),
      log_prob_dims=stack([o.log_prob_dims for o in outs]),
      value=stack([o.value for o in outs]), reward=stack([r.reward for r in results]),
      done=stack([r.done for r in results]), terminated=stack([r.terminated for r in results]),
      final_value=stack(finals).astype(np.float32), steps=stack([r.steps for r in results]),
      bootstrap_value=np.asarray(value(params, pol.prepare(obs))),
      policy_version=np.full((num_steps, env.num_envs), policy_version, np.int32))


def test_lockstep_segments_equal_a_plain_loop():
  """Lockstep rollout through the segment builder gives a plain loop's trajectory."""
  c, env, pol, params, act, value = _setup()
  builder = segments_lib.SegmentBuilder(c.num_envs, c.rollout_len, 2)
  keys = jax.random.split(jax.random.PRNGKey(5), c.rollout_len)
  calls = iter(range(100))
  act_keyed = lambda p, b, _: act(p, b, keys[next(calls)])
  ro = rollout_lib.Rollout(env, pol, act_keyed, value, lambda: (params, 7), builder,
                           jax.random.PRNGKey(0), seed=3)
  for _ in range(c.rollout_len):
    ro.step_all()
  items = builder.pop_items()
  assert len(items) == 2 and all(it.data.log_prob.shape == (3, 2) for it in items)
  got = types.concat([it.data for it in items])
  want = _reference_collect(builtin.make(c.env, c.num_envs, 0), pol, act, value, params,
                            c.rollout_len, jax.random.PRNGKey(5), policy_version=7, seed=3)
  assert want.final_value.any()  # Episodes were cut by the time limit: their values came.
  for name in ("chain", "log_prob", "log_prob_dims", "value", "reward", "done", "terminated",
               "final_value", "steps", "bootstrap_value", "policy_version"):
    np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-6,
                               err_msg=name)
  jax.tree.map(np.testing.assert_array_equal, got.batch, want.batch)
  assert builder.in_flight() == types.Counts(env_steps=0, chunks=0, segments=0)


def test_inference_batches_pad_to_buckets():
  assert [rollout_lib.bucket_size(n, 12) for n in (1, 2, 3, 4, 5, 8, 9, 12)] == [
      1, 2, 4, 4, 8, 8, 12, 12]
  with pytest.raises(ValueError, match="outside"):
    rollout_lib.bucket_size(13, 12)
  # pipeline.min_bucket: nothing smaller than it, the env count still the largest.
  assert [rollout_lib.bucket_size(n, 12, minimum=4) for n in (1, 3, 4, 5, 12)] == [
      4, 4, 4, 8, 12]
  assert rollout_lib.bucket_sizes(12, minimum=4) == [4, 8, 12]
  assert rollout_lib.bucket_sizes(32, minimum=8) == [8, 16, 32]
  assert rollout_lib.bucket_sizes(6, minimum=6) == [6]
  padded = rollout_lib.pad_rows({"x": np.arange(6).reshape(3, 2)}, 4)
  np.testing.assert_array_equal(padded["x"], [[0, 1], [2, 3], [4, 5], [0, 1]])


@pytest.mark.run_first
def test_first_ready_inference_sees_only_bucket_shapes():
  c, env, policy, params, act, value = _setup(num_envs=6)
  env.close()
  c.env.latency_ms, c.env.latency_sigma = 2.0, 1.0  # Ragged readiness: many batch sizes.
  env = make_vec_env(c.env, 6, 0, num_workers=3, step_timeout_s=60.0)
  shapes = []

  def recording_act(p, batch, key):
    shapes.append(batch["state"].shape[0])
    return act(p, batch, key)
  builder = segments_lib.SegmentBuilder(6, 2, 6)
  ro = rollout_lib.Rollout(env, policy, recording_act, value, lambda: (params, 0), builder,
                           jax.random.PRNGKey(0), seed=0)
  try:
    for _ in range(12):
      ro.step_ready(b_max=3, t_max_s=0.002)
  finally:
    env.close()
  # Every bucket compiled (run once) up front, then only bucket shapes, one act per step.
  assert rollout_lib.bucket_sizes(6) == [1, 2, 4, 6]
  assert shapes[:4] == [1, 2, 4, 6] and ro.clock.counters()["rollout_compile_s"] > 0, shapes
  assert set(shapes[4:]) <= {1, 2, 4, 6}, shapes
  assert ro.env_steps > 0 and len(shapes) == 4 + 12


def test_first_ready_pacing_parks_envs_instead_of_deadlocking():
  """Staleness 0 with ragged envs: fast envs wait at segment starts, slow ones finish.

  A refused segment start must not hold up the envs still inside a segment (their
  segments are what the learner waits for): the rollout parks the refused envs.
  """
  num_envs, seg = 8, 2
  c, env, policy, params, act, value = _setup(num_envs=num_envs)
  env.close()
  c.env.latency_ms, c.env.latency_sigma = 2.0, 1.5
  env = make_vec_env(c.env, num_envs, 0, num_workers=4, step_timeout_s=60.0)
  pacer = pacer_lib.Pacer(segments_per_update=num_envs, max_staleness=0)
  version = [0]
  builder = segments_lib.SegmentBuilder(num_envs, seg, 2)
  ro = rollout_lib.Rollout(env, policy, act, value, lambda: (params, version[0]), builder,
                           jax.random.PRNGKey(0), seed=0, pacer=pacer)
  updates, segments = [], [0]

  def drive():
    while len(updates) < 4:
      ro.step_ready(b_max=2, t_max_s=0.001)
      for item in builder.pop_items():  # The learner: one update per num_envs segments.
        assert np.all(item.versions == version[0]), "pacing let a stale segment through"
        segments[0] += item.data.reward.shape[1]
        if segments[0] == num_envs * (len(updates) + 1):
          updates.append(version[0])
          version[0] += 1
          pacer.set_version(version[0])
  t = threading.Thread(target=drive, daemon=True)
  t.start()
  t.join(120)
  alive = t.is_alive()
  pacer.close()
  env.close()
  assert not alive, f"rollout stalled after {len(updates)} updates ({segments[0]} segments)"
  assert updates == [0, 1, 2, 3]


def test_result_without_act_is_an_error():
  builder = segments_lib.SegmentBuilder(2, 2, 1)
  step = protocol.ChunkStep(obs=None, reward=np.zeros(1, np.float32),
                            terminated=np.zeros(1, bool), truncated=np.zeros(1, bool),
                            success=np.zeros(1, bool), steps=np.ones(1, np.int32), episodes=[],
                            has_final_obs=np.zeros(1, bool), final_obs=None)
  with pytest.raises(RuntimeError, match="env 1: a result arrived with no chunk"):
    builder.on_result(np.array([1]), step)


# ---------------------------------------------------------------- streamer --
@pytest.mark.run_first
@pytest.mark.parametrize("value_targets", ["rollout", "learner"])
def test_streamed_update_equals_the_non_streamed_one(monkeypatch, value_targets):
  """Gradients of micro-batches computed one by one as they arrive, summed and
  applied once per minibatch, equal one non-streamed PPO update over the same data in
  the same minibatches (with learner-side value targets too: each micro-batch's GAE
  from the same critic). Two minibatches: the second one's micro-batches are evaluated
  under the params the update started from (decoupled PPO's proximal policy), as the
  non-streamed update evaluates every minibatch.

  Adam's eps is 1e-3 here: with 1e-8 a parameter whose gradient is zero up to
  float32 rounding moves by +-lr depending on the rounding of two summation
  orders, which would test Adam's conditioning, not the accumulation.
  """
  monkeypatch.setattr(optimizers_lib, "make_optimizer", lambda lr, clip, b1=0.9, **_: optax.chain(
      optax.clip_by_global_norm(clip), optax.adam(lr, b1=b1, eps=1e-3)))
  c, env, pol, params, act, value = _setup(
      num_envs=4, **{"rl.num_epochs": 1, "rl.num_minibatches": 2,
                     "rl.advantage_norm": "none", "rl.correction": "decoupled",
                     "rl.value_targets": value_targets})
  builder = segments_lib.SegmentBuilder(c.num_envs, c.rollout_len, 1)
  ro = rollout_lib.Rollout(env, pol, act, value, lambda: (params, 0), builder,
                           jax.random.PRNGKey(1), seed=0)
  for _ in range(c.rollout_len):
    ro.step_all()
  items = builder.pop_items()
  assert len(items) == 4  # One env's segment each: rows t * 4 + env of the batch.
  # The non-streamed update's minibatches: envs 0-1, then envs 2-3, as streamed below.
  order = np.array([t * 4 + e for half in ((0, 1), (2, 3)) for t in range(c.rollout_len)
                    for e in half])
  monkeypatch.setattr(jax.random, "permutation", lambda key, n: jnp.asarray(order))
  lrn = learner_lib.Learner(pol, c)
  assert lrn.streamed_proximal
  copy = lambda t: jax.tree.map(np.array, jax.device_get(t))
  state0 = copy(learner_lib.init_state(params, lrn.ppo_tx, jax.random.PRNGKey(2)))
  ref_state, ref_metrics = lrn.update(jax.device_put(state0),
                                      types.concat([it.data for it in items]))
  state = jax.device_put(state0)
  start = lrn.snapshot(state.params)
  metrics = []
  for first in (0, 2):  # Two minibatches of two micro-batches each.
    acc = None
    for it in items[first:first + 2]:
      acc = lrn.accumulate(acc, lrn.micro_grads(state.params, it.data, 6, 0,
                                                proximal=start if first else None))
    state, m = lrn.apply(state, acc, bump_version=bool(first))
    metrics.append(jax.device_get(m))
  close = functools.partial(np.testing.assert_allclose, rtol=2e-5, atol=1e-6)
  jax.tree.map(close, jax.device_get(state.params), jax.device_get(ref_state.params))
  jax.tree.map(close, jax.device_get(state.opt_state), jax.device_get(ref_state.opt_state))
  assert int(state.step) == int(ref_state.step) == 1
  # One optimizer-step program for both minibatches, though the second's metrics carry
  # the proximal pass's diagnostics too.
  assert lrn._apply_jit._cache_size() == 1  # pylint: disable=protected-access
  keys = ["loss", "policy_loss", "value_loss", "approx_kl", "clip_frac", "grad_norm"]
  keys += [k for k in ref_metrics if k.startswith("grad_norm/")]  # (per part)
  assert "grad_norm/llm_expert/layer1" in keys, keys
  if value_targets == "learner":  # (the staleness diagnostics need the proximal pass)
    keys += ["value_drift", "kl_behaviour_proximal"]
  for k in keys:
    close(np.mean([m[k] for m in metrics]), ref_metrics[k], err_msg=k)
  # The second minibatch stepped from other params than the proximal ones: its ratio
  # moved, so the clip had something to act on (a check of the check).
  assert metrics[1]["approx_kl"] > 0 and metrics[0]["approx_kl"] == 0
  # The whole update in one call logs the whole batch's spreads, not the mean of its
  # micro-batches' (one env's segment each, whose own explained variance differs).
  _, streamed = lrn.streamed_update(jax.device_put(state0), iter(items), len(items))
  spread_close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5)
  for k in ("explained_variance", "advantage_std"):
    spread_close(streamed[k], ref_metrics[k], err_msg=k)
  assert not [k for k in (*streamed, *ref_metrics) if k.startswith("moment/")]
  # (The mean of the two minibatches' own explained variances is another figure.)
  halves = np.mean([objectives_lib.spreads(m)["explained_variance"] for m in metrics])
  assert abs(halves - ref_metrics["explained_variance"]) > 1e-3, halves


def test_streamed_proximal_snapshot_keeps_the_rollout_dtype():
  """With a bfloat16 rollout copy the streamed update keeps its proximal snapshot in
  bfloat16 too (half of full pi0's 12 GiB float32 copy), and the later minibatches are
  evaluated under exactly those rounded weights."""
  c, env, pol, params, act, value = _setup(
      num_envs=4, **{"rl.num_epochs": 1, "rl.num_minibatches": 2,
                     "rl.correction": "decoupled", "pipeline.mode": "async",
                     "pipeline.rollout_dtype": "bfloat16"})
  builder = segments_lib.SegmentBuilder(c.num_envs, c.rollout_len, 1)
  ro = rollout_lib.Rollout(env, pol, act, value, lambda: (params, 0), builder,
                           jax.random.PRNGKey(1), seed=0)
  for _ in range(c.rollout_len):
    ro.step_all()
  item = builder.pop_items()[0]
  lrn = learner_lib.Learner(pol, c)
  assert lrn.streamed_proximal
  snap = lrn.snapshot(jax.device_put(params))
  for got, want in zip(jax.tree.leaves(snap), jax.tree.leaves(lrn.rl_trainable.select(params))):
    assert got.dtype == jnp.bfloat16, got.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(jnp.bfloat16))
  # The same rounded values held in float32 give the same pass, to float32 rounding.
  widened = jax.tree.map(lambda x: x.astype(jnp.float32), snap)
  got = jax.device_get(lrn.micro_grads(params, item.data, 8, 1, proximal=snap))
  want = jax.device_get(lrn.micro_grads(params, item.data, 8, 1, proximal=widened))
  close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6)
  jax.tree.map(close, got, want)
  # (a check of the check: the rounding moved the proximal log-probs by more than that)
  exact = jax.device_get(lrn.micro_grads(params, item.data, 8, 1,
                                         proximal=lrn.rl_trainable.select(params)))
  with pytest.raises(AssertionError):
    close(got[1]["kl_behaviour_proximal"], exact[1]["kl_behaviour_proximal"])


# ---------------------------------------------------------------- end to end --
# Each run also trains one policy variant end to end (BC warm start, rollout, PPO,
# evaluation): pi0 with the expert's state-token value and the flow-noise sampler, pi0.5,
# pi0-FAST (its tokenizer fitted on the run's demonstrations), and the default tiny pi0
# (prefix value, flow-SDE sampler), which tests/test_checkpoint.py::test_resume_continues_run
# trains in `sync_colocated` mode, with these same checks.
_PI0_EXPERT_NOISE = dict(name="pi0", value_source="expert", train_sampler="flow_noise")
_PI05 = dict(name="pi05", value_source="prefix", train_sampler="flow_sde")
_FAST = dict(name="pi0_fast", max_action_tokens=16, max_token_len=16)


@pytest.mark.run_first
@pytest.mark.parametrize("mode,switches", [
    ("sync_disaggregated", dict(model=_PI0_EXPERT_NOISE)),
    ("async", dict(train_async=True, rollout_async=False, streamer=False, model=_FAST)),
    ("async", dict(train_async=True, rollout_async=True, streamer=True,
                   staleness_control="pace")),
    ("async", dict(train_async=False, rollout_async=True, streamer=False, model=_PI05)),
])
def test_every_mode_trains_end_to_end(tmp_path, mode, switches):
  c = end_to_end.smoke_config(mode=mode, **switches)
  workdir = str(tmp_path / "run")
  end_to_end.check_run(c, train.train_and_evaluate(c, workdir), workdir)
  if c.model.name == "pi0_fast":
    _check_fast_run(c, workdir)


def _check_fast_run(c, workdir: str) -> None:
  """A pi0-FAST run: its tokenizer fitted on the demonstrations and kept in the workdir and
  the export, its decode counts in the metrics, and its export and checkpoints loaded back
  (policy_io, the path eval and serve take) acting as the run's policy did."""
  for where in (workdir, os.path.join(workdir, "export")):
    assert os.path.exists(os.path.join(where, fast_lib.RUN_DIR, fast_lib.PROCESSOR_CONFIG)), where
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["model"]["fast_tokenizer_path"] == ""  # (the run's own is found)
  recs = end_to_end.records(workdir)
  warm = [r for r in recs if r["phase"] == "warm_start"][0]
  assert warm["fast_encoded_chunks"] >= c.bc.num_steps * c.bc.batch_size
  last = [r for r in recs if r["phase"] == "train"][-1]
  assert last["fast_decoded_rows"] >= last["env_steps"] / c.model.chunk_len
  assert 0.0 <= last["fast_malformed_frac"] <= 1.0
  export = policy_io.load(os.path.join(workdir, "export"))
  run = policy_io.load(workdir)
  assert export.config.model.fast_tokenizer_path.startswith(os.path.join(workdir, "export"))
  env = builtin.make(c.env, 4, 0)
  batch = export.policy.prepare(env.observe())
  act = lambda p, params: jax.jit(functools.partial(p.act, mode="eval"))(
      params, batch, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(act(export.policy, export.params).chain,
                                act(run.policy, run.params).chain)


@pytest.mark.run_first
@pytest.mark.parametrize("switches", [dict(mode="sync_colocated"),
                                      dict(mode="async", train_async=True, rollout_async=True,
                                           streamer=True)])
def test_grpo_trains_end_to_end(tmp_path, switches, monkeypatch):
  """GRPO over group resets: one queue item per group of G episodes, streamed or not.

  Every item the learner takes holds one group's G whole episodes (one group id, the
  group's advantages normalised to mean 0), and each update takes num_envs / G of them."""
  taken = []  # (learner version, item) for every item the learner took.
  take = pipeline_lib.Pipeline._take

  def spy(self, version):
    item = take(self, version)
    taken.append((version, item))
    return item

  monkeypatch.setattr(pipeline_lib.Pipeline, "_take", spy)
  c = default.get_config("smoke")
  c.total_env_steps = 600
  c.env_workers = 2
  g = c.env.group_size = 2
  c.algorithm, c.grpo.loss_normalizer = "grpo", "constant"
  c.rl.update(num_epochs=1, num_minibatches=2, advantage_norm="none")
  c.bc.num_steps = 0  # RL from the fresh policy (the PPO runs above check the warm start)
  c.pipeline.update(switches)
  summary = train.train_and_evaluate(c, str(tmp_path / "grpo"))
  records = [r for r in end_to_end.records(str(tmp_path / "grpo")) if r["phase"] == "train"]
  assert summary["iterations"] >= 1 and len(records) == summary["iterations"]
  assert all(np.isfinite(r["loss"]) and "episode_return_mean" in r for r in records)
  per_update = c.num_envs // g
  versions = [v for v, _ in taken]
  for v in range(summary["iterations"]):
    assert versions.count(v) == per_update, (v, versions)
  for v, item in taken:
    eb = item.data
    assert isinstance(eb, types.EpisodeBatch) and eb.group.shape == (g,), (v, eb.group)
    assert item.num_segments == g and len(set(eb.group.tolist())) == 1, (v, eb.group)
    assert eb.mask.any(axis=0).all(), f"update {v}: an episode of the group has no chunk"
    np.testing.assert_allclose(eb.advantage.sum(), 0.0, atol=1e-5)


def test_rollout_thread_error_stops_the_run(tmp_path, monkeypatch):
  def broken(self):
    raise ValueError("simulated simulator failure")

  monkeypatch.setattr(rollout_lib.Rollout, "step_all", broken)
  before = {t.name for t in threading.enumerate()}
  c = end_to_end.smoke_config(mode="async", train_async=True, rollout_async=False)
  c.bc.num_steps = 0  # (the failure is the first rollout step's)
  with pytest.raises(RuntimeError, match="rollout thread failed") as info:
    train.train_and_evaluate(c, str(tmp_path / "err"))
  assert "simulated simulator failure" in repr(info.value.__cause__)
  leftover = {t.name for t in threading.enumerate()} - before
  assert not {"rollout", "broadcaster"} & leftover, leftover
