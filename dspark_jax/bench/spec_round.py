"""Speculative round vs plain decode step, part by part (the round's anatomy;
../shared/docs/PERFORMANCE.md bars).

For each number of requests R in `--requests` (default 1, 4, 16), with R requests of `--context`
prompt tokens in flight in the serving engine (`dspark_jax.serving.Engine`, the host-stepped path
users run), one table gives, in ms and as a ratio to the plain step:
  * the plain decode step: the engine under scheduler `none`, one step per round
    (`round_seconds`; `generate` runs up to `plain_steps_per_call` steps per device
    call, and that amortised per-step time is an extra row; another is the plain step's device
    call alone, on the speculative engine's cache length, next to verification's);
  * verification at K = 1, 2, 4, … , γ+1 tokens per request (R·K tokens: the engine's
    verification step `cost_profile.verify_step_fn(eng)(R·K)`, every slot with K − 1 drafts;
    it also feeds the drafter's context, as in a round);
  * the draft call (draft block + Markov sampling + scheduling, `cost_profile.draft_step_fn`);
  * the whole round under `fixed` (ℓ = γ, so K = γ+1: draft → verify → commit → host);
  * host overhead per round = whole round − (draft + verify at K = γ+1);
  * the sequential (Markov) stage's share of the round and the steady-state recompilations of
    the round (compilations during the timed rounds);
  * with `--tree-budgets N,…`, for each draft-tree budget N (docs/TREES.md): the tree's draft
    call and the whole tree round under `fixed` (every node verified: R·(N+1) tokens), next to
    verification at K = N + 1 (the chain's step at the same token count);
  * rows with `sampler="pallas"` / `verifier="pallas"` where the engine offers them (CPU, where
    the kernels are interpreted: those rows are labelled and are not kernel timings;
    `--no-pallas-rows` skips them);
and flags each bar (../shared/docs/PERFORMANCE.md; on CPU: verify at K = γ+1 ≤ 1.5×,
draft ≤ 0.2× with a draft vocabulary / ≤ 0.3× with the full one, whole round ≤ 1.6×; on GPU /
TPU the round ≤ 1.15×; everywhere the sequential stage ≤ 2% and zero recompiles). The bars are
stated for R = 1; the other columns carry the same flags for comparison. The parts are timed in
`--repeats` interleaved passes (each: `--rounds` plain rounds, one plain `generate`, each device
call once, `--rounds` speculative rounds), so that a shared machine's drift hits every part
alike; the figures are medians over the passes.

The drafter: `--draft DIR` (a trained export, `dspark_jax.models.load_draft`), `--draft random`
(random weights of `--gamma` / `--draft-layers` / `--rank` / `--head`), or by default the main
job's export `runs/smollm2_dspark/export` when it exists and fits the target, else a random one
(passing any random-drafter shape option also picks a random drafter).

Then the Pallas kernels (pallas_kernels/markov_sample, pallas_kernels/verify) against the pure-JAX
paths they replace (decoding/markov_sampling.py, decoding/acceptance_rule.py), at the first R's
B, γ, V and r. Kernels are timed only on GPU (Triton) and TPU (Mosaic): on CPU they could only
run in interpret mode, which says nothing about speed, so the table shows the pure-JAX time and
marks the kernel "n/a".
Example:
  python -m dspark_jax.bench.spec_round --target smollm2-135m-instruct --dtype float32 \\
      --draft /path/to/export --requests 1,4,16 --context 128 --temperature 0
  python -m dspark_jax.bench.spec_round --target qwen3-4b --context 1024 --batch 1 --gamma 7
  python -m dspark_jax.bench.spec_round --target qwen3-4b --kernels-only --batch 16
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.bench.common import build_target, device_name, median, print_table, save_json
from dspark_jax.decoding.pallas_backend import OFFERED_BACKENDS
from dspark_jax.decoding.sampling import sample_probs
from dspark_jax.models import init_draft, load_draft
from dspark_jax.models.drafters.config import default_target_layer_ids
from dspark_jax.serving import cost_profile
from dspark_jax.serving.cost_profile import profile_calls, time_call

DEFAULT_DRAFT = os.path.join("runs", "smollm2_dspark", "export")
RANDOM_DEFAULTS = dict(gamma=7, draft_layers=5, rank=256, head="vanilla")


class CompileTimes:
    """Counts XLA backend compilations through jax.monitoring, with the wall time
    (time.perf_counter) at which each one was reported."""

    def __init__(self):
        self.n = 0
        self.times: list[float] = []
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, *_a, **_k) -> None:
        if "backend_compile" in event:
            self.n += 1
            self.times.append(time.perf_counter())

    def between(self, t0: float, t1: float) -> int:
        return sum(t0 <= t <= t1 for t in self.times)


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


def build_drafter(target, a: argparse.Namespace):
    """→ (drafter, description dict). See the module docstring for the choice."""
    shape_given = any(getattr(a, k) is not None for k in RANDOM_DEFAULTS)
    spec, note = a.draft, None
    if spec is None:
        spec = "random"
        if shape_given:
            note = "random-drafter shape options given"
        elif not os.path.isdir(DEFAULT_DRAFT):
            note = f"no {DEFAULT_DRAFT}"
        else:
            try:
                d = load_draft(DEFAULT_DRAFT, target=target, dtype=a.dtype, param_dtype=a.dtype)
                return d, describe_drafter(d, f"trained: {DEFAULT_DRAFT}", target)
            except Exception as e:  # a partial export or another target's drafter
                note = f"{DEFAULT_DRAFT} not loadable for this target ({type(e).__name__}: {e})"
    if spec == "random":
        o = {k: (getattr(a, k) if getattr(a, k) is not None else v)
             for k, v in RANDOM_DEFAULTS.items()}
        cfg = target.config
        d = init_draft(target, dict(
            block_size=o["gamma"], num_draft_layers=o["draft_layers"],
            target_layer_ids=default_target_layer_ids(cfg.num_hidden_layers),
            mask_token_id=cfg.vocab_size - 1, markov_rank=o["rank"],
            markov_head_type=o["head"]), seed=0, dtype=a.dtype, param_dtype=a.dtype)
        desc = describe_drafter(d, "random weights", target)
        if note:
            desc["note"] = note
        return d, desc
    d = load_draft(spec, target=target, dtype=a.dtype, param_dtype=a.dtype)
    return d, describe_drafter(d, f"trained: {spec}", target)


def describe_drafter(d, source: str, target) -> dict:
    c = d.config
    V = int(target.config.vocab_size)
    dv = int(getattr(c, "draft_vocab_size", 0) or 0)
    n_layers = getattr(c, c.kind.layers_field)
    return dict(source=source, model_type=c.model_type, gamma=int(c.num_drafts),
                block_size=int(c.block_size), layers=int(n_layers),
                markov_rank=int(getattr(c, "markov_rank", 0) or 0),
                head=getattr(c, "markov_head_type", None),
                draft_vocab=dv if 0 < dv < V else V, pruned_vocab=0 < dv < V)


def per_request_ks(gamma: int, ks: list[int] | None = None) -> list[int]:
    """Tokens per request verified: `ks` (default 1, 2, 4, … below γ+1) and γ+1 (the round's
    K), those in 1..γ+1."""
    if ks is None:
        ks, k = [], 1
        while k < gamma + 1:
            ks.append(k)
            k *= 2
    return sorted({int(k) for k in ks if 1 <= k <= gamma + 1} | {gamma + 1})


def sequential_stage_calls(draft, B: int, N: int, temperature: float) -> dict:
    """Two device calls, each N rounds inside a `fori_loop`: "seq" = `sample_block` over the γ
    slots from fixed backbone outputs, "head" = the base logits alone (the LM head on the γ
    slots over the draft vocabulary, as `sample_block` computes them). The sequential (Markov)
    stage per round is (seq − head) / N."""
    from flax import nnx

    g = draft.config.num_drafts
    D = int(draft.config.target.hidden_size)
    h = jax.random.normal(jax.random.key(1), (B, g, D)).astype(draft.model.dtype)
    dgd = draft.graphdef
    temp = jnp.asarray(temperature, jnp.float32)
    # the draft vocabulary's rows, gathered once as the engine does
    vw = jax.jit(lambda st: nnx.merge(dgd, st).draft_vocab_weights())(draft.state)

    @jax.jit
    def seq_stage(state, h, vw):
        model = nnx.merge(dgd, state)

        def body(i, acc):
            # (+ acc·0 keeps each iteration data-dependent so XLA cannot hoist it)
            out = model.sample_block(h + acc[:, :, None].astype(h.dtype) * 0,
                                     jnp.ones((B,), jnp.int32), jax.random.key(i), temp,
                                     sample_probs, vocab_weights=vw)
            return acc + out["tokens"] % 2
        return jax.lax.fori_loop(0, N, body, jnp.zeros((B, g), jnp.int32))

    @jax.jit
    def head_only(state, h, vw):
        model = nnx.merge(dgd, state)

        def body(i, acc):
            logits = model.draft_vocab_logits(h + acc[:, :, None].astype(h.dtype) * 0, vw)
            return acc + jnp.argmax(logits, -1) % 2
        return jax.lax.fori_loop(0, N, body, jnp.zeros((B, g), jnp.int32))

    return {"seq": lambda: seq_stage(draft.state, h, vw),
            "head": lambda: head_only(draft.state, h, vw)}


def plain_device_step_fn(eng, steps: int = 1):
    """`steps` plain decoding steps of every slot as the `none` engine's device call
    (`decoding.plain_steps` with num_steps = `steps`, ≤ its `plain_steps_per_call`; 1: the
    program `round_seconds` runs), without the engine's host work, on a cache of max_len (the
    speculative engine's), rewound after each call. (The engine has no such step_fn; this
    mirrors `cost_profile.verify_step_fn`.)"""
    from dspark_jax.decoding.plain_steps import plain_steps
    from dspark_jax.decoding.sampling import top_k_cap_for

    R = eng.R
    p = cost_profile.all_slots_active(eng)
    holder = {"s": eng.fresh_state(eng.max_len)}
    if not 1 <= steps <= eng.plain_steps_per_call:
        raise ValueError(f"steps must be in [1, {eng.plain_steps_per_call}], got {steps}")
    one, none_done = jnp.asarray(steps, jnp.int32), jnp.asarray(R + 1, jnp.int32)

    def step():
        st = eng.step_target
        holder["s"], out = plain_steps(st.graphdef, st.state, holder["s"], p,
                                       eng.stop_ids, one, none_done,
                                       max_steps=eng.plain_steps_per_call,
                                       top_k_cap=top_k_cap_for([0] * R, eng.V),
                                       budget_rule=eng.budget_rule)
        holder["s"] = holder["s"].replace(
            cache=holder["s"].cache.with_lengths(jnp.zeros((R,), jnp.int32)))
        return out.n_emit

    return step


def round_seconds(eng, prompts, rounds: int, temperature: float = 1.0, seed: int = 0
                  ) -> list[float]:
    """Wall seconds of each of `rounds` rounds of engine `eng` (after one untimed round:
    compilation) with `prompts` in flight: the host-stepped path `generate` runs (draft →
    schedule → bucket → verify → commit → host bookkeeping; plain decoding: one step a round,
    as verification). No request may finish meanwhile: the budget exceeds what the rounds can
    emit, and the engine must have no stop tokens (`stop_token_ids=[]`)."""
    from dspark_jax.serving.run_loop import Request, Run as _Run

    n = len(prompts)
    if not 1 <= n <= eng.R:
        raise ValueError(f"round_seconds takes 1..max_requests={eng.R} prompts, got {n}")
    budget = (int(rounds) + 2) * (eng.gamma + 1) + 2
    if max(len(p) for p in prompts) + budget + eng.gamma + 1 > eng.max_len:
        raise ValueError(f"max_len={eng.max_len} cannot hold the prompts + {rounds} rounds")
    kd = list(np.asarray(jax.random.key_data(jax.random.split(
        jax.random.key(int(seed), impl="threefry2x32"), n))))
    run = _Run(eng, budget, fresh_policy=True)
    for i in range(n):
        run.add(Request(prompts[i], kd[i], float(temperature)))
    run.t0 = time.perf_counter()
    s = run._prefill(run.start_state(), run._admit(0.0))
    s = run._round(s, max_steps=1)
    out = []
    for _ in range(int(rounds)):
        t0 = time.perf_counter()
        s = run._round(s, max_steps=1)
        out.append(time.perf_counter() - t0)
    if not run.host["active"].all():
        raise ValueError("a request finished during round_seconds (a stop token): build "
                         "the engine with stop_token_ids=[] to time rounds")
    return out


def plain_steps_in_generate(eng, prompts, temperature: float) -> list[float]:
    """Seconds per step of plain decoding as `generate` runs it (`plain_steps_per_call` steps
    per device call, host work included): each full call after the first of one `generate`
    (2n + 1 new tokens: the prefill's and two calls of n). [] when max_len cannot hold them."""
    n = eng.plain_steps_per_call
    max_new = 2 * n + 1
    if max(len(p) for p in prompts) + max_new > eng.max_len:
        return []
    res = eng.generate(prompts, max_new_tokens=max_new, temperature=temperature)
    return [r["seconds"] / r["steps"] for r in res.rounds[1:] if r["steps"] == n]


def anatomy(target, draft, R: int, a: argparse.Namespace, counter: CompileTimes) -> dict:
    """The parts of a speculative round with R requests of `a.context` tokens in flight (see
    the module docstring); times in ms (medians).

    The parts are timed in `a.repeats` interleaved passes, so that a shared machine's drift
    hits every part alike: each pass runs `a.rounds` plain engine rounds, one `generate` of
    plain decoding, each device call once (verify at each K, draft, sequential stage;
    round-robin), then `a.rounds` rounds of the `fixed` engine. Each pass's `round_seconds`
    prefills its requests again (untimed)."""
    from dspark_jax.serving import Engine, EngineSettings

    g, C = int(draft.config.num_drafts), int(a.context)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, target.config.vocab_size - 1, C)) for _ in range(R)]
    max_len = C + (a.rounds + 2) * (g + 1) + 2 * g + 8
    kw = dict(max_requests=R, max_len=max_len, prefill_chunk=min(C * R, 512),
              stop_token_ids=[])   # the settings every engine here shares
    interpreted = jax.default_backend() not in ("gpu", "tpu")
    T = a.temperature

    plain = Engine(target, None, settings=EngineSettings(scheduler="none", **kw))
    eng = Engine(target, draft, settings=EngineSettings(scheduler="fixed", **kw))
    ks = per_request_ks(g, a.verify_ks)
    verify, drafting = cost_profile.verify_step_fn(eng), cost_profile.draft_step_fn(eng)
    calls = {"plain_device": plain_device_step_fn(plain)}
    calls.update({f"verify_{k}": functools.partial(verify, R * k) for k in ks})
    calls["draft"] = functools.partial(drafting, 0)
    calls.update(sequential_stage_calls(draft, R, a.rounds, T))
    samples: dict[str, list[float]] = {k: [] for k in ("plain", "plain_gen", "round", *calls)}
    recompiles = 0
    for rep in range(max(int(a.repeats), 1)):
        samples["plain"] += round_seconds(plain, prompts, a.rounds, temperature=T)
        samples["plain_gen"] += plain_steps_in_generate(plain, prompts, T)
        for k, v in profile_calls(calls, repeats=1, warmup=int(rep == 0)).items():
            samples[k].append(v)
        # compilations during the timed rounds (after round_seconds' untimed first round)
        times = round_seconds(eng, prompts, a.rounds, temperature=T)
        t_end = time.perf_counter()
        recompiles += counter.between(t_end - sum(times), t_end)
        samples["round"] += times
    med = {k: (median(v) if v else None) for k, v in samples.items()}
    seq_s = max(med["seq"] - med["head"], 0.0) / a.rounds
    round_s = med["round"]

    rows = [dict(sampler="jax", verifier="jax", round_ms=1e3 * round_s,
                 rounds=len(samples["round"]), interpreted=False)]
    # the engine refuses the kernels where they are not offered (`pallas_backend`): no rows there
    if not a.no_pallas_rows and jax.default_backend() in OFFERED_BACKENDS:
        for sampler, verifier in ENGINE_ROWS[1:]:
            n = min(a.rounds, 3) if interpreted else a.rounds
            e2 = Engine(target, draft, settings=EngineSettings(
                scheduler="fixed", sampler=sampler, verifier=verifier, **kw))
            rows.append(dict(sampler=sampler, verifier=verifier, rounds=n,
                             round_ms=1e3 * median(round_seconds(e2, prompts, n, temperature=T)),
                             interpreted=interpreted))
    verify_ms = {k: 1e3 * med[f"verify_{k}"] for k in ks}
    draft_ms = 1e3 * med["draft"]
    trees = [tree_anatomy(target, draft, prompts, n, a, kw) for n in a.tree_budgets]
    return dict(requests=R, context=C, max_len=max_len, gamma=g, round_k=g + 1,
                plain_step_ms=1e3 * med["plain"],
                plain_step_in_generate_ms=(None if med["plain_gen"] is None
                                           else 1e3 * med["plain_gen"]),
                plain_steps_per_call=int(plain.plain_steps_per_call),
                plain_device_step_ms=1e3 * med["plain_device"],
                verify_ms=verify_ms, draft_ms=draft_ms, round_ms=1e3 * round_s,
                host_ms=1e3 * round_s - draft_ms - verify_ms[g + 1],
                sequential_stage_ms=1e3 * seq_s, sequential_share=seq_s / round_s,
                steady_state_recompiles=recompiles, engine_rounds=rows, trees=trees,
                samples_ms={k: [round(1e3 * x, 3) for x in v] for k, v in samples.items()})


