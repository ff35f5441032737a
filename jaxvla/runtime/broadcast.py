"""Versioned weight broadcast from the learner mesh to the rollout devices.

:meth:`ParamServer.publish` is called by the learner after each update with the
new params and version ``v + 1``. It only *dispatches* the copy (gather on the
learner mesh where the params are FSDP-sharded, then an asynchronous
``device_put`` onto the rollout shardings that never aliases the learner's
buffers, which the next update donates) and returns; a broadcaster thread waits
for the copy to land and only then makes the version current. The rollout takes
``latest()`` between inference batches, so it never waits for a copy in flight
and never switches versions inside an action chunk.

In a multi-process run ``publish`` is a collective (the gather spans every
host's learner devices): every process's learner calls it after every update,
and each process's rollout receives a copy on its own rollout devices.

Publishing faster than copies land keeps only the newest pending version (an
older one still in flight is superseded, counted in ``skipped_versions``). A replay
(``keep_versions``) instead lands every version and keeps those the rollout may still
ask for by number (:meth:`ParamServer.at`): the ones its schedule log says it acted with.

``cast`` (``config.pipeline.rollout_dtype``) makes the rollout's copy a
lower-precision one: floating leaves are cast on the learner devices (a jitted
cast, dispatched like the copy) before the transfer, which halves the bytes moved
and the rollout's memory for bfloat16. The behaviour log-probs are then those of
the rounded weights, not exactly the learner's; pair it with an off-policy
correction (``rl.correction``), as rollout engines in bf16 are used in practice.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Any, Callable

import jax

from jaxvla import timing
from jaxvla.learner import trainable as trainable_lib
from jaxvla.parallel import distributed
from jaxvla.parallel import sharding as sharding_lib


class ParamServer:
  """Holds the rollout's copy of the params and its version.

  Args:
    rollout_shardings: target sharding tree (like the params) on the rollout
      devices, or one sharding for every leaf.
    learner_mesh: the learner's mesh; with FSDP-sharded params and a different
      rollout mesh, params are gathered on it first (a direct cross-mesh copy of
      sharded arrays blocks the host).
    on_ready: called with ``(version, start, end)`` when a copy has landed
      (``time.perf_counter`` times; the pipeline records them as the broadcast stage).
    gather: gather on the learner mesh before copying (True when the meshes
      differ and the params are sharded).
    cast: dtype name of the rollout's floating leaves ('' or None: the
      learner's dtypes, an exact copy).
    keep_versions: land every published version (none is skipped) and keep each
      until :meth:`at` asks for a newer one (a replay).
  """

  def __init__(self, rollout_shardings: Any, learner_mesh: jax.sharding.Mesh | None = None,
               on_ready: Callable[[int, float, float], None] | None = None,
               gather: bool = False, cast: str | None = None, keep_versions: bool = False):
    self.rollout_shardings = rollout_shardings
    self.learner_mesh = learner_mesh
    self.gather = gather and learner_mesh is not None
    self.on_ready = on_ready
    self._cast = None
    if cast:
      trainable_lib.floating_dtype(cast)  # (fails here, not at the first publish)
      self._cast = jax.jit(functools.partial(trainable_lib.cast_floating, dtype=cast))
    self._cond = threading.Condition()
    self._current: tuple[Any, int] | None = None
    self._pending: collections.deque[tuple[Any, int, float]] = collections.deque()
    self.keep_versions = keep_versions
    self._kept: dict[int, Any] = {}  # keep_versions: landed versions at() may still return.
    self._closed = False
    self.error: BaseException | None = None
    self.published = 0
    self.skipped_versions = 0
    self._thread = threading.Thread(target=self._run, name="broadcaster", daemon=True)
    self._thread.start()

  def _copy(self, params):
    if self.gather:
      params = sharding_lib.gather(params, self.learner_mesh)
    # Multi-process: the learner's arrays span every host; this process's rollout
    # takes the replica on one of its own devices (identity on one process).
    params = distributed.local_replica(params)
    if self._cast is not None:
      # Fresh buffers the learner never donates: the transfer may reuse them.
      return jax.device_put(self._cast(params), self.rollout_shardings)
    return jax.device_put(params, self.rollout_shardings, may_alias=False)

  def publish(self, params, version: int, wait: bool = False) -> None:
    """Dispatches the copy of ``params`` as ``version``; returns without waiting.

    ``wait=True`` (the synchronous baselines, and the first version) blocks until
    it is current.
    """
    self._raise_if_failed()
    t0 = time.perf_counter()
    with jax.profiler.TraceAnnotation(timing.TRACE_PREFIX + "broadcast_dispatch"):
      copied = self._copy(params)
    with self._cond:
      if not self.keep_versions:
        self.skipped_versions += len(self._pending)
        self._pending.clear()
      self._pending.append((copied, version, t0))
      self.published += 1
      self._cond.notify_all()
      if wait:
        self._cond.wait_for(lambda: self._closed or self.error is not None or (
            self._current is not None and self._current[1] >= version))
    self._raise_if_failed()

  def _run(self) -> None:
    try:
      while True:
        with self._cond:
          self._cond.wait_for(lambda: self._closed or self._pending)
          if not self._pending:
            return
          copied, version, t0 = self._pending.popleft()
        with jax.profiler.TraceAnnotation(timing.TRACE_PREFIX + "broadcast_wait"):
          jax.block_until_ready(copied)
        t1 = time.perf_counter()
        with self._cond:
          self._current = (copied, version)
          if self.keep_versions:
            self._kept[version] = copied
          self._cond.notify_all()
        if self.on_ready is not None:
          self.on_ready(version, t0, t1)
    except BaseException as e:  # Surfaced to the learner and the rollout.
      with self._cond:
        self.error = e
        self._cond.notify_all()

  def _raise_if_failed(self) -> None:
    if self.error is not None:
      raise RuntimeError("weight broadcast failed") from self.error

  def latest(self) -> tuple[Any, int]:
    """The newest landed ``(params, version)``; blocks only before the first."""
    with self._cond:
      self._cond.wait_for(lambda: self._current is not None or self._closed
                          or self.error is not None)
      self._raise_if_failed()
      if self._current is None:
        raise RuntimeError("param server closed before any params were published")
      return self._current

  def at(self, version: int) -> tuple[Any, int]:
    """``(params, version)`` of exactly ``version`` once it has landed (``keep_versions``);
    older versions are released (the rollout's versions never go back).

    Raises:
      RuntimeError: without ``keep_versions``, when ``version`` was released or the
        server closed first.
    """
    if not self.keep_versions:
      raise RuntimeError("ParamServer.at() needs keep_versions=True")
    with self._cond:
      self._cond.wait_for(lambda: version in self._kept or self._closed
                          or self.error is not None
                          or (self._current is not None and self._current[1] > version
                              and version not in self._kept))
      self._raise_if_failed()
      if version not in self._kept:
        raise RuntimeError(f"params version {version} is not held (the rollout asked for it "
                           f"after a newer one, or the server closed)")
      for v in [v for v in self._kept if v < version]:
        del self._kept[v]
      return self._kept[version], version

  def version(self) -> int:
    with self._cond:
      return -1 if self._current is None else self._current[1]

  def close(self) -> None:
    """Stops the broadcaster and releases the rollout's copies (device memory)."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    self._thread.join()
    with self._cond:
      self._current = None
      self._pending.clear()
      self._kept.clear()
