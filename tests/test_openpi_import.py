"""openpi checkpoint import: layouts, dtype casts, shardings and path-by-path checks.

Synthetic checkpoints use openpi's real parameter paths (``jaxvla/models/openpi_params.json``)
with every dimension shrunk to at most 3; the full-size trees are checked abstractly.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxvla.models import openpi_import as oi
from jaxvla.models import summary

SPEC_PATH = summary.DEFAULT_SPEC
MODELS = ("pi0", "pi05")
RL_PATH = "rl/value_out/kernel"


@pytest.fixture(scope="module")
def spec() -> dict:
  if not os.path.exists(SPEC_PATH):
    pytest.skip(f"{SPEC_PATH} not present")
  with open(SPEC_PATH, encoding="utf-8") as f:
    return json.load(f)


def _abstract(spec: dict, model: str, shrink: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
  """The spec's flat tree as ShapeDtypeStructs; ``shrink`` caps every dimension at 3."""
  out = {}
  for path, leaf in spec["models"][model]["params"].items():
    shape = tuple(min(d, 3) if shrink else d for d in leaf["shape"])
    out[path] = jax.ShapeDtypeStruct(shape, np.dtype(leaf["dtype"]))
  return out


def _values(abstract: dict[str, jax.ShapeDtypeStruct], seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {p: rng.standard_normal(s.shape).astype(np.float32) for p, s in sorted(abstract.items())}


def _write(directory, flat: dict[str, np.ndarray], *, with_value: bool) -> str:
  """Writes ``flat`` in openpi's layout: ``<directory>/params`` holding ``{'params': nested}``."""
  if with_value:  # nnx.State form: every leaf is {'value': array}
    flat = {p: {"value": x} for p, x in flat.items()}
  path = os.path.join(str(directory), "params")
  with ocp.PyTreeCheckpointer() as ckptr:
    ckptr.save(path, {"params": oi.unflatten(flat)})
  return path


def _mesh_sharding() -> NamedSharding:
  mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  return NamedSharding(mesh, P())


def _target(abstract: dict[str, jax.ShapeDtypeStruct], sharding) -> dict:
  """The model's nested float32 target: the checkpoint's paths plus an RL-only head."""
  flat = {p: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sharding)
          for p, s in abstract.items()}
  flat[RL_PATH] = jax.ShapeDtypeStruct((3, 1), jnp.float32, sharding=sharding)
  return oi.unflatten(flat)


@pytest.fixture(scope="module")
def pi0_small(spec, tmp_path_factory):
  """A float32 pi0 checkpoint without '/value': ``(path, abstract, values)``."""
  abstract = _abstract(spec, "pi0", shrink=True)
  values = _values(abstract, 0)
  return _write(tmp_path_factory.mktemp("pi0"), values, with_value=False), abstract, values


def test_flatten_unflatten_roundtrip():
  tree = {"a": {"b": 1, "c": {"d": 2}}, "e": 3}
  flat = oi.flatten(tree)
  assert flat == {"a/b": 1, "a/c/d": 2, "e": 3}
  assert oi.unflatten(flat) == tree
  with pytest.raises(ValueError, match="'a/b'"):
    oi.unflatten({"a/b": 1, "a/b/c": 2})


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("form", ["f32", "bf16", "f32_value"])
def test_load_roundtrip(spec, tmp_path, model, form):
  abstract = _abstract(spec, model, shrink=True)
  values = _values(abstract, seed=len(form))
  disk = {p: x.astype(jnp.bfloat16) for p, x in values.items()} if form == "bf16" else values
  path = _write(tmp_path, disk, with_value=form == "f32_value")

  meta = oi.read_checkpoint_tree(path)
  assert set(meta) == set(abstract)
  disk_dtype = np.dtype(jnp.bfloat16) if form == "bf16" else np.dtype(np.float32)
  assert all(m.dtype == disk_dtype and m.shape == abstract[p].shape for p, m in meta.items())

  sharding = _mesh_sharding()
  params, skipped = oi.load_openpi_params(path, _target(abstract, sharding))
  assert skipped == [RL_PATH]
  assert isinstance(params, dict) and "rl" not in params
  flat = oi.flatten(params)
  assert set(flat) == set(abstract)
  for p, x in flat.items():
    assert isinstance(x, jax.Array), p
    assert x.dtype == jnp.float32, p
    assert x.sharding == sharding, p
    want = values[p].astype(jnp.bfloat16).astype(np.float32) if form == "bf16" else values[p]
    np.testing.assert_array_equal(np.asarray(x), want, err_msg=p)


