"""The speculative round: draft → schedule → verify → commit, for a batch of request slots
(paper §2, §3.2.2, §5.2–5.3; SPEC §1, §8, §9; DeepSpec's evaluator's round, with its
budget rule as `budget_rule="deepspec"`). The one implementation of a round: the serving engine
(`dspark_jax.serving.Engine`), `speculative_generate`, evaluation and calibration all run it.

A round has three parts:
  1. `draft_and_schedule` — every slot's drafter proposes γ tokens; the scheduler picks ℓ_r
     from the CURRENT round's confidences σ(c_k / T_k); returns ℓ and Σ(1 + ℓ_r);
  2. the smallest capacity bucket K ≥ Σ(1 + ℓ_r) is picked;
  3. verify and commit (`verification`; one verification program per bucket) — the admitted
     tokens of all requests are flattened into K slots, verified with the lossless rule and
     committed by moving lengths. `verify_and_commit` runs such steps as their own call
     (profiling).
`speculative_rounds` runs whole rounds in one device call: step 2 happens on device (a
`lax.switch` over the buckets' verification programs), and several rounds run in a
`lax.while_loop` until a slot finishes, so no host round trip separates draft, schedule and
verify, nor one round from the next. The separate jitted parts serve profiling (SPS per
bucket, the drafter's cost) and the `adaptive` rounds that skip drafting.
`prefill_prompts` runs joins (the joining prompts densely, the drafter's context fed).
Under "adaptive" the host decides a call's first round (`serving.policy`) and the device each
later one (`DraftChoice`, `scheduler.drafting_pays`: the same rule), the call ending at the
first round it would not draft; a round that does not draft verifies the anchors alone (drafts
of width 0, `anchor_rounds`) and still commits their features to the drafter.

Every program takes the static `RoundConfig`, the engine's arrays (`EngineArrays`) and the
state, and returns the new state with typed outputs (`round_types`). Randomness is per request
(`key_data[r]`, folded with the request's round counter), so a request's output does not depend
on the slot it sits in or on the other requests.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding import scheduler as sched
from dspark_jax.decoding import tree as tree_mod
from dspark_jax.decoding.acceptance_rule import draw_rows
from dspark_jax.decoding.draft_adapters import Proposal, adapter_for
from dspark_jax.decoding.markov_sampling import pallas_markov_sample_with_uniforms
from dspark_jax.decoding.precision import model_precision, with_precision_policy
from dspark_jax.decoding.round_types import (DraftChoice, DraftOutputs, EngineArrays,
                                             EngineState, PackedRecords, RoundConfig,
                                             RoundOutputs, RoundRecord, RoundsResult,
                                             ScheduleRecord, ScheduleState, SlotSettings)
from dspark_jax.decoding.sampling import filtered_probs
from dspark_jax.decoding.tree_verification import verify_tree
from dspark_jax.decoding.verification import (commit, no_writes, row_keys, row_uniforms,
                                              verify)
from dspark_jax.models import layers as L
from dspark_jax.models.decoder import prefill
from pallas_kernels.markov_sample import tiled as markov_tiled


def _draft_model(arrays: EngineArrays) -> Any:
    return nnx.merge(arrays.draft_graphdef, arrays.draft_state)


# ------------------------------------------------------------------------------ 1. draft
def _propose_scan(draft: Any, arrays: EngineArrays, state: EngineState,
                  slots: SlotSettings) -> Proposal:
    """The drafter's own proposal (its per-slot scan), each request's uniforms drawn from its
    own key and its top-k / top-p applied.

    Compiled for a GPU, a vanilla Markov head over the full vocabulary is sampled by the tiled
    Triton kernels instead (`pallas_kernels.markov_sample.markov_sample_tiled`: two kernels a
    slot where the scan takes about forty): the same uniforms and tokens, the drafts drawn
    from softmax(·/T) without the request's top-k / top-p (lossless: verification uses the p_d
    the draft reports). The branch is chosen for the platform being compiled for."""
    adapter = adapter_for(draft.cfg.model_type)
    if (adapter.markov_kernel and adapter.supports_markov_kernel(draft)
            and draft.vocab_ids() is None and L.kernels_enabled()):
        def tiled(anchor: jax.Array, interpret: bool) -> Proposal:
            del anchor
            sample = functools.partial(markov_tiled.markov_sample_tiled, interpret=interpret)
            return _propose_kernel(draft, arrays, state, slots, sample)

        return L.on_gpu(tiled, lambda anchor: _scan_proposal(draft, arrays, state, slots),
                        state.anchor)
    return _scan_proposal(draft, arrays, state, slots)


def _scan_proposal(draft: Any, arrays: EngineArrays, state: EngineState,
                   slots: SlotSettings) -> Proposal:
    keys = row_keys(slots, 0)
    salt_key = jax.random.key(0, impl="threefry2x32")   # per-slot keys carry no randomness

    def sample_fn(key: jax.Array, probs: jax.Array) -> jax.Array:
        salt = jax.random.key_data(key)[-1]
        uniforms = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, salt), (),
                                                         jnp.float32))(keys)
        return draw_rows(probs, uniforms)

    def probs_fn(logits: jax.Array) -> jax.Array:
        return filtered_probs(logits, slots.temperature, slots.top_k, slots.top_p)

    with model_precision(draft):
        return adapter_for(draft.cfg.model_type).propose(
            draft, state.draft_cache, state.anchor, state.cache.lengths, salt_key,
            slots.temperature[:, None], sample_fn, probs_fn=probs_fn, stop_ids=arrays.stop_ids,
            vocab_weights=arrays.vocab_weights)


def _propose_kernel(draft: Any, arrays: EngineArrays, state: EngineState,
                    slots: SlotSettings,
                    sample: Callable[..., Any] = pallas_markov_sample_with_uniforms
                    ) -> Proposal:
    """The vanilla Markov head sampled by a Pallas kernel (`sample`, the batched one by
    default) with the same per-request uniforms as `_propose_scan` (same tokens, barring f32
    rounding at a CDF step); the draft then ignores top-k/top-p (lossless: verification uses
    the p_d it reports)."""
    del arrays
    keys = row_keys(slots, 0)
    salt_key = jax.random.key(0, impl="threefry2x32")
    salts = jax.random.key_data(jax.random.split(salt_key, draft.cfg.num_drafts))[:, -1]
    uniforms = jax.vmap(lambda k: jax.vmap(lambda salt: jax.random.uniform(
        jax.random.fold_in(k, salt), (), jnp.float32))(salts))(keys)          # [R, γ]
    with model_precision(draft):
        return adapter_for(draft.cfg.model_type).propose_with_uniforms(
            draft, state.draft_cache, state.anchor, state.cache.lengths, uniforms,
            slots.temperature, sample)


# the drafter's proposal by `RoundConfig.sampler`
PROPOSERS: dict[str, Callable[..., Proposal]] = {
    "jax": _propose_scan, "pallas": _propose_kernel}


def _draft_tree(config: RoundConfig, arrays: EngineArrays, state: EngineState,
                slots: SlotSettings, capacity: jax.Array) -> DraftOutputs:
    """A draft tree of `config.tree_budget` nodes for every slot (`decoding.tree`; with
    `config.cap_budget` none deeper than the request's budget), scheduled as the chain's
    drafts are: `fixed` admits every node, the other modes admit a prefix of each tree by the
    nodes' survival estimates (`tree.node_survival`) with the scheduler of `config.mode`
    (`capacity`, K, and the search for two rounds later count tree nodes)."""
    draft = _draft_model(arrays)
    num_drafts = draft.cfg.num_drafts
    depth_limit = (jnp.minimum(slots.remaining - 1, num_drafts) if config.cap_budget
                   else jnp.full(slots.remaining.shape, num_drafts, jnp.int32))
    with model_precision(draft):
        tree, conf_logits = adapter_for(draft.cfg.model_type).propose_tree(
            draft, state.draft_cache, state.anchor, state.cache.lengths, row_keys(slots, 0),
            slots.temperature, slots.top_k, slots.top_p, budget=config.tree_budget,
            branching=config.tree_branching, depth_limit=depth_limit.astype(jnp.int32),
            vocab_weights=arrays.vocab_weights)
    has_conf = draft.cfg.has_confidence
    survival = tree_mod.node_survival(
        tree, sched.confidence_probs(conf_logits, arrays.confidence_temperatures)
        if has_conf else None, num_drafts)                                     # [R, N]
    previous = jnp.pad(survival[:, :-1], ((0, 0), (1, 0)), constant_values=1.0)
    step_conf = jnp.where(previous > 0, survival / jnp.maximum(previous, 1e-30), 0.0)
    lengths, capacity_new, gain_new = config.mode.schedule(
        step_conf, slots.active, config.tree_budget, arrays.threshold, arrays.sps, capacity,
        arrays.sps_draft)
    lengths = jnp.where(slots.active, jnp.minimum(lengths, tree.num_nodes), 0).astype(jnp.int32)
    n_tokens = jnp.sum(jnp.where(slots.active, 1 + lengths, 0)).astype(jnp.int32)
    admitted = jnp.arange(config.tree_budget)[None] < lengths[:, None]
    predicted = jnp.sum(jnp.where(admitted, survival, 0.0))
    return DraftOutputs(tokens=tree.tokens[:, :num_drafts], probs=None,
                        confidence=conf_logits.astype(jnp.float32), lengths=lengths,
                        n_tokens=n_tokens, capacity_new=capacity_new.astype(jnp.int32),
                        gain_new=gain_new.astype(jnp.float32),
                        predicted=predicted.astype(jnp.float32), tree=tree)


def _draft_and_schedule(config: RoundConfig, arrays: EngineArrays, state: EngineState,
                        slots: SlotSettings, capacity: jax.Array) -> DraftOutputs:
    """Drafts γ tokens for every slot (`PROPOSERS[config.sampler]`) and schedules them
    (`config.mode.schedule`; `capacity`: the K the stale-capacity modes admit; the
    capacity and gain for two rounds later are searched on `arrays.sps_draft`). With
    `config.cap_budget` no draft past a request's token budget is verified. With
    `config.tree_budget` every slot drafts a tree instead (`_draft_tree`)."""
    if config.tree_budget:
        return _draft_tree(config, arrays, state, slots, capacity)
    draft = _draft_model(arrays)
    num_drafts = draft.cfg.num_drafts
    proposal = PROPOSERS[config.sampler](draft, arrays, state, slots)
    conf_logits = proposal.confidence      # zeros from a drafter without a confidence head
    conf = sched.confidence_probs(conf_logits, arrays.confidence_temperatures)
    lengths, capacity_new, gain_new = config.mode.schedule(
        conf, slots.active, num_drafts, arrays.threshold, arrays.sps, capacity, arrays.sps_draft)
    if proposal.length is not None:      # Eagle3's chain stopped at a drafted stop token
        lengths = jnp.minimum(lengths, proposal.length)
    if config.cap_budget:   # drafts past the request's token budget can never be emitted
        lengths = jnp.minimum(lengths, slots.remaining - 1)
    lengths = jnp.where(slots.active, jnp.clip(lengths, 0, num_drafts), 0)
    n_tokens = jnp.sum(jnp.where(slots.active, 1 + lengths, 0)).astype(jnp.int32)
    # expected accepted drafts of what is admitted (the policy's calibration check)
    admitted = jnp.arange(num_drafts)[None] < lengths[:, None]
    predicted = jnp.sum(jnp.where(admitted, sched.prefix_survival(conf), 0.0))
    return DraftOutputs(tokens=proposal.tokens, probs=proposal.probs,
                        confidence=conf_logits, lengths=lengths.astype(jnp.int32),
                        n_tokens=n_tokens, capacity_new=capacity_new.astype(jnp.int32),
                        gain_new=gain_new.astype(jnp.float32),
                        predicted=predicted.astype(jnp.float32), draft_cache=proposal.cache)


def _drafted_only(config: RoundConfig, arrays: EngineArrays, state: EngineState,
                  slots: SlotSettings, capacity: jax.Array) -> DraftOutputs:
    """`_draft_and_schedule` without the drafter's cache (a call of its own keeps the state)."""
    return _draft_and_schedule(config, arrays, state, slots, capacity).replace(draft_cache=None)


draft_and_schedule = jax.jit(with_precision_policy(_drafted_only), static_argnames=("config",))


@functools.partial(jax.jit, static_argnames=("config", "steps"))
@with_precision_policy
def draft_steps(config: RoundConfig, arrays: EngineArrays, state: EngineState,
                slots: SlotSettings, capacity: jax.Array, *, steps: int
                ) -> tuple[jax.Array, jax.Array]:
    """`steps` drafting + scheduling steps (`draft_and_schedule`) in one device call, for
    profiling the drafter's time per round as the rounds' device loop pays it. Each step drafts
    from the previous step's first draft token as its anchor, so no step is loop-invariant
    (XLA would hoist it). → (the last anchor [R], the last step's n_tokens)."""
    def one(anchor: jax.Array) -> tuple[jax.Array, jax.Array]:
        drafted = _draft_and_schedule(config, arrays, state.replace(anchor=anchor), slots,
                                      capacity)
        return drafted.tokens[:, 0].astype(jnp.int32), drafted.n_tokens

    return jax.lax.fori_loop(0, int(steps), lambda _, carry: one(carry[0]),
                             (state.anchor, jnp.int32(0)))


# ------------------------------------------------------------------------------ 3. verify
@functools.partial(jax.jit, static_argnames=("config", "capacity", "steps"),
                   donate_argnames=("state",))
@with_precision_policy
def verify_and_commit(config: RoundConfig, arrays: EngineArrays, state: EngineState,
                      slots: SlotSettings, drafts: jax.Array, draft_probs: jax.Array,
                      draft_lengths: jax.Array, *, capacity: int, steps: int = 1
                      ) -> tuple[EngineState, RoundOutputs]:
    """`steps` verification steps in `capacity` K as one device call, for profiling (the
    engine's SPS(B), `steps` > 1: the cost a step has inside the rounds' device loop, without
    the call's dispatch and host sync; `bench.spec_round`, one step a call). Each step verifies
    inside a `lax.cond` (a step with no active slot writes nothing), then commits — the
    structure of the rounds (verify in the capacity bucket's branch, commit after it), in which
    XLA writes the donated caches in place. As one straight-line program XLA:CPU copies each
    cache twice before writing it, a cost the rounds never pay (figures:
    `python -m dspark_jax.bench.spec_round`). Each step commits (its accepted drafts and the
    next token), so no step repeats another's work.
    → (state, the last step's per-slot outputs)."""
    def one(current: EngineState) -> tuple[EngineState, RoundOutputs]:
        def verified() -> tuple[RoundOutputs, Any]:
            return verify(config, arrays, current, slots, drafts, draft_probs, draft_lengths,
                          capacity=capacity)

        def skipped() -> tuple[RoundOutputs, Any]:
            outputs, writes = jax.eval_shape(verified)
            return (jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), outputs),
                    no_writes(writes, current))

        outputs, writes = jax.lax.cond(jnp.any(slots.active), verified, skipped)
        return commit(arrays, current, slots, writes), outputs

    state, outputs = one(state)
    if steps > 1:
        state, outputs = jax.lax.fori_loop(1, int(steps), lambda _, carry: one(carry[0]),
                                           (state, outputs))
    return state, outputs


