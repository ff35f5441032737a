"""A run's working directory: its default name and the exclusive lock on it.

Two runs writing one workdir interleave ``metrics.jsonl``, overwrite each other's
``config.json`` and rotate each other's checkpoints. :class:`WorkdirLock` takes
an exclusive ``fcntl.flock`` on ``<workdir>/.lock`` (process 0 alone in a
multi-host run) and writes its holder there (host, pid, start time), so a
refused run names the holder. The kernel drops a flock when its process dies, so
a lock left by a killed run is taken over; the previous holder is named in a
warning.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import time

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


def default_workdir(now: datetime.datetime | None = None) -> str:
  """``workdirs/<YYYYmmdd-HHMMSS>`` under the current directory (``--workdir`` unset)."""
  now = now or datetime.datetime.now()
  return os.path.join("workdirs", now.strftime("%Y%m%d-%H%M%S"))


class WorkdirInUse(RuntimeError):
  """Another live process holds the workdir."""


class WorkdirLock:
  """Exclusive use of ``workdir`` while held; a context manager.

  Args:
    workdir: created if missing.
    enabled: False on the processes of a multi-host run other than process 0
      (they share process 0's workdir and its lock).
  """

  def __init__(self, workdir: str, enabled: bool = True):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.enabled = enabled
    self._fd: int | None = None

  def acquire(self) -> None:
    if not self.enabled:
      return
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read_holder(fd)
      os.close(fd)
      raise WorkdirInUse(
          f"workdir {os.path.dirname(self.path)!r} is in use by {_describe(holder)}; "
          "choose another --workdir or stop that run") from None
    previous = _read_holder(fd)
    if previous:  # Its process died without releasing the lock (killed, crashed).
      log.warning("workdir %s: taking over the lock of %s, which is no longer running",
                  os.path.dirname(self.path), _describe(previous))
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(dict(host=socket.gethostname(), pid=os.getpid(),
                                 started=time.strftime("%Y-%m-%d %H:%M:%S"))).encode())
    os.fsync(fd)
    self._fd = fd

  def release(self) -> None:
    if self._fd is None:
      return
    # Cleared first, so the next run sees a clean release rather than a dead holder.
    os.ftruncate(self._fd, 0)
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _read_holder(fd: int) -> dict:
  os.lseek(fd, 0, os.SEEK_SET)
  raw = os.read(fd, 4096)
  try:
    return json.loads(raw) if raw else {}
  except ValueError:
    return {"unreadable": raw[:80].decode(errors="replace")}


def _describe(holder: dict) -> str:
  if "pid" in holder:
    return f"pid {holder['pid']} on {holder.get('host', '?')} (started {holder.get('started', '?')})"
  return f"another process ({holder})" if holder else "another process"
