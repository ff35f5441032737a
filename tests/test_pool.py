"""EnvPool: equivalence with in-process stepping, first-ready batching, faults, GRPO groups,
clean close."""

import dataclasses
import multiprocessing as mp
import os
import signal
import time

import ml_collections
import numpy as np
import psutil
import pytest

from configs import default
from jaxvla import envs as envs_lib
from jaxvla.envs import pool as pool_lib

CHUNK = 4
CFG = {**default.get_config("smoke").env.to_dict(), "image_size": 16}
SPEC = pool_lib.config_env_fn(CFG)(0, 1, 0).spec


class _ScriptedEnv:
  """A one-env ColorReach that sleeps, hangs once or raises, per the factory's env ids."""
  task_name = "scripted-reach"

  def __init__(self, env, env_id: int, fn: "ScriptedFn"):
    self.env, self.env_id, self.fn = env, env_id, fn
    self.steps = 0
    self.spec, self.num_envs, self.group_size = env.spec, env.num_envs, env.group_size

  def group_ids(self):
    return self.env.group_ids()

  def reset(self, seed, first_episode=None):
    return self.env.reset(seed, first_episode)

  def step_chunk(self, actions):
    if self.env_id in self.fn.fail_ids:
      raise FloatingPointError("simulated physics blow-up")
    if self.env_id in self.fn.slow_ids:
      time.sleep(self.fn.sleep_s)
    self.steps += 1
    if (self.env_id in self.fn.hang_ids and self.steps > self.fn.hang_after
        and not os.path.exists(self.fn.hang_marker)):
      open(self.fn.hang_marker, "w").close()  # Hang once: the restarted env steps normally.
      time.sleep(120)
    return self.env.step_chunk(actions)

  def close(self):
    self.env.close()


@dataclasses.dataclass(frozen=True)
class ScriptedFn:
  """Picklable env_fn: built-in envs with scripted slowness, hangs and failures."""
  slow_ids: tuple = ()
  sleep_s: float = 0.0
  hang_ids: tuple = ()
  hang_marker: str = ""
  hang_after: int = 0  # Hang on the first step after this many.
  fail_ids: tuple = ()
  fail_build: bool = False
  build_sleep_s: float = 0.0  # Each env's construction takes this long.
  num_envs: int = 4  # Of the pool: places env first_env_id in its group.

  def __call__(self, first_env_id, count, seed):
    if self.fail_build:
      raise OSError(f"no simulator assets for env {first_env_id}")
    time.sleep(self.build_sleep_s)
    env = pool_lib.config_env_fn(CFG, self.num_envs)(first_env_id, count, seed)
    return _ScriptedEnv(env, first_env_id, self)


@dataclasses.dataclass(frozen=True)
class FirstIdIgnoredFn:
  """A wrong env_fn: builds every env as env 0, so all would play the same episodes."""

  def __call__(self, first_env_id, count, seed):
    return pool_lib.config_env_fn(CFG)(0, count, seed)


def make_pool(num_envs=4, envs_per_worker=2, env_fn=None, step_timeout_s=30.0, cfg=None,
              **kwargs):
  return pool_lib.EnvPool(env_fn or pool_lib.config_env_fn(cfg or CFG), num_envs,
                          envs_per_worker, SPEC, step_timeout_s=step_timeout_s, **kwargs)


def reference_envs(num_envs, seed):
  """The pool's envs built and reset in-process, one per global env id."""
  envs = [pool_lib.config_env_fn(CFG, num_envs)(i, 1, 0) for i in range(num_envs)]
  obs = [e.reset(seed) for e in envs]
  return envs, obs


def random_actions(rng, n):
  return rng.uniform(-1, 1, (n, CHUNK, SPEC.action_dim)).astype(np.float32)