# ------------------------------------------------------------------------------ 1–3 fused
@flax.struct.dataclass
class _Loop:
    """The carry of a device call of rounds: the state in and out of each round, the slots as
    the rounds advance them (liveness, budget, round counter), the schedule and the records
    so far. A slot leaves `slots.active` only by finishing its request, so the slots that
    finished in the call are those live at its start and not in the carry."""

    state: EngineState
    slots: SlotSettings
    schedule: ScheduleState | None
    index: jax.Array             # () int32 rounds run
    records: PackedRecords       # [max_rounds, …]


# one round: (state, slots, schedule) → (state, its record, schedule)
OneRound = Callable[[EngineState, SlotSettings, Any], tuple[EngineState, RoundRecord, Any]]


def _round_loop(one_round: OneRound, state: EngineState, slots: SlotSettings,
                schedule: ScheduleState | None, records: PackedRecords, num_rounds: jax.Array,
                min_done: jax.Array,
                proceed: Callable[[ScheduleState, jax.Array], jax.Array] | None = None
                ) -> tuple[EngineState, RoundsResult]:
    """The device loop of whole rounds shared by `speculative_rounds` and `anchor_rounds`. A
    slot's budget, round counter and liveness advance on device exactly as the host advances
    them between single rounds. Stops when no slot is live, after `num_rounds` (≤ the records'
    length) rounds, once `min_done` slots finished, or before a round after the first for which
    `proceed(schedule, live)` is False."""
    max_rounds = records.rounds
    live_at_start = jnp.sum(slots.active.astype(jnp.int32))

    def cond(loop: _Loop) -> jax.Array:
        live = jnp.sum(loop.slots.active.astype(jnp.int32))
        more = ((live > 0) & (loop.index < jnp.minimum(num_rounds, max_rounds))
                & (live_at_start - live < min_done))
        if proceed is None:
            return more
        return more & ((loop.index == 0) | proceed(loop.schedule, loop.slots.active))

    def body(loop: _Loop) -> _Loop:
        live = loop.slots.active
        state, record, schedule = one_round(loop.state, loop.slots, loop.schedule)
        finished = record.outputs.finished
        slots = loop.slots._replace(active=live & ~finished,
                                    remaining=loop.slots.remaining - record.outputs.n_emit,
                                    counter=loop.slots.counter + live.astype(jnp.int32))
        records = loop.records.set(loop.index, record)
        return _Loop(state=state, slots=slots, schedule=schedule, index=loop.index + 1,
                     records=records)

    start = _Loop(state=state, slots=slots, schedule=schedule, index=jnp.zeros((), jnp.int32),
                  records=records)
    loop = jax.lax.while_loop(cond, body, start)
    return loop.state, RoundsResult(packed=loop.records, rounds=loop.index,
                                    schedule=loop.schedule, slots=loop.slots)


