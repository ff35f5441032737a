"""Placement for N accelerators: ``python -m jaxvla.plan --accelerators=N``.

The planner simulates (:mod:`jaxvla.plan.simulator`) every placement of one machine of
``min(N, 8)`` accelerators with 16 CPU cores per accelerator, and keeps the fastest:

* **shared**: every accelerator both acts and trains (the rollout's work and the
  learner's share the devices), or **split**: ``R`` accelerators act and the others train;
* the async level: synchronous, L1, L1 + L2, L1 + L2 + L3;
* envs per machine: one or two per env worker, one worker per core;
* the staleness bound ``k`` (1, 2 or 4) for the asynchronous levels.

A run over several machines is one process per machine, each its own envs and rollout, the
learner data-parallel over every learner device (the params replicated: each machine
broadcasts to its own rollout devices). Two machines are simulated, every optimizer step
waiting for both, and the rest are taken to be alike: the throughput is multiplied by
the number of machines over two. The gradient
reduction is the one network cost in the model: ``2 x gradient bytes / bandwidth`` per
optimizer step, over NVLink within a machine and the network between machines.

Stage costs (:func:`h100_costs`), every figure from a measurement in the docs:

* ``act`` and the PPO minibatch: full pi0 / pi0.5 on one H100 (docs/results/policy.md,
  "Full pi0 and pi0.5 on one H100 (measured)"); ``value`` is the prefix's share of ``act`` (act
  minus its denoise steps, from the K = 4 and K = 10 rows); pi0.5's batch of 64 is pi0's
  ratio of 64 to 16 rows applied to pi0.5's 16.
* LIBERO's step: 4.4 env steps/s per CPU core (one worker process, two 64 px cameras
  rendered by llvmpipe; docs/results/envs.md), one core per worker; a chunk's time spread
  by a log-normal of sigma :data:`LIBERO_SIGMA`. Every episode runs to the suite's time
  limit, then the env's auto-reset costs :data:`LIBERO_RESET_STEPS` steps' time.
* The broadcast: the rollout's bfloat16 copy over NVLink at :data:`NVLINK_BYTES_PER_S`.
* The host's time per inference batch and per env result: :data:`ROLLOUT_OVERHEAD_S`,
  :data:`ROLLOUT_PER_ENV_S` (assumed).
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections
import numpy as np

from jaxvla.envs import libero
from jaxvla.plan import costs as costs_lib
from jaxvla.plan import simulator

GPUS_PER_MACHINE = 8
TIE = 0.02  # Relative throughput difference the planner treats as a tie.
SIMULATED_MACHINES = 2
CORES_PER_GPU = 16
LIBERO_STEPS_PER_CORE_S = 4.4  # docs/results/envs.md, one worker, 2 cameras, llvmpipe.
LIBERO_SIGMA = 0.2
# LIBERO's auto-reset (the scene re-placed, then 10 settle steps, each rendered), in env
# steps' time: measured on the 2-core CPU machine (libero_spatial, 64 px), the chunk that
# ends an episode took 2.76 and 2.94 s beyond chunks of 10 steps whose medians were 1.92
# and 2.14 s (docs/results/scaling.md, "Episodes and the streamed update").
LIBERO_RESET_STEPS = 14.0
NVLINK_BYTES_PER_S = 200e9  # Achieved all-reduce bus bandwidth within an H100 machine.
NETWORK_BYTES_PER_S = 50e9  # 400 Gb/s InfiniBand per GPU between machines.
# Measured on one H100 (docs/results/policy.md): act ms by (K, batch) and the PPO minibatch.
_H100_ACT_MS = {
    "pi0": {4: {1: 22.6, 16: 145.6, 64: 536.3}, 10: {1: 33.1, 16: 162.9, 64: 573.7}},
    "pi05": {10: {1: 36.1, 16: 184.5, 64: 184.5 * 573.7 / 162.9}},
}
_H100_PPO_MS = {"pi0": {8: 338.2, 32: 1046.1}, "pi05": {8: 395.0}}
_PARAMS = {"pi0": 3.238e9, "pi05": 3.353e9}  # (docs/design/policy.md)
# Host time around an inference batch and per env result: assumed, not measured on a GPU
# machine. The 2-core CPU machine measures about 1 ms per batch and 0.07 ms per result for
# ColorReach's 32 px frames (docs/results/scaling.md); 224 px frames are ~50x the bytes.
ROLLOUT_OVERHEAD_S = 2e-3
ROLLOUT_PER_ENV_S = 0.5e-3


def h100_costs(model: str, denoise_steps: int, chunk_len: int,
               episode_steps: int) -> costs_lib.Costs:
  """The costs of one H100 with 16 cores running LIBERO (the module docstring's sources),
  whose episodes last ``episode_steps`` env steps (the suite's time limit: an episode that
  succeeds sooner resets sooner, so this is the fewest resets)."""
  if model not in _H100_ACT_MS:
    raise ValueError(f"H100 figures exist for {sorted(_H100_ACT_MS)}, not {model!r}")
  tables = _H100_ACT_MS[model]
  k = denoise_steps if denoise_steps in tables else max(tables)
  act = {b: (ms / 1e3, 1.0) for b, ms in tables[k].items()}
  pair = _H100_ACT_MS["pi0"]
  value = {}  # The prefix alone: act minus K denoise steps (priced from pi0's K=4/10 rows).
  for b, ms in tables[k].items():
    per_step = (pair[10][b] - pair[4][b]) / 6 if b in pair[10] else 0.0
    value[b] = (max(ms - k * per_step, 0.1 * ms) / 1e3, 1.0)
  ppo = _H100_PPO_MS["pi0"]
  per_chunk = (ppo[32] - ppo[8]) / 24 / 1e3
  fixed = ppo[8] / 1e3 - 8 * per_chunk
  if model != "pi0":
    scale = _H100_PPO_MS[model][8] / ppo[8]
    per_chunk, fixed = per_chunk * scale, fixed * scale
  rng = np.random.default_rng(0)
  median = chunk_len / LIBERO_STEPS_PER_CORE_S
  env = [(float(s), 1.0) for s in median * rng.lognormal(0.0, LIBERO_SIGMA, 256)]
  copy_bytes = 2 * _PARAMS[model]  # The rollout's bfloat16 copy.
  return costs_lib.Costs(
      cores=CORES_PER_GPU, backend="gpu", chunk_len=chunk_len, env_chunk=env, act=act,
      value=value, rollout_overhead_s=ROLLOUT_OVERHEAD_S, rollout_per_env_s=ROLLOUT_PER_ENV_S,
      learner=costs_lib.Learner(fixed_s=fixed, per_chunk_s=per_chunk),
      broadcast_s=copy_bytes / NVLINK_BYTES_PER_S,
      env_reset=[(LIBERO_RESET_STEPS / LIBERO_STEPS_PER_CORE_S, 1.0)],
      episode_chunks=math.ceil(episode_steps / chunk_len),
      meta=dict(source="docs/results/policy.md (H100), docs/results/envs.md (LIBERO)",
                model=model, denoise_steps=k, episode_steps=episode_steps))


@dataclasses.dataclass(frozen=True)
class Option:
  placement: str  # 'shared' or 'split R/L'
  level: str
  envs_per_machine: int
  max_staleness: int
  env_steps_per_s: float  # the whole run
  staleness_mean: float
  efficiency: float
  learner_busy: float
  workers_busy: float


_LEVELS = {"sync": {}, "L1": dict(train_async=True),
           "L1+L2": dict(train_async=True, rollout_async=True),
           "L1+L2+L3": dict(train_async=True, rollout_async=True, streamer=True)}


def _options(config: ml_collections.ConfigDict, accelerators: int, costs: costs_lib.Costs,
             updates: int, network_bytes_per_s: float) -> list[Option]:
  gpus = min(accelerators, GPUS_PER_MACHINE)
  machines = math.ceil(accelerators / GPUS_PER_MACHINE)
  cores = int(costs.cores) * gpus
  machine_costs = dataclasses.replace(costs, cores=cores)
  # Two machines are simulated (each update waits for both: their stragglers count); the
  # rest are taken to be alike.
  simulated = min(machines, SIMULATED_MACHINES)
  grad_bytes = 4 * _PARAMS.get(config.model.name, 3.3e9)  # float32 gradients
  bandwidth = network_bytes_per_s if machines > 1 else NVLINK_BYTES_PER_S
  out = []
  splits = [("shared", gpus, gpus)] + [(f"split {r}/{gpus - r}", r, gpus - r)
                                        for r in range(1, gpus)]
  for name, rollout, learner in splits:
    learners = learner * machines
    allreduce = 2 * grad_bytes / bandwidth if learners > 1 else 0.0
    for per_worker in (1, 2):
      envs = cores * per_worker
      for level, switches in _LEVELS.items():
        for k in ((1,) if level == "sync" else (1, 2, 4)):
          items = envs // config.pipeline.micro_batch_segments
          setup = simulator.Setup(
              separate_params=name != "shared" or level != "sync", num_envs=envs,
              env_workers=cores, rollout_len=config.rollout_len,
              micro_batch_segments=config.pipeline.micro_batch_segments,
              b_max=max(config.pipeline.min_bucket, envs // 4), t_max_s=0.005,
              min_bucket=config.pipeline.min_bucket, max_staleness=k,
              queue_items=2 * items, num_minibatches=math.gcd(items, 4), num_epochs=1,
              rollout_devices=rollout, learner_devices=learner,
              shared_devices=name == "shared", allreduce_s=allreduce,
              processes=simulated, **switches)
          r = simulator.simulate(setup, machine_costs, updates=updates)
          out.append(Option(name, level, envs, k, r.env_steps_per_s * machines / simulated,
                            r.staleness_mean, r.efficiency, r.learner_busy,
                            r.env_workers_busy))
  return out


def plan(config: ml_collections.ConfigDict, accelerators: int,
         costs: costs_lib.Costs | None = None, updates: int = 12,
         network_bytes_per_s: float = NETWORK_BYTES_PER_S) -> dict:
  """The fastest placement for ``accelerators``: of those within :data:`TIE` of the
  fastest, the one with the lowest mean staleness.

  Raises:
    ValueError: for a count above 8 that is not a whole number of machines, or a config
      without built-in figures and no ``costs``.
  """
  if accelerators < 1 or (accelerators > GPUS_PER_MACHINE
                          and accelerators % GPUS_PER_MACHINE):
    raise ValueError(f"--accelerators={accelerators}: plan 1 to {GPUS_PER_MACHINE} or a "
                     f"multiple of {GPUS_PER_MACHINE} (whole machines)")
  if costs is None:
    if config.env.name != "libero":
      raise ValueError(f"built-in accelerator figures exist for LIBERO, not env "
                       f"{config.env.name!r}: measure its costs on one accelerator machine "
                       "(--measure) and pass --costs")
    episode_steps = libero.spec_from_config(config.env).max_episode_steps
    costs = h100_costs(config.model.name, config.model.num_denoise_steps,
                       config.model.chunk_len, episode_steps)
  options = _options(config, accelerators, costs, updates, network_bytes_per_s)
  fastest = max(o.env_steps_per_s for o in options)
  # Within TIE of the fastest is within the simulation's own noise: the freshest data wins.
  best = min((o for o in options if o.env_steps_per_s >= (1 - TIE) * fastest),
             key=lambda o: (o.staleness_mean, -o.env_steps_per_s))
  by_kind = {}
  for o in options:
    kind = ("shared" if o.placement == "shared" else "split", o.level)
    if kind not in by_kind or o.env_steps_per_s > by_kind[kind].env_steps_per_s:
      by_kind[kind] = o
  return dict(accelerators=accelerators, machines=math.ceil(accelerators / GPUS_PER_MACHINE),
              model=config.model.name, costs=costs.meta, best=dataclasses.asdict(best),
              best_by_kind=[dataclasses.asdict(o) for o in by_kind.values()],
              fastest_env_steps_per_s=fastest,
              network_bytes_per_s=network_bytes_per_s, options_simulated=len(options))


def format_plan(plan_: dict) -> str:
  b = plan_["best"]
  lines = [f"{plan_['accelerators']} accelerators ({plan_['machines']} machine(s)), "
           f"{plan_['model']}: {b['placement']}, {b['level']}, {b['envs_per_machine']} envs "
           f"per machine, k={b['max_staleness']}: {b['env_steps_per_s']:.0f} env steps/s "
           f"(staleness {b['staleness_mean']:.2f})",
           f"{'placement':<12}{'level':<10}{'envs':>6}{'k':>3}{'env steps/s':>13}{'stale':>7}"
           f"{'learner':>9}{'workers':>9}"]
  for o in sorted(plan_["best_by_kind"], key=lambda o: -o["env_steps_per_s"]):
    lines.append(f"{o['placement']:<12}{o['level']:<10}{o['envs_per_machine']:>6}"
                 f"{o['max_staleness']:>3}{o['env_steps_per_s']:>13.1f}"
                 f"{o['staleness_mean']:>7.2f}{o['learner_busy']:>9.2f}"
                 f"{o['workers_busy']:>9.2f}")
  return "\n".join(lines)


# RL-VLA3 (LIBERO, pi0.5): env steps/s of its colocated and fully asynchronous runs.
RL_VLA3 = {"colocated": {8: 289, 16: 548, 32: 704}, "full async": {8: 383, 16: 713, 32: 1121}}


def plot(plans: list[dict], path: str) -> None:
  """Predicted env steps/s against accelerators: the best placement, the best shared
  synchronous one (colocated) and the best L1 + L2 + L3 one, beside :data:`RL_VLA3`."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  counts = [p["accelerators"] for p in plans]

  def series(pick):
    return [max((o["env_steps_per_s"] for o in p["best_by_kind"] if pick(o)), default=0.0)
            for p in plans]

  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  ax.plot(counts, [p["best"]["env_steps_per_s"] for p in plans], "o-", label="planner: best")
  ax.plot(counts, series(lambda o: o["placement"] == "shared" and o["level"] == "sync"), "s--",
          label="planner: colocated sync")
  ax.plot(counts, series(lambda o: o["level"] == "L1+L2+L3"), "^--",
          label="planner: best full async")
  for name, marker in (("colocated", "x"), ("full async", "+")):
    points = sorted(RL_VLA3[name].items())
    ax.plot([a for a, _ in points], [v for _, v in points], marker, markersize=10,
            linestyle=":", label=f"RL-VLA3 {name} (pi0.5)")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(counts, [str(c) for c in counts])
  ax.set_xlabel("H100s (8 per machine, 16 CPU cores each)")
  ax.set_ylabel("env steps/s")
  ax.set_title(f"LIBERO, {plans[0]['model']}: predicted throughput")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