def test_step_chunk_equals_in_process_stepping():
  rng = np.random.default_rng(0)
  envs, ref_obs = reference_envs(4, seed=7)
  batch = envs_lib.make_env(ml_collections.ConfigDict(CFG), 4, 0)  # The in-process run.
  batch_obs = batch.reset(7)
  with make_pool() as pool:
    obs = pool.reset(7)
    assert pool.group_size == 1 and pool.group_ids().tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(obs.images, batch_obs.images)
    np.testing.assert_array_equal(obs.images, np.concatenate([o.images for o in ref_obs]))
    np.testing.assert_array_equal(obs.state, np.concatenate([o.state for o in ref_obs]))
    assert obs.instruction.tolist() == [o.instruction[0] for o in ref_obs]
    episodes = truncations = 0
    for _ in range(6):
      actions = random_actions(rng, 4)
      got = pool.step_chunk(actions)
      refs = [e.step_chunk(actions[i:i + 1]) for i, e in enumerate(envs)]
      for field in ("reward", "terminated", "truncated", "success", "steps", "has_final_obs"):
        np.testing.assert_array_equal(getattr(got, field),
                                      np.concatenate([getattr(r, field) for r in refs]))
      # The last observations of time-limit truncations came through the pipe, in row order.
      for field in ("images", "state", "instruction"):
        np.testing.assert_array_equal(getattr(got.final_obs, field), np.concatenate(
            [getattr(r.final_obs, field) for r in refs]))
      truncations += int(got.has_final_obs.sum())
      np.testing.assert_array_equal(got.obs.images,
                                    np.concatenate([r.obs.images for r in refs]))
      np.testing.assert_array_equal(got.obs.state, np.concatenate([r.obs.state for r in refs]))
      assert got.obs.instruction.tolist() == [r.obs.instruction[0] for r in refs]
      ref_eps = [dataclasses.replace(e, env_id=i) for i, r in enumerate(refs) for e in r.episodes]
      assert got.episodes == ref_eps
      in_batch = batch.step_chunk(actions)
      np.testing.assert_array_equal(got.obs.state, in_batch.obs.state)
      np.testing.assert_array_equal(got.final_obs.images, in_batch.final_obs.images)
      assert got.episodes == in_batch.episodes
      episodes += len(got.episodes)
    assert episodes > 0 and truncations > 0  # Auto-reset happened inside the workers.
    assert pool.stats.chunks == 24 and pool.stats.restarts == 0


def test_reset_from_later_episodes_matches_in_process_envs():
  # (jaxvla.eval resumes an evaluation by starting each env at its next unplayed episode.)
  first = np.array([2, 0, 5, 1])
  batch = envs_lib.make_env(ml_collections.ConfigDict(CFG), 4, 0)
  want = batch.reset(7, first)
  with make_pool() as pool:
    obs = pool.reset(7, first)
    np.testing.assert_array_equal(obs.images, want.images)
    np.testing.assert_array_equal(obs.state, want.state)
    ends = {}
    still = np.zeros((4, CHUNK, SPEC.action_dim), np.float32)
    for _ in range(8):
      got, ref = pool.step_chunk(still), batch.step_chunk(still)
      assert got.episodes == ref.episodes
      for ep in got.episodes:
        ends.setdefault(ep.env_id, ep.episode)
    assert ends == {i: int(k) for i, k in enumerate(first)}
    with pytest.raises(ValueError, match="first_episode must be 4 numbers"):
      pool.reset(7, np.array([0, 1]))


def test_recv_returns_sent_ids_with_their_rows_and_idle_envs_stay_put():
  rng = np.random.default_rng(1)
  envs, _ = reference_envs(4, seed=3)
  with make_pool() as pool:
    pool.reset(3)
    with pytest.raises(RuntimeError, match="no chunk in flight"):
      pool.recv(4, 0.0)
    actions = random_actions(rng, 2)
    pool.send(actions, np.array([3, 0]))  # Env 3 on worker 1, env 0 on worker 0; 1, 2 idle.
    got_ids, got = [], []
    while len(got_ids) < 2:
      ids, res = pool.recv(4, 10.0)
      got_ids += ids.tolist()
      got.append((ids, res))
    assert sorted(got_ids) == [0, 3]
    t0 = time.monotonic()
    one = random_actions(rng, 1)
    pool.send(one, np.array([2]))
    ids, _ = pool.recv(4, 30.0)  # Nothing else in flight: no waiting for T_max.
    assert ids.tolist() == [2] and time.monotonic() - t0 < 10.0
    envs[2].step_chunk(one)  # Keep the reference in step.
    ref = {3: envs[3].step_chunk(actions[0:1]), 0: envs[0].step_chunk(actions[1:2])}
    for ids, res in got:
      for k, i in enumerate(ids):
        np.testing.assert_array_equal(res.obs.images[k], ref[i].obs.images[0])
        np.testing.assert_array_equal(res.obs.state[k], ref[i].obs.state[0])
        assert res.reward[k] == ref[i].reward[0]
    # Env 1 was never sent: it stayed idle, so its next step matches its first in-process.
    actions = random_actions(rng, 4)
    full = pool.step_chunk(actions)
    for i in range(4):
      ref_i = envs[i].step_chunk(actions[i:i + 1])
      np.testing.assert_array_equal(full.obs.state[i], ref_i.obs.state[0])


