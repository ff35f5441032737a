"""jaxvla.bench.openpi_fast_equiv without openpi (none of openpi's code is in the repository,
so the check itself cannot run here): which directories it takes for ``--openpi_src``, and
the short error, naming the path, for one that holds no openpi package."""

import os
import re
import subprocess
import sys

import pytest

from jaxvla.bench import openpi_fast_equiv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_openpi(src) -> str:
  """``src/openpi`` with the two files openpi_root looks for (empty: nothing is imported)."""
  pkg = src / "openpi"
  (pkg / "models").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "models" / "pi0_fast.py").write_text("")
  return str(pkg)


def test_takes_src_of_a_checkout_or_the_package_itself(tmp_path):
  pkg = _fake_openpi(tmp_path / "src")
  src = str(tmp_path / "src")
  assert openpi_fast_equiv.openpi_root(src) == src
  assert openpi_fast_equiv.openpi_root(pkg) == src


@pytest.mark.parametrize("case", ["missing", "empty", "checkout_root", "no_pi0_fast"])
def test_a_directory_without_openpi_is_named(tmp_path, case):
  path = tmp_path / "openpi_src"
  if case != "missing":
    path.mkdir()
  if case == "checkout_root":  # the checkout itself, not its src/
    _fake_openpi(path / "src")
  if case == "no_pi0_fast":
    (path / "openpi").mkdir()
    (path / "openpi" / "__init__.py").write_text("")
  with pytest.raises(ValueError, match=re.escape(f"--openpi_src={path}")) as e:
    openpi_fast_equiv.openpi_root(str(path))
  assert (f"did you mean {path / 'src'}?" in str(e.value)) == (case == "checkout_root")


def test_the_command_exits_with_the_error_not_a_traceback(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxvla.bench.openpi_fast_equiv",
                      f"--openpi_src={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=300, check=False)
  assert r.returncode == 1, r.stderr[-2000:]
  assert f"error: --openpi_src={tmp_path} holds no openpi package" in r.stderr
  assert "Traceback" not in r.stderr and not r.stdout
