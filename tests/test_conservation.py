"""Every env step accounted for: an async run (all three levels, an env pool) with env
workers killed at random, one worker hung, and the main process killed and resumed;
and ``max_staleness`` held over random schedules of rollout, broadcast and learner."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import psutil
import pytest

from jaxvla import metrics, types
from jaxvla.envs import builtin
from jaxvla.learner import learner as learner_lib
from jaxvla.models import policy as policy_lib
from jaxvla.rollout import pacer as pacer_lib
from jaxvla.runtime import ledger as ledger_lib, queue as queue_lib
from jaxvla.storage import checkpoint as checkpoint_lib, jsonl
from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FLAGS = {  # Every async level, an env pool, a checkpoint after every update.
    "pipeline.mode": "async", "pipeline.train_async": True, "pipeline.rollout_async": True,
    "pipeline.streamer": True, "pipeline.micro_batch_segments": 2, "pipeline.max_staleness": 1,
    "rl.num_epochs": 1, "rl.advantage_norm": "none", "env_workers": 2,
    # A hang is found within 10 s (the timeout caps 10x the slowest chunk so far).
    "env_step_timeout_s": 10.0, "env_hang_floor_s": 4.0,
    "checkpoint.every_iters": 1, "checkpoint.max_to_keep": 3, "eval.every_iters": 1000,
}


class _Chaos:
  """Once ``ready()`` (the run is training: a worker that dies while the pool starts
  fails the run, by design), faults the env workers of run ``pid`` and counts what it
  did. The first fault kills one worker and hangs (SIGSTOP) another at the same moment:
  the pool restarts the dead one while the hung one's timeout runs. Later faults each
  kill one random worker.

  A worker that fails again right after its restart fails the run (the pool does not
  restart in a loop), so each fault waits until the run has made ``UPDATES_BETWEEN``
  more updates (``updates()``, its train records) since the last one, and picks only
  workers that were there at the last fault (at ``ready()``, for the first): a
  replacement started by that fault may still be starting. The pool restarts a worker
  synchronously, before it steps again, so two faults later (four updates, more than
  the queue can feed while the rollout waits for a restart) a replacement is running.
  (Waiting for a worker's age instead was flaky on a loaded machine, where a start took
  longer than the age waited, and idled the test.)"""

  UPDATES_BETWEEN = 2

  def __init__(self, pid: int, seed: int, ready, updates):
    self.pid, self.rng, self.ready, self.updates = pid, random.Random(seed), ready, updates
    self.kills = self.hangs = 0
    self._next_at = 0  # Updates the run must have made before the next fault.
    self._eligible = None  # Pids of the workers a fault may hit: those seen at the last.
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.wait(self.rng.uniform(0.5, 1.5)):
      if not self.ready() or self.updates() < self._next_at:
        continue
      if self._eligible is None:  # The pool's first workers have started.
        self._eligible = {w.pid for w in conftest.pool_workers(self.pid)}
      # (pids, not create_time(): that is only as exact as the boot time, to a second)
      workers = [w for w in conftest.pool_workers(self.pid)
                 if w.status() != psutil.STATUS_STOPPED and w.pid in self._eligible]
      if len(workers) < (1 if self.hangs else 2):
        continue
      self._next_at = self.updates() + self.UPDATES_BETWEEN
      self._eligible = {w.pid for w in conftest.pool_workers(self.pid)}
      victim, *others = self.rng.sample(workers, len(workers))
      if not self.hangs and _signal(others[0], signal.SIGSTOP):
        self.hangs += 1  # Hung: the pool must notice and replace it.
      if _signal(victim, signal.SIGKILL):
        self.kills += 1

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(10)


def _signal(process: psutil.Process, sig: int) -> bool:
  """Sends ``sig``; False if the process is already gone."""
  try:
    process.send_signal(sig)
    return True
  except psutil.NoSuchProcess:
    return False


def _start(workdir: str, log_path, total_env_steps: int, resume: bool) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "jaxvla.main", "--config=configs/default.py:smoke",
         f"--workdir={workdir}", f"--config.total_env_steps={total_env_steps}",
         *(f"--config.{k}={v}" for k, v in _FLAGS.items())]
  if resume:
    cmd.append("--config.resume=True")
  env = conftest.fast_xla_env(dict(os.environ, JAX_PLATFORMS="cpu"))  # (short runs)
  # stderr to a file: a pipe nobody reads while waiting would block a chatty run.
  with open(log_path, "wb") as log_file:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file, env=env)


def _latest_step(ckpt_dir: str) -> int | None:
  """The newest committed step in a live run's checkpoint directory (a listing: a
  CheckpointManager there would race the run's own rotation of old steps)."""
  try:
    names = os.listdir(ckpt_dir)
  except FileNotFoundError:
    return None
  steps = [int(n) for n in names
           if n.isdigit() and os.path.exists(os.path.join(ckpt_dir, n, "_CHECKPOINT_METADATA"))]
  return max(steps, default=None)


