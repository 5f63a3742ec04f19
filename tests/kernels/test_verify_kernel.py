"""The Pallas verification kernel (interpret mode on CPU) against its pure-JAX oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.sampling import probs_from_logits
from pallas_kernels.verify.kernel import ref_verify, verify


def _case(B: int, G: int, V: int, seed: int, dtype=jnp.float32):
    """Random rows with exact zeros, drafts mostly from p_d, verify lengths covering 0 and γ."""
    rng = np.random.default_rng(seed)
    tp = rng.dirichlet(np.full(V, 0.3), size=(B, G + 1))
    dp = 0.5 * rng.dirichlet(np.full(V, 0.3), size=(B, G)) + 0.5 * tp[:, :G]
    tp[..., :3] = 0.0  # tokens the target forbids → rejections with a non-trivial residual
    tp /= tp.sum(-1, keepdims=True)
    tokens = np.array([[rng.choice(V, p=dp[b, k]) for k in range(G)] for b in range(B)])
    vlen = rng.integers(0, G + 1, size=B)
    vlen[0] = G
    au = rng.uniform(size=(B, G))
    su = rng.uniform(size=B)
    return (jnp.asarray(au, jnp.float32), jnp.asarray(su, jnp.float32),
            jnp.asarray(tp, dtype), jnp.asarray(dp, dtype), jnp.asarray(tokens, jnp.int32),
            jnp.asarray(vlen, jnp.int32))


def _assert_same(got, want):
    for name, g, w in zip(("num_accepted", "next_token", "accepted_mask"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("B,G,V,block_v,dtype", [
    (1, 1, 37, 16, jnp.float32),
    (3, 4, 100, 32, jnp.bfloat16),
    (3, 7, 300, 128, jnp.float32),
    (1, 7, 70, None, jnp.bfloat16),
    (3, 1, 50, 64, jnp.float32),
])
def test_kernel_matches_reference(B, G, V, block_v, dtype):
    kernel = jax.jit(functools.partial(verify, block_v=block_v, interpret=True))
    ref = jax.jit(ref_verify)
    for seed in range(3):  # same shapes: one compilation, more rows covered
        args = _case(B, G, V, seed, dtype)
        _assert_same(kernel(*args), ref(*args))


def test_kernel_greedy():
    B, G, V = 3, 4, 45
    rng = np.random.default_rng(1)
    t_logits = jnp.asarray(rng.normal(size=(B, G + 1, V)), jnp.float32)
    t_arg = np.asarray(t_logits.argmax(-1))
    drafts = t_arg[:, :G].copy()
    drafts[0, 2] = (drafts[0, 2] + 1) % V
    drafts[1, 0] = (drafts[1, 0] + 1) % V
    tp = probs_from_logits(t_logits, 0.0)
    dp = jax.nn.one_hot(drafts, V, dtype=jnp.float32)
    args = (jax.random.uniform(jax.random.key(0), (B, G)), jnp.array([0.3, 0.6, 0.99]), tp, dp,
            jnp.asarray(drafts, jnp.int32), jnp.array([4, 4, 3], jnp.int32))
    got = verify(*args, block_v=16, interpret=True)
    _assert_same(got, ref_verify(*args))
    np.testing.assert_array_equal(got.num_accepted, [2, 0, 3])
    np.testing.assert_array_equal(got.next_token, t_arg[np.arange(B), [2, 0, 3]])


def test_kernel_residual_fallback():
    p = jnp.array([[0.2, 0.3, 0.5, 0.0]] * 3)
    args = (jnp.full((3, 1), 0.5), jnp.array([0.1, 0.4, 0.9]), jnp.stack([p, p], 1), p[:, None],
            jnp.full((3, 1), 3, jnp.int32), jnp.ones((3,), jnp.int32))
    got = verify(*args, interpret=True)
    _assert_same(got, ref_verify(*args))
    np.testing.assert_array_equal(got.next_token, [0, 1, 2])


def test_validators():
    args = list(_case(2, 3, 20, 0))
    bad = {
        2: jnp.zeros((2, 4)),                          # target_probs not rank 3
        3: jnp.zeros((2, 3, 21)),                      # draft_probs V mismatch
        4: jnp.zeros((2, 4), jnp.int32),               # draft_tokens γ mismatch
        5: jnp.zeros((3,), jnp.int32),                 # verify_len B mismatch
        0: jnp.zeros((2, 2)),                          # accept_u γ mismatch
    }
    for fn in (ref_verify, functools.partial(verify, interpret=True)):
        for i, value in bad.items():
            a = list(args)
            a[i] = value
            with pytest.raises(ValueError, match="must"):
                fn(*a)
        a = list(args)
        a[4] = a[4].astype(jnp.float32)
        with pytest.raises(TypeError, match="draft_tokens"):
            fn(*a)
        a = list(args)
        a[2], a[3], a[4], a[0] = (jnp.zeros((2, 1, 20)), jnp.zeros((2, 0, 20)),
                                  jnp.zeros((2, 0), jnp.int32), jnp.zeros((2, 0)))
        with pytest.raises(ValueError, match="γ ≥ 1"):
            fn(*a)
    with pytest.raises(ValueError, match="power of two"):
        verify(*args, block_v=24, interpret=True)


@pytest.mark.parametrize("B,G,V,dtype", [(3, 4, 300, jnp.float32), (4, 7, 200, jnp.bfloat16)])
def test_tpu_kernel_matches_reference(B, G, V, dtype):
    """The Mosaic variant (HBM probabilities, DMA'd windows/tiles, matmul prefix sums)."""
    kernel = jax.jit(functools.partial(verify, block_v=128, interpret=True, backend="mosaic"))
    for seed in range(2):
        args = _case(B, G, V, seed, dtype)
        _assert_same(kernel(*args), ref_verify(*args))
    with pytest.raises(ValueError, match="block_v % 128"):
        verify(*args, block_v=64, interpret=True, backend="mosaic")
    with pytest.raises(ValueError, match="backend"):
        verify(*args, interpret=True, backend="gpu")
