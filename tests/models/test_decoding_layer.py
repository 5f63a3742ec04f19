"""A decoder layer while decoding (`models.decoding_layer`): where the GPU's kernels take the
layer (fused q/k/v, power-of-two heads, a cache of whole tiles) the layer writes its rows into
its own cache buffer and attention reads them there. On a CPU the same program runs with XLA's
ops or, inside `layers.interpret_kernels()`, with the GPU's kernels interpreted; both equal the
stacked layers' forward (which writes after the last layer): logits, taps and caches, Qwen3's
q/k norms and Llama's none."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from dspark_jax.models import layers as L
from dspark_jax.models import load_target
from dspark_jax.models.decoder import init_cache
from hf_tiny import save_tiny_hf

TAPS = (-1, 0, 1)
S = 64          # one 64-position tile: the kernels take it


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(tmp_path_factory, request):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp(request.param), request.param,
                                    head_dim=32, layers=2, seed=4))


@pytest.fixture(params=["whole", "split_k"])
def products(request, monkeypatch):
    """The layer's products whole, or (`split_k`) split along K into parts the kernels sum
    (`decoding_layer.split_k_parts`, its threshold lowered to the tiny model's 64 columns):
    → (the mode, the parts of every split product traced, the test's monkeypatch)."""
    from dspark_jax.models import decoding_layer as DL

    traced: list[int] = []
    if request.param == "split_k":
        monkeypatch.setattr(DL, "SPLIT_K_MIN_CHUNK", 16)
        real = DL.product_parts
        monkeypatch.setattr(DL, "product_parts",
                            lambda x, w, parts: traced.append(parts) or real(x, w, parts))
    jax.clear_caches()   # no program traced under the other threshold is reused, either way
    yield request.param, traced, monkeypatch
    jax.clear_caches()


def _check_products(products) -> None:
    """A split-K run took its products in parts (≥ 2) inside the kernels' branch."""
    mode, traced, _ = products
    if mode == "split_k":
        assert traced and min(traced) >= 2, traced


def _steps(model, per_layer_cache: bool):
    """A prefill of 4 and 2 tokens, a one-token step and a 3-token block, over a cache whose
    unwritten positions hold stale values: (logits and taps of each call, the final caches)."""
    rng = np.random.RandomState(0)
    cache = init_cache(model.cfg, 2, S, model.dtype, per_layer=per_layer_cache)
    stale = lambda c: jnp.asarray(rng.randn(*c.shape), c.dtype)   # noqa: E731
    if per_layer_cache:
        cache = cache.replace(k=tuple(map(stale, cache.k)), v=tuple(map(stale, cache.v)))
    else:
        cache = cache.replace(k=stale(cache.k), v=stale(cache.v))
    cache = cache.with_lengths(jnp.zeros((2,), jnp.int32))
    outs = []
    for toks, adv in (([[5, 6, 7, 8], [9, 10, 11, 12]], [4, 2]), ([[13], [14]], [1, 1]),
                      ([[15, 16, 17], [18, 19, 20]], [3, 3])):
        o = model(jnp.asarray(toks, jnp.int32), cache=cache, tap_layer_ids=TAPS,
                  advance=jnp.asarray(adv, jnp.int32))
        outs.append((np.asarray(model.logits(o.hidden)), np.asarray(o.taps)))
        cache = o.cache
    lens = np.asarray(cache.lengths)
    kv = [np.asarray(L.cache_like(c, jnp.zeros(()))) for c in (cache.k, cache.v)]
    return outs, [a[:, b, :lens[b]] for a in kv for b in range(2)]   # written positions


def test_the_kernels_layer_equals_the_stacked_forward(target):
    """Prefill, a step and a block through the GPU's kernels (interpreted), whose products
    take their norms, activation and attention merge in their own kernels (no product is
    split for another kernel to sum), equal the stacked forward's."""
    per_layer = target.decoding_layout(True).model
    lp = per_layer.layers.layer_params(jnp.float32)[0]
    from dspark_jax.models.decoding_layer import fused_kernels_take
    assert fused_kernels_take(lp, jnp.zeros((2, S, 2, 32)), jnp.float32, 8)
    want = _steps(target.model, per_layer_cache=False)
    runs = {"xla": _steps(per_layer, per_layer_cache=True)}
    with L.interpret_kernels():
        runs["kernels"] = _steps(per_layer, per_layer_cache=True)
        cache = init_cache(per_layer.cfg, 2, S, per_layer.dtype, per_layer=True)
        jaxpr = str(jax.make_jaxpr(lambda c: per_layer(jnp.ones((2, 1), jnp.int32), cache=c))(
            cache))
    # the interpreted run is the kernels' program: the attention's kernel, its cache splits
    # merged in the o product's (`row_gemm.merge_gemm`), the sums and norms in the products'
    # kernels, the activation in the down product's
    for name in ("layer_attention_splits", "merge_gemm", "norm_gemm", "swiglu_gemm"):
        assert name in jaxpr, name
    assert "decode_attention_merge" not in jaxpr
    for name, (outs, kv) in runs.items():
        for (logits, taps), (w_logits, w_taps) in zip(outs, want[0]):
            np.testing.assert_allclose(logits, w_logits, atol=2e-5, rtol=2e-5, err_msg=name)
            np.testing.assert_allclose(taps, w_taps, atol=2e-5, rtol=2e-5, err_msg=name)
        for a, w in zip(kv, want[1]):
            np.testing.assert_allclose(a, w, atol=2e-6, err_msg=name)


def test_the_kernels_verify_ragged_requests_as_the_dense_forward(target):
    """The ragged verification with its per-request grid and deferred writes (what the round's
    bucket switch runs), each request's cells through the layer's attention kernel and its
    admitted tokens gathered from the grid in the o product's (`row_gemm.merge_gemm`): their
    logits and K/V rows equal the stacked dense forward's."""
    from dspark_jax.models.decoder import ragged_forward, write_ragged

    per_layer = target.decoding_layout(True).model
    R, Q, K = 3, 4, 8
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [3]]
    toks = np.zeros((R, 5), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)

    def prefilled(model):
        cache = init_cache(model.cfg, R, S, model.dtype,
                           per_layer=isinstance(model.layers, L.UnstackedLayers))
        return model(jnp.asarray(toks), cache=cache).cache.with_lengths(lens)

    seq = np.random.RandomState(1).randint(3, 90, (R, Q)).astype(np.int32)
    dense = target.model(jnp.asarray(seq), cache=prefilled(target.model))
    want = np.asarray(target.model.logits(dense.hidden))
    ell = [3, 0, 2]                                   # drafts admitted after each anchor
    tok, slot, pos, valid = (np.zeros(K, np.int32) for _ in range(4))
    grid, cell, k = np.full((R, Q), K, np.int32), np.zeros(K, np.int32), 0
    for r, n in enumerate(ell):
        for j in range(n + 1):
            tok[k], slot[k], pos[k], valid[k] = seq[r, j], r, len(prompts[r]) + j, 1
            grid[r, j], cell[k] = k, r * Q + j
            k += 1
    args = tuple(map(jnp.asarray, (tok, slot, pos))) + (jnp.asarray(valid, bool),)

    def run(cache):
        out = ragged_forward(per_layer, *args, cache, grid=(jnp.asarray(grid),
                                                           jnp.asarray(cell)),
                             defer_writes=True)
        return out.hidden, write_ragged(out.cache, out.new_kv, jnp.where(args[3], args[1], R),
                                        args[2])

    for name in ("xla", "kernels"):
        if name == "kernels":
            with L.interpret_kernels():
                hidden, cache = run(prefilled(per_layer))
                jaxpr = str(jax.make_jaxpr(run)(prefilled(per_layer)))
            for kernel in ("layer_attention_splits", "merge_gemm", "norm_gemm", "swiglu_gemm"):
                assert kernel in jaxpr, kernel
        else:
            hidden, cache = run(prefilled(per_layer))
        got = np.asarray(per_layer.logits(hidden))
        ck = np.asarray(L.cache_like(cache.k, jnp.zeros(())))
        want_k = np.asarray(L.cache_like(dense.cache.k, jnp.zeros(())))
        k = 0
        for r, n in enumerate(ell):
            for j in range(n + 1):
                np.testing.assert_allclose(got[k], want[r, j], atol=2e-5, rtol=2e-5,
                                           err_msg=name)
                p = len(prompts[r]) + j
                np.testing.assert_allclose(ck[:, r, p], want_k[:, r, p], atol=2e-6,
                                           err_msg=name)
                k += 1


def test_the_drafters_layers_over_their_cache_equal_the_stacked_backbone(target, products):
    """A DSpark drafter while decoding (`DSparkDraft.backbone_over_cache`): its context cache
    one buffer a layer, a block a row over the context below each anchor. The decoding layout
    with XLA's ops and with the GPU's kernels interpreted equals the stacked backbone with its
    dense block attention, anchors at 0, inside and at the end of the committed context, and
    the interpreted context cache (committed as verification commits it, 24 flattened rows a
    call: the fc product's norm and every layer's k|v product of it in one `norm_gemm`, the
    keys normed and rotated on their way into the caches by `write_context_rows`) equals the
    stacked drafter's. With split products,
    the layers keep the attention's merge apart (as shapes past the row kernels' do) and the
    o product is split along K for the norm kernel to sum."""
    from dspark_jax.decoding.draft_adapters import DSparkAdapter
    from dspark_jax.models import decoding_layer as DL
    from dspark_jax.models import init_draft
    from dspark_jax.models.drafters.dspark import with_layer_buffers

    merged = products[0] == "whole"
    if not merged:
        products[2].setattr(DL, "merged_o_takes", lambda *a, **k: False)
    draft = init_draft(target, dict(block_size=4, num_draft_layers=2, target_layer_ids=(-1, 0),
                                    mask_token_id=4, markov_rank=8), seed=2)
    stacked = draft.model
    per_layer = nnx.merge(*with_layer_buffers(draft.graphdef, draft.state))
    assert isinstance(per_layer.layers, L.UnstackedLayers)
    B, n_feat = 3, stacked.cfg.num_features * stacked.cfg.target.hidden_size
    feats = jnp.asarray(np.random.RandomState(3).randn(B, 40, n_feat), jnp.float32)
    anchor = jnp.asarray([7, 8, 9], jnp.int32)
    anchor_pos = jnp.asarray([0, 17, 40], jnp.int32)

    slot_k = jnp.repeat(jnp.arange(B, dtype=jnp.int32), 8)

    def commit(model, cache, start):   # 8 tokens a row, flattened (24 rows a call), as a
        # verification commits them: the rows the context's kernels take
        pos_k = jnp.tile(start + jnp.arange(8, dtype=jnp.int32), B)
        return DSparkAdapter.commit_ragged(model, cache, feats[:, start:start + 8].reshape(
            B * 8, -1), slot_k, pos_k, jnp.ones((B * 8,), bool), None, None, None, None)

    def outputs(model):
        cache = DSparkAdapter.init_cache(model, B, S)
        for start in range(0, 40, 8):
            cache = commit(model, cache, start)
        return cache, np.asarray(model.backbone_over_cache(anchor, anchor_pos, cache.k, cache.v))

    stacked_cache, want = outputs(stacked)
    per_layer_cache, got = outputs(per_layer)
    assert isinstance(per_layer_cache.k, tuple) and not isinstance(stacked_cache.k, tuple)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    products[1].clear()
    with L.interpret_kernels():
        kernels_cache, got_kernels = outputs(per_layer)
        jaxpr = str(jax.make_jaxpr(lambda c: per_layer.backbone_over_cache(
            anchor, anchor_pos, c.k, c.v))(per_layer_cache))
        # the context's norm and every layer's k|v product of it: one `norm_gemm`
        context = str(jax.make_jaxpr(lambda f: per_layer.context_kv(
            f, jnp.broadcast_to(jnp.arange(8), (B, 8))))(feats[:, :8]))
        written = str(jax.make_jaxpr(lambda c: commit(per_layer, c, 0))(per_layer_cache))
    assert "norm_gemm" in context
    assert "norm_gemm" in written and "cache_write_context_rows" in written
    for c_got, c_want in zip((kernels_cache.k, kernels_cache.v), (stacked_cache.k,
                                                                  stacked_cache.v)):
        np.testing.assert_allclose(np.stack([np.asarray(x[0]) for x in c_got]),
                                   np.asarray(c_want), atol=2e-5, rtol=2e-5)
    # five kernels a layer, as the target's: the attention's splits merged in the o
    # product's kernel; the final norm with the last residual sum
    merge, apart = (("merge_gemm", "decode_attention_merge") if merged
                    else ("decode_attention_merge", "merge_gemm"))
    for name in ("norm_gemm", "layer_attention_splits", merge, "swiglu_gemm", "add_rms_norm"):
        assert name in jaxpr, name
    assert apart not in jaxpr
    _check_products(products)
    np.testing.assert_allclose(got_kernels, want, atol=2e-5, rtol=2e-5)
