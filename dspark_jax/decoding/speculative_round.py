"""The speculative round: draft → schedule → verify → commit, for a batch of request slots
(paper §2, §3.2.2, §5.2–5.3; SPEC §1, §8, §9; DeepSpec's evaluator's round, with its
budget rule as `budget_rule="deepspec"`). The one implementation of a round: the serving engine
(`dspark_jax.serving.Engine`), `speculative_generate`, evaluation and calibration all run it.

A round has three parts:
  1. `draft_and_schedule` — every slot's drafter proposes γ tokens; the scheduler picks ℓ_r
     from the CURRENT round's confidences σ(c_k / T_k); returns ℓ and Σ(1 + ℓ_r);
  2. the smallest capacity bucket K ≥ Σ(1 + ℓ_r) is picked;
  3. verify and commit (`_verify`, `_commit`; one verification program per bucket) — the
     admitted tokens of all requests are flattened into K slots
     (`models.decoder.ragged_forward`, attention laid out per request so each cache row is
     read once), verified with the lossless rule at every verified position under each
     request's own temperature / top-k / top-p (every live request greedy: from the target's
     argmax alone, `acceptance_rule.greedy_verify`), and committed by moving lengths; only
     the committed tokens' features reach the drafter. `verify_and_commit` runs one such step
     as its own call (profiling).
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

Randomness is per request (`key_data[r]`, folded with the request's round counter), so a
request's output does not depend on the slot it sits in or on the other requests.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding import scheduler as sched
from dspark_jax.decoding.precision import with_precision_policy
from dspark_jax.decoding.acceptance_rule import (VERIFIERS, VerifyResult, greedy_verify,
                                                 inverse_cdf_sample,
                                                 rejection_verify_with_uniforms)
from dspark_jax.decoding.draft_adapters import adapter_for
from dspark_jax.decoding.markov_sampling import pallas_markov_sample_with_uniforms
from dspark_jax.decoding.sampling import filtered_probs
from dspark_jax.decoding.stops import is_stop
from dspark_jax.models.decoder import (KVCache, RaggedOutput, prefill, ragged_forward,
                                      write_ragged)


@flax.struct.dataclass
class EngineState:
    """Device state of the request slots (what the host sets per slot: `SlotSettings`)."""

    cache: KVCache        # target K/V [L, R, S]; lengths[r] = committed tokens = anchor position
    draft_cache: Any      # drafter context cache (None with scheduler "none")
    anchor: jax.Array     # [R] last committed token, not yet in the target cache


@flax.struct.dataclass
class DraftChoice:
    """The `adaptive` mode's drafting choice carried through a device call of rounds
    (`speculative_rounds`; the host's `serving.policy.DraftPolicy` holds the same state between
    calls): the estimates of the two rounds before (K, G and the requests active then, 0 when
    there is none: the loop then returns to the host), the calibration averages and the tables
    the choice compares (`scheduler.drafting_pays`)."""

    gain: jax.Array        # [2] f32: G of the estimates of rounds t−2, t−1 (K: `queue`)
    n_then: jax.Array      # [2] int32: requests active when each was computed (0: none)
    predicted: jax.Array   # () f32: exponential average of predicted accepted drafts
    realised: jax.Array    # () f32: ... of realised accepted drafts
    decay: jax.Array       # () f32: the averages' decay per drafting round
    plain_sps: jax.Array   # [n + 1] f32: plain rounds per second by active requests

    def ratio(self) -> jax.Array:
        """ρ = realised / predicted (capped at 4), 1 before any prediction."""
        return jnp.where(self.predicted > 1e-9,
                         jnp.minimum(self.realised / jnp.maximum(self.predicted, 1e-9), 4.0),
                         1.0)

    def after_round(self, gain: jax.Array, n_active: jax.Array, predicted: jax.Array,
                    realised: jax.Array) -> "DraftChoice":
        """After a drafting round: its estimate enters the queue, the averages move (when it
        predicted anything), as `DraftPolicy.update(True, …)` does."""
        moved = predicted > 0
        return self.replace(
            gain=jnp.stack([self.gain[1], gain.astype(jnp.float32)]),
            n_then=jnp.stack([self.n_then[1], n_active.astype(jnp.int32)]),
            predicted=jnp.where(moved, self.decay * self.predicted + predicted,
                                self.predicted),
            realised=jnp.where(moved, self.decay * self.realised + realised, self.realised))


class SlotSettings(NamedTuple):
    """What the host sets for each request slot, sent with every call ([R] arrays; tiny):
    whether the slot runs a request, its token budget and round counter, its sampling settings
    and its key."""

    active: jax.Array       # bool: slot holds a running request
    remaining: jax.Array    # int32: tokens it may still emit
    counter: jax.Array      # int32: rounds it has run (folds its key)
    temperature: jax.Array  # f32
    top_k: jax.Array        # int32 (0 = off)
    top_p: jax.Array        # f32 (1 = off)
    key_data: jax.Array     # [R, 2] uint32


def _row_keys(p: SlotSettings, salt: int) -> jax.Array:
    keys = jax.random.wrap_key_data(p.key_data, impl="threefry2x32")
    keys = jax.vmap(jax.random.fold_in)(keys, p.counter)
    return jax.vmap(lambda k: jax.random.fold_in(k, salt))(keys)


def _row_uniforms(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda k: jax.random.uniform(k, shape, jnp.float32))(keys)


# ------------------------------------------------------------------------------ 1. draft
# Markov-head samplers by name (explicit uniforms): "jax" is the model's own per-slot scan
SAMPLERS = ("jax", "pallas")


def _draft_and_schedule(draft_gd: Any, draft_state: Any, s: EngineState, p: SlotSettings,
                       stop_ids: jax.Array, conf_temps: jax.Array | None,
                       threshold: jax.Array, sps: jax.Array, capacity: jax.Array,
                       sps_draft: jax.Array | None = None, vocab_weights: Any = None, *,
                       mode: str, cap_budget: bool = True, sampler: str = "jax"
                       ) -> dict[str, jax.Array]:
    """Drafts γ tokens for every slot and schedules them. → tokens, probs, confidence logits,
    lengths ℓ [R], n_tokens = Σ_active(1 + ℓ_r), capacity_new / gain_new (adaptive: K and G
    for two rounds later, searched on `sps_draft`), predicted (Σ of the admitted tokens'
    prefix survival: expected accepted drafts). `cap_budget`: never
    verify drafts past a request's token budget (off = DeepSpec's protocol, always γ).
    `sampler="pallas"`: the vanilla Markov head is sampled by the batched Pallas kernel with
    the same per-request uniforms as the "jax" path (same tokens, barring f32 rounding at a CDF
    step); the draft then ignores top-k/top-p (lossless: verification uses the p_d it reports).
    `vocab_weights`: the adapter's `vocab_weights(draft)` (the draft vocabulary's weight rows,
    gathered once by the engine; None gathers them here)."""
    draft = nnx.merge(draft_gd, draft_state)
    adapter = adapter_for(draft.cfg.model_type)
    g = draft.cfg.num_drafts
    row_keys = _row_keys(p, 0)
    salt_key = jax.random.key(0, impl="threefry2x32")  # per-slot keys below carry no randomness

    def sample_fn(k, probs_rv):
        salt = jax.random.key_data(k)[-1]
        u = jax.vmap(lambda rk: jax.random.uniform(jax.random.fold_in(rk, salt), (),
                                                   jnp.float32))(row_keys)
        return inverse_cdf_sample(probs_rv, u)

    def probs_fn(logits_rv):
        return filtered_probs(logits_rv, p.temperature, p.top_k, p.top_p)

    if sampler == "pallas":
        salts = jax.random.key_data(jax.random.split(salt_key, g))[:, -1]     # [γ]
        u_rg = jax.vmap(lambda rk: jax.vmap(lambda sl: jax.random.uniform(
            jax.random.fold_in(rk, sl), (), jnp.float32))(salts))(row_keys)   # [R, γ]
        prop = adapter.propose_with_uniforms(draft, s.draft_cache, s.anchor, s.cache.lengths,
                                             u_rg, p.temperature,
                                             pallas_markov_sample_with_uniforms)
    else:
        prop = adapter.propose(draft, s.draft_cache, s.anchor, s.cache.lengths, salt_key,
                               p.temperature[:, None], sample_fn, probs_fn=probs_fn,
                               stop_ids=stop_ids, vocab_weights=vocab_weights)
    conf_logits = prop.get("confidence")
    if conf_logits is None:
        conf_logits = jnp.zeros(prop["tokens"].shape, jnp.float32)
    conf = sched.confidence_probs(conf_logits, conf_temps)
    ell, cap_new, gain_new = sched.schedule_lengths(mode, conf, p.active, g, threshold, sps,
                                                    capacity, sps_draft)
    if "length" in prop:      # Eagle3's chain stopped at a drafted stop token
        ell = jnp.minimum(ell, prop["length"])
    if cap_budget:   # drafts past the request's token budget can never be emitted
        ell = jnp.minimum(ell, p.remaining - 1)
    ell = jnp.where(p.active, jnp.clip(ell, 0, g), 0)
    n_tokens = jnp.sum(jnp.where(p.active, 1 + ell, 0)).astype(jnp.int32)
    # expected accepted drafts of what is admitted (the policy's calibration check)
    admitted = jnp.arange(g)[None] < ell[:, None]
    predicted = jnp.sum(jnp.where(admitted, sched.prefix_survival(conf), 0.0))
    return dict(tokens=prop["tokens"], probs=prop["probs"], confidence=conf_logits,
                lengths=ell.astype(jnp.int32), n_tokens=n_tokens, capacity_new=cap_new,
                gain_new=gain_new, predicted=predicted.astype(jnp.float32))


draft_and_schedule = jax.jit(with_precision_policy(_draft_and_schedule),
                             static_argnames=("draft_gd", "mode", "cap_budget", "sampler"))


# ------------------------------------------------------------------------------ flattening
def flatten_plan(n_tok: jax.Array, K: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Flattened layout of n_tok[r] tokens per request in K slots, request-major.
    → slot [K], index within its request [K], valid [K], start offset per request [R]."""
    R = n_tok.shape[0]
    cum = jnp.cumsum(n_tok)
    start = cum - n_tok
    k = jnp.arange(K, dtype=jnp.int32)
    slot = jnp.clip(jnp.searchsorted(cum, k, side="right"), 0, R - 1).astype(jnp.int32)
    j = k - start[slot]
    valid = k < cum[-1]
    return slot, j.astype(jnp.int32), valid, start.astype(jnp.int32)


