"""On-disk demonstrations: RLDS (TFDS ArrayRecord) and LeRobot v2.1 / v3 readers, the grain
pipeline, normalisation statistics and the collector.

The datasets are written here in the real layouts, tiny (3 episodes of at most 12
steps, 16x16 images): RLDS through TFDS's own writer with OpenVLA's LIBERO
feature names, LeRobot with pyarrow parquet files and PyAV mp4s (AV1, a keyframe
every 2 frames, as LeRobot encodes).
"""

import concurrent.futures
import importlib.util
import json
import os
import random
import subprocess
import sys

import av
import jax
import ml_collections
import numpy as np
import PIL.Image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow_datasets as tfds

from configs import default
from jaxvla import config_checks
from jaxvla.data import config as data_config
from jaxvla.data import lerobot, loader, norm_stats, readers, rlds
from jaxvla.data.episodes import DataError
from jaxvla.envs import normalized, protocol
from jaxvla.models import policy as policy_lib
from tests.conftest import ROOT

LENGTHS = (12, 7, 9)  # steps of the 3 episodes
STATE, ACTION, SIZE, FPS = 8, 7, 16, 10
TASKS = ("put the bowl on the plate", "open the drawer")
# Mean absolute pixel error allowed after lossy coding of these smooth frames (measured:
# 1.3 JPEG, 1.9 AV1); the frames of consecutive steps differ by more than 19, so a
# wrong frame cannot pass.
JPEG_TOL, VIDEO_TOL = 5.0, 5.0


# ------------------------------------------------------------------- the data --
def _frame(rng: np.random.Generator) -> np.ndarray:
  """A smooth ``uint8 [16, 16, 3]`` frame (a colour plus a gentle ramp): codecs keep it."""
  base = rng.uniform(40, 200, 3)
  ramp = np.linspace(0, 24, SIZE)[None, :, None] + np.linspace(0, 12, SIZE)[:, None, None]
  return np.clip(base + ramp, 0, 255).astype(np.uint8)


def _make_episodes(seed: int = 0) -> list[dict]:
  """Per episode: ``state [T, 8]``, ``actions [T, 7]``, two cameras ``[T, 16, 16, 3]``, task."""
  rng = np.random.default_rng(seed)
  out = []
  for e, t in enumerate(LENGTHS):
    frames = [np.stack([_frame(rng) for _ in range(t)]) for _ in range(2)]
    for f in frames:  # consecutive frames far apart, so an off-by-one frame is caught
      f[1::2] = 255 - f[1::2]
    out.append(dict(state=rng.normal(size=(t, STATE)).astype(np.float32),
                    actions=rng.uniform(-1, 1, (t, ACTION)).astype(np.float32),
                    images=frames, task=e % 2))
  return out


EPISODES = _make_episodes()


def _all(key: str) -> np.ndarray:
  return np.concatenate([ep[key] for ep in EPISODES])


# ----------------------------------------------------------------------- RLDS --
def _openvla_features(num_state: int = STATE):
  """OpenVLA's LIBERO RLDS features (modified_libero_rlds), at 16 px."""
  image = lambda: tfds.features.Image(shape=(SIZE, SIZE, 3), dtype=np.uint8,
                                      encoding_format="jpeg")
  return tfds.features.FeaturesDict({
      "steps": tfds.features.Dataset({
          "observation": tfds.features.FeaturesDict({
              "image": image(), "wrist_image": image(),
              "state": tfds.features.Tensor(shape=(num_state,), dtype=np.float32),
              "joint_state": tfds.features.Tensor(shape=(7,), dtype=np.float32),
          }),
          "action": tfds.features.Tensor(shape=(ACTION,), dtype=np.float32),
          "discount": tfds.features.Scalar(dtype=np.float32),
          "reward": tfds.features.Scalar(dtype=np.float32),
          "is_first": tfds.features.Scalar(dtype=np.bool_),
          "is_last": tfds.features.Scalar(dtype=np.bool_),
          "is_terminal": tfds.features.Scalar(dtype=np.bool_),
          "language_instruction": tfds.features.Text(),
      }),
      "episode_metadata": tfds.features.FeaturesDict({"file_path": tfds.features.Text()}),
  })


def _openvla_examples(episodes: list[dict]):
  for e, ep in enumerate(episodes):
    t = len(ep["actions"])
    yield dict(steps=[dict(
        observation=dict(image=PIL.Image.fromarray(ep["images"][0][i]),
                         wrist_image=PIL.Image.fromarray(ep["images"][1][i]),
                         state=ep["state"][i], joint_state=np.zeros(7, np.float32)),
        action=ep["actions"][i], discount=1.0, reward=float(i == t - 1), is_first=i == 0,
        is_last=i == t - 1, is_terminal=i == t - 1, language_instruction=TASKS[ep["task"]])
        for i in range(t)], episode_metadata=dict(file_path=f"demo_{e}.hdf5"))


def write_openvla_rlds(directory: str, episodes: list[dict] = EPISODES) -> str:
  version_dir = os.path.join(directory, "1.0.0")
  rlds.write_dataset(version_dir, _openvla_features(), _openvla_examples(episodes),
                     name="libero_tiny_no_noops", max_examples_per_shard=2)
  return directory


def openvla_config(path: str):
  d = data_config.get_config("openvla_libero")
  d.path = path
  return d


