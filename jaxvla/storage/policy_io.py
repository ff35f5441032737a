"""A trained policy, loaded from any of the three places one lives, ready to act.

:func:`load` reads, from ``path``:

* a **jaxvla export** (``<workdir>/export``: ``params/``, ``config.json``, and
  ``norm_stats.json`` / ``env_spec.json`` when the run wrote them);
* a **jaxvla run's checkpoints**: the run's workdir (its ``checkpoints/`` and
  ``config.json``) or the ``checkpoints/`` directory itself; the newest step's
  params (or ``step``'s) and the normaliser stored in that step's ``meta``;
* an **openpi checkpoint**: a step directory with ``params/`` (orbax,
  ``{"params": tree}``) and ``assets/<asset_id>/norm_stats.json``. It carries no
  jaxvla config, so ``config`` is required (e.g. ``configs/openpi.py:pi0``); the
  normalisation mode is openpi's for the model (``zscore`` for pi0, ``quantile``
  for pi0.5, as openpi's data configs choose it).

A ``config`` passed for a jaxvla export or checkpoint replaces the stored one
(e.g. another env to evaluate on); the stored model must still fit it.

A pi0-FAST policy acts through the FAST tokenizer it was trained with: the directory's own
``fast_tokenizer/`` (a run's workdir, an export, an openpi export written by jaxvla) takes
the place of ``config.model.fast_tokenizer_path``; an openpi checkpoint without one needs
that key set (e.g. to a copy of HuggingFace's ``physical-intelligence/fast``).

The result (:class:`LoadedPolicy`) holds the config, the env spec the policy acts
in, the policy, its params and the normaliser. The evaluation (:mod:`jaxvla.eval`),
the policy server (:mod:`jaxvla.serve`) and the openpi export all load through here.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_collections

from jaxvla import defaults
from jaxvla.data import norm_stats
from jaxvla.envs import protocol
from jaxvla.envs import spec_from_config, spec_from_json, spec_to_json
from jaxvla.models import contract, openpi_import
from jaxvla.models import fast_tokenizer as fast_lib
from jaxvla.models import policy as policy_lib
from jaxvla.models.openpi_export import OPENPI_NORM_MODE
from jaxvla.storage import checkpoint

KINDS = ("export", "checkpoint", "openpi")
CONFIG_FILE = "config.json"
SPEC_FILE = "env_spec.json"


@dataclasses.dataclass
class LoadedPolicy:
  """A policy with everything it needs to act (see the module docstring).

  Attributes:
    config: the run config (the stored one, or the one passed to :func:`load`).
    spec: the env spec the policy was built for (cameras, state and action sizes).
    policy: the policy object.
    params: its parameters (on the first local device).
    normalizer: state / action normalisation, or None (the policy acts in env units).
    kind: one of :data:`KINDS`.
    path: where it was loaded from.
  """
  config: ml_collections.ConfigDict
  spec: protocol.EnvSpec
  policy: contract.Policy
  params: contract.Params
  normalizer: norm_stats.Normalizer | None
  kind: str
  path: str


@dataclasses.dataclass(frozen=True)
class PolicyFlags:
  """The command-line flags naming a policy (``--policy``, ``--step``, ``--asset_id``)."""
  policy: object
  step: object
  asset_id: object

  def load_kwargs(self) -> dict:
    """``path``, ``step``, ``asset_id`` as :func:`load` takes them."""
    return dict(path=self.policy.value, step=self.step.value, asset_id=self.asset_id.value)


def define_flags() -> PolicyFlags:
  """Defines the flags every command that loads a policy shares (one wording, one owner)."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  return PolicyFlags(
      policy=flags.DEFINE_string("policy", None, "A jaxvla export, run or checkpoints/ "
                                 "directory, or an openpi checkpoint step.", required=True),
      step=flags.DEFINE_integer("step", None, "Checkpoint step of a jaxvla run (default "
                                "newest)."),
      asset_id=flags.DEFINE_string("asset_id", None, "openpi checkpoint: the assets/<id> "
                                   "whose norm stats to use (default: the only one)."))


def detect(path: str) -> str:
  """Which of :data:`KINDS` ``path`` holds.

  Raises:
    FileNotFoundError: ``path`` is missing or none of the three (naming what was looked for).
  """
  if not os.path.isdir(path):
    raise FileNotFoundError(f"--policy={path}: no such directory")
  has = lambda name: os.path.exists(os.path.join(path, name))
  if has("params") and has(CONFIG_FILE):
    return "export"
  if has("params") and has("assets"):
    return "openpi"
  if has("checkpoints") or checkpoint.has_checkpoint(path):
    return "checkpoint"
  raise FileNotFoundError(
      f"--policy={path} is none of: a jaxvla export (params/ + {CONFIG_FILE}), a jaxvla "
      "run (checkpoints/) or its checkpoints/ directory, an openpi checkpoint "
      "(params/ + assets/)")


def _read_config(file: str) -> ml_collections.ConfigDict:
  """A run's stored config. Model keys added to the defaults (:mod:`jaxvla.defaults`) after
  the run was written (e.g. ``model.lora``) take their defaults, which is what the run used."""
  if not os.path.exists(file):
    raise FileNotFoundError(f"{file} is missing: the run's config is needed to build its "
                            "policy (or pass a config)")
  with open(file, encoding="utf-8") as f:
    stored = json.load(f)
  if isinstance(stored.get("model"), dict):
    stored["model"] = {**defaults.get_config().model.to_dict(), **stored["model"]}
  return ml_collections.ConfigDict(stored)


