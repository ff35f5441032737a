"""Replaying asynchronous runs from their schedule logs (jaxvla.runtime.schedule).

The slow test makes the case the issue names: a fully asynchronous ColorReach run
(first-ready batching over four env workers, the streamed learner) in which an env
worker is SIGKILLed mid-run and which is then interrupted (Ctrl-C) and resumed, so its
history has a fault and two sessions. Its replay, in another workdir, follows both
sessions' logs and must end with the same params, optimizer state, learner metrics
and evaluations, bit for bit; ``replay_diff`` finds them equal, and a difference
planted in a copy of the log at the right update. A replay fed a tampered log stops
at the first update that the tampering changed, naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxvla import defaults, metrics, replay_diff
from jaxvla.runtime import replay as replay_lib
from jaxvla.runtime import schedule as schedule_lib
from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The smoke run, fully asynchronous: 8 envs in 4 workers with a long-tailed step
# latency (so first-ready batches vary), the streamed learner, staleness 2.
_FLAGS = {
    "env_workers": 4, "env.latency_ms": 2.0, "env.latency_sigma": 1.0,
    "pipeline.mode": "async", "pipeline.streamer": True,
    "pipeline.micro_batch_segments": 2, "pipeline.max_staleness": 2,
    "rl.num_epochs": 1, "rl.num_minibatches": 2, "rl.advantage_norm": "none",
    "total_env_steps": 4000, "checkpoint.every_iters": 4, "eval.every_iters": 6,
}


def _command(workdir: str, **extra) -> list[str]:
  flags = dict(_FLAGS, **extra)
  return [sys.executable, "-m", "jaxvla.main", "--config=configs/default.py:smoke",
          f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in flags.items())]


def _env() -> dict:
  return conftest.fast_xla_env(dict(os.environ, JAX_PLATFORMS="cpu"))


def _run(workdir: str, log_path: str, *, kill_worker_at: int | None = None,
         interrupt_at: int | None = None, **extra) -> None:
  """Runs ``jaxvla.main``; SIGKILLs an env worker once it has made ``kill_worker_at``
  updates, and sends Ctrl-C once it has made ``interrupt_at``."""
  with open(log_path, "wb") as log_file:
    proc = subprocess.Popen(_command(workdir, **extra), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=log_file, env=_env())
    try:
      deadline = time.time() + 600
      while proc.poll() is None and time.time() < deadline:
        updates = len(metrics.records(workdir, "train"))  # (complete lines only)
        if kill_worker_at is not None and updates >= kill_worker_at:
          workers = conftest.pool_workers(proc.pid)
          if workers:
            workers[0].send_signal(signal.SIGKILL)
            kill_worker_at = None
        if interrupt_at is not None and updates >= interrupt_at:
          proc.send_signal(signal.SIGINT)
          interrupt_at = None
        time.sleep(0.05)
      proc.communicate(timeout=120)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait(30)
  with open(log_path, encoding="utf-8", errors="replace") as f:
    tail = f.read()[-3000:]
  assert proc.returncode == 0, tail


def _state(workdir: str, step: int) -> dict:
  """Checkpoint ``step``'s whole train state (params and optimizer), as NumPy arrays."""
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  with ocp.PyTreeCheckpointer() as ckptr:
    meta = ckptr.metadata(path).item_metadata.tree
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                            meta)
    state = ckptr.restore(path, args=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))
  return jax.tree.map(np.asarray, state)


def _learning_records(workdir: str) -> tuple[list[dict], list[dict]]:
  """Every update's learner metrics and env-step counts, and every evaluation (the
  timing and window metrics describe the machine, not the learning: left out)."""
  session = schedule_lib.Session(schedule_lib.session_path(workdir, 0))
  keys = [*session.updates[0].metrics, "env_steps", "dropped_env_steps"]
  train_rows = [{k: r[k] for k in keys} for r in metrics.records(workdir, "train")]
  evals = [{k: v for k, v in r.items() if k != "time"}
           for r in metrics.records(workdir, "eval")]
  return train_rows, evals


