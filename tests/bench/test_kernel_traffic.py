"""`bench.kernel_traffic` compiles both decoding kernels and their pure-JAX paths for one TPU chip
and reports each program's HBM traffic, the kernels' modelled inner traffic beside it."""

import json

import pytest

from dspark_jax.aot import topology


@pytest.mark.tpu
@pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu: pip install -e '.[tpu]'")
def test_kernel_traffic_table_for_a_v5e(tmp_path, capsys):
    from dspark_jax.bench import kernel_traffic

    out = tmp_path / "k.json"
    assert kernel_traffic.main(["--chips", "v5e", "--batches", "1", "--vocab", "1024",
                                "--rank", "16", "--gamma", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    paths = {(r["kernel"], r["path"]) for r in rows}
    assert paths == {("markov_sample", "pure JAX"), ("markov_sample", "Pallas (mosaic)"),
                     ("verify", "pure JAX"), ("verify", "Pallas (mosaic)")}
    for r in rows:
        assert r["hlo_gb"] > 0 and r["kernels"] > 0
        assert (r["modelled_gb"] is None) == (r["path"] == "pure JAX")
    assert "markov_sample B=1 Pallas (mosaic)" in capsys.readouterr().out
