"""`bench.kernel_traffic` compiles the decoding kernels and the target's flash attention, and their
pure-JAX paths, for one TPU chip and reports each program's HBM traffic, the kernels' modelled
inner traffic beside it."""

import json

import pytest

from dspark_jax.aot import topology


@pytest.mark.tpu
@pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu: pip install -e '.[tpu]'")
def test_kernel_traffic_table_for_a_v5e(tmp_path, capsys):
    from dspark_jax.bench import kernel_traffic

    out = tmp_path / "k.json"
    assert kernel_traffic.main(["--chips", "v5e", "--batches", "1", "--vocab", "1024",
                                "--rank", "16", "--gamma", "3", "--attention", "2048,8,2,128",
                                "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    paths = {(r["kernel"], r["path"]) for r in rows}
    assert paths == {("markov_sample", "pure JAX"), ("markov_sample", "Pallas (mosaic)"),
                     ("verify", "pure JAX"), ("verify", "Pallas (mosaic)"),
                     ("causal_attention", "pure JAX"), ("causal_attention", "Pallas (mosaic)")}
    for r in rows:
        assert r["hlo_gb"] > 0 and r["kernels"] > 0
        assert (r["modelled_gb"] is None) == (r["path"] == "pure JAX")
    dense, flash = sorted((r for r in rows if r["kernel"] == "causal_attention"),
                          key=lambda r: r["path"] != "pure JAX")
    # the dense path writes and re-reads the [8, 2048, 2048] f32 scores (too large to stay on
    # chip); the kernel keeps them in VMEM and streams the K/V tiles on and below the diagonal
    assert 2 * (flash["hlo_gb"] + flash["modelled_gb"]) < dense["hlo_gb"]
    printed = capsys.readouterr().out
    assert "markov_sample B=1 Pallas (mosaic)" in printed
    assert "causal_attention T=2048 N=8 Kh=2 H=128 Pallas (mosaic)" in printed


@pytest.mark.gpu
def test_row_sampler_traffic_for_an_h200(tmp_path):
    """Compiled for an H200 (the CUDA plugin, no GPU, in a subprocess as `aot` runs): the row
    sampler draws in two kernels where XLA's inverse CDF takes more, and reads less."""
    import os
    import subprocess
    import sys

    from dspark_jax.aot import gpu

    if not gpu.has_cuda_plugin():
        pytest.skip(f"needs the CUDA plugin: {gpu.GPU_INSTALL_HINT}")
    out = tmp_path / "k.json"
    rc = subprocess.run([sys.executable, "-m", "dspark_jax.bench.kernel_traffic", "--chips",
                         "h200", "--batches", "4", "--vocab", "151936", "--rank", "16",
                         "--gamma", "2", "--attention", "", "--json", str(out)],
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        timeout=600).returncode
    assert rc == 0
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]
            if r["kernel"] == "row_sample"}
    xla, kernel = rows["pure JAX"], rows["Pallas (triton)"]
    assert kernel["kernels"] == 2 < xla["kernels"]
    assert kernel["modelled_gb"] < xla["hlo_gb"]
