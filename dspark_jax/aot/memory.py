"""Per-chip memory of a program compiled for a TPU topology: XLA's argument / output / alias /
temporary / generated-code bytes, a compile-time HBM OOM read back as the temporaries it needed,
and the verdict (does the peak fit the chip's HBM, and by how much not) that `python -m
dspark_jax.aot` exits with — the check that the paper's settings (SPEC §4: batch 512 × 4096,
512 anchors, γ 7; the serving round of §5.2–5.3) fit a pod slice.
"""

from __future__ import annotations

import re
from typing import Any

from dspark_jax.aot.topology import GiB


def memory_of(m: Any) -> dict[str, Any]:
    return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
            "generated_code": m.generated_code_size_in_bytes}


def _compile_time_oom(message: str) -> dict[str, Any] | None:
    """XLA's CompileTimeHbmOom ("HLO temporaries (47.84G) exceeds available HBM"): the
    temporaries it needed (arguments etc. unknown, counted as 0), or None for other errors."""
    m = re.search(r"temporaries \(([\d.]+)([KMGT])\)", message)
    if "RESOURCE_EXHAUSTED" not in message or m is None:
        return None
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": GiB, "T": 2 ** 40}[m.group(2)]
    return {"argument": 0, "output": 0, "alias": 0, "generated_code": 0,
            "temp": int(float(m.group(1)) * scale), "error": message.splitlines()[0][:300]}


def memory_and_kernels(lowered: Any, via_dump: bool = False) -> dict[str, Any]:
    """Compiles a lowered program → its per-chip byte counts (`memory_of`), or the temporaries
    of a compile-time HBM OOM (with `error`), and its Pallas kernels read off its optimized HLO:
    `pallas_kernels` (how many custom calls) and `kernel_gathers` (the collectives that feed a
    kernel's operands, `hlo_traffic.collectives_feeding_kernels`: empty where every kernel runs
    per device on its own shards). After a compile-time HBM OOM both are unknown (-1, []).
    `via_dump`: read the text off XLA's dump (`hlo_traffic.compile_with_text`; TPU programs)."""
    from dspark_jax.aot.hlo_traffic import (collectives_feeding_kernels, compile_with_text,
                                            pallas_kernels)

    try:
        compiled, text = compile_with_text(lowered, via_dump)
    except Exception as e:   # the TPU compiler refuses a program whose temporaries exceed HBM
        mem = _compile_time_oom(str(e))
        if mem is None:
            raise
        return mem | {"pallas_kernels": -1, "kernel_gathers": []}
    return memory_of(compiled.memory_analysis()) | {
        "pallas_kernels": len(pallas_kernels(text)),
        "kernel_gathers": collectives_feeding_kernels(text)}


def fmt_bytes(b: float) -> str:
    """Bytes as a fixed-width GiB (or MiB below 0.1 GiB) figure for the report tables."""
    return f"{b / GiB:8.2f} GiB" if abs(b) >= GiB / 10 else f"{b / 2**20:8.2f} MiB"


def verdict(report: dict[str, Any]) -> tuple[int, str]:
    """(exit code, message): 1 with the per-chip shortfall when the step does not fit."""
    need, have = report["peak_bytes_per_chip"], report["hbm_bytes_per_chip"]
    if need <= have:
        return 0, f"fits: {need / GiB:.2f} of {have / GiB:.2f} GiB per chip"
    return 1, (f"the step does not fit: {need / GiB:.2f} GiB per chip needed, {have / GiB:.2f} "
               f"GiB available (short by {(need - have) / GiB:.2f} GiB)")