@pytest.mark.slow  # (five short runs: about two and a half minutes)
@pytest.mark.run_first(1)
def test_an_async_run_with_a_fault_and_a_resume_replays_bit_for_bit(tmp_path):
  run, replay = str(tmp_path / "run"), str(tmp_path / "replay")
  # The recorded run: a worker killed at update 3, Ctrl-C at update 9, then resumed.
  _run(run, str(tmp_path / "run1.txt"), kill_worker_at=3, interrupt_at=9)
  _run(run, str(tmp_path / "run2.txt"), resume=True)
  sessions = schedule_lib.sessions(run)
  assert len(sessions) == 2 and sessions[0] == 0, sessions
  first = schedule_lib.Session(schedule_lib.session_path(run, 0))
  assert [r.why for r in first.restart_records] == ["died"], first.restart_records
  assert first.end == "interrupted"
  batches = {len(s.recv) for s in first.steps if s.recv is not None}
  assert len(batches) > 1, f"first-ready batches all of one size {batches}: not a test of it"

  # The replay: the first session, then (resumed) the second.
  _run(replay, str(tmp_path / "replay1.txt"), replay=run)
  _run(replay, str(tmp_path / "replay2.txt"), replay=run, resume=True)
  assert replay_diff.compare(run, replay) == dict(equal=True,
                                                  updates=len(metrics.records(run, "train")))
  assert _learning_records(replay) == _learning_records(run)
  last = max(int(n) for n in os.listdir(os.path.join(run, "checkpoints")) if n.isdigit())
  a, b = _state(run, last), _state(replay, last)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)

  # replay_diff names a difference planted in a copy of the log, at its update.
  planted = str(tmp_path / "planted")
  shutil.copytree(os.path.join(run, "schedule"), os.path.join(planted, "schedule"))
  path = schedule_lib.session_path(planted, 0)
  with open(path, encoding="utf-8") as f:
    lines = [json.loads(line) for line in f]
  update = [r for r in lines if r["k"] == "update"][5]
  update["metrics"]["grad_norm"] += 1e-6
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in lines)
  found = replay_diff.compare(run, planted)
  assert (found["equal"], found["update"], found["what"]) == (False, update["u"],
                                                            "metrics.grad_norm"), found
  assert subprocess.run([sys.executable, "-m", "jaxvla.replay_diff", run, planted],
                        cwd=ROOT, capture_output=True, check=False).returncode == 1

  # A tampered log: one rollout step acts with an older version than it did.
  tampered = str(tmp_path / "tampered")
  shutil.copytree(os.path.join(run, "schedule"), os.path.join(tampered, "schedule"))
  shutil.copy(os.path.join(run, "config.json"), tampered)
  path = schedule_lib.session_path(tampered, 0)
  with open(path, encoding="utf-8") as f:
    lines = [json.loads(line) for line in f]
  step = next(r for r in lines if r["k"] == "step" and r.get("v") == 1)
  step["v"] = 0
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in lines)
  proc = subprocess.run(_command(str(tmp_path / "replay_tampered"), replay=tampered),
                        cwd=ROOT, env=_env(), capture_output=True, text=True, check=False,
                        timeout=300)
  assert proc.returncode != 0
  # Its chunks now carry version 0: an item made of them is dropped as too stale where
  # the recorded run trained on it, or (consumed sooner) its update's numbers differ.
  assert re.search(r"ReplayMismatch: update \d+.*(: dropped items \[[\d, ]+\] as too stale,"
                   r" the recorded update dropped|replayed, .* recorded)",
                   proc.stderr), proc.stderr[-3000:]


def _config(**changes):
  c = defaults.get_config()
  for key, value in changes.items():
    section, _, name = key.rpartition(".")
    (c[section] if section else c)[name] = value
  return c


