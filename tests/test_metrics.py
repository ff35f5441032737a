"""``jaxvla.metrics``: what a run's processes load to write metrics, and what they write."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_writer_loads_without_torch_and_torch_still_loads_after(tmp_path):
  # In a fresh process: the test process may have imported torch already.
  script = f"""
import os, sys
import jaxvla.train
from jaxvla import metrics
assert "torch" not in sys.modules, "importing jaxvla.train loaded torch"
writer = metrics.MetricWriter({str(tmp_path)!r})
writer.write(7, "train", {{"loss": 0.5}})
writer.close()
import torch  # A simulator in the same process still gets it.
torch.zeros(1)
events = os.listdir(os.path.join({str(tmp_path)!r}, "tb"))
assert any(e.startswith("events.out.tfevents") for e in events), events
"""
  done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                        text=True, check=False, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    record = json.loads(f.readline())
  assert (record["phase"], record["env_steps"], record["loss"]) == ("train", 7, 0.5), record
