"""Learning parity of the async pipeline: ``python -m jaxvla.bench.parity``.

For each seed: one warm start (a run with no RL budget writes checkpoint 0), then a
copy of that workdir resumed into every pipeline of ``--pipelines`` at the same
env-step budget: ``sync`` is ``sync_colocated``, ``kN`` the async pipeline with
``max_staleness=N`` and ``--correction`` (``k0``: the async machinery held to fresh
data, the control that separates staleness from the rest). ``--levels`` picks the async
levels: ``l1`` (rollout thread || learner, lockstep envs: deterministic, what
``tests/test_learning.py`` runs) or ``full`` (L1 + L2 first-ready env batching in
``--env_workers`` processes + L3 streamed learner). The streamer makes one pass over
each batch without minibatch advantage statistics, so with ``full`` every run, the
sync one included, trains with ``rl.num_epochs=1`` and ``rl.advantage_norm='none'``:
the pipeline is the only difference between the columns.

Prints one row per seed (evaluation success of each pipeline, warm start, mean
staleness), the mean and spread per column and each async column's gap to sync;
writes ``results.json`` and ``table.md`` to ``--out``. Finished runs are kept: a
rerun with the same ``--out`` does only the missing ones. Config overrides go after
the config, e.g. ``--config.rl.learning_rate=5e-5``.

  python -m jaxvla.bench.parity --out=/tmp/parity --seeds=3,4,5,6,7 \\
      --pipelines=sync,k0,k1,k2,k4,k8 --levels=full
"""

from __future__ import annotations

import json
import os
import shutil
import statistics

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from jaxvla import config_checks, train

LEVELS = ("l1", "full")
KEYS = ("success_rate", "warm_start_success_rate", "staleness_mean", "env_steps",
        "dropped_env_steps", "policy_version", "wall_s")


SYNC = "sync"


def parse_pipeline(name: str) -> int | None:
  """``'sync'`` -> None (sync_colocated); ``'kN'`` -> N (async, ``max_staleness=N``).

  Raises:
    ValueError: naming ``name`` if it is neither.
  """
  if name == SYNC:
    return None
  if name.startswith("k") and name[1:].isdigit():
    return int(name[1:])
  raise ValueError(f"a pipeline is 'sync' or 'kN' (async with max_staleness=N), got {name!r}")


