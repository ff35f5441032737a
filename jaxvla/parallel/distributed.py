"""Multi-host runs: ``jax.distributed`` start-up and the host <-> global array moves.

One process per host (or per GPU group) runs the whole job (Sebulba-like, see
``train.py``): its own env pool, its own rollout devices, and its share of one
SPMD learner over every process's learner devices. This module owns what that
needs and nothing else:

* :func:`initialize`: ``jax.distributed.initialize`` from ``config.distributed``
  (an explicit coordinator, or JAX's cluster auto-detection on TPU pods, SLURM,
  Open MPI, ...). Must run before anything touches a JAX backend.
* :func:`to_global`: host-local NumPy data (this process's rows) -> global
  ``jax.Array``s on the learner mesh (``jax.make_array_from_process_local_data``).
* :func:`local_replica`: global arrays (gathered on the learner mesh) -> this
  process's copy on one of its devices (what its rollout and evaluation use).
* :func:`host_seed`: each process's env seed, so hosts play different episodes.
* :func:`sum_over_hosts`, :func:`broadcast_from_primary`: small host values
  (counters, flags, evaluation results) made equal on every process, so every
  process takes the same decisions (stop, evaluate, save) at the same update.

On a single process every function is the identity (or a plain local
computation), so single-host code paths do not change.

Failure model: there is no in-job recovery across hosts; a run that loses a process
ends and resumes from its last checkpoint. A process that dies makes the others' next
collective fail (gloo or NCCL: the connection to it is reset), and JAX's coordination
service aborts every survivor once the dead one has missed its heartbeats
(``config.distributed.heartbeat_timeout_s``), with a C++ trace, after waiting for it
in the shutdown barrier. :func:`lost_processes` recognises that failed collective
and names the lost process (from :func:`initialize`'s table of every process's host
and pid), so ``jaxvla.main`` can end at once in one line instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import zlib
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jaxvla.parallel import sharding

log = logging.getLogger(__name__)


def _parse_ids(text: str) -> list[int] | None:
  text = text.strip()
  if not text:
    return None
  try:
    return [int(x) for x in text.split(",")]
  except ValueError:
    raise ValueError(f"config.distributed.local_device_ids={text!r}: expected comma-separated "
                     "integers such as '0,1'") from None


def validate(d: ml_collections.ConfigDict) -> None:
  """Raises ``ValueError`` naming the ``config.distributed`` key that is wrong."""
  if d.cluster_auto and d.coordinator_address:
    raise ValueError("config.distributed: set either cluster_auto=True (JAX detects the "
                     "cluster) or coordinator_address, not both")
  if d.coordinator_address:
    host, _, port = d.coordinator_address.rpartition(":")
    if not host or not port.isdigit():
      raise ValueError(f"config.distributed.coordinator_address={d.coordinator_address!r}: "
                       "expected 'host:port' of process 0")
    if d.num_processes < 1:
      raise ValueError(f"config.distributed.num_processes must be >= 1, got {d.num_processes}")
    if not 0 <= d.process_id < d.num_processes:
      raise ValueError(f"config.distributed.process_id={d.process_id} is not in "
                       f"[0, num_processes={d.num_processes})")
  elif not d.cluster_auto and d.num_processes != 1:
    raise ValueError(f"config.distributed.num_processes={d.num_processes} needs "
                     "config.distributed.coordinator_address (or cluster_auto=True)")
  for key in ("initialization_timeout_s", "heartbeat_timeout_s"):
    if d[key] < 1:
      raise ValueError(f"config.distributed.{key} must be >= 1, got {d[key]}")
  _parse_ids(d.local_device_ids)


def initialize(d: ml_collections.ConfigDict) -> None:
  """Starts ``jax.distributed`` as ``config.distributed`` says (no-op for one process).

  Call before any JAX computation. Idempotent.
  """
  validate(d)
  if not d.cluster_auto and not d.coordinator_address:
    return
  if jax.distributed.is_initialized():
    return
  kwargs = dict(local_device_ids=_parse_ids(d.local_device_ids),
                initialization_timeout=d.initialization_timeout_s,
                heartbeat_timeout_seconds=d.heartbeat_timeout_s)
  if d.coordinator_address:
    kwargs.update(coordinator_address=d.coordinator_address, num_processes=d.num_processes,
                  process_id=d.process_id)
  jax.distributed.initialize(**kwargs)
  _register_processes()
  log.info("jax.distributed: process %d of %d, %d local / %d global devices",
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count())


def is_primary() -> bool:
  """Process 0: the one that writes metrics, the summary files and the progress bar."""
  return jax.process_index() == 0


def multi_process() -> bool:
  return jax.process_count() > 1


# Per-process offset of env seeds (process 0 keeps the single-process seeds).
_HOST_SEED_STRIDE = 1_000_003


def host_seed(seed: int) -> int:
  """This process's env seed for the run seed ``seed``: each host plays other episodes."""
  return seed + _HOST_SEED_STRIDE * jax.process_index()


