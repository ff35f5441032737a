"""jaxvla.bench.parity without training: what each pipeline's run config is, and the table."""

import pytest

from configs import default
from jaxvla import config_checks
from jaxvla.bench import parity


@pytest.mark.parametrize("levels", parity.LEVELS)
def test_run_configs_differ_only_in_the_pipeline(levels):
  base = default.get_config("parity")
  sync = parity.run_config(base, 4, parity.SYNC, levels)
  assert sync.pipeline.mode == "sync_colocated" and sync.seed == 4
  for name, k in (("k0", 0), ("k4", 4)):
    c = parity.run_config(base, 4, name, levels)
    config_checks.validate(c)
    assert (c.pipeline.mode, c.pipeline.max_staleness, c.rl.correction) == (
        "async", k, "decoupled")
    assert c.pipeline.streamer == c.pipeline.rollout_async == (levels == "full")
    # The RL settings are the sync run's (full: the streamer's one pass, for every run).
    assert c.rl.num_epochs == sync.rl.num_epochs == (1 if levels == "full" else 2)
    assert c.rl.learning_rate == sync.rl.learning_rate == base.rl.learning_rate
  assert base.pipeline.mode == "sync_colocated"  # (the base is not modified)
  with pytest.raises(ValueError, match="'sync' or 'kN'"):
    parity.run_config(base, 4, "4", levels)


def test_runs_the_config_cannot_make_are_refused_before_any_runs():
  from configs import maniskill  # pylint: disable=import-outside-toplevel
  base = maniskill.get_config("flow_rl_short")  # 16 envs / 8 per item: 2 items, 4 minibatches
  parity.check_runs(base, [0, 1], [parity.SYNC, "k4"], "l1", 2)
  with pytest.raises(ValueError, match=r"--pipelines=k4 \(--levels=full\): "
                                       r"config.rl.num_minibatches"):
    parity.check_runs(base, [0, 1], [parity.SYNC, "k4"], "full", 2)
  base.pipeline.micro_batch_segments = 2
  parity.check_runs(base, [0, 1], [parity.SYNC, "k4"], "full", 2)


def test_table_has_means_and_gaps_to_sync():
  run = lambda s, st: dict(success_rate=s, warm_start_success_rate=0.3, staleness_mean=st)
  results = {"seed1/sync": run(0.9, 0.0), "seed1/k4": run(0.8, 3.9),
             "seed2/sync": run(1.0, 0.0), "seed2/k4": run(0.9, 3.8)}
  text = parity.table(results, [1, 2], [parity.SYNC, "k4"])
  assert "| 1 | 0.300 | 0.900 | 0.800 (3.9) |" in text
  assert "| mean ± std | | 0.950 ± 0.050 | 0.850 ± 0.050 |" in text
  assert "| gap to sync | |  | -0.100 (worst -0.100) |" in text


def test_seed_table_and_seed_ranges(tmp_path):
  """jaxvla.bench.seeds: its seed ranges, a run's curve from its metrics, and the table."""
  from jaxvla.bench import seeds  # pylint: disable=import-outside-toplevel
  assert seeds.parse_seeds(["0-3", "7"]) == [0, 1, 2, 3, 7]
  for bad in ("3-1", "x"):
    with pytest.raises(ValueError, match=f"--seeds: '{bad}'"):
      seeds.parse_seeds([bad])
  (tmp_path / "metrics.jsonl").write_text("\n".join([
      '{"phase": "warm_start", "env_steps": 0, "success_rate": 0.25}',
      '{"phase": "train", "env_steps": 100, "loss": 1.0}',
      '{"phase": "eval", "env_steps": 200, "success_rate": 0.5}',
      '{"phase": "summary", "env_steps": 200, "wall_s": 60.0}', '']))
  assert seeds.curve(str(tmp_path)) == [(0, 0.25), (200, 0.5)]
  assert seeds.warm_wall_s(str(tmp_path)) == 60.0
  rows = {0: dict(warm_start=0.25, final=0.9, wall_s=600.0, curve=[(0, 0.25), (200, 0.9)]),
          1: dict(warm_start=0.15, final=0.7, wall_s=660.0, curve=[(0, 0.15), (200, 0.7)])}
  text = seeds.table(rows, 0.8)
  assert "| 0 | 0.250 | 0.900 | 10.0 | 0.25 0.90 |" in text
  assert ("| mean ± std | 0.200 | 0.800 ± 0.100 | | range 0.700–0.900; 1 of 2 at 0.8 or above |"
          in text)
  seeds.plot(rows, str(tmp_path / "curves.png"))
  assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
