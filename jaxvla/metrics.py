"""Run metrics: ``metrics.jsonl`` and TensorBoard event files in the workdir, and a progress bar."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import tqdm

from jaxvla.progress import on_terminal
from jaxvla.storage import jsonl

log = logging.getLogger(__name__)

FILE = "metrics.jsonl"


def records(workdir: str, phase: str | None = None) -> list[dict]:
  """The complete records of ``workdir/metrics.jsonl`` (of ``phase`` only, if given),
  in order; ``[]`` before the run has written one. Safe while the run still writes."""
  rows = jsonl.read_if_exists(os.path.join(workdir, FILE))
  return rows if phase is None else [r for r in rows if r.get("phase") == phase]


def _import_tensorboardx():
  """tensorboardX, imported without torch where torch is not loaded yet.

  Its writer module imports torch, if installed, only to accept torch tensors (the
  simulators install the CPU torch): 1.3 CPU-seconds in every process that writes
  metrics, for values that are NumPy scalars here. A ``None`` entry in ``sys.modules``
  makes that ``import torch`` fail as if torch were absent, which tensorboardX handles;
  the entry is removed at once, so a later ``import torch`` (a simulator in this
  process) loads it as usual.
  """
  if "torch" in sys.modules:
    import tensorboardX  # pylint: disable=import-outside-toplevel
    return tensorboardX
  sys.modules["torch"] = None
  try:
    import tensorboardX  # pylint: disable=import-outside-toplevel
  finally:
    del sys.modules["torch"]
  return tensorboardX


tensorboardX = _import_tensorboardx()


class MetricWriter:
  """Appends one JSON object per record to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

  Args:
    workdir: the run directory; events go to ``workdir/tb``.
    enabled: False: write nothing (the non-primary processes of a multi-host run).
  """

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, FILE)
    if os.path.exists(path) and (cut := jsonl.cut_torn(path)):
      # A killed run's torn last line would run into the next record.
      log.warning("%s: cut its torn last line (%d bytes, written when the run was killed)",
                  path, cut)
    self._jsonl = open(path, "a", encoding="utf-8")
    self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, env_steps: int, phase: str, metrics: dict[str, float]) -> None:
    """Records ``metrics`` under ``phase/`` at x-axis ``env_steps``."""
    if not self.enabled:
      return
    record = dict(phase=phase, env_steps=int(env_steps), time=time.time(),
                  **{k: float(v) for k, v in metrics.items()})
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for k, v in metrics.items():
      self._tb.add_scalar(f"{phase}/{k}", float(v), int(env_steps))

  def resume_from(self, env_steps: int) -> int:
    """A resume from a checkpoint at ``env_steps``: the records the interrupted process
    wrote after it (their steps are trained again) leave ``metrics.jsonl`` for
    ``metrics.discarded.jsonl``, and TensorBoard purges its events past it, so the
    curves continue instead of repeating a range. Returns how many records moved.
    """
    if not self.enabled:
      return 0
    self._jsonl.close()
    path = self._jsonl.name
    keep, moved = [], []
    for record in jsonl.read(path):
      (moved if record["env_steps"] > env_steps else keep).append(json.dumps(record) + "\n")
    if moved:
      with open(path[:-len(".jsonl")] + ".discarded.jsonl", "a", encoding="utf-8") as f:
        f.writelines(moved)
      tmp = path + ".tmp"
      with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(keep)
      os.replace(tmp, path)
    self._jsonl = open(path, "a", encoding="utf-8")
    logdir = self._tb.logdir
    self._tb.close()
    self._tb = tensorboardX.SummaryWriter(logdir, purge_step=env_steps + 1)
    return len(moved)

  def close(self) -> None:
    if not self.enabled:
      return
    self._jsonl.close()
    self._tb.close()


class Progress:
  """A tqdm bar over env steps showing throughput, success rate and loss (on a terminal)."""

  def __init__(self, total: int, initial: int, enabled: bool):
    self._bar = tqdm.tqdm(total=total, initial=initial, unit="step",
                          disable=not (enabled and on_terminal()), dynamic_ncols=True,
                          desc="env steps")
    self._postfix: dict[str, str] = {}

  def update(self, env_steps: int, **fields: float) -> None:
    self._bar.update(env_steps - self._bar.n)
    self._postfix.update({k: f"{v:.3g}" for k, v in fields.items()})
    self._bar.set_postfix(self._postfix, refresh=False)

  def close(self) -> None:
    self._bar.close()
