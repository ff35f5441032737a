"""Which parameters the learner trains: the trained subtree and the optimizer over it alone.

With LoRA (``config.model.lora``) most weights are frozen (openpi's freeze filter,
:func:`jaxvla.models.lora.trainable_predicate`). Like openpi's train step
(``nnx.DiffState`` on the trainable filter, ``tx.init(params.filter(trainable))``),
the learner then

* differentiates the loss with respect to the trained subtree only
  (:meth:`Trainable.select`), so no gradient of a frozen weight is ever formed;
* keeps the optimizer state of that subtree only (:func:`train_only`), so Adam holds
  no moments for frozen weights;
* writes the updated subtree back into the full params (:meth:`Trainable.merge`),
  which the rollout, checkpoints and exports keep seeing whole.

A policy whose ``rl_heads_only`` is set (the steered samplers 'latent' and
'residual') has RL train the heads under ``rl/`` alone (:meth:`Trainable.rl_heads`); BC still trains what
:meth:`Trainable.of` says.

Without adapters everything trains, ``select`` and ``merge`` are the identity and
the optimizer is the plain one (same state tree as before LoRA existed).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from jaxvla.models import lora

RL_PREFIX = "rl/"  # the RL heads' subtree (value, flow_noise std, steering)
Tree = Any  # a nested dict of arrays (params, gradients, shardings, ShapeDtypeStructs)


def _paths(tree: Mapping, prefix: str = ""):
  for key, value in tree.items():
    path = f"{prefix}/{key}" if prefix else str(key)
    if isinstance(value, Mapping):
      yield from _paths(value, path)
    else:
      yield path


def _filter(tree: Mapping, keep: Callable[[str], bool], prefix: str = "") -> dict:
  out = {}
  for key, value in tree.items():
    path = f"{prefix}/{key}" if prefix else str(key)
    if isinstance(value, Mapping):
      sub = _filter(value, keep, path)
      if sub:
        out[key] = sub
    elif keep(path):
      out[key] = value
  return out


def _overlay(tree: Mapping, sub: Mapping) -> dict:
  out = dict(tree)
  for key, value in sub.items():
    out[key] = _overlay(tree[key], value) if isinstance(value, Mapping) else value
  return out


@dataclasses.dataclass(frozen=True)
class Trainable:
  """The trained parameters: those whose ``'/'``-joined path ``predicate`` accepts.

  Attributes:
    predicate: path -> trained; None: every parameter.
  """
  predicate: Callable[[str], bool] | None = None

  @classmethod
  def of(cls, params: Tree) -> "Trainable":
    """openpi's rule for ``params`` (arrays or ShapeDtypeStructs): everything unless
    the tree holds LoRA adapters (:func:`jaxvla.models.lora.trainable_predicate`)."""
    if not isinstance(params, Mapping):
      return cls()
    return cls(lora.trainable_predicate(list(_paths(params))))

  @classmethod
  def rl_heads(cls) -> "Trainable":
    """The RL heads under ``rl/`` alone (value, steering): what RL trains when the
    policy's ``rl_heads_only`` (a steered sampler; the base network is frozen)."""
    return cls(lambda path: path.startswith(RL_PREFIX))

  def select(self, tree: Tree) -> Tree:
    """The trained leaves of a params-like ``tree`` (idempotent: a selected tree stays)."""
    return tree if self.predicate is None else _filter(tree, self.predicate)

  def merge(self, params: Tree, sub: Tree) -> Tree:
    """``params`` with the trained leaves replaced by ``sub``'s (``select``'s inverse)."""
    return sub if self.predicate is None else _overlay(params, sub)

  def count(self, params: Tree) -> tuple[int, int]:
    """``(trained, total)`` parameter counts (elements) of ``params``."""
    size = lambda t: sum(math.prod(x.shape) for x in jax.tree.leaves(t))
    return size(self.select(params)), size(params)


def floating_dtype(name: str) -> jnp.dtype:
  """The floating dtype ``name`` names; a ValueError names anything else."""
  dtype = jnp.dtype(name)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name!r} is not a floating dtype")
  return dtype


def cast_floating(tree: Tree, dtype: str | None) -> Tree:
  """``tree`` with its floating leaves cast to ``dtype`` (None or '': unchanged): the
  rollout's lower-precision copy of the params and a streamed update's proximal
  snapshot (``config.pipeline.rollout_dtype``)."""
  if not dtype:
    return tree
  dt = floating_dtype(dtype)
  return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


def train_only(tx: optax.GradientTransformation,
               trainable: Trainable) -> optax.GradientTransformation:
  """``tx`` over ``trainable.select(params)`` alone; ``tx`` itself when everything trains.

  ``init`` takes the full params (what :func:`jaxvla.learner.learner.init_state`
  passes); ``update`` takes the trained subtree's gradients and params (the full
  trees are accepted too: ``select`` is idempotent) and returns the subtree's
  updates.
  """
  if trainable.predicate is None:
    return tx

  def init(params):
    return tx.init(trainable.select(params))

  def update(updates, state, params=None):
    return tx.update(trainable.select(updates), state,
                     None if params is None else trainable.select(params))

  return optax.GradientTransformation(init, update)


ALL = Trainable()  # every parameter trains (no adapters)