# ------------------------------------------------------------------------------ 3. verify
def _accept(name: str, accept_u, sample_u, tp, dp, drafts, ell):
    """The acceptance rule registered as `name` (`acceptance_rule.VERIFIERS`, explicit
    uniforms: same uniforms → same result)."""
    if drafts.shape[1] == 0:   # scheduler "none": plain decoding, nothing to verify
        return rejection_verify_with_uniforms(accept_u, sample_u, tp, dp, drafts, ell)
    return VERIFIERS[name](accept_u, sample_u, tp, dp, drafts, ell)


BUDGET_RULES = ("serving", "deepspec")


def _verify(target_gd: Any, target_state: Any, s: EngineState, p: SlotSettings,
            drafts: jax.Array, draft_probs: jax.Array, ell: jax.Array, stop_ids: jax.Array, *,
            K: int, verifier: str, tap_layer_ids: tuple[int, ...], budget_rule: str = "serving",
            pad_to: int | None = None) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """Ragged verification of the admitted tokens in capacity K, without touching the state:
    → (per-slot outputs, the writes `_commit` applies). The writes' token axis is padded to
    `pad_to` (≥ K; padding writes nothing), so every bucket of a `lax.switch` returns the same
    shapes; with a family that defers its cache writes (`ragged_forward(defer_writes=True)`)
    the caches are only read here, and XLA copies neither of them. With no drafts (γ = 0:
    `anchor_rounds`, `adaptive`'s plain rounds) the anchors go through the dense cached
    forward over [R, 1] instead, which writes the cache itself: a plain step's cost (the
    ragged path costs more at many requests; figures: BENCHMARKS.md); at one slot the ragged
    one-cell step, writing in place.

    drafts [R, γ], draft_probs [R, γ, V], ell [R] (0 for inactive slots). Returns the new state
    and per slot: emitted tokens [R, γ+1] with their count, and DeepSpec's bookkeeping (SPEC §1
    step 6): a stop token among the accepted drafts at index e records e+1 as both accepted and
    proposed, and adds e+1 (no bonus) to τ. `budget_rule` "serving": a request finishes once
    it has emitted its budget (`remaining` tokens); "deepspec": DeepSpec's `while start <
    max_length` — it finishes only when this round's tokens (before the cut at the budget)
    exceed `remaining`, so a round that ends exactly on the budget is followed by one more.
    """
    target = nnx.merge(target_gd, target_state)
    R, g = drafts.shape
    V = target.cfg.vocab_size
    n_tok = jnp.where(p.active, 1 + ell, 0)
    slot, j, valid, start = flatten_plan(n_tok, K)
    drafts_pad = jnp.concatenate([s.anchor[:, None], drafts], axis=1)         # [R, γ+1]
    tok = drafts_pad[slot, jnp.clip(j, 0, g)]
    pos = s.cache.lengths[slot] + j
    jj = jnp.arange(g + 1, dtype=jnp.int32)
    # the same tokens per request ([R, γ+1] cells): attention reads each cache row once
    grid_rq = jnp.where(jj[None] < n_tok[:, None], start[:, None] + jj[None], K)
    cell_k = slot * (g + 1) + jnp.clip(j, 0, g)
    if R == 1 and 1 < (K if pad_to is None else int(pad_to)) <= g + 1:
        # one request: its tokens are contiguous, so the dense cached forward over [1, K]
        # verifies them, the cache only read and the admitted tokens' rows written by `_commit`
        # (every bucket of a `lax.switch` takes this path alike). It is faster than the
        # ragged path, and XLA:CPU copies a cache that is written inside the branch, which
        # the read-only forward avoids (figures: BENCHMARKS.md)
        dense = target(drafts_pad[:, :K], cache=s.cache, tap_layer_ids=tap_layer_ids,
                       defer_writes=True)
        out = RaggedOutput(hidden=dense.hidden[0], cache=dense.cache,
                           taps=None if dense.taps is None else dense.taps[0],
                           new_kv=None if dense.new_kv is None
                           else jax.tree.map(lambda a: a[:, 0], dense.new_kv))
    elif g == 0 and R == 1:   # one anchor: the ragged one-cell step, writing in place
        # (`plain_steps` takes the dense `decode_one` at every batch size instead)
        out = ragged_forward(target, tok, slot, pos, valid, s.cache,
                             tap_layer_ids=tap_layer_ids, grid=(grid_rq, cell_k))
    elif g == 0:   # the anchors alone, one a slot: the dense cached forward over [R, 1] (as
        # a plain step; a slot that is not active writes past its length, where nothing reads)
        dense = target(s.anchor[:, None], cache=s.cache, tap_layer_ids=tap_layer_ids)
        r_k = jnp.clip(slot, 0, R - 1)                      # token k is slot_k's anchor
        out = RaggedOutput(hidden=dense.hidden[:, 0][r_k], cache=dense.cache,
                           taps=None if dense.taps is None else dense.taps[:, 0][r_k])
    else:
        out = ragged_forward(target, tok, slot, pos, valid, s.cache,
                             tap_layer_ids=tap_layer_ids, grid=(grid_rq, cell_k),
                             defer_writes=True)
    logits = target.logits(out.hidden)                                          # [K, V]
    dense_idx = jnp.clip(start[:, None] + jj[None], 0, K - 1)                   # [R, γ+1]

    def sampled(logits: jax.Array) -> VerifyResult:
        probs_k = filtered_probs(logits, p.temperature[slot], p.top_k[slot], p.top_p[slot])
        tp = probs_k[dense_idx]                                                 # [R, γ+1, V]
        vkeys = _row_keys(p, 1)
        ku = jax.vmap(lambda k: jax.random.split(k))(vkeys)
        accept_u = _row_uniforms(ku[:, 0], (g,))
        sample_u = _row_uniforms(ku[:, 1], ())
        dp = draft_probs if g > 0 else jnp.zeros((R, 0, V), jnp.float32)
        return _accept(verifier, accept_u, sample_u, tp, dp, drafts, ell)

    def greedy(logits: jax.Array) -> VerifyResult:   # the same tokens, from the argmax alone
        return greedy_verify(jnp.argmax(logits, axis=-1)[dense_idx], drafts, ell)

    # every live request greedy (T ≤ 0): one-hot target rows, so the rule needs only the
    # argmax — no [K, V] softmax, no [R, γ+1, V] probabilities gathered
    all_greedy = jnp.all(jnp.where(p.active, p.temperature <= 0, True))
    res = jax.lax.cond(all_greedy, greedy, sampled, logits)
    n_acc = res.num_accepted

    # emitted: accepted drafts then the correction/bonus; cut after a stop token / at budget
    cand = jnp.where(jj[None] < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                     res.next_token[:, None])                                   # [R, γ+1]
    n_emit = n_acc + 1
    stop_hit = is_stop(cand, stop_ids) & (jj[None] < n_emit[:, None])
    any_stop = jnp.any(stop_hit, axis=1)
    first_stop = jnp.argmax(stop_hit, axis=1)
    stop_in_drafts = any_stop & (first_stop < n_acc)
    n_full = jnp.where(any_stop, first_stop + 1, n_emit)
    n_emit = jnp.where(p.active, jnp.minimum(n_full, p.remaining), 0)
    if budget_rule == "deepspec":
        finished = p.active & (any_stop | (n_full > p.remaining))
    elif budget_rule == "serving":
        finished = p.active & (any_stop | (n_emit >= p.remaining))
    else:
        raise ValueError(f"unknown budget_rule {budget_rule!r}; choose from {BUDGET_RULES}")
    acc_rec = jnp.where(stop_in_drafts, first_stop + 1, n_acc)
    prop_rec = jnp.where(stop_in_drafts, first_stop + 1, ell)
    tau_term = jnp.where(stop_in_drafts, first_stop + 1, n_acc + 1)

    n_commit = jnp.where(p.active, n_acc + 1, 0)
    next_tokens = jnp.where(jj[None] < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                            res.next_token[:, None])
    P = K if pad_to is None else int(pad_to)

    def pad(x: jax.Array, fill: Any = 0, axis: int = 0) -> jax.Array:
        width = [(0, 0)] * x.ndim
        width[axis] = (0, P - K)
        return jnp.pad(x, width, constant_values=fill)

    R_drop = s.anchor.shape[0]
    writes = dict(slot=pad(slot), pos=pad(pos), write_k=pad(jnp.where(valid, slot, R_drop),
                                                            R_drop),
                  commit_valid=pad(valid & (j <= n_acc[slot]) & p.active[slot], False),
                  dense_idx=dense_idx, n_commit=n_commit, next_tokens=next_tokens,
                  next_token=res.next_token,
                  taps=None if out.taps is None else pad(out.taps))
    if out.new_kv is None:   # the family wrote its cache itself
        writes["cache"] = out.cache
    else:
        writes["new_kv"] = jax.tree.map(lambda a: pad(a, axis=1), out.new_kv)
    return dict(tokens=cand, n_emit=n_emit, finished=finished, accepted=acc_rec,
                proposed=prop_rec, tau_term=tau_term), writes


