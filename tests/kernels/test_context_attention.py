"""The context-attention kernel (Triton, interpreted on CPU) against its pure-JAX oracle: values,
log-sum-exp, gradients, rows that see nothing, ragged shapes, unsorted limits; and its Triton
lowering for CUDA at a Qwen3-4B training shape."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.context_attention import (context_attention, context_attention_bwd,
                                              ref_context_attention)

# ragged on purpose: R, S are no multiple of the 16-wide tiles, H is no power of two
B, R, N, KH, H, S = 2, 37, 4, 2, 12, 45
SCALE = H ** -0.5
TILES = dict(block_q=16, block_k=16, interpret=True)
H200_SMS = 132


def _inputs(seed: int, sort: bool = True):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, R, N, H))
    k = jax.random.normal(ks[1], (B, S, KH, H))
    v = jax.random.normal(ks[2], (B, S, KH, H))
    lim = jax.random.randint(ks[3], (B, R), 0, S + 1)
    if sort:                       # as training samples anchors: sorted, pads (limit 0) last
        lim = jnp.sort(lim, axis=1).at[:, -5:].set(0)
    q_seg = (jnp.arange(R) >= 20).astype(jnp.int32)[None].repeat(B, 0)
    k_seg = (jnp.arange(S) >= 25).astype(jnp.int32)[None].repeat(B, 0)
    do = jax.random.normal(ks[4], (B, R, N, H))
    return q, k, v, lim, q_seg, k_seg, do


@pytest.mark.parametrize("sort", [True, False])
def test_forward_matches_the_oracle(sort):
    q, k, v, lim, q_seg, k_seg, _ = _inputs(0, sort)
    o, lse = context_attention(q, k, v, lim, q_seg, k_seg, scale=SCALE, **TILES)
    ro, rlse = ref_context_attention(q, k, v, lim, q_seg, k_seg, scale=SCALE)
    np.testing.assert_allclose(o, ro, atol=1e-5, rtol=1e-5)
    empty = np.isinf(np.asarray(rlse))
    assert empty.any() and (~empty).any()
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), empty)   # rows that see no key
    np.testing.assert_allclose(np.where(empty, 0, lse), np.where(empty, 0, rlse), atol=1e-5)
    assert not np.asarray(o)[np.moveaxis(empty, 1, 2)].any()          # … output zeros


@pytest.mark.parametrize("sort", [True, False])
def test_backward_matches_autodiff_of_the_oracle(sort):
    """With the oracle's own log-sum-exp and delta (no merged part) the kernel's dq, dk, dv are
    the oracle's gradients; a wrong tile range or a missed group head would change dk/dv."""
    q, k, v, lim, q_seg, k_seg, do = _inputs(1, sort)
    ro, rlse = ref_context_attention(q, k, v, lim, q_seg, k_seg, scale=SCALE)
    want = jax.grad(lambda q, k, v: jnp.sum(do * ref_context_attention(
        q, k, v, lim, q_seg, k_seg, scale=SCALE)[0]), argnums=(0, 1, 2))(q, k, v)
    delta = jnp.einsum("brnh,brnh->bnr", do, ro)
    got = context_attention_bwd(q, k, v, lim, q_seg, k_seg, do, rlse, delta, scale=SCALE,
                                **TILES)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert np.abs(np.asarray(b)).max() > 1e-2, name
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=name)
    # keys no row can see (past every limit of their segment) get no gradient
    unseen = np.asarray(jnp.arange(S)[None] >= jnp.max(lim, axis=1, keepdims=True))
    assert unseen.any() and not np.asarray(got[1])[unseen].any()


def test_bad_shapes_are_errors():
    q, k, v, lim, q_seg, k_seg, _ = _inputs(2)
    with pytest.raises(ValueError, match="limit"):
        context_attention(q, k, v, lim[:, 1:], q_seg, k_seg, scale=SCALE, **TILES)
    with pytest.raises(ValueError, match="group"):
        context_attention(q[:, :, :3], k, v, lim, q_seg, k_seg, scale=SCALE, **TILES)


@pytest.mark.gpu
def test_lowers_for_gpu_with_triton_at_a_training_shape():
    """Forward, dq and dk/dv lower to Triton for CUDA at Qwen3-4B's drafter shape (32 heads over
    8, H 128, 512 anchors × 7 slots over 4096 keys); the grids fill an H200's 132 SMs."""
    from jax import export

    b, r, n, kh, h, s = 1, 512 * 7, 32, 8, 128, 4096
    spec = jax.ShapeDtypeStruct
    q = spec((b, r, n, h), jnp.bfloat16)
    kv = spec((b, s, kh, h), jnp.bfloat16)
    rows, keys = spec((b, r), jnp.int32), spec((b, s), jnp.int32)
    heads = spec((b, n, r), jnp.float32)
    fwd = functools.partial(context_attention, scale=h ** -0.5)
    bwd = functools.partial(context_attention_bwd, scale=h ** -0.5)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    try:
        texts = [export.export(jax.jit(fwd), platforms=["cuda"], disabled_checks=checks)(
                     q, kv, kv, rows, rows, keys).mlir_module(),
                 export.export(jax.jit(bwd), platforms=["cuda"], disabled_checks=checks)(
                     q, kv, kv, rows, rows, keys, q, heads, heads).mlir_module()]
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
        pytest.skip(f"Triton lowering unavailable: {e}")
    text = "\n".join(texts)
    for name in ("context_attention_fwd", "context_attention_dq", "context_attention_dkv"):
        assert name in text, name
    grids = [int(x) * int(y) * int(z) for x, y, z in re.findall(
        r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)]
    assert len(grids) == 3 and min(grids) >= H200_SMS, grids     # even at one sequence
