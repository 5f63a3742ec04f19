"""The kernel section of `python -m dspark_jax.bench.spec_round` on CPU: pure-JAX timings are
real numbers, kernel timings are withheld (interpret mode is not a timing) and say so."""

from __future__ import annotations

import json

from dspark_jax.bench.spec_round import kernel_rows, kernel_timings, main


def test_kernel_section_on_cpu(tmp_path, capsys):
    k = kernel_timings(batch=2, gamma=3, vocab=300, rank=16, dtype="float32", temperature=1.0,
                       repeats=1)
    assert k["backend"] == "cpu" and k["markov_jax_ms"] > 0 and k["verify_jax_ms"] > 0
    assert k["markov_kernel_ms"] is None and k["verify_kernel_ms"] is None
    rows = dict(kernel_rows(k))
    assert "n/a on CPU" in rows["Markov sampling, Pallas"]
    out = tmp_path / "k.json"
    main(["--kernels-only", "--batch", "2", "--gamma", "3", "--vocab", "300", "--rank", "16",
          "--dtype", "float32", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text())["kernels"]["vocab"] == 300
    assert "Pallas kernels vs pure JAX" in capsys.readouterr().out
