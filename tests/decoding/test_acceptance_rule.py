"""Tests for dspark_jax.decoding.acceptance_rule: lossless verification (SPEC §1 steps 3–5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.acceptance_rule import (
    VERIFIERS,
    VerifyResult,
    get_verifier,
    greedy_verify,
    inverse_cdf_sample,
    pallas_verify,
    rejection_verify,
    rejection_verify_with_uniforms,
)
from dspark_jax.decoding.sampling import probs_from_logits
from pallas_kernels.common import inverse_cdf_sample_tiled, tile_width

try:  # scipy is not a declared dependency
    from scipy.stats import chi2 as _chi2

    def chi2_crit(df: int) -> float:
        return float(_chi2.ppf(0.999, df))
except ImportError:  # 0.999 quantiles of χ²(df), from scipy.stats.chi2.ppf(0.999, df)
    _CHI2_999 = {4: 18.46682695, 5: 20.51500565, 24: 51.17859778, 35: 66.61882884}

    def chi2_crit(df: int) -> float:
        return _CHI2_999[df]


def chi2_stat(samples: np.ndarray, expected_probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic of integer samples against a distribution over range(len(p)); all
    expected cells must be positive. Returns (statistic, degrees of freedom)."""
    p = np.asarray(expected_probs, np.float64).ravel()
    counts = np.bincount(np.asarray(samples).ravel(), minlength=p.size)
    assert counts.size == p.size, "sample outside the support"
    expected = counts.sum() * p / p.sum()
    assert expected.min() >= 5, "chi-square needs ≥ 5 expected counts per cell"
    return float(np.sum((counts - expected) ** 2 / expected)), p.size - 1


def _rand_dist(rng: np.random.Generator, *shape: int, floor: float = 0.3) -> np.ndarray:
    """Random distributions over the last axis, every entry ≥ floor / V."""
    v = shape[-1]
    d = rng.dirichlet(np.ones(v), size=shape[:-1])
    return ((1 - floor) * d + floor / v).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Inverse-CDF sampling
# ------------------------------------------------------------------------------------------

def test_inverse_cdf_sample_edges():
    w = jnp.array([[0.0, 0.3, 0.7, 0.0]] * 4 + [[0.0] * 4])
    u = jnp.array([0.0, 0.29, 0.31, 1.0, 0.5])
    # u·total lands left of / right of the first step; even u = 1 (beyond the top of the CDF)
    # never picks the zero-weight index 3; an all-zero row returns 0.
    np.testing.assert_array_equal(inverse_cdf_sample(w, u), [1, 1, 2, 2, 0])
    # unnormalised weights: same answer as normalised
    np.testing.assert_array_equal(inverse_cdf_sample(w * 5.0, u), [1, 1, 2, 2, 0])


