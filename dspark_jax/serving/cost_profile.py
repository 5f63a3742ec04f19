"""The cost profile: what a verification step, a drafting call and a plain decoding step cost
on this machine (paper §3.2.2, Algorithm 1's table SPS(B); §5.2; SPEC §8–9). The one profiler
of the package: the engine, the benchmarks and the tests time device calls here.

The scheduler's objective Θ = τ · SPS(B) needs the target's verification steps per second at
B batch tokens. With ragged verification the program that runs for B tokens is the one of the
smallest capacity bucket ≥ B, so SPS is a step function over the buckets (`sps_table`): it is
measured on exactly those compiled programs, once per engine. The adaptive policy
(`serving.policy`) also needs the drafter's seconds per round and the plain step's. Every
profile is a set of named calls timed round-robin (`profile_calls`) and cached on disk
(`load_or_profile`), keyed by the device kind, the target's shapes and the buckets (`cache_key`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time
from typing import Any, Callable, Hashable, Mapping, Sequence, TypeVar

import jax
import numpy as np

ENV_CACHE_DIR = "DSPARK_JAX_CACHE_DIR"
K = TypeVar("K", bound=Hashable)


def default_cache_dir() -> pathlib.Path:
    """~/.cache/dspark_jax/sps (or $DSPARK_JAX_CACHE_DIR/sps)."""
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "dspark_jax")
    return pathlib.Path(root) / "sps"


def capacity_buckets(num_slots: int, gamma: int, buckets: Sequence[int] | None = None
                     ) -> tuple[int, ...]:
    """The static token capacities of the verification step: by default R, 2R, 4R, R(γ+1)
    (those ≤ R(γ+1)), rounded up to a multiple of 8 above 8. A given set must cover R(γ+1)
    and may not go below R (every active request verifies at least its anchor)."""
    R, top = int(num_slots), int(num_slots) * (int(gamma) + 1)
    if buckets is None:
        cand = {R, 2 * R, 4 * R, top}
        rnd = {min(top, ((c + 7) // 8) * 8) if c > 8 else c for c in cand if c <= top}
        return tuple(sorted(rnd | {top}))
    out = sorted({int(b) for b in buckets})
    if not out or out[0] < R:
        raise ValueError(f"capacity_buckets {out}: a capacity smaller than the number of "
                         f"request slots (max_requests={R}) cannot hold every anchor")
    if out[-1] < top:
        out.append(top)
    return tuple(out)


def bucket_for(buckets: Sequence[int], n_tokens: int) -> int:
    for b in buckets:
        if n_tokens <= b:
            return int(b)
    raise ValueError(f"{n_tokens} tokens exceed the largest capacity bucket {buckets[-1]}")


def sps_table(buckets: Sequence[int], seconds: Mapping[int, float]) -> np.ndarray:
    """sps[B] for B = 0..max bucket: 1 / (time of the smallest bucket ≥ B)."""
    top = int(max(buckets))
    bs = sorted(int(b) for b in buckets)
    # timing noise must not make a larger bucket look faster: running max of the seconds
    secs = np.maximum.accumulate([float(seconds[b]) for b in bs])
    table = np.zeros((top + 1,), np.float32)
    for B in range(top + 1):
        table[B] = 1.0 / max(float(secs[bs.index(bucket_for(bs, max(B, 1)))]), 1e-12)
    return table


def cache_key(target_cfg: Any, dtype: Any, num_slots: int, max_len: int,
              buckets: Sequence[int], extra: Mapping[str, Any] | None = None) -> str:
    """Disk-cache key: device kind, target shapes, dtype, slots, max_len, buckets (+ `extra`,
    e.g. the drafter's shapes for its per-round cost)."""
    dev = jax.devices()[0]
    shape = {f: getattr(target_cfg, f, None) for f in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim")}
    blob = json.dumps(dict(platform=dev.platform, kind=getattr(dev, "device_kind", ""),
                           shape=shape, dtype=str(dtype), slots=int(num_slots),
                           max_len=int(max_len), buckets=[int(b) for b in buckets],
                           **({"extra": dict(extra)} if extra else {})),
                      sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:20]


def time_call(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
              timer: Callable[[], float] = time.perf_counter) -> list[float]:
    """Wall seconds of each of `repeats` calls of `fn()`, blocked on its result, after `warmup`
    untimed calls (compilation)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(max(int(repeats), 1)):
        t0 = timer()
        jax.block_until_ready(fn())
        out.append(timer() - t0)
    return out


def profile_calls(calls: Mapping[K, Callable[[], Any]], *, repeats: int = 3, warmup: int = 1,
                  timer: Callable[[], float] = time.perf_counter) -> dict[K, float]:
    """Median seconds of each call (blocked on its result). Every call runs `warmup` times
    untimed first (compilation), then the timed calls go round-robin over the calls, `repeats`
    rounds, so that the machine's drift hits every call alike instead of bending the profile."""
    if repeats < 1:
        raise ValueError(f"repeats must be ≥ 1, got {repeats}")
    for fn in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[K, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for k, fn in calls.items():
            t0 = timer()
            jax.block_until_ready(fn())
            times[k].append(timer() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def load_or_profile(key: str, cache_dir: str | os.PathLike | None,
                    calls: Mapping[K, Callable[[], Any]], *, repeats: int = 3
                    ) -> tuple[dict[K, float], float, bool]:
    """Seconds of each call (`profile_calls`: e.g. the verification step per capacity bucket,
    or the drafter's round and the plain step) from the disk cache entry `key`, else profiled
    and written there. → (seconds by call, profiling wall seconds (0 if cached), from_cache)."""
    path = pathlib.Path(cache_dir or default_cache_dir()) / f"{key}.json"
    names = {str(k): k for k in calls}
    if path.is_file():
        try:
            saved = json.loads(path.read_text())["seconds"]
            if set(saved) == set(names):
                return {names[n]: float(v) for n, v in saved.items()}, 0.0, True
        except (ValueError, KeyError, OSError, TypeError, AttributeError):
            pass   # a damaged cache entry is re-profiled
    t0 = time.perf_counter()
    secs = profile_calls(calls, repeats=repeats)
    took = time.perf_counter() - t0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"seconds": {str(k): v for k, v in secs.items()},
                                    "profile_s": took, "device": str(jax.devices()[0])}))
    except OSError:
        pass   # a read-only cache dir only costs a re-profile next time
    return secs, took, False
