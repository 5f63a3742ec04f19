"""The Pallas vanilla-Markov sampling kernel (interpret mode on CPU) against its JAX oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.markov_sample.kernel import (MAX_TILE_ELEMS, default_block_v, markov_sample,
                                                 ref_markov_sample)


def _case(B: int, G: int, V: int, r: int, seed: int, dtype):
    rng = np.random.default_rng(seed)
    U = jnp.asarray(rng.normal(size=(B, G, V)) * 2.0, dtype)
    w1 = jnp.asarray(rng.normal(size=(V, r)), dtype)
    w2 = jnp.asarray(rng.normal(size=(V, r)) * 0.5, dtype)
    anchor = jnp.asarray(rng.integers(0, V, size=B), jnp.int32)
    u = jnp.asarray(rng.uniform(size=(B, G)), jnp.float32)
    return u, U, w1, w2, anchor


@pytest.mark.parametrize("B,G,V,r,block_v,dtype,temperature", [
    (1, 1, 37, 4, 16, jnp.float32, 1.0),
    (3, 4, 100, 16, 32, jnp.bfloat16, 0.8),
    (3, 7, 300, 4, 128, jnp.float32, "per_row"),
    (1, 7, 70, 16, None, jnp.bfloat16, 0.0),
    (3, 4, 130, 4, 64, jnp.float32, 0.0),
    (1, 4, 50, 16, 16, jnp.float32, 1.5),
])
def test_kernel_matches_reference(B, G, V, r, block_v, dtype, temperature):
    if temperature == "per_row":  # greedy and sampled rows in one batch
        temperature = jnp.array([1.0, 0.0, 0.5])[:B]
    kernel = jax.jit(functools.partial(markov_sample, block_v=block_v, interpret=True))
    ref = jax.jit(ref_markov_sample)
    for seed in range(2):
        args = _case(B, G, V, r, seed, dtype)
        toks, probs = kernel(*args, temperature)
        want_toks, want_probs = ref(*args, temperature)
        assert toks.dtype == jnp.int32 and toks.shape == (B, G)
        assert probs.dtype == jnp.float32 and probs.shape == (B, G, V)
        np.testing.assert_array_equal(toks, want_toks)
        np.testing.assert_allclose(probs, want_probs, atol=1e-5, rtol=0)


def test_default_block_is_a_power_of_two_within_budget():
    for V, r in [(37, 4), (151_936, 256), (32_000, 16), (1, 1), (5000, 100)]:
        bv = default_block_v(V, r)
        assert bv & (bv - 1) == 0 and bv <= pl.next_power_of_2(V)
        assert bv * pl.next_power_of_2(r) <= MAX_TILE_ELEMS


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
    with pytest.raises(ValueError, match="power of two"):
        markov_sample(u, U, w1, w2, anchor, 1.0, block_v=12, interpret=True)


def test_lowers_for_triton():
    """The non-interpreted kernel lowers to a Triton custom call (no GPU needed), at a real size."""
    from jax import export

    B, G, V, r = 4, 7, 151_936, 256
    S = jax.ShapeDtypeStruct
    specs = (S((B, G), jnp.float32), S((B, G, V), jnp.bfloat16), S((V, r), jnp.bfloat16),
             S((V, r), jnp.bfloat16), S((B,), jnp.int32), S((B,), jnp.float32))
    fn = jax.jit(functools.partial(markov_sample, interpret=False))
    try:
        exported = export.export(fn, platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*specs)
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
        pytest.skip(f"Triton lowering unavailable: {e}")
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text and f"grid_x = {B}" in text
