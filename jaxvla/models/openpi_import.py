"""Loading openpi's pi0 / pi0.5 checkpoints into jaxvla's parameter tree.

This file owns the openpi checkpoint layout and nothing else: reading the array
metadata of ``<ckpt>/params`` without loading it, checking that it matches the
model's parameters path by path, and restoring the arrays with orbax straight
into the model's dtypes and shardings.

The layout (as openpi's ``restore_params`` reads it): an
orbax PyTree checkpoint whose tree is ``{'params': <nested pure dict>}``.
Released checkpoints are pure dicts; checkpoints written by openpi training
(an ``nnx.State``) end every path in ``'/value'``, which is stripped when *all*
paths end in ``value`` (as openpi's ``restore_params`` does). Arrays are float32
or bfloat16 on disk; orbax casts them to the model's dtype while reading.

Paths are ``'/'``-joined keys relative to the ``params`` item, e.g.
``PaliGemma/llm/layers/attn/q_einsum/w``.

LoRA: openpi's loader fills missing ``.*lora.*`` weights from init. Here every
mismatch is an error unless asked otherwise, so that nothing is dropped or
initialised silently:

* a LoRA path the model has but the checkpoint lacks (a released checkpoint
  loaded into a LoRA model) is returned among the skipped paths when it matches
  ``missing_ok`` (e.g. ``missing_ok="lora"``);
* a LoRA path the checkpoint has but the model lacks (a checkpoint trained with
  LoRA loaded into a model without it) is left unloaded when it matches
  ``ignore_extra`` (e.g. ``ignore_extra="lora"``).

Both are regular expressions searched in the path (``re.search``). :func:`init_params`
(a run's ``config.model.init_checkpoint``) passes ``missing_ok="lora"``, as openpi's
loader does: a LoRA model starts from a plain checkpoint with fresh adapters.
"""

from __future__ import annotations

import collections.abc
import os
import re
from typing import Any, Iterable, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

SEP = "/"
PARAMS_ITEM = "params"  # the checkpoint's top-level item holding the model
VALUE_SUFFIX = "value"  # the leaf name of an nnx.State's variables
# On-disk dtypes accepted for a floating-point parameter; orbax casts on read.
FLOAT_DISK_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


class ShapeDtypeLike(Protocol):
  """Anything with ``shape`` and ``dtype``: ``jax.ShapeDtypeStruct``, an array, orbax metadata."""

  shape: tuple[int, ...]
  dtype: Any


# --------------------------------------------------------------------------- paths


def flatten(tree: Mapping[str, Any]) -> dict[str, Any]:
  """Nested mappings -> ``{'a/b/c': leaf}``; empty sub-mappings are dropped.

  Any ``Mapping`` is a node (dicts, ``nnx.State``, orbax metadata trees);
  everything else is a leaf. Keys are converted with ``str``.
  """
  flat: dict[str, Any] = {}

  def visit(node: Mapping[str, Any], prefix: str) -> None:
    for key, child in node.items():
      key = str(key)
      if SEP in key:
        raise ValueError(f"key {key!r} under {prefix or '<root>'!r} contains {SEP!r}; "
                         f"paths could not be split back")
      path = f"{prefix}{SEP}{key}" if prefix else key
      if isinstance(child, collections.abc.Mapping):
        visit(child, path)
      else:
        flat[path] = child

  if not isinstance(tree, collections.abc.Mapping):
    raise TypeError(f"expected a nested mapping, got {type(tree).__name__}")
  visit(tree, "")
  return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  """``{'a/b/c': leaf}`` -> nested plain dicts (the inverse of :func:`flatten`)."""
  tree: dict[str, Any] = {}
  for path in sorted(flat):
    node = tree
    keys = path.split(SEP)
    for depth, key in enumerate(keys[:-1]):
      node = node.setdefault(key, {})
      if not isinstance(node, dict):
        raise ValueError(f"path {path!r}: {SEP.join(keys[:depth + 1])!r} is both a leaf and a node")
    if keys[-1] in node:
      raise ValueError(f"path {path!r}: is both a leaf and a node")
    node[keys[-1]] = flat[path]
  return tree


