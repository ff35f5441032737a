"""The learner's device mesh and the map from logical axis names to mesh shardings.

Model code names *logical* axes only (``embed``, ``mlp``, ``heads``, ``batch``, ...:
see :mod:`jaxvla.models.layers`); ``config.mesh.rules`` maps each logical name to
mesh axes of the 3-D mesh ``('data', 'fsdp', 'tensor')``. This module owns that
translation, for any policy with ``logical_axes()``:

* :func:`make_mesh`: the mesh from ``config.mesh`` (``-1`` = the remaining devices).
* :func:`logical_to_spec`: logical axes of one array -> ``PartitionSpec``.
* :func:`param_shardings`: the ``NamedSharding`` tree of a parameter tree.
* :func:`mirror_shardings`: shardings of a tree holding parameter-like subtrees
  (train state, optimizer moments) -> the params' shardings there, replicated elsewhere.
* :func:`batch_sharding`, :func:`replicated`, :func:`with_logical_constraint`.
* :func:`split_devices`, :func:`role_devices`: learner and rollout devices from
  ``config.mesh.rollout_devices`` (one host; every process of a multi-host run).

Resolution of one array's logical axes (``logical_to_spec``), dimension by dimension:

1. ``None`` stays unsharded; a name missing from the rules is an error.
2. A mesh axis already used by an earlier dimension of the same array is dropped
   (a mesh axis can shard one dimension only): an ``[embed, embed]`` kernel is
   sharded on its first dimension only.
3. With a shape and a mesh: a dimension whose size is not divisible by the product
   of its mesh axes' sizes is left unsharded (replicated along those axes), and the
   axes stay free for later dimensions. :func:`param_specs` lists such cases and
   :func:`param_shardings` logs their count, so a poor rule set is visible.

Activations: :func:`with_logical_constraint` is the hook for model code; e.g. in
``jaxvla.models.pi0`` the prefix tokens ``x [B, P, D0]`` of ``encode_prefix`` and
the suffix ``tokens [B, T_s, E]`` of ``_suffix_pass`` would take
``("batch", None, "embed")`` (which resolves to ``P(('data', 'fsdp'), None, None)``
with the default rules, ``embed``'s ``fsdp`` being taken by the batch). The learner
does not need it for correctness: XLA propagates the batch sharding of the inputs.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxvla.parallel import axes

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # The mesh axes of the leading batch dimension by default.

Rules = Sequence[tuple[str, Any]]
LogicalAxes = Sequence[str | None]

DEFAULT_RULES = axes.DEFAULT_RULES  # (owned by jaxvla.parallel.axes: no jax there)


# ---------------------------------------------------------------------- mesh --
def check_mesh_config(mesh_config: Mapping) -> dict[str, int]:
  """The ``config.mesh`` sizes and rules checked, before any device is known.

  Returns:
    ``{axis: size}`` for :data:`MESH_AXES` (``-1``: the remaining devices).

  Raises:
    ValueError naming the ``config.mesh.*`` key: a size that is not an int >= 1
    or -1, more than one -1, or malformed rules (:func:`parse_rules`).
  """
  sizes = {}
  for name in MESH_AXES:
    value = mesh_config[name]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"config.mesh.{name} must be an int (a size or -1), got {value!r}")
    if value != -1 and value < 1:
      raise ValueError(f"config.mesh.{name} must be >= 1 or -1, got {value}")
    sizes[name] = int(value)
  free = [name for name in MESH_AXES if sizes[name] == -1]
  if len(free) > 1:
    raise ValueError(f"at most one of config.mesh.{{data,fsdp,tensor}} may be -1, got "
                     f"{', '.join(f'config.mesh.{n}=-1' for n in free)}")
  if "rules" in mesh_config:
    parse_rules(mesh_config["rules"])
  return sizes


def resolve_mesh_shape(mesh_config: Mapping, num_devices: int) -> tuple[int, int, int]:
  """``(data, fsdp, tensor)`` sizes from ``config.mesh`` for ``num_devices`` devices.

  One size may be ``-1``: it takes the devices the others leave. Errors name the
  ``config.mesh.*`` keys.
  """
  sizes = check_mesh_config(mesh_config)
  free = [name for name in MESH_AXES if sizes[name] == -1]
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if free:
    if num_devices % fixed:
      others = " * ".join(f"config.mesh.{n}={sizes[n]}" for n in MESH_AXES if n != free[0])
      raise ValueError(f"config.mesh.{free[0]}=-1: {others} = {fixed} does not divide the "
                       f"{num_devices} devices")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(
        "config.mesh.data * config.mesh.fsdp * config.mesh.tensor = "
        f"{sizes['data']} * {sizes['fsdp']} * {sizes['tensor']} = {fixed} does not match the "
        f"{num_devices} devices (set one of them to -1 to take the remaining devices)")
  return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(mesh_config: Mapping, devices: Sequence[jax.Device] | None = None
              ) -> jax.sharding.Mesh:
  """The ``('data', 'fsdp', 'tensor')`` mesh (Auto axis types) over ``devices``.

  Args:
    mesh_config: the ``mesh`` sub-config (``data``, ``fsdp``, ``tensor``; one may be -1).
    devices: the devices to lay out (default: ``jax.devices()``).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_config, len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices)


