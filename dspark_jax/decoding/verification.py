"""Verification of a speculative round in capacity K, and its commit (paper §2, §5.2–5.3;
SPEC §1 steps 3–6, §9).

The admitted tokens of all requests (each request's anchor plus its first ℓ_r drafts) are
flattened into K slots (`verify_plan`), run through the target on one of four forward paths
(`forward_path`: attention laid out per request so each cache row is read once), verified with
the lossless rule at every verified position under each request's own temperature / top-k /
top-p (`accept`; every live request greedy: from the target's argmax alone,
`acceptance_rule.greedy_verify`), cut at stop tokens and budgets (`emission`), and committed by
moving lengths (`commit`); only the committed tokens' features reach the drafter.

`verify` only reads the state and returns the writes (`CommitWrites`), so that the round's
`lax.switch` over capacity buckets verifies in the chosen branch and `commit` writes once,
after it: with a family that defers its cache writes (`ragged_forward(defer_writes=True)`)
XLA then copies neither cache.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.acceptance_rule import (VERIFIERS, VerifyResult, greedy_verify,
                                                 rejection_verify_with_uniforms)
from dspark_jax.decoding.draft_adapters import adapter_for
from dspark_jax.decoding.emission import emit_and_finish, emitted_tokens
from dspark_jax.decoding.precision import model_precision
from dspark_jax.decoding.round_types import (CommitWrites, EngineArrays, EngineState,
                                             RoundConfig, RoundOutputs, SlotSettings)
from dspark_jax.decoding.sampling import filtered_probs
from dspark_jax.models.decoder import RaggedOutput, ragged_forward, write_ragged


def row_keys(slots: SlotSettings, salt: int) -> jax.Array:
    """Each request's key for this round: its own key folded with its round counter and
    `salt` (so its randomness depends on neither its slot nor the other requests)."""
    keys = jax.random.wrap_key_data(slots.key_data, impl="threefry2x32")
    keys = jax.vmap(jax.random.fold_in)(keys, slots.counter)
    return jax.vmap(lambda k: jax.random.fold_in(k, salt))(keys)


def row_uniforms(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda k: jax.random.uniform(k, shape, jnp.float32))(keys)


def flatten_plan(n_tok: jax.Array, K: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Flattened layout of n_tok[r] tokens per request in K slots, request-major.
    → slot [K], index within its request [K], valid [K], start offset per request [R]."""
    R = n_tok.shape[0]
    cum = jnp.cumsum(n_tok)
    start = cum - n_tok
    k = jnp.arange(K, dtype=jnp.int32)
    slot = jnp.clip(jnp.searchsorted(cum, k, side="right"), 0, R - 1).astype(jnp.int32)
    index = k - start[slot]
    valid = k < cum[-1]
    return slot, index.astype(jnp.int32), valid, start.astype(jnp.int32)


@flax.struct.dataclass
class VerifyPlan:
    """The flattened layout of one verification in capacity K (SPEC §9): token k is cell
    `index[k]` of request `slot[k]` (cell 0 its anchor, cell j its j-th draft)."""

    cells: jax.Array        # [R, γ+1] each request's anchor then its drafts
    slot: jax.Array         # [K] request of each flattened token
    index: jax.Array        # [K] its cell
    valid: jax.Array        # [K] bool: an admitted token (else padding)
    tokens: jax.Array       # [K] token ids
    positions: jax.Array    # [K] cache positions
    grid_rows: jax.Array    # [R, γ+1] flattened index of each request's cells (K: none)
    grid_cells: jax.Array   # [K] cell of each token in the [R, γ+1] grid
    dense_index: jax.Array  # [R, γ+1] flattened index of each cell, clipped into [0, K)