# -------------------------------------------------------------------- LeRobot --
def _write_mp4(path: str, frames: np.ndarray) -> None:
  """``frames [T, H, W, 3]`` as LeRobot encodes them: AV1 (SVT), yuv420p, keyframe every 2."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with av.open(path, "w") as container:
    stream = container.add_stream("libsvtav1", rate=FPS, options={"g": "2", "crf": "30"})
    stream.width, stream.height, stream.pix_fmt = SIZE, SIZE, "yuv420p"
    for frame in frames:
      container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
    container.mux(stream.encode())


def _png(image: np.ndarray) -> bytes:
  buf = pa.BufferOutputStream()
  PIL.Image.fromarray(image).save(buf, format="png")
  return buf.getvalue().to_pybytes()


def _frames_table(episodes, first_index: int, keys: dict, video: bool) -> pa.Table:
  """Frame rows of ``episodes`` (list of (episode_index, episode)) in LeRobot's columns."""
  cols = {keys["state"]: [], keys["action"]: [], "timestamp": [], "frame_index": [],
          "episode_index": [], "index": [], "task_index": []}
  if not video:
    cols.update({k: [] for k in keys["cameras"]})
  index = first_index
  for ep_index, ep in episodes:
    for i in range(len(ep["actions"])):
      cols[keys["state"]].append(ep["state"][i].tolist())
      cols[keys["action"]].append(ep["actions"][i].tolist())
      cols["timestamp"].append(i / FPS)
      cols["frame_index"].append(i)
      cols["episode_index"].append(ep_index)
      cols["index"].append(index)
      cols["task_index"].append(ep["task"])
      if not video:
        for c, k in enumerate(keys["cameras"]):
          cols[k].append({"bytes": _png(ep["images"][c][i]), "path": None})
      index += 1
  types = {keys["state"]: pa.list_(pa.float32(), STATE),
           keys["action"]: pa.list_(pa.float32(), ACTION), "timestamp": pa.float32(),
           "frame_index": pa.int64(), "episode_index": pa.int64(), "index": pa.int64(),
           "task_index": pa.int64()}
  types.update({k: pa.struct([("bytes", pa.binary()), ("path", pa.string())])
                for k in keys["cameras"] if not video})
  return pa.table({k: pa.array(v, type=types[k]) for k, v in cols.items()})


def _info(version: str, keys: dict, video: bool) -> dict:
  camera = {"dtype": "video" if video else "image", "shape": [SIZE, SIZE, 3],
            "names": ["height", "width", "channel"]}
  features = {k: dict(camera) for k in keys["cameras"]}
  features[keys["state"]] = {"dtype": "float32", "shape": [STATE], "names": None}
  features[keys["action"]] = {"dtype": "float32", "shape": [ACTION], "names": None}
  for k, t in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
               ("index", "int64"), ("task_index", "int64")):
    features[k] = {"dtype": t, "shape": [1], "names": None}
  info = {"codebase_version": version, "robot_type": "panda", "total_episodes": len(EPISODES),
          "total_frames": sum(LENGTHS), "total_tasks": len(TASKS), "chunks_size": 1000,
          "fps": FPS, "splits": {"train": f"0:{len(EPISODES)}"}, "features": features}
  if version == "v3.0":
    info.update(data_path="data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
                video_path="videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
                if video else None, data_files_size_in_mb=100, video_files_size_in_mb=200)
  else:
    info.update(data_path="data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
                video_path="videos/chunk-{episode_chunk:03d}/{video_key}/"
                "episode_{episode_index:06d}.mp4" if video else None,
                total_chunks=1, total_videos=len(EPISODES) * 2 if video else 0)
  return info


VIDEO_KEYS = dict(cameras=("observation.images.image", "observation.images.wrist_image"),
                  state="observation.state", action="action")
OPENPI_KEYS = dict(cameras=("image", "wrist_image"), state="state", action="actions")


def write_lerobot_v21(root: str, keys: dict = VIDEO_KEYS, video: bool = True) -> str:
  """LeRobot v2.1: a parquet (and an mp4 per camera) per episode, jsonl metadata."""
  os.makedirs(os.path.join(root, "meta"))
  with open(os.path.join(root, "meta", "info.json"), "w") as f:
    json.dump(_info("v2.1", keys, video), f)
  with open(os.path.join(root, "meta", "tasks.jsonl"), "w") as f:
    f.writelines(json.dumps({"task_index": i, "task": t}) + "\n" for i, t in enumerate(TASKS))
  with open(os.path.join(root, "meta", "episodes.jsonl"), "w") as f:
    f.writelines(json.dumps({"episode_index": e, "tasks": [TASKS[ep["task"]]],
                             "length": len(ep["actions"])}) + "\n"
                 for e, ep in enumerate(EPISODES))
  start = 0
  for e, ep in enumerate(EPISODES):
    path = os.path.join(root, "data", "chunk-000", f"episode_{e:06d}.parquet")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(_frames_table([(e, ep)], start, keys, video), path)
    start += len(ep["actions"])
    for c, key in enumerate(keys["cameras"] if video else ()):
      _write_mp4(os.path.join(root, "videos", "chunk-000", key, f"episode_{e:06d}.mp4"),
                 ep["images"][c])
  return root


