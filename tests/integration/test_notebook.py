"""examples/distributed_training.ipynb: committed without outputs, and run end to end by a kernel
of this environment's Python (nbclient), failing on any cell that raises."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

from tests.helpers.timing import scaled

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "distributed_training.ipynb"


def test_the_notebook_is_committed_without_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code, "the notebook has no code"
    assert all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.mark.slow  # a kernel, a local Ray and two runs (1 and 2 workers): about a minute on 2 cores
def test_the_notebook_runs_end_to_end(tmp_path: Path) -> None:
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    # nbclient starts the kernel named python3 as this Python: the kernel imports this environment's trainforge
    assert KernelManager(kernel_name="python3").format_kernel_cmd()[0] == sys.executable
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=int(scaled(300)),  # per cell
        allow_errors=False,  # a cell that raises fails the test, naming it (nbclient's CellExecutionError)
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    texts = [cell_text(cell) for cell in notebook.cells if cell.cell_type == "code"]
    fits = [text for text in texts if "finished" in text]
    assert len(fits) == 2 and all("80/80" in text for text in fits)  # the progress of each run, to its last step
    everything = "\n".join(texts)
    assert "scaling efficiency" in everything and "accuracy of the loaded weights" in everything
    images = [out for cell in notebook.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) >= 2  # the report's plots (loss, accuracy, throughput)


def cell_text(cell: nbformat.NotebookNode) -> str:
    """What a code cell showed: its streams and the plain text of what it displayed (rich's lines)."""
    return "".join(out.get("text", "") or out.get("data", {}).get("text/plain", "") for out in cell.outputs)
