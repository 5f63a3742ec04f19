"""Load benchmark of the serving engine (paper §5.3–5.4, Figures 7 and 8 analogs).

Closed loop: for each concurrency c, an engine with c request slots decodes `--requests-per-slot`
× c prompts (a finished request's slot is refilled at once, so c requests stay in flight), for
each scheduler mode (default: every mode of `serving.modes.BUILTIN_MODES`, side by side: none,
fixed, threshold, algorithm1, production — the paper's §5.2 schedule alone — and adaptive, that
schedule plus our switch to plain decoding; `treeN`, e.g. `tree16`, is `fixed` drafting trees of
N nodes, `adaptive+tree32` adaptive sizing trees of up to 32 nodes, docs/TREES.md). Every
mode's engine is built, compiled and run once
over c prompts first (a served engine is warm: `adaptive` keeps what its policy learned there,
`serving.policy`); then `--repeats` measured passes run with the modes interleaved, the order
rotating each pass, so the machine's drift hits every mode alike. `--sequential` runs one mode
at a time instead and releases its compiled programs before the next mode compiles (every
mode's per-layer programs at once do not fit a 23 GB host at c = 4); compiled programs are
released between concurrencies either way.
Per (mode, c): aggregate output tok/s (median pass, each pass listed) and its ratio to `none`
at the same c, per-user tok/s (median and p10 of tokens / (finish − join)), mean verified
(admitted) draft tokens per request per round, τ, the fraction of rounds that ran the drafter
(`adaptive` skips it when plain decoding is expected to be faster), the drafter's time per
round and the seconds the engine spent profiling at start (SPS + drafter/plain-step costs; 0
when they came from the cache), and the mean WHOLE-round time per capacity bucket (draft +
schedule + verify + host bookkeeping). Per c: the PURE verification-step time per capacity
bucket — the engine's SPS(B) profile of the compiled ragged programs (ms per step; it must grow
with the bucket) — and how long that profiling took (`none` runs its own, drafter-free step).
The SPS cache is a fresh directory per run unless `--sps-cache-dir` is given, so the profiling
time is measured. Writes JSON, a markdown table (`<out>.md`) and two PNGs:
  * `<out>_fig7.png` — aggregate throughput against per-user tok/s, one curve per mode;
  * `<out>_fig8.png` — throughput and per-request verification budget against concurrency.

    # a trained drafter exported in DeepSpec's format (e.g. the default job's export)
    python -m dspark_jax.bench.load --target smollm2-135m-instruct --draft /work/runs/v1/export \
        --concurrency 1,2,4,8,16,32 --max-new-tokens 64 --out bench_load
    # a random-init DSpark drafter (plumbing only: its drafts are never accepted)
    python -m dspark_jax.bench.load --target smollm2-135m-instruct --draft random \
        --concurrency 1,2 --max-new-tokens 8 --requests-per-slot 1 --out /tmp/load_smoke
"""

from __future__ import annotations

import argparse
import os
import json
import time
from typing import Any, Iterator, Sequence

import numpy as np

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Give me three tips for writing clear commit messages.",
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the ocean.",
    "Summarise what a hash map is in two sentences.",
    "List the first ten square numbers.",
    "How do I reverse a string in JavaScript?",
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True,
                   help="embedded target name, HF directory, or a random-weight shape of "
                        "bench.common.SHAPES (e.g. qwen3-8b: synthetic prompts, no tokenizer)")
    p.add_argument("--draft", required=True,
                   help="DeepSpec-format drafter directory, or 'random' (random-init DSpark)")
    p.add_argument("--draft-layers", type=int, default=2, help="layers of a 'random' drafter")
    p.add_argument("--rank", type=int, default=64, help="Markov rank of a 'random' drafter")
    from dspark_jax.serving.modes import mode_names

    p.add_argument("--modes", default=",".join(mode_names()),
                   help="comma-separated scheduler modes, run side by side (default: all); "
                        "treeN: fixed with draft trees of N nodes; MODE+treeN: MODE sizing "
                        "trees of up to N nodes")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3,
                   help="measured passes per (mode, c), modes interleaved; the median is kept")
    p.add_argument("--sequential", action="store_true",
                   help="run the modes one after another, each mode's compiled programs "
                        "released before the next compiles (less memory; passes not "
                        "interleaved across modes)")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--explore", type=float, default=0.01,
                   help="adaptive: the fraction of plain-decoding time probes may cost")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--sampler", default="jax", choices=("jax", "pallas"))
    p.add_argument("--verifier", default="jax", choices=("jax", "pallas"))
    p.add_argument("--sps-cache-dir", default=None,
                   help="SPS profile cache (default: a fresh temporary directory per run)")
    p.add_argument("--out", default="bench_load", help="output prefix (.json, _fig7/_fig8.png)")
    return p.parse_args(argv)


