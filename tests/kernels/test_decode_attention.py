"""The decode-attention kernel (Triton, interpreted on CPU) against its pure-JAX oracle in each
of its three ways of taking the call's own keys, over ragged cache prefixes, rows that see
nothing and several cache splits; and its Triton lowering for CUDA at Qwen3-8B's decoding
shape."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention, ref_decode_attention, splits_for

B, N, KH, H, S = 3, 8, 2, 16, 128
SCALE = H ** -0.5
TILES = dict(block_k=16, interpret=True)


def _inputs(seed: int, t: int, q_len: int):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, t, N, H))
    ck, cv = (jax.random.normal(k, (B, S, KH, H)) for k in ks[1:3])
    ok, ov = (jax.random.normal(k, (B, q_len, KH, H)) for k in ks[3:5])
    return q, ck, cv, ok, ov


@pytest.mark.parametrize("t,q_len,splits", [(1, 1, 2), (3, 5, 4), (8, 8, 8)])
def test_own_keys_apart_match_the_oracle(t, q_len, splits):
    """Own keys [B, Q, Kh, H] under an arbitrary mask (a draft tree's), cache prefixes 0, mid
    and whole; row 0 sees nothing at all and gives zeros."""
    q, ck, cv, ok, ov = _inputs(0, t, q_len)
    start = jnp.asarray([0, 57, S], jnp.int32)
    mask = jax.random.bernoulli(jax.random.key(9), 0.6, (B, t, q_len)).at[0].set(False)
    want = ref_decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE)
    got = decode_attention(q, ck, cv, start, ok, ov, mask, scale=SCALE, splits=splits, **TILES)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    assert not np.asarray(got[0]).any()


def test_a_fused_qkv_product_is_read_in_place():
    """q as the q/k/v product [B, T, N + 2Kh, H]: its k / v heads are the own keys (causal)."""
    t = 5
    qkv = jax.random.normal(jax.random.key(1), (B, t, N + 2 * KH, H))
    _, ck, cv, _, _ = _inputs(1, t, t)
    start = jnp.asarray([3, 64, 100], jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (B, t, t))
    want = ref_decode_attention(qkv[:, :, :N], ck, cv, start, qkv[:, :, N:N + KH],
                                qkv[:, :, N + KH:], mask, scale=SCALE)
    got = decode_attention(qkv, ck, cv, start, None, None, mask, scale=SCALE, num_q_heads=N,
                           **TILES)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_keys_written_to_the_cache_first(fused):
    """Without own keys the cache holds the T tokens at start + t already: token t sees up to
    its own position, nothing past it (the positions after hold other values)."""
    t = 4
    qkv = jax.random.normal(jax.random.key(2), (B, t, N + 2 * KH, H))
    _, ck, cv, _, _ = _inputs(2, t, t)
    start = jnp.asarray([0, 60, S - t], jnp.int32)
    k_new, v_new = qkv[:, :, N:N + KH], qkv[:, :, N + KH:]
    rows = (jnp.arange(B)[:, None], start[:, None] + jnp.arange(t))
    ck2, cv2 = ck.at[rows].set(k_new), cv.at[rows].set(v_new)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (B, t, t))
    want = ref_decode_attention(qkv[:, :, :N], ck, cv, start, k_new, v_new, mask, scale=SCALE)
    q = qkv if fused else qkv[:, :, :N]
    got = decode_attention(q, ck2, cv2, start, scale=SCALE, num_q_heads=N if fused else None,
                           **TILES)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


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
    cache = spec((1, 4224, 8, 128), jnp.bfloat16)
    start = spec((1,), jnp.int32)
    fn = functools.partial(decode_attention, scale=128 ** -0.5, num_q_heads=32)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    try:
        text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
            qkv, cache, cache, start).mlir_module()
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
        pytest.skip(f"Triton lowering unavailable: {e}")
    for name in ("decode_attention_splits", "decode_attention_merge"):
        assert name in text, name
    grids = [int(x) * int(y) * int(z) for x, y, z in re.findall(
        r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)]
    assert sorted(grids) == [8, 256], grids
