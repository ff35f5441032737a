"""Plots a saved stage timeline, one lane per stage: ``python -m jaxvla.plot_timeline``.

This module owns the picture of a :class:`jaxvla.timing.StageClock` record: each
lane shows a stage's busy intervals (their union) with its busy fraction, so the
overlap of stages in an asynchronous run can be seen::

  python -m jaxvla.plot_timeline --intervals=WORKDIR/timeline.json --out=timeline.png

``--t0`` / ``--t1`` pick a window (seconds since the run's start); the default is
every interval in the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from jaxvla import timing

Interval = timing.Interval


def _merge(intervals: Iterable[Interval]) -> list[Interval]:
  """The union of ``intervals`` as sorted, disjoint intervals."""
  out: list[list[float]] = []
  for start, end in sorted(intervals):
    if end <= start:
      continue
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([start, end])
  return [(a, b) for a, b in out]


def _bounds(intervals: Mapping[str, Sequence[Interval]]) -> Interval:
  """The earliest start and the latest end over all stages (``(0, 1)`` when empty)."""
  starts = [s for ivs in intervals.values() for s, _ in ivs]
  ends = [e for ivs in intervals.values() for _, e in ivs]
  if not starts:
    return 0.0, 1.0
  return min(starts), max(ends)


def plot_timeline(intervals: Mapping[str, Sequence[Interval]], out_path: str, *,
                  t_range: tuple[float, float] | None = None, title: str = "") -> str:
  """Draws one lane per stage with its busy intervals and writes a PNG.

  Each lane shows the union of the stage's intervals inside the window and is
  labelled with the stage's busy fraction of the window, so the overlap of
  stages (env stepping while the learner trains) is visible at a glance.

  Args:
    intervals: stage -> ``[(start, end)]`` in seconds
      (:meth:`jaxvla.timing.StageClock.intervals` or
      :meth:`jaxvla.timing.StageClock.from_json`); lanes follow this order, top to
      bottom.
    out_path: the PNG to write; its directory is created.
    t_range: the window ``(t0, t1)`` in seconds; default: all intervals.
    title: the figure title.

  Returns:
    ``out_path``.
  """
  # Imported here, and no pyplot: importers that only sometimes plot (the pipeline
  # benchmark) never load matplotlib or touch pyplot's global figure state.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  lo, hi = t_range if t_range is not None else _bounds(intervals)
  if hi <= lo:
    raise ValueError(f"empty time range [{lo}, {hi}]")
  names = list(intervals)
  fig = Figure(figsize=(10, 1.0 + 0.6 * max(len(names), 1)))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  colors = [f"C{i % 10}" for i in range(len(names))]
  labels = []
  for lane, (name, color) in enumerate(zip(names, colors)):
    pieces = _merge((max(s, lo), min(e, hi)) for s, e in intervals[name])
    busy = sum(e - s for s, e in pieces) / (hi - lo)
    y = len(names) - 1 - lane  # The first stage on top.
    ax.broken_barh([(s, e - s) for s, e in pieces], (y - 0.4, 0.8), facecolors=color,
                   linewidth=0)
    labels.append((y, f"{name}\n{busy:.0%} busy"))
  ax.set_yticks([y for y, _ in labels], [text for _, text in labels])
  ax.set_ylim(-0.6, len(names) - 0.4)
  ax.set_xlim(lo, hi)
  ax.set_xlabel("seconds since start")
  ax.grid(axis="x", alpha=0.3)
  if title:
    ax.set_title(title, fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  fig.savefig(out_path, dpi=120)
  return out_path


def _cli() -> None:
  """``python -m jaxvla.plot_timeline``: plots a timeline JSON (flags defined only here)."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel

  intervals_path = flags.DEFINE_string("intervals", None, "StageClock.to_json file.",
                                       required=True)
  out = flags.DEFINE_string("out", None, "Output PNG path.", required=True)
  t0 = flags.DEFINE_float("t0", None, "Window start in seconds (default: first interval).")
  t1 = flags.DEFINE_float("t1", None, "Window end in seconds (default: last interval).")
  title = flags.DEFINE_string("title", "", "Plot title.")

  def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    intervals = timing.StageClock.from_json(intervals_path.value)
    lo, hi = _bounds(intervals)
    t_range = (lo if t0.value is None else t0.value, hi if t1.value is None else t1.value)
    print(plot_timeline(intervals, out.value, t_range=t_range, title=title.value))

  app.run(main)


if __name__ == "__main__":
  _cli()