@functools.partial(jax.jit, static_argnames=("config",),
                   donate_argnames=("state", "slots", "schedule"))
@with_precision_policy
def speculative_rounds(config: RoundConfig, arrays: EngineArrays, state: EngineState,
                       slots: SlotSettings, schedule: ScheduleState, num_rounds: jax.Array,
                       min_done: jax.Array) -> tuple[EngineState, RoundsResult]:
    """Up to `num_rounds` (traced, ≤ `config.rounds_per_call`) whole rounds in one device
    call: each drafts and schedules (`draft_and_schedule`), picks the smallest capacity bucket
    K ≥ Σ(1 + ℓ_r) ON DEVICE (`lax.switch` over the verification programs of every bucket: only
    the chosen one runs) and verifies and commits, with no host round trip in between, so every
    token and record equals the host-stepped path. The loop stops when no slot is live, after
    `num_rounds` rounds, or once `min_done` slots have finished (the host can then hand their
    slots to waiting requests).

    `schedule`: the capacities of rounds t−2, t−1 (`production`, paper §5.2: round t admits
    the top K_{t−2}; the round's new K enters the queue; the other modes read capacities[0]).
    With `schedule.choice` (`adaptive`) the host chose to draft the first round; each later
    round first makes the policy's choice on device (`scheduler.drafting_pays` on the estimate
    of two rounds before) and the call ends, back to the host, at the first round that would
    decode plainly (the host's policy then decides it, with its probes and budget).
    `state`, `slots` and `schedule` are donated: the loop advances them in place.
    → (state, the rounds' records with their schedules, how many ran, the final schedule and
    slots)."""
    num_slots = state.anchor.shape[0]
    num_drafts = _draft_model(arrays).cfg.num_drafts
    buckets = jnp.asarray(config.buckets, jnp.int32)

    def one_round(current: EngineState, slots: SlotSettings, schedule: ScheduleState):
        drafted = _draft_and_schedule(config, arrays, current, slots, schedule.capacities[0])
        if drafted.draft_cache is not None:   # Eagle3's scratch K/V written in place
            current = current.replace(draft_cache=drafted.draft_cache)
        bucket = jnp.searchsorted(buckets, jnp.maximum(drafted.n_tokens, 1), side="left")

        def verify_in(capacity: int) -> Callable[[EngineState], Any]:
            if drafted.tree is not None:
                return lambda state: verify_tree(config, arrays, state, slots, drafted.tree,
                                                 drafted.lengths, capacity=capacity,
                                                 width=config.buckets[-1])
            return lambda state: verify(config, arrays, state, slots, drafted.tokens,
                                        drafted.probs, drafted.lengths, capacity=capacity,
                                        width=config.buckets[-1])

        # the bucket's verification reads the state; the writes happen once, outside
        branches = [verify_in(capacity) for capacity in config.buckets]
        outputs, writes = jax.lax.switch(bucket, branches, current)
        record = ScheduleRecord(
            admitted=schedule.capacities[0], lengths=drafted.lengths,
            confidence=drafted.confidence, capacity=buckets[bucket],
            n_tokens=drafted.n_tokens, capacity_new=drafted.capacity_new,
            gain_new=drafted.gain_new, predicted=drafted.predicted)
        realised = jnp.sum(jnp.where(slots.active, outputs.accepted, 0)).astype(jnp.float32)
        return (commit(arrays, current, slots, writes),
                RoundRecord(live=slots.active, outputs=outputs, schedule=record),
                schedule.after_round(record, slots.active, realised))

    def drafting_pays(schedule: ScheduleState, live: jax.Array) -> jax.Array:
        choice = schedule.choice
        return sched.drafting_pays(schedule.capacities[0], choice.gain[0], schedule.n_then[0],
                                   jnp.sum(live), choice.ratio(), arrays.sps_draft,
                                   choice.plain_sps, config.tree_budget or num_drafts)

    records = PackedRecords.for_rounds(config.rounds_per_call, num_slots, num_drafts,
                                       num_drafts + 1, scheduled=True)
    return _round_loop(one_round, state, slots, schedule, records, num_rounds, min_done,
                       proceed=None if schedule.choice is None else drafting_pays)


