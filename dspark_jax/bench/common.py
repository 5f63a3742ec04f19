"""Shared benchmark plumbing: named target shapes, random-weight targets, host facts (the device
calls are timed by `serving.cost_profile.time_call`, the package's one timer).

Dense-model speed does not depend on weight values, so the GPU benchmarks use random bf16
weights created directly on the device (PERFORMANCE.md).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import jax
import numpy as np
from flax import nnx

from dspark_jax.models.config import DecoderConfig, RopeConfig
from dspark_jax.models.decoder import create_target
from dspark_jax.models.target import Target, load_target, resolve_dtype

SHAPES = {
    "qwen3-4b": DecoderConfig(family="qwen3", vocab_size=151936, hidden_size=2560,
                              intermediate_size=9728, num_hidden_layers=36,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
                              tie_word_embeddings=True, qk_norm=True,
                              max_position_embeddings=40960),
    "qwen3-8b": DecoderConfig(family="qwen3", vocab_size=151936, hidden_size=4096,
                              intermediate_size=12288, num_hidden_layers=36,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
                              tie_word_embeddings=False, qk_norm=True,
                              max_position_embeddings=40960),
}


def build_target(name: str, dtype: str = "bfloat16", seed: int = 0) -> Target:
    """A named random-weight shape (created on device) or a real target by name/path."""
    if name in SHAPES:
        cfg = SHAPES[name]
        dt = resolve_dtype(dtype)

        @jax.jit
        def make():
            return nnx.split(create_target(cfg, seed, dt, dt))[1]

        graphdef = nnx.graphdef(nnx.eval_shape(lambda: create_target(cfg, seed, dt, dt)))
        return Target(config=cfg, graphdef=graphdef, state=make(), name=name)
    return load_target(name, dtype=dtype, with_tokenizer=False)


def weight_bytes(target: Target) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(target.state))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')} x{jax.device_count()}"


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
    """Writes a benchmark's result dict when `--json PATH` was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def print_table(rows: list[tuple[str, str]], title: str) -> None:
    w = max(len(k) for k, _ in rows)
    print(f"\n{title}\n" + "-" * (w + 24))
    for k, v in rows:
        print(f"{k.ljust(w)}  {v}")
