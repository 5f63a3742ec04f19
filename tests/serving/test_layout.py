"""One decoding layout for every path (`Target.decoding_layout`): chosen from the devices the
weights live on, taken by the engine, `speculative_generate` and the autoregressive loop for
prefill and steps alike, so the weights they read are held once (Gemma4 included); layers
without the per-layer layout are refused where it is asked for and warned about where it is
chosen."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding import autoregressive_generate
from dspark_jax.decoding import autoregressive as ar_mod
from dspark_jax.decoding import speculative_round as round_
from dspark_jax.models import init_draft, load_draft, load_target
from dspark_jax.models import layers as L
from dspark_jax.models.target import Target
from dspark_jax.serving import Engine, speculative_generate
from dspark_jax.serving.generation import generation_settings
from hf_tiny import save_tiny_gemma4, save_tiny_hf

BASE = dict(block_size=3, num_draft_layers=1, target_layer_ids=(-1, 0), mask_token_id=96,
            markov_rank=8)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
MAX_NEW = 8


@pytest.fixture()
def on_accelerator(monkeypatch):
    """The layout rule as it runs on a GPU or TPU (the weights' devices say accelerator)."""
    monkeypatch.setattr(Target, "on_accelerator", lambda self: True)


def _qwen3(tmp_path) -> Target:
    return load_target(save_tiny_hf(tmp_path / "t", "qwen3", head_dim=16, layers=2, seed=1))


def test_the_rule_follows_the_devices(tmp_path, monkeypatch):
    target = _qwen3(tmp_path)
    assert not target.on_accelerator()                     # this test machine: a CPU
    assert target.decoding_layout() is target              # the stack on a CPU
    monkeypatch.setattr(Target, "on_accelerator", lambda self: True)
    view = target.decoding_layout()
    assert isinstance(view.model.layers, L.UnstackedLayers)
    assert view.decoding_layout() is view                   # chosen once, kept


def test_every_path_prefills_and_steps_on_the_chosen_layout(tmp_path, on_accelerator,
                                                            monkeypatch):
    """On an accelerator the engine's prefill, the rounds, `speculative_generate` and the
    autoregressive loop all read the per-layer buffers (none reads the stack), and greedy
    speculative output equals greedy autoregressive output."""
    target = _qwen3(tmp_path)
    draft = init_draft(target, BASE, seed=3)
    seen: list[str] = []

    def layout(graphdef, state) -> str:
        return type(nnx.merge(graphdef, state).layers).__name__

    real_prefill, real_ar_prefill = round_.prefill_prompts, ar_mod.ar_prefill_rows

    def prefill(config, arrays, *a, **kw):
        seen.append(layout(arrays.target_graphdef, arrays.target_state))
        return real_prefill(config, arrays, *a, **kw)

    def ar_prefill(graphdef, state, *a, **kw):
        seen.append(layout(graphdef, state))
        return real_ar_prefill(graphdef, state, *a, **kw)

    monkeypatch.setattr(round_, "prefill_prompts", prefill)
    monkeypatch.setattr(ar_mod, "ar_prefill_rows", ar_prefill)
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])
    res = speculative_generate(target, draft, PROMPTS, max_new_tokens=MAX_NEW,
                               stop_token_ids=[])
    assert res.tokens == ref
    assert len(seen) >= 2 and set(seen) == {"UnstackedLayers"}, seen


