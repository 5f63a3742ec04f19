"""Chunked (online-softmax) and fused (Triton kernel, interpreted) block attention against the
dense oracle: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models.drafters.block_attention import (ContextMask, block_attend,
                                                        chunked_block_attend, dense_block_attend,
                                                        fused_block_attend)

B, A, T, N, K, H, S = 2, 5, 3, 4, 2, 8, 19


def _inputs(seed: int, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, A, T, N, H), dtype)
    ck = jax.random.normal(ks[1], (B, S, K, H), dtype)
    cv = jax.random.normal(ks[2], (B, S, K, H), dtype)
    bk = jax.random.normal(ks[3], (B, A, T, K, H), dtype)
    bv = jax.random.normal(ks[4], (B, A, T, K, H), dtype)
    # context strictly before each anchor, one anchor with no context, one invalid anchor
    anchors = jnp.array([[0, 4, 9, 13, 18], [2, 3, 7, 11, 16]])
    visible = jnp.arange(S)[None, None, :] < anchors[..., None]
    valid = jnp.ones((B, A), bool).at[1, 2].set(False)
    visible = visible & valid[..., None]
    return q, ck, cv, bk, bv, visible, valid


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_matches_dense_values(chunk):
    args = _inputs(0)
    ref = dense_block_attend(*args)
    out = chunked_block_attend(*args, key_chunk=chunk)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    # the invalid anchor's rows are exactly zero; a context-free anchor still sees its block
    assert np.all(np.asarray(out[1, 2]) == 0.0)
    assert np.abs(np.asarray(out[0, 0])).max() > 0.0


@pytest.mark.parametrize("chunk", [4, pytest.param(19, marks=pytest.mark.slow)])
def test_chunked_matches_dense_gradients(chunk):
    q, ck, cv, bk, bv, visible, valid = _inputs(1)
    w = jax.random.normal(jax.random.key(7), (B, A, T, N, H))

    def loss(fn, *xs):
        return jnp.sum(w * fn(*xs, visible, valid))

    dense = jax.grad(lambda *xs: loss(dense_block_attend, *xs), argnums=(0, 1, 2, 3, 4))
    chunked = jax.grad(lambda *xs: loss(
        lambda *a: chunked_block_attend(*a, key_chunk=chunk), *xs), argnums=(0, 1, 2, 3, 4))
    g_ref = dense(q, ck, cv, bk, bv)
    g_out = chunked(q, ck, cv, bk, bv)
    for name, a, b in zip(("q", "ctx_k", "ctx_v", "blk_k", "blk_v"), g_out, g_ref):
        assert np.abs(np.asarray(b)).max() > 1e-3, name
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)
    # keys after every anchor's position get no gradient
    np.testing.assert_array_equal(g_out[1][0, 18:], 0.0)


# the fp32 equality tests above cover the algorithm; this one only bounds bf16 rounding
@pytest.mark.slow
def test_chunked_bf16_close_to_dense():
    args = _inputs(2, jnp.bfloat16)
    ref = dense_block_attend(*args).astype(jnp.float32)
    out = chunked_block_attend(*args, key_chunk=5).astype(jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, atol=3e-2, rtol=3e-2)


def _packed_inputs(seed: int):
    """`_inputs` with two packed sequences a row (keys 0–9 and 10–18) and limits per anchor."""
    q, ck, cv, bk, bv, _, valid = _inputs(seed)
    anchors = jnp.array([[0, 4, 9, 13, 18], [2, 3, 7, 11, 16]])
    key_seg = (jnp.arange(S) >= 10).astype(jnp.int32)[None].repeat(B, 0)
    mask = ContextMask(jnp.where(valid, anchors, 0), (anchors >= 10).astype(jnp.int32), key_seg)
    return q, ck, cv, bk, bv, mask, valid


def _fused(*args):
    return fused_block_attend(*args, interpret=True)


def test_context_mask_is_the_dense_mask():
    *_, mask, valid = _packed_inputs(0)
    vis = np.asarray(mask.dense(S))
    assert vis[0, 3, 10:13].all() and not vis[0, 3, :10].any()     # anchor 13: its own sequence
    assert not vis[1, 2].any()                                      # the invalid anchor
    lim, aseg, kseg = ContextMask(mask.limit_ba).arrays(S)          # no packing: zero segments
    assert not np.asarray(aseg).any() and kseg.shape == (B, S)


def test_fused_matches_dense_values_and_gradients():
    q, ck, cv, bk, bv, mask, valid = _packed_inputs(4)
    vis = mask.dense(S)
    w = jax.random.normal(jax.random.key(8), (B, A, T, N, H))
    ref = dense_block_attend(q, ck, cv, bk, bv, vis, valid)
    out = _fused(q, ck, cv, bk, bv, mask, valid)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(out[1, 2]) == 0.0) and np.abs(np.asarray(out[0, 0])).max() > 0.0

    g_ref = jax.grad(lambda *xs: jnp.sum(w * dense_block_attend(*xs, vis, valid)),
                     argnums=(0, 1, 2, 3, 4))(q, ck, cv, bk, bv)
    g_out = jax.grad(lambda *xs: jnp.sum(w * _fused(*xs, mask, valid)),
                     argnums=(0, 1, 2, 3, 4))(q, ck, cv, bk, bv)
    for name, a, b in zip(("q", "ctx_k", "ctx_v", "blk_k", "blk_v"), g_out, g_ref):
        assert np.abs(np.asarray(b)).max() > 1e-3, name
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)


def test_block_attend_takes_the_chunked_path_off_gpu():
    """On CPU a `ContextMask` runs the chunked path (the kernel only where compiled for CUDA)."""
    q, ck, cv, bk, bv, mask, valid = _packed_inputs(5)
    ref = dense_block_attend(q, ck, cv, bk, bv, mask.dense(S), valid)
    np.testing.assert_allclose(block_attend(q, ck, cv, bk, bv, mask, valid, key_chunk=4), ref,
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(block_attend(q, ck, cv, bk, bv, mask, valid), ref,
                               atol=1e-5, rtol=1e-5)


def _largest_intermediate(fn, *args) -> int:
    """Element count of the largest value in fn's jaxpr, sub-jaxprs (scan bodies) included."""
    sizes = [0]

    def walk(jp):
        for eqn in jp.eqns:
            sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars
                         if hasattr(v.aval, "shape"))
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return max(sizes)


