"""The cluster launchers without a cluster: ``launch/tpu_pod.sh --dry_run``, ``launch/slurm.sbatch``
under stand-ins for SLURM's commands, and ``configs/tpu.py``.

Checked:

* ``tpu_pod.sh up --dry_run`` prints every step (describe, create or reuse, the code
  copied to all workers, set-up, the checkpoint check, the run with ``cluster_auto`` on
  all workers, worker 0's log) and runs nothing: fake ``gcloud`` and ``git`` first on
  ``PATH`` must stay uncalled. ``logs``, ``kill``, ``stop``, ``delete`` likewise. A bad
  flag fails with one line on stderr naming it; ``--help`` documents every flag.
* ``slurm.sbatch`` parses (``bash -n``), carries ``--requeue`` and the USR1 signal, and its
  ``srun`` (a recording stand-in) gets ``cluster_auto`` and the workdir, plus
  ``--config.resume=True`` exactly when the workdir holds a finished checkpoint; GPU
  layouts get the right ``local_device_ids``; USR1 stops the tasks (SIGINT through
  ``scancel``) and requeues the job (``scontrol requeue``).
* ``configs/tpu.py`` passes the config checks and splits its batches on slices of
  4 to 256 chips.
* ``setup.sh``'s Vulkan ICD file names lavapipe by its real path when the prefix is
  reached through a link (a second checkout linking the first's prefix).

The SLURM path with real tasks (two processes joined by JAX's SLURM detection, a run and
its resume) is ``tests/test_multihost.py::test_two_process_async_run_via_slurm_...``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time

import numpy as np
import pytest

from configs import tpu
from jaxvla import config_checks
from jaxvla.parallel import sharding
from jaxvla.storage import checkpoint as checkpoint_lib
from tests import fake_slurm
from tests.conftest import ROOT

TPU_POD = os.path.join(ROOT, "launch", "tpu_pod.sh")
SBATCH = os.path.join(ROOT, "launch", "slurm.sbatch")


# ------------------------------------------------------------- tpu_pod.sh --
def _poison_bin(tmp_path) -> str:
  """A directory of `gcloud` and `git` that record a call (the dry run must make none)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  for name in ("gcloud", "git"):
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {tmp_path}/called\nexit 97\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return str(bin_dir)