def plan_cells(state: EngineState, active: jax.Array, drafts: jax.Array,
               draft_lengths: jax.Array, capacity: int,
               depths: jax.Array | None = None) -> VerifyPlan:
    """Each active request's anchor and first ℓ_r cells of `drafts` [R, Q − 1], flattened into
    `capacity` slots; a cell's position is the request's length plus its depth (`depths`
    [R, Q], the anchor's 0; default the cell's index: a chain)."""
    num_drafts = drafts.shape[1]
    n_tokens = jnp.where(active, 1 + draft_lengths, 0)
    slot, index, valid, start = flatten_plan(n_tokens, capacity)
    cells = jnp.concatenate([state.anchor[:, None].astype(jnp.int32), drafts], axis=1)
    cell_index = jnp.clip(index, 0, num_drafts)
    cell = jnp.arange(num_drafts + 1, dtype=jnp.int32)
    depth = index if depths is None else depths[slot, cell_index]
    return VerifyPlan(
        cells=cells, slot=slot, index=index, valid=valid, tokens=cells[slot, cell_index],
        positions=state.cache.lengths[slot] + depth,
        grid_rows=jnp.where(cell[None] < n_tokens[:, None], start[:, None] + cell[None],
                            capacity),
        grid_cells=slot * (num_drafts + 1) + cell_index,
        dense_index=jnp.clip(start[:, None] + cell[None], 0, capacity - 1))


def verify_plan(state: EngineState, active: jax.Array, drafts: jax.Array,
                draft_lengths: jax.Array, capacity: int) -> VerifyPlan:
    """Each active request's anchor and first ℓ_r drafts, flattened into `capacity` slots."""
    return plan_cells(state, active, drafts, draft_lengths, capacity)


# ------------------------------------------------------------------------------ forward paths
ForwardPath = Callable[[Any, EngineState, VerifyPlan, tuple[int, ...]], RaggedOutput]


def _dense_block(target: Any, state: EngineState, plan: VerifyPlan,
                 tap_layer_ids: tuple[int, ...]) -> RaggedOutput:
    """One request: its tokens are contiguous, so the dense cached forward over [1, K]
    verifies them, the cache only read and the admitted tokens' rows written by `commit`
    (every bucket of a `lax.switch` takes this path alike). It is faster than the ragged
    path, and XLA:CPU copies a cache that is written inside the branch, which the read-only
    forward avoids (`python -m dspark_jax.bench.spec_round`)."""
    capacity = plan.slot.shape[0]
    dense = target(plan.cells[:, :capacity], cache=state.cache, tap_layer_ids=tap_layer_ids,
                   defer_writes=True)
    return RaggedOutput(hidden=dense.hidden[0], cache=dense.cache,
                        taps=None if dense.taps is None else dense.taps[0],
                        new_kv=None if dense.new_kv is None
                        else jax.tree.map(lambda a: a[:, 0], dense.new_kv))


def _ragged_in_place(target: Any, state: EngineState, plan: VerifyPlan,
                     tap_layer_ids: tuple[int, ...]) -> RaggedOutput:
    """One anchor: the ragged one-cell step, writing in place (`plain_steps` takes the dense
    `decode_one` at every batch size instead)."""
    return ragged_forward(target, plan.tokens, plan.slot, plan.positions, plan.valid,
                          state.cache, tap_layer_ids=tap_layer_ids,
                          grid=(plan.grid_rows, plan.grid_cells))


def _dense_anchors(target: Any, state: EngineState, plan: VerifyPlan,
                   tap_layer_ids: tuple[int, ...]) -> RaggedOutput:
    """The anchors alone, one a slot: the dense cached forward over [R, 1], as a plain step
    (the ragged path costs more at many requests: `python -m dspark_jax.bench.spec_round`).
    A slot that is not
    active writes past its length, where nothing reads."""
    dense = target(state.anchor[:, None], cache=state.cache, tap_layer_ids=tap_layer_ids)
    token_slot = jnp.clip(plan.slot, 0, state.anchor.shape[0] - 1)   # token k: its anchor
    return RaggedOutput(hidden=dense.hidden[:, 0][token_slot], cache=dense.cache,
                        taps=None if dense.taps is None else dense.taps[:, 0][token_slot])


def _ragged_deferred(target: Any, state: EngineState, plan: VerifyPlan,
                     tap_layer_ids: tuple[int, ...]) -> RaggedOutput:
    """The general case: the ragged forward over the K flattened tokens, the cache only read
    and the K/V rows returned for `commit` to write."""
    return ragged_forward(target, plan.tokens, plan.slot, plan.positions, plan.valid,
                          state.cache, tap_layer_ids=tap_layer_ids,
                          grid=(plan.grid_rows, plan.grid_cells), defer_writes=True)


def forward_path(num_slots: int, num_drafts: int, width: int) -> ForwardPath:
    """The forward that verifies a round of `num_slots` requests with `num_drafts` drafts
    each, in a call whose buckets are at most `width` tokens wide."""
    if num_slots == 1 and 1 < width <= num_drafts + 1:
        return _dense_block
    if num_drafts == 0:
        return _ragged_in_place if num_slots == 1 else _dense_anchors
    return _ragged_deferred


