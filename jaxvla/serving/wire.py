"""The wire format: msgpack with NumPy arrays, byte for byte openpi_client's ``msgpack_numpy``.

An array travels as the map ``{b"__ndarray__": True, b"data": raw bytes, b"dtype":
dtype.str, b"shape": shape}`` and a NumPy scalar as ``{b"__npgeneric__": True,
b"data": item, b"dtype": dtype.str}``, so messages packed here are read by
``openpi_client.msgpack_numpy.unpackb`` and the other way round. Unlike it,
unpacking checks what a client sent before trusting it: only boolean, integer
and floating dtypes, and a buffer whose size fits the shape (a bad array is a
:class:`WireError` naming it, not a NumPy error deep in the server).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

# Kinds an array may have on the wire: bool, signed / unsigned int, float.
_KINDS = ("b", "i", "u", "f")


class WireError(ValueError):
  """A message that is not msgpack, or an array whose header does not fit its data."""


def _pack_default(obj: Any) -> Any:
  if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in ("V", "O", "c"):
    raise ValueError(f"Unsupported dtype: {obj.dtype}")
  if isinstance(obj, np.ndarray):
    return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str,
            b"shape": obj.shape}
  if isinstance(obj, np.generic):
    return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
  return obj


def _unpack_hook(obj: dict) -> Any:
  if b"__ndarray__" in obj:
    try:
      dtype, shape, data = np.dtype(obj[b"dtype"]), tuple(obj[b"shape"]), obj[b"data"]
    except (KeyError, TypeError) as e:
      raise WireError(f"an array header is malformed: {e}") from e
    if dtype.kind not in _KINDS:
      raise WireError(f"arrays of dtype {dtype} are not accepted (bool, int or float only)")
    if any(not isinstance(d, int) or d < 0 for d in shape) or (
        len(data) != math.prod(shape) * dtype.itemsize):
      raise WireError(f"an array of shape {shape} and dtype {dtype} cannot hold "
                      f"{len(data)} bytes")
    return np.ndarray(buffer=data, dtype=dtype, shape=shape)
  if b"__npgeneric__" in obj:
    return np.dtype(obj[b"dtype"]).type(obj[b"data"])
  return obj


def packb(obj: Any) -> bytes:
  """``obj`` (dicts, lists, str, numbers, NumPy arrays) as one msgpack message."""
  return msgpack.packb(obj, default=_pack_default)


def unpackb(data: bytes) -> Any:
  """The message ``data``, arrays as read-only NumPy arrays over its buffer.

  Raises:
    WireError: ``data`` is not one msgpack message, or holds an array that does not fit.
  """
  try:
    return msgpack.unpackb(data, object_hook=_unpack_hook)
  except WireError:
    raise
  except (ValueError, TypeError, msgpack.UnpackException) as e:
    raise WireError(f"the message is not msgpack (openpi_client.msgpack_numpy): {e}") from e
