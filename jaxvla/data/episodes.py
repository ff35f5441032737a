"""What every on-disk demonstration reader provides: an episode table and per-step images.

A reader (:mod:`jaxvla.data.rlds`, :mod:`jaxvla.data.lerobot`) opens a dataset
directory once, reads every episode's small per-step values (state, action,
instruction) into an :class:`EpisodeTable` in memory, and decodes camera images on
demand (:meth:`EpisodeReader.images`), one step at a time. Images stay on disk
because they are most of a dataset's bytes; the table costs ``4 * (S + A) + 4``
bytes per step (about 17 MB for LIBERO's 270k steps).

This module is the leaf of the package: the readers, the grain pipeline and the
normalisation statistics import it, it imports none of them. It also owns the
one error type (:class:`DataError`, a message naming the key, file or episode)
and the image resize every reader's output goes through.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import PIL.Image


class DataError(ValueError):
  """A dataset that cannot be used as configured; the message names the key, file or episode."""


# What the data CLIs print as one ``error:`` line, without a traceback: the message says
# all a user needs (the key, file or episode), as in jaxvla.main.
ONE_LINE_ERRORS = (DataError, FileExistsError, FileNotFoundError)


@dataclasses.dataclass(frozen=True)
class Features:
  """The dataset keys a reader extracts, in the policy's terms (from the ``data`` config).

  Attributes:
    cameras: dataset image keys, in the policy's camera order.
    state: key of the proprioceptive state vector ``[S]``.
    action: key of the action vector ``[A]``.
    instruction: key of the per-step instruction text, or ``'task_index'`` for a
      LeRobot dataset's task table.
  """
  cameras: tuple[str, ...]
  state: str
  action: str
  instruction: str


@dataclasses.dataclass(frozen=True)
class EpisodeTable:
  """Every step's small values, episodes one after another (N steps in E episodes).

  Attributes:
    lengths: ``int64 [E]`` steps per episode (each >= 1).
    state: ``float32 [N, S]``.
    actions: ``float32 [N, A]``.
    task_ids: ``int32 [N]`` index of each step's instruction in ``tasks``.
    tasks: the distinct instruction texts.
    critic_state: ``float32 [N, C]`` the simulation state an asymmetric critic reads
      (recorded demonstrations of such an env), or None where the dataset has none.
  """
  lengths: np.ndarray
  state: np.ndarray
  actions: np.ndarray
  task_ids: np.ndarray
  tasks: tuple[str, ...]
  critic_state: np.ndarray | None = None

  @property
  def num_steps(self) -> int:
    return int(self.state.shape[0])

  @property
  def num_episodes(self) -> int:
    return int(self.lengths.shape[0])

  @property
  def starts(self) -> np.ndarray:
    """``int64 [E]``: index of each episode's first step."""
    return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)

  def locate(self, index: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
    """Global step ``index`` ``[...]`` -> ``(episode [...], step in episode [...])``."""
    ends = np.cumsum(self.lengths)
    episode = np.searchsorted(ends, index, side="right")
    return episode, np.asarray(index) - self.starts[episode]

  def action_window(self, index: int, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """The actions of steps ``index .. index + horizon - 1`` of ``index``'s episode.

    Past the episode's last step the window repeats that step's action (as
    LeRobot pads ``delta_timestamps``), so a loss without the mask still sees a
    plausible chunk; the mask says which entries are real.

    Returns:
      ``(actions float32 [horizon, A], mask bool [horizon])``.
    """
    episode, step = self.locate(index)
    last = index - step + self.lengths[episode] - 1  # global index of the episode's last step
    rows = np.minimum(np.arange(index, index + horizon), last)
    return self.actions[rows], np.arange(index, index + horizon) <= last


class EpisodeReader(Protocol):
  """A demonstration dataset opened for training (picklable: grain workers get a copy).

  Attributes:
    path: the dataset directory.
    table: every step's state, action and instruction.
    image_shapes: ``(H, W, 3)`` of each camera in :attr:`Features.cameras`, as stored.
  """
  path: str
  table: EpisodeTable
  image_shapes: tuple[tuple[int, int, int], ...]

  def images(self, episode: int, step: int) -> list[np.ndarray]:
    """``uint8 [H, W, 3]`` per camera, in :attr:`Features.cameras` order."""


def build_table(episodes: list[tuple[np.ndarray, np.ndarray, list[str]]], path: str,
                features: Features, critic_state: list[np.ndarray] | None = None
                ) -> EpisodeTable:
  """Stacks per-episode ``(state [T, S], actions [T, A], instructions [T])`` into a table,
  with each episode's ``critic_state [T, C]`` if given.

  Raises:
    DataError: no episodes, an empty episode, or state / action sizes that differ
      between episodes (naming the key and the episode).
  """
  if not episodes:
    raise DataError(f"{path}: the dataset holds no episodes")
  vocab: dict[str, int] = {}
  for e, (state, actions, texts) in enumerate(episodes):
    if len(texts) == 0:
      raise DataError(f"{path}: episode {e} has no steps")
    for key, arr, ref in ((features.state, state, episodes[0][0]),
                          (features.action, actions, episodes[0][1])):
      if arr.ndim != 2 or arr.shape[0] != len(texts) or arr.shape[1:] != ref.shape[1:]:
        raise DataError(f"{path}: '{key}' of episode {e} has shape {arr.shape}, expected "
                        f"[{len(texts)}, {ref.shape[1]}] (one vector per step)")
    if critic_state is not None and (critic_state[e].shape[0] != len(texts) or
                                     critic_state[e].shape[1:] != critic_state[0].shape[1:]):
      raise DataError(f"{path}: 'critic_state' of episode {e} has shape "
                      f"{critic_state[e].shape}, expected [{len(texts)}, "
                      f"{critic_state[0].shape[1]}] (one vector per step)")
    for text in texts:
      vocab.setdefault(text, len(vocab))
  return EpisodeTable(
      lengths=np.array([len(t) for _, _, t in episodes], np.int64),
      state=np.concatenate([s for s, _, _ in episodes]).astype(np.float32),
      actions=np.concatenate([a for _, a, _ in episodes]).astype(np.float32),
      task_ids=np.array([vocab[t] for _, _, texts in episodes for t in texts], np.int32),
      tasks=tuple(vocab),
      critic_state=(None if critic_state is None
                    else np.concatenate(critic_state).astype(np.float32)))


def check_image(image: np.ndarray, shape: tuple[int, int, int], key: str, where: str) -> np.ndarray:
  """``image`` as ``uint8 [H, W, 3]``, or a :class:`DataError` naming ``key`` and ``where``."""
  image = np.asarray(image)
  if image.shape != tuple(shape) or image.dtype != np.uint8:
    raise DataError(f"{where}: camera '{key}' decoded to {image.dtype} {image.shape}, "
                    f"expected uint8 {tuple(shape)}")
  return image


def resize_with_pad(image: np.ndarray, size: int) -> np.ndarray:
  """``uint8 [H, W, 3]`` -> ``[size, size, 3]``: bilinear, aspect kept, zero padding centred.

  The same result as openpi's ``image_tools.resize_with_pad`` (PIL bilinear), so
  a policy trained here sees LIBERO's 256 px frames as openpi's policies do.
  """
  h, w = image.shape[:2]
  if (h, w) == (size, size):
    return image
  ratio = max(w / size, h / size)
  new_h, new_w = int(h / ratio), int(w / ratio)
  resized = PIL.Image.fromarray(image).resize((new_w, new_h), resample=PIL.Image.BILINEAR)
  out = PIL.Image.new(resized.mode, (size, size), 0)
  out.paste(resized, (max(0, (size - new_w) // 2), max(0, (size - new_h) // 2)))
  return np.asarray(out)
