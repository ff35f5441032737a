"""A request dict -> the policy's :class:`~jaxvla.envs.protocol.Observation`, by an observation key map.

The map (``jaxvla/serving/config.py:obs_map``) says which request key feeds each of the
policy's cameras, which keys make up its state and where the prompt is. This
module owns reading a request with it: the checks (every wrong key or shape is an
:class:`ObservationError` naming the key and what was expected), openpi's image
conventions (float images in [0, 1] become uint8, ``[3, H, W]`` becomes
``[H, W, 3]``, any size is resized with padding to the policy's), the zero image
and False mask of a camera the client does not send, and the description of what
it expects (:meth:`ObsMap.expected`) with an example a client can send back as is
(:meth:`ObsMap.example`). Nested request dicts are read as ``/``-joined keys,
as openpi's transforms flatten them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
import numpy as np
from PIL import Image

from jaxvla.envs import protocol

# openpi's example clients send this when they have no instruction (make_*_example).
EXAMPLE_PROMPT = "do something"


class ObservationError(ValueError):
  """A request that does not fit the key map (the message names the key and the expected shape)."""


def resize_with_pad(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """``uint8 [h, w, 3]`` -> ``[height, width, 3]``: aspect kept, zero padding centred.

  openpi_client's ``image_tools.resize_with_pad`` (PIL bilinear, sizes truncated,
  padding split with the extra pixel after), which its LIBERO and DROID clients
  apply before sending; an image already at the size is returned as is.
  """
  cur_height, cur_width = image.shape[:2]
  if (cur_height, cur_width) == (height, width):
    return image
  ratio = max(cur_width / width, cur_height / height)
  new_height, new_width = int(cur_height / ratio), int(cur_width / ratio)
  resized = Image.fromarray(image).resize((new_width, new_height), resample=Image.BILINEAR)
  out = Image.new(resized.mode, (width, height), 0)
  out.paste(resized, (max(0, int((width - new_width) / 2)), max(0, int((height - new_height) / 2))))
  return np.asarray(out)


def flatten(request: dict, prefix: str = "") -> dict[str, Any]:
  """Nested dicts as one dict of ``/``-joined keys (``{"a": {"b": x}}`` -> ``{"a/b": x}``)."""
  flat = {}
  for key, value in request.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(flatten(value, name + "/"))
    else:
      flat[name] = value
  return flat


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
  nested: dict[str, Any] = {}
  for key, value in flat.items():
    *parents, leaf = key.split("/")
    node = nested
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return nested


@dataclasses.dataclass(frozen=True)
class Field:
  """One request key: its shape, dtype, whether it may be left out, and what it feeds."""
  key: str
  shape: tuple[int, ...]
  dtype: str
  required: bool
  feeds: str

  def to_json(self) -> dict:
    return dict(shape=list(self.shape), dtype=self.dtype, required=self.required,
                feeds=self.feeds)


class ObsMap:
  """Reads requests for a policy acting in ``spec`` (see the module docstring).

  Args:
    config: the ``obs_map`` block of ``jaxvla/serving/config.py``.
    spec: the env spec the policy was built for.
    default_prompt: the instruction of a request without one ('': required).

  Raises:
    ValueError: the map does not fit the policy (more cameras than it has, state
      sizes that do not add up to its state), naming both.
  """

  def __init__(self, config: ml_collections.ConfigDict, spec: protocol.EnvSpec,
               default_prompt: str):
    self.name, self.spec, self.default_prompt = config.name, spec, default_prompt
    cams = spec.camera_names
    self.image_keys = tuple(cams) if config.images_from_spec else tuple(config.images)
    if len(self.image_keys) > len(cams):
      raise ValueError(f"obs_map {self.name!r} names {len(self.image_keys)} cameras "
                       f"{list(self.image_keys)}, the policy has {len(cams)}: {list(cams)}")
    self.optional = frozenset(config.optional_images)
    self.ignored = frozenset(config.ignored)
    self.prompt_key = config.prompt
    self.chw = config.image_layout == "chw"
    self.nested = config.nested
    self.state_keys = tuple(config.state)
    self.state_sizes = self._state_sizes(tuple(config.state_sizes), spec.state_dim)
    # Every key a request may hold; an unknown key in one of their groups ('images/...',
    # 'observation/...') is a typo, reported rather than silently ignored.
    self.known = set(self.image_keys) | self.ignored | set(self.state_keys) | {self.prompt_key}
    self.groups = {k.rsplit("/", 1)[0] for k in self.known if "/" in k}

  def _state_sizes(self, sizes: tuple[int, ...], state_dim: int) -> tuple[int, ...]:
    if len(sizes) != len(self.state_keys) or sum(s == 0 for s in sizes) > 1:
      raise ValueError(f"obs_map {self.name!r}: state_sizes {sizes} needs one size per "
                       f"state key {self.state_keys}, at most one of them 0 (the rest)")
    rest = state_dim - sum(sizes)
    if (0 in sizes and rest < 1) or (0 not in sizes and rest != 0):
      raise ValueError(f"obs_map {self.name!r}: state keys {self.state_keys} of sizes {sizes} "
                       f"do not make the policy's state of {state_dim}")
    return tuple(s or rest for s in sizes)

  # ----------------------------------------------------------- what it expects --
  def _image_shape(self) -> tuple[int, int, int]:
    h, w, c = self.spec.image_shape
    return (c, h, w) if self.chw else (h, w, c)

  def expected(self) -> list[Field]:
    """The request keys, with shapes, dtypes and what each one feeds."""
    cams = self.spec.camera_names
    fields = [Field(k, self._image_shape(), "uint8", k not in self.optional,
                    f"camera {cams[i]!r} (any size: resized with padding)")
              for i, k in enumerate(self.image_keys)]
    start = 0
    for key, size in zip(self.state_keys, self.state_sizes):
      fields.append(Field(key, (size,), "float32", True, f"state[{start}:{start + size}]"))
      start += size
    fields.append(Field(self.prompt_key, (), "str", not self.default_prompt, "instruction"))
    return fields

  def masked_cameras(self) -> list[str]:
    """The policy's cameras no request key feeds (always a zero image, mask False)."""
    return list(self.spec.camera_names[len(self.image_keys):])

  def example(self) -> dict[str, Any]:
    """A request that :meth:`parse` accepts (zero images and state), nested as clients send it."""
    flat: dict[str, Any] = {}
    for f in self.expected():
      flat[f.key] = (self.default_prompt or EXAMPLE_PROMPT if f.dtype == "str"
                     else np.zeros(f.shape, f.dtype))
    return _unflatten(flat) if self.nested else flat

  # ------------------------------------------------------------------ reading --
  def parse(self, request: Any) -> protocol.Observation:
    """One request -> an observation batch of one (``images [1, N_cam, H, W, 3]``, env units).

    Raises:
      ObservationError: a missing or unknown key, a wrong shape or dtype (naming it).
    """
    keys = [f.key for f in self.expected()]
    if not isinstance(request, dict):
      raise ObservationError(f"a request must be a dict (msgpack map) with the keys {keys}; "
                             f"got {type(request).__name__}")
    flat = flatten(request)
    unknown = sorted(k for k in flat if k not in self.known and k.rsplit("/", 1)[0] in self.groups)
    if unknown:
      raise ObservationError(f"unknown key(s) {unknown} (obs_map {self.name!r} expects {keys})")
    n_cam = len(self.spec.camera_names)
    h, w, _ = self.spec.image_shape
    images = np.zeros((1, n_cam, h, w, 3), np.uint8)
    mask = np.zeros((1, n_cam), bool)
    for i, key in enumerate(self.image_keys):
      if key in flat:
        images[0, i], mask[0, i] = self._image(key, flat[key]), True
      elif key not in self.optional:
        raise self._missing(key, flat)
    state = np.concatenate([self._state(k, flat, size)
                            for k, size in zip(self.state_keys, self.state_sizes)])
    return protocol.Observation(images=images, state=state[None].astype(np.float32),
                                instruction=np.array([self._prompt(flat)], object),
                                image_mask=mask)

  def _missing(self, key: str, flat: dict) -> ObservationError:
    f = next(f for f in self.expected() if f.key == key)
    return ObservationError(f"the request has no key {key!r} (expected {f.dtype} "
                            f"{list(f.shape)}); it has {sorted(flat)}")

  def _image(self, key: str, value: Any) -> np.ndarray:
    """``[h, w, 3]`` or ``[3, h, w]``, uint8 or float in [0, 1] -> ``uint8 [H, W, 3]``."""
    image = np.asarray(value)
    want = f"uint8 [H, W, 3] or [3, H, W] (the policy's: {list(self._image_shape())})"
    if image.ndim != 3 or 3 not in (image.shape[0], image.shape[-1]):
      raise ObservationError(f"{key!r} has shape {list(image.shape)}; expected {want}")
    if image.dtype.kind == "f":  # openpi's _parse_image: float images are in [0, 1].
      image = (255 * np.clip(image, 0.0, 1.0)).astype(np.uint8)
    elif image.dtype != np.uint8:
      raise ObservationError(f"{key!r} has dtype {image.dtype}; expected {want}")
    if image.shape[-1] != 3:  # (openpi's rule: channels first when they are not last)
      image = image.transpose(1, 2, 0)
    h, w, _ = self.spec.image_shape
    return resize_with_pad(np.ascontiguousarray(image), h, w)

  def _state(self, key: str, flat: dict, size: int) -> np.ndarray:
    if key not in flat:
      raise self._missing(key, flat)
    try:
      value = np.asarray(flat[key], np.float32)
    except (TypeError, ValueError) as e:
      raise ObservationError(f"{key!r} is not numbers ({e}); expected float [{size}]") from e
    if value.ndim == 0 and size == 1:  # DROID's gripper position may come as a scalar.
      value = value[None]
    if value.shape != (size,):
      raise ObservationError(f"{key!r} has shape {list(value.shape)}; expected float [{size}]")
    if not np.isfinite(value).all():
      raise ObservationError(f"{key!r} holds non-finite values: {value.tolist()}")
    return value

  def _prompt(self, flat: dict) -> str:
    prompt = flat.get(self.prompt_key, self.default_prompt or None)
    if prompt is None:
      raise ObservationError(f"the request has no key {self.prompt_key!r} (the instruction, a "
                             f"str; or start the server with a default_prompt)")
    if isinstance(prompt, bytes):  # (DroidInputs decodes bytes prompts too)
      prompt = prompt.decode("utf-8", errors="replace")
    if not isinstance(prompt, str):
      raise ObservationError(f"{self.prompt_key!r} is a {type(prompt).__name__}; expected str")
    return prompt
