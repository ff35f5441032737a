"""``launch/gpu_check.sh`` / ``jaxvla.bench.gpu_check``: the GPU window's prepared check.

The dry run is the real script with the tiny pi0 on the CPU, every step, so the check a
rare GPU window depends on is known to run before the window opens.
"""

import json
import os
import subprocess
import sys

import pytest

from jaxvla.bench import gpu_check
from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.run_first(3)
@pytest.mark.slow  # Five processes, a minute: the slow step.
def test_dry_run_runs_every_step_and_writes_one_json(tmp_path):
  out = tmp_path / "out"
  r = subprocess.run(
      ["bash", os.path.join(ROOT, "launch", "gpu_check.sh"), "--dry_run", f"--out={out}",
       f"--profile_dir={tmp_path / 'profile'}", f"--cache_dir={tmp_path / 'cache'}"],
      capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
      env=conftest.fast_xla_env(dict(os.environ)))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  report = json.loads((out / "gpu_check.json").read_text())
  assert report["ok"] and report["dry_run"] and report["device"]
  assert list(report["steps"]) == list(gpu_check.STEPS)
  assert all(s["rc"] == 0 for s in report["steps"].values())
  s = report["summary"]
  assert 0 < s["efficiency"] and set(s["env_steps_per_s"]) == set(gpu_check.MODES)
  assert set(s["act_median_ms"]) == {str(b) for b in gpu_check.ACT_BATCHES}
  assert s["ppo_minibatch"]["batch"] == gpu_check.PPO_BATCH
  assert s["ppo_minibatch"]["median_ms"] > 0
  assert set(s["ppo_memory_gib"]) == {f"4x{nm}" for nm in gpu_check.MEMORY_MINIBATCHES}
  assert all(gib > 0 for gib in s["ppo_memory_gib"].values())
  assert s["streamed_live_gib"] > 0
  # The async row carries its profile summary; the text summaries sit beside the JSON.
  rows = {row["mode"]: row for row in report["steps"]["pipeline"]["result"]["rows"]}
  assert rows["+streamer"]["profile"]
  for mode in gpu_check.MODES:
    assert "trace span" in (out / f"trace_{mode.lstrip('+')}.txt").read_text()
  assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] is True


def test_a_failing_or_slow_step_is_recorded_and_the_rest_still_run(tmp_path):
  py = sys.executable
  ok = gpu_check.run_step("ok", [[py, "-c", "print('x'); print('{\"a\": 1}')"]], 30,
                          str(tmp_path), dict(os.environ))
  assert ok["rc"] == 0 and ok["result"] == {"a": 1}
  bad = gpu_check.run_step("bad", [[py, "-c", "import sys; sys.exit(3)"],
                                   [py, "-c", "print(1)"]], 30, str(tmp_path), dict(os.environ))
  assert bad["rc"] == 3 and bad["result"] == [None]  # the second command never ran
  slow = gpu_check.run_step("slow", [[py, "-c", "import time; time.sleep(30)"]], 1,
                            str(tmp_path), dict(os.environ))
  assert slow["rc"] == 124 and "over its 1 s" in (tmp_path / "slow.log").read_text()


def test_unknown_step_is_named(tmp_path):
  with pytest.raises(ValueError, match="'mfu'"):
    gpu_check.check(str(tmp_path), dry_run=True, steps=["pipeline", "mfu"],
                    profile_dir=str(tmp_path), cache_dir=str(tmp_path))


def test_pipeline_flags_end_the_pipeline_command():
  """``--pipeline_flag``s come after the step's own flags (absl keeps a flag's last value),
  and no other step's command takes them."""
  extra = ("--config.model.lora=both", "--modes=+streamer")
  commands = gpu_check.step_commands(False, "/tmp/p", extra)
  pipeline = commands["pipeline"][0]
  assert tuple(pipeline[-2:]) == extra and "--modes=sync_colocated,+streamer" in pipeline
  assert all(a not in extra for name, cmds in commands.items() if name != "pipeline"
             for cmd in cmds for a in cmd)


def test_the_device_is_named_by_a_step_of_several_commands():
  # A window runs memory (three commands: a list of results), pipeline and trace only,
  # so the report's device must come from the memory step's list (2026-12-04: it was null).
  memory = [None, {"rows": [{"device": "NVIDIA H200"}]}, {"device": "other"}]
  assert gpu_check._device_of(memory) == "NVIDIA H200"
  assert gpu_check._device_of([None, {"rows": []}]) is None
  assert gpu_check._device_of({"device": "NVIDIA H100"}) == "NVIDIA H100"
