"""Every step's camera image of each env's first episode, for rollout videos.

:class:`FirstEpisodeFrames` wraps an in-process env that reports each executed step
through a ``frame_hook`` (ColorReach does: :mod:`jaxvla.envs.builtin`). It is a
:class:`jaxvla.envs.protocol.VecEnv` itself, so jaxvla's own evaluation
(:func:`jaxvla.evaluation.success.evaluate`, which plays exactly the first episode of
every env) runs through it unchanged while it keeps, per env, the frame after
``reset`` and the frame after each step of that first episode. :func:`tile` lays
recorded episodes side by side as one clip (``uint8 [T, H, W, 3]``) for a GIF or mp4.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxvla.envs import protocol

_RUNNING = np.array([128, 128, 128], np.uint8)  # Border while the episode runs,
_SUCCESS = np.array([40, 200, 60], np.uint8)  # once it has succeeded,
_FAILURE = np.array([220, 40, 40], np.uint8)  # or once it has failed / timed out.


@dataclasses.dataclass
class Episode:
  """One recorded episode.

  Attributes:
    frames: ``uint8 [T, H, W, 3]``: the first camera after the reset, then after each
      executed step (``T`` = the episode's length + 1).
    instruction: the episode's language instruction.
    success: whether it ended in success (None while it has not ended).
  """
  frames: np.ndarray
  instruction: str
  success: bool | None


class FirstEpisodeFrames:
  """``env`` with every env's first episode recorded step by step (see the module doc).

  The recording starts again at every ``reset``. Anything not defined here
  (``spec``, ``num_envs``, ``group_ids``, ``close``, ...) is the env's own.

  Raises:
    TypeError: ``env`` has no ``frame_hook`` (an env pool, or a simulator adapter
      that does not report steps).
  """

  def __init__(self, env: protocol.VecEnv):
    if not hasattr(env, "frame_hook"):
      raise TypeError(f"{type(env).__name__} reports no per-step frames (no frame_hook); "
                      "record frames from an in-process ColorReach (env_workers=0)")
    self.env = env
    env.frame_hook = self._on_step
    self._frames: list[list[np.ndarray]] = []
    self._instructions: list[str] = []
    self._done = np.zeros(0, bool)  # [B]: the first episode has ended.
    self._success: list[bool | None] = []

  def __getattr__(self, name: str):
    return getattr(self.env, name)  # (only reached for what this class does not define)

  def reset(self, seed: int, first_episode: np.ndarray | None = None) -> protocol.Observation:
    obs = self.env.reset(seed) if first_episode is None else self.env.reset(seed, first_episode)
    self._frames = [[img] for img in obs.images[:, 0]]
    self._instructions = [str(x) for x in obs.instruction]
    self._done = np.zeros(self.env.num_envs, bool)
    self._success = [None] * self.env.num_envs
    return obs

  def step_chunk(self, actions: np.ndarray) -> protocol.ChunkStep:
    result = self.env.step_chunk(actions)
    # An env ends at most one episode per chunk, so its first end carries the outcome.
    for i in np.flatnonzero(result.done):
      if self._success[i] is None:
        self._success[i] = bool(result.success[i])
    return result

  def _on_step(self, images: np.ndarray, stepped: np.ndarray, ended: np.ndarray) -> None:
    for i in np.flatnonzero(stepped & ~self._done):
      self._frames[i].append(images[i].copy())
    self._done |= stepped & ended

  def episodes(self) -> list[Episode]:
    """Each env's first episode since the last ``reset``, in env order."""
    return [Episode(np.stack(frames), text, success) for frames, text, success
            in zip(self._frames, self._instructions, self._success)]


def tile(episodes: list[Episode], scale: int = 4, border: int = 2) -> np.ndarray:
  """The episodes side by side as one clip ``uint8 [T, H', W', 3]``.

  Each image is enlarged ``scale`` times (nearest pixel) inside a ``border``-pixel
  frame: grey while its episode runs, then green (success) or red (failure), holding
  its last image until the longest episode ends.
  """
  if not episodes:
    raise ValueError("tile needs at least one episode")
  length = max(len(e.frames) for e in episodes)
  columns = []
  for e in episodes:
    big = e.frames.repeat(scale, axis=1).repeat(scale, axis=2)  # [T, h, w, 3]
    held = np.concatenate([big, np.repeat(big[-1:], length - len(big), axis=0)])
    end_colour = _RUNNING if e.success is None else (_SUCCESS if e.success else _FAILURE)
    colour = np.where((np.arange(length) >= len(big) - 1)[:, None], end_colour, _RUNNING)
    framed = np.broadcast_to(colour[:, None, None, :],
                             (length, held.shape[1] + 2 * border, held.shape[2] + 2 * border,
                              3)).copy()
    framed[:, border:border + held.shape[1], border:border + held.shape[2]] = held
    columns.append(framed)
  return np.concatenate(columns, axis=2)
