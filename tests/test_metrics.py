"""``jaxvla.metrics``: what a run's processes load to write metrics, and what they write."""

import json
import logging
import os
import subprocess
import sys

import pytest

from jaxvla import metrics, progress
from jaxvla.storage import jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_writer_loads_without_torch_and_torch_still_loads_after(tmp_path):
  # In a fresh process: the test process may have imported torch already.
  script = f"""
import os, sys
import jaxvla.train
from jaxvla import metrics, progress
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


def test_a_torn_last_line_is_left_out_while_written_and_cut_before_appending(tmp_path, caplog):
  """A reader polling a running job's ``metrics.jsonl`` can meet its last line half
  written, and a killed run leaves one; neither breaks a reader, a new writer or a
  resume, and a bad complete line is named."""
  path = tmp_path / metrics.FILE
  rows = [dict(phase="train", env_steps=s, time=0.0, loss=s / 10) for s in (10, 20, 30)]
  whole = "".join(json.dumps(r) + "\n" for r in rows)
  path.write_text(whole + json.dumps(rows[0])[:25], encoding="utf-8")
  assert metrics.records(str(tmp_path)) == rows
  assert metrics.records(str(tmp_path), "train")[-1]["env_steps"] == 30
  assert metrics.records(str(tmp_path / "none")) == []
  torn = json.dumps(rows[0])[:25]
  assert path.read_text(encoding="utf-8").endswith(torn)  # Reading cuts nothing.

  # A writer opening the killed run's file starts on a clean line (saying what it cut);
  # its resume moves the records past the checkpoint.
  with caplog.at_level(logging.WARNING, logger="jaxvla.metrics"):
    writer = metrics.MetricWriter(str(tmp_path))
  assert "cut its torn last line (25 bytes" in caplog.text
  writer.write(40, "train", {"loss": 4.0})
  assert [r["env_steps"] for r in metrics.records(str(tmp_path))] == [10, 20, 30, 40]
  assert writer.resume_from(20) == 2
  writer.write(25, "eval", {"success_rate": 0.5})
  writer.close()
  assert [(r["phase"], r["env_steps"]) for r in metrics.records(str(tmp_path))] == [
      ("train", 10), ("train", 20), ("eval", 25)]
  discarded = jsonl.read(str(tmp_path / "metrics.discarded.jsonl"))
  assert [r["env_steps"] for r in discarded] == [30, 40]

  path.write_text(whole.replace('"env_steps": 20', '"env_steps": 2?'), encoding="utf-8")
  with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2: not a JSON record"):
    metrics.records(str(tmp_path))
  path.write_text(whole + "[1, 2]\n", encoding="utf-8")
  with pytest.raises(ValueError, match=r"line 4: not a JSON record \(a list"):
    metrics.records(str(tmp_path))


def test_cut_torn_reads_back_past_its_block_to_the_last_newline(tmp_path):
  path = tmp_path / "log.jsonl"
  path.write_bytes(b'{"a": 1}\n' + b"x" * 50)
  assert jsonl.cut_torn(str(path), block=8) == 50
  assert path.read_bytes() == b'{"a": 1}\n'
  assert jsonl.cut_torn(str(path), block=8) == 0
  path.write_bytes(b"y" * 20)  # No newline at all: nothing is a record.
  assert jsonl.cut_torn(str(path), block=8) == 20 and path.read_bytes() == b""


def test_phase_log_writes_a_line_at_its_pace_and_at_the_end(caplog):
  """metrics.PhaseLog: one line per ``every_s`` of (fake) time, and the last step's, each
  with the step, total, fields, rate and time left."""
  now = [0.0]
  phase = progress.PhaseLog("warm start (BC)", 100, 30.0, clock=lambda: now[0])
  written = []
  with caplog.at_level(logging.INFO, logger="jaxvla.progress"):
    for step in range(1, 101):
      now[0] = step * 1.0  # one step per second
      if phase.tick(step, loss=0.5):
        written.append(step)
  assert written == [30, 60, 90, 100]
  lines = [r.getMessage() for r in caplog.records]
  assert lines[0] == "warm start (BC): step 30/100 (30%), loss 0.5, 1 steps/s, ~70 s left"
  assert lines[-1].startswith("warm start (BC): step 100/100 (100%)")
  assert not progress.PhaseLog("x", 10, 0.0).tick(10)  # 0: no lines
