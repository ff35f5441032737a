"""Measures a config's stage costs (:class:`jaxvla.plan.costs.Costs`) on this machine.

Each stage alone, as the simulator needs it: one env's chunk in a worker process (or
in this process when ``env_workers = 0``), stepped until an episode has ended too (the
chunks that end one are the reset's samples, and the episodes' length is counted),
``act`` and ``value`` at every padded batch size the rollout can use, the host time
around an inference call, a PPO update at two batch sizes (its fixed and per-chunk
parts) and the streamer's update (its cost per item beyond those), and one weight
broadcast. CPU demand is the CPU seconds of the process doing the work (the env
worker's, or this one's) over the wall seconds; on an accelerator ``act`` and the
learner are the device's (demand 1).

``act``, ``value`` and the host time around them are timed as the rollout meets them:
each call after a pause and a sweep through memory (:func:`_as_the_rollout_calls`), not
back to back. A run's inference call follows a wait for the envs, while other processes
had the cores and the caches; back-to-back calls keep both warm and are faster (ManiSkill3
state, the tiny pi0's ``act`` at 8 rows: 1.97 ms back to back, 2.58 ms after a pause and a
sweep, 2.78 ms inside a ``sync_colocated`` run, where nothing else runs during the call).

The figures are alone-times: run this with nothing else on the machine.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
import psutil
from absl import logging

from jaxvla import types
from jaxvla.bench import pipeline as bench_pipeline
from jaxvla.envs import make_vec_env
from jaxvla.envs import protocol
from jaxvla.parallel import sharding as sharding_lib
from jaxvla.plan import costs as costs_lib
from jaxvla.rollout import rollout as rollout_lib
from jaxvla.rollout import segments as segments_lib
from jaxvla.runtime import broadcast as broadcast_lib

_MIN_CALLS = 5
_MIN_CHUNKS = 20  # An env's chunks vary more (episode ends and resets): a few more.
_MAX_PARALLEL_ENVS = 16
# Before each timed inference call: the rollout's wait for the envs (a few ms of a chunk
# at the least), and a sweep through more memory than a core's own caches hold.
_PAUSE_S = 0.005
_SWEEP_FLOATS = 8 << 20  # 32 MiB


@functools.cache
def _sweep() -> np.ndarray:
  return np.ones(_SWEEP_FLOATS, np.float32)  # (made on the first measurement, not on import)


def _as_the_rollout_calls() -> None:
  """What precedes an inference call in a run: a pause, and other work through the
  caches (the module docstring)."""
  time.sleep(_PAUSE_S)
  _sweep().sum()


def _timed(fn: Callable[[], object], seconds: float,
           cpu: Callable[[], float] = time.process_time, calls: int = _MIN_CALLS,
           before: Callable[[], object] | None = None) -> tuple[list[float], float]:
  """Calls ``fn`` for about ``seconds`` (at least ``calls`` times), ``before()`` ahead of
  each call if given (not timed): ``(wall seconds of each call, CPU seconds / wall
  seconds over the calls)``."""
  walls, cpu_s, t0 = [], 0.0, time.perf_counter()
  while len(walls) < calls or time.perf_counter() - t0 < seconds:
    if before is not None:
      before()
    c0, start = cpu(), time.perf_counter()
    fn()
    walls.append(time.perf_counter() - start)
    cpu_s += cpu() - c0
  return walls, cpu_s / max(sum(walls), 1e-9)


def _pool_cpu(pool) -> Callable[[], float]:
  """CPU seconds (user + system, every thread) of the pool's worker processes so far."""
  processes = [psutil.Process(pid) for pid in pool.pids]
  return lambda: sum(sum(p.cpu_times()[:2]) for p in processes)


def _cores() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # (not Linux)
    return os.cpu_count() or 1


