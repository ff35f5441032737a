"""The openpi-layout export, read back the way openpi's own code reads a checkpoint.

``_openpi_restore_params`` and ``_openpi_load_norm_stats`` copy the few lines of
openpi's ``src/openpi/models/model.py`` ``restore_params`` and
``src/openpi/shared/normalize.py`` ``load`` / ``deserialize_json`` (commit 15a9616,
the one ``jaxvla/models/openpi_params.json`` was built from), not jaxvla's loader.
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from configs import default
from jaxvla.data import norm_stats
from jaxvla.envs import builtin
from jaxvla.models import fast_tokenizer, layers, lora, openpi_export, openpi_import, pi0
from jaxvla.models import pi0_fast, summary
from jaxvla.models import policy as policy_lib
from jaxvla.storage import policy_io
from tests.conftest import ROOT


def _openpi_restore_params(params_path) -> dict:
  """openpi's ``restore_params(params_path, restore_type=np.ndarray)``, line for line.

  One adaptation: openpi pins orbax 0.11, whose ``metadata()`` returns the tree itself;
  orbax 0.12's returns it under ``.item_metadata.tree``.
  """
  params_path = pathlib.Path(params_path).resolve()
  restore_type, dtype, sharding = np.ndarray, None, None
  with ocp.PyTreeCheckpointer() as ckptr:
    metadata = ckptr.metadata(params_path)
    metadata = getattr(getattr(metadata, "item_metadata", None), "tree", metadata)
    item = {"params": metadata["params"]}

    params = ckptr.restore(
        params_path,
        ocp.args.PyTreeRestore(
            item=item,
            restore_args=jax.tree.map(
                lambda _: ocp.ArrayRestoreArgs(sharding=sharding, restore_type=restore_type,
                                               dtype=dtype), item
            ),
        ),
    )["params"]
  flat_params = traverse_util.flatten_dict(params)
  if all(kp[-1] == "value" for kp in flat_params):
    flat_params = {kp[:-1]: v for kp, v in flat_params.items()}
  return traverse_util.unflatten_dict(flat_params)


def _openpi_load_norm_stats(directory) -> dict:
  """openpi's ``normalize.load(directory)``: ``_NormStatsDict(**json.loads(text)).norm_stats``,
  with its pydantic ``NormStats(mean, std, q01=None, q99=None)`` as plain arrays."""
  path = pathlib.Path(directory) / "norm_stats.json"
  if not path.exists():
    raise FileNotFoundError(f"Norm stats file not found at: {path}")
  body = json.loads(path.read_text())
  assert set(body) == {"norm_stats"}  # pydantic would reject other top-level fields' absence
  out = {}
  for key, entry in body["norm_stats"].items():
    assert set(entry) <= {"mean", "std", "q01", "q99"} and {"mean", "std"} <= set(entry)
    out[key] = {k: None if entry.get(k) is None else np.asarray(entry[k])
                for k in ("mean", "std", "q01", "q99")}
  return out


def _spec(model: str) -> dict:
  with open(summary.DEFAULT_SPEC) as f:
    return json.load(f)["models"][model]["params"]


def _policy(name: str, posemb: str = "learn"):
  c = default.get_config("smoke")
  c.model.update(name=name, posemb=posemb)
  env = builtin.make(c.env, 2, 0)
  pol = policy_lib.make_policy(c.model, env.spec)
  params = pol.init(jax.random.PRNGKey(0))
  # Distinct values everywhere (zero-initialised biases would hide a swapped leaf).
  params = jax.tree.map(lambda x: x + 0.01 * jnp.sin(jnp.arange(x.size).reshape(x.shape) + 1.0),
                        params)
  return c, env, pol, params


def _normalizer(mode: str) -> norm_stats.Normalizer:
  rng = np.random.default_rng(0)
  stats = {k: norm_stats.compute_array(rng.normal(size=(50, d))) for k, d in
           (("state", 2), ("actions", 2))}
  return norm_stats.Normalizer(stats, mode)


def _export(tmp_path, name, params, pol, normalizer, **kwargs):
  return openpi_export.export_openpi(
      str(tmp_path / "ckpt"), params, normalizer, "physical-intelligence/libero", model=name,
      image_size=pol.net.image_size, patch_size=pol.net.vit.patch_size, **kwargs)


@pytest.mark.parametrize("name,posemb", [("pi0", "learn"), ("pi05", "sincos2d")])
def test_openpi_restores_the_export(tmp_path, name, posemb):
  """Paths, ranks and dtypes are openpi's, values the policy's, norm stats round trip."""
  _, _, pol, params = _policy(name, posemb)
  mode = openpi_export.OPENPI_NORM_MODE[name]
  normalizer = _normalizer(mode)
  out = _export(tmp_path, name, params, pol, normalizer)
  restored = openpi_import.flatten(_openpi_restore_params(out["params"]))
  spec = _spec(name)
  assert sorted(restored) == sorted(spec)
  ours = openpi_import.flatten(params)
  for path, entry in spec.items():
    assert restored[path].dtype == np.dtype(entry["dtype"]), path
    assert restored[path].ndim == len(entry["shape"]), path
    if path == openpi_export.POS_EMBEDDING and posemb == "sincos2d":
      # The fixed table the ViT adds, written where openpi keeps its learned one.
      grid = pol.net.image_size // pol.net.vit.patch_size
      want = layers.posemb_sincos_2d(grid, grid, pol.net.vit.width)[None]
    else:
      want = ours[path]
    np.testing.assert_array_equal(restored[path], np.asarray(want, np.float32), err_msg=path)
  stats = _openpi_load_norm_stats(tmp_path / "ckpt" / "assets" / "physical-intelligence" / "libero")
  assert set(stats) == {"state", "actions"}
  for key in stats:
    for field in ("mean", "std", "q01", "q99"):
      np.testing.assert_allclose(stats[key][field], getattr(normalizer.stats[key], field),
                                 rtol=1e-12)


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_full_variant_tree_is_openpis(name):
  """The full variant's export tree (abstract) has openpi's paths, shapes and dtypes exactly."""
  c = summary.model_config(name, "full")
  c.posemb = "sincos2d"  # the export writes the fixed table as openpi's learned one
  pol = policy_lib.make_policy(c, summary.env_spec("full"))
  tree = jax.eval_shape(lambda p: openpi_export.openpi_tree(
      p, name, image_size=pol.net.image_size, patch_size=pol.net.vit.patch_size),
      pol.abstract_params())
  got = {k: (list(v.shape), str(v.dtype)) for k, v in openpi_import.flatten(tree).items()}
  assert got == {k: (v["shape"], v["dtype"]) for k, v in _spec(name).items()}


def test_jaxvla_import_and_policy_io_read_the_export_back(tmp_path):
  """Round trip: openpi_import fills the policy's tree with the exported values, and
  policy_io loads the export as an openpi checkpoint that acts as the original."""
  c, env, pol, params = _policy("pi0")
  normalizer = _normalizer("zscore")
  _export(tmp_path, "pi0", params, pol, normalizer)
  loaded, skipped = openpi_import.load_openpi_params(str(tmp_path / "ckpt" / "params"),
                                                     pol.abstract_params())
  assert all(p.startswith("rl/") for p in skipped) and skipped
  flat = openpi_import.flatten(params)
  for path, value in openpi_import.flatten(loaded).items():
    np.testing.assert_array_equal(value, flat[path], err_msg=path)
  back = policy_io.load(str(tmp_path / "ckpt"), c, asset_id="physical-intelligence/libero")
  assert back.kind == "openpi" and back.normalizer.mode == "zscore"
  np.testing.assert_allclose(back.normalizer.stats["state"].mean, normalizer.stats["state"].mean)
  batch = pol.prepare(env.observe())
  key = jax.random.PRNGKey(3)
  act = jax.jit(lambda p: pol.act(p, batch, key, "eval").actions)
  np.testing.assert_allclose(act(back.params), act(params), rtol=1e-6, atol=1e-6)


def test_normaliser_rules(tmp_path):
  _, _, pol, params = _policy("pi0")
  with pytest.raises(ValueError, match="--identity_norm_stats"):
    _export(tmp_path, "pi0", params, pol, None)
  with pytest.raises(ValueError, match="--allow_norm_mode_mismatch"):
    _export(tmp_path, "pi0", params, pol, _normalizer("quantile"))
  with pytest.raises(ValueError, match="asset_id"):
    openpi_export.export_openpi(str(tmp_path / "x"), params, _normalizer("zscore"), "../up",
                                model="pi0", image_size=32, patch_size=8)
  out = _export(tmp_path, "pi0", params, pol, None, identity_dims=(2, 2))
  stats = _openpi_load_norm_stats(pathlib.Path(out["norm_stats"]).parent)
  x = np.array([0.3, -0.7])
  # openpi's z-score transform, (x - mean) / (std + 1e-6): identity up to its epsilon.
  np.testing.assert_allclose((x - stats["state"]["mean"]) / (stats["state"]["std"] + 1e-6), x,
                             rtol=1e-5)
  with pytest.raises(FileExistsError, match="params"):
    _export(tmp_path, "pi0", params, pol, None, identity_dims=(2, 2))


def test_lora_adapters_are_merged(tmp_path):
  """LoRA leaves are folded in by jaxvla.models.lora.merge_lora."""
  _, _, pol, params = _policy("pi0")
  q = params["PaliGemma"]["llm"]["layers"]["attn"]["q_einsum"]
  layers_, heads, width, head_dim = q["w"].shape
  rng = np.random.default_rng(0)
  q["lora_a"] = jnp.asarray(rng.normal(size=(layers_, heads, width, 4)), jnp.float32)
  q["lora_b"] = jnp.asarray(rng.normal(size=(layers_, heads, 4, head_dim)), jnp.float32)
  out = _export(tmp_path / "b", "pi0", params, pol, _normalizer("zscore"))
  assert out["merged_lora"]
  restored = openpi_import.flatten(_openpi_restore_params(out["params"]))
  merged = openpi_import.flatten(lora.merge_lora({k: v for k, v in params.items() if k != "rl"}))
  assert sorted(restored) == sorted(_spec("pi0"))
  w = "PaliGemma/llm/layers/attn/q_einsum/w"
  np.testing.assert_allclose(restored[w], merged[w], rtol=1e-6)
  delta = np.einsum("lndr,lnrh->lndh", np.asarray(q["lora_a"]), np.asarray(q["lora_b"]))
  np.testing.assert_allclose(restored[w], np.asarray(q["w"]) + delta, rtol=1e-4, atol=1e-5)


def test_cli_exports_a_jaxvla_export(tmp_path):
  """``python -m jaxvla.openpi_export`` on a jaxvla export (through policy_io.load)."""
  from jaxvla.storage import checkpoint
  c, env, pol, params = _policy("pi0")
  src = tmp_path / "export"
  checkpoint.export_policy(str(src), params, c.to_json())
  policy_io.write_spec(str(src), env.spec)
  norm_stats.save_normalizer(str(src), _normalizer("zscore"))
  run = subprocess.run([sys.executable, "-m", "jaxvla.openpi_export", f"--policy={src}",
                        f"--out={tmp_path / 'openpi'}", "--asset_id=colorreach"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["kind"] == "export" and out["num_arrays"] == len(_spec("pi0"))
  restored = openpi_import.flatten(_openpi_restore_params(out["params"]))
  w = "PaliGemma/llm/layers/mlp/linear"
  np.testing.assert_array_equal(restored[w], openpi_import.flatten(params)[w])
  assert _openpi_load_norm_stats(tmp_path / "openpi" / "assets" / "colorreach")["actions"]
  again = subprocess.run([sys.executable, "-m", "jaxvla.openpi_export", f"--policy={src}",
                          f"--out={tmp_path / 'openpi'}", "--asset_id=colorreach"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert again.returncode != 0 and "exists" in again.stderr.splitlines()[-1]


def _fast_policy(tmp_path):
  """A tiny pi0-FAST with a FAST tokenizer fitted on smooth chunks, distinct param values."""
  fast_dir = str(tmp_path / "fast")
  chunks = fast_tokenizer.smooth_chunks(np.random.default_rng(0), 200, 5, 2)
  fast_tokenizer.FastTokenizer.fit(chunks, vocab_size=256).save(fast_dir)
  c = default.get_config("fast")
  c.model.update(fast_tokenizer_path=fast_dir, max_action_tokens=12)
  env = builtin.make(c.env, 2, 0)
  pol = policy_lib.make_policy(c.model, env.spec)
  params = jax.tree.map(lambda x: x + 0.01 * jnp.sin(jnp.arange(x.size).reshape(x.shape) + 1.0),
                        pol.init(jax.random.PRNGKey(0)))
  return c, env, pol, params


def test_pi0_fast_export_is_openpis_and_reads_back_with_its_tokenizer(tmp_path):
  """pi0-FAST's export: openpi's full-size tree (paths, float32), the policy's values, its
  FAST tokenizer beside; policy_io reads it back as an openpi checkpoint, finding that
  tokenizer, and it decodes the same tokens."""
  full = openpi_export._spec("pi0_fast")  # pylint: disable=protected-access
  net = pi0_fast.Pi0FastConfig(
      llm=pi0.VARIANTS["full"][0], vit=pi0.VARIANTS["full"][2], image_size=224, num_cameras=3,
      action_dim=32, chunk_len=10, vocab_size=pi0.PALIGEMMA_VOCAB_SIZE, max_action_tokens=256,
      eos_id=1, temperature=1.0, dtype="bfloat16", remat=False, value_hidden=64)
  tree = jax.eval_shape(lambda p: openpi_export.openpi_tree(p, "pi0_fast", image_size=224,
                                                            patch_size=net.vit.patch_size),
                        layers.abstract_tree(pi0_fast.build, net)[0])
  assert {k: (list(v.shape), str(v.dtype)) for k, v in openpi_import.flatten(tree).items()} == {
      k: (v["shape"], v["dtype"]) for k, v in full.items()}
  c, env, pol, params = _fast_policy(tmp_path)
  loaded = policy_io.LoadedPolicy(config=c, spec=env.spec, policy=pol, params=params,
                                  normalizer=_normalizer("quantile"), kind="export", path="")
  out = openpi_export.export_loaded(str(tmp_path / "ckpt"), loaded, "colorreach")
  restored = openpi_import.flatten(_openpi_restore_params(out["params"]))
  assert sorted(restored) == sorted(full)
  ours = openpi_import.flatten(params)
  for path in full:
    assert restored[path].dtype == np.float32, path
    if path != openpi_export.POS_EMBEDDING:  # (sincos2d's fixed table, written there)
      np.testing.assert_array_equal(restored[path], ours[path], err_msg=path)
  assert out["fast_tokenizer"] == str(tmp_path / "ckpt" / fast_tokenizer.RUN_DIR)
  bare = c.copy_and_resolve_references()
  bare.model.update(fast_tokenizer_path="", posemb="learn")  # (openpi's learned table)
  back = policy_io.load(str(tmp_path / "ckpt"), bare)
  assert back.kind == "openpi" and back.normalizer.mode == "quantile"
  assert back.config.model.fast_tokenizer_path == out["fast_tokenizer"]
  assert back.policy.prompt.vocab_size == pol.prompt.vocab_size
  batch = pol.prepare(env.observe())
  chain = jax.jit(lambda q: pol.act(q, batch, jax.random.PRNGKey(1), "eval").chain)
  np.testing.assert_array_equal(chain(back.params), chain(params))
