"""Served requests -> actions: one jitted call per batch of requests, on a batching thread.

:class:`PolicyRunner` owns the policy's side: normalising a request's state and
preparing its arrays (:meth:`PolicyRunner.prepare`, per request, so that a bad
prompt fails its own request only), then acting on a batch of prepared requests
padded to one of a few sizes (powers of two up to ``max_batch``: few compiles) and
un-normalising the actions, exactly as :mod:`jaxvla.envs.normalized` does around
an env. Every row is sampled as a batch of one with its own key (``vmap`` over
rows), so a request's actions do not depend on what else shares its batch; with
``noise='fixed'`` every key is ``PRNGKey(seed)`` and the actions are a function of
the observation alone (the deterministic ``ode`` eval sampler then gives exactly
``act(params, prepare(obs), PRNGKey(seed))``).

:class:`Batcher` owns the thread: it takes the first waiting request, collects up
to ``max_batch`` for at most ``batch_wait_s``, runs them in one call and answers
each request's future. A failing call answers every request in it with the
traceback and the thread goes on; an error of the thread itself fails every
waiting request and is re-raised by :meth:`Batcher.check` and :meth:`Batcher.close`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import traceback

import jax
import numpy as np

from jaxvla.envs import protocol
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.storage import policy_io

NOISE_MODES = ("fixed", "per_request")
_log = logging.getLogger("jaxvla.serve")


def batch_sizes(max_batch: int) -> tuple[int, ...]:
  """The padded batch sizes: powers of two below ``max_batch``, then ``max_batch``."""
  if max_batch < 1:
    raise ValueError(f"max_batch={max_batch}: must be at least 1")
  sizes = [1]
  while sizes[-1] * 2 < max_batch:
    sizes.append(sizes[-1] * 2)
  return tuple(sizes) + ((max_batch,) if max_batch > 1 else ())


class PolicyRunner:
  """The loaded policy acting on batches of prepared requests (see the module docstring).

  Args:
    loaded: the policy (:func:`jaxvla.storage.policy_io.load`).
    sampler: ``act``'s mode: 'eval', 'train' or a sampler name.
    noise: one of :data:`NOISE_MODES`.
    seed: seed of the noise keys.
    max_batch: the largest batch of one call.
  """

  def __init__(self, loaded: policy_io.LoadedPolicy, *, sampler: str, noise: str, seed: int,
               max_batch: int):
    if noise not in NOISE_MODES:
      raise ValueError(f"noise={noise!r}: choose one of {list(NOISE_MODES)}")
    self.loaded, self.noise = loaded, noise
    self.sizes = batch_sizes(max_batch)
    self.horizon, self.action_dim = loaded.policy.chunk_len, loaded.spec.action_dim
    # One key per row (the policy vmapped over rows): fixed noise folds in nothing, so
    # every key is PRNGKey(seed); per-request noise folds in the request's counter.
    self._act = evaluate_lib.row_keyed_act(loaded.policy, sampler)
    self._key = jax.random.PRNGKey(seed)
    self._requests = 0  # Requests answered so far: the per_request noise counter.

  def prepare(self, obs: protocol.Observation) -> dict[str, np.ndarray]:
    """Observations in env units ``[n, ...]`` -> the policy's arrays ``[n, ...]``."""
    normalizer = self.loaded.normalizer
    if normalizer is not None:
      obs = dataclasses.replace(obs, state=normalizer.state(obs.state))
    return self.loaded.policy.prepare(obs)

  def act(self, rows: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, int]:
    """Prepared requests (each ``[1, ...]``) -> ``float32 [n, H, A]`` in env units, padded size.

    Called from one thread only (the per-request noise counter is not locked).
    """
    n = len(rows)
    size = next((s for s in self.sizes if s >= n), None)
    if size is None:
      raise ValueError(f"{n} requests in one call; max_batch is {self.sizes[-1]}")
    batch = {k: np.concatenate([r[k] for r in rows] + [rows[0][k]] * (size - n))
             for k in rows[0]}
    counters = np.arange(self._requests, self._requests + size, dtype=np.uint32)[:, None]
    self._requests += n
    ids = counters[:, :0] if self.noise == "fixed" else counters  # [size, 0 or 1]
    out = self._act(self.loaded.params, batch, self._key, ids)
    actions = np.asarray(jax.device_get(out.actions))[:n]
    if self.loaded.normalizer is not None:
      actions = self.loaded.normalizer.actions(actions)
    return actions.astype(np.float32), size

  def warmup(self, example: protocol.Observation) -> None:
    """Compiles every padded size on ``example`` (a batch of one)."""
    row = self.prepare(example)
    counter = self._requests
    for size in self.sizes:
      self.act([row] * size)
    self._requests = counter  # (warm-up calls draw no request's noise)


