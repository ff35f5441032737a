"""Pipeline throughput in every mode: ``python -m jaxvla.bench.pipeline --config=...``.

Runs the RL phase (no warm start, no evaluation, no checkpoints) of one config
in each mode, the paper's ablation, for ``--updates`` learner updates after
``--warmup`` (compilation, first batches) that are not timed:

=====================  ==============================================
``sync_colocated``     lockstep rollout, then train, on one device set
``sync_disaggregated`` the same with the weight-broadcast path
``+train_async``       L1: rollout thread || learner (lockstep envs)
``+rollout_async``     L1 + L2: first-ready env batching
``+streamer``          L1 + L2 + L3: streamed micro-batch learner
=====================  ==============================================

Throughput is env steps per second of the timed window, the smaller of two
rates: what the learner trained on, and what the rollout produced that was not
dropped as too stale. In steady state they are equal; over a short window an
async learner can drain a backlog queued during the warm-up (trained > produced),
or the rollout can fill the queue ahead of the learner (produced > trained), and
the minimum counts neither. Both rates are in the row (``trained_env_steps_per_s``,
``usable_rollout_env_steps_per_s``), beside the rollout's raw rate including
dropped steps (``rollout_env_steps_per_s``). Each stage's standalone rate is
measured alone, in the same units:

* env: the env pool with a zero-cost policy (random chunks), first-ready
  batching as the async mode uses it;
* inference: ``act`` on the async mode's inference batch, chunks/s x chunk length;
* learner: ``Learner.update`` on one stored update batch, its env steps / update time.

Pipeline efficiency = full-async throughput / the slowest standalone rate. The
last line of output is JSON with every row, ``speedup_vs_sync_colocated`` and
``efficiency`` of the full-async mode.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import os
import platform
import shutil
import tempfile
import time

import jax
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from jaxvla import config_checks, config_files, plot_timeline
from jaxvla.bench import envs as env_bench
from jaxvla.bench import trace_summary
from jaxvla.envs import make_vec_env
from jaxvla.learner import algorithm as algorithm_lib
from jaxvla.learner import learner as learner_lib
from jaxvla.models import policy as policy_lib
from jaxvla.parallel import distributed
from jaxvla.parallel import sharding as sharding_lib
from jaxvla.rollout import rollout as rollout_lib
from jaxvla.rollout import segments as segments_lib
from jaxvla.runtime import pipeline as pipeline_lib
from jaxvla.runtime import schedule as schedule_lib

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py:bench", "Config file (optionally ':variant').",
    lock_config=True)
_UPDATES = flags.DEFINE_integer("updates", 8, "Timed learner updates per mode.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed updates first (compilation).")
_MODES = flags.DEFINE_list(
    "modes", ["sync_colocated", "sync_disaggregated", "+train_async", "+rollout_async",
              "+streamer"], "Modes to run (the ablation order).")
_STAGE_SECONDS = flags.DEFINE_float("stage_seconds", 8.0, "Seconds per standalone-stage rate.")
_STALENESS_CONTROL = flags.DEFINE_enum(
    "staleness_control", "", ["", "drop", "pace"],
    "Override config.pipeline.staleness_control for the async modes ('': the config's).")
_TIMELINE = flags.DEFINE_string("timeline", "", "Write the full-async run's timeline PNG here.")
_PROFILE = flags.DEFINE_string(
    "profile", "", "Trace each mode with jax.profiler for --profile_updates more updates after "
    "its timed window, into DIR/<mode>, and print where the time went (trace_summary).")
_PROFILE_UPDATES = flags.DEFINE_integer(
    "profile_updates", 2, "Updates traced after each mode's timed window (with --profile).")

ABLATION = {
    "sync_colocated": dict(mode="sync_colocated"),
    "sync_disaggregated": dict(mode="sync_disaggregated"),
    "+train_async": dict(mode="async", train_async=True, rollout_async=False, streamer=False),
    "+rollout_async": dict(mode="async", train_async=True, rollout_async=True, streamer=False),
    "+streamer": dict(mode="async", train_async=True, rollout_async=True, streamer=True),
}


def mode_config(base: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """``base`` with the pipeline switches of ablation row ``name``."""
  if name not in ABLATION:
    raise ValueError(f"--modes: unknown mode {name!r}; choose from {list(ABLATION)}")
  c = copy.deepcopy(base)
  with c.unlocked():
    c.pipeline.update(ABLATION[name])
    if _STALENESS_CONTROL.value:
      c.pipeline.staleness_control = _STALENESS_CONTROL.value
    if name == "sync_colocated":  # Rolls out with the learner's own params: nothing to cast.
      c.pipeline.rollout_dtype = ""
    if c.pipeline.streamer:
      c.rl.update(config_checks.STREAMER_PPO)
  config_checks.validate(c)
  return c


class Parts:
  """What every mode shares: the policy, its params and the learner.

  ``mesh``: the learner mesh (None: one device). A multi-process run
  (``jaxvla.bench.scaling``) passes one over every process's devices, as
  ``jaxvla.train`` builds it.
  """

  def __init__(self, config: ml_collections.ConfigDict, spec,
               mesh: jax.sharding.Mesh | None = None):
    self.policy = policy_lib.make_policy(config.model, spec)
    self.params = jax.device_get(self.policy.init(jax.random.PRNGKey(config.seed)))
    self.act = jax.jit(functools.partial(self.policy.act, mode="train"))
    self.value = jax.jit(self.policy.value)
    self.mesh = mesh

  def learner(self, config) -> learner_lib.Learner:
    return learner_lib.Learner(self.policy, config, mesh=self.mesh,
                               rules=config.mesh.rules)

  def state(self, learner: learner_lib.Learner):
    if self.mesh is None:
      return learner_lib.init_state(jax.device_put(self.params), learner.ppo_tx,
                                    jax.random.PRNGKey(1))
    # (every process holds the same host params: placed into the mesh's shards)
    return learner.shard_state(learner_lib.init_state(self.params, learner.ppo_tx,
                                                      jax.random.PRNGKey(1)))


def run_mode(base: ml_collections.ConfigDict, name: str, parts: Parts) -> dict:
  """Throughput of one mode over ``--updates`` timed updates.

  Multi-process: every process calls it; the env-step rates are every process's
  steps together (the pipeline sums them at each update), the busy fractions this
  process's.
  """
  c = mode_config(base, name)
  seed = distributed.host_seed(c.seed)  # (each process plays its own episodes)
  env = make_vec_env(c.env, c.num_envs, seed, num_workers=c.env_workers,
                     step_timeout_s=c.env_step_timeout_s, hang_floor_s=c.env_hang_floor_s)
  learner = parts.learner(c)
  state = parts.state(learner)
  rng = jax.random.PRNGKey(2)
  if distributed.multi_process():  # Each process samples its own actions (as train does).
    rng = jax.random.fold_in(rng, jax.process_index())
  recorder = None
  if c.pipeline.schedule_log:  # As a run writes it (into a scratch folder), to price it.
    log_dir = tempfile.mkdtemp(prefix="jaxvla_bench_schedule_")
    recorder = schedule_lib.Recorder(schedule_lib.session_path(log_dir, 0), iteration=0,
                                     version=0, env_steps=0, seed=seed, mode=c.pipeline.mode)
  builder, items = algorithm_lib.get(c.algorithm).builder(c, env.spec)
  acting = pipeline_lib.Acting(env=env, policy=parts.policy, act_fn=parts.act,
                               value_fn=parts.value, builder=builder, items_per_update=items,
                               rng=rng, seed=seed)
  pipe = pipeline_lib.Pipeline(c.pipeline, learner, acting,
                               sharding_lib.rollout_sharding(jax.local_devices()),
                               schedule=schedule_lib.LiveSchedule(recorder))
  marks, trained = [], [0]

  def on_update(info):
    trained[0] += info.env_steps
    totals = pipe.totals()
    marks.append((time.perf_counter(), trained[0], totals["rollout_env_steps"],
                  pipe.clock.elapsed(), totals["dropped_env_steps"]))

  timed_end = _WARMUP.value + _UPDATES.value
  profile_dir = profile_path(name) if _PROFILE.value else ""
  tracing = [False]

  def on_update_traced(info):
    on_update(info)
    if profile_dir and len(marks) == timed_end:  # The timed window is over: trace from here.
      jax.profiler.start_trace(profile_dir, profiler_options=_profile_options())
      tracing[0] = True

  total = timed_end + (_PROFILE_UPDATES.value if profile_dir else 0)
  try:
    with contextlib.closing(pipe.updates(state, 0, 1 << 62)) as updates:  # Donates state.
      for info in updates:
        on_update_traced(info)
        if len(marks) >= total:
          pipe.request_stop()
  finally:
    if tracing[0]:
      jax.profiler.stop_trace()
    env.close()
    log_bytes = 0
    if recorder is not None:
      recorder.close()
      log_bytes = os.path.getsize(recorder.path)
      shutil.rmtree(os.path.dirname(os.path.dirname(recorder.path)))
    del state  # The next mode allocates its own train state (a full model's is ~36 GiB).
    gc.collect()
  # (a multi-process stop is agreed one update after it is asked for: marks can run on)
  (t0, s0, r0, c0, d0), (t1, s1, r1, c1, d1) = marks[_WARMUP.value - 1], marks[timed_end - 1]
  window = pipe.clock.window(c0, c1)
  workers = pipe.meters.workers_busy(since=c0, until=c1)  # The env pool's use over the timed window.
  stats = pipe.meters.record()
  trained_rate = (s1 - s0) / (t1 - t0)
  usable_rate = (r1 - r0 - (d1 - d0)) / (t1 - t0)
  throughput = min(trained_rate, usable_rate)
  row = dict(mode=name, pipeline=pipe.mode_name, env_steps_per_s=throughput,
             # (every process's steps over every device: per GPU / TPU chip)
             env_steps_per_s_per_device=throughput / jax.device_count(),
             trained_env_steps_per_s=trained_rate, usable_rollout_env_steps_per_s=usable_rate,
             rollout_env_steps_per_s=(r1 - r0) / (t1 - t0),
             updates=_UPDATES.value, seconds=t1 - t0,
             staleness_control=c.pipeline.staleness_control,
             staleness_mean=stats.get("staleness_mean", 0.0),
             dropped_env_steps=int(stats["queue_dropped_env_steps"]),
             env_workers_busy=workers,  # None without an env pool (env_workers=0).
             # The schedule log's size (config.pipeline.schedule_log; 0 when off).
             schedule_log_bytes_per_million_env_steps=(
                 log_bytes / max(pipe.totals()["rollout_env_steps"], 1) * 1e6),
             **{k: v for k, v in window.items() if k.endswith("_busy")})
  if profile_dir:
    row["profile"] = trace_summary.summarize(trace_summary.load(profile_dir))
    row["profile_dir"] = profile_dir
  if name == "+streamer" and _TIMELINE.value:
    intervals = pipe.clock.intervals()
    end = max(e for ivs in intervals.values() for _, e in ivs)  # The run's last activity.
    plot_timeline.plot_timeline(intervals, _TIMELINE.value, t_range=(max(c0, end - 3.0), end),
                         title=f"{pipe.mode_name}: 3 s of the timed window")
  return row


def profile_path(mode: str) -> str:
  """Where ``--profile`` traces ``mode`` (one folder per process of a multi-process run)."""
  path = os.path.join(_PROFILE.value, mode.lstrip("+"))
  if distributed.multi_process():
    path = os.path.join(path, f"process_{jax.process_index()}")
  return path


def _profile_options() -> jax.profiler.ProfileOptions:
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0  # Python function spans would be most of a long trace.
  return options


def stage_rates(base: ml_collections.ConfigDict, parts: Parts) -> dict[str, float]:
  """Standalone env, inference and learner rates (env steps/s)."""
  c = mode_config(base, "+rollout_async")
  seconds = _STAGE_SECONDS.value
  b_max = c.pipeline.b_max or max(1, c.num_envs // 2)
  chunk = c.model.chunk_len
  env = make_vec_env(c.env, c.num_envs, c.seed, num_workers=c.env_workers,
                     step_timeout_s=c.env_step_timeout_s, hang_floor_s=c.env_hang_floor_s)
  try:
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (c.num_envs, chunk, env.spec.action_dim)).astype(np.float32)
    env_rate = env_bench.run_first_ready(env, actions, seconds, b_max,
                                         c.pipeline.t_max_ms / 1000)
    # One lockstep update's data for the learner, and observations for inference.
    builder = segments_lib.SegmentBuilder(c.num_envs, c.rollout_len, c.num_envs)
    ro = rollout_lib.Rollout(env, parts.policy, parts.act, parts.value,
                             lambda: (parts.params, 0), builder, jax.random.PRNGKey(0), seed=1)
    for _ in range(c.rollout_len):
      ro.step_all()
    traj = ro.pop_items()[0].data
  finally:
    env.close()
  batch = jax.tree.map(lambda x: x[0, :b_max], traj.batch)
  params = jax.device_put(parts.params)
  jax.block_until_ready(parts.act(params, batch, jax.random.PRNGKey(0)))
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    jax.device_get(parts.act(params, batch, jax.random.PRNGKey(n)))
    n += 1
  inference_rate = n * b_max * chunk / (time.perf_counter() - t0)
  learner = parts.learner(c)
  state = parts.state(learner)
  state, _ = learner.update(state, traj)
  jax.block_until_ready(state)
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    state, m = learner.update(state, traj)
    jax.device_get(m)
    n += 1
  learner_rate = n * traj.num_env_steps / (time.perf_counter() - t0)
  return dict(env=env_rate, inference=inference_rate, learner=learner_rate)


def print_header(base: ml_collections.ConfigDict, device: str, scope: str, updates: int,
                 warmup: int) -> None:
  """The benchmark's '#' lines: machine, ``device``, the config's sizes (``scope``:
  e.g. 'per process: '), the timed updates and the built-in env's slept latency."""
  print(f"# {platform.machine()} {platform.processor() or 'cpu'}, {os.cpu_count()} cores, "
        f"jax {jax.__version__} {device}; {scope}env={base.env.name} "
        f"num_envs={base.num_envs} env_workers={base.env_workers} rollout_len={base.rollout_len} "
        f"chunk={base.model.chunk_len} model={base.model.name}/{base.model.variant}; "
        f"{updates} timed updates after {warmup}", flush=True)
  if base.env.name == "builtin":
    print(f"# builtin env latency {base.env.latency_ms:g} ms median per step, log-normal "
          f"sigma {base.env.latency_sigma:g} (long tail, slept)", flush=True)


