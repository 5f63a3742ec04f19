"""One-shot benchmark suite: every benchmark of dspark_jax.bench in one process, one JSON and one
markdown table (the accelerator check a session with a lent GPU runs once).

`python -m dspark_jax.bench.suite --preset {gpu-h200,cpu-smoke} [--out DIR]`

Runs the decode-step (HBM floor, ../shared/docs/PERFORMANCE.md), speculative-round (round /
plain step and the sequential stage share) and drafter training-step benchmarks, and the serving
load benchmark (`dspark_jax.bench.load`: `none` / `fixed` / `adaptive` under concurrent requests
with a random-init DSpark drafter, whose drafts are rejected, so `adaptive` must learn to stop
drafting and stay near `none`; its JSON and PNGs go to `<out>/load*`). A benchmark that is not
importable is listed as skipped; one that fails is recorded with its error and the others still run.
`gpu-h200`: the Qwen3-8B shape with random bf16 weights at context 4096 (sized to fit a lent
H200's device-time budget); `cpu-smoke`: SmolLM2-135M at tiny sizes (a quick run on a small CPU
host).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import time
import traceback
from typing import Any

PRESETS: dict[str, dict[str, list[str]]] = {
    "gpu-h200": {
        "decode_step": ["--target", "qwen3-8b", "--batch", "1", "--context", "4096",
                        "--steps", "64", "--repeats", "5", "--bandwidth-gbs", "4300"],
        "spec_round": ["--target", "qwen3-8b", "--batch", "1", "--context", "4096",
                       "--gamma", "7", "--draft-layers", "5", "--rank", "256",
                       "--rounds", "32", "--repeats", "3"],
        "train_step": ["--target", "qwen3-4b", "--dtype", "bfloat16", "--batch", "4",
                       "--seq", "4096", "--draft-layers", "5", "--anchors", "512",
                       "--anchor-chunk", "64", "--gamma", "7", "--rank", "256",
                       "--repeats", "3", "--peak-tflops", "989"],
        "load": ["--target", "qwen3-8b", "--dtype", "bfloat16", "--draft", "random",
                 "--draft-layers", "5", "--rank", "256", "--modes", "none,fixed,production,adaptive",
                 "--concurrency", "1,8,32", "--max-new-tokens", "32", "--requests-per-slot", "1",
                 "--repeats", "1", "--max-len", "1024", "--out", "{out}/load"],
    },
    "cpu-smoke": {
        "decode_step": ["--batch", "1", "--context", "128", "--steps", "4", "--repeats", "1",
                        "--dtype", "float32"],
        "spec_round": ["--batch", "1", "--context", "128", "--gamma", "3", "--draft-layers",
                       "1", "--rank", "16", "--rounds", "2", "--repeats", "1",
                       "--dtype", "float32", "--no-pallas-rows"],   # interpreted on CPU: slow
        "train_step": ["--batch", "2", "--seq", "128", "--draft-layers", "1", "--anchors", "8",
                       "--anchor-chunk", "8", "--gamma", "3", "--rank", "16", "--repeats", "1"],
        "load": ["--target", "smollm2-135m-instruct", "--draft", "random", "--draft-layers", "1",
                 "--rank", "16", "--modes", "none,adaptive", "--concurrency", "1,2",
                 "--max-new-tokens", "8", "--requests-per-slot", "1", "--repeats", "1",
                 "--max-len", "128", "--out", "{out}/load"],
    },
}

# the headline figure of each benchmark for the table: (result key, label, format)
HEADLINES = {
    "decode_step": [("ms_per_step", "decode step ms", "{:.3f}"),
                    ("ratio_to_floor", "× HBM floor", "{:.2f}")],
    "spec_round": [("round_ms", "round ms", "{:.3f}"), ("round_over_step", "round / step", "{:.3f}"),
                   ("sequential_share", "sequential share", "{:.2%}")],
    "train_step": [("step_s", "step s", "{:.3f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                   ("mfu", "MFU", "{:.1%}")],
}


def run_one(name: str, argv: list[str]) -> dict[str, Any]:
    """Runs `dspark_jax.bench.<name>.main(argv)`; an error is recorded, not raised."""
    t0 = time.perf_counter()
    try:
        mod = importlib.import_module(f"dspark_jax.bench.{name}")
    except ImportError as e:
        return {"status": "skipped", "reason": f"dspark_jax.bench.{name} not importable: {e}"}
    try:
        result = mod.main(argv)
        status = {"status": "ok", "result": result}
    except Exception as e:  # keep going: one broken benchmark must not hide the others
        status = {"status": "error", "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc(limit=8)}
    status["wall_s"] = round(time.perf_counter() - t0, 1)
    status["argv"] = argv
    return status


def markdown(preset: str, results: dict[str, dict[str, Any]], device: str) -> str:
    lines = [f"### bench suite `{preset}` on {device}", "", "| benchmark | status | wall s | figures |",
             "|---|---|---|---|"]
    for name, r in results.items():
        figs = ""
        if r["status"] == "ok":
            res = r["result"] or {}
            figs = ", ".join(f"{label} {fmt.format(res[key])}"
                             for key, label, fmt in HEADLINES.get(name, [])
                             if isinstance(res.get(key), (int, float)))
            # a benchmark may also hand over flat `headline` figures (load: tok/s per mode@c)
            figs = ", ".join([figs] * bool(figs) + [f"{k} {v:.3g}" for k, v in
                                                    (res.get("headline") or {}).items()])
        else:
            figs = r.get("reason") or r.get("error", "")
        lines.append(f"| {name} | {r['status']} | {r.get('wall_s', '')} | {figs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", default="bench_suite", help="directory for suite.json / suite.md")
    p.add_argument("--only", default="", help="comma-separated subset of the benchmarks")
    a = p.parse_args(argv)
    import jax

    from dspark_jax.bench.common import device_name

    only = {s for s in a.only.split(",") if s}
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = {name: run_one(name, [x.replace("{out}", str(out)) for x in args])
               for name, args in PRESETS[a.preset].items() if not only or name in only}
    device = device_name()
    summary = {"preset": a.preset, "device": device, "jax": jax.__version__,
               "wall_s": round(time.perf_counter() - t0, 1), "benchmarks": results}
    (out / "suite.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    table = markdown(a.preset, results, device)
    (out / "suite.md").write_text(table)
    print("\n" + table + f"\ntotal {summary['wall_s']} s; {out / 'suite.json'}", flush=True)
    return summary


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
