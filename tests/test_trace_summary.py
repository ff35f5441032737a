"""``jaxvla.bench.trace_summary``: where a profiler trace's time went.

A real CPU trace (``jax.profiler`` around a pipeline stage and a jitted program) checks
what this JAX writes and the summary reads back. The GPU layout (a ``/device:GPU:0``
process with stream lines, kernels tagged with their module, memcpy events and a derived
``XLA Modules`` line, as xprof's conversion writes them) is a constructed trace: no GPU
is on the test machine.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxvla import timing
from jaxvla.bench import trace_summary as ts


def test_interval_algebra():
  assert ts.merge([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
  assert ts.gaps([(1, 2), (3, 4)], 0, 5) == [(0, 1), (2, 3), (4, 5)]
  assert ts.gaps([(0, 5)], 1, 4) == []
  assert ts.intersect([(0, 2), (3, 6)], [(1, 4), (5, 7)]) == [(1, 2), (3, 4), (5, 6)]
  assert ts.length([(0, 1.5), (2, 3)]) == 2.5


def _x(name, ts_us, dur_us, pid=1, tid=1, **args):
  return dict(ph="X", name=name, ts=ts_us, dur=dur_us, pid=pid, tid=tid, args=args)


def _meta(pid, process, threads):
  out = [dict(ph="M", name="process_name", pid=pid, args=dict(name=process))]
  out += [dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=n))
          for tid, n in threads.items()]
  return out


def _gpu_trace():
  """10 ms: the learner stage on the host, a GPU busy 0-4 ms (update) and 6-7 ms (act)."""
  host, gpu = 1, 2
  return (_meta(host, "/host:CPU", {1: "learner", 2: "rollout"})
          + _meta(gpu, "/device:GPU:0", {10: "XLA Modules", 11: "Stream #7(Compute)",
                                          12: "Stream #9(MemcpyH2D)"})
          + [_x("jaxvla/learner", 0, 5000, host, 1),
             _x("jaxvla/inference", 5500, 2000, host, 2),
             _x("jaxvla/rollout_recv_wait_s", 8000, 2000, host, 2),
             _x("PjitFunction(update)", 10, 50, host, 1),
             _x("backend_compile_and_load", 9000, 500, host, 1),
             _x("update(42)", 0, 4000, gpu, 10),  # derived: not busy time by itself
             _x("fusion.1", 0, 1500, gpu, 11, hlo_module="jit_update", hlo_op="fusion.1"),
             _x("gemm.2", 1500, 2500, gpu, 11, hlo_module="jit_update", hlo_op="gemm.2"),
             _x("MemcpyH2D", 6000, 200, gpu, 12),
             _x("act(7)", 6200, 800, gpu, 10),
             _x("fusion.9", 6200, 800, gpu, 11, hlo_module="jit_act", hlo_op="fusion.9"),
             _x("host_end", 9990, 10, host, 1)])


def test_gpu_layout():
  s = ts.summarize(_gpu_trace(), min_gap_ms=0.5)
  assert s["window_s"] == pytest.approx(0.010)
  gpu = s["devices"]["/device:GPU:0"]
  assert gpu["busy_fraction"] == pytest.approx(0.5)  # 0-4 ms and 6-7 ms of 10
  assert gpu["modules"] == pytest.approx({"update": 0.004, "act": 0.0008})  # the derived line
  assert gpu["memcpy"] == pytest.approx({"H2D": 0.0002})
  assert gpu["idle_s"] == pytest.approx(0.005)
  # Idle 4-6 ms and 7-10 ms: the learner ran 4-5, inference 5.5-6 and 7-7.5, recv 8-10.
  assert gpu["idle_while"] == pytest.approx({
      "rollout_recv_wait_s": 0.002, "learner": 0.001, "inference": 0.001,
      "(no stage)": 0.001})
  assert [round(g["length_ms"], 3) for g in gpu["gaps"]] == [3.0, 2.0]
  assert gpu["gaps"][0]["host_stages"] == ["inference", "rollout_recv_wait_s"]
  assert s["host_stages"]["learner"]["busy_s"] == pytest.approx(0.005)
  assert s["programs"]["update"]["count"] == 1
  assert s["transfers"]["compile"]["busy_s"] == pytest.approx(0.0005)
  text = ts.format_summary(s)
  assert "/device:GPU:0: busy 0.50" in text and "memcpy H2D" in text


def test_modules_from_kernels_without_a_derived_line():
  events = [e for e in _gpu_trace() if e.get("tid") != 10 and not (
      e.get("ph") == "M" and e["args"].get("name") == "XLA Modules")]
  gpu = ts.summarize(events)["devices"]["/device:GPU:0"]
  assert gpu["modules"] == pytest.approx({"jit_update": 0.004, "jit_act": 0.0008})


def test_real_cpu_trace(tmp_path):
  """What this JAX writes: stage annotations, and ops tagged with module and device."""

  @jax.jit
  def traced_program(x):
    return jnp.tanh(x @ x.T).sum()

  x = jnp.ones((256, 256))
  traced_program(x).block_until_ready()  # compiled before the trace
  clock = timing.StageClock(("learner",))
  clock.start()
  jax.profiler.start_trace(str(tmp_path))
  try:
    with clock.busy("learner"):
      for _ in range(3):
        float(traced_program(x))
  finally:
    jax.profiler.stop_trace()
  s = ts.summarize(ts.load(str(tmp_path)))
  assert s["host_stages"]["learner"]["count"] == 1
  assert s["programs"]["traced_program"]["count"] >= 3
  assert "compile" not in s["transfers"]  # compiled before the trace
  cpu = s["devices"]["/host:CPU device 0"]
  assert cpu["modules"]["jit_traced_program"] > 0
  assert 0 < cpu["busy_fraction"] <= 1


def test_errors_and_cli(tmp_path):
  with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz under"):
    ts.load(str(tmp_path))
  with pytest.raises(ValueError, match="no complete"):
    ts.summarize([dict(ph="M", name="process_name", pid=1, args=dict(name="/host:CPU"))])
  path = tmp_path / "plugins" / "profile" / "run" / "h.trace.json.gz"
  os.makedirs(path.parent)
  with gzip.open(path, "wt") as f:
    json.dump(dict(traceEvents=_gpu_trace()), f)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "jaxvla.bench.trace_summary", str(tmp_path),
                      "--json"], capture_output=True, text=True, env=env, timeout=120)
  assert r.returncode == 0, r.stderr
  assert json.loads(r.stdout)["devices"]["/device:GPU:0"]["busy_fraction"] == pytest.approx(0.5)
  r = subprocess.run([sys.executable, "-m", "jaxvla.bench.trace_summary"], capture_output=True,
                     text=True, env=env, timeout=120)
  assert r.returncode == 2 and "usage:" in r.stderr
