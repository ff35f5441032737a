"""Per-module parameter counts of a policy, abstractly: ``python -m jaxvla.models.summary``.

This module owns the per-module parameter breakdown of the VLA trees and its
comparison with openpi's parameter spec (``jaxvla/models/openpi_params.json``):

* ``siglip``: ``PaliGemma/img`` minus its head (the So400m/14 ViT);
* ``multimodal_projector``: ``PaliGemma/img/head`` (ViT width -> LLM width);
* ``gemma_llm``: ``PaliGemma/llm`` keys of expert 0 (PaliGemma's Gemma 2B);
* ``action_expert``: ``PaliGemma/llm`` keys with a path component ending in ``_1``
  (``q_einsum_1``, ``mlp_1``, ``pre_attention_norm_1``, ``final_norm_1`` ...);
* ``action_projections``: every other top-level key (``action_in_proj``, ...).

Everything under ``rl/`` (value head, ``flow_noise`` std head) is RL-only and not
in an openpi checkpoint: it is reported apart (``rl_params``, ``rl_modules``) and
``total_params`` never includes it. Nothing is allocated: shapes come from the
policy's ``abstract_params()`` (``jax.eval_shape``), so the full ~3.3B variants
(13 GB in float32) are summarised in about a second on a CPU.

Full variants are built as openpi builds them (3 cameras at 224x224, state and
action padded to 32, PaliGemma's 257152-row vocabulary, learned ViT position
embedding, bfloat16 compute); tiny / small use the built-in env's spec.

pi0-FAST's tree depends on its FAST tokenizer only through the vocabulary size (tiny and
small: the built-in tokenizer's ids plus the FAST ids; full: PaliGemma's 257152 rows, the
FAST ids at their top). ``--fast_tokenizer=DIR`` names one; without it a stand-in is fitted
on random smooth chunks at ``model.fast_vocab_size`` (reported as ``fast_tokenizer``). Its
full variant is compared with openpi's ``Pi0FAST`` tree (``fast_openpi_params.json``, paths
and shapes).

Prints one JSON line::

  {"model": "pi0", "variant": "full", "total_params": 3238048528, "modules": {...},
   "rl_params": ..., "rl_modules": {...}, "matches_openpi_spec": true, ...}
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Mapping

import jax
import ml_collections
import numpy as np

from jaxvla import defaults
from jaxvla.envs import builtin, protocol

# openpi's parameter trees (names, shapes, dtypes), read from openpi's own model code
# (provenance in the file's "source" and "how" fields; third_party/README.md).
DEFAULT_SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openpi_params.json")

MODULES = ("siglip", "multimodal_projector", "gemma_llm", "action_expert", "action_projections")
RL_KEY = "rl"
# openpi's Pi0FAST trees (paths and shapes only), tiny and full.
FAST_SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_openpi_params.json")
# Our module name -> the key of the spec's ``param_split`` for the same parameters.
OPENPI_SPLIT_NAMES = {
    "siglip": "siglip_so400m",
    "multimodal_projector": "multimodal_projector(img/head)",
    "gemma_llm": "gemma_2b(PaliGemma/llm, expert 0)",
    "action_expert": "action_expert_gemma_300m(llm *_1 keys)",
    "action_projections": "action_projections(top-level)",
}
OPENPI_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
OPENPI_IMAGE_SIZE = 224
OPENPI_PADDED_DIM = 32  # openpi pads state and actions to 32 dims.
OPENPI_MAX_TOKEN_LEN = {"pi0": 48, "pi05": 200}  # Pi0Config's prompt lengths.


# ------------------------------------------------------------------ building --
def default_config() -> ml_collections.ConfigDict:
  """A fresh default run config (:func:`jaxvla.defaults.get_config`)."""
  return defaults.get_config()


def model_config(model: str, variant: str, *,
                 dtype: str | None = None) -> ml_collections.ConfigDict:
  """The default ``model`` sub-config (:mod:`jaxvla.defaults`) for ``model`` / ``variant``.

  ``full``: openpi's sizes (224 px, learned posemb, 32-dim state / actions,
  PaliGemma's vocabulary, openpi's prompt length) and bfloat16 compute unless
  ``dtype`` says otherwise; tiny / small keep the default config's settings.
  """
  c = default_config().model
  c.name, c.variant = model, variant
  if variant == "full":
    from jaxvla.models import pi0  # pylint: disable=import-outside-toplevel
    c.update(posemb="learn", image_size=OPENPI_IMAGE_SIZE, action_dim=OPENPI_PADDED_DIM,
             state_dim=OPENPI_PADDED_DIM, vocab_size=pi0.PALIGEMMA_VOCAB_SIZE, dtype="bfloat16",
             max_token_len=OPENPI_MAX_TOKEN_LEN.get(model, 48))
  if dtype is not None:
    c.dtype = dtype
  return c


def env_spec(variant: str) -> protocol.EnvSpec:
  """The ``EnvSpec`` a variant is built against: openpi's for ``full``, the built-in env's else."""
  if variant == "full":
    return protocol.EnvSpec(camera_names=OPENPI_CAMERAS,
                            image_shape=(OPENPI_IMAGE_SIZE, OPENPI_IMAGE_SIZE, 3),
                            state_dim=OPENPI_PADDED_DIM, action_dim=OPENPI_PADDED_DIM,
                            max_episode_steps=100)
  return builtin.spec_from_config(default_config().env)


def stand_in_fast_tokenizer(config: ml_collections.ConfigDict, horizon: int,
                            action_dim: int, directory: str) -> None:
  """Saves into ``directory`` a FAST tokenizer fitted on random smooth chunks ``[512, H, A]``
  at ``config.fast_scale`` / ``fast_vocab_size``, covering ``[-1, 1]``: the tree's shapes
  depend on a tokenizer only through its vocabulary size."""
  from jaxvla.models import fast_tokenizer as fast_lib  # pylint: disable=import-outside-toplevel
  chunks = fast_lib.smooth_chunks(np.random.default_rng(0), 512, horizon, action_dim)
  fast_lib.FastTokenizer.fit(chunks, scale=config.fast_scale, vocab_size=config.fast_vocab_size,
                             cover=1.0).save(directory)


def make_policy(model: str, variant: str, *, dtype: str | None = None,
                config: ml_collections.ConfigDict | None = None, fast_tokenizer: str = ""):
  """The policy ``model`` / ``variant`` (see :func:`model_config`; ``config`` overrides it).

  pi0_fast reads ``fast_tokenizer`` (a directory), else ``config.fast_tokenizer_path``,
  else a stand-in (:func:`stand_in_fast_tokenizer`).
  """
  from jaxvla.models import policy as policy_lib  # pylint: disable=import-outside-toplevel
  if model not in policy_lib.POLICIES:
    raise ValueError(f"--model={model!r} is not one of {sorted(policy_lib.POLICIES)}")
  config = config if config is not None else model_config(model, variant, dtype=dtype)
  spec = env_spec(variant)
  if model == "pi0_fast":
    config = ml_collections.ConfigDict(config.to_dict())
    if fast_tokenizer:
      if not os.path.isdir(fast_tokenizer):
        raise ValueError(f"--fast_tokenizer={fast_tokenizer!r} is not a directory")
      config.fast_tokenizer_path = fast_tokenizer
    elif not config.fast_tokenizer_path:  # (the policy reads the files when it is made)
      with tempfile.TemporaryDirectory(prefix="fast_stand_in_") as directory:
        stand_in_fast_tokenizer(config, config.chunk_len, spec.action_dim, directory)
        config.fast_tokenizer_path = directory
        return policy_lib.make_policy(config, spec)
  return policy_lib.make_policy(config, spec)


# ------------------------------------------------------------------ counting --
def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Nested dict -> ``{"a/b/c": leaf}`` (the spec's path convention)."""
  out: dict[str, Any] = {}
  for key, value in tree.items():
    path = f"{prefix}/{key}" if prefix else str(key)
    if isinstance(value, Mapping):
      out.update(flatten(value, path))
    else:
      out[path] = value
  return out


