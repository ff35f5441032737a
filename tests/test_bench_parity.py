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
    assert (c.pipeline.mode, c.pipeline.max_staleness, c.ppo.correction) == (
        "async", k, "decoupled")
    assert c.pipeline.streamer == c.pipeline.rollout_async == (levels == "full")
    # The RL settings are the sync run's (full: the streamer's one pass, for every run).
    assert c.ppo.num_epochs == sync.ppo.num_epochs == (1 if levels == "full" else 2)
    assert c.ppo.learning_rate == sync.ppo.learning_rate == base.ppo.learning_rate
  assert base.pipeline.mode == "sync_colocated"  # (the base is not modified)
  with pytest.raises(ValueError, match="'sync' or 'kN'"):
    parity.run_config(base, 4, "4", levels)


def test_table_has_means_and_gaps_to_sync():
  run = lambda s, st: dict(success_rate=s, warm_start_success_rate=0.3, staleness_mean=st)
  results = {"seed1/sync": run(0.9, 0.0), "seed1/k4": run(0.8, 3.9),
             "seed2/sync": run(1.0, 0.0), "seed2/k4": run(0.9, 3.8)}
  text = parity.table(results, [1, 2], [parity.SYNC, "k4"])
  assert "| 1 | 0.300 | 0.900 | 0.800 (3.9) |" in text
  assert "| mean ± std | | 0.950 ± 0.050 | 0.850 ± 0.050 |" in text
  assert "| gap to sync | |  | -0.100 (worst -0.100) |" in text
