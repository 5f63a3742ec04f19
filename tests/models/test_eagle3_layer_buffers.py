"""An Eagle3 drafter with one buffer per draft layer (`drafters.dspark.with_layer_buffers`: q/k/v
and gate/up fused, the layers unrolled), Qwen3's and Gemma4's, drafts what the stacked drafter
drafts: the committed K/V, the chain's tokens and distributions; greedy speculative decoding
with it equals greedy autoregressive decoding. Qwen3's drafter in the kernels' shapes drafts the
same on the decoding layer's kernels (interpreted: the program a GPU compiles)."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models import init_draft, load_target
from dspark_jax.models import layers as L
from dspark_jax.models.drafters.dspark import with_layer_buffers
from dspark_jax.models.gemma4.decoder import Gemma4Group
from dspark_jax.models.gemma4.layer_buffers import Gemma4GroupLayers
from hf_tiny import save_tiny_gemma4, save_tiny_hf

GAMMA = 4


# Gemma4: DeepSpec's Gemma4 drafters take targets without per-layer inputs; sliding and k=v
# full layers, the drafter's layers full with k = v. No logit softcap: capped at 3, the peaky
# drafts' top logits tie, and a chain's argmax would follow the summation order
GEMMA4_TARGET = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                     hidden_size_per_layer_input=0, num_kv_shared_layers=0)


@pytest.fixture(scope="module", params=["qwen3", "gemma4"])
def models(request, tmp_path_factory):
    """(target, stacked drafter, per-layer drafter): a tiny target and a two-layer Eagle3
    drafter (DeepSpec's checkpoints have one layer; two exercise the per-layer cache writes)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        target = load_target(save_tiny_hf(path, "qwen3", head_dim=16, layers=3, seed=2))
        ids, mask = (-1, 0, 1), 96
    else:
        target = load_target(save_tiny_gemma4(path, "all_features", seed=2,
                                              final_logit_softcapping=None, **GEMMA4_TARGET))
        ids, mask = (0, 1, 2), 4
    draft = init_draft(target, dict(model_type="eagle3", block_size=GAMMA, ttt_length=3,
                                    draft_num_hidden_layers=2, target_layer_ids=ids,
                                    mask_token_id=mask), seed=3)
    rng = np.random.RandomState(1)   # visible norms and weights, so a wrong layer shows
    model = draft.model
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            w = var.get_value()
            noise = rng.randn(*w.shape).astype(np.float32)
            around_one = "norm" in str(path) or "scalar" in str(path)
            var.set_value(jnp.asarray(1.0 + 0.2 * noise if around_one else 0.2 * noise))
    model.lm_head.set_value(model.lm_head.get_value() * 20.0)   # peaky drafts
    gd, st = nnx.split(model)
    stacked = dataclasses.replace(draft, graphdef=gd, state=st)
    pgd, pst = with_layer_buffers(gd, st)
    return target, stacked, dataclasses.replace(draft, graphdef=pgd, state=pst)


def _assert_same_drafts(want, got, *, rtol: float, greedy_probs: bool = False) -> None:
    """The per-layer drafter's (cache, sampled proposal, greedy proposal) `got` equal the
    stacked drafter's `want`: caches and probabilities to float rounding (the greedy
    proposal's probabilities too with `greedy_probs`), lengths and tokens exactly."""
    (c0, soft0, greedy0), (c1, soft1, greedy1) = want, got
    pairs = [(c1.k, c0.k), (c1.v, c0.v), (c1.last_hidden, c0.last_hidden),
             (c1.last_logits, c0.last_logits), (soft1["probs"], soft0["probs"])]
    if greedy_probs:
        pairs.append((greedy1["probs"], greedy0["probs"]))
    for a, b in pairs:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=rtol)
    np.testing.assert_array_equal(np.asarray(c1.lengths), np.asarray(c0.lengths))
    np.testing.assert_array_equal(np.asarray(soft1["tokens"]), np.asarray(soft0["tokens"]))
    np.testing.assert_array_equal(np.asarray(greedy1["tokens"]), np.asarray(greedy0["tokens"]))
    assert float(jnp.abs(c0.k).sum()) > 0


