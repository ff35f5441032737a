"""Serve a policy to openpi clients: ``python -m jaxvla.serve --policy=DIR --port=8000``.

Loads the policy with :func:`jaxvla.storage.policy_io.load` (a jaxvla export, a run or its
``checkpoints/``, or an openpi checkpoint step with ``--config``) and serves it
over openpi's websocket + msgpack protocol (:mod:`jaxvla.serving.server`) until
Ctrl-C or SIGTERM (a scheduler's stop), closing its connections first. Flags:

* ``--config``: the policy's run config (required for an openpi checkpoint, e.g.
  ``configs/openpi.py:pi0``; replaces a jaxvla policy's stored one);
* ``--serve``: the server's settings, ``configs/serve.py[:MAP]`` (every field
  commented there; ``--serve.noise=per_request`` and the like override them);
* ``--obs_map``, ``--port``, ``--host``, ``--max_batch``, ``--batch_wait_ms``:
  shortcuts for those fields of ``--serve``;
* ``--step``, ``--asset_id``: which checkpoint step / openpi norm stats to load.

Parses flags only; docs/guides/serving.md describes the protocol and the key maps.
"""

from __future__ import annotations

import logging
import sys

import ml_collections

from jaxvla.serving import config as serving_config
from jaxvla.serving import server as server_lib
from jaxvla.storage import policy_io

# The server's settings as a config file (config_flags reads files), inside the package.
SERVE_CONFIG = serving_config.__file__


def serve_config(base: ml_collections.ConfigDict, *, obs_map: str | None = None,
                 **overrides) -> ml_collections.ConfigDict:
  """``base`` with the command line's shortcuts applied (``None``: keep ``base``'s)."""
  config = base.copy_and_resolve_references()
  with config.unlocked():
    if obs_map is not None:
      config.obs_map = serving_config.obs_map(obs_map)  # (an unknown name: its ValueError)
    for key, value in overrides.items():
      if value is not None:
        setattr(config, key, value)
  if config.max_batch < 1 or config.batch_wait_ms < 0:
    raise ValueError(f"max_batch={config.max_batch} must be >= 1 and batch_wait_ms="
                     f"{config.batch_wait_ms} >= 0")
  return config


def main(argv: list[str]) -> None:
  """Parses the flags (see the module docstring) and serves until Ctrl-C."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_flag = config_flags.DEFINE_config_file(
      "config", None, "The policy's run config (':variant'); required for an openpi "
      "checkpoint. Default: the policy's own.", lock_config=True)
  serve_flag = config_flags.DEFINE_config_file(
      "serve", SERVE_CONFIG, "Server settings (jaxvla/serving/config.py[:obs_map]).",
      lock_config=True)
  policy_flags = policy_io.define_flags()
  obs_map = flags.DEFINE_string("obs_map", None, "Observation keys clients send: jaxvla, "
                                "libero, droid or aloha (default: --serve's).")
  port = flags.DEFINE_integer("port", None, "TCP port (default: --serve's, 8000).")
  host = flags.DEFINE_string("host", None, "Interface (default: --serve's, all).")
  max_batch = flags.DEFINE_integer("max_batch", None, "Most requests per policy call.")
  wait_ms = flags.DEFINE_float("batch_wait_ms", None, "How long a batch waits to fill.")

  def body(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {args[1:]}")
    from jaxvla import simulator_env  # pylint: disable=import-outside-toplevel
    simulator_env.ensure()  # (thread counts and the backends' settings of launch/env.sh)
    logging.getLogger("jaxvla").setLevel(logging.INFO)
    try:
      config = serve_config(serve_flag.value, obs_map=obs_map.value, port=port.value,
                            host=host.value, max_batch=max_batch.value,
                            batch_wait_ms=wait_ms.value)
      loaded = policy_io.load(config=config_flag.value, **policy_flags.load_kwargs())
      server = server_lib.PolicyServer(loaded, config)
    except (ValueError, FileNotFoundError) as e:
      sys.stderr.write(f"error: {e}\n")
      sys.exit(1)
    ready = lambda p: print(f"serving {loaded.path} on port {p} (obs_map "
                            f"{config.obs_map.name!r}); Ctrl-C stops", flush=True)
    try:
      server.serve_forever(on_ready=ready)
    except KeyboardInterrupt:  # (a second Ctrl-C while stopping)
      pass
    print("stopped", flush=True)

  app.run(body, argv)


if __name__ == "__main__":
  main(sys.argv)
