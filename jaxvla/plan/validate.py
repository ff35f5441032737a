"""The simulator against measured runs: ``python -m jaxvla.plan --validate``.

For each row of :data:`ROWS` (a config, overrides, the pipeline modes to compare, the
process count), in subprocesses so that each measurement starts alone:

1. ``python -m jaxvla.plan --measure=costs.json`` measures the config's stage costs;
2. ``python -m jaxvla.bench.pipeline`` (``jaxvla.bench.scaling`` for several processes)
   runs each mode and measures env steps/s and the mean staleness;
3. :func:`jaxvla.plan.simulator.simulate` predicts the same from the costs alone.

Steps 1 to 3 run ``repeats`` times per row (:data:`REPEATS` by default). A row holds
when the median prediction is within :data:`THROUGHPUT_TOLERANCE` of the median
measured env steps/s (relative) and within :data:`STALENESS_TOLERANCE` of its mean
staleness.

Both runs use :data:`XLA_FLAGS` (one thread per XLA computation, as the benchmark's
documented figures do), so an XLA computation is one core's work in both.

The machine's own speed drifts between the minute the costs are measured and the minute
the run is (a shared machine's neighbours; docs/results/scaling.md). :func:`machine_speed`,
a fixed single-core workload, is timed before and after each of the two, and the
prediction uses the costs :meth:`~jaxvla.plan.costs.Costs.scaled` by the ratio of the
two speeds (the speed while the costs were measured over the speed while the run was).
The line also carries the unscaled prediction's error (``raw_relative_error``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

import ml_collections
import numpy as np

from jaxvla import config_files, progress as progress_lib
from jaxvla.bench import pipeline as bench_pipeline
from jaxvla.plan import costs as costs_lib
from jaxvla.plan import simulator

log = logging.getLogger(__name__)

THROUGHPUT_TOLERANCE = 0.15
STALENESS_TOLERANCE = 0.5
# Measurements per row: single benchmark runs of one row moved by up to 25% between two
# validations on one quiet machine (docs/results/scaling.md), more than the tolerance.
REPEATS = 3
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
SPEED_SECONDS = 1.0  # Per machine_speed reading.
WARMUP = 2  # The benchmark's untimed updates (--warmup), simulated alike.
SIM_SEEDS = 5  # Simulated runs per prediction (draws of the env samples), averaged.


@dataclasses.dataclass(frozen=True)
class Prediction:
  env_steps_per_s: float
  staleness_mean: float


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  config: str  # PATH[:ARG]
  overrides: tuple[tuple[str, object], ...] = ()
  modes: tuple[str, ...] = ("sync_colocated", "+streamer")
  processes: int = 1
  updates: int = 8
  measure_seconds: float = 3.0  # Per stage-cost measurement (--measure_seconds).

  def load(self) -> ml_collections.ConfigDict:
    path, _, arg = self.config.partition(":")
    c = config_files.load_config(path, arg or None)
    with c.unlocked():
      c.update_from_flattened_dict(dict(self.overrides))
    return c

  def flags(self) -> list[str]:
    return [f"--config={self.config}"] + [f"--config.{k}={v}" for k, v in self.overrides]


ROWS = (
    Row("ColorReach (bench), 32 envs / 8 workers, k=1", "configs/default.py:bench",
        modes=("sync_colocated", "+train_async", "+streamer"), updates=12),
    Row("ColorReach (bench), 16 envs / 4 workers, k=2", "configs/default.py:bench",
        (("num_envs", 16), ("env_workers", 4), ("pipeline.b_max", 4),
         ("pipeline.max_staleness", 2)), modes=("+rollout_async", "+streamer"), updates=12),
    Row("ManiSkill3 PickCube state, 8 envs / 2 workers, k=1", "configs/maniskill.py:state",
        (("num_envs", 8), ("env_workers", 2), ("rollout_len", 4),
         ("pipeline.micro_batch_segments", 2)), updates=8),
    # 22 updates of 2 chunks per env: two whole 22-chunk episodes (libero_spatial's 220
    # steps) per env, so the window holds two resets per env whatever the episodes'
    # phase (an async rollout runs ahead of the learner by what it made while the learner
    # compiled; a reset costs about 1.5 chunks). Single runs of one episode's window
    # spread by 15% in a quiet hour (docs/results/scaling.md); two average twice the
    # chunks and resets.
    Row("LIBERO tiny, 2 envs / 2 workers, k=1", "configs/libero_bench.py:tiny", updates=22),
    Row("ColorReach (scaling), 2 processes x 32 envs, k=1", "configs/scaling.py",
        modes=("+rollout_async",), processes=2, updates=12),
)
QUICK_ROWS = (
    Row("ColorReach (bench), 16 envs / 4 workers, k=1", "configs/default.py:bench",
        (("num_envs", 16), ("env_workers", 4), ("pipeline.b_max", 4)),
        modes=("sync_colocated", "+streamer"), updates=4, measure_seconds=1.0),
)


def select(rows: tuple[Row, ...], names: list[str]) -> tuple[Row, ...]:
  """The rows whose name contains one of ``names`` (all of them for none).

  Raises:
    ValueError: a name matches no row (the rows' names are listed).
  """
  if not names:
    return rows
  unmatched = [n for n in names if not any(n in row.name for row in rows)]
  if unmatched:
    raise ValueError(f"--rows: {unmatched} match no validation row; the rows: "
                     f"{[row.name for row in rows]}")
  return tuple(row for row in rows if any(n in row.name for n in names))


def _env() -> dict[str, str]:
  """The environment of the measured runs: the caller's, with :data:`XLA_FLAGS` added to
  its ``XLA_FLAGS`` (the costs and the benchmark see the same compiler settings)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_FLAGS}".strip()
  return env


