"""The row sampler (`pallas_kernels.row_sample.row_sample`, two Triton kernels a draw,
interpreted here) against its oracle `inverse_cdf_sample`: same uniforms → same indices, over
vocabularies that are not a whole number of tiles, bf16 and unnormalised weights, one-hot
(greedy) rows, zero weights at either end and inside, uniforms at 0 and just below 1, and any
leading shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import inverse_cdf_sample, probs_from_logits
from pallas_kernels.row_sample import row_sample


def _weights(shape, seed, dtype=jnp.float32):
    rng = np.random.RandomState(seed)
    w = rng.rand(*shape) ** 6 * 3.0                   # skewed, unnormalised
    w[..., : shape[-1] // 7] = 0.0                    # leading zeros
    w[..., shape[-1] // 3: shape[-1] // 2] = 0.0      # whole zero tiles inside
    w[..., -(shape[-1] // 5):] = 0.0                  # trailing zeros
    return jnp.asarray(w, dtype)


@pytest.mark.parametrize("shape,block_v,dtype", [
    ((5, 1000), 128, jnp.float32),        # 8 tiles, the last partial
    ((1, 130), 32, jnp.float32),          # one row
    ((2, 3, 700), 1024, jnp.bfloat16),    # leading [2, 3], one tile wider than V, bf16
    ((40, 96), 16, jnp.float32),          # several row blocks
])
def test_matches_the_oracle(shape, block_v, dtype):
    w = _weights(shape, seed=sum(shape))
    w = w.astype(dtype)
    rng = np.random.RandomState(len(shape))
    for u in (rng.rand(*shape[:-1]), np.zeros(shape[:-1]), np.full(shape[:-1], 1 - 2 ** -24)):
        u = jnp.asarray(u, jnp.float32)
        got = row_sample(w, u, block_v=block_v, interpret=True)
        assert got.shape == shape[:-1] and got.dtype == jnp.int32
        want = inverse_cdf_sample(w, u)
        if u.max() < 0.999:
            np.testing.assert_array_equal(got, want)
        else:   # u·Σ within f32 rounding of the last steps (weights ~1e-6 of Σ): either side
            cdf = np.cumsum(np.asarray(w, np.float64), -1)
            step = np.take_along_axis(cdf, np.asarray(got)[..., None], -1)[..., 0]
            np.testing.assert_allclose(step, cdf[..., -1], rtol=1e-6)
        # every draw lands on a positive weight: never a zero run, leading or trailing
        assert bool(jnp.all(jnp.take_along_axis(w, got[..., None], -1) > 0))


def test_draws_follow_the_row_distribution():
    """10,000 draws from one row: the frequencies match the probabilities (χ² well inside its
    99.9% bound for 11 degrees of freedom)."""
    p = jnp.asarray(np.random.RandomState(3).dirichlet(np.ones(12) * 0.7), jnp.float32)
    n = 10_000
    u = jax.random.uniform(jax.random.key(0), (n,), jnp.float32)
    idx = row_sample(jnp.broadcast_to(p, (n, 12)), u, block_v=16, interpret=True)
    counts = np.bincount(np.asarray(idx), minlength=12)
    expected = np.asarray(p) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 31.3, (chi2, counts, expected)


def test_greedy_rows_and_all_zero_rows():
    """One-hot rows (T = 0, the first argmax) give that index for any uniform; an all-zero
    row gives 0, as the oracle."""
    logits = jnp.asarray(np.random.RandomState(1).randn(3, 300), jnp.float32)
    logits = logits.at[1, 17].set(9.0).at[1, 250].set(9.0)       # tied maxima across tiles
    hard = probs_from_logits(logits, 0.0)
    for u in (0.0, 0.5, 1 - 2 ** -24):
        got = row_sample(hard, jnp.full((3,), u, jnp.float32), block_v=64, interpret=True)
        np.testing.assert_array_equal(got, jnp.argmax(logits, -1))
        assert int(got[1]) == 17
    zero = jnp.zeros((2, 300), jnp.float32)
    assert row_sample(zero, jnp.asarray([0.3, 0.9]), block_v=64, interpret=True).tolist() == [0, 0]


def test_bad_inputs():
    w = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="leading shape"):
        row_sample(w, jnp.zeros((3,)), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        row_sample(w, jnp.zeros((2,)), block_v=48, interpret=True)