def test_the_weights_are_resident_once(tmp_path, on_accelerator, monkeypatch):
    """On an accelerator the engine's prefill and its rounds read the same per-layer buffers:
    every target weight the engine holds is one of the decoding layout's (none is one of the
    stacked state's), and they add up to the parameters' bytes (within 2%)."""
    target = _qwen3(tmp_path)
    draft = init_draft(target, BASE, seed=3)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(target.state))
    stacked = {id(x) for x in jax.tree.leaves(target.state) if x.ndim >= 3}
    view = target.decoding_layout()
    seen = []
    real_prefill = round_.prefill_prompts

    def prefill(config, arrays, *a, **kw):
        seen.append({id(x) for x in jax.tree.leaves(arrays.target_state)})
        return real_prefill(config, arrays, *a, **kw)

    monkeypatch.setattr(round_, "prefill_prompts", prefill)
    eng = Engine(target, draft, max_requests=2, max_len=32, prefill_chunk=8, stop_token_ids=[],
                 sps=np.ones(9, np.float32))
    eng.generate(PROMPTS, max_new_tokens=MAX_NEW)
    held = {id(x) for x in jax.tree.leaves(eng.arrays.target_state)}
    assert held == {id(x) for x in jax.tree.leaves(view.state)} and not held & stacked
    assert seen and all(ids == held for ids in seen)          # the prefill reads them too
    resident = sum(x.nbytes for x in jax.tree.leaves(eng.arrays.target_state))
    assert abs(resident - param_bytes) <= 0.02 * param_bytes


def test_gemma4_takes_the_per_layer_layout(tmp_path, on_accelerator):
    target = load_target(save_tiny_gemma4(tmp_path / "g", "untied_plain"))
    assert target.supports_layer_buffers
    view = target.decoding_layout()
    assert type(view.model.layers).__name__ == "Gemma4Layers"
    assert view.decoding_layout() is view


def test_layers_without_the_per_layer_layout_are_refused_or_warned(tmp_path, monkeypatch):
    target = _qwen3(tmp_path)
    monkeypatch.setattr(Target, "supports_layer_buffers", property(lambda self: False))
    with pytest.raises(ValueError, match="qwen3 targets have no per-layer decoding layout"):
        target.decoding_layout(True)
    assert target.decoding_layout(False) is target
    monkeypatch.setattr(Target, "on_accelerator", lambda self: True)
    from dspark_jax.models import target as target_mod

    target_mod._warn_stacked.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert target.decoding_layout() is target
    assert any("stacked layers on this accelerator" in str(w.message) for w in caught)


def test_aot_compiles_the_layout_the_engine_runs(tmp_path, on_accelerator):
    """The target and drafter states `aot --decode` compiles (abstractly) have the structure,
    shapes and dtypes of the ones the engine decodes with on an accelerator."""
    from dspark_jax.aot.decode import decoding_layouts
    from dspark_jax.serving.engine import Engine

    target = _qwen3(tmp_path)
    draft = init_draft(target, BASE, seed=3)
    eng = Engine(target, draft, max_requests=2, max_len=32, prefill_chunk=8, stop_token_ids=[],
                 sps=np.ones(9, np.float32))
    abstract = lambda st: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), st)
    t_gd, t_st, d_gd, d_st = decoding_layouts(target.graphdef, abstract(target.state),
                                              draft.graphdef, abstract(draft.state))
    assert t_gd == eng.arrays.target_graphdef and d_gd == eng.arrays.draft_graphdef
    assert jax.tree.structure(t_st) == jax.tree.structure(eng.arrays.target_state)
    assert abstract(eng.arrays.target_state) == t_st
    assert abstract(eng.arrays.draft_state) == d_st


