"""Roofline of verification's matmuls: what B rows cost against one.

Verifying ℓ drafts of one request multiplies 1 + ℓ rows by every weight of the target; a
plain step multiplies one. Both read the same weight bytes, so on a machine that streams the
weights at its copy bandwidth, B ≤ 16 rows should cost about what one row costs (the FLOPs,
2·B per weight, stay under the byte time). This benchmark measures what the backend's dot
emitter actually does on the target's own matrix shapes: one buffer per matrix and per layer
as the decoding layout holds them (`layers.UnstackedLayers`: q|k|v fused, o, gate|up fused,
down), random weights of the target's dtype, the layers' projections applied in sequence as a
decode step applies them, then the tied or untied LM head in the model's "BD,VD->BV" form,
each timed call reading every byte once. It prints per B the time, the ratio to one row, the
weight bytes per second and GFLOP/s, beside the byte floor from the host's copy bandwidth.

  python -m dspark_jax.bench.matmul_rows --target smollm2-135m-instruct --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.bench.common import (SHAPES, device_name, host_facts, median, save_json)
from dspark_jax.serving.cost_profile import time_call


def layer_shapes(cfg: Any) -> list[tuple[int, int]]:
    """[in, out] of one decoder layer's matrices in the decoding layout: q|k|v, o, gate|up,
    down."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return [(D, q + 2 * kv), (q, D), (D, 2 * F), (F, D)]


def weights(cfg: Any, dtype: Any, seed: int = 0) -> tuple[list[list[jax.Array]], jax.Array]:
    """Random weights of the target's shapes: per layer its projections, and the LM head
    [V, D]."""
    rng = np.random.default_rng(seed)

    def mat(shape: tuple[int, int]) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02, dtype)

    layers = [[mat(s) for s in layer_shapes(cfg)] for _ in range(cfg.num_hidden_layers)]
    return layers, mat((cfg.vocab_size, cfg.hidden_size))


@jax.jit
def stream(x_bd: jax.Array, layers: list[list[jax.Array]], head_vd: jax.Array) -> jax.Array:
    """Every projection of every layer applied to B rows, then the LM head: the matmuls of a
    verification forward without attention (each output feeds the next layer, so none is
    dead code)."""
    for w_qkv, wo, w_gate_up, wd in layers:
        q_dim = wo.shape[0]
        qkv = x_bd @ w_qkv
        q = qkv[:, :q_dim] + jnp.sum(qkv[:, q_dim:], -1, keepdims=True)
        x_bd = x_bd + q @ wo
        gate, up = jnp.split(x_bd @ w_gate_up, 2, axis=-1)
        x_bd = x_bd + (jax.nn.silu(gate) * up) @ wd
    return jnp.einsum("BD,VD->BV", x_bd, head_vd)


def run(cfg: Any, rows: list[int], dtype: Any, repeats: int) -> dict:
    layers, head = weights(cfg, dtype)
    n_weights = sum(w.size for w in jax.tree.leaves((layers, head)))
    nbytes = sum(w.size * w.dtype.itemsize for w in jax.tree.leaves((layers, head)))
    facts = host_facts()
    out = []
    for b in rows:
        x = jnp.asarray(np.random.default_rng(b).standard_normal((b, cfg.hidden_size)), dtype)
        s = median(time_call(lambda: stream(x, layers, head), repeats=repeats))
        out.append(dict(rows=b, ms=1e3 * s, weight_gbs=nbytes / s / 1e9,
                        gflops=2 * b * n_weights / s / 1e9))
    for r in out:
        r["x_one_row"] = r["ms"] / out[0]["ms"] if rows[0] == 1 else None
    floor_ms = 1e3 * nbytes / (facts["memory_copy_gbs"] * 1e9)   # bytes moved at copy speed
    return dict(device=device_name(), host=facts, weight_bytes=nbytes, byte_floor_ms=floor_ms,
                rows=out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="a real target (its config) or a shape of bench.common.SHAPES")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args(argv)
    rows = [int(x) for x in a.rows.split(",")]
    if not rows or min(rows) < 1:
        raise SystemExit(f"--rows: positive integers, got {a.rows!r}")
    if a.target in SHAPES:
        cfg = SHAPES[a.target]
    else:
        from dspark_jax.models.target import load_target
        cfg = load_target(a.target, with_tokenizer=False).config
    r = run(cfg, rows, jnp.dtype(a.dtype), a.repeats)
    r.update(target=a.target, dtype=a.dtype)
    save_json(r, a.json)
    print(f"{a.target} {a.dtype}, {r['device']}, {r['host']['cpu']}, "
          f"{r['host']['logical_cpus']} CPUs, copy {r['host']['memory_copy_gbs']} GB/s; "
          f"weights {r['weight_bytes'] / 1e6:.0f} MB, byte floor {r['byte_floor_ms']:.1f} ms")
    print("| rows | ms | × one row | weight GB/s | GFLOP/s |\n|---:|---:|---:|---:|---:|")
    for x in r["rows"]:
        ratio = "" if x["x_one_row"] is None else f"{x['x_one_row']:.2f}"
        print(f"| {x['rows']} | {x['ms']:.1f} | {ratio} | {x['weight_gbs']:.1f} | "
              f"{x['gflops']:.1f} |")
    return r


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
