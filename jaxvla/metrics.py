"""Run metrics: ``metrics.jsonl`` and TensorBoard event files in the workdir, and a progress bar."""

from __future__ import annotations

import json
import os
import time

import tensorboardX
import tqdm


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
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
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

  def close(self) -> None:
    if not self.enabled:
      return
    self._jsonl.close()
    self._tb.close()


class Progress:
  """A tqdm bar over env steps showing throughput, success rate and loss."""

  def __init__(self, total: int, initial: int, enabled: bool):
    self._bar = tqdm.tqdm(total=total, initial=initial, unit="step", disable=not enabled,
                          dynamic_ncols=True, desc="env steps")
    self._postfix: dict[str, str] = {}

  def update(self, env_steps: int, **fields: float) -> None:
    self._bar.update(env_steps - self._bar.n)
    self._postfix.update({k: f"{v:.3g}" for k, v in fields.items()})
    self._bar.set_postfix(self._postfix, refresh=False)

  def close(self) -> None:
    self._bar.close()
