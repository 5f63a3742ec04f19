"""Plain decoding through the serving engine against the on-device loop (the bar:
the engine's `scheduler="none"` at ≥ 0.9× `autoregressive_generate`'s tok/s at batch 1 and 16).

Both decode the same prompts greedily to the same length (no stop tokens, so every request
runs `--max-new-tokens`); each is warmed up once (compilation) and timed over `--repeats`
passes (median). The outputs must be identical token for token; the table gives tok/s, ms per
step and the engine's ratio to the loop.

Example:
  python -m dspark_jax.bench.plain_decode --target smollm2-135m-instruct --dtype float32 \
      --batches 1,16 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import numpy as np

from dspark_jax.bench.common import build_target, device_name, host_facts, median, print_table, \
    save_json
from dspark_jax.decoding.autoregressive import autoregressive_generate
from dspark_jax.serving import Engine, EngineSettings


def _prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(batch)]


def _timed(fn, repeats: int) -> tuple[float, Any]:
    out = fn()   # compilation
    secs = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        out = fn()
        secs.append(time.perf_counter() - t0)
    return median(secs), out


def time_both(target: Any, prompts: list[list[int]], max_new: int, repeats: int,
              steps_per_call: int) -> tuple[float, Any, float, Any]:
    """`autoregressive_generate` and the `none` engine on the same prompts (no stop tokens,
    exactly `max_new` tokens each), each warmed up once, median of `repeats` timed runs.
    → (loop s, loop tokens, engine s, engine result)."""
    longest = max(map(len, prompts))
    ar_s, ar_out = _timed(lambda: autoregressive_generate(
        target, prompts, max_new_tokens=max_new, stop_token_ids=[]), repeats)
    eng = Engine(target, None, settings=EngineSettings(
        scheduler="none", max_requests=len(prompts),
        max_len=-(-(longest + max_new + 2) // 64) * 64, stop_token_ids=[],
        plain_steps_per_call=steps_per_call, prefill_chunk=max(128, longest)))
    eng_s, eng_res = _timed(lambda: eng.generate(prompts, max_new_tokens=max_new), repeats)
    return ar_s, ar_out, eng_s, eng_res


def measure(target: Any, batch: int, prompt_len: int, max_new: int, repeats: int,
            steps_per_call: int) -> dict[str, Any]:
    prompts = _prompts(target.config.vocab_size, batch, prompt_len)
    ar_s, ar_out, eng_s, eng_res = time_both(target, prompts, max_new, repeats, steps_per_call)
    tokens = batch * max_new
    return dict(batch=batch, prompt_tokens=prompt_len, max_new_tokens=max_new,
                autoregressive_s=ar_s, engine_s=eng_s,
                autoregressive_tok_s=tokens / ar_s, engine_tok_s=tokens / eng_s,
                ratio=ar_s / eng_s, identical=eng_res.tokens == ar_out,
                engine_calls=len(eng_res.rounds))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="a named shape (random weights) or a checkpoint directory / name")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps-per-call", type=int, default=16,
                   help="the engine's plain_steps_per_call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    target = build_target(a.target, a.dtype)
    rows, results = [], []
    for b in (int(x) for x in a.batches.split(",") if x.strip()):
        r = measure(target, b, a.prompt_tokens, a.max_new_tokens, a.repeats, a.steps_per_call)
        results.append(r)
        rows.append((f"batch {b}", f"engine {r['engine_tok_s']:.1f} tok/s · loop "
                     f"{r['autoregressive_tok_s']:.1f} tok/s · ratio {r['ratio']:.2f} (bar ≥ 0.9)"
                     f" · identical {r['identical']} · {r['engine_calls']} engine calls"))
    print_table(rows, f"plain decoding, {a.target} {a.dtype} on {device_name()}")
    save_json(dict(device=device_name(), host=host_facts(), args=vars(a), results=results),
              a.json)
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