@pytest.mark.parametrize("V", [37, 1000, 4099])
def test_tiled_inverse_cdf_equals_the_untiled_search(V):
    """`ref_verify`'s tiled search (tile sums, a prefix over the tiles, one within the chosen
    tile) returns `inverse_cdf_sample`'s index for every uniform: integer weights make every
    partial sum exact, so the two must agree exactly, zeros, a last tile padded past V, u = 0,
    u = 1 and an all-zero row included."""
    assert tile_width(V) < V or V == 37     # several tiles (37: one)
    rng = np.random.default_rng(V)
    w = rng.integers(0, 4, size=(6, V)).astype(np.float32)
    w[1, : V // 2] = 0.0                    # mass only in the later tiles
    w[2, V // 3:] = 0.0                     # ... only in the first ones: zero tiles at the end
    w[3] = 0.0
    w[4, :] = 0.0
    w[4, V - 1] = 5.0                       # one token, the last
    w = jnp.asarray(w)
    for u in [jnp.zeros(6), jnp.ones(6), *jax.random.uniform(jax.random.key(V), (40, 6))]:
        np.testing.assert_array_equal(inverse_cdf_sample_tiled(w, u), inverse_cdf_sample(w, u))
    assert int(inverse_cdf_sample_tiled(w, jnp.ones(6))[4]) == V - 1


# ------------------------------------------------------------------------------------------
# Greedy: one-hot probabilities reduce the rule to exact prefix matching
# ------------------------------------------------------------------------------------------

def test_greedy_accepts_exactly_the_matching_prefix():
    B, G, V = 6, 5, 11
    rng = np.random.default_rng(0)
    t_logits = rng.normal(size=(B, G + 1, V)).astype(np.float32)
    t_arg = t_logits.argmax(-1)                                               # [B, γ+1]
    match_len = np.array([0, 1, 3, 5, 5, 2])                                  # matching prefix
    verify_len = np.array([5, 5, 5, 5, 3, 0], np.int32)
    drafts = t_arg[:, :G].copy()
    for b, m in enumerate(match_len):
        if m < G:
            drafts[b, m] = (t_arg[b, m] + 1) % V                              # first mismatch
            drafts[b, m + 1:] = rng.integers(0, V, size=G - m - 1)
    d_logits = np.where(np.arange(V) == drafts[..., None], 5.0, 0.0).astype(np.float32)
    d_logits += rng.normal(size=d_logits.shape).astype(np.float32) * 0.1
    tp = probs_from_logits(jnp.asarray(t_logits), 0.0)
    dp = probs_from_logits(jnp.asarray(d_logits), 0.0)

    expected_n = np.minimum(match_len, verify_len)
    for seed in range(3):  # greedy is deterministic whatever the uniforms
        res = jax.jit(rejection_verify)(jax.random.key(seed), tp, dp, jnp.asarray(drafts),
                                        jnp.asarray(verify_len))
        assert isinstance(res, VerifyResult)
        np.testing.assert_array_equal(res.num_accepted, expected_n)
        np.testing.assert_array_equal(res.next_token, t_arg[np.arange(B), expected_n])
        np.testing.assert_array_equal(res.accepted_mask, np.arange(G) < expected_n[:, None])
        assert res.num_accepted.dtype == jnp.int32 and res.next_token.dtype == jnp.int32
    # the engine's T = 0 fast path gives the same result from the target's argmax alone
    fast = jax.jit(greedy_verify)(jnp.asarray(t_arg), jnp.asarray(drafts),
                                  jnp.asarray(verify_len))
    for got, want in zip(fast, res):
        np.testing.assert_array_equal(got, want)


def test_greedy_fast_path_equals_the_rule_on_random_drafts():
    """Random drafts against one-hot target rows with ties in the logits (first argmax wins):
    `greedy_verify` from the argmax equals the full rule on `probs_from_logits(·, 0)` rows."""
    B, G, V = 64, 7, 6
    rng = np.random.default_rng(3)
    t_logits = rng.integers(0, 3, size=(B, G + 1, V)).astype(np.float32)   # many ties
    drafts = rng.integers(0, V, size=(B, G)).astype(np.int32)
    same = rng.random((B, G)) < 0.7   # mostly matching prefixes
    drafts = np.where(same, t_logits[:, :G].argmax(-1), drafts).astype(np.int32)
    verify_len = rng.integers(0, G + 1, size=B).astype(np.int32)
    dp = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, G, V)), jnp.float32), axis=-1)
    want = rejection_verify(jax.random.key(1), probs_from_logits(jnp.asarray(t_logits), 0.0),
                            dp, jnp.asarray(drafts), jnp.asarray(verify_len))
    got = greedy_verify(jnp.argmax(jnp.asarray(t_logits), axis=-1), jnp.asarray(drafts),
                        jnp.asarray(verify_len))
    assert 0 < int(jnp.sum(want.num_accepted)) < int(verify_len.sum())
    for g_, w_ in zip(got, want):
        np.testing.assert_array_equal(g_, w_)


# ------------------------------------------------------------------------------------------
# Statistical losslessness
# ------------------------------------------------------------------------------------------

V_STAT = 6
N_STAT = 40_000


