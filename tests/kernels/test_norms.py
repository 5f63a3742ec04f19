"""The decoding layer's residual-sum RMS norm kernel (Triton, interpreted on CPU) against its
pure-JAX oracle, in fp32 and bf16, on rows that are and are not a power of two long."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norms import add_rms_norm, ref_add_rms_norm

EPS = 1e-6


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [32, 40])        # 40: a row that is no power of two
def test_add_rms_norm_matches_the_oracle(dtype, d):
    ks = jax.random.split(jax.random.key(0), 3)
    h, delta = (jax.random.normal(k, (5, d)).astype(dtype) for k in ks[:2])
    w = (1 + 0.1 * jax.random.normal(ks[2], (d,))).astype(dtype)
    got = add_rms_norm(h, delta, w, eps=EPS, interpret=True)
    want = ref_add_rms_norm(h, delta, w, eps=EPS)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for g, r in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_allclose(_f32(g), _f32(r), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(h, delta, w[:-1], eps=EPS, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_rms_norm_sums_a_split_k_products_parts(dtype):
    """delta as the f32 parts of a split-K product [parts, ≥ R, D]: the kernel sums each row's
    parts, rounds them to h's dtype and adds, as the oracle (XLA's sum of the parts); rows of
    the parts past R are never read."""
    ks = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(ks[0], (3, 40)).astype(dtype)
    parts = jax.random.normal(ks[1], (4, 5, 40), jnp.float32)
    parts = parts.at[:, 3:].set(jnp.nan)                       # rows past R: unread
    w = (1 + 0.1 * jax.random.normal(ks[2], (40,))).astype(dtype)
    got = add_rms_norm(h, parts, w, eps=EPS, interpret=True)
    want = ref_add_rms_norm(h, parts, w, eps=EPS)
    whole = ref_add_rms_norm(h, parts[:, :3].sum(0).astype(dtype), w, eps=EPS)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for g, r, r2 in zip(got, want, whole):
        assert g.dtype == dtype and np.isfinite(_f32(g)).all()
        np.testing.assert_allclose(_f32(g), _f32(r), atol=tol, rtol=tol)
        np.testing.assert_allclose(_f32(g), _f32(r2), atol=tol, rtol=tol)
    assert float(jnp.max(jnp.abs(_f32(got[0]) - _f32(h + parts[0, :3].astype(dtype))))) > 0.1
    with pytest.raises(ValueError, match="parts"):
        add_rms_norm(h, parts.astype(jnp.bfloat16), w, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="parts"):
        add_rms_norm(h, parts[:, :2], w, eps=EPS, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("split", [False, True])
def test_a_sandwich_norm_and_a_scale_match_the_oracle(dtype, split):
    """Gemma's residual update, s = (h + RMSNorm(delta)·w_d)·scale and RMSNorm(s)·w, in one
    kernel: equal to the oracle with the delta whole or as split-K parts, with and without the
    output norm; dropping the delta's norm or the scale is visible."""
    ks = jax.random.split(jax.random.key(2), 5)
    h = jax.random.normal(ks[0], (3, 40)).astype(dtype)
    delta = (4 * jax.random.normal(ks[1], (3, 40))).astype(dtype)
    wd, w = ((1 + 0.1 * jax.random.normal(k, (40,))).astype(dtype) for k in ks[2:4])
    scale = jnp.asarray([0.7], dtype)
    d_in = (jnp.stack([delta.astype(jnp.float32) * 0.25] * 4) if split else delta)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for weight in (w, None):
        got = add_rms_norm(h, d_in, weight, eps=EPS, delta_weight=wd, scale=scale,
                           interpret=True)
        want = ref_add_rms_norm(h, d_in, weight, eps=EPS, delta_weight=wd, scale=scale)
        np.testing.assert_allclose(_f32(got[0]), _f32(want[0]), atol=tol, rtol=tol)
        if weight is None:
            assert got[1] is None and want[1] is None
        else:
            np.testing.assert_allclose(_f32(got[1]), _f32(want[1]), atol=tol, rtol=tol)
    plain = ref_add_rms_norm(h, delta, w, eps=EPS)[0]
    assert float(jnp.max(jnp.abs(_f32(got[0]) - _f32(plain)))) > 0.5
    with pytest.raises(ValueError, match="scale"):
        add_rms_norm(h, delta, w, eps=EPS, scale=jnp.ones((2,), dtype), interpret=True)
