"""The Pallas kernels against their pure-JAX paths, compiled for one chip without it: the
decoding kernels (paper §3.2 Markov sampling, SPEC §1 verification; `pallas_kernels/`) and the
flash attention of the target's forward over training rows (online features, SPEC §4;
`models.layers.causal_attention`).

For each chip (a TPU through libtpu, the H200 through the CUDA plugin: `aot.decode_floor.
single_chip_devices`) and batch size, the Markov sampler and the verification rule are compiled
twice, as the Pallas kernel (Mosaic on TPU, Triton on GPU) and as the pure-JAX oracle, and each
program's HBM traffic is read off the optimized HLO (`aot.hlo_traffic`). A kernel is one custom
call whose operands and results the HLO shows once; what it streams inside is its own schedule,
so the table adds the kernel's modelled traffic: the Markov kernel reads W2 twice a slot (its two
passes) in each of its B / block_b programs and the logits twice, and writes the probabilities
once; the verification kernel reads a row's probabilities once for the ratio test and twice for
the residual's two passes; the row sampler (`pallas_kernels/row_sample`, Triton only: the GPU's
draws outside the rule) reads each row once for its tile masses and one tile again for the pick,
against XLA's inverse CDF; the causal flash attention reads q once, writes the output once and
streams each head's K/V tiles on and below the diagonal once per query tile (the 128 × 128
tiles of both JAX kernels; tiles above the diagonal are neither computed nor fetched), where
the dense path writes and re-reads the [N, T, T] scores.
  python -m dspark_jax.bench.kernel_traffic --chips v5e,v5p --batches 1,16
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.measurement import print_table, save_json


def _traffic(fn: Any, args: tuple, device: Any) -> tuple[float, int]:
    """(HBM bytes accessed, kernels) of `fn(*args)` compiled for `device`."""
    from jax.sharding import SingleDeviceSharding

    from dspark_jax.aot.hlo_traffic import Program, compile_with_text

    sh = SingleDeviceSharding(device)
    abstract = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args)
    _, text = compile_with_text(jax.jit(fn).lower(*abstract))
    summary = Program(text, lambda name: None).summary()
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


def row_sample_rows(device: Any, B: int, V: int) -> list[dict]:
    """One inverse-CDF draw from each of B rows of V probabilities: XLA's cumulative sum
    (`inverse_cdf_sample`) against the row sampler's two Triton kernels."""
    from pallas_kernels.common import inverse_cdf_sample
    from pallas_kernels.row_sample import DEFAULT_BLOCK_V, row_sample

    args = (jnp.zeros((B, V), jnp.float32), jnp.zeros((B,), jnp.float32))
    ref_bytes, ref_k = _traffic(inverse_cdf_sample, args, device)
    k_bytes, k_k = _traffic(row_sample, args, device)
    modelled = B * (V + min(DEFAULT_BLOCK_V, V)) * 4
    return [dict(kernel="row_sample", path="pure JAX", batch=B, hlo_gb=ref_bytes / 1e9,
                 kernels=ref_k, modelled_gb=None),
            dict(kernel="row_sample", path="Pallas (triton)", batch=B, hlo_gb=k_bytes / 1e9,
                 kernels=k_k, modelled_gb=modelled / 1e9)]


def attention_rows(device: Any, backend: str, T: int, N: int, Kh: int, H: int) -> list[dict]:
    """The target's causal attention over one T-token row (forward only: the target is frozen):
    the dense oracle against the flash kernel of the chip's backend."""
    from dspark_jax.models import layers

    args = (jnp.zeros((1, T, N, H), jnp.bfloat16), jnp.zeros((1, T, Kh, H), jnp.bfloat16),
            jnp.zeros((1, T, Kh, H), jnp.bfloat16))
    dense = lambda q, k, v: layers.attend(q, k, v, layers.causal_mask(1, T))  # noqa: E731
    kern = layers.flash_attention_tpu if backend == "mosaic" else layers.flash_attention_gpu
    ref_bytes, ref_k = _traffic(dense, args, device)
    k_bytes, k_k = _traffic(kern, args, device)
    tiles = T // layers.FLASH_BLOCK
    tile_bytes = layers.FLASH_BLOCK * H * 2
    modelled = 2 * T * N * H * 2 + N * 2 * tile_bytes * tiles * (tiles + 1) // 2
    common = dict(kernel="causal_attention", batch=1, shape=f"T={T} N={N} Kh={Kh} H={H}")
    return [dict(common, path="pure JAX", hlo_gb=ref_bytes / 1e9, kernels=ref_k,
                 modelled_gb=None),
            dict(common, path=f"Pallas ({backend})",
                 hlo_gb=k_bytes / 1e9, kernels=k_k, modelled_gb=modelled / 1e9)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chips", default="v5e,v5p", help="v5e, v5p, v6e (Mosaic); h200 (Triton)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--attention", default="4096,32,8,128",
                    help="T,N,Kh,H of the causal attention rows (Qwen3-4B: 4096,32,8,128); "
                         "empty: none")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if a.attention:
        from dspark_jax.models.layers import FLASH_BLOCK

        dims = [int(x) for x in a.attention.split(",")] if re.fullmatch(
            r"\d+,\d+,\d+,\d+", a.attention) else []
        if not dims or dims[0] % FLASH_BLOCK or dims[1] % dims[2] or dims[3] > 256:
            ap.error(f"--attention {a.attention!r}: T,N,Kh,H with T a multiple of "
                     f"{FLASH_BLOCK}, N a multiple of Kh and H ≤ 256 (the kernels' shapes)")
    from dspark_jax.aot.decode_floor import single_chip_devices

    rows = []
    for chip in [c for c in a.chips.split(",") if c]:
        devices, _ = single_chip_devices(chip)
        backend = "triton" if devices[0].platform in ("cuda", "gpu") else "mosaic"
        for B in [int(b) for b in a.batches.split(",") if b]:
            for row in (markov_rows(devices[0], backend, B, a.gamma, a.vocab, a.rank)
                        + verify_rows(devices[0], backend, B, a.gamma, a.vocab)
                        + (row_sample_rows(devices[0], B, a.vocab) if backend == "triton"
                           else [])):
                rows.append(dict(chip=chip, **row))
        if a.attention:
            T, N, Kh, H = (int(x) for x in a.attention.split(","))
            rows += [dict(chip=chip, **row)
                     for row in attention_rows(devices[0], backend, T, N, Kh, H)]
    fmt = lambda x: "-" if x is None else f"{x:.3f} GB"  # noqa: E731
    label = lambda r: r.get("shape") or f"B={r['batch']}"  # noqa: E731
    print_table([(f"{r['chip']} {r['kernel']} {label(r)} {r['path']}",
                  f"HLO {fmt(r['hlo_gb'])}, modelled {fmt(r['modelled_gb'])}, "
                  f"{r['kernels']} kernels") for r in rows],
                f"Pallas kernels vs pure JAX (γ {a.gamma}, V {a.vocab}, r {a.rank}; "
                f"attention T,N,Kh,H {a.attention or '-'})")
    save_json(dict(rows=rows, gamma=a.gamma, vocab=a.vocab, rank=a.rank,
                   attention=a.attention), a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