def measure(config: ml_collections.ConfigDict, seconds: float = 3.0) -> costs_lib.Costs:
  """The stage costs of ``config``'s run on this machine (``seconds`` per measurement)."""
  c = config
  chunk = c.model.chunk_len
  workers = 1 if c.env_workers else 0
  env = make_vec_env(c.env, 1, c.seed, num_workers=workers, step_timeout_s=c.env_step_timeout_s,
                     hang_floor_s=c.env_hang_floor_s)
  parts = bench_pipeline.Parts(c, env.spec)
  params = jax.device_put(parts.params)
  policy_actions = _policy_actions(parts, params)
  try:
    obs = env.reset(c.seed)
    # act compiles on its first call: outside the clock, or it takes most of ``seconds``
    # and leaves a few chunks (ManiSkill3: 20 to 83 in 3 s, their mean 10 to 16 ms).
    policy_actions(obs)
    cpu = _pool_cpu(env) if workers else time.process_time
    busy0, c0, walls, ends = env.stats.worker_busy_s if workers else 0.0, cpu(), [], []
    # Until an episode has ended too (its reset is a cost of its own), within two time
    # limits: an episode may also end sooner (success).
    limit = math.ceil(env.spec.max_episode_steps / chunk)
    t0 = time.perf_counter()
    while (time.perf_counter() - t0 < seconds or len(walls) < _MIN_CHUNKS
           or (not any(ends) and len(walls) < 2 * limit)):
      actions = policy_actions(obs)
      start = time.perf_counter()
      step = env.step_chunk(actions)
      walls.append(time.perf_counter() - start)
      ends.append(bool(step.terminated[0] or step.truncated[0]))
      obs = step.obs
    if workers:  # The worker's own time: its CPU seconds over its busy seconds.
      busy = env.stats.worker_busy_s - busy0
      demand = (cpu() - c0) / max(busy, 1e-9)
      walls = [w * busy / sum(walls) for w in walls]  # (the round trip's share is the parent's)
    else:
      demand = (cpu() - c0) / sum(walls)
    samples = list(zip(walls, ends))
    # Chunks per episode: through the last episode that ended, over the episodes.
    ended_at = [i + 1 for i, ended in enumerate(ends) if ended]
    episode_chunks = ended_at[-1] / len(ended_at) if ended_at else float(limit)
    # Cores to spare (one kept for this process): more samples of a long tail, at once.
    parallel = min(_MAX_PARALLEL_ENVS, int((_cores() - 1) / max(demand, 1e-3)))
    if workers and parallel >= 2:
      samples += _parallel_chunks(c, parallel, seconds, policy_actions)
    env_chunk, env_reset = _split_resets(samples, demand)
    logging.info("env: %d chunks, median %.4f s, demand %.2f; %d episode ends, %.4f s "
                 "each beyond a chunk, %.1f chunks per episode", len(env_chunk),
                 statistics.median(s for s, _ in env_chunk), demand, len(env_reset),
                 statistics.mean(s for s, _ in env_reset) if env_reset else 0.0,
                 episode_chunks)
    # One segment of the config's length from the one env, for the learner below.
    builder = segments_lib.SegmentBuilder(1, c.rollout_len, 1)
    rollout = rollout_lib.Rollout(env, parts.policy, parts.act, parts.value,
                                  lambda: (parts.params, 0), builder, jax.random.PRNGKey(0),
                                  seed=c.seed)
    for _ in range(c.rollout_len):
      rollout.step_all()
    segment = rollout.pop_items()[0].data
  finally:
    env.close()
  one = parts.policy.prepare(obs)
  sizes = sorted(set(rollout_lib.bucket_sizes(c.num_envs, c.pipeline.min_bucket))
                 | {c.num_envs})
  act, value = {}, {}
  device_demand = None if jax.default_backend() == "cpu" else 1.0
  for size in sizes:
    batch = jax.tree.map(lambda x, n=size: np.repeat(x, n, axis=0), one)
    key = jax.random.PRNGKey(size)
    jax.block_until_ready((parts.act(params, batch, key), parts.value(params, batch)))
    walls, demand = _timed(lambda b=batch, k=key: jax.block_until_ready(parts.act(params, b, k)),
                           seconds / len(sizes) / 2, before=_as_the_rollout_calls)
    act[size] = (statistics.median(walls), device_demand or demand)
    walls, demand = _timed(lambda b=batch: jax.block_until_ready(parts.value(params, b)),
                           seconds / len(sizes) / 2, before=_as_the_rollout_calls)
    value[size] = (statistics.median(walls), device_demand or demand)
  logging.info("act: %s", {b: round(s, 5) for b, (s, _) in act.items()})
  overhead = _rollout_overhead(parts, params, obs, c.num_envs, seconds, act[c.num_envs][0])
  per_env = _per_env_overhead(c, parts)
  learner = _learner_costs(c, parts, segment, seconds)
  broadcast_s = _broadcast_s(c, parts, seconds)
  return costs_lib.Costs(
      cores=_cores(), backend=jax.default_backend(), chunk_len=chunk, env_chunk=env_chunk,
      act=act, value=value, rollout_overhead_s=overhead, rollout_per_env_s=per_env,
      learner=learner, broadcast_s=broadcast_s, env_reset=env_reset,
      episode_chunks=episode_chunks,
      meta=dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                device=jax.devices()[0].device_kind, jax=jax.__version__,
                machine=platform.machine(), xla_flags=os.environ.get("XLA_FLAGS", ""),
                env=c.env.name, env_workers=c.env_workers, num_envs=c.num_envs,
                model=f"{c.model.name}/{c.model.variant}"))