def _run(cmd: list[str]) -> str:
  done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n"
                       f"{done.stderr[-3000:]}")
  return done.stdout


def _last_json(stdout: str) -> dict:
  return json.loads(stdout.strip().splitlines()[-1])


def machine_speed(seconds: float = SPEED_SECONDS) -> float:
  """Rounds per second of a fixed single-core workload: small matrix products through
  NumPy (compiled numerics, as XLA's and the simulators' kernels) and a Python loop (the
  interpreter, as the rollout's bookkeeping). Only ratios between readings mean anything."""
  a = np.random.default_rng(0).standard_normal((96, 96)).astype(np.float32)
  rounds, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    b = a
    for _ in range(20):
      b = np.tanh(b @ a * 0.01)
    total = 0
    for i in range(2000):
      total += i * i % 7
    rounds += 1
  return rounds / (time.perf_counter() - t0)


def measure_row(row: Row, workdir: str) -> tuple[costs_lib.Costs, list[dict], dict]:
  """The row's measured stage costs, its benchmark rows (one per mode) and the machine's
  speed while each was measured (``costs``, ``run``: the mean of the readings before
  and after)."""
  costs_path = os.path.join(workdir, "costs.json")
  speeds = [machine_speed()]
  _run([sys.executable, "-m", "jaxvla.plan", *row.flags(), f"--measure={costs_path}",
        f"--measure_seconds={row.measure_seconds}"])
  speeds.append(machine_speed())
  common = [*row.flags(), f"--modes={','.join(row.modes)}", f"--updates={row.updates}",
            f"--warmup={WARMUP}"]
  if row.processes == 1:
    out = _run([sys.executable, "-m", "jaxvla.bench.pipeline", *common, "--stage_seconds=1"])
  else:
    out = _run([sys.executable, "-m", "jaxvla.bench.scaling", *common,
                f"--processes={row.processes}"])
  speeds.append(machine_speed())
  speed = dict(costs=(speeds[0] + speeds[1]) / 2, run=(speeds[1] + speeds[2]) / 2)
  return costs_lib.Costs.load(costs_path), _last_json(out)["rows"], speed


def predict(row: Row, costs: costs_lib.Costs, mode: str) -> Prediction:
  """The simulator's figures for the benchmark's own window (its warm-up, then
  ``row.updates`` updates), averaged over :data:`SIM_SEEDS` draws of the env samples:
  a window of a few updates holds an episode's reset or not as the run's does."""
  c = bench_pipeline.mode_config(row.load(), mode)
  setup = simulator.Setup.from_config(c, processes=row.processes,
                                      processes_per_machine=row.processes)
  runs = [simulator.simulate(setup, costs, updates=row.updates, warmup=WARMUP, seed=seed)
          for seed in range(SIM_SEEDS)]
  return Prediction(statistics.mean(r.env_steps_per_s for r in runs),
                    statistics.mean(r.staleness_mean for r in runs))


