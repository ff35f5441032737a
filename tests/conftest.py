"""Shared fixtures: the default config's tiny pieces, kept small for 2-core CPU runs."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import default  # noqa: E402


@pytest.hookimpl(trylast=True)  # After pytest's own -m / -k deselection (see below).
def pytest_collection_modifyitems(config, items):
  """Tests marked ``run_first`` first, by rank (the longest runs of a step, minutes each,
  are rank 0), stable otherwise: with parallel workers (``launch/test.sh``), a long test started
  last would run on alone at the end.

  Under pytest-xdist the order is also dealt out over the workers. Its ``worksteal``
  scheduler first gives each worker a contiguous share of the list, and it steals
  from a queue only when more than 2 tests wait there, so two long tests in one share
  run one after the other while the other worker idles. Dealt, each worker's share
  starts with its own long test. The hook runs last (``trylast``) so that it deals the
  step's own tests: dealt before ``-m`` deselected the rest of the suite's ~500, the
  slow step's shares came out arbitrary, and its two learning runs ran in a row on one
  worker while the other ran the rest. On 2 cores that step is CPU-bound, so it took
  as long either way (776 s dealt wrongly, 780 s dealt right: 1,444 and 1,449
  CPU-seconds); where each worker has a core of its own, the dealt order is the faster
  one. The slow step's ranks 0..6 deal its seven tests so that each of two workers
  holds about half of the work, from a fresh clone's durations on a 2-core AMD EPYC
  (2026-12-02): learner check (129 s), notebook (63), fault injection (56) | replay
  (107), gpu_check dry run (89), sharded step (42), install (26). The learning step's
  ranks 0 and 1 (and the planner's check, unranked, last) put the ManiSkill3 run on
  one worker and the parity run, then the planner's check, on the other.
  """
  items.sort(key=_rank)
  workers = getattr(config, "workerinput", {}).get("workercount", 1)
  if workers > 1:
    items[:] = _dealt(items, workers)


def _rank(item) -> float:
  """A test's place in its step: ``run_first``'s rank (default 1), else last."""
  mark = item.get_closest_marker("run_first")
  if mark is None:
    return float("inf")
  return mark.args[0] if mark.args else mark.kwargs.get("rank", 1)


def _dealt(items: list, workers: int) -> list:
  """``items`` reordered so that worker ``k``'s contiguous share (as xdist's worksteal
  sizes them: the rest divided by the workers left) holds items ``k``, ``k + workers``,
  ... of the original order, as far as the shares' sizes allow."""
  sizes, left = [], len(items)
  for k in range(workers):
    sizes.append(left // (workers - k))
    left -= sizes[-1]
  shares = [[] for _ in range(workers)]
  k = 0
  for item in items:
    while len(shares[k]) == sizes[k]:
      k = (k + 1) % workers
    shares[k].append(item)
    k = (k + 1) % workers
  return [item for share in shares for item in share]


def pool_workers(pid: int) -> list:
  """The env pool's worker processes (``psutil.Process``) of run ``pid``, not
  multiprocessing's helpers."""
  import psutil  # pylint: disable=import-outside-toplevel
  try:
    children = psutil.Process(pid).children()
  except psutil.NoSuchProcess:
    return []
  out = []
  for child in children:
    try:
      if "spawn_main" in " ".join(child.cmdline()):
        out.append(child)
    except psutil.NoSuchProcess:
      pass
  return out


def fast_xla_env(env: dict[str, str]) -> dict[str, str]:
  """``env`` with launch/test.sh's compile-time XLA flags (``JAXVLA_TEST_FAST_XLA_FLAGS``,
  when test.sh set them): for the slow step's short subprocess runs, whose speed is not
  checked (the slow step itself keeps XLA's defaults, for the learning runs)."""
  if "JAXVLA_TEST_FAST_XLA_FLAGS" in env:
    return dict(env, XLA_FLAGS=env["JAXVLA_TEST_FAST_XLA_FLAGS"])
  return dict(env)


@pytest.fixture
def smoke_config():
  c = default.get_config("smoke")
  return c
