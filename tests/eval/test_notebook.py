"""notebooks/accept_length_analysis.ipynb runs top to bottom (nbclient, kernel "python3") on
the results of a tiny `dspark_jax.evaluate` run, and shows the table, plots and STS output."""

from __future__ import annotations

import pathlib

import pytest

from test_evaluate import tiny_eval_env

NOTEBOOK = (pathlib.Path(__file__).resolve().parents[2] / "notebooks"
            / "accept_length_analysis.ipynb")


def _ensure_python3_kernel(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Uses an installed "python3" kernel spec, else installs one for this interpreter in tmp."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
        return
    except NoSuchKernel:
        pass
    try:
        from ipykernel.kernelspec import install
    except ImportError:
        pytest.skip("no 'python3' Jupyter kernel spec and ipykernel is not installed")
    install(kernel_name="python3", prefix=str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter" / "share" / "jupyter"))


def test_notebook_executes_on_tiny_results(tmp_path_factory, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    _ensure_python3_kernel(tmp_path, monkeypatch)
    env = tiny_eval_env(tmp_path_factory)
    monkeypatch.setenv("DSPARK_RESULTS", str(env["out"] / "results.json"))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=180,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on any failing cell

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    markdown = "\n".join(o["data"]["text/markdown"] for o in outputs
                         if o.output_type == "display_data" and "text/markdown" in o["data"])
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o["data"]]
    assert str(env["out"] / "results.json") in text
    tau = env["results"]["datasets"]["alpha"]["tau"]
    assert "| alpha |" in markdown and f"{tau:.2f}" in markdown
    assert "held-out ECE raw" in markdown  # the STS cell ran on the raw records
    assert len(images) == 3  # τ bars, acceptance by position, calibration
