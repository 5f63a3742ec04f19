"""`python -m dspark_jax.bench.spec_round` times the serving engine's round (the path users
run), with pure-JAX and Pallas sampler / verifier rows (interpreted on CPU, and labelled so)."""

from __future__ import annotations

import json

import pytest

from dspark_jax.bench.spec_round import main
from hf_tiny import save_tiny_hf


@pytest.mark.slow
def test_engine_round_rows_on_cpu(tmp_path, capsys):
    tdir = save_tiny_hf(tmp_path / "t", "qwen3", head_dim=16, layers=2, seed=1)
    out = tmp_path / "r.json"
    main(["--target", str(tdir), "--dtype", "float32", "--batch", "2", "--context", "6",
          "--gamma", "3", "--draft-layers", "1", "--rank", "8", "--rounds", "3",
          "--repeats", "1", "--no-kernels", "--json", str(out)])
    r = json.loads(out.read_text())
    rows = {(x["sampler"], x["verifier"]): x for x in r["engine_rounds"]}
    assert set(rows) == {("jax", "jax"), ("pallas", "jax"), ("jax", "pallas")}
    assert all(x["round_ms"] > 0 for x in rows.values())
    assert rows[("jax", "jax")]["round_ms"] == pytest.approx(r["round_ms"])
    assert not rows[("jax", "jax")]["interpreted"] and rows[("pallas", "jax")]["interpreted"]
    assert r["plain_step_ms"] > 0 and r["steady_state_recompiles"] == 0
    text = capsys.readouterr().out
    assert "interpreted on CPU" in text and "engine round" in text
