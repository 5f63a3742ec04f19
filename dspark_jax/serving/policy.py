"""The host's per-round scheduling state of the §5.2 modes (paper §5.2; SPEC §8): the
`production` mode's capacity queue (`CapacityQueue`: the paper's schedule alone) and the
cost-aware drafting decision of the `adaptive` mode (`DraftPolicy`: the paper's schedule plus
our switch to plain decoding); the other drafting modes decide nothing across rounds
(`AlwaysDraft`). Each answers `decide(n_active)` → (draft?, K) before a round, says what a
device call of rounds carries (`device_schedule`) and replays the rounds the device ran
(`replay`): the `Policy` protocol, which the run loop (`serving.run_loop`) calls. Each
scheduler mode (`serving.modes`) makes its own from the engine's costs (`PolicyInputs`).

What the paper does (§5.2): the verification capacity K of round t is the global search's
argmax of Θ = τ · SPS(B) on the confidences of round t − 2, and round t admits the top-K of its
current candidates. Θ prices only the verification step: every round runs the drafter.

What we add, and why: a round that drafts pays the drafter (t_d) even when what it proposes is
never admitted or never accepted. With a weak drafter, or under load where the verification
step is compute-bound, such rounds lose to plain decoding (measured on CPU with a random
drafter; figures: `python -m dspark_jax.bench.load`). So before drafting, each round chooses between
  (a) plain decoding: ℓ = 0 for every request and the drafter is NOT run,
      Θ_a = n / t_plain                                     (n active requests);
  (b) drafting with capacity K: Θ_b = (n + ρ·G) / (t_d + t_v(n + K)),
where t_v(B) is the verification step of the capacity bucket holding B tokens (SPS profile),
t_plain the plain step and t_d the drafter's time per round (both profiled with SPS), and K and
G (the expected accepted drafts of the admitted top-K) come from the global search on the
confidences two rounds old with the drafting cost inside its objective: τ / (t_d + t_v(B))
instead of τ · SPS(B) (the drafter's fixed cost makes a larger K worth more). K and G are
carried to the current n (K capped at n·γ, G scaled by n / n_then). ρ is the ratio of realised
to predicted accepted drafts (an exponential average over drafting rounds, 1 at start): it keeps
miscalibrated confidences — a random drafter's σ(c) ≈ 0.5 — from buying rounds that never pay.
The round drafts iff Θ_b ≥ Θ_a (with t_d = 0 and t_plain = t_v(n) that always holds: the
paper's behaviour). The very first round, with no estimate, drafts as a probe (one draft
token per request, see below) — admitting everything there (the K = R(γ+1) bucket) costs
several plain rounds on the load bench for a drafter that turns out not to pay; the next
round, whose two-rounds-old estimate does not exist yet either, decodes plainly.

Probing: while (a) wins, no confidences arrive and the estimate goes stale, so a round drafts
anyway now and then as a probe. A probe admits at most one draft token per active request
(K = min(K*, n)): the drafter's confidences for every slot arrive whatever is admitted, and one
verified token per request keeps ρ current, so a probe costs t_d + t_v(2n) instead of the full
t_v(n(γ+1)). Its price over a plain round, t_d + t_v(2n) − t_plain, is paid from an exploration
budget that grows by `explore` · t_plain with every plain round: re-probing costs at most that
fraction of plain decoding time however long plain decoding keeps winning (a probe costs more
than a plain round, so probing at a fixed short interval loses clearly against `none`;
figures: `python -m dspark_jax.bench.load`). `probe_interval` is the least number of rounds
between probes (doubling at each probe up to `max_probe_interval`; a won decision resets it);
`explore=None` lifts the budget (probes by the interval alone). Only the very first round,
when nothing is known, probes for free (unless even a drafter whose every draft is accepted,
K = G = n·γ, could not pay: then the first probe waits for the budget too).

`production` (`CapacityQueue`) is the paper's rule taken literally: every round drafts and
admits the top K_{t−2} of its candidates, K_{t−2} the argmax of τ · SPS(B) over the global
admission path of round t − 2's confidences (the drafter's time priced nowhere, no ρ, no
probes). Its first two rounds, with no K yet, admit every candidate with a > 0 (K₀ = R·γ).
The queue starts over with every `Engine.generate` / `serve` call (two rounds old means two
rounds of the same run).

The adaptive state persists across `Engine.generate` calls (one policy per engine, like a
server that learns its drafter's acceptance once): ρ, the latest estimate (scaled to the
current load) and the budget carry over; `Engine.reset_policy()` forgets them.

Lossless: the choice uses only what earlier rounds produced (their confidences, acceptances and
the active set), never the current round's drafts, so each round's verification lengths are
fixed before its drafts are sampled and the speculative-sampling argument holds round by round
(the same reason the §5.2 stale K is lossless; Appendix A). A skipped round still commits its
token's target features to the drafter's context cache (`speculative_round.anchor_rounds`
feeds the drafter in every round), so the next drafting round sees the full committed context.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What one drafting round says about drafting two rounds later."""

    capacity: int      # K: draft tokens to admit (global search, drafting cost included)
    gain: float        # G: expected accepted drafts among those K
    n_active: int      # requests active when it was computed


