"""Plain decoding of the serving engine's request slots: several one-token steps per device call
(SPEC §1, the autoregressive baseline speculative decoding must equal; paper §5.2's "no
drafting" point of the schedule, which the engine's `scheduler="none"` serves).

The state is the engine's (`round_types.EngineState`: the target KV cache [L, R, S] with a
committed length per slot and the anchor, the last committed token not yet in the cache), so
requests join and leave between calls exactly as between speculative rounds. One call runs up
to `num_steps` steps in a `lax.while_loop`: feed every slot's anchor (one token a slot
through `models.decoder.decode_one`, as `autoregressive_generate` decodes: the dense cached
forward over [R, 1] at every batch size, the layers reading the cache where it lies and each
row's new K/V written in place after the last layer), sample each live slot's next token
with `sampling.sample_request_rows` (the request's own key folded with its token index, so a
reply does not depend on its slot, its neighbours or how many steps a call ran), commit it,
and end the slot by the round's rule (`emission.step_emission`). The loop carries a struct
(`PlainCarry`), returns the round's output type (`round_types.RoundOutputs`) and ends early
once `min_done` slots have finished (a stop token or the token budget), so the host can hand
their slots to waiting requests: continuous batching without a host round trip per token.
Regeneration (`data/regeneration.py`) runs on it through the engine.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.emission import check_budget_rule, step_emission
from dspark_jax.decoding.precision import model_precision, with_precision_policy
from dspark_jax.decoding.round_types import EngineState, RoundOutputs, SlotSettings
from dspark_jax.decoding.sampling import sample_request_rows
from dspark_jax.decoding.stops import is_stop
from dspark_jax.models.decoder import KVCache, decode_one, prefill


@flax.struct.dataclass
class PlainCarry:
    """What the loop of plain steps carries: the target cache and anchors, each slot's key
    counter, budget and liveness, the outputs so far and the step index."""

    cache: KVCache
    anchor: jax.Array       # [R] last committed token, not yet in the cache
    counter: jax.Array      # [R] int32 the slot's next token index (folds its key)
    remaining: jax.Array    # [R] int32 tokens it may still emit
    live: jax.Array         # [R] bool: still decoding
    outputs: RoundOutputs   # tokens [R, max_steps], n_emit, finished, tau_term (steps run)
    i: jax.Array            # () int32 steps run


@functools.partial(jax.jit, static_argnames=("target_gd", "max_steps", "top_k_cap",
                                             "budget_rule"),
                   donate_argnames=("s",))
@with_precision_policy
def plain_steps(target_gd: Any, target_state: Any, s: EngineState, p: SlotSettings,
                stop_ids: jax.Array, num_steps: jax.Array, min_done: jax.Array, *,
                max_steps: int, top_k_cap: int = 0, budget_rule: str = "serving"
                ) -> tuple[EngineState, RoundOutputs]:
    """Up to `num_steps` (traced, ≤ `max_steps`) plain decoding steps of every active slot.

    A slot's token number i (i = its `counter`, 1 after the prefill's token 0) is sampled with
    `sample_request_rows(key_data, counter, …)`. `budget_rule` as in
    `speculative_round.verify_and_commit` with no drafts ("serving": finished once `remaining`
    tokens are emitted; "deepspec": one more step after that, which emits nothing). The loop
    stops when no slot is live, after `num_steps` steps, or once `min_done` slots finished.
    → (state, RoundOutputs: tokens [R, max_steps] (−1 past n_emit), n_emit [R], finished
    [R], tau_term [R] the steps the slot ran (its rounds), no drafts).
    """
    check_budget_rule(budget_rule)
    target = nnx.merge(target_gd, target_state)
    R = s.anchor.shape[0]
    zeros = jnp.zeros((R,), jnp.int32)
    init = PlainCarry(
        cache=s.cache, anchor=s.anchor, counter=p.counter, remaining=p.remaining, live=p.active,
        outputs=RoundOutputs(tokens=jnp.full((R, max_steps), -1, jnp.int32), n_emit=zeros,
                             finished=jnp.zeros((R,), bool), tau_term=zeros),
        i=jnp.zeros((), jnp.int32))

    def cond(c: PlainCarry) -> jax.Array:
        return (jnp.any(c.live) & (c.i < jnp.minimum(num_steps, max_steps))
                & (jnp.sum(c.outputs.finished.astype(jnp.int32)) < min_done))

    def body(c: PlainCarry) -> PlainCarry:
        with model_precision(target):
            hidden, out_cache = decode_one(target, c.anchor, c.cache, c.live)
            logits = target.logits(hidden)
        nxt = sample_request_rows(p.key_data, c.counter, logits, p.temperature, p.top_k,
                                  p.top_p, top_k_cap=top_k_cap)
        emit, done = step_emission(c.live, c.remaining, is_stop(nxt, stop_ids), budget_rule)
        out = c.outputs
        outputs = out.replace(tokens=out.tokens.at[:, c.i].set(jnp.where(emit, nxt, -1)),
                              n_emit=out.n_emit + emit, finished=out.finished | done,
                              tau_term=out.tau_term + c.live)
        return PlainCarry(cache=out_cache, anchor=jnp.where(c.live, nxt, c.anchor),
                          counter=c.counter + c.live, remaining=c.remaining - emit,
                          live=c.live & ~done, outputs=outputs, i=c.i + 1)

    c = jax.lax.while_loop(cond, body, init)
    return s.replace(cache=c.cache, anchor=c.anchor), c.outputs


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
