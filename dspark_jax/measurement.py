"""What a measurement reports beside its figures: the host a CPU figure was taken on (processor,
logical CPUs, memory-copy bandwidth, CPU time stolen by the hypervisor during the run), a
two-column table, the result as JSON. Used by the benchmarks (`bench/`) and by llama.cpp's
consumer check (`interop/llamacpp_loop.py`), which times both loops."""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np


def _cpu_times() -> list[int] | None:
    """The aggregate `cpu` line of /proc/stat (user nice system idle iowait irq softirq steal …)
    in clock ticks; None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in first[1:]] if first and first[0] == "cpu" else None


_STEAL = 7  # index of "steal" among /proc/stat's cpu fields


class StealMeter:
    """Share of CPU time the hypervisor gave to other guests ("steal") between construction and
    `fraction()`, so CPU figures taken on different days say how contended the VM was. None
    where /proc/stat is missing."""

    def __init__(self) -> None:
        self._t0 = _cpu_times()

    def fraction(self) -> float | None:
        t1 = _cpu_times()
        if self._t0 is None or t1 is None or len(t1) <= _STEAL:
            return None
        delta = [b - a for a, b in zip(self._t0, t1)]
        total = sum(delta[:_STEAL + 1])  # guest time is already counted in user/nice
        return delta[_STEAL] / total if total > 0 else None


def memory_copy_gbs(megabytes: int = 256, repeats: int = 3) -> float:
    """Memory bandwidth one numpy copy reaches now (GB/s, bytes read + written, best of
    `repeats`): a batch-32 decode step on CPU reads every weight and the whole KV cache."""
    src = np.ones(megabytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def cpu_model() -> str:
    """The processor's name (/proc/cpuinfo's `model name`, else `platform.processor()`)."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else (platform.processor() or platform.machine())


def host_facts() -> dict:
    """What a CPU figure depends on besides the code: processor, logical CPUs, copy bandwidth."""
    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(),
            "memory_copy_gbs": round(memory_copy_gbs(), 1)}


def save_json(result: dict, path: str | None) -> None:
    """Writes a result dict when `--json PATH` was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def print_table(rows: list[tuple[str, str]], title: str) -> None:
    w = max(len(k) for k, _ in rows)
    print(f"\n{title}\n" + "-" * (w + 24))
    for k, v in rows:
        print(f"{k.ljust(w)}  {v}")