def _under(path: str, prefixes: Iterable[str]) -> str | None:
  """The first of ``prefixes`` that ``path`` lies under (whole components only), or None."""
  for prefix in prefixes:
    prefix = prefix.rstrip(SEP)
    if path == prefix or path.startswith(prefix + SEP):
      return prefix
  return None


def _matches(pattern: str | None, path: str) -> bool:
  return pattern is not None and re.search(pattern, path) is not None


# ------------------------------------------------------------------ checkpoint side


def _read_layout(path: str) -> tuple[dict[str, jax.ShapeDtypeStruct], dict[str, tuple[str, ...]]]:
  """Metadata of an openpi ``params`` directory.

  Returns:
    ``(meta, disk_keys)``: per stripped path (no ``params`` item, no ``value``
    suffix), its shape/dtype and its key path in the on-disk tree.
  """
  directory = epath.Path(path)
  if not directory.is_dir():
    raise FileNotFoundError(f"openpi checkpoint {path!r}: no such directory")
  with ocp.PyTreeCheckpointer() as ckptr:
    meta = ckptr.metadata(directory)
  # orbax >= 0.11 wraps the tree in StepMetadata(item_metadata=TreeMetadata(tree=...)).
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  if not isinstance(tree, collections.abc.Mapping) or not tree:
    hint = ""
    if (directory / PARAMS_ITEM).is_dir():
      hint = f"; did you mean {os.fspath(directory / PARAMS_ITEM)!r}?"
    raise ValueError(f"{path!r} is not an orbax PyTree checkpoint (expected the '.../params' "
                     f"directory of an openpi checkpoint){hint}")
  if PARAMS_ITEM not in tree:
    raise ValueError(f"openpi checkpoint {path!r} has no top-level {PARAMS_ITEM!r} item "
                     f"(top-level keys: {sorted(tree)})")
  flat = flatten(tree[PARAMS_ITEM])
  if not flat:
    raise ValueError(f"openpi checkpoint {path!r}: the {PARAMS_ITEM!r} item holds no arrays")
  strip = all(p.split(SEP)[-1] == VALUE_SUFFIX for p in flat)
  meta_out: dict[str, jax.ShapeDtypeStruct] = {}
  disk_keys: dict[str, tuple[str, ...]] = {}
  for disk_path, leaf in flat.items():
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) or leaf.shape is None:
      raise ValueError(f"openpi checkpoint {path!r}: {PARAMS_ITEM}/{disk_path} is not an array "
                       f"({type(leaf).__name__})")
    key = disk_path.rsplit(SEP, 1)[0] if strip else disk_path
    meta_out[key] = jax.ShapeDtypeStruct(tuple(leaf.shape), np.dtype(leaf.dtype))
    disk_keys[key] = (PARAMS_ITEM, *disk_path.split(SEP))
  return meta_out, disk_keys


def read_checkpoint_tree(path: str) -> dict[str, jax.ShapeDtypeStruct]:
  """The flat ``{path: ShapeDtypeStruct}`` of an openpi ``.../params`` directory, no arrays read.

  The ``params`` item is removed from the paths, and so is a trailing ``value``
  when every path has one (checkpoints written by openpi training).
  """
  return _read_layout(path)[0]


# --------------------------------------------------------------------------- checks


def _as_flat(tree: Mapping[str, Any]) -> dict[str, Any]:
  """Accepts a flat ``{path: leaf}`` or a nested dict."""
  if any(isinstance(v, collections.abc.Mapping) for v in tree.values()):
    return flatten(tree)
  return dict(tree)


def _is_float(dtype) -> bool:
  return jnp.issubdtype(np.dtype(dtype), jnp.floating)


