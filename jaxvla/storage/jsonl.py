"""JSON-lines files that a process appends to while others read them.

A run's ``metrics.jsonl``, its schedule logs and ``jaxvla.eval``'s ``episodes.jsonl``
are written one record per line. A reader can meet the last line half-written: the
writer may be mid-``write`` (Linux does not make a file write atomic to a concurrent
read), or it was killed there (SIGKILL, preemption, OOM). Only lines ending in a newline
are records; :func:`read` is the one reader that knows this.
"""

from __future__ import annotations

import json
import os


def read(path: str) -> list[dict]:
  """The complete records of ``path``, in order; blank lines are skipped.

  Args:
    path: a JSON-lines file.

  Returns:
    One dict per complete line.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: a complete line is not a JSON object (naming the file and line).
  """
  with open(path, "rb") as f:
    data = f.read()
  complete = data[:data.rfind(b"\n") + 1]
  records = []
  for number, line in enumerate(complete.decode("utf-8").split("\n"), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}, line {number}: not a JSON record ({e})") from None
    if not isinstance(record, dict):
      raise ValueError(f"{path}, line {number}: not a JSON record (a "
                       f"{type(record).__name__}, not an object)")
    records.append(record)
  return records


def read_if_exists(path: str) -> list[dict]:
  """:func:`read`, or ``[]`` when ``path`` does not exist yet."""
  return read(path) if os.path.exists(path) else []


def cut_torn(path: str, block: int = 1 << 16) -> int:
  """Truncates ``path`` after its last newline, so that the next append starts a clean
  line; for a writer taking over a killed run's file (never while another process
  still appends). Reads only the file's tail. Returns how many bytes were cut.

  Raises:
    FileNotFoundError: ``path`` does not exist.
  """
  with open(path, "r+b") as f:
    end = pos = f.seek(0, os.SEEK_END)
    keep = 0
    while pos > 0:
      start = max(0, pos - block)
      f.seek(start)
      newline = f.read(pos - start).rfind(b"\n")
      if newline >= 0:
        keep = start + newline + 1
        break
      pos = start
    if keep != end:
      f.truncate(keep)
  return end - keep
