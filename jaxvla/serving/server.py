"""The websocket server: openpi's ``WebsocketPolicyServer`` protocol in front of the batcher.

Protocol (openpi's ``src/openpi/serving/websocket_policy_server.py``, read by
``openpi_client.websocket_client_policy.WebsocketClientPolicy``):

* on connect the server sends its metadata (msgpack, :mod:`jaxvla.serving.wire`);
* then every binary message is one observation dict and is answered with
  ``{"actions": float32 [H, A] (env units), "policy_timing": {...},
  "server_timing": {...}}``;
* a request that fails is answered with a text frame: the error (a bad
  observation: one line naming the key and the expected shape; a failing policy
  call: its traceback). The client raises ``RuntimeError`` on it. Unlike openpi,
  which closes the connection after an error, the connection stays open and the
  server goes on serving;
* ``GET /healthz`` answers ``OK`` (openpi's health check).

Each connection is one coroutine; the requests of all connections meet in the
:class:`~jaxvla.serving.runner.Batcher`'s queue, so concurrent clients share
batched policy calls. A client that disconnects while its request is in a batch
only loses its reply.
"""

from __future__ import annotations

import asyncio
import http
import logging
import signal
import threading
import time
import traceback
from typing import Any, Callable

import ml_collections
import numpy as np
import websockets
from websockets.asyncio import server as ws_server

from jaxvla.serving import obs_map as obs_map_lib
from jaxvla.serving import runner as runner_lib
from jaxvla.serving import wire
from jaxvla.storage import policy_io

_log = logging.getLogger("jaxvla.serve")
# How often the serving loop looks at the batching thread (it stops the server if it died).
_WATCH_S = 0.5


def metadata(loaded: policy_io.LoadedPolicy, obs_map: obs_map_lib.ObsMap,
             config: ml_collections.ConfigDict) -> dict[str, Any]:
  """What a client is sent on connect: what to send, what comes back, how it is served."""
  return dict(
      server="jaxvla",
      obs_map=obs_map.name,
      observation={f.key: f.to_json() for f in obs_map.expected()},
      masked_cameras=obs_map.masked_cameras(),
      unused_keys=sorted(obs_map.ignored),  # accepted, fed to nothing (ALOHA's cam_low)
      example_observation=obs_map.example(),
      actions=dict(shape=[loaded.policy.chunk_len, loaded.spec.action_dim], dtype="float32",
                   units="env (un-normalised)"),
      policy=dict(kind=loaded.kind, model=loaded.config.model.name,
                  cameras=list(loaded.spec.camera_names),
                  image_shape=list(loaded.spec.image_shape), state_dim=loaded.spec.state_dim,
                  action_dim=loaded.spec.action_dim, normalized=loaded.normalizer is not None),
      sampler=config.sampler, noise=config.noise, seed=config.seed, max_batch=config.max_batch)


def _health_check(connection: ws_server.ServerConnection,
                  request: ws_server.Request) -> ws_server.Response | None:
  if request.path == "/healthz":
    return connection.respond(http.HTTPStatus.OK, "OK\n")
  return None  # (a websocket handshake: go on)


