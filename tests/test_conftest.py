"""``tests/conftest.py``'s test order: ``run_first`` ranks dealt over the xdist workers.

The order is checked on an inner pytest session (pytest's ``pytester``) that stands in
for one xdist worker of two (``config.workerinput``, which xdist sets in its workers), so
the dealt list is what each worker would receive, without starting workers.
"""

import pytest

from tests import conftest

pytest_plugins = ["pytester"]

_TESTS = """
import pytest

@pytest.mark.slow
@pytest.mark.run_first(0)
def test_long_a(): pass

@pytest.mark.slow
@pytest.mark.run_first(1)
def test_long_b(): pass

@pytest.mark.slow
@pytest.mark.run_first(2)
def test_short_a(): pass

@pytest.mark.slow
@pytest.mark.run_first(3)
def test_short_b(): pass

@pytest.mark.slow
def test_unranked(): pass
"""

# Tests of other steps, ranked and not, before and between the step's own: -m deselects
# them, and the dealing must not count them.
_OTHERS = """
import pytest

@pytest.mark.run_first(0)
def test_other_long(): pass

def test_other_0(): pass

@pytest.mark.run_first(1)
def test_other_ranked(): pass

def test_other_1(): pass

def test_other_2(): pass
"""

_AS_A_WORKER = f"""
import sys
sys.path.insert(0, {conftest.ROOT!r})
from tests.conftest import pytest_collection_modifyitems  # noqa: F401

def pytest_configure(config):
  config.workerinput = {{"workercount": 2}}  # (as xdist sets it in each of 2 workers)
"""


def test_dealing_counts_only_the_tests_the_step_selects(pytester: pytest.Pytester):
  pytester.makeini("[pytest]\nmarkers =\n  slow: x\n  run_first(rank=1): x\n")
  pytester.makeconftest(_AS_A_WORKER)
  pytester.makepyfile(test_a_others=_OTHERS, test_b_step=_TESTS)
  r = pytester.runpytest_inprocess("-m", "slow", "--collect-only", "-q", "-p", "no:cacheprovider")
  order = [line.split("::")[1] for line in r.outlines if "::" in line]
  # Ranked first, then dealt: worker 0's share (the first 5 // 2 = 2) holds ranks 0 and 2,
  # worker 1's ranks 1 and 3 and the unranked test; each share starts with a long test.
  assert order == ["test_long_a", "test_short_a",
                   "test_long_b", "test_short_b", "test_unranked"], order
