"""One `Engine.generate` / `Engine.serve` call on the host (paper §5.2–5.4; SPEC §8, §9): the
request queue, admission into free slots, the prefill of joining prompts, the per-request
records and the loop of device calls (`Run`), with the records it returns (`EngineResult`) and
the requests it takes (`Request`). A run reads its engine's immutable spec
(`serving.engine_spec.EngineSpec`: the round programs' config and arrays, the caches' layout
and lengths); the `Engine` (`serving.engine`) holds what lasts across runs — the drafting
policy, the prefill shapes and capacity buckets compiled so far — and a run drives them."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding import speculative_round as round_
from dspark_jax.decoding.plain_steps import plain_prefill, plain_steps
from dspark_jax.decoding.prefill_plan import shaped_prefill_groups
from dspark_jax.decoding.round_types import EngineState, RoundConfig, RoundOutputs, RoundsResult
from dspark_jax.decoding.sampling import check_sampling, top_k_cap_for
from dspark_jax.serving import policy
from dspark_jax.serving.engine_spec import EngineSpec, bucket_for
from dspark_jax.serving.records import RequestRecord, RoundSummary


@dataclasses.dataclass
class EngineResult:
    """Output of `Engine.generate` (the names are part of the stable API)."""

    tokens: list[list[int]]              # generated ids per prompt (prompt excluded)
    rounds: list[RoundSummary]           # per engine step: active, verified_tokens, capacity, …
    per_request: list[RequestRecord]     # accepted/proposed per round, first_token_s, finish_s
    wall_s: float = 0.0

    @property
    def tau(self) -> float:
        """DeepSpec's pooled accepted length over all requests and rounds."""
        terms = [t for r in self.per_request for t in r.acceptance]
        return float(sum(terms) / max(len(terms), 1))


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of `Engine.serve`: prompt ids, its sampling settings and its own key
    (threefry key data, uint32 [2]: its sampled tokens depend on nothing else — not the slot,
    not the neighbours; in plain decoding, requests sharing one top-k also draw the same
    tokens in any batch). `handle`: anything the caller wants back in `on_reply`."""

    prompt: Sequence[int]
    key_data: Any
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    arrival_s: float = 0.0
    handle: Any = None


def _per_prompt(value: Any, n: int, name: str, cast: type) -> list:
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} prompts")
        return [cast(v) for v in value]
    return [cast(value)] * n


def requests_for(prompts: Sequence[Sequence[int]], temperature: Any = 0.0, seed: Any = 0,
                 arrivals: Sequence[float] | None = None, top_k: Any = 0, top_p: Any = 1.0
                 ) -> list[Request]:
    """`Engine.generate`'s requests: temperature / top_k / top_p / seed one value or one per
    prompt (one seed: split into a key per prompt; one per prompt: each its own key);
    `arrivals` [s after the call] each request's join; `handle` the prompt's index."""
    n = len(prompts)
    if n == 0:
        raise ValueError("no prompts given")
    temps = _per_prompt(temperature, n, "temperature", float)
    tks = _per_prompt(top_k, n, "top_k", int)
    tps = _per_prompt(top_p, n, "top_p", float)
    seeds = _per_prompt(seed, n, "seed", int)
    if isinstance(seed, (list, tuple, np.ndarray)):
        kd = [np.asarray(jax.random.key_data(jax.random.key(s, impl="threefry2x32")))
              for s in seeds]
    else:
        base = jax.random.split(jax.random.key(int(seed), impl="threefry2x32"), n)
        kd = list(np.asarray(jax.random.key_data(base)))
    arr_t = [0.0] * n if arrivals is None else [float(a) for a in arrivals]
    if len(arr_t) != n:
        raise ValueError(f"arrivals: {len(arr_t)} values for {n} prompts")
    return [Request(prompts[i], kd[i], temps[i], tks[i], tps[i], arr_t[i], handle=i)
            for i in range(n)]


class Served(Protocol):
    """What a run reads of its engine (`serving.Engine`): the spec, the state factory that
    grows the caches, the drafting policy that persists across runs and its factory, the
    config of a call's rounds, and the prefill shapes compiled so far (by cache length and
    top-k cap)."""

    spec: EngineSpec
    policy: policy.Policy | None
    prefill_shapes: dict[tuple[int, int], set[tuple[int, int]]]

    def grown(self, state: EngineState, cache_len: int) -> EngineState: ...

    def new_policy(self) -> policy.Policy | None: ...

    def rounds_config(self, max_active: int | None = None) -> RoundConfig: ...


# What compiling one more prefill shape is worth, in padded prompt tokens: a join prefills in a
# shape already compiled, or in fewer groups, unless that pads more tokens than this
# (`prefill_plan.shaped_prefill_groups`).
NEW_PREFILL_SHAPE_TOKENS = 1024


class Run:
    """Host bookkeeping of one `Engine.generate` / `Engine.serve` call: the request queue,
    admission into free slots, the per-request records and the run loop."""

    def __init__(self, eng: Served, max_new: int, *, fresh_policy: bool = False,
                 progress: bool = False, total: int | None = None,
                 on_reply: Callable[[Request, list[int]], Sequence[Request]] | None = None,
                 after_replies: Callable[[], None] | None = None,
                 max_active: int | None = None):
        self.eng, self.spec, self.max_new = eng, eng.spec, int(max_new)
        R, self.plain = self.spec.num_slots, not self.spec.mode.drafts
        # the drafting rounds' program: the buckets `max_active` requests can reach
        self.config = self.spec.config if self.plain else eng.rounds_config(max_active)
        self.requests: list[Request] = []
        self.prompts: list[list[int]] = []
        self.out: list[list[int]] = []
        self.per: list[RequestRecord] = []
        self.on_reply, self.after_replies = on_reply, after_replies
        self.ended = 0          # requests ended since `after_replies` last ran
        self.rounds: list[RoundSummary] = []
        self.host = self.spec.empty_slots()
        self.slot_req = [-1] * R
        self.free = collections.deque(range(R))
        self.pending: collections.deque[int] = collections.deque()
        self.step_s = 0.0       # seconds per step / round (last call), for arrivals
        # adaptive: the engine's drafting policy (its state persists across calls);
        # production: a fresh capacity queue for this run
        self.policy: policy.Policy | None = eng.policy
        if self.policy is not None and (fresh_policy or not self.policy.persists):
            self.policy = eng.new_policy()
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="speculative" if not self.plain else "decode",
                            unit="tok", dynamic_ncols=True)

    def add(self, req: Request, label: Any = None) -> int:
        """Queues a request (validated); → its index in the result."""
        i = len(self.requests)
        self.spec.check_prompt(i if label is None else label, req.prompt, self.max_new)
        check_sampling(req.temperature, req.top_k, req.top_p,
                       where=f"request {i if label is None else label}: ")
        self.requests.append(req)
        self.prompts.append(list(map(int, req.prompt)))
        self.out.append([])
        self.per.append(RequestRecord(arrival_s=float(req.arrival_s),
                                      prompt_tokens=len(req.prompt)))
        self.pending.append(i)
        return i

    # -------------------------------------------------------------- joins
    def _admit(self, now: float) -> list[int]:
        joined, host = [], self.host
        while (self.pending and self.free
               and self.requests[self.pending[0]].arrival_s <= now):
            i = self.pending.popleft()
            r = self.free.popleft()
            self.slot_req[r] = i
            self.per[i].join_s = now
            req = self.requests[i]
            host.temperature[r], host.top_k[r], host.top_p[r] = (
                req.temperature, req.top_k, req.top_p)
            host.key_data[r] = np.asarray(req.key_data, np.uint32)
            host.counter[r], host.remaining[r], host.active[r] = 1, self.max_new, False
            joined.append(r)
        return joined

    def _cache_need(self, prompts: list[int]) -> int:
        """Cache positions the requests of `prompts` need: prompt, budget and, speculating,
        one more verified block."""
        return (max(len(self.prompts[i]) for i in prompts) + self.max_new + 1
                + (0 if self.plain else self.spec.gamma))

    def _fit_cache(self, state: EngineState, slots: list[int]) -> EngineState:
        """Grows the caches (`EngineSpec.cache_lengths`, up to max_len) to hold the joining
        requests (attention reads the whole cache, so a short one is a faster step)."""
        n = self.spec.cache_length_for(self._cache_need([self.slot_req[r] for r in slots]))
        return self.eng.grown(state, n) if n > state.cache.max_len else state

    def _prefill(self, state: EngineState, slots: list[int]) -> EngineState:
        """The joining prompts prefilled together, densely (plain: `plain_steps.plain_prefill`;
        speculative: `speculative_round.prefill_prompts`, which also feeds the drafter's
        context), in groups of at most R padded to a power-of-two size (padding rows write
        nothing) and to a `len_bucket` multiple of tokens (a `prefill_chunk` multiple past it,
        run chunk by chunk), at most `prefill_tokens` padded tokens a call and slot shard
        (`EngineSpec.prefill_call_tokens`; one longer prompt alone), so few shapes compile and
        a join's memory stays bounded;
        `shaped_prefill_groups` splits the joiners by length where that computes fewer padded
        tokens, counting a shape not compiled yet as `NEW_PREFILL_SHAPE_TOKENS` more, and may
        run a group in a larger compiled shape."""
        spec, st = self.spec, self.spec.settings
        R, arrays = spec.num_slots, spec.arrays
        state = self._fit_cache(state, slots)
        settings = self.host.to_device()
        cap = top_k_cap_for([int(self.host.top_k[r]) for r in slots], spec.vocab_size)
        lengths = [len(self.prompts[self.slot_req[r]]) for r in slots]
        compiled = self.eng.prefill_shapes.setdefault((int(state.cache.max_len), cap), set())
        for idx, n, width in shaped_prefill_groups(lengths, R, st.len_bucket,
                                                   st.prefill_chunk, state.cache.max_len,
                                                   compiled, NEW_PREFILL_SHAPE_TOKENS,
                                                   max_tokens=spec.prefill_call_tokens):
            compiled.add((n, width))
            group = [slots[i] for i in idx]
            tokens = np.zeros((n, width), np.int32)
            lens = np.ones((n,), np.int32)
            rows = np.full((n,), R, np.int32)     # R: a padding row, dropped
            for j, r in enumerate(group):
                prompt = self.prompts[self.slot_req[r]]
                tokens[j, :len(prompt)], lens[j], rows[j] = prompt, len(prompt), r
            args = (jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(rows))
            chunk = min(width, st.prefill_chunk)
            if self.plain:
                state, first = plain_prefill(arrays.target_graphdef, arrays.target_state,
                                             state, settings, *args, chunk=chunk,
                                             top_k_cap=cap)
            else:
                state, first = round_.prefill_prompts(spec.config, arrays, state, settings,
                                                      *args, chunk=chunk)
            first = np.asarray(first)
            self._first_tokens([(r, int(first[j])) for j, r in enumerate(group)])
        return state

    def _first_tokens(self, firsts: list[tuple[int, int]]) -> None:
        """Books each joined slot's first token (sampled by its prefill)."""
        now = time.perf_counter() - self.t0
        stops = set(np.asarray(self.spec.arrays.stop_ids).tolist()) - {-1}
        for r, t in firsts:
            i = self.slot_req[r]
            self.out[i].append(t)
            if self.bar is not None:
                self.bar.update(1)
            self.per[i].first_token_s = now
            # DeepSpec's loop runs a round even with a budget of one token
            if t in stops or (self.max_new <= 1 and self.config.budget_rule == "serving"):
                self._finish(r, now)
            else:
                self.host.active[r], self.host.remaining[r] = True, self.max_new - 1

    def _finish(self, r: int, now: float) -> None:
        i = self.slot_req[r]
        self.per[i].finish_s = now
        self.host.active[r] = False
        self.slot_req[r] = -1
        self.free.append(r)
        self.ended += 1
        if self.on_reply is not None:
            for req in self.on_reply(self.requests[i], list(self.out[i])) or ():
                self.add(dataclasses.replace(req, arrival_s=min(req.arrival_s, now)))

    # -------------------------------------------------------------- rounds
    def _record(self, r: int, tokens: Sequence[int], accepted: Sequence[int],
                proposed: Sequence[int], acceptance: Sequence[int], rounds: int) -> None:
        i = self.slot_req[r]
        self.out[i].extend(int(x) for x in tokens)
        pr = self.per[i]
        pr.accepted.extend(accepted)
        pr.proposed.extend(proposed)
        pr.acceptance.extend(acceptance)
        self.host.remaining[r] -= len(tokens)
        self.host.counter[r] += rounds

    def _plain_round(self, state: EngineState, max_steps: int | None = None) -> EngineState:
        """Plain decoding (scheduler "none"): up to `plain_steps_per_call` steps in one device
        call (`decoding.plain_steps`), back on the host as soon as a slot can be handed to a
        waiting request, or when the next one arrives."""
        spec, host, config = self.spec, self.host, self.config
        t_start = time.perf_counter()
        n_active = int(host.active.sum())
        steps, min_done = self._call_budget(max_steps, config.plain_rounds_per_call)
        cap = top_k_cap_for([int(k) for k in host.top_k[host.active]], spec.vocab_size)
        state, out = plain_steps(spec.arrays.target_graphdef, spec.arrays.target_state, state,
                                 host.to_device(), spec.arrays.stop_ids,
                                 jnp.asarray(steps, jnp.int32), jnp.asarray(min_done, jnp.int32),
                                 max_steps=config.plain_rounds_per_call, top_k_cap=cap,
                                 budget_rule=config.budget_rule)
        out = jax.device_get(out)
        emitted = self._book_round(out, host.active.copy(), time.perf_counter() - self.t0)
        n_steps = int(out.tau_term.max(initial=0))
        seconds = time.perf_counter() - t_start
        self.step_s = seconds / max(n_steps, 1)
        self.rounds.append(RoundSummary(active=n_active, verified_tokens=0,
                                        capacity=spec.buckets[0], tokens=emitted, drafted=False,
                                        seconds=seconds, steps=n_steps,
                                        cache_len=int(state.cache.max_len)))
        return state

    def _call_budget(self, max_steps: int | None, per_call: int) -> tuple[int, int]:
        """(steps or rounds for this device call, min_done): back on the host as soon as a
        slot can be handed to a waiting request, or in time for the next arrival."""
        steps, min_done = per_call, self.spec.num_slots + 1
        if max_steps is not None:
            steps = min(steps, int(max_steps))
        if self.pending:
            if not self.free:
                min_done = 1
            else:   # a free slot awaits a later arrival: return in time for it
                wait = (self.requests[self.pending[0]].arrival_s
                        - (time.perf_counter() - self.t0))
                if self.step_s > 0:
                    steps = int(min(steps, max(1, wait // self.step_s + 1)))
        return steps, min_done

    def _round(self, state: EngineState, max_steps: int | None = None) -> EngineState:
        """Speculative rounds: up to `rounds_per_call` whole rounds in one device call
        (`speculative_round.speculative_rounds`). The policy decides the first round on the
        host (`adaptive`: the device makes the same choice before each later round and ends
        the call at the first that would not draft), then replays the rounds the device ran.
        A round it does not draft verifies the anchors alone (`_anchor_rounds`)."""
        if self.plain:
            return self._plain_round(state, max_steps)
        spec = self.spec
        t_start = time.perf_counter()
        n_active = int(self.host.active.sum())
        drafted, capacity = self.policy.decide(n_active)
        if not drafted:   # plain decoding: ℓ = 0, the drafter not run
            return self._anchor_rounds(state, n_active, t_start)
        rounds, min_done = self._call_budget(max_steps, self.config.rounds_per_call)
        state, result = round_.speculative_rounds(
            self.config, spec.arrays, state, self.host.to_device(),
            spec.schedule_state(*self.policy.device_schedule(capacity)),
            jnp.asarray(rounds, jnp.int32), jnp.asarray(min_done, jnp.int32))
        result, now, seconds = self._fetch_rounds(result, t_start)
        records = result.records   # unpacked once, on the host
        for i in range(int(result.rounds)):
            record = jax.tree.map(lambda a: a[i], records)
            live, decided = record.live, record.schedule
            self.policy.replay(i == 0, policy.Estimate(int(decided.capacity_new),
                                                       float(decided.gain_new),
                                                       int(live.sum())),
                               float(decided.predicted),
                               float(np.sum(record.outputs.accepted[live])))
            emitted = self._book_round(record.outputs, live, now, decided.confidence)
            self.rounds.append(RoundSummary(
                active=int(live.sum()), verified_tokens=int(decided.lengths[live].sum()),
                capacity=int(decided.capacity), tokens=emitted, drafted=True, seconds=seconds,
                steps=1, admitted_capacity=int(decided.admitted)))
        return state

    def _fetch_rounds(self, result: RoundsResult, t_start: float
                      ) -> tuple[RoundsResult, float, float]:
        """A rounds call's result on the host: → (result, run time now, seconds a round), the
        last also kept as the pace for arrivals (`step_s`)."""
        result = jax.device_get(result)
        now = time.perf_counter() - self.t0
        self.step_s = (time.perf_counter() - t_start) / max(int(result.rounds), 1)
        return result, now, self.step_s

    def _book_round(self, outputs: RoundOutputs, live: np.ndarray, now: float,
                    confidence: np.ndarray | None = None) -> int:
        """Books one round's per-slot outputs ([R, …] on the host) for the slots in `live`:
        tokens, acceptance records, confidence logits, finished requests; a call of plain
        steps (no drafts) books each slot's `tau_term` steps as rounds of one token. → tokens
        emitted."""
        emitted = 0
        for r in np.nonzero(live)[0]:
            m = int(outputs.n_emit[r])
            if confidence is not None:   # confidence logits of this round's proposals
                self.per[self.slot_req[r]].confidence.append(
                    np.asarray(confidence[r], np.float32))
            if outputs.accepted is None:   # plain steps
                k = int(outputs.tau_term[r])
                self._record(r, outputs.tokens[r, :m], [0] * k, [0] * k, [1] * k, k)
            else:
                self._record(r, outputs.tokens[r, :m], [int(outputs.accepted[r])],
                             [int(outputs.proposed[r])], [int(outputs.tau_term[r])], 1)
            emitted += m
            if outputs.finished[r]:
                self._finish(r, now)
        if self.bar is not None:
            self.bar.update(emitted)
        return emitted

    def _anchor_rounds(self, state: EngineState, n_active: int, t_start: float) -> EngineState:
        """Rounds that skip drafting (`adaptive`): the anchors alone are verified (drafts of
        width 0) in the smallest bucket, and the drafter's context is still fed. The policy's
        next plain choices are known ahead (`DraftPolicy.plain_rounds`), so up to
        `plain_steps_per_call` of them run in one device call (`anchor_rounds`), back on the
        host once a slot finishes (the active count the choices assumed changes then)."""
        spec, per_call = self.spec, self.config.plain_rounds_per_call
        want = self.policy.plain_rounds(n_active, per_call)
        rounds, _ = self._call_budget(want, per_call)
        K = bucket_for(spec.buckets, max(n_active, 1))
        state, result = round_.anchor_rounds(spec.config, spec.arrays, state,
                                             self.host.to_device(),
                                             jnp.asarray(rounds, jnp.int32),
                                             jnp.asarray(1, jnp.int32), capacity=K)
        result, now, seconds = self._fetch_rounds(result, t_start)
        records = result.records   # unpacked once, on the host
        for i in range(int(result.rounds)):
            if i:   # replays the choice made ahead (the same n_active: no slot finished)
                self.policy.decide(n_active)
            self.policy.update(False)
            record = jax.tree.map(lambda a: a[i], records)
            emitted = self._book_round(record.outputs, record.live, now)
            self.rounds.append(RoundSummary(active=n_active, verified_tokens=0, capacity=K,
                                            tokens=emitted, drafted=False, seconds=seconds,
                                            steps=1))
        return state

    def start_state(self) -> EngineState:
        """Empty slots whose caches hold what the requests joining first need (`_fit_cache`
        for the first R queued at the start), so a run starts with no cache to grow."""
        first = [i for i in list(self.pending)[:self.spec.num_slots]
                 if self.requests[i].arrival_s <= 0]
        if not first:
            return self.spec.fresh_state(self.spec.cache_lengths()[0])
        return self.spec.fresh_state(self.spec.cache_length_for(self._cache_need(first)))

    def loop(self) -> EngineResult:
        state = self.start_state()
        self.t0 = time.perf_counter()
        while self.pending or self.host.active.any():
            now = time.perf_counter() - self.t0
            joined = self._admit(now)
            if joined:
                state = self._prefill(state, joined)
            if self.host.active.any():
                state = self._round(state)
            elif self.pending and self.free:
                wait = (self.requests[self.pending[0]].arrival_s
                        - (time.perf_counter() - self.t0))
                if wait > 0:
                    time.sleep(wait)
            if self.ended and self.after_replies is not None:
                self.after_replies()
            self.ended = 0
        self.final_state = state
        if self.bar is not None:
            self.bar.close()
        return EngineResult(tokens=self.out, rounds=self.rounds, per_request=self.per,
                            wall_s=time.perf_counter() - self.t0)
