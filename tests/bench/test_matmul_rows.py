"""`bench.matmul_rows` multiplies B rows by every weight of the target's shapes: the stream it
times is the matmuls of a verification forward (checked against the same products in numpy),
and its table reports each B against one row."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dspark_jax.bench import matmul_rows
from dspark_jax.models.config import DecoderConfig, RopeConfig

CFG = DecoderConfig(family="llama", vocab_size=40, hidden_size=16, intermediate_size=24,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e4),
                    tie_word_embeddings=True, max_position_embeddings=64)


def test_stream_applies_every_projection_of_every_layer():
    layers, head = matmul_rows.weights(CFG, jnp.float32)
    assert [tuple(w.shape) for w in layers[0]] == matmul_rows.layer_shapes(CFG)
    assert len(layers) == 2 and head.shape == (40, 16)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    ref = x.astype(np.float64)
    for w_qkv, wo, w_gate_up, wd in ([np.asarray(w, np.float64) for w in ws] for ws in layers):
        qkv = ref @ w_qkv          # q [16], k [8], v [8]
        ref = ref + (qkv[:, :16] + qkv[:, 16:].sum(-1, keepdims=True)) @ wo
        g, u = ref @ w_gate_up[:, :24], ref @ w_gate_up[:, 24:]
        ref = ref + (g / (1 + np.exp(-g)) * u) @ wd
    got = matmul_rows.stream(jnp.asarray(x), layers, head)
    np.testing.assert_allclose(np.asarray(got), ref @ np.asarray(head, np.float64).T,
                               rtol=1e-4, atol=1e-5)


def test_table_reports_each_row_count_against_one(capsys, monkeypatch):
    monkeypatch.setattr(matmul_rows, "host_facts", lambda: dict(
        cpu="test", logical_cpus=2, memory_copy_gbs=10.0))
    r = matmul_rows.run(CFG, [1, 2, 8], jnp.float32, repeats=2)
    assert [x["rows"] for x in r["rows"]] == [1, 2, 8]
    assert r["rows"][0]["x_one_row"] == 1.0 and all(x["ms"] > 0 for x in r["rows"])
    assert r["weight_bytes"] == 4 * (2 * sum(i * o for i, o in matmul_rows.layer_shapes(CFG))
                                     + 40 * 16)