def _tpu_pod(tmp_path, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PATH=_poison_bin(tmp_path) + os.pathsep + os.environ["PATH"])
  return subprocess.run(["bash", TPU_POD, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=60)


def _commands(stdout: str) -> list[list[str]]:
  """The '+ ' lines of a dry run, as argument lists."""
  return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def _remote(argv: list[str]) -> tuple[str, list[str]]:
  """(workers, remote command as arguments) of a `gcloud ... ssh` argument list."""
  flags = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
  return flags["--worker"], shlex.split(flags["--command"])


_UP = ("up", "--dry_run", "--name=vla", "--zone=us-east5-a", "--project=proj",
       "--accelerator_type=v5p-64", "--spot", "--nfs=10.0.0.2:/share", "--workdir=runs/pi0")


def test_tpu_pod_up_dry_run_prints_every_step_and_runs_nothing(tmp_path):
  user = ["--config.seed=3", "--config.model.tokenizer_path=/mnt/it's here/tok.model"]
  r = _tpu_pod(tmp_path, *_UP, "--", *user)
  assert r.returncode == 0, r.stderr
  assert not (tmp_path / "called").exists(), (tmp_path / "called").read_text()
  cmds = _commands(r.stdout)
  tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
  assert all(c[:4] == tpu for c in cmds if c[0] == "gcloud")
  where = ["--zone=us-east5-a", "--project=proj"]
  # 1. The slice: described (reused if READY), created if absent.
  describe, create = cmds[0], cmds[1]
  assert describe[4:6] == ["describe", "vla"] and all(w in describe for w in where)
  assert create[4:6] == ["create", "vla"] and all(w in create for w in where)
  assert {"--accelerator-type=v5p-64", "--version=v2-alpha-tpuv5", "--spot"} <= set(create)
  assert "READY with type v5p-64: reused" in r.stdout
  # 2. The code: the working tree archived, copied to every worker, unpacked there.
  archive = next(c for c in cmds if c[:1] == ["git"] and "archive" in c)
  scp = next(c for c in cmds if c[4:5] == ["scp"])
  assert archive[-1] == "WORKTREE_COMMIT" and scp[5].endswith(".tar.gz")
  assert "--worker=all" in scp and scp[6] == "vla:jaxvla-src.tar.gz"
  ssh = [_remote(c) for c in cmds if c[4:5] == ["ssh"]]
  assert all(c[5] == "vla" and all(w in c for w in where) for c in cmds if c[4:5] == ["ssh"])
  unpack, setup, check, start, logs = ssh
  assert unpack[0] == "all" and "tar" in unpack[1] and "jaxvla" in unpack[1]
  # 3. Set-up on every worker, with the share mounted and the workdir under it.
  assert setup == ("all", ["bash", "jaxvla/launch/tpu_pod.sh", "_setup", "--nfs=10.0.0.2:/share",
                           "--mount=/mnt/jaxvla", "--workdir=/mnt/jaxvla/runs/pi0"])
  # 4. Worker 0 checks the workdir for a checkpoint (the resume decision).
  assert check == ("0", ["bash", "jaxvla/launch/tpu_pod.sh", "_has_checkpoint",
                         "/mnt/jaxvla/runs/pi0"])
  assert "--config.resume=True as well" in r.stdout
  # 5. The run on every worker at once: the TPU config, the user's arguments intact,
  # cluster_auto and the shared workdir.
  assert start == ("all", ["bash", "jaxvla/launch/tpu_pod.sh", "_start", "--",
                           "--config=configs/tpu.py", *user,
                           "--config.distributed.cluster_auto=True",
                           "--workdir=/mnt/jaxvla/runs/pi0"])
  # 6. Worker 0's log streamed.
  assert logs == ("0", ["bash", "jaxvla/launch/tpu_pod.sh", "_logs"])
  assert r.stdout.index("_has_checkpoint") < r.stdout.index("_start") < r.stdout.index("_logs")


def test_tpu_pod_other_subcommands_dry_run(tmp_path):
  base = ("--dry_run", "--name=vla", "--zone=z1")
  stop = _commands(_tpu_pod(tmp_path, "stop", *base).stdout)
  delete = _commands(_tpu_pod(tmp_path, "delete", *base).stdout)
  assert stop == [["gcloud", "compute", "tpus", "tpu-vm", "stop", "vla", "--zone=z1", "--quiet"]]
  assert delete == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "vla", "--zone=z1",
                     "--quiet"]]
  assert [_remote(c) for c in _commands(_tpu_pod(tmp_path, "kill", *base).stdout)] == [
      ("all", ["bash", "jaxvla/launch/tpu_pod.sh", "_kill"])]
  assert [_remote(c) for c in _commands(_tpu_pod(tmp_path, "logs", *base).stdout)] == [
      ("0", ["bash", "jaxvla/launch/tpu_pod.sh", "_logs"])]
  # A clone on the workers instead of a copy; a v5e slice's software; no log streaming.
  r = _tpu_pod(tmp_path, "up", *base, "--accelerator_type=v5litepod-16",
               "--workdir=/shared/run", "--git_url=https://example.org/jaxvla.git",
               "--ref=abc123", "--remote_dir=src/jv", "--detach", "--preemptible",
               "--create_flag=--network=net1", "--", "--config=configs/default.py:smoke")
  assert r.returncode == 0, r.stderr
  cmds = _commands(r.stdout)
  assert {"--version=v2-alpha-tpuv5-lite", "--preemptible", "--network=net1"} <= set(cmds[1])
  assert not any("scp" in c for c in cmds)
  clone = _remote(next(c for c in cmds if c[4:5] == ["ssh"]))
  assert clone[0] == "all" and "https://example.org/jaxvla.git" in clone[1]
  assert clone[1][-4:] == ["checkout", "-q", "--force", "abc123"]
  starts = [_remote(c) for c in cmds if "_start" in " ".join(c)]
  assert starts[0][1][:5] == ["bash", "src/jv/launch/tpu_pod.sh", "_start", "--",
                              "--config=configs/default.py:smoke"]
  assert "--workdir=/shared/run" in starts[0][1] and "_logs" not in r.stdout
  assert not (tmp_path / "called").exists()


