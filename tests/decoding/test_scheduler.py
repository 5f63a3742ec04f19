"""Tests for dspark_jax.decoding.scheduler (paper Algorithm 1, §5.2, Appendix A)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.scheduler import (
    global_capacity,
    init_capacity_queue,
    production_schedule,
    schedule_verification,
    topk_admission,
)
from scheduler_oracles import schedule_verification_reference, topk_admission_reference

# ------------------------------------------------------------------------------------------
# Appendix A counterexample
# ------------------------------------------------------------------------------------------

P_T = np.array([0.7, 0.3])  # target distribution over {A, B}
P_D = np.array([0.5, 0.5])  # draft distribution
C2_GIVEN_X1 = {0: 0.9, 1: 0.0}  # x1 = A -> confident continuation, x1 = B -> c2 = 0
SPS_A = np.array([0.0, 1.0, 0.5, 0.45], np.float32)  # SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45


def _output_distribution(length_of_x1) -> np.ndarray:
    """Exact distribution of the first committed token, enumerating the draft x1 in {A, B}.

    If x1 is verified (l >= 1) the standard rule applies: accept with min(1, p_t/p_d), otherwise
    resample from norm(max(p_t - p_d, 0)).  If l = 0 the target samples the token from p_t.
    """
    out = np.zeros(2)
    resid = np.maximum(P_T - P_D, 0.0)
    resid = resid / resid.sum() if resid.sum() > 1e-8 else P_T
    for x1 in range(2):
        if length_of_x1(x1) >= 1:
            alpha = min(1.0, P_T[x1] / P_D[x1])
            out[x1] += P_D[x1] * alpha
            out += P_D[x1] * (1.0 - alpha) * resid
        else:
            out += P_D[x1] * P_T
    return out


def _appendix_conf(x1: int) -> np.ndarray:
    a1 = float(np.minimum(P_T, P_D).sum())  # 0.8, the standard acceptance probability
    return np.array([[a1, C2_GIVEN_X1[x1]]], np.float32)


def test_appendix_a_enumeration_is_lossless_for_fixed_length() -> None:
    # Sanity of the enumeration itself: any length chosen independently of x1 is lossless.
    assert np.allclose(_output_distribution(lambda x1: 1), P_T)
    assert np.allclose(_output_distribution(lambda x1: 0), P_T)


def test_appendix_a_global_search_is_biased() -> None:
    active = np.array([True])
    lengths = {}
    for x1 in range(2):
        res = schedule_verification(_appendix_conf(x1), active, SPS_A, early_stop=False)
        lengths[x1] = int(res.lengths[0])
        ref, _ = schedule_verification_reference(_appendix_conf(x1), active, SPS_A, early_stop=False)
        assert int(ref[0]) == lengths[x1]
    assert lengths == {0: 2, 1: 0}  # x1 = A: Theta2 = 1.134 is the global max; x1 = B: Theta0 = 1.0
    res_a = schedule_verification(_appendix_conf(0), active, SPS_A, early_stop=False)
    assert float(res_a.throughput) == pytest.approx((1 + 0.8 + 0.72) * 0.45, rel=1e-6)
    dist = _output_distribution(lambda x1: lengths[x1])
    assert dist == pytest.approx([0.85, 0.15])  # biased away from (0.7, 0.3)


def test_appendix_a_causal_scheduler_preserves_target() -> None:
    active = np.array([True])
    lengths = {}
    for x1 in range(2):
        res = schedule_verification(_appendix_conf(x1), active, SPS_A, early_stop=True)
        lengths[x1] = int(res.lengths[0])
        assert float(res.throughput) == pytest.approx(1.0)  # Theta0: stops at Theta1 = 0.9 < 1.0
        assert int(res.batch_tokens) == 1
        ref, _ = schedule_verification_reference(_appendix_conf(x1), active, SPS_A, early_stop=True)
        assert int(ref[0]) == 0
    assert lengths == {0: 0, 1: 0}
    assert _output_distribution(lambda x1: lengths[x1]) == pytest.approx(P_T)


# ------------------------------------------------------------------------------------------
# JAX vs literal loop
# ------------------------------------------------------------------------------------------


def _random_sps(rng: np.random.Generator, n: int, dyadic: bool) -> np.ndarray:
    kind = rng.integers(0, 3)
    if kind == 0:  # smooth, decreasing
        v = 1.0 / (1.0 + rng.uniform(0.005, 0.2) * np.arange(n))
    elif kind == 1:  # jagged, step-wise
        v = np.repeat(rng.uniform(0.2, 1.0, n // 4 + 1), 4)[:n]
        v = np.sort(v)[::-1] if rng.random() < 0.5 else v
    else:  # flat then cliff
        v = np.where(np.arange(n) < rng.integers(1, n), 1.0, rng.uniform(0.05, 0.5))
    if dyadic:
        v = np.round(v * 64) / 64
    return v.astype(np.float32)


def _random_conf(rng: np.random.Generator, r: int, g: int, dyadic: bool) -> np.ndarray:
    if dyadic:  # exact in float32 -> many exact ties in a and in Theta
        c = rng.choice(np.array([0.0, 0.25, 0.5, 0.75, 1.0]), size=(r, g), p=[0.05, 0.15, 0.2, 0.35, 0.25])
    else:
        c = rng.uniform(0.0, 1.0, (r, g)) ** 0.3
        c[rng.random((r, g)) < 0.03] = 0.0
        c[rng.random((r, g)) < 0.03] = 1.0
        if r > 1:  # duplicated requests
            c[1] = c[0]
    return c.astype(np.float32)


def _check_prefix_mask(lengths: np.ndarray, mask: np.ndarray, g: int) -> None:
    assert np.array_equal(mask, np.arange(g)[None, :] < lengths[:, None])
    assert lengths.min() >= 0 and lengths.max() <= g


@pytest.mark.parametrize("dyadic", [True, False])
@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("shape", [(1, 2), (3, 4), (8, 7)])
def test_jax_matches_reference(shape, early_stop: bool, dyadic: bool) -> None:
    r, g = shape
    rng = np.random.default_rng(hash((r, g, early_stop, dyadic)) % 2**32)
    dtype = np.float32 if dyadic else np.float64
    n_admitted = []
    for _ in range(40):
        conf = _random_conf(rng, r, g, dyadic)
        active = rng.random(r) < 0.8
        sps_len = int(rng.integers(r + 1, r * (g + 1) + 2))  # sometimes a hard capacity
        # zero padding = "beyond the table"; a fixed length avoids recompiling for every case
        sps = np.zeros(r * (g + 1) + 2, np.float32)
        sps[:sps_len] = _random_sps(rng, sps_len, dyadic)
        res = schedule_verification(conf, active, sps, early_stop=early_stop)
        ref_len, ref_mask = schedule_verification_reference(conf, active, sps, early_stop, dtype=dtype)
        lengths, mask = np.asarray(res.lengths), np.asarray(res.mask)
        assert np.array_equal(lengths, ref_len), (conf, active, sps)
        assert np.array_equal(mask, ref_mask)
        _check_prefix_mask(lengths, mask, g)
        assert np.all(lengths[~active] == 0)
        assert int(res.batch_tokens) == int(active.sum() + lengths.sum())
        a = np.cumprod(conf.astype(np.float64), axis=1)
        tau = active.sum() + (a * ref_mask).sum()
        assert float(res.expected_accepts) == pytest.approx(tau, rel=1e-5)
        b = int(res.batch_tokens)
        s = sps[b] if b < len(sps) else 0.0
        assert float(res.throughput) == pytest.approx(tau * s, rel=1e-5, abs=1e-6)
        n_admitted.append(lengths.sum())
    assert max(n_admitted) > 0  # the cases are not all trivial


def test_tie_break_and_strict_improvement() -> None:
    # Two identical requests; Theta0 = 2*0.5 = 1, Theta1 = 2.5*0.75 = 1.875, Theta2 = 3*0.625 =
    # 1.875 (no strict gain) -> exactly one token admitted, to the lower request index.
    conf = np.array([[0.5], [0.5]], np.float32)
    sps = np.array([0.0, 1.0, 0.5, 0.75, 0.625], np.float32)
    res = schedule_verification(conf, np.array([True, True]), sps)
    assert np.asarray(res.lengths).tolist() == [1, 0]
    assert schedule_verification_reference(conf, [True, True], sps)[0].tolist() == [1, 0]
    # an inactive first row is skipped (and not counted in R): R = 1, Theta0 = 1, Theta1 = 1.5
    sps2 = np.array([0.0, 1.0, 1.0, 0.0, 0.0], np.float32)
    res2 = schedule_verification(conf, np.array([False, True]), sps2)
    assert int(res2.batch_tokens) == 2
    assert np.asarray(res2.lengths).tolist() == [0, 1]


def test_edge_cases_zero_one_confidences_and_no_active() -> None:
    g = 4
    flat = np.ones(64, np.float32)  # SPS constant: every candidate with a > 0 improves Theta
    conf = np.array(
        [[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0], [1.0, 0.5, 0.0, 1.0], [np.nan, 1.0, 1.0, 1.0]],
        np.float32,
    )
    res = schedule_verification(conf, np.ones(4, bool), flat)
    assert np.asarray(res.lengths).tolist() == [4, 0, 2, 0]  # a = 0 (or NaN) is never admitted
    res_none = schedule_verification(conf, np.zeros(4, bool), flat)
    assert np.asarray(res_none.lengths).tolist() == [0, 0, 0, 0]
    assert int(res_none.batch_tokens) == 0 and float(res_none.throughput) == 0.0
    assert not np.asarray(res_none.mask).any()
    ref_none = schedule_verification_reference(conf, np.zeros(4, bool), flat)[0]
    assert ref_none.tolist() == [0, 0, 0, 0]
    # table shorter than the maximal batch: acts as a hard token capacity
    short = np.ones(7, np.float32)  # B <= 6 tokens
    res_cap = schedule_verification(np.ones((2, g), np.float32), np.ones(2, bool), short)
    assert int(res_cap.batch_tokens) == 6 and np.asarray(res_cap.lengths).tolist() == [4, 0]


def test_runs_inside_jit_and_vmap() -> None:
    rng = np.random.default_rng(7)
    conf = rng.uniform(0.3, 1.0, (5, 4, 7)).astype(np.float32)
    active = np.ones((5, 4), bool)
    sps = _random_sps(rng, 40, dyadic=False)

    @jax.jit
    def round_fn(c, a, s):
        out = schedule_verification(c, a, s)
        return out.lengths, out.mask

    batched = jax.vmap(round_fn, in_axes=(0, 0, None))(jnp.asarray(conf), jnp.asarray(active), jnp.asarray(sps))
    for i in range(5):
        ref_len, ref_mask = schedule_verification_reference(conf[i], active[i], sps)
        assert np.array_equal(np.asarray(batched[0][i]), ref_len)
        assert np.array_equal(np.asarray(batched[1][i]), ref_mask)


# ------------------------------------------------------------------------------------------
# Production variant (§5.2)
# ------------------------------------------------------------------------------------------


def test_topk_admission_matches_reference() -> None:
    rng = np.random.default_rng(11)
    for _ in range(60):
        conf = _random_conf(rng, 6, 5, dyadic=bool(rng.random() < 0.5))
        active = rng.random(6) < 0.8
        k = int(rng.integers(0, 34))
        res = topk_admission(conf, active, k)
        ref_len, ref_mask = topk_admission_reference(conf, active, k, dtype=np.float32)
        assert np.array_equal(np.asarray(res.lengths), ref_len)
        assert np.array_equal(np.asarray(res.mask), ref_mask)
        n_cand = int((np.cumprod(conf, axis=1)[active] > 0).sum())
        assert int(np.asarray(res.lengths).sum()) == min(k, n_cand)


def test_global_capacity_and_production_queue() -> None:
    rng = np.random.default_rng(12)
    sps = _random_sps(rng, 6 * 8 + 1, dyadic=False)
    active = np.ones(6, bool)
    confs = [_random_conf(rng, 6, 7, dyadic=False) for _ in range(5)]
    caps = []
    for c in confs:
        k = int(global_capacity(c, active, sps))
        ref_len, _ = schedule_verification_reference(c, active, sps, early_stop=False)
        assert k == int(ref_len.sum())
        caps.append(k)
    queue = init_capacity_queue(3)
    for t, c in enumerate(confs):
        sched, queue = production_schedule(c, active, sps, queue)
        k_used = 3 if t < 2 else caps[t - 2]  # capacity from confidences two steps old
        ref_len, _ = topk_admission_reference(c, active, k_used, dtype=np.float32)
        assert np.array_equal(np.asarray(sched.lengths), ref_len)
        assert np.asarray(queue).tolist() == [3 if t == 0 else caps[t - 1], caps[t]]


def test_production_admission_is_independent_of_current_continuation() -> None:
    # Appendix A setting under §5.2: K comes from stale confidences, so whether x1 is admitted
    # cannot depend on c2(x1); the output distribution stays (0.7, 0.3) for any stale K.
    active = np.array([True])
    for k_stale in range(3):
        lengths = {}
        for x1 in range(2):
            sched, _ = production_schedule(_appendix_conf(x1), active, SPS_A, init_capacity_queue(k_stale))
            lengths[x1] = int(sched.lengths[0])
        assert (lengths[0] >= 1) == (lengths[1] >= 1)
        assert _output_distribution(lambda x1: lengths[x1]) == pytest.approx(P_T)


def test_production_mode_is_the_paper_schedule_alone() -> None:
    """`schedule_lengths("production")`: ℓ = the top-K current candidates (K given, stale),
    the new K = the global search of τ·SPS(B) (the paper's objective: a drafting-cost table
    `sps_draft` is ignored, where "adaptive" searches on it), G = its expected accepted drafts;
    both stale-capacity modes admit the same ℓ."""
    from scheduler_by_name import (CONFIDENCE_MODES, MODES, STALE_CAPACITY_MODES,
                                   schedule_lengths)

    assert "production" in MODES and "production" in CONFIDENCE_MODES
    assert set(STALE_CAPACITY_MODES) == {"production", "adaptive"}
    rng = np.random.default_rng(21)
    R, G = 5, 4
    sps = _random_sps(rng, R * (G + 1) + 1, dyadic=False)
    # a drafting round's rate with a fixed drafter cost: 1 / (t_d + t_v(B)), t_d = 3 t_v(R)
    t_v = 1.0 / np.maximum(sps, 1e-12)
    sps_draft = (1.0 / (t_v + 3.0 * t_v[R])).astype(np.float32)
    differs = 0
    for _ in range(20):
        conf = _random_conf(rng, R, G, dyadic=False)
        active = rng.random(R) < 0.8
        k = int(rng.integers(0, R * G + 1))
        ell, k_new, gain = schedule_lengths("production", jnp.asarray(conf), jnp.asarray(active),
                                            G, 0.5, jnp.asarray(sps), jnp.asarray(k, jnp.int32),
                                            jnp.asarray(sps_draft))
        ref_len, _ = topk_admission_reference(conf, active, k, dtype=np.float32)
        assert np.array_equal(np.asarray(ell), ref_len)
        glob = schedule_verification(conf, active, sps, early_stop=False)
        assert int(k_new) == int(global_capacity(conf, active, sps))
        assert float(gain) == pytest.approx(float(glob.expected_accepts) - active.sum(),
                                            abs=1e-5)
        ell_a, k_a, _ = schedule_lengths("adaptive", jnp.asarray(conf), jnp.asarray(active),
                                         G, 0.5, jnp.asarray(sps), jnp.asarray(k, jnp.int32),
                                         jnp.asarray(sps_draft))
        assert np.array_equal(np.asarray(ell_a), np.asarray(ell))
        assert int(k_a) == int(global_capacity(conf, active, sps_draft))
        differs += int(k_a) != int(k_new)
    assert differs > 0   # the drafter's cost in adaptive's objective changes K somewhere
