"""jaxvla.storage.policy_io: one loader for exports, a run's checkpoints and openpi checkpoints.

Checked: a run's checkpoint directory yields the newest (or a named) step's params
only, with the normaliser stored in its meta and the run's config; the workdir and its
``checkpoints/`` both work; an openpi checkpoint with openpi's nested asset id
(``physical-intelligence/libero``) is found, and one needs a config; a directory that
is none of the three, an ambiguous asset, a missing step and a model that does not fit
fail naming the path, key or step. (Exports: tests/test_exported.py, tests/test_eval.py;
openpi exports read back: tests/test_openpi_export.py.)
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from configs import default
from jaxvla.data import norm_stats
from jaxvla.envs import builtin
from jaxvla.models import openpi_export
from jaxvla.models import policy as policy_lib
from jaxvla.storage import checkpoint, policy_io


def _setup():
  c = default.get_config("smoke")
  c.model.posemb = "learn"  # openpi's tree (a learned ViT position table).
  spec = builtin.spec_from_config(c.env)
  policy = policy_lib.make_policy(c.model, spec)
  return c, spec, policy


def _normalizer(mode="zscore"):
  return norm_stats.Normalizer(dict(
      state=norm_stats.NormStats(np.full(2, 0.3), np.full(2, 0.2), np.full(2, -1.0),
                                 np.full(2, 1.0)),
      actions=norm_stats.NormStats(np.full(2, 0.5), np.full(2, 0.5), np.full(2, -1.0),
                                   np.full(2, 1.0))), mode)


def test_run_checkpoints_load_params_normaliser_and_config(tmp_path):
  c, _, policy = _setup()
  workdir = tmp_path / "run"
  os.makedirs(workdir)
  (workdir / policy_io.CONFIG_FILE).write_text(c.to_json_best_effort())
  ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"), 3)
  params = [policy.init(jax.random.PRNGKey(i)) for i in range(2)]
  for step, p in zip((10, 20), params):  # A train state: params plus optimizer moments.
    ckpt.save(step, dict(params=p, opt_state=dict(mu=p), step=np.int32(step)),
              dict(normalizer=_normalizer().to_json(), iteration=step))
  ckpt.close()

  for path in (workdir, workdir / "checkpoints"):
    loaded = policy_io.load(str(path))
    assert loaded.kind == "checkpoint"
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params[1])
    assert loaded.normalizer.to_json() == _normalizer().to_json()
    assert loaded.config.model.name == c.model.name
  older = policy_io.load(str(workdir), step=10)
  jax.tree.map(np.testing.assert_array_equal, older.params, params[0])
  with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint 15 \(it has \[10, 20\]\)"):
    policy_io.load(str(workdir), step=15)

  other = default.get_config("smoke")
  other.model.name = "action_token_vla"
  with pytest.raises(ValueError, match="does not fit the config's model"):
    policy_io.load(str(workdir), other)


def test_openpi_checkpoint_with_nested_asset_id(tmp_path):
  c, spec, policy = _setup()
  params = policy.init(jax.random.PRNGKey(0))
  step_dir = tmp_path / "openpi" / "29999"
  openpi_export.export_openpi(str(step_dir), params, _normalizer(), "physical-intelligence/libero",
                              model="pi0", image_size=policy.net.image_size,
                              patch_size=policy.net.vit.patch_size)
  assert policy_io.detect(str(step_dir)) == "openpi"
  assert policy_io.openpi_asset_ids(str(step_dir)) == ["physical-intelligence/libero"]
  loaded = policy_io.load(str(step_dir), c)
  assert loaded.kind == "openpi" and loaded.normalizer.mode == "zscore"  # openpi's for pi0
  np.testing.assert_allclose(loaded.normalizer.stats["state"].mean, 0.3)
  flat = dict(jax.tree_util.tree_leaves_with_path(loaded.params["PaliGemma"]))
  want = dict(jax.tree_util.tree_leaves_with_path(params["PaliGemma"]))
  for path, value in want.items():
    np.testing.assert_array_equal(flat[path], value)

  with pytest.raises(ValueError, match="openpi checkpoint, which has no jaxvla config"):
    policy_io.load(str(step_dir))
  openpi_export.export_openpi(str(tmp_path / "two"), params, _normalizer(), "a/one",
                              model="pi0", image_size=policy.net.image_size,
                              patch_size=policy.net.vit.patch_size)
  norm_stats.save(str(tmp_path / "two" / "assets" / "b"), _normalizer().stats)
  with pytest.raises(ValueError, match=r"\['a/one', 'b'\]; name one with asset_id"):
    policy_io.load(str(tmp_path / "two"), c)
  assert policy_io.load(str(tmp_path / "two"), c, asset_id="b").normalizer is not None


def test_not_a_policy_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such directory"):
    policy_io.detect(str(tmp_path / "missing"))
  with pytest.raises(FileNotFoundError, match="is none of"):
    policy_io.detect(str(tmp_path))


def test_an_export_written_before_a_model_key_existed_loads(tmp_path):
  import json
  c, spec, policy = _setup()
  stored = json.loads(c.to_json_best_effort())
  for key in [k for k in stored["model"] if k.startswith("lora")]:  # Added after the run.
    del stored["model"][key]
  out = checkpoint.export_policy(str(tmp_path / "export"), policy.init(jax.random.PRNGKey(0)),
                                 json.dumps(stored))
  loaded = policy_io.load(out)
  assert loaded.config.model.lora == default.get_config().model.lora