def tree_anatomy(target, draft, prompts, budget: int, a: argparse.Namespace, kw: dict
                  ) -> dict:
    """A draft-tree round of `budget` nodes a request (engine `fixed`): its draft call, the
    chain's verification step at the same R·(N+1) tokens and the whole round, ms (medians of
    `a.repeats` passes)."""
    from dspark_jax.serving import Engine, EngineSettings

    R = len(prompts)
    eng = Engine(target, draft, settings=EngineSettings(scheduler="fixed", tree_budget=budget,
                                                        **kw))
    calls = {"draft": functools.partial(cost_profile.draft_step_fn(eng), 0),
             "verify": functools.partial(cost_profile.verify_step_fn(eng), R * (budget + 1))}
    samples: dict[str, list[float]] = {"draft": [], "verify": [], "round": []}
    for rep in range(max(int(a.repeats), 1)):
        for k, v in profile_calls(calls, repeats=1, warmup=int(rep == 0)).items():
            samples[k].append(v)
        samples["round"] += round_seconds(eng, prompts, a.rounds, temperature=a.temperature)
    return dict(budget=budget, **{f"{k}_ms": 1e3 * median(v) for k, v in samples.items()})


def bars(backend: str, pruned_vocab: bool) -> dict:
    """Upper bars as ratios to the plain step (None: no bar on this backend)."""
    if backend in ("gpu", "tpu"):
        return dict(verify=None, draft=None, round=1.15)
    return dict(verify=1.5, draft=0.2 if pruned_vocab else 0.3, round=1.6)


