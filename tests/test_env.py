"""The built-in ColorReach env: shapes, the expert, language grounding, failures, latency,
GRPO group resets."""

import os
import subprocess
import sys
import time
import types

import ml_collections
import numpy as np
import pytest

from configs import default
from jaxvla.envs import builtin, make_env, protocol


def make(n=8, **kw):
  return builtin.ColorReach(n, seed=0, **kw)


def test_observation_structure():
  env = make(4)
  obs = env.reset(1)
  assert obs.images.shape == (4, 1, 32, 32, 3) and obs.images.dtype == np.uint8
  assert obs.state.shape == (4, 2)
  assert all(t.startswith("move to the ") for t in obs.instruction)


def test_instruction_names_goal_colour_and_image_shows_it():
  env = make(16)
  env.reset(3)
  img = env.render()
  for i, text in enumerate(env.instructions()):
    colour = text.split()[3]
    goal_colour = env.colour_names[env.target_colours[i, env.goal[i]]]
    assert colour == goal_colour
    assert np.any(np.all(img[i] == builtin.COLOURS[colour], axis=-1))  # visible in the image


def test_expert_succeeds_and_random_policy_mostly_fails():
  env = make(64)
  env.reset(0)
  done = np.zeros(64, bool)
  succ = np.zeros(64, bool)
  for _ in range(10):
    r = env.step_chunk(env.expert_chunk(5))
    succ |= r.success & ~done
    done |= r.done
  assert succ.mean() > 0.95
  env.reset(0)
  rng = np.random.default_rng(0)
  successes = []
  while len(successes) < 64:
    successes += [e.success for e in env.step_chunk(rng.uniform(-1, 1, (64, 5, 2))).episodes]
  assert np.mean(successes) < 0.3


def test_wrong_target_fails_with_zero_reward():
  env = make(1)
  env.reset(0)
  other = (env.goal[0] + 1) % env.num_targets
  env.agent[0] = env.targets[0, other] + np.array([0.05, 0.0], np.float32)
  r = env.step_chunk(np.zeros((1, 5, 2)))
  assert r.terminated[0] and not r.success[0] and r.reward[0] == 0.0
  assert r.steps[0] == 1 and r.episodes[0].length == 1


def test_chunk_stops_at_episode_end_and_time_limit():
  env = make(2, max_episode_steps=7)
  env.reset(0)
  env.agent[:] = 0.0
  env.targets[:] = 0.9  # far away: nothing is reached
  r1 = env.step_chunk(np.zeros((2, 5, 2)))
  r2 = env.step_chunk(np.zeros((2, 5, 2)))
  assert r1.steps.tolist() == [5, 5] and r2.steps.tolist() == [2, 2]
  assert r2.truncated.all() and not r2.terminated.any()
  assert [e.length for e in r2.episodes] == [7, 7]
  assert (env.t == 0).all()  # auto-reset


def test_truncated_episodes_report_their_final_observation():
  """A time limit's last observation, before the auto-reset, in final_obs; a termination
  in the same chunk and an episode going on have none."""
  env = make(3, max_episode_steps=7)
  env.reset(0)
  env.agent[:] = 0.0
  env.targets[:] = 0.9  # Far away: nothing is reached by standing still.
  r1 = env.step_chunk(np.zeros((3, 5, 2)))
  other = (env.goal[0] + 1) % env.num_targets
  env.agent[0] = env.targets[0, other] + np.array([0.05, 0.0], np.float32)  # Fails at once.
  before = env.observe()
  env.t[2] = 0  # Env 2's episode is far from its limit.
  r2 = env.step_chunk(np.zeros((3, 5, 2)))
  assert r2.terminated.tolist() == [True, False, False]
  assert r2.truncated.tolist() == [False, True, False]
  assert r2.has_final_obs.tolist() == [False, True, False] and r2.final_obs.batch_size == 1
  np.testing.assert_array_equal(r2.final_obs.images[0], before.images[1])  # Stood still.
  np.testing.assert_array_equal(r2.final_obs.state[0], before.state[1])
  np.testing.assert_array_equal(before.images[1], r1.obs.images[1])
  assert r2.final_obs.instruction[0] == before.instruction[1]
  assert not np.array_equal(r2.obs.images[1], before.images[1])  # A new layout.
  assert not r1.has_final_obs.any() and r1.final_obs.batch_size == 0
  assert r1.final_obs.images.shape == (0, 1, 32, 32, 3)


