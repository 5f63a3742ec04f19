"""The decoding layer's norm kernels (Triton, interpreted on CPU) against their pure-JAX
oracles: the residual sum with its RMS norm, and the q/k norms with RoPE and the cache write
(rows past the cache dropped), in fp32 and bf16, with and without q/k norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norms import add_rms_norm, qk_norm_rope, ref_add_rms_norm, ref_qk_norm_rope

EPS = 1e-6
B, T, N, KH, H, S = 2, 3, 4, 2, 16, 8


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


def _qk_inputs(dtype):
    ks = jax.random.split(jax.random.key(1), 2)
    qkv = jax.random.normal(ks[0], (B, T, N + 2 * KH, H)).astype(dtype)
    qn = (1 + 0.1 * jax.random.normal(ks[1], (H,))).astype(dtype)
    ang = 0.37 * jnp.arange(B * T * H // 2, dtype=jnp.float32).reshape(B, T, H // 2)
    return qkv, qn, qn[::-1], jnp.cos(ang), jnp.sin(ang)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("normed", [True, False])
def test_qk_norm_rope_matches_the_oracle(dtype, normed):
    qkv, qn, kn, cos, sin = _qk_inputs(dtype)
    norms = (qn, kn) if normed else (None, None)
    kw = dict(num_q_heads=N, num_kv_heads=KH, eps=EPS)
    got = qk_norm_rope(qkv, *norms, cos, sin, interpret=True, **kw)
    want = ref_qk_norm_rope(qkv, *norms, cos, sin, **kw)
    tol = 2e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(_f32(got), _f32(want), atol=tol, rtol=tol)
    np.testing.assert_array_equal(_f32(got[:, :, N + KH:]), _f32(qkv[:, :, N + KH:]))  # v


def test_qk_norm_rope_writes_the_cache_rows_in_place():
    """Each token's k and v land at its position of its row's cache; a position ≥ S is dropped
    and every other position keeps what it held."""
    qkv, qn, kn, cos, sin = _qk_inputs(jnp.float32)
    kw = dict(num_q_heads=N, num_kv_heads=KH, eps=EPS)
    pos = jnp.asarray([[2, 3, 4], [6, 7, 8]], jnp.int32)          # row 1's last: past S
    ck, cv = jnp.full((B, S, KH, H), -3.0), jnp.full((B, S, KH, H), 5.0)
    want = ref_qk_norm_rope(qkv, qn, kn, cos, sin, **kw)
    rows = (jnp.arange(B)[:, None], pos)
    want_k = ck.at[rows].set(want[:, :, N:N + KH], mode="drop")
    want_v = cv.at[rows].set(want[:, :, N + KH:], mode="drop")
    y, ck2, cv2 = qk_norm_rope(qkv, qn, kn, cos, sin, pos, ck, cv, interpret=True, **kw)
    np.testing.assert_allclose(y, want, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(ck2, want_k, atol=2e-6, rtol=2e-6)
    np.testing.assert_array_equal(cv2, want_v)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope(qkv, qn, kn, cos, sin, pos[:, :2], jnp.zeros((B, S, KH, H)),
                     jnp.zeros((B, S, KH, H)), interpret=True, **kw)