def main(argv):
  del argv
  base = _CONFIG.value
  probe = make_vec_env(base.env, 1, 0, num_workers=0, step_timeout_s=60)
  spec = probe.spec
  probe.close()
  parts = Parts(base, spec)
  print_header(base, f"on {jax.devices()[0].device_kind}", "", _UPDATES.value, _WARMUP.value)
  rates = stage_rates(base, parts)
  slowest = min(rates, key=rates.get)
  print(f"{'stage (standalone)':<24}{'env steps/s':>12}")
  for k, v in rates.items():
    print(f"{k:<24}{v:>12.1f}{'  <- slowest' if k == slowest else ''}", flush=True)
  rows = []
  print(f"{'mode':<20}{'pipeline':<18}{'env steps/s':>12}{'trained':>9}{'usable':>8}"
        f"{'vs sync':>9}{'efficiency':>11}{'env':>6}{'workers':>8}{'infer':>7}{'learn':>7}"
        f"{'stale':>7}{'dropped':>9}")
  for name in _MODES.value:
    row = run_mode(base, name, parts)
    base_sps = rows[0]["env_steps_per_s"] if rows else row["env_steps_per_s"]
    # (a window too short for the rollout to produce anything usable reads 0: no ratio)
    row["speedup_vs_sync_colocated"] = (row["env_steps_per_s"] / base_sps if base_sps > 0
                                        else float("nan"))
    row["efficiency"] = row["env_steps_per_s"] / rates[slowest]
    rows.append(row)
    print(f"{name:<20}{row['pipeline']:<18}{row['env_steps_per_s']:>12.1f}"
          f"{row['trained_env_steps_per_s']:>9.1f}{row['usable_rollout_env_steps_per_s']:>8.1f}"
          f"{row['speedup_vs_sync_colocated']:>9.2f}{row['efficiency']:>11.2f}"
          f"{row['env_busy']:>6.2f}"
          + (f"{'-':>8}" if row["env_workers_busy"] is None else f"{row['env_workers_busy']:>8.2f}")
          + f"{row['inference_busy']:>7.2f}{row['learner_busy']:>7.2f}"
          f"{row['staleness_mean']:>7.2f}{row['dropped_env_steps']:>9d}", flush=True)
  for row in rows:
    if "profile" in row:
      print(f"# profile of {row['mode']} ({_PROFILE_UPDATES.value} updates after the timed "
            f"window, {row['profile_dir']}):")
      print(trace_summary.format_summary(row["profile"]), flush=True)
  full = rows[-1]
  print(json.dumps(dict(
      stage_rates=rates, slowest_stage=slowest, rows=rows, full_async_mode=full["mode"],
      speedup_vs_sync_colocated=full["speedup_vs_sync_colocated"],
      efficiency=full["efficiency"])))


if __name__ == "__main__":
  app.run(main, flags_parser=config_files.parse_flags)
