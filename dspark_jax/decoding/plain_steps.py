"""Plain decoding of the serving engine's request slots: several one-token steps per device call
(SPEC §1, the autoregressive baseline speculative decoding must equal; paper §5.2's "no
drafting" point of the schedule, which the engine's `scheduler="none"` serves).

The state is the engine's (`speculative_round.EngineState`: the target KV cache [L, R, S] with a
committed length per slot and the anchor, the last committed token not yet in the cache), so
requests join and leave between calls exactly as between speculative rounds. One call runs up
to `num_steps` steps in a `lax.while_loop`: feed every slot's anchor (one token a slot
through `models.decoder.decode_one`, as `autoregressive_generate` decodes: the dense cached
forward over [R, 1] at every batch size, the layers reading the cache where it lies and each
row's new K/V written in place after the last layer), sample each live slot's next token
with `sampling.sample_request_rows` (the request's own key folded with its token index, so a
reply does not depend on its slot, its neighbours or how many steps a call ran), commit it.
The loop returns early once `min_done` slots have finished (a stop token or the token
budget), so the host can hand their slots to waiting requests: continuous batching without a
host round trip per token. Regeneration (`data/regeneration.py`) runs on it through the engine.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.emission import BUDGET_ENDS
from dspark_jax.decoding.precision import model_precision, with_precision_policy
from dspark_jax.decoding.sampling import sample_request_rows
from dspark_jax.decoding.speculative_round import BUDGET_RULES, EngineState, SlotSettings
from dspark_jax.decoding.stops import is_stop
from dspark_jax.models.decoder import decode_one, prefill


@functools.partial(jax.jit, static_argnames=("target_gd", "max_steps", "top_k_cap",
                                             "budget_rule"),
                   donate_argnames=("s",))
@with_precision_policy
def plain_steps(target_gd: Any, target_state: Any, s: EngineState, p: SlotSettings,
                stop_ids: jax.Array, num_steps: jax.Array, min_done: jax.Array, *,
                max_steps: int, top_k_cap: int = 0, budget_rule: str = "serving"
                ) -> tuple[EngineState, dict[str, jax.Array]]:
    """Up to `num_steps` (traced, ≤ `max_steps`) plain decoding steps of every active slot.

    A slot's token number i (i = its `counter`, 1 after the prefill's token 0) is sampled with
    `sample_request_rows(key_data, counter, …)`. `budget_rule` as in
    `speculative_round.verify_and_commit` with no drafts ("serving": finished once `remaining`
    tokens are emitted; "deepspec": one more step after that, which emits nothing). The loop
    stops when no slot is live, after `num_steps` steps, or once `min_done` slots finished.
    → (state, dict(tokens [R, max_steps] (−1 past n_emit), n_emit [R], steps [R] steps the
    slot ran (its rounds), finished [R])).
    """
    if budget_rule not in BUDGET_RULES:
        raise ValueError(f"unknown budget_rule {budget_rule!r}; choose from {BUDGET_RULES}")
    target = nnx.merge(target_gd, target_state)
    R = s.anchor.shape[0]
    zeros, one = jnp.zeros((R,), jnp.int32), jnp.ones((R,), jnp.int32)   # one token a step
    init = dict(cache=s.cache, anchor=s.anchor, counter=p.counter, remaining=p.remaining,
                live=p.active, n_emit=zeros, steps=zeros, finished=jnp.zeros((R,), bool),
                tokens=jnp.full((R, max_steps), -1, jnp.int32), i=jnp.zeros((), jnp.int32))

    def cond(c: dict[str, jax.Array]) -> jax.Array:
        return (jnp.any(c["live"]) & (c["i"] < jnp.minimum(num_steps, max_steps))
                & (jnp.sum(c["finished"].astype(jnp.int32)) < min_done))

    def body(c: dict[str, jax.Array]) -> dict[str, jax.Array]:
        live = c["live"]
        with model_precision(target):
            hidden, out_cache = decode_one(target, c["anchor"], c["cache"], live)
            logits = target.logits(hidden)
        nxt = sample_request_rows(p.key_data, c["counter"], logits, p.temperature, p.top_k,
                                  p.top_p, top_k_cap=top_k_cap)
        emit = live & (c["remaining"] > 0)
        budget_ends = BUDGET_ENDS[budget_rule](emit.astype(jnp.int32), one, c["remaining"])
        done = live & (is_stop(nxt, stop_ids) | budget_ends)
        tokens = c["tokens"].at[:, c["i"]].set(jnp.where(emit, nxt, -1))
        return dict(cache=out_cache, anchor=jnp.where(live, nxt, c["anchor"]),
                    counter=c["counter"] + live, remaining=c["remaining"] - emit,
                    live=live & ~done, n_emit=c["n_emit"] + emit, steps=c["steps"] + live,
                    finished=c["finished"] | done, tokens=tokens, i=c["i"] + 1)

    c = jax.lax.while_loop(cond, body, init)
    new_s = s.replace(cache=c["cache"], anchor=c["anchor"])
    return new_s, dict(tokens=c["tokens"], n_emit=c["n_emit"], steps=c["steps"],
                       finished=c["finished"])


@functools.partial(jax.jit, static_argnames=("target_gd", "chunk", "top_k_cap"),
                   donate_argnames=("s",))
@with_precision_policy
def plain_prefill(target_gd: Any, target_state: Any, s: EngineState, p: SlotSettings,
                  tokens: jax.Array, lens: jax.Array, slots: jax.Array, *, chunk: int,
                  top_k_cap: int = 0) -> tuple[EngineState, jax.Array]:
    """Prefills n joining requests at once, densely: `tokens` [n, P] right-padded prompts of
    `lens` [n] tokens for slots `slots` [n] (a slot ≥ R is a padding row: nothing is written).
    One causal forward over [n, P] (`models.decoder.prefill`, in chunks of `chunk` tokens) —
    the cost of the prompts alone, with no per-token gather of the slots' [S] caches — then
    the K/V rows are written into the slots, each slot's first token is sampled (token 0 of
    `sample_request_rows`) and becomes its anchor. → (state, first token [n])."""
    target = nnx.merge(target_gd, target_state)
    n = tokens.shape[0]
    R = s.anchor.shape[0]
    with model_precision(target):
        out = prefill(target, tokens, chunk, cache_dtype=jax.tree.leaves(s.cache.k)[0].dtype)
        logits = target.logits(out.hidden[jnp.arange(n), lens - 1])             # [n, V]
    rows = jnp.clip(slots, 0, R - 1)
    first = sample_request_rows(p.key_data[rows], jnp.zeros((n,), jnp.int32), logits,
                                p.temperature[rows], p.top_k[rows], p.top_p[rows],
                                top_k_cap=top_k_cap)
    return s.replace(cache=s.cache.put_rows(out.cache, slots, lens),
                     anchor=s.anchor.at[slots].set(first, mode="drop")), first