def _in_flight_at(ckpt_dir: str, step: int | None) -> int:
  """Env steps in flight when checkpoint ``step`` was written (its ``meta`` JSON; 0 if
  there is none yet)."""
  try:
    with open(os.path.join(ckpt_dir, str(step), "meta", "metadata")) as f:
      return ledger_lib.Ledger.from_meta(json.load(f)["ledger"]).in_flight("env_steps")
  except FileNotFoundError:
    return 0


def _records(workdir: str, phase: str, name: str = metrics.FILE) -> list[dict]:
  """(Read while the run writes: complete lines only.)"""
  return [r for r in jsonl.read_if_exists(os.path.join(workdir, name)) if r["phase"] == phase]


@pytest.mark.slow  # (two runs with faults: a minute and more; test.sh's third step)
@pytest.mark.run_first(4)
def test_every_env_step_is_accounted_for_through_faults_and_a_resume(tmp_path, smoke_config):
  workdir, ckpt_dir = str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints")
  # -- Run A: faults while it trains, then SIGKILL (possibly in the middle of a save).
  proc = _start(workdir, tmp_path / "a.txt", 10_000_000, resume=False)
  updates = lambda: len(_records(workdir, "train"))
  chaos = _Chaos(proc.pid, seed=1, ready=lambda: updates() > 0, updates=updates)
  # (the env pool starts before the warm start, whose records come first)
  try:
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
      latest, records = _latest_step(ckpt_dir), _records(workdir, "train")
      # Run A's faults seen in its records: a kill and the hang, at least.
      faults = records[-1] if records else dict(env_hangs=0, env_restarts=0)
      if (latest or 0) >= 4 and faults["env_hangs"] >= 1 and faults["env_restarts"] >= 2:
        break
      time.sleep(0.5)
    assert proc.poll() is None, (tmp_path / "a.txt").read_text(errors="replace")[-3000:]
    assert (latest or 0) >= 4 and faults["env_hangs"] >= 1, (
        f"checkpoint {latest}, {faults} after 10 minutes")
    chaos.stop()
    # SIGKILL (possibly in the middle of a save) at a moment when the newest complete
    # checkpoint has data in flight, so that the resume has something to discard.
    # The process is frozen while its checkpoint is read (no new one commits meanwhile).
    for _ in range(100):
      os.kill(proc.pid, signal.SIGSTOP)
      if _in_flight_at(ckpt_dir, _latest_step(ckpt_dir)) > 0:
        break
      os.kill(proc.pid, signal.SIGCONT)
      time.sleep(random.uniform(0.1, 0.5))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
  finally:
    chaos.stop()
    if proc.poll() is None:
      proc.kill()
      proc.wait(30)
  deadline = time.time() + 30  # The orphaned workers see their pipe close and exit.
  while time.time() < deadline and any(
      "jaxvla" in " ".join(p.info["cmdline"] or []) and "spawn_main" in " ".join(
          p.info["cmdline"] or []) and p.info["ppid"] == 1
      for p in psutil.process_iter(["cmdline", "ppid"])):
    time.sleep(0.5)
  a_train = _records(workdir, "train")  # (the resume moves those past its checkpoint)

  # What the run left: the newest complete checkpoint (orbax ignores a half-written one).
  for k, v in _FLAGS.items():
    section, _, key = k.rpartition(".")
    (smoke_config[section] if section else smoke_config)[key] = v
  env = builtin.make(smoke_config.env, 2, 0)
  pol = policy_lib.make_policy(smoke_config.model, env.spec)
  lrn = learner_lib.Learner(pol, smoke_config)
  abstract = checkpoint_lib.abstract_like(
      learner_lib.init_state(pol.init(jax.random.PRNGKey(9)), lrn.ppo_tx, jax.random.PRNGKey(9)))
  ckpt = checkpoint_lib.Checkpointer(ckpt_dir, 3)
  step = ckpt.latest_step()
  saved, meta = ckpt.restore(step, abstract)
  ckpt.close()
  assert step >= 4 and int(saved.step) == meta["iteration"] == step
  adam_counts = {int(x) for p, x in jax.tree_util.tree_leaves_with_path(saved.opt_state)
                 if "count" in jax.tree_util.keystr(p)}
  assert adam_counts == {int(saved.step) * smoke_config.rl.num_minibatches}, adam_counts
  at_ckpt = ledger_lib.Ledger.from_meta(meta["ledger"])
  assert at_ckpt.trained_env_steps + at_ckpt.dropped_env_steps == meta["env_steps"]
  # Async with a queue: data was in flight when the checkpoint was written.
  assert at_ckpt.in_flight("env_steps") > 0 and at_ckpt.in_flight("chunks") > 0

  # -- Run B: resumed, with faults again, then Ctrl-C; its ledger must balance.
  proc = _start(workdir, tmp_path / "b.txt", 10_000_000, resume=True)
  # (the env pool starts, and records past the checkpoint are moved, before this line)
  resumed = lambda: "resumed from checkpoint" in (tmp_path / "b.txt").read_text(errors="replace")
  # Faults start once run B has trained, as in run A: a worker faulted during the
  # resume's reset has no episode under way, so it rightly loses none.
  trained = lambda: resumed() and any(r["env_steps"] > meta["env_steps"]
                                      for r in _records(workdir, "train"))
  chaos = _Chaos(proc.pid, seed=2, ready=trained, updates=updates)
  try:
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
      records = _records(workdir, "train") if resumed() else []
      faults = records[-1] if records else dict(env_steps=0)
      if (faults["env_steps"] > meta["env_steps"] and faults["env_hangs"] >= 1
          and faults["env_restarts"] >= 2):
        break
      time.sleep(0.5)
    chaos.stop()
    # A fault chaos made after the records above: wait until the run has seen it.
    while (time.time() < deadline and proc.poll() is None
           and _records(workdir, "train")[-1]["env_restarts"] < chaos.kills + chaos.hangs):
      time.sleep(0.5)
    assert proc.poll() is None, (tmp_path / "b.txt").read_text(errors="replace")[-3000:]
    proc.send_signal(signal.SIGINT)  # Stops after the current update (mid-update data).
    out, _ = proc.communicate(timeout=300)
  finally:
    chaos.stop()
    if proc.poll() is None:
      proc.kill()
      proc.wait(30)
  assert proc.returncode == 0, (tmp_path / "b.txt").read_text(errors="replace")[-3000:]
  second = json.loads(out.decode().strip().splitlines()[-1])
  ledger = second["ledger"]
  for unit in ledger_lib.UNITS:
    row = ledger[unit]
    assert row["unaccounted"] == 0, ledger
    assert row["produced"] == (row["trained"] + row["dropped"] + row["discarded"]
                               + row["in_flight_counted"]), ledger
  assert second["env_steps_unaccounted"] == 0
  # Discarded: exactly what was in flight at the checkpoint resumed from.
  assert second["discarded_on_resume"] == dict(env_steps=at_ckpt.in_flight("env_steps"),
                                               chunks=at_ckpt.in_flight("chunks"))
  assert ledger["env_steps"]["discarded"] == at_ckpt.in_flight("env_steps")
  # The whole history: the checkpoint's counts plus what run B did. The budget counts
  # the finished updates; the ledger also holds what the update that Ctrl-C interrupted
  # dropped as too stale while it gathered its batch (its taken items are in flight).
  b_train = _records(workdir, "train")
  b_train = b_train[len(b_train) - (second["iterations"] - meta["iteration"]):]
  b_dropped = sum(r["dropped_env_steps"] for r in b_train)
  interrupted_drops = second["dropped_env_steps"] - b_dropped
  assert interrupted_drops >= 0, (second["dropped_env_steps"], b_dropped)
  assert ledger["env_steps"]["dropped"] == (at_ckpt.dropped_env_steps + b_dropped
                                            + interrupted_drops)
  assert (ledger["env_steps"]["trained"] + ledger["env_steps"]["dropped"] - interrupted_drops
          == second["env_steps"])
  assert ledger["env_steps"]["produced"] == (at_ckpt.produced_env_steps
                                             + second["rollout_env_steps"])
  assert b_train[-1]["env_steps"] == second["env_steps"]
  assert second["interrupted"] and chaos.hangs == 1
  last = b_train[-1]
  # (A loaded machine may also take a slow chunk for a hang: at least what chaos did.)
  assert last["env_hangs"] >= 1 and last["env_restarts"] >= chaos.kills + 1, (last, chaos.kills)
  # Every episode a restart cut short is counted: the hung worker's (it was sent a step it
  # never answered) and the killed ones' under way (a worker killed while all its envs
  # sat at an episode boundary loses none).
  b_log = (tmp_path / "b.txt").read_text(errors="replace")
  restarts = re.findall(r"(died|hung|failed)\b.*: restarted; (\d+) episode\(s\) cut short",
                        b_log)
  lost = [int(n) for _, n in restarts[:int(last["env_restarts"])]]
  assert last["episodes_lost_to_faults"] == sum(lost), restarts
  assert [int(n) for why, n in restarts if why == "hung"][0] >= 1, restarts
  # Trained data is never staler than max_staleness, before or after the resume.
  k = _FLAGS["pipeline.max_staleness"]
  stale = [r["staleness_max"] for r in a_train + b_train]
  assert stale and max(stale) <= k, stale
  # The rest of a resume's promises: version, optimizer, no second warm start, the curve.
  resumed_iters = second["iterations"] - meta["iteration"]
  assert resumed_iters >= 1 and second["policy_version"] == int(saved.step) + resumed_iters
  assert len(_records(workdir, "warm_start")) == 1
  steps = [r["env_steps"] for r in _records(workdir, "train")]
  assert steps == sorted(set(steps)), steps
  assert _records(workdir, "train", "metrics.discarded.jsonl") or steps[-1] > meta["env_steps"]
  assert second["env_steps_this_process"] == second["env_steps"] - meta["env_steps"]