def flag(x: float, bar: float | None) -> str:
    return "" if bar is None else (" pass" if x <= bar else " FAIL")


def anatomy_table(res: dict) -> str:
    """The markdown table: one row per part, ms and × plain step for each R, and the bar."""
    an, dr = res["anatomy"], res["drafter"]
    b = bars(res["backend"], dr["pruned_vocab"])
    head = "| part of a round | " + " | ".join(f"R={x['requests']} ms | × plain" for x in an)
    head += " | bar |"
    lines = [head, "|---|" + "---:|---:|" * len(an) + "---|"]

    def row(label: str, vals: list[float | None], bar: float | None = None, ratio=True,
            bar_text: str | None = None) -> None:
        cells = []
        for x, v in zip(an, vals):
            if v is None:
                cells += ["–", "–"]
                continue
            r = v / x["plain_step_ms"]
            cells += [f"{v:.1f}", (f"{r:.2f}{flag(r, bar)}" if ratio else "")]
        txt = bar_text if bar_text is not None else ("" if bar is None else f"≤ {bar}×")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {txt} |")

    g, K = an[0]["gamma"], an[0]["round_k"]
    row("plain decode step (1 token a request, engine `none`, one step a call)",
        [x["plain_step_ms"] for x in an])
    row(f"plain step inside `generate` ({an[0]['plain_steps_per_call']} steps a call), per "
        "step", [x["plain_step_in_generate_ms"] for x in an])
    row(f"plain step, device call alone (cache {an[0]['max_len']}, as verify's)",
        [x.get("plain_device_step_ms") for x in an])
    for k in an[0]["verify_ms"]:
        row(f"verify K = {k} token{'s' * (k > 1)} a request (R·{k})",
            [x["verify_ms"][k] for x in an], b["verify"] if k == K else None)
    vocab = (f"draft vocab {dr['draft_vocab']}" if dr["pruned_vocab"] else "full vocab")
    row(f"draft ({dr['layers']}-layer drafter, block {dr['block_size']}, γ = {g}, {vocab})",
        [x["draft_ms"] for x in an], b["draft"])
    row(f"host overhead per round (whole − draft − verify K = {K})", [x["host_ms"] for x in an])
    row(f"whole round at K = {K} (engine `fixed`, ℓ = γ)", [x["round_ms"] for x in an],
        b["round"])
    cells = []
    for x in an:
        s = x["sequential_share"]
        cells += [f"{x['sequential_stage_ms']:.2f}", f"{100 * s:.2f}% of round"
                  + flag(s, 0.02)]
    lines.append("| sequential (Markov) stage | " + " | ".join(cells) + " | ≤ 2% of round |")
    cells = []
    for x in an:
        n = x["steady_state_recompiles"]
        cells += [str(n), "pass" if n == 0 else "FAIL"]
    lines.append("| steady-state recompiles (timed rounds) | " + " | ".join(cells) + " | 0 |")
    for i, tree in enumerate(an[0].get("trees", [])):
        N = tree["budget"]
        row(f"tree of {N} nodes: draft", [x["trees"][i]["draft_ms"] for x in an])
        row(f"tree of {N} nodes: verify K = {N + 1} a request (the chain's step)",
            [x["trees"][i]["verify_ms"] for x in an])
        row(f"tree of {N} nodes: whole round (engine `fixed`)",
            [x["trees"][i]["round_ms"] for x in an])
    for sampler, verifier in ENGINE_ROWS[1:]:
        vals = []
        for x in an:
            m = [r for r in x["engine_rounds"] if (r["sampler"], r["verifier"])
                 == (sampler, verifier)]
            vals.append(m[0]["round_ms"] if m else None)
        if any(v is not None for v in vals):
            interp = any(r["interpreted"] for x in an for r in x["engine_rounds"])
            row(f"engine round, sampler={sampler} verifier={verifier}"
                + (" (Pallas interpreted on CPU: not a kernel timing)" if interp else ""),
                vals)
    return "\n".join(lines)


