"""`dspark_jax.serving.Engine`: continuous-batching speculative decoding with load-aware
verification (paper §3.2.2 Algorithm 1, §5.2–5.4; SPEC §1, §8, §9).

A fixed number of request slots share one static target KV cache [R, max_len] and one drafter
context cache. Requests join between device calls (the joining prompts are prefilled together,
densely, `prefill_chunk` tokens of each at a time) and leave at a stop token or at max_new_tokens;
a freed slot is reused by the next request without recompiling. Every round: draft all slots →
schedule on the current confidences (`scheduler`: none / fixed / threshold / algorithm1 /
production / adaptive) → ragged verification of exactly the admitted tokens in the smallest
capacity bucket that holds them → commit, all in one device call; up to `rounds_per_call` rounds
run per call (`decoding.speculative_round.speculative_rounds`), back on the host when a slot can go
to a waiting request (`adaptive`: the host decides a call's first round, the device each later
one, and the call ends at the first round it would not draft; its stretches of plain rounds run
up to `plain_steps_per_call` a call, `speculative_round.anchor_rounds`). Each
request keeps its own temperature, top-k, top-p and seed. `sampler="pallas"` / `verifier="pallas"`
run the Markov-head sampling / verification Pallas kernels (compiled on GPU and TPU, interpreted on
CPU) in place of their pure-JAX oracles. SPS(B) for the scheduler is profiled at start over the
buckets (cached on disk) or passed in. `production` is the paper's §5.2 schedule alone: every round
drafts and admits the top K of its current candidates, K the argmax of τ · SPS(B) found on the
confidences of two rounds before (`serving.policy.CapacityQueue`). `adaptive` is that schedule plus
our switch: the engine also profiles the drafter's time per round and the plain step, the search
prices the drafter, and each round first chooses between plain decoding (drafter not run) and
drafting, whichever is expected to emit more tokens per second (`serving.policy`: the rule, and why
it is lossless).

`scheduler="none"` is plain decoding on the same slots (`decoding.plain_steps`): several
one-token steps per device call, back on the host only when a slot can be handed to a waiting
request. The caches grow to what the admitted requests need (`Engine.cache_lengths`). `serve`
takes a stream of requests whose replies may queue follow-ups (regeneration's conversation
turns run on it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import speculative_round as round_
from dspark_jax.decoding.draft_adapters import adapter_for
from dspark_jax.decoding.plain_steps import plain_prefill, plain_steps
from dspark_jax.decoding.prefill_plan import prefill_groups, prefill_length
from dspark_jax.decoding.round_types import (EngineArrays, EngineState, RoundConfig,
                                             RoundOutputs, RoundsResult, ScheduleState,
                                             SlotSettings)
from dspark_jax.decoding.sampling import top_k_cap_for
from dspark_jax.decoding.stops import stop_array
from dspark_jax.models.decoder import aligned_length
from dspark_jax.models.drafters.dspark import with_layer_buffers as draft_layer_buffers
from dspark_jax.serving import cost_profile, policy
from dspark_jax.serving.settings import EngineSettings

# speculative decoding's cache lengths, in `len_bucket`s: the powers of two and 1.5× them
_SPECULATIVE_LENGTHS = sorted({2 ** k for k in range(40)} | {3 * 2 ** k for k in range(40)})


@dataclasses.dataclass
class EngineResult:
    """Output of `Engine.generate` (the names are part of the stable API)."""

    tokens: list[list[int]]          # generated ids per prompt (prompt excluded)
    rounds: list[dict[str, Any]]     # per engine step: active, verified_tokens, capacity, seconds
    per_request: list[dict[str, Any]]  # accepted/proposed per round, first_token_s, finish_s
    wall_s: float = 0.0

    @property
    def tau(self) -> float:
        """DeepSpec's pooled accepted length over all requests and rounds."""
        terms = [t for r in self.per_request for t in r["acceptance"]]
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


