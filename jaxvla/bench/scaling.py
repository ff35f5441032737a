"""Multi-process scaling on one machine: ``python -m jaxvla.bench.scaling``.

Runs the RL phase of one config (default ``configs/scaling.py``: latency-bound
ColorReach, the tiny pi0) as 1 and as 2 processes joined by ``jax.distributed``,
started here as local subprocesses the way a multi-host job starts one process
per host. It is weak scaling: every process owns its own env pool of
``num_envs`` envs in ``env_workers`` worker processes and one CPU device, the
learner is one SPMD program over every process's device, and each process feeds
its own rows of every update, so a process's work is the same at either count.

Each process count runs :func:`jaxvla.bench.pipeline.run_mode` (the pipeline
benchmark's timing: ``--warmup`` untimed updates, then ``--updates`` timed ones;
throughput is the smaller of the env steps trained and the usable env steps
produced per second of that window, every process's steps together). Flags
``--config``, ``--modes``, ``--updates``, ``--warmup`` and ``--staleness_control``
are that benchmark's (``--modes`` defaults to ``+rollout_async`` here: asynchronous
rollout with first-ready env batching, and ``--updates`` to 24; ``--profile`` traces
every process; ``--timeline``, with ``+streamer``, is drawn by
process 0 of the last count). ``--processes`` lists the counts (default ``1,2``).

Scaling efficiency of ``P`` processes = throughput(P) / (P / P0 x throughput(P0)),
``P0`` the first count: 1.0 is perfect weak scaling. The last line of output is
JSON: every row, and ``speedup`` and ``scaling_efficiency`` of the last count
against the first for the first mode.

The processes share this machine's cores: the figures say whether the pipeline
keeps up when more hosts add envs, not what separate hosts (with their own cores
and a network between them) would reach.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

DEFAULT_CONFIG = "configs/scaling.py"


def _argv(argv: list[str]) -> list[str]:
  """``argv`` with ``--config=`` :data:`DEFAULT_CONFIG` first unless it names a config.

  ``--config`` is the pipeline benchmark's flag, whose default is another config; a
  config flag reads ``sys.argv`` when it is defined (on import) to pick the file, so
  the command line is completed before that import.
  """
  if any(a == "--config" or a.startswith("--config=") for a in argv[1:]):
    return list(argv)
  return [argv[0], f"--config={DEFAULT_CONFIG}", *argv[1:]]


if __name__ == "__main__":
  sys.argv = _argv(sys.argv)

# pylint: disable=wrong-import-position
import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxvla.bench import pipeline as bench_pipeline  # noqa: E402
from jaxvla.envs import make_vec_env  # noqa: E402
from jaxvla.parallel import distributed, sharding as sharding_lib  # noqa: E402

FLAGS = flags.FLAGS
# The pipeline benchmark's flags (defined by that import), with this benchmark's defaults:
# 24 timed updates (about 2 minutes per count), since over 8 the slept long tail moved the
# two-process speedup between 1.77 and 2.05 (docs/guides/multihost.md).
FLAGS.set_default("modes", ["+rollout_async"])
FLAGS.set_default("updates", 24)

_PROCESSES = flags.DEFINE_list("processes", ["1", "2"], "Process counts to run, in order.")
_PROCESS_TIMEOUT_S = flags.DEFINE_float(
    "process_timeout_s", 900.0, "Seconds one process count may take (start-up included).")
_WORKER = flags.DEFINE_string(
    "worker", "", "Internal: 'P,I,PORT' runs process I of P (coordinator on localhost:PORT).")

_MODULE = "jaxvla.bench.scaling"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
  """This process's environment for a worker: one CPU device per process, no
  persistent compilation cache (on the CPU backend, processes that load one
  program from the cache while another compiles it ran their collectives in
  different orders: docs/guides/multihost.md)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return env


