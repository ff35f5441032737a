"""Multi-host runs on one machine: two processes joined through ``jax.distributed`` (gloo).

Each process owns one CPU device, so the learner mesh spans both processes and
the params are FSDP-sharded across them, as across the hosts of a GPU cluster or
a TPU pod. Checked:

* the learner split over two processes, each feeding half of every batch,
  computes the same BC step, PPO update and streamed update as one process
  on the whole batch (``tests/multihost_check.py``);
* ``python -m jaxvla.main`` as two processes, fully asynchronous (L1+L2+L3),
  started as a SLURM job would start them: ``launch/slurm.sbatch`` under a stand-in
  ``srun`` (``tests/fake_slurm.py``) that sets the variables the real one sets, so the
  processes join through ``cluster_auto`` alone (JAX's SLURM detection, its derived
  coordinator port). Both finish with the same summary, the budget counts both
  processes' env steps, process 0 alone writes the metrics, the export loads, and a
  second submission to the same workdir resumes the checkpoint on both (the script
  adds ``--config.resume=True`` itself). The other runs join through an explicit
  coordinator;
* a process lost mid-run (SIGKILL) ends the other at once, in one line that names it,
  the last checkpoint and the resume command, and that command resumes the run;
* ``config.distributed`` errors name the key.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from configs import default
from jaxvla import config_checks
from jaxvla import metrics as metrics_lib
from jaxvla.parallel import distributed
from jaxvla.storage import checkpoint as checkpoint_lib
from tests import fake_slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env() -> dict:
  env = dict(os.environ)
  # launch/test.sh's compile-time flags; one CPU device per process.
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  # No persistent compilation cache: only process 0 writes it, so in a later run one
  # process can load an executable compiled by an earlier run while the other compiles
  # its own, and on the CPU backend the two then ran their gloo collectives in different
  # orders ("Received data size doesn't match expected size"; seen with cache entries
  # from test_two_process_async_run written before test_two_process_sync_modes ran).
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


class _Process:
  """A subprocess whose stdout and stderr go to temporary files, not pipes: a pipe that
  nobody reads fills at 64 KiB and blocks its writer, and two processes joined in a
  collective would then both hang while the test waits for one of them."""

  def __init__(self, argv: list[str]):
    self._out, self._err = (tempfile.TemporaryFile("w+", encoding="utf-8") for _ in range(2))
    self.popen = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=self._out,
                                  stderr=self._err, text=True)

  def communicate(self, timeout: float) -> tuple[str, str]:
    """Waits for the exit (``subprocess.TimeoutExpired`` after ``timeout`` s); its output."""
    self.popen.wait(timeout)
    texts = []
    for f in (self._out, self._err):
      f.seek(0)
      texts.append(f.read())
      f.close()
    return texts[0], texts[1]

  def stop(self) -> None:
    """Kills the process if it still runs."""
    if self.popen.poll() is None:
      self.popen.kill()
      self.popen.wait()


def _run_processes(argv_of, n: int, timeout: float) -> list[subprocess.CompletedProcess]:
  """Starts ``n`` processes (``argv_of(i)``) and waits for all; a hang fails the test."""
  procs = [_Process(argv_of(i)) for i in range(n)]
  out = []
  try:
    for p in procs:
      stdout, stderr = p.communicate(timeout=timeout)
      out.append(subprocess.CompletedProcess(p.popen.args, p.popen.returncode, stdout, stderr))
  finally:
    for p in procs:
      p.stop()
  for i, r in enumerate(out):
    assert r.returncode == 0, f"process {i} failed:\n{r.stderr[-6000:]}"
  return out


@pytest.mark.multihost
def test_learner_split_over_two_processes_matches_one_process(tmp_path):
  script = os.path.join(ROOT, "tests", "multihost_check.py")
  ref, split = tmp_path / "one.npz", tmp_path / "two.npz"
  _run_processes(lambda i: [sys.executable, script, str(ref)], 1, timeout=600)
  port = _free_port()
  _run_processes(lambda i: [sys.executable, script, str(split),
                            f"--coordinator=localhost:{port}", "--num_processes=2",
                            f"--process_id={i}"], 2, timeout=600)
  want, got = np.load(ref), np.load(split)
  assert set(want) == set(got)
  params = [k for k in want if k.split("[")[0] in ("bc_params", "ppo_params", "stream_params")]
  assert len(params) > 50, params  # every leaf of three param trees
  for k in params:  # Same global batch, same update, to float32 reduction order.
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
  for k in want:
    if k.startswith(("ppo_metric_", "stream_metric_")) or k == "bc_loss":
      np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
  # Real updates happened (not a comparison of two untouched inits).
  assert int(got["step"]) == 1
  key = "['rl']['value_out']['kernel']"
  assert not np.allclose(got["ppo_params" + key], got["bc_params" + key])
  np.testing.assert_array_equal(got["sum_over_hosts"], [1 + 2, 10 + 10])
  assert float(got["broadcast"]) == 7.0  # process 0's value on both


# The two-process asynchronous run's settings (fully asynchronous: L1+L2+L3).
_ASYNC = ("--config.pipeline.mode=async", "--config.pipeline.streamer=True",
          "--config.env_workers=2", "--config.pipeline.micro_batch_segments=2",
          "--config.rl.num_minibatches=2", "--config.rl.num_epochs=1",
          "--config.rl.advantage_norm=none")


def _main_argv(workdir: str, port: int, i: int, *extra: str) -> list[str]:
  return [sys.executable, "-m", "jaxvla.main", "--config=configs/default.py:smoke",
          f"--workdir={workdir}",
          f"--config.distributed.coordinator_address=localhost:{port}",
          "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
          "--config.distributed.initialization_timeout_s=120", *_ASYNC, *extra]


def _sbatch(tmp_path, workdir: str, *args: str, **env: str) -> tuple[list[dict], str]:
  """``launch/slurm.sbatch ARGS`` as a 2-task job on this machine (``env``: more of the
  job's variables). Returns each task's summary (its last stdout line) and the script's log."""
  bin_dir, fake = str(tmp_path / "bin"), str(tmp_path / "slurm")
  fake_slurm.install(bin_dir)
  for name in os.listdir(fake) if os.path.isdir(fake) else ():
    os.remove(os.path.join(fake, name))  # (the previous submission's task logs)
  job_env = fake_slurm.job_env(_env(), bin_dir, fake, ntasks=2, job_id=fake_slurm.free_job_id(),
                               workdir=workdir, submit_dir=ROOT, **env)
  r = subprocess.run(["bash", os.path.join(ROOT, "launch", "slurm.sbatch"), *args],
                     cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=800)
  outs, errs = [], []
  for i in range(2):
    with open(os.path.join(fake, f"task{i}.out"), encoding="utf-8") as f:
      outs.append(f.read())
    with open(os.path.join(fake, f"task{i}.err"), encoding="utf-8") as f:
      errs.append(f.read())
  assert r.returncode == 0, (f"slurm.sbatch failed:\n{r.stderr[-3000:]}\n" + "\n".join(
      f"task {i}:\n{err[-3000:]}" for i, err in enumerate(errs)))
  (srun,) = fake_slurm.calls(fake, "srun")
  assert "--config.distributed.cluster_auto=True" in srun
  assert not any(a.startswith("--config.distributed.coordinator_address") for a in srun)
  for i, err in enumerate(errs):  # Each task's rank came from SLURM_PROCID, via JAX.
    assert f"jax.distributed: process {i} of 2" in err, err[-3000:]
  return [json.loads(out.strip().splitlines()[-1]) for out in outs], r.stderr


@pytest.mark.multihost
def test_two_process_async_run_via_slurm_detection_trains_checkpoints_and_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  budget = 1_200
  smoke = ("--config=configs/default.py:smoke", "--config.distributed.initialization_timeout_s=120",
           *_ASYNC)
  (a, b), log = _sbatch(tmp_path, workdir, *smoke, f"--config.total_env_steps={budget}")
  assert "no checkpoint in the workdir: starting the run" in log
  assert a["num_processes"] == b["num_processes"] == 2
  assert a["pipeline"] == "async[L1+L2+L3]"
  for key in ("env_steps", "iterations", "policy_version", "success_rate", "rollout_env_steps"):
    assert a[key] == b[key], key  # decided together: same budget count, same stop
  # One update consumes num_envs segments of rollout_len chunks on *each* process.
  per_update = 2 * 8 * 4 * 5
  assert a["env_steps"] >= budget and a["iterations"] <= -(-budget // (per_update // 2)) + 1
  assert a["env_steps"] > a["iterations"] * per_update // 2  # both processes' steps counted
  assert a["rollout_env_steps"] >= a["env_steps"]
  # Process 0 alone writes metrics: every train record once.
  train = metrics_lib.records(workdir, "train")
  assert len(train) == a["iterations"]
  # (A copy lands asynchronously, maybe after its update's record: look over the run.)
  assert min(r["learner_busy"] for r in train) > 0
  assert max(r["broadcast_busy"] for r in train) > 0
  params, _ = checkpoint_lib.load_policy_params(os.path.join(workdir, "export"))
  assert np.all(np.isfinite(np.asarray(params["rl"]["value_out"]["kernel"])))

  # The job submitted again to the same workdir, with a larger budget (a requeue
  # passes the same arguments): slurm.sbatch finds the checkpoint and resumes it.
  (c, d), log = _sbatch(tmp_path, workdir, *smoke, f"--config.total_env_steps={2 * budget}",
                        SLURM_RESTART_COUNT="1")
  assert "the workdir holds a checkpoint: resuming it" in log
  assert c["env_steps"] == d["env_steps"] >= 2 * budget
  assert c["policy_version"] == d["policy_version"] > a["policy_version"]
  assert c["discarded_on_resume"] == d["discarded_on_resume"] is not None


# The runs below start RL from the fresh policy: the two-process warm start (BC) is
# checked by the learner-split test and the async run above.
_NO_WARM_START = "--config.bc.num_steps=0"


def _check_grpo_records(workdir: str, iterations: int) -> None:
  """GRPO's train records: one per update, each with a finite loss and episode returns."""
  train = metrics_lib.records(workdir, "train")
  assert len(train) == iterations
  assert all(np.isfinite(r["loss"]) and "episode_return_mean" in r for r in train)


@pytest.mark.multihost
@pytest.mark.parametrize("mode", ["sync_colocated", "sync_disaggregated"])
def test_two_process_sync_modes(tmp_path, mode):
  """The synchronous baselines: each process acts on its replica of the learner's params."""
  workdir = str(tmp_path / mode)
  port = _free_port()
  runs = _run_processes(lambda i: _main_argv(
      workdir, port, i, "--config.total_env_steps=600", f"--config.pipeline.mode={mode}",
      "--config.checkpoint.every_iters=1000", _NO_WARM_START), 2, timeout=800)
  a, b = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
  assert a["pipeline"] == b["pipeline"] == mode
  assert a["iterations"] == b["iterations"] >= 1 and a["env_steps"] == b["env_steps"] >= 600
  assert a["staleness_mean"] == 0.0 and a["success_rate"] == b["success_rate"]


_GRPO = ("--config.env.group_size=2", "--config.algorithm=grpo",
         "--config.grpo.loss_normalizer=constant")


@pytest.mark.multihost
def test_two_process_streamed_grpo_run(tmp_path):
  """GRPO, streamed (L3): each process's episode groups, one global batch per update.
  (The non-streamed GRPO update runs in the Ctrl-C test below.)"""
  workdir = str(tmp_path / "grpo")
  port = _free_port()
  runs = _run_processes(lambda i: _main_argv(
      workdir, port, i, "--config.total_env_steps=600", *_GRPO, "--config.pipeline.streamer=True",
      "--config.checkpoint.every_iters=1000", _NO_WARM_START), 2, timeout=800)
  a, b = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
  assert a["iterations"] == b["iterations"] >= 1 and a["env_steps"] == b["env_steps"] >= 600
  _check_grpo_records(workdir, a["iterations"])


def _wait_for_updates(procs: list[_Process], workdir: str, n: int) -> list[dict]:
  """Waits until process 0 has written ``n`` RL updates' records; returns them."""
  deadline = time.monotonic() + 600
  while time.monotonic() < deadline:
    assert all(p.popen.poll() is None for p in procs), "a process ended too early"
    train = metrics_lib.records(workdir, "train")  # (complete lines: the run still writes)
    if len(train) >= n:
      return train
    time.sleep(0.5)
  pytest.fail(f"no {n} RL updates within 600 s")


@pytest.mark.multihost
def test_ctrl_c_on_one_process_stops_both_after_the_same_update(tmp_path):
  """SIGINT to process 1 only: both stop after the same update and save it. The run is
  GRPO without the streamer (L1+L2), so its updates are checked too."""
  workdir = str(tmp_path / "run")
  port = _free_port()
  procs = [_Process(_main_argv(workdir, port, i, "--config.total_env_steps=1000000",
                               "--config.eval.every_iters=1000",
                               "--config.checkpoint.every_iters=1000", *_GRPO,
                               "--config.pipeline.streamer=False", _NO_WARM_START))
           for i in range(2)]
  try:
    _wait_for_updates(procs, workdir, 2)
    procs[1].popen.send_signal(signal.SIGINT)
    results = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      p.stop()
  for p, (_, stderr) in zip(procs, results):
    assert p.popen.returncode == 0, stderr[-4000:]
  a, b = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
  assert a["interrupted"] and b["interrupted"]
  assert a["pipeline"] == "async[L1+L2]"
  assert a["policy_version"] == b["policy_version"] == a["iterations"] >= 2
  _check_grpo_records(workdir, a["iterations"])
  assert a["env_steps"] == b["env_steps"] < 1_000_000
  assert checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), 2).latest_step() \
      == a["iterations"]