def test_the_layout_is_one_fused_buffer_per_layer(models):
    _, stacked, per_layer = models
    layers = per_layer.model.layers
    assert len(layers.per_layer) == 2
    if isinstance(layers, Gemma4GroupLayers):   # k = v: q|k one buffer
        assert {"w_qk", "w_gate_up"} <= set(layers.names) and "wq" not in layers.names
        assert type(stacked.model.layers) is Gemma4Group
    else:
        assert type(layers) is L.UnstackedLayers
        assert {"w_qkv", "w_gate_up"} <= set(layers.names) and "wq" not in layers.names
        assert type(stacked.model.layers) is L.DecoderLayers   # the source is left as it was
    with pytest.raises(ValueError, match="training runs the stacked layers"):
        per_layer.model.ttt_hidden(jnp.zeros((1, 4, 3 * 32)), jnp.zeros((1, 4), jnp.int32))


def test_commit_and_propose_equal_the_stacked_drafter(models):
    from dspark_jax.decoding.sampling import sample_probs

    _, stacked, per_layer = models
    B, F = 3, stacked.config.num_features * stacked.config.target.hidden_size
    outs = []
    for d in (stacked, per_layer):
        m = d.model
        commit = jax.jit(m.commit)
        propose = jax.jit(m.propose, static_argnums=(3, 4))
        cache = m.init_cache(B, 32)
        r = np.random.RandomState(2)
        for counts, width in (([6, 3, 5], 6), ([2, 0, 3], 3)):
            feats = r.randn(B, width, F).astype(np.float32)
            toks = r.randint(0, 97, (B, width)).astype(np.int32)
            cache = commit(cache, feats, toks, jnp.asarray(counts))
        outs.append((cache, propose(cache, jax.random.key(0), 1.0, GAMMA,
                                    lambda k, p: jnp.argmax(p, -1).astype(jnp.int32)),
                     propose(cache, jax.random.key(0), 0.0, GAMMA, sample_probs)))
    (c0, soft0, greedy0), (c1, soft1, greedy1) = outs
    _assert_same_drafts((c0, soft0, greedy0), (c1, soft1, greedy1), rtol=1e-5)


def test_greedy_speculative_with_per_layer_eagle3_equals_autoregressive(models):
    from dspark_jax.decoding import autoregressive_generate
    from dspark_jax.serving import speculative_generate

    target, _, per_layer = models
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]
    ref = autoregressive_generate(target, prompts, max_new_tokens=10, stop_token_ids=[])
    res = speculative_generate(target, per_layer, prompts, max_new_tokens=10,
                               stop_token_ids=[])
    assert res.tokens == ref


# ----------------------------------------------------------------------------- the GPU's kernels
# The decoding layer's kernels take a head size ≥ 32 and a cache of whole 64-position tiles
KERNEL_S = 64


@pytest.fixture(scope="module", params=[1, 2])
def kernel_drafters(request, tmp_path_factory):
    """(stacked, per-layer) Qwen3 Eagle3 drafters of `request.param` layers, shaped for the
    decoding layer's kernels (`decoding_layer.fused_kernels_take`: head size 32, q/k norms)."""
    path = tmp_path_factory.mktemp("qwen3_kernels")
    target = load_target(save_tiny_hf(path, "qwen3", head_dim=32, layers=3, seed=4))
    draft = init_draft(target, dict(model_type="eagle3", block_size=GAMMA, ttt_length=3,
                                    draft_num_hidden_layers=request.param,
                                    target_layer_ids=(-1, 0, 1), mask_token_id=96), seed=5)
    rng = np.random.RandomState(3)
    model = draft.model
    for p, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            w = var.get_value()
            noise = rng.randn(*w.shape).astype(np.float32)
            var.set_value(jnp.asarray(1.0 + 0.2 * noise if "norm" in str(p) else 0.2 * noise))
    model.lm_head.set_value(model.lm_head.get_value() * 20.0)
    gd, st = nnx.split(model)
    pgd, pst = with_layer_buffers(gd, st)
    return (dataclasses.replace(draft, graphdef=gd, state=st),
            dataclasses.replace(draft, graphdef=pgd, state=pst))


