"""The planner (jaxvla.plan): the event engine, the pipeline model against closed forms and
the pipeline's own rules, the stage-cost file, and the placement search."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import types

import pytest

from jaxvla import config_files, defaults
from jaxvla.plan import costs as costs_lib
from jaxvla.plan import engine, placement, profile, simulator
from jaxvla.runtime import modes as modes_lib
from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _costs(env_s=(0.02,), demand=0.05, cores=64.0, act_s=0.004, value_s=0.002,
           overhead_s=0.001, fixed_s=0.01, per_chunk_s=0.001, broadcast_s=0.003):
  return costs_lib.Costs(
      cores=cores, backend="cpu", chunk_len=5, env_chunk=[(s, demand) for s in env_s],
      act={1: (act_s, 1.0), 64: (act_s, 1.0)}, value={1: (value_s, 1.0), 64: (value_s, 1.0)},
      rollout_overhead_s=overhead_s, rollout_per_env_s=0.0, learner=costs_lib.Learner(fixed_s, per_chunk_s, 1.0),
      broadcast_s=broadcast_s)


# ------------------------------------------------------------------- engine --
def test_processor_sharing_slows_tasks_only_beyond_the_capacity():
  sim = engine.Sim()
  cpu = engine.Resource(sim, "cpu", 1.0)
  done = {}

  def task(name, start, alone, demand):
    yield sim.timeout(start)
    yield cpu.run(alone, demand)
    done[name] = sim.now

  # Two 1 s single-core tasks on one core: each at half speed, both done at 2 s.
  sim.spawn(task("a", 0.0, 1.0, 1.0))
  sim.spawn(task("b", 0.0, 1.0, 1.0))
  # A task that joins at 3 s and sleeps half its time (demand 0.5) with another: 1.5
  # cores demanded of 1, so each runs at 2/3 speed: the 1 s task ends at 4.5 s.
  sim.spawn(task("c", 3.0, 1.0, 0.5))
  sim.spawn(task("d", 3.0, 1.0, 1.0))
  sim.run(lambda: False)
  assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(2.0)
  assert done["c"] == pytest.approx(4.5) and done["d"] == pytest.approx(4.5)
  assert cpu.busy_seconds() == pytest.approx(3.5)


def test_a_task_leaving_speeds_up_the_rest():
  sim = engine.Sim()
  cpu = engine.Resource(sim, "cpu", 1.0)
  ends = []

  def task(alone):
    yield cpu.run(alone, 1.0)
    ends.append(sim.now)

  sim.spawn(task(1.0))
  sim.spawn(task(3.0))
  sim.run(lambda: False)
  # Both at half speed until the short one is done at 2 s (1 s of service each); the
  # long one has 2 s of its 3 left, alone: done at 4 s.
  assert ends == pytest.approx([2.0, 4.0])


# ---------------------------------------------------------------- the model --
def test_sync_throughput_is_the_closed_form_of_one_lockstep_iteration():
  s = simulator.Setup(num_envs=8, env_workers=4, rollout_len=3, micro_batch_segments=4,
                      num_minibatches=2, num_epochs=2)
  c = _costs()
  r = simulator.simulate(s, c, updates=5)
  # Per chunk: host overhead + act, then every worker steps its 2 envs one after the
  # other (no contention: 64 cores); the last chunk adds the value call; then the update.
  chunk = c.rollout_overhead_s + 0.004 + 2 * 0.02
  update = 2 * (2 * 0.01 + 8 * 3 * 0.001)
  iteration = 3 * chunk + c.rollout_overhead_s + 0.002 + update
  assert r.env_steps_per_s == pytest.approx(8 * 3 * 5 / iteration, rel=1e-9)
  assert r.staleness_mean == 0 and r.dropped_env_steps == 0


def test_episode_ends_add_their_reset_from_the_start_of_the_run():
  """Every env starts an episode with the run; the chunk that ends one adds a reset
  sample. Lockstep with every env ending together: the iteration that holds the resets
  is one reset longer, so a window's throughput depends on whether it holds one."""
  s = simulator.Setup(num_envs=2, env_workers=2, rollout_len=2, micro_batch_segments=2,
                      num_minibatches=1)
  plain = _costs(env_s=(0.1,), fixed_s=0.0, per_chunk_s=1e-6, act_s=1e-6, value_s=1e-6,
                 overhead_s=0.0)
  resets = dataclasses.replace(plain, env_reset=[(0.3, 1.0)], episode_chunks=4.0)
  # Updates of 2 chunks: episodes end in the chunks of updates 2, 4, ...; a window of
  # updates 3-4 holds one reset, one of update 3 alone holds none.
  base = simulator.simulate(s, plain, updates=2, warmup=2)
  held = simulator.simulate(s, resets, updates=2, warmup=2)
  assert held.seconds == pytest.approx(base.seconds + 0.3, rel=1e-3)
  assert simulator.simulate(s, resets, updates=1, warmup=2).seconds == pytest.approx(
      simulator.simulate(s, plain, updates=1, warmup=2).seconds, rel=1e-6)
  # The standalone env rate amortises the reset over the episode.
  assert simulator.stage_rates(s, resets)["env"] == pytest.approx(
      simulator.stage_rates(s, plain)["env"] * 0.1 / (0.1 + 0.3 / 4))
  # A chunk that ended its episode early (a negative reset) costs less, never below 0.
  short = dataclasses.replace(plain, env_reset=[(-0.05, 1.0)], episode_chunks=4.0)
  assert simulator.simulate(s, short, updates=2, warmup=2).seconds == pytest.approx(
      base.seconds - 0.05, rel=1e-3)
  gone = dataclasses.replace(plain, env_reset=[(-1.0, 1.0)], episode_chunks=4.0)
  assert simulator.simulate(s, gone, updates=2, warmup=2).seconds == pytest.approx(
      base.seconds - 0.1, rel=1e-3)
  # A non-integer mean: episodes of 2 and 3 chunks, 2.5 on average.
  proc = simulator._Run(s, dataclasses.replace(resets, episode_chunks=2.5), 0).processes[0]
  lengths = []
  for _ in range(400):
    proc._new_episode(0)
    lengths.append(int(proc.episode_left[0]))
  assert set(lengths) == {2, 3} and sum(lengths) / 400 == pytest.approx(2.5, abs=0.15)