def module_of(path: str) -> str:
  """The module (one of :data:`MODULES`, or ``"rl"``) a parameter ``path`` belongs to."""
  parts = path.split("/")
  if parts[0] == RL_KEY:
    return RL_KEY
  if parts[0] == "PaliGemma" and len(parts) > 1:
    if parts[1] == "img":
      return "multimodal_projector" if len(parts) > 2 and parts[2] == "head" else "siglip"
    if parts[1] == "llm":
      return "action_expert" if any(p.endswith("_1") for p in parts[2:]) else "gemma_llm"
    raise ValueError(f"parameter {path!r}: unknown PaliGemma child {parts[1]!r} "
                     "(expected 'img' or 'llm')")
  return "action_projections"


def _size(leaf) -> int:
  return int(math.prod(leaf.shape))


def count(abstract: Mapping[str, Any]) -> dict:
  """Parameter counts of a (nested or flat) tree of arrays / ShapeDtypeStructs.

  Returns:
    ``total_params`` (openpi-compatible part, no ``rl/``), ``modules`` {name: count}
    for every name of :data:`MODULES`, ``num_arrays`` (no ``rl/``), ``param_bytes``
    (no ``rl/``, at the leaves' dtypes), ``rl_params``, ``rl_modules``
    {``rl/`` child: count} and ``total_with_rl``.
  """
  flat = flatten(abstract)
  modules = {name: 0 for name in MODULES}
  rl_modules: dict[str, int] = {}
  num_arrays = param_bytes = 0
  for path, leaf in flat.items():
    module, n = module_of(path), _size(leaf)
    if module == RL_KEY:
      child = path.split("/")[1] if "/" in path else path
      rl_modules[child] = rl_modules.get(child, 0) + n
      continue
    modules[module] += n
    num_arrays += 1
    param_bytes += n * np.dtype(leaf.dtype).itemsize
  total, rl = sum(modules.values()), sum(rl_modules.values())
  return dict(total_params=total, modules=modules, num_arrays=num_arrays,
              param_bytes=param_bytes, rl_params=rl, rl_modules=rl_modules,
              total_with_rl=total + rl)


