"""Entry point: ``python -m jaxvla.main --config=configs/X.py[:variant] [--workdir=DIR]``.

``--workdir`` defaults to ``workdirs/<timestamp>`` (a single-process run; the
processes of a multi-host run must be given one shared directory).

Parses flags only; the job is :func:`jaxvla.train.train_and_evaluate`. The last
line on stdout is the run's summary as one JSON object.
"""

import json
import logging
import os
import shlex
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

# Only light modules here: flags and configs are parsed (and a typo reported) before the
# training stack (flax, orbax, the data and env libraries: seconds) is imported, and a
# direct start re-executes under launch/env.sh (simulator_env.ensure) before it is, too.
from jaxvla import config_files, simulator_env
from jaxvla.storage import workdir as workdir_lib

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "Config file (optionally ':variant').", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints and metrics (default: workdirs/<timestamp>).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Started without launch/run.sh: the simulators' environment (launch/env.sh) is applied
  # by re-executing this command with it, before any simulator or backend loads.
  simulator_env.ensure()
  # pylint: disable=import-outside-toplevel
  from jaxvla import train
  from jaxvla.parallel import distributed
  from jaxvla.storage import checkpoint
  # pylint: enable=import-outside-toplevel
  # Errors whose message says all a user needs (the step, file or holder): one line on
  # stderr and exit status 1, without a traceback.
  one_line_errors = (checkpoint.CheckpointError, workdir_lib.WorkdirInUse, FileNotFoundError)
  # Library INFO chatter (orbax, jax) off; jaxvla's own INFO lines stay.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("jaxvla").setLevel(logging.INFO)
  # Multi-host: join the job before anything touches a JAX backend.
  distributed.initialize(_CONFIG.value.distributed)
  workdir = _WORKDIR.value
  if workdir is None:
    if distributed.multi_process():  # Each process would pick its own timestamp.
      raise app.UsageError("a multi-host run needs --workdir: one directory shared by every "
                           "process")
    workdir = workdir_lib.default_workdir()
    logging.getLogger("jaxvla").info("workdir: %s", workdir)
  try:
    summary = train.train_and_evaluate(_CONFIG.value, workdir)
  except one_line_errors as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(1)
  except Exception as e:  # pylint: disable=broad-except
    lost = distributed.lost_processes(e)
    if lost is None:
      raise
    _exit_lost(distributed.describe_processes(lost), workdir,
               checkpoint.saved_steps(os.path.join(workdir, "checkpoints")))
  sys.stdout.write(json.dumps(summary) + "\n")
  sys.stdout.flush()


def _exit_lost(lost: str, workdir: str, saved: list[int]) -> None:
  """Ends a multi-process run that lost a process: one line naming it, the last finished
  checkpoint and the resume command, then exit status 1 at once. A normal exit would
  wait for the lost process in JAX's shutdown barrier until the heartbeat timeout and
  then abort with a C++ trace. ``lost``: who (``distributed.describe_processes``);
  ``saved``: the workdir's finished checkpoint steps."""
  import jax  # pylint: disable=import-outside-toplevel
  resume = [a for a in sys.argv[1:] if not a.startswith("--config.resume")]
  command = shlex.join(["python", "-m", "jaxvla.main", *resume, "--config.resume=True"])
  where = (f"the last finished checkpoint is {saved[-1]} in {workdir}/checkpoints"
           if saved else f"{workdir} holds no finished checkpoint")
  sys.stderr.write(f"error: {lost} was lost; the run stops "
                   f"(this is process {jax.process_index()}); {where}; to resume, "
                   f"start every process again with: {command}\n")
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(1)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(main, flags_parser=config_files.parse_flags)