def test_chunk_step_take_and_concat_keep_final_obs_with_their_rows():
  env = make(4, max_episode_steps=8)
  env.reset(0)
  env.targets[:] = 0.9
  env.agent[:] = np.arange(8, dtype=np.float32).reshape(4, 2) / 10
  env.t[[1, 3]] = 3  # Envs 1 and 3 hit the limit in this chunk, 0 and 2 go on.
  res = env.step_chunk(np.zeros((4, 5, 2)))
  assert res.has_final_obs.tolist() == [False, True, False, True]
  np.testing.assert_allclose(res.final_obs.state, [[0.2, 0.3], [0.6, 0.7]])  # Stood still.
  swapped = res.take(np.array([3, 0, 1]))
  assert swapped.has_final_obs.tolist() == [True, False, True]
  np.testing.assert_array_equal(swapped.final_obs.state, res.final_obs.state[::-1])
  cat = protocol.concat_chunk_steps([res.take(np.array([2, 3])), res.take(np.array([1]))])
  np.testing.assert_array_equal(cat.final_obs.images, res.final_obs.images[::-1])
  assert cat.has_final_obs.tolist() == [False, True, True] and cat.reward.shape == (3,)


def test_bad_action_shape_is_a_clear_error():
  env = make(3)
  with pytest.raises(ValueError, match=r"num_envs=3, chunk, action_dim=2"):
    env.step_chunk(np.zeros((3, 5, 7)))
  with pytest.raises(ValueError, match="NaN"):
    env.step_chunk(np.full((3, 5, 2), np.nan))


def test_latency_sleeps_long_tail():
  env = make(4, latency_ms=2.0, latency_sigma=1.0)
  env.reset(0)
  t0, c0 = time.perf_counter(), time.process_time()
  env.step_chunk(np.zeros((4, 5, 2)))
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  assert wall > 0.02  # 20 env steps at a 2 ms median
  assert cpu < 0.5 * wall  # it sleeps rather than burning CPU


def test_reset_is_deterministic_per_seed():
  a, b = make(4), make(4)
  np.testing.assert_array_equal(a.reset(7).images, b.reset(7).images)
  assert not np.array_equal(a.reset(7).images, b.reset(8).images)


def assert_same_start(obs, a, b):
  np.testing.assert_array_equal(obs.images[a], obs.images[b])
  np.testing.assert_array_equal(obs.state[a], obs.state[b])
  assert obs.instruction[a] == obs.instruction[b]


def test_group_members_share_initial_states_at_every_episode():
  env = make(8, group_size=4, max_episode_steps=10)
  assert env.group_size == 4 and env.group_ids().tolist() == [0] * 4 + [1] * 4
  obs = env.reset(3)
  for a, b in ((0, 1), (0, 2), (0, 3), (4, 5), (4, 6), (4, 7)):
    assert_same_start(obs, a, b)
  assert not np.array_equal(obs.images[0], obs.images[4])  # Groups differ.
  # Per group: the expert at full and at half speed, standing still, random actions: the
  # members' first episodes end at different chunks (auto-reset inside the chunk).
  rng = np.random.default_rng(0)
  ended_at, second = {}, {}
  for chunk in range(3):  # 10-step limit, chunks of 4: every first episode ends by chunk 2.
    actions = np.zeros((8, 4, 2), np.float32)
    actions[0::4] = env.expert_chunk(4)[0::4]
    actions[1::4] = env.expert_chunk(4, speed=0.5)[1::4]
    actions[3::4] = rng.uniform(-1, 1, (2, 4, 2))
    res = env.step_chunk(actions)
    for e in res.episodes:
      assert e.group == e.env_id // 4
      if e.episode == 0:
        ended_at[e.env_id] = chunk
        second[e.env_id] = res.obs.take(np.array([e.env_id]))
  assert sorted(ended_at) == list(range(8))
  assert len({ended_at[i] for i in range(4)}) > 1 and len({ended_at[i] for i in range(4, 8)}) > 1
  second = protocol.Observation(*(np.concatenate([getattr(second[i], f) for i in range(8)])
                                  for f in ("images", "state", "instruction")))
  for a, b in ((0, 1), (0, 2), (0, 3), (4, 5), (4, 6), (4, 7)):
    assert_same_start(second, a, b)
  assert not np.array_equal(second.images[0], second.images[4])
  assert not np.array_equal(second.images[0], obs.images[0])
  # Episode k is a pure function of (seed, group, k): a reset can start at episode 1.
  again = make(8, group_size=4).reset(3, first_episode=np.ones(8, np.int64))
  np.testing.assert_array_equal(again.images, second.images)


