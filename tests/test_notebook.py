"""``notebooks/quickstart.ipynb`` executed top to bottom on CPU (``nbclient``), so it cannot rot.

The kernel is this interpreter's (jaxvla importable), so the set-up cell does
nothing; it runs in a temporary directory and writes its run there. Checked: every
cell runs without an error, and the outputs a reader looks for are there: the run's
summary, the learning curve (a PNG), the export's evaluation and the rollout GIF.
"""

from __future__ import annotations

import json
import os

import nbclient  # (the `test` extra in setup.py: a missing one fails, never skips)
import nbformat
import pytest

from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def _outputs(nb, mime: str) -> list:
  return [out["data"][mime] for cell in nb.cells if cell.cell_type == "code"
          for out in cell.get("outputs", []) if mime in out.get("data", {})]


def _text(nb) -> str:
  return "".join(out.get("text", "") + out.get("data", {}).get("text/plain", "")
                 for cell in nb.cells if cell.cell_type == "code"
                 for out in cell.get("outputs", []))


@pytest.mark.slow  # It trains a policy (a minute or two): test.sh's third step.
@pytest.mark.run_first(2)
def test_quickstart_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel inherits this environment: its tempfile.mkdtemp() workdir lands here.
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  for key, value in conftest.fast_xla_env(dict(os.environ)).items():  # (a short run)
    monkeypatch.setenv(key, value)
  nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  text = _text(nb)
  summary = json.loads(text[text.index("{"):text.index("}") + 1])
  assert summary["env_steps"] >= 6_000 and 0.0 <= summary["success_rate"] <= 1.0
  assert summary["export_dir"].startswith(str(tmp_path))
  assert "export: success" in text and "over 32 episodes" in text
  assert len(_outputs(nb, "image/png")) == 1  # the learning curve, once
  assert len(_outputs(nb, "image/gif")) == 1  # the rollout
  assert text.count("move to the red target") == 4
