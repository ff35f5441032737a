"""Opening a dataset on disk for the ``data`` config: its format and the keys it reads.

:func:`open_reader` turns the ``data`` sub-config into an RLDS or LeRobot
:class:`~jaxvla.data.episodes.EpisodeReader` (the format from the config or detected
from the files, :func:`detect_format`); :func:`features_from_config` and
:func:`camera_present` say which dataset keys the config's cameras map to.

The one owner of the config -> reader rule, below both of its users: the BC pipeline
(:mod:`jaxvla.data.loader`, which re-exports :func:`open_reader`) and the statistics
command (``python -m jaxvla.data.norm_stats``).
"""

from __future__ import annotations

import os

import ml_collections

from jaxvla.data import config as data_config
from jaxvla.data import lerobot, rlds
from jaxvla.data.episodes import DataError, EpisodeReader, Features


def features_from_config(d: ml_collections.ConfigDict) -> Features:
  """The dataset keys named by the ``data`` sub-config (the cameras the dataset has)."""
  return Features(cameras=tuple(k for k in d.cameras.values() if k != data_config.ABSENT_CAMERA),
                  state=d.state_key, action=d.action_key, instruction=d.instruction_key)


def camera_present(d: ml_collections.ConfigDict) -> tuple[bool, ...]:
  """Per policy camera (``config.data.cameras`` order): whether the dataset has it."""
  return tuple(k != data_config.ABSENT_CAMERA for k in d.cameras.values())


def detect_format(path: str) -> str:
  """``'lerobot'`` (``meta/info.json``) or ``'rlds'`` (a TFDS ``dataset_info.json``).

  Raises:
    DataError: ``path`` is missing or neither.
  """
  if not os.path.isdir(path):
    raise DataError(f"{path}: no such dataset directory (config.data.path)")
  if lerobot.is_lerobot(path):
    return "lerobot"
  if rlds.find_dataset_dir(path) is not None:
    return "rlds"
  raise DataError(f"{path}: neither a LeRobot dataset (meta/info.json) nor a TFDS RLDS "
                  "dataset (dataset_info.json); set config.data.path to the dataset's root")


def open_reader(d: ml_collections.ConfigDict) -> EpisodeReader:
  """Opens the dataset ``d.path`` (the ``data`` sub-config) for training.

  Raises:
    DataError: naming the file, key or episode that does not fit the config.
  """
  if not d.path:
    raise DataError("config.data.path is empty: no dataset to open")
  fmt = detect_format(d.path) if d.format == "auto" else d.format
  if d.format != "auto" and not os.path.isdir(d.path):
    raise DataError(f"{d.path}: no such dataset directory (config.data.path)")
  features = features_from_config(d)
  if fmt == "rlds":
    return rlds.RldsReader(d.path, features, split=d.split)
  if fmt == "lerobot":
    return lerobot.LeRobotReader(d.path, features, split=d.split)
  raise DataError(f"config.data.format={d.format!r} is not one of 'auto', 'rlds', 'lerobot'")


__all__ = ["camera_present", "detect_format", "features_from_config", "open_reader"]