# ------------------------------------------------------------------------------ acceptance
def accept(verifier: str, logits: jax.Array, plan: VerifyPlan, slots: SlotSettings,
           drafts: jax.Array, draft_probs: jax.Array, draft_lengths: jax.Array
           ) -> VerifyResult:
    """The acceptance rule registered as `verifier` (`acceptance_rule.VERIFIERS`, explicit
    uniforms: same uniforms → same result) on the target's logits [K, V] under each request's
    sampling settings; with every live request greedy (T ≤ 0) the target rows are one-hot, so
    the rule needs only the argmax — no [K, V] softmax, no [R, γ+1, V] rows gathered."""
    num_slots, num_drafts = drafts.shape

    def sampled(accept_u: jax.Array, sample_u: jax.Array, probs: jax.Array, cells: jax.Array
                ) -> VerifyResult:
        target_probs = probs[cells]
        if num_drafts == 0:   # nothing to verify: plain decoding
            no_drafts = jnp.zeros((num_slots, 0, target_probs.shape[-1]), jnp.float32)
            return rejection_verify_with_uniforms(accept_u, sample_u, target_probs,
                                                  no_drafts, drafts, draft_lengths)
        return VERIFIERS[verifier](accept_u, sample_u, target_probs, draft_probs, drafts,
                                   draft_lengths)

    def greedy(target_argmax: jax.Array) -> VerifyResult:   # the same tokens
        return greedy_verify(target_argmax, drafts, draft_lengths)

    return rule_on_target(logits, plan, slots, (num_drafts,), sampled, greedy)


def rule_on_target(logits: jax.Array, plan: VerifyPlan, slots: SlotSettings,
                   accept_shape: tuple[int, ...],
                   sampled: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], Any],
                   greedy: Callable[[jax.Array], Any]) -> Any:
    """An acceptance rule on the target's logits [K, V]: `sampled(accept uniforms [R,
    *accept_shape], sample uniforms [R], probs [K, V], cells [R, Q])`, each row the
    filtered distribution of its request, `cells` the rows of each request's Q cells (the
    rule gathers the rows it reads) and the uniforms from each request's own key; or, with
    every live request greedy, `greedy(target argmax [R, Q])` (no [K, V] softmax, no rows
    gathered)."""

    def on_probs(logits: jax.Array) -> Any:
        probs = filtered_probs(logits, slots.temperature, slots.top_k, slots.top_p,
                               rows=plan.slot)
        # one draw per request: its accept uniforms, then its sample uniform
        n_accept = math.prod(accept_shape)
        u = row_uniforms(row_keys(slots, 1), (n_accept + 1,))
        return sampled(u[:, :n_accept].reshape(u.shape[:1] + accept_shape), u[:, n_accept],
                       probs, plan.dense_index)

    def on_argmax(logits: jax.Array) -> Any:
        return greedy(jnp.argmax(logits, axis=-1)[plan.dense_index])

    # every live request greedy, or sampled (`filtered_probs` skips the top-k / top-p sort in
    # a cond of its own when no request filters: one sampled branch, compiled once)
    all_greedy = jnp.all(jnp.where(slots.active, slots.temperature <= 0, True))
    return jax.lax.cond(all_greedy, on_argmax, on_probs, logits)


