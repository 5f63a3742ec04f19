"""The adaptive scheduler's cost-aware drafting choice (`serving.policy`): given the
verification step per bucket, the drafter's and the plain step's cost and the confidences, it
decodes plainly when drafting cannot pay and drafts when it does; the probe back-off and the
calibration ratio behave as documented."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.serving import policy
import scheduler_by_name as scheduler

R, G = 4, 3
TOP = R * (G + 1)
# verification step seconds by token count: flat up to R tokens, then growing linearly
T_V = np.asarray([1.0] * (R + 1) + [1.0 + 0.05 * (b - R) for b in range(R + 1, TOP + 1)])


def _estimate(conf: float, draft_s: float, active=(True,) * R) -> policy.Estimate:
    """K and G exactly as the engine's drafting round computes them (global search with the
    drafting cost in the objective)."""
    c = jnp.full((R, G), conf, jnp.float32)
    act = jnp.asarray(active)
    sps = jnp.asarray(1.0 / T_V, jnp.float32)
    sps_d = jnp.asarray(policy.drafting_sps_table(T_V, draft_s))
    _, k, gain = scheduler.schedule_lengths("adaptive", c, act, G, 0.5, sps,
                                            jnp.zeros((), jnp.int32), sps_d)
    return policy.Estimate(int(k), float(gain), int(sum(active)))


def test_plain_when_drafting_cannot_pay_draft_when_it_does():
    # near-zero confidences: nothing worth verifying, the drafter's cost is pure loss
    est = _estimate(1e-3, draft_s=0.2)
    assert est.capacity == 0
    want, th_plain, th_draft = policy.plain_or_draft(R, est, T_V, 0.2, 1.0, G)
    assert not want and th_draft < th_plain
    # confident drafts and a cheap drafter: drafting wins and K > 0
    est = _estimate(0.95, draft_s=0.2)
    assert est.capacity > 0 and est.gain > 0.5 * est.capacity
    want, th_plain, th_draft = policy.plain_or_draft(R, est, T_V, 0.2, 1.0, G)
    assert want and th_draft > th_plain
    # the same confidences with a drafter that costs more than it can ever gain
    est = _estimate(0.95, draft_s=20.0)
    assert not policy.plain_or_draft(R, est, T_V, 20.0, 1.0, G)[0]
    # a calibration ratio of 0 (drafts never accepted) makes drafting lose
    est = _estimate(0.95, draft_s=0.2)
    assert not policy.plain_or_draft(R, est, T_V, 0.2, 1.0, G, ratio=0.0)[0]
    # a free drafter with plain = verification at n tokens never loses (the paper's rule)
    assert policy.plain_or_draft(R, _estimate(1e-3, 0.0), T_V, 0.0, T_V, G)[0]


def test_cost_in_objective_admits_more():
    """The drafter's fixed cost makes larger capacities worth more than τ·SPS(B) says."""
    assert _estimate(0.6, draft_s=2.0).capacity > _estimate(0.6, draft_s=0.0).capacity


def test_estimate_scales_to_current_load():
    est = policy.Estimate(capacity=8, gain=4.0, n_active=4)
    # one request left: K capped at n·γ = 3, G scaled to 1 → Θ_b = 2 / (d + t_v(4))
    _, _, th = policy.plain_or_draft(1, est, T_V, 0.5, 1.0, G)
    assert th == pytest.approx(2.0 / (0.5 + T_V[4]))


def test_probe_backoff_and_reset():
    bad = policy.Estimate(capacity=0, gain=0.0, n_active=R)
    good = policy.Estimate(capacity=R * G, gain=R * G * 0.95, n_active=R)
    pol = policy.DraftPolicy(T_V, 0.2, 1.0, G, R * G, probe_interval=2, max_probe_interval=4,
                             explore=None)
    flags = []
    for _ in range(14):
        d, cap = pol.decide(R)
        flags.append(d)
        assert cap <= R   # probes (the first round's included) admit ≤ one token a request
        if len(flags) == 1:
            assert d and cap == R
        pol.update(d, bad if d else None, predicted=1.0, realised=1.0)
    # the unknown first round probes, the second (no two-rounds-old estimate) does not, then
    # probes after 2, 4, 4, ... rounds
    assert flags == [True, False, True, False, False, False, True, False, False, False,
                     True, False, False, False]
    # a probe that finds a good drafter is used two rounds later, and resets the interval
    d, _ = pol.decide(R)
    assert d   # the 4th round since the last draft: a probe
    pol.update(True, good, predicted=1.0, realised=1.0)
    d, _ = pol.decide(R)
    assert not d
    pol.update(False)
    d, cap = pol.decide(R)
    assert d and cap == R * G and pol.interval == 2


