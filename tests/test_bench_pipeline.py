"""``python -m jaxvla.bench.pipeline`` at a tiny size, with ``--profile``: a sync and the
full-async mode run, the table and JSON line are printed, and each mode's profile (traced
after its timed window) is summarised. Figures are not checked (the machine's load decides
them); what the rows and the profile must hold is.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TINY = ("--modes=sync_colocated,+streamer", "--updates=1", "--warmup=1", "--profile_updates=1",
         "--stage_seconds=0.5", "--config.num_envs=2", "--config.env_workers=1",
         "--config.rollout_len=2", "--config.ppo.num_minibatches=1",
         "--config.pipeline.micro_batch_segments=2", "--config.pipeline.b_max=2",
         "--config.env.latency_ms=0")


@pytest.mark.slow  # Two modes and the standalone stages: about 40 s of compiling on 2 cores.
def test_pipeline_bench_with_profile(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxvla.bench.pipeline", *_TINY,
                      f"--profile={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert [row["mode"] for row in out["rows"]] == ["sync_colocated", "+streamer"]
  assert set(out["stage_rates"]) == {"env", "inference", "learner"}
  for row, folder in zip(out["rows"], ("sync_colocated", "streamer")):
    assert row["updates"] == 1 and row["env_steps_per_s"] > 0
    assert row["profile_dir"] == os.path.join(str(tmp_path), folder)
    assert glob.glob(os.path.join(row["profile_dir"], "**", "*.trace.json.gz"), recursive=True)
    profile = row["profile"]
    # The traced update's stages and programs, on the CPU backend's device.
    assert profile["host_stages"]["learner"]["count"] >= 1
    assert profile["host_stages"]["inference"]["count"] >= 1
    assert "compile" not in profile["transfers"], profile["transfers"]  # warm by then
    modules = profile["devices"]["/host:CPU device 0"]["modules"]
    assert "jit_act" in modules
  assert "jit__update" in out["rows"][0]["profile"]["devices"]["/host:CPU device 0"]["modules"]
  streamed = out["rows"][1]["profile"]
  assert {"jit_micro_grads", "jit__apply"} <= set(streamed["devices"]["/host:CPU device 0"]
                                                  ["modules"])
  assert "broadcast_dispatch" in streamed["host_stages"]  # the async mode's weight copies
  assert r.stdout.count("# profile of ") == 2 and "idle while host in" in r.stdout
