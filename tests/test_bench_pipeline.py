"""``python -m jaxvla.bench.pipeline`` at a tiny size, with ``--profile``: the standalone
stages and the full-async mode run, the table and JSON line are printed, and the mode's
profile (traced after its timed window) is summarised. Figures are not checked (the
machine's load decides them); what the rows and the profile must hold is. The sync modes
run through the same ``run_mode`` in the scaling benchmark's test (multi-host step).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TINY = ("--modes=+streamer", "--updates=1", "--warmup=1", "--profile_updates=1",
         "--stage_seconds=0.5", "--config.num_envs=2", "--config.env_workers=1",
         "--config.rollout_len=2", "--config.ppo.num_minibatches=1",
         "--config.pipeline.micro_batch_segments=2", "--config.pipeline.b_max=2",
         "--config.env.latency_ms=0")


def test_pipeline_bench_with_profile(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxvla.bench.pipeline", *_TINY,
                      f"--profile={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert set(out["stage_rates"]) == {"env", "inference", "learner"}
  assert out["slowest_stage"] in out["stage_rates"] and out["efficiency"] > 0
  row, = out["rows"]
  assert row["mode"] == "+streamer" and row["pipeline"] == "async[L1+L2+L3]"
  assert row["updates"] == 1 and row["env_steps_per_s"] > 0
  assert row["env_steps_per_s_per_device"] == row["env_steps_per_s"]  # one CPU device
  assert row["profile_dir"] == os.path.join(str(tmp_path), "streamer")
  assert glob.glob(os.path.join(row["profile_dir"], "**", "*.trace.json.gz"), recursive=True)
  profile = row["profile"]
  # The traced update's stages and programs, on the CPU backend's device.
  for stage in ("learner", "inference", "broadcast_dispatch", "rollout_recv_wait_s"):
    assert profile["host_stages"][stage]["count"] >= 1, (stage, profile["host_stages"])
  assert "compile" not in profile["transfers"], profile["transfers"]  # warm by then
  modules = profile["devices"]["/host:CPU device 0"]["modules"]
  assert {"jit_act", "jit_micro_grads", "jit__apply"} <= set(modules), modules
  assert r.stdout.count("# profile of +streamer") == 1 and "idle while host in" in r.stdout
