"""A short learning test on the built-in env: BC warm start, then PPO must raise success.

One target (no colour binding to learn, so the warm start is quick), a cautious
demonstrator and a tight time limit: the warm-started policy reaches the target
too slowly, and only a working RL learner (correct log-probs, advantages, signs
and updates) speeds it up. A learner that does nothing, or climbs the wrong way,
stays at or below the warm start.
"""

from jaxvla import train


def test_ppo_improves_over_warm_start(tmp_path, smoke_config):
  c = smoke_config
  c.env.num_targets = 1
  c.env.num_colours = 1
  c.num_envs = 32
  c.rollout_len = 4
  c.total_env_steps = 45_000
  c.bc.num_episodes = 1000
  c.bc.num_steps = 700
  c.bc.batch_size = 64
  c.ppo.num_minibatches = 2
  c.ppo.num_epochs = 2
  c.eval.num_episodes = 128
  c.eval.every_iters = 1000  # only at the end
  c.checkpoint.every_iters = 1000
  summary = train.train_and_evaluate(c, str(tmp_path / "run"))
  print(summary)
  assert summary["success_rate"] >= summary["warm_start_success_rate"] + 0.2
  assert summary["success_rate"] >= 0.6
