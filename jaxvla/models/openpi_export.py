"""Export of a pi0 / pi0.5 / pi0-FAST policy in openpi's checkpoint layout, for openpi's own
tools.

This file owns the jaxvla -> openpi direction (:mod:`jaxvla.models.openpi_import` owns
the other): which parameters an openpi checkpoint holds, in which dtypes, and the
directory it writes::

  <out>/params/                          orbax PyTree checkpoint, tree {"params": <openpi tree>}
  <out>/assets/<asset_id>/norm_stats.json  {"norm_stats": {"state": {...}, "actions": {...}}}
  <out>/fast_tokenizer/                  pi0-FAST only: the FAST tokenizer's files (HuggingFace's
                                         processor layout; openpi's Pi0FASTConfig takes it through
                                         fast_model_tokenizer_kwargs={"fast_tokenizer_path": ...})

openpi's ``restore_params`` reads ``params/`` with a plain ``PyTreeCheckpointer`` and
``normalize.load`` reads the norm stats (the file format is
:mod:`jaxvla.data.norm_stats`'s). The tree is openpi's (``jaxvla/models/openpi_params.json``
lists it with its dtypes; ``fast_openpi_params.json`` pi0-FAST's, float32 throughout):

* ``rl/`` (the value head, the flow-noise std head) is dropped: openpi has no RL heads. A
  policy steered by a 'latent' or 'residual' sampler (``rl/steer_*``) is refused unless
  ``--base_only``.
* LoRA adapters (``lora`` leaves) are folded into their weights with
  ``jaxvla.models.lora.merge_lora``, so the export loads into openpi's non-LoRA config.
* A ViT with jaxvla's fixed ``sincos2d`` position embedding gets that embedding written
  as openpi's learned ``PaliGemma/img/pos_embedding`` ``[1, P, W]``: openpi adds the
  stored table, which then holds the same values, so the function is unchanged.
* Every array is cast to openpi's stored dtype (float32 throughout).

Normalisation: openpi normalises pi0's state and actions by z-score and pi0.5's by
quantiles and its file does not say which, so a policy trained with the other mode is
refused unless ``allow_norm_mode_mismatch`` (the openpi config must then set
``use_quantile_norm`` to match). A policy without a normaliser (it acts in env units) is
refused too, because openpi needs the file: ``identity_norm_stats=True`` writes
statistics under which openpi's transform leaves values unchanged up to its ``1e-6``.

The command, ``python -m jaxvla.openpi_export`` (:mod:`jaxvla.openpi_export`), loads any
policy :func:`jaxvla.storage.policy_io.load` reads and writes the export with :func:`export_loaded`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxvla.data import norm_stats
from jaxvla.models import fast_tokenizer, layers, lora, openpi_import, summary

PARAMS_DIR = "params"
ASSETS_DIR = "assets"
RL_KEY = "rl"
POS_EMBEDDING = "PaliGemma/img/pos_embedding"
# openpi's normalisation per model (its DataConfigFactory: use_quantile_norm = model != PI0).
# openpi normalises pi0's state and actions by z-score and pi0.5's (and FAST's) by
# quantiles (its DataConfigFactory: use_quantile_norm = model_type != PI0). The one
# owner of that rule: jaxvla.storage.policy_io reads openpi checkpoints with it.
OPENPI_NORM_MODE = {"pi0": "zscore", "pi05": "quantile", "pi0_fast": "quantile"}
from jaxvla.models.summary import FAST_SPEC  # (its one owner) pylint: disable=wrong-import-position


def _spec(model: str, spec_path: str = summary.DEFAULT_SPEC) -> dict[str, dict]:
  """openpi's ``{path: {"shape", "dtype"}}`` for ``model`` ('pi0', 'pi05' or 'pi0_fast', whose
  full-size tree :data:`FAST_SPEC` holds: openpi stores it in float32)."""
  if model == "pi0_fast":
    with open(FAST_SPEC, encoding="utf-8") as f:
      return {path: {"shape": shape, "dtype": "float32"}
              for path, shape in json.load(f)["full"].items()}
  with open(spec_path, encoding="utf-8") as f:
    models = json.load(f)["models"]
  if model not in models:
    raise ValueError(f"model {model!r}: openpi checkpoints hold one of {sorted(models)}")
  return models[model]["params"]


def _has_lora(tree: Mapping[str, Any]) -> bool:
  return any(lora.is_adapter(path) for path in openpi_import.flatten(tree))


def openpi_tree(params: Mapping[str, Any], model: str, *, image_size: int,
                patch_size: int) -> dict[str, Any]:
  """jaxvla pi0 / pi0.5 / pi0-FAST params -> openpi's nested tree in openpi's dtypes (jittable).

  Args:
    params: the policy's parameters (``rl/`` and LoRA adapters allowed).
    model: 'pi0', 'pi05' or 'pi0_fast' (which openpi tree).
    image_size, patch_size: the ViT's input side and patch, for the ``sincos2d`` table
      (a ``[1, (image_size // patch_size) ** 2, W]`` position embedding).

  Raises:
    ValueError: naming the first path openpi's tree has and the params lack (or the
      other way round), or a path whose rank differs.
  """
  spec = _spec(model)
  tree = {k: v for k, v in params.items() if k != RL_KEY}
  if _has_lora(tree):
    tree = lora.merge_lora(tree)
  flat = openpi_import.flatten(tree)
  if POS_EMBEDDING in spec and POS_EMBEDDING not in flat:
    width = flat["PaliGemma/img/embedding/kernel"].shape[-1]
    grid = image_size // patch_size
    flat[POS_EMBEDDING] = layers.posemb_sincos_2d(grid, grid, width)[None]
  missing, extra = sorted(spec.keys() - flat.keys()), sorted(flat.keys() - spec.keys())
  if missing:
    raise ValueError(f"openpi's {model} tree has {missing[0]!r} {spec[missing[0]]['shape']}; "
                     f"the params do not ({len(missing)} such paths)")
  if extra:
    raise ValueError(f"parameter {extra[0]!r} {list(flat[extra[0]].shape)} has no place in "
                     f"openpi's {model} tree ({len(extra)} such paths)")
  out = {}
  for path, entry in spec.items():
    if len(flat[path].shape) != len(entry["shape"]):
      raise ValueError(f"parameter {path!r} has shape {list(flat[path].shape)}; openpi's has "
                       f"rank {len(entry['shape'])} ({entry['shape']} in the full model)")
    out[path] = jnp.asarray(flat[path]).astype(np.dtype(entry["dtype"]))
  return openpi_import.unflatten(out)


def identity_normalizer(state_dim: int, action_dim: int, mode: str) -> norm_stats.Normalizer:
  """Statistics (mean 0, std 1, q01 -1, q99 1) that openpi's transforms leave values under,
  up to openpi's ``1e-6``: for a policy that acts in env units."""
  def stats(d: int) -> norm_stats.NormStats:
    return norm_stats.NormStats(mean=np.zeros(d), std=np.ones(d), q01=-np.ones(d),
                                q99=np.ones(d))
  return norm_stats.Normalizer({"state": stats(state_dim), "actions": stats(action_dim)}, mode)


def _check_asset_id(asset_id: str) -> None:
  parts = asset_id.split("/")
  if not asset_id or os.path.isabs(asset_id) or any(p in ("", ".", "..") for p in parts):
    raise ValueError(f"asset_id={asset_id!r} must be a relative name such as "
                     "'physical-intelligence/libero' (openpi's data.asset_id)")


def _check_normalizer(normalizer: norm_stats.Normalizer | None, model: str,
                      allow_norm_mode_mismatch: bool) -> norm_stats.Normalizer:
  if normalizer is None:
    raise ValueError("the policy has no normaliser (it acts in env units) but openpi needs "
                     "assets/<asset_id>/norm_stats.json; pass --identity_norm_stats "
                     "(identity_norm_stats=True) to write statistics openpi applies as identity")
  want = OPENPI_NORM_MODE[model]
  if normalizer.mode != want and not allow_norm_mode_mismatch:
    raise ValueError(f"the policy normalises with {normalizer.mode!r} but openpi's {model} "
                     f"configs use {want!r} and norm_stats.json cannot say so; pass "
                     "--allow_norm_mode_mismatch (allow_norm_mode_mismatch=True) if your openpi "
                     f"config sets use_quantile_norm={normalizer.mode == 'quantile'}")
  return normalizer


def export_openpi(out_dir: str, params: Mapping[str, Any],
                  normalizer: norm_stats.Normalizer | None, asset_id: str, *, model: str,
                  image_size: int, patch_size: int, allow_norm_mode_mismatch: bool = False,
                  identity_dims: tuple[int, int] | None = None) -> dict:
  """Writes ``out_dir/params`` and ``out_dir/assets/<asset_id>/norm_stats.json``.

  Args:
    out_dir: the openpi checkpoint (step) directory to create; ``params/`` must not exist.
    params: the policy's parameters (see :func:`openpi_tree`).
    normalizer: the policy's state / action normalisation (None: see ``identity_dims``).
    asset_id: openpi's ``data.asset_id`` (e.g. ``physical-intelligence/libero``).
    model: 'pi0', 'pi05' or 'pi0_fast'.
    image_size, patch_size: the ViT's (see :func:`openpi_tree`).
    allow_norm_mode_mismatch: write statistics of the mode openpi does not use for
      ``model`` (see the module docstring).
    identity_dims: ``(state_dim, action_dim)``: with no normaliser, write identity
      statistics of these sizes instead of refusing.

  Returns:
    ``{"params": dir, "norm_stats": file, "num_arrays": n, "merged_lora": bool}``.

  Raises:
    ValueError: no normaliser (and no ``identity_dims``), a mode openpi would not use, a
      bad ``asset_id``, or a tree that is not openpi's.
    FileExistsError: ``out_dir/params`` exists.
  """
  _check_asset_id(asset_id)
  if model not in OPENPI_NORM_MODE:
    raise ValueError(f"model {model!r}: openpi checkpoints hold one of {sorted(OPENPI_NORM_MODE)}")
  if normalizer is None and identity_dims is not None:
    normalizer = identity_normalizer(*identity_dims, OPENPI_NORM_MODE[model])
  normalizer = _check_normalizer(normalizer, model, allow_norm_mode_mismatch)
  out_dir = os.path.abspath(out_dir)
  params_dir = os.path.join(out_dir, PARAMS_DIR)
  if os.path.exists(params_dir):
    raise FileExistsError(f"{params_dir} exists; export to a new directory")
  merged = _has_lora({k: v for k, v in params.items() if k != RL_KEY})
  tree = jax.device_get(openpi_tree(params, model, image_size=image_size,
                                    patch_size=patch_size))
  os.makedirs(out_dir, exist_ok=True)
  with ocp.PyTreeCheckpointer() as ckptr:
    ckptr.save(params_dir, {"params": tree})
  file = norm_stats.save(os.path.join(out_dir, ASSETS_DIR, asset_id), normalizer.stats)
  return {"params": params_dir, "norm_stats": file,
          "num_arrays": len(openpi_import.flatten(tree)), "merged_lora": merged}


def export_loaded(out_dir: str, loaded, asset_id: str, *, identity_norm_stats: bool = False,
                  allow_norm_mode_mismatch: bool = False, base_only: bool = False) -> dict:
  """:func:`export_openpi` of a :class:`jaxvla.storage.policy_io.LoadedPolicy` (pi0, pi0.5 or
  pi0-FAST, whose FAST tokenizer is written beside, in ``out_dir/fast_tokenizer``).

  A policy RL-trained with a steered sampler ('latent', 'residual') acts through its
  steering head (``rl/steer_*``), which openpi's tree has no place for: it is refused
  unless ``base_only`` (export the frozen base flow, which openpi then runs unsteered).
  """
  name = loaded.config.model.name
  net = getattr(loaded.policy, "net", None)
  if name not in OPENPI_NORM_MODE or net is None:
    raise ValueError(f"config.model.name={name!r}: only pi0 / pi05 / pi0_fast policies have "
                     "openpi's tree")
  if getattr(loaded.policy, "steer", "") and not base_only:
    raise ValueError(f"the policy steers its flow with rl/steer_* (train_sampler="
                     f"{loaded.policy.steer!r}), which openpi's tree cannot hold: openpi "
                     "would run the unsteered base policy. Serve it with jaxvla.serve, or pass --base_only "
                     "(base_only=True) to export that base policy deliberately")
  dims = (loaded.spec.state_dim, loaded.spec.action_dim) if identity_norm_stats else None
  out = export_openpi(out_dir, loaded.params, loaded.normalizer, asset_id, model=name,
                      image_size=net.image_size, patch_size=net.vit.patch_size,
                      allow_norm_mode_mismatch=allow_norm_mode_mismatch, identity_dims=dims)
  written = fast_tokenizer.save_beside(os.path.abspath(out_dir), loaded.policy)
  if written:
    out["fast_tokenizer"] = written
  return out


if __name__ == "__main__":
  # The command loads policies through jaxvla.storage.policy_io, which sits above models/: it lives in
  # jaxvla.openpi_export, so that nothing under models/ imports back up.
  sys.exit("error: the openpi export's command is now `python -m jaxvla.openpi_export` "
           "(same flags)")