def test_a_replay_refuses_a_changed_config_its_own_workdir_and_several_processes(
    tmp_path, monkeypatch):
  run = tmp_path / "run"
  (run / "schedule").mkdir(parents=True)
  (run / "config.json").write_text(defaults.get_config().to_json_best_effort())
  schedule_lib.Recorder(schedule_lib.session_path(str(run), 0), iteration=0).close()
  with pytest.raises(ValueError, match=r"differs: config.rl.learning_rate: 0.0001 -> 0.001"):
    replay_lib.check_request(_config(replay=str(run), **{"rl.learning_rate": 1e-3}),
                        str(tmp_path / "b"))
  with pytest.raises(ValueError, match="is the --workdir"):
    replay_lib.check_request(_config(replay=str(run)), str(run))
  assert replay_lib.check_request(_config(replay=str(run), **{"log.progress": False}),
                             str(tmp_path / "b")) == 0
  with pytest.raises(FileNotFoundError, match="config.json is missing"):
    replay_lib.check_request(_config(replay=str(tmp_path)), str(tmp_path / "b"))
  unlogged = tmp_path / "unlogged"
  unlogged.mkdir()
  (unlogged / "config.json").write_text(defaults.get_config().to_json_best_effort())
  with pytest.raises(FileNotFoundError, match="holds no schedule log"):
    replay_lib.check_request(_config(replay=str(unlogged)), str(tmp_path / "b"))
  multi = tmp_path / "multi"
  shutil.copytree(unlogged, multi)
  schedule_lib.Recorder(schedule_lib.session_path(str(multi), 0, 1, 2), iteration=0).close()
  with pytest.raises(ValueError, match="multi-process run's .* cannot be replayed"):
    replay_lib.check_request(_config(replay=str(multi)), str(tmp_path / "b"))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match="multi-process run cannot be replayed"):
    replay_lib.check_request(_config(replay=str(run)), str(tmp_path / "b"))


def test_the_log_reader_names_a_bad_line_and_drops_a_torn_last_one(tmp_path):
  path = str(tmp_path / "schedule" / "session-0.jsonl")
  recorder = schedule_lib.Recorder(path, iteration=0, version=0)
  recorder.step(0, version=0)
  recorder.step(1, recv=[1, 0], act=[1], version=0, values=[0])
  recorder.write("update", u=0, items=[0], dropped=[], metrics={"loss": 0.5})
  recorder.close()
  with open(path, "a", encoding="utf-8") as f:
    f.write('{"k":"step","n":2,"re')  # A run killed mid-line.
  session = schedule_lib.Session(path)
  assert [s.n for s in session.steps] == [0, 1] and session.end is None
  assert session.steps[1] == schedule_lib.StepRecord(n=1, recv=(1, 0), act=(1,), version=0,
                                                     values=(0,))
  assert session.steps[1].to_json() == dict(n=1, recv=[1, 0], act=[1], v=0, values=[0])
  with open(path, "a", encoding="utf-8") as f:
    f.write('\n{"k":"step","n":7}\n')  # The torn line is now a whole line, and bad.
  with pytest.raises(ValueError, match=r"line 5: not a JSON record"):
    schedule_lib.Session(path)
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines[:4] + lines[5:]))
  with pytest.raises(ValueError, match=r"line 5: step 7 where step 2 was due"):
    schedule_lib.Session(path)
  replayed = lambda items, loss: schedule_lib.UpdateRecord(u=0, items=items,
                                                           metrics={"loss": loss})
  with pytest.raises(replay_lib.ReplayMismatch, match=r"update 0 .*loss = 0.25 replayed, "
                                                      r"0.5 recorded"):
    replay_lib.check_update(session.updates[0], replayed((0,), 0.25), path)
  with pytest.raises(replay_lib.ReplayMismatch, match=r"items \[1\] replayed, \[0\]"):
    replay_lib.check_update(session.updates[0], replayed((1,), 0.5), path)
