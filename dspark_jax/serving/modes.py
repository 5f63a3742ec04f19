"""The scheduler modes (paper §3.2.2, §5.2, Appendix A; SPEC §8): each mode is one frozen,
hashable object that carries everything the engine asks of it —

* `schedule(...)`: the device step that picks every request's verification length ℓ_r from the
  round's confidences. The mode sits in the static `RoundConfig` (`RoundConfig.mode`), so the
  jitted round calls it directly;
* its traits: whether it drafts at all, reads the drafter's confidences, needs the SPS profile,
  prices the drafter (profiles t_d and t_plain), schedules draft trees, reads `threshold`;
* `new_policy(...)`: its per-round host state (`serving.policy.Policy`), or None.

The built-in modes (`BUILTIN_MODES`), by the name users pass (`EngineSettings.scheduler`):
"none" plain decoding; "fixed" all γ drafts (DeepSpec's evaluator); "threshold" DeepSpec's
static confidence cut; "algorithm1" the causal scheduler (`scheduler.schedule_verification`);
"production" the paper's §5.2 schedule alone (K from the global search of τ·SPS(B) on the
confidences of two rounds before, top-K admission of the current candidates, every round
drafts); "adaptive" the same schedule with the drafter's cost in the search's objective and the
drafting choice of `serving.policy.DraftPolicy` (a round may decode plainly instead).

A new mode is one subclass of `SchedulerMode` (decorated `@dataclasses.dataclass(frozen=True)`,
its parameters as fields): pass an instance as `EngineSettings(scheduler=mode)`; listed in
`BUILTIN_MODES` it is also known by its `name`. Modes are looked up by name once, where
settings arrive as strings (`scheduler_mode`); the object is passed on from there.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dspark_jax.decoding import scheduler as sched
from dspark_jax.serving.policy import (AlwaysDraft, CapacityQueue, DraftPolicy, Policy,
                                       PolicyInputs)

Lengths = tuple[jax.Array, jax.Array, jax.Array]


def _no_capacity(lengths: jax.Array) -> Lengths:
    """ℓ with no §5.2 capacity or gain for two rounds later (zeros)."""
    return (lengths.astype(jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))


@dataclasses.dataclass(frozen=True)
class SchedulerMode:
    """A scheduler mode (see the module docstring). Subclasses set `name`, the traits and
    `schedule`; `new_policy` defaults to `AlwaysDraft` (every round drafts, nothing carried
    across rounds)."""

    name: ClassVar[str] = ""
    drafts: ClassVar[bool] = True            # runs the drafter (every built-in but `none`)
    needs_confidence: ClassVar[bool] = False  # schedules on the drafter's confidences
    profiles_sps: ClassVar[bool] = False      # its search reads SPS(B), profiled unless given
    prices_drafting: ClassVar[bool] = False   # profiles t_d and t_plain; may skip drafting
    schedules_trees: ClassVar[bool] = True    # admits draft trees by the nodes' survival
    reads_threshold: ClassVar[bool] = False   # reads `EngineSettings.threshold`

    def schedule(self, conf: jax.Array, active: jax.Array, gamma: int, threshold: jax.Array,
                 sps: jax.Array, capacity: jax.Array, sps_draft: jax.Array | None = None
                 ) -> Lengths:
        """On device, inside the round: → (ℓ [R] int32 (0 for inactive rows), the capacity K
        for two rounds later, G its expected accepted drafts). conf [R, γ]: σ(c / T); active
        [R]; `capacity`: the K of two rounds before; sps / sps_draft [B]: SPS(B) and the
        drafting rounds per second 1 / (t_d + t_v(B)) (`serving.policy`)."""
        raise NotImplementedError(f"{type(self).__name__} defines no schedule")

    def new_policy(self, inputs: PolicyInputs) -> Policy | None:
        """A fresh per-round host state for this mode (None: no rounds to decide)."""
        del inputs
        return AlwaysDraft()

    def __str__(self) -> str:
        return self.name or type(self).__name__


@dataclasses.dataclass(frozen=True)
class Plain(SchedulerMode):
    """`none`: plain decoding, no drafter."""

    name = "none"
    drafts = False
    schedules_trees = False

    def schedule(self, conf: jax.Array, active: jax.Array, gamma: int, threshold: jax.Array,
                 sps: jax.Array, capacity: jax.Array, sps_draft: jax.Array | None = None
                 ) -> Lengths:
        return _no_capacity(jnp.zeros(active.shape, jnp.int32))

    def new_policy(self, inputs: PolicyInputs) -> Policy | None:
        return None


@dataclasses.dataclass(frozen=True)
class Fixed(SchedulerMode):
    """`fixed`: every active request verifies all γ drafts (DeepSpec's evaluator)."""

    name = "fixed"

    def schedule(self, conf: jax.Array, active: jax.Array, gamma: int, threshold: jax.Array,
                 sps: jax.Array, capacity: jax.Array, sps_draft: jax.Array | None = None
                 ) -> Lengths:
        return _no_capacity(jnp.where(active, gamma, 0))


@dataclasses.dataclass(frozen=True)
class Threshold(SchedulerMode):
    """`threshold`: DeepSpec's static cut, the first slot with σ(c) < t ends the proposal."""

    name = "threshold"
    needs_confidence = True
    schedules_trees = False   # a tree's nodes have no per-slot confidences to cut
    reads_threshold = True

    def schedule(self, conf: jax.Array, active: jax.Array, gamma: int, threshold: jax.Array,
                 sps: jax.Array, capacity: jax.Array, sps_draft: jax.Array | None = None
                 ) -> Lengths:
        keep = jnp.cumprod((conf >= threshold).astype(jnp.int32), axis=-1)
        return _no_capacity(jnp.where(active, jnp.sum(keep, axis=-1), 0))


@dataclasses.dataclass(frozen=True)
class Algorithm1(SchedulerMode):
    """`algorithm1`: the causal scheduler with early stop (Algorithm 1, Appendix A)."""

    name = "algorithm1"
    needs_confidence = True
    profiles_sps = True

    def schedule(self, conf: jax.Array, active: jax.Array, gamma: int, threshold: jax.Array,
                 sps: jax.Array, capacity: jax.Array, sps_draft: jax.Array | None = None
                 ) -> Lengths:
        return _no_capacity(sched.schedule_verification(conf, active, sps,
                                                        early_stop=True).lengths)


@dataclasses.dataclass(frozen=True)
class Production(SchedulerMode):
    """`production`: the paper's §5.2 schedule alone — admits the top `capacity` (K of two
    rounds before) current candidates, and searches the new K globally on τ·SPS(B); every
    round drafts (`CapacityQueue`: K₀ = R·γ until a K exists; a fresh queue every run)."""

    name = "production"
    needs_confidence = True
    profiles_sps = True

    def objective(self, sps: jax.Array, sps_draft: jax.Array | None) -> jax.Array:
        """The rate the global search maximises τ times: SPS(B)."""
        return sps

    def schedule(self, conf: jax.Array, active: jax.Array, gamma: int, threshold: jax.Array,
                 sps: jax.Array, capacity: jax.Array, sps_draft: jax.Array | None = None
                 ) -> Lengths:
        return sched.stale_capacity_schedule(conf, active, capacity, sps,
                                             self.objective(sps, sps_draft))

    def new_policy(self, inputs: PolicyInputs) -> Policy | None:
        return CapacityQueue(inputs.initial_capacity)


@dataclasses.dataclass(frozen=True)
class Adaptive(Production):
    """`adaptive`: `production`'s schedule with the drafter's cost in the search's objective
    (τ / (t_d + t_v(B))) and the cost-aware choice to skip drafting (`DraftPolicy`, whose
    state persists across runs)."""

    name = "adaptive"
    prices_drafting = True

    def objective(self, sps: jax.Array, sps_draft: jax.Array | None) -> jax.Array:
        """The drafting rounds per second 1 / (t_d + t_v(B)) (SPS(B) when not given)."""
        return sps if sps_draft is None else sps_draft

    def new_policy(self, inputs: PolicyInputs) -> Policy | None:
        return DraftPolicy(inputs.verify_seconds, inputs.draft_seconds, inputs.plain_seconds,
                           inputs.gamma, inputs.initial_capacity,
                           probe_interval=inputs.probe_interval,
                           max_probe_interval=inputs.max_probe_interval,
                           explore=inputs.explore)


BUILTIN_MODES: tuple[SchedulerMode, ...] = (Plain(), Fixed(), Threshold(), Algorithm1(),
                                            Production(), Adaptive())


def mode_names() -> tuple[str, ...]:
    """The built-in modes' names, in `BUILTIN_MODES` order (command lines' choices)."""
    return tuple(m.name for m in BUILTIN_MODES)


def scheduler_mode(value: str | SchedulerMode, field: str = "scheduler") -> SchedulerMode:
    """The mode a setting names: a built-in's name, or a `SchedulerMode` passed as is (it must
    hash: it is part of the round's static config). Raises ValueError naming `field` and the
    valid choices."""
    if isinstance(value, SchedulerMode):
        try:
            hash(value)
        except TypeError as e:
            raise ValueError(f"{field}: a scheduler mode must be hashable (a frozen "
                             f"dataclass), got {value!r}") from e
        return value
    for mode in BUILTIN_MODES:
        if mode.name == value:
            return mode
    raise ValueError(f"unknown {field} {value!r}; choose from {list(mode_names())}")
