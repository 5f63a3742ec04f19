"""The decoding Pallas kernels against their pure-JAX paths, compiled for one chip without it
(paper §3.2 Markov sampling, SPEC §1 verification; `pallas_kernels/`).

For each chip (a TPU through libtpu, the H200 through the CUDA plugin: `aot.decode_floor.
single_chip_devices`) and batch size, the Markov sampler and the verification rule are compiled
twice, as the Pallas kernel (Mosaic on TPU, Triton on GPU) and as the pure-JAX oracle, and each
program's HBM traffic is read off the optimized HLO (`aot.hlo_traffic`). A kernel is one custom
call whose operands and results the HLO shows once; what it streams inside is its own schedule,
so the table adds the kernel's modelled traffic: the Markov kernel reads W2 twice a slot (its two
passes) in each of its B / block_b programs and the logits twice, and writes the probabilities
once; the verification kernel reads a row's probabilities once for the ratio test and twice for
the residual's two passes.
  python -m dspark_jax.bench.kernel_traffic --chips v5e,v5p --batches 1,16
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.measurement import print_table, save_json


def _traffic(fn: Any, args: tuple, device: Any) -> tuple[float, int]:
    """(HBM bytes accessed, kernels) of `fn(*args)` compiled for `device`."""
    from jax.sharding import SingleDeviceSharding

    from dspark_jax.aot.hlo_traffic import Program

    sh = SingleDeviceSharding(device)
    abstract = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args)
    compiled = jax.jit(fn).lower(*abstract).compile()
    summary = Program(compiled.as_text(), lambda name: None).summary()
    return float(summary["bytes_accessed"]), int(summary["kernels_per_step"])


def markov_rows(device: Any, backend: str, B: int, gamma: int, V: int, r: int) -> list[dict]:
    from pallas_kernels.markov_sample import kernel as mk

    args = (jnp.zeros((B, gamma), jnp.float32), jnp.zeros((B, gamma, V), jnp.float32),
            jnp.zeros((V, r), jnp.bfloat16), jnp.zeros((V, r), jnp.bfloat16),
            jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.float32))
    kern = lambda *a: mk.markov_sample(*a, backend=backend)  # noqa: E731
    ref_bytes, ref_k = _traffic(mk.ref_markov_sample, args, device)
    k_bytes, k_k = _traffic(kern, args, device)
    programs = -(-B // mk.default_block_b(B))
    w2 = V * max(r, 128 if backend == "mosaic" else 16) * 2
    modelled = programs * 2 * gamma * w2 + 2 * B * gamma * V * 4 + B * gamma * V * 4
    return [dict(kernel="markov_sample", path="pure JAX", batch=B, hlo_gb=ref_bytes / 1e9,
                 kernels=ref_k, modelled_gb=None),
            dict(kernel="markov_sample", path=f"Pallas ({backend})", batch=B,
                 hlo_gb=k_bytes / 1e9, kernels=k_k, modelled_gb=modelled / 1e9)]


def verify_rows(device: Any, backend: str, B: int, gamma: int, V: int) -> list[dict]:
    from pallas_kernels.verify import kernel as vk

    args = (jnp.zeros((B, gamma), jnp.float32), jnp.zeros((B,), jnp.float32),
            jnp.zeros((B, gamma + 1, V), jnp.float32), jnp.zeros((B, gamma, V), jnp.float32),
            jnp.zeros((B, gamma), jnp.int32), jnp.full((B,), gamma, jnp.int32))
    kern = lambda *a: vk.verify(*a, backend=backend)  # noqa: E731
    ref_bytes, ref_k = _traffic(vk.ref_verify, args, device)
    k_bytes, k_k = _traffic(kern, args, device)
    modelled = B * 3 * 2 * V * 4      # the residual row's p_t and p_d: one pass + two passes
    return [dict(kernel="verify", path="pure JAX", batch=B, hlo_gb=ref_bytes / 1e9,
                 kernels=ref_k, modelled_gb=None),
            dict(kernel="verify", path=f"Pallas ({backend})", batch=B, hlo_gb=k_bytes / 1e9,
                 kernels=k_k, modelled_gb=modelled / 1e9)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chips", default="v5e,v5p", help="v5e, v5p, v6e (Mosaic); h200 (Triton)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    from dspark_jax.aot.decode_floor import single_chip_devices

    rows = []
    for chip in [c for c in a.chips.split(",") if c]:
        devices, _ = single_chip_devices(chip)
        backend = "triton" if devices[0].platform in ("cuda", "gpu") else "mosaic"
        for B in [int(b) for b in a.batches.split(",") if b]:
            for row in (markov_rows(devices[0], backend, B, a.gamma, a.vocab, a.rank)
                        + verify_rows(devices[0], backend, B, a.gamma, a.vocab)):
                rows.append(dict(chip=chip, **row))
    fmt = lambda x: "-" if x is None else f"{x:.3f} GB"  # noqa: E731
    print_table([(f"{r['chip']} {r['kernel']} B={r['batch']} {r['path']}",
                  f"HLO {fmt(r['hlo_gb'])}, modelled {fmt(r['modelled_gb'])}, "
                  f"{r['kernels']} kernels") for r in rows],
                f"decoding kernels vs pure JAX (γ {a.gamma}, V {a.vocab}, r {a.rank})")
    save_json(dict(rows=rows, gamma=a.gamma, vocab=a.vocab, rank=a.rank), a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