def drafting_sps_table(verify_seconds: Sequence[float], draft_seconds: float) -> np.ndarray:
    """Rounds per second of a drafting round at B tokens: 1 / (t_d + t_v(B)), B = 0..top."""
    t = np.asarray(verify_seconds, np.float64)
    return (1.0 / np.maximum(t + float(draft_seconds), 1e-12)).astype(np.float32)


def plain_at(plain_seconds: float | np.ndarray, n_active: int) -> float:
    """t_plain at n active requests (a scalar, or [n] by active requests, clipped)."""
    t = np.asarray(plain_seconds, np.float64)
    return float(t[min(int(n_active), t.shape[0] - 1)] if t.ndim else t)


def plain_or_draft(n_active: int, est: Estimate, verify_seconds: np.ndarray,
                   draft_seconds: float, plain_seconds: float | np.ndarray, gamma: int,
                   ratio: float = 1.0) -> tuple[bool, float, float]:
    """The per-round choice of the module docstring. verify_seconds [B] (t_v by token count),
    plain_seconds a scalar or [n] (t_plain by active requests). → (draft?, Θ_a, Θ_b) in
    tokens/second."""
    n = int(n_active)
    theta_plain = n / max(plain_at(plain_seconds, n), 1e-12)
    k = min(int(est.capacity), n * int(gamma))
    gain = float(ratio) * float(est.gain) * n / max(int(est.n_active), 1)
    b = min(n + k, len(verify_seconds) - 1)
    theta_draft = (n + gain) / max(float(draft_seconds) + float(verify_seconds[b]), 1e-12)
    return bool(theta_draft >= theta_plain), float(theta_plain), float(theta_draft)


@dataclasses.dataclass(frozen=True, eq=False)
class PolicyInputs:
    """What a mode's policy is made from (`SchedulerMode.new_policy`): t_v by token count
    [B], t_d, t_plain (a scalar or [n] by active requests), γ (a tree: its nodes), the capacity
    K₀ before any estimate, and the probing settings (`EngineSettings`)."""

    verify_seconds: np.ndarray
    draft_seconds: float
    plain_seconds: float | np.ndarray
    gamma: int
    initial_capacity: int
    probe_interval: int = 4
    max_probe_interval: int = 64
    explore: float | None = 0.01


class Policy(Protocol):
    """A mode's per-round host state, as the run loop (`serving.run_loop.Run`) calls it.
    `persists`: one policy per engine, across runs (False: a fresh one every run)."""

    persists: bool

    def decide(self, n_active: int) -> tuple[bool, int]:
        """Before a round: → (draft?, capacity K to admit)."""
        ...

    def device_schedule(self, capacity: int) -> tuple[list[int], dict[str, Any] | None]:
        """What a device call of drafting rounds carries: (K of rounds t−2, t−1, the device
        drafting choice's state or None: every round drafts)."""
        ...

    def replay(self, first: bool, est: Estimate, predicted: float, realised: float) -> None:
        """Replays a drafting round the device ran (`first`: the call's first round)."""
        ...

    def update(self, drafted: bool, est: Estimate | None = None, predicted: float = 0.0,
               realised: float = 0.0) -> None:
        """After a round the host ran (`drafted` False: a round that skipped drafting)."""
        ...

    def plain_rounds(self, n_active: int, limit: int) -> int:
        """After `decide(n_active)` chose plain decoding: how many rounds in a row (≤ `limit`)
        it chooses plain decoding while `n_active` stays the same."""
        ...