# --------------------------------------------------------------- openpi spec --
def load_spec(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def spec_mismatches(abstract: Mapping[str, Any], spec_params: Mapping[str, dict]) -> list[str]:
  """Path-by-path differences between our tree (``rl/`` excluded) and a spec's ``params``.

  Returns:
    One line per difference (missing path, extra path, shape mismatch), sorted; empty
    when every path and shape is equal.
  """
  ours = {k: tuple(v.shape) for k, v in flatten(abstract).items() if module_of(k) != RL_KEY}
  theirs = {k: tuple(v["shape"]) for k, v in spec_params.items()}
  out = [f"missing (in openpi, not ours): {k} {list(theirs[k])}"
         for k in theirs.keys() - ours.keys()]
  out += [f"extra (ours, not in openpi): {k} {list(ours[k])}" for k in ours.keys() - theirs.keys()]
  out += [f"shape: {k} ours {list(ours[k])} openpi {list(theirs[k])}"
          for k in ours.keys() & theirs.keys() if ours[k] != theirs[k]]
  return sorted(out)


def split_as_openpi(modules: Mapping[str, int]) -> dict[str, int]:
  """Our ``modules`` counts under the spec's ``param_split`` names."""
  return {OPENPI_SPLIT_NAMES[k]: v for k, v in modules.items()}


def fast_summary_spec(out: dict, abstract: Mapping[str, Any], spec_path: str) -> dict:
  """``out`` with pi0-FAST's comparison with openpi's ``Pi0FAST`` tree at ``spec_path``
  (:data:`FAST_SPEC`'s form: ``{"full": {path: shape}, ...}``), paths and shapes only."""
  with open(spec_path, encoding="utf-8") as f:
    theirs = json.load(f)["full"]
  mismatches = spec_mismatches(abstract, {k: {"shape": v} for k, v in theirs.items()})
  out["spec"] = spec_path
  out["matches_openpi_spec"] = not mismatches
  if mismatches:
    out["spec_mismatches"] = mismatches[:20]
    out["num_spec_mismatches"] = len(mismatches)
  return out


def summarize(model: str, variant: str, *, spec_path: str | None = DEFAULT_SPEC,
              dtype: str | None = None, policy=None, fast_tokenizer: str = "") -> dict:
  """The summary of ``model`` / ``variant`` as a JSON-able dict (see the module docstring).

  ``matches_openpi_spec`` is true / false for full variants of a model the spec
  has, else null with ``spec_note`` saying why; a missing spec file is reported
  there rather than raised.
  """
  policy = policy if policy is not None else make_policy(model, variant, dtype=dtype,
                                                         fast_tokenizer=fast_tokenizer)
  abstract = policy.abstract_params()
  counts = count(abstract)
  net = getattr(policy, "net", None)
  out = dict(model=model, variant=variant, dtype=getattr(net, "dtype", None), **counts)
  out["param_gib_f32"] = round(counts["total_params"] * 4 / 2**30, 3)
  out["matches_openpi_spec"] = None
  if model == "pi0_fast":
    out["fast_tokenizer"] = fast_tokenizer or "a stand-in fitted on random smooth chunks"
    if spec_path == DEFAULT_SPEC:
      spec_path = FAST_SPEC
  if spec_path is None:
    out["spec_note"] = "no spec given"
    return out
  spec_path = os.path.normpath(spec_path)
  out["spec"] = spec_path
  if not os.path.exists(spec_path):
    out["spec_note"] = f"openpi spec not found at {spec_path}; shapes not compared"
    return out
  if model == "pi0_fast":
    if variant != "full":
      out["spec_note"] = f"only the full variant is compared with openpi's (this is {variant!r})"
      return out
    return fast_summary_spec(out, abstract, spec_path)
  spec = load_spec(spec_path)
  if model not in spec["models"]:
    out["spec_note"] = f"the spec has no model {model!r} (it has {sorted(spec['models'])})"
    return out
  if variant != "full":
    out["spec_note"] = f"only the full variant has openpi's shapes (this is {variant!r})"
    return out
  entry = spec["models"][model]
  mismatches = spec_mismatches(abstract, entry["params"])
  split_ok = split_as_openpi(counts["modules"]) == entry["param_split"]
  out["matches_openpi_spec"] = not mismatches
  out["matches_openpi_split"] = split_ok
  out["matches_openpi_total"] = counts["total_params"] == entry["total_params"]
  if mismatches:
    out["spec_mismatches"] = mismatches[:20]
    out["num_spec_mismatches"] = len(mismatches)
  return out


def main(argv: list[str] | None = None) -> dict:
  import argparse  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="pi0", help="pi0, pi05, action_token_vla, ...")
  parser.add_argument("--variant", default="full", help="tiny, small or full")
  parser.add_argument("--spec", default=DEFAULT_SPEC,
                      help="openpi_params.json to compare with ('' to skip)")
  parser.add_argument("--dtype", default=None, help="compute dtype (default: the variant's)")
  parser.add_argument("--fast_tokenizer", default="",
                      help="pi0_fast: FAST tokenizer directory ('': a stand-in; shapes depend "
                           "only on its vocabulary size)")
  args = parser.parse_args(argv)
  jax.config.update("jax_platforms", "cpu")  # Abstract only: never wake an accelerator.
  out = summarize(args.model, args.variant, spec_path=args.spec or None, dtype=args.dtype,
                  fast_tokenizer=args.fast_tokenizer)
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