def test_episodes_do_not_depend_on_batching():
  """G = 1: env i's episodes are its own (all differ), whatever batch it is built in."""
  whole = make(8)
  obs = whole.reset(5)
  assert whole.group_ids().tolist() == list(range(8))
  assert len({o.tobytes() for o in obs.images}) == 8
  alone = builtin.ColorReach(1, first_env_id=6, total_envs=8)  # As a pool's worker builds it.
  np.testing.assert_array_equal(alone.reset(5).images[0], obs.images[6])
  zeros = np.zeros((8, 25, 2), np.float32)  # 25 < 50 steps: no episode ends.
  whole.step_chunk(zeros)
  res = whole.step_chunk(zeros)  # All time out: episode 1.
  alone.step_chunk(zeros[:1])
  np.testing.assert_array_equal(alone.step_chunk(zeros[:1]).obs.images[0], res.obs.images[6])
  assert [(e.env_id, e.group, e.episode) for e in res.episodes] == [(i, i, 0) for i in range(8)]


def test_group_size_must_divide_num_envs():
  with pytest.raises(ValueError, match=r"env\.group_size=4 must divide .*num_envs=6"):
    make(6, group_size=4)
  with pytest.raises(ValueError, match=r"env\.group_size=0 must be an integer >= 1"):
    make(4, group_size=0)
  cfg = default.get_config("smoke").env
  cfg.group_size = 3
  with pytest.raises(ValueError, match=r"env\.group_size=3"):
    make_env(cfg, 8, 0)
  assert make_env(cfg, 8, 0, group_size=1).group_size == 1  # e.g. an evaluation batch.
  assert make_env(ml_collections.ConfigDict(cfg), 6, 0).group_ids().tolist() == [0] * 3 + [1] * 3


def test_evaluation_env_in_workers_plays_the_same_episodes():
  """``eval.env_workers``: the evaluation envs in worker processes give the same
  evaluation as in the trainer process (same episodes, ungrouped)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jaxvla import train  # pylint: disable=import-outside-toplevel
  from jaxvla.evaluation import success as evaluate  # pylint: disable=import-outside-toplevel
  c = default.get_config("smoke")
  c.env.group_size = 2  # (a run's groups; evaluation episodes are independent)
  results = []
  for workers in (0, 2):
    c.eval.env_workers = workers
    env = train._eval_env(c)  # pylint: disable=protected-access
    try:
      assert env.num_envs == c.eval.num_episodes and env.group_size == 1
      assert (hasattr(env, "send")) == (workers > 0)
      rng = np.random.default_rng(0)

      class Policy:  # Random actions, the same sequence for both envs.
        @staticmethod
        def prepare(obs):
          return obs

      def act(params, batch, key, ids):  # (row_keyed_act's signature)
        return types.SimpleNamespace(  # (evaluation reads .actions [B, H, A])
            actions=rng.uniform(-1, 1, (c.eval.num_episodes, c.model.chunk_len, 2)))

      results.append(evaluate.evaluate(env, Policy, act, None, jax.random.key(0), seed=5,
                                       chunk_len=c.model.chunk_len))
    finally:
      env.close()
  assert results[0] == results[1] and results[0]["num_episodes"] == c.eval.num_episodes



def test_the_env_package_imports_without_jax():
  """The motion planner's worker runs in a Python environment of its own, without JAX
  (``jaxvla.data.planner_worker``): ``jaxvla.envs`` and its pool must import there."""
  code = ("import sys; sys.modules['jax'] = sys.modules['jaxlib'] = None; "
          "from jaxvla.envs import maniskill, pool, registry")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        check=False, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.returncode == 0, proc.stderr[-2000:]
