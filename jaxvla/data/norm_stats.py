"""Normalisation statistics of state and actions, in openpi's ``norm_stats.json`` form.

The file (openpi: ``assets/<asset_id>/norm_stats.json``)::

  {"norm_stats": {"state":   {"mean": [...], "std": [...], "q01": [...], "q99": [...]},
                  "actions": {"mean": [...], "std": [...], "q01": [...], "q99": [...]}}}

:func:`compute` takes one pass over a dataset's steps (its episode table: every
step's state and action once). ``std`` is the population standard deviation
(openpi's); ``q01`` / ``q99`` are NumPy's exact (linearly interpolated)
quantiles, where openpi's ``RunningStats`` reads them off 5000-bin histograms
(within a bin width, ``(max - min) / 5000``, of these). openpi counts each action
once per chunk that contains it; here every step counts once.

:func:`normalize` / :func:`unnormalize` are openpi's two modes: ``'zscore'``
``(x - mean) / (std + 1e-6)`` and ``'quantile'`` ``(x - q01) / (q99 - q01 + 1e-6) * 2 - 1``
(pi0.5's default). Arrays wider than the statistics (openpi pads to 32 dims)
keep their extra dims unchanged. A dimension that is constant in the data (spread
below :data:`MIN_SPREAD`) is only centred, not divided by ~1e-6: on the data both
give 0, but a policy acting in an env where it varies slightly would see it
magnified a million times.

:class:`Normalizer` is what a run applies: state into the policy, action labels
into the policy's space for SFT, the policy's actions back out to the env
(:mod:`jaxvla.envs.normalized`), and, for an asymmetric critic, the simulation state
into the value head (the :data:`CRITIC_STATE` entry, from demonstrations that recorded
it; openpi reads the file's other entries and leaves this one). It is stored with each checkpoint and written
into the export, so an exported policy acts correctly on its own.

``python -m jaxvla.data.norm_stats --config=CONFIG --out=DIR`` writes the file
for the dataset a config's ``data`` block names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np

from jaxvla.data.config import NORM_MODES as MODES
from jaxvla.data.episodes import ONE_LINE_ERRORS, EpisodeTable

FILE_NAME = "norm_stats.json"
_EPS = 1e-6  # openpi's
MIN_SPREAD = 1e-4  # std (zscore) or q99 - q01 (quantile) below which a dim is only centred.
CRITIC_STATE = "critic_state"  # The entry of an asymmetric critic's simulation state.
# The critic state is z-scored with its std floored here, in the simulator's SI units (1 cm,
# 0.01 rad, 1 cm/s): a dim nearly still in the demonstrations (a joint velocity of 1 mm/s)
# would otherwise be magnified a thousand times when RL moves it.
CRITIC_STATE_STD_FLOOR = 1e-2


@dataclasses.dataclass(frozen=True)
class NormStats:
  """Per-dimension statistics ``[D]`` (``q01`` / ``q99`` may be absent in openpi files)."""
  mean: np.ndarray
  std: np.ndarray
  q01: np.ndarray | None = None
  q99: np.ndarray | None = None


def compute_array(values: np.ndarray) -> NormStats:
  """Statistics of ``values`` ``[N, D]`` over its N rows.

  Raises:
    ValueError: fewer than 2 rows, or non-finite values (naming the dims).
  """
  values = np.asarray(values, np.float64)
  if values.ndim != 2 or values.shape[0] < 2:
    raise ValueError(f"statistics need [N >= 2, D] values, got shape {values.shape}")
  bad = np.flatnonzero(~np.isfinite(values).all(0))
  if bad.size:
    raise ValueError(f"values of dims {bad.tolist()} are not all finite")
  q01, q99 = np.quantile(values, [0.01, 0.99], axis=0)
  return NormStats(mean=values.mean(0), std=values.std(0), q01=q01, q99=q99)


def compute(table: EpisodeTable) -> dict[str, NormStats]:
  """``{"state": ..., "actions": ...}`` over every step of a dataset's episode table, and
  :data:`CRITIC_STATE` where the table has a critic state."""
  stats = {"state": compute_array(table.state), "actions": compute_array(table.actions)}
  if table.critic_state is not None:
    stats[CRITIC_STATE] = compute_array(table.critic_state)
  return stats


def _as_lists(stats: NormStats) -> dict[str, list[float] | None]:
  return {f.name: None if getattr(stats, f.name) is None
          else [float(v) for v in getattr(stats, f.name)] for f in dataclasses.fields(stats)}


def _path(path: str) -> str:
  """``path`` itself if it names a ``.json`` file, else ``path/norm_stats.json`` (openpi's)."""
  return path if path.endswith(".json") else os.path.join(path, FILE_NAME)


def save(path: str, stats: dict[str, NormStats]) -> str:
  """Writes ``stats`` to ``path`` (a directory, as openpi's ``save``, or a ``.json`` file).

  Returns:
    the file written.
  """
  file = _path(path)
  os.makedirs(os.path.dirname(file) or ".", exist_ok=True)
  body = {"norm_stats": {name: _as_lists(s) for name, s in stats.items()}}
  with open(file, "w") as f:
    json.dump(body, f, indent=2)
  return file


def load(path: str) -> dict[str, NormStats]:
  """Reads an openpi ``norm_stats.json`` (a directory holding it, or the file).

  Raises:
    FileNotFoundError: naming the file.
    ValueError: naming the file and the entry that is malformed.
  """
  file = _path(path)
  return _parse(_read_json(file), file)


def _read_json(file: str):
  """The JSON body of ``file``; ValueError naming the file if it is not JSON."""
  with open(file) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{file}: not JSON ({e})") from e


def _parse(body, file: str) -> dict[str, NormStats]:
  """The ``norm_stats`` object of a file's ``body``; errors name ``file``."""
  if not isinstance(body, dict) or not isinstance(body.get("norm_stats"), dict):
    raise ValueError(f"{file}: no 'norm_stats' object at the top level")
  out = {}
  for name, entry in body["norm_stats"].items():
    arrays = {}
    for field in ("mean", "std", "q01", "q99"):
      value = entry.get(field) if isinstance(entry, dict) else None
      if value is None and field in ("mean", "std"):
        raise ValueError(f"{file}: norm_stats.{name} has no '{field}'")
      arrays[field] = None if value is None else np.asarray(value, np.float64)
      if value is not None and arrays[field].shape != arrays["mean"].shape:
        raise ValueError(f"{file}: norm_stats.{name}.{field} has shape "
                         f"{arrays[field].shape}, mean {arrays['mean'].shape}")
    out[name] = NormStats(**arrays)
  return out


def _check_mode(mode: str, stats: NormStats) -> None:
  if mode not in MODES:
    raise ValueError(f"normalisation mode {mode!r} is not one of {MODES}")
  if mode == "quantile" and (stats.q01 is None or stats.q99 is None):
    raise ValueError("quantile normalisation needs q01 and q99 statistics")


def _affine(x: np.ndarray, stats: NormStats, mode: str) -> tuple[int, np.ndarray, np.ndarray]:
  """``(d, offset [d], scale [d])`` with ``normalized = (x - offset) / scale`` on the first
  ``d = min(D', D)`` dims: z-score ``(mean, std)``; quantile maps ``[q01, q99]`` to
  ``[-1, 1]``, i.e. ``(q01 + half range, half range)`` (openpi's formulas)."""
  _check_mode(mode, stats)
  d = min(x.shape[-1], stats.mean.shape[-1])
  if mode == "zscore":
    spread, offset, scale = stats.std[:d], stats.mean[:d], stats.std[:d] + _EPS
  else:
    spread = stats.q99[:d] - stats.q01[:d]
    scale = (spread + _EPS) / 2.0
    offset = stats.q01[:d] + scale
  return d, offset, np.where(spread < MIN_SPREAD, 1.0, scale)


def normalize(x: np.ndarray, stats: NormStats, mode: str = "zscore") -> np.ndarray:
  """``x`` ``[..., D']`` normalised with the first ``min(D', D)`` dims of ``stats`` (openpi's)."""
  x = np.asarray(x)
  d, offset, scale = _affine(x, stats, mode)
  head = (x[..., :d] - offset) / scale
  return np.concatenate([head, x[..., d:]], axis=-1).astype(x.dtype, copy=False)


def unnormalize(x: np.ndarray, stats: NormStats, mode: str = "zscore") -> np.ndarray:
  """The inverse of :func:`normalize` (dims past the statistics pass through, as in openpi)."""
  x = np.asarray(x)
  d, offset, scale = _affine(x, stats, mode)
  head = x[..., :d] * scale + offset
  return np.concatenate([head, x[..., d:]], axis=-1).astype(x.dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class Normalizer:
  """A run's normalisation of state and actions (``stats`` with keys ``state``, ``actions``).

  The policy sees normalised state and acts in normalised action space: SFT labels
  go in through :meth:`action_labels`, its actions go out to the env through
  :meth:`actions`.
  """
  stats: dict[str, NormStats]
  mode: str

  def __post_init__(self):
    for key in ("state", "actions"):
      if key not in self.stats:
        raise ValueError(f"normalisation statistics have no {key!r} entry "
                         f"(have {sorted(self.stats)})")
      _check_mode(self.mode, self.stats[key])

  def state(self, x: np.ndarray) -> np.ndarray:
    """Env state ``[..., S]`` -> the policy's input."""
    return normalize(x, self.stats["state"], self.mode)

  def action_labels(self, a: np.ndarray) -> np.ndarray:
    """Env-space actions ``[..., A]`` (a dataset's) -> the policy's action space."""
    return normalize(a, self.stats["actions"], self.mode)

  def actions(self, a: np.ndarray) -> np.ndarray:
    """The policy's actions ``[..., A]`` -> the env's."""
    return unnormalize(a, self.stats["actions"], self.mode)

  def critic_state(self, x: np.ndarray) -> np.ndarray:
    """An asymmetric critic's simulation state ``[..., C]`` -> the value head's input:
    z-scored by the :data:`CRITIC_STATE` statistics, the std floored at
    :data:`CRITIC_STATE_STD_FLOOR` (whatever :attr:`mode`: openpi's modes are for the
    policy's state and actions). Raw simulation state mixes metres, radians and
    quaternions, a cube's place varying by a few centimetres: read raw, the value head
    hardly saw it (explained variance about 0.2 against 0.5 z-scored, docs/results/maniskill.md).
    Statistics without the entry (a policy trained before it existed, its value head on the
    raw state) leave ``x`` as it is; a new run checks with :meth:`check_critic_state`.

    Raises:
      ValueError: the :data:`CRITIC_STATE` entry has another size than ``x``.
    """
    x = np.asarray(x)
    if x.shape[-1] == 0 or CRITIC_STATE not in self.stats:
      return x
    self.check_critic_state(x.shape[-1])
    s = self.stats[CRITIC_STATE]
    std = np.maximum(s.std, CRITIC_STATE_STD_FLOOR)
    return ((x - s.mean) / std).astype(x.dtype, copy=False)

  def check_critic_state(self, size: int, where: str = "the normalisation statistics") -> None:
    """Raises a ValueError naming ``where`` unless the statistics cover a critic state of
    ``size`` dims (none needed for 0)."""
    if not size:
      return
    s = self.stats.get(CRITIC_STATE)
    if s is None:
      raise ValueError(f"{where} have no {CRITIC_STATE!r} entry, which an env with "
                       f"config.env.critic_state_dim={size} needs: demonstrations recorded "
                       f"with the critic state give one (jaxvla.data.collect)")
    if s.mean.shape != (size,):
      raise ValueError(f"{where}: {CRITIC_STATE!r} has {s.mean.shape[-1]} dims, "
                       f"config.env.critic_state_dim={size}")

  def to_json(self) -> dict:
    """``{"mode": ..., "norm_stats": {...}}`` (the file's body plus the mode)."""
    return {"mode": self.mode,
            "norm_stats": {name: _as_lists(s) for name, s in self.stats.items()}}

  @classmethod
  def from_json(cls, body: dict, where: str = "normalizer") -> "Normalizer":
    """The inverse of :meth:`to_json`; ``where`` names the source in errors."""
    if not isinstance(body, dict) or "mode" not in body or "norm_stats" not in body:
      raise ValueError(f"{where}: expected {{'mode', 'norm_stats'}}, got {body!r:.80}")
    return cls(_parse(body, where), body["mode"])


def save_normalizer(directory: str, normalizer: Normalizer | None) -> None:
  """Writes ``directory/norm_stats.json`` (openpi's form, plus ``"mode"``); removes a stale
  one when ``normalizer`` is None."""
  file = os.path.join(directory, FILE_NAME)
  if normalizer is None:
    if os.path.exists(file):
      os.remove(file)
    return
  os.makedirs(directory, exist_ok=True)
  with open(file, "w") as f:
    json.dump(normalizer.to_json(), f, indent=2)


def load_normalizer(directory: str) -> Normalizer | None:
  """``directory/norm_stats.json`` as written by :func:`save_normalizer` (None if absent)."""
  file = os.path.join(directory, FILE_NAME)
  if not os.path.exists(file):
    return None
  return Normalizer.from_json(_read_json(file), file)


def main(argv: list[str]) -> None:
  """``--config=FILE[:VARIANT] [--config.data.*=...] --out=DIR``: writes DIR/norm_stats.json."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  # Only the command reads a dataset (and so imports its readers).
  from jaxvla.data import readers  # pylint: disable=import-outside-toplevel

  config_flag = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                                lock_config=True)
  out_flag = flags.DEFINE_string("out", None, "Directory (or .json file) to write.")
  flags.mark_flags_as_required(["config", "out"])

  def run(_):
    absl_logging.set_verbosity(absl_logging.WARNING)  # TFDS's INFO lines
    try:
      reader = readers.open_reader(config_flag.value.data)
    except ONE_LINE_ERRORS as e:
      sys.exit(f"error: {e}")
    file = save(out_flag.value, compute(reader.table))
    print(json.dumps({"norm_stats": file, "steps": reader.table.num_steps,
                      "episodes": reader.table.num_episodes}))

  app.run(run, argv)


if __name__ == "__main__":
  main(sys.argv)
