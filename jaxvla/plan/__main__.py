"""``python -m jaxvla.plan``: plan a run before paying for it (docs/results/scaling.md).

  # measure a config's stage costs on this machine (run it alone)
  python -m jaxvla.plan --config=configs/default.py:bench --measure=/tmp/costs.json
  # predict the config's run from them (its mode, envs, workers, staleness, processes)
  python -m jaxvla.plan --config=configs/default.py:bench --costs=/tmp/costs.json
  # the simulator against measured runs on this machine (JSON: the largest error), each
  # row measured 3 times and the medians compared (--repeats=N; --rows=LIBERO: one row)
  python -m jaxvla.plan --validate
  # the placement for N accelerators, from the measured H100 figures
  python -m jaxvla.plan --config=configs/libero_bench.py:pi0 --accelerators=64

``--config`` and its ``--config.KEY=VALUE`` overrides are the pipeline benchmark's
(``jaxvla.bench.pipeline``), and so are ``--updates`` and ``--warmup`` (simulated updates).
The last line of every command is JSON.
"""

from __future__ import annotations

import json

from absl import app, flags

from jaxvla import config_files
# The benchmark's flags (--config, --updates, --warmup) are this command's too.
from jaxvla.bench import pipeline as bench_pipeline  # noqa: F401  pylint: disable=unused-import
from jaxvla.plan import costs as costs_lib
from jaxvla.plan import placement, profile, simulator, validate

FLAGS = flags.FLAGS
_MEASURE = flags.DEFINE_string("measure", "", "Measure the config's stage costs into this JSON.")
_COSTS = flags.DEFINE_string("costs", "", "Stage costs (a --measure file) to simulate with.")
_PROCESSES = flags.DEFINE_integer("processes", 1, "Processes of the simulated run.")
_VALIDATE = flags.DEFINE_bool("validate", False, "Measure and simulate the validation rows.")
_QUICK = flags.DEFINE_bool("quick", False, "--validate: one small row (the test suite's).")
_ACCELERATORS = flags.DEFINE_list(
    "accelerators", [], "Plan a placement for each of these accelerator counts (H100s, 8 per "
    "machine), e.g. 64 or 8,16,32,64,256.")
_NETWORK_GBS = flags.DEFINE_float(
    "network_gbs", placement.NETWORK_BYTES_PER_S / 1e9,
    "--accelerators: network GB/s per accelerator between machines (the gradient reduction).")
_PLOT = flags.DEFINE_string("plot", "", "--accelerators: draw the plans beside RL-VLA3's here.")
_MEASURE_SECONDS = flags.DEFINE_float("measure_seconds", 3.0, "Seconds per measurement.")
_ROWS = flags.DEFINE_list(
    "rows", [], "--validate: only the rows whose name contains one of these (e.g. LIBERO).")
_REPEATS = flags.DEFINE_integer(
    "repeats", None, "--validate: measure and simulate each row this many times and compare "
    "the medians (default 3; 1 with --quick).")


def main(argv):
  del argv
  config = FLAGS.config
  if _VALIDATE.value:
    print(validate.header(), flush=True)
    repeats = _REPEATS.value
    if repeats is None:
      repeats = 1 if _QUICK.value else validate.REPEATS
    try:
      rows = validate.select(validate.QUICK_ROWS if _QUICK.value else validate.ROWS,
                             _ROWS.value)
      report = validate.validate(rows, repeats=repeats)
    except ValueError as e:  # (--rows and --repeats are checked before anything is measured)
      raise app.UsageError(str(e)) from e
    print(json.dumps(report))
    return
  if _MEASURE.value:
    costs = profile.measure(config, _MEASURE_SECONDS.value)
    costs.save(_MEASURE.value)
    print(json.dumps(costs.to_json()))
    return
  if _ACCELERATORS.value:
    costs = costs_lib.Costs.load(_COSTS.value) if _COSTS.value else None
    plans = []
    for count in _ACCELERATORS.value:
      try:
        count = int(count)
      except ValueError:
        raise app.UsageError(f"--accelerators: {count!r} is not a whole number") from None
      plans.append(placement.plan(config, count, costs,
                                  network_bytes_per_s=_NETWORK_GBS.value * 1e9))
      print(placement.format_plan(plans[-1]), flush=True)
    if _PLOT.value:
      placement.plot(plans, _PLOT.value)
    print(json.dumps(plans[0] if len(plans) == 1 else plans))
    return
  if not _COSTS.value:
    raise app.UsageError("give --costs=FILE (from --measure), or --measure, --validate or "
                         "--accelerators")
  costs = costs_lib.Costs.load(_COSTS.value)
  setup = simulator.Setup.from_config(config, processes=_PROCESSES.value)
  result = simulator.simulate(setup, costs, updates=FLAGS.updates, warmup=FLAGS.warmup)
  print(json.dumps(dict(setup=setup.level_name(), **result.to_json())))


if __name__ == "__main__":
  app.run(main, flags_parser=config_files.parse_flags)