def test_probe_budget_bounds_probing_time():
    """With `explore` = ε, probes cost at most ε of the plain decoding time: a drafter that
    never pays is probed about every cost / (ε · t_plain) rounds, however many rounds run."""
    bad = policy.Estimate(capacity=0, gain=0.0, n_active=R)
    eps, t_d = 0.05, 0.2
    pol = policy.DraftPolicy(T_V, t_d, 1.0, G, R * G, probe_interval=1, max_probe_interval=1,
                             explore=eps)
    assert pol.probe_cost(R, R) == pytest.approx(t_d + T_V[2 * R] - 1.0)
    cost = pol.probe_cost(R, bad.capacity)   # K* = 0: a probe only drafts
    assert cost == pytest.approx(t_d)
    flags = []
    for _ in range(400):
        d, cap = pol.decide(R)
        flags.append(d)
        pol.update(d, bad if d else None)
    probes = sum(flags[1:])   # the first round's free probe aside
    plain = flags.count(False)
    assert probes * cost <= eps * plain * 1.0 + cost   # the budget holds (one probe of slack)
    assert probes >= int(eps * plain / cost) - 1        # and is spent: probing does not stop
    gaps = np.diff(np.nonzero(flags)[0][1:])
    assert gaps.min() >= int(cost / eps) - 1


def test_hopeless_drafter_decodes_plainly_from_the_start():
    """No estimate yet, but even all-accepted drafts cannot pay for this drafter: plain
    decoding from round 1, probes only (one draft token per request: a probe only refreshes the
    confidences and ρ); under the default budget such a drafter is almost never probed."""
    pol = policy.DraftPolicy(T_V, 100.0, 1.0, G, R * G, probe_interval=2, max_probe_interval=2,
                             explore=None)
    flags = []
    for _ in range(5):
        d, cap = pol.decide(R)
        flags.append(d)
        assert cap == (R if d else 0)
        pol.update(d, None)
    assert flags == [False, True, False, True, False]
    pol = policy.DraftPolicy(T_V, 100.0, 1.0, G, R * G)
    flags = []
    for _ in range(200):
        d, _ = pol.decide(R)
        flags.append(d)
        pol.update(d, None)
    assert not any(flags)   # 200 plain rounds at ε = 1% buy 2 s, a probe costs ~100 s


def test_ratio_tracks_realised_acceptance():
    pol = policy.DraftPolicy(T_V, 0.2, 1.0, G, R * G)
    assert pol.ratio == 1.0
    for _ in range(10):
        pol.update(True, None, predicted=2.0, realised=0.0)
    assert pol.ratio == 0.0
    with pytest.raises(ValueError, match="probe_interval"):
        policy.DraftPolicy(T_V, 0.2, 1.0, G, R * G, probe_interval=0)
    with pytest.raises(ValueError, match="explore"):
        policy.DraftPolicy(T_V, 0.2, 1.0, G, R * G, explore=1.5)


def test_production_queue_uses_the_capacity_of_two_rounds_before():
    """`production`'s state: every round drafts; rounds 1–2 admit K₀, round t the K that round
    t − 2 computed (an update without an estimate keeps the latest K)."""
    q = policy.CapacityQueue(R * G)
    assert not q.persists and policy.DraftPolicy.persists
    ks = [5, 0, 7, 2, 9]
    used = []
    for k in ks:
        d, cap = q.decide(R)
        assert d
        used.append(cap)
        q.update(True, policy.Estimate(k, 0.5 * k, R), predicted=1.0, realised=0.0)
    assert used == [R * G, R * G, *ks[:3]]
    q.update(True, None)
    assert q.queue == [ks[-1], ks[-1]]
    with pytest.raises(ValueError, match="initial_capacity"):
        policy.CapacityQueue(-1)