def _commit(draft_gd: Any, draft_state: Any, s: EngineState, p: SlotSettings,
            w: dict[str, Any]) -> EngineState:
    """Applies `_verify`'s writes: the anchor and accepted drafts enter the target cache
    (lengths move), and the drafter's context gets the features of exactly those tokens (also
    in rounds that skip drafting, g = 0: its context must hold every committed token)."""
    cache = w["cache"] if "cache" in w else write_ragged(s.cache, w["new_kv"], w["write_k"],
                                                         w["pos"])
    dcache = s.draft_cache
    if draft_gd is not None:
        draft = nnx.merge(draft_gd, draft_state)
        adapter = adapter_for(draft.cfg.model_type)
        dcache = adapter.commit_ragged(draft, dcache, w["taps"], w["slot"], w["pos"],
                                       w["commit_valid"], s.cache.lengths, w["dense_idx"],
                                       w["n_commit"], w["next_tokens"])
    return EngineState(cache=cache.with_lengths(s.cache.lengths + w["n_commit"]),
                       draft_cache=dcache,
                       anchor=jnp.where(p.active, w["next_token"], s.anchor))


@functools.partial(jax.jit, static_argnames=("target_gd", "draft_gd", "K", "verifier",
                                             "tap_layer_ids", "budget_rule", "steps"),
                   donate_argnames=("s",))