def single_device_mesh(device: jax.Device | None = None) -> jax.sharding.Mesh:
  """A ``1 x 1 x 1`` mesh on ``device`` (default: the first device), for unsharded runs."""
  return make_mesh(dict(data=1, fsdp=1, tensor=1),
                   [jax.devices()[0] if device is None else device])


def num_batch_shards(mesh: jax.sharding.Mesh, rules: Rules | None = None) -> int:
  """How many ways the batch dimension is split (``data * fsdp`` with the default rules)."""
  axes = _batch_mesh_axes(rules)
  return math.prod(mesh.shape[a] for a in axes)


# --------------------------------------------------------------------- rules --
def parse_rules(rules: Rules) -> dict[str, tuple[str, ...]]:
  """``config.mesh.rules`` -> ``{logical: (mesh axes...)}`` (``()`` for unsharded).

  Raises:
    ValueError naming ``config.mesh.rules[i]`` for a malformed entry, an unknown
    mesh axis, a mesh axis named twice in one rule, or a repeated logical name.
  """
  if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
    raise ValueError(f"config.mesh.rules must be a sequence of (logical axis, mesh axes) "
                     f"pairs, got {rules!r}")
  out: dict[str, tuple[str, ...]] = {}
  for i, rule in enumerate(rules):
    key = f"config.mesh.rules[{i}]"
    if isinstance(rule, (str, bytes)) or not isinstance(rule, Sequence) or len(rule) != 2:
      raise ValueError(f"{key} must be a (logical axis, mesh axes or None) pair, got {rule!r}")
    logical, target = rule
    if not isinstance(logical, str) or not logical:
      raise ValueError(f"{key}: the logical axis must be a non-empty string, got {logical!r}")
    if logical in out:
      raise ValueError(f"{key}: logical axis {logical!r} already has a rule")
    if target is None:
      axes: tuple = ()
    elif isinstance(target, str):
      axes = (target,)
    elif isinstance(target, Sequence) and all(isinstance(a, str) for a in target):
      axes = tuple(target)
    else:
      raise ValueError(f"{key}: mesh axes of {logical!r} must be None, a mesh axis name or a "
                       f"tuple of them, got {target!r}")
    for a in axes:
      if a not in MESH_AXES:
        raise ValueError(f"{key}: {logical!r} -> unknown mesh axis {a!r}; the mesh axes are "
                         f"{MESH_AXES}")
    if len(set(axes)) != len(axes):
      raise ValueError(f"{key}: {logical!r} names a mesh axis twice: {axes}")
    out[logical] = axes
  return out


def _batch_mesh_axes(rules: Rules | None) -> tuple[str, ...]:
  if rules is None:
    return BATCH_AXES
  return parse_rules(rules).get("batch", BATCH_AXES)


def _resolve(axes: LogicalAxes, rules: Rules | Mapping, shape: Sequence[int] | None,
             mesh_shape: Mapping[str, int] | None) -> tuple[PartitionSpec, list[int]]:
  """The spec and the dims left unsharded for indivisibility (see the module docstring)."""
  table = rules if isinstance(rules, Mapping) else parse_rules(rules)
  if shape is not None and len(shape) != len(axes):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  used: set[str] = set()
  spec, indivisible = [], []
  for dim, name in enumerate(axes):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis {name!r} has no rule in config.mesh.rules (known: "
                       f"{sorted(table)})")
    mesh_axes = tuple(a for a in table[name] if a not in used)
    if mesh_shape is not None:
      for a in mesh_axes:
        if a not in mesh_shape:
          raise ValueError(f"config.mesh.rules: {name!r} -> mesh axis {a!r}, which the mesh "
                           f"{dict(mesh_shape)} does not have")
      if shape is not None and mesh_axes:
        if shape[dim] % math.prod(mesh_shape[a] for a in mesh_axes):
          indivisible.append(dim)
          spec.append(None)
          continue
    used.update(mesh_axes)
    spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return PartitionSpec(*spec), indivisible