def check_compatible(ckpt: Mapping[str, ShapeDtypeLike], target: Mapping[str, ShapeDtypeLike], *,
                     skip_prefixes: Iterable[str] = (), ignore_extra: str | None = None,
                     missing_ok: str | None = None) -> None:
  """Checks that an openpi checkpoint fills the model's parameters exactly.

  Args:
    ckpt: the checkpoint's ``{path: shape/dtype}`` (:func:`read_checkpoint_tree`).
    target: the model's ``{path: shape/dtype}`` (flat, or nested dicts).
    skip_prefixes: target subtrees (e.g. ``'rl'``) that the model initialises
      fresh; they must not be in the checkpoint.
    ignore_extra: regex; checkpoint paths matching it that the model lacks are
      allowed (left unloaded), e.g. ``'lora'``.
    missing_ok: regex; target paths matching it that the checkpoint lacks are
      allowed (the caller initialises them), e.g. ``'lora'``.

  Shapes must be equal. A floating-point target accepts float32 or bfloat16 on
  disk (cast on load); any other target dtype must match exactly.

  Raises:
    ValueError: naming the first bad path in sorted order.
  """
  ckpt, target = _as_flat(ckpt), _as_flat(target)
  skip_prefixes = tuple(skip_prefixes)
  for path in sorted(set(ckpt) | set(target)):
    skipped_by = _under(path, skip_prefixes)
    if path not in ckpt:
      if skipped_by is None and not _matches(missing_ok, path):
        raise ValueError(f"the model expects path {path!r} (shape {tuple(target[path].shape)}) "
                         f"but the openpi checkpoint does not have it")
      continue
    have = ckpt[path]
    if skipped_by is not None:
      raise ValueError(f"openpi checkpoint path {path!r} lies under {skipped_by!r}, which the "
                       f"model initialises fresh (skip_prefixes={skip_prefixes}); it would be "
                       f"dropped")
    if path not in target:
      if _matches(ignore_extra, path):
        continue
      lora = (" (openpi LoRA weight; set config.model.lora to load it, or pass "
              "ignore_extra='lora' to leave it out)" if "lora" in path else "")
      raise ValueError(f"openpi checkpoint path {path!r} (shape {tuple(have.shape)}) is not a "
                       f"parameter of the model{lora}")
    want = target[path]
    if tuple(have.shape) != tuple(want.shape):
      raise ValueError(f"openpi checkpoint path {path!r} has shape {tuple(have.shape)} but the "
                       f"model expects {tuple(want.shape)}")
    have_dtype, want_dtype = np.dtype(have.dtype), np.dtype(want.dtype)
    if _is_float(want_dtype):
      if have_dtype not in FLOAT_DISK_DTYPES:
        raise ValueError(f"openpi checkpoint path {path!r} has dtype {have_dtype} but the model's "
                         f"{want_dtype} parameter accepts only float32 or bfloat16 on disk")
    elif have_dtype != want_dtype:
      raise ValueError(f"openpi checkpoint path {path!r} has dtype {have_dtype} but the model "
                       f"expects {want_dtype}")


# ---------------------------------------------------------------------------- load


