"""Stand-ins for SLURM's commands, to run ``launch/slurm.sbatch`` on one machine in tests.

:func:`install` writes ``srun``, ``scancel`` and ``scontrol`` into a directory to put
first on ``PATH``; :func:`job_env` is the environment ``sbatch`` would give the batch
script. The fake ``srun`` starts ``SLURM_NTASKS`` local copies of its command with the
variables the real one sets per task and JAX's SLURM detection reads
(``jax/_src/clusters/slurm_cluster.py``: ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``,
``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``), so the tasks join one job the
way they would on a cluster: through ``cluster_auto``, with the coordinator port JAX
derives from the job id. Each task's stdout and stderr go to
``$FAKE_SLURM_DIR/task<i>.out`` / ``.err``; every call's arguments are recorded in
``$FAKE_SLURM_DIR/<command>.args`` (a JSON list per line, read by :func:`calls`).
"""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import sys

# JAX's SLURM coordinator port: job id mod 2**12 in the top 4096 ports.
PORT_BASE = 65535 - 2**12 + 1

_SRUN = r'''#!{python}
"""Fake srun: SLURM_NTASKS local tasks of the command after the options."""
import json, os, subprocess, sys, time

args = sys.argv[1:]
fake = os.environ["FAKE_SLURM_DIR"]
with open(os.path.join(fake, "srun.args"), "a") as f:
  f.write(json.dumps(args) + "\n")
while args and args[0].startswith("-"):  # options (this file's callers use --opt=value)
  args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
procs = []
for i in range(n):
  env = dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_NODEID="0",
             SLURM_STEP_ID="0", SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
             SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS=str(n))
  out = open(os.path.join(fake, f"task{{i}}.out"), "w")
  err = open(os.path.join(fake, f"task{{i}}.err"), "w")
  procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL))
with open(os.path.join(fake, "srun.pid"), "w") as f:
  f.write(" ".join(str(p.pid) for p in procs))
# --kill-on-bad-exit: one failed task ends the others (they would wait for it).
while any(p.poll() is None for p in procs):
  if any(p.poll() not in (None, 0) for p in procs):
    for p in procs:
      if p.poll() is None:
        p.kill()
  time.sleep(0.2)
sys.exit(int(any(p.returncode != 0 for p in procs)))
'''

# An srun that starts nothing: it records its arguments, then exits 0 at once, or with
# FAKE_SRUN_WAIT=1 when a SIGINT arrives (as tasks stopped by jaxvla's Ctrl-C do).
RECORDING_SRUN = r'''#!{python}
import json, os, signal, sys, time
fake = os.environ["FAKE_SLURM_DIR"]
with open(os.path.join(fake, "srun.args"), "a") as f:
  f.write(json.dumps(sys.argv[1:]) + "\n")
if os.environ.get("FAKE_SRUN_WAIT") == "1":
  signal.signal(signal.SIGINT, lambda *_: sys.exit(0))  # (bash started it with INT ignored)
  with open(os.path.join(fake, "srun.pid"), "w") as f:
    f.write(str(os.getpid()))
  time.sleep(120)
  sys.exit(3)  # no signal came
'''

# Records its arguments; scancel --signal=SIG sends SIG to the fake srun's tasks.
_SCANCEL = r'''#!{python}
import json, os, signal, sys
fake = os.environ["FAKE_SLURM_DIR"]
with open(os.path.join(fake, "scancel.args"), "a") as f:
  f.write(json.dumps(sys.argv[1:]) + "\n")
sig = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--signal=")), "TERM")
try:
  pids = open(os.path.join(fake, "srun.pid")).read().split()
except FileNotFoundError:
  pids = []
for pid in pids:
  try:
    os.kill(int(pid), getattr(signal, "SIG" + sig))
  except ProcessLookupError:
    pass
'''

_SCONTROL = r'''#!{python}
import json, os, sys
with open(os.path.join(os.environ["FAKE_SLURM_DIR"], "scontrol.args"), "a") as f:
  f.write(json.dumps(sys.argv[1:]) + "\n")
'''


def install(bin_dir: str, srun: str | None = None) -> None:
  """Writes the fake commands into ``bin_dir`` (``srun``: another srun script's text)."""
  os.makedirs(bin_dir, exist_ok=True)
  for name, text in (("srun", srun or _SRUN), ("scancel", _SCANCEL), ("scontrol", _SCONTROL)):
    path = os.path.join(bin_dir, name)
    with open(path, "w", encoding="utf-8") as f:
      f.write(text.format(python=sys.executable) if text.startswith("#!{python}") else text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def free_job_id() -> str:
  """A job id whose derived coordinator port (``PORT_BASE + id % 4096``) is free now."""
  for _ in range(200):
    port = random.randrange(PORT_BASE, 65536)
    with socket.socket() as s:
      try:
        s.bind(("localhost", port))
      except OSError:
        continue
    return str(4096 * 1000 + port - PORT_BASE)
  raise RuntimeError(f"no free port in [{PORT_BASE}, 65535]")


def job_env(base: dict, bin_dir: str, fake_dir: str, *, ntasks: int, job_id: str,
            workdir: str, submit_dir: str, **extra: str) -> dict:
  """The batch script's environment: ``base`` without any cluster's variables, plus
  what ``sbatch`` sets for a one-node job of ``ntasks`` tasks (``extra`` on top)."""
  env = {k: v for k, v in base.items()
         if not k.startswith(("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR", "JAX_PROCESS",
                              "JAX_NUM_PROCESSES", "JAX_LOCAL_DEVICE_IDS"))
         and k not in ("CUDA_VISIBLE_DEVICES", "JAXVLA_WORKDIR", "JAXVLA_JAX_PLUGIN")}
  os.makedirs(fake_dir, exist_ok=True)
  env.update(PATH=bin_dir + os.pathsep + base.get("PATH", ""), FAKE_SLURM_DIR=fake_dir,
             SLURM_JOB_ID=job_id, SLURM_JOB_NAME="jaxvla-test", SLURM_SUBMIT_DIR=submit_dir,
             SLURM_NTASKS=str(ntasks), SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1",
             SLURM_JOB_NODELIST="localhost", JAXVLA_WORKDIR=workdir)
  env.update(extra)
  return env


def calls(fake_dir: str, command: str) -> list[list[str]]:
  """The argument lists of every call of ``command``, in order ([] if never called)."""
  path = os.path.join(fake_dir, f"{command}.args")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]