class PolicyServer:
  """Serves ``loaded`` with the settings ``config`` (``jaxvla/serving/config.py``).

  :meth:`serve_forever` runs in the calling thread until Ctrl-C; :meth:`start`
  runs the server in a thread (tests, the load test) until :meth:`close`.
  """

  def __init__(self, loaded: policy_io.LoadedPolicy, config: ml_collections.ConfigDict):
    self.config = config
    self.obs_map = obs_map_lib.ObsMap(config.obs_map, loaded.spec, config.default_prompt)
    self.runner = runner_lib.PolicyRunner(loaded, sampler=config.sampler, noise=config.noise,
                                          seed=config.seed, max_batch=config.max_batch)
    self.batcher = runner_lib.Batcher(self.runner, config.max_batch,
                                      config.batch_wait_ms / 1000)
    self.metadata = metadata(loaded, self.obs_map, config)
    self._packed_metadata = wire.packb(self.metadata)
    self.port: int | None = None
    self._stop: asyncio.Event | None = None
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self._thread_error: BaseException | None = None

  # ---------------------------------------------------------------- lifetime --
  def serve_forever(self, on_ready: Callable[[int], None] | None = None) -> None:
    """Serves in this thread until SIGINT (Ctrl-C) or SIGTERM, then returns; a second
    signal while stopping raises ``KeyboardInterrupt``. The batching thread's error,
    if it died of one, is re-raised."""
    try:
      asyncio.run(self._serve(on_ready))
    finally:
      start = time.monotonic()
      self.batcher.close()
      _log.info("batching thread stopped in %.1f s", time.monotonic() - start)

  def start(self, timeout_s: float = 600.0) -> int:
    """Serves in a thread; returns the port once it listens (compilation included)."""
    ready = threading.Event()

    def run():
      try:
        asyncio.run(self._serve(lambda _: ready.set()))
      except BaseException as e:  # Re-raised by start() / close() in the caller's thread.
        self._thread_error = e
        ready.set()

    self._thread = threading.Thread(target=run, name="jaxvla-serve", daemon=True)
    self._thread.start()
    if not ready.wait(timeout_s):
      raise RuntimeError(f"the server did not start listening within {timeout_s} s")
    if self._thread_error is not None:
      raise RuntimeError("the server failed to start") from self._thread_error
    return self.port

  def close(self, timeout_s: float = 30.0) -> None:
    """Stops a server started with :meth:`start`, then the batching thread."""
    if self._thread is not None and self._loop is not None and self._stop is not None:
      self._loop.call_soon_threadsafe(self._stop.set)
      self._thread.join(timeout_s)
      if self._thread.is_alive():
        raise RuntimeError(f"the server thread did not stop within {timeout_s} s")
    self.batcher.close()
    if self._thread_error is not None:
      raise RuntimeError("the server failed") from self._thread_error

  def _on_signal(self, signum: int) -> None:
    if self._stop.is_set():  # (a second Ctrl-C: stop waiting for a clean shutdown)
      raise KeyboardInterrupt
    _log.info("%s: stopping", signal.Signals(signum).name)
    self._stop.set()

  async def _serve(self, on_ready: Callable[[int], None] | None) -> None:
    self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
    # In the main thread (the command), SIGINT and SIGTERM set the stop event through the
    # loop's own signal handling, which wakes the loop at once; the server then closes its
    # connections and returns, rather than relying on the task's cancellation.
    signals = ((signal.SIGINT, signal.SIGTERM)
               if threading.current_thread() is threading.main_thread() else ())
    for signum in signals:
      self._loop.add_signal_handler(signum, self._on_signal, signum)
    try:
      await self._serve_until_stopped(on_ready)
    finally:
      for signum in signals:
        self._loop.remove_signal_handler(signum)

  async def _serve_until_stopped(self, on_ready: Callable[[int], None] | None) -> None:
    if self.config.warmup:
      start = time.monotonic()
      self.runner.warmup(self.obs_map.parse(self.obs_map.example()))
      _log.info("compiled batch sizes %s in %.1f s", list(self.runner.sizes),
                time.monotonic() - start)
    self.batcher.start()
    stopping = None  # When the loop below ended (the shutdown's log says what took how long).
    try:
      async with ws_server.serve(
          self._handler, self.config.host, self.config.port, compression=None,
          max_size=int(self.config.max_message_mb * 2**20),
          process_request=_health_check) as server:
        self.port = server.sockets[0].getsockname()[1]
        _log.info("serving on %s:%d (obs_map %r)", self.config.host, self.port,
                  self.obs_map.name)
        if on_ready is not None:
          on_ready(self.port)
        try:
          while not self._stop.is_set():
            self.batcher.check()  # A dead batching thread ends the server with its error.
            try:
              await asyncio.wait_for(self._stop.wait(), _WATCH_S)
            except asyncio.TimeoutError:
              pass
        finally:  # (also when cancelled)
          stopping = time.monotonic()
          _log.info("stopping: closing %d connection(s)", len(server.connections))
    finally:
      if stopping is not None:
        _log.info("connections closed in %.1f s", time.monotonic() - stopping)

  # ------------------------------------------------------------ connections --
  async def _handler(self, websocket: ws_server.ServerConnection) -> None:
    _log.info("connection from %s opened", websocket.remote_address)
    await websocket.send(self._packed_metadata)
    prev_total_ms = None
    while True:
      try:
        message = await websocket.recv()
        start = time.monotonic()
        reply = await self._answer(message, prev_total_ms)
        await websocket.send(reply)
        prev_total_ms = (time.monotonic() - start) * 1000
      except websockets.ConnectionClosed:
        _log.info("connection from %s closed", websocket.remote_address)
        return

  async def _answer(self, message: bytes | str, prev_total_ms: float | None) -> bytes | str:
    """One request message -> the reply frame (bytes: actions; str: the error)."""
    start = time.monotonic()
    try:
      if isinstance(message, str):
        raise obs_map_lib.ObservationError(
            "expected a binary msgpack message (openpi_client.msgpack_numpy), got text")
      row = self.runner.prepare(self.obs_map.parse(wire.unpackb(message)))
    except (obs_map_lib.ObservationError, wire.WireError) as e:
      return f"bad observation: {e}"
    except Exception:  # (e.g. a prompt longer than the policy's tokens): this request only
      return f"bad observation:\n{traceback.format_exc()}"
    reply = await asyncio.wrap_future(self.batcher.submit(row))
    if reply.error is not None:
      return reply.error
    server_timing = dict(infer_ms=(time.monotonic() - start) * 1000, queue_ms=reply.queue_ms)
    if prev_total_ms is not None:  # (openpi's: the previous request, its send included)
      server_timing["prev_total_ms"] = prev_total_ms
    return wire.packb(dict(
        actions=np.asarray(reply.actions, np.float32),
        policy_timing=dict(infer_ms=reply.infer_ms, batch_size=reply.batch_size,
                           padded_batch_size=reply.padded_batch_size),
        server_timing=server_timing))
