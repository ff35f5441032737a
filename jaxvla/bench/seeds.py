"""Seed robustness of a run config: ``python -m jaxvla.bench.seeds``.

Runs ``--config`` (by default the main job, ``configs/default.py``) at every seed of
``--seeds``, each as ``bash launch/run.sh --config.seed=N`` would, in two parts: the warm
start (a run with no RL budget writes checkpoint 0) and the RL resumed from a copy of it,
which starts exactly as the one run would have (``jaxvla.bench.parity``'s protocol, whose
functions this uses). Warm starts are kept in ``--warm_dir``, so configs that differ only
in their RL settings share them.

Prints and writes to ``--out`` (``results.json``, ``table.md``, ``curves.png``) a row per
seed: the warm start's and the final success, the wall time (warm start + RL), and the
curve of every evaluation; then the mean, the spread and the worst seed. Finished seeds
are kept: a rerun with the same ``--out`` does only the missing ones.

  python -m jaxvla.bench.seeds --out=/tmp/seeds --seeds=0-9
  python -m jaxvla.bench.seeds --out=/tmp/seeds_lr --warm_dir=/tmp/seeds \\
      --config.rl.learning_rate=2e-4
"""

from __future__ import annotations

import json
import os
import statistics

from absl import app, flags
from ml_collections import config_flags

from jaxvla import config_files, metrics
from jaxvla.bench import parity

SYNC = parity.SYNC


def parse_seeds(spec: list[str]) -> list[int]:
  """``['0-3', '7']`` -> ``[0, 1, 2, 3, 7]``.

  Raises:
    ValueError: naming an entry that is neither ``N`` nor ``A-B`` with ``A <= B``.
  """
  seeds = []
  for item in spec:
    lo, sep, hi = item.partition("-")
    try:
      first, last = int(lo), int(hi) if sep else int(lo)
    except ValueError:
      raise ValueError(f"--seeds: {item!r} is neither N nor A-B") from None
    if last < first:
      raise ValueError(f"--seeds: {item!r} is an empty range")
    seeds.extend(range(first, last + 1))
  return seeds


def curve(workdir: str) -> list[tuple[int, float]]:
  """``(env_steps, success_rate)`` of every evaluation in ``workdir/metrics.jsonl``,
  the warm start's first."""
  return [(int(row["env_steps"]), float(row["success_rate"]))
          for row in metrics.records(workdir) if row.get("phase") in ("warm_start", "eval")]


def warm_wall_s(warm_dir: str) -> float:
  """The warm start's wall time (its run's summary)."""
  return float(metrics.records(warm_dir, "summary")[-1]["wall_s"])


def table(rows: dict[int, dict], threshold: float) -> str:
  """Markdown: a row per seed (warm start, final, wall minutes, curve), then the mean ±
  std, the range and how many seeds ended at ``threshold`` or above."""
  lines = ["| seed | warm start | final | wall (min) | evaluations (every 10 updates) |",
           "|---|---:|---:|---:|---|"]
  for seed, r in sorted(rows.items()):
    lines.append(f"| {seed} | {r['warm_start']:.3f} | {r['final']:.3f} | "
                 f"{r['wall_s'] / 60:.1f} | {' '.join(f'{s:.2f}' for _, s in r['curve'])} |")
  finals = [r["final"] for r in rows.values()]
  if finals:
    lines.append(f"| mean ± std | {statistics.mean(r['warm_start'] for r in rows.values()):.3f} "
                 f"| {statistics.mean(finals):.3f} ± {statistics.pstdev(finals):.3f} | | "
                 f"range {min(finals):.3f}–{max(finals):.3f}; "
                 f"{sum(f >= threshold for f in finals)} of {len(finals)} at {threshold} or "
                 "above |")
  return "\n".join(lines)


def plot(rows: dict[int, dict], path: str, title: str = "") -> None:
  """Every seed's curve (success over RL env steps) into the PNG ``path``."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for seed, r in sorted(rows.items()):
    ax.plot([x / 1000 for x, _ in r["curve"]], [y for _, y in r["curve"]], marker=".",
            label=f"seed {seed}")
  ax.set_xlabel("RL env steps (thousands)")
  ax.set_ylabel("evaluation success")
  ax.set_ylim(0, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(ncol=2, fontsize=8, loc="lower right")
  if title:
    ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _define_flags() -> None:
  config_flags.DEFINE_config_file("config", "configs/default.py", "The run config.")
  flags.DEFINE_string("out", None, "Directory for the runs, results.json and table.md.",
                      required=True)
  flags.DEFINE_list("seeds", ["0-9"], "Seeds: N or A-B, comma-separated.")
  flags.DEFINE_string("warm_dir", None, "Where the warm starts live (default: --out).")
  flags.DEFINE_float("threshold", 0.8, "The success every seed should reach (for the count).")


def main(argv: list[str]) -> None:
  del argv
  f = flags.FLAGS
  out = os.path.abspath(f.out)
  warm_root = os.path.abspath(f.warm_dir or out)
  os.makedirs(out, exist_ok=True)
  results: dict = {}
  path = os.path.join(out, "results.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as fp:
      results = json.load(fp)
  rows = {}
  for seed in parse_seeds(f.seeds):
    parity.run_seed(f.config, out, seed, [SYNC], "l1", 0, results, warm_root)
    r = results[f"seed{seed}/{SYNC}"]
    rows[seed] = dict(warm_start=r["warm_start_success_rate"], final=r["success_rate"],
                      wall_s=warm_wall_s(os.path.join(warm_root, f"seed{seed}", "warm_start"))
                      + r["wall_s"],
                      curve=curve(os.path.join(out, f"seed{seed}", SYNC)))
  text = table(rows, f.threshold)
  with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as fp:
    fp.write(text + "\n")
  plot(rows, os.path.join(out, "curves.png"))
  print(text)


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=config_files.parse_flags)
