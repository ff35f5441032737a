"""The end-to-end smoke run the pipeline and checkpoint tests share, and what every such
run must show (one owner for those checks, so a test that trains a mode checks it whole)."""

from __future__ import annotations

import os

import numpy as np

from configs import default
from jaxvla import metrics, timing


def smoke_config(model: dict | None = None, **pipeline):
  """The smoke config as the end-to-end runs use it: 600 env steps, an env pool of two
  workers with a little latency, four-segment micro-batches; ``pipeline`` overrides."""
  c = default.get_config("smoke")
  c.total_env_steps = 600
  c.env_workers = 2
  c.env.latency_ms, c.env.latency_sigma = 1.0, 1.0
  c.model.update(model or {})
  c.pipeline.micro_batch_segments = 4
  c.pipeline.update(pipeline)
  if c.pipeline.streamer:
    c.rl.update(num_epochs=1, num_minibatches=2, advantage_norm="none")
  return c


def records(workdir: str) -> list[dict]:
  """The run's metric records (``metrics.jsonl``), every phase."""
  return metrics.records(workdir)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> bool:
  """Whether some interval of ``a`` and some interval of ``b`` run at the same time."""
  return any(min(e1, e2) > max(s1, s2) for s1, e1 in a for s2, e2 in b)


def check_run(c, summary: dict, workdir: str) -> None:
  """What every end-to-end run must show: the budget met, one record per update with a
  finite loss and the stage metrics, staleness within bounds (none, and nothing dropped,
  for ``sync_colocated``), a timeline, a warm start read from demonstrations recorded
  on disk (RLDS), and evaluations."""
  recs = records(workdir)
  assert summary["env_steps"] >= c.total_env_steps
  assert summary["policy_version"] == summary["iterations"] >= 2
  train_records = [r for r in recs if r["phase"] == "train"]
  assert len(train_records) == summary["iterations"]
  assert all(np.isfinite(r["loss"]) for r in train_records)
  last = train_records[-1]
  for key in ("env_busy", "inference_busy", "learner_busy", "staleness_mean", "queue_depth"):
    assert key in last, key
  # The env pool's workers (2, each stepping its envs): a real share of their time.
  assert 0.0 < last["env_workers_busy"] <= 1.0 + 1e-6
  p = c.pipeline
  timeline = timing.StageClock.from_json(os.path.join(workdir, "timeline.json"))
  if p.mode == "async" and p.rollout_async:
    # First-ready: envs keep stepping while inference runs on the batch that is ready (a
    # fact of the timeline, not a speed: lockstep never overlaps the two).
    assert _overlap(timeline["env"], timeline["inference"])
  if p.mode == "async" and p.train_async:  # The rollout runs beside the learner.
    assert _overlap(timeline["env"] + timeline["inference"], timeline["learner"])
  assert last["staleness_max"] <= p.max_staleness
  if p.mode == "sync_colocated":
    assert last["staleness_max"] == 0 and summary["dropped_env_steps"] == 0
  # The warm start read its demonstrations from disk: the expert, recorded as RLDS.
  assert os.path.exists(os.path.join(workdir, "demos", "dataset_info.json"))
  warm = [r for r in recs if r["phase"] == "warm_start"][0]
  assert warm["demo_episodes"] == c.bc.num_episodes and warm["demo_env_steps"] > 0
  evals = [r for r in recs if r["phase"] == "eval"]
  assert evals and all(0.0 <= r["success_rate"] <= 1.0 for r in evals)
