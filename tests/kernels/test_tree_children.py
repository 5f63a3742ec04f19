"""The tree-children kernel (Triton, interpreted on CPU) against its pure-JAX oracle: the top-c
values and ids and the log-sum-exp of every frontier row's logits U + z·W2ᵀ, over several
chunks with a ragged last tile, frontier blocks with masked rows, ties broken to the lower id,
bf16 weights; bad shapes refused; and its Triton lowering for CUDA at Qwen3's vocabulary."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_children import ref_top_children, top_children


def _inputs(seed: int, R: int, F: int, V: int, r: int, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    u = 2.0 * jax.random.normal(ks[0], (R, V))
    z = jax.random.normal(ks[1], (R, F, r)).astype(dtype)
    w2 = (0.5 * jax.random.normal(ks[2], (V, r))).astype(dtype)
    return u, z, w2


@pytest.mark.parametrize("R,F,V,r,c,block_v,chunks", [
    (2, 5, 300, 8, 4, 32, 3),      # a ragged last tile, three chunks, rows masked
    (1, 20, 200, 24, 16, 16, 4),   # two frontier blocks, c = 16, rank not a power of two
    (3, 1, 64, 16, 3, 16, None)])  # one node a request (the anchor), default chunks
def test_top_children_match_the_oracle(R, F, V, r, c, block_v, chunks):
    u, z, w2 = _inputs(0, R, F, V, r)
    want = ref_top_children(u, z, w2, c=c)
    got = top_children(u, z, w2, c=c, block_v=block_v, chunks=chunks, interpret=True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lower_id_across_tiles_and_chunks():
    """Equal logits in different tiles and chunks: the ids `lax.top_k` gives (lower first)."""
    R, F, V, r = 1, 2, 128, 16
    u = jnp.zeros((R, V)).at[0, jnp.asarray([5, 40, 70, 100, 127])].set(3.0)
    z = jnp.zeros((R, F, r))
    w2 = jnp.zeros((V, r))
    got = top_children(u, z, w2, c=4, block_v=16, chunks=3, interpret=True)
    np.testing.assert_array_equal(got[1], [[[5, 40, 70, 100]] * F])
    np.testing.assert_array_equal(got[1], ref_top_children(u, z, w2, c=4)[1])


def test_bf16_weights():
    u, z, w2 = _inputs(1, 2, 8, 256, 32, jnp.bfloat16)
    want = ref_top_children(u, z, w2, c=8)
    got = top_children(u, z, w2, c=8, block_v=64, interpret=True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-4)


def test_bad_shapes():
    u, z, w2 = _inputs(2, 2, 3, 64, 8)
    with pytest.raises(ValueError, match="do not match"):
        top_children(u, z[:1], w2, c=2, interpret=True)
    with pytest.raises(ValueError, match="children"):
        top_children(u, z, w2, c=65, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        top_children(u, z, w2, c=2, block_v=24, interpret=True)


@pytest.mark.gpu
def test_lowers_for_gpu_with_triton_at_qwen3_vocabulary():
    """64 requests × 64 frontier nodes over Qwen3's 151,936 ids, rank 256 in bf16."""
    from jax import export

    spec = jax.ShapeDtypeStruct
    args = (spec((64, 151936), jnp.float32), spec((64, 64, 256), jnp.bfloat16),
            spec((151936, 256), jnp.bfloat16))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    try:
        text = export.export(jax.jit(lambda *a: top_children(*a, c=16)), platforms=["cuda"],
                             disabled_checks=checks)(*args).mlir_module()
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
        pytest.skip(f"Triton lowering unavailable: {e}")
    assert "tree_top_children" in text
    grids = [int(x) * int(y) * int(z) for x, y, z in re.findall(
        r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)]
    assert grids and min(grids) >= 256, grids
