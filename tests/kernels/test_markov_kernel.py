"""The Pallas vanilla-Markov sampling kernel (interpret mode on CPU) against its JAX oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.markov_sample.kernel import (MAX_TILE_ELEMS, default_block_b,
                                                 default_block_v, markov_sample,
                                                 ref_markov_sample)


def _case(B: int, G: int, V: int, r: int, seed: int, dtype):
    rng = np.random.default_rng(seed)
    U = jnp.asarray(rng.normal(size=(B, G, V)) * 2.0, dtype)
    w1 = jnp.asarray(rng.normal(size=(V, r)), dtype)
    w2 = jnp.asarray(rng.normal(size=(V, r)) * 0.5, dtype)
    anchor = jnp.asarray(rng.integers(0, V, size=B), jnp.int32)
    u = jnp.asarray(rng.uniform(size=(B, G)), jnp.float32)
    return u, U, w1, w2, anchor


@pytest.mark.parametrize("B,G,V,r,block_v,block_b,dtype,temperature", [
    (1, 1, 37, 4, 16, None, jnp.float32, 1.0),
    (3, 4, 100, 16, 32, None, jnp.bfloat16, 0.8),
    (3, 7, 300, 4, 128, None, jnp.float32, "per_row"),
    (1, 7, 70, 16, None, None, jnp.bfloat16, 0.0),
    (5, 4, 130, 4, 64, 2, jnp.float32, 0.0),       # 3 row blocks, the last one padded
    (1, 4, 50, 16, 16, None, jnp.float32, 1.5),
    (20, 3, 200, 24, 64, 16, jnp.bfloat16, "per_row"),  # two programs of 16 rows
    (8, 5, 64, 32, 16, 8, jnp.float32, 1.0),
])
def test_kernel_matches_reference(B, G, V, r, block_v, block_b, dtype, temperature):
    if temperature == "per_row":  # greedy and sampled rows in one batch
        temperature = jnp.asarray(np.resize([1.0, 0.0, 0.5], B), jnp.float32)
    kernel = jax.jit(functools.partial(markov_sample, block_v=block_v, block_b=block_b,
                                       interpret=True, backend="triton"))
    ref = jax.jit(ref_markov_sample)
    for seed in range(2):
        args = _case(B, G, V, r, seed, dtype)
        toks, probs = kernel(*args, temperature)
        want_toks, want_probs = ref(*args, temperature)
        assert toks.dtype == jnp.int32 and toks.shape == (B, G)
        assert probs.dtype == jnp.float32 and probs.shape == (B, G, V)
        np.testing.assert_array_equal(toks, want_toks)
        np.testing.assert_allclose(probs, want_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("B,G,V,r,dtype,temperature", [
    (3, 4, 300, 16, jnp.float32, "per_row"),
    (9, 3, 200, 8, jnp.bfloat16, 0.0),
])
def test_tpu_kernel_matches_reference(B, G, V, r, dtype, temperature):
    """The Mosaic variant (HBM operands, DMA'd tiles, matmul prefix sums) in interpret mode."""
    if temperature == "per_row":
        temperature = jnp.asarray(np.resize([1.0, 0.0, 0.5], B), jnp.float32)
    kernel = jax.jit(functools.partial(markov_sample, block_v=128, block_b=8, interpret=True,
                                       backend="mosaic"))
    args = _case(B, G, V, r, 0, dtype)
    toks, probs = kernel(*args, temperature)
    want_toks, want_probs = ref_markov_sample(*args, temperature)
    np.testing.assert_array_equal(toks, want_toks)
    np.testing.assert_allclose(probs, want_probs, atol=1e-5, rtol=0)


def test_default_blocks_are_powers_of_two_within_budget():
    for V, r in [(37, 4), (151_936, 256), (32_000, 16), (1, 1), (5000, 100)]:
        bv = default_block_v(V, r)
        assert bv & (bv - 1) == 0 and 16 <= bv <= max(pl.next_power_of_2(V), 16)
        assert bv * max(pl.next_power_of_2(r), 16) <= MAX_TILE_ELEMS
    for B, want in [(1, 16), (16, 16), (17, 32), (64, 64), (500, 64)]:
        assert default_block_b(B) == want  # ≥ 16 rows: the dot's M dimension on Triton


def test_validators():
    u, U, w1, w2, anchor = _case(2, 3, 20, 4, 0, jnp.float32)
    cases = [
        ((u, U[0], w1, w2, anchor, 1.0), ValueError, "base_logits"),
        ((u, U, w1[:-1], w2, anchor, 1.0), ValueError, "w1"),
        ((u, U, w1, w2.T, anchor, 1.0), ValueError, "w2"),
        ((u, U, w1, w2, anchor[:1], 1.0), ValueError, "anchor"),
        ((u[:, :2], U, w1, w2, anchor, 1.0), ValueError, "uniforms"),
        ((u, U, w1, w2, anchor, jnp.ones(3)), ValueError, "temperature"),
        ((u, U, w1, w2, anchor.astype(jnp.float32), 1.0), TypeError, "anchor"),
        ((u, U[:, :0], w1, w2, anchor, 1.0), ValueError, "γ ≥ 1"),
    ]
    for fn in (ref_markov_sample, functools.partial(markov_sample, interpret=True)):
        for args, exc, match in cases:
            with pytest.raises(exc, match=match):
                fn(*args)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        markov_sample(u, U, w1, w2, anchor, 1.0, block_v=12, interpret=True)
    with pytest.raises(ValueError, match="block_b must be a power of two"):
        markov_sample(u, U, w1, w2, anchor, 1.0, block_b=3, interpret=True)
    with pytest.raises(ValueError, match="backend"):
        markov_sample(u, U, w1, w2, anchor, 1.0, interpret=True, backend="cuda")
    with pytest.raises(ValueError, match="block_v % 128"):
        markov_sample(u, U, w1, w2, anchor, 1.0, block_v=64, interpret=True, backend="mosaic")


def test_kernels_import_nothing_from_dspark_jax():
    import ast
    import pathlib

    import pallas_kernels

    root = pathlib.Path(pallas_kernels.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 5
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "dspark_jax" for n in names), f


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_sampled_draws_follow_the_markov_distribution():
    """T = 1: 20,480 draws of (x1, x2) from the kernel (fresh uniforms, not the oracle's) follow
    the exact joint p(x1)·p(x2 | x1) of the vanilla Markov head, as do the pure-JAX sampler's;
    a stateless head (x2 conditioned on the anchor instead of x1) is rejected."""
    from dspark_jax.decoding.markov_sampling import sequential_markov_sample
    from tests.decoding.test_acceptance_rule import chi2_crit, chi2_stat

    V, G, r, B, calls = 5, 2, 4, 64, 320
    rng = np.random.default_rng(7)
    U = 0.8 * rng.normal(size=(G, V))
    w1, w2 = rng.normal(size=(V, r)), 0.5 * rng.normal(size=(V, r))
    anchor = 2
    p1 = _softmax(U[0] + w1[anchor] @ w2.T)                                  # [V]
    p2 = _softmax(U[1][None] + w1 @ w2.T)                                     # [V(x1), V]
    joint = (p1[:, None] * p2).ravel()
    stateless = (p1[:, None] * p2[anchor][None, :]).ravel()
    assert np.abs(joint - stateless).max() > 0.02  # the broken rule is really different

    args = (jnp.asarray(np.broadcast_to(U, (B, G, V)), jnp.float32), jnp.asarray(w1, jnp.float32),
            jnp.asarray(w2, jnp.float32), jnp.full((B,), anchor, jnp.int32))
    kernel = functools.partial(markov_sample, block_b=B, interpret=True, backend="triton")

    @jax.jit
    def draws(key):
        us = jax.random.uniform(key, (calls, B, G))
        return jax.lax.map(lambda u: kernel(u, *args, 1.0)[0], us).reshape(-1, G)

    @jax.jit
    def jax_draws(key):
        keys = jax.random.split(key, calls)
        return jax.lax.map(lambda k: sequential_markov_sample(k, *args, 1.0)[0], keys
                           ).reshape(-1, G)

    pairs = lambda t: np.asarray(t[:, 0] * V + t[:, 1])  # noqa: E731
    got = pairs(draws(jax.random.key(11)))
    ref = pairs(jax_draws(jax.random.key(12)))
    stat, df = chi2_stat(got, joint)
    assert stat < chi2_crit(df), (stat, chi2_crit(df))
    stat_ref, _ = chi2_stat(ref, joint)
    assert stat_ref < chi2_crit(df)
    stat_broken, _ = chi2_stat(got, stateless)
    assert stat_broken > 5 * chi2_crit(df)