@with_precision_policy
def verify_and_commit(target_gd: Any, draft_gd: Any, target_state: Any, draft_state: Any,
                      s: EngineState, p: SlotSettings, drafts: jax.Array,
                      draft_probs: jax.Array, ell: jax.Array, stop_ids: jax.Array,
                      go: jax.Array, *, K: int, verifier: str,
                      tap_layer_ids: tuple[int, ...], budget_rule: str = "serving",
                      steps: int = 1) -> tuple[EngineState, dict[str, jax.Array]]:
    """`steps` verification steps in capacity K as one device call, for profiling (the
    engine's SPS(B), `steps` > 1: the cost a step has inside the rounds' device loop, without
    the call's dispatch and host sync; `bench.spec_round`, one step a call): `_verify` inside a
    `lax.cond` on `go` (traced; pass True), then `_commit` — the structure of the rounds
    (`speculative_rounds`: verify in the capacity bucket's branch, commit after it), in which
    XLA writes the donated caches in place. As one straight-line program XLA:CPU copies each
    cache twice before writing it, a cost the rounds never pay (figures: BENCHMARKS.md). Each
    step commits (its accepted drafts and the next token), so no step repeats another's work.
    → (state, the last step's per-slot outputs)."""
    def one(st: EngineState) -> tuple[EngineState, dict[str, jax.Array]]:
        def verify() -> tuple[dict[str, jax.Array], dict[str, Any]]:
            return _verify(target_gd, target_state, st, p, drafts, draft_probs, ell, stop_ids,
                           K=K, verifier=verifier, tap_layer_ids=tap_layer_ids,
                           budget_rule=budget_rule)

        nothing = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(verify))
        o, w = jax.lax.cond(go, verify, lambda: nothing)
        return _commit(draft_gd, draft_state, st, p, w), o

    s, o = one(s)
    if steps > 1:
        s, o = jax.lax.fori_loop(1, int(steps), lambda _, c: one(c[0]), (s, o))
    return s, o


