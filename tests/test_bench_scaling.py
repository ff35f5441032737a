"""``python -m jaxvla.bench.scaling`` at a tiny size: both process counts run, and the output
has its table and its JSON line. Figures are not checked (the machine's load decides them).
With ``--profile`` (the pipeline benchmark's flag), every process traces one update after
its timed window into its own folder, and process 0's rows carry the trace's summary.

Run as a subprocess, as a user runs it: the benchmark starts its own processes (one,
then two joined by ``jax.distributed``), and its flags are the pipeline benchmark's.
No ``--config`` is given, so the default one (``configs/scaling.py``) is loaded and
overridden down to two in-process envs and one untimed plus one timed update.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TINY = ("--updates=1", "--warmup=1", "--modes=sync_colocated", "--config.num_envs=2",
         "--config.env_workers=0", "--config.rollout_len=2", "--config.rl.num_minibatches=1",
         "--config.env.latency_ms=0", "--config.pipeline.micro_batch_segments=2",
         "--config.pipeline.b_max=2", "--process_timeout_s=500")


@pytest.mark.multihost  # Two processes joined by jax.distributed: the multi-host step.
def test_scaling_bench_runs_one_and_two_processes(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxvla.bench.scaling", *_TINY,
                      f"--profile={tmp_path}", "--profile_updates=1"], cwd=ROOT,
                     capture_output=True, text=True, timeout=1100)
  assert r.returncode == 0, r.stderr[-4000:]
  lines = r.stdout.strip().splitlines()
  out = json.loads(lines[-1])
  assert out["processes"] == [1, 2] and out["modes"] == ["sync_colocated"]
  one, two = out["rows"]
  assert (one["processes"], two["processes"]) == (1, 2)  # both counts really ran
  for row in (one, two):
    assert row["mode"] == "sync_colocated" and row["pipeline"] == "sync_colocated"
    assert row["env_steps_per_s"] > 0 and row["seconds"] > 0 and row["updates"] >= 1
    assert row["num_envs_per_process"] == 2 and row["env_workers_per_process"] == 0
  # An update trains every process's envs: 2 envs x 2 chunks of up to 5 steps each.
  # (Rounded: rate x seconds gives back the count only to float precision, 40.00000000000001.)
  per_update = [round(row["env_steps_per_s"] * row["seconds"] / row["updates"], 6)
                for row in (one, two)]
  assert 10 < per_update[0] <= 20 < per_update[1] <= 40, per_update
  assert one["scaling_efficiency"] == one["speedup"] == 1.0
  assert two["speedup"] == pytest.approx(two["env_steps_per_s"] / one["env_steps_per_s"])
  assert two["scaling_efficiency"] == pytest.approx(two["speedup"] / 2)
  assert two["env_steps_per_s_per_process"] == pytest.approx(two["env_steps_per_s"] / 2)
  assert out["speedup"] == two["speedup"]
  assert out["scaling_efficiency"] == two["scaling_efficiency"]
  # The header (the default config, latency overridden) and one table row per count.
  assert any(line.startswith("# builtin env latency 0 ms") for line in lines)
  table = [line.split() for line in lines if line.startswith("sync_colocated")]
  assert [row[1] for row in table] == ["1", "2"]
  # Profiles: one folder per process of the two-process run, the summary in the rows.
  assert one["profile_dir"] == os.path.join(str(tmp_path), "sync_colocated")
  assert two["profile_dir"] == os.path.join(str(tmp_path), "sync_colocated", "process_0")
  assert glob.glob(os.path.join(str(tmp_path), "sync_colocated", "process_1", "**",
                                "*.trace.json.gz"), recursive=True)
  for row in (one, two):
    profile = row["profile"]
    for stage in ("learner", "inference", "env"):
      assert profile["host_stages"][stage]["count"] >= 1, (stage, profile["host_stages"])
    assert "compile" not in profile["transfers"], profile["transfers"]  # warm by then
    device, = profile["devices"].values()  # this process's one CPU device
    assert {"jit_act", "jit__update"} <= set(device["modules"]), device["modules"]
    assert 0 < device["busy_fraction"] <= 1
  assert two["env_steps_per_s_per_device"] == pytest.approx(two["env_steps_per_s"] / 2)