@pytest.mark.parametrize("args, names", [
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=v5p-8",
      "--workdir=/w", "--bogus=1"), "--bogus"),
    (("up", "--dry_run", "--zone=z"), "--name"),
    (("up", "--dry_run", "--name=Bad_Name", "--zone=z"), "--name=Bad_Name"),
    (("up", "--dry_run", "--name=vla", "--accelerator_type=v5p-8", "--workdir=/w"), "--zone"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--workdir=/w"), "--accelerator_type"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=tpu9",
      "--workdir=/w"), "--accelerator_type=tpu9"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=v5p-8"), "--workdir"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=v5p-8",
      "--workdir=gs://b/run"), "gs://"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=v5p-8",
      "--workdir=runs/x"), "--workdir=runs/x"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=v5p-8",
      "--workdir=/w", "--spot", "--preemptible"), "--preemptible"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=v5p-8",
      "--workdir=/w", "--nfs=share"), "--nfs=share"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=v5p-8",
      "--workdir=/w", "--", "--workdir=/other"), "--workdir=/other"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=v5p-8",
      "--workdir=/w", "--", "--config.resume=True"), "--config.resume"),
    (("up", "--dry_run", "--name=vla", "--zone=z", "--accelerator_type=v5p-8",
      "--workdir=/w", "--", "--config.distributed.coordinator_address=h:1"), "coordinator"),
    (("up", "--dry_run", "--name", "vla"), "--name needs a value"),
    (("launch", "--name=vla"), "'launch'"),
    ((), "no subcommand"),
    (("stop", "--dry_run", "--name=vla", "--zone=z", "--", "--config.seed=1"), "stop"),
])
def test_tpu_pod_bad_flag_fails_with_one_line_naming_it(tmp_path, args, names):
  r = _tpu_pod(tmp_path, *args)
  assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tpu_pod.sh: ") and names in lines[0], lines
  assert not (tmp_path / "called").exists()