def test_first_ready_does_not_wait_for_a_slow_worker():
  with make_pool(envs_per_worker=1, env_fn=ScriptedFn(slow_ids=(0,), sleep_s=2.0)) as pool:
    pool.reset(0)
    t0 = time.monotonic()
    pool.send(random_actions(np.random.default_rng(2), 4), np.arange(4))
    ids_a, res_a = pool.recv(2, float("inf"))  # b_max: return as soon as two are ready.
    assert len(ids_a) == 2 and 0 not in ids_a and res_a.obs.state.shape == (2, 2)
    ids_b, _ = pool.recv(4, 0.2)  # The third fast one; T_max long passed for it.
    t_fast = time.monotonic() - t0
    assert sorted(ids_a.tolist() + ids_b.tolist()) == [1, 2, 3]
    assert t_fast < 1.8  # Well before the slow env's 2 s.
    ids_c, _ = pool.recv(4, 0.0)
    assert ids_c.tolist() == [0] and time.monotonic() - t0 >= 1.9
    # Worker busy time: the slow worker's 2 s plus the fast ones' short chunks.
    assert 2.0 <= pool.stats.worker_busy_s < 2.0 + 3 * 0.5


def test_t_max_bounds_the_wait_after_the_first_ready_env():
  t_max = 0.6
  with make_pool(envs_per_worker=1, env_fn=ScriptedFn(slow_ids=(2,), sleep_s=2.5)) as pool:
    pool.reset(0)
    t0 = time.monotonic()
    pool.send(random_actions(np.random.default_rng(3), 4), np.arange(4))
    ids, _ = pool.recv(4, t_max)
    waited = time.monotonic() - t0
    assert sorted(ids.tolist()) == [0, 1, 3]
    # It waited T_max past the first ready env (which is after the send), but not for the slow one.
    assert t_max <= waited < t_max + 1.0
    ids, _ = pool.recv(1, 0.0)
    assert ids.tolist() == [2]


def test_sigkill_restarts_worker_and_reports_truncated_episodes():
  rng = np.random.default_rng(4)
  with make_pool() as pool:
    pool.reset(0)
    first = pool.step_chunk(random_actions(rng, 4))
    old_pid = pool.pids[0]
    os.kill(old_pid, signal.SIGKILL)
    res = pool.step_chunk(random_actions(rng, 4))
    assert res.truncated[:2].all() and res.done[:2].all() and not res.truncated[2:].any()
    # Lost, not cut by the time limit: no final observation, so no bootstrap.
    assert not res.has_final_obs[:2].any()
    assert res.final_obs.batch_size == int(res.has_final_obs.sum())
    assert pool.stats.restarts == 1 and pool.stats.died == 1
    lost = [e for e in res.episodes if e.env_id in (0, 1)]
    assert [e.env_id for e in lost] == [0, 1] and pool.stats.truncated_by_fault == 2
    assert all(e.truncated and e.fault and not e.success for e in lost)
    assert not any(e.fault for e in res.episodes if e.env_id not in (0, 1))
    # The lost episodes' lengths: what they had run before the kill (0 if one just auto-reset).
    assert [e.length for e in lost] == [0 if first.done[i] else first.steps[i] for i in (0, 1)]
    assert pool.pids[0] != old_pid and not psutil.pid_exists(old_pid)
    assert res.obs.images.shape == (4, 1, 16, 16, 3)
    after = pool.step_chunk(random_actions(rng, 4))  # The run goes on.
    assert after.steps.min() >= 1 and pool.stats.restarts == 1


