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

An engine's profile (`engine_costs` → `EngineCosts`): the verification step of every bucket
(`verify_step_fn`), the drafter's round (`draft_step_fn`) and the plain round
(`plain_rounds_fn`), each a step's share of a device call of several steps, as the rounds'
device loop pays them, under a key naming everything those calls depend on, the decoding layout
(one buffer per layer or the stacked layers) included (`profile_key`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import time
from typing import Any, Callable, Hashable, Mapping, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding import speculative_round as round_
from dspark_jax.serving import policy

ENV_CACHE_DIR = "DSPARK_JAX_CACHE_DIR"
K = TypeVar("K", bound=Hashable)
log = logging.getLogger(__name__)


def default_cache_dir() -> pathlib.Path:
    """~/.cache/dspark_jax/sps (or $DSPARK_JAX_CACHE_DIR/sps)."""
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "dspark_jax")
    return pathlib.Path(root) / "sps"


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
    for b in buckets:
        if n_tokens <= b:
            return int(b)
    raise ValueError(f"{n_tokens} tokens exceed the largest capacity bucket {buckets[-1]}")


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
@dataclasses.dataclass(frozen=True)
class EngineCosts:
    """What an engine's schedule reads of its costs (`serving.policy`): SPS(B), the drafter's
    seconds per round t_d and the plain round's t_plain (in the units of SPS), and what
    profiling them took."""

    sps: np.ndarray                    # [top + 1] f32 SPS(B), B = 0..largest bucket
    draft_seconds: float               # t_d (0: the drafter counts as free)
    plain_seconds: np.ndarray          # [min(R, top) + 1] t_plain by active requests
    bucket_seconds: dict[int, float] | None = None   # seconds per bucket (profiled or given)
    profile_seconds: float = 0.0       # SPS profiling wall seconds (0: cached or given)
    cost_profile_seconds: float = 0.0  # t_d / t_plain profiling wall seconds (0: cached)

    @property
    def verify_seconds(self) -> np.ndarray:
        """t_v(B) = 1 / SPS(B)."""
        return 1.0 / np.maximum(np.asarray(self.sps, np.float64), 1e-12)

    @property
    def sps_draft(self) -> np.ndarray:
        """Drafting rounds per second at B tokens: 1 / (t_d + t_v(B))."""
        return policy.drafting_sps_table(self.verify_seconds, self.draft_seconds)

    @property
    def plain_sps(self) -> np.ndarray:
        """Plain rounds per second by active requests (`adaptive`'s choice on device)."""
        return (1.0 / np.maximum(self.plain_seconds, 1e-12)).astype(np.float32)


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


def engine_costs(eng: Any) -> EngineCosts:
    """The costs of engine `eng`: SPS given, profiled (the modes whose search reads it,
    `Mode.profiles_sps`) or flat; t_d and t_plain given or profiled (`adaptive` without a
    given SPS); with SPS given and no costs the drafter counts as free and a plain round as
    the verification step at n tokens (the paper's rule: always draft)."""
    st, buckets = eng.settings, eng.buckets
    bucket_seconds, took = None, 0.0
    if st.sps is not None:
        table, bucket_seconds = given_sps(st.sps, buckets)
    elif eng.mode.profiles_sps:
        bucket_seconds, took, cached = profile_buckets(eng)
        log.info("SPS over buckets %s: %s (%s)", buckets,
                 {b: f"{1 / t:.1f}/s" for b, t in bucket_seconds.items()},
                 "from cache" if cached else f"profiled in {took:.2f} s")
        table = sps_table(buckets, bucket_seconds)
    else:
        table = np.ones((buckets[-1] + 1,), np.float32)
    draft_s, plain_s, cost_took = st.draft_seconds, st.plain_seconds, 0.0
    if eng.mode.prices_drafting and st.sps is None and None in (draft_s, plain_s):
        measured, cost_took = profile_costs(eng, sps=table)
        draft_s = measured["draft"] if draft_s is None else draft_s
        plain_s = measured["plain"] if plain_s is None else plain_s
        log.info("adaptive costs: draft %.2f ms / round, plain step %.2f ms (%s)",
                 1e3 * draft_s, 1e3 * plain_s,
                 f"profiled in {cost_took:.2f} s" if cost_took else "from cache")
    verify_s = 1.0 / np.maximum(np.asarray(table, np.float64), 1e-12)
    n_plain = min(eng.R, len(verify_s) - 1) + 1
    plain = (np.full((n_plain,), float(plain_s)) if plain_s is not None
             else verify_s[:n_plain])
    return EngineCosts(sps=np.asarray(table, np.float32), draft_seconds=float(draft_s or 0.0),
                       plain_seconds=plain, bucket_seconds=bucket_seconds,
                       profile_seconds=took, cost_profile_seconds=cost_took)