def _commit_and_propose(d, interpret: bool):
    """Two commits (counts below the chunk's width included), then a greedy and a sampled
    chain from the result; with `interpret`, the kernels' program (interpreted) and the jaxprs
    of the commit and of the chain."""
    from dspark_jax.decoding.sampling import sample_probs

    m = d.model
    B, F = 3, d.config.num_features * d.config.target.hidden_size
    greedy = lambda k, p: jnp.argmax(p, -1).astype(jnp.int32)  # noqa: E731
    r = np.random.RandomState(2)
    cache = m.init_cache(B, KERNEL_S)
    with L.interpret_kernels() if interpret else contextlib.nullcontext():
        jaxprs = []
        for counts, width in (([6, 3, 5], 6), ([2, 0, 3], 3)):
            feats = r.randn(B, width, F).astype(np.float32)
            toks = r.randint(0, 97, (B, width)).astype(np.int32)
            args = (cache, feats, toks, jnp.asarray(counts))
            jaxprs.append(str(jax.make_jaxpr(m.commit)(*args)))
            cache = jax.jit(m.commit)(*args)
        propose = jax.jit(m.propose, static_argnums=(3, 4))
        jaxprs.append(str(jax.make_jaxpr(m.propose, static_argnums=(3, 4))(
            cache, jax.random.key(0), 1.0, GAMMA, greedy)))
        out = (cache, propose(cache, jax.random.key(0), 1.0, GAMMA, greedy),
               propose(cache, jax.random.key(0), 0.7, GAMMA, sample_probs))
    return out, jaxprs


def test_commit_and_propose_on_the_kernels_equal_the_stacked_drafter(kernel_drafters):
    """Interpreted, the per-layer drafter's program on a GPU (each layer's attention half in
    `layer_attention`, its K/V rows written into the cache by the kernel, the residual sums in
    `add_rms_norm`) commits and drafts what the stacked drafter does in XLA's ops."""
    stacked, per_layer = kernel_drafters
    lp = per_layer.model.layers.layer_params(jnp.float32)
    assert per_layer.model._kernel_layers_take(lp, per_layer.model.init_cache(3, KERNEL_S).k, 6)
    (c0, greedy0, soft0), _ = _commit_and_propose(stacked, interpret=False)
    (c1, greedy1, soft1), jaxprs = _commit_and_propose(per_layer, interpret=True)
    for jaxpr in jaxprs:   # the interpreted run is the kernels' program
        for name in ("layer_attention_splits", "decode_attention_merge", "add_rms_norm"):
            assert name in jaxpr, name
    _assert_same_drafts((c0, soft0, greedy0), (c1, soft1, greedy1), rtol=2e-5,
                        greedy_probs=True)


def test_off_the_kernels_the_per_layer_drafter_keeps_xla_arithmetic(kernel_drafters):
    """Outside `interpret_kernels` on a CPU the per-layer drafter runs `_xla_layers`: the same
    results as the stacked drafter to float rounding."""
    stacked, per_layer = kernel_drafters
    (c0, greedy0, _), _ = _commit_and_propose(stacked, interpret=False)
    (c1, greedy1, _), _ = _commit_and_propose(per_layer, interpret=False)
    np.testing.assert_allclose(np.asarray(c1.k), np.asarray(c0.k), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(greedy1["probs"]), np.asarray(greedy0["probs"]),
                               atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(greedy1["tokens"]), np.asarray(greedy0["tokens"]))