def run_config(base: ml_collections.ConfigDict, seed: int, pipeline: str, levels: str,
               env_workers: int = 2, correction: str = "decoupled") -> ml_collections.ConfigDict:
  """``base`` for one run of ``pipeline`` (:func:`parse_pipeline`); async runs use
  ``correction`` (``rl.correction``). ``k0`` is the async machinery held to fresh
  data: the control that separates staleness from the rest of the async pipeline.

  Raises:
    ValueError: an unknown ``levels`` or ``pipeline``.
  """
  if levels not in LEVELS:
    raise ValueError(f"levels must be one of {LEVELS}, got {levels!r}")
  staleness = parse_pipeline(pipeline)
  c = ml_collections.ConfigDict(base.to_dict())
  c.seed = seed
  if levels == "full":
    c.rl.update(config_checks.STREAMER_PPO)
  if staleness is not None:
    p = c.pipeline
    p.mode = "async"
    p.max_staleness = staleness
    c.rl.correction = correction
    if levels == "l1":
      p.train_async, p.rollout_async, p.streamer = True, False, False
      # Room for the rollout to run as far ahead as the bound lets it.
      p.queue_items = 4 * staleness + 4
    else:
      c.env_workers = env_workers
      p.train_async, p.rollout_async, p.streamer = True, True, True
      p.queue_items = (4 * staleness + 4) * (c.num_envs // p.micro_batch_segments)
  return c


def check_runs(base: ml_collections.ConfigDict, seeds: list[int], pipelines: list[str],
               levels: str, env_workers: int, correction: str = "decoupled") -> None:
  """Every run's config checked before any runs, so that a pipeline the config cannot
  make (e.g. a streamer whose minibatches do not divide the update's queue items) fails
  at the start, not after the warm starts and the runs before it.

  Raises:
    ValueError: naming the pipeline and the config key.
  """
  for pipeline in pipelines:
    for seed in seeds:
      c = run_config(base, seed, pipeline, levels, env_workers, correction)
      try:
        config_checks.validate(c)
      except ValueError as e:
        raise ValueError(f"--pipelines={pipeline} (--levels={levels}): {e}") from None


def run_seed(base: ml_collections.ConfigDict, out: str, seed: int, pipelines: list[str],
             levels: str, env_workers: int, results: dict, warm_root: str,
             correction: str = "decoupled") -> None:
  """The warm start of ``seed`` (in ``warm_root``, made once) and every pipeline not yet
  in ``results`` (updated, saved)."""
  warm_dir = os.path.join(warm_root, f"seed{seed}", "warm_start")
  if not os.path.exists(os.path.join(warm_dir, "done")):
    shutil.rmtree(warm_dir, ignore_errors=True)
    c = run_config(base, seed, SYNC, levels)
    c.total_env_steps = 0
    train.train_and_evaluate(c, warm_dir)
    open(os.path.join(warm_dir, "done"), "w").close()
  for pipeline in pipelines:
    name = f"seed{seed}/{pipeline}"
    if name in results:
      continue
    workdir = os.path.join(out, f"seed{seed}", pipeline)
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(warm_dir, workdir)
    c = run_config(base, seed, pipeline, levels, env_workers, correction)
    c.resume = True
    summary = train.train_and_evaluate(c, workdir)
    results[name] = {key: summary[key] for key in KEYS}
    logging.info("%s: %s", name, results[name])
    _save_json(out, results)


def _save_json(out: str, results: dict) -> None:
  tmp = os.path.join(out, "results.json.tmp")
  with open(tmp, "w") as f:
    json.dump(results, f, indent=1, sort_keys=True)
  os.replace(tmp, os.path.join(out, "results.json"))


def table(results: dict, seeds: list[int], pipelines: list[str]) -> str:
  """Markdown: a row per seed (success, and mean staleness of async runs), then the mean
  (± std over seeds) and each async column's gap to sync (mean, and the worst seed)."""
  col = lambda p: p if p == SYNC else f"k={parse_pipeline(p)}"
  lines = ["| seed | warm start | " + " | ".join(col(p) for p in pipelines) + " |",
           "|---" * (len(pipelines) + 2) + "|"]
  get = lambda s, p: results.get(f"seed{s}/{p}")
  for s in seeds:
    row = [get(s, p) for p in pipelines]
    warm = next((r["warm_start_success_rate"] for r in row if r), None)
    cell = lambda r, p: "" if r is None else (
        f"{r['success_rate']:.3f}" + ("" if p == SYNC else f" ({r['staleness_mean']:.1f})"))
    lines.append(f"| {s} | {'' if warm is None else f'{warm:.3f}'} | "
                 + " | ".join(cell(r, p) for r, p in zip(row, pipelines)) + " |")
  means, gaps = [], []
  for p in pipelines:
    xs = [get(s, p)["success_rate"] for s in seeds if get(s, p)]
    means.append(f"{statistics.mean(xs):.3f} ± {statistics.pstdev(xs):.3f}" if xs else "")
    pairs = [get(s, p)["success_rate"] - get(s, SYNC)["success_rate"]
             for s in seeds if get(s, p) and get(s, SYNC)]
    gaps.append("" if p == SYNC or not pairs else
                f"{statistics.mean(pairs):+.3f} (worst {min(pairs):+.3f})")
  lines.append("| mean ± std | | " + " | ".join(means) + " |")
  lines.append("| gap to sync | | " + " | ".join(gaps) + " |")
  return "\n".join(lines)


def _define_flags() -> None:
  """The command line's flags (defined only when run as a program: tests import
  :func:`run_config` next to other modules' flags)."""
  config_flags.DEFINE_config_file(
      "config", "configs/default.py:parity", "Base config (its seed is replaced by --seeds).")
  flags.DEFINE_string("out", None, "Directory for the runs, results.json and table.md.",
                      required=True)
  flags.DEFINE_list("seeds", ["3", "4", "5", "6", "7"], "Seeds (one warm start each).")
  flags.DEFINE_list("pipelines", [SYNC, "k1", "k2", "k4", "k8"],
                    "'sync': sync_colocated; 'kN': async with max_staleness=N.")
  flags.DEFINE_enum("levels", "full", list(LEVELS), "Async levels (see the docstring).")
  flags.DEFINE_integer("env_workers", 2, "Env worker processes (levels=full).")
  flags.DEFINE_enum("correction", "decoupled", ["none", "decoupled", "truncated_is"],
                    "rl.correction of the async runs.")
  flags.DEFINE_string(
      "warm_dir", None, "Where the warm starts live (default: --out). Share it between runs "
      "whose configs differ only in RL settings (the warm start is BC).")


def main(argv: list[str]) -> None:
  del argv
  f = flags.FLAGS
  out = os.path.abspath(f.out)
  os.makedirs(out, exist_ok=True)
  seeds = [int(s) for s in f.seeds]
  pipelines = list(f.pipelines)
  check_runs(f.config, seeds, pipelines, f.levels, f.env_workers, f.correction)
  path = os.path.join(out, "results.json")
  results = json.load(open(path)) if os.path.exists(path) else {}
  for seed in seeds:
    run_seed(f.config, out, seed, pipelines, f.levels, f.env_workers, results,
             os.path.abspath(f.warm_dir or out), f.correction)
  text = table(results, seeds, pipelines)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