def _policy_actions(parts: bench_pipeline.Parts, params
                    ) -> Callable[[protocol.Observation], np.ndarray]:
  """``obs [b] -> actions [b, H, A]`` from the config's policy: the env steps as it does in
  the run (a simulator's step time depends on the actions: random ones collide more)."""
  count = [0]

  def actions(obs: protocol.Observation) -> np.ndarray:
    count[0] += 1
    out = parts.act(params, parts.policy.prepare(obs), jax.random.PRNGKey(count[0]))
    return np.asarray(jax.device_get(out.actions))

  return actions


def _split_resets(samples: list[tuple[float, bool]], demand: float
                  ) -> tuple[list[costs_lib.Cost], list[costs_lib.Cost]]:
  """``(env_chunk, env_reset)`` from ``(seconds, episode ended)`` chunk samples: the
  chunks in which no episode ended, and what each one that ended took beyond their mean.
  Not clipped at 0: an episode that ended a few steps into its chunk skips the rest, and
  a reset that costs less reads negative, so the two kinds of chunk keep their measured
  mean (clipping a long tail's differences at 0 would add its spread as a cost)."""
  plain = [w for w, ended in samples if not ended] or [w for w, _ in samples]
  mean = statistics.mean(plain)
  return ([(w, demand) for w in plain],
          [(w - mean, demand) for w, ended in samples if ended])


def _parallel_chunks(c: ml_collections.ConfigDict, count: int, seconds: float,
                     policy_actions: Callable[[protocol.Observation], np.ndarray]
                     ) -> list[tuple[float, bool]]:
  """Chunk times of ``count`` one-env workers stepping at once (each env sent its next
  chunk as soon as its last is back), scaled to the workers' own busy time, each with
  whether the env's episode ended in it."""
  pool = make_vec_env(c.env, count, c.seed + 1, num_workers=count,
                      step_timeout_s=c.env_step_timeout_s, hang_floor_s=c.env_hang_floor_s)
  try:
    obs = pool.reset(c.seed + 1)
    sent = {}

    def send(ids, obs):
      pool.send(policy_actions(obs), np.asarray(ids))
      now = time.perf_counter()
      sent.update({int(i): now for i in ids})

    send(np.arange(count), obs)
    busy0, walls, ends, t0 = pool.stats.worker_busy_s, [], [], time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(walls) < _MIN_CHUNKS:
      ids, result = pool.recv(1, 0.0)
      walls.append(time.perf_counter() - sent.pop(int(ids[0])))
      ends.append(bool(result.terminated[0] or result.truncated[0]))
      send(ids, result.obs)
    busy = pool.stats.worker_busy_s - busy0
  finally:
    pool.close()
  # (the in-flight chunks' busy time is not counted yet: scale by the chunks counted)
  scale = min(1.0, busy / max(sum(walls), 1e-9))
  return [(w * scale, ended) for w, ended in zip(walls, ends)]


def _rollout_overhead(parts: bench_pipeline.Parts, params, obs: protocol.Observation,
                      rows: int, seconds: float, act_s: float) -> float:
  """Host seconds around one inference call of ``rows`` rows: preparing the observations,
  padding, fetching the outputs (what :meth:`Rollout._act` adds to ``act`` itself)."""
  many = protocol.concat_observations([obs] * rows)
  key = jax.random.PRNGKey(0)

  def call():
    batch = rollout_lib.pad_rows(parts.policy.prepare(many), rows)
    out = jax.device_get(parts.act(params, batch, jax.random.fold_in(key, 1)))
    return jax.tree.map(lambda x: np.asarray(x)[:rows], out)

  walls, _ = _timed(call, seconds / 2, before=_as_the_rollout_calls)
  return max(0.0, statistics.median(walls) - act_s)


def _per_env_overhead(c: ml_collections.ConfigDict, parts: bench_pipeline.Parts) -> float:
  """Host seconds per env result: lockstep steps of the config's own env batch, less
  their ``act`` / ``value`` time and their wait for the envs, per env chunk."""
  env = make_vec_env(c.env, c.num_envs, c.seed, num_workers=c.env_workers,
                     step_timeout_s=c.env_step_timeout_s, hang_floor_s=c.env_hang_floor_s)
  try:
    builder = segments_lib.SegmentBuilder(c.num_envs, c.rollout_len, c.num_envs)
    rollout = rollout_lib.Rollout(env, parts.policy, parts.act, parts.value,
                                  lambda: (parts.params, 0), builder, jax.random.PRNGKey(0),
                                  seed=c.seed)
    for _ in range(c.rollout_len):  # (compiles; the first segment)
      rollout.step_all()
    rollout.pop_items()
    before, t0 = rollout.clock.busy_seconds(), time.perf_counter()
    steps = 2 * c.rollout_len
    for _ in range(steps):
      rollout.step_all()
      rollout.pop_items()
    wall = time.perf_counter() - t0
    after = rollout.clock.busy_seconds()
  finally:
    env.close()
  busy = sum(after[k] - before[k] for k in ("env", "inference"))
  per_env = max(0.0, wall - busy) / (steps * c.num_envs)
  logging.info("rollout: %.2f ms per env result outside act and the envs", per_env * 1e3)
  return per_env