def validate(rows: tuple[Row, ...] = ROWS, workdir: str | None = None,
             repeats: int = 1) -> dict:
  """Measures and predicts every row ``repeats`` times (costs and benchmark each time);
  compares the median prediction with the median measurement. Returns the report (also
  the command's JSON), each line with every repeat's measured figure and their spread
  ((max - min) / median): the machine's own run-to-run noise, beside the tolerance."""
  if repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {repeats}")
  workdir = workdir or tempfile.mkdtemp(prefix="jaxvla_plan_validate_")
  lines = []
  # One line per measurement (each is minutes of subprocesses), on a terminal or not.
  phase = progress_lib.PhaseLog("planner validation (measurements)", len(rows) * repeats,
                                every_s=1e-9)
  for k, row in enumerate(rows):
    # mode -> [(measured row, prediction, unscaled prediction)]
    runs = collections.defaultdict(list)
    slowdowns = []  # per repeat: the run's machine against the costs' (> 1: slower)
    for r in range(repeats):
      row_dir = os.path.join(workdir, f"row{k}", f"repeat{r}")
      os.makedirs(row_dir, exist_ok=True)
      log.info("planner validation: row %s, repeat %d of %d: measuring its costs and "
               "benchmarking %s", row.name, r + 1, repeats, ", ".join(row.modes))
      costs, measured, speed = measure_row(row, row_dir)
      phase.tick(k * repeats + r + 1)
      slowdowns.append(speed["costs"] / speed["run"])
      for mode, got in zip(row.modes, measured):
        runs[mode].append((got, predict(row, costs.scaled(slowdowns[-1]), mode),
                           predict(row, costs, mode)))
    for mode in row.modes:
      got = [g["env_steps_per_s"] for g, _, _ in runs[mode]]
      sim = [p.env_steps_per_s for _, p, _ in runs[mode]]
      measured, predicted = statistics.median(got), statistics.median(sim)
      raw_error = statistics.median(p.env_steps_per_s for _, _, p in runs[mode]) / measured - 1
      stale_measured = statistics.median(g["staleness_mean"] for g, _, _ in runs[mode])
      stale_predicted = statistics.median(p.staleness_mean for _, p, _ in runs[mode])
      error, stale_error = predicted / measured - 1, stale_predicted - stale_measured
      lines.append(dict(
          row=row.name, mode=mode, processes=row.processes, repeats=repeats,
          measured_env_steps_per_s=measured, predicted_env_steps_per_s=predicted,
          measured_runs=got, predicted_runs=sim, machine_slowdowns=slowdowns,
          measured_spread=(max(got) - min(got)) / measured, relative_error=error,
          raw_relative_error=raw_error,
          measured_staleness=stale_measured, predicted_staleness=stale_predicted,
          staleness_error=stale_error,
          within=abs(error) <= THROUGHPUT_TOLERANCE and abs(stale_error) <= STALENESS_TOLERANCE))
      print(f"{row.name:<52}{mode:<16}{measured:>9.1f}{predicted:>9.1f}{error:>+8.1%}"
            f"{raw_error:>+8.1%}{statistics.median(slowdowns):>7.2f}"
            f"{stale_measured:>7.2f}{stale_predicted:>7.2f}{lines[-1]['measured_spread']:>8.0%}"
            f"{'  ok' if lines[-1]['within'] else '  OUT'}", flush=True)
  return dict(
      rows=lines, largest_relative_error=max(abs(x["relative_error"]) for x in lines),
      largest_staleness_error=max(abs(x["staleness_error"]) for x in lines),
      all_within=all(x["within"] for x in lines), workdir=workdir, repeats=repeats,
      tolerance=dict(relative=THROUGHPUT_TOLERANCE, staleness=STALENESS_TOLERANCE))


def header() -> str:
  return (f"{'row':<52}{'mode':<16}{'measured':>9}{'sim':>9}{'error':>8}{'raw':>8}"
          f"{'slower':>7}{'stale':>7}{'sim':>7}{'spread':>8}")
