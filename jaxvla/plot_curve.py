"""Plots a run's learning curve from its ``metrics.jsonl``.

``python -m jaxvla.plot_curve --workdir=DIR --out=docs/results/learning_curve.png``
draws evaluation success (and the warm-start level) and the recent training
success against RL env steps. In a notebook, ``plot(load(workdir))`` returns the
figure (shown inline) without writing a file.
"""

from __future__ import annotations

import os

import matplotlib
import matplotlib.pyplot as plt
from absl import app, flags

from jaxvla import metrics

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding metrics.jsonl.",
                               required=True)
_OUT = flags.DEFINE_string("out", "docs/results/learning_curve.png", "Output PNG path.")
_TITLE = flags.DEFINE_string("title", "jaxvla default run (ColorReach, tiny flow VLA, PPO)",
                             "Plot title.")


def load(workdir: str) -> dict[str, list[dict]]:
  out: dict[str, list[dict]] = {}
  for rec in metrics.records(workdir):
    out.setdefault(rec["phase"], []).append(rec)
  return out


def plot(records: dict[str, list[dict]], out: str | None = None,
         title: str = "ColorReach, tiny flow VLA, PPO") -> matplotlib.figure.Figure:
  """Draws the curve of :func:`load`'s ``records``; writes it to ``out`` (a PNG) if given."""
  fig, ax = plt.subplots(figsize=(7, 4))
  ev = records.get("eval", [])
  warm = records.get("warm_start", [])
  xs = [0] + [r["env_steps"] for r in ev]
  ys = [warm[0]["success_rate"] if warm else float("nan")] + [r["success_rate"] for r in ev]
  ax.plot(xs, ys, "o-", label="evaluation success (deterministic sampler)")
  tr = [r for r in records.get("train", []) if "success_rate" in r]
  ax.plot([r["env_steps"] for r in tr], [r["success_rate"] for r in tr], alpha=0.6,
          label="training episodes (stochastic sampler, last 256)")
  if warm:
    ax.axhline(warm[0]["success_rate"], color="gray", ls="--", label="warm start (BC) alone")
  ax.set_xlabel("RL env steps")
  ax.set_ylabel("success rate")
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right", fontsize=8)
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
  return fig


def main(argv):
  del argv
  # A file, never a window (set here, not at import: a notebook keeps its inline backend).
  matplotlib.use("Agg")
  plot(load(_WORKDIR.value), _OUT.value, _TITLE.value)
  print(_OUT.value)


if __name__ == "__main__":
  app.run(main)
