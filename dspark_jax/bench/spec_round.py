"""Speculative round vs plain decode step (issue: speculative engine §7; PERFORMANCE.md bars).

Reports, from one run on one device:
  * plain decode step time (on-device loop) and speculative round time (draft block +
    sequential sampling + verification of γ+1 tokens + commit; on-device loop),
    and their ratio (bar ≤ 1.15 at γ = 7);
  * the sequential (Markov) stage's share of the round (bar ≤ 2%);
  * recompilations of the host-stepped round in steady state (bar: zero).
Example:
  python -m dspark_jax.bench.spec_round --target qwen3-4b --context 1024 --gamma 7
  python -m dspark_jax.bench.spec_round --target smollm2-135m-instruct --dtype float32
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.bench.common import (build_target, device_name, median, print_table, save_json,
                                     time_call)
from dspark_jax.bench.decode_step import make_state
from dspark_jax.decoding.autoregressive import ar_decode
from dspark_jax.decoding.sampling import sample_probs
from dspark_jax.decoding.speculative import (SpecSettings, full_verify_mask, spec_loop,
                                             spec_prefill, spec_step)
from dspark_jax.models import init_draft
from dspark_jax.models.draft_config import default_target_layer_ids


class CompileCounter:
    """Counts XLA backend compilations through jax.monitoring."""

    def __init__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, *_a, **_k) -> None:
        if "backend_compile" in event:
            self.n += 1


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
    settings = SpecSettings(verifier=a.verifier, record_confidence=False)
    temp = jnp.asarray(a.temperature, jnp.float32)
    no_stop = jnp.asarray([-1], jnp.int32)
    max_new = 2 * N * (g + 1) + 2
    cache_len = C + max_new + g + 8
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size - 1, (B, C)), jnp.int32)
    lens = jnp.full((B,), C, jnp.int32)

    def prefill():
        return spec_prefill(target.graphdef, draft.graphdef, target.state, draft.state, tokens,
                            lens, jax.random.key(0), temp, no_stop, cache_len=cache_len,
                            max_new=max_new, max_rounds=N + 2, settings=settings)

    def rounds(n: int):
        s = spec_loop(target.graphdef, draft.graphdef, target.state, draft.state, prefill(),
                      temp, no_stop, settings=settings, num_rounds=n)
        return s.out

    def plain(n: int):
        s = make_state(target, B, C, 2 * N)
        return ar_decode(target.graphdef, target.state, s, temp, no_stop, num_steps=n).out

    # slopes between N and 2N on-device iterations (prefill, dispatch and set-up cancel)
    slope = lambda f: max(median(time_call(lambda: f(2 * N), repeats=a.repeats))
                          - median(time_call(lambda: f(N), repeats=a.repeats)), 1e-9) / N
    round_s = slope(rounds)
    step_s = slope(plain)

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

    # steady-state recompilations of the host-stepped round
    s = prefill()
    mask = full_verify_mask(jnp.ones((B,), bool), g)
    for _ in range(3):
        s = spec_step(target.graphdef, draft.graphdef, target.state, draft.state, s, mask, temp,
                      no_stop, settings=settings)
    jax.block_until_ready(s.out)
    before = counter.n
    for _ in range(min(N, 20)):
        s = spec_step(target.graphdef, draft.graphdef, target.state, draft.state, s, mask, temp,
                      no_stop, settings=settings)
    jax.block_until_ready(s.out)
    recompiles = counter.n - before
    return {"target": a.target, "device": device_name(), "dtype": a.dtype, "batch": B,
            "context": C, "gamma": g, "draft_layers": a.draft_layers, "markov_rank": a.rank,
            "head": a.head, "verifier": a.verifier, "plain_step_ms": step_s * 1e3,
            "round_ms": round_s * 1e3, "round_over_step": round_s / step_s,
            "sequential_stage_ms": seq_only * 1e3, "sequential_share": seq_only / round_s,
            "steady_state_recompiles": recompiles}


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
    p.add_argument("--verifier", default="jax")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    r = run(a)
    save_json(r, a.json)
    print_table([
        ("target / dtype / device", f"{r['target']} / {r['dtype']} / {r['device']}"),
        ("batch × context, γ", f"{r['batch']} × {r['context']}, γ={r['gamma']}"),
        ("draft", f"{r['draft_layers']} layers, {r['head']} head rank {r['markov_rank']}"),
        ("plain decode step", f"{r['plain_step_ms']:.3f} ms"),
        ("speculative round", f"{r['round_ms']:.3f} ms"),
        ("round / step", f"{r['round_over_step']:.3f} (bar ≤ 1.15)"),
        ("sequential stage", f"{r['sequential_stage_ms']:.3f} ms = "
                             f"{100 * r['sequential_share']:.2f}% of a round (bar ≤ 2%)"),
        ("steady-state recompiles", f"{r['steady_state_recompiles']} (bar: 0)"),
    ], "speculative round benchmark")
    return r


if __name__ == "__main__":
    main()