class AlwaysDraft:
    """The modes that decide nothing across rounds (`fixed`, `threshold`, `algorithm1`): every
    round drafts, and the capacity they carry is unused."""

    persists = True

    def decide(self, n_active: int) -> tuple[bool, int]:
        return True, 0

    def device_schedule(self, capacity: int) -> tuple[list[int], dict[str, Any] | None]:
        """(capacities K of rounds t−2, t−1, the drafting choice's state or None) for a device
        call of rounds (`speculative_round.ScheduleState`)."""
        return [capacity, capacity], None

    def replay(self, first: bool, est: Estimate, predicted: float, realised: float) -> None:
        """Replays a drafting round the device ran (`first`: the call's first round)."""

    def update(self, drafted: bool, est: Estimate | None = None, predicted: float = 0.0,
               realised: float = 0.0) -> None:
        """Nothing carries across rounds."""

    def plain_rounds(self, n_active: int, limit: int) -> int:
        """`decide` never chooses plain decoding: one round."""
        return 1


class CapacityQueue:
    """The `production` mode's state (see the module docstring): the §5.2 capacities of the
    last two drafting rounds. `decide(n)` → (True, K_{t−2}); `update(...)` after the round
    (the same interface as `DraftPolicy`). `persists = False`: the engine makes a fresh queue
    for every run."""

    persists = False

    def __init__(self, initial_capacity: int):
        if int(initial_capacity) < 0:
            raise ValueError(f"initial_capacity must be ≥ 0, got {initial_capacity}")
        self.initial_capacity = int(initial_capacity)
        self.queue = [self.initial_capacity] * 2   # K of rounds t−2, t−1

    def decide(self, n_active: int) -> tuple[bool, int]:
        """Always drafts; admits the top K of round t − 2 (top-K admission caps it at the
        candidates there are)."""
        return True, self.queue[0]

    def update(self, drafted: bool, est: Estimate | None = None, predicted: float = 0.0,
               realised: float = 0.0) -> None:
        """After a round: its new capacity `est.capacity` enters the queue (every round
        drafts; a round without an estimate keeps the latest K)."""
        k = self.queue[1] if est is None else int(est.capacity)
        self.queue = [self.queue[1], k]

    def device_schedule(self, capacity: int) -> tuple[list[int], dict[str, Any] | None]:
        """The queue, which the device advances round by round (no choice: every round
        drafts)."""
        return list(self.queue), None

    def replay(self, first: bool, est: Estimate, predicted: float, realised: float) -> None:
        self.update(True, est, predicted, realised)

    def plain_rounds(self, n_active: int, limit: int) -> int:
        """`decide` never chooses plain decoding: one round."""
        return 1


