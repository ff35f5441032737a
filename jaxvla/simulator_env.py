"""The simulators' run-time environment for a process not started by ``launch/``.

``launch/env.sh`` is the one definition of that environment (the Vulkan ICD and
library path for ManiSkill3 on CPU, MuJoCo's GL backend, thread counts, ...).
:func:`ensure` applies it to a process started directly (``python -m
jaxvla.main``): it asks bash what sourcing ``env.sh`` changes and, if anything,
re-executes the same command line with it, since the dynamic loader reads
``LD_LIBRARY_PATH`` only at process start. The pid stays the same (``execve``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

ENV_SH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch",
                      "env.sh")
_MARK = "JAXVLA_RUNTIME_ENV"  # Set in the re-executed process: never re-execute twice.
_SEP = "--jaxvla-env-sh--"


def changes(environ: dict[str, str] | None = None) -> dict[str, str]:
  """The variables sourcing ``launch/env.sh`` would set or change in ``environ``.

  Empty when there is no ``launch/env.sh`` (an installed package, not a checkout).
  """
  environ = dict(os.environ if environ is None else environ)
  if not os.path.exists(ENV_SH):
    return {}
  script = f'env -0; printf "\\0{_SEP}\\0"; source "$1" >/dev/null; env -0'
  out = subprocess.run(["bash", "-c", script, "env.sh", ENV_SH], env=environ,
                       capture_output=True, check=True).stdout.decode()
  before, after = (dict(kv.split("=", 1) for kv in part.split("\0") if "=" in kv)
                   for part in out.split(f"\0{_SEP}\0"))
  return {k: v for k, v in after.items() if before.get(k) != v and environ.get(k) != v}


def ensure() -> None:
  """Re-executes this process under ``launch/env.sh``'s environment if it lacks it."""
  if os.environ.get(_MARK):
    return
  needed = changes()
  if not needed:
    return
  log.info("applying launch/env.sh (%s) and restarting the process", ", ".join(sorted(needed)))
  env = dict(os.environ, **needed, **{_MARK: "1"})
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