def logical_to_spec(axes: LogicalAxes, rules: Rules | Mapping,
                    shape: Sequence[int] | None = None,
                    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None
                    ) -> PartitionSpec:
  """``PartitionSpec`` of an array whose dims carry logical ``axes``.

  Args:
    axes: one logical name (or None) per dimension.
    rules: ``config.mesh.rules`` (or its :func:`parse_rules` dict).
    shape, mesh: with both, a dim not divisible by its mesh axes' total size is
      left unsharded (see the module docstring).
  """
  mesh_shape = None if mesh is None else dict(mesh.shape)
  return _resolve(axes, rules, shape, mesh_shape)[0]


# -------------------------------------------------------------------- params --
def _is_axes_leaf(x) -> bool:
  return x is None or (isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))


def param_specs(axes_tree: Any, abstract_params: Any, mesh: jax.sharding.Mesh,
                rules: Rules) -> tuple[Any, list[str]]:
  """``PartitionSpec`` tree of the params and the ``path[dim]`` left unsharded as indivisible.

  Args:
    axes_tree: ``policy.logical_axes()`` (same structure as the params; tuple leaves).
    abstract_params: arrays or ``ShapeDtypeStruct``s (``policy.abstract_params()``).
  """
  table = parse_rules(rules)
  paths_axes, axes_def = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=_is_axes_leaf)
  leaves, params_def = jax.tree.flatten(abstract_params)
  if len(leaves) != len(paths_axes):
    raise ValueError(f"logical axes tree ({len(paths_axes)} leaves) does not match the params "
                     f"({len(leaves)} leaves): {axes_def} vs {params_def}")
  specs, skipped = [], []
  for (path, axes), leaf in zip(paths_axes, leaves):
    name = jax.tree_util.keystr(path)
    if axes is None:  # A parameter created without axes metadata: replicated.
      axes = (None,) * len(leaf.shape)
    try:
      spec, bad = _resolve(axes, table, leaf.shape, mesh.shape)
    except ValueError as e:
      raise ValueError(f"parameter {name}: {e}") from None
    specs.append(spec)
    skipped += [f"{name}[{d}]" for d in bad]
  return jax.tree.unflatten(params_def, specs), skipped


def param_shardings(axes_tree: Any, abstract_params: Any, mesh: jax.sharding.Mesh,
                    rules: Rules) -> Any:
  """``NamedSharding`` tree of the params (same structure as ``abstract_params``)."""
  specs, skipped = param_specs(axes_tree, abstract_params, mesh, rules)
  if skipped:
    log.info("%d parameter dims left unsharded (size not divisible by their mesh axes): %s",
             len(skipped), ", ".join(skipped[:8]) + (" ..." if len(skipped) > 8 else ""))
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def mirror_shardings(tree: Any, abstract_params: Any, shardings: Any,
                     default: jax.sharding.Sharding, *alternatives: tuple[Any, Any]) -> Any:
  """Shardings for ``tree``: its parameter-like subtrees get the params' ``shardings``.

  A subtree with the params' tree structure (the params themselves, Adam's ``mu``
  and ``nu``, ...) takes the params' sharding leaf by leaf where the leaf's shape
  equals the parameter's (a factored statistic with another shape takes
  ``default``); every other leaf (step counts, PRNG keys, ...) takes ``default``.
  ``alternatives``: more ``(abstract_params, shardings)`` pairs (other subtrees of the
  params, e.g. the RL phase's trained part), matched by structure the same way.
  """
  pairs = [(abstract_params, shardings), *alternatives]
  by_structure = {
      jax.tree.structure(a): (jax.tree.leaves(a), jax.tree.leaves(
          s, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))
      for a, s in pairs}

  def is_params_like(x) -> bool:
    return jax.tree.structure(x) in by_structure

  def assign(x):
    if not is_params_like(x):
      return default
    treedef = jax.tree.structure(x)
    param_leaves, sharding_leaves = by_structure[treedef]
    return jax.tree.unflatten(treedef, [
        s if tuple(l.shape) == tuple(p.shape) else default
        for l, p, s in zip(jax.tree.leaves(x), param_leaves, sharding_leaves)])

  return jax.tree.map(assign, tree, is_leaf=is_params_like)


def with_shardings(abstract_tree: Any, shardings: Any) -> Any:
  """``ShapeDtypeStruct``s of ``abstract_tree`` carrying ``shardings`` (a restore target)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, shardings)


# ---------------------------------------------------------------------- data --
def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Every device holds the whole array."""
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: jax.sharding.Mesh, rules: Rules | None = None,
                   batch_dim: int = 0) -> NamedSharding:
  """Data: dimension ``batch_dim`` split over the batch mesh axes (``('data', 'fsdp')``).

  With ``rules``, the ``batch`` rule's mesh axes are used. The spec names leading
  dims only, so one sharding serves arrays of any rank ``> batch_dim``.
  """
  axes = _batch_mesh_axes(rules)
  return NamedSharding(mesh, PartitionSpec(*([None] * batch_dim), axes or None))