def test_load_default_sharding_and_dtype_override(pi0_small):
  path, abstract, values = pi0_small
  target = oi.unflatten({p: jax.ShapeDtypeStruct(s.shape, jnp.float32)
                         for p, s in abstract.items()})
  params, skipped = oi.load_openpi_params(path, target, dtype=jnp.bfloat16)
  assert skipped == []
  single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  for p, x in oi.flatten(params).items():
    assert x.dtype == jnp.bfloat16 and x.sharding == single, p
    np.testing.assert_array_equal(np.asarray(x), values[p].astype(jnp.bfloat16), err_msg=p)


def test_load_shape_mismatch_names_first_path(pi0_small):
  path, abstract, _ = pi0_small
  bad = dict(abstract)
  for p in ("PaliGemma/llm/layers/mlp/linear", "state_proj/kernel"):  # first one is reported
    bad[p] = jax.ShapeDtypeStruct(abstract[p].shape[:-1] + (2,), jnp.float32)
  want = abstract["PaliGemma/llm/layers/mlp/linear"].shape
  msg = (f"openpi checkpoint path 'PaliGemma/llm/layers/mlp/linear' has shape {want} "
         f"but the model expects {want[:-1] + (2,)}")
  with pytest.raises(ValueError) as e:
    oi.load_openpi_params(path, oi.unflatten(bad))
  assert str(e.value) == msg


def test_load_missing_path(pi0_small):
  path, abstract, _ = pi0_small
  extra = "PaliGemma/llm/extra_norm/scale"
  target = dict(abstract, **{extra: jax.ShapeDtypeStruct((3,), jnp.float32)})
  with pytest.raises(ValueError, match=f"expects path '{extra}'.*does not have"):
    oi.load_openpi_params(path, oi.unflatten(target))


def test_load_extra_checkpoint_path(pi0_small):
  path, abstract, _ = pi0_small
  target = {p: s for p, s in abstract.items() if p != "state_proj/bias"}
  with pytest.raises(ValueError, match="'state_proj/bias' .*is not a parameter of the model"):
    oi.load_openpi_params(path, oi.unflatten(target))


def test_lora_paths(spec, tmp_path, pi0_small):
  """LoRA paths are errors by default; ``ignore_extra`` / ``missing_ok`` allow them explicitly."""
  path, abstract, values = pi0_small
  lora = {p: jax.ShapeDtypeStruct(tuple(min(d, 3) for d in leaf["shape"]), jnp.float32)
          for p, leaf in spec["lora_extra_params_for_pi0_lora_variants"]["params"].items()}
  # A LoRA-trained checkpoint into a model without LoRA.
  lora_path = _write(tmp_path, {**values, **_values(lora, 1)}, with_value=False)
  first = sorted(lora)[0]
  with pytest.raises(ValueError, match=f"'{first}' .*not a parameter.*ignore_extra"):
    oi.load_openpi_params(lora_path, oi.unflatten(dict(abstract)))
  params, skipped = oi.load_openpi_params(lora_path, oi.unflatten(dict(abstract)),
                                          ignore_extra="lora")
  assert skipped == [] and set(oi.flatten(params)) == set(abstract)
  np.testing.assert_array_equal(np.asarray(oi.flatten(params)["state_proj/kernel"]),
                                values["state_proj/kernel"])
  # A released checkpoint into a LoRA model.
  with_lora = oi.unflatten({**abstract, **lora})
  with pytest.raises(ValueError, match=f"expects path '{first}'"):
    oi.load_openpi_params(path, with_lora)
  params, skipped = oi.load_openpi_params(path, with_lora, missing_ok="lora")
  assert skipped == sorted(lora) and set(oi.flatten(params)) == set(abstract)


