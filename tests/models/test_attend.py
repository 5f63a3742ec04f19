"""Attention over a read-only cache plus a call's own keys (`layers.attend_cache_and_own`)
equals `layers.attend` over the concatenated keys, on both of its paths; and the two KV cache
layouts (stacked, one buffer per layer) hold and write the same values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import layers as L


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("T", [1, 3])   # 1: the multiply-reduce path; 3: the batched dots
def test_cache_and_own_attention_matches_attention_over_the_concatenation(dtype, T):
    B, S, N, K, H = 3, 11, 6, 2, 8
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (B, T, N, H), dtype)
    ck = jax.random.normal(ks[1], (B, S, K, H), dtype)
    cv = jax.random.normal(ks[2], (B, S, K, H), dtype)
    ok = jax.random.normal(ks[3], (B, T, K, H), dtype)
    ov = jax.random.normal(ks[4], (B, T, K, H), dtype)
    lens = jnp.asarray([4, S, 0])                                    # row 2: an empty cache
    cache_mask = jnp.arange(S)[None, :] < lens[:, None]              # [B, S]
    own_mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    if T > 1:   # row 2's first query sees nothing at all: zeros
        own_mask = own_mask.at[2, 0].set(False)
    got = L.attend_cache_and_own(q, ck, cv, lens, ok, ov, own_mask)
    keys, vals = jnp.concatenate([ck, ok], 1), jnp.concatenate([cv, ov], 1)
    mask = jnp.concatenate([jnp.broadcast_to(cache_mask[:, None], (B, T, S)), own_mask], -1)
    want = L.attend(q, keys, vals, mask)
    assert got.shape == (B, T, N, H) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    if T > 1:
        np.testing.assert_array_equal(np.asarray(got[2, 0], np.float32), 0.0)


def test_per_layer_cache_holds_and_writes_what_the_stack_does():
    Lyr, B, S, K, H = 3, 2, 5, 2, 4
    stack = jax.random.normal(jax.random.key(1), (Lyr, B, S, K, H))
    per_layer = L.cache_like(stack, tuple(jnp.zeros((1, B, S, K, H)) for _ in range(Lyr)))
    assert isinstance(per_layer, tuple) and len(per_layer) == Lyr
    assert L.cache_positions(per_layer) == L.cache_positions(stack) == S
    for i in range(Lyr):
        np.testing.assert_array_equal(L.cache_layer(per_layer, i), L.cache_layer(stack, i))
    np.testing.assert_array_equal(L.cache_like(per_layer, stack), stack)

    rows = jax.random.normal(jax.random.key(2), (Lyr, B, 2, K, H))
    index = (jnp.arange(B)[:, None], jnp.asarray([[1, 2], [4, S]]))  # position S: dropped
    a, b = L.cache_scatter(stack, index, rows), L.cache_scatter(per_layer, index, rows)
    np.testing.assert_array_equal(L.cache_like(b, stack), a)
    assert float(jnp.abs(a - stack).max()) > 0

    one = rows[0, :, 0]                                                # [B, K, H]
    index1 = (jnp.arange(B), jnp.asarray([0, 3]))
    a1, b1 = L.cache_set_layer(stack, 1, index1, one), L.cache_set_layer(per_layer, 1, index1, one)
    np.testing.assert_array_equal(L.cache_like(b1, stack), a1)
    np.testing.assert_array_equal(a1[1, jnp.arange(B), jnp.asarray([0, 3])], one)


@pytest.mark.parametrize("segments", [False, True])
def test_flash_attention_kernel_matches_dense_causal_attention(segments):
    """The Triton flash-attention path of `causal_attention` (interpreted on CPU) equals
    `attend` under the causal (and same-segment) mask, grouped heads included."""
    B, T, N, K, H = 2, 2 * L.FLASH_BLOCK, 4, 2, 16
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, K, H), jnp.float32)
    seg = None
    if segments:   # row 0: two packed sequences; row 1: one sequence, then padding (0)
        seg = jnp.stack([jnp.where(jnp.arange(T) < 100, 1, 2),
                         jnp.where(jnp.arange(T) < 200, 1, 0)]).astype(jnp.int32)
    want = L.attend(q, k, v, L.causal_mask(B, T, seg))
    got = L.flash_attention_gpu(q, k, v, seg, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # on the CPU the dense path runs: the same values
    np.testing.assert_allclose(np.asarray(L.causal_attention(q, k, v, seg)), np.asarray(want),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chip,call", [
    pytest.param("v5e", "tpu_custom_call", marks=pytest.mark.tpu),
    pytest.param("h200", "__gpu$xla.gpu.triton", marks=pytest.mark.gpu)])
def test_causal_attention_compiles_to_the_flash_kernel_for_an_accelerator(chip, call):
    """Compiled for a TPU or GPU chip (no device: `aot.decode_floor.single_chip_devices`), the
    target's uncached attention is the flash-attention kernel, not the dense scores."""
    from jax.sharding import SingleDeviceSharding

    from dspark_jax.aot import decode_floor, gpu, topology

    if chip == "v5e" and not topology.has_libtpu():
        pytest.skip("needs libtpu: pip install -e '.[tpu]'")
    if chip == "h200" and not gpu.has_cuda_plugin():
        pytest.skip(f"needs the CUDA plugin: {gpu.GPU_INSTALL_HINT}")
    devices, _ = decode_floor.single_chip_devices(chip)
    sh = SingleDeviceSharding(devices[0])
    q = jax.ShapeDtypeStruct((2, 2 * L.FLASH_BLOCK, 4, 128), jnp.bfloat16, sharding=sh)
    k = jax.ShapeDtypeStruct((2, 2 * L.FLASH_BLOCK, 2, 128), jnp.bfloat16, sharding=sh)
    seg = jax.ShapeDtypeStruct((2, 2 * L.FLASH_BLOCK), jnp.int32, sharding=sh)
    text = jax.jit(L.causal_attention).lower(q, k, k, seg).compile().as_text()
    assert f'custom_call_target="{call}"' in text