# ------------------------------------------------------------------------------ writes
def pad_to(x: jax.Array, width: int, fill: Any = 0, axis: int = 0) -> jax.Array:
    """`x` padded with `fill` along `axis` to length `width` (a bucket's token axis K to the
    round's width, so that every bucket of a `lax.switch` returns the same shapes)."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, width - x.shape[axis])
    return jnp.pad(x, widths, constant_values=fill)


def commit_writes(plan: VerifyPlan, forward: RaggedOutput, active: jax.Array,
                  verdict: VerifyResult, tokens: jax.Array, width: int,
                  committed: jax.Array | None = None,
                  dense_index: jax.Array | None = None) -> CommitWrites:
    """The writes of a verification, the token axis padded from K to `width` (padding writes
    nothing), so that every bucket of a `lax.switch` returns the same shapes. A chain commits
    its first cells up to the accepted ones and writes the K/V rows of every admitted cell
    (those past the accepted are overwritten before they are read); a tree passes its
    `committed` [K] cells (its accepted path, whose siblings share positions: only they are
    written) and their flattened indices `dense_index` [R, γ + 1]."""
    drop_row, num_accepted = active.shape[0], verdict.num_accepted
    if committed is None:
        committed = plan.valid & (plan.index <= num_accepted[plan.slot]) & active[plan.slot]
        written = plan.valid
    else:
        written = committed
    return CommitWrites(
        slot=pad_to(plan.slot, width), positions=pad_to(plan.positions, width),
        write_rows=pad_to(jnp.where(written, plan.slot, drop_row), width, drop_row),
        commit_valid=pad_to(committed, width, False),
        dense_index=plan.dense_index if dense_index is None else dense_index,
        n_commit=jnp.where(active, num_accepted + 1, 0), tokens=tokens,
        next_anchor=verdict.next_token,
        taps=None if forward.taps is None else pad_to(forward.taps, width),
        cache=forward.cache if forward.new_kv is None else None,
        new_kv=None if forward.new_kv is None
        else jax.tree.map(lambda a: pad_to(a, width, axis=1), forward.new_kv))


def no_writes(shapes: CommitWrites, state: EngineState) -> CommitWrites:
    """Writes of `shapes` (`jax.eval_shape` of a verification's) that change nothing: every
    row dropped, nothing committed, the anchors and the cache as they are."""
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return zeros.replace(write_rows=jnp.full_like(zeros.write_rows, state.anchor.shape[0]),
                         next_anchor=state.anchor,
                         cache=None if shapes.cache is None else state.cache)


# ------------------------------------------------------------------------------ verify, commit
def verify(config: RoundConfig, arrays: EngineArrays, state: EngineState, slots: SlotSettings,
           drafts: jax.Array, draft_probs: jax.Array, draft_lengths: jax.Array, *,
           capacity: int, width: int | None = None) -> tuple[RoundOutputs, CommitWrites]:
    """Ragged verification of the admitted tokens in `capacity` K, without touching the state:
    → (per-slot outputs, the writes `commit` applies; token axis `width` ≥ K, default K).
    drafts [R, γ] (γ = 0: the anchors alone, `anchor_rounds` and `adaptive`'s plain rounds),
    draft_probs [R, γ, V], draft_lengths ℓ [R] (0 for inactive slots)."""
    target = nnx.merge(arrays.target_graphdef, arrays.target_state)
    num_slots, num_drafts = drafts.shape
    width = capacity if width is None else int(width)
    plan = verify_plan(state, slots.active, drafts, draft_lengths, capacity)
    with model_precision(target):
        forward = forward_path(num_slots, num_drafts, width)(target, state, plan,
                                                             config.tap_layer_ids)
        logits = target.logits(forward.hidden)
    verdict = accept(config.verifier, logits, plan, slots, drafts, draft_probs, draft_lengths)
    tokens = emitted_tokens(drafts, verdict.num_accepted, verdict.next_token)
    outputs = emit_and_finish(tokens, verdict.num_accepted, draft_lengths, slots.active,
                              slots.remaining, arrays.stop_ids, config.budget_rule)
    return outputs, commit_writes(plan, forward, slots.active, verdict, tokens, width)


def commit(arrays: EngineArrays, state: EngineState, slots: SlotSettings,
           writes: CommitWrites) -> EngineState:
    """Applies `verify`'s writes: the anchor and accepted drafts enter the target cache
    (lengths move), and the drafter's context gets the features of exactly those tokens (also
    in rounds that skip drafting, γ = 0: its context must hold every committed token)."""
    cache = writes.cache
    if cache is None:
        cache = write_ragged(state.cache, writes.new_kv, writes.write_rows, writes.positions)
    draft_cache = state.draft_cache
    if arrays.draft_graphdef is not None:
        draft = nnx.merge(arrays.draft_graphdef, arrays.draft_state)
        with model_precision(draft):
            draft_cache = adapter_for(draft.cfg.model_type).commit_ragged(
                draft, draft_cache, writes.taps, writes.slot, writes.positions,
                writes.commit_valid, state.cache.lengths, writes.dense_index, writes.n_commit,
                writes.tokens)
    return EngineState(cache=cache.with_lengths(state.cache.lengths + writes.n_commit),
                       draft_cache=draft_cache,
                       anchor=jnp.where(slots.active, writes.next_anchor, state.anchor))