def test_production_never_decodes_plainly_where_adaptive_does():
    """Fed the same rounds — a drafter that costs more than it could ever gain, whose drafts are
    never accepted — `adaptive` decodes plainly in most rounds and `production` (the paper's
    schedule alone) drafts in every one, with the stale global-search K."""
    bad = _estimate(0.95, draft_s=0.0)   # τ·SPS(B) wants drafts (the paper's objective)
    assert bad.capacity > 0
    adaptive = policy.DraftPolicy(T_V, 100.0, 1.0, G, R * G, probe_interval=2,
                                  max_probe_interval=2, explore=None)
    production = policy.CapacityQueue(R * G)
    flags = {"adaptive": [], "production": []}
    for _ in range(12):
        for name, pol in (("adaptive", adaptive), ("production", production)):
            d, cap = pol.decide(R)
            flags[name].append(d)
            pol.update(d, bad if d else None, predicted=bad.gain, realised=0.0)
    assert flags["adaptive"].count(False) >= 6
    assert all(flags["production"])
    assert production.decide(R) == (True, bad.capacity)


def test_plain_rounds_known_ahead_equal_deciding_one_by_one():
    """`plain_rounds`: after a plain choice, the count of the plain choices that follow at the
    same load, known ahead (plain rounds teach the policy nothing), is exactly what deciding
    round by round gives; replaying them leaves the policy where one-by-one deciding does."""
    bad = policy.Estimate(capacity=0, gain=0.0, n_active=R)

    def fresh():
        pol = policy.DraftPolicy(T_V, 0.2, 1.0, G, R * G, probe_interval=1,
                                 max_probe_interval=1, explore=0.05)
        pol.update(*pol.decide(R)[:1], bad)   # the free probe: drafting does not pay
        return pol

    one, ahead = fresh(), fresh()
    flags = []   # one by one
    for _ in range(60):
        d, _ = one.decide(R)
        flags.append(d)
        one.update(d, bad if d else None)
    got = []     # ahead: runs of plain rounds counted first, then replayed
    while len(got) < 60:
        d, _ = ahead.decide(R)
        if d:
            got.append(True)
            ahead.update(True, bad)
            continue
        k = ahead.plain_rounds(R, min(16, 60 - len(got)))
        for i in range(k):
            if i:
                assert ahead.decide(R)[0] is False
            ahead.update(False)
        got += [False] * k
    assert got == flags and True in flags and flags.count(False) > 20
    assert vars(ahead).keys() == vars(one).keys()
    for key, val in vars(one).items():
        assert np.all(vars(ahead)[key] == val), key
    runs = [len(r) for r in "".join("d" if f else "p" for f in flags).split("d") if r]
    assert max(runs) > 1   # the stretches are longer than one round


def test_device_choice_is_the_host_rule():
    """`scheduler.drafting_pays` (the choice the device makes between a call's drafting rounds)
    agrees with `policy.plain_or_draft` on random estimates, loads, ratios and cost tables,
    away from ties, and declines without an estimate (n_then = 0)."""
    rng = np.random.default_rng(0)
    agree = 0
    for _ in range(300):
        n_max, g = int(rng.integers(1, 17)), int(rng.integers(1, 8))
        t_v = np.sort(rng.uniform(0.01, 0.2, n_max * (g + 1) + 1))
        t_d, ratio = float(rng.uniform(0, 0.05)), float(rng.uniform(0.1, 4.0))
        t_plain = rng.uniform(0.01, 0.1, n_max + 1)
        n, n_then = int(rng.integers(1, n_max + 1)), int(rng.integers(1, n_max + 1))
        est = policy.Estimate(int(rng.integers(0, n_then * g + 1)),
                              float(rng.uniform(0, n_then * g)), n_then)
        want, th_a, th_b = policy.plain_or_draft(n, est, t_v, t_d, t_plain, g, ratio)
        if abs(th_a - th_b) < 1e-4 * max(th_a, th_b):
            continue
        got = scheduler.drafting_pays(
            jnp.int32(est.capacity), jnp.float32(est.gain), jnp.int32(n_then), jnp.int32(n),
            jnp.float32(ratio), jnp.asarray(policy.drafting_sps_table(t_v, t_d)),
            jnp.asarray(1.0 / t_plain, jnp.float32), g)
        assert bool(got) == want, (n, est, ratio)
        agree += 1
    assert agree > 250
    assert not bool(scheduler.drafting_pays(jnp.int32(4), jnp.float32(9.0), jnp.int32(0),
                                            jnp.int32(2), jnp.float32(1.0),
                                            jnp.ones((9,), jnp.float32),
                                            jnp.full((3,), 1e-3, jnp.float32), 3))