def test_the_gpu_program_with_split_k_products_interpreted_is_lossless(tmp_path, on_accelerator,
                                                                      monkeypatch):
    """The per-layer program a GPU runs, its kernels interpreted on a CPU and its products
    split along K into parts the kernels sum (`decoding_layer.split_k_parts`, its threshold
    lowered to the tiny model; the attention's merge kept apart, as shapes past the row
    kernels' keep it, so that the o products are split): greedy speculative output equals
    greedy autoregressive output, both through the same kernels."""
    from dspark_jax.models import decoding_layer as DL

    target = load_target(save_tiny_hf(tmp_path / "t", "qwen3", head_dim=32, layers=2, seed=1))
    draft = init_draft(target, BASE, seed=3)
    monkeypatch.setattr(DL, "SPLIT_K_MIN_CHUNK", 16)
    monkeypatch.setattr(DL, "merged_o_takes", lambda *a, **k: False)
    parts: list[int] = []
    real = DL.product_parts
    monkeypatch.setattr(DL, "product_parts",
                        lambda x, w, p: parts.append(p) or real(x, w, p))
    jax.clear_caches()   # programs traced before the threshold changed hold whole products
    try:
        with L.interpret_kernels():
            ref = autoregressive_generate(target, PROMPTS, max_new_tokens=MAX_NEW,
                                          stop_token_ids=[])
            res = speculative_generate(target, draft, PROMPTS, max_new_tokens=MAX_NEW,
                                       settings=generation_settings(stop_token_ids=[]))
    finally:
        jax.clear_caches()   # and later tests reuse none traced under the lowered one
    assert parts and min(parts) >= 2, parts
    assert res.tokens == ref


def test_the_drafter_holds_the_targets_embedding_and_lm_head(tmp_path):
    """A drafter's frozen embedding and LM head, equal to its target's, are the target's own
    arrays once loaded against it and inside the engine (one buffer each in device memory; the
    drafter handed in is left as it was); a table that differs stays the drafter's. Greedy
    speculative output is unchanged."""
    target = _qwen3(tmp_path)
    tm = target.model
    tables = {"embed": tm.embed.get_value(), "lm_head": tm.lm_head_weight()}
    init_draft(target, BASE, seed=3).save(tmp_path / "d")
    own = load_draft(tmp_path / "d")                        # no target: its own copies
    assert not any(getattr(own.model, n).get_value() is t for n, t in tables.items())
    shared = own.sharing_tables_with(target)
    for name, table in tables.items():
        assert getattr(shared.model, name).get_value() is table, name
        assert getattr(own.model, name).get_value() is not table, name
    loaded = load_draft(tmp_path / "d", target=target)
    assert all(getattr(loaded.model, n).get_value() is t for n, t in tables.items())
    eng = Engine(target, own, max_requests=2, max_len=32, prefill_chunk=8,
                 stop_token_ids=[], sps=np.ones(9, np.float32))
    held = {id(x) for x in jax.tree.leaves(eng.arrays.target_state)}
    assert {id(t) for t in tables.values()} <= held & {
        id(x) for x in jax.tree.leaves(eng.arrays.draft_state)}
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])
    assert eng.generate(PROMPTS, max_new_tokens=MAX_NEW).tokens == ref
    m = own.model
    m.embed.set_value(m.embed.get_value().at[0, 0].add(1.0))
    other = dataclasses.replace(own, state=nnx.split(m)[1]).sharing_tables_with(target)
    assert other.model.embed.get_value() is not tables["embed"]
    assert other.model.lm_head.get_value() is tables["lm_head"]


def test_a_drafter_loaded_against_a_target_takes_its_dtypes(tmp_path):
    """Against a bf16 target a drafter loads in bf16 (as `aot --decode` compiles it) and holds
    the target's embedding and LM head; alone, or given its dtypes, it loads as asked."""
    path = save_tiny_hf(tmp_path / "t", "qwen3", head_dim=16, layers=2, seed=1)
    init_draft(load_target(path), BASE, seed=3).save(tmp_path / "d")
    target = load_target(path, dtype="bfloat16")
    draft = load_draft(tmp_path / "d", target=target)

    def floats(d) -> set[str]:
        return {str(x.dtype) for x in jax.tree.leaves(d.state)
                if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)}

    assert floats(draft) == {"bfloat16"} and draft.model.dtype == target.dtype
    assert draft.model.embed.get_value() is target.model.embed.get_value()
    assert floats(load_draft(tmp_path / "d")) == {"float32"}
    assert floats(load_draft(tmp_path / "d", target=target, param_dtype="float32")) == {
        "float32"}
