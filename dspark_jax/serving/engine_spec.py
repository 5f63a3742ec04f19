"""The serving engine's immutable spec (paper §3.2.2, §5.2–5.4; SPEC §8, §9): what every
program of one engine is built from and nothing changes afterwards.

`EngineSpec` holds the settings, the round programs' static config with its capacity buckets,
the arrays every round reads (weights in the decoding layout, stop ids, the scheduler's
tables) and the costs the schedule reads, and makes what the programs take: empty request
slots and caches grown to a length (`fresh_state`, `grown`; laid on the weights' mesh where
they span several devices, `decoding.placement`), the host's slot settings
(`empty_slots`), a device call's schedule (`schedule_state`) and a mode's policy inputs.
`engine_spec` builds one from the settings and the models in their decoding layout: the
engine (`serving.engine`), a run (`serving.run_loop`), the cost profile
(`serving.cost_profile`) and the ahead-of-time compilation (`aot.decode`, abstractly under
`jax.eval_shape`) all take what it builds.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.draft_adapters import adapter_for
from dspark_jax.decoding.placement import place_slots, prefill_call_tokens
from dspark_jax.decoding.round_types import (DraftChoice, EngineArrays, EngineState, RoundConfig,
                                             ScheduleState)
from dspark_jax.decoding.stops import stop_array
from dspark_jax.models.decoder import aligned_length, has_layer_buffers, init_cache
from dspark_jax.models.drafters.dspark import with_layer_buffers as draft_layer_buffers
from dspark_jax.serving.modes import SchedulerMode
from dspark_jax.serving.policy import PolicyInputs, drafting_sps_table
from dspark_jax.serving.records import HostSlots
from dspark_jax.serving.settings import EngineSettings
from dspark_jax.sharding import weights_mesh

# speculative decoding's cache lengths, in `len_bucket`s: the powers of two and 1.5× them
_SPECULATIVE_LENGTHS = sorted({2 ** k for k in range(40)} | {3 * 2 ** k for k in range(40)})


def capacity_buckets(num_slots: int, gamma: int, buckets: Sequence[int] | None = None
                     ) -> tuple[int, ...]:
    """The static token capacities of the verification step: by default R, 2R, 4R, R(γ+1)
    (those ≤ R(γ+1)), rounded up to a multiple of 8 above 8. A given set must cover R(γ+1)
    and may not go below R (every active request verifies at least its anchor)."""
    R, top = int(num_slots), int(num_slots) * (int(gamma) + 1)
    if buckets is None:
        cand = {R, 2 * R, 4 * R, top}
        rnd = {min(top, ((c + 7) // 8) * 8) if c > 8 else c for c in cand if c <= top}
        return tuple(sorted(rnd | {top}))
    out = sorted({int(b) for b in buckets})
    if not out or out[0] < R:
        raise ValueError(f"capacity_buckets {out}: a capacity smaller than the number of "
                         f"request slots (max_requests={R}) cannot hold every anchor")
    if out[-1] < top:
        out.append(top)
    return tuple(out)


def bucket_for(buckets: Sequence[int], n_tokens: int) -> int:
    """The smallest capacity bucket that holds `n_tokens`."""
    for b in buckets:
        if n_tokens <= b:
            return int(b)
    raise ValueError(f"{n_tokens} tokens exceed the largest capacity bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class EngineCosts:
    """What an engine's schedule reads of its costs (`serving.policy`): SPS(B), the drafter's
    seconds per round t_d and the plain round's t_plain (in the units of SPS), and what
    profiling them took (`cost_profile.engine_costs`)."""

    sps: np.ndarray                    # [top + 1] f32 SPS(B), B = 0..largest bucket
    draft_seconds: float               # t_d (0: the drafter counts as free)
    plain_seconds: np.ndarray          # [min(R, top) + 1] t_plain by active requests
    bucket_seconds: dict[int, float] | None = None   # seconds per bucket (profiled or given)
    profile_seconds: float = 0.0       # SPS profiling wall seconds (0: cached or given)
    cost_profile_seconds: float = 0.0  # t_d / t_plain profiling wall seconds (0: cached)

    @classmethod
    def flat(cls, top: int, num_slots: int) -> "EngineCosts":
        """Costs that rank nothing: SPS 1 at every size, a free drafter, a plain round as the
        verification step."""
        return cls(sps=np.ones((top + 1,), np.float32), draft_seconds=0.0,
                   plain_seconds=np.ones((min(num_slots, top) + 1,)))

    @property
    def verify_seconds(self) -> np.ndarray:
        """t_v(B) = 1 / SPS(B)."""
        return 1.0 / np.maximum(np.asarray(self.sps, np.float64), 1e-12)

    @property
    def sps_draft(self) -> np.ndarray:
        """Drafting rounds per second at B tokens: 1 / (t_d + t_v(B))."""
        return drafting_sps_table(self.verify_seconds, self.draft_seconds)

    @property
    def plain_sps(self) -> np.ndarray:
        """Plain rounds per second by active requests (`adaptive`'s choice on device)."""
        return (1.0 / np.maximum(self.plain_seconds, 1e-12)).astype(np.float32)


def _static() -> Any:
    return flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class EngineSpec:
    """Everything one engine's programs are built from (see module docstring); a pytree whose
    only leaves are `arrays`, so `jax.eval_shape` builds it abstractly."""

    settings: EngineSettings = _static()
    config: RoundConfig = _static()          # the round programs' config, every bucket
    arrays: EngineArrays
    target_config: Any = _static()           # `DecoderConfig`
    draft_config: Any = _static()            # `DraftConfig`; None without a drafter
    cache_dtype: Any = _static()
    per_layer_cache: bool = _static()        # the target cache: one buffer per layer
    layer_buffers: bool = _static()          # the decoding layout: one buffer per layer
    costs: EngineCosts = _static()
    # the mesh of several devices the weights span (`sharding.weights_mesh`); None: one device
    mesh: Any = flax.struct.field(pytree_node=False, default=None)

    @property
    def mode(self) -> SchedulerMode:
        return self.config.mode

    @property
    def num_slots(self) -> int:
        return int(self.settings.max_requests)

    @property
    def max_len(self) -> int:
        return int(self.settings.max_len)

    @property
    def gamma(self) -> int:
        return 0 if self.draft_config is None else int(self.draft_config.num_drafts)

    @property
    def vocab_size(self) -> int:
        return int(self.target_config.vocab_size)

    @property
    def per_request(self) -> int:
        """Tokens a request verifies besides its anchor: γ drafts or N tree nodes."""
        return int(self.config.tree_budget) or self.gamma

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.config.buckets

    @property
    def prefill_call_tokens(self) -> int:
        """The most padded tokens one prefill call takes (`placement.prefill_call_tokens`)."""
        return prefill_call_tokens(self.settings.prefill_tokens, self.mesh)

    @property
    def adapter(self) -> Any:
        """The drafter's adapter (`draft_adapters.adapter_for`); None without a drafter."""
        return None if self.draft_config is None else adapter_for(self.draft_config.model_type)

    def with_costs(self, costs: EngineCosts) -> "EngineSpec":
        """This spec scheduling on `costs` (its SPS tables in the arrays)."""
        arrays = self.arrays.replace(sps=jnp.asarray(costs.sps),
                                     sps_draft=jnp.asarray(costs.sps_draft))
        return self.replace(arrays=arrays, costs=costs)

    # ------------------------------------------------------------------ state
    def fresh_state(self, cache_len: int | None = None) -> EngineState:
        """Empty slots. `cache_len` (default: the longest of `cache_lengths`): the caches'
        initial length, which a run grows as longer requests join (`grown`)."""
        R, n = self.num_slots, cache_len or self.cache_lengths()[-1]
        cache = init_cache(self.target_config, R, n, self.cache_dtype,
                           per_layer=self.per_layer_cache)
        draft_cache = None
        if self.draft_config is not None:   # in the layout the rounds' drafter reads
            drafter = nnx.merge(self.arrays.draft_graphdef, self.arrays.draft_state)
            draft_cache = self.adapter.init_cache(drafter, R, n)
        return place_slots(EngineState(cache=cache, draft_cache=draft_cache,
                                       anchor=jnp.zeros((R,), jnp.int32)), self.mesh)

    def grown(self, state: EngineState, cache_len: int) -> EngineState:
        """The state with room for `cache_len` positions in the target and drafter caches."""
        return place_slots(_grown_state(state, cache_len=int(cache_len), adapter=self.adapter),
                           self.mesh)

    def cache_lengths(self) -> list[int]:
        """The cache lengths a run can grow through: plain decoding's `len_bucket` multiples;
        speculative decoding's `len_bucket` times 1, 2, 3, 4, 6, 8, 12, … (a power of two and
        1.5× it: its programs cost more to compile, and every step attends over the whole
        cache, so a length at most a third too long — powers of two alone: up to twice — keeps
        its rounds' attention near plain decoding's; a cache a third longer than plain
        decoding's already slows `adaptive`'s plain rounds measurably: `python -m
        dspark_jax.bench.load`); the last is max_len rounded up to `models.decoder.CACHE_ALIGN`
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

    def empty_slots(self) -> HostSlots:
        """The host's copy of `SlotSettings` for R empty slots."""
        return HostSlots.empty(self.num_slots)

    def check_prompt(self, i: Any, prompt: Sequence[int], max_new_tokens: int) -> None:
        """Raises ValueError for prompt `i` when it is empty, holds ids outside the vocabulary
        or cannot fit max_len with its budget and one verified block."""
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        arr = np.asarray(prompt)
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
        need = len(prompt) + max_new_tokens + self.gamma + 1
        if need > self.max_len:
            raise ValueError(f"prompt {i} ({len(prompt)} tokens) + max_new_tokens "
                             f"({max_new_tokens}) + γ+1 ({self.gamma + 1}) exceeds "
                             f"max_len={self.max_len}")

    # ------------------------------------------------------------------ schedule
    def buckets_reached(self, max_active: int | None = None) -> int:
        """How many buckets a call that never holds more than `max_active` requests at once
        (None: R) can reach: up to the smallest that holds the largest verification so many
        requests can ask for (each at most its share of the top bucket)."""
        R, top = self.num_slots, self.buckets[-1]
        n = R if max_active is None else max(1, min(int(max_active), R))
        return 1 + self.buckets.index(bucket_for(self.buckets, -(-top * n // R)))

    def config_through(self, n_buckets: int) -> RoundConfig:
        """The round config compiled with the first `n_buckets` capacity buckets only: the
        device picks the same bucket as with every bucket compiled (the smallest that holds
        the round's tokens) when the round's tokens fit them."""
        if n_buckets >= len(self.buckets):
            return self.config
        return dataclasses.replace(self.config, buckets=self.buckets[:n_buckets])

    def policy_inputs(self) -> PolicyInputs:
        """What this mode's per-round policy is made from (`SchedulerMode.new_policy`)."""
        st, costs = self.settings, self.costs
        return PolicyInputs(
            verify_seconds=costs.verify_seconds, draft_seconds=costs.draft_seconds,
            plain_seconds=costs.plain_seconds, gamma=self.per_request,
            initial_capacity=self.num_slots * self.per_request,
            probe_interval=int(st.probe_interval), max_probe_interval=int(st.max_probe_interval),
            explore=None if st.explore is None else float(st.explore))

    def schedule_state(self, capacities: Sequence[int], choice: Mapping[str, Any] | None,
                       plain_sps: np.ndarray | None = None) -> ScheduleState:
        """A policy's `device_schedule` as the device call carries it; the drafting choice
        compares against `plain_sps` (default: the costs' plain rounds per second)."""
        if choice is None:
            return ScheduleState.of(capacities)
        plain = self.costs.plain_sps if plain_sps is None else plain_sps
        return ScheduleState.of(capacities, choice["n_then"], DraftChoice.of(
            choice["gain"], choice["predicted"], choice["realised"], choice["decay"],
            jnp.array(plain)))   # a copy: the call donates it


def decoding_models(settings: EngineSettings, target: Any, draft: Any) -> tuple[Any, Any]:
    """The target and the drafter in the layout prefill, decoding steps and verification run
    on (`Target.decoding_layout`: one buffer per layer on accelerators), so the engine holds
    the weights once; the drafter's layers follow the target's, and its embedding and LM head
    are the target's own arrays where they are equal (`Draft.sharing_tables_with`)."""
    step_target = target.decoding_layout(settings.layer_buffers)
    if draft is not None and step_target is not target:
        draft_gd, draft_st = draft_layer_buffers(draft.graphdef, draft.state)
        draft = dataclasses.replace(draft, graphdef=draft_gd, state=draft_st)
    if draft is not None:
        draft = draft.sharing_tables_with(step_target)
    return step_target, draft


def engine_spec(settings: EngineSettings, target: Any, draft: Any, *, layer_buffers: bool,
                default_stops: Sequence[int]) -> EngineSpec:
    """The spec of an engine with `settings` decoding `target` (a `Target`) and `draft` (a
    `Draft`, None for plain decoding), both in their decoding layout (`decoding_models`;
    `layer_buffers`: one buffer per layer), stopping at `default_stops` unless the settings
    name stop ids. Its costs are flat (`EngineCosts.flat`) until `with_costs`."""
    draft = draft if settings.mode.drafts else None
    R, gamma = int(settings.max_requests), 0 if draft is None else int(draft.config.num_drafts)
    buckets = capacity_buckets(R, int(settings.tree_budget) or gamma, settings.capacity_buckets)
    if buckets[-1] > int(settings.max_len) * R:
        raise ValueError("capacity_buckets exceed what max_len can hold")
    config = RoundConfig(
        mode=settings.mode, verifier=settings.verifier, sampler=settings.sampler,
        budget_rule=settings.budget_rule, cap_budget=settings.caps_budget,
        tap_layer_ids=() if draft is None else tuple(draft.config.target_layer_ids),
        buckets=buckets, rounds_per_call=int(settings.rounds_per_call),
        plain_rounds_per_call=int(settings.plain_steps_per_call),
        tree_budget=int(settings.tree_budget), tree_branching=int(settings.tree_branching))
    costs = EngineCosts.flat(buckets[-1], R)
    return EngineSpec(settings=settings, config=config,
                      arrays=_engine_arrays(settings, target, draft, gamma, default_stops, costs),
                      target_config=target.config,
                      draft_config=None if draft is None else draft.config,
                      cache_dtype=target.dtype, per_layer_cache=has_layer_buffers(target.model),
                      layer_buffers=bool(layer_buffers), costs=costs,
                      mesh=weights_mesh(target.state))


def _engine_arrays(settings: EngineSettings, target: Any, draft: Any, gamma: int,
                   default_stops: Sequence[int], costs: EngineCosts) -> EngineArrays:
    """The arrays every round program reads, their SPS tables from `costs`."""
    temps = settings.confidence_temperatures_for(draft, gamma)
    draft_graphdef = draft_state = vocab_weights = None
    if draft is not None:
        draft_graphdef, draft_state = draft.graphdef, draft.state
        adapter = adapter_for(draft.config.model_type)
        # the draft vocabulary's weight rows, gathered once (not in every drafting call)
        vocab_weights = jax.jit(lambda state: adapter.vocab_weights(
            nnx.merge(draft_graphdef, state)))(draft_state)
    return EngineArrays(
        target_graphdef=target.graphdef, draft_graphdef=draft_graphdef,
        target_state=target.state, draft_state=draft_state,
        stop_ids=stop_array(settings.stop_token_ids, default_stops),
        confidence_temperatures=None if temps is None else jnp.asarray(temps, jnp.float32),
        threshold=jnp.asarray(float(settings.threshold), jnp.float32),
        sps=jnp.asarray(costs.sps), sps_draft=jnp.asarray(costs.sps_draft),
        vocab_weights=vocab_weights)


@functools.partial(jax.jit, static_argnames=("cache_len", "adapter"))
def _grown_state(state: EngineState, *, cache_len: int, adapter: Any) -> EngineState:
    draft_cache = state.draft_cache
    if draft_cache is not None:
        draft_cache = adapter.grown_cache(draft_cache, cache_len)
    return state.replace(cache=state.cache.grown(cache_len), draft_cache=draft_cache)
