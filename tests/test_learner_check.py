"""The learner check: a broken RL learner fails the per-submission suite in minutes.

``configs/default.py:check`` on ColorReach (one target, a cautious demonstrator, a tight
time limit: the learning-parity setting at a third of its budget): a BC warm start, then
16k env steps of synchronous PPO, evaluated on the same 128 fixed-seed episodes before
and after. About 80 to 170 s and 160 CPU-seconds on a 2-core AMD EPYC.

Two assertions, each with its margin set from seeds 0-8 (docs/results/testing.md "The
learner check"):

* success rises by at least ``MIN_GAIN``: the nine seeds gained 0.476 to 0.594 (mean
  0.523, std 0.044);
* the critic fits the returns at least as well as a constant, less ``MIN_EXPLAINED``:
  the learner's ``explained_variance`` (the rollout values against the GAE returns)
  averaged over the run's second half was -0.024 to 0.108 over the nine seeds.

Each of the four bugs planted in docs/results/testing.md fails it: the policy gradient's
sign flipped (success 0.328 -> 0.109), the advantages zeroed (-> 0.195), the behaviour
log-probs off by one step (-> 0.117), the value loss detached (success rose, but the
explained variance stayed at -0.43). The long learning runs (``launch/test.sh
--only=learning``) hold the learning figures themselves.
"""

import numpy as np
import pytest

from jaxvla import metrics, train

MIN_GAIN = 0.3  # 0.18 (4 stds) below the nine seeds' smallest gain.
MIN_EXPLAINED = -0.2  # 0.18 (4 stds) below the nine seeds' lowest mean.


@pytest.mark.slow  # (two to three minutes beside the slow step's other tests)
@pytest.mark.run_first(0)
def test_ppo_raises_colorreach_success_and_fits_its_critic(tmp_path):
  from configs import default  # pylint: disable=import-outside-toplevel
  c = default.get_config("check")
  workdir = str(tmp_path / "run")
  r = train.train_and_evaluate(c, workdir)
  explained = [rec["explained_variance"] for rec in metrics.records(workdir, "train")]
  second_half = float(np.mean(explained[len(explained) // 2:]))
  print({k: r[k] for k in ("warm_start_success_rate", "success_rate", "env_steps", "wall_s")},
        {"explained_variance_second_half": second_half})
  warm = r["warm_start_success_rate"]
  assert 0.15 <= warm <= 0.5, f"the warm start should be clearly imperfect, not {warm}"
  assert r["env_steps"] >= c.total_env_steps and r["nonfinite_updates"] == 0
  assert len(explained) == r["iterations"] >= 20, (len(explained), r["iterations"])
  assert r["success_rate"] >= warm + MIN_GAIN, (
      f"PPO raised success from {warm:.3f} to {r['success_rate']:.3f} only "
      f"(at least {MIN_GAIN} expected)")
  assert second_half >= MIN_EXPLAINED, (
      f"the critic does not fit the returns: explained variance {second_half:.3f} over the "
      f"run's second half (at least {MIN_EXPLAINED} expected)")
