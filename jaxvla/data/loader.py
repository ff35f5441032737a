"""From an on-disk dataset to behaviour-cloning batches: one grain pipeline for every format.

* :func:`open_reader`: the ``data`` config -> an RLDS or LeRobot reader
  (format from the config or detected from the files); owned by
  :mod:`jaxvla.data.readers` and re-exported here, where BC's users look for it.
* :class:`StepSource`: a random-access source with one sample per step (or per
  ``stride``-th step of each episode): the cameras, state and instruction at the
  step and its next H actions with a validity mask (False past the episode's end).
  A policy camera the dataset does not have (``config.data.cameras`` maps it to
  ``""``) is a zero image with ``image_mask`` False, so the policy leaves it out.
* :func:`make_dataset`: grain ``MapDataset`` over that source: this process's
  shard (``[shard_index::shard_count]``: disjoint, together complete), a seeded
  shuffle redrawn every epoch, batches, then threads (``ReadOptions``) and
  optionally worker processes (``mp_prefetch``). Iterators resume exactly from
  ``get_state()`` / ``set_state()``.
* :func:`bc_batches`: batches -> ``(batch, actions, mask)`` for
  ``Learner.bc_step(state, batch, actions)``: ``batch`` is what
  ``policy.prepare(obs)`` returns for the equivalent env observation.

A batch of :func:`make_dataset` (B = ``batch_size``)::

  images       uint8   [B, N_cam, H, W, 3]   cameras in config.data.cameras order
  image_mask   bool    [B, N_cam]            False for a camera the dataset does not have
  state        float32 [B, S]
  instruction  object  [B]                   text
  actions      float32 [B, H, A]             steps t .. t+H-1 (the last one repeated past the end)
  action_mask  bool    [B, H]                False where t+h is past the episode's end
  episode      int64   [B]                   episode index in the split
  step         int64   [B]                   step t in its episode
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import grain
import jax
import ml_collections
import numpy as np
from absl import flags

from jaxvla.data import episodes as episodes_lib
from jaxvla.data import norm_stats
from jaxvla.data.episodes import DataError, EpisodeReader
from jaxvla.data.readers import camera_present, open_reader
from jaxvla.envs import protocol


def dataset_spec(reader: EpisodeReader, d: ml_collections.ConfigDict) -> protocol.EnvSpec:
  """The ``EnvSpec`` a policy trained on ``reader``'s samples sees (to build one from data).

  ``max_episode_steps`` is the dataset's longest episode.
  """
  h, w, _ = image_shape(reader, d.image_size)
  table = reader.table
  return protocol.EnvSpec(camera_names=tuple(d.cameras.keys()), image_shape=(h, w, 3),
                          state_dim=int(table.state.shape[1]),
                          action_dim=int(table.actions.shape[1]),
                          max_episode_steps=int(table.lengths.max()))


def image_shape(reader: EpisodeReader, image_size: int) -> tuple[int, int, int]:
  """``(H, W, 3)`` of every sample's cameras (all must match unless resized).

  Raises:
    DataError: the cameras differ in shape and ``image_size`` is 0.
  """
  if image_size:
    return image_size, image_size, 3
  shapes = set(reader.image_shapes)
  if len(shapes) != 1:
    raise DataError(f"{reader.path}: cameras have different shapes "
                    f"{list(reader.image_shapes)}; set config.data.image_size to resize them")
  return next(iter(shapes))


class StepSource:
  """One sample per step of a reader's dataset (a grain random-access source).

  Args:
    reader: the opened dataset.
    horizon: H, actions per sample.
    image_size: resize cameras to ``[image_size, image_size, 3]`` (0: as stored).
    stride: samples start at steps ``0, stride, 2 * stride, ...`` of every episode
      (1: every step). A chunked policy that acts every H steps sees only the states
      at chunk starts; with ``stride = H`` the samples are those states.
    camera_present: per policy camera, whether the reader has it (:func:`camera_present`);
      the reader's cameras fill the True places in order, the False ones get a zero
      image of the same shape and ``image_mask`` False. None: every camera is the reader's.
  """

  def __init__(self, reader: EpisodeReader, horizon: int, image_size: int = 0,
               stride: int = 1, camera_present: tuple[bool, ...] | None = None):
    if horizon < 1:
      raise ValueError(f"action horizon must be >= 1, got {horizon}")
    if stride < 1:
      raise ValueError(f"sample stride must be >= 1, got {stride}")
    self.reader = reader
    self.horizon = horizon
    self.image_size = image_size
    self.stride = stride
    self.image_shape = image_shape(reader, image_size)  # fails now rather than in a worker
    present = (True,) * len(reader.image_shapes) if camera_present is None else camera_present
    if sum(present) != len(reader.image_shapes):
      raise ValueError(f"camera_present={present} marks {sum(present)} cameras present; the "
                       f"reader has {len(reader.image_shapes)}")
    self.image_mask = np.array(present, bool)
    table = reader.table
    # The global steps samples start at (all of them unless strided).
    self._steps = (np.arange(table.num_steps) if stride == 1 else np.nonzero(
        table.locate(np.arange(table.num_steps))[1] % stride == 0)[0])

  def __len__(self) -> int:
    return len(self._steps)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    """Sample ``index`` (of the sampled steps): see the module docstring for the fields."""
    table = self.reader.table
    index = int(self._steps[int(index)])
    episode, step = (int(x) for x in table.locate(index))
    actions, mask = table.action_window(index, self.horizon)
    stored = iter(self.reader.images(episode, step))
    images = []
    for present in self.image_mask:
      image = next(stored) if present else np.zeros(self.image_shape, np.uint8)
      images.append(episodes_lib.resize_with_pad(image, self.image_size)
                    if self.image_size else image)
    return dict(images=np.stack(images), image_mask=self.image_mask.copy(),
                state=table.state[index],
                instruction=np.array(table.tasks[table.task_ids[index]], dtype=object),
                actions=actions, action_mask=mask, episode=np.int64(episode),
                step=np.int64(step))

  def __repr__(self) -> str:
    return (f"StepSource({self.reader.path}, {len(self)} steps, H={self.horizon}, "
            f"stride={self.stride}, "
            f"image_size={self.image_size})")


def make_dataset(reader: EpisodeReader, *, horizon: int, batch_size: int, seed: int,
                 image_size: int = 0, stride: int = 1, shard_index: int | None = None,
                 shard_count: int | None = None, num_epochs: int | None = None,
                 num_workers: int = 0, read_threads: int = 4,
                 drop_remainder: bool = True,
                 camera_present: tuple[bool, ...] | None = None) -> grain.IterDataset:
  """The batched, shuffled, sharded pipeline over ``reader``'s steps.

  Args:
    reader: the opened dataset.
    horizon: H, actions per sample.
    batch_size: samples per batch of this process (multi-host: the global batch
      divided by the process count, as ``Learner.bc_step`` takes this process's rows).
    seed: shuffle seed; epoch ``k`` is shuffled with ``seed + k``.
    image_size: resize cameras to this square side (0: as stored).
    stride: samples start every ``stride`` steps of an episode (:class:`StepSource`).
    shard_index, shard_count: this process's shard; default
      ``jax.process_index()`` of ``jax.process_count()``. Shard ``i`` holds steps
      ``i, i + n, i + 2n, ...``: shards are disjoint and cover every step.
    num_epochs: passes over the shard (None: forever, so processes never run out
      at different batches).
    num_workers: grain worker processes (0: threads of this process only).
    read_threads: threads reading batches (in each worker process, if any); twice as
      many batches are read ahead.
    drop_remainder: drop a last, smaller batch.
    camera_present: per policy camera, whether the dataset has it (:class:`StepSource`).

  Raises:
    ValueError: a shard outside ``[0, shard_count)``.
  """
  shard_index = jax.process_index() if shard_index is None else shard_index
  shard_count = jax.process_count() if shard_count is None else shard_count
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} is not in [0, shard_count={shard_count})")
  ds = grain.MapDataset.source(StepSource(reader, horizon, image_size, stride, camera_present))
  ds = ds[shard_index::shard_count].shuffle(seed=seed).repeat(num_epochs)
  # Batched before the threads and workers, so each of them assembles whole batches: the
  # batches do not depend on read_threads or num_workers.
  ds = ds.batch(batch_size, drop_remainder=drop_remainder)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                            prefetch_buffer_size=2 * read_threads))
  if num_workers:
    # grain's workers read absl flags; outside absl.app.run they are unparsed and the
    # workers would fail on first access.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return it


def from_config(d: ml_collections.ConfigDict, *, chunk_len: int, batch_size: int, seed: int,
                shard_index: int | None = None, shard_count: int | None = None
                ) -> tuple[grain.IterDataset, EpisodeReader]:
  """:func:`make_dataset` for the ``data`` sub-config (H: ``d.action_horizon`` or
  ``chunk_len``; stride: ``d.stride``, 0 meaning H).

  Returns:
    the pipeline and the opened reader (for :func:`dataset_spec` and statistics).
  """
  reader = open_reader(d)
  horizon = d.action_horizon or chunk_len
  ds = make_dataset(reader, horizon=horizon, batch_size=batch_size,
                    seed=seed, image_size=d.image_size, stride=d.stride or horizon, shard_index=shard_index,
                    shard_count=shard_count, num_workers=d.num_workers,
                    read_threads=d.read_threads, camera_present=camera_present(d))
  return ds, reader


def bc_batches(batches: Iterable[dict[str, np.ndarray]],
               prepare: Callable[[protocol.Observation], dict[str, np.ndarray]],
               normalizer: norm_stats.Normalizer | None = None
               ) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]]:
  """Batches of :func:`make_dataset` -> ``(batch, actions [B, H, A], mask [B, H])``.

  ``batch = prepare(Observation(images, state, instruction, image_mask))``, with ``prepare``
  the policy's own ``prepare``; ``(batch, actions)`` are the arguments of
  ``Learner.bc_step(state, batch, actions)`` and ``mask`` marks the real actions.
  With a ``normalizer``, state and actions are in the policy's normalised space.
  """
  for b in batches:
    state, actions = b["state"], b["actions"]
    if normalizer is not None:
      state, actions = normalizer.state(state), normalizer.action_labels(actions)
    obs = protocol.Observation(images=b["images"], state=state,
                               instruction=np.asarray(b["instruction"], dtype=object),
                               image_mask=b["image_mask"])
    yield prepare(obs), actions, b["action_mask"]


def normalizer_from_config(d, reader: EpisodeReader | None = None
                           ) -> norm_stats.Normalizer | None:
  """The normalisation ``config.data`` asks for: None for ``normalize='none'``; else the
  statistics of ``d.norm_stats`` if set, else computed over ``reader``'s (or
  ``d.path``'s) whole dataset.

  Raises:
    ValueError: naming ``config.data.normalize`` when there is nothing to compute
      the statistics from.
  """
  if d.normalize == "none":
    return None
  if d.norm_stats:
    return norm_stats.Normalizer(norm_stats.load(d.norm_stats), d.normalize)
  if reader is None:
    if not d.path:
      raise ValueError(f"config.data.normalize={d.normalize!r} needs statistics: set "
                       "config.data.norm_stats (a norm_stats.json) or config.data.path")
    reader = open_reader(d)
  return norm_stats.Normalizer(norm_stats.compute(reader.table), d.normalize)


__all__ = ["DataError", "StepSource", "bc_batches", "dataset_spec", "from_config",
           "make_dataset", "normalizer_from_config", "open_reader"]
