"""Tests for dspark_jax.decoding.sampling: the distribution a request samples from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.sampling import (FILTER_CAP, check_sampling, filter_logits_rows,
                                           filter_within_top, filtered_probs, probs_from_logits)


def test_filtered_probs_is_the_filtered_softmax_in_one_pass():
    """`filtered_probs` (one variadic reduction for the maximum, the first argmax and Σ exp)
    equals `probs_from_logits` of the filtered logits: to f32 rounding for T > 0, exactly the
    first argmax's one-hot for T ≤ 0 (a tie included); per-request settings indexed by `rows`
    equal the same settings given per row; without top-k / top-p the filter is skipped."""
    R, V = 3, 1000
    logits = 4.0 * jax.random.normal(jax.random.key(0), (R, V))
    logits = logits.at[1, 7].set(50.0).at[1, 9].set(50.0)         # a tie: the first wins
    rows = jnp.array([0, 1, 2, 1, 0])
    t = jnp.array([0.7, 0.0, 1.3])
    k = jnp.array([0, 0, 20])
    p = jnp.array([0.9, 1.0, 1.0])
    lg = logits[rows]
    want = probs_from_logits(filter_logits_rows(lg, k[rows], p[rows]), t[rows][:, None])
    got = filtered_probs(lg, t, k, p, rows=rows)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)
    np.testing.assert_array_equal(got[1], jax.nn.one_hot(7, V))
    np.testing.assert_array_equal(got, filtered_probs(lg, t[rows], k[rows], p[rows]))
    plain = filtered_probs(lg, t, 0 * k, 1.0 + 0 * p, rows=rows)
    np.testing.assert_allclose(plain, probs_from_logits(lg, t[rows][:, None]), rtol=2e-6,
                               atol=1e-9)
    assert np.all(np.abs(np.asarray(got).sum(-1) - 1.0) < 1e-5)


def test_filter_within_the_top_candidates_is_the_sorting_filter():
    """`filter_within_top` (`lax.top_k`'s candidates, no sort of the vocabulary) keeps exactly
    what `filter_logits_rows` keeps for rows with 0 < top_k ≤ cap (ties at the k-th logit and
    among the candidates included) and rows that do not filter; `filtered_probs` sends a row
    whose nucleus has no top-k bound to the sort, where the candidates would cut it short."""
    R, V, cap = 256, 3000, 64
    key = jax.random.split(jax.random.key(1), 4)
    for scale, ties in ((1.0, False), (4.0, False), (2.0, True)):
        x = scale * jax.random.normal(key[0], (R, V))
        x = jnp.round(2 * x) / 2 if ties else x
        k = jax.random.randint(key[1], (R,), 1, cap + 1)
        p = jax.random.uniform(key[2], (R,))
        k = jnp.where(jnp.arange(R) % 5 == 0, 0, k)                # no top-k …
        p = jnp.where(k == 0, 1.0, jnp.where(jnp.arange(R) % 3 == 0, 1.0, p))   # … no top-p
        got = filter_within_top(x, k, p, cap=cap)
        np.testing.assert_array_equal(got, filter_logits_rows(x, k, p))
        kept = np.asarray(got > jnp.finfo(jnp.float32).min).sum(-1)
        assert (kept[np.asarray(k) == 0] == V).all()
        assert ties or (kept[np.asarray(k) > 0] <= cap).all()      # ties at the k-th stay
    flat = 0.01 * jax.random.normal(key[3], (2, V))
    k, p, t = jnp.array([10, 0]), jnp.array([0.9, 0.9]), jnp.ones((2,))
    want = probs_from_logits(filter_logits_rows(flat, k, p), t[:, None])
    np.testing.assert_allclose(filtered_probs(flat, t, k, p), want, rtol=2e-6, atol=1e-9)
    assert (np.asarray(want[1]) > 0).sum() > 2000           # the nucleus: most of the row
    assert (np.asarray(filter_within_top(flat, k, p)[1]) > -1e30).sum() <= FILTER_CAP
    np.testing.assert_allclose(filtered_probs(flat[:1], t[:1], k[:1], p[:1]), want[:1],
                               rtol=2e-6, atol=1e-9)


def test_check_sampling_names_the_first_bad_setting():
    """One value or one per request; what falls silently into greedy decoding (T < 0, NaN) or
    into no filter (top-k < 0, top-p outside (0, 1]) is refused by name."""
    check_sampling(0.0, 0, 1.0)
    check_sampling([0.0, 0.7], [0, 50], [1.0, 0.9])
    for kw, msg in ((dict(temperature=-0.5), "temperature must be finite and ≥ 0"),
                    (dict(temperature=[0.0, float("inf")]), "temperature .* got inf"),
                    (dict(top_k=[4, -1]), "top_k must be an integer ≥ 0"),
                    (dict(top_k=2.5), "top_k must be an integer"),
                    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                    (dict(top_p=[1.0, 1.01]), "got 1.01")):
        with pytest.raises(ValueError, match=msg):
            check_sampling(**kw)
    with pytest.raises(ValueError, match="^request 3: top_p"):
        check_sampling(top_p=2.0, where="request 3: ")