def test_tpu_pod_needs_gcloud_unless_dry_run(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in ("bash", "dirname"):  # (what the script needs before it looks for gcloud)
    os.symlink(shutil.which(tool), bin_dir / tool)
  r = subprocess.run(["bash", TPU_POD, "stop", "--name=vla", "--zone=z"], cwd=ROOT,
                     env=dict(os.environ, PATH=str(bin_dir)), capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 2 and r.stderr.strip() == (
      "tpu_pod.sh: gcloud not found: install the Google Cloud CLI (or try --dry_run)")


def test_tpu_pod_help_documents_every_subcommand_and_flag(tmp_path):
  r = _tpu_pod(tmp_path, "--help")
  assert r.returncode == 0 and not r.stdout.startswith("#"), r.stderr
  with open(TPU_POD, encoding="utf-8") as f:
    source = f.read()
  flags = set(re.findall(r"^    (--[a-z_]+)(?:=\*)?\)", source, re.M))
  assert {"--name", "--zone", "--workdir", "--dry_run", "--spot"} <= flags
  for flag in flags:
    assert f"  {flag}" in r.stdout, flag
  for sub in ("up", "logs", "kill", "stop", "delete"):
    assert f"tpu_pod.sh {sub} " in r.stdout, sub


def test_jax_plugin_none_is_a_no_op_and_a_bad_name_one_line():
  script = os.path.join(ROOT, "launch", "jax_plugin.sh")
  assert subprocess.run(["bash", script, "none"], capture_output=True, timeout=30).returncode == 0
  r = subprocess.run(["bash", script, "rocm"], capture_output=True, text=True, timeout=30)
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      "jax_plugin.sh: unknown plugin 'rocm': expected tpu, cuda12, cuda13 or none"]


# --------------------------------------------------------------- setup.sh --
def test_setup_icd_names_the_real_prefix_through_a_link(tmp_path):
  real = tmp_path / "checkout" / "prefix"
  shipped = real / "root" / "usr" / "share" / "vulkan" / "icd.d" / "lvp_icd.json"
  shipped.parent.mkdir(parents=True)
  shipped.write_text('{"ICD": {"library_path": "/usr/lib/libvulkan_lvp.so"}}')
  link = tmp_path / "other_checkout_prefix"
  link.symlink_to(real)
  setup = os.path.join(ROOT, "launch", "setup.sh")
  # The function alone: sourcing setup.sh would run the whole set-up.
  script = (f"eval \"$(sed -n '/^_jaxvla_write_icd()/,/^}}/p' {shlex.quote(setup)})\"\n"
            f"_jaxvla_write_icd {shlex.quote(str(link))}")
  subprocess.run(["bash", "-c", script], check=True, timeout=30)
  written = (real / "lvp_icd.json").read_text()
  assert f'"library_path": "{real.resolve()}/lib/libvulkan_lvp.so"' in written


# ----------------------------------------------------------- slurm.sbatch --
def test_slurm_sbatch_parses_and_asks_for_requeue_and_the_time_limit_signal():
  assert subprocess.run(["bash", "-n", SBATCH], capture_output=True).returncode == 0
  with open(SBATCH, encoding="utf-8") as f:
    text = f.read()
  directives = re.findall(r"^#SBATCH (\S+)", text, re.M)
  assert "--requeue" in directives and "--open-mode=append" in directives
  usr1 = [d for d in directives if d.startswith("--signal=")]
  assert usr1 and re.fullmatch(r"--signal=B:USR1@\d+", usr1[0])
  # Every #SBATCH line comes before the first command (sbatch stops reading there).
  first_command = next(i for i, line in enumerate(text.splitlines())
                       if line.strip() and not line.startswith("#"))
  assert all(i < first_command for i, line in enumerate(text.splitlines())
             if line.startswith("#SBATCH"))
  srun = [line for line in text.splitlines() if line.startswith("srun ")]
  assert len(srun) == 1 and 'launch/run.sh" "${args[@]}"' in srun[0]
  assert 'args=("$@" --config.distributed.cluster_auto=True "--workdir=$WORKDIR")' in text
  assert "args+=(--config.resume=True)" in text and "has_checkpoint" in text


def _sbatch(tmp_path, *args, ntasks=2, wait=False, **env_extra):
  """Runs slurm.sbatch as sbatch would, with the recording srun; returns (Popen, fake dir)."""
  bin_dir, fake = str(tmp_path / "bin"), str(tmp_path / "slurm")
  fake_slurm.install(bin_dir, srun=fake_slurm.RECORDING_SRUN)
  env = fake_slurm.job_env(os.environ, bin_dir, fake, ntasks=ntasks, job_id="4242",
                           workdir=str(tmp_path / "run"), submit_dir=ROOT,
                           JAXVLA_JAX_PLUGIN="none", **env_extra)
  if wait:
    env["FAKE_SRUN_WAIT"] = "1"
  proc = subprocess.Popen(["bash", SBATCH, *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  return proc, fake


def _finish(proc, timeout=120) -> tuple[int, str, str]:
  try:
    out, err = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
  return proc.returncode, out, err


def _srun_argv(fake: str) -> list[str]:
  (call,) = fake_slurm.calls(fake, "srun")
  return call


def test_slurm_sbatch_resumes_exactly_when_the_workdir_holds_a_checkpoint(tmp_path):
  rc, _, err = _finish(_sbatch(tmp_path, "--config=configs/default.py:smoke",
                               "--config.seed=2")[0])
  assert rc == 0, err
  argv = _srun_argv(str(tmp_path / "slurm"))
  i = argv.index("bash")
  assert argv[:i] == ["--kill-on-bad-exit=1", "--cpu-bind=none"]
  assert argv[i + 1] == os.path.join(ROOT, "launch", "run.sh")
  assert argv[i + 2:] == ["--config=configs/default.py:smoke", "--config.seed=2",
                          "--config.distributed.cluster_auto=True",
                          f"--workdir={tmp_path / 'run'}"]
  assert "no checkpoint in the workdir: starting the run" in err

  # A (re)start once the run has written a checkpoint: the same job resumes it.
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "run" / "checkpoints"), 1)
  ckpt.save(3, {"x": np.zeros(2, np.float32)}, {})
  ckpt.close()
  os.remove(tmp_path / "slurm" / "srun.args")
  rc, _, err = _finish(_sbatch(tmp_path, "--config=configs/default.py:smoke",
                               "--config.seed=2", SLURM_RESTART_COUNT="1")[0])
  assert rc == 0, err
  argv = _srun_argv(str(tmp_path / "slurm"))
  assert argv[-3:] == ["--config.distributed.cluster_auto=True", f"--workdir={tmp_path / 'run'}",
                       "--config.resume=True"]
  assert "the workdir holds a checkpoint: resuming it" in err and "restart 1" in err


@pytest.mark.parametrize("ntasks, ids", [(1, "0,1,2,3,4,5,6,7"), (8, None)])
def test_slurm_sbatch_gives_a_task_per_node_all_its_gpus(tmp_path, ntasks, ids):
  rc, _, err = _finish(_sbatch(tmp_path, ntasks=ntasks, SLURM_GPUS_ON_NODE="8")[0])
  assert rc == 0, err
  argv = _srun_argv(str(tmp_path / "slurm"))
  given = [a.split("=", 1)[1] for a in argv
           if a.startswith("--config.distributed.local_device_ids=")]
  assert given == ([ids] if ids else [])  # a task per GPU: JAX picks GPU SLURM_LOCALID


@pytest.mark.parametrize("args, ntasks, env, names", [
    (("--workdir=/x",), 2, {}, "--workdir=/x: the workdir is set by JAXVLA_WORKDIR"),
    (("--config.resume=True",), 2, {}, "--config.resume=True: resume is decided"),
    (("--config.distributed.cluster_auto=False",), 2, {}, "cluster_auto"),
    (("--config.distributed.num_processes=4",), 2, {}, "num_processes"),
    ((), 3, dict(SLURM_GPUS_ON_NODE="8"), "3 tasks per node with 8 GPUs per node"),
    ((), 2, dict(SLURM_JOB_ID=""), "not inside a SLURM job"),
    ((), 2, dict(JAXVLA_ROOT="/nonexistent"), "no launch/run.sh under '/nonexistent'"),
])
def test_slurm_sbatch_refuses_with_one_line(tmp_path, args, ntasks, env, names):
  proc, fake = _sbatch(tmp_path, *args, ntasks=ntasks, **env)
  rc, out, err = _finish(proc)
  assert rc == 2 and out == "", (out, err)
  lines = [line for line in err.strip().splitlines() if not line.startswith("[slurm.sbatch]")]
  assert len(lines) == 1 and lines[0].startswith("slurm.sbatch: ") and names in lines[0], err
  assert fake_slurm.calls(fake, "srun") == []


def test_slurm_sbatch_usr1_stops_the_tasks_then_requeues(tmp_path):
  proc, fake = _sbatch(tmp_path, "--config=configs/default.py:smoke", wait=True)
  deadline = time.monotonic() + 60
  while not os.path.exists(os.path.join(fake, "srun.pid")):
    assert proc.poll() is None and time.monotonic() < deadline, _finish(proc)
    time.sleep(0.1)
  proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends before the time limit
  rc, _, err = _finish(proc)
  assert rc == 0, err  # the tasks stopped cleanly (jaxvla's Ctrl-C saves and exits 0)
  assert fake_slurm.calls(fake, "scancel") == [["--signal=INT", "4242"]]
  assert fake_slurm.calls(fake, "scontrol") == [["requeue", "4242"]]
  assert "requeueing job 4242" in err


# -------------------------------------------------------------- configs/tpu --
@pytest.mark.parametrize("arg", [None, "pi05", "pi0,libero_10/3"])
def test_tpu_config_validates_and_splits_its_batches_on_slices(arg):
  c = tpu.get_config(arg)
  config_checks.validate(c)
  assert (c.model.variant, c.model.dtype, c.model.remat) == ("full", "bfloat16", True)
  assert c.env_workers > 0 and c.num_envs % c.env_workers == 0
  assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == (1, -1, 1)
  for chips in (4, 16, 64, 128, 256):  # 4 chips per TPU VM (v5e, v5p multi-host)
    data, fsdp, tensor = sharding.resolve_mesh_shape(c.mesh, chips)
    assert (data, fsdp, tensor) == (1, chips, 1)
    config_checks.validate_batch_shards(c, data * fsdp, num_processes=chips // 4)
  # 8-GPU nodes under launch/slurm.sbatch: a process per node or per GPU.
  for processes in (4, 32):
    config_checks.validate_batch_shards(c, 32, num_processes=processes)
  # The variant the docstring gives for 256 chips (SigLIP's width divides by 128).
  with c.unlocked():
    c.mesh.data, c.mesh.fsdp = -1, 128
  assert sharding.resolve_mesh_shape(c.mesh, 256) == (2, 128, 1)
  config_checks.validate_batch_shards(c, 256, num_processes=64)