def test_checkpoint_path_under_skip_prefix_is_an_error(pi0_small):
  _, abstract, _ = pi0_small
  ckpt = dict(abstract, **{RL_PATH: jax.ShapeDtypeStruct((3, 1), jnp.float32)})
  with pytest.raises(ValueError, match=f"'{RL_PATH}' lies under 'rl'"):
    oi.check_compatible(ckpt, ckpt, skip_prefixes=("rl",))


def test_dtype_checks():
  f32, bf16 = jnp.float32, jnp.bfloat16
  ok = {"a": jax.ShapeDtypeStruct((2,), bf16), "b": jax.ShapeDtypeStruct((2,), jnp.int32)}
  oi.check_compatible(ok, {"a": jax.ShapeDtypeStruct((2,), f32),
                           "b": jax.ShapeDtypeStruct((2,), jnp.int32)})
  with pytest.raises(ValueError, match="'a' has dtype float16"):
    oi.check_compatible({"a": jax.ShapeDtypeStruct((2,), jnp.float16)},
                        {"a": jax.ShapeDtypeStruct((2,), f32)})
  with pytest.raises(ValueError, match="'b' has dtype float32 but the model expects int32"):
    oi.check_compatible({"b": jax.ShapeDtypeStruct((2,), f32)},
                        {"b": jax.ShapeDtypeStruct((2,), jnp.int32)})


def test_not_a_checkpoint(tmp_path, pi0_small):
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
    oi.read_checkpoint_tree(str(tmp_path / "nope"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match=f"{tmp_path / 'empty'}' is not an orbax"):
    oi.read_checkpoint_tree(str(tmp_path / "empty"))
  parent = os.path.dirname(pi0_small[0])
  with pytest.raises(ValueError, match="did you mean .*/params'"):
    oi.read_checkpoint_tree(parent)


@pytest.mark.parametrize("model", MODELS)
def test_full_trees_abstract(spec, model):
  full = _abstract(spec, model)
  oi.check_compatible(full, full)
  target = dict(full, **{RL_PATH: jax.ShapeDtypeStruct((1024, 1), jnp.float32)})
  oi.check_compatible(full, target, skip_prefixes=("rl",))
  bad = dict(full)
  bad["PaliGemma/llm/layers/mlp/linear"] = jax.ShapeDtypeStruct((18, 8192, 2048), jnp.float32)
  with pytest.raises(ValueError) as e:
    oi.check_compatible(full, bad)
  assert str(e.value) == ("openpi checkpoint path 'PaliGemma/llm/layers/mlp/linear' has shape "
                          "(18, 16384, 2048) but the model expects (18, 8192, 2048)")


def test_pi0_vs_pi05_names_first_difference(spec):
  pi0, pi05 = _abstract(spec, "pi0"), _abstract(spec, "pi05")
  differ = sorted(p for p in set(pi0) | set(pi05)
                  if p not in pi0 or p not in pi05 or pi0[p].shape != pi05[p].shape)
  assert differ[0] == "PaliGemma/llm/final_norm_1/Dense_0/bias"
  with pytest.raises(ValueError, match=f"expects path '{differ[0]}'"):
    oi.check_compatible(pi0, pi05)  # pi0 checkpoint into a pi0.5 model
  with pytest.raises(ValueError, match=f"checkpoint path '{differ[0]}' .*not a parameter"):
    oi.check_compatible(pi05, pi0)  # pi0.5 checkpoint into a pi0 model