def run(a: argparse.Namespace) -> dict:
    counter = CompileTimes()
    target = build_target(a.target, a.dtype)
    draft, desc = build_drafter(target, a)
    an = [anatomy(target, draft, R, a, counter) for R in a.requests]
    first = an[0]
    return {"target": a.target, "device": device_name(), "backend": jax.default_backend(),
            "dtype": a.dtype, "vocab": int(target.config.vocab_size), "drafter": desc,
            "temperature": a.temperature, "rounds": a.rounds, "repeats": a.repeats,
            "anatomy": an,
            # the first R's figures, under the keys the suite (bench.suite) reads
            "batch": first["requests"], "context": first["context"], "gamma": first["gamma"],
            "draft_layers": desc["layers"], "markov_rank": desc["markov_rank"],
            "head": desc["head"], "plain_step_ms": first["plain_step_ms"],
            "round_ms": first["round_ms"],
            "round_over_step": first["round_ms"] / first["plain_step_ms"],
            "engine_rounds": first["engine_rounds"],
            "sequential_stage_ms": first["sequential_stage_ms"],
            "sequential_share": first["sequential_share"],
            "steady_state_recompiles": first["steady_state_recompiles"]}


def int_list(s: str) -> list[int]:
    out = [int(x) for x in s.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (`bench.suite`'s presets and the GPU check pass theirs)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="a named random shape (qwen3-4b, qwen3-8b), the embedded "
                        "smollm2-135m-instruct, or a Hugging Face directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--draft", default=None,
                   help=f"a drafter export directory, or 'random' (default: {DEFAULT_DRAFT} "
                        "when it exists and fits the target, else random)")
    p.add_argument("--requests", type=int_list, default=None,
                   help="comma-separated numbers of requests in flight (default 1,4,16)")
    p.add_argument("--batch", type=int, default=None,
                   help="one number of requests (same as --requests N); the kernel section's B")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--gamma", type=int, default=None, help="random drafter: block size (7)")
    p.add_argument("--draft-layers", type=int, default=None, help="random drafter: layers (5)")
    p.add_argument("--rank", type=int, default=None, help="random drafter: Markov rank (256)")
    p.add_argument("--head", default=None, help="random drafter: Markov head type (vanilla)")
    p.add_argument("--verify-ks", type=int_list, default=None,
                   help="tokens per request to time verification at (default 1,2,4,… below "
                        "γ+1); γ+1 is always timed")
    p.add_argument("--tree-budgets", type=int_list, default=[],
                   help="draft-tree budgets N whose round to time too (e.g. 16,32)")
    p.add_argument("--no-pallas-rows", action="store_true",
                   help="skip the engine rows with sampler/verifier='pallas'")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=32,
                   help="engine rounds timed per pass (plain and speculative)")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved passes over the parts (and the kernel section's repeats)")
    p.add_argument("--json", default=None)
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel section")
    p.add_argument("--kernels-only", action="store_true",
                   help="only the kernel section (no target or drafter is built)")
    p.add_argument("--vocab", type=int, default=None,
                   help="kernel section vocabulary (default: the target's; 151936 with "
                        "--kernels-only)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    if a.requests is None:
        a.requests = [a.batch] if a.batch is not None else [1, 4, 16]
    if a.kernels_only:
        k = kernel_timings(a.batch or a.requests[0], a.gamma or RANDOM_DEFAULTS["gamma"],
                           a.vocab or 151_936, a.rank or RANDOM_DEFAULTS["rank"], a.dtype,
                           a.temperature, a.repeats)
        save_json({"kernels": k}, a.json)
        print_table(kernel_rows(k), "Pallas kernels vs pure JAX")
        return {"kernels": k}
    r = run(a)
    if not a.no_kernels:
        r["kernels"] = kernel_timings(a.batch or a.requests[0], r["gamma"],
                                      a.vocab or r["vocab"], r["markov_rank"] or 256, a.dtype,
                                      a.temperature, a.repeats)
    save_json(r, a.json)
    dr, an = r["drafter"], r["anatomy"]
    print_table([
        ("target / dtype / device", f"{r['target']} / {r['dtype']} / {r['device']}"),
        ("drafter", f"{dr['source']}: {dr['model_type']}, {dr['layers']} layers, γ = "
                    f"{dr['gamma']}, {dr['head']} Markov head rank {dr['markov_rank']}, "
                    f"vocab {dr['draft_vocab']}" + (f" ({dr['note']})" if "note" in dr else "")),
        ("requests × context, cache", ", ".join(f"{x['requests']} × {x['context']}"
                                                for x in an)
         + f"; speculative cache {an[0]['max_len']} (plain: grown to fit)"),
        ("temperature, timed rounds, repeats", f"{r['temperature']}, {r['rounds']}, "
                                               f"{r['repeats']}"),
    ], "speculative round anatomy")
    print("\n" + anatomy_table(r))
    if "kernels" in r:
        print_table(kernel_rows(r["kernels"]), "Pallas kernels vs pure JAX")
    return r


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