def gather(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """All-gathers a (FSDP-)sharded tree to a replicated layout *on its own mesh*.

  Copying a sharded tree straight to other devices or a single device can block
  the host; gather here first, then ``jax.device_put`` the replicated arrays.
  """
  return _gather_fn(mesh)(tree)


@functools.lru_cache(maxsize=8)
def _gather_fn(mesh: jax.sharding.Mesh):
  # One jitted identity per mesh (a fresh lambda per call would retrace every time).
  return jax.jit(lambda t: t, out_shardings=replicated(mesh))


def with_logical_constraint(x: jax.Array, axes: LogicalAxes, rules: Rules | Mapping,
                            mesh: jax.sharding.Mesh | None = None) -> jax.Array:
  """``jax.lax.with_sharding_constraint`` of activation ``x`` by logical ``axes``.

  ``axes`` may name the leading dims only; the remaining dims are left unsharded.
  Uses ``mesh``, else the mesh set by ``jax.set_mesh``; with neither (an unsharded
  run) ``x`` is returned unchanged, so model code may call it unconditionally.
  """
  if mesh is None:
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
      return x
    mesh_shape = dict(abstract.shape)
  else:
    mesh_shape = dict(mesh.shape)
  axes = tuple(axes) + (None,) * (x.ndim - len(axes))
  spec, _ = _resolve(axes, rules, x.shape, mesh_shape)
  target = spec if mesh is None else NamedSharding(mesh, spec)
  return jax.lax.with_sharding_constraint(x, target)


# ------------------------------------------------------------------- roles --
def split_devices(rollout_devices: str, devices: Sequence[jax.Device]
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
  """``(learner devices, rollout devices)`` from ``config.mesh.rollout_devices``.

  ``''``: both roles use every device (colocated; on one device they coincide).
  ``'N'``: the last ``N`` devices roll out, the rest learn. ``'0.25'``: that
  fraction of the devices (at least one) rolls out. ``'4,5,6,7'``: those device
  ids. Errors name the key and what is wrong.
  """
  devices = list(devices)
  spec = rollout_devices.strip()
  if not spec:
    return devices, devices
  key = f"config.mesh.rollout_devices={rollout_devices!r}"
  if "," in spec:
    try:
      ids = [int(x) for x in spec.split(",")]
    except ValueError:
      raise ValueError(f"{key}: device ids must be integers") from None
    by_id = {d.id: d for d in devices}
    missing = [i for i in ids if i not in by_id]
    if missing or len(set(ids)) != len(ids):
      raise ValueError(f"{key}: unknown or repeated device ids {missing or ids}; this host has "
                       f"{sorted(by_id)}")
    rollout = [by_id[i] for i in ids]
  else:
    try:
      value = float(spec)
    except ValueError:
      raise ValueError(f"{key}: expected '', a count, a fraction or device ids") from None
    count = int(value) if value >= 1 else max(1, round(value * len(devices)))
    if value <= 0 or (value >= 1 and value != int(value)):
      raise ValueError(f"{key}: a count must be a whole number >= 1, a fraction in (0, 1)")
    rollout = devices[len(devices) - count:] if count < len(devices) else []
    if not rollout:
      raise ValueError(f"{key}: {count} rollout devices leave none of the {len(devices)} "
                       "devices to the learner")
  learner = [d for d in devices if d not in rollout]
  if not learner:
    raise ValueError(f"{key}: leaves no device to the learner")
  return learner, rollout


def role_devices(rollout_devices: str) -> tuple[list[jax.Device], list[jax.Device]]:
  """``(learner devices of every process, this process's rollout devices)``.

  Every process splits its own local devices by ``config.mesh.rollout_devices``
  (:func:`split_devices`); the learner is one SPMD program over the union of the
  learner parts, in process order, and each process rolls out on its own part.
  With one process this is ``split_devices`` of the local devices.
  """
  local_learner, local_rollout = split_devices(rollout_devices, jax.local_devices())
  if jax.process_count() == 1:
    return local_learner, local_rollout
  if "," in rollout_devices:
    raise ValueError(f"config.mesh.rollout_devices={rollout_devices!r}: device ids differ "
                     "from host to host in a multi-process run; give a count or a fraction "
                     "so that every process splits its devices alike")
  learner = []
  for p in range(jax.process_count()):
    devices = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
    learner += split_devices(rollout_devices, devices)[0]
  return learner, local_rollout


def rollout_sharding(devices: Sequence[jax.Device]) -> NamedSharding:
  """Params replicated on every rollout device (a 1-D ``('data',)`` mesh)."""
  mesh = jax.sharding.Mesh(np.asarray(list(devices)), ("data",),
                           axis_types=(jax.sharding.AxisType.Auto,))
  return NamedSharding(mesh, PartitionSpec())