@pytest.mark.multihost
def test_a_lost_process_ends_the_other_in_one_line_and_the_same_command_resumes(tmp_path):
  """SIGKILL to process 1 once training runs. Process 0 must stop within seconds (not
  wait out the 100 s heartbeat timeout and abort with a C++ trace, as JAX alone does),
  with exit status 1 and one line that names process 1, the last finished checkpoint
  and the command that resumes the run; that command (with a budget the test can
  reach) continues from the checkpoint on both processes, every env step accounted."""
  workdir = str(tmp_path / "run")
  port = _free_port()
  long_run = ("--config.total_env_steps=1000000", "--config.eval.every_iters=1000",
              "--config.checkpoint.every_iters=2", _NO_WARM_START)
  procs = [_Process(_main_argv(workdir, port, i, *long_run)) for i in range(2)]
  try:
    train = _wait_for_updates(procs, workdir, 3)
    procs[1].popen.kill()
    killed = time.monotonic()
    _, stderr = procs[0].communicate(timeout=90)
    stopped_s = time.monotonic() - killed
  finally:
    for p in procs:
      p.stop()
  assert procs[0].popen.returncode == 1, stderr[-4000:]
  assert stopped_s < 20, stopped_s  # (measured: 0.9 s)
  assert "Fatal Python error" not in stderr and "Check failure" not in stderr, stderr[-4000:]
  line = stderr.strip().splitlines()[-1]
  assert line.startswith("error: process 1 (host ") and " was lost; " in line, line
  saved = checkpoint_lib.saved_steps(os.path.join(workdir, "checkpoints"))
  assert saved and saved[-1] >= 2
  assert f"the last finished checkpoint is {saved[-1]} in {workdir}/checkpoints" in line
  command = line.split("start every process again with: ", 1)[1].split()
  assert command[:3] == ["python", "-m", "jaxvla.main"] and command[-1] == "--config.resume=True"
  assert command[3:-1] == _main_argv(workdir, port, 0, *long_run)[3:]

  # The same command on both processes (a fresh port, each its process id), with a
  # budget just past what the run had reached.
  port = _free_port()
  budget = max(r["env_steps"] for r in train) + 1
  def resume_argv(i):
    args = [f"--config.distributed.coordinator_address=localhost:{port}"
            if a.startswith("--config.distributed.coordinator_address=")
            else f"--config.distributed.process_id={i}"
            if a.startswith("--config.distributed.process_id=") else a for a in command[3:]]
    return [sys.executable, "-m", "jaxvla.main", *args, f"--config.total_env_steps={budget}"]
  a, b = [json.loads(r.stdout.strip().splitlines()[-1])
          for r in _run_processes(resume_argv, 2, timeout=600)]
  assert a["policy_version"] == b["policy_version"] > saved[-1]
  assert a["env_steps"] == b["env_steps"] >= budget
  assert a["discarded_on_resume"] is not None and a["env_steps_unaccounted"] == 0


