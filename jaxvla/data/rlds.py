"""RLDS datasets in TFDS's on-disk ArrayRecord form: reading and writing, without TensorFlow.

An RLDS dataset is a TFDS dataset of episodes; each episode has a ``steps``
sequence whose elements carry ``observation/<keys>``, ``action``,
``language_instruction`` and RLDS's ``is_first / is_last / is_terminal / reward /
discount`` (OpenVLA's LIBERO sets: ``observation/image``,
``observation/wrist_image`` 256x256x3 JPEG, ``observation/state`` [8],
``action`` [7]).

Reading goes through TFDS's own pieces: ``tfds.builder_from_directory`` for the
metadata, ``as_data_source`` (array_record random access, one record per
episode) for the bytes, and TFDS's NumPy example parser (its own copy of the
``tf.Example`` proto) for the values. Images are kept encoded until a step's
camera is asked for and then decoded by the TFDS feature itself. None of this
imports TensorFlow; TFRecord datasets do need it, to convert them once (see
docs/guides/data.md).

Writing (:func:`write_dataset`) uses TFDS's ``SequentialWriter`` with the
``array_record`` format, fed ``PIL`` images that TFDS encodes with PIL (TFDS only
needs TensorFlow to encode NumPy images).
"""

from __future__ import annotations

import collections
import glob
import os
import shutil
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxvla.data import episodes as episodes_lib
from jaxvla.data.episodes import DataError, Features

_INFO_FILE = "dataset_info.json"
# The step key of the simulation state an asymmetric critic reads (demonstrations of an
# env with EnvSpec.critic_state_dim): read into EpisodeTable.critic_state where present.
CRITIC_STATE_FIELD = "critic_state"  # (under observation/)
CRITIC_STATE_KEY = f"observation/{CRITIC_STATE_FIELD}"
# Parsed episodes kept per process (images still encoded), the least recently used
# evicted past this many bytes: a dataset that fits (demonstrations of a few hundred
# episodes) is parsed once; a larger one, read in shuffled order, mostly misses, which
# costs one record parse per sample (half of a shuffled batch's CPU time here).
_CACHE_BYTES = 256 << 20


def find_dataset_dir(path: str) -> str | None:
  """The TFDS version directory at or right under ``path`` (holding ``dataset_info.json``).

  ``path`` may be the version directory itself (``.../libero_10_no_noops/1.0.0``)
  or the dataset directory above it when it holds exactly one version.
  """
  if os.path.isfile(os.path.join(path, _INFO_FILE)):
    return path
  found = sorted(glob.glob(os.path.join(path, "*", _INFO_FILE)))
  return os.path.dirname(found[0]) if len(found) == 1 else None


def _import_tfds():
  # Deferred: tensorflow_datasets takes ~0.4 s to import and only RLDS users need it.
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  return tfds


def _flat_features(features) -> dict[str, Any]:
  """``{'observation/image': feature, 'action': feature, ...}`` of a FeaturesDict."""
  tfds = _import_tfds()
  flat = {}
  for name, feature in features.items():
    if isinstance(feature, tfds.features.FeaturesDict):
      flat.update({f"{name}/{k}": v for k, v in _flat_features(feature).items()})
    else:
      flat[name] = feature
  return flat


def _nbytes(values: Any) -> int:
  """Bytes held by one parsed step feature: an array, or encoded images as bytes objects."""
  values = np.asarray(values)
  if values.dtype == object:
    return sum(len(v) if isinstance(v, bytes) else 64 for v in values.reshape(-1))
  return values.nbytes


def _flat_values(tree: dict, prefix: str = "") -> dict[str, Any]:
  """A parsed nested example as ``{'steps/observation/image': values, ...}``."""
  flat = {}
  for name, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flat_values(value, f"{prefix}{name}/"))
    else:
      flat[prefix + name] = value
  return flat


