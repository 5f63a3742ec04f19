"""Tests for dspark_jax.decoding.sampling: the distribution a request samples from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.sampling import filter_logits_rows, filtered_probs, probs_from_logits


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
