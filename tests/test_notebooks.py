"""The notebooks: committed without outputs, and run top to bottom at the small size (nbclient).

Executing needs the dev packages nbclient, nbformat and ipykernel; without them the run tests skip.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # pytest -m 'not slow' skips this module (see pyproject.toml)

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
NAMES = ["chunk_size_sweep.ipynb", "token_budget_sweep.ipynb"]


def test_both_notebooks_are_committed():
    assert sorted(p.name for p in NOTEBOOKS) == NAMES


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_have_no_outputs(path):
    notebook = json.loads(path.read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name}: strip the outputs"


def execute(path: Path, cwd: Path, monkeypatch, out: Path):
    """Run a notebook at the small size in `cwd`; return it with its outputs."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("CBSIM_NB_SIZE", "small")
    monkeypatch.setenv("CBSIM_NB_OUT", str(out))
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return notebook


def outputs(notebook) -> tuple[str, int]:
    """All text the notebook printed or displayed, and the number of images it showed."""
    text, images = [], 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            text.append(output.get("text", ""))
            data = output.get("data", {})
            text.append(data.get("text/markdown", "") + data.get("text/plain", ""))
            images += "image/png" in data
    return "\n".join(text), images


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_at_small_size(path, monkeypatch, tmp_path):
    notebook = execute(path, path.parent, monkeypatch, tmp_path / "out")
    text, images = outputs(notebook)
    assert "size small" in text
    assert "trace:" in text or "synthetic lognormal workload" in text
    assert images >= 2
    assert " ok) in " in text and (tmp_path / "out" / "results.parquet").is_file()


def test_notebook_falls_back_to_a_synthetic_workload_without_data(monkeypatch, tmp_path):
    copy = tmp_path / "alone" / "token_budget_sweep.ipynb"
    copy.parent.mkdir()
    shutil.copy(next(p for p in NOTEBOOKS if p.name == "token_budget_sweep.ipynb"), copy)
    monkeypatch.setenv("CBSIM_DATA", str(tmp_path / "empty"))
    text, images = outputs(execute(copy, copy.parent, monkeypatch, tmp_path / "out"))
    assert "the Azure trace was not found" in text and "synthetic lognormal workload" in text
    assert "trace:" not in text and images >= 2
