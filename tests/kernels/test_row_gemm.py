"""The decoding layer's products with the work before them (`pallas_kernels.row_gemm`, Triton,
interpreted on CPU) against their pure-JAX oracles, in fp32 and bf16: the residual sum and
RMS norm before a product, with the delta as rows, as a split-K product's parts or absent;
the SwiGLU activation before a product split into parts; rows from one to a verification
block's, padded to the kernels' tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import layer_attention
from pallas_kernels.row_gemm import (merge_gemm, norm_gemm, ref_merge_gemm, ref_norm_gemm,
                                     ref_swiglu_gemm, swiglu_gemm, swiglu_parts)

EPS = 1e-6


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def _close(got, want, dtype):
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(_f32(got), _f32(want), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("delta_kind", ["rows", "parts", "none"])
def test_norm_gemm_matches_the_oracle(dtype, rows, delta_kind):
    """s = h + delta and RMSNorm(s) · weight @ w: both outputs equal the oracle's (XLA's
    `add_rms_norm` then the product); the parts' rows past R are never read (NaN there)."""
    ks = jax.random.split(jax.random.key(rows), 5)
    D, N = 96, 64
    h = jax.random.normal(ks[0], (rows, D)).astype(dtype)
    delta = {"rows": jax.random.normal(ks[1], (rows, D)).astype(dtype),
             "parts": jax.random.normal(ks[1], (4, rows + 2, D), jnp.float32)
             .at[:, rows:].set(jnp.nan),
             "none": None}[delta_kind]
    weight = (1 + 0.1 * jax.random.normal(ks[2], (D,))).astype(dtype)
    w = (0.1 * jax.random.normal(ks[3], (D, N))).astype(dtype)
    got = norm_gemm(h, delta, weight, w, eps=EPS, block_n=16, block_k=32, interpret=True)
    want = ref_norm_gemm(h, delta, weight, w, eps=EPS)
    for g, r in zip(got, want):
        assert g.dtype == dtype and g.shape == r.shape and np.isfinite(_f32(g)).all()
        _close(g, r, dtype)
    # the default tiles (one program for the 64 columns, the contraction whole) agree
    _close(norm_gemm(h, delta, weight, w, eps=EPS, interpret=True)[1], want[1], dtype)
    if delta_kind != "none":   # the delta is not ignored
        assert float(np.abs(_f32(got[0]) - _f32(h)).max()) > 0.1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_gemm_reads_two_weights_where_they_lie(dtype):
    """w as two weights (a drafter's q and k|v): the product is theirs with their columns
    concatenated, each tile of output columns from its own weight."""
    ks = jax.random.split(jax.random.key(7), 5)
    D = 64
    h = jax.random.normal(ks[0], (5, D)).astype(dtype)
    delta = jax.random.normal(ks[1], (2, 5, D), jnp.float32)
    weight = (1 + 0.1 * jax.random.normal(ks[2], (D,))).astype(dtype)
    wq = (0.1 * jax.random.normal(ks[3], (D, 48))).astype(dtype)
    wkv = (0.1 * jax.random.normal(ks[4], (D, 32))).astype(dtype)
    got = norm_gemm(h, delta, weight, (wq, wkv), eps=EPS, block_n=16, interpret=True)
    want = ref_norm_gemm(h, delta, weight, jnp.concatenate([wq, wkv], -1), eps=EPS)
    assert got[1].shape == (5, 80)
    for g, r in zip(got, want):
        _close(g, r, dtype)
    with pytest.raises(ValueError, match="norm_gemm"):   # 48 columns: no 32-column tiles
        norm_gemm(h, delta, weight, (wq, wkv), eps=EPS, block_n=32, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("source", ["rows", "parts"])
def test_norm_gemm_reads_every_layers_weight_where_it_lies(dtype, source):
    """w as five weights (a drafter's context: the fc product normed once, then each draft
    layer's k|v product of it), the fc product given as rows with no delta, or as its
    split-K parts with no h (summed and rounded in the kernel): the product is theirs with
    their columns concatenated in order, each tile from its own weight."""
    ks = jax.random.split(jax.random.key(8), 7)
    D = 64
    h = jax.random.normal(ks[0], (8, D)).astype(dtype)
    parts = jax.random.normal(ks[0], (5, 8, D), jnp.float32)
    h, delta = (h, None) if source == "rows" else (None, parts)
    weight = (1 + 0.1 * jax.random.normal(ks[1], (D,))).astype(dtype)
    ws = tuple((0.1 * jax.random.normal(k, (D, 32))).astype(dtype) for k in ks[2:])
    got = norm_gemm(h, delta, weight, ws, eps=EPS, block_n=16, interpret=True)
    want = ref_norm_gemm(h, delta, weight, jnp.concatenate(ws, -1), eps=EPS)
    assert got[1].shape == (8, 160)
    for g, r in zip(got, want):
        assert g.dtype == dtype
        _close(g, r, dtype)
    if source == "parts":   # s is the parts' sum
        _close(got[0], parts.sum(0), dtype)
        with pytest.raises(ValueError, match="without h"):
            norm_gemm(None, parts[0], weight, ws, eps=EPS, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 9])
