"""``launch/test.sh`` itself: a step that collects no test fails, the time table is its
last line also then, and a bad ``--only`` is refused in one line."""

import os
import re
import subprocess

from tests.conftest import ROOT


def _test_sh(*args: str) -> subprocess.CompletedProcess:
  # In-process pytest (no xdist workers): the nested run only collects.
  env = dict(os.environ, JAXVLA_TEST_WORKERS="0")
  return subprocess.run(["bash", os.path.join(ROOT, "launch", "test.sh"), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300,
                        stdin=subprocess.DEVNULL)


def test_a_step_that_collects_nothing_fails_and_the_time_table_still_prints():
  r = _test_sh("--only=learning", "-k", "no_test_has_this_name", "-p", "no:cacheprovider")
  assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
  err = r.stderr.strip().splitlines()
  assert "=== test.sh: step 'learning' collected no tests; counted as a failure" in err
  assert "=== test.sh: FAILED: learning (exit 5)" in err
  assert re.fullmatch(r"=== test\.sh: times: set-up \d+ s / \d+ CPU-s; "
                      r"learning \d+ s / \d+ CPU-s; whole \d+ s / \d+ CPU-s", err[-1]), err[-1]


def test_a_bad_only_is_refused_in_one_line():
  r = _test_sh("--only=learnin")
  assert r.returncode == 2
  assert r.stderr.strip() == ("test.sh: --only takes fast, multihost, slow, sim or learning, "
                              "not 'learnin'")
