"""Decode-step benchmark of a target (../shared/docs/PERFORMANCE.md's first bar).

Times one batched decode step at batch B and context C from inside an on-device
`lax.while_loop` (host dispatch excluded) and prints the ratio to the HBM floor
(weight bytes / bandwidth). Example:
  python -m dspark_jax.bench.decode_step --target qwen3-4b --batch 1 --context 1024 \
      --bandwidth-gbs 4300
  python -m dspark_jax.bench.decode_step --target smollm2-135m-instruct --dtype float32
"""

from __future__ import annotations

import argparse
from typing import Sequence

import jax.numpy as jnp

from dspark_jax.bench.common import (build_target, device_name, median, print_table, save_json,
                                     weight_bytes)
from dspark_jax.decoding.autoregressive import ARState, ar_decode, row_key_data
from dspark_jax.serving.cost_profile import time_call


def make_state(target, batch: int, context: int, steps: int) -> ARState:
    cache = target.init_cache(batch, context + steps + 8)
    cache = cache.with_lengths(jnp.full((batch,), context, jnp.int32))
    return ARState(cache=cache, last_token=jnp.ones((batch,), jnp.int32),
                   out=jnp.zeros((batch, steps + 1), jnp.int32),
                   num_out=jnp.ones((batch,), jnp.int32),
                   done=jnp.zeros((batch,), bool), key_data=row_key_data(0, batch),
                   steps=jnp.zeros((), jnp.int32))


def run(target_name: str, batch: int, context: int, steps: int, dtype: str,
        bandwidth_gbs: float, repeats: int) -> dict:
    target = build_target(target_name, dtype).decoding_layout()
    no_stop = jnp.asarray([-1], jnp.int32)
    temp = jnp.asarray(0.0)

    def run_steps(n: int):
        s = make_state(target, batch, context, 2 * steps)
        return ar_decode(target.graphdef, target.state, s, temp, no_stop, num_steps=n).out

    # slope between n and 2n on-device steps: cancels dispatch, state set-up and loop entry
    t1 = median(time_call(lambda: run_steps(steps), repeats=repeats))
    t2 = median(time_call(lambda: run_steps(2 * steps), repeats=repeats))
    step_s = max(t2 - t1, 1e-9) / steps
    wbytes = weight_bytes(target)
    floor_s = wbytes / (bandwidth_gbs * 1e9)
    return {"target": target_name, "device": device_name(), "dtype": dtype, "batch": batch,
            "context": context, "steps_timed": steps, "ms_per_step": step_s * 1e3,
            "weight_gb": wbytes / 1e9, "bandwidth_gbs": bandwidth_gbs,
            "hbm_floor_ms": floor_s * 1e3, "ratio_to_floor": step_s / floor_s}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (`bench.suite`'s presets and the GPU check pass theirs)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="qwen3-4b / qwen3-8b (random weights) or a real target")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bandwidth-gbs", type=float, default=4300.0,
                   help="memory bandwidth for the floor (H200: 4300 GB/s)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the result here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    r = run(a.target, a.batch, a.context, a.steps, a.dtype, a.bandwidth_gbs, a.repeats)
    save_json(r, a.json)
    print_table([
        ("target / dtype", f"{r['target']} / {r['dtype']}"),
        ("device", r["device"]),
        ("batch × context", f"{r['batch']} × {r['context']}"),
        ("weights", f"{r['weight_gb']:.3f} GB"),
        ("HBM floor", f"{r['hbm_floor_ms']:.3f} ms @ {r['bandwidth_gbs']:.0f} GB/s"),
        ("decode step", f"{r['ms_per_step']:.3f} ms"),
        ("ratio to floor", f"{r['ratio_to_floor']:.2f}x (bar ≤ 1.25x on GPU)"),
    ], "decode step benchmark")
    return r


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
