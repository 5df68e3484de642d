"""The Colab notebook runs headless on CPU with smoke-sized parameters."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

# Runs every cell (about a minute cold): CI's slow step.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "launch" / "colab_quickstart.ipynb"


def test_notebook_executes_without_errors(tmp_path):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1
  params[0].source = f'SMOKE = True\nWORKDIR = "{tmp_path}"\nREPO_URL = ""\n'
  # Raises CellExecutionError, naming the cell, on any error.
  NotebookClient(
    nb,
    timeout=600,
    kernel_name="python3",
    resources={"metadata": {"path": str(REPO)}},
  ).execute()
  outputs = "".join(
    o.get("text", "")
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
  )
  markdown = "".join(
    o.get("data", {}).get("text/markdown", "")
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
  )
  images = sum(
    "image/png" in o.get("data", {})
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
  )
  assert "| format | flash policy |" in markdown  # the headline table
  assert images >= 4  # three forward plots and the drift plot
  assert "Running on CPU" in outputs
  assert "FlashAttention rule at bf16-fa2" in outputs
  assert (tmp_path / "forward" / "report.md").exists()
  assert (tmp_path / "drift" / "fig8_all_pairs.png").exists()