def test_kill_with_chunks_in_flight_and_with_idle_envs_in_the_async_api():
  zeros = np.zeros((4, CHUNK, 2), np.float32)  # The agent stays put: no episode ends by itself.

  def recv_all(pool, n):
    ids, results = [], []
    while len(ids) < n:
      i, r = pool.recv(n, 30.0)
      ids += i.tolist()
      results += [(int(k), bool(t), int(s)) for k, t, s in zip(i, r.truncated, r.steps)]
    return sorted(results)

  with make_pool(env_fn=ScriptedFn(slow_ids=(0,), sleep_s=3.0)) as pool:
    pool.reset(0)
    pool.send(zeros, np.arange(4))
    ids, _ = pool.recv(2, float("inf"))
    assert sorted(ids.tolist()) == [2, 3]  # Worker 0 is still busy with slow env 0.
    os.kill(pool.pids[0], signal.SIGKILL)  # In flight: envs 0 and 1.
    assert recv_all(pool, 2) == [(0, True, 0), (1, True, 0)]
    os.kill(pool.pids[1], signal.SIGKILL)  # Idle: envs 2 and 3 (their results were received).
    pool.send(zeros[:1], np.array([2]))
    assert recv_all(pool, 1) == [(2, True, 0)]
    pool.send(zeros[:1], np.array([3]))  # Its episode ended with the restart: reported now.
    ids, res = pool.recv(1, 0.0)
    assert ids.tolist() == [3] and res.truncated[0] and res.steps[0] == 0
    assert [(e.env_id, e.length, e.truncated) for e in res.episodes] == [(3, CHUNK, True)]
    assert pool.stats.restarts == 2 and pool.stats.died == 2
    assert pool.stats.truncated_by_fault == 4
    pool.send(zeros[:3], np.array([1, 2, 3]))  # The run goes on with fresh episodes.
    assert recv_all(pool, 3) == [(i, False, CHUNK) for i in (1, 2, 3)]


def test_a_restart_keeps_the_final_obs_of_a_result_not_yet_received():
  """A time-limit truncation still waiting in the parent when its worker dies lost no
  episode: it keeps its final observation; the env in flight is a fault without one."""
  zeros = np.zeros((4, CHUNK, 2), np.float32)  # Stand still: episodes end at 10 steps.
  with make_pool() as pool:
    start = pool.reset(0)
    pool.step_chunk(zeros)
    pool.step_chunk(zeros)  # 8 of 10 steps.
    pool.send(zeros[:2], np.array([0, 1]))  # Worker 0 answers both in one reply.
    ids, first = pool.recv(1, float("inf"))
    assert ids.tolist() == [0] and first.has_final_obs.tolist() == [True]
    np.testing.assert_array_equal(first.final_obs.state[0], start.state[0])
    os.kill(pool.pids[0], signal.SIGKILL)  # Env 1's result waits in the parent.
    pool.send(zeros[:1], np.array([0]))  # Noticed on this send or the next recv.
    got = {}
    while len(got) < 2:
      ids, res = pool.recv(2, 30.0)
      got.update((int(i), res.take(np.array([k]))) for k, i in enumerate(ids))
    assert pool.stats.restarts == 1 and pool.stats.truncated_by_fault == 1
    kept, lost = got[1], got[0]
    assert kept.truncated[0] and kept.has_final_obs[0] and kept.steps[0] == 2
    np.testing.assert_array_equal(kept.final_obs.images[0], start.images[1])
    np.testing.assert_array_equal(kept.final_obs.state[0], start.state[1])
    assert lost.truncated[0] and not lost.has_final_obs[0] and lost.final_obs.batch_size == 0
    assert [e.fault for e in lost.episodes if e.env_id == 0] == [True]


def test_hung_worker_is_restarted_after_step_timeout(tmp_path):
  fn = ScriptedFn(hang_ids=(1,), hang_marker=str(tmp_path / "hung-once"))
  with make_pool(env_fn=fn, step_timeout_s=1.0) as pool:
    pool.reset(0)
    t0 = time.monotonic()
    res = pool.step_chunk(random_actions(np.random.default_rng(5), 4))
    assert 1.0 <= time.monotonic() - t0 < 30.0
    assert pool.stats.hung == 1 and pool.stats.restarts == 1
    assert pool.stats.truncated_by_fault == 2  # Envs 0 and 1 were in flight on that worker.
    assert res.truncated[:2].all()
    assert sorted(e.env_id for e in res.episodes if e.truncated) == [0, 1]
    res = pool.step_chunk(random_actions(np.random.default_rng(6), 4))
    assert (res.steps >= 1).all() and pool.stats.restarts == 1


