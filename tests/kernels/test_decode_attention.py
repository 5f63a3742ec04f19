"""The decode-attention kernels (Triton, interpreted on CPU) against their pure-JAX oracles:
own keys apart under any mask, over ragged cache prefixes, rows that see nothing and several
cache splits; the layer's attention from its raw q/k/v product (q/k norms, RoPE, the cache
write) in fp32 and bf16; and their Triton lowering for CUDA at Qwen3-8B's decoding step."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import (decode_attention, layer_attention,
                                             ref_decode_attention, ref_layer_attention,
                                             splits_for)

B, N, KH, H, S = 3, 8, 2, 16, 128
SCALE = H ** -0.5
TILES = dict(block_k=16, interpret=True)


def _inputs(seed: int, t: int, q_len: int):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, t, N, H))
    ck, cv = (jax.random.normal(k, (B, S, KH, H)) for k in ks[1:3])
    ok, ov = (jax.random.normal(k, (B, q_len, KH, H)) for k in ks[3:5])
    return q, ck, cv, ok, ov


@pytest.mark.parametrize("t,q_len,splits", [(1, 1, 2), (3, 5, 4), (8, 8, 8), (37, 37, 2)])
def test_own_keys_apart_match_the_oracle(t, q_len, splits):
    """Own keys [B, Q, Kh, H] under an arbitrary mask (a draft tree's), cache prefixes 0, mid
    and whole; row 0 sees nothing at all and gives zeros. At T = 37 (T·G = 148 query rows) the
    queries run in two tiles, the last one partial."""
    q, ck, cv, ok, ov = _inputs(0, t, q_len)
    start = jnp.asarray([0, 57, S], jnp.int32)
    mask = jax.random.bernoulli(jax.random.key(9), 0.6, (B, t, q_len)).at[0].set(False)
    want = ref_decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE)
    got = decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE, splits=splits, **TILES)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    assert not np.asarray(got[0]).any()


@pytest.mark.parametrize("t,window,splits", [(1, 20, 2), (4, 33, 4), (37, 70, 2)])
def test_a_sliding_window_matches_the_oracle(t, window, splits):
    """A sliding-window layer (Gemma4's): query t at start + t sees the cache above
    start + t − window, across cache splits and query tiles; tiles below every window unread
    (a window wider than the cache sees it all)."""
    q, ck, cv, ok, ov = _inputs(6, t, t)
    start = jnp.asarray([0, 57, S], jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (B, t, t))
    want = ref_decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE, window=window)
    got = decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE, window=window,
                           splits=splits, **TILES)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    full = ref_decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE)
    assert not np.allclose(np.asarray(got[2]), np.asarray(full[2]))   # the window cut keys


def test_query_tiles_that_fill_the_gpu_write_their_rows_without_a_merge(monkeypatch):
    """When the query tiles alone make enough programs, the cache is one split and each program
    writes its normalised rows: still the oracle, rows seeing nothing still zeros."""
    import pallas_kernels.decode_attention.kernel as K

    monkeypatch.setattr(K, "TARGET_PROGRAMS", 8)   # 3 rows × 2 key heads × 2 query tiles
    q, ck, cv, ok, ov = _inputs(4, 37, 37)
    start = jnp.asarray([0, 57, S], jnp.int32)
    mask = jax.random.bernoulli(jax.random.key(2), 0.6, (B, 37, 37)).at[0].set(False)
    want = ref_decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE)
    jaxpr = str(jax.make_jaxpr(lambda *a: K.decode_attention(*a, scale=SCALE, **TILES))(
        q, ck, cv, start, ok, ov, mask))
    assert "decode_attention_merge" not in jaxpr
    got = K.decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE, block_k=16,
                             interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    assert not np.asarray(got[0]).any()


def _layer_inputs(dtype, t: int = 3):
    ks = jax.random.split(jax.random.key(5), 4)
    qkv = jax.random.normal(ks[0], (B, t, N + 2 * KH, H)).astype(dtype)
    ck, cv = (jax.random.normal(k, (B, S, KH, H)).astype(dtype) for k in ks[1:3])
    qn = (1 + 0.1 * jax.random.normal(ks[3], (H,))).astype(dtype)
    freq = 1.0 / 10000.0 ** (jnp.arange(H // 2, dtype=jnp.float32) * 2 / H)
    return qkv, qn, qn[::-1], freq.at[-2:].set(0.0), ck, cv   # a zero: a pair held still


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("normed", [True, False])
def test_layer_attention_matches_the_oracle(dtype, normed):
    """From the raw q/k/v product: q/k norms (Qwen3's; Llama's none) and RoPE in the kernel,
    the T tokens causal to each other after cache prefixes 0, mid and full; the returned k / v
    rows are the oracle's."""
    qkv, qn, kn, freq, ck, cv = _layer_inputs(dtype)
    norms = (qn, kn) if normed else (None, None)
    start = jnp.asarray([0, 57, S - 3], jnp.int32)
    kw = dict(num_q_heads=N, eps=1e-6, scale=SCALE)
    want = ref_layer_attention(qkv, *norms, freq, start, ck, cv, **kw)
    got = layer_attention(qkv, *norms, freq, start, ck, cv, splits=4, **kw, **TILES)
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(_f32(got[0]), _f32(want[0]), atol=tol, rtol=tol)
    for g, w in zip(got[1:], want[1:]):      # the rows: the same arithmetic, the same values
        np.testing.assert_allclose(_f32(g), _f32(w), atol=tol, rtol=tol)


def test_layer_attention_of_a_draft_block():
    """A drafter's parallel block (`causal=False`): every token sees all T own keys and the
    cache below its anchor; equal to the oracle, and not to the causal form (so the flag reaches
    the kernel)."""
    qkv, qn, kn, freq, ck, cv = _layer_inputs(jnp.float32)
    start = jnp.asarray([0, 57, S - 3], jnp.int32)
    kw = dict(num_q_heads=N, eps=1e-6, scale=SCALE)
    want = ref_layer_attention(qkv, qn, kn, freq, start, ck, cv, causal=False, **kw)
    got = layer_attention(qkv, qn, kn, freq, start, ck, cv, causal=False, splits=4, **kw,
                          **TILES)
    for g, w in zip(got, want):
        np.testing.assert_allclose(_f32(g), _f32(w), atol=2e-6, rtol=2e-6)
    causal = ref_layer_attention(qkv, qn, kn, freq, start, ck, cv, **kw)[0]
    assert float(jnp.max(jnp.abs(causal[:, :-1] - got[0][:, :-1]))) > 1e-3
    with pytest.raises(ValueError, match="causal"):
        layer_attention(qkv, qn, kn, freq, start, ck, cv, causal=False, write=True, **kw)


def test_layer_attention_writes_the_rows_into_the_cache():
    """With `write` the tokens' k / v rows land at start + t of their row's cache, a position
    ≥ S is dropped, every other position keeps its value, and the attention is unchanged."""
    qkv, qn, kn, freq, ck, cv = _layer_inputs(jnp.float32)
    start = jnp.asarray([0, 57, S - 2], jnp.int32)                # row 2's last token: past S
    kw = dict(num_q_heads=N, eps=1e-6, scale=SCALE)
    attn, k, v = ref_layer_attention(qkv, qn, kn, freq, start, ck, cv, **kw)
    rows = (jnp.arange(B)[:, None], start[:, None] + jnp.arange(3))
    want_k, want_v = ck.at[rows].set(k, mode="drop"), cv.at[rows].set(v, mode="drop")
    got, ck2, cv2 = layer_attention(qkv, qn, kn, freq, start, ck, cv, write=True, **kw,
                                    **TILES)
    np.testing.assert_allclose(got, attn, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(ck2, want_k, atol=2e-6, rtol=2e-6)
    np.testing.assert_array_equal(cv2, want_v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_attention_sums_a_split_k_products_parts(dtype):
    """The q/k/v product as the f32 parts of a split-K GEMM [parts, B, Tq ≥ T, heads, H]: each
    program sums its rows' parts and rounds them to the cache's dtype before the norms; equal
    to the oracle on the summed product, rows past T (NaN here) unread, the cache written."""
    qkv, qn, kn, freq, ck, cv = _layer_inputs(dtype)
    parts = jax.random.normal(jax.random.key(5), (4, *qkv.shape), jnp.float32) * 0.5
    parts = parts.at[-1].add(qkv.astype(jnp.float32) - parts.sum(0))   # sums to qkv
    padded = jnp.concatenate([parts, jnp.full_like(parts[:, :, :1], jnp.nan)], axis=2)
    start = jnp.asarray([0, 57, S - 3], jnp.int32)
    kw = dict(num_q_heads=N, eps=1e-6, scale=SCALE, num_tokens=3)
    want = ref_layer_attention(padded, qn, kn, freq, start, ck, cv, **kw)
    got = layer_attention(padded, qn, kn, freq, start, ck, cv, splits=4, **kw, **TILES)
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    for g, w in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_allclose(_f32(g), _f32(w), atol=tol, rtol=tol)
    whole = ref_layer_attention(qkv, qn, kn, freq, start, ck, cv, **kw)[0]
    np.testing.assert_allclose(_f32(got[0]), _f32(whole), atol=max(tol, 1e-5), rtol=tol)
    written = layer_attention(padded, qn, kn, freq, start, ck, cv, write=True, **kw,
                              **TILES)
    rows = (jnp.arange(B)[:, None], start[:, None] + jnp.arange(qkv.shape[1]))
    np.testing.assert_allclose(_f32(written[1]), _f32(ck.at[rows].set(want[1], mode="drop")),
                               atol=tol, rtol=tol)
    for bad in (padded.astype(jnp.bfloat16), padded[:, :, :2]):   # not f32; fewer rows than T
        with pytest.raises(ValueError, match="parts"):
            layer_attention(bad, qn, kn, freq, start, ck, cv, **kw, **TILES)
    kw.pop("num_tokens")   # padded rows: T is not the parts' row count
    for fn in (layer_attention, ref_layer_attention):
        with pytest.raises(ValueError, match="num_tokens"):
            fn(padded, qn, kn, freq, start, ck, cv, **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,window,split_k", [(1, 20, False), (5, 3, True), (8, 40, True)])
def test_layer_attention_of_a_gemma4_sliding_layer(dtype, t, window, split_k):
    """Gemma4's sliding layer: v RMS-normed without a scale, query t (at start + t) seeing the
    cache above start + t − window and the own keys within the window, from the raw product or
    a split-K product's parts; equal to the oracle, and the window and the v norm both change
    the result (so both reach the kernel)."""
    qkv, qn, kn, freq, ck, cv = _layer_inputs(dtype, t)
    qkv = qkv.at[:, :, N + KH:].multiply(3.0)              # v rows far from unit RMS
    start = jnp.asarray([0, 57, S - t], jnp.int32)
    kw = dict(num_q_heads=N, eps=1e-6, scale=SCALE, num_tokens=t)
    product = qkv
    if split_k:   # four f32 parts summing to the product, a row past T (NaN) unread
        parts = jax.random.normal(jax.random.key(7), (4, *qkv.shape), jnp.float32) * 0.5
        parts = parts.at[-1].add(qkv.astype(jnp.float32) - parts.sum(0))
        product = jnp.concatenate([parts, jnp.full_like(parts[:, :, :1], jnp.nan)], axis=2)
    gemma = dict(v_norm=True, window=window)
    want = ref_layer_attention(product, qn, kn, freq, start, ck, cv, **kw, **gemma)
    got = layer_attention(product, qn, kn, freq, start, ck, cv, splits=4, **kw, **gemma,
                          **TILES)
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    for g, w in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_allclose(_f32(g), _f32(w), atol=tol, rtol=tol)
    vf = _f32(want[2])
    np.testing.assert_allclose(np.sqrt((vf * vf).mean(-1)), 1.0, rtol=tol * 10)
    unnormed = ref_layer_attention(product, qn, kn, freq, start, ck, cv, **kw,
                                   window=window)[0]
    assert float(jnp.max(jnp.abs(_f32(unnormed) - _f32(got[0])))) > 0.1
    if window < S:   # row 2 at S − t: its window cuts the cache
        whole = ref_layer_attention(product, qn, kn, freq, start, ck, cv, **kw,
                                    v_norm=True)[0]
        assert float(jnp.max(jnp.abs(_f32(whole[2]) - _f32(got[0][2])))) > 1e-2
    written = layer_attention(product, qn, kn, freq, start, ck, cv, write=True, **kw,
                              **gemma, **TILES)
    rows = (jnp.arange(B)[:, None], start[:, None] + jnp.arange(t))
    np.testing.assert_allclose(_f32(written[0]), _f32(want[0]), atol=tol, rtol=tol)
    np.testing.assert_allclose(_f32(written[2]), _f32(cv.at[rows].set(want[2], mode="drop")),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("split_k", [False, True])
def test_layer_attention_of_a_gemma4_k_eq_v_layer(split_k):
    """Gemma4's k=v layer: a product [B, T, N + Kh, H] without v heads, the values the raw k
    heads normed without a scale; equal to the oracle and to the same attention given the k
    heads twice as k and v."""
    qkv, qn, kn, freq, ck, cv = _layer_inputs(jnp.float32, 4)
    qk = qkv[:, :, :N + KH]
    start = jnp.asarray([0, 57, S - 4], jnp.int32)
    kw = dict(num_q_heads=N, eps=1e-6, scale=SCALE, v_norm=True, num_tokens=4)
    product = qk
    if split_k:
        parts = jax.random.normal(jax.random.key(8), (2, *qk.shape), jnp.float32) * 0.5
        product = parts.at[-1].add(qk - parts.sum(0))
    want = ref_layer_attention(product, qn, kn, freq, start, ck, cv, v_from_k=True, **kw)
    got = layer_attention(product, qn, kn, freq, start, ck, cv, v_from_k=True, splits=2,
                          **kw, **TILES)
    for g, w in zip(got, want):
        np.testing.assert_allclose(_f32(g), _f32(w), atol=2e-6, rtol=2e-6)
    twice = jnp.concatenate([qk, qkv[:, :, N:N + KH]], axis=2)
    same = ref_layer_attention(twice, qn, kn, freq, start, ck, cv, **kw)
    for g, w in zip(got, same):
        np.testing.assert_allclose(_f32(g), _f32(w), atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="heads"):
        layer_attention(qk, qn, kn, freq, start, ck, cv, **kw, **TILES)


def test_splits_and_bad_shapes():
    assert splits_for(1, 8, 4224) == 32 and splits_for(64, 8, 4224) == 2
    assert splits_for(1, 8, 64) == 2             # one tile: still a split and the own part
    q, ck, cv, ok, ov = _inputs(3, 2, 2)
    mask = jnp.ones((B, 2, 2), bool)
    start = jnp.zeros((B,), jnp.int32)
    with pytest.raises(ValueError, match="group"):
        decode_attention(q[:, :, :3], ck, cv, start, ok, ov, mask, scale=SCALE, **TILES)
    with pytest.raises(ValueError, match="own_mask"):
        decode_attention(q, ck, cv, start, ok, ov, mask[:, :1], scale=SCALE, **TILES)
    with pytest.raises(ValueError, match="multiple of block_k"):
        decode_attention(q, ck[:, :100], cv[:, :100], start, ok, ov, mask, scale=SCALE,
                         **TILES)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE, splits=3, **TILES)


@pytest.mark.gpu
def test_lowers_for_gpu_with_triton_at_a_decoding_shape():
    """The split and merge kernels lower to Triton for CUDA at Qwen3-8B's decoding step (32
    heads over 8, H 128, a 4224-position cache, one token): the splits fill an H200's SMs."""
    from jax import export

    spec = jax.ShapeDtypeStruct
    qkv = spec((1, 1, 48, 128), jnp.bfloat16)
    norm = spec((128,), jnp.bfloat16)
    freq = spec((64,), jnp.float32)
    cache = spec((1, 4224, 8, 128), jnp.bfloat16)
    start = spec((1,), jnp.int32)
    fn = functools.partial(layer_attention, scale=128 ** -0.5, num_q_heads=32, eps=1e-6,
                           write=True)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    try:
        text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
            qkv, norm, norm, freq, start, cache, cache).mlir_module()
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
        pytest.skip(f"Triton lowering unavailable: {e}")
    for name in ("layer_attention_splits", "decode_attention_merge"):
        assert name in text, name
    grids = [int(x) * int(y) * int(z) for x, y, z in re.findall(
        r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)]
    assert sorted(grids) == [8, 256], grids


@pytest.mark.gpu
@pytest.mark.parametrize("h,heads,window,v_from_k", [(256, 32, 1024, False),
                                                     (512, 32, 0, False), (512, 24, 0, True)])
def test_lowers_for_gpu_with_triton_at_gemma4_shapes(h, heads, window, v_from_k):
    """Gemma4-12B's one-token step (16 query heads over 8, an 8192-position cache, the q/k/v
    product as two split-K parts of two rows): a sliding layer (heads of 256, its window), a
    full layer (heads of 512) and a k=v full layer lower to Triton with the v norm and the
    cache write."""
    from jax import export

    spec = jax.ShapeDtypeStruct
    parts = spec((2, 1, 2, heads, h), jnp.float32)
    norm = spec((h,), jnp.bfloat16)
    freq = spec((h // 2,), jnp.float32)
    cache = spec((1, 8192, 8, h), jnp.bfloat16)
    fn = functools.partial(layer_attention, scale=1.0, num_q_heads=16, eps=1e-6, write=True,
                           v_norm=True, window=window, v_from_k=v_from_k, num_tokens=1)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    try:
        text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
            parts, norm, norm, freq, spec((1,), jnp.int32), cache, cache).mlir_module()
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
        pytest.skip(f"Triton lowering unavailable: {e}")
    for name in ("layer_attention_splits", "decode_attention_merge"):
        assert name in text, name


@pytest.mark.gpu
def test_lowers_for_gpu_with_triton_at_a_tree_shape():
    """A draft tree's verification at Qwen3-8B's heads (65 cells a row, 64 rows, a 1024-
    position cache) lowers to Triton: the 260 query rows a key head run as three tiles of the
    grid's fourth axis."""
    from jax import export

    spec = jax.ShapeDtypeStruct
    q = spec((64, 65, 32, 128), jnp.bfloat16)
    cache = spec((64, 1024, 8, 128), jnp.bfloat16)
    own = spec((64, 65, 8, 128), jnp.bfloat16)
    fn = functools.partial(decode_attention, scale=128 ** -0.5)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    try:
        text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
            q, cache, cache, spec((64,), jnp.int32), own, own,
            spec((64, 65, 65), jnp.bool_)).mlir_module()
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
        pytest.skip(f"Triton lowering unavailable: {e}")
    grids = [int(x) * int(y) * int(z) for x, y, z in re.findall(
        r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)]
    assert grids == [64 * 8 * 3], grids   # the query tiles fill the GPU: one split, no merge
    assert "decode_attention_merge" not in text
