"""The ``data`` sub-config: which on-disk demonstrations to read and how they map onto a policy.

``get_config(preset)`` builds it; ``configs/default.py`` holds ``get_config()``,
whose empty ``path`` makes the warm start record the env's scripted expert into
``<workdir>/demos`` first (:func:`recorded` points the config at it). A config file pointing at a dataset sets ``c.data =
get_config("openvla_libero")`` (or another preset) and ``c.data.path``; any
field can then be overridden on the command line. Presets:

* ``""``: what ``python -m jaxvla.data.collect`` writes for the default env
  (RLDS, camera ``top``).
* ``"openvla_libero"``: OpenVLA's LIBERO RLDS sets (``modified_libero_rlds``).
* ``"openpi_libero"``: openpi's LeRobot LIBERO set (``physical-intelligence/libero``).

The two LIBERO presets name the cameras as jaxvla's LIBERO env does
(``agentview``, ``robot0_eye_in_hand``). A policy camera mapped to
:data:`ABSENT_CAMERA` (``""``) is one the dataset does not have: its samples hold
a zero image with ``image_mask`` False (openpi's placeholder for a missing camera).
Only ``ml_collections`` is imported here, so config checks stay cheap.
"""

from __future__ import annotations

import ml_collections

PRESETS = ("", "openvla_libero", "openpi_libero")
FORMATS = ("auto", "rlds", "lerobot")
NORM_MODES = ("zscore", "quantile")  # openpi's (jaxvla.data.norm_stats applies them).
# The dataset key of a policy camera the dataset does not have (zero image, masked out).
ABSENT_CAMERA = ""


def get_config(preset: str = "") -> ml_collections.ConfigDict:
  """The ``data`` sub-config for ``preset`` (one of :data:`PRESETS`)."""
  if preset not in PRESETS:
    raise ValueError(f"unknown data preset {preset!r}; choose one of {PRESETS}")
  d = ml_collections.ConfigDict()
  d.path = ""  # Dataset directory ('': no dataset; the warm start collects scripted demos).
  d.format = "auto"  # 'rlds' (TFDS ArrayRecord), 'lerobot' (v2.x / v3) or 'auto' (from the files).
  d.split = "train"  # RLDS split, or a LeRobot info.json split ('': every episode).
  # Policy camera name -> dataset image key, in the policy's camera order ('': the dataset
  # has no such camera; samples hold a zero image with image_mask False).
  d.cameras = ml_collections.ConfigDict({"top": "observation/top"})
  d.state_key = "observation/state"  # Proprioceptive state vector [S] per step.
  d.action_key = "action"  # Action vector [A] per step.
  d.instruction_key = "language_instruction"  # Per-step text, or 'task_index' (LeRobot tasks).
  d.action_horizon = 0  # H future actions per sample (0: model.chunk_len).
  d.image_size = 0  # Resize every camera, with padding, to this square side (0: as stored).
  # Samples start every `stride` steps of an episode (1: every step; 0: the action horizon,
  # the states where a chunked policy acts).
  d.stride = 1
  # State/action normalisation: 'none', 'zscore' or 'quantile' (openpi's modes), with the
  # statistics of `norm_stats` if set, else computed from the dataset in one pass.
  d.normalize = "none"
  d.norm_stats = ""  # An openpi norm_stats.json (or its directory) to use instead.
  d.num_workers = 0  # grain prefetch processes (0: read in the training process).
  d.read_threads = 4  # grain threads reading samples in each process.
  if preset == "openvla_libero":
    d.format = "rlds"
    d.cameras = ml_collections.ConfigDict({"agentview": "observation/image",
                                           "robot0_eye_in_hand": "observation/wrist_image"})
  elif preset == "openpi_libero":
    d.format = "lerobot"
    d.cameras = ml_collections.ConfigDict({"agentview": "image",
                                           "robot0_eye_in_hand": "wrist_image"})
    d.state_key = "state"
    d.action_key = "actions"
    d.instruction_key = "task_index"
  return d


def recorded(d: ml_collections.ConfigDict, path: str,
             camera_names: tuple[str, ...]) -> ml_collections.ConfigDict:
  """``d`` pointed at a dataset ``python -m jaxvla.data.collect`` wrote at ``path`` for
  an env with ``camera_names``: its format and feature keys, ``d``'s reading options."""
  out = d.copy_and_resolve_references()
  with out.unlocked():
    out.path, out.format, out.split = path, "rlds", "train"
    out.cameras = ml_collections.ConfigDict({c: f"observation/{c}" for c in camera_names})
    out.state_key, out.action_key = "observation/state", "action"
    out.instruction_key = "language_instruction"
  return out


def validate(d: ml_collections.ConfigDict) -> None:
  """Raises ``ValueError`` naming the first invalid ``config.data`` field."""
  def require(ok: bool, key: str, message: str) -> None:
    if not ok:
      raise ValueError(f"config.data.{key}: {message}")

  require(d.format in FORMATS, "format", f"must be one of {FORMATS}, got {d.format!r}")
  require(len(d.cameras) >= 1, "cameras", "needs at least one 'camera name: dataset key'")
  for name, key in d.cameras.items():
    require(isinstance(key, str), f"cameras.{name}",
            f"must be a dataset image key (or {ABSENT_CAMERA!r}: no such camera), got {key!r}")
  require(any(key != ABSENT_CAMERA for key in d.cameras.values()), "cameras",
          f"every camera is {ABSENT_CAMERA!r} (absent); at least one needs a dataset image key")
  for field in ("state_key", "action_key", "instruction_key"):
    require(isinstance(d[field], str) and bool(d[field]), field, "must be a dataset key")
  require(d.action_horizon >= 0, "action_horizon", f"must be >= 0, got {d.action_horizon}")
  require(d.image_size >= 0, "image_size", f"must be >= 0, got {d.image_size}")
  require(d.stride >= 0, "stride", f"must be >= 0 (0: the action horizon), got {d.stride}")
  require(d.normalize in ("none",) + NORM_MODES, "normalize",
          f"must be 'none' or one of {NORM_MODES}, got {d.normalize!r}")
  require(d.num_workers >= 0, "num_workers", f"must be >= 0, got {d.num_workers}")
  require(d.read_threads >= 1, "read_threads", f"must be >= 1, got {d.read_threads}")