@functools.partial(jax.jit, static_argnames=("config", "capacity"),
                   donate_argnames=("state", "slots"))
@with_precision_policy
def anchor_rounds(config: RoundConfig, arrays: EngineArrays, state: EngineState,
                  slots: SlotSettings, num_rounds: jax.Array, min_done: jax.Array, *,
                  capacity: int) -> tuple[EngineState, RoundsResult]:
    """Up to `num_rounds` (traced, ≤ `config.plain_rounds_per_call`) rounds that skip drafting
    in one device call: `adaptive`'s plain stretches (`serving.policy`). Each verifies the
    anchors alone (drafts of width 0, ℓ = 0) in `capacity` K and commits them, the drafter's
    context fed with their features, exactly as `verify_and_commit` with no drafts, round after
    round, with the loop and records of `speculative_rounds` (tokens [R, 1] a round, no
    schedule; `state` and `slots` donated)."""
    num_slots = state.anchor.shape[0]
    vocab = nnx.merge(arrays.target_graphdef, arrays.target_state).cfg.vocab_size
    drafts = jnp.zeros((num_slots, 0), jnp.int32)
    draft_probs = jnp.zeros((num_slots, 0, vocab), jnp.float32)
    draft_lengths = jnp.zeros((num_slots,), jnp.int32)

    def one_round(current: EngineState, slots: SlotSettings, schedule: None):
        outputs, writes = verify(config, arrays, current, slots, drafts, draft_probs,
                                 draft_lengths, capacity=capacity)
        return (commit(arrays, current, slots, writes),
                RoundRecord(live=slots.active, outputs=outputs), schedule)

    records = PackedRecords.for_rounds(config.plain_rounds_per_call, num_slots, 0, 1,
                                       scheduled=False)
    return _round_loop(one_round, state, slots, None, records, num_rounds, min_done)


