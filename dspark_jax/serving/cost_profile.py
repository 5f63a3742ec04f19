"""The cost profile: what a verification step, a drafting call and a plain decoding step cost
on this machine (paper §3.2.2, Algorithm 1's table SPS(B); §5.2; SPEC §8–9). The one profiler
of the package: the engine, the benchmarks and the tests time device calls here.

The scheduler's objective Θ = τ · SPS(B) needs the target's verification steps per second at
B batch tokens. With ragged verification the program that runs for B tokens is the one of the
smallest capacity bucket ≥ B, so SPS is a step function over the buckets (`sps_table`): it is
measured on exactly those compiled programs, once per engine. The adaptive policy
(`serving.policy`) also needs the drafter's seconds per round and the plain step's. Every
profile is a set of named calls timed round-robin (`profile_calls`) and cached on disk
(`load_or_profile`), keyed by the device kind, the target's shapes and the buckets (`cache_key`).

An engine's profile (`engine_costs` of its `serving.engine_spec.EngineSpec` → `EngineCosts`,
which the spec then carries): the verification step of every bucket
(`verify_step_fn`), the drafter's round (`draft_step_fn`) and the plain round
(`plain_rounds_fn`), each a step's share of a device call of several steps, as the rounds'
device loop pays them, under a key naming everything those calls depend on, the decoding layout
(one buffer per layer or the stacked layers) included (`profile_key`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import time
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding import speculative_round as round_
from dspark_jax.decoding.round_types import EngineState, SlotSettings
from dspark_jax.serving.engine_spec import EngineCosts, EngineSpec, bucket_for

ENV_CACHE_DIR = "DSPARK_JAX_CACHE_DIR"
K = TypeVar("K", bound=Hashable)
log = logging.getLogger(__name__)


def default_cache_dir() -> pathlib.Path:
    """~/.cache/dspark_jax/sps (or $DSPARK_JAX_CACHE_DIR/sps)."""
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "dspark_jax")
    return pathlib.Path(root) / "sps"


def sps_table(buckets: Sequence[int], seconds: Mapping[int, float]) -> np.ndarray:
    """sps[B] for B = 0..max bucket: 1 / (time of the smallest bucket ≥ B)."""
    top = int(max(buckets))
    bs = sorted(int(b) for b in buckets)
    # timing noise must not make a larger bucket look faster: running max of the seconds
    secs = np.maximum.accumulate([float(seconds[b]) for b in bs])
    table = np.zeros((top + 1,), np.float32)
    for B in range(top + 1):
        table[B] = 1.0 / max(float(secs[bs.index(bucket_for(bs, max(B, 1)))]), 1e-12)
    return table


def cache_key(target_cfg: Any, dtype: Any, num_slots: int, max_len: int,
              buckets: Sequence[int], extra: Mapping[str, Any] | None = None) -> str:
    """Disk-cache key: device kind, target shapes, dtype, slots, max_len, buckets (+ `extra`,
    e.g. the drafter's shapes for its per-round cost)."""
    dev = jax.devices()[0]
    shape = {f: getattr(target_cfg, f, None) for f in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim")}
    blob = json.dumps(dict(platform=dev.platform, kind=getattr(dev, "device_kind", ""),
                           shape=shape, dtype=str(dtype), slots=int(num_slots),
                           max_len=int(max_len), buckets=[int(b) for b in buckets],
                           **({"extra": dict(extra)} if extra else {})),
                      sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:20]


def time_call(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
              timer: Callable[[], float] = time.perf_counter) -> list[float]:
    """Wall seconds of each of `repeats` calls of `fn()`, blocked on its result, after `warmup`
    untimed calls (compilation)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(max(int(repeats), 1)):
        t0 = timer()
        jax.block_until_ready(fn())
        out.append(timer() - t0)
    return out


def profile_calls(calls: Mapping[K, Callable[[], Any]], *, repeats: int = 3, warmup: int = 1,
                  timer: Callable[[], float] = time.perf_counter) -> dict[K, float]:
    """Median seconds of each call (blocked on its result). Every call runs `warmup` times
    untimed first (compilation), then the timed calls go round-robin over the calls, `repeats`
    rounds, so that the machine's drift hits every call alike instead of bending the profile."""
    if repeats < 1:
        raise ValueError(f"repeats must be ≥ 1, got {repeats}")
    for fn in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[K, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for k, fn in calls.items():
            t0 = timer()
            jax.block_until_ready(fn())
            times[k].append(timer() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def load_or_profile(key: str, cache_dir: str | os.PathLike | None,
                    calls: Mapping[K, Callable[[], Any]], *, repeats: int = 3
                    ) -> tuple[dict[K, float], float, bool]:
    """Seconds of each call (`profile_calls`: e.g. the verification step per capacity bucket,
    or the drafter's round and the plain step) from the disk cache entry `key`, else profiled
    and written there. → (seconds by call, profiling wall seconds (0 if cached), from_cache)."""
    path = pathlib.Path(cache_dir or default_cache_dir()) / f"{key}.json"
    names = {str(k): k for k in calls}
    if path.is_file():
        try:
            saved = json.loads(path.read_text())["seconds"]
            if set(saved) == set(names):
                return {names[n]: float(v) for n, v in saved.items()}, 0.0, True
        except (ValueError, KeyError, OSError, TypeError, AttributeError):
            pass   # a damaged cache entry is re-profiled
    t0 = time.perf_counter()
    secs = profile_calls(calls, repeats=repeats)
    took = time.perf_counter() - t0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"seconds": {str(k): v for k, v in secs.items()},
                                    "profile_s": took, "device": str(jax.devices()[0])}))
    except OSError:
        pass   # a read-only cache dir only costs a re-profile next time
    return secs, took, False


# ------------------------------------------------------------------------------ an engine's costs
def given_sps(sps: Any, buckets: Sequence[int]) -> tuple[np.ndarray, dict[int, float] | None]:
    """SPS passed in — {bucket: steps/s} or a table [≥ largest bucket + 1] — → (table,
    seconds per bucket or None)."""
    top = int(buckets[-1])
    if isinstance(sps, Mapping):
        secs = {int(b): 1.0 / float(sps[b]) for b in sps}
        missing = [b for b in buckets if b not in secs]
        if missing:
            raise ValueError(f"sps has no value for capacity buckets {missing}")
        bucket_seconds = {b: secs[b] for b in buckets}
        return sps_table(buckets, bucket_seconds), bucket_seconds
    table = np.asarray(sps, np.float32)
    if table.ndim != 1 or table.shape[0] < top + 1:
        raise ValueError(f"sps table must be 1-D with ≥ {top + 1} entries (SPS(B) for B = "
                         f"0..{top}), got shape {table.shape}")
    return table[:top + 1], None


def engine_costs(spec: EngineSpec) -> EngineCosts:
    """The costs of the engine of `spec`: SPS given, profiled (the modes whose search reads
    it, `Mode.profiles_sps`) or flat; t_d and t_plain given or profiled (`adaptive` without a
    given SPS); with SPS given and no costs the drafter counts as free and a plain round as
    the verification step at n tokens (the paper's rule: always draft)."""
    st, buckets = spec.settings, spec.buckets
    bucket_seconds, took = None, 0.0
    if st.sps is not None:
        table, bucket_seconds = given_sps(st.sps, buckets)
    elif spec.mode.profiles_sps:
        bucket_seconds, took, cached = profile_buckets(spec)
        log.info("SPS over buckets %s: %s (%s)", buckets,
                 {b: f"{1 / t:.1f}/s" for b, t in bucket_seconds.items()},
                 "from cache" if cached else f"profiled in {took:.2f} s")
        table = sps_table(buckets, bucket_seconds)
    else:
        table = np.ones((buckets[-1] + 1,), np.float32)
    draft_s, plain_s, cost_took = st.draft_seconds, st.plain_seconds, 0.0
    if spec.mode.prices_drafting and st.sps is None and None in (draft_s, plain_s):
        measured, cost_took = profile_costs(spec, sps=table)
        draft_s = measured["draft"] if draft_s is None else draft_s
        plain_s = measured["plain"] if plain_s is None else plain_s
        log.info("adaptive costs: draft %.2f ms / round, plain step %.2f ms (%s)",
                 1e3 * draft_s, 1e3 * plain_s,
                 f"profiled in {cost_took:.2f} s" if cost_took else "from cache")
    verify_s = 1.0 / np.maximum(np.asarray(table, np.float64), 1e-12)
    n_plain = min(spec.num_slots, len(verify_s) - 1) + 1
    plain = (np.full((n_plain,), float(plain_s)) if plain_s is not None
             else verify_s[:n_plain])
    return EngineCosts(sps=np.asarray(table, np.float32), draft_seconds=float(draft_s or 0.0),
                       plain_seconds=plain, bucket_seconds=bucket_seconds,
                       profile_seconds=took, cost_profile_seconds=cost_took)


# ------------------------------------------------------------------------------ profiled calls
class HasSpec(Protocol):
    """An engine (`serving.Engine`): the profiled calls also take one for its spec."""

    spec: EngineSpec


def spec_of(eng: EngineSpec | HasSpec) -> EngineSpec:
    """`eng` itself when it is a spec, else its spec."""
    return eng if isinstance(eng, EngineSpec) else eng.spec


def all_slots_active(eng: EngineSpec | HasSpec) -> SlotSettings:
    """Settings of R running requests with room to the end of the cache (profiling)."""
    spec = spec_of(eng)
    h = spec.empty_slots()
    h.active[:] = True
    h.remaining[:] = spec.max_len
    return h.to_device()


def profile_steps(spec: EngineSpec) -> int:
    """Steps a profiled device call runs (verification per bucket, drafting): the costs are a
    step's share of the call, as inside the rounds' device loop, which runs up to
    `rounds_per_call` rounds a call without the call's dispatch and host sync (at one request
    on CPU these made a lone call ~1.4× a round of the loop)."""
    return min(4, spec.settings.rounds_per_call)


def _rewound(state: EngineState) -> EngineState:
    """The state with every slot's cache emptied again (a profiled call repeats)."""
    return state.replace(cache=state.cache.with_lengths(jnp.zeros_like(state.cache.lengths)))


def verify_step_fn(eng: EngineSpec | HasSpec, steps: int = 1) -> Callable[[int], Any]:
    """step_fn(K): `steps` verification steps with exactly K admitted tokens (all slots) in
    one device call (`speculative_round.verify_and_commit`)."""
    spec = spec_of(eng)
    R, gamma, V = spec.num_slots, spec.gamma, spec.vocab_size
    slots = all_slots_active(spec)
    drafts = jnp.zeros((R, gamma), jnp.int32)
    probs = jnp.full((R, gamma, V), 1.0 / V, jnp.float32)
    holder = {"state": spec.fresh_state()}

    def step(capacity: int) -> Any:
        extra = capacity - R
        lengths = np.minimum(gamma, extra // R + (np.arange(R) < extra % R)).astype(np.int32)
        state, outputs = round_.verify_and_commit(
            spec.config, spec.arrays, holder["state"], slots, drafts, probs,
            jnp.asarray(lengths), capacity=capacity, steps=steps)
        holder["state"] = _rewound(state)
        return outputs.n_emit

    return step


def plain_rounds_fn(spec: EngineSpec) -> tuple[Callable[[int], Any], int]:
    """(step_fn(K), n): n rounds that skip drafting in one device call (`anchor_rounds`: the
    anchors alone verified in bucket K, the drafter's context still fed), as `adaptive`'s
    plain stretches run them; the cost of one is the call's time / n."""
    n = max(1, min(spec.settings.plain_steps_per_call, spec.max_len - 1))
    arrays = spec.arrays.replace(stop_ids=jnp.full_like(spec.arrays.stop_ids, -1))
    holder = {"state": spec.fresh_state()}

    def step(capacity: int) -> Any:
        state, result = round_.anchor_rounds(spec.config, arrays, holder["state"],
                                             all_slots_active(spec),   # donated: fresh
                                             jnp.asarray(n, jnp.int32),
                                             jnp.asarray(spec.num_slots + 1, jnp.int32),
                                             capacity=capacity)
        holder["state"] = _rewound(state)
        return result.rounds

    return step, n


def draft_step_fn(eng: EngineSpec | HasSpec, steps: int = 1, arrays: Any = None
                  ) -> Callable[[int], Any]:
    """step_fn(_): one drafting + scheduling call, synchronised on what the host reads;
    `steps` > 1: that many in one device call (`speculative_round.draft_steps`). `arrays`:
    the engine's arrays to draft with (default: the spec's)."""
    spec = spec_of(eng)
    arrays = spec.arrays if arrays is None else arrays
    slots, state = all_slots_active(spec), spec.fresh_state()
    capacity = jnp.asarray(spec.num_slots * spec.gamma, jnp.int32)

    def step(_: int) -> Any:
        if steps == 1:
            drafted = round_.draft_and_schedule(spec.config, arrays, state, slots, capacity)
            return drafted.n_tokens, drafted.capacity_new
        return round_.draft_steps(spec.config, arrays, state, slots, capacity, steps=steps)

    return step


def profile_key(spec: EngineSpec, **extra: Any) -> str:
    """Disk-cache key of a profile of the engine of `spec`: everything the timed calls depend
    on — device, target shapes and dtype, slots, max_len, buckets, the decoding layout, the
    verifier and the sampler, the drafter's shapes including its draft vocabulary (the
    verification step also feeds the drafter's context) and the draft tree's budget and
    branching (a tree's drafting call costs more than a chain's) — plus `extra`."""
    drafter = None
    if spec.draft_config is not None:
        dc = spec.draft_config
        drafter = {f: getattr(dc, f, None) for f in (
            "model_type", "num_drafts", "num_draft_layers", "markov_rank",
            "markov_head_type", "target_layer_ids", "draft_vocab_size", "layer_family",
            "hidden_size", "intermediate_size")}
    st = spec.settings
    return cache_key(spec.target_config, spec.cache_dtype, spec.num_slots, spec.max_len,
                     spec.buckets,
                     extra=dict(drafter=drafter,
                                layout="layer_buffers" if spec.layer_buffers else "stacked",
                                verifier=st.verifier, sampler=st.sampler,
                                tree=(int(st.tree_budget), int(st.tree_branching)), **extra))


def profile_buckets(spec: EngineSpec, cache_dir: str | None = None, repeats: int | None = None
                    ) -> tuple[dict[int, float], float, bool]:
    """Seconds of the verification step per capacity bucket (the SPS profile: SPS(B) =
    1 / seconds of the smallest bucket ≥ B; a step's share of a device call of
    `profile_steps`), from the disk cache or profiled there (`load_or_profile`; `cache_dir`
    default: the settings' `sps_cache_dir`). → (seconds by bucket, profiling s, from cache)."""
    st, steps = spec.settings, profile_steps(spec)
    step = verify_step_fn(spec, steps)
    calls = {K: functools.partial(step, K) for K in spec.buckets}
    secs, took, cached = load_or_profile(
        profile_key(spec, steps=steps), st.sps_cache_dir if cache_dir is None else cache_dir,
        calls, repeats=st.profile_repeats if repeats is None else repeats)
    return {K: t / steps for K, t in secs.items()}, took, cached


def profile_costs(spec: EngineSpec, sps: np.ndarray | None = None
                  ) -> tuple[dict[str, float], float]:
    """The drafter's seconds per round (draft + schedule, all slots; `profile_steps` a device
    call) and a plain round's seconds (anchors only, smallest bucket, several a device call as
    `adaptive`'s plain stretches run them: `plain_rounds_fn`), profiled once like SPS and
    cached on disk next to it. `sps`: the SPS table the drafting call schedules with (default:
    the spec's). → ({"draft": t_d, "plain": t_plain}, profiling s (0 when cached))."""
    if spec.draft_config is None:
        raise ValueError("profile_costs needs a drafter (scheduler='none' has none)")
    steps, arrays = profile_steps(spec), spec.arrays
    if sps is not None:   # until t_d is known the drafting objective is SPS itself
        arrays = arrays.replace(sps=jnp.asarray(sps), sps_draft=jnp.asarray(sps))
    plain, n = plain_rounds_fn(spec)
    calls = {f"draft_{steps}_steps": functools.partial(draft_step_fn(spec, steps, arrays), 0),
             f"plain_{n}_rounds": functools.partial(plain, spec.buckets[0])}
    key = profile_key(spec, costs=True, mode=spec.mode.name, steps=steps)
    secs, took, _ = load_or_profile(key, spec.settings.sps_cache_dir, calls,
                                    repeats=spec.settings.profile_repeats)
    return {"draft": secs[f"draft_{steps}_steps"] / steps,
            "plain": secs[f"plain_{n}_rounds"] / n}, took