def test_causal_attention_under_a_mesh_runs_per_shard_and_equals_unsharded():
    """Inside a sharded program the attention runs in `shard_map` on each device's rows and
    KV-head groups (data 2 × fsdp 2 × tensor 2), with the same values as unsharded."""
    from dspark_jax.sharding import make_mesh, use_mesh

    B, T, N, K, H = 4, L.FLASH_BLOCK, 4, 2, 8
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, K, H), jnp.float32)
    seg = jnp.where(jnp.arange(T)[None] < jnp.array([[40], [128], [90], [7]]), 1, 2)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)

    def sharded(*xs):
        with use_mesh(mesh):
            return L.causal_attention(*xs)

    body = str(jax.make_jaxpr(sharded)(q, k, v, seg)).split("shard_map", 1)[1]
    assert f"f32[1,{T},1,{N // K},{H}]" in body        # a quarter of the rows, half the heads
    np.testing.assert_allclose(np.asarray(jax.jit(sharded)(q, k, v, seg)),
                               np.asarray(L.attend(q, k, v, L.causal_mask(B, T, seg))),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("topo,mesh_shape,call", [
    pytest.param("v5p:2x2x2", (2, 2, 2), "tpu_custom_call", marks=pytest.mark.tpu),
    pytest.param("h200:4", (2, 2, 1), "__gpu$xla.gpu.triton", marks=pytest.mark.gpu)])
def test_flash_kernel_reads_its_shards_where_they_lie_on_several_chips(topo, mesh_shape, call):
    """Compiled for several chips (no device), the flash kernel runs on each chip's rows and
    heads: its custom call takes the local shapes, and no collective feeds its operands. The
    bare kernel outside `shard_map` (GPU: a TPU refuses to compile it) is gathered whole first,
    which the same check reports; `flash_kernels(False)` compiles the dense path instead."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from dspark_jax.aot import gpu, topology
    from dspark_jax.aot.hlo_traffic import collectives_feeding_kernels, pallas_kernels
    from dspark_jax.sharding import MESH_AXES, use_mesh

    if topo.startswith("v5p") and not topology.has_libtpu():
        pytest.skip("needs libtpu: pip install -e '.[tpu]'")
    if topo.startswith("h200") and not gpu.has_cuda_plugin():
        pytest.skip(f"needs the CUDA plugin: {gpu.GPU_INSTALL_HINT}")
    from dspark_jax.aot.devices import slice_devices

    devices, _ = slice_devices(topo)
    mesh = Mesh(np.asarray(devices).reshape(mesh_shape), MESH_AXES)
    B, T, N, K, H = 4, 2 * L.FLASH_BLOCK, 4, 2, 128
    rows = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=rows)
    k = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16, sharding=rows)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))

    def compiled(fn):
        def f(*xs):
            with use_mesh(mesh):
                return fn(*xs)
        return jax.jit(f, out_shardings=rows).lower(q, k, k, seg).compile().as_text()

    text = compiled(L.causal_attention)
    kernels = pallas_kernels(text)
    assert kernels and all(f'custom_call_target="{call}"' in i.attrs for i in kernels)
    local = f"[1,{T},{N // mesh_shape[2]},{H}]" if call.startswith("__gpu") else \
        f"[1,{N // mesh_shape[2]},{T},{H}]"
    assert all(local in i.shape for i in kernels), [i.shape for i in kernels]
    assert collectives_feeding_kernels(text) == []

    def dense(*xs):
        with L.flash_kernels(False):                    # train.attn_kernel=False
            return L.causal_attention(*xs)

    assert pallas_kernels(compiled(dense)) == []
    if call.startswith("__gpu"):
        bare = compiled(lambda *xs: L.flash_attention_gpu(*xs))
        assert f"[{B},{T},{N},{H}]" in pallas_kernels(bare)[0].shape
        assert any(g["collective"].startswith("all-gather")
                   for g in collectives_feeding_kernels(bare))
