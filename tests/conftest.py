"""Shared fixtures: the default config's tiny pieces, kept small for 2-core CPU runs."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import default  # noqa: E402


def pytest_collection_modifyitems(config, items):
  """Tests marked ``long`` first, the long learning runs (minutes) before the other long
  tests, stable otherwise: with parallel workers (``launch/test.sh``), a long test
  started last would run on alone at the end."""
  del config
  items.sort(key=lambda item: (item.get_closest_marker("long") is None,
                               item.get_closest_marker("learning") is None))


@pytest.fixture
def smoke_config():
  c = default.get_config("smoke")
  return c