def _default_sharding() -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def load_openpi_params(path: str, target: Mapping[str, Any], *,
                       skip_prefixes: Iterable[str] = ("rl",), dtype=None,
                       ignore_extra: str | None = None,
                       missing_ok: str | None = None) -> tuple[dict[str, Any], list[str]]:
  """Restores an openpi checkpoint into the model's dtypes and shardings.

  Args:
    path: the checkpoint's ``.../params`` directory (local or any epath, e.g. ``gs://``).
    target: nested dict of ``jax.ShapeDtypeStruct`` describing the model's
      parameters; each leaf's ``sharding`` is used (single-device when None).
    skip_prefixes: target subtrees not in an openpi checkpoint (the RL heads).
    dtype: when given, floating-point parameters are restored in this dtype
      instead of the target's (e.g. ``jnp.bfloat16`` for inference).
    ignore_extra, missing_ok: see :func:`check_compatible`.

  Returns:
    ``(params, skipped)``: ``params`` the nested plain dict of ``jax.Array`` for
    every target path that was loaded (the target minus ``skipped``), and
    ``skipped`` the sorted target paths not loaded (under ``skip_prefixes`` or
    allowed by ``missing_ok``), which the caller initialises fresh.

  Raises:
    ValueError: the checkpoint does not fit ``target`` (see :func:`check_compatible`).
  """
  skip_prefixes = tuple(skip_prefixes)
  flat_target = flatten(target)
  meta, disk_keys = _read_layout(path)
  check_compatible(meta, flat_target, skip_prefixes=skip_prefixes, ignore_extra=ignore_extra,
                   missing_ok=missing_ok)
  load = sorted(p for p in flat_target if p in meta and _under(p, skip_prefixes) is None)
  skipped = sorted(set(flat_target) - set(load))

  # The restore item mirrors the on-disk tree (params item, '/value' leaves) but holds
  # only the paths to load; orbax reads, casts and places each array in one step.
  item, restore_args = {}, {}
  for p in load:
    want = flat_target[p]
    out_dtype = np.dtype(want.dtype)
    if dtype is not None and _is_float(out_dtype):
      out_dtype = np.dtype(dtype)
    sharding = getattr(want, "sharding", None) or _default_sharding()
    disk_path = SEP.join(disk_keys[p])
    item[disk_path] = jax.ShapeDtypeStruct(tuple(want.shape), out_dtype, sharding=sharding)
    restore_args[disk_path] = ocp.ArrayRestoreArgs(
        restore_type=jax.Array, sharding=sharding, dtype=out_dtype, global_shape=tuple(want.shape))
  partial = len(load) < len(meta)  # checkpoint paths left out through ignore_extra
  with ocp.PyTreeCheckpointer() as ckptr:
    restored = ckptr.restore(
        epath.Path(path),
        args=ocp.args.PyTreeRestore(item=unflatten(item), restore_args=unflatten(restore_args),
                                    partial_restore=partial))
  flat_restored = flatten(restored)
  params = {p: flat_restored[SEP.join(disk_keys[p])] for p in load}
  return unflatten(params), skipped


# LoRA weights an openpi checkpoint may lack: openpi's loader fills missing '.*lora.*'
# weights from init (a released checkpoint into a LoRA model), and so does init_params.
LORA_MISSING_OK = "lora"


def init_params(policy, rng: jax.Array, checkpoint: str = "", shardings=None) -> dict:
  """A policy's parameters: fresh, or openpi's weights with fresh RL-only heads.

  Args:
    policy: the policy (``abstract_params()`` and ``init(rng)``).
    rng: key of the fresh initialisation.
    checkpoint: an openpi ``.../params`` directory; empty for a fresh policy.
    shardings: optional tree (like the params) of target shardings.

  The fresh RL heads (``rl/``), and a LoRA model's adapters when the checkpoint
  has none (``config.model.lora`` on a plain openpi checkpoint), come from
  ``policy.init`` jitted to return only them, so XLA drops the rest of the
  initialisation: a full model is never initialised just to be overwritten.
  """
  init = jax.jit(policy.init, out_shardings=shardings)
  if not checkpoint:
    return init(rng)
  target = policy.abstract_params()
  if shardings is not None:
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          target, shardings)
  loaded, skipped = load_openpi_params(checkpoint, target, skip_prefixes=("rl",),
                                       missing_ok=LORA_MISSING_OK)

  def pick(tree):  # the skipped paths of a params-like tree
    flat = flatten(tree)
    return unflatten({p: flat[p] for p in skipped})

  fresh_shardings = None if shardings is None else pick(shardings)
  fresh = jax.jit(lambda k: pick(policy.init(k)), out_shardings=fresh_shardings)(rng)
  return unflatten({**flatten(loaded), **flatten(fresh)})