def _run_count(num_processes: int, argv: list[str]) -> list[dict]:
  """Runs the benchmark as ``num_processes`` processes; returns process 0's rows."""
  port = _free_port()
  with tempfile.TemporaryDirectory(prefix="jaxvla-scaling-") as logs:
    procs, files = [], []
    for i in range(num_processes):
      extra = [f"--worker={num_processes},{i},{port}"]
      if i:  # One timeline (process 0's), not every process writing the same file.
        extra.append("--timeline=")
      out, err = (open(os.path.join(logs, f"{i}.{k}"), "w+", encoding="utf-8")
                  for k in ("out", "err"))
      files.append((out, err))
      procs.append(subprocess.Popen([sys.executable, "-m", _MODULE, *argv, *extra],
                                    env=_worker_env(), stdout=out, stderr=err, text=True))
    deadline = time.monotonic() + _PROCESS_TIMEOUT_S.value
    failed = None
    try:
      # A failed process leaves the others waiting in a collective: stop at the first.
      while failed is None and any(p.poll() is None for p in procs):
        failed = next((i for i, p in enumerate(procs) if p.poll()), None)
        if time.monotonic() > deadline:
          raise RuntimeError(f"{num_processes} processes: not done within "
                             f"--process_timeout_s={_PROCESS_TIMEOUT_S.value:g}")
        time.sleep(0.2)
      failed = next((i for i, p in enumerate(procs) if p.poll()), failed)
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    texts = []
    for out, err in files:
      out.seek(0)
      err.seek(0)
      texts.append((out.read(), err.read()))
      out.close()
      err.close()
  if failed is not None:
    raise RuntimeError(f"process {failed} of {num_processes} failed (exit "
                       f"{procs[failed].returncode}):\n{texts[failed][1][-4000:]}")
  return json.loads(texts[0][0].strip().splitlines()[-1])["rows"]


def _worker(spec: str) -> None:
  """One process of a run: joins the others, then times every mode (process 0 prints)."""
  num_processes, process_id, port = (int(x) for x in spec.split(","))
  base = FLAGS.config
  if num_processes > 1:
    d = base.distributed
    d.coordinator_address = f"localhost:{port}"
    d.num_processes, d.process_id = num_processes, process_id
    d.initialization_timeout_s = 120
    distributed.initialize(d)
  probe = make_vec_env(base.env, 1, 0, num_workers=0, step_timeout_s=60)
  spec_ = probe.spec
  probe.close()
  # The learner mesh over every process's devices, this process's rollout devices (as
  # jaxvla.train builds them).
  learner_devices, _ = sharding_lib.role_devices(base.mesh.rollout_devices)
  mesh = sharding_lib.make_mesh(base.mesh, learner_devices)
  parts = bench_pipeline.Parts(base, spec_, mesh)
  rows = []
  for name in FLAGS.modes:
    row = bench_pipeline.run_mode(base, name, parts)
    rows.append(dict(row, processes=jax.process_count(), num_envs_per_process=base.num_envs,
                     env_workers_per_process=base.env_workers))
  if distributed.is_primary():
    sys.stdout.write(json.dumps(dict(rows=rows)) + "\n")
    sys.stdout.flush()


def main(argv):
  if _WORKER.value:
    _worker(_WORKER.value)
    return
  del argv
  base = FLAGS.config
  counts = [int(p) for p in _PROCESSES.value]
  if not counts or min(counts) < 1:
    raise app.UsageError(f"--processes must list counts >= 1, got {_PROCESSES.value}")
  modes = FLAGS.modes
  for name in modes:
    bench_pipeline.mode_config(base, name)  # An unknown mode or a bad config fails here.
  bench_pipeline.print_header(base, "on one CPU device per process", "per process: ",
                              FLAGS.updates, FLAGS.warmup)
  # Everything after the program name is passed on to the workers (config overrides too).
  passed = sys.argv[1:]
  by_count = {}
  for n in counts:
    t0 = time.perf_counter()
    by_count[n] = _run_count(n, passed)
    print(f"# {n} process(es): {time.perf_counter() - t0:.0f} s with start-up", flush=True)
  print(f"{'mode':<18}{'processes':>10}{'env steps/s':>13}{'per process':>13}{'speedup':>9}"
        f"{'efficiency':>11}{'learner':>9}{'infer':>7}{'workers':>9}{'stale':>7}")
  rows = []
  for m, name in enumerate(modes):
    first = by_count[counts[0]][m]
    for n in counts:
      row = by_count[n][m]
      row["env_steps_per_s_per_process"] = row["env_steps_per_s"] / n
      row["speedup"] = row["env_steps_per_s"] / first["env_steps_per_s"]
      row["scaling_efficiency"] = row["speedup"] / (n / counts[0])
      rows.append(row)
      workers = row["env_workers_busy"]
      print(f"{name:<18}{n:>10d}{row['env_steps_per_s']:>13.1f}"
            f"{row['env_steps_per_s_per_process']:>13.1f}{row['speedup']:>9.2f}"
            f"{row['scaling_efficiency']:>11.2f}{row['learner_busy']:>9.2f}"
            f"{row['inference_busy']:>7.2f}"
            + (f"{'-':>9}" if workers is None else f"{workers:>9.2f}")
            + f"{row['staleness_mean']:>7.2f}", flush=True)
  last = rows[len(counts) - 1]  # The first mode's last count.
  print(json.dumps(dict(
      processes=counts, modes=modes, rows=rows, speedup=last["speedup"],
      scaling_efficiency=last["scaling_efficiency"])))


if __name__ == "__main__":
  app.run(main)