def _stat_tables(seed: int = 0) -> dict[str, np.ndarray]:
    """Target tables p0 [V], P1[x1] [V, V], P2[x1, x2] [V, V, V] and a deliberately different
    drafter d0, D1[x1] (anti-correlated with the target, zero mass on token 0)."""
    rng = np.random.default_rng(seed)
    V = V_STAT
    p0, P1, P2 = _rand_dist(rng, V), _rand_dist(rng, V, V), _rand_dist(rng, V, V, V)

    def unlike(p: np.ndarray) -> np.ndarray:
        q = 1.0 / p ** 2
        q[..., 0] = 0.0  # token 0 can only be emitted through the residual
        return (q / q.sum(-1, keepdims=True)).astype(np.float32)

    return dict(p0=p0, P1=P1, P2=P2, d0=unlike(p0), D1=unlike(P1))


def _emitted_pair(verifier, key: jax.Array, tab: dict[str, np.ndarray], n: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """First two emitted tokens of N independent sequences: a γ = 2 round, plus a γ = 1 round
    anchored on the first token for the sequences whose first round emitted only one token."""
    k_d1, k_d2, k_v1, k_d3, k_v2 = jax.random.split(key, 5)
    V = V_STAT
    p0, P1, P2, d0, D1 = (jnp.asarray(tab[k]) for k in ("p0", "P1", "P2", "d0", "D1"))
    x1 = jax.random.categorical(k_d1, jnp.log(d0), shape=(n,))
    x2 = jax.random.categorical(k_d2, jnp.log(D1[x1]))
    tp = jnp.stack([jnp.broadcast_to(p0, (n, V)), P1[x1], P2[x1, x2]], axis=1)   # [N, 3, V]
    dp = jnp.stack([jnp.broadcast_to(d0, (n, V)), D1[x1]], axis=1)              # [N, 2, V]
    r1 = verifier(k_v1, tp, dp, jnp.stack([x1, x2], 1).astype(jnp.int32),
                  jnp.full((n,), 2, jnp.int32))
    t1 = jnp.where(r1.num_accepted >= 1, x1, r1.next_token)
    t2_first = jnp.where(r1.num_accepted >= 2, x2, r1.next_token)
    # second round (used where the first one emitted a single token): anchor t1, one draft
    y1 = jax.random.categorical(k_d3, jnp.log(D1[t1]))
    tp2 = jnp.stack([P1[t1], P2[t1, y1]], axis=1)                               # [N, 2, V]
    r2 = verifier(k_v2, tp2, D1[t1][:, None], y1[:, None].astype(jnp.int32),
                  jnp.ones((n,), jnp.int32))
    t2_second = jnp.where(r2.num_accepted >= 1, y1, r2.next_token)
    t2 = jnp.where(r1.num_accepted == 0, t2_second, t2_first)
    return np.asarray(t1), np.asarray(t2)


def _broken_residual_is_target(key, tp, dp, tokens, vlen) -> VerifyResult:
    """Broken rule: on rejection, resample from p_t instead of norm(max(p_t − p_d, 0))."""
    k1, k2 = jax.random.split(key)
    res = rejection_verify(k1, tp, dp, tokens, vlen)
    pt_j = jnp.take_along_axis(tp, res.num_accepted[:, None, None], axis=1)[:, 0]
    redraw = inverse_cdf_sample(pt_j, jax.random.uniform(k2, vlen.shape))
    nxt = jnp.where(res.num_accepted < vlen, redraw, res.next_token)
    return res._replace(next_token=nxt)


def _broken_always_accept(key, tp, dp, tokens, vlen) -> VerifyResult:
    """Broken rule: accept every verified draft, then the bonus from p_t,ℓ."""
    G = tokens.shape[1]
    pt_l = jnp.take_along_axis(tp, vlen[:, None, None], axis=1)[:, 0]
    nxt = inverse_cdf_sample(pt_l, jax.random.uniform(key, vlen.shape))
    return VerifyResult(vlen, nxt, jnp.arange(G)[None, :] < vlen[:, None])


def _pair_stats(verifier, seed: int = 1) -> tuple[float, float]:
    tab = _stat_tables()
    t1, t2 = _emitted_pair(jax.jit(verifier), jax.random.key(seed), tab, N_STAT)
    s1, df1 = chi2_stat(t1, tab["p0"])
    joint = tab["p0"][:, None] * tab["P1"]                       # P(t1 = a, t2 = b)
    s12, df12 = chi2_stat(t1 * V_STAT + t2, joint)
    return s1 / chi2_crit(df1), s12 / chi2_crit(df12)


def test_emitted_tokens_follow_the_target_distribution():
    tab = _stat_tables()
    # the drafter really is different: accept rate well below 1 for slot 1
    assert 0.5 * np.abs(tab["p0"] - tab["d0"]).sum() > 0.3
    first, pair = _pair_stats(rejection_verify)
    assert first < 1.0, f"first-token χ² is {first:.2f}× the 0.999 quantile"
    assert pair < 1.0, f"(first, second) χ² is {pair:.2f}× the 0.999 quantile"


@pytest.mark.parametrize("broken", [_broken_residual_is_target, _broken_always_accept])
def test_chi_square_rejects_broken_rules(broken):
    first, pair = _pair_stats(broken)
    assert pair > 1.0 and first > 1.0, (first, pair)


# ------------------------------------------------------------------------------------------
# verify_len, bonus token and residual fallback
# ------------------------------------------------------------------------------------------

def test_verify_len_masks_slots():
    B, G, V = 256, 4, 5
    rng = np.random.default_rng(3)
    tp = jnp.asarray(_rand_dist(rng, B, G + 1, V))
    dp = jnp.asarray(_rand_dist(rng, B, G, V))
    tokens = jnp.asarray(rng.integers(0, V, size=(B, G)), jnp.int32)
    vlen = jnp.asarray(rng.integers(0, G + 1, size=B), jnp.int32)
    verify = jax.jit(rejection_verify)
    res = verify(jax.random.key(0), tp, dp, tokens, vlen)
    n, mask = np.asarray(res.num_accepted), np.asarray(res.accepted_mask)
    assert (n <= np.asarray(vlen)).all() and (n >= 0).all()
    assert not mask[np.arange(G)[None, :] >= np.asarray(vlen)[:, None]].any()
    np.testing.assert_array_equal(mask, np.arange(G)[None, :] < n[:, None])  # a prefix
    assert 0 < n.mean() < np.asarray(vlen).mean()  # some accepted, some rejected

    # a perfect drafter (p_d = p_t) is accepted on exactly the ℓ verified slots, never more
    perfect = verify(jax.random.key(1), tp, tp[:, :G], tokens, vlen)
    np.testing.assert_array_equal(perfect.num_accepted, vlen)


@pytest.mark.parametrize("ell", [0, 2])
def test_bonus_and_zero_length_sample_from_target_row(ell):
    """All ℓ verified drafts accepted (perfect drafter) → next token ~ p_t,ℓ; ℓ = 0 → p_t,0."""
    N, G, V = 20_000, 3, 5
    rng = np.random.default_rng(4)
    rows = _rand_dist(rng, G + 1, V)
    tp = jnp.broadcast_to(jnp.asarray(rows), (N, G + 1, V))
    tokens = jnp.asarray(rng.integers(0, V, size=(N, G)), jnp.int32)
    res = jax.jit(rejection_verify)(jax.random.key(5), tp, tp[:, :G], tokens,
                                    jnp.full((N,), ell, jnp.int32))
    np.testing.assert_array_equal(res.num_accepted, ell)
    s, df = chi2_stat(res.next_token, rows[ell])
    assert s < chi2_crit(df)
    wrong = rows[(ell + 1) % (G + 1)]  # the test can tell rows apart
    s_wrong, _ = chi2_stat(res.next_token, wrong)
    assert s_wrong > chi2_crit(df)


def test_residual_falls_back_to_target_when_mass_vanishes():
    # the draft token has zero mass under both models → rejected, and p_t − p_d = 0 everywhere
    p = jnp.array([[0.2, 0.3, 0.5, 0.0]])
    tp = jnp.stack([p, p], axis=1)                       # [1, 2, 4]
    dp = p[:, None]                                      # [1, 1, 4]
    su = jnp.array([0.1, 0.4, 0.9])
    bcast = lambda x: jnp.broadcast_to(x, (3,) + x.shape[1:])  # noqa: E731
    res = jax.jit(rejection_verify_with_uniforms)(
        jnp.full((3, 1), 0.5), su, bcast(tp), bcast(dp), jnp.full((3, 1), 3, jnp.int32),
        jnp.ones((3,), jnp.int32))
    np.testing.assert_array_equal(res.num_accepted, [0, 0, 0])
    np.testing.assert_array_equal(res.next_token, [0, 1, 2])  # inverse CDF of p_t itself


def test_registry():
    assert {"jax", "pallas"} <= set(VERIFIERS)  # other tests may register more
    assert get_verifier("jax") is rejection_verify_with_uniforms
    with pytest.raises(ValueError, match="unknown verifier"):
        get_verifier("cuda")


def test_pallas_verifier_matches_jax_for_same_key():
    B, G, V = 3, 4, 37
    rng = np.random.default_rng(6)
    tp = jnp.asarray(_rand_dist(rng, B, G + 1, V, floor=0.0))
    dp = jnp.asarray(_rand_dist(rng, B, G, V, floor=0.0))
    tokens = jnp.asarray(rng.integers(0, V, size=(B, G)), jnp.int32)
    vlen = jnp.array([4, 2, 0], jnp.int32)
    key = jax.random.key(7)
    want = rejection_verify(key, tp, dp, tokens, vlen)
    got = pallas_verify(key, tp, dp, tokens, vlen)   # interpreter on CPU
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


def test_one_copy_of_the_rule_the_kernels_oracle(monkeypatch):
    """decoding runs the kernel package's `ref_verify` oracle (one copy of the rule), and γ = 0
    (plain decoding) draws the next token from p_t."""
    import dspark_jax.decoding.acceptance_rule as dv
    from pallas_kernels.verify.kernel import ref_verify

    assert dv.ref_verify is ref_verify
    calls = []
    monkeypatch.setattr(dv, "ref_verify", lambda *a: calls.append("verify") or "v")
    tp = jnp.full((2, 3, 4), 0.25)
    assert dv.rejection_verify_with_uniforms(None, None, tp, None, None, None) == "v"
    assert calls == ["verify"]
    p0 = jnp.asarray([[[0.0, 1.0, 0.0]], [[0.5, 0.0, 0.5]]])              # [2, 1, 3]
    res = dv.rejection_verify_with_uniforms(jnp.zeros((2, 0)), jnp.asarray([0.3, 0.9]), p0,
                                            jnp.zeros((2, 0, 3)), jnp.zeros((2, 0), jnp.int32),
                                            jnp.zeros((2,), jnp.int32))
    np.testing.assert_array_equal(res.next_token, [1, 2])
    np.testing.assert_array_equal(res.num_accepted, [0, 0])


@pytest.mark.parametrize("backend,want", [("cpu", (True, "triton"))])
def test_kernels_interpreted_on_cpu(monkeypatch, backend, want):
    """(On a GPU or TPU they are not offered: tests/kernels/test_offered.py.)"""
    import dspark_jax.decoding.acceptance_rule as dv
    from dspark_jax.decoding.pallas_backend import kernel_mode

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    mode = kernel_mode()
    assert (mode["interpret"], mode["backend"]) == want
    seen = {}
    monkeypatch.setattr(dv, "verify_kernel", lambda *a, **kw: seen.update(kw) or "k")
    tp = jnp.full((1, 2, 4), 0.25)
    assert dv.pallas_verify(jax.random.key(0), tp, tp[:, :1], jnp.zeros((1, 1), jnp.int32),
                            jnp.ones((1,), jnp.int32)) == "k"
    assert (seen["interpret"], seen["backend"]) == want
