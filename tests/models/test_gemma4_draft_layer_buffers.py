"""Gemma4's DSpark / DFlash drafters with one buffer per draft layer
(`drafters.dspark.with_layer_buffers` → `gemma4.layer_buffers.Gemma4GroupLayers`: k alone on
k=v layers, k|v where the layer has a v projection, gate|up fused) draft what the stacked
drafters draft: the context K/V they commit and the block hidden states over a per-layer
context cache; greedy speculative decoding with them equals greedy autoregressive decoding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding.draft_adapters import DSparkAdapter
from dspark_jax.models import init_draft, load_target
from dspark_jax.models.drafters.dspark import with_layer_buffers
from dspark_jax.models.gemma4.decoder import Gemma4Group
from dspark_jax.models.gemma4.layer_buffers import Gemma4GroupLayers
from hf_tiny import save_tiny_gemma4

# DeepSpec's Gemma4 drafters take targets without per-layer inputs
TARGET_KW = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                 hidden_size_per_layer_input=0, num_kv_shared_layers=0)
BASE = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1, 2), mask_token_id=4)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]


@pytest.fixture(scope="module", params=["k_eq_v", "v_proj"])
def target(request, tmp_path_factory):
    """The drafters' layers take the target's full-attention shape: k = v (no v projection)
    or a v projection of their own."""
    kw = dict(TARGET_KW, attention_k_eq_v=request.param == "k_eq_v")
    return load_target(save_tiny_gemma4(tmp_path_factory.mktemp("g4"), "all_features", seed=2,
                                        **kw))


def _views(target, draft_kw):
    draft = init_draft(target, draft_kw, seed=1)
    gd, st = with_layer_buffers(draft.graphdef, draft.state)
    return draft, dataclasses.replace(draft, graphdef=gd, state=st)


def _context_and_block(model, n_feat: int, S: int = 64):
    """Three requests' committed contexts (40 features each) in `model`'s cache of S
    positions, and its jitted block over them at anchors of 0, 17 and 40 context tokens:
    (cache, block hidden)."""
    B = 3
    feats = jnp.asarray(np.random.RandomState(3).randn(B, 40, n_feat), jnp.float32)
    cache = DSparkAdapter.init_cache(model, B, S)
    cache = DSparkAdapter.commit(model, cache, feats, jnp.zeros((B,), jnp.int32),
                                 jnp.full((B,), 40, jnp.int32), None)
    h = jax.jit(model.backbone_over_cache)(jnp.asarray([7, 8, 9], jnp.int32),
                                           jnp.asarray([0, 17, 40], jnp.int32), cache.k, cache.v)
    return cache, np.asarray(h)


def test_context_and_block_over_the_cache_equal_the_stacked_drafter(target):
    stacked, per_layer = _views(target, dict(BASE, markov_rank=8))
    s_model, p_model = stacked.model, per_layer.model
    assert type(s_model.layers) is Gemma4Group
    layers = p_model.layers
    assert type(layers) is Gemma4GroupLayers and len(layers.per_layer) == 2
    k_eq_v = not hasattr(s_model.layers, "wv")
    assert {"wq", "w_gate_up"} <= set(layers.names)
    assert ("wk" in layers.names) == k_eq_v and ("w_kv" in layers.names) == (not k_eq_v)
    n_feat = stacked.config.num_features * target.config.hidden_size
    (c0, h0), (c1, h1) = (_context_and_block(m, n_feat) for m in (s_model, p_model))
    assert isinstance(c1.k, tuple) and len(c1.k) == 2        # one context buffer a layer
    for i in range(2):
        for a, b in ((c1.k[i][0], c0.k[i]), (c1.v[i][0], c0.v[i])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(h1, h0, atol=2e-5, rtol=1e-5)
    assert float(np.abs(h0).sum()) > 0


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_greedy_speculative_with_per_layer_drafter_equals_autoregressive(target, kind):
    from dspark_jax.decoding import autoregressive_generate
    from dspark_jax.serving import speculative_generate

    kw = (dict(BASE, markov_rank=8) if kind == "dspark"
          else dict(BASE, model_type="dflash", markov_rank=0, enable_confidence_head=False))
    _, per_layer = _views(target, kw)
    assert type(per_layer.model.layers) is Gemma4GroupLayers
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=10, stop_token_ids=[])
    res = speculative_generate(target, per_layer, PROMPTS, max_new_tokens=10, stop_token_ids=[])
    assert res.tokens == ref


def test_the_engine_on_an_accelerator_holds_the_layout_aot_builds(target, monkeypatch):
    """On a GPU or TPU the engine decodes a Gemma4 target and its DSpark drafter on per-layer
    buffers, with the structure, shapes and dtypes `aot.decode.decoding_layouts` builds
    abstractly."""
    from dspark_jax.aot.decode import decoding_layouts
    from dspark_jax.models.gemma4.layer_buffers import Gemma4Layers
    from dspark_jax.models.target import Target
    from dspark_jax.serving.engine import Engine

    monkeypatch.setattr(Target, "on_accelerator", lambda self: True)
    draft = init_draft(target, dict(BASE, markov_rank=8), seed=1)
    eng = Engine(target, draft, max_requests=2, max_len=32, prefill_chunk=8, stop_token_ids=[],
                 sps=np.ones(11, np.float32))
    abstract = lambda st: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), st)
    t_gd, t_st, d_gd, d_st = decoding_layouts(target.graphdef, abstract(target.state),
                                              draft.graphdef, abstract(draft.state))
    assert t_gd == eng.arrays.target_graphdef and d_gd == eng.arrays.draft_graphdef
    assert abstract(eng.arrays.target_state) == t_st
    assert abstract(eng.arrays.draft_state) == d_st
    held = nnx.merge(eng.arrays.target_graphdef, eng.arrays.target_state)
    assert isinstance(held.layers, Gemma4Layers)
    assert type(nnx.merge(d_gd, eng.arrays.draft_state).layers) is Gemma4GroupLayers


@pytest.mark.parametrize("k_eq_v", [True, False])
@pytest.mark.parametrize("split", [False, True])
def test_block_over_the_cache_through_the_layer_kernel_equals_the_stacked_drafter(
        tmp_path, monkeypatch, k_eq_v, split):
    """The program a GPU compiles, its kernels interpreted (`layers.interpret_kernels`): each
    draft layer (heads of 32) runs its attention half from its q and k(|v) products in
    `layer_attention` (causal=False over the block, the context below the anchor, the unscaled
    v norm, a k=v layer's values from its k heads, no window), the products split along K with
    `split`; the block hidden states equal the stacked drafter's and the per-layer drafter's
    XLA path."""
    import pallas_kernels.decode_attention as DA
    from dspark_jax.models import decoding_layer as DL
    from dspark_jax.models import layers as L

    calls, kernel = [], DA.layer_attention

    def counted(*args, **kw):
        calls.append((args[0].ndim == 5, kw["causal"], kw["v_norm"], kw.get("window", 0),
                      kw["v_from_k"], kw["scale"]))
        return kernel(*args, **kw)

    monkeypatch.setattr(DA, "layer_attention", counted)
    parts: list[int] = []
    if split:   # the q|k|v product split along K (the threshold lowered)
        monkeypatch.setattr(DL, "SPLIT_K_MIN_CHUNK", 8)
        real = DL.product_parts
        monkeypatch.setattr(DL, "product_parts",
                            lambda x, w, p: parts.append(p) or real(x, w, p))
    target = load_target(save_tiny_gemma4(tmp_path, "all_features", seed=2, global_head_dim=32,
                                          **dict(TARGET_KW, attention_k_eq_v=k_eq_v)))
    stacked, per_layer = _views(target, dict(BASE, markov_rank=8))
    s_model, p_model = stacked.model, per_layer.model
    assert ("wk" in p_model.layers.names) == k_eq_v
    n_feat = stacked.config.num_features * target.config.hidden_size
    # a cache of 64 positions: the kernel's cache tile divides it
    block = lambda model: _context_and_block(model, n_feat)[1]  # noqa: E731

    h_stacked, h_xla = block(s_model), block(p_model)
    calls.clear()   # the GPU branch traced beside XLA's (`lax.platform_dependent`), not run
    parts.clear()
    with L.interpret_kernels():
        h_kernel = block(p_model)
    np.testing.assert_allclose(h_kernel, h_xla, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(h_kernel, h_stacked, atol=2e-5, rtol=1e-5)
    assert float(np.abs(h_kernel).sum()) > 0
    assert calls == [(split, False, True, 0, k_eq_v, 1.0)] * 2, calls   # both draft layers
    assert (min(parts) >= 2) if split else not parts, parts