def test_hang_timeout_follows_the_measured_chunk_times(tmp_path, caplog):
  """After warm-up a hang is a chunk 10x slower than any so far (with a floor), not
  the fixed step_timeout_s; each restart is one warning line and a counter."""
  import logging  # pylint: disable=import-outside-toplevel
  steps_before_hang = pool_lib.HANG_MIN_CHUNKS // 4 + 1  # 4 envs: enough chunks measured.
  fn = ScriptedFn(hang_ids=(1,), hang_marker=str(tmp_path / "hung-once"),
                  hang_after=steps_before_hang)
  with make_pool(env_fn=fn, step_timeout_s=120.0, hang_floor_s=0.5) as pool:
    pool.reset(0)
    assert pool.hang_timeout_s() == 120.0  # Warm-up: nothing measured yet.
    rng = np.random.default_rng(8)
    for _ in range(steps_before_hang):
      pool.step_chunk(random_actions(rng, 4))
    assert pool.stats.chunks >= pool_lib.HANG_MIN_CHUNKS
    assert pool.hang_timeout_s() == max(0.5, pool_lib.HANG_FACTOR * pool.stats.slowest_chunk_s)
    assert pool.hang_timeout_s() < 120.0
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="jaxvla.envs.pool"):
      res = pool.step_chunk(random_actions(rng, 4))
    assert time.monotonic() - t0 < 30.0  # Not the 120 s limit.
    assert pool.stats.hung == 1 and pool.stats.truncated_by_fault == 2
    assert res.truncated[:2].all()
    assert "env worker 0 (env ids 0-1) hung (no answer within" in caplog.text
    assert "2 episode(s) cut short" in caplog.text


def test_simulator_exception_surfaces_with_env_id_task_and_traceback():
  with make_pool(env_fn=ScriptedFn(fail_ids=(3,))) as pool:
    pool.reset(0)
    with pytest.raises(RuntimeError) as err:
      pool.step_chunk(random_actions(np.random.default_rng(7), 4))
    msg = str(err.value)
    assert "env id(s) [3]" in msg and "scripted-reach" in msg
    assert "FloatingPointError: simulated physics blow-up" in msg and "Traceback" in msg
    assert pool.stats.sim_errors == 1
  with pytest.raises(RuntimeError, match=r"(?s)env id\(s\) \[0, 1\].*no simulator assets"):
    make_pool(env_fn=ScriptedFn(fail_build=True))


def test_a_worker_slower_to_build_than_its_start_timeout_is_an_error_naming_it():
  # The default grows with the envs a worker builds (ManiSkill3's ~1-3 s each): the
  # evaluation pool's 50 per worker get minutes where 8 get under two.
  assert pool_lib.start_timeout(50) >= 300 > pool_lib.start_timeout(8) >= 90
  with pytest.raises(RuntimeError, match="worker 0 did not answer start within 3.0 s"):
    make_pool(env_fn=ScriptedFn(build_sleep_s=5.0), start_timeout_s=3.0)


def test_bad_actions_and_ids_raise_value_error():
  with pytest.raises(ValueError, match="must divide"):
    make_pool(num_envs=3, envs_per_worker=2)
  with make_pool(num_envs=2, envs_per_worker=2) as pool:
    with pytest.raises(RuntimeError, match="reset"):
      pool.send(np.zeros((1, CHUNK, 2), np.float32), np.array([0]))
    pool.reset(0)
    with pytest.raises(ValueError, match=r"action_dim=2.*\(2, 4, 3\)"):
      pool.step_chunk(np.zeros((2, CHUNK, 3), np.float32))
    with pytest.raises(ValueError, match=r"num_envs=1.*\(2, 4, 2\)"):
      pool.send(np.zeros((2, CHUNK, 2), np.float32), np.array([0]))
    with pytest.raises(ValueError, match=r"unknown env ids \[7\]"):
      pool.send(np.zeros((1, CHUNK, 2), np.float32), np.array([7]))
    with pytest.raises(ValueError, match="repeated"):
      pool.send(np.zeros((2, CHUNK, 2), np.float32), np.array([1, 1]))
    pool.send(np.zeros((1, CHUNK, 2), np.float32), np.array([1]))
    with pytest.raises(ValueError, match=r"\[1\] already have a chunk"):
      pool.send(np.zeros((1, CHUNK, 2), np.float32), np.array([1]))
    ids, _ = pool.recv(1, 0.0)
    assert ids.tolist() == [1]


