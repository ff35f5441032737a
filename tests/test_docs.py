"""The documentation: the site builds without a warning, and the README stays a short,
linked front page."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def test_site_builds_with_warnings_as_errors(tmp_path):
  # -E: every page read afresh; -W --keep-going: every warning reported, then a failure.
  r = subprocess.run([sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b",
                      "html", os.path.join(ROOT, "docs"), str(tmp_path / "html")],
                     capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
  assert (tmp_path / "html" / "index.html").exists()
  assert (tmp_path / "html" / "api.html").exists()


def test_readme_is_short_and_its_links_resolve():
  text = open(README, encoding="utf-8").read()
  assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move detail to docs/"
  targets = re.findall(r"\]\(([^)\s]+)\)", text)
  local = [t.split("#")[0] for t in targets if "://" not in t and not t.startswith("#")]
  assert local, "no relative links found in README.md"
  missing = [t for t in local if not os.path.exists(os.path.join(ROOT, t))]
  assert not missing, f"README.md links to missing files: {missing}"
