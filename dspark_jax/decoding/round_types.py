"""The speculative round's state, settings and outputs (paper §2, §3.2.2, §5.2–5.3; SPEC §1,
§8, §9): one static `RoundConfig`, the per-engine arrays (`EngineArrays`), the device state of
the request slots (`EngineState`) with what the host sets per slot (`SlotSettings`), and the
typed outputs of each part of a round — drafting (`DraftOutputs`), verification (`RoundOutputs`,
`CommitWrites`) and whole device calls of rounds (`RoundRecord`, `PackedRecords`,
`RoundsResult`).

A round program is a pure function of these, state in and state out, as Gemma's sampling loop
(`gm/text/_sampler_loop.py`): static settings in a frozen, hashable config passed as a static
jit argument, everything else a pytree.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.scheduler import RoundScheduler
from dspark_jax.decoding.tree import DEFAULT_BRANCHING
from dspark_jax.models.decoder import KVCache

# how a request's token budget ends it (`emission.finished`): "serving" once it has emitted its
# budget; "deepspec" DeepSpec's `while start < max_length`
BUDGET_RULES = ("serving", "deepspec")
# Markov-head samplers by name (explicit uniforms): "jax" is the model's own per-slot scan
SAMPLERS = ("jax", "pallas")


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """Static settings of the round programs (a static jit argument: frozen and hashable).

    `mode`: the scheduler mode, whose `schedule` picks the verification lengths on device
    (`scheduler.RoundScheduler`; the modes: `serving.modes`); `verifier`: the acceptance
    rule by name (`acceptance_rule.VERIFIERS`); `sampler`: the Markov-head sampler (`SAMPLERS`);
    `budget_rule`: `BUDGET_RULES`; `cap_budget`: never verify drafts past a request's token
    budget (off: DeepSpec's protocol, always γ); `tap_layer_ids`: the target layers whose
    features feed the drafter; `buckets`: the verification capacities K (ascending);
    `rounds_per_call` / `plain_rounds_per_call`: the most drafting rounds / rounds that skip
    drafting one device call runs; `tree_budget`: draft trees of that many nodes
    (`decoding.tree`; 0: the chain of γ drafts) with `tree_branching` children a node at
    most."""

    mode: RoundScheduler | None = None
    verifier: str = "jax"
    sampler: str = "jax"
    budget_rule: str = "serving"
    cap_budget: bool = True
    tap_layer_ids: tuple[int, ...] = ()
    buckets: tuple[int, ...] = ()
    rounds_per_call: int = 8
    plain_rounds_per_call: int = 16
    tree_budget: int = 0
    tree_branching: int = DEFAULT_BRANCHING

    def __post_init__(self) -> None:
        if self.budget_rule not in BUDGET_RULES:
            raise ValueError(f"unknown budget_rule {self.budget_rule!r}; choose from "
                             f"{list(BUDGET_RULES)}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; choose from {list(SAMPLERS)}")
        if self.tree_budget < 0 or self.tree_branching < 1:
            raise ValueError(f"tree_budget must be ≥ 0 and tree_branching ≥ 1, got "
                             f"{self.tree_budget} and {self.tree_branching}")


@flax.struct.dataclass
class EngineArrays:
    """What every round program of one engine reads and never changes: the target and the
    drafter (graph definitions static, states as arrays), the stop ids, the scheduler's inputs
    and the draft vocabulary's weight rows (gathered once: `DraftAdapter.vocab_weights`)."""

    target_graphdef: Any = flax.struct.field(pytree_node=False)
    draft_graphdef: Any = flax.struct.field(pytree_node=False)
    target_state: Any
    draft_state: Any
    stop_ids: jax.Array                          # [n + 1] int32, padded with −1
    confidence_temperatures: jax.Array | None    # [γ] f32 (None: uncalibrated)
    threshold: jax.Array                         # () f32: `threshold` mode's cut
    sps: jax.Array                               # [B + 1] f32: SPS(B)
    sps_draft: jax.Array                         # [B + 1] f32: drafting rounds/s at B tokens
    vocab_weights: Any = None


@flax.struct.dataclass
class EngineState:
    """Device state of the request slots (what the host sets per slot: `SlotSettings`)."""

    cache: KVCache        # target K/V [L, R, S]; lengths[r] = committed tokens = anchor position
    draft_cache: Any      # drafter context cache (None with scheduler "none")
    anchor: jax.Array     # [R] last committed token, not yet in the target cache


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


@flax.struct.dataclass
class DraftChoice:
    """The `adaptive` mode's drafting choice carried through a device call of rounds
    (`speculative_rounds`; the host's `serving.policy.DraftPolicy` holds the same state between
    calls): the gains of the two rounds' estimates before (their K and requests active then in
    `ScheduleState`), the calibration averages and the tables the choice compares
    (`scheduler.drafting_pays`). The gains and averages are one array, so a round's update is
    one kernel on a GPU where each would take its own."""

    values: jax.Array      # [4] f32: G of the estimates of rounds t−2, t−1; the exponential
    #                        averages of predicted and of realised accepted drafts
    decay: jax.Array       # () f32: the averages' decay per drafting round
    plain_sps: jax.Array   # [n + 1] f32: plain rounds per second by active requests

    @classmethod
    def of(cls, gain: Any, predicted: Any, realised: Any, decay: Any, plain_sps: Any
           ) -> "DraftChoice":
        """The choice from its parts: gain [2], predicted, realised, decay (), plain_sps."""
        values = jnp.concatenate([jnp.asarray(gain, jnp.float32).reshape(2),
                                  jnp.asarray([predicted, realised], jnp.float32)])
        return cls(values=values, decay=jnp.asarray(decay, jnp.float32),
                   plain_sps=jnp.asarray(plain_sps, jnp.float32))

    @property
    def gain(self) -> jax.Array:
        """[2] f32: G of the estimates of rounds t−2, t−1."""
        return self.values[:2]

    @property
    def predicted(self) -> jax.Array:
        """() f32: the exponential average of predicted accepted drafts."""
        return self.values[2]

    @property
    def realised(self) -> jax.Array:
        """() f32: the exponential average of realised accepted drafts."""
        return self.values[3]

    def ratio(self) -> jax.Array:
        """ρ = realised / predicted (capped at 4), 1 before any prediction."""
        return jnp.where(self.predicted > 1e-9,
                         jnp.minimum(self.realised / jnp.maximum(self.predicted, 1e-9), 4.0),
                         1.0)

    def after_round(self, gain: jax.Array, predicted: jax.Array, realised: jax.Array
                    ) -> "DraftChoice":
        """After a drafting round: its estimate's gain enters the queue, the averages move
        (when it predicted anything), as `DraftPolicy.update(True, …)` does."""
        moved = predicted > 0
        return self.replace(values=jnp.stack([
            self.values[1], gain.astype(jnp.float32),
            jnp.where(moved, self.decay * self.predicted + predicted, self.predicted),
            jnp.where(moved, self.decay * self.realised + realised, self.realised)]))


@flax.struct.dataclass
class ScheduleState:
    """What the schedule carries from round to round (paper §5.2): the capacities K of rounds
    t−2 and t−1 (`production` and `adaptive` admit the top K_{t−2}; the other modes read
    `capacities[0]` as their `capacity`) with the requests active when each was estimated
    (`adaptive`'s choice scales by them; 0: none, the loop then returns to the host), one
    array, so a round's update is one kernel on a GPU; and under `adaptive` the drafting
    choice (None: every round drafts)."""

    queue: jax.Array                   # [4] int32: K of rounds t−2, t−1; requests then
    choice: DraftChoice | None = None

    @classmethod
    def of(cls, capacities: Any, n_then: Any = (0, 0), choice: DraftChoice | None = None
           ) -> "ScheduleState":
        """The state from the capacities [2] and the requests active then [2]."""
        return cls(queue=jnp.concatenate([jnp.asarray(capacities, jnp.int32).reshape(2),
                                          jnp.asarray(n_then, jnp.int32).reshape(2)]),
                   choice=choice)

    @property
    def capacities(self) -> jax.Array:
        """[2] int32: K of rounds t−2, t−1."""
        return self.queue[:2]

    @property
    def n_then(self) -> jax.Array:
        """[2] int32: the requests active when each was estimated."""
        return self.queue[2:]

    def after_round(self, record: "ScheduleRecord", active: jax.Array,
                    realised: jax.Array) -> "ScheduleState":
        """After a drafting round (`active`: the slots that ran it; `realised`: its accepted
        drafts): its K and the requests active enter the queue, and the choice learns its
        estimate's gain and its predicted / realised accepted drafts."""
        queue = jnp.stack([self.queue[1], record.capacity_new.astype(jnp.int32),
                           self.queue[3], jnp.sum(active.astype(jnp.int32))])
        choice = self.choice
        if choice is not None:
            choice = choice.after_round(record.gain_new, record.predicted, realised)
        return ScheduleState(queue=queue, choice=choice)


@flax.struct.dataclass
class DraftOutputs:
    """One drafting + scheduling step (`draft_and_schedule`)."""

    tokens: jax.Array        # [R, γ] drafted tokens (a tree's: its chain)
    probs: jax.Array | None  # [R, γ, V] the drafter's distributions p_d (a tree: None)
    confidence: jax.Array    # [R, γ] confidence logits (zeros without a confidence head)
    lengths: jax.Array       # [R] int32 ℓ_r: drafts (a tree: nodes) admitted to verification
    n_tokens: jax.Array      # () int32 Σ_active(1 + ℓ_r)
    capacity_new: jax.Array  # () int32 K for two rounds later (production / adaptive)
    gain_new: jax.Array      # () f32 G: expected accepted drafts among those K
    predicted: jax.Array     # () f32 expected accepted drafts of what is admitted
    tree: Any = None         # the draft trees (`decoding.tree.DraftTree`) or None
    draft_cache: Any = None  # the drafter's cache as drafting left it, to carry on with (None:
    #                          drafting did not write it)


@flax.struct.dataclass(kw_only=True)
class RoundOutputs:
    """Per slot, what one verification emitted, and DeepSpec's bookkeeping (SPEC §1 step 6).

    A device call of plain decoding steps (`plain_steps`) returns its steps' outputs together:
    tokens [R, steps] (−1 past n_emit), no drafts (`accepted`, `proposed` None) and as τ term
    the steps each slot ran, each a round of acceptance length 1."""

    tokens: jax.Array     # [R, γ+1] accepted drafts then the correction / bonus (first n_emit)
    n_emit: jax.Array     # [R] int32 tokens emitted (cut after a stop token, at the budget)
    finished: jax.Array   # [R] bool: the request ends with this round
    accepted: jax.Array | None = None   # [R] int32 accepted drafts as recorded (plain: None)
    proposed: jax.Array | None = None   # [R] int32 verified drafts as recorded (plain: None)
    tau_term: jax.Array   # [R] int32 the round's acceptance length (τ term)


@flax.struct.dataclass
class CommitWrites:
    """What a verification writes, applied by `verification.commit`: the flattened tokens'
    places (token axis padded to the call's widest bucket; padding writes nothing), their K/V
    rows (or the cache a forward wrote itself) and the drafter's features, and per slot the
    committed count and next anchor."""

    slot: jax.Array          # [W] request of each flattened token
    positions: jax.Array     # [W] its cache position
    write_rows: jax.Array    # [W] row its K/V is written to (R: dropped)
    commit_valid: jax.Array  # [W] bool: committed (anchor or accepted draft of a live slot)
    dense_index: jax.Array   # [R, γ+1] flattened index of each request's cells
    n_commit: jax.Array      # [R] int32 tokens committed (0 for inactive slots)
    tokens: jax.Array        # [R, γ+1] the round's tokens (`RoundOutputs.tokens`)
    next_anchor: jax.Array   # [R] the correction / bonus token: the next anchor
    taps: jax.Array | None   # [W, n·D] target features for the drafter
    cache: KVCache | None = None   # the cache, when the forward wrote it itself
    new_kv: Any = None             # else the K/V rows [L, W, Kh, H] still to write (stacked
                                   # or layer groups, `layers.cache_like`)


@flax.struct.dataclass
class ScheduleRecord:
    """What the schedule of one drafting round decided (host bookkeeping and the policy)."""

    admitted: jax.Array      # () int32 the capacity K the round admitted (capacities[0])
    lengths: jax.Array       # [R] int32 ℓ_r
    confidence: jax.Array    # [R, γ] confidence logits
    capacity: jax.Array      # () int32 the verification bucket that ran
    n_tokens: jax.Array      # () int32 Σ_active(1 + ℓ_r)
    capacity_new: jax.Array  # () int32
    gain_new: jax.Array      # () f32
    predicted: jax.Array     # () f32


@flax.struct.dataclass
class RoundRecord:
    """One round of a device call: the slots that ran it, what it emitted and (drafting
    rounds) what its schedule decided. Stacked over a call's rounds in `RoundsResult`."""

    live: jax.Array                        # [R] bool
    outputs: RoundOutputs
    schedule: ScheduleRecord | None = None

    @classmethod
    def zeros(cls, rounds: int, num_slots: int, num_drafts: int, width: int,
              scheduled: bool) -> "RoundRecord":
        """Records of `rounds` rounds, all zeros: a call's records before its rounds fill them
        (tokens [R, `width`] a round; `scheduled`: with the drafting rounds' `schedule`)."""
        def z(*shape: int, dtype: Any = jnp.int32) -> jax.Array:
            return jnp.zeros((rounds, *shape), dtype)

        R = num_slots
        outputs = RoundOutputs(tokens=z(R, width), n_emit=z(R), finished=z(R, dtype=bool),
                               accepted=z(R), proposed=z(R), tau_term=z(R))
        schedule = None
        if scheduled:
            schedule = ScheduleRecord(
                admitted=z(), lengths=z(R), confidence=z(R, num_drafts, dtype=jnp.float32),
                capacity=z(), n_tokens=z(), capacity_new=z(), gain_new=z(dtype=jnp.float32),
                predicted=z(dtype=jnp.float32))
        return cls(live=z(R, dtype=bool), outputs=outputs, schedule=schedule)


@flax.struct.dataclass
class PackedRecords:
    """A call's round records as one int32 buffer [rounds, F]: the int fields as they are (the
    bool fields as 0 / 1), the float32 fields by their bits. A round stores its record as one
    row, one in-place update (and one buffer to zero per call) where a field at a time takes
    one kernel a field; `unpack` gives the stacked `RoundRecord` back, on the host (numpy) or
    on device. `layout`: the record's tree and, per field, its shape in a round, dtype, whether
    its numbers are floats and its first column."""

    data: jax.Array                        # [rounds, F] int32
    layout: tuple = flax.struct.field(pytree_node=False)

    @classmethod
    def for_rounds(cls, rounds: int, num_slots: int, num_drafts: int, width: int,
                   scheduled: bool) -> "PackedRecords":
        """Zero records of `rounds` rounds shaped as `RoundRecord.zeros` (same arguments)."""
        return cls.zeros(jax.eval_shape(lambda: RoundRecord.zeros(
            rounds, num_slots, num_drafts, width, scheduled)))

    @classmethod
    def zeros(cls, stacked: RoundRecord) -> "PackedRecords":
        """Zero buffers for records shaped as `stacked` (arrays or ShapeDtypeStructs
        [rounds, …], e.g. `jax.eval_shape` of `RoundRecord.zeros`)."""
        leaves, treedef = jax.tree.flatten(stacked)
        fields, width = [], 0
        for leaf in leaves:
            floating = bool(jnp.issubdtype(leaf.dtype, jnp.floating))
            fields.append((tuple(leaf.shape[1:]), jnp.dtype(leaf.dtype), floating, width))
            width += math.prod(leaf.shape[1:])
        rounds = leaves[0].shape[0]
        return cls(data=jnp.zeros((rounds, width), jnp.int32), layout=(treedef, tuple(fields)))

    @property
    def rounds(self) -> int:
        """The most rounds the records hold."""
        return self.data.shape[0]

    def set(self, i: jax.Array, record: RoundRecord) -> "PackedRecords":
        """The records with round `i`'s row set to `record` (one round's fields)."""
        leaves, tree = jax.tree.flatten(record)
        if tree != self.layout[0]:
            raise ValueError(f"a round's record {tree} is not shaped as the records "
                             f"{self.layout[0]}")
        row = [jax.lax.bitcast_convert_type(jnp.ravel(leaf).astype(jnp.float32), jnp.int32)
               if floating else jnp.ravel(leaf).astype(jnp.int32)
               for leaf, (_, _, floating, _) in zip(leaves, self.layout[1])]
        return self.replace(data=self.data.at[i].set(jnp.concatenate(row)))

    def unpack(self) -> RoundRecord:
        """The stacked `RoundRecord` [rounds, …] (numpy where the buffer is)."""
        treedef, fields = self.layout
        on_host = isinstance(self.data, np.ndarray)

        def field(shape: tuple, dtype: Any, floating: bool, first: int) -> Any:
            x = self.data[:, first:first + math.prod(shape)]
            if floating:
                x = (x.view(np.float32) if on_host
                     else jax.lax.bitcast_convert_type(x, jnp.float32))
            return x.reshape(self.rounds, *shape).astype(dtype)

        return jax.tree.unflatten(treedef, [field(*f) for f in fields])


@flax.struct.dataclass
class RoundsResult:
    """A device call of rounds: its records (`packed`; leading axis: the call's most rounds;
    entries past `rounds` are fill), how many rounds ran, the schedule it ends with and the
    slots as its rounds left them (budgets, round counters, liveness: the call takes the slots
    and the schedule donated and returns them, so its loop advances them in place)."""

    packed: PackedRecords
    rounds: jax.Array                      # () int32
    schedule: ScheduleState | None = None
    slots: SlotSettings | None = None      # as the rounds left them (budget, counter, liveness)

    @property
    def records(self) -> RoundRecord:
        """The call's records, stacked over its rounds."""
        return self.packed.unpack()