@functools.partial(jax.jit, static_argnames=("draft_gd", "mode", "cap_budget", "sampler",
                                             "steps"))
@with_precision_policy
def draft_steps(draft_gd: Any, draft_state: Any, s: EngineState, p: SlotSettings,
                stop_ids: jax.Array, conf_temps: jax.Array | None, threshold: jax.Array,
                sps: jax.Array, capacity: jax.Array, sps_draft: jax.Array | None,
                vocab_weights: Any, *, mode: str, cap_budget: bool, sampler: str, steps: int
                ) -> tuple[jax.Array, jax.Array]:
    """`steps` drafting + scheduling steps (`draft_and_schedule`) in one device call, for
    profiling the drafter's time per round as the rounds' device loop pays it. Each step drafts
    from the previous step's first draft token as its anchor, so no step is loop-invariant
    (XLA would hoist it). → (the last anchor [R], the last step's n_tokens)."""
    def one(anchor: jax.Array) -> tuple[jax.Array, jax.Array]:
        d = _draft_and_schedule(draft_gd, draft_state, s.replace(anchor=anchor), p, stop_ids,
                                conf_temps, threshold, sps, capacity, sps_draft,
                                vocab_weights, mode=mode, cap_budget=cap_budget,
                                sampler=sampler)
        return d["tokens"][:, 0].astype(jnp.int32), d["n_tokens"]

    return jax.lax.fori_loop(0, int(steps), lambda _, c: one(c[0]), (s.anchor, jnp.int32(0)))


