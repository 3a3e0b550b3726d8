"""notebooks/overlap.ipynb runs top to bottom on statistics this test builds, and draws its plots.

The notebook reads the statistics directory from REAP_OVERLAP_STATS; the corpora here have names
the notebook's own synthetic fallback never uses, so the report output proves it analyzed them.
"""

from pathlib import Path

import pytest

from notebooks.synthetic import planted_corpora, write_corpora

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "overlap.ipynb"


def test_overlap_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    fam = {"latin": ["es", "it"], "code": ["go"], "cjk": ["ja"]}
    write_corpora(
        planted_corpora(families=fam, n_layers=3, n_experts=48, n_seqs=12, seed=3),
        str(tmp_path / "stats"),
    )
    monkeypatch.setenv("REAP_OVERLAP_STATS", str(tmp_path / "stats"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook without outputs"
    )
    nbclient.NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 7, len(images)
    report = next(
        o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})
    )
    assert "es – it" in report and "less than chance" in report
