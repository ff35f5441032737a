"""The built-in ColorReach env: shapes, the expert, language grounding, failures, latency."""

import time

import numpy as np
import pytest

from jaxvla.envs import builtin


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