def write_lerobot_v3(root: str, keys: dict = VIDEO_KEYS) -> str:
  """LeRobot v3.0: episodes 0-1 packed in data file-000, episode 2 in file-001; one mp4 per
  camera holding every episode, with each episode's from/to timestamps in meta/episodes."""
  os.makedirs(os.path.join(root, "meta", "episodes", "chunk-000"))
  with open(os.path.join(root, "meta", "info.json"), "w") as f:
    json.dump(_info("v3.0", keys, True), f)
  # LeRobot writes a pandas DataFrame indexed by the task text: columns task_index, task.
  pq.write_table(pa.table({"task_index": list(range(len(TASKS))), "task": list(TASKS)}),
                 os.path.join(root, "meta", "tasks.parquet"))
  files = [[0, 1], [2]]
  meta, start = [], 0
  for file_index, members in enumerate(files):
    eps = [(e, EPISODES[e]) for e in members]
    path = os.path.join(root, "data", "chunk-000", f"file-{file_index:03d}.parquet")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(_frames_table(eps, start, keys, True), path)
    for e, ep in eps:
      meta.append({"episode_index": e, "tasks": [TASKS[ep["task"]]], "length": len(ep["actions"]),
                   "data/chunk_index": 0, "data/file_index": file_index,
                   "dataset_from_index": start, "dataset_to_index": start + len(ep["actions"]),
                   "stats/action/mean": ep["actions"].mean(0).tolist(),
                   "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
      start += len(ep["actions"])
  for c, key in enumerate(keys["cameras"]):
    t0 = 0.0
    for m, ep in zip(meta, EPISODES):
      duration = len(ep["actions"]) / FPS
      m.update({f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": 0,
                f"videos/{key}/from_timestamp": t0, f"videos/{key}/to_timestamp": t0 + duration})
      t0 += duration
    _write_mp4(os.path.join(root, "videos", key, "chunk-000", "file-000.mp4"),
               np.concatenate([ep["images"][c] for ep in EPISODES]))
  pq.write_table(pa.Table.from_pylist(meta),
                 os.path.join(root, "meta", "episodes", "chunk-000", "file-000.parquet"))
  return root


def lerobot_config(path: str, keys: dict = VIDEO_KEYS):
  d = data_config.get_config("openpi_libero")
  d.path, d.format = path, "auto"
  d.cameras.agentview, d.cameras.robot0_eye_in_hand = keys["cameras"]
  d.state_key, d.action_key = keys["state"], keys["action"]
  return d


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
  root = tmp_path_factory.mktemp("datasets")
  return dict(rlds=write_openvla_rlds(str(root / "rlds")),
              v21=write_lerobot_v21(str(root / "v21")),
              v21_inline=write_lerobot_v21(str(root / "v21_inline"), OPENPI_KEYS, video=False),
              v3=write_lerobot_v3(str(root / "v3")))


def _configs(datasets: dict[str, str]) -> dict:
  return dict(rlds=openvla_config(datasets["rlds"]), v21=lerobot_config(datasets["v21"]),
              v21_inline=lerobot_config(datasets["v21_inline"], OPENPI_KEYS),
              v3=lerobot_config(datasets["v3"]))


# ------------------------------------------------------------------ round trips --
@pytest.mark.parametrize("name,tolerance", [("rlds", JPEG_TOL), ("v21", VIDEO_TOL),
                                            ("v21_inline", 0.0), ("v3", VIDEO_TOL)])
def test_round_trip(datasets, name, tolerance):
  d = _configs(datasets)[name]
  reader = loader.open_reader(d)
  table = reader.table
  np.testing.assert_array_equal(table.lengths, LENGTHS)
  np.testing.assert_array_equal(table.state, _all("state"))
  np.testing.assert_array_equal(table.actions, _all("actions"))
  assert [table.tasks[i] for i in table.task_ids] == [
      TASKS[ep["task"]] for ep in EPISODES for _ in ep["actions"]]
  for e, ep in enumerate(EPISODES):
    for step in range(len(ep["actions"])):
      for c, image in enumerate(reader.images(e, step)):
        err = np.abs(image.astype(float) - ep["images"][c][step]).mean()
        assert err <= tolerance, (name, e, step, c, err)
  spec = loader.dataset_spec(reader, d)
  assert spec.camera_names == ("agentview", "robot0_eye_in_hand")
  assert (spec.image_shape, spec.state_dim, spec.action_dim) == ((SIZE, SIZE, 3), STATE, ACTION)
  assert spec.max_episode_steps == max(LENGTHS)


def test_formats_are_detected(datasets):
  assert readers.detect_format(datasets["rlds"]) == "rlds"
  assert readers.detect_format(os.path.join(datasets["rlds"], "1.0.0")) == "rlds"
  assert readers.detect_format(datasets["v3"]) == "lerobot"


def test_samples_have_action_windows_masked_at_episode_ends(datasets):
  source = loader.StepSource(loader.open_reader(_configs(datasets)["v21_inline"]), horizon=5)
  last = LENGTHS[0] - 1
  for step, valid in ((0, 5), (last - 4, 5), (last - 2, 3), (last, 1)):
    s = source[step]  # episode 0
    np.testing.assert_array_equal(s["action_mask"], np.arange(5) < valid)
    real = EPISODES[0]["actions"][step:step + valid]
    np.testing.assert_array_equal(s["actions"][:valid], real)
    np.testing.assert_array_equal(s["actions"][valid:], np.repeat(real[-1:], 5 - valid, 0))
    np.testing.assert_array_equal(s["state"], EPISODES[0]["state"][step])
  first = source[LENGTHS[0]]  # the next episode's first step: nothing leaks across
  assert (int(first["episode"]), int(first["step"])) == (1, 0)
  np.testing.assert_array_equal(first["actions"], EPISODES[1]["actions"][:5])


def test_images_resized_with_padding(datasets):
  d = _configs(datasets)["v21_inline"]
  d.image_size = 8
  batch = next(iter(loader.make_dataset(loader.open_reader(d), horizon=2, batch_size=3,
                                          seed=0, image_size=8, shard_index=0, shard_count=1)))
  assert batch["images"].shape == (3, 2, 8, 8, 3) and batch["images"].dtype == np.uint8
  wide = np.zeros((4, 8, 3), np.uint8) + 200
  out = loader.episodes_lib.resize_with_pad(wide, 8)  # aspect kept: rows 2..5, zero bands
  assert out.shape == (8, 8, 3) and out[:2].max() == 0 and out[6:].max() == 0
  assert out[2:6].min() == 200


def test_absent_camera_is_a_masked_zero_image(datasets):
  """A policy camera mapped to '' (the dataset has none): zeros, image_mask False, and the
  batch reaches the policy with that mask (openpi's LIBERO setup: a third, masked camera)."""
  d = _configs(datasets)["v21_inline"]
  with d.unlocked():
    d.cameras = ml_collections.ConfigDict({"agentview": OPENPI_KEYS["cameras"][0], "right_wrist": "",
                                           "robot0_eye_in_hand": OPENPI_KEYS["cameras"][1]})
  data_config.validate(d)
  ds, reader = loader.from_config(d, chunk_len=2, batch_size=3, seed=0, shard_index=0,
                                    shard_count=1)
  spec = loader.dataset_spec(reader, d)
  assert spec.camera_names == ("agentview", "right_wrist", "robot0_eye_in_hand")
  raw = next(iter(ds))
  assert raw["images"].shape == (3, 3, SIZE, SIZE, 3)
  np.testing.assert_array_equal(raw["image_mask"], [[True, False, True]] * 3)
  assert raw["images"][:, 1].max() == 0
  for row, (e, t) in enumerate(zip(raw["episode"], raw["step"])):  # the others in their places
    for place, c in ((0, 0), (2, 1)):
      np.testing.assert_array_equal(raw["images"][row, place], EPISODES[e]["images"][c][t])
  c = default.get_config()
  policy = policy_lib.make_policy(c.model, spec)
  batch, _, _ = next(loader.bc_batches([raw], policy.prepare))
  np.testing.assert_array_equal(batch["image_mask"], raw["image_mask"])
  d.cameras.agentview = d.cameras.robot0_eye_in_hand = ""
  with pytest.raises(ValueError, match="config.data.cameras: every camera is ''"):
    data_config.validate(d)


# ------------------------------------------------------------------- pipeline --
def _keys(batches) -> list[tuple[int, int]]:
  return [(int(e), int(s)) for b in batches for e, s in zip(b["episode"], b["step"])]


def test_two_process_shards_are_disjoint_and_complete(datasets):
  reader = loader.open_reader(_configs(datasets)["rlds"])
  shards = [_keys(loader.make_dataset(reader, horizon=3, batch_size=4, seed=1, shard_index=i,
                                        shard_count=2, num_epochs=1, drop_remainder=False))
            for i in range(2)]
  assert not set(shards[0]) & set(shards[1])
  everything = {(e, s) for e, t in enumerate(LENGTHS) for s in range(t)}
  assert set(shards[0]) | set(shards[1]) == everything
  assert len(shards[0]) + len(shards[1]) == sum(LENGTHS)
  # The shuffle is seeded and redrawn each epoch.
  again = _keys(loader.make_dataset(reader, horizon=3, batch_size=4, seed=1, shard_index=0,
                                      shard_count=2, num_epochs=2, drop_remainder=False))
  assert again[:len(shards[0])] == shards[0] and again[len(shards[0]):] != shards[0]


def test_resume_from_grain_state(datasets):
  ds = loader.make_dataset(loader.open_reader(_configs(datasets)["v3"]), horizon=4,
                             batch_size=3, seed=7, shard_index=0, shard_count=1)
  it = iter(ds)
  for _ in range(4):  # past the first epoch (28 steps / 3)
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(8)]
  resumed = iter(ds)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def test_worker_processes_give_the_same_batches(datasets):
  reader = loader.open_reader(_configs(datasets)["rlds"])
  kwargs = dict(horizon=2, batch_size=4, seed=3, shard_index=0, shard_count=1, num_epochs=1)
  in_process = _keys(loader.make_dataset(reader, **kwargs))
  it = iter(loader.make_dataset(reader, num_workers=2, **kwargs))
  try:
    assert _keys(it) == in_process
  finally:
    it.close()


def test_bc_batches_fit_the_policy(datasets):
  """``(batch, actions, mask)`` is what ``policy.bc_loss`` (inside ``Learner.bc_step``) takes."""
  d = _configs(datasets)["v21"]
  reader = loader.open_reader(d)
  c = default.get_config()
  policy = policy_lib.make_policy(c.model, loader.dataset_spec(reader, d))
  batches = loader.make_dataset(reader, horizon=c.model.chunk_len, batch_size=4, seed=0,
                                  shard_index=0, shard_count=1)
  batch, actions, mask = next(loader.bc_batches(batches, policy.prepare))
  assert set(batch) == {"images", "image_mask", "state", "tokens", "token_mask"}
  assert batch["image_mask"].shape == (4, 2) and batch["image_mask"].all()
  assert batch["images"].shape == (4, 2, SIZE, SIZE, 3)
  assert actions.shape == (4, c.model.chunk_len, ACTION) and mask.shape == (4, c.model.chunk_len)
  loss = jax.eval_shape(policy.bc_loss, policy.abstract_params(), batch, actions,
                        jax.random.key(0))
  assert loss.shape == ()


# ----------------------------------------------------------------- statistics --
def test_norm_stats_against_numpy(datasets, tmp_path):
  stats = norm_stats.compute(loader.open_reader(_configs(datasets)["v3"]).table)
  for name, values in (("state", _all("state")), ("actions", _all("actions"))):
    v = values.astype(np.float64)
    np.testing.assert_allclose(stats[name].mean, v.mean(0), rtol=1e-6)
    np.testing.assert_allclose(stats[name].std, v.std(0), rtol=1e-6)
    np.testing.assert_allclose(stats[name].q01, np.quantile(v, 0.01, axis=0), rtol=1e-6)
    np.testing.assert_allclose(stats[name].q99, np.quantile(v, 0.99, axis=0), rtol=1e-6)
  file = norm_stats.save(str(tmp_path / "assets"), stats)
  body = json.load(open(file))
  assert file.endswith("norm_stats.json") and set(body) == {"norm_stats"}
  assert set(body["norm_stats"]["state"]) == {"mean", "std", "q01", "q99"}
  assert all(isinstance(x, float) for x in body["norm_stats"]["actions"]["q99"])
  loaded = norm_stats.load(str(tmp_path / "assets"))
  np.testing.assert_array_equal(loaded["actions"].q01, stats["actions"].q01)


def test_normalize_modes_match_openpi():
  s = norm_stats.NormStats(mean=np.array([1.0, -2.0]), std=np.array([2.0, 0.5]),
                           q01=np.array([-1.0, 0.0]), q99=np.array([3.0, 1.0]))
  x = np.array([[3.0, -1.0, 7.0]])  # one dim more than the statistics (padded actions)
  z = norm_stats.normalize(x, s, "zscore")
  np.testing.assert_allclose(z, [[2.0 / (2 + 1e-6), 1.0 / (0.5 + 1e-6), 7.0]])
  q = norm_stats.normalize(x, s, "quantile")
  np.testing.assert_allclose(q, [[4.0 / (4 + 1e-6) * 2 - 1, -1.0 / (1 + 1e-6) * 2 - 1, 7.0]])
  for mode, y in (("zscore", z), ("quantile", q)):
    np.testing.assert_allclose(norm_stats.unnormalize(y, s, mode), x, rtol=1e-9)
  with pytest.raises(ValueError, match="q01 and q99"):
    norm_stats.normalize(x, norm_stats.NormStats(mean=s.mean, std=s.std), "quantile")


def test_norm_stats_reads_openpi_files_without_quantiles(tmp_path):
  (tmp_path / "norm_stats.json").write_text(json.dumps(
      {"norm_stats": {"state": {"mean": [0.5], "std": [2.0], "q01": None, "q99": None}}}))
  stats = norm_stats.load(str(tmp_path))
  assert stats["state"].q01 is None and stats["state"].std.tolist() == [2.0]
  (tmp_path / "bad.json").write_text(json.dumps({"norm_stats": {"actions": {"mean": [0.0]}}}))
  with pytest.raises(ValueError, match="norm_stats.actions has no 'std'"):
    norm_stats.load(str(tmp_path / "bad.json"))


# ---------------------------------------------------------------- bad datasets --
def _expect(match: str, d) -> None:
  with pytest.raises(DataError, match=match) as info:
    loader.open_reader(d)
  assert len(str(info.value)) < 400  # one line a user reads, not a dump


def test_missing_keys_are_named(datasets):
  d = openvla_config(datasets["rlds"])
  d.state_key = "observation/proprio"
  _expect("no step feature 'observation/proprio'", d)
  d = lerobot_config(datasets["v21"])
  d.cameras.robot0_eye_in_hand = "observation.images.side"
  _expect("no feature 'observation.images.side'", d)
  d = openvla_config(datasets["rlds"])
  d.split = "val"
  _expect("no split 'val'", d)


def test_wrong_shapes_are_named(tmp_path):
  d = openvla_config(str(tmp_path / "rlds"))
  d.cameras.agentview = "observation/state"  # a vector where a camera belongs
  write_openvla_rlds(d.path, EPISODES[:1])
  _expect("camera 'observation/state'", d)
  root = write_lerobot_v21(str(tmp_path / "ragged"), OPENPI_KEYS, video=False)
  path = os.path.join(root, "data", "chunk-000", "episode_000001.parquet")
  table = pq.read_table(path)
  ragged = [row[:STATE - (i % 2)] for i, row in enumerate(table.column("state").to_pylist())]
  table = table.set_column(table.column_names.index("state"), "state",
                           pa.array(ragged, pa.list_(pa.float32())))
  pq.write_table(table, path)
  _expect(r"episode_000001.parquet: episode 1: 'state' rows have lengths \[7, 8\]",
          lerobot_config(root, OPENPI_KEYS))


def test_empty_datasets_fail(tmp_path):
  d = openvla_config(str(tmp_path / "rlds"))
  write_openvla_rlds(d.path, [])
  _expect("holds no episodes", d)
  root = write_lerobot_v21(str(tmp_path / "lerobot"), OPENPI_KEYS, video=False)
  open(os.path.join(root, "meta", "episodes.jsonl"), "w").close()
  _expect("holds no episodes", lerobot_config(root, OPENPI_KEYS))
  d = openvla_config(str(tmp_path / "nothing"))
  os.makedirs(d.path)
  d.format = "auto"
  _expect("neither a LeRobot dataset", d)


def test_unreadable_files_are_named(tmp_path):
  d = openvla_config(str(tmp_path / "rlds"))
  write_openvla_rlds(d.path)
  shard = os.path.join(d.path, "1.0.0", "libero_tiny_no_noops-train.array_record-00001")
  with open(shard, "r+b") as f:  # overwrite the records of the second shard
    f.seek(64)
    f.write(b"\0" * 4000)
  _expect("episode 2 of split 'train' is unreadable", d)
  root = write_lerobot_v3(str(tmp_path / "v3"))
  data = os.path.join(root, "data", "chunk-000", "file-001.parquet")
  with open(data, "wb") as f:
    f.write(b"not parquet")
  _expect("file-001.parquet: unreadable parquet", lerobot_config(root))
  root = write_lerobot_v21(str(tmp_path / "v21"))
  video = os.path.join(root, "videos", "chunk-000", VIDEO_KEYS["cameras"][0],
                       "episode_000002.mp4")
  with open(video, "wb") as f:
    f.write(b"\0" * 100)
  reader = loader.open_reader(lerobot_config(root))
  with pytest.raises(DataError, match="episode_000002.mp4: unreadable video"):
    reader.images(2, 0)


def test_tfrecord_datasets_are_refused_with_the_conversion_command(tmp_path):
  d = openvla_config(write_openvla_rlds(str(tmp_path / "rlds"), EPISODES[:1]))
  info_file = os.path.join(d.path, "1.0.0", "dataset_info.json")
  info = json.load(open(info_file))
  del info["fileFormat"]  # what a TFRecord dataset's dataset_info.json says (the default)
  json.dump(info, open(info_file, "w"))
  _expect("stored as tfrecord, not array_record; convert it once with "
          "`python -m jaxvla.data.convert`", d)


def test_a_failed_write_leaves_no_dataset(tmp_path):
  def examples():
    yield from _openvla_examples(EPISODES[:1])
    raise RuntimeError("simulator crashed")

  out = str(tmp_path / "demos")
  with pytest.raises(RuntimeError, match="simulator crashed"):
    rlds.write_dataset(out, _openvla_features(), examples(), name="demos")
  assert not os.path.exists(out) and os.path.isdir(out + ".incomplete")
  rlds.write_dataset(out, _openvla_features(), _openvla_examples(EPISODES), name="demos")
  assert loader.open_reader(openvla_config(out)).table.num_episodes == len(EPISODES)
  assert not os.path.exists(out + ".incomplete")


# ------------------------------------------------------------------ collector --
def test_collect_cli_writes_a_dataset_the_reader_reads(tmp_path):
  out = str(tmp_path / "demos")
  r = subprocess.run([sys.executable, "-m", "jaxvla.data.collect",
                      "--config=configs/default.py", f"--out={out}", "--episodes=3",
                      "--config.env.image_size=16"],
                     cwd=ROOT, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr[-2000:]
  summary = json.loads(r.stdout.strip().splitlines()[-1])
  assert summary["episodes"] == 3
  d = default.get_config().data
  d.path = out
  reader = loader.open_reader(d)
  assert reader.table.num_episodes == 3 and reader.table.num_steps == summary["steps"]
  assert all(t.startswith("move to the ") for t in reader.table.tasks)
  assert reader.images(0, 0)[0].shape == (16, 16, 3)
  # Strided samples (the default config's stride 0: the chunk length) start at chunk starts.
  table = reader.table
  assert d.stride == 0 and len(loader.StepSource(reader, 5)) == table.num_steps
  strided = loader.StepSource(reader, 5, stride=5)
  assert len(strided) == sum(-(-int(n) // 5) for n in table.lengths)
  assert all(strided[i]["step"] % 5 == 0 for i in range(len(strided)))
  ds, _ = loader.from_config(d, chunk_len=5, batch_size=2, seed=0)
  assert set(next(iter(ds))["step"] % 5) == {0}
  # TFDS itself reads it too, RLDS step fields included.
  builder = tfds.builder_from_directory(out)
  steps = builder.as_data_source(split="train")[0]["steps"]
  assert steps[0]["is_first"] and steps[len(steps) - 1]["is_last"]
  assert "episode_metadata" in builder.info.features
  # A second run does not overwrite it.
  r = subprocess.run([sys.executable, "-m", "jaxvla.data.collect",
                      "--config=configs/default.py", f"--out={out}", "--episodes=1"],
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and "already holds a TFDS dataset" in r.stderr


# --------------------------------------------------------------------- config --
def test_default_config_keeps_the_in_memory_warm_start():
  c = default.get_config()
  assert c.data.path == ""
  config_checks.validate(c)


@pytest.mark.parametrize("key,value,match", [
    ("format", "zarr", "config.data.format"),
    ("action_horizon", 3, "config.data.action_horizon"),
    ("image_size", -1, "config.data.image_size"),
    ("num_workers", -2, "config.data.num_workers"),
])
def test_bad_data_config_names_the_key(key, value, match):
  c = default.get_config()
  c.data[key] = value
  with pytest.raises(ValueError, match=match):
    config_checks.validate(c)


# ---------------------------------------------------------- TFRecord datasets --
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="TensorFlow is not installed (optional: pip install tensorflow-cpu); "
                    "only the TFRecord -> ArrayRecord conversion needs it")
def test_tfrecord_dataset_converts_to_array_record(tmp_path):
  class LiberoTiny(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Built as OpenVLA built its RLDS sets: a TFDS builder writing TFRecord shards."""
    VERSION = tfds.core.Version("1.0.0")
    pkg_dir_path = tfds.core.Path(tmp_path)  # (TFDS looks for metadata of a builder here)

    def _info(self):
      return self.dataset_info_from_configs(features=_openvla_features(),
                                            disable_shuffling=True)

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      for e, example in enumerate(_openvla_examples(EPISODES)):
        yield f"episode_{e}", example

  builder = LiberoTiny(data_dir=str(tmp_path / "tfrecord"))
  builder.download_and_prepare()
  assert builder.info.file_format.value == "tfrecord"
  out = tmp_path / "array_record" / "1.0.0"
  r = subprocess.run([sys.executable, "-m", "jaxvla.data.convert", f"--src={builder.data_dir}",
                      f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  table = loader.open_reader(openvla_config(str(out))).table
  np.testing.assert_array_equal(table.actions, _all("actions"))
  np.testing.assert_array_equal(table.lengths, LENGTHS)


def test_expert_labels_are_its_clean_open_loop_plan():
  """With execution noise, a window of labels from a chunk boundary is the clean chunk
  the expert planned there (what a chunked policy should learn), not a relabelling of
  every step from the noisy states."""
  from jaxvla.data import demonstrators  # pylint: disable=import-outside-toplevel
  from jaxvla.envs import builtin  # pylint: disable=import-outside-toplevel
  c = default.get_config()
  h = c.model.chunk_len
  demo = demonstrators.ExpertDemonstrator(builtin.make(c.env, 1, 0), noise=0.3, speed=0.4,
                                          seed=7, horizon=h)
  episodes = list(demo.episodes(3))
  twin = builtin.make(c.env, 1, 0)
  twin.reset(7)
  plan = twin.expert_chunk(h, speed=0.4)[0]  # The first episode's first chunk.
  first = episodes[0]
  assert len(first.actions) >= h
  np.testing.assert_allclose(first.actions[:h], plan, atol=1e-6)
  np.testing.assert_allclose(first.state[0], twin.observe().state[0])
  # The executed (noisy) path left the planned one: the later states differ from the plan's.
  planned_pos = first.state[0] + c.env.max_speed * np.cumsum(plan, axis=0)
  assert not np.allclose(first.state[1:h], planned_pos[:h - 1], atol=1e-3)


def test_demonstrations_are_episodes_rl_and_evaluation_do_not_play(tmp_path):
  """The recorded demonstrations start from other layouts (first camera images) than the
  run's RL envs' first episodes and its evaluation's: recorded at the RL envs' seed, a warm
  start met its own demonstrations again in RL and seemed to get worse when the envs moved
  past them."""
  from jaxvla.data import collect, demonstrators  # pylint: disable=import-outside-toplevel
  from jaxvla.envs import builtin  # pylint: disable=import-outside-toplevel
  from jaxvla.evaluation import success  # pylint: disable=import-outside-toplevel
  from jaxvla.parallel import distributed  # pylint: disable=import-outside-toplevel
  c = default.get_config()
  c.env.image_size = 16
  out = str(tmp_path / "demos")
  collect.collect(c, out, 8, noise=0.0, num_envs=4)
  ds = tfds.builder_from_directory(out).as_data_source(split="train")
  demo = {bytes(next(iter(ds[i]["steps"]))["observation"]["top"]) for i in range(len(ds))}

  def first_images(seed: int) -> set[bytes]:  # the 4 envs' first episodes' reset images
    return {bytes(img[0]) for img in builtin.make(c.env, 4, seed).reset(seed).images}

  assert first_images(demonstrators.demo_seed(c.seed)) <= demo  # (each env's first episode)
  for seed in (distributed.host_seed(c.seed), c.seed + success.EVAL_SEED_OFFSET,
               demonstrators.demo_seed(c.seed + 1)):  # (the next run seed's demonstrations)
    assert not first_images(seed) & demo, seed
  # A run seed's attempts (episode seeds demo_seed + k) never reach the next seed's.
  assert demonstrators.demo_seed(c.seed + 1) - demonstrators.demo_seed(c.seed) >= 10_000


# ------------------------------------------------------- normalisation in a run --
def _stats() -> dict[str, norm_stats.NormStats]:
  """State with a constant second dim (as a fixed joint or an unused goal field gives)."""
  return {"state": norm_stats.NormStats(mean=np.array([1.0, 5.0]), std=np.array([2.0, 0.0]),
                                        q01=np.array([-3.0, 5.0]), q99=np.array([5.0, 5.0])),
          "actions": norm_stats.NormStats(mean=np.array([0.5, -0.5]), std=np.array([0.25, 0.5]),
                                          q01=np.array([0.0, -1.0]), q99=np.array([1.0, 0.0]))}


@pytest.mark.parametrize("mode", norm_stats.MODES)
def test_normalizer_maps_state_and_actions_and_round_trips(mode, tmp_path):
  n = norm_stats.Normalizer(_stats(), mode)
  state = np.array([[3.0, 5.001]])
  z = n.state(state)
  # The varying dim is openpi's formula; the constant one only centred (not x 1e6).
  first = 2.0 / 2.000001 if mode == "zscore" else 6.0 / 8.000001 * 2 - 1
  np.testing.assert_allclose(z, [[first, 0.001]], rtol=1e-6, atol=1e-6)
  actions = np.array([[[0.75, -1.0], [0.25, 0.0]]])  # [B, H, A]
  labels = n.action_labels(actions)
  np.testing.assert_allclose(n.actions(labels), actions, atol=1e-9)
  if mode == "zscore":
    np.testing.assert_allclose(labels[0, 0], [0.25 / 0.250001, -0.5 / 0.500001])
  # Stored as JSON (checkpoint metadata, the export's norm_stats.json) and read back.
  back = norm_stats.Normalizer.from_json(json.loads(json.dumps(n.to_json())))
  assert back.mode == mode
  np.testing.assert_array_equal(back.state(state), z)
  norm_stats.save_normalizer(str(tmp_path), n)
  body = json.load(open(tmp_path / norm_stats.FILE_NAME))
  assert set(body["norm_stats"]) == {"state", "actions"}  # openpi's file, plus "mode"
  assert norm_stats.load(str(tmp_path))["actions"].std.tolist() == [0.25, 0.5]
  np.testing.assert_array_equal(norm_stats.load_normalizer(str(tmp_path)).actions(labels),
                                n.actions(labels))
  norm_stats.save_normalizer(str(tmp_path), None)  # a run without one leaves no stale file
  assert norm_stats.load_normalizer(str(tmp_path)) is None


def test_bad_normalizers_name_what_is_missing(tmp_path):
  with pytest.raises(ValueError, match="no 'actions' entry"):
    norm_stats.Normalizer({"state": _stats()["state"]}, "zscore")
  with pytest.raises(ValueError, match="checkpoint 7: expected"):
    norm_stats.Normalizer.from_json({"norm_stats": {}}, "checkpoint 7")
  c = default.get_config()
  c.data.normalize = "zscore"  # with neither statistics nor a dataset to compute them from
  with pytest.raises(ValueError, match="config.data.normalize='zscore' needs statistics"):
    loader.normalizer_from_config(c.data)
  c.data.normalize = "minmax"
  with pytest.raises(ValueError, match="config.data.normalize"):
    config_checks.validate(c)


def test_bc_batches_normalise_state_and_labels(datasets):
  d = _configs(datasets)["v3"]
  reader = loader.open_reader(d)
  d.normalize = "quantile"
  n = loader.normalizer_from_config(d, reader)
  np.testing.assert_allclose(n.stats["state"].q99, np.quantile(_all("state"), 0.99, axis=0),
                             rtol=1e-6)
  ds, _ = loader.from_config(d, chunk_len=4, batch_size=3, seed=0)
  raw = next(iter(ds))
  seen = []
  _, actions, mask = next(loader.bc_batches(iter([raw]), lambda obs: seen.append(obs) or {},
                                              n))
  np.testing.assert_allclose(seen[0].state, n.state(raw["state"]))
  np.testing.assert_allclose(actions, n.action_labels(raw["actions"]))
  np.testing.assert_array_equal(mask, raw["action_mask"])


class _RecordingEnv:
  """An AsyncVecEnv (by its members) that records the actions it is given."""
  num_envs, group_size, num_workers, stats = 2, 1, 1, None

  def __init__(self):
    self.spec = protocol.EnvSpec(camera_names=("c",), image_shape=(1, 1, 3), state_dim=2,
                                 action_dim=2, max_episode_steps=5)
    self.sent = []

  def _obs(self, b):
    return protocol.Observation(images=np.zeros((b, 1, 1, 1, 3), np.uint8),
                                state=np.tile([[3.0, 5.0]], (b, 1)).astype(np.float32),
                                instruction=np.array(["x"] * b, dtype=object))

  def group_ids(self):
    return np.arange(2)

  def reset(self, seed, first_episode=None):
    return self._obs(2)

  def _result(self, b):
    final = protocol.Observation(images=np.zeros((1, 1, 1, 1, 3), np.uint8),
                                  state=np.array([[1.0, 5.0]], np.float32),
                                  instruction=np.array(["x"], dtype=object))
    return protocol.ChunkStep(obs=self._obs(b), reward=np.zeros(b), terminated=np.zeros(b, bool),
                              truncated=np.arange(b) == 0, success=np.zeros(b, bool),
                              steps=np.ones(b, np.int64), episodes=[],
                              has_final_obs=np.arange(b) == 0, final_obs=final)

  def step_chunk(self, actions):
    self.sent.append(actions)
    return self._result(len(actions))

  def send(self, actions, env_ids):
    self.sent.append(actions)

  def recv(self, b_max, t_max_s):
    return np.array([1]), self._result(1)

  def close(self):
    pass


def test_normalized_env_feeds_normalised_state_and_unnormalises_actions():
  n = norm_stats.Normalizer(_stats(), "zscore")
  raw = _RecordingEnv()
  env = normalized.wrap(raw, n)
  assert isinstance(env, protocol.AsyncVecEnv) and env.spec is raw.spec
  assert normalized.wrap(raw, None) is raw
  np.testing.assert_allclose(env.reset(0).state, n.state(np.array([[3.0, 5.0]] * 2)))
  policy_actions = np.array([[[0.0, 0.0], [1.0, -1.0]]] * 2)
  result = env.step_chunk(policy_actions)
  np.testing.assert_allclose(raw.sent[-1], n.actions(policy_actions))  # the env's space
  np.testing.assert_allclose(raw.sent[-1][0, 0], [0.5, -0.5])  # 0 is the data's mean action
  np.testing.assert_allclose(result.obs.state, n.state(np.array([[3.0, 5.0]] * 2)))
  np.testing.assert_allclose(result.final_obs.state, [[0.0, 0.0]])  # (1 - 1) / 2, 5 - 5
  env.send(policy_actions[:1], np.array([0]))
  np.testing.assert_allclose(raw.sent[-1], n.actions(policy_actions[:1]))
  ids, result = env.recv(2, 0.0)
  assert ids.tolist() == [1] and result.obs.batch_size == 1
  np.testing.assert_allclose(result.obs.state, n.state(np.array([[3.0, 5.0]])))


class _CriticEnv(_RecordingEnv):
  """:class:`_RecordingEnv` whose observations carry a critic state ``[B, 3]``."""

  def _obs(self, b):
    obs = super()._obs(b)
    obs.critic_state = np.tile([[3.0, 0.01, 5.0]], (b, 1)).astype(np.float32)
    return obs


def test_critic_state_is_z_scored_by_the_demonstrations_statistics(tmp_path):
  """An asymmetric critic's simulation state reaches the value head z-scored by the
  demonstrations' statistics, its std floored (a nearly still dim is not magnified); a
  new run refuses statistics without them, an older policy's pass it through raw."""
  from jaxvla import warm_start  # pylint: disable=import-outside-toplevel
  from jaxvla.data import episodes  # pylint: disable=import-outside-toplevel
  critic = np.array([[-1.0, 0.0, 5.0], [3.0, 0.002, 5.0]], np.float32)
  table = episodes.EpisodeTable(lengths=np.array([2]), state=np.zeros((2, 2), np.float32),
                                actions=np.zeros((2, 2), np.float32),
                                task_ids=np.zeros(2, np.int32), tasks=("x",),
                                critic_state=critic)
  stats = norm_stats.compute(table)
  np.testing.assert_allclose(stats[norm_stats.CRITIC_STATE].mean, [1.0, 0.001, 5.0])
  np.testing.assert_allclose(stats[norm_stats.CRITIC_STATE].std, [2.0, 0.001, 0.0], atol=1e-9)
  n = norm_stats.Normalizer(stats, "quantile")  # (the critic state is z-scored in any mode)
  floor = norm_stats.CRITIC_STATE_STD_FLOOR
  want = [[1.0, (0.01 - 0.001) / floor, 0.0]]
  np.testing.assert_allclose(n.critic_state(np.array([[3.0, 0.01, 5.0]])), want, rtol=1e-6)
  env = normalized.wrap(_CriticEnv(), n)
  np.testing.assert_allclose(env.reset(0).critic_state, want * 2, rtol=1e-6)
  result = env.step_chunk(np.zeros((2, 1, 2)))
  np.testing.assert_allclose(result.obs.critic_state, want * 2, rtol=1e-6)
  assert result.final_obs.critic_state.shape == (1, 0)  # (no critic state: nothing to do)
  # Stored with the policy (checkpoint metadata, the export's norm_stats.json).
  back = norm_stats.Normalizer.from_json(json.loads(json.dumps(n.to_json())))
  np.testing.assert_allclose(back.critic_state(critic), n.critic_state(critic))
  n.check_critic_state(3)
  with pytest.raises(ValueError, match="'critic_state' has 3 dims, config.env.critic_state_dim=4"):
    n.check_critic_state(4)
  # Statistics from before the critic state was recorded.
  old = norm_stats.Normalizer(_stats(), "zscore")
  np.testing.assert_array_equal(old.critic_state(critic), critic)  # its value head read it raw
  old.check_critic_state(0)
  file = norm_stats.save(str(tmp_path / "old"), _stats())
  c = default.get_config()
  c.data.normalize, c.data.norm_stats = "zscore", file
  spec = protocol.EnvSpec(camera_names=("c",), image_shape=(1, 1, 3), state_dim=2,
                          action_dim=2, max_episode_steps=5, critic_state_dim=3)
  with pytest.raises(ValueError, match=r"config.data.norm_stats \(.*old.*\) have no "
                     r"'critic_state' entry, which an env with config.env.critic_state_dim=3"):
    warm_start._normalizer(c.data, spec)  # pylint: disable=protected-access


def test_collect_success_only_records_successes_and_fails_when_too_few(tmp_path):
  from jaxvla.data import collect  # pylint: disable=import-outside-toplevel
  c = default.get_config()
  c.env.image_size = 16
  c.env.max_episode_steps = 12  # Short: the noisy, cautious expert fails some episodes.
  out = str(tmp_path / "demos")
  summary = collect.collect(c, out, 6, noise=0.5, num_envs=4, success_only=True)
  assert summary["episodes"] == 6 and summary["attempted"] > 6, summary
  assert 0.0 < summary["success_rate"] < 1.0
  d = c.data
  d.path = out
  ds = tfds.builder_from_directory(out).as_data_source(split="train")
  assert len(ds) == 6 and all(bool(ds[i]["episode_metadata"]["success"]) for i in range(6))
  assert loader.open_reader(d).table.num_episodes == 6
  c.env.max_episode_steps = 1  # nothing can succeed
  with pytest.raises(ValueError, match=r"--success_only: only 0 of 8 attempted episodes"):
    collect.collect(c, str(tmp_path / "none"), 2, noise=0.0, num_envs=2, success_only=True)
  assert not os.path.exists(tmp_path / "none")


def test_rlds_reader_parses_a_dataset_that_fits_its_cache_once(datasets, monkeypatch):
  """Shuffled BC reads hit the parsed-episode cache when the dataset fits its byte budget
  (each miss parses a whole episode record), and evict the oldest past it."""
  def reads(reader) -> int:
    parsed = []
    parse = reader._parser.parse_example
    monkeypatch.setattr(reader._parser, "parse_example",
                        lambda raw: parsed.append(1) or parse(raw))
    jobs = [(e, s) for e, n in enumerate(LENGTHS) for s in range(n)]
    for e, s in random.Random(0).sample(jobs, len(jobs)):
      reader.images(e, s)
    return len(parsed)
  assert reads(loader.open_reader(_configs(datasets)["rlds"])) == 0  # (parsed at open)
  monkeypatch.setattr(rlds, "_CACHE_BYTES", 1)  # one episode at a time
  reader = loader.open_reader(_configs(datasets)["rlds"])
  assert len(reader._cache) == 1
  assert reads(reader) > len(LENGTHS)


@pytest.mark.parametrize("name,module,cache,rounds", [
    ("rlds", rlds, "_CACHE_BYTES", 20),  # (20 rounds fail the unlocked code)
    ("v21_inline", lerobot, "_CACHED_ROW_GROUPS", 3)])  # (decoding PNGs is the slow part)
def test_read_threads_share_the_readers_cache(datasets, monkeypatch, name, module, cache,
                                              rounds):
  """grain reads with several threads: with a one-entry cache every read evicts another
  thread's entry (a check-then-read race was a KeyError in a real run)."""
  monkeypatch.setattr(module, cache, 1)
  reader = loader.open_reader(_configs(datasets)[name])
  jobs = [(e, s) for e, n in enumerate(LENGTHS) for s in range(n)] * rounds
  interval = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)  # Threads switch often enough to meet inside the cache.
  try:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      images = list(pool.map(lambda job: reader.images(*job)[0], jobs))
  finally:
    sys.setswitchinterval(interval)
  for (e, s), image in zip(jobs[:sum(LENGTHS)], images):
    np.testing.assert_array_equal(image, reader.images(e, s)[0])
