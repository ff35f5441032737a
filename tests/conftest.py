"""Shared fixtures: the default config's tiny pieces, kept small for 2-core CPU runs."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import default  # noqa: E402


@pytest.fixture
def smoke_config():
  c = default.get_config("smoke")
  return c