# ------------------------------------------------------ staleness, as a property --
def _schedule(seed: int, lockstep: bool, k: int) -> tuple[list[int], int]:
  """One random schedule of a paced async run, simulated step by step.

  The rollout starts segments of ``envs`` envs when the :class:`Pacer` grants them,
  each finishing after a random number of ticks (first-ready: stragglers finish
  late; lockstep: all at once); finished segments become queue items; the learner
  trains when it has an update's worth; the broadcast reaches the rollout after a
  random delay; the queue gives a dropped item's starts back to the pacer. Returns the
  staleness of every trained item and the dropped count.
  """
  rng = random.Random(seed)
  envs, per_item = 8, rng.choice([1, 2, 4])
  pacer = pacer_lib.Pacer(envs, k, version=rng.randrange(3))
  version = pacer.started // envs  # (a resumed run starts at its version)
  queue = queue_lib.TrajectoryQueue(rng.choice([2, 4, 64]), k,
                                    on_drop=lambda item: pacer.release(item.num_segments))
  consumed = version * envs  # Segments trained on (a resumed run's count from its version).
  rollout_version = version  # The params the rollout acts with (broadcast lags).
  running: list[tuple[int, int]] = []  # (finish tick, version that acted).
  done: list[int] = []
  pending_broadcast: list[tuple[int, int]] = []
  taken, trained_staleness = [], []
  idle = [envs]  # Envs free to start a segment.
  for tick in range(400):
    for when, v in list(pending_broadcast):
      if when <= tick:
        rollout_version = max(rollout_version, v)
        pacer.set_version(rollout_version)
        pending_broadcast.remove((when, v))
    if idle[0]:
      granted, acting = pacer.acquire(idle[0], rollout_version, block=False)
      finish = tick + 1 + rng.randrange(2)
      for _ in range(granted):
        running.append((finish if lockstep else tick + 1 + rng.randrange(6), acting))
      idle[0] -= granted
    for seg in [s for s in running if s[0] <= tick]:
      running.remove(seg)
      done.append(seg[1])
      idle[0] += 1
    while len(done) >= per_item and len(queue) < queue.capacity:
      versions, done = np.asarray(done[:per_item], np.int32), done[per_item:]
      queue.put(types.Item(data=None, versions=versions, num_chunks=per_item,
                           num_env_steps=per_item, num_segments=per_item))
    if rng.random() < 0.5:  # The learner's turn.
      try:
        item, staleness = queue.get(version, timeout=0.0)
      except TimeoutError:
        continue
      taken.append(item)
      consumed += item.num_segments
      trained_staleness.append(staleness)
      if sum(it.num_chunks for it in taken) >= envs:  # One update's worth.
        taken = []
        version += 1
        pending_broadcast.append((tick + rng.randrange(4), version))
  # The pacer counts exactly the segments that are not dropped: trained, queued, done
  # and not yet an item, or running (so drops never narrow the bound).
  assert pacer.started == consumed + len(queue) * per_item + len(done) + len(running), seed
  return trained_staleness, queue.stats.dropped_items


@pytest.mark.parametrize("lockstep", [True, False])
def test_trained_data_is_never_staler_than_max_staleness(lockstep):
  for seed in range(150):
    k = seed % 3
    staleness, dropped = _schedule(seed, lockstep, k)
    assert staleness, seed
    assert max(staleness) <= k and min(staleness) >= 0, (seed, k, max(staleness))
    if lockstep:  # Pacing alone keeps lockstep data fresh enough: nothing dropped.
      assert dropped == 0, (seed, k, dropped)