class Engine:
    """Continuous-batching speculative decoding engine (see module docstring).

    `Engine(target, draft, **kw)`: the keywords are the fields of `EngineSettings` (what each
    does: its docstring), or pass `settings=`; they are validated before anything is built.
    The adaptive policy's learned state persists across `generate` calls; `reset_policy()`
    forgets it. `production`'s two-rounds-old capacity queue starts over with every call.
    """

    def __init__(self, target: Any, draft: Any = None, *,
                 settings: EngineSettings | None = None, **kwargs: Any):
        if settings is None:
            settings = EngineSettings(**kwargs)
        elif kwargs:
            settings = dataclasses.replace(settings, **kwargs)
        settings.validate().check_models(target, draft)
        self.settings, self.target = settings, target
        self.mode, self.mode_traits = settings.scheduler, policy.MODES[settings.scheduler]
        self.R, self.max_len = int(settings.max_requests), int(settings.max_len)
        self.plain_steps_per_call = int(settings.plain_steps_per_call)
        self.rounds_per_call = int(settings.rounds_per_call)
        self.budget_rule, self.cap_to_budget = settings.budget_rule, settings.caps_budget
        # decoding steps and verification run on the target in `layer_buffers`' layout (one
        # buffer per layer by default); the prefill's long forwards keep the stacked one
        self.step_target = target.decoding_layout(settings.layer_buffers)
        self.draft = draft if self.mode_traits.drafts else None
        self.gamma = int(self.draft.config.num_drafts) if self.draft is not None else 0
        self.V = int(target.config.vocab_size)
        self.buckets = cost_profile.capacity_buckets(self.R, self.gamma,
                                                     settings.capacity_buckets)
        if self.buckets[-1] > self.max_len * self.R:
            raise ValueError("capacity_buckets exceed what max_len can hold")
        self.config = RoundConfig(
            mode=self.mode, verifier=settings.verifier, sampler=settings.sampler,
            budget_rule=self.budget_rule, cap_budget=self.cap_to_budget,
            tap_layer_ids=(tuple(self.draft.config.target_layer_ids)
                           if self.draft is not None else ()),
            buckets=self.buckets, rounds_per_call=self.rounds_per_call,
            plain_rounds_per_call=self.plain_steps_per_call)
        self.arrays = self._engine_arrays()
        self.stop_ids = self.arrays.stop_ids
        self.costs = cost_profile.engine_costs(self)
        self.arrays = self.arrays.replace(sps=jnp.asarray(self.costs.sps),
                                          sps_draft=jnp.asarray(self.costs.sps_draft))
        self.sps, self.bucket_seconds = self.arrays.sps, self.costs.bucket_seconds
        self.profile_seconds = self.costs.profile_seconds
        self.cost_profile_seconds = self.costs.cost_profile_seconds
        self.reset_policy()

    def _engine_arrays(self) -> EngineArrays:
        """The arrays every round program reads (SPS flat until the costs are known)."""
        cfg, st = self.target.config, self.settings
        default_stops = getattr(self.target.tokenizer, "stop_token_ids", None) or \
            cfg.stop_token_ids
        temps = st.confidence_temperatures_for(self.draft, self.gamma)
        draft_graphdef = draft_state = vocab_weights = None
        if self.draft is not None:
            draft_graphdef, draft_state = self.draft.graphdef, self.draft.state
            if self.step_target is not self.target:   # per-layer buffers
                draft_graphdef, draft_state = draft_layer_buffers(draft_graphdef, draft_state)
            adapter = adapter_for(self.draft.config.model_type)
            # the draft vocabulary's weight rows, gathered once (not in every drafting call)
            vocab_weights = jax.jit(lambda state: adapter.vocab_weights(
                nnx.merge(draft_graphdef, state)))(draft_state)
        flat = jnp.ones((self.buckets[-1] + 1,), jnp.float32)
        return EngineArrays(
            target_graphdef=self.step_target.graphdef, draft_graphdef=draft_graphdef,
            target_state=self.step_target.state, draft_state=draft_state,
            stop_ids=stop_array(st.stop_token_ids, default_stops),
            confidence_temperatures=None if temps is None else jnp.asarray(temps, jnp.float32),
            threshold=jnp.asarray(float(st.threshold), jnp.float32), sps=flat, sps_draft=flat,
            vocab_weights=vocab_weights)

    @property
    def prefill_arrays(self) -> EngineArrays:
        """The round arrays with the stacked target, which the prefill's long forwards run."""
        return self.arrays.replace(target_graphdef=self.target.graphdef,
                                   target_state=self.target.state)

    # ------------------------------------------------------------------ state
    def fresh_state(self, cache_len: int | None = None) -> EngineState:
        """Empty slots. `cache_len` (default: the longest of `cache_lengths`): the caches'
        initial length, which `_Run` grows as longer requests join (`_grown`)."""
        n = cache_len or self.cache_lengths()[-1]
        cache = self.step_target.init_cache(self.R, n, self.target.dtype)
        draft_cache = None
        if self.draft is not None:
            draft_cache = adapter_for(self.draft.config.model_type).init_cache(
                self.draft.model, self.R, n)
        return EngineState(cache=cache, draft_cache=draft_cache,
                           anchor=jnp.zeros((self.R,), jnp.int32))

    def _grown(self, state: EngineState, cache_len: int) -> EngineState:
        """The state with room for `cache_len` positions in the target and drafter caches."""
        adapter = adapter_for(self.draft.config.model_type) if self.draft is not None else None
        return _grown_state(state, cache_len=int(cache_len), adapter=adapter)

    def cache_lengths(self) -> list[int]:
        """The cache lengths a run can grow through (`_Run._fit_cache`): plain decoding's
        `len_bucket` multiples; speculative decoding's `len_bucket` times 1, 2, 3, 4, 6, 8,
        12, … (a power of two and 1.5× it: its programs cost more to compile, and every step
        attends over the whole cache, so a length at most a third too long — powers of two
        alone: up to twice — keeps its rounds' attention near plain decoding's; a cache a third
        longer than plain decoding's already slows `adaptive`'s plain rounds measurably, figures:
        BENCHMARKS.md); the last is max_len rounded up to `models.decoder.CACHE_ALIGN`
        positions, which verification reads without padding the cache."""
        step, out = int(self.settings.len_bucket), []
        n = step
        while n < self.max_len:
            out.append(n)
            if self.mode_traits.drafts:
                n = next(m * step for m in _SPECULATIVE_LENGTHS if m * step > n)
            else:
                n += step
        return out + [aligned_length(self.max_len)]

    def cache_length_for(self, need: int) -> int:
        """The first of `cache_lengths` that holds `need` positions."""
        return next(n for n in self.cache_lengths() if n >= min(need, self.max_len))

    def slot_settings(self, host: dict[str, np.ndarray]) -> SlotSettings:
        return SlotSettings(**{f: jnp.asarray(host[f]) for f in SlotSettings._fields})

    def host_arrays(self) -> dict[str, np.ndarray]:
        """The host's copy of `SlotSettings` for R empty slots."""
        R = self.R
        return dict(active=np.zeros(R, bool), remaining=np.zeros(R, np.int32),
                    counter=np.zeros(R, np.int32), temperature=np.zeros(R, np.float32),
                    top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
                    key_data=np.zeros((R, 2), np.uint32))

    # ------------------------------------------------------------------ costs, policy
    @property
    def profile_steps(self) -> int:
        return cost_profile.profile_steps(self)

    def profile_buckets(self, cache_dir: str | None = None, repeats: int | None = None
                        ) -> tuple[dict[int, float], float, bool]:
        """The SPS profile's seconds per bucket (`cost_profile.profile_buckets`)."""
        return cost_profile.profile_buckets(self, cache_dir, repeats)

    def profile_costs(self) -> dict[str, float]:
        """The drafter's and a plain round's seconds (`cost_profile.profile_costs`); also sets
        `cost_profile_seconds` (0 when cached)."""
        costs, self.cost_profile_seconds = cost_profile.profile_costs(self)
        return costs

    def new_policy(self) -> policy.Policy | None:
        """A fresh per-round scheduling state for this mode (`policy.MODES`): the adaptive
        drafting choice, `production`'s capacity queue (K₀ = R·γ: every candidate until a K
        exists), `AlwaysDraft` for the modes that decide nothing across rounds, or None
        (`none`)."""
        st = self.settings
        return policy.policy_for(
            self.mode, verify_seconds=self.costs.verify_seconds,
            draft_seconds=self.costs.draft_seconds, plain_seconds=self.costs.plain_seconds,
            gamma=self.gamma, initial_capacity=self.R * self.gamma,
            probe_interval=int(st.probe_interval), max_probe_interval=int(st.max_probe_interval),
            explore=None if st.explore is None else float(st.explore))

    def reset_policy(self) -> None:
        """Forgets what the adaptive policy learned (ρ, estimates, probe budget): the next
        `generate` starts as a new engine does. `production`'s queue starts over with every
        run anyway; the other modes learn nothing."""
        self.policy = self.new_policy()

    def schedule_state(self, capacities: Sequence[int],
                       choice: dict[str, Any] | None) -> ScheduleState:
        """A policy's `device_schedule` as the device call carries it."""
        if choice is not None:
            choice = round_.DraftChoice(**{k: jnp.asarray(v) for k, v in choice.items()},
                                        plain_sps=jnp.asarray(self.costs.plain_sps))
        return ScheduleState(capacities=jnp.asarray(capacities, jnp.int32), choice=choice)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, max_tokens: int | None = None) -> None:
        """Compiles the programs the engine runs: the verification step of every bucket (what
        profiling times), then, at every cache length a run can grow to (`cache_lengths`) up to
        the one that `max_tokens` (the longest prompt + max_new_tokens to be served; default: up
        to max_len) needs, the rounds (and for `adaptive` the plain stretches at each bucket a
        load needs) and a one-prompt prefill, so growing the cache compiles no round program."""
        step = cost_profile.verify_step_fn(self)
        for K in self.buckets:
            jax.block_until_ready(step(K))
        top = self.cache_length_for(self.max_len if max_tokens is None
                                    else int(max_tokens) + 1 + self.gamma)
        slots = cost_profile.all_slots_active(self)
        anchor_buckets = sorted({cost_profile.bucket_for(self.buckets, r)
                                 for r in range(1, self.R + 1)})
        one = jnp.asarray(1, jnp.int32)
        for n in self.cache_lengths():
            if n > top:
                break
            if self.mode_traits.prices_drafting:   # plain stretches at each bucket a load needs
                for K in anchor_buckets:
                    jax.block_until_ready(round_.anchor_rounds(
                        self.config, self.arrays, self.fresh_state(n), slots, one, one,
                        capacity=K)[1])
                self._warm_device_choice(n)
            # a prompt whose request needs exactly n positions (prompt + 2 + γ + 1)
            self.generate([[0] * max(1, n - 3 - self.gamma)], max_new_tokens=2)
        self.reset_policy()   # dummy requests teach the policy nothing

    def _warm_device_choice(self, cache_len: int, rounds: int = 3) -> int:
        """Runs `adaptive`'s drafting call through `rounds` rounds whose choice to draft the
        device makes (a dummy state; a choice whose estimate always pays) → the rounds run.
        The one-prompt warm-up generate only ever runs a call's first round; without this, the
        first call that goes on drafting on device pays a one-off cost, once per engine, inside
        the first timed pass (figures: BENCHMARKS.md)."""
        R, top = self.R, self.R * self.gamma
        choice = round_.DraftChoice(
            gain=jnp.full((2,), float(top), jnp.float32), n_then=jnp.full((2,), R, jnp.int32),
            predicted=jnp.zeros((), jnp.float32), realised=jnp.zeros((), jnp.float32),
            decay=jnp.asarray(0.9, jnp.float32),
            plain_sps=jnp.zeros(self.costs.plain_sps.shape, jnp.float32))
        schedule = ScheduleState(capacities=jnp.asarray([top, top], jnp.int32), choice=choice)
        _, result = round_.speculative_rounds(
            self.config, self.arrays, self.fresh_state(cache_len),
            cost_profile.all_slots_active(self), schedule, jnp.asarray(rounds, jnp.int32),
            jnp.asarray(R + 1, jnp.int32))
        return int(jax.device_get(result.rounds))

    # ------------------------------------------------------------------ generate
    def check_prompt(self, i: Any, prompt: Sequence[int], max_new_tokens: int) -> None:
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        arr = np.asarray(prompt)
        if arr.min() < 0 or arr.max() >= self.V:
            raise ValueError(f"prompt {i} has token ids outside [0, {self.V})")
        need = len(prompt) + max_new_tokens + self.gamma + 1
        if need > self.max_len:
            raise ValueError(f"prompt {i} ({len(prompt)} tokens) + max_new_tokens "
                             f"({max_new_tokens}) + γ+1 ({self.gamma + 1}) exceeds "
                             f"max_len={self.max_len}")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 temperature: Any = 0.0, seed: Any = 0, arrivals: Sequence[float] | None = None,
                 top_k: Any = 0, top_p: Any = 1.0, progress: bool = False) -> EngineResult:
        """Decodes every prompt (token-id lists); temperature/top_k/top_p/seed may be one value
        or one per prompt; `arrivals` [s after the call] delays each request's join.
        `progress`: a tqdm bar of the emitted tokens (out of prompts × max_new_tokens)."""
        n = len(prompts)
        if n == 0:
            raise ValueError("no prompts given")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        temps = _per_prompt(temperature, n, "temperature", float)
        tks = _per_prompt(top_k, n, "top_k", int)
        tps = _per_prompt(top_p, n, "top_p", float)
        seeds = _per_prompt(seed, n, "seed", int)
        if isinstance(seed, (list, tuple, np.ndarray)):
            kd = [np.asarray(jax.random.key_data(jax.random.key(s_, impl="threefry2x32")))
                  for s_ in seeds]
        else:
            base = jax.random.split(jax.random.key(int(seed), impl="threefry2x32"), n)
            kd = list(np.asarray(jax.random.key_data(base)))
        arr_t = [0.0] * n if arrivals is None else [float(a) for a in arrivals]
        if len(arr_t) != n:
            raise ValueError(f"arrivals: {len(arr_t)} values for {n} prompts")
        reqs = [Request(prompts[i], kd[i], temps[i], tks[i], tps[i], arr_t[i], handle=i)
                for i in range(n)]
        run = _Run(self, max_new_tokens, progress=progress, total=n * max_new_tokens)
        for i in sorted(range(n), key=lambda i: (arr_t[i], i)):
            run.add(reqs[i], i)
        return run.loop()

    def serve(self, requests: Sequence[Request],
              on_reply: Callable[[Request, list[int]], Sequence[Request]] | None = None, *,
              max_new_tokens: int, after_replies: Callable[[], None] | None = None,
              progress: bool = False) -> EngineResult:
        """Serves a stream of requests: `requests` join in order (at their `arrival_s`); when a
        request ends, `on_reply(request, reply_ids)` is called (the stop token, when hit, is
        the reply's last id) and the requests it returns join the queue at once (e.g. the next
        turn of a conversation); `after_replies()` runs after every device call that ended at
        least one request (a point to write results). The result lists every request in the
        order it was added (follow-ups after the requests given)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        run = _Run(self, max_new_tokens, progress=progress, on_reply=on_reply,
                   after_replies=after_replies)
        for req in requests:
            run.add(req)
        return run.loop()


@functools.partial(jax.jit, static_argnames=("cache_len", "adapter"))
def _grown_state(state: EngineState, *, cache_len: int, adapter: Any) -> EngineState:
    draft_cache = state.draft_cache
    if draft_cache is not None:
        draft_cache = adapter.grown_cache(draft_cache, cache_len)
    return state.replace(cache=state.cache.grown(cache_len), draft_cache=draft_cache)


class _Run:
    """Host bookkeeping of one `Engine.generate` / `Engine.serve` call: the request queue,
    admission into free slots, the per-request records and the run loop."""

    def __init__(self, eng: Engine, max_new: int, *, fresh_policy: bool = False,
                 progress: bool = False, total: int | None = None,
                 on_reply: Callable[[Request, list[int]], Sequence[Request]] | None = None,
                 after_replies: Callable[[], None] | None = None):
        self.eng, self.max_new = eng, int(max_new)
        self.requests: list[Request] = []
        self.prompts: list[list[int]] = []
        self.out: list[list[int]] = []
        self.per: list[dict[str, Any]] = []
        self.on_reply, self.after_replies = on_reply, after_replies
        self.ended = 0          # requests ended since `after_replies` last ran
        self.rounds: list[dict[str, Any]] = []
        self.host = eng.host_arrays()
        self.slot_req = [-1] * eng.R
        self.free = collections.deque(range(eng.R))
        self.pending: collections.deque[int] = collections.deque()
        self.plain = not eng.mode_traits.drafts
        self.step_s = 0.0       # seconds per step / round (last call), for arrivals
        # adaptive: the engine's drafting policy (its state persists across calls);
        # production: a fresh capacity queue for this run
        self.policy = eng.policy
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
        self.eng.check_prompt(i if label is None else label, req.prompt, self.max_new)
        if req.temperature < 0:
            raise ValueError("temperature must be ≥ 0")
        if not 0.0 < req.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        self.requests.append(req)
        self.prompts.append(list(map(int, req.prompt)))
        self.out.append([])
        self.per.append(dict(accepted=[], proposed=[], acceptance=[], confidence=[],
                             arrival_s=float(req.arrival_s), join_s=None,
                             prompt_tokens=len(req.prompt), first_token_s=None,
                             finish_s=None))
        self.pending.append(i)
        return i

    # -------------------------------------------------------------- joins
    def _admit(self, now: float) -> list[int]:
        joined = []
        while (self.pending and self.free
               and self.requests[self.pending[0]].arrival_s <= now):
            i = self.pending.popleft()
            r = self.free.popleft()
            self.slot_req[r] = i
            self.per[i]["join_s"] = now
            req, host = self.requests[i], self.host
            host["temperature"][r], host["top_k"][r], host["top_p"][r] = (
                req.temperature, req.top_k, req.top_p)
            host["key_data"][r] = np.asarray(req.key_data, np.uint32)
            host["counter"][r], host["remaining"][r], host["active"][r] = 1, self.max_new, False
            joined.append(r)
        return joined

    def _fit_cache(self, state: EngineState, slots: list[int]) -> EngineState:
        """Grows the caches (`Engine.cache_lengths`, up to max_len) to hold the joining
        requests: prompt, budget and, speculating, one more verified block (attention reads
        the whole cache, so a short one is a faster step)."""
        eng = self.eng
        need = (max(len(self.prompts[self.slot_req[r]]) for r in slots) + self.max_new + 1
                + (0 if self.plain else eng.gamma))
        n = eng.cache_length_for(need)
        return eng._grown(state, n) if n > state.cache.max_len else state

    def _prefill(self, state: EngineState, slots: list[int]) -> EngineState:
        """The joining prompts prefilled together, densely (plain: `plain_steps.plain_prefill`;
        speculative: `speculative_round.prefill_prompts`, which also feeds the drafter's
        context), in groups of at most R padded to a power-of-two size (padding rows write
        nothing) and to a `len_bucket` multiple of tokens (a `prefill_chunk` multiple past it,
        run chunk by chunk), so few shapes compile; `prefill_groups` splits the joiners by
        length where that computes fewer padded tokens."""
        eng, st = self.eng, self.eng.settings
        state = self._fit_cache(state, slots)
        settings = eng.slot_settings(self.host)
        cap = top_k_cap_for([int(self.host["top_k"][r]) for r in slots], eng.V)
        lengths = [len(self.prompts[self.slot_req[r]]) for r in slots]
        for idx in prefill_groups(lengths, eng.R, st.len_bucket, st.prefill_chunk,
                                  state.cache.max_len):
            group = [slots[i] for i in idx]
            n = 1 << (len(group) - 1).bit_length()
            width = prefill_length(max(lengths[i] for i in idx), st.len_bucket,
                                   st.prefill_chunk, state.cache.max_len)
            tokens = np.zeros((n, width), np.int32)
            lens = np.ones((n,), np.int32)
            rows = np.full((n,), eng.R, np.int32)     # R: a padding row, dropped
            for j, r in enumerate(group):
                prompt = self.prompts[self.slot_req[r]]
                tokens[j, :len(prompt)], lens[j], rows[j] = prompt, len(prompt), r
            args = (jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(rows))
            chunk = min(width, st.prefill_chunk)
            if self.plain:
                state, first = plain_prefill(eng.target.graphdef, eng.target.state, state,
                                             settings, *args, chunk=chunk, top_k_cap=cap)
            else:
                state, first = round_.prefill_prompts(eng.config, eng.prefill_arrays, state,
                                                      settings, *args, chunk=chunk)
            first = np.asarray(first)
            self._first_tokens([(r, int(first[j])) for j, r in enumerate(group)])
        return state

    def _first_tokens(self, firsts: list[tuple[int, int]]) -> None:
        """Books each joined slot's first token (sampled by its prefill)."""
        eng = self.eng
        now = time.perf_counter() - self.t0
        stops = set(np.asarray(eng.stop_ids).tolist()) - {-1}
        for r, t in firsts:
            i = self.slot_req[r]
            self.out[i].append(t)
            if self.bar is not None:
                self.bar.update(1)
            self.per[i]["first_token_s"] = now
            # DeepSpec's loop runs a round even with a budget of one token
            if t in stops or (self.max_new <= 1 and eng.budget_rule == "serving"):
                self._finish(r, now)
            else:
                self.host["active"][r], self.host["remaining"][r] = True, self.max_new - 1

    def _finish(self, r: int, now: float) -> None:
        i = self.slot_req[r]
        self.per[i]["finish_s"] = now
        self.host["active"][r] = False
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
        pr["accepted"].extend(accepted)
        pr["proposed"].extend(proposed)
        pr["acceptance"].extend(acceptance)
        self.host["remaining"][r] -= len(tokens)
        self.host["counter"][r] += rounds

    def _plain_round(self, state: EngineState, max_steps: int | None = None) -> EngineState:
        """Plain decoding (scheduler "none"): up to `plain_steps_per_call` steps in one device
        call (`decoding.plain_steps`), back on the host as soon as a slot can be handed to a
        waiting request, or when the next one arrives."""
        eng, host = self.eng, self.host
        t_start = time.perf_counter()
        n_active = int(host["active"].sum())
        steps, min_done = self._call_budget(max_steps, eng.plain_steps_per_call)
        cap = top_k_cap_for([int(k) for k in host["top_k"][host["active"]]], eng.V)
        state, out = plain_steps(eng.step_target.graphdef, eng.step_target.state, state,
                                 eng.slot_settings(host), eng.stop_ids,
                                 jnp.asarray(steps, jnp.int32), jnp.asarray(min_done, jnp.int32),
                                 max_steps=eng.plain_steps_per_call, top_k_cap=cap,
                                 budget_rule=eng.budget_rule)
        out = jax.device_get(out)
        now = time.perf_counter() - self.t0
        emitted = 0
        for r in np.nonzero(host["active"])[0]:
            m, k = int(out["n_emit"][r]), int(out["steps"][r])
            self._record(r, out["tokens"][r, :m], [0] * k, [0] * k, [1] * k, k)
            emitted += m
            if out["finished"][r]:
                self._finish(r, now)
        if self.bar is not None:
            self.bar.update(emitted)
        n_steps = int(out["steps"].max(initial=0))
        seconds = time.perf_counter() - t_start
        self.step_s = seconds / max(n_steps, 1)
        self.rounds.append(dict(active=n_active, verified_tokens=0, capacity=eng.buckets[0],
                                tokens=emitted, drafted=False, seconds=seconds, steps=n_steps,
                                cache_len=int(state.cache.max_len)))
        return state

    def _call_budget(self, max_steps: int | None, per_call: int) -> tuple[int, int]:
        """(steps or rounds for this device call, min_done): back on the host as soon as a
        slot can be handed to a waiting request, or in time for the next arrival."""
        steps, min_done = per_call, self.eng.R + 1
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
        eng, host = self.eng, self.host
        t_start = time.perf_counter()
        n_active = int(host["active"].sum())
        drafted, capacity = self.policy.decide(n_active)
        if not drafted:   # plain decoding: ℓ = 0, the drafter not run
            return self._anchor_rounds(state, n_active, t_start)
        rounds, min_done = self._call_budget(max_steps, eng.rounds_per_call)
        state, result = round_.speculative_rounds(
            eng.config, eng.arrays, state, eng.slot_settings(host),
            eng.schedule_state(*self.policy.device_schedule(capacity)),
            jnp.asarray(rounds, jnp.int32), jnp.asarray(min_done, jnp.int32))
        result, now, seconds = self._fetch_rounds(result, t_start)
        for i in range(int(result.rounds)):
            record = jax.tree.map(lambda a: a[i], result.records)
            live, decided = record.live, record.schedule
            self.policy.replay(i == 0, policy.Estimate(int(decided.capacity_new),
                                                       float(decided.gain_new),
                                                       int(live.sum())),
                               float(decided.predicted),
                               float(np.sum(record.outputs.accepted[live])))
            emitted = self._book_round(record.outputs, live, now, decided.confidence)
            self.rounds.append(dict(active=int(live.sum()),
                                    verified_tokens=int(decided.lengths[live].sum()),
                                    capacity=int(decided.capacity), tokens=emitted,
                                    drafted=True, steps=1, seconds=seconds,
                                    admitted_capacity=int(decided.admitted)))
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
        tokens, acceptance records, confidence logits, finished requests. → tokens emitted."""
        emitted = 0
        for r in np.nonzero(live)[0]:
            m = int(outputs.n_emit[r])
            if confidence is not None:   # confidence logits of this round's proposals
                self.per[self.slot_req[r]]["confidence"].append(
                    np.asarray(confidence[r], np.float32))
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
        eng, host = self.eng, self.host
        want = self.policy.plain_rounds(n_active, eng.plain_steps_per_call)
        rounds, _ = self._call_budget(want, eng.plain_steps_per_call)
        K = cost_profile.bucket_for(eng.buckets, max(n_active, 1))
        state, result = round_.anchor_rounds(eng.config, eng.arrays, state, eng.slot_settings(host),
                                         jnp.asarray(rounds, jnp.int32),
                                         jnp.asarray(1, jnp.int32), capacity=K)
        result, now, seconds = self._fetch_rounds(result, t_start)
        for i in range(int(result.rounds)):
            if i:   # replays the choice made ahead (the same n_active: no slot finished)
                self.policy.decide(n_active)
            self.policy.update(False)
            record = jax.tree.map(lambda a: a[i], result.records)
            emitted = self._book_round(record.outputs, record.live, now)
            self.rounds.append(dict(active=n_active, verified_tokens=0, capacity=K,
                                    tokens=emitted, drafted=False, steps=1, seconds=seconds))
        return state

    def start_state(self) -> EngineState:
        return self.eng.fresh_state(self.eng.cache_lengths()[0])

    def loop(self) -> EngineResult:
        state = self.start_state()
        self.t0 = time.perf_counter()
        while self.pending or self.host["active"].any():
            now = time.perf_counter() - self.t0
            joined = self._admit(now)
            if joined:
                state = self._prefill(state, joined)
            if self.host["active"].any():
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
