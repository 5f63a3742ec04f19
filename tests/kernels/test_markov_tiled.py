"""The tiled Markov-head sampler (`pallas_kernels.markov_sample.markov_sample_tiled`, two Triton
kernels a slot, interpreted here) against its oracle `ref_markov_sample`: same uniforms → same
tokens and probabilities, with greedy rows, a vocabulary that is not a whole number of tiles, a
rank that is not a power of two, bf16 weights, the first argmax among tied tiles, and the W1 rows
the kernel gathers for each row's previous token (anchors clamped, rows past B masked)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.markov_sample import ref_markov_sample
from pallas_kernels.markov_sample.tiled import markov_sample_tiled, tiled_block_v


def _inputs(B, G, V, r, seed, dtype=jnp.float32):
    rng = np.random.RandomState(seed)
    return (jnp.asarray(rng.rand(B, G), jnp.float32),
            jnp.asarray(rng.randn(B, G, V) * 2, jnp.float32),
            jnp.asarray(rng.randn(V, r), dtype), jnp.asarray(rng.randn(V, r) * 0.3, dtype),
            jnp.asarray(rng.randint(0, V, B), jnp.int32))


@pytest.mark.parametrize("B,G,V,r,temps,block_v,dtype", [
    (3, 4, 1000, 8, [1.0, 0.7, 0.0], 128, jnp.float32),     # 8 tiles, the last partial
    (1, 3, 130, 24, [1.3], 32, jnp.float32),                 # rank not a power of two
    (2, 5, 700, 16, [0.0, 1.0], None, jnp.bfloat16),         # bf16 weights, the default tile
])
def test_matches_the_oracle(B, G, V, r, temps, block_v, dtype):
    u, U, w1, w2, anchor = _inputs(B, G, V, r, seed=B + V)
    t = jnp.asarray(temps, jnp.float32)
    want_tok, want_p = ref_markov_sample(u, U, w1, w2, anchor, t)
    tok, p = markov_sample_tiled(u, U, w1, w2, anchor, t, block_v=block_v, interpret=True)
    np.testing.assert_array_equal(tok, want_tok)
    np.testing.assert_allclose(p, want_p, atol=2e-6, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, atol=1e-5)


def test_greedy_takes_the_first_of_tied_maxima_across_tiles():
    B, G, V, r = 1, 2, 200, 8
    u, U, _, _, anchor = _inputs(B, G, V, r, seed=1)
    U = U.at[:, :, 37].set(50.0).at[:, :, 150].set(50.0)    # ties in tiles 1 and 4 (of 32)
    w = jnp.zeros((V, r), jnp.float32)                        # no bias: the tie stays exact
    tok, p = markov_sample_tiled(u, U, w, w, anchor, 0.0, block_v=32, interpret=True)
    assert tok.tolist() == [[37, 37]]
    assert float(p[0, 0, 37]) == 1.0 and float(p[0, 0].sum()) == 1.0


def test_bad_inputs_and_tiles():
    u, U, w1, w2, anchor = _inputs(1, 2, 64, 8, seed=2)
    with pytest.raises(TypeError, match="share a dtype"):
        markov_sample_tiled(u, U, w1, w2.astype(jnp.bfloat16), anchor, 1.0, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        markov_sample_tiled(u, U, w1, w2, anchor, 1.0, block_v=48, interpret=True)
    # a W2 tile in shared memory stays within its budget: Qwen3's r = 256
    assert tiled_block_v(256, 2) == 128 and tiled_block_v(256, 4) == 64
    assert tiled_block_v(8, 4) == 512


def test_each_row_gathers_the_w1_row_of_its_own_clamped_previous_token():
    """`markov_tiles` gathers W1[x_{k−1}] itself: W1's rows large and unlike each other (the
    bias decides the token), anchors below 0 and past V − 1 clamped to the vocabulary's ends,
    and B = 5 rows (the kernel's 16, the rows past B masked)."""
    B, G, V, r = 5, 4, 300, 12
    u, U, _, w2, _ = _inputs(B, G, V, r, seed=7)
    rng = np.random.RandomState(8)
    w1 = jnp.asarray(rng.randn(V, r) * 8, jnp.float32)
    anchor = jnp.asarray([-4, V + 7, 0, V - 1, 123], jnp.int32)
    t = jnp.asarray([0.0, 1.0, 0.0, 0.5, 0.0], jnp.float32)
    clamped = jnp.clip(anchor, 0, V - 1)
    want_tok, want_p = ref_markov_sample(u, U, w1, w2, clamped, t)
    tok, p = markov_sample_tiled(u, U, w1, w2, anchor, t, block_v=64, interpret=True)
    np.testing.assert_array_equal(tok, want_tok)
    np.testing.assert_allclose(p, want_p, atol=2e-6, rtol=1e-4)
    # the rows' first tokens follow their anchors' W1 rows: another row's (or a wrapped
    # index's) would pick another token
    other_tok, _ = ref_markov_sample(u, U, w1, w2, jnp.roll(clamped, 1), t)
    assert (np.asarray(other_tok)[:, 0] != np.asarray(want_tok)[:, 0]).sum() >= 3