def test_chunked_never_builds_full_scores():
    """No value of the chunked forward+backward holds the [B,A,K,G,T,S] scores; dense does."""
    q, _, _, bk, bv, _, valid = _inputs(3)
    Sbig = 64
    ck = cv = jnp.zeros((B, Sbig, K, H))
    visible = jnp.ones((B, A, Sbig), bool)
    score_elems = B * A * N * T * Sbig

    def grad_of(attend):
        return jax.grad(lambda q, ck, cv: jnp.sum(attend(q, ck, cv, bk, bv, visible, valid)),
                        argnums=(0, 1, 2))

    chunked = lambda *a: chunked_block_attend(*a, key_chunk=8)
    assert _largest_intermediate(grad_of(dense_block_attend), q, ck, cv) >= score_elems
    # what remains are score tiles of 8 keys and ctx_k/v themselves (B·S·K·H < scores / 2 here)
    assert _largest_intermediate(grad_of(chunked), q, ck, cv) < score_elems // 2


def test_bad_chunk_is_an_error():
    with pytest.raises(ValueError, match="key_chunk"):
        chunked_block_attend(*_inputs(0), key_chunk=0)


@pytest.mark.slow   # two jitted value_and_grads
def test_training_loss_and_grads_chunked_equal_dense(tmp_path):
    """The whole drafter loss (backbone with several key chunks) equals the dense path."""
    from flax import nnx

    from dspark_jax.models import init_draft, load_target
    from dspark_jax.train.losses import dspark_loss_sums
    from hf_tiny import save_tiny_hf

    target = load_target(save_tiny_hf(tmp_path, "qwen3", head_dim=16, layers=2))
    draft = init_draft(target, dict(block_size=3, num_draft_layers=2, target_layer_ids=(0,),
                                    mask_token_id=96, markov_rank=4, num_anchors=5), seed=1)
    graphdef, params, rest = nnx.split(draft.model, nnx.Param, ...)
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(3, 90, (2, 21)), jnp.int32)
    lm = jnp.ones((2, 21), jnp.int32).at[:, :4].set(0)
    feats = jnp.asarray(target.hidden_states(np.asarray(ids), [0]))
    hidden = target.model(ids).hidden

    def loss(p, key_chunk):
        sums = dspark_loss_sums(nnx.merge(graphdef, p, rest), feats, hidden, ids, lm,
                                jax.random.key(3), anchor_chunk=2, key_chunk=key_chunk)
        return sums["ce"] + sums["l1"], sums

    (l_ref, s_ref), g_ref = jax.jit(jax.value_and_grad(lambda p: loss(p, None), has_aux=True))(params)
    (l_out, s_out), g_out = jax.jit(jax.value_and_grad(lambda p: loss(p, 5), has_aux=True))(params)
    assert float(s_ref["weight"]) > 0
    np.testing.assert_allclose(l_out, l_ref, rtol=1e-5, atol=1e-5)
    flat_ref, flat_out = jax.tree.leaves(g_ref), jax.tree.leaves(g_out)
    assert any(np.abs(np.asarray(g)).max() > 1e-4 for g in flat_ref)
    for a, b in zip(flat_out, flat_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_block_attention_compiles_to_the_context_kernel_for_an_h200():
    """Compiled for an H200 (no device), the training-time block attention and its gradient
    run the Triton context-attention kernels (forward, dq, dk/dv), not XLA score tiles."""
    from jax.sharding import SingleDeviceSharding

    from dspark_jax.aot import decode_floor, gpu

    if not gpu.has_cuda_plugin():
        pytest.skip(f"needs the CUDA plugin: {gpu.GPU_INSTALL_HINT}")
    devices, _ = decode_floor.single_chip_devices("h200")
    sh = SingleDeviceSharding(devices[0])
    b, a, t, n, kh, h, s = 1, 8, 4, 4, 2, 64, 128
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731

    def loss(q, ck, cv, bk, bv, limit, valid):
        return jnp.sum(block_attend(q, ck, cv, bk, bv, ContextMask(limit), valid, key_chunk=64)
                       .astype(jnp.float32))

    args = (spec((b, a, t, n, h)), spec((b, s, kh, h)), spec((b, s, kh, h)),
            spec((b, a, t, kh, h)), spec((b, a, t, kh, h)), spec((b, a), jnp.int32),
            spec((b, a), jnp.bool_))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile() \
        .as_text()
    for name in ("context_attention_fwd", "context_attention_dq", "context_attention_dkv"):
        assert name in text, name


def test_fused_under_a_mesh_runs_per_shard_and_equals_dense():
    """Inside a sharded program the kernel runs in `shard_map`, each device on its own rows and
    KV heads (data 2 × tensor 2): values and gradients equal the unsharded oracle's."""
    from dspark_jax.sharding import make_mesh, use_mesh

    mesh = make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    q, ck, cv, bk, bv, mask, valid = _packed_inputs(5)
    vis = mask.dense(S)
    w = jax.random.normal(jax.random.key(9), (B, A, T, N, H))

    def loss(fn, *xs):
        return jnp.sum(w * fn(*xs))

    def sharded(*xs):
        with use_mesh(mesh):
            return _fused(*xs, mask, valid)

    jaxpr = str(jax.make_jaxpr(sharded)(q, ck, cv, bk, bv))
    body = jaxpr.split("shard_map", 1)[1]        # the kernel sees half the rows and KV heads
    assert f"f32[{B // 2},{A},{T},{K // 2},{N // K},{H}]" in body
    ref = dense_block_attend(q, ck, cv, bk, bv, vis, valid)
    np.testing.assert_allclose(jax.jit(sharded)(q, ck, cv, bk, bv), ref, atol=1e-5, rtol=1e-5)
    g_ref = jax.grad(lambda *xs: loss(lambda *a: dense_block_attend(*a, vis, valid), *xs),
                     argnums=(0, 1, 2, 3, 4))(q, ck, cv, bk, bv)
    g_out = jax.jit(jax.grad(lambda *xs: loss(sharded, *xs), argnums=(0, 1, 2, 3, 4)))(
        q, ck, cv, bk, bv)
    for name, a, b in zip(("q", "ctx_k", "ctx_v", "blk_k", "blk_v"), g_out, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)