# ------------------------------------------------------------------------------ 1–3 fused
ROUND_OUTPUTS = ("tokens", "n_emit", "finished", "accepted", "proposed", "tau_term")


@functools.partial(jax.jit, static_argnames=("target_gd", "draft_gd", "buckets", "max_rounds",
                                             "mode", "cap_budget", "sampler", "verifier",
                                             "tap_layer_ids", "budget_rule"),
                   donate_argnames=("s",))
@with_precision_policy
def speculative_rounds(target_gd: Any, draft_gd: Any, target_state: Any, draft_state: Any,
                       s: EngineState, p: SlotSettings, stop_ids: jax.Array,
                       conf_temps: jax.Array | None, threshold: jax.Array, sps: jax.Array,
                       sps_draft: jax.Array | None, vocab_weights: Any, queue: jax.Array,
                       num_rounds: jax.Array, min_done: jax.Array,
                       choice: DraftChoice | None = None, *,
                       buckets: tuple[int, ...], max_rounds: int,
                       mode: str, cap_budget: bool, sampler: str, verifier: str,
                       tap_layer_ids: tuple[int, ...], budget_rule: str
                       ) -> tuple[EngineState, dict[str, jax.Array]]:
    """Up to `num_rounds` (traced, ≤ `max_rounds`) whole rounds in one device call: each
    drafts and schedules (`draft_and_schedule`), picks the smallest capacity bucket K ≥
    Σ(1 + ℓ_r) ON DEVICE (`lax.switch` over the verification programs of every bucket: only the
    chosen one runs) and verifies and commits (`verify_and_commit`), with no host round trip in
    between. A slot's budget, round counter and liveness advance on device exactly as the host
    advances them between single rounds, so every token and record equals the host-stepped
    path. The loop stops when no slot is live, after `num_rounds` rounds, or once `min_done`
    slots have finished (the host can then hand their slots to waiting requests).

    `queue` [2] int32: the capacities of rounds t−2, t−1 (`production`, paper §5.2: round t
    admits the top K_{t−2}; the round's new K enters the queue); the other modes read
    queue[0] as `draft_and_schedule`'s `capacity`. `choice` (`adaptive`; None: every round
    drafts): the host chose to draft the first round; each later round of the call first makes
    the policy's choice on device (`scheduler.drafting_pays` on the estimate of two rounds
    before, `queue[0]` its K) and the call ends, back to the host, at the first round that
    would decode plainly (the host's policy then decides it, with its probes and budget). → (state, per round i < rounds (leading axis
    `max_rounds`): `live` [R] (slots that ran it), `admitted` (queue[0] as the round read
    it), the draft's `lengths` [R] and confidence
    logits [R, γ], `capacity` (the bucket), `n_tokens`, `capacity_new`, `gain_new`,
    `predicted`, and `verify_and_commit`'s per-slot outputs; `rounds` (how many ran), `queue`).
    """
    R = s.anchor.shape[0]
    g = nnx.merge(draft_gd, draft_state).cfg.num_drafts
    bucket_arr = jnp.asarray(buckets, jnp.int32)
    n = max_rounds
    extra = dict(admitted=((), jnp.int32, 0), lengths=((R,), jnp.int32, 0),
                 confidence=((R, g), jnp.float32, 0), capacity=((), jnp.int32, 0),
                 n_tokens=((), jnp.int32, 0), capacity_new=((), jnp.int32, 0),
                 gain_new=((), jnp.float32, 0), predicted=((), jnp.float32, 0))

    def one_round(st: EngineState, pr: SlotSettings, queue: Any):
        ks = queue if choice is None else queue[0]     # the capacities K of t−2, t−1
        d = _draft_and_schedule(draft_gd, draft_state, st, pr, stop_ids, conf_temps,
                                threshold, sps, ks[0], sps_draft, vocab_weights,
                                mode=mode, cap_budget=cap_budget, sampler=sampler)
        b = jnp.searchsorted(bucket_arr, jnp.maximum(d["n_tokens"], 1), side="left")

        def verify_in(K: int):
            def run(x: EngineState):
                return _verify(target_gd, target_state, x, pr, d["tokens"], d["probs"],
                               d["lengths"], stop_ids, K=K, verifier=verifier,
                               tap_layer_ids=tap_layer_ids, budget_rule=budget_rule,
                               pad_to=buckets[-1])
            return run

        # the bucket's verification reads the state; the writes happen once, outside
        o, w = jax.lax.switch(b, [verify_in(K) for K in buckets], st)
        row = dict(admitted=ks[0], lengths=d["lengths"], confidence=d["confidence"],
                   capacity=bucket_arr[b], n_tokens=d["n_tokens"],
                   capacity_new=d["capacity_new"].astype(jnp.int32),
                   gain_new=d["gain_new"].astype(jnp.float32), predicted=d["predicted"], **o)
        ks = jnp.stack([ks[1], row["capacity_new"]])
        if choice is not None:
            realised = jnp.sum(jnp.where(pr.active, o["accepted"], 0)).astype(jnp.float32)
            ks = (ks, queue[1].after_round(row["gain_new"], jnp.sum(pr.active),
                                           row["predicted"], realised))
        return _commit(draft_gd, draft_state, st, pr, w), row, ks

    def drafts_next(q: Any, live: jax.Array) -> jax.Array:   # adaptive: the policy's choice
        ks, c = q
        return sched.drafting_pays(ks[0], c.gain[0], c.n_then[0], jnp.sum(live), c.ratio(),
                                   sps_draft, c.plain_sps, g)

    q0 = queue.astype(jnp.int32)
    if choice is None:
        return _round_loop(one_round, s, p, q0, num_rounds, min_done, n, g, extra)
    return _round_loop(one_round, s, p, (q0, choice), num_rounds, min_done, n, g, extra,
                       proceed=drafts_next)


