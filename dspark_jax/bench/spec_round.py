"""Speculative round vs plain decode step (issue: speculative engine §7; PERFORMANCE.md bars).

Reports, from one run on one device:
  * the serving engine's round (`dspark_jax.serving.Engine`, the host-stepped path users run:
    draft block + sequential sampling + scheduling + ragged verification of γ+1 tokens per
    request + commit + host bookkeeping; median over `--rounds` rounds with `--batch` requests
    of `--context` tokens in flight) under `fixed` (ℓ = γ) against the same engine's plain
    decode step (`none`), and their ratio (bar ≤ 1.15 at γ = 7); rows with
    `sampler="pallas"` / `verifier="pallas"` (on CPU the kernels are interpreted: those rows
    are labelled and are not kernel timings);
  * the sequential (Markov) stage's share of the round (bar ≤ 2%);
  * recompilations of the engine's round in steady state (bar: zero);
  * the Pallas kernels (pallas_kernels/markov_sample, pallas_kernels/verify) against the pure-JAX
    paths they replace (decoding/markov_sampling.py, decoding/acceptance_rule.py), at the round's B, γ, V and r. Kernels are timed only
    on GPU (Triton) and TPU (Mosaic): on CPU they could only run in interpret mode, which says
    nothing about speed, so the table shows the pure-JAX time and marks the kernel "n/a".
Example:
  python -m dspark_jax.bench.spec_round --target qwen3-4b --context 1024 --gamma 7
  python -m dspark_jax.bench.spec_round --target smollm2-135m-instruct --dtype float32
  python -m dspark_jax.bench.spec_round --target qwen3-4b --kernels-only --batch 16
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.bench.common import build_target, device_name, median, print_table, save_json
from dspark_jax.decoding.sampling import sample_probs
from dspark_jax.models import init_draft
from dspark_jax.models.drafters.config import default_target_layer_ids
from dspark_jax.serving.cost_profile import time_call


class CompileCounter:
    """Counts XLA backend compilations through jax.monitoring."""

    def __init__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, *_a, **_k) -> None:
        if "backend_compile" in event:
            self.n += 1


def kernel_timings(batch: int, gamma: int, vocab: int, rank: int, dtype: str,
                   temperature: float, repeats: int) -> dict:
    """Seconds per call of the Markov sampler and the verifier: pure JAX vs the Pallas kernel.

    The kernel entries are None on CPU (interpret mode only; not a timing).
    """
    from dspark_jax.decoding.acceptance_rule import rejection_verify_with_uniforms
    from dspark_jax.decoding.markov_sampling import sequential_markov_sample_with_uniforms
    from dspark_jax.models.target import resolve_dtype
    from pallas_kernels.markov_sample import markov_sample
    from pallas_kernels.verify import verify

    B, G, V, r = batch, gamma, vocab, rank
    dt = resolve_dtype(dtype)
    ks = jax.random.split(jax.random.key(0), 8)
    u = jax.random.uniform(ks[0], (B, G))
    U = (2.0 * jax.random.normal(ks[1], (B, G, V))).astype(dt)
    w1 = jax.random.normal(ks[2], (V, r)).astype(dt)
    w2 = (0.1 * jax.random.normal(ks[3], (V, r))).astype(dt)
    anchor = jax.random.randint(ks[4], (B,), 0, V)
    temp = jnp.full((B,), temperature, jnp.float32)
    tp = jax.nn.softmax(jax.random.normal(ks[5], (B, G + 1, V)), -1)
    dp = jax.nn.softmax(jax.random.normal(ks[6], (B, G, V)), -1)
    drafts = jax.random.randint(ks[7], (B, G), 0, V)
    ell = jnp.full((B,), G, jnp.int32)
    su = u[:, 0]
    on_accel = jax.default_backend() in ("gpu", "tpu")

    def t(fn, *args):
        f = jax.jit(fn)
        return median(time_call(lambda: f(*args), repeats=repeats))

    out = {"batch": B, "gamma": G, "vocab": V, "rank": r, "dtype": dtype,
           "backend": jax.default_backend(),
           "markov_jax_ms": 1e3 * t(sequential_markov_sample_with_uniforms, u, U, w1, w2, anchor,
                                    temp),
           "verify_jax_ms": 1e3 * t(rejection_verify_with_uniforms, u, su, tp, dp, drafts, ell),
           "markov_kernel_ms": None, "verify_kernel_ms": None}
    if on_accel:
        out["markov_kernel_ms"] = 1e3 * t(markov_sample, u, U, w1, w2, anchor, temp)
        out["verify_kernel_ms"] = 1e3 * t(verify, u, su, tp, dp, drafts, ell)
    return out


def kernel_rows(k: dict) -> list[tuple[str, str]]:
    note = ("" if k["markov_kernel_ms"] is not None else
            "n/a on CPU: kernels run only in interpret mode here (not a timing); "
            "run on GPU (Triton) or TPU (Mosaic)")
    fmt = lambda x: note if x is None else f"{x:.3f} ms"  # noqa: E731
    ratio = lambda a, b: "" if a is None else f" ({b / a:.2f}× the pure-JAX speed)"  # noqa: E731
    return [
        ("shape", f"B={k['batch']}, γ={k['gamma']}, V={k['vocab']}, r={k['rank']}, "
                  f"{k['dtype']} on {k['backend']}"),
        ("Markov sampling, pure JAX", f"{k['markov_jax_ms']:.3f} ms"),
        ("Markov sampling, Pallas", fmt(k["markov_kernel_ms"])
         + ratio(k["markov_kernel_ms"], k["markov_jax_ms"])),
        ("verification, pure JAX", f"{k['verify_jax_ms']:.3f} ms"),
        ("verification, Pallas", fmt(k["verify_kernel_ms"])
         + ratio(k["verify_kernel_ms"], k["verify_jax_ms"])),
    ]


ENGINE_ROWS = (("jax", "jax"), ("pallas", "jax"), ("jax", "pallas"))


def engine_rounds(target, draft, B: int, C: int, a: argparse.Namespace,
                  counter: CompileCounter) -> dict:
    """Round times of `dspark_jax.serving.Engine` (the path users run) with B requests of C
    prompt tokens in flight: `none` (plain decoding through the engine) and `fixed` (ℓ = γ
    for every request) with the pure-JAX and the Pallas sampler / verifier. On CPU the
    Pallas rows run the kernels in interpret mode: their time is not a kernel timing."""
    from dspark_jax.serving import Engine

    g = draft.config.num_drafts
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, target.config.vocab_size - 1, C)) for _ in range(B)]
    max_len = C + (a.rounds + 2) * (g + 1) + 2 * g + 8
    kw = dict(max_requests=B, max_len=max_len, prefill_chunk=min(C * B, 512),
              stop_token_ids=[])
    interpreted = jax.default_backend() not in ("gpu", "tpu")

    def timed(eng, n):
        return median(eng.round_seconds(prompts, n, temperature=a.temperature))

    plain = timed(Engine(target, None, scheduler="none", **kw), a.rounds)
    rows, recompiles = [], 0
    for sampler, verifier in ENGINE_ROWS:
        if "pallas" in (sampler, verifier) and a.no_pallas_rows:
            continue
        pallas = "pallas" in (sampler, verifier)
        n = min(a.rounds, 3) if pallas and interpreted else a.rounds
        eng = Engine(target, draft, scheduler="fixed", sampler=sampler, verifier=verifier,
                     **kw)
        eng.round_seconds(prompts, 1, temperature=a.temperature)   # compile every program
        before = counter.n
        sec = timed(eng, n)
        if (sampler, verifier) == ("jax", "jax"):
            recompiles = counter.n - before
        rows.append(dict(sampler=sampler, verifier=verifier, round_ms=1e3 * sec, rounds=n,
                         interpreted=bool(pallas and interpreted)))
    return dict(plain_ms=1e3 * plain, rows=rows, recompiles=recompiles)


def run(a: argparse.Namespace) -> dict:
    counter = CompileCounter()
    target = build_target(a.target, a.dtype)
    cfg = target.config
    draft = init_draft(target, dict(
        block_size=a.gamma, num_draft_layers=a.draft_layers,
        target_layer_ids=default_target_layer_ids(cfg.num_hidden_layers),
        mask_token_id=cfg.vocab_size - 1, markov_rank=a.rank, markov_head_type=a.head),
        seed=0, dtype=a.dtype, param_dtype=a.dtype)
    B, C, N, g = a.batch, a.context, a.rounds, a.gamma
    temp = jnp.asarray(a.temperature, jnp.float32)
    er = engine_rounds(target, draft, B, C, a, counter)
    base = next(r for r in er["rows"] if (r["sampler"], r["verifier"]) == ("jax", "jax"))
    round_s, step_s = base["round_ms"] / 1e3, er["plain_ms"] / 1e3

    # the sequential stage alone: sample_block over γ slots from fixed backbone outputs
    from flax import nnx

    D = cfg.hidden_size
    h = jax.random.normal(jax.random.key(1), (B, g, D)).astype(draft.model.dtype)
    dgd = draft.graphdef

    @jax.jit
    def seq_stage(state, h):
        model = nnx.merge(dgd, state)

        def body(i, acc):
            # (+ acc·0 keeps each iteration data-dependent so XLA cannot hoist it)
            out = model.sample_block(h + acc[:, :, None].astype(h.dtype) * 0,
                                     jnp.ones((B,), jnp.int32), jax.random.key(i), temp,
                                     sample_probs)
            return acc + out["tokens"] % 2
        return jax.lax.fori_loop(0, N, body, jnp.zeros((B, g), jnp.int32))

    # the base logits (the LM head on γ slots) are part of the backbone, not the sequential
    # stage: time them on their own and subtract
    @jax.jit
    def head_only(state, h):
        model = nnx.merge(dgd, state)

        def body(i, acc):
            logits = model.base_logits(h + acc[:, :, None].astype(h.dtype) * 0)
            return acc + jnp.argmax(logits, -1) % 2
        return jax.lax.fori_loop(0, N, body, jnp.zeros((B, g), jnp.int32))

    seq_s = median(time_call(lambda: seq_stage(draft.state, h), repeats=a.repeats)) / N
    head_s = median(time_call(lambda: head_only(draft.state, h), repeats=a.repeats)) / N
    seq_only = max(seq_s - head_s, 0.0)
    return {"target": a.target, "device": device_name(), "dtype": a.dtype, "batch": B,
            "vocab": cfg.vocab_size,
            "context": C, "gamma": g, "draft_layers": a.draft_layers, "markov_rank": a.rank,
            "head": a.head, "plain_step_ms": step_s * 1e3,
            "round_ms": round_s * 1e3, "round_over_step": round_s / step_s,
            "engine_rounds": er["rows"],
            "sequential_stage_ms": seq_only * 1e3, "sequential_share": seq_only / round_s,
            "steady_state_recompiles": er["recompiles"]}


def engine_rows(r: dict) -> list[tuple[str, str]]:
    out = []
    for row in r["engine_rounds"]:
        note = (" (Pallas interpreted on CPU: not a kernel timing)" if row["interpreted"]
                else "")
        out.append((f"engine round, fixed ℓ=γ, sampler={row['sampler']} "
                    f"verifier={row['verifier']}",
                    f"{row['round_ms']:.3f} ms over {row['rounds']} rounds{note}"))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--head", default="vanilla")
    p.add_argument("--no-pallas-rows", action="store_true",
                   help="skip the engine rows with sampler/verifier='pallas'")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel section")
    p.add_argument("--kernels-only", action="store_true",
                   help="only the kernel section (no target or drafter is built)")
    p.add_argument("--vocab", type=int, default=None,
                   help="kernel section vocabulary (default: the target's; 151936 with "
                        "--kernels-only)")
    a = p.parse_args(argv)
    if a.kernels_only:
        k = kernel_timings(a.batch, a.gamma, a.vocab or 151_936, a.rank, a.dtype, a.temperature,
                           a.repeats)
        save_json({"kernels": k}, a.json)
        print_table(kernel_rows(k), "Pallas kernels vs pure JAX")
        return {"kernels": k}
    r = run(a)
    if not a.no_kernels:
        r["kernels"] = kernel_timings(a.batch, a.gamma, a.vocab or r["vocab"], a.rank, a.dtype,
                                      a.temperature, a.repeats)
    save_json(r, a.json)
    print_table([
        ("target / dtype / device", f"{r['target']} / {r['dtype']} / {r['device']}"),
        ("batch × context, γ", f"{r['batch']} × {r['context']}, γ={r['gamma']}"),
        ("draft", f"{r['draft_layers']} layers, {r['head']} head rank {r['markov_rank']}"),
        ("plain decode step (engine, scheduler=none)", f"{r['plain_step_ms']:.3f} ms"),
        ("speculative round (engine, fixed ℓ=γ)", f"{r['round_ms']:.3f} ms"),
        ("round / step", f"{r['round_over_step']:.3f} (bar ≤ 1.15)"),
        *engine_rows(r),
        ("sequential stage", f"{r['sequential_stage_ms']:.3f} ms = "
                             f"{100 * r['sequential_share']:.2f}% of a round (bar ≤ 2%)"),
        ("steady-state recompiles", f"{r['steady_state_recompiles']} (bar: 0)"),
    ], "speculative round benchmark")
    if "kernels" in r:
        print_table(kernel_rows(r["kernels"]), "Pallas kernels vs pure JAX")
    return r


if __name__ == "__main__":
    main()