def test_swiglu_gemm_matches_the_oracle(dtype, rows):
    """(silu(gate) · up) @ w as f32 parts along the contraction: each part equals the
    oracle's (`jax.nn.silu(gate) * up` in the dtype, then the product of that part), and the
    parts sum to the whole product."""
    ks = jax.random.split(jax.random.key(10 + rows), 2)
    F, N = 128, 48
    gu = (2 * jax.random.normal(ks[0], (rows, 2 * F))).astype(dtype)
    w = (0.1 * jax.random.normal(ks[1], (F, N))).astype(dtype)
    got = swiglu_gemm(gu, w, parts=2, block_n=16, block_k=32, interpret=True)
    want = ref_swiglu_gemm(gu, w, parts=2)
    assert got.shape == (2, rows, N) and got.dtype == jnp.float32
    _close(got, want, dtype)
    gate, up = jnp.split(gu, 2, axis=-1)
    whole = jnp.einsum("RF,FN->RN", jax.nn.silu(gate) * up, w,
                       preferred_element_type=jnp.float32)
    _close(got.sum(0), whole, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 1), (1, 3)])
def test_merge_gemm_merges_the_attention_splits_into_the_product(dtype, batch, tokens):
    """The attention kernel's unmerged cache splits (`layer_attention(merge=False)`) merged in
    the product's kernel: its parts equal the oracle's, and they sum to the merged
    attention's product (the merge kernel's, then XLA's product) for every row and token."""
    ks = jax.random.split(jax.random.key(batch * 10 + tokens), 7)
    N, Kh, H, S, D = 4, 2, 32, 128, 48
    qkv = jax.random.normal(ks[0], (batch, tokens, N + 2 * Kh, H)).astype(dtype)
    ck, cv = (jax.random.normal(k, (batch, S, Kh, H)).astype(dtype) for k in ks[1:3])
    freq = jax.random.uniform(ks[4], (H // 2,))
    start = jnp.asarray([40, 100, 7][:batch], jnp.int32)
    norm = (1 + 0.1 * jax.random.normal(ks[5], (H,))).astype(dtype)
    w = (0.1 * jax.random.normal(ks[6], (N * H, D))).astype(dtype)
    kw = dict(num_q_heads=N, eps=EPS, scale=H ** -0.5, interpret=True)
    attn = layer_attention(qkv, norm, norm, freq, start, ck, cv, **kw)[0]
    partials = layer_attention(qkv, norm, norm, freq, start, ck, cv, merge=False, **kw)[0]
    got = merge_gemm(*partials, w, num_tokens=tokens, dtype=dtype, parts=2, block_n=16,
                     interpret=True)
    assert got.shape == (2, batch, tokens, D) and got.dtype == jnp.float32
    _close(got, ref_merge_gemm(*partials, w, num_tokens=tokens, dtype=dtype, parts=2), dtype)
    whole = jnp.einsum("BTF,FD->BTD", attn.reshape(batch, tokens, N * H), w,
                       preferred_element_type=jnp.float32)
    _close(got.sum(0), whole, dtype)


def test_the_tiles_and_parts_follow_the_shapes():
    """The default split: about one program a multiprocessor, parts a whole number of tiles
    deep; shapes the kernels cannot tile are refused by name."""
    assert swiglu_parts(9728, 2560) == 2        # Qwen3-4B's down product: 80 tiles × 2
    assert swiglu_parts(12288, 4096) == 1       # Qwen3-8B's: 128 tiles
    h = jnp.zeros((2, 40), jnp.float32)
    with pytest.raises(ValueError, match="norm_gemm"):
        norm_gemm(h, None, jnp.ones((40,)), jnp.zeros((40, 32)), eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="norm_gemm"):
        norm_gemm(jnp.zeros((65, 32)), None, jnp.ones((32,)), jnp.zeros((32, 32)), eps=EPS,
                  interpret=True)
    with pytest.raises(ValueError, match="swiglu_gemm"):
        swiglu_gemm(jnp.zeros((2, 64)), jnp.zeros((32, 24)), interpret=True)
    o, m = jnp.zeros((1, 2, 4, 8, 32)), jnp.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="merge_gemm"):   # 5 tokens: more than the tile's 4
        merge_gemm(o, m, m, jnp.zeros((128, 32)), num_tokens=5, dtype=jnp.float32,
                   interpret=True)
