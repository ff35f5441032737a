"""Loading the checkout's config files (``configs/*.py``) by path, for the benchmarks;
the flag parser of the commands that take a run config (``--config.KEY=VALUE``).

A config file defines ``get_config(arg=None) -> ConfigDict``, as ml_collections'
``config_flags`` expects. Entry points read them through ``--config=PATH[:ARG]``. The
library's own defaults are code (:mod:`jaxvla.defaults`, :mod:`jaxvla.serving.config`),
so an installed jaxvla reads no file of the checkout; a benchmark that measures a
checkout config's env (``jaxvla.bench.envs``) goes through :func:`load_config`, which
executes the file by its path: the
top-level ``configs`` directory is not a package on ``sys.path`` once the
process does not start at the repository root, and importing it as one would
need ``sys.path`` edits.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import ml_collections
from absl import app

from jaxvla import defaults

# The repository's configs/ directory: a sibling of the package directory. It exists in a
# checkout (or an editable install), not in an installed wheel.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEFAULT_CONFIG = os.path.join(CONFIG_DIR, "default.py")


def load_config(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """``get_config(arg)`` of the config file at ``path`` (``get_config()`` when ``arg`` is None).

  The file is executed afresh on every call, as a module outside ``sys.modules``,
  so every call returns a new ConfigDict that the caller may change.

  Args:
    path: a ``.py`` config file, e.g. :data:`DEFAULT_CONFIG`.
    arg: the variant passed to ``get_config`` (``configs/default.py:smoke`` on the
      command line is ``arg="smoke"`` here).

  Raises:
    FileNotFoundError: no file at ``path`` (the message names the resolved path).
    AttributeError: the file defines no ``get_config``.
  """
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"config file not found: {path} (the configs/ directory lives in the repository "
        "checkout, next to the jaxvla package)")
  name = f"_jaxvla_config_{os.path.splitext(os.path.basename(path))[0]}"
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise ImportError(f"cannot load {path} as a Python module")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  get_config = getattr(module, "get_config", None)
  if get_config is None:
    raise AttributeError(f"config file {path} defines no get_config()")
  return get_config() if arg is None else get_config(arg)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (``app.run(main, flags_parser=parse_flags)``), after refusing a
  moved config key (:data:`jaxvla.defaults.MOVED_KEYS`) with its new name: the config
  flag would only say that the old key does not exist. Exits with status 1 then."""
  moved = defaults.moved_in_argv(argv[1:])
  if moved:
    sys.stderr.write(f"error: {moved}\n")
    sys.exit(1)
  return app.parse_flags_with_usage(argv)