@dataclasses.dataclass
class Reply:
  """The answer to one request: its actions ``[H, A]``, or the error text, and timings."""
  actions: np.ndarray | None
  error: str | None
  queue_ms: float  # From submit to the start of its batch's call.
  infer_ms: float  # The batch's call (act + un-normalisation).
  batch_size: int  # Requests in that call.
  padded_batch_size: int  # The call's padded size.


@dataclasses.dataclass
class _Request:
  row: dict[str, np.ndarray]
  future: concurrent.futures.Future
  submitted: float


_STOP = object()


class Batcher:
  """The batching thread (see the module docstring).

  Attributes:
    batch_counts: ``Counter`` of requests per call (``{batch size: calls}``).
  """

  def __init__(self, runner: PolicyRunner, max_batch: int, batch_wait_s: float):
    self.runner, self.max_batch, self.wait_s = runner, max_batch, batch_wait_s
    self.batch_counts: collections.Counter = collections.Counter()
    self._queue: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._stopping = threading.Event()
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._loop, name="jaxvla-serve-batcher", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def submit(self, row: dict[str, np.ndarray]) -> concurrent.futures.Future:
    """Queues one prepared request; the future's result is its :class:`Reply`."""
    self.check()
    if self._stopping.is_set():
      raise RuntimeError("the server is stopping")
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put(_Request(row, future, time.monotonic()))
    return future

  def stats(self) -> dict[str, int]:
    """Calls, requests and the largest batch so far (a consistent snapshot)."""
    with self._lock:
      counts = dict(self.batch_counts)
    return dict(calls=sum(counts.values()), requests=sum(b * c for b, c in counts.items()),
                max_batch_size=max(counts, default=0))

  def check(self) -> None:
    """Raises the batching thread's error, if it died of one."""
    if self._error is not None:
      raise RuntimeError("the batching thread failed") from self._error

  def close(self, timeout_s: float = 30.0) -> None:
    """Stops the thread after the call in progress; waiting requests get an error."""
    self._stopping.set()
    self._queue.put(_STOP)
    if self._thread.is_alive():
      self._thread.join(timeout_s)
      if self._thread.is_alive():
        raise RuntimeError(f"the batching thread did not stop within {timeout_s} s")
    self._fail_waiting(RuntimeError("the server stopped before answering"))
    self.check()

  # ---------------------------------------------------------------- the thread --
  def _loop(self) -> None:
    try:
      while not self._stopping.is_set():
        requests = self._collect()
        if requests:
          self._run(requests)
    except BaseException as e:  # Reaches the server through check() / close().
      self._error = e
      _log.exception("the batching thread failed")
      self._fail_waiting(e)

  def _collect(self) -> list[_Request]:
    """The first waiting request and those that arrive within ``wait_s`` of it."""
    try:
      first = self._queue.get(timeout=0.2)  # (wakes up to see a stop)
    except queue.Empty:
      return []
    if first is _STOP:
      return []
    requests = [first]
    deadline = time.monotonic() + self.wait_s
    while len(requests) < self.max_batch:
      try:
        item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        break
      if item is _STOP:
        break
      requests.append(item)
    return requests

  def _run(self, requests: list[_Request]) -> None:
    start = time.monotonic()
    try:
      actions, padded = self.runner.act([r.row for r in requests])
      error = None
    except Exception:  # One failing call answers its requests; the server goes on.
      error, padded = traceback.format_exc(), 0
      _log.error("a batch of %d requests failed:\n%s", len(requests), error)
    infer_ms = (time.monotonic() - start) * 1000
    with self._lock:
      self.batch_counts[len(requests)] += 1
    for i, r in enumerate(requests):
      r.future.set_result(Reply(
          actions=None if error else actions[i], error=error,
          queue_ms=(start - r.submitted) * 1000, infer_ms=infer_ms,
          batch_size=len(requests), padded_batch_size=padded))

  def _fail_waiting(self, error: BaseException) -> None:
    while True:
      try:
        item = self._queue.get_nowait()
      except queue.Empty:
        return
      if item is not _STOP and not item.future.done():
        item.future.set_exception(error)
