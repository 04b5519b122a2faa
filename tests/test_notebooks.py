"""Execute the parity notebooks end to end (a failing cell fails the test)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")


@pytest.mark.parametrize("name", ["parity_hf.ipynb"])
def test_notebook_runs(name):
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": NOTEBOOKS}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "greedy identical: True" in text