def test_a_streamed_update_adds_its_cost_per_item():
  """L3 trains each item as it arrives: ``learner.item_s`` per item on top of the whole
  update's model (the learner alone: no envs, act or value to speak of)."""
  s = simulator.Setup(num_envs=8, env_workers=0, rollout_len=2, micro_batch_segments=2,
                      num_minibatches=2, streamer=True, train_async=True)
  c = _costs(env_s=(1e-6,), act_s=1e-6, value_s=1e-6, overhead_s=0.0, fixed_s=0.01,
             per_chunk_s=0.001)
  slow = dataclasses.replace(c, learner=costs_lib.Learner(0.01, 0.001, 1.0, item_s=0.005))
  update = 2 * 0.01 + 16 * 0.001  # 2 optimizer steps, 16 chunks; 4 items of 4 chunks
  assert simulator.stage_rates(s, c)["learner"] == pytest.approx(16 * 5 / update)
  assert simulator.stage_rates(s, slow)["learner"] == pytest.approx(16 * 5 / (update + 0.02))
  assert simulator.simulate(s, slow, updates=4).learner_busy > simulator.simulate(
      s, c, updates=4).learner_busy


def test_cores_shared_by_demand_slow_the_env_workers():
  s = simulator.Setup(num_envs=8, env_workers=8, rollout_len=2, micro_batch_segments=8,
                      num_minibatches=1)
  alone = simulator.simulate(s, _costs(demand=1.0, cores=8.0), updates=3)
  crowded = simulator.simulate(s, _costs(demand=1.0, cores=2.0), updates=3)
  sleepy = simulator.simulate(s, _costs(demand=0.25, cores=2.0), updates=3)
  assert crowded.env_steps_per_s < 0.6 * alone.env_steps_per_s
  assert sleepy.env_steps_per_s == pytest.approx(alone.env_steps_per_s, rel=1e-9)