# ------------------------------------------------------------------------------ prefill
@functools.partial(jax.jit, static_argnames=("config", "chunk"), donate_argnames=("state",))
@with_precision_policy
def prefill_prompts(config: RoundConfig, arrays: EngineArrays, state: EngineState,
                    slots: SlotSettings, tokens: jax.Array, lens: jax.Array, rows: jax.Array,
                    *, chunk: int) -> tuple[EngineState, jax.Array]:
    """Prefills n joining requests at once, densely (`models.decoder.prefill`, in chunks of
    `chunk` tokens): `tokens` [n, P] right-padded prompts of `lens` [n] tokens for slots
    `rows` [n] (a row ≥ R is padding: nothing is written). Their K/V enter the slots' target
    cache, the drafter's context gets the features of every prompt token, and each slot's first
    token is sampled from its own key (folded with −1) and becomes its anchor.
    → (state, first token [n])."""
    target = nnx.merge(arrays.target_graphdef, arrays.target_state)
    n, width = tokens.shape
    num_slots = state.anchor.shape[0]
    with model_precision(target):
        out = prefill(target, tokens, chunk, tap_layer_ids=config.tap_layer_ids,
                      cache_dtype=jax.tree.leaves(state.cache.k)[0].dtype)
        logits = target.logits(out.hidden[jnp.arange(n), lens - 1])             # [n, V]
    settings_row = jnp.clip(rows, 0, num_slots - 1)
    probs = filtered_probs(logits, slots.temperature[settings_row],
                           slots.top_k[settings_row], slots.top_p[settings_row])
    keys = jax.random.wrap_key_data(slots.key_data[settings_row], impl="threefry2x32")
    first_keys = jax.vmap(jax.random.fold_in)(
        keys, jnp.full((n,), -1, jnp.int32).astype(jnp.uint32))
    first = draw_rows(probs, row_uniforms(first_keys, ()))
    draft_cache = state.draft_cache
    if arrays.draft_graphdef is not None:
        draft_cache = _feed_prompts(arrays, state, out.taps, tokens, lens, rows, first)
    return EngineState(cache=state.cache.put_rows(out.cache, rows, lens),
                       draft_cache=draft_cache,
                       anchor=state.anchor.at[rows].set(first, mode="drop")), first