def _prompts(target: Any, n: int) -> list[list[int]]:
    from dspark_jax.data.chat import render_prompt

    tok = target.tokenizer
    out = []
    for i in range(n):
        text = PROMPTS[i % len(PROMPTS)]
        if tok is None:
            out.append([(7 * i + j) % target.config.vocab_size for j in range(8 + i % 8)])
        else:
            # as evaluation and regeneration render prompts (Gemma4: the empty thought channel)
            out.append(render_prompt([{"role": "user", "content": text}], tok).tolist())
    return out


def _load_target(name: str, dtype: str) -> Any:
    """A real target (with its tokenizer), or a named random-weight shape (bench.common)."""
    from dspark_jax.bench.common import SHAPES, build_target
    from dspark_jax.models import load_target

    # build_target loads real targets without their tokenizer; the load benchmark wants it
    return build_target(name, dtype) if name in SHAPES else load_target(name, dtype=dtype)


def _load_draft(target: Any, spec: str, layers: int = 2, rank: int = 64) -> Any:
    from dspark_jax.models import init_draft, load_draft

    if spec != "random":
        return load_draft(spec, target=target)
    from dspark_jax.models.drafters.config import default_target_layer_ids

    # the default job's drafter (configs/smollm2_dspark.py): DSpark, block 7, taps by DeepSpec's
    # rule on SmolLM2's 30 layers, mask token 16 — clipped to the target at hand
    n = target.config.num_hidden_layers
    taps = tuple(x for x in default_target_layer_ids(30) if x < n - 1) or (0,)
    return init_draft(target, dict(model_type="dspark", num_draft_layers=layers, block_size=7,
                                   markov_rank=rank, target_layer_ids=taps,
                                   mask_token_id=min(16, target.config.vocab_size - 1)), seed=0)


def engine_mode(mode: str) -> tuple[str, int]:
    """A `--modes` entry → (scheduler, tree budget): `treeN` is the fixed scheduler drafting
    trees of N nodes, `MODE+treeN` scheduler MODE sizing trees of up to N nodes, any other
    entry a scheduler mode drafting chains."""
    scheduler, _, tree = mode.rpartition("+") if "+" in mode else ("fixed", "", mode)
    if not tree.startswith("tree"):
        return mode, 0
    try:
        return scheduler, int(tree[4:])
    except ValueError:
        raise ValueError(f"--modes {mode!r}: a tree mode is treeN or MODE+treeN, e.g. "
                         "adaptive+tree32") from None


def build_engine(target: Any, draft: Any, mode: str, c: int, prompts: list[list[int]],
                 a: argparse.Namespace) -> Any:
    """An engine with c slots for `mode`, compiled (warm-up) and run once over c prompts."""
    from dspark_jax.serving import Engine, EngineSettings

    scheduler, tree_budget = engine_mode(mode)
    settings = EngineSettings(max_requests=c, max_len=a.max_len, scheduler=scheduler,
                              tree_budget=tree_budget, threshold=a.threshold,
                              prefill_chunk=a.prefill_chunk, sampler=a.sampler,
                              verifier=a.verifier, sps_cache_dir=a.sps_cache_dir,
                              explore=a.explore)
    eng = Engine(target, draft if mode != "none" else None, settings=settings)
    eng.warmup(max(len(x) for x in prompts) + a.max_new_tokens)
    eng.generate(prompts[:c], max_new_tokens=a.max_new_tokens, temperature=a.temperature)
    return eng


