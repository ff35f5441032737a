"""orbax checkpoints: save -> restore equality, resume of a run, and parameter-only export."""

import os

import jax
import numpy as np
import pytest

from configs import default
from jaxvla import config_checks
from jaxvla import metrics as metrics_lib
from jaxvla import train
from jaxvla.data import norm_stats
from jaxvla.envs import builtin
from jaxvla.learner import learner as learner_lib
from jaxvla.models import policy as policy_lib
from jaxvla.storage import checkpoint as checkpoint_lib
from tests import end_to_end


def _tree_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _random_like(rng: np.random.Generator, x) -> np.ndarray:
  """An array like ``x`` with random entries (any integer, PRNG key words too)."""
  x = np.asarray(x)
  if np.issubdtype(x.dtype, np.floating):
    return rng.standard_normal(x.shape).astype(x.dtype)
  info = np.iinfo(x.dtype)
  return rng.integers(info.min, info.max, x.shape, dtype=x.dtype, endpoint=True)


@pytest.fixture(scope="module")
def trained():
  """The smoke policy and two train states (seeds 0 and 5) on the learner's mesh, every
  leaf random (the optimizer's moments and count, the step and the key too), so a
  restore that mixed up leaves or kept its target's values cannot pass."""
  config = default.get_config("smoke")
  env = builtin.make(config.env, 2, 0)
  pol = policy_lib.make_policy(config.model, env.spec)
  lrn = learner_lib.Learner(pol, config)
  states = []
  for seed in (0, 5):
    state = learner_lib.init_state(pol.init(jax.random.PRNGKey(seed)), lrn.ppo_tx,
                                   jax.random.PRNGKey(seed + 1))
    rng = np.random.default_rng(seed)
    states.append(lrn.shard_state(jax.tree.map(lambda x: _random_like(rng, x), state)))
  return pol, states


@pytest.mark.run_first
def test_save_restore_equality(tmp_path, trained):
  _, (state, other) = trained
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
  ckpt.save(3, state, {"env_steps": 123})
  ckpt.close()
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
  assert ckpt.latest_step() == 3
  restored, meta = ckpt.restore(3, checkpoint_lib.abstract_like(other))
  ckpt.close()
  assert meta == {"env_steps": 123}
  _tree_equal(restored, state)


def test_the_warm_start_outlives_max_to_keep(tmp_path, trained):
  # checkpoint.keep_warm_start: step 0 (the SFT policy of an SFT -> RL run) stays beside
  # the newest max_to_keep, so the policy before RL can be evaluated after the run.
  _, (state, _) = trained
  for keep, kept in (((0,), [0, 20, 30]), ((), [20, 30])):
    ckpt = checkpoint_lib.Checkpointer(str(tmp_path / f"keep{len(keep)}"), max_to_keep=2,
                                       keep_steps=keep)
    for step in (0, 10, 20, 30):
      ckpt.save(step, state, {"iteration": step})
    ckpt.close()
    assert sorted(ckpt.manager.all_steps()) == kept
  c = default.get_config()
  c.checkpoint.max_to_keep = 0  # (checked with the whole config, before any work starts)
  with pytest.raises(ValueError, match="config.checkpoint.max_to_keep: must be >= 1, got 0"):
    config_checks.validate(c)


def test_export_loads_without_optimizer(tmp_path, smoke_config, trained):
  pol, (state, _) = trained
  checkpoint_lib.export_policy(str(tmp_path / "export"), state.params,
                               smoke_config.to_json_best_effort())
  params, cfg = checkpoint_lib.load_policy_params(str(tmp_path / "export"),
                                                  pol.abstract_params())
  _tree_equal(params, state.params)
  assert cfg["model"]["name"] == "pi0"
  raw, _ = checkpoint_lib.load_policy_params(str(tmp_path / "export"))  # no target needed
  assert len(jax.tree.leaves(raw)) == len(jax.tree.leaves(state.params))


@pytest.mark.run_first
def test_resume_continues_run(tmp_path):
  """The end-to-end run of the default pi0 in ``sync_colocated`` mode (with every check of
  tests/test_pipeline.py's end-to-end runs), its checkpoint and export, then its resume."""
  workdir = str(tmp_path / "run")
  smoke_config = end_to_end.smoke_config(mode="sync_colocated")
  smoke_config.data.normalize = "zscore"  # Statistics of the recorded demonstrations.
  first = train.train_and_evaluate(smoke_config, workdir)
  end_to_end.check_run(smoke_config, first, workdir)
  # The normalisation travels with the policy: in the checkpoints and the export.
  normalizer = norm_stats.load_normalizer(first["export_dir"])
  assert normalizer.mode == "zscore"
  assert norm_stats.load(first["export_dir"])["state"].mean.shape == (2,)
  # The latest checkpoint holds the final params and optimizer state.
  env = builtin.make(smoke_config.env, 2, 0)
  pol = policy_lib.make_policy(smoke_config.model, env.spec)
  lrn = learner_lib.Learner(pol, smoke_config)
  abstract = checkpoint_lib.abstract_like(
      learner_lib.init_state(pol.init(jax.random.PRNGKey(9)), lrn.ppo_tx, jax.random.PRNGKey(9)))
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), 2)
  saved, meta = ckpt.restore(ckpt.latest_step(), abstract)
  ckpt.close()
  exported, _ = checkpoint_lib.load_policy_params(first["export_dir"], pol.abstract_params())
  _tree_equal(saved.params, exported)
  assert meta["iteration"] == first["iterations"] and int(saved.step) == first["policy_version"]
  assert meta["normalizer"] == normalizer.to_json()

  # A second start without resume is refused before it writes anything: the run's
  # config.json (what a resume compares against) stays the run's.
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    written = f.read()
  smoke_config.seed += 1
  with pytest.raises(FileExistsError, match=r"holds checkpoint \d+; pass --config.resume"):
    train.train_and_evaluate(smoke_config, workdir)
  smoke_config.seed -= 1
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert f.read() == written

  # Resuming with another model size: one line naming the step, the path and the key.
  smoke_config.resume = True
  smoke_config.model.variant = "small"
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=r"checkpoint \d+ .* does not fit this run's model: params/.* "
                           r"\(changed since that run: config.model.variant: 'tiny' -> 'small'\)"):
    train.train_and_evaluate(smoke_config, workdir)
  smoke_config.model.variant = "tiny"
  # A key that acts only in a fresh run (its init, its warm start) is refused, not ignored.
  smoke_config.bc.num_steps += 1
  with pytest.raises(ValueError, match=r"^--config.resume=True: config.bc.num_steps: \d+ -> "
                                       r"\d+ acts only when a fresh run builds its parameters"):
    train.train_and_evaluate(smoke_config, workdir)
  smoke_config.bc.num_steps -= 1

  smoke_config.total_env_steps = 1200
  second = train.train_and_evaluate(smoke_config, workdir)
  assert second["iterations"] > first["iterations"]
  assert second["policy_version"] == first["policy_version"] + (
      second["iterations"] - first["iterations"])
  assert len(metrics_lib.records(workdir, "warm_start")) == 1  # no second warm start
  steps = [r["env_steps"] for r in metrics_lib.records(workdir, "train")]
  assert steps == sorted(steps) and steps[-1] == second["env_steps"]
  # The resumed run acted with the checkpoint's normalisation and exported it again.
  assert norm_stats.load_normalizer(second["export_dir"]).to_json() == normalizer.to_json()


