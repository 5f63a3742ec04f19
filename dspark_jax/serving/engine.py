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
run the Markov-head sampling / verification Pallas kernels in place of their pure-JAX oracles
where they are offered (`decoding.pallas_backend`: the interpreter on CPU). SPS(B) for the scheduler is profiled at start over the
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
turns run on it). The host side of one call (queue, admission, records, the loop of device
calls) is `serving.run_loop.Run`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import speculative_round as round_
from dspark_jax.decoding.draft_adapters import adapter_for
from dspark_jax.decoding.round_types import (EngineArrays, EngineState, RoundConfig,
                                             ScheduleState, SlotSettings)
from dspark_jax.decoding.stops import stop_array
from dspark_jax.models.decoder import aligned_length
from dspark_jax.models.drafters.dspark import with_layer_buffers as draft_layer_buffers
from dspark_jax.serving import cost_profile, policy
from dspark_jax.serving.run_loop import EngineResult, Request, Run as _Run
from dspark_jax.serving.settings import EngineSettings

# speculative decoding's cache lengths, in `len_bucket`s: the powers of two and 1.5× them
_SPECULATIVE_LENGTHS = sorted({2 ** k for k in range(40)} | {3 * 2 ** k for k in range(40)})


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
        self.mode = settings.mode
        self.R, self.max_len = int(settings.max_requests), int(settings.max_len)
        self.plain_steps_per_call = int(settings.plain_steps_per_call)
        self.rounds_per_call = int(settings.rounds_per_call)
        self.budget_rule, self.cap_to_budget = settings.budget_rule, settings.caps_budget
        # prefill, decoding steps and verification run on the target in one layout
        # (`Target.decoding_layout`: one buffer per layer on accelerators), so the engine
        # holds the weights once
        self.step_target = target.decoding_layout(settings.layer_buffers)
        self.draft = draft if self.mode.drafts else None
        self.gamma = int(self.draft.config.num_drafts) if self.draft is not None else 0
        self.V = int(target.config.vocab_size)
        # a request verifies its anchor and γ drafts, or N tree nodes
        self.per_request = int(settings.tree_budget) or self.gamma
        self.buckets = cost_profile.capacity_buckets(self.R, self.per_request,
                                                     settings.capacity_buckets)
        if self.buckets[-1] > self.max_len * self.R:
            raise ValueError("capacity_buckets exceed what max_len can hold")
        self.config = RoundConfig(
            mode=self.mode, verifier=settings.verifier, sampler=settings.sampler,
            budget_rule=self.budget_rule, cap_budget=self.cap_to_budget,
            tap_layer_ids=(tuple(self.draft.config.target_layer_ids)
                           if self.draft is not None else ()),
            buckets=self.buckets, rounds_per_call=self.rounds_per_call,
            plain_rounds_per_call=self.plain_steps_per_call,
            tree_budget=int(settings.tree_budget), tree_branching=int(settings.tree_branching))
        self.reached_buckets = 1   # buckets[:n] the rounds programs have been asked for
        self.prefill_shapes: dict[tuple[int, int], set[tuple[int, int]]] = {}   # compiled
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

    # ------------------------------------------------------------------ state
    def fresh_state(self, cache_len: int | None = None) -> EngineState:
        """Empty slots. `cache_len` (default: the longest of `cache_lengths`): the caches'
        initial length, which `_Run` grows as longer requests join (`_grown`)."""
        n = cache_len or self.cache_lengths()[-1]
        cache = self.step_target.init_cache(self.R, n, self.target.dtype)
        draft_cache = None
        if self.draft is not None:   # in the layout the rounds' drafter reads
            drafter = nnx.merge(self.arrays.draft_graphdef, self.arrays.draft_state)
            draft_cache = adapter_for(self.draft.config.model_type).init_cache(
                drafter, self.R, n)
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
            if self.mode.drafts:
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
        """A fresh per-round scheduling state for this mode (`SchedulerMode.new_policy`): the
        adaptive drafting choice, `production`'s capacity queue (K₀ = R·γ: every candidate
        until a K exists), `AlwaysDraft` for the modes that decide nothing across rounds, or
        None (`none`)."""
        st = self.settings
        return self.mode.new_policy(policy.PolicyInputs(
            verify_seconds=self.costs.verify_seconds, draft_seconds=self.costs.draft_seconds,
            plain_seconds=self.costs.plain_seconds, gamma=self.per_request,
            initial_capacity=self.R * self.per_request, probe_interval=int(st.probe_interval),
            max_probe_interval=int(st.max_probe_interval),
            explore=None if st.explore is None else float(st.explore)))

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

    def rounds_config(self, max_active: int | None = None) -> RoundConfig:
        """The config of the drafting rounds' program (`speculative_rounds`) for a call that
        never holds more than `max_active` requests at once (None: R). Its capacity buckets
        stop at the smallest one that holds the largest verification so many requests can ask
        for (each at most its share of the top bucket), so a call with few requests compiles
        no verification branch it cannot reach; the device picks the same bucket as with every
        bucket compiled (the smallest that holds the round's tokens). The buckets an earlier
        call reached (after `warmup`: all) stay, so a run of calls compiles at most one rounds
        program per bucket and a call never recompiles for fewer requests."""
        top = self.buckets[-1]
        n = self.R if max_active is None else max(1, min(int(max_active), self.R))
        need = -(-top * n // self.R)
        reach = 1 + self.buckets.index(cost_profile.bucket_for(self.buckets, need))
        self.reached_buckets = max(self.reached_buckets, reach)
        if self.reached_buckets == len(self.buckets):
            return self.config
        return dataclasses.replace(self.config, buckets=self.buckets[:self.reached_buckets])

    # ------------------------------------------------------------------ warm-up
    def warmup(self, max_tokens: int | None = None) -> None:
        """Compiles the programs the engine runs: the verification step of every bucket (what
        profiling times), then, at every cache length a run can grow to (`cache_lengths`) up to
        the one that `max_tokens` (the longest prompt + max_new_tokens to be served; default: up
        to max_len) needs, the rounds (and for `adaptive` the plain stretches at each bucket a
        load needs) and a one-prompt prefill, so growing the cache compiles no round program."""
        self.reached_buckets = len(self.buckets)   # every bucket: no call compiles again
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
            if self.mode.prices_drafting:   # plain stretches at each bucket a load needs
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
        R, top = self.R, self.R * self.per_request
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
        run = _Run(self, max_new_tokens, progress=progress, total=n * max_new_tokens,
                   max_active=n)
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
                   after_replies=after_replies,
                   max_active=len(requests) if on_reply is None else None)
        for req in requests:
            run.add(req)
        return run.loop()


@functools.partial(jax.jit, static_argnames=("cache_len", "adapter"))
def _grown_state(state: EngineState, *, cache_len: int, adapter: Any) -> EngineState:
    draft_cache = state.draft_cache
    if draft_cache is not None:
        draft_cache = adapter.grown_cache(draft_cache, cache_len)
    return state.replace(cache=state.cache.grown(cache_len), draft_cache=draft_cache)
