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
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import speculative_round as round_
from dspark_jax.decoding.plain_steps import plain_prefill, plain_steps
from dspark_jax.decoding.prefill_plan import prefill_groups, prefill_length
from dspark_jax.decoding.sampling import top_k_cap_for
from dspark_jax.decoding.acceptance_rule import VERIFIERS
from dspark_jax.decoding.draft_adapters import adapter_for
from dspark_jax.decoding.scheduler import CONFIDENCE_MODES, MODES
from dspark_jax.decoding.stops import stop_array
from dspark_jax.decoding.pallas_backend import check_offered
from dspark_jax.models.decoder import aligned_length
from dspark_jax.models.drafters.config import validate_against_target
from dspark_jax.models.drafters.dspark import with_layer_buffers as draft_layer_buffers
from dspark_jax.serving import policy
from dspark_jax.serving import cost_profile

log = logging.getLogger(__name__)

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


def _per_prompt(value: Any, n: int, name: str, cast: type) -> list:
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} prompts")
        return [cast(v) for v in value]
    return [cast(value)] * n


class Engine:
    """Continuous-batching speculative decoding engine (see module docstring).

    Costs of the `adaptive` drafting choice (`serving.policy`): `draft_seconds` (the drafter's
    time per round) and `plain_seconds` (a plain decoding step), in the units of `sps`; when
    None they are profiled with SPS (cached on disk), except that with `sps` passed in the
    drafter counts as free and a plain step as the verification step at n tokens (the paper's
    rule: always draft). `probe_interval` / `max_probe_interval`: the least rounds between
    probes while plain decoding wins (doubling at each probe); `explore`: the fraction of plain
    decoding time that probes may cost (None: no limit). The adaptive policy's learned state
    persists across `generate` calls; `reset_policy()` forgets it. `plain_steps_per_call`: the
    most plain steps (`none`) or plain rounds (`adaptive`'s rounds that skip drafting) one
    device call runs. `production` (the paper's
    §5.2 schedule without that choice) profiles SPS only, never reads these costs and always
    drafts; its two-rounds-old capacity queue starts over with every `generate` call.

    `layer_buffers`: the target layout the decoding steps and verification run on
    (`Target.decoding_layout`): None (default) or True one buffer per decoder layer, so the
    dots read the weights where they lie (a scanned stack has them copied out every step);
    False the stacked layers (faster to compile); the prefill always runs on the stacked
    layers.

    Token budget: `budget_rule="serving"` (default) ends a request as soon as it has emitted
    `max_new_tokens`, and `cap_to_budget` (default True) never verifies drafts past that budget.
    `budget_rule="deepspec"` is the rule of DeepSpec's evaluation loop (`while start <
    max_length`): every round verifies the full block (`cap_to_budget` defaults to False and
    cannot be True), a request runs another round while it has emitted at most
    `max_new_tokens` tokens, and its output is cut at the budget, so the rounds, their counts and
    τ are DeepSpec's (`speculative_generate` and `dspark_jax.evaluate` use it).
    """

    def __init__(self, target: Any, draft: Any = None, max_requests: int = 16,
                 max_len: int = 2048, scheduler: str = "adaptive", threshold: float = 0.5, *,
                 capacity_buckets: Sequence[int] | None = None, prefill_chunk: int = 128,
                 sps: Any = None, sps_cache_dir: str | None = None, profile_repeats: int = 3,
                 confidence_temperatures: Sequence[float] | None = None,
                 verifier: str = "jax", sampler: str = "jax",
                 stop_token_ids: Sequence[int] | None = None,
                 cap_to_budget: bool | None = None, budget_rule: str = "serving",
                 draft_seconds: float | None = None, plain_seconds: float | None = None,
                 probe_interval: int = 4, max_probe_interval: int = 64,
                 explore: float | None = 0.01, plain_steps_per_call: int = 16,
                 rounds_per_call: int = 8, len_bucket: int = 64,
                 layer_buffers: bool | None = None):
        if scheduler not in MODES:
            raise ValueError(f"unknown scheduler {scheduler!r}; choose from {list(MODES)}")
        if verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {verifier!r}; choose from "
                             f"{sorted(VERIFIERS)}")
        for name, value in (("verifier", verifier), ("sampler", sampler)):
            if value == "pallas":
                check_offered(f"{name}='pallas'")
        if budget_rule not in round_.BUDGET_RULES:
            raise ValueError(f"unknown budget_rule {budget_rule!r}; choose from "
                             f"{list(round_.BUDGET_RULES)}")
        if cap_to_budget is None:
            cap_to_budget = budget_rule == "serving"
        elif cap_to_budget and budget_rule == "deepspec":
            raise ValueError("budget_rule='deepspec' verifies full blocks up to the end (as "
                             "DeepSpec's loop); it cannot be combined with cap_to_budget=True")
        if sampler not in round_.SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; choose from {list(round_.SAMPLERS)}")
        if max_requests < 1:
            raise ValueError(f"max_requests must be ≥ 1, got {max_requests}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be ≥ 1, got {prefill_chunk}")
        if min(plain_steps_per_call, rounds_per_call, len_bucket) < 1:
            raise ValueError(f"plain_steps_per_call, rounds_per_call and len_bucket must be "
                             f"≥ 1, got {plain_steps_per_call}, {rounds_per_call} and "
                             f"{len_bucket}")
        if scheduler != "none" and draft is None:
            raise ValueError(f"scheduler={scheduler!r} needs a drafter (draft=None only works "
                             "with scheduler='none')")
        if scheduler == "threshold" and not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if draft_seconds is not None and not float(draft_seconds) >= 0:
            raise ValueError(f"draft_seconds must be ≥ 0, got {draft_seconds}")
        if plain_seconds is not None and not float(plain_seconds) > 0:
            raise ValueError(f"plain_seconds must be > 0, got {plain_seconds}")
        if not 1 <= int(probe_interval) <= int(max_probe_interval):
            raise ValueError(f"probe_interval must be ≥ 1 and ≤ max_probe_interval, got "
                             f"probe_interval={probe_interval}, "
                             f"max_probe_interval={max_probe_interval}")
        if explore is not None and not 0.0 <= float(explore) <= 1.0:
            raise ValueError(f"explore must be in [0, 1] or None, got {explore}")
        self.probe_interval, self.max_probe_interval = int(probe_interval), int(
            max_probe_interval)
        self.explore = None if explore is None else float(explore)
        self.target, self.mode = target, scheduler
        # decoding steps and verification run on the target in `layer_buffers`' layout (one
        # buffer per layer by default); the prefill's long forwards keep the stacked one
        self.step_target = target.decoding_layout(layer_buffers)
        self.draft = draft if scheduler != "none" else None
        if self.draft is not None:
            validate_against_target(draft.config, target.config, source="draft")
            if scheduler in CONFIDENCE_MODES and not draft.config.has_confidence:
                raise ValueError(f"scheduler={scheduler!r} needs the drafter's confidence head, "
                                 f"but this {draft.config.model_type} drafter has none; use "
                                 "scheduler='fixed' (or 'none')")
            if sampler == "pallas":
                ad = adapter_for(draft.config.model_type)
                if not getattr(ad, "supports_markov_kernel", lambda m: False)(draft.model):
                    raise ValueError(
                        "sampler='pallas' runs the vanilla Markov-head sampling kernel, but this "
                        f"{draft.config.model_type} drafter has markov_head_type="
                        f"{getattr(draft.config, 'markov_head_type', None)!r} (rank "
                        f"{getattr(draft.config, 'markov_rank', 0)}); "
                        "use sampler='jax'")
        self.gamma = int(self.draft.config.num_drafts) if self.draft is not None else 0
        self.R, self.max_len = int(max_requests), int(max_len)
        self.plain_steps_per_call, self.len_bucket = int(plain_steps_per_call), int(len_bucket)
        self.rounds_per_call = int(rounds_per_call)
        self.threshold = float(threshold)
        self.verifier, self.prefill_chunk = verifier, int(prefill_chunk)
        self.sampler = sampler
        self.cap_to_budget = bool(cap_to_budget)
        self.budget_rule = budget_rule
        self.buckets = cost_profile.capacity_buckets(self.R, self.gamma, capacity_buckets)
        if self.buckets[-1] > self.max_len * self.R:
            raise ValueError("capacity_buckets exceed what max_len can hold")
        cfg = target.config
        self.V = int(cfg.vocab_size)
        default_stops = getattr(target.tokenizer, "stop_token_ids", None) or cfg.stop_token_ids
        self.stop_ids = stop_array(stop_token_ids, default_stops)
        self.tap_ids = (tuple(self.draft.config.target_layer_ids) if self.draft is not None
                        else ())
        temps = confidence_temperatures
        if temps is None and draft is not None:
            temps = getattr(draft, "confidence_temperatures", None)
        if temps is not None:
            temps = [float(t) for t in temps]
            if len(temps) != self.gamma or min(temps) <= 0:
                raise ValueError(f"confidence_temperatures must be {self.gamma} positive "
                                 f"floats (one per draft slot), got {temps}")
        self.conf_temps = None if temps is None else jnp.asarray(temps, jnp.float32)
        self._dgd = self.draft.graphdef if self.draft is not None else None
        self._dstate = self.draft.state if self.draft is not None else None
        if self.draft is not None and self.step_target is not target:   # per-layer buffers
            self._dgd, self._dstate = draft_layer_buffers(self._dgd, self._dstate)
        # the draft vocabulary's weight rows, gathered once (not in every drafting call)
        self._vocab_weights = None
        if self.draft is not None:
            ad = adapter_for(self.draft.config.model_type)
            self._vocab_weights = jax.jit(
                lambda st: ad.vocab_weights(nnx.merge(self._dgd, st)))(self._dstate)
        self.bucket_seconds: dict[int, float] | None = None
        self.profile_seconds = 0.0
        self.sps_cache_dir, self.profile_repeats = sps_cache_dir, int(profile_repeats)
        self.sps = self._init_sps(sps, sps_cache_dir, profile_repeats)
        self._init_costs(sps, draft_seconds, plain_seconds)
        self.reset_policy()

    # ------------------------------------------------------------------ state
    def _fresh_state(self, cache_len: int | None = None) -> round_.EngineState:
        """Empty slots. `cache_len` (default: the longest of `cache_lengths`): the caches'
        initial length, which `_Run` grows as longer requests join (`_grown`)."""
        n = cache_len or self.cache_lengths()[-1]
        cache = self.step_target.init_cache(self.R, n, self.target.dtype)
        dcache = None
        if self.draft is not None:
            dcache = adapter_for(self.draft.config.model_type).init_cache(
                self.draft.model, self.R, n)
        return round_.EngineState(cache=cache, draft_cache=dcache,
                                  anchor=jnp.zeros((self.R,), jnp.int32))

    def _grown(self, s: round_.EngineState, cache_len: int) -> round_.EngineState:
        """The state with room for `cache_len` positions in the target and drafter caches."""
        adapter = adapter_for(self.draft.config.model_type) if self.draft is not None else None
        return _grown_state(s, cache_len=int(cache_len), adapter=adapter)

    def cache_lengths(self) -> list[int]:
        """The cache lengths a run can grow through (`_Run._fit_cache`): plain decoding's
        `len_bucket` multiples; speculative decoding's `len_bucket` times 1, 2, 3, 4, 6, 8,
        12, … (a power of two and 1.5× it: its programs cost more to compile, and every step
        attends over the whole cache, so a length at most a third too long — powers of two
        alone: up to twice — keeps its rounds' attention near plain decoding's; a cache a third
        longer than plain decoding's already slows `adaptive`'s plain rounds measurably, figures:
        BENCHMARKS.md); the last is max_len rounded up to `models.decoder.CACHE_ALIGN`
        positions, which verification reads without padding the cache."""
        b, out = self.len_bucket, []
        n = b
        top = aligned_length(self.max_len)
        while n < self.max_len:
            out.append(n)
            if self.mode == "none":
                n += b
            else:
                n = next(m * b for m in _SPECULATIVE_LENGTHS if m * b > n)
        return out + [top]

    def cache_length_for(self, need: int) -> int:
        """The first of `cache_lengths` that holds `need` positions."""
        return next(n for n in self.cache_lengths() if n >= min(need, self.max_len))

    def _slot_settings(self, h: dict[str, np.ndarray]) -> round_.SlotSettings:
        return round_.SlotSettings(**{f: jnp.asarray(h[f]) for f in round_.SlotSettings._fields})

    def _host_arrays(self) -> dict[str, np.ndarray]:
        R = self.R
        return dict(active=np.zeros(R, bool), remaining=np.zeros(R, np.int32),
                    counter=np.zeros(R, np.int32), temperature=np.zeros(R, np.float32),
                    top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
                    key_data=np.zeros((R, 2), np.uint32))

    # ------------------------------------------------------------------ SPS
    def _verify(self, s, p, drafts, probs, ell, K, steps: int = 1):
        return round_.verify_and_commit(self.step_target.graphdef, self._dgd,
                                        self.step_target.state,
                                        self._dstate, s, p, drafts, probs, ell, self.stop_ids,
                                        jnp.asarray(True), K=K, verifier=self.verifier,
                                        tap_layer_ids=self.tap_ids,
                                        budget_rule=self.budget_rule, steps=steps)

    def _dummy_step_fn(self, steps: int = 1):
        """step_fn(K): `steps` verification steps with exactly K admitted tokens (all slots)
        in one device call (`verify_and_commit`)."""
        R, g = self.R, self.gamma
        p = self._all_slots_active()
        drafts = jnp.zeros((R, g), jnp.int32)
        probs = jnp.full((R, g, self.V), 1.0 / self.V, jnp.float32)
        holder = {"s": self._fresh_state()}

        def step(K: int):
            extra = K - R
            ell = np.minimum(g, extra // R + (np.arange(R) < extra % R)).astype(np.int32)
            holder["s"], out = self._verify(holder["s"], p, drafts, probs, jnp.asarray(ell), K,
                                            steps)
            holder["s"] = holder["s"].replace(
                cache=holder["s"].cache.with_lengths(jnp.zeros((R,), jnp.int32)))
            return out["n_emit"]

        return step

    def _all_slots_active(self) -> round_.SlotSettings:
        """Settings of R running requests with room to the end of the cache (profiling)."""
        h = self._host_arrays()
        h["active"][:] = True
        h["remaining"][:] = self.max_len
        return self._slot_settings(h)

    def _plain_rounds_fn(self) -> tuple[Callable[[int], Any], int]:
        """(step_fn(K), n): n rounds that skip drafting in one device call (`anchor_rounds`:
        the anchors alone verified in bucket K, the drafter's context still fed), as
        `adaptive`'s plain stretches run them; the cost of one is the call's time / n."""
        p = self._all_slots_active()
        n = max(1, min(self.plain_steps_per_call, self.max_len - 1))
        no_stops = jnp.full_like(self.stop_ids, -1)
        holder = {"s": self._fresh_state()}

        def step(K: int):
            holder["s"], out = self._anchor_rounds(holder["s"], p, n, self.R + 1, K,
                                                   stop_ids=no_stops)
            holder["s"] = holder["s"].replace(
                cache=holder["s"].cache.with_lengths(jnp.zeros((self.R,), jnp.int32)))
            return out["rounds"]

        return step, n

    def _draft(self, s, p, capacity: int) -> dict[str, jax.Array]:
        return round_.draft_and_schedule(self._dgd, self._dstate, s, p, self.stop_ids,
                                         self.conf_temps,
                                         jnp.asarray(self.threshold, jnp.float32), self.sps,
                                         jnp.asarray(capacity, jnp.int32), self.sps_draft,
                                         self._vocab_weights,
                                         mode=self.mode, cap_budget=self.cap_to_budget,
                                         sampler=self.sampler)

    def _rounds(self, s, p, queue: Sequence[int], rounds: int, min_done: int,
                choice: round_.DraftChoice | None = None):
        """Up to `rounds` whole rounds in one device call (`speculative_rounds`; `choice`:
        `adaptive`'s drafting choice made on device after the first round)."""
        return round_.speculative_rounds(
            self.step_target.graphdef, self._dgd, self.step_target.state, self._dstate, s, p,
            self.stop_ids, self.conf_temps, jnp.asarray(self.threshold, jnp.float32), self.sps,
            self.sps_draft, self._vocab_weights, jnp.asarray(queue, jnp.int32),
            jnp.asarray(rounds, jnp.int32),
            jnp.asarray(min_done, jnp.int32), choice, buckets=self.buckets,
            max_rounds=self.rounds_per_call, mode=self.mode,
            cap_budget=self.cap_to_budget, sampler=self.sampler, verifier=self.verifier,
            tap_layer_ids=self.tap_ids, budget_rule=self.budget_rule)

    def _anchor_rounds(self, s, p, rounds: int, min_done: int, K: int,
                       stop_ids: jax.Array | None = None):
        """Up to `rounds` rounds that skip drafting in one device call (`anchor_rounds`)."""
        return round_.anchor_rounds(
            self.step_target.graphdef, self._dgd, self.step_target.state, self._dstate, s, p,
            self.stop_ids if stop_ids is None else stop_ids, jnp.asarray(rounds, jnp.int32),
            jnp.asarray(min_done, jnp.int32),
            K=K, max_rounds=self.plain_steps_per_call, verifier=self.verifier,
            tap_layer_ids=self.tap_ids, budget_rule=self.budget_rule)

    def _draft_step_fn(self, steps: int = 1):
        """step_fn(_): one drafting + scheduling call, synchronised on what the host reads;
        `steps` > 1: that many in one device call (`speculative_round.draft_steps`)."""
        p, s = self._all_slots_active(), self._fresh_state()

        def step(_: int):
            if steps == 1:
                d = self._draft(s, p, self.R * self.gamma)
                return (d["n_tokens"], d["capacity_new"])
            return round_.draft_steps(
                self._dgd, self._dstate, s, p, self.stop_ids, self.conf_temps,
                jnp.asarray(self.threshold, jnp.float32), self.sps,
                jnp.asarray(self.R * self.gamma, jnp.int32), self.sps_draft,
                self._vocab_weights, mode=self.mode, cap_budget=self.cap_to_budget,
                sampler=self.sampler, steps=steps)

        return step

    def _profile_key(self, **extra: Any) -> str:
        """Disk-cache key of a profile: everything the timed calls depend on — device, target
        shapes and dtype, slots, max_len, buckets, the verifier and the sampler, and the
        drafter's shapes including its draft vocabulary (the verification step also feeds the
        drafter's context) — plus `extra`."""
        drafter = None
        if self.draft is not None:
            dc = self.draft.config
            drafter = {f: getattr(dc, f, None) for f in (
                "model_type", "num_drafts", "num_draft_layers", "markov_rank",
                "markov_head_type", "target_layer_ids", "draft_vocab_size", "layer_family",
                "hidden_size", "intermediate_size")}
        return cost_profile.cache_key(self.target.config, self.target.dtype, self.R,
                                      self.max_len, self.buckets,
                                      extra=dict(drafter=drafter, verifier=self.verifier,
                                                 sampler=self.sampler, **extra))

    @property
    def profile_steps(self) -> int:
        """Steps a profiled device call runs (verification per bucket, drafting): the costs
        are a step's share of the call, as inside the rounds' device loop, which runs up to
        `rounds_per_call` rounds a call without the call's dispatch and host sync (at one
        request on CPU these made a lone call ~1.4× a round of the loop)."""
        return min(4, self.rounds_per_call)

    def profile_costs(self) -> dict[str, float]:
        """The drafter's seconds per round (draft + schedule, all slots; `profile_steps` a
        device call) and a plain round's seconds (anchors only, smallest bucket, several a
        device call as `adaptive`'s plain stretches run them: `_plain_rounds_fn`), profiled
        once like SPS and cached on disk next to it (keyed by device kind, target and drafter
        shapes, slots and γ). Also sets `cost_profile_seconds` (0 when cached)."""
        if self.draft is None:
            raise ValueError("profile_costs needs a drafter (scheduler='none' has none)")
        m = self.profile_steps
        key = self._profile_key(costs=True, mode=self.mode, steps=m)
        plain, n = self._plain_rounds_fn()
        calls = {f"draft_{m}_steps": functools.partial(self._draft_step_fn(m), 0),
                 f"plain_{n}_rounds": functools.partial(plain, self.buckets[0])}
        secs, took, _ = cost_profile.load_or_profile(key, self.sps_cache_dir, calls,
                                                     repeats=self.profile_repeats)
        self.cost_profile_seconds = took
        return {"draft": secs[f"draft_{m}_steps"] / m, "plain": secs[f"plain_{n}_rounds"] / n}

    def _init_costs(self, sps: Any, draft_seconds: float | None,
                    plain_seconds: float | None) -> None:
        """t_v, t_d, t_plain and the drafting-round objective of `serving.policy` (profiled
        for `adaptive` only: `production`, the paper's schedule, prices the drafter nowhere and
        its global search maximises τ · SPS(B) itself)."""
        t_v = 1.0 / np.maximum(np.asarray(self.sps, np.float64), 1e-12)    # [top + 1]
        self.cost_profile_seconds = 0.0
        self.sps_draft = self.sps   # until t_d is known (the profiled draft call reads it)
        if self.mode == "adaptive" and sps is None and (draft_seconds is None
                                                        or plain_seconds is None):
            prof = self.profile_costs()
            draft_seconds = prof["draft"] if draft_seconds is None else draft_seconds
            plain_seconds = prof["plain"] if plain_seconds is None else plain_seconds
            log.info("adaptive costs: draft %.2f ms / round, plain step %.2f ms (%s)",
                     1e3 * draft_seconds, 1e3 * plain_seconds,
                     f"profiled in {self.cost_profile_seconds:.2f} s"
                     if self.cost_profile_seconds else "from cache")
        # with SPS passed in and no costs: a free drafter and plain = verification at n tokens
        self.draft_seconds = float(draft_seconds or 0.0)
        self.verify_step_seconds = t_v
        top_plain = min(self.R, len(t_v) - 1)
        self.plain_step_seconds = (np.full((top_plain + 1,), float(plain_seconds))
                                   if plain_seconds is not None else t_v[:top_plain + 1])
        self.sps_draft = jnp.asarray(policy.drafting_sps_table(t_v, self.draft_seconds))
        # plain rounds per second by active requests (`adaptive`'s choice on device)
        self.plain_sps = jnp.asarray(1.0 / np.maximum(self.plain_step_seconds, 1e-12),
                                     jnp.float32)

    def new_policy(self) -> policy.DraftPolicy | policy.CapacityQueue | None:
        """A fresh per-round scheduling state (`serving.policy`): the adaptive drafting choice,
        `production`'s capacity queue (K₀ = R·γ: every candidate until a K exists), or None
        (the other modes decide nothing across rounds)."""
        if self.mode == "production":
            return policy.CapacityQueue(self.R * self.gamma)
        if self.mode != "adaptive":
            return None
        return policy.DraftPolicy(self.verify_step_seconds, self.draft_seconds,
                                  self.plain_step_seconds, self.gamma, self.R * self.gamma,
                                  self.probe_interval, self.max_probe_interval,
                                  explore=self.explore)

    def reset_policy(self) -> None:
        """Forgets what the adaptive policy learned (ρ, estimates, probe budget): the next
        `generate` starts as a new engine does. `production`'s queue starts over with every
        run anyway; the other modes have no policy (None)."""
        self.policy = self.new_policy()

    def _init_sps(self, sps: Any, cache_dir: str | None, repeats: int) -> jax.Array:
        top = self.buckets[-1]
        if sps is not None:
            if isinstance(sps, Mapping):
                secs = {int(b): 1.0 / float(sps[b]) for b in sps}
                missing = [b for b in self.buckets if b not in secs]
                if missing:
                    raise ValueError(f"sps has no value for capacity buckets {missing}")
                self.bucket_seconds = {b: secs[b] for b in self.buckets}
                table = cost_profile.sps_table(self.buckets, self.bucket_seconds)
            else:
                table = np.asarray(sps, np.float32)
                if table.ndim != 1 or table.shape[0] < top + 1:
                    raise ValueError(f"sps table must be 1-D with ≥ {top + 1} entries (SPS(B) "
                                     f"for B = 0..{top}), got shape {table.shape}")
                table = table[:top + 1]
            return jnp.asarray(table)
        if self.mode not in ("algorithm1", "production", "adaptive"):
            return jnp.ones((top + 1,), jnp.float32)
        secs, took, cached = self.profile_buckets(cache_dir, repeats)
        self.bucket_seconds, self.profile_seconds = secs, took
        log.info("SPS over buckets %s: %s (%s)", self.buckets,
                 {b: f"{1 / s:.1f}/s" for b, s in secs.items()},
                 "from cache" if cached else f"profiled in {took:.2f} s")
        return jnp.asarray(cost_profile.sps_table(self.buckets, secs))

    def profile_buckets(self, cache_dir: str | None = None, repeats: int | None = None
                        ) -> tuple[dict[int, float], float, bool]:
        """Seconds of the verification step per capacity bucket (the SPS profile: SPS(B) =
        1 / seconds of the smallest bucket ≥ B; a step's share of a device call of
        `profile_steps`), from the disk cache or profiled there
        (`cost_profile.load_or_profile`; `cache_dir` default: the engine's `sps_cache_dir`).
        → (seconds by bucket, profiling s, from cache)."""
        m = self.profile_steps
        key = self._profile_key(steps=m)
        step = self._dummy_step_fn(m)
        calls = {K: functools.partial(step, K) for K in self.buckets}
        secs, took, cached = cost_profile.load_or_profile(
            key, self.sps_cache_dir if cache_dir is None else cache_dir, calls,
            repeats=self.profile_repeats if repeats is None else repeats)
        return {K: t / m for K, t in secs.items()}, took, cached

    def warmup(self, max_tokens: int | None = None) -> None:
        """Compiles the programs the engine runs: the verification step of every bucket (what
        profiling times), then, at every cache length a run can grow to (`cache_lengths`) up to
        the one that `max_tokens` (the longest prompt + max_new_tokens to be served; default: up
        to max_len) needs, the rounds (and for `adaptive` the plain stretches at each bucket a load
        needs) and a one-prompt prefill, so growing the cache compiles no round program."""
        step = self._dummy_step_fn()
        for K in self.buckets:
            jax.block_until_ready(step(K))
        top = self.cache_length_for(self.max_len if max_tokens is None
                                    else int(max_tokens) + 1 + self.gamma)
        p = self._all_slots_active()
        anchor_buckets = sorted({cost_profile.bucket_for(self.buckets, r)
                                 for r in range(1, self.R + 1)})
        for n in self.cache_lengths():
            if n > top:
                break
            if self.mode == "adaptive":   # plain stretches at each bucket a load needs
                for K in anchor_buckets:
                    jax.block_until_ready(self._anchor_rounds(self._fresh_state(n), p, 1, 1,
                                                              K)[1])
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
        R = self.R
        choice = round_.DraftChoice(
            gain=jnp.full((2,), float(R * self.gamma), jnp.float32),
            n_then=jnp.full((2,), R, jnp.int32), predicted=jnp.zeros((), jnp.float32),
            realised=jnp.zeros((), jnp.float32), decay=jnp.asarray(0.9, jnp.float32),
            plain_sps=jnp.zeros_like(jnp.asarray(self.plain_sps)))
        _, o = self._rounds(self._fresh_state(cache_len), self._all_slots_active(),
                            [R * self.gamma] * 2, rounds, R + 1, choice)
        return int(jax.device_get(o["rounds"]))

    def round_seconds(self, prompts: Sequence[Sequence[int]], rounds: int,
                      temperature: float = 1.0, seed: int = 0) -> list[float]:
        """Wall seconds of each of `rounds` engine rounds (after one untimed round: compilation)
        with `prompts` in flight: the host-stepped path `generate` runs (draft → schedule →
        bucket → verify → commit → host bookkeeping). No request may finish meanwhile: the
        budget exceeds what the rounds can emit, and the engine must have no stop tokens
        (`stop_token_ids=[]`). For round benchmarks."""
        n = len(prompts)
        if not 1 <= n <= self.R:
            raise ValueError(f"round_seconds takes 1..max_requests={self.R} prompts, got {n}")
        budget = (int(rounds) + 2) * (self.gamma + 1) + 2
        if max(len(p) for p in prompts) + budget + self.gamma + 1 > self.max_len:
            raise ValueError(f"max_len={self.max_len} cannot hold the prompts + {rounds} rounds")
        kd = list(np.asarray(jax.random.key_data(jax.random.split(
            jax.random.key(int(seed), impl="threefry2x32"), n))))
        run = _Run(self, budget, fresh_policy=True)
        for i in range(n):
            run.add(Request(prompts[i], kd[i], float(temperature)))
        run.t0 = time.perf_counter()
        s = run._prefill(run.start_state(), run._admit(0.0))
        s = run._round(s, max_steps=1)
        out = []
        for _ in range(int(rounds)):   # plain decoding: one step a round, as verification
            t0 = time.perf_counter()
            s = run._round(s, max_steps=1)
            out.append(time.perf_counter() - t0)
        if not run.h["active"].all():
            raise ValueError("a request finished during round_seconds (a stop token): build "
                             "the engine with stop_token_ids=[] to time rounds")
        return out

    # ------------------------------------------------------------------ generate
    def _check_prompt(self, i: Any, prompt: Sequence[int], max_new_tokens: int) -> None:
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

    def serve(self, requests: Sequence["Request"],
              on_reply: Callable[["Request", list[int]], Sequence["Request"]] | None = None, *,
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


@functools.partial(jax.jit, static_argnames=("cache_len", "adapter"))
def _grown_state(s: round_.EngineState, *, cache_len: int, adapter: Any
                 ) -> round_.EngineState:
    dcache = s.draft_cache
    if dcache is not None:
        dcache = adapter.grown_cache(dcache, cache_len)
    return s.replace(cache=s.cache.grown(cache_len), draft_cache=dcache)


class _Run:
    """Host bookkeeping of one `Engine.generate` / `Engine.serve` call."""

    def __init__(self, eng: Engine, max_new: int, *, fresh_policy: bool = False,
                 progress: bool = False, total: int | None = None,
                 on_reply: Callable[[Request, list[int]], Sequence[Request]] | None = None,
                 after_replies: Callable[[], None] | None = None):
        self.e, self.max_new = eng, int(max_new)
        self.requests: list[Request] = []
        self.prompts: list[list[int]] = []
        self.out: list[list[int]] = []
        self.per: list[dict[str, Any]] = []
        self.on_reply, self.after_replies = on_reply, after_replies
        self.ended = 0          # requests ended since `after_replies` last ran
        self.rounds: list[dict[str, Any]] = []
        self.h = eng._host_arrays()
        self.slot_req = [-1] * eng.R
        self.free = collections.deque(range(eng.R))
        self.pending: collections.deque[int] = collections.deque()
        self.plain = eng.mode == "none"
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
        self.e._check_prompt(i if label is None else label, req.prompt, self.max_new)
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
            req, h = self.requests[i], self.h
            h["temperature"][r], h["top_k"][r], h["top_p"][r] = (req.temperature, req.top_k,
                                                                  req.top_p)
            h["key_data"][r] = np.asarray(req.key_data, np.uint32)
            h["counter"][r], h["remaining"][r], h["active"][r] = 1, self.max_new, False
            joined.append(r)
        return joined

    def _fit_cache(self, s, slots: list[int]):
        """Grows the caches (`Engine.cache_lengths`, up to max_len) to hold the joining
        requests: prompt, budget and, speculating, one more verified block (attention reads
        the whole cache, so a short one is a faster step)."""
        e = self.e
        need = (max(len(self.prompts[self.slot_req[r]]) for r in slots) + self.max_new + 1
                + (0 if self.plain else e.gamma))
        n = e.cache_length_for(need)
        return e._grown(s, n) if n > s.cache.max_len else s

    def _prefill(self, s, slots: list[int]):
        """The joining prompts prefilled together, densely (plain: `plain_steps.plain_prefill`;
        speculative: `speculative_round.prefill_prompts`, which also feeds the drafter's
        context), in groups of at most R padded to a power-of-two size (padding rows write
        nothing) and to a `len_bucket` multiple of tokens (a `prefill_chunk` multiple past it,
        run chunk by chunk), so few shapes compile; `prefill_groups` splits the joiners by
        length where that computes fewer padded tokens."""
        e = self.e
        s = self._fit_cache(s, slots)
        p = e._slot_settings(self.h)
        cap = top_k_cap_for([int(self.h["top_k"][r]) for r in slots], e.V)
        lengths = [len(self.prompts[self.slot_req[r]]) for r in slots]
        for idx in prefill_groups(lengths, e.R, e.len_bucket, e.prefill_chunk,
                                  s.cache.max_len):
            group = [slots[i] for i in idx]
            n = 1 << (len(group) - 1).bit_length()
            P = prefill_length(max(lengths[i] for i in idx), e.len_bucket, e.prefill_chunk,
                               s.cache.max_len)
            tokens = np.zeros((n, P), np.int32)
            lens = np.ones((n,), np.int32)
            rows = np.full((n,), e.R, np.int32)     # R: a padding row, dropped
            for j, r in enumerate(group):
                prompt = self.prompts[self.slot_req[r]]
                tokens[j, :len(prompt)], lens[j], rows[j] = prompt, len(prompt), r
            args = (jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(rows))
            chunk = min(P, e.prefill_chunk)
            if self.plain:
                s, first = plain_prefill(e.target.graphdef, e.target.state, s, p, *args,
                                         chunk=chunk, top_k_cap=cap)
            else:
                s, first = round_.prefill_prompts(e.target.graphdef, e._dgd, e.target.state,
                                                  e._dstate, s, p, *args, chunk=chunk,
                                                  tap_layer_ids=e.tap_ids)
            first = np.asarray(first)
            self._first_tokens([(r, int(first[j])) for j, r in enumerate(group)])
        return s

    def _first_tokens(self, firsts: list[tuple[int, int]]) -> None:
        """Books each joined slot's first token (sampled by its prefill)."""
        e = self.e
        now = time.perf_counter() - self.t0
        stops = set(np.asarray(e.stop_ids).tolist()) - {-1}
        for r, t in firsts:
            i = self.slot_req[r]
            self.out[i].append(t)
            if self.bar is not None:
                self.bar.update(1)
            self.per[i]["first_token_s"] = now
            # DeepSpec's loop runs a round even with a budget of one token
            if t in stops or (self.max_new <= 1 and e.budget_rule == "serving"):
                self._finish(r, now)
            else:
                self.h["active"][r], self.h["remaining"][r] = True, self.max_new - 1

    def _finish(self, r: int, now: float) -> None:
        i = self.slot_req[r]
        self.per[i]["finish_s"] = now
        self.h["active"][r] = False
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
        self.h["remaining"][r] -= len(tokens)
        self.h["counter"][r] += rounds

    def _plain_round(self, s, max_steps: int | None = None):
        """Plain decoding (scheduler "none"): up to `plain_steps_per_call` steps in one device
        call (`decoding.plain_steps`), back on the host as soon as a slot can be handed to a
        waiting request, or when the next one arrives."""
        e, h = self.e, self.h
        t_start = time.perf_counter()
        n_active = int(h["active"].sum())
        steps, min_done = self._call_budget(max_steps, e.plain_steps_per_call)
        cap = top_k_cap_for([int(k) for k in h["top_k"][h["active"]]], e.V)
        s, o = plain_steps(e.step_target.graphdef, e.step_target.state, s, e._slot_settings(h),
                           e.stop_ids, jnp.asarray(steps, jnp.int32),
                           jnp.asarray(min_done, jnp.int32),
                           max_steps=e.plain_steps_per_call, top_k_cap=cap,
                           budget_rule=e.budget_rule)
        o = jax.device_get(o)
        now = time.perf_counter() - self.t0
        emitted = 0
        for r in np.nonzero(h["active"])[0]:
            m, k = int(o["n_emit"][r]), int(o["steps"][r])
            self._record(r, o["tokens"][r, :m], [0] * k, [0] * k, [1] * k, k)
            emitted += m
            if o["finished"][r]:
                self._finish(r, now)
        if self.bar is not None:
            self.bar.update(emitted)
        n_steps = int(o["steps"].max(initial=0))
        seconds = time.perf_counter() - t_start
        self.step_s = seconds / max(n_steps, 1)
        self.rounds.append(dict(active=n_active, verified_tokens=0, capacity=e.buckets[0],
                                tokens=emitted, drafted=False, seconds=seconds, steps=n_steps,
                                cache_len=int(s.cache.max_len)))
        return s

    def _call_budget(self, max_steps: int | None, per_call: int) -> tuple[int, int]:
        """(steps or rounds for this device call, min_done): back on the host as soon as a
        slot can be handed to a waiting request, or in time for the next arrival."""
        steps, min_done = per_call, self.e.R + 1
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

    def _round(self, s, max_steps: int | None = None):
        """Speculative rounds: up to `rounds_per_call` whole rounds in one device call
        (`speculative_round.speculative_rounds`). `adaptive` decides the first round on the
        host; the device makes the same choice before each later round and ends the call at
        the first that would not draft (`DraftChoice`), which the host then replays into its
        policy. A round it does not draft verifies the anchors alone (`_anchor_rounds`)."""
        if self.plain:
            return self._plain_round(s, max_steps)
        e, h = self.e, self.h
        t_start = time.perf_counter()
        n_active = int(h["active"].sum())
        drafted, capacity = True, 0
        if self.policy is not None:   # production: always drafts, K of two rounds before
            drafted, capacity = self.policy.decide(n_active)
        if not drafted:   # plain decoding: ℓ = 0, the drafter not run
            return self._anchor_rounds(s, n_active, t_start)
        rounds, min_done = self._call_budget(max_steps, e.rounds_per_call)
        choice = None
        if isinstance(self.policy, policy.CapacityQueue):
            queue = self.policy.queue
        elif isinstance(self.policy, policy.DraftPolicy):   # later rounds choose on device
            ks, gains, n_then = self.policy.carried()
            queue = [capacity, ks[1]]
            choice = round_.DraftChoice(
                gain=jnp.asarray(gains, jnp.float32), n_then=jnp.asarray(n_then, jnp.int32),
                predicted=jnp.asarray(self.policy.pred, jnp.float32),
                realised=jnp.asarray(self.policy.real, jnp.float32),
                decay=jnp.asarray(self.policy.decay, jnp.float32), plain_sps=e.plain_sps)
        else:
            queue = [capacity, capacity]
        s, o = e._rounds(s, e._slot_settings(h), queue, rounds, min_done, choice)
        o, now, n_run, seconds = self._fetch_rounds(o, t_start)
        for i in range(n_run):
            live = o["live"][i]
            if i and choice is not None:   # the device chose to draft this round
                self.policy.drafted_on_device()
            if self.policy is not None:
                self.policy.update(True, policy.Estimate(int(o["capacity_new"][i]),
                                                         float(o["gain_new"][i]),
                                                         int(live.sum())),
                                   float(o["predicted"][i]),
                                   float(np.sum(o["accepted"][i][live])))
            emitted = self._book_round({k: o[k][i] for k in round_.ROUND_OUTPUTS}, live, now,
                                       confidence=o["confidence"][i])
            self.rounds.append(dict(active=int(live.sum()),
                                    verified_tokens=int(o["lengths"][i][live].sum()),
                                    capacity=int(o["capacity"][i]), tokens=emitted,
                                    drafted=True, steps=1, seconds=seconds,
                                    admitted_capacity=int(o["admitted"][i])))
        return s

    def _fetch_rounds(self, o: Mapping[str, Any], t_start: float
                      ) -> tuple[dict[str, np.ndarray], float, int, float]:
        """A rounds call's outputs on the host: → (outputs, run time now, rounds run, seconds
        a round), the last also kept as the pace for arrivals (`step_s`)."""
        o = jax.device_get(o)
        now = time.perf_counter() - self.t0
        n_run = int(o["rounds"])
        self.step_s = (time.perf_counter() - t_start) / max(n_run, 1)
        return o, now, n_run, self.step_s

    def _book_round(self, o: Mapping[str, np.ndarray], live: np.ndarray, now: float,
                    confidence: np.ndarray | None = None) -> int:
        """Books one round's per-slot outputs (`verify_and_commit`'s, [R, …]) for the slots
        in `live`: tokens, acceptance records, confidence logits, finished requests. → tokens
        emitted."""
        emitted = 0
        for r in np.nonzero(live)[0]:
            m = int(o["n_emit"][r])
            if confidence is not None:   # confidence logits of this round's proposals
                self.per[self.slot_req[r]]["confidence"].append(
                    np.asarray(confidence[r], np.float32))
            self._record(r, o["tokens"][r, :m], [int(o["accepted"][r])],
                         [int(o["proposed"][r])], [int(o["tau_term"][r])], 1)
            emitted += m
            if o["finished"][r]:
                self._finish(r, now)
        if self.bar is not None:
            self.bar.update(emitted)
        return emitted

    def _anchor_rounds(self, s, n_active: int, t_start: float):
        """Rounds that skip drafting (`adaptive`): the anchors alone are verified (drafts of
        width 0) in the smallest bucket, and the drafter's context is still fed. The policy's
        next plain choices are known ahead (`DraftPolicy.plain_rounds`), so up to
        `plain_steps_per_call` of them run in one device call (`anchor_rounds`), back on the
        host once a slot finishes (the active count the choices assumed changes then)."""
        e, h = self.e, self.h
        want = self.policy.plain_rounds(n_active, e.plain_steps_per_call)
        rounds, _ = self._call_budget(want, e.plain_steps_per_call)
        K = cost_profile.bucket_for(e.buckets, max(n_active, 1))
        s, o = e._anchor_rounds(s, e._slot_settings(h), rounds, 1, K)
        o, now, n_run, seconds = self._fetch_rounds(o, t_start)
        for i in range(n_run):
            if i:   # replays the choice made ahead (the same n_active: no slot finished)
                self.policy.decide(n_active)
            self.policy.update(False)
            emitted = self._book_round({k: o[k][i] for k in round_.ROUND_OUTPUTS},
                                       o["live"][i], now)
            self.rounds.append(dict(active=n_active, verified_tokens=0, capacity=K,
                                    tokens=emitted, drafted=False, steps=1, seconds=seconds))
        return s

    def start_state(self):
        return self.e._fresh_state(self.e.cache_lengths()[0])

    def loop(self) -> EngineResult:
        s = self.start_state()
        self.t0 = time.perf_counter()
        while self.pending or self.h["active"].any():
            now = time.perf_counter() - self.t0
            joined = self._admit(now)
            if joined:
                s = self._prefill(s, joined)
            if self.h["active"].any():
                s = self._round(s)
            elif self.pending and self.free:
                wait = (self.requests[self.pending[0]].arrival_s
                        - (time.perf_counter() - self.t0))
                if wait > 0:
                    time.sleep(wait)
            if self.ended and self.after_replies is not None:
                self.after_replies()
            self.ended = 0
        self.final_state = s
        if self.bar is not None:
            self.bar.close()
        return EngineResult(tokens=self.out, rounds=self.rounds, per_request=self.per,
                            wall_s=time.perf_counter() - self.t0)