@pytest.mark.parametrize("rollout_async", [False, True])
def test_paced_staleness_stays_within_the_bound(rollout_async):
  # A slow learner: the rollout runs ahead until the pacer holds it at k.
  s = simulator.Setup(train_async=True, rollout_async=rollout_async, separate_params=True,
                      num_envs=16, env_workers=4, rollout_len=2, micro_batch_segments=4,
                      num_minibatches=2, max_staleness=2, b_max=4, queue_items=64)
  env = [0.005, 0.01, 0.02, 0.08]
  r = simulator.simulate(s, _costs(env_s=env, fixed_s=0.2), updates=10)
  assert r.staleness_mean > 1.0  # The learner trains on old data ...
  assert max(r.staleness_hist) <= 2  # ... never older than k.
  if not rollout_async:  # Lockstep segments start together: nothing is ever dropped.
    assert r.dropped_env_steps == 0


def test_without_pacing_too_stale_items_are_dropped():
  s = simulator.Setup(train_async=True, separate_params=True, staleness_control="drop",
                      num_envs=16, env_workers=4, rollout_len=2, micro_batch_segments=4,
                      num_minibatches=2, max_staleness=1, queue_items=64)
  r = simulator.simulate(s, _costs(fixed_s=0.2), updates=10)
  assert r.dropped_env_steps > 0 and max(r.staleness_hist) <= 1
  assert r.usable_rollout_env_steps_per_s < r.trained_env_steps_per_s * 1.5


def test_first_ready_batching_beats_lockstep_on_a_long_tail():
  lockstep = simulator.Setup(train_async=True, separate_params=True, num_envs=32,
                             env_workers=8, micro_batch_segments=8, b_max=8)
  first_ready = dataclasses.replace(lockstep, rollout_async=True)
  tail = [0.01] * 9 + [0.2]  # One chunk in ten takes 20 times as long.
  c = _costs(env_s=tail)
  assert (simulator.simulate(first_ready, c).env_steps_per_s
          > 1.3 * simulator.simulate(lockstep, c).env_steps_per_s)


def test_processes_on_one_machine_share_its_cores():
  one = simulator.Setup(num_envs=8, env_workers=4, micro_batch_segments=4, rollout_len=2)
  two = dataclasses.replace(one, processes=2, processes_per_machine=2)
  apart = dataclasses.replace(one, processes=2, processes_per_machine=1)
  c = _costs(demand=1.0, cores=4.0)
  r1, r2, r_apart = (simulator.simulate(s, c, updates=4) for s in (one, two, apart))
  assert r_apart.env_steps_per_s == pytest.approx(2 * r1.env_steps_per_s, rel=0.05)
  assert r2.env_steps_per_s < 0.8 * r_apart.env_steps_per_s


def test_setup_reads_the_pipelines_own_switches():
  c = defaults.get_config()
  c.env_workers = 4
  for mode in modes_lib.MODES:
    c.pipeline.mode = mode
    levels = modes_lib.Levels.from_config(c.pipeline)
    s = simulator.Setup.from_config(c)
    assert (s.train_async, s.rollout_async, s.streamer, s.separate_params) == (
        levels.train_async, levels.rollout_async, levels.streamer, levels.separate_params)
  c.algorithm = "grpo"
  with pytest.raises(ValueError, match="algorithm='grpo'"):
    simulator.Setup.from_config(c)
  with pytest.raises(ValueError, match="micro_batch_segments=3 must divide num_envs=8"):
    simulator.Setup(num_envs=8, env_workers=4, micro_batch_segments=3)