def _round_loop(one_round: Any, s: EngineState, p: SlotSettings, queue: Any,
                num_rounds: jax.Array, min_done: jax.Array, max_rounds: int, g: int,
                extra: dict[str, tuple[tuple[int, ...], Any, Any]], proceed: Any = None
                ) -> tuple[EngineState, dict[str, jax.Array]]:
    """The device loop of whole rounds shared by `speculative_rounds` and `anchor_rounds`:
    `one_round(state, settings, queue)` → (state, row: `extra`'s outputs and `ROUND_OUTPUTS`
    for tokens of up to g + 1 a slot, queue; `queue` any pytree the rounds carry). A slot's
    budget, round counter and liveness advance on device exactly as the host advances them
    between single rounds. Stops when no slot is live, after `num_rounds` (≤ max_rounds)
    rounds, once `min_done` slots finished, or before a round after the first for which
    `proceed(queue, live)` is False.
    → (state, per round i (leading axis max_rounds): `live` [R] and the rows; `rounds`,
    `queue`)."""
    R, n = s.anchor.shape[0], max_rounds

    def slots(shape, dtype, fill=0):
        return jnp.full((n, *shape), fill, dtype)

    out0 = dict(live=slots((R,), bool, False), tokens=slots((R, g + 1), jnp.int32, -1),
                n_emit=slots((R,), jnp.int32), finished=slots((R,), bool, False),
                accepted=slots((R,), jnp.int32), proposed=slots((R,), jnp.int32),
                tau_term=slots((R,), jnp.int32),
                **{k: slots(shape, dtype, fill) for k, (shape, dtype, fill) in extra.items()})
    init = dict(s=s, live=p.active, remaining=p.remaining, counter=p.counter,
                done=jnp.zeros((R,), bool), queue=queue, i=jnp.zeros((), jnp.int32), out=out0)

    def cond(c: dict[str, Any]) -> jax.Array:
        go = (jnp.any(c["live"]) & (c["i"] < jnp.minimum(num_rounds, n))
              & (jnp.sum(c["done"].astype(jnp.int32)) < min_done))
        if proceed is None:
            return go
        return go & ((c["i"] == 0) | proceed(c["queue"], c["live"]))

    def body(c: dict[str, Any]) -> dict[str, Any]:
        pr = p._replace(active=c["live"], remaining=c["remaining"], counter=c["counter"])
        new_s, row, queue = one_round(c["s"], pr, c["queue"])
        row = dict(row, live=c["live"])
        out = {k: c["out"][k].at[c["i"]].set(row[k].astype(c["out"][k].dtype))
               for k in c["out"]}
        return dict(s=new_s, live=c["live"] & ~row["finished"],
                    remaining=c["remaining"] - row["n_emit"],
                    counter=c["counter"] + c["live"].astype(jnp.int32),
                    done=c["done"] | row["finished"], queue=queue, i=c["i"] + 1, out=out)

    c = jax.lax.while_loop(cond, body, init)
    return c["s"], dict(c["out"], rounds=c["i"], queue=c["queue"])


@functools.partial(jax.jit, static_argnames=("target_gd", "draft_gd", "K", "max_rounds",
                                             "verifier", "tap_layer_ids", "budget_rule"),
                   donate_argnames=("s",))
