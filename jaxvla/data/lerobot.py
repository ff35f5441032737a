"""LeRobot datasets (codebase v2.0 / v2.1 and v3.0) read with pyarrow and PyAV.

The two layouts, as LeRobot writes them (``meta/info.json`` holds the path
templates and ``features``; ``codebase_version`` says which layout):

* v2.x: one parquet file per episode, ``data/chunk-XXX/episode_XXXXXX.parquet``;
  one mp4 per episode and camera, ``videos/chunk-XXX/<key>/episode_XXXXXX.mp4``;
  episodes in ``meta/episodes.jsonl`` (``episode_index``, ``tasks``, ``length``),
  tasks in ``meta/tasks.jsonl`` (``task_index``, ``task``).
* v3.0: many episodes per file, ``data/chunk-XXX/file-XXX.parquet`` and
  ``videos/<key>/chunk-XXX/file-XXX.mp4``; episodes in
  ``meta/episodes/chunk-XXX/file-XXX.parquet`` (``data/chunk_index``,
  ``data/file_index``, ``videos/<key>/{chunk_index,file_index,from_timestamp}``,
  ``length``), tasks in ``meta/tasks.parquet`` (``task_index`` and the ``task``
  text, pandas' index column).

Every frame row carries ``episode_index``, ``frame_index``, ``timestamp`` and
``task_index``. Cameras are ``video`` features (frame at ``from_timestamp +
timestamp`` of the episode's mp4, decoded with PyAV) or ``image`` features stored
inline as ``{bytes, path}`` structs (openpi's ``physical-intelligence/libero``:
``image``, ``wrist_image``, ``state`` [8], ``actions`` [7]).

Opening reads the small columns of every data file (state, action, indices) into
the episode table; images are read per step. An inline image costs a read of its
parquet row group (LeRobot writes 100-row groups for image datasets; the last few
are cached per process), a video frame a seek to the keyframe before it plus the
frames up to it (LeRobot encodes with a keyframe every 2 frames).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import threading

import av
import numpy as np
import PIL.Image
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jaxvla.data import episodes as episodes_lib
from jaxvla.data.episodes import DataError, Features

INFO_PATH = os.path.join("meta", "info.json")
_TASK_INDEX = "task_index"
_CACHED_ROW_GROUPS = 8  # inline-image row groups kept per process


def is_lerobot(path: str) -> bool:
  return os.path.isfile(os.path.join(path, INFO_PATH))


@dataclasses.dataclass(frozen=True)
class _Episode:
  """Where one episode's frames are.

  Attributes:
    data_file: the parquet file holding its rows.
    rows: ``int64 [T]`` row of each step in ``data_file``.
    timestamps: ``float64 [T]`` each step's ``timestamp`` (seconds from the
      episode's start).
    videos: camera key -> (mp4 file, the episode's start time in it).
  """
  data_file: str
  rows: np.ndarray
  timestamps: np.ndarray
  videos: dict[str, tuple[str, float]]


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise DataError(f"{path}: unreadable ({e})") from e


def _read_jsonl(path: str) -> list[dict]:
  try:
    with open(path) as f:
      return [json.loads(line) for line in f if line.strip()]
  except (OSError, json.JSONDecodeError) as e:
    raise DataError(f"{path}: unreadable ({e})") from e


def _read_parquet(path: str, columns: list[str] | None = None) -> pa.Table:
  if not os.path.isfile(path):
    raise DataError(f"{path}: missing (listed by the dataset's metadata)")
  try:
    schema = pq.read_schema(path)
  except (OSError, pa.ArrowException) as e:
    raise DataError(f"{path}: unreadable parquet ({e})") from e
  if columns is not None:
    missing = [c for c in columns if c not in schema.names]
    if missing:
      raise DataError(f"{path}: no column {missing[0]!r}; columns: {schema.names}")
  try:
    return pq.read_table(path, columns=columns)
  except (OSError, pa.ArrowException) as e:
    raise DataError(f"{path}: unreadable parquet ({e})") from e


def _vectors(column: pa.ChunkedArray, key: str, where: str) -> np.ndarray:
  """A column of equal-length float lists (or scalars) as ``float32 [T, D]``."""
  arr = column.combine_chunks()
  if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or \
     pa.types.is_fixed_size_list(arr.type):
    sizes = pc.unique(pc.list_value_length(arr)).to_pylist()
    if len(sizes) != 1 or arr.null_count:
      lengths = sorted(s for s in sizes if s is not None)
      raise DataError(f"{where}: '{key}' rows have lengths {lengths}, expected one vector size")
    values = arr.flatten()
    if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
      raise DataError(f"{where}: '{key}' holds {values.type} values, expected numbers")
    return values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(arr), -1)
  if pa.types.is_floating(arr.type) or pa.types.is_integer(arr.type):
    return arr.to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, 1)
  raise DataError(f"{where}: '{key}' has type {arr.type}, expected a list of numbers per step")


def _image_shape(feature: dict, key: str, where: str) -> tuple[int, int, int]:
  """``(H, W, 3)`` from an info.json feature (``shape`` ordered by ``names``)."""
  shape = list(feature.get("shape", []))
  names = feature.get("names") or []
  if len(shape) == 3 and len(names) == 3 and "height" in names and "width" in names:
    h, w = shape[names.index("height")], shape[names.index("width")]
    c = shape[3 - names.index("height") - names.index("width")]
  elif len(shape) == 3 and shape[-1] == 3:
    h, w, c = shape
  elif len(shape) == 3 and shape[0] == 3:
    c, h, w = shape
  else:
    h = w = c = None
  if c != 3:
    raise DataError(f"{where}: camera '{key}' has shape {shape} (names {names}), expected RGB "
                    "(H, W, 3)")
  return int(h), int(w), 3


class LeRobotReader:
  """A LeRobot dataset (v2.0, v2.1 or v3.0) opened for training (implements ``EpisodeReader``).

  Args:
    path: the dataset root (holding ``meta/info.json``).
    features: the columns to read: camera, state and action feature names, and
      the instruction (``'task_index'`` for the tasks table, or a string column).
    split: a split of ``info.json``'s ``splits`` (episode ranges ``"a:b"``); ``''``
      for every episode.

  Raises:
    DataError: naming the file, the feature or the episode that does not fit.
  """

  def __init__(self, path: str, features: Features, split: str = "train"):
    self.path = path
    self.features = features
    info_path = os.path.join(path, INFO_PATH)
    info = _read_json(info_path)
    for field in ("codebase_version", "fps", "features", "data_path"):
      if field not in info:
        raise DataError(f"{info_path}: no '{field}' field")
    self.version = str(info["codebase_version"])
    if self.version.split(".")[0] not in ("v2", "v3"):
      raise DataError(f"{info_path}: codebase_version {self.version} is not v2.x or v3.0")
    self._v3 = self.version.startswith("v3")
    self.fps = float(info["fps"])
    self._info = info
    feats = info["features"]
    for key in (features.state, features.action, *features.cameras):
      if key not in feats:
        raise DataError(f"{info_path}: no feature '{key}'; features: {sorted(feats)}")
    for key in features.cameras:
      if feats[key].get("dtype") not in ("image", "video"):
        raise DataError(f"{info_path}: camera '{key}' has dtype {feats[key].get('dtype')!r}, "
                        "expected 'image' or 'video'")
    if features.instruction != _TASK_INDEX and feats.get(features.instruction, {}).get(
        "dtype") != "string":
      raise DataError(f"{info_path}: instruction '{features.instruction}' is not a string "
                      "feature; use 'task_index' for the tasks table")
    self.image_shapes = tuple(_image_shape(feats[k], k, info_path) for k in features.cameras)
    self._video_keys = {k for k in features.cameras if feats[k]["dtype"] == "video"}
    self._tasks = self._read_tasks() if features.instruction == _TASK_INDEX else {}
    meta = self._select_split(self._read_episode_meta(), split)
    if not meta:
      raise DataError(f"{path}: the dataset holds no episodes (split '{split}')")
    self._episodes: list[_Episode] = []  # in table order (filled by _read_frames)
    self.table = self._read_frames(meta)
    self._row_groups: collections.OrderedDict = collections.OrderedDict()
    self._row_groups_lock = threading.Lock()

  # ------------------------------------------------------------- metadata --
  def _read_tasks(self) -> dict[int, str]:
    if self._v3:
      table = _read_parquet(os.path.join(self.path, "meta", "tasks.parquet"))
      # LeRobot writes the task text as the DataFrame index; pyarrow reads it as a column.
      text = "task" if "task" in table.column_names else "__index_level_0__"
      rows = zip(table.column(_TASK_INDEX).to_pylist(), table.column(text).to_pylist())
    else:
      rows = ((t[_TASK_INDEX], t["task"])
              for t in _read_jsonl(os.path.join(self.path, "meta", "tasks.jsonl")))
    return {int(i): str(t) for i, t in rows}

  def _read_episode_meta(self) -> list[dict]:
    """One dict per episode, sorted by ``episode_index``."""
    if not self._v3:
      return sorted(_read_jsonl(os.path.join(self.path, "meta", "episodes.jsonl")),
                    key=lambda e: e["episode_index"])
    root = os.path.join(self.path, "meta", "episodes")
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                   if f.endswith(".parquet"))
    if not files:
      raise DataError(f"{root}: no episode metadata (*.parquet)")
    columns = ["episode_index", "length", "data/chunk_index", "data/file_index"]
    for key in sorted(self._video_keys):
      columns += [f"videos/{key}/chunk_index", f"videos/{key}/file_index",
                  f"videos/{key}/from_timestamp"]
    rows = [r for f in files for r in _read_parquet(f, columns).to_pylist()]
    return sorted(rows, key=lambda e: e["episode_index"])

  def _select_split(self, meta: list[dict], split: str) -> list[dict]:
    splits = self._info.get("splits") or {}
    if not split or not splits:
      return meta
    if split not in splits:
      raise DataError(f"{os.path.join(self.path, INFO_PATH)}: no split '{split}' "
                      f"(config.data.split); splits: {sorted(splits)}")
    start, _, stop = str(splits[split]).partition(":")
    return [m for m in meta if int(start) <= m["episode_index"] < int(stop)]

  def _data_file(self, m: dict) -> str:
    template = self._info["data_path"]
    if self._v3:
      rel = template.format(chunk_index=m["data/chunk_index"], file_index=m["data/file_index"])
    else:
      ep = m["episode_index"]
      rel = template.format(episode_chunk=ep // int(self._info.get("chunks_size", 1000)),
                            episode_index=ep)
    return os.path.join(self.path, rel)

  def _video(self, m: dict, key: str) -> tuple[str, float]:
    """(mp4 path, start time of the episode in it) of camera ``key``."""
    template = self._info.get("video_path")
    if not template:
      raise DataError(f"{os.path.join(self.path, INFO_PATH)}: camera '{key}' is a video "
                      "but there is no 'video_path'")
    if self._v3:
      rel = template.format(video_key=key, chunk_index=m[f"videos/{key}/chunk_index"],
                            file_index=m[f"videos/{key}/file_index"])
      return os.path.join(self.path, rel), float(m[f"videos/{key}/from_timestamp"])
    ep = m["episode_index"]
    rel = template.format(episode_chunk=ep // int(self._info.get("chunks_size", 1000)),
                          video_key=key, episode_index=ep)
    return os.path.join(self.path, rel), 0.0

  # --------------------------------------------------------------- frames --
  def _read_frames(self, meta: list[dict]) -> episodes_lib.EpisodeTable:
    f = self.features
    by_file: dict[str, list[dict]] = collections.defaultdict(list)
    for m in meta:
      by_file[self._data_file(m)].append(m)
    columns = [f.state, f.action, "episode_index", "frame_index", "timestamp",
               f.instruction]
    rows: dict[int, tuple] = {}
    located: dict[int, _Episode] = {}
    for path, members in by_file.items():
      table = _read_parquet(path, columns)
      episode_col = table.column("episode_index").to_numpy()
      frame_col = table.column("frame_index").to_numpy()
      for m in members:
        ep = m["episode_index"]
        where = f"{path}: episode {ep}"
        idx = np.flatnonzero(episode_col == ep)
        idx = idx[np.argsort(frame_col[idx], kind="stable")]
        if "length" in m and len(idx) != m["length"]:
          raise DataError(f"{where} has {len(idx)} frames, the metadata says {m['length']}")
        part = table.take(pa.array(idx))
        state = _vectors(part.column(f.state), f.state, where)
        actions = _vectors(part.column(f.action), f.action, where)
        texts = self._texts(part.column(f.instruction), where)
        located[ep] = _Episode(
            data_file=path, rows=idx.astype(np.int64),
            timestamps=part.column("timestamp").to_numpy().astype(np.float64),
            videos={k: self._video(m, k) for k in sorted(self._video_keys)})
        rows[ep] = (state, actions, texts)
    self._episodes = [located[m["episode_index"]] for m in meta]
    return episodes_lib.build_table([rows[m["episode_index"]] for m in meta], self.path, f)

  def _texts(self, column: pa.ChunkedArray, where: str) -> list[str]:
    values = column.to_pylist()
    if self.features.instruction != _TASK_INDEX:
      return [str(v) for v in values]
    missing = sorted({int(v) for v in values} - set(self._tasks))
    if missing:
      raise DataError(f"{where}: task_index {missing[0]} is not in the tasks table")
    return [self._tasks[int(v)] for v in values]

  # --------------------------------------------------------------- images --
  def images(self, episode: int, step: int) -> list[np.ndarray]:
    """``uint8 [H, W, 3]`` per camera of step ``step`` of episode ``episode``."""
    ep = self._episodes[episode]
    out = []
    for key, shape in zip(self.features.cameras, self.image_shapes):
      if key in self._video_keys:
        path, start = ep.videos[key]
        t = start + ep.timestamps[step]
        image, where = decode_frame(path, t, self.fps), f"{path} at {t:.3f} s"
      else:
        image, where = self._inline_image(ep, int(ep.rows[step]), key), ep.data_file
      out.append(episodes_lib.check_image(image, shape, key, where))
    return out

  def _inline_image(self, ep: _Episode, row: int, key: str) -> np.ndarray:
    """Decodes the ``{bytes, path}`` image struct at ``row`` of ``ep.data_file``."""
    try:
      file = pq.ParquetFile(ep.data_file)
      starts = np.cumsum([0] + [file.metadata.row_group(g).num_rows
                                for g in range(file.num_row_groups)])
      group = int(np.searchsorted(starts, row, side="right") - 1)
      cache_key = (ep.data_file, group, key)
      # grain's read threads share the cache: one lock around check, read and eviction.
      with self._row_groups_lock:
        column = self._row_groups.get(cache_key)
      if column is None:
        column = file.read_row_group(group, columns=[key]).column(key)
        with self._row_groups_lock:
          self._row_groups[cache_key] = column
          if len(self._row_groups) > _CACHED_ROW_GROUPS:
            self._row_groups.popitem(last=False)
      value = column[row - int(starts[group])].as_py()
      data = value.get("bytes") if isinstance(value, dict) else value
      if data is None and isinstance(value, dict) and value.get("path"):
        with open(os.path.join(self.path, value["path"]), "rb") as fh:
          data = fh.read()
      with PIL.Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))
    except (OSError, pa.ArrowException, TypeError, PIL.UnidentifiedImageError) as e:
      raise DataError(f"{ep.data_file}: camera '{key}' row {row} is unreadable ({e})") from e

  def __getstate__(self) -> dict:
    # grain's worker processes get a copy: the row-group cache is per process.
    state = dict(self.__dict__)
    state["_row_groups"] = collections.OrderedDict()
    del state["_row_groups_lock"]  # (not picklable; a fresh one per process)
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._row_groups_lock = threading.Lock()


def decode_frame(path: str, timestamp: float, fps: float) -> np.ndarray:
  """The frame of mp4 ``path`` shown at ``timestamp`` seconds, ``uint8 [H, W, 3]``.

  Seeks to the keyframe at or before ``timestamp`` and decodes forward (PyAV has
  no frame-accurate seek; LeRobot's own PyAV path does the same).

  Raises:
    DataError: naming the file and the time, when the file is missing or damaged
      or has no frame within half a frame period of ``timestamp``.
  """
  tolerance = 0.5 / fps
  try:
    with av.open(path) as container:
      stream = container.streams.video[0]
      container.seek(max(0, int(timestamp / stream.time_base) - 1), backward=True,
                     any_frame=False, stream=stream)
      for frame in container.decode(stream):
        if frame.pts is None:
          continue
        t = float(frame.pts * stream.time_base)
        if t >= timestamp - tolerance:
          if t > timestamp + tolerance:
            break
          return frame.to_ndarray(format="rgb24")
  except (OSError, av.FFmpegError, IndexError) as e:
    raise DataError(f"{path}: unreadable video ({e})") from e
  raise DataError(f"{path}: no frame at {timestamp:.3f} s (within {tolerance:.3f} s)")