# ------------------------------------------------------------------------------ profiled calls
def all_slots_active(eng: Any) -> round_.SlotSettings:
    """Settings of R running requests with room to the end of the cache (profiling)."""
    h = eng.host_arrays()
    h["active"][:] = True
    h["remaining"][:] = eng.max_len
    return eng.slot_settings(h)


def profile_steps(eng: Any) -> int:
    """Steps a profiled device call runs (verification per bucket, drafting): the costs are a
    step's share of the call, as inside the rounds' device loop, which runs up to
    `rounds_per_call` rounds a call without the call's dispatch and host sync (at one request
    on CPU these made a lone call ~1.4× a round of the loop)."""
    return min(4, eng.settings.rounds_per_call)


def _rewound(state: round_.EngineState) -> round_.EngineState:
    """The state with every slot's cache emptied again (a profiled call repeats)."""
    return state.replace(cache=state.cache.with_lengths(jnp.zeros_like(state.cache.lengths)))


def verify_step_fn(eng: Any, steps: int = 1) -> Callable[[int], Any]:
    """step_fn(K): `steps` verification steps with exactly K admitted tokens (all slots) in
    one device call (`speculative_round.verify_and_commit`)."""
    R, gamma = eng.R, eng.gamma
    slots = all_slots_active(eng)
    drafts = jnp.zeros((R, gamma), jnp.int32)
    probs = jnp.full((R, gamma, eng.V), 1.0 / eng.V, jnp.float32)
    holder = {"state": eng.fresh_state()}

    def step(capacity: int) -> Any:
        extra = capacity - R
        lengths = np.minimum(gamma, extra // R + (np.arange(R) < extra % R)).astype(np.int32)
        state, outputs = round_.verify_and_commit(
            eng.config, eng.arrays, holder["state"], slots, drafts, probs,
            jnp.asarray(lengths), capacity=capacity, steps=steps)
        holder["state"] = _rewound(state)
        return outputs.n_emit

    return step


def plain_rounds_fn(eng: Any) -> tuple[Callable[[int], Any], int]:
    """(step_fn(K), n): n rounds that skip drafting in one device call (`anchor_rounds`: the
    anchors alone verified in bucket K, the drafter's context still fed), as `adaptive`'s
    plain stretches run them; the cost of one is the call's time / n."""
    slots = all_slots_active(eng)
    n = max(1, min(eng.settings.plain_steps_per_call, eng.max_len - 1))
    arrays = eng.arrays.replace(stop_ids=jnp.full_like(eng.arrays.stop_ids, -1))
    holder = {"state": eng.fresh_state()}

    def step(capacity: int) -> Any:
        state, result = round_.anchor_rounds(eng.config, arrays, holder["state"], slots,
                                             jnp.asarray(n, jnp.int32),
                                             jnp.asarray(eng.R + 1, jnp.int32),
                                             capacity=capacity)
        holder["state"] = _rewound(state)
        return result.rounds

    return step, n


def draft_step_fn(eng: Any, steps: int = 1, arrays: Any = None) -> Callable[[int], Any]:
    """step_fn(_): one drafting + scheduling call, synchronised on what the host reads;
    `steps` > 1: that many in one device call (`speculative_round.draft_steps`). `arrays`:
    the engine's arrays to draft with (default `eng.arrays`)."""
    arrays = eng.arrays if arrays is None else arrays
    slots, state = all_slots_active(eng), eng.fresh_state()
    capacity = jnp.asarray(eng.R * eng.gamma, jnp.int32)

    def step(_: int) -> Any:
        if steps == 1:
            drafted = round_.draft_and_schedule(eng.config, arrays, state, slots, capacity)
            return drafted.n_tokens, drafted.capacity_new
        return round_.draft_steps(eng.config, arrays, state, slots, capacity, steps=steps)

    return step


def profile_key(eng: Any, **extra: Any) -> str:
    """Disk-cache key of a profile of engine `eng`: everything the timed calls depend on —
    device, target shapes and dtype, slots, max_len, buckets, the decoding layout, the verifier
    and the sampler, the drafter's shapes including its draft vocabulary (the verification
    step also feeds the drafter's context) and the draft tree's budget and branching (a tree's
    drafting call costs more than a chain's) — plus `extra`."""
    drafter = None
    if eng.draft is not None:
        dc = eng.draft.config
        drafter = {f: getattr(dc, f, None) for f in (
            "model_type", "num_drafts", "num_draft_layers", "markov_rank",
            "markov_head_type", "target_layer_ids", "draft_vocab_size", "layer_family",
            "hidden_size", "intermediate_size")}
    layout = "layer_buffers" if eng.step_target is not eng.target else "stacked"
    return cache_key(eng.target.config, eng.target.dtype, eng.R, eng.max_len, eng.buckets,
                     extra=dict(drafter=drafter, layout=layout, verifier=eng.settings.verifier,
                                sampler=eng.settings.sampler,
                                tree=(int(eng.settings.tree_budget),
                                      int(eng.settings.tree_branching)), **extra))


def profile_buckets(eng: Any, cache_dir: str | None = None, repeats: int | None = None
                    ) -> tuple[dict[int, float], float, bool]:
    """Seconds of the verification step per capacity bucket (the SPS profile: SPS(B) =
    1 / seconds of the smallest bucket ≥ B; a step's share of a device call of
    `profile_steps`), from the disk cache or profiled there (`load_or_profile`; `cache_dir`
    default: the engine's `sps_cache_dir`). → (seconds by bucket, profiling s, from cache)."""
    st, steps = eng.settings, profile_steps(eng)
    step = verify_step_fn(eng, steps)
    calls = {K: functools.partial(step, K) for K in eng.buckets}
    secs, took, cached = load_or_profile(
        profile_key(eng, steps=steps), st.sps_cache_dir if cache_dir is None else cache_dir,
        calls, repeats=st.profile_repeats if repeats is None else repeats)
    return {K: t / steps for K, t in secs.items()}, took, cached


def profile_costs(eng: Any, sps: np.ndarray | None = None) -> tuple[dict[str, float], float]:
    """The drafter's seconds per round (draft + schedule, all slots; `profile_steps` a device
    call) and a plain round's seconds (anchors only, smallest bucket, several a device call as
    `adaptive`'s plain stretches run them: `plain_rounds_fn`), profiled once like SPS and
    cached on disk next to it. `sps`: the SPS table the drafting call schedules with (default:
    the engine's). → ({"draft": t_d, "plain": t_plain}, profiling s (0 when cached))."""
    if eng.draft is None:
        raise ValueError("profile_costs needs a drafter (scheduler='none' has none)")
    steps, arrays = profile_steps(eng), eng.arrays
    if sps is not None:   # until t_d is known the drafting objective is SPS itself
        arrays = arrays.replace(sps=jnp.asarray(sps), sps_draft=jnp.asarray(sps))
    plain, n = plain_rounds_fn(eng)
    calls = {f"draft_{steps}_steps": functools.partial(draft_step_fn(eng, steps, arrays), 0),
             f"plain_{n}_rounds": functools.partial(plain, eng.buckets[0])}
    key = profile_key(eng, costs=True, mode=eng.mode.name, steps=steps)
    secs, took, _ = load_or_profile(key, eng.settings.sps_cache_dir, calls,
                                    repeats=eng.settings.profile_repeats)
    return {"draft": secs[f"draft_{steps}_steps"] / steps,
            "plain": secs[f"plain_{n}_rounds"] / n}, took