class RldsReader:
  """An RLDS ArrayRecord dataset opened for training (implements ``EpisodeReader``).

  Opening reads every episode once (one record parse each, images left encoded)
  to fill the episode table.

  Args:
    path: the TFDS version directory, or the dataset directory holding one version.
    features: the step keys to read (``observation/state``, ...).
    split: TFDS split name.

  Raises:
    DataError: naming the path, the split, the missing or malformed step key, or
      the episode, when the dataset does not fit ``features``.
  """

  def __init__(self, path: str, features: Features, split: str = "train"):
    tfds = _import_tfds()
    self.path = path
    self.features = features
    self.split = split
    directory = find_dataset_dir(path)
    if directory is None:
      raise DataError(f"{path}: no {_INFO_FILE} here or in exactly one subdirectory "
                      "(not a TFDS dataset directory)")
    try:
      builder = tfds.builder_from_directory(directory)
    except Exception as e:  # TFDS raises several types for unreadable metadata.
      raise DataError(f"{directory}: unreadable TFDS metadata ({type(e).__name__}: {e})") from e
    info = builder.info
    if "steps" not in info.features:
      raise DataError(f"{directory}: no 'steps' feature (not an RLDS dataset); features: "
                      f"{sorted(info.features.keys())}")
    if split not in info.splits:
      raise DataError(f"{directory}: no split '{split}' (config.data.split); splits: "
                      f"{sorted(info.splits.keys())}")
    stored = info.file_format.value if info.file_format else "tfrecord"  # TFDS's default
    if stored != "array_record":
      raise DataError(f"{directory}: stored as {stored}, not array_record; convert it once "
                      "with `python -m jaxvla.data.convert` (docs/guides/data.md)")
    self._dir = directory
    self._steps = _flat_features(info.features["steps"].feature)
    self.image_shapes = tuple(self._camera_shape(k) for k in features.cameras)
    self._check_vector(features.state)
    self._check_vector(features.action)
    self._check_text(features.instruction)
    if info.splits[split].num_examples == 0:
      raise DataError(f"{directory}: the dataset holds no episodes (split '{split}')")
    self._source = builder.as_data_source(
        split=split, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
    self._parser = tfds.core.example_parser.ExampleParserNp(
        info.features.get_serialized_info())
    self._cache: collections.OrderedDict[int, tuple[dict, int]] = collections.OrderedDict()
    self._cache_bytes = 0
    self._cache_lock = threading.Lock()
    self.table = self._read_table()

  # ------------------------------------------------------------ the schema --
  def _feature(self, key: str):
    if key not in self._steps:
      raise DataError(f"{self._dir}: no step feature '{key}'; step features: "
                      f"{sorted(self._steps)}")
    return self._steps[key]

  def _camera_shape(self, key: str) -> tuple[int, int, int]:
    feature = self._feature(key)
    shape = tuple(feature.shape)
    if (not isinstance(feature, _import_tfds().features.Image) or len(shape) != 3
        or shape[-1] != 3 or None in shape):
      raise DataError(f"{self._dir}: camera '{key}' is {feature!r}, expected an RGB "
                      "Image of fixed shape (H, W, 3)")
    return shape  # type: ignore[return-value]

  def _check_vector(self, key: str) -> None:
    shape = tuple(self._feature(key).shape)
    if len(shape) != 1 or shape[0] is None:
      raise DataError(f"{self._dir}: '{key}' has shape {shape} per step, expected a "
                      "vector (D,)")

  def _check_text(self, key: str) -> None:
    if not isinstance(self._feature(key), _import_tfds().features.Text):
      raise DataError(f"{self._dir}: instruction '{key}' is {self._feature(key)!r}, "
                      "expected Text")

  # ------------------------------------------------------------- episodes --
  def _episode(self, episode: int) -> dict[str, Any]:
    """Episode ``episode``'s steps as ``{key: values [T, ...]}`` (images still encoded)."""
    # grain's read threads share the cache: check, reorder and evict under one lock
    # (another thread's eviction between the check and the read was a KeyError).
    with self._cache_lock:
      cached = self._cache.get(episode)
      if cached is not None:
        self._cache.move_to_end(episode)
        return cached[0]
    try:
      raw = self._source[episode]
      values = _flat_values(self._parser.parse_example(raw))
    except Exception as e:  # array_record / protobuf errors for damaged shards.
      raise DataError(f"{self._dir}: episode {episode} of split '{self.split}' is unreadable "
                      f"({type(e).__name__}: {e})") from e
    steps = {k[len("steps/"):]: v for k, v in values.items() if k.startswith("steps/")}
    size = sum(_nbytes(v) for v in steps.values())
    with self._cache_lock:
      if episode not in self._cache:  # (another thread may have parsed it meanwhile)
        self._cache[episode] = steps, size
        self._cache_bytes += size
      while self._cache_bytes > _CACHE_BYTES and len(self._cache) > 1:
        self._cache_bytes -= self._cache.popitem(last=False)[1][1]
    return steps

  def _read_table(self) -> episodes_lib.EpisodeTable:
    f = self.features
    rows, critic = [], []
    for e in range(len(self._source)):
      steps = self._episode(e)
      texts = [t.decode("utf-8") if isinstance(t, bytes) else str(t)
               for t in np.asarray(steps[f.instruction]).reshape(-1)]
      state = np.asarray(steps[f.state], np.float32).reshape(len(texts), -1)
      actions = np.asarray(steps[f.action], np.float32).reshape(len(texts), -1)
      rows.append((state, actions, texts))
      if CRITIC_STATE_KEY in self._steps:
        critic.append(np.asarray(steps[CRITIC_STATE_KEY], np.float32).reshape(len(texts), -1))
    return episodes_lib.build_table(rows, f"{self._dir} (split '{self.split}')", f,
                                    critic or None)

  def images(self, episode: int, step: int) -> list[np.ndarray]:
    """``uint8 [H, W, 3]`` per camera of step ``step`` of episode ``episode``."""
    steps = self._episode(episode)
    out = []
    for key, shape in zip(self.features.cameras, self.image_shapes):
      where = f"{self._dir}: episode {episode} step {step}"
      try:
        image = self._steps[key].decode_example_np(steps[key][step])
      except Exception as e:  # cv2 / PIL errors on damaged image bytes.
        raise DataError(f"{where}: camera '{key}' does not decode ({e})") from e
      out.append(episodes_lib.check_image(image, shape, key, where))
    return out

  def __getstate__(self) -> dict:
    # grain's worker processes get a copy: the cache is per process.
    state = dict(self.__dict__)
    state["_cache"], state["_cache_bytes"] = collections.OrderedDict(), 0
    del state["_cache_lock"]  # (not picklable; a fresh one per process)
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._cache_lock = threading.Lock()


# ------------------------------------------------------------------ writing --
def step_features(camera_shapes: dict[str, tuple[int, int, int]], state_dim: int,
                  action_dim: int, image_format: str = "png", critic_state_dim: int = 0):
  """TFDS features of an RLDS dataset with these cameras (``observation/<camera>``).

  The layout is OpenVLA's / Open X-Embodiment's: per step ``observation``
  (cameras and ``state``), ``action``, ``reward``, ``discount``,
  ``is_first / is_last / is_terminal`` and ``language_instruction``; per episode
  ``episode_metadata/success``. With ``critic_state_dim``, ``observation/critic_state``
  (:data:`CRITIC_STATE_KEY`) holds the simulation state an asymmetric critic reads.
  """
  tfds = _import_tfds()
  observation = {name: tfds.features.Image(shape=tuple(shape), dtype=np.uint8,
                                           encoding_format=image_format)
                 for name, shape in camera_shapes.items()}
  observation["state"] = tfds.features.Tensor(shape=(state_dim,), dtype=np.float32)
  if critic_state_dim:
    observation[CRITIC_STATE_FIELD] = tfds.features.Tensor(
        shape=(critic_state_dim,), dtype=np.float32)
  return tfds.features.FeaturesDict({
      "steps": tfds.features.Dataset({
          "observation": tfds.features.FeaturesDict(observation),
          "action": tfds.features.Tensor(shape=(action_dim,), dtype=np.float32),
          "reward": tfds.features.Scalar(dtype=np.float32),
          "discount": tfds.features.Scalar(dtype=np.float32),
          "is_first": tfds.features.Scalar(dtype=np.bool_),
          "is_last": tfds.features.Scalar(dtype=np.bool_),
          "is_terminal": tfds.features.Scalar(dtype=np.bool_),
          "language_instruction": tfds.features.Text(),
      }),
      "episode_metadata": tfds.features.FeaturesDict({
          "success": tfds.features.Scalar(dtype=np.bool_),
      }),
  })


def write_dataset(directory: str, features, examples: Iterable[dict], *, name: str,
                  description: str = "", split: str = "train",
                  max_examples_per_shard: int = 1000) -> int:
  """Writes ``examples`` (one nested dict per episode) as a TFDS ArrayRecord dataset.

  ``directory`` becomes the TFDS version directory (``dataset_info.json``,
  ``features.json``, ``<name>-<split>.array_record-0000N``). Images in
  ``examples`` must be ``PIL.Image`` objects (TFDS encodes those without
  TensorFlow). Episodes are written as they come, into ``<directory>.incomplete``,
  which becomes ``directory`` once the last one is written: a run that fails
  leaves no dataset that looks whole.

  Returns:
    the number of episodes written.

  Raises:
    FileExistsError: ``directory`` holds a dataset or other files.
  """
  tfds = _import_tfds()
  if os.path.exists(os.path.join(directory, _INFO_FILE)):
    raise FileExistsError(f"{directory} already holds a TFDS dataset; choose another --out")
  if os.path.isdir(directory) and os.listdir(directory):
    raise FileExistsError(f"{directory} is not empty; choose another --out")
  partial = os.path.normpath(directory) + ".incomplete"
  shutil.rmtree(partial, ignore_errors=True)  # what an earlier failed run left
  os.makedirs(partial)
  identity = tfds.core.DatasetIdentity(name=name, version=tfds.core.Version("1.0.0"),
                                       data_dir=partial, module_name="jaxvla.data.rlds")
  info = tfds.core.DatasetInfo(builder=identity, features=features, description=description)
  writer = tfds.core.SequentialWriter(info, max_examples_per_shard=max_examples_per_shard,
                                      file_format="array_record")
  writer.initialize_splits([split])
  count = 0
  for example in examples:
    writer.add_examples({split: [example]})
    count += 1
  writer.close_all()
  os.replace(partial, directory)  # (an empty directory there is replaced)
  return count