def test_close_leaves_no_processes_or_shared_memory():
  pool = make_pool()
  pool.reset(0)
  os.kill(pool.pids[1], signal.SIGKILL)
  pool.step_chunk(random_actions(np.random.default_rng(8), 4))  # Restart, then close.
  pids, names = pool.pids, [s.name for s in pool._shms]
  pool.close()
  pool.close()  # Idempotent.
  assert not [p for p in mp.active_children() if p.name.startswith("jaxvla-env-worker")]
  assert not any(psutil.pid_exists(p) for p in pids)
  assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
  with pytest.raises(RuntimeError, match="closed"):
    pool.reset(0)


# ------------------------------------------------------------------ GRPO groups --
GROUP_CFG = {**CFG, "group_size": 2}


def assert_rows_equal(obs, a, b):
  """Envs ``a`` and ``b`` of ``obs`` show the same episode start."""
  np.testing.assert_array_equal(obs.images[a], obs.images[b])
  np.testing.assert_array_equal(obs.state[a], obs.state[b])
  assert obs.instruction[a] == obs.instruction[b]


def test_groups_span_workers_and_share_every_episode_start():
  # 6 envs, 2 workers of 3, G = 2: groups {0, 1} {2, 3} {4, 5}; group 1 spans both workers.
  shadow = envs_lib.make_env(ml_collections.ConfigDict(GROUP_CFG), 6, 0)  # In-process twin.
  with make_pool(num_envs=6, envs_per_worker=3, cfg=GROUP_CFG) as pool:
    assert pool.group_size == 2 and pool.group_ids().tolist() == [0, 0, 1, 1, 2, 2]
    obs = pool.reset(11)
    np.testing.assert_array_equal(obs.images, shadow.reset(11).images)
    for g in range(3):
      assert_rows_equal(obs, 2 * g, 2 * g + 1)
    assert not np.array_equal(obs.images[1], obs.images[2])  # Groups differ.
    assert not np.array_equal(obs.images[3], obs.images[4])
    # Even envs follow the expert (their episode ends within 2 chunks), odd ones stand still
    # (time limit after 10 steps: the 3rd chunk), so members auto-reset at different chunks.
    second_start, ended_at = {}, {}
    for chunk in range(3):
      actions = np.zeros((6, CHUNK, 2), np.float32)
      actions[::2] = shadow.expert_chunk(CHUNK)[::2]
      res = pool.step_chunk(actions)
      np.testing.assert_array_equal(res.obs.state, shadow.step_chunk(actions).obs.state)
      for e in res.episodes:
        assert e.group == e.env_id // 2
        if e.episode == 0:
          ended_at[e.env_id] = chunk
          second_start[e.env_id] = (res.obs.images[e.env_id], res.obs.state[e.env_id],
                                    res.obs.instruction[e.env_id])
    assert sorted(ended_at) == list(range(6))
    assert all(ended_at[2 * g] < ended_at[2 * g + 1] for g in range(3))
    for g in range(3):
      a, b = second_start[2 * g], second_start[2 * g + 1]
      np.testing.assert_array_equal(a[0], b[0])
      np.testing.assert_array_equal(a[1], b[1])
      assert a[2] == b[2]
    assert not np.array_equal(second_start[0][0], second_start[2][0])
    assert not np.array_equal(second_start[0][0], obs.images[0])  # A new layout.