# -------------------------------------------------------------- cost files --
def test_costs_round_trip_and_name_what_is_wrong(tmp_path):
  c = _costs(env_s=(0.01, 0.03))
  c.env_reset, c.episode_chunks = [(0.05, 1.0)], 22.0
  c.learner.item_s = 0.004
  path = str(tmp_path / "costs.json")
  c.save(path)
  back = costs_lib.Costs.load(path)
  assert back.act == c.act and back.env_chunk == c.env_chunk and back.learner == c.learner
  assert back.env_reset == c.env_reset and back.episode_chunks == 22.0
  d = json.load(open(path, encoding="utf-8"))
  # A file from before resets and streamed items were measured: neither is modelled.
  older = {k: v for k, v in d.items() if k not in ("env_reset", "episode_chunks")}
  older["learner"] = {k: v for k, v in d["learner"].items() if k != "item_s"}
  old = costs_lib.Costs.from_json(older)
  assert old.env_reset == [] and old.episode_chunks == 0.0 and old.learner.item_s == 0.0
  del d["broadcast_s"]
  json.dump(d, open(path, "w", encoding="utf-8"))
  with pytest.raises(ValueError, match=r"costs.json: missing key 'broadcast_s'"):
    costs_lib.Costs.load(path)
  d["format"] = 7
  json.dump(d, open(path, "w", encoding="utf-8"))
  with pytest.raises(ValueError, match="format 7"):
    costs_lib.Costs.load(path)


def test_act_cost_interpolates_between_measured_batches():
  c = _costs()
  c.act = {1: (0.01, 1.0), 16: (0.04, 1.0), 64: (0.10, 1.0)}
  assert c.act_cost(1)[0] == pytest.approx(0.01)
  assert c.act_cost(8)[0] == pytest.approx(0.01 + 7 / 15 * 0.03)
  assert c.act_cost(128)[0] == pytest.approx(0.10 + 64 / 48 * 0.06)  # (extrapolated)


def test_scaled_costs_slow_only_the_cpu_work():
  c = _costs(env_s=(0.02,), demand=0.25, act_s=0.004, fixed_s=0.01, overhead_s=0.001)
  c.env_reset, c.learner.item_s = [(0.04, 0.25)], 0.003
  s = c.scaled(2.0)  # cores twice as slow
  assert s.env_chunk == [(pytest.approx(0.02 * 1.25), 0.25)]  # a quarter of it computes
  assert s.env_reset == [(pytest.approx(0.04 * 1.25), 0.25)]
  assert s.learner.item_s == pytest.approx(0.006)
  assert s.act_cost(1)[0] == pytest.approx(0.008) and s.learner.fixed_s == pytest.approx(0.02)
  assert s.rollout_overhead_s == pytest.approx(0.002) and s.meta["scaled"] == 2.0
  gpu = dataclasses.replace(c, backend="gpu").scaled(2.0)  # the device's work keeps its time
  assert gpu.act_cost(1)[0] == pytest.approx(0.004) and gpu.learner.fixed_s == pytest.approx(0.01)
  assert gpu.env_chunk == s.env_chunk and gpu.rollout_overhead_s == pytest.approx(0.002)
  with pytest.raises(ValueError, match="factor must be > 0"):
    c.scaled(0.0)


def test_inference_is_timed_after_what_precedes_it_in_a_run():
  """``_timed(before=...)``: only the calls are timed, and the CPU demand is over the
  calls (a pause before each must not read as a call that waits). The CPU clock is the
  calls' own: each call adds the time it spun, so the demand is 1 (a little less when the
  process is preempted between the timer and the call: 0.995 on a loaded machine) unless
  the pauses count (0.25 then)."""
  calls, cpu = [], [0.0]

  def spin():
    start = time.perf_counter()
    calls.append(start)
    while time.perf_counter() < start + 0.01:
      pass
    cpu[0] += time.perf_counter() - start

  walls, demand = profile._timed(spin, 0.0, cpu=lambda: cpu[0], calls=5,
                                 before=lambda: time.sleep(0.03))
  assert len(walls) == 5 and all(0.01 <= w < 0.025 for w in walls), walls
  assert 0.9 < demand <= 1.0 + 1e-9, demand
  assert min(b - a for a, b in zip(calls, calls[1:])) >= 0.04  # each pause came first