@with_precision_policy
def anchor_rounds(target_gd: Any, draft_gd: Any, target_state: Any, draft_state: Any,
                  s: EngineState, p: SlotSettings, stop_ids: jax.Array, num_rounds: jax.Array,
                  min_done: jax.Array, *, K: int, max_rounds: int, verifier: str,
                  tap_layer_ids: tuple[int, ...], budget_rule: str
                  ) -> tuple[EngineState, dict[str, jax.Array]]:
    """Up to `num_rounds` (traced, ≤ `max_rounds`) rounds that skip drafting in one device
    call: `adaptive`'s plain stretches (`serving.policy`). Each verifies the anchors alone
    (drafts of width 0, ℓ = 0) in capacity K and commits them, the drafter's context fed with
    their features, exactly as `verify_and_commit` with no drafts, round after round, with
    the loop and outputs of `speculative_rounds` (tokens [R, 1] a round)."""
    R = s.anchor.shape[0]
    V = nnx.merge(target_gd, target_state).cfg.vocab_size
    drafts, probs = jnp.zeros((R, 0), jnp.int32), jnp.zeros((R, 0, V), jnp.float32)
    ell = jnp.zeros((R,), jnp.int32)

    def one_round(st: EngineState, pr: SlotSettings, queue: jax.Array):
        o, w = _verify(target_gd, target_state, st, pr, drafts, probs, ell, stop_ids, K=K,
                       verifier=verifier, tap_layer_ids=tap_layer_ids, budget_rule=budget_rule)
        return _commit(draft_gd, draft_state, st, pr, w), o, queue

    return _round_loop(one_round, s, p, jnp.zeros((2,), jnp.int32), num_rounds, min_done,
                       max_rounds, 0, {})


# ------------------------------------------------------------------------------ prefill
@functools.partial(jax.jit, static_argnames=("target_gd", "draft_gd", "chunk", "tap_layer_ids"),
                   donate_argnames=("s",))
@with_precision_policy
def prefill_prompts(target_gd: Any, draft_gd: Any, target_state: Any, draft_state: Any,
                    s: EngineState, p: SlotSettings, tokens: jax.Array, lens: jax.Array,
                    slots: jax.Array, *, chunk: int, tap_layer_ids: tuple[int, ...]
                    ) -> tuple[EngineState, jax.Array]:
    """Prefills n joining requests at once, densely (`models.decoder.prefill`, in chunks of
    `chunk` tokens): `tokens` [n, P] right-padded prompts of `lens` [n] tokens for slots
    `slots` [n] (a slot ≥ R is a padding row: nothing is written). Their K/V enter the slots'
    target cache, the drafter's context gets the features of every prompt token, and each
    slot's first token is sampled from its own key (folded with −1) and becomes its anchor.
    → (state, first token [n])."""
    target = nnx.merge(target_gd, target_state)
    n, P = tokens.shape
    R = s.anchor.shape[0]
    out = prefill(target, tokens, chunk, tap_layer_ids=tap_layer_ids,
                  cache_dtype=jax.tree.leaves(s.cache.k)[0].dtype)
    rows = jnp.clip(slots, 0, R - 1)
    h_last = out.hidden[jnp.arange(n), lens - 1]                                # [n, D]
    probs = filtered_probs(target.logits(h_last), p.temperature[rows], p.top_k[rows],
                           p.top_p[rows])
    keys = jax.random.wrap_key_data(p.key_data[rows], impl="threefry2x32")
    u = _row_uniforms(jax.vmap(jax.random.fold_in)(keys, jnp.full((n,), -1, jnp.int32)
                                                   .astype(jnp.uint32)), ())
    first = inverse_cdf_sample(probs, u)
    cache = s.cache.put_rows(out.cache, slots, lens)
    dcache = s.draft_cache
    if draft_gd is not None:
        draft = nnx.merge(draft_gd, draft_state)
        t = jnp.arange(P, dtype=jnp.int32)
        # token t of a prompt is followed by token t + 1, its last by the sampled first token
        nxt = jnp.where(t[None] == lens[:, None] - 1, first[:, None],
                        jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))))                # [n, P]
        joined = jnp.zeros((R,), bool).at[slots].set(True, mode="drop")
        row_of = jnp.zeros((R,), jnp.int32).at[slots].set(jnp.arange(n, dtype=jnp.int32),
                                                         mode="drop")           # slot → row
        dcache = adapter_for(draft.cfg.model_type).commit_ragged(
            draft, dcache, out.taps.reshape(n * P, -1), jnp.repeat(slots, P),
            jnp.tile(t, n), (t[None] < lens[:, None]).reshape(-1),
            jnp.where(joined, 0, s.cache.lengths),
            row_of[:, None] * P + t[None], jnp.where(joined, lens[row_of], 0),
            nxt[row_of])
    return EngineState(cache=cache, draft_cache=dcache,
                       anchor=s.anchor.at[slots].set(first, mode="drop")), first