# ----------------------------------------------------------------- arrays --
def to_global(tree: Any, shardings: Any) -> Any:
  """This process's rows of a batch -> global arrays with ``shardings``.

  Args:
    tree: NumPy (or host) arrays; along each sharded dimension this process
      holds ``1 / process_count`` of the global batch (its own rows, in order).
    shardings: one ``NamedSharding`` for every leaf, or a tree of them that is a
      prefix of ``tree`` (each sharding serves the whole subtree under it).

  Single process: ``tree`` unchanged (``jit`` places it by its in-shardings).
  """
  if not multi_process():
    return tree

  def under(sharding, subtree):
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), subtree)
  return jax.tree.map(under, shardings, tree,
                      is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


def _on(x: jax.Array, sharding: jax.sharding.Sharding) -> bool:
  """Whether ``x`` is laid out as ``sharding`` and typed with its mesh (if it has one)."""
  if not x.sharding.is_equivalent_to(sharding, x.ndim):
    return False
  if isinstance(sharding, jax.sharding.NamedSharding):
    return isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == sharding.mesh
  return True


def device_put(tree: Any, shardings: Any) -> Any:
  """``jax.device_put`` that also places *host-local* values on multi-process shardings.

  Every process must pass the same value for a leaf that is not already a global
  array (a fresh optimizer step count, a PRNG key, NumPy params): it is read
  through the host (``jax.make_array_from_callback``), since handing a committed
  single-device array to a sharding that spans processes does not build a
  valid global array. Global arrays are resharded by ``jax.device_put``.

  A tree whose every leaf is already an array on its sharding is returned as it is:
  ``jax.device_put`` costs about 0.1 ms per leaf even when it moves nothing (18 ms for
  the tiny pi0's BC state, a quarter of its BC step on the CPU), and the learner places
  its state before every step. "On its sharding" includes the mesh: a jit's cache key
  holds each argument's mesh, so a fresh scalar on one device (no mesh), though
  equivalent to the replicated sharding of a one-device mesh, would compile every
  step twice, once for it and once for the on-mesh state the step returns.
  """
  leaves = jax.tree.leaves(tree)
  targets = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
  if len(leaves) == len(targets) and all(
      isinstance(x, jax.Array) and _on(x, s) for x, s in zip(leaves, targets)):
    return tree
  if not multi_process():
    return jax.device_put(tree, shardings)

  def place(x, sharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(place, tree, shardings)


def local_replica(tree: Any, mesh: jax.sharding.Mesh | None = None) -> Any:
  """Global arrays -> their values as single-device arrays on one of this process's devices.

  Args:
    tree: global arrays; replicated ones, unless ``mesh`` is given.
    mesh: gather ``tree`` on this (the learner's) mesh to a replicated layout
      first (a collective: every process calls it).

  Single process: ``tree`` unchanged (nothing gathered).

  Raises:
    ValueError: a leaf is not fully replicated (and no ``mesh`` to gather on).
  """
  if not multi_process():
    return tree
  if mesh is not None:
    tree = sharding.gather(tree, mesh)

  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    if not x.sharding.is_fully_replicated:
      raise ValueError(f"local_replica: an array of shape {x.shape} is sharded as "
                       f"{x.sharding}; gather it to a replicated layout first")
    return x.addressable_shards[0].data
  return jax.tree.map(one, tree)


# ------------------------------------------------------------ host values --
def sum_over_hosts(values) -> np.ndarray:
  """Element-wise sum of a small NumPy vector over every process (a collective)."""
  values = np.asarray(values)
  if not multi_process():
    return values
  return np.asarray(multihost_utils.process_allgather(values)).sum(axis=0)


def broadcast_from_primary(values: dict[str, float]) -> dict[str, float]:
  """Process 0's ``values`` on every process (same keys everywhere; a collective)."""
  if not multi_process():
    return values
  keys = sorted(values)
  arr = np.asarray([float(values[k]) for k in keys], np.float64)
  arr = np.asarray(multihost_utils.broadcast_one_to_all(arr))
  return dict(zip(keys, (float(v) for v in arr)))


def check_same_on_hosts(value: str, what: str) -> None:
  """Raises on every process if ``value`` differs between processes (a collective).

  Args:
    value: e.g. the workdir or the config as JSON.
    what: how the error names it (e.g. ``'--workdir'``).
  """
  if not multi_process():
    return
  digest = zlib.crc32(value.encode()) & 0x7FFFFFFF
  digests = np.asarray(multihost_utils.process_allgather(np.asarray(digest, np.int32)))
  differ = [p for p, d in enumerate(digests.reshape(-1)) if d != digests.reshape(-1)[0]]
  if differ:
    raise ValueError(f"{what} differs between processes: processes {differ} do not have "
                     f"process 0's (this is process {jax.process_index()}: {value[:200]!r}); "
                     "every process must run the same config and workdir")


def barrier(name: str) -> None:
  """Every process waits here until all have arrived."""
  if multi_process():
    multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------ lost processes --
@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  """Where one process of the job runs (exchanged by :func:`initialize`)."""
  host: str
  ip: str
  pid: int


_PROCESSES: dict[int, ProcessInfo] = {}
_HOST_BYTES = 64
# What a collective raises when a peer process is gone: gloo (CPU) and NCCL (GPU) see the
# connection to it reset or closed; the coordination service names a missed heartbeat.
_PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|"
                        r"Connection refused|Socket closed|NCCL error|unhandled system error|"
                        r"heartbeat timeout|stopped sending heartbeats|"
                        r"coordination service (?:has stopped|detected)", re.IGNORECASE)
_IP = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?:\d+")


def _register_processes() -> None:
  """Every process's host, IP address and pid, on every process (a collective)."""
  host = socket.gethostname()
  try:
    ip = socket.gethostbyname(host)
  except OSError:
    ip = ""
  raw = np.zeros(_HOST_BYTES * 2 + 1, np.int32)
  for k, text in enumerate((host, ip)):
    b = text.encode()[:_HOST_BYTES]
    raw[k * _HOST_BYTES:k * _HOST_BYTES + len(b)] = np.frombuffer(b, np.uint8)
  raw[-1] = os.getpid()
  table = np.asarray(multihost_utils.process_allgather(raw)).reshape(-1, raw.size)
  text = lambda row: bytes(row[row > 0].astype(np.uint8)).decode(errors="replace")
  _PROCESSES.clear()
  for i, row in enumerate(table):
    _PROCESSES[i] = ProcessInfo(host=text(row[:_HOST_BYTES]),
                                ip=text(row[_HOST_BYTES:2 * _HOST_BYTES]), pid=int(row[-1]))


def _messages(error: BaseException) -> str:
  """``error``'s message and those of its causes and contexts."""
  seen, parts = set(), []
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    parts.append(str(error))
    error = error.__cause__ or error.__context__
  return "\n".join(parts)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)  # (signal 0: only checks; PermissionError means it exists)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def lost_processes(error: BaseException) -> list[int] | None:
  """The processes whose loss made ``error`` (a failed collective), or None if it is not
  that (or this is a one-process run).

  A process on this host counts as lost when its pid is gone; one on another host when
  the error names its address. When neither narrows it down, every other process is a
  candidate.
  """
  text = _messages(error)
  if not multi_process() or not _PEER_LOST.search(text):
    return None
  me = jax.process_index()
  others = [i for i in range(jax.process_count()) if i != me]
  if not _PROCESSES:
    return others
  here = _PROCESSES[me].host
  dead = [i for i in others
          if _PROCESSES[i].host == here and not _pid_alive(_PROCESSES[i].pid)]
  if dead:
    return dead
  addresses = set(_IP.findall(text)) - {"127.0.0.1"}
  named = [i for i in others if _PROCESSES[i].host != here and _PROCESSES[i].ip in addresses]
  return named or others


def describe_processes(ids: list[int]) -> str:
  """``'process 1 (host h, pid 123)'``, or ``'one of processes 1, 2 (...)'``."""
  def one(i):
    info = _PROCESSES.get(i)
    return f"{i} (host {info.host}, pid {info.pid})" if info else str(i)
  if len(ids) == 1:
    return f"process {one(ids[0])}"
  return "one of processes " + ", ".join(one(i) for i in ids)