def test_chunks_that_end_an_episode_give_the_reset_its_own_samples():
  chunks, resets = profile._split_resets(
      [(0.1, False), (0.3, False), (0.5, True), (0.15, True)], 0.9)
  assert chunks == [(0.1, 0.9), (0.3, 0.9)]
  # Beyond the mean ordinary chunk (0.2); an episode that ended early in its chunk
  # skipped steps and reads negative, so both kinds keep their measured mean.
  assert resets == [(pytest.approx(0.3), 0.9), (pytest.approx(-0.05), 0.9)]
  chunks, resets = profile._split_resets([(0.1, True)], 1.0)  # (no ordinary chunk)
  assert chunks == [(0.1, 1.0)] and resets == [(0.0, 1.0)]


# --------------------------------------------------------------- placement --
def test_h100_costs_are_the_documented_figures():
  c = placement.h100_costs("pi0", 4, 10, 220)
  assert c.act[16][0] == pytest.approx(0.1456)
  # libero_spatial's 220 steps: 22 chunks, then the reset's 14 steps' time on one core.
  assert c.episode_chunks == 22
  assert c.env_reset == [(pytest.approx(14 / placement.LIBERO_STEPS_PER_CORE_S), 1.0)]
  assert c.learner.fixed_s + 8 * c.learner.per_chunk_s == pytest.approx(0.3382)
  assert c.learner.fixed_s + 32 * c.learner.per_chunk_s == pytest.approx(1.0461)
  median = sorted(s for s, _ in c.env_chunk)[len(c.env_chunk) // 2]
  assert median == pytest.approx(10 / placement.LIBERO_STEPS_PER_CORE_S, rel=0.1)


def test_plan_picks_the_fastest_simulated_placement():
  config = config_files.load_config(os.path.join(ROOT, "configs", "libero_bench.py"), "pi0")
  plan = placement.plan(config, 2, updates=3)
  best, fastest = plan["best"], plan["fastest_env_steps_per_s"]
  assert fastest == max(o["env_steps_per_s"] for o in plan["best_by_kind"])
  assert best["env_steps_per_s"] >= (1 - placement.TIE) * fastest
  assert plan["options_simulated"] == 2 * (1 + 3 * 3) * 2  # shared and split 1/1
  with pytest.raises(ValueError, match="multiple of 8"):
    placement.plan(config, 12)
  config.env.name = "maniskill"
  with pytest.raises(ValueError, match="--costs"):
    placement.plan(config, 8)


def test_the_command_simulates_a_config_from_a_costs_file(tmp_path):
  path = str(tmp_path / "costs.json")
  _costs().save(path)
  out = subprocess.run(
      [sys.executable, "-m", "jaxvla.plan", "--config=configs/default.py:bench",
       "--config.pipeline.mode=async", "--config.pipeline.streamer=True",
       "--config.rl.num_epochs=1", "--config.rl.advantage_norm=none", f"--costs={path}",
       "--updates=3"], cwd=ROOT, capture_output=True, text=True,
      check=True).stdout
  result = json.loads(out.strip().splitlines()[-1])
  assert result["setup"] == "L1+L2+L3" and result["env_steps_per_s"] > 0
  assert math.isfinite(result["efficiency"])


def test_validate_compares_medians_over_repeats(tmp_path, monkeypatch):
  """Each repeat measures costs and runs anew; the row compares the medians and carries
  every measured figure and their spread. Each prediction uses its costs scaled by the
  machine's slowdown between the costs' measurement and the run's."""
  from jaxvla.plan import validate  # pylint: disable=import-outside-toplevel

  class Costs:  # a prediction of base / factor env steps/s: slower cores, fewer steps
    def __init__(self, base, factor=1.0):
      self.base, self.factor = base, factor

    def scaled(self, factor):
      return Costs(self.base, factor)

  measured = iter([100.0, 130.0, 110.0])  # three repeats of one mode
  bases = iter([120.0, 118.0, 200.0])
  monkeypatch.setattr(validate, "measure_row", lambda row, d: (
      Costs(next(bases)), [dict(env_steps_per_s=next(measured), staleness_mean=0.5)],
      dict(costs=1.1, run=1.0)))  # the machine was 10% faster during the runs
  monkeypatch.setattr(validate, "predict", lambda row, costs, mode: types.SimpleNamespace(
      env_steps_per_s=costs.base / costs.factor, staleness_mean=0.7))
  row = validate.Row("r", "configs/default.py:bench", modes=("sync_colocated",))
  report = validate.validate((row,), str(tmp_path), repeats=3)
  (line,) = report["rows"]
  assert line["measured_runs"] == [100.0, 130.0, 110.0]
  assert line["machine_slowdowns"] == pytest.approx([1.1] * 3)
  assert line["measured_env_steps_per_s"] == 110.0
  assert line["predicted_env_steps_per_s"] == pytest.approx(120 / 1.1)
  assert line["relative_error"] == pytest.approx(120 / 1.1 / 110 - 1)
  assert line["raw_relative_error"] == pytest.approx(120 / 110 - 1)
  assert line["measured_spread"] == pytest.approx(30 / 110)
  assert line["staleness_error"] == pytest.approx(0.2) and line["within"]
  with pytest.raises(ValueError, match="--repeats must be >= 1"):
    validate.validate((row,), str(tmp_path), repeats=0)


def test_validate_rows_are_picked_by_name():
  from jaxvla.plan import validate  # pylint: disable=import-outside-toplevel
  assert validate.select(validate.ROWS, []) == validate.ROWS
  (row,) = validate.select(validate.ROWS, ["LIBERO"])
  assert row.config == "configs/libero_bench.py:tiny"
  with pytest.raises(ValueError, match=r"\['LIBRO'\] match no validation row.*LIBERO tiny"):
    validate.select(validate.ROWS, ["LIBERO", "LIBRO"])


# Measures a config, then benchmarks two modes: two to four minutes on 2 cores. A timing
# check, so it runs in the learning step (`launch/test.sh --only=learning`), not in the
# per-submission suite: it read an error of 0.57 against its bound of 0.5 with a third
# test process on the two cores (docs/results/testing.md), and the suite's own load
# varies with what else a CI machine runs. Third in the step (conftest deals the ranks out
# over the workers): on 2 it follows the pixel run on its worker.
@pytest.mark.learning
@pytest.mark.run_first(2)
def test_validate_compares_the_simulator_with_measured_runs(tmp_path):
  """The small version of ``--validate``: one config's costs measured, two modes run and
  simulated. The documented check (every row within 15%, docs/results/scaling.md) is for
  a quiet machine; the learning step runs two tests at a time, so the measured runs share
  the cores with another test and only a gross error (a stage or a rule missing from the
  model: a factor, not percent) fails here. Costs and runs are compiled alike, with the
  test suite's compile-time XLA flags (conftest.fast_xla_env): what is checked is the
  model against the programs measured, whichever programs they are."""
  env = conftest.fast_xla_env(dict(os.environ, TMPDIR=str(tmp_path)))  # (its workdir)
  out = subprocess.run([sys.executable, "-m", "jaxvla.plan", "--validate", "--quick"],
                       cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout
  report = json.loads(out.strip().splitlines()[-1])
  assert [r["mode"] for r in report["rows"]] == ["sync_colocated", "+streamer"]
  for row in report["rows"]:
    assert row["measured_env_steps_per_s"] > 0 and row["predicted_env_steps_per_s"] > 0
    assert abs(row["relative_error"]) < 0.5, row
    assert abs(row["staleness_error"]) < 1.0, row
  assert report["largest_relative_error"] == max(abs(r["relative_error"])
                                                 for r in report["rows"])