def _feed_prompts(arrays: EngineArrays, state: EngineState, taps: jax.Array,
                  tokens: jax.Array, lens: jax.Array, rows: jax.Array,
                  first: jax.Array) -> Any:
    """The drafter's context cache with every prompt token's target features (`taps`
    [n, P, F]) of the joining slots `rows`, each followed by its next token (a prompt's last by
    its sampled first token)."""
    draft = _draft_model(arrays)
    n, width = tokens.shape
    num_slots = state.anchor.shape[0]
    position = jnp.arange(width, dtype=jnp.int32)
    following = jnp.where(position[None] == lens[:, None] - 1, first[:, None],
                          jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))))                # [n, P]
    joined = jnp.zeros((num_slots,), bool).at[rows].set(True, mode="drop")
    row_of = jnp.zeros((num_slots,), jnp.int32).at[rows].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop")                              # slot → row
    with model_precision(draft):
        return adapter_for(draft.cfg.model_type).commit_ragged(
            draft, state.draft_cache, taps.reshape(n * width, -1), jnp.repeat(rows, width),
            jnp.tile(position, n), (position[None] < lens[:, None]).reshape(-1),
            jnp.where(joined, 0, state.cache.lengths),
            row_of[:, None] * width + position[None], jnp.where(joined, lens[row_of], 0),
            following[row_of])
