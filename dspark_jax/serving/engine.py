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
to a waiting request (`adaptive`: the host decides a call's first round, the device each later one,
and the call ends at the first round it would not draft; its stretches of plain rounds run up to
`plain_steps_per_call` a call, `speculative_round.anchor_rounds`). Each request keeps its own
temperature, top-k, top-p and seed. `sampler="pallas"` / `verifier="pallas"` run the Markov-head
sampling / verification Pallas kernels in place of their pure-JAX oracles where they are offered
(`decoding.pallas_backend`: the interpreter on CPU). SPS(B) for the scheduler is profiled at start
over the buckets (cached on disk) or passed in. `production` is the paper's §5.2 schedule alone:
every round drafts and admits the top K of its current candidates, K the argmax of τ · SPS(B) found
on the confidences of two rounds before (`serving.policy.CapacityQueue`). `adaptive` is that
schedule plus our switch: the engine also profiles the drafter's time per round and the plain step,
the search prices the drafter, and each round first chooses between plain decoding (drafter not
run) and drafting, whichever is expected to emit more tokens per second (`serving.policy`: the
rule, and why it is lossless).

`scheduler="none"` is plain decoding on the same slots (`decoding.plain_steps`): several one-token
steps per device call, back on the host only when a slot can be handed to a waiting request. The
caches grow to what the admitted requests need (`Engine.cache_lengths`). `serve` takes a stream of
requests whose replies may queue follow-ups (regeneration's conversation turns run on it). The
engine is built from one immutable `serving.engine_spec.EngineSpec` (settings, round config,
buckets, arrays, costs, state factories); the host side of one call (queue, admission, records, the
loop of device calls) is `serving.run_loop.Run`. Where the target's weights span several devices
(`load_target(mesh=...)`), the slots' caches are laid on their mesh and every program is traced
under it (`decoding.placement`): the programs `aot --decode --topology` compiles.
"""

from __future__ import annotations

import functools
from operator import attrgetter
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding import speculative_round as round_
from dspark_jax.decoding.round_types import EngineState, RoundConfig, SlotSettings
from dspark_jax.serving import cost_profile, policy
from dspark_jax.serving.engine_spec import (EngineSpec, bucket_for, decoding_models,
                                            engine_spec)
from dspark_jax.serving.records import HostSlots
from dspark_jax.serving.run_loop import EngineResult, Request, Run as _Run, requests_for
from dspark_jax.serving.settings import EngineSettings, with_fields
from dspark_jax.sharding import use_mesh


def _on_mesh(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` run with the engine's mesh active (`sharding.use_mesh`; none on one device),
    so the programs it traces keep the state's layout (`decoding.placement`) and run each
    kernel inside `shard_map` on its own slots and heads."""
    @functools.wraps(method)
    def run(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        with use_mesh(self.spec.mesh):
            return method(self, *args, **kwargs)
    return run


class Engine:
    """Continuous-batching speculative decoding engine (see module docstring).

    `Engine(target, draft, settings=EngineSettings(...))` (None: the defaults; what each field
    does: `EngineSettings`); the settings are validated before anything is built. Deprecated:
    `EngineSettings` fields as keywords, `Engine(target, draft, scheduler=...)`, which are
    folded into the settings with a `DeprecationWarning` (`settings.with_fields`).
    The adaptive policy's learned state persists across `generate` calls; `reset_policy()`
    forgets it. `production`'s two-rounds-old capacity queue starts over with every call.
    """

    def __init__(self, target: Any, draft: Any = None, *,
                 settings: EngineSettings | None = None, **fields: Any):
        settings = with_fields(settings, fields, caller="Engine")
        settings.validate().check_models(target, draft)
        self.target, self.draft = target, draft if settings.mode.drafts else None
        # prefill, decoding steps and verification run on the target in one layout, so the
        # engine holds the weights once
        self.step_target, step_draft = decoding_models(settings, target, self.draft)
        stops = getattr(target.tokenizer, "stop_token_ids", None) or target.config.stop_token_ids
        spec = engine_spec(settings, self.step_target, step_draft,
                           layer_buffers=self.step_target is not target, default_stops=stops)
        with use_mesh(spec.mesh):
            self.spec: EngineSpec = spec.with_costs(cost_profile.engine_costs(spec))
        self.cost_profile_seconds = self.spec.costs.cost_profile_seconds
        self.reached_buckets = 1   # buckets[:n] the rounds programs have been asked for
        self.prefill_shapes: dict[tuple[int, int], set[tuple[int, int]]] = {}   # compiled
        self.reset_policy()

    # the spec's values under the engine's names (`EngineSpec`)
    settings = property(attrgetter("spec.settings"))
    config = property(attrgetter("spec.config"))        # the round programs', every bucket
    arrays = property(attrgetter("spec.arrays"))        # what every round program reads
    costs = property(attrgetter("spec.costs"))          # what the schedule reads
    mode = property(attrgetter("spec.mode"))
    buckets = property(attrgetter("spec.buckets"))      # the verification capacities K
    R = property(attrgetter("spec.num_slots"))
    V = property(attrgetter("spec.vocab_size"))
    gamma = property(attrgetter("spec.gamma"))          # drafts a round (0: plain decoding)
    max_len = property(attrgetter("spec.max_len"))
    stop_ids = property(attrgetter("spec.arrays.stop_ids"))
    sps = property(attrgetter("spec.arrays.sps"))
    bucket_seconds = property(attrgetter("spec.costs.bucket_seconds"))
    profile_seconds = property(attrgetter("spec.costs.profile_seconds"))
    budget_rule = property(attrgetter("spec.config.budget_rule"))
    cap_to_budget = property(attrgetter("spec.config.cap_budget"))
    plain_steps_per_call = property(attrgetter("spec.config.plain_rounds_per_call"))
    rounds_per_call = property(attrgetter("spec.config.rounds_per_call"))

    # ------------------------------------------------------------------ state
    def fresh_state(self, cache_len: int | None = None) -> EngineState:
        """Empty slots (`EngineSpec.fresh_state`)."""
        return self.spec.fresh_state(cache_len)

    def grown(self, state: EngineState, cache_len: int) -> EngineState:
        """The state with room for `cache_len` positions (`EngineSpec.grown`)."""
        return self.spec.grown(state, cache_len)

    def cache_lengths(self) -> list[int]:
        """The cache lengths a run can grow through (`EngineSpec.cache_lengths`)."""
        return self.spec.cache_lengths()

    def cache_length_for(self, need: int) -> int:
        return self.spec.cache_length_for(need)

    def host_arrays(self) -> HostSlots:
        """The host's copy of `SlotSettings` for R empty slots."""
        return self.spec.empty_slots()

    def slot_settings(self, host: HostSlots) -> SlotSettings:
        return host.to_device()

    def check_prompt(self, i: Any, prompt: Sequence[int], max_new_tokens: int) -> None:
        self.spec.check_prompt(i, prompt, max_new_tokens)

    # ------------------------------------------------------------------ costs, policy
    @property
    def profile_steps(self) -> int:
        return cost_profile.profile_steps(self.spec)

    @_on_mesh
    def profile_buckets(self, cache_dir: str | None = None, repeats: int | None = None
                        ) -> tuple[dict[int, float], float, bool]:
        """The SPS profile's seconds per bucket (`cost_profile.profile_buckets`)."""
        return cost_profile.profile_buckets(self.spec, cache_dir, repeats)

    @_on_mesh
    def profile_costs(self) -> dict[str, float]:
        """The drafter's and a plain round's seconds (`cost_profile.profile_costs`); also sets
        `cost_profile_seconds` (0 when cached)."""
        costs, self.cost_profile_seconds = cost_profile.profile_costs(self.spec)
        return costs

    def new_policy(self) -> policy.Policy | None:
        """A fresh per-round scheduling state for this mode (`SchedulerMode.new_policy`): the
        adaptive drafting choice, `production`'s capacity queue (K₀ = R·γ: every candidate
        until a K exists), `AlwaysDraft` for the modes that decide nothing across rounds, or
        None (`none`)."""
        return self.spec.mode.new_policy(self.spec.policy_inputs())

    def reset_policy(self) -> None:
        """Forgets what the adaptive policy learned (ρ, estimates, probe budget): the next
        `generate` starts as a new engine does. `production`'s queue starts over with every
        run anyway; the other modes learn nothing."""
        self.policy = self.new_policy()

    def rounds_config(self, max_active: int | None = None) -> RoundConfig:
        """The config of the drafting rounds' program (`speculative_rounds`) for a call that
        never holds more than `max_active` requests at once (None: R): its capacity buckets
        stop at the last such a call can reach (`EngineSpec.buckets_reached`), so it compiles
        no verification branch it cannot reach. The buckets an earlier call reached (after
        `warmup`: all) stay, so a run of calls compiles at most one rounds program per bucket
        and a call never recompiles for fewer requests."""
        self.reached_buckets = max(self.reached_buckets, self.spec.buckets_reached(max_active))
        return self.spec.config_through(self.reached_buckets)

    # ------------------------------------------------------------------ warm-up
    @_on_mesh
    def warmup(self, max_tokens: int | None = None) -> None:
        """Compiles the programs the engine runs: the verification step of every bucket (what
        profiling times), then, at every cache length a run can grow to (`cache_lengths`) up to
        the one that `max_tokens` (the longest prompt + max_new_tokens to be served; default: up
        to max_len) needs, the rounds (and for `adaptive` the plain stretches at each bucket a
        load needs) and a one-prompt prefill, so growing the cache compiles no round program."""
        spec = self.spec
        self.reached_buckets = len(spec.buckets)   # every bucket: no call compiles again
        step = cost_profile.verify_step_fn(spec)
        for K in spec.buckets:
            jax.block_until_ready(step(K))
        top = spec.cache_length_for(spec.max_len if max_tokens is None
                                    else int(max_tokens) + 1 + spec.gamma)
        one = jnp.asarray(1, jnp.int32)
        anchor_buckets = sorted({bucket_for(spec.buckets, r) for r in range(1, self.R + 1)})
        for n in [n for n in spec.cache_lengths() if n <= top]:
            if spec.mode.prices_drafting:   # plain stretches at each bucket a load needs
                for K in anchor_buckets:
                    jax.block_until_ready(round_.anchor_rounds(
                        spec.config, spec.arrays, spec.fresh_state(n),
                        cost_profile.all_slots_active(spec), one, one, capacity=K)[1])
                self._warm_device_choice(n)
            # a prompt whose request needs exactly n positions (prompt + 2 + γ + 1)
            self.generate([[0] * max(1, n - 3 - spec.gamma)], max_new_tokens=2)
        self.reset_policy()   # dummy requests teach the policy nothing

    def _warm_device_choice(self, cache_len: int, rounds: int = 3) -> int:
        """Runs `adaptive`'s drafting call through `rounds` rounds whose choice to draft the
        device makes (a dummy state; a choice whose estimate always pays) → the rounds run.
        The one-prompt warm-up generate only ever runs a call's first round; without this, the
        first call that goes on drafting on device pays a one-off cost, once per engine, inside
        the first timed pass (`python -m dspark_jax.bench.load`;
        docs/benchmark-log/serving-2026-12-04.md)."""
        spec = self.spec
        R, top = spec.num_slots, spec.num_slots * spec.per_request
        choice = dict(gain=np.full((2,), top, np.float32), n_then=np.full((2,), R, np.int32),
                      predicted=np.float32(0), realised=np.float32(0), decay=np.float32(0.9))
        schedule = spec.schedule_state([top, top], choice,
                                       plain_sps=np.zeros_like(spec.costs.plain_sps))
        _, result = round_.speculative_rounds(
            spec.config, spec.arrays, spec.fresh_state(cache_len),
            cost_profile.all_slots_active(spec), schedule, jnp.asarray(rounds, jnp.int32),
            jnp.asarray(R + 1, jnp.int32))
        return int(jax.device_get(result.rounds))

    # ------------------------------------------------------------------ generate
    @_on_mesh
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 temperature: Any = 0.0, seed: Any = 0, arrivals: Sequence[float] | None = None,
                 top_k: Any = 0, top_p: Any = 1.0, progress: bool = False) -> EngineResult:
        """Decodes every prompt (token-id lists); temperature/top_k/top_p/seed may be one value
        or one per prompt; `arrivals` [s after the call] delays each request's join.
        `progress`: a tqdm bar of the emitted tokens (out of prompts × max_new_tokens)."""
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        reqs = requests_for(prompts, temperature, seed, arrivals, top_k, top_p)
        n = len(reqs)
        run = _Run(self, max_new_tokens, progress=progress, total=n * max_new_tokens,
                   max_active=n)
        for i in sorted(range(n), key=lambda i: (reqs[i].arrival_s, i)):
            run.add(reqs[i], i)
        return run.loop()

    @_on_mesh
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