@pytest.mark.multihost
def test_processes_with_different_workdirs_fail_with_a_clear_error(tmp_path):
  port = _free_port()
  procs = [_Process(_main_argv(str(tmp_path / f"run{i}"), port, i)) for i in range(2)]
  try:
    results = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      p.stop()
  for p, (_, stderr) in zip(procs, results):
    assert p.popen.returncode != 0
    assert "--workdir differs between processes" in stderr, stderr[-3000:]


@pytest.mark.parametrize("overrides, key", [
    (dict(coordinator_address="localhost"), "coordinator_address"),
    (dict(coordinator_address="localhost:1234", num_processes=2, process_id=2), "process_id"),
    (dict(num_processes=2), "num_processes"),
    (dict(cluster_auto=True, coordinator_address="localhost:1234"), "cluster_auto"),
    (dict(local_device_ids="0,a"), "local_device_ids"),
    (dict(heartbeat_timeout_s=0), "heartbeat_timeout_s"),
])
def test_distributed_config_errors_name_the_key(overrides, key):
  c = default.get_config()
  with c.unlocked():
    c.distributed.update(overrides)
  with pytest.raises(ValueError, match=key):
    config_checks.validate(c)


def test_single_process_helpers_are_the_identity():
  tree = {"a": np.arange(3)}
  assert distributed.to_global(tree, None) is tree
  assert distributed.local_replica(tree) is tree
  np.testing.assert_array_equal(distributed.sum_over_hosts([1, 2]), [1, 2])
  assert distributed.broadcast_from_primary({"x": 1.0}) == {"x": 1.0}
  assert distributed.is_primary() and not distributed.multi_process()
