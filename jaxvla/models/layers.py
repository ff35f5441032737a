"""Parameter trees and the small numerical pieces the VLA networks share.

Parameters are created with Flax NNX (:class:`Node` holds named children, every
leaf an ``nnx.Param`` that carries its *logical axes* as ``axes`` metadata) and
used as a pure nested dict, so that optax, orbax, sharding code and openpi's
checkpoints see the same tree. The forward passes are plain functions of those
dicts; scanned layer stacks hold each weight with a leading ``layers`` axis,
exactly as openpi's ``nn.scan`` stores them.

Logical axis names used here (``jaxvla.parallel.sharding`` maps them to mesh axes):
``layers``, ``embed`` (model width), ``mlp``, ``heads``, ``kv_heads``,
``head_dim``, ``vocab``, ``patch``, ``channels``, and ``None`` for axes that are
never sharded.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Init = Callable[..., jax.Array]
Axes = tuple[str | None, ...]

zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


class Node(nnx.Module):
  """A node of a parameter tree; children (Params or Nodes) are named as keyword arguments."""

  def __init__(self, **children):
    for name, child in children.items():
      setattr(self, name, child)


def param(rngs: nnx.Rngs, init: Init, shape: Sequence[int], axes: Axes) -> nnx.Param:
  """A float32 ``nnx.Param`` of ``shape`` with its logical ``axes`` (one per dimension)."""
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {axes} do not match shape {tuple(shape)}")
  return nnx.Param(init(rngs.params(), tuple(shape), jnp.float32), axes=tuple(axes))


def lecun(in_axis=-2, out_axis=-1, batch_axis=()) -> Init:
  return jax.nn.initializers.lecun_normal(in_axis=in_axis, out_axis=out_axis,
                                          batch_axis=batch_axis)


def dense(rngs: nnx.Rngs, din: int, dout: int, axes: Axes, *, stack: tuple[int, ...] = (),
          kernel_init: Init | None = None, bias: bool = True) -> Node:
  """``kernel [*stack, din, dout]`` (+ ``bias [*stack, dout]``); ``axes`` name (din, dout)."""
  lead = ("layers",) * len(stack)
  kernel_init = kernel_init or lecun(batch_axis=tuple(range(len(stack))))
  children = dict(kernel=param(rngs, kernel_init, (*stack, din, dout), lead + tuple(axes)))
  if bias:
    children["bias"] = param(rngs, zeros, (*stack, dout), lead + (axes[1],))
  return Node(**children)


def layer_norm_params(rngs: nnx.Rngs, width: int, *, stack: tuple[int, ...] = ()) -> Node:
  lead = ("layers",) * len(stack)
  return Node(scale=param(rngs, ones, (*stack, width), lead + ("embed",)),
              bias=param(rngs, zeros, (*stack, width), lead + ("embed",)))


def logical_axes(module: nnx.Module) -> dict:
  """The ``axes`` metadata of every ``nnx.Param`` of ``module``, as a nested dict."""
  out: dict = {}
  for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = var.get_metadata().get("axes")
  return out


@functools.lru_cache(maxsize=64)
def _abstract_tree(build: Callable[..., nnx.Module], net: Any) -> tuple[dict, dict]:
  nodes = nnx.eval_shape(lambda: build(net, nnx.Rngs(params=0)))
  return nnx.to_pure_dict(nnx.state(nodes, nnx.Param)), logical_axes(nodes)


def abstract_tree(build: Callable[..., nnx.Module], net: Any) -> tuple[dict, dict]:
  """``(shapes, axes)`` of the tree ``build(net, rngs)`` makes, without allocating it.

  ``shapes`` holds a ``jax.ShapeDtypeStruct`` per parameter, ``axes`` its logical axes
  (:func:`logical_axes`). Tracing a network's construction takes a noticeable
  fraction of a second and every learner, checkpoint restore and import asks for
  these trees, so they are traced once per ``(build, net)`` (``net``: the network's
  frozen, hashable config) and each caller gets its own copy.
  """
  return copy.deepcopy(_abstract_tree(build, net))



class TreeOwner:
  """A policy's parameter-tree methods, for a policy whose tree is ``tree_builder(net, rngs)``.

  Subclasses set ``tree_builder`` (``staticmethod(build)`` of their network module) and
  ``self.net`` (the network's frozen config); ``init``, ``abstract_params`` and
  ``logical_axes`` of the policy contract then come from here, once for every policy.
  """

  tree_builder: Callable[..., "Node"]
  net: Any

  def build(self, rng: jax.Array | int = 0):
    """The parameter tree as NNX nodes (with logical-axis metadata)."""
    return self.tree_builder(self.net, nnx.Rngs(params=rng))

  def init(self, rng: jax.Array) -> dict:
    """Fresh parameters (a pure nested dict)."""
    return nnx.to_pure_dict(nnx.state(self.build(rng), nnx.Param))

  def abstract_params(self) -> dict:
    """Shapes and dtypes of the parameters, without allocating them."""
    return abstract_tree(self.tree_builder, self.net)[0]

  def logical_axes(self) -> dict:
    """Logical axis names of every parameter (same tree as :meth:`init`)."""
    return abstract_tree(self.tree_builder, self.net)[1]

# ----------------------------------------------------------------- functions --
def apply_dense(p: dict, x: jax.Array, dtype=None) -> jax.Array:
  """``x [..., din] @ kernel + bias`` in ``dtype`` (default: ``x``'s)."""
  dtype = dtype or x.dtype
  y = jnp.dot(x.astype(dtype), p["kernel"].astype(dtype))
  return y + p["bias"].astype(dtype) if "bias" in p else y


def layer_norm(p: dict, x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """Flax ``LayerNorm`` (statistics in float32) of ``x [..., D]``."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]
  return y.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, max_wavelength: float = 10_000.0) -> jax.Array:
  """Rotary embedding (Gemma's) of ``x [B, T, N, H]`` at integer ``positions [B, T]``."""
  half = x.shape[-1] // 2
  timescale = max_wavelength ** (2.0 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
  angle = positions[..., None, None].astype(jnp.float32) / timescale  # [B, T, 1, H/2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def posemb_sincos(t: jax.Array, dim: int, min_period: float = 4e-3,
                  max_period: float = 4.0) -> jax.Array:
  """Sine-cosine embedding of scalars ``t [B]`` -> ``[B, dim]`` (pi0's time embedding)."""
  fraction = jnp.linspace(0.0, 1.0, dim // 2)
  period = min_period * (max_period / min_period) ** fraction
  angle = t[:, None].astype(jnp.float32) * (2.0 * math.pi / period)[None]
  return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


def posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.0) -> jax.Array:
  """Fixed 2-D sine-cosine position embedding ``[h * w, width]`` (big_vision's)."""
  y, x = jnp.mgrid[:h, :w]
  omega = 1.0 / temperature ** (jnp.arange(width // 4) / max(width // 4 - 1, 1))
  y = y.reshape(-1)[:, None] * omega[None]
  x = x.reshape(-1)[:, None] * omega[None]
  return jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)


def prefix_lm_mask(input_mask: jax.Array, ar_mask: jax.Array) -> jax.Array:
  """openpi's ``make_attn_mask``: ``bool [B, T, T]`` from ``input_mask [B, T]``, ``ar_mask [T]``.

  A token attends to every valid token whose cumulative ``ar_mask`` count is not
  larger than its own: ``ar_mask = 0`` continues the previous block
  (bidirectional within it), ``1`` starts a new causal block.
  """
  cum = jnp.cumsum(jnp.broadcast_to(ar_mask, input_mask.shape), axis=1)
  attn = cum[:, None, :] <= cum[:, :, None]
  valid = input_mask[:, None, :] & input_mask[:, :, None]
  return attn & valid