def _two_steps(tmp_path, trained):
  pol, (state, _) = trained
  directory = str(tmp_path / "ckpt")
  ckpt = checkpoint_lib.Checkpointer(directory, max_to_keep=3)
  ckpt.save(1, state, {"env_steps": 1})
  ckpt.save(2, state, {"env_steps": 2})
  ckpt.close()
  return pol, state, directory


def _abstract_state(pol, config):
  """The train state a run of ``config`` with policy ``pol`` restores into (abstract)."""
  lrn = learner_lib.Learner(pol, config)
  return jax.eval_shape(lambda: learner_lib.init_state(
      pol.init(jax.random.PRNGKey(0)), lrn.ppo_tx, jax.random.PRNGKey(0)))


def _truncate_arrays(step_dir):
  """Halves every array data file of a step (a write cut short)."""
  n = 0
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    if os.path.basename(root) == "d":
      for name in files:
        path = os.path.join(root, name)
        with open(path, "r+b") as f:
          f.truncate(os.path.getsize(path) // 2)
        n += 1
  assert n, f"no array files under {step_dir}"


@pytest.mark.run_first
def test_damaged_latest_checkpoint_falls_back_and_mismatch_names_the_path(tmp_path, smoke_config,
                                                                          trained, caplog):
  import logging  # pylint: disable=import-outside-toplevel
  pol, state, directory = _two_steps(tmp_path, trained)
  abstract = checkpoint_lib.abstract_like(state)

  _truncate_arrays(os.path.join(directory, "2"))
  ckpt = checkpoint_lib.Checkpointer(directory, max_to_keep=3)
  with caplog.at_level(logging.WARNING):
    step, restored, meta = ckpt.restore_latest(abstract)
  assert step == 1 and meta == {"env_steps": 1}
  _tree_equal(restored.params, state.params)
  assert "checkpoint 2 in" in caplog.text and "damaged" in caplog.text

  # Step 1's metadata gone too: no intact step, each one's cause named in one line.
  os.remove(os.path.join(directory, "1", "state", "_METADATA"))
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=r"no intact checkpoint in .*: step 2: unreadable \(.*OUT_OF_RANGE.*\); "
                           r"step 1: \S+/1/state/_METADATA is missing") as info:
    ckpt.restore_latest(abstract)
  assert "\n" not in str(info.value)
  ckpt.close()

  # Another model over these params: the step, the first differing path and the hint.
  _, _, directory = _two_steps(tmp_path / "b", trained)
  smoke_config.model.variant = "small"
  env = builtin.make(smoke_config.env, 2, 0)
  small = policy_lib.make_policy(smoke_config.model, env.spec)
  abstract_small = _abstract_state(small, smoke_config)
  ckpt = checkpoint_lib.Checkpointer(directory, max_to_keep=3)
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=r"checkpoint 2 in .* does not fit this run's model: params/\S+ is "
                           r"stored with shape \(.*\), the config's model has .* \(hint\)"):
    ckpt.restore_latest(abstract_small, " (hint)")
  ckpt.close()


def test_another_optimizer_is_named_not_taken_for_damage(tmp_path, smoke_config, trained):
  """The same model with a separate critic optimizer (``rl.value_learning_rate``): the
  params fit but the optimizer state's tree does not. One error naming the step, the
  first differing path and the settings, instead of every step reported damaged."""
  pol, _, directory = _two_steps(tmp_path, trained)
  smoke_config.rl.value_learning_rate = 3e-4
  abstract = _abstract_state(pol, smoke_config)
  ckpt = checkpoint_lib.Checkpointer(directory, max_to_keep=3)
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=r"^checkpoint 2 in .* does not fit this run's optimizer: "
                           r"(the checkpoint has )?opt_state/\S+ .*rl\.value_learning_rate.*"
                           r" \(hint\)$") as info:
    ckpt.restore_latest(abstract, " (hint)")
  assert "damaged" not in str(info.value) and "\n" not in str(info.value)
  ckpt.close()