def _learner_costs(c: ml_collections.ConfigDict, parts: bench_pipeline.Parts, segment,
                   seconds: float) -> costs_lib.Learner:
  """``fixed_s`` and ``per_chunk_s`` from updates over the config's env count and half of it."""
  learner = parts.learner(c)
  state = parts.state(learner)
  m, epochs = c.rl.num_minibatches, c.rl.num_epochs
  sizes = [c.num_envs]
  if c.num_envs % (2 * m) == 0 and c.num_envs // 2 >= m:
    sizes.append(c.num_envs // 2)
  times, demands = {}, []
  for envs in sizes:
    traj = types.concat([segment] * envs)
    holder = [state]

    def update(t=traj):
      holder[0], metrics = learner.update(holder[0], t)
      jax.device_get(metrics)

    update()  # (compiles)
    walls, demand = _timed(update, seconds / len(sizes))
    state = holder[0]
    times[envs] = statistics.median(walls)
    demands.append(demand)
  chunks = {e: e * c.rollout_len for e in sizes}
  if len(sizes) == 2:
    big, small = sizes
    per_chunk = (times[big] - times[small]) / (epochs * (chunks[big] - chunks[small]))
    per_chunk = max(per_chunk, 0.0)
  else:
    per_chunk = times[sizes[0]] / (epochs * chunks[sizes[0]])
  fixed = max(0.0, (times[sizes[0]] / epochs - chunks[sizes[0]] * per_chunk) / m)
  demand = 1.0 if jax.default_backend() != "cpu" else statistics.mean(demands)
  item_s = _streamed_item_s(c, parts, segment, fixed, per_chunk, seconds)
  logging.info("learner: updates %s s, fixed %.4f s, per chunk %.5f s, demand %.2f, "
               "streamed %.4f s more per item", times, fixed, per_chunk, demand, item_s)
  return costs_lib.Learner(fixed_s=fixed, per_chunk_s=per_chunk, demand=demand, item_s=item_s)


def _streamed_item_s(c: ml_collections.ConfigDict, parts: bench_pipeline.Parts, segment,
                     fixed_s: float, per_chunk_s: float, seconds: float) -> float:
  """What the streamer's update (L3, :meth:`Learner.streamed_update`) takes per item
  beyond the whole update's model of its chunks and optimizer steps: each item's own
  gradient call and accumulation, and the later minibatches' pass under the update's
  first params. 0 for a config the streamer cannot run."""
  try:
    cs = bench_pipeline.mode_config(c, "+streamer")
  except ValueError as e:
    logging.info("learner: no streamed update for this config (%s)", e)
    return 0.0
  learner = parts.learner(cs)
  holder = [parts.state(learner)]
  segments = cs.pipeline.micro_batch_segments
  items = cs.num_envs // segments
  chunks = segments * cs.rollout_len
  item = types.Item(types.concat([segment] * segments), versions=np.zeros(chunks, np.int32),
                    num_chunks=chunks, num_env_steps=chunks * cs.model.chunk_len,
                    num_segments=segments)

  def update():
    holder[0], _ = learner.streamed_update(holder[0], [item] * items, items)

  update()  # (compiles both gradient programs: the later minibatches' keep a snapshot)
  walls, _ = _timed(update, seconds / 2)
  modelled = cs.rl.num_minibatches * fixed_s + items * chunks * per_chunk_s
  return max(0.0, (statistics.median(walls) - modelled) / items)


def _broadcast_s(c: ml_collections.ConfigDict, parts: bench_pipeline.Parts,
                 seconds: float) -> float:
  """One weight broadcast to the rollout's copy, as the pipeline makes it, waited for."""
  server = broadcast_lib.ParamServer(sharding_lib.rollout_sharding(jax.local_devices()),
                                     cast=c.pipeline.rollout_dtype or None)
  params = jax.device_put(parts.params)
  version = [0]

  def publish():
    version[0] += 1
    server.publish(params, version[0], wait=True)

  try:
    publish()
    walls, _ = _timed(publish, seconds / 4)
  finally:
    server.close()
  return statistics.median(walls)