def test_group_members_stay_aligned_after_a_worker_restart():
  zeros = np.zeros((6, CHUNK, 2), np.float32)  # Stand still: episodes end at the time limit.
  with make_pool(num_envs=6, envs_per_worker=3, cfg=GROUP_CFG) as pool:
    start = pool.reset(0)
    pool.step_chunk(zeros)
    os.kill(pool.pids[0], signal.SIGKILL)  # Envs 0, 1, 2 lose episode 0 after 4 steps.
    res = pool.step_chunk(zeros)
    assert pool.stats.restarts == 1 and res.truncated[:3].all() and not res.done[3:].any()
    assert [(e.env_id, e.group, e.episode, e.length) for e in res.episodes] == [
        (0, 0, 0, CHUNK), (1, 0, 0, CHUNK), (2, 1, 0, CHUNK)]
    restarted = res.obs  # Envs 0-2: episode 1 in the fresh worker.
    assert_rows_equal(restarted, 0, 1)
    assert not np.array_equal(restarted.images[0], start.images[0])
    res = pool.step_chunk(zeros)  # Envs 3-5 reach the time limit: their episode 1 starts.
    assert [(e.env_id, e.group, e.episode) for e in res.episodes] == [
        (3, 1, 0), (4, 2, 0), (5, 2, 0)]
    np.testing.assert_array_equal(res.obs.images[3], restarted.images[2])  # Across workers.
    np.testing.assert_array_equal(res.obs.state[3], restarted.state[2])
    assert_rows_equal(res.obs, 4, 5)
    # Episode 2 starts alike too: env 2 (restarted) and env 3 run 10 more steps each.
    ends = {}
    for _ in range(3):
      res = pool.step_chunk(zeros)
      for e in res.episodes:
        ends[(e.env_id, e.episode)] = res.obs.images[e.env_id]
    np.testing.assert_array_equal(ends[(2, 1)], ends[(3, 1)])


def test_group_size_must_divide_num_envs_and_env_fn_must_place_envs():
  cfg = ml_collections.ConfigDict({**CFG, "group_size": 4})
  with pytest.raises(ValueError, match=r"env\.group_size=4 must divide .*num_envs=6"):
    envs_lib.make_vec_env(cfg, 6, 0, num_workers=2, step_timeout_s=30)  # Before any worker.
  with pytest.raises(ValueError, match=r"expects groups \[0, 1\]"):
    make_pool(num_envs=2, envs_per_worker=2, env_fn=FirstIdIgnoredFn())


def _chunk_equal(a, b) -> None:
  for field in ("reward", "terminated", "truncated", "success", "steps", "has_final_obs"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  np.testing.assert_array_equal(a.obs.images, b.obs.images)
  np.testing.assert_array_equal(a.obs.state, b.obs.state)
  assert list(a.obs.instruction) == list(b.obs.instruction)
  assert a.episodes == b.episodes


def test_a_replayed_restart_gives_what_the_recorded_fault_gave():
  """A worker killed with its chunk in flight, and the same restart replayed after that
  chunk had landed (a replay's timing): the envs' results, fresh episodes and counters
  are the same, so the schedule log can replay faults exactly."""
  cfg = dict(CFG, latency_ms=100.0, latency_sigma=0.0)  # A chunk takes about 0.4 s.
  actions = random_actions(np.random.default_rng(1), 4)
  restarts = []
  with make_pool(cfg=cfg) as recorded:
    recorded.set_restart_listener(lambda *r: restarts.append(r))
    recorded.reset(seed=3)
    recorded.send(actions, np.arange(4))
    os.kill(recorded.pids[0], signal.SIGKILL)
    _, want_a = recorded.recv_ids([2, 3])
    _, want_b = recorded.recv_ids([0, 1])
    recorded.send(actions, np.arange(4))
    _, want_next = recorded.recv_ids(np.arange(4))
  assert restarts == [(0, "died", [0, 1], [])], restarts
  assert want_b.truncated.all() and not want_b.steps.any() and want_a.steps.all()
  with make_pool(cfg=cfg) as replay:
    replay.reset(seed=3)
    replay.send(actions, np.arange(4))
    time.sleep(1.5)
    _, got_a = replay.recv_ids([2, 3])  # Every chunk has landed, envs 0 and 1's too:
    with pytest.raises(pool_lib.ReplayMismatch, match="env 2 was in flight then, and is idle"):
      replay.replay_restart(1, "died", [2, 3], [])
    replay.replay_restart(0, "died", [0, 1], [])  # ... so the replay undoes them.
    _, got_b = replay.recv_ids([0, 1])
    _chunk_equal(got_a, want_a)
    _chunk_equal(got_b, want_b)
    replay.send(actions, np.arange(4))
    _, got_next = replay.recv_ids(np.arange(4))
    _chunk_equal(got_next, want_next)
    assert replay.stats.restarts == 1