class DraftPolicy:
    """State of the choice (see the module docstring): the two-round estimate queue, the probe
    spacing and budget, and the calibration ratio ρ. `decide(n)` → (draft?, capacity to admit);
    `update(...)` after the round. `persists = True`: one policy per engine, across runs."""

    persists = True

    def __init__(self, verify_seconds: np.ndarray, draft_seconds: float,
                 plain_seconds: float | np.ndarray, gamma: int, initial_capacity: int,
                 probe_interval: int = 4, max_probe_interval: int = 64,
                 ratio_decay: float = 0.8, explore: float | None = 0.01):
        if probe_interval < 1 or max_probe_interval < probe_interval:
            raise ValueError(f"probe_interval must be ≥ 1 and ≤ max_probe_interval, got "
                             f"{probe_interval} and {max_probe_interval}")
        if explore is not None and not 0.0 <= float(explore) <= 1.0:
            raise ValueError(f"explore must be in [0, 1] or None, got {explore}")
        self.t_v, self.t_d, self.t_plain = verify_seconds, float(draft_seconds), plain_seconds
        self.gamma, self.initial_capacity = int(gamma), int(initial_capacity)
        self.probe0, self.probe_max = int(probe_interval), int(max_probe_interval)
        self.interval, self.since_draft = self.probe0, 0
        self.explore = None if explore is None else float(explore)
        self.budget = 0.0            # seconds of probing that plain rounds have paid for
        self.started = False         # a round has been decided
        self.decay, self.pred, self.real = float(ratio_decay), 0.0, 0.0
        self.queue: list[Estimate | None] = [None, None]   # estimates of rounds t−2, t−1

    @property
    def ratio(self) -> float:
        """ρ: realised / predicted accepted drafts (exponential averages), 1 before any."""
        if self.pred <= 1e-9:
            return 1.0
        return float(min(self.real / self.pred, 4.0))

    def probe_cost(self, n_active: int, capacity: int) -> float:
        """A probe's seconds over a plain round: t_d + t_v(n + min(K, n)) − t_plain(n) ≥ 0."""
        n = int(n_active)
        b = min(n + min(int(capacity), n), len(self.t_v) - 1)
        return max(self.t_d + float(self.t_v[b]) - plain_at(self.t_plain, n), 0.0)

    def decide(self, n_active: int) -> tuple[bool, int]:
        est = self.queue[0]
        first, self.started = not self.started, True
        if est is None:   # nothing known yet: would a perfect drafter pay?
            best = Estimate(self.initial_capacity, float(self.initial_capacity), n_active)
            want, _, _ = plain_or_draft(n_active, best, self.t_v, self.t_d, self.t_plain,
                                        self.gamma)
            if want and first:   # the one free probe
                return True, min(self.initial_capacity, n_active)
            want, cap = False, self.initial_capacity
        else:
            want, _, _ = plain_or_draft(n_active, est, self.t_v, self.t_d, self.t_plain,
                                        self.gamma, self.ratio)
            cap = est.capacity
        if want:
            self.interval = self.probe0
            return True, cap
        cap = min(cap, n_active)
        cost = self.probe_cost(n_active, cap)
        if self.since_draft + 1 >= self.interval and (self.explore is None
                                                      or self.budget >= cost):
            self.interval = min(2 * self.interval, self.probe_max)
            if self.explore is not None:
                self.budget -= cost
            return True, cap
        if self.explore is not None:   # this plain round pays into the probing budget
            self.budget = min(self.budget + self.explore * plain_at(self.t_plain, n_active),
                              max(cost, self.budget))
        return False, 0

    def carried(self) -> tuple[list[int], list[float], list[int]]:
        """The estimate queue as the device loop carries it (`speculative_round.DraftChoice`):
        (K, G, requests active then) of rounds t−2, t−1, zeros for a missing estimate."""
        q = [e or Estimate(0, 0.0, 0) for e in self.queue]
        return ([int(e.capacity) for e in q], [float(e.gain) for e in q],
                [int(e.n_active) for e in q])

    def device_schedule(self, capacity: int) -> tuple[list[int], dict[str, Any] | None]:
        """This round's capacity and the estimate queue's K of round t − 1, with the state the
        device's choice reads (`speculative_round.DraftChoice`, less the plain step's table)."""
        ks, gains, n_then = self.carried()
        return [capacity, ks[1]], dict(gain=np.asarray(gains, np.float32),
                                       n_then=np.asarray(n_then, np.int32),
                                       predicted=np.float32(self.pred),
                                       realised=np.float32(self.real),
                                       decay=np.float32(self.decay))

    def replay(self, first: bool, est: Estimate, predicted: float, realised: float) -> None:
        """A drafting round of a device call: after the first, the device chose to draft."""
        if not first:
            self.drafted_on_device()
        self.update(True, est, predicted, realised)

    def drafted_on_device(self) -> None:
        """Replays a round after the first of a device call of drafting rounds, whose choice
        to draft the device made (`scheduler.drafting_pays`, this rule in float32): the state
        `decide` leaves when it chooses to draft (call `update` after it, as for any round)."""
        self.started = True
        self.interval = self.probe0

    def plain_rounds(self, n_active: int, limit: int) -> int:
        """After `decide(n_active)` chose plain decoding: how many rounds in a row, this one
        included (≤ `limit`), the policy chooses plain decoding while `n_active` stays the
        same. A plain round teaches it nothing (no confidences, no acceptances), so those
        choices are known now: the engine runs them in one device call, then replays them
        (`decide` and `update(False)` per round), which leaves the same state as deciding
        them one by one."""
        sim = copy.deepcopy(self)
        sim.update(False)
        k = 1
        while k < int(limit) and not sim.decide(n_active)[0]:
            sim.update(False)
            k += 1
        return k

    def update(self, drafted: bool, est: Estimate | None = None, predicted: float = 0.0,
               realised: float = 0.0) -> None:
        """After a round: a drafting round's new estimate and its predicted / realised accepted
        drafts; a skipped round carries the latest estimate forward (it only ages)."""
        if drafted:
            self.since_draft = 0
            if predicted > 0:
                self.pred = self.decay * self.pred + predicted
                self.real = self.decay * self.real + realised
        else:
            self.since_draft += 1
            est = self.queue[1]
        self.queue = [self.queue[1], est]
