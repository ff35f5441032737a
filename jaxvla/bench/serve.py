"""Policy-server load test: ``python -m jaxvla.bench.serve --policy=DIR --clients=N --requests=M``.

Starts the server in this process (:class:`jaxvla.serving.server.PolicyServer`,
settings from ``--serve`` and its shortcut flags, as ``python -m jaxvla.serve``)
or connects to a running one (``--connect=HOST:PORT``). Then ``--clients``
threads, each with its own websocket connection, send ``--requests`` requests
each, back to back, all starting together. A request is the server's
``example_observation`` with its images replaced by random uint8 images of
``--image_size`` pixels (openpi's clients send 224; the server resizes them).
Each client's first request is a warm-up and is not counted.

Prints requests/s (counted requests / wall time from the common start to the last
reply), per-request latency percentiles (send to reply, client side: p50, p90,
p99, max) and, for an in-process server, its policy calls and mean requests per
call over the repeat (the clients' warm-up requests included).
``--repeats`` runs the whole measurement several times on one server; the last
line is one JSON object with every repeat.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import websockets.sync.client

from jaxvla.serving import server as server_lib
from jaxvla.serving import wire
from jaxvla.storage import policy_io


class _Client:
  """A minimal synchronous client of the protocol (what openpi_client's does)."""

  def __init__(self, host: str, port: int):
    self._stack = contextlib.ExitStack()  # (websockets 15+ wants connect() as a context)
    self.ws = self._stack.enter_context(websockets.sync.client.connect(
        f"ws://{host}:{port}", compression=None, max_size=None))
    self.metadata = wire.unpackb(self.ws.recv())

  def infer(self, packed: bytes) -> dict:
    self.ws.send(packed)
    reply = self.ws.recv()
    if isinstance(reply, str):
      raise RuntimeError(f"Error in inference server:\n{reply}")
    return wire.unpackb(reply)

  def close(self) -> None:
    self._stack.close()


def request_like(example: Any, image_size: int, rng: np.random.Generator) -> Any:
  """``example`` with each uint8 image (``[H, W, 3]`` or ``[3, H, W]``) random at ``image_size``."""
  if isinstance(example, dict):
    return {k: request_like(v, image_size, rng) for k, v in example.items()}
  if isinstance(example, np.ndarray) and example.dtype == np.uint8 and example.ndim == 3:
    shape = ((3, image_size, image_size) if example.shape[0] == 3 and example.shape[-1] != 3
             else (image_size, image_size, 3))
    return rng.integers(0, 256, shape, np.uint8)
  return example


def measure(host: str, port: int, clients: int, requests: int,
            image_size: int) -> dict[str, float]:
  """One load test: ``clients`` threads x ``requests`` requests; figures in ms and 1/s."""
  conns = [_Client(host, port) for _ in range(clients)]
  example = conns[0].metadata["example_observation"]
  packed = [wire.packb(request_like(example, image_size, np.random.default_rng(i)))
            for i in range(clients)]
  latencies: list[list[float]] = [[] for _ in range(clients)]
  errors: list[BaseException] = []
  barrier = threading.Barrier(clients + 1)

  def run(i: int) -> None:
    try:
      conns[i].infer(packed[i])  # warm-up, not counted
      barrier.wait()
      for _ in range(requests):
        start = time.perf_counter()
        conns[i].infer(packed[i])
        latencies[i].append((time.perf_counter() - start) * 1000)
    except BaseException as e:  # Re-raised in the main thread below.
      errors.append(e)
      barrier.abort()

  threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
  for t in threads:
    t.start()
  barrier.wait()
  start = time.perf_counter()
  for t in threads:
    t.join()
  wall = time.perf_counter() - start
  for c in conns:
    c.close()
  if errors:
    raise RuntimeError("a client failed") from errors[0]
  flat = np.concatenate(latencies)
  return dict(requests=int(flat.size), wall_s=round(wall, 3),
              requests_per_s=round(flat.size / wall, 1),
              **{f"p{q}_ms": round(float(np.percentile(flat, q)), 2) for q in (50, 90, 99)},
              max_ms=round(float(flat.max()), 2))


def _spread(rows: list[dict], key: str) -> str:
  values = [r[key] for r in rows]
  if len(values) == 1:
    return f"{values[0]}"
  return f"{round(statistics.median(values), 2)} (min {min(values)}, max {max(values)})"


def main(argv: list[str]) -> None:
  """Parses the flags (see the module docstring) and prints the figures."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  from jaxvla import serve  # pylint: disable=import-outside-toplevel

  config_flag = config_flags.DEFINE_config_file(
      "config", None, "The policy's run config (openpi checkpoints).", lock_config=True)
  serve_flag = config_flags.DEFINE_config_file(
      "serve", serve.SERVE_CONFIG, "Server settings (jaxvla/serving/config.py[:obs_map]).",
      lock_config=True)
  policy = flags.DEFINE_string("policy", None, "The policy to serve in this process.")
  connect = flags.DEFINE_string("connect", None, "HOST:PORT of a running server instead.")
  obs_map = flags.DEFINE_string("obs_map", None, "Key map (default: --serve's).")
  max_batch = flags.DEFINE_integer("max_batch", None, "Most requests per policy call.")
  wait_ms = flags.DEFINE_float("batch_wait_ms", None, "How long a batch waits to fill.")
  clients = flags.DEFINE_integer("clients", 4, "Concurrent connections.")
  requests = flags.DEFINE_integer("requests", 50, "Counted requests per connection.")
  image_size = flags.DEFINE_integer("image_size", 224, "Side of the images sent.")
  repeats = flags.DEFINE_integer("repeats", 1, "Measurements on the same server.")

  def body(args):
    if len(args) > 1 or (policy.value is None) == (connect.value is None):
      raise app.UsageError("give --policy (serve it here) or --connect=HOST:PORT, not both")
    server, host = None, "127.0.0.1"
    if policy.value is not None:
      from jaxvla import simulator_env  # pylint: disable=import-outside-toplevel
      simulator_env.ensure()
      config = serve.serve_config(serve_flag.value, obs_map=obs_map.value, host=host, port=0,
                                  max_batch=max_batch.value, batch_wait_ms=wait_ms.value)
      server = server_lib.PolicyServer(policy_io.load(policy.value, config_flag.value), config)
      port = server.start()
    else:
      host, port = connect.value.rsplit(":", 1)
      port = int(port)
    rows = []
    try:
      for r in range(repeats.value):
        before = server.batcher.stats() if server else None
        row = measure(host, port, clients.value, requests.value, image_size.value)
        if server is not None:
          after = server.batcher.stats()
          calls = after["calls"] - before["calls"]
          row.update(calls=calls, mean_batch=round(
              (after["requests"] - before["requests"]) / max(calls, 1), 2))
        rows.append(row)
        print(f"# repeat {r}: " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    finally:
      if server is not None:
        server.close()
    setting = dict(clients=clients.value, requests=requests.value, image_size=image_size.value,
                   max_batch=server.config.max_batch if server else None,
                   batch_wait_ms=server.config.batch_wait_ms if server else None,
                   machine=f"{platform.machine()}, {os.cpu_count()} cores")
    print(f"requests/s {_spread(rows, 'requests_per_s')}; p50 {_spread(rows, 'p50_ms')} ms; "
          f"p99 {_spread(rows, 'p99_ms')} ms")
    print(json.dumps(dict(setting=setting, repeats=rows)))

  app.run(body, argv)


if __name__ == "__main__":
  main(sys.argv)