def summarize_point(mode: str, c: int, n_prompts: int, runs: list[Any], eng: Any) -> dict[str, Any]:
    """One (mode, c) point from its repeated passes: aggregate tok/s is the median pass (each
    pass's figure listed), everything else pooled over the passes."""
    agg = [sum(len(t) for t in r.tokens) / r.wall_s for r in runs]
    costs = eng.profile_costs() if eng.draft is not None else {}
    per_user = [len(t) / max(p["finish_s"] - p["join_s"], 1e-9)
                for r in runs for t, p in zip(r.tokens, r.per_request)]
    rounds = [x for r in runs for x in r.rounds]
    terms = [t for r in runs for q in r.per_request for t in q["acceptance"]]
    by_bucket: dict[int, list[float]] = {}   # seconds per round (a plain call runs several)
    for x in rounds:
        by_bucket.setdefault(x["capacity"], []).extend([x["seconds"] / x["steps"]] * x["steps"])
    steps = sum(x["steps"] for x in rounds)
    return dict(
        mode=mode, concurrency=c, requests=n_prompts,
        output_tokens=sum(len(t) for t in runs[0].tokens), passes=len(runs),
        wall_s=float(np.median([r.wall_s for r in runs])),
        aggregate_tok_s=float(np.median(agg)), aggregate_tok_s_passes=[float(x) for x in agg],
        per_user_tok_s_median=float(np.median(per_user)),
        per_user_tok_s_p10=float(np.percentile(per_user, 10)),
        verified_per_request_round=float(sum(x["verified_tokens"] / x["active"]
                                             for x in rounds) / max(steps, 1)),
        tau=float(sum(terms) / max(len(terms), 1)), rounds=steps // len(runs),
        drafted_fraction=float(np.mean([x.get("drafted", mode != "none") for x in rounds])),
        draft_ms_per_round=1e3 * costs["draft"] if costs else 0.0,
        plain_step_ms=1e3 * costs["plain"] if costs else None,
        engine_profile_s=float(eng.profile_seconds + eng.cost_profile_seconds),
        round_ms_by_bucket={str(k): 1e3 * float(np.mean(v))
                            for k, v in sorted(by_bucket.items())},
        rounds_by_bucket={str(k): len(v) // len(runs) for k, v in sorted(by_bucket.items())})


def _release_programs() -> None:
    """Drop every compiled program JAX holds (its jit caches are process-wide and keyed by the
    graphdefs, so they outlive the engines that compiled them) and collect the engines."""
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


def run_concurrency(target: Any, draft: Any, modes: list[str], c: int, a: argparse.Namespace
                    ) -> Iterator[tuple[dict[str, Any], Any]]:
    """Every mode at concurrency c → (point, engine) in `modes` order, each engine alive only
    until the caller moves on. Interleaved (default): every engine is built and warmed first,
    then `a.repeats` passes run over the same prompts with the modes interleaved (the order
    rotates each pass), so machine drift hits every mode alike; every mode's programs are in
    memory at once. `a.sequential`: one mode at a time (build, warm, its passes), its programs
    released before the next mode compiles: for hosts where all modes' programs do not fit."""
    prompts = _prompts(target, c * a.requests_per_slot)

    def built(m: str) -> tuple[Any, float]:
        t0 = time.perf_counter()
        eng = build_engine(target, draft, m, c, prompts, a)
        return eng, time.perf_counter() - t0

    def passes(eng: Any) -> Any:
        return eng.generate(prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature)

    def point(m: str, runs: list[Any], eng: Any, build_s: float) -> dict[str, Any]:
        return dict(summarize_point(m, c, len(prompts), runs, eng), build_s=build_s)

    if a.sequential:
        for m in modes:
            eng, secs = built(m)
            runs = [passes(eng) for _ in range(a.repeats)]
            yield point(m, runs, eng, secs), eng
            del eng, runs
            _release_programs()
        return
    engines = {m: built(m) for m in modes}
    runs: dict[str, list[Any]] = {m: [] for m in modes}
    for rep in range(a.repeats):
        for m in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            runs[m].append(passes(engines[m][0]))
    for m in modes:
        eng, secs = engines.pop(m)
        yield point(m, runs.pop(m), eng, secs), eng
        del eng


def over_none(points: list[dict[str, Any]]) -> None:
    """Each point's aggregate tok/s over plain decoding's at its c (`over_none`; None where
    `none` did not run at that c)."""
    none = {p["concurrency"]: p["aggregate_tok_s"] for p in points if p["mode"] == "none"}
    for p in points:
        ref = none.get(p["concurrency"])
        p["over_none"] = p["aggregate_tok_s"] / ref if ref else None


def verify_profile(eng: Any, cache_dir: str) -> dict[str, Any]:
    """The pure verification-step time per capacity bucket: the SPS profile the engine made at
    start (algorithm1 / production / adaptive), else profiled here the same way (cached per c)."""
    secs, took = eng.bucket_seconds, eng.profile_seconds
    if secs is None:
        secs, took, _ = eng.profile_buckets(cache_dir)
    ms = [1e3 * secs[b] for b in sorted(secs)]
    return dict(step_ms_by_bucket={str(b): 1e3 * secs[b] for b in sorted(secs)},
                sps_profile_s=took, grows_with_bucket=bool(all(np.diff(ms) > 0)))


def headline(points: list[dict[str, Any]]) -> dict[str, float]:
    """Aggregate tok/s per (mode, c) as flat keys `<mode>@c<c>`, and `<mode>_over_none@c<c>`
    for every other mode where `none` ran too (the one-line summary the benchmark suite
    prints)."""
    out = {f"{p['mode']}@c{p['concurrency']}": p["aggregate_tok_s"] for p in points}
    for p in points:
        none = out.get(f"none@c{p['concurrency']}")
        if p["mode"] != "none" and none:
            out[f"{p['mode']}_over_none@c{p['concurrency']}"] = p["aggregate_tok_s"] / none
    return out


def load_markdown(result: dict[str, Any]) -> str:
    """The load table and the per-bucket verification times as markdown (for BENCHMARKS.md)."""
    rows = ["| c | mode | agg tok/s (passes) | × none | per-user tok/s median (p10) | "
            "verified/req/round | τ | drafted rounds | draft ms/round | engine profiling s | "
            "rounds | whole-round ms by bucket K |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        rb = ", ".join(f"{k}: {v:.0f}" for k, v in p["round_ms_by_bucket"].items())
        passes = "/".join(f"{x:.1f}" for x in p.get("aggregate_tok_s_passes", []))
        ratio = p.get("over_none")
        rows.append(f"| {p['concurrency']} | {p['mode']} | {p['aggregate_tok_s']:.1f}"
                    f"{f' ({passes})' if passes else ''} | "
                    f"{'–' if ratio is None else f'{ratio:.2f}'} | "
                    f"{p['per_user_tok_s_median']:.1f} ({p['per_user_tok_s_p10']:.1f}) | "
                    f"{p['verified_per_request_round']:.2f} | {p['tau']:.2f} | "
                    f"{100 * p['drafted_fraction']:.0f}% | {p['draft_ms_per_round']:.1f} | "
                    f"{p['engine_profile_s']:.2f} | {p['rounds']} | {rb} |")
    rows += ["", "| c | step | verification step ms by capacity bucket K | grows | "
             "SPS profiling s |", "|---|---|---|---|---|"]
    for key, v in result["verify_step"].items():
        c, _, kind = key.partition("/")
        ks = ", ".join(f"K={k}: {ms:.1f}" for k, ms in v["step_ms_by_bucket"].items())
        grows = ("n/a" if len(v["step_ms_by_bucket"]) < 2 else
                 "yes" if v["grows_with_bucket"] else "NO")
        rows.append(f"| {c} | {kind or 'speculative'} | {ks} | {grows} | "
                    f"{v['sps_profile_s']:.2f} |")
    return "\n".join(rows) + "\n"


def plots(points: list[dict[str, Any]], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({p["mode"] for p in points}, key=lambda m: [p["mode"] for p in points].index(m))
    f7, f8 = f"{out}_fig7.png", f"{out}_fig8.png"
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for m in modes:
        ps = sorted((p for p in points if p["mode"] == m), key=lambda p: p["concurrency"])
        ax.plot([p["per_user_tok_s_median"] for p in ps], [p["aggregate_tok_s"] for p in ps],
                "o-", label=m)
        for p in ps:
            ax.annotate(str(p["concurrency"]), (p["per_user_tok_s_median"], p["aggregate_tok_s"]),
                        fontsize=7)
    ax.set_xlabel("per-user tok/s (median)")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title("throughput vs per-user speed (labels: concurrency)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f7, dpi=120)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for m in modes:
        ps = sorted((p for p in points if p["mode"] == m), key=lambda p: p["concurrency"])
        cs = [p["concurrency"] for p in ps]
        a1.plot(cs, [p["aggregate_tok_s"] for p in ps], "o-", label=m)
        a2.plot(cs, [p["verified_per_request_round"] for p in ps], "o-", label=m)
    for a_, yl in ((a1, "aggregate output tok/s"), (a2, "verified draft tokens / request / round")):
        a_.set_xscale("log", base=2)
        a_.set_xlabel("concurrency")
        a_.set_ylabel(yl)
        a_.legend()
    fig.tight_layout()
    fig.savefig(f8, dpi=120)
    plt.close("all")
    return [f7, f8]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.repeats < 1:
        raise SystemExit(f"--repeats must be ≥ 1, got {a.repeats}")
    from dspark_jax.bench.common import device_name

    target = _load_target(a.target, a.dtype)
    draft = _load_draft(target, a.draft, a.draft_layers, a.rank)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not draft.config.has_confidence:
        modes = [m for m in modes if engine_mode(m)[0] in ("none", "fixed")]
    conc = [int(x) for x in a.concurrency.split(",")]
    if a.sps_cache_dir is None:   # fresh: the SPS profiling below is measured, not cached
        import tempfile

        a.sps_cache_dir = tempfile.mkdtemp(prefix="dspark_sps_")
    points, verify_s = [], {}
    t_all = time.perf_counter()
    for c in conc:
        t0 = time.perf_counter()
        at_c = []
        for point, eng in run_concurrency(target, draft, modes, c, a):
            m = point["mode"]
            at_c.append(point)
            # verification step per bucket: once per c for the drafting modes (one program),
            # separately for "none" (its own drafter-free program); read while the engine lives
            vkey = f"{c}/plain (none)" if m == "none" else str(c)
            if vkey not in verify_s:
                verify_s[vkey] = verify_profile(eng, a.sps_cache_dir)
            del eng
        over_none(at_c)
        for point in at_c:
            spread = "/".join(f"{x:.1f}" for x in point["aggregate_tok_s_passes"])
            ratio = point["over_none"]
            print(f"c={c:3d} {point['mode']:10s} agg {point['aggregate_tok_s']:8.1f} tok/s "
                  f"({spread})  x none {'-' if ratio is None else f'{ratio:.2f}'}  "
                  f"per-user {point['per_user_tok_s_median']:7.1f} "
                  f"(p10 {point['per_user_tok_s_p10']:.1f})"
                  f"  verified/req/round {point['verified_per_request_round']:.2f}  "
                  f"tau {point['tau']:.2f}  drafted {100 * point['drafted_fraction']:.0f}%  "
                  f"draft {point['draft_ms_per_round']:.1f} ms/round", flush=True)
        for vkey in (f"{c}/plain (none)", str(c)):
            v = verify_s.get(vkey)
            if v is not None:
                print(f"c={c:3d} {'none' if '/' in vkey else 'speculative'} verification step "
                      "per bucket: " + ", ".join(f"K={k}: {ms:.1f} ms"
                                                 for k, ms in v["step_ms_by_bucket"].items())
                      + f" (SPS profiling {v['sps_profile_s']:.2f} s"
                      + ("" if v["grows_with_bucket"] or len(v["step_ms_by_bucket"]) < 2
                         else "; does NOT grow with the bucket") + ")", flush=True)
        points += at_c
        _release_programs()   # the next c compiles its own programs; these are not needed
        print(f"c={c:3d} done in {time.perf_counter() - t0:.0f} s", flush=True)
    result = dict(device=device_name(), target=a.target, draft=a.draft,
                  gamma=int(draft.config.num_drafts), settings=vars(a), points=points,
                  verify_step=verify_s, total_s=time.perf_counter() - t_all,
                  headline=headline(points))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    result["figures"] = plots(points, a.out)
    with open(f"{a.out}.json", "w") as f:
        json.dump(result, f, indent=2)
    with open(f"{a.out}.md", "w") as f:
        f.write(load_markdown(result))
    print(load_markdown(result))
    print(f"wrote {a.out}.json, {a.out}.md, {', '.join(result['figures'])}")
    return result


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