def _spec(config: ml_collections.ConfigDict, directory: str | None) -> protocol.EnvSpec:
  """The stored ``env_spec.json`` when ``directory`` has one, else the config's env's."""
  file = os.path.join(directory, SPEC_FILE) if directory else ""
  if file and os.path.exists(file):
    with open(file, encoding="utf-8") as f:
      return spec_from_json(json.load(f), file)
  return spec_from_config(config.env)


def write_spec(directory: str, spec: protocol.EnvSpec) -> None:
  """Writes ``directory/env_spec.json`` (an export acts without building its env)."""
  with open(os.path.join(directory, SPEC_FILE), "w", encoding="utf-8") as f:
    json.dump(spec_to_json(spec), f, indent=2)


def _with_own_fast_tokenizer(config: ml_collections.ConfigDict,
                             directory: str) -> ml_collections.ConfigDict:
  """pi0-FAST: the config, with ``model.fast_tokenizer_path`` at ``directory``'s own
  tokenizer when it has one (the one the policy was trained with)."""
  own = os.path.join(directory, fast_lib.RUN_DIR)
  if config.model.name != "pi0_fast" or not os.path.isdir(own):
    return config
  config = config.copy_and_resolve_references()
  config.model.fast_tokenizer_path = own
  return config


def _check_fits(params, policy: contract.Policy, where: str, hint: str) -> None:
  mismatch = checkpoint.params_mismatch(params, policy.abstract_params())
  if mismatch:
    raise ValueError(f"{where} does not fit the config's model: {mismatch}{hint}")


def openpi_asset_ids(path: str) -> list[str]:
  """The asset ids under ``path/assets`` that hold norm stats (openpi's ids nest, e.g.
  ``physical-intelligence/libero``), sorted."""
  assets = os.path.join(path, "assets")
  ids = []
  for root, _, files in os.walk(assets):
    if norm_stats.FILE_NAME in files:
      ids.append(os.path.relpath(root, assets))
  return sorted(ids)


def _openpi_normalizer(path: str, asset_id: str | None, mode: str) -> norm_stats.Normalizer:
  ids = openpi_asset_ids(path)
  if asset_id is None:
    if len(ids) != 1:
      raise ValueError(f"{os.path.join(path, 'assets')} holds norm stats for "
                       f"{ids or 'no asset'}; name one with asset_id (openpi's "
                       "data.asset_id, e.g. 'physical-intelligence/libero')")
    asset_id = ids[0]
  file = os.path.join(path, "assets", asset_id, norm_stats.FILE_NAME)
  if not os.path.exists(file):
    raise FileNotFoundError(f"{file} is missing (assets with norm stats: {ids})")
  return norm_stats.Normalizer(norm_stats.load(file), mode)


def load(path: str, config: ml_collections.ConfigDict | None = None, *,
         step: int | None = None, asset_id: str | None = None) -> LoadedPolicy:
  """Loads the policy at ``path`` (see the module docstring).

  Args:
    path: an export, a run's workdir or ``checkpoints/``, or an openpi checkpoint step.
    config: the run config to build the policy from (required for openpi; for the
      others it replaces the stored one).
    step: the checkpoint step (jaxvla checkpoints only; default the newest).
    asset_id: the openpi asset whose norm stats to use (default: the only one).

  Raises:
    FileNotFoundError / ValueError: naming the file, key or path that is wrong.
  """
  kind = detect(path)
  path = os.path.abspath(path)
  if step is not None and kind != "checkpoint":
    raise ValueError(f"step={step} is given but {path} is a {kind}, not a run's checkpoints")
  if kind == "export":
    config = _with_own_fast_tokenizer(config or _read_config(os.path.join(path, CONFIG_FILE)),
                                      path)
    spec = _spec(config, path)
    policy = policy_lib.make_policy(config.model, spec)
    params, _ = checkpoint.load_policy_params(path)
    _check_fits(params, policy, f"the export {path}", "")
    normalizer = norm_stats.load_normalizer(path)
  elif kind == "checkpoint":
    ckpt_dir = os.path.join(path, "checkpoints") if os.path.isdir(
        os.path.join(path, "checkpoints")) else path
    run_dir = os.path.dirname(ckpt_dir)
    config = _with_own_fast_tokenizer(config or _read_config(os.path.join(run_dir, CONFIG_FILE)),
                                      run_dir)
    spec = _spec(config, None)
    policy = policy_lib.make_policy(config.model, spec)
    step, params, meta = checkpoint.load_checkpoint_params(ckpt_dir, step)
    _check_fits(params, policy, f"checkpoint {step} in {ckpt_dir}", "")
    stored = meta.get("normalizer")
    normalizer = (None if stored is None
                  else norm_stats.Normalizer.from_json(stored, f"checkpoint {step}"))
  else:
    if config is None:
      raise ValueError(f"{path} is an openpi checkpoint, which has no jaxvla config: pass "
                       "one, e.g. --config=configs/openpi.py:pi0")
    if config.model.name not in OPENPI_NORM_MODE:
      raise ValueError(f"config.model.name={config.model.name!r}: an openpi checkpoint holds "
                       f"one of {sorted(OPENPI_NORM_MODE)}")
    config = _with_own_fast_tokenizer(config, path)
    spec = _spec(config, None)
    policy = policy_lib.make_policy(config.model, spec)
    params = openpi_import.init_params(policy, jax.random.PRNGKey(config.seed),
                                       os.path.join(path, "params"))
    normalizer = _openpi_normalizer(path, asset_id, OPENPI_NORM_MODE[config.model.name])
  return LoadedPolicy(config=config, spec=spec, policy=policy, params=params,
                      normalizer=normalizer, kind=kind, path=path)
