"""The ragged verification forward equals the dense [R, γ+1] forward, token for token and logit
for logit (paper §5.2–5.3, SPEC §9), and padding writes nothing into the cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models import load_target
from dspark_jax.models import layers as L
from dspark_jax.models.decoder import (has_layer_buffers, init_cache, ragged_forward,
                                      write_ragged)
from hf_tiny import save_tiny_hf

TAPS = (-1, 0, 2)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("rg"), "qwen3", head_dim=16,
                                    layers=3, seed=2))


@pytest.fixture(scope="module", params=["stacked", "per_layer"])
def model(target, request):
    """The target with its layers stacked (scanned) and with one buffer per layer (unrolled,
    `Target.decoding_layout(True)`): every test below holds for both."""
    t = target.decoding_layout(request.param == "per_layer")
    assert (type(t.model.layers).__name__ == "UnstackedLayers") == (request.param == "per_layer")
    return t.model


def test_per_layer_buffers_equal_the_stack(target):
    """One buffer per layer (q/k/v and gate/up fused) runs the same forward as the stack: a
    prefill, then cached steps of 1 and 3 tokens over a cache whose positions past the lengths
    hold stale values (they must stay invisible), with taps; logits, taps and the written cache
    agree."""
    stacked, per_layer = target.model, target.decoding_layout(True).model
    # one dot for q/k/v and one for gate/up: the fused buffers hold the stack's columns
    lp = per_layer.layers.layer_params(jnp.float32)[1]
    assert {"w_qkv", "w_gate_up"} <= set(lp) and not {"wq", "wk", "w_gate"} & set(lp)
    st = stacked.layers.stacked(jnp.float32)
    D = st["wq"].shape[1]
    np.testing.assert_array_equal(
        np.asarray(lp["w_qkv"]), np.concatenate([np.asarray(st[n][1]).reshape(D, -1)
                                                 for n in ("wq", "wk", "wv")], axis=1))
    np.testing.assert_array_equal(np.asarray(lp["w_gate_up"]), np.concatenate(
        [np.asarray(st["w_gate"][1]), np.asarray(st["w_up"][1])], axis=1))
    rng = np.random.RandomState(3)
    cache = init_cache(stacked.cfg, 2, 16, stacked.dtype)
    cache = cache.replace(k=jnp.asarray(rng.randn(*cache.k.shape), cache.k.dtype),
                          v=jnp.asarray(rng.randn(*cache.v.shape), cache.v.dtype))
    # the per-layer weights over the stacked cache, and over one cache buffer per layer
    layered = cache.replace(k=L.cache_like(cache.k, _fresh(per_layer, 2, 16).k),
                            v=L.cache_like(cache.v, _fresh(per_layer, 2, 16).v))
    assert isinstance(layered.k, tuple) and len(layered.k) == stacked.cfg.num_hidden_layers
    caches = {}
    for name, m, c in (("stacked", stacked, cache), ("per_layer", per_layer, cache),
                       ("per_layer_cache", per_layer, layered)):
        c = c.with_lengths(jnp.asarray([0, 0], jnp.int32))
        outs = []
        for toks, adv in (([[5, 6, 7, 8], [9, 10, 11, 12]], [4, 2]), ([[13], [14]], [1, 1]),
                          ([[15, 16, 17], [18, 19, 20]], [3, 3])):
            o = m(jnp.asarray(toks, jnp.int32), cache=c, tap_layer_ids=TAPS,
                  advance=jnp.asarray(adv, jnp.int32))
            outs.append((np.asarray(m.logits(o.hidden)), np.asarray(o.taps)))
            c = o.cache
        caches[name] = (outs, c)
    for other in ("per_layer", "per_layer_cache"):
        for (a_logits, a_taps), (b_logits, b_taps) in zip(caches["stacked"][0],
                                                          caches[other][0]):
            np.testing.assert_allclose(b_logits, a_logits, atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(b_taps, a_taps, atol=1e-5, rtol=1e-5)
        for kv in ("k", "v"):
            np.testing.assert_allclose(_st(getattr(caches[other][1], kv)),
                                       _st(getattr(caches["stacked"][1], kv)), atol=1e-6)
        np.testing.assert_array_equal(np.asarray(caches[other][1].lengths), [8, 6])
    assert isinstance(caches["per_layer_cache"][1].k, tuple)
    # the stale positions did not leak: the same steps over a zeroed cache give the same logits
    m, c, outs = stacked, init_cache(stacked.cfg, 2, 16, stacked.dtype), []
    for toks, adv in (([[5, 6, 7, 8], [9, 10, 11, 12]], [4, 2]), ([[13], [14]], [1, 1])):
        o = m(jnp.asarray(toks, jnp.int32), cache=c, advance=jnp.asarray(adv, jnp.int32))
        outs.append(np.asarray(m.logits(o.hidden)))
        c = o.cache
    np.testing.assert_allclose(outs[1], caches["stacked"][0][1][0], atol=1e-5, rtol=1e-5)


def _fresh(model, R, S):
    """An empty cache in the model's layout (one buffer per layer beside per-layer weights)."""
    return init_cache(model.cfg, R, S, model.dtype, per_layer=has_layer_buffers(model))


def _st(a):
    """A cache array as one stack [L, B, S, K, H], whatever its layout."""
    return np.asarray(L.cache_like(a, jnp.zeros(())))


def _prefilled(model, prompts, S=32):
    R = len(prompts)
    P = max(map(len, prompts))
    toks = np.zeros((R, P), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    out = model(jnp.asarray(toks), cache=_fresh(model, R, S))
    return out.cache.with_lengths(lens)


def _flatten(seq, lens, ell, K):
    tok, slot, pos, valid = (np.zeros(K, np.int32) for _ in range(4))
    k = 0
    for r, l in enumerate(ell):
        for j in range(l + 1):
            tok[k], slot[k], pos[k], valid[k] = seq[r, j], r, lens[r] + j, 1
            k += 1
    slot[k:] = 7  # padding points anywhere: it must write nothing
    pos[k:] = 3
    return tuple(jnp.asarray(a) for a in (tok, slot, pos)) + (jnp.asarray(valid, bool),), k


def _grid(ell, K, Q):
    """The per-request layout of `_flatten`'s tokens: grid [R, Q] (K = empty) and cell [K]."""
    grid = np.full((len(ell), Q), K, np.int32)
    cell = np.zeros(K, np.int32)
    k = 0
    for r, l in enumerate(ell):
        for j in range(l + 1):
            grid[r, j], cell[k] = k, r * Q + j
            k += 1
    return jnp.asarray(grid), jnp.asarray(cell)


@pytest.mark.parametrize("layout", ["per_token", "per_request", "per_request_deferred"])
def test_ragged_equals_dense(model, layout):
    """Every attention layout of the ragged forward: a cache row gathered per token, the
    per-request grid, and the grid with the cache left read-only and the K/V rows written
    afterwards (`write_ragged`, what the fused round's bucket switch runs)."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23, 24]]
    cache = _prefilled(model, prompts)
    lens = np.asarray(cache.lengths)
    rng = np.random.RandomState(0)
    seq = rng.randint(3, 90, (4, 5)).astype(np.int32)          # [R, γ+1]: anchor + 4 drafts
    dense = model(jnp.asarray(seq), cache=cache, tap_layer_ids=TAPS)
    d_logits = np.asarray(model.logits(dense.hidden))
    ell = [0, 2, 4, 1]
    (tok, slot, pos, valid), n = _flatten(seq, lens, ell, K=16)
    grid = None if layout == "per_token" else _grid(ell, 16, seq.shape[1])
    defer = layout == "per_request_deferred"

    def run(*a):
        out = ragged_forward(model, *a, tap_layer_ids=TAPS, grid=grid, defer_writes=defer)
        assert (out.new_kv is not None) == defer
        if defer:   # the call left the cache alone; the caller writes the rows
            assert out.cache is a[-1]
            written = write_ragged(out.cache, out.new_kv, jnp.where(valid, slot, 4), pos)
            out = out.replace(cache=written, new_kv=None)
        return out

    rag = jax.jit(run)(tok, slot, pos, valid, cache)
    r_logits = np.asarray(model.logits(rag.hidden))
    k = 0
    for r, l in enumerate(ell):
        for j in range(l + 1):
            np.testing.assert_allclose(r_logits[k], d_logits[r, j], atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(np.asarray(rag.taps[k]), np.asarray(dense.taps[r, j]),
                                       atol=1e-5, rtol=1e-5)
            assert r_logits[k].argmax() == d_logits[r, j].argmax()
            # K/V written where the dense pass wrote them
            np.testing.assert_allclose(_st(rag.cache.k)[:, r, lens[r] + j],
                                       _st(dense.cache.k)[:, r, lens[r] + j], atol=1e-5)
            k += 1
        # nothing written past the request's admitted tokens; committed prefix untouched
        np.testing.assert_array_equal(_st(rag.cache.k)[:, r, lens[r] + l + 1:],
                                      _st(cache.k)[:, r, lens[r] + l + 1:])
        np.testing.assert_array_equal(_st(rag.cache.v)[:, r, :lens[r]],
                                      _st(cache.v)[:, r, :lens[r]])
    np.testing.assert_array_equal(np.asarray(rag.cache.lengths), lens)


def test_ragged_prefill_of_several_requests_equals_dense(model):
    """Prompts of different requests packed in one call (how the engine prefills joins)."""
    prompts = [[5, 6, 7, 8], [9, 10]]
    ref = _prefilled(model, prompts)
    cache = _fresh(model, 2, 32)
    tok = jnp.asarray([5, 6, 7, 8, 9, 10, 0, 0], jnp.int32)
    slot = jnp.asarray([0, 0, 0, 0, 1, 1, 0, 0], jnp.int32)
    pos = jnp.asarray([0, 1, 2, 3, 0, 1, 0, 0], jnp.int32)
    valid = jnp.asarray([1, 1, 1, 1, 1, 1, 0, 0], bool)
    out = ragged_forward(model, tok, slot, pos, valid, cache)
    np.testing.assert_allclose(_st(out.cache.k)[:, 0, :4], _st(ref.k)[:, 0, :4],
                               atol=1e-5)
    np.testing.assert_allclose(_st(out.cache.k)[:, 1, :2], _st(ref.k)[:, 1, :2],
                               atol=1e-5)
    dense_last = model(jnp.asarray([[5, 6, 7, 8]]))
    np.testing.assert_allclose(np.asarray(model.logits(out.hidden[3])),
                               np.asarray(model.logits(dense_last.hidden[0, 3])), atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2])
def test_dense_forward_defers_its_writes(model, rows):
    """The dense cached forward with `defer_writes` (one-request verification inside the fused
    round's bucket switch) only reads the cache: its hidden states and taps equal the writing
    forward's, and its K/V rows written afterwards (`write_ragged`) give the same cache."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]][:rows]
    cache = _prefilled(model, prompts)
    seq = jnp.asarray(np.random.RandomState(1).randint(3, 90, (rows, 4)), jnp.int32)
    ref = model(seq, cache=cache, tap_layer_ids=TAPS)
    out = jax.jit(lambda s, c: model(s, cache=c, tap_layer_ids=TAPS, defer_writes=True))(
        seq, cache)
    assert out.new_kv is not None
    assert L.cache_like(out.new_kv[0], jnp.zeros(())).shape[1:3] == (rows, 4)
    np.testing.assert_array_equal(_st(out.cache.k), _st(cache.k))
    np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(ref.hidden), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.taps), np.asarray(ref.taps), atol=1e-5)
    written = out.cache
    for r in range(rows):   # each row's tokens at its own positions
        pos = cache.lengths[r] + jnp.arange(4, dtype=jnp.int32)
        written = write_ragged(written, jax.tree.map(lambda a: a[:, r], out.new_kv),
                               jnp.full((4,), r, jnp.int32), pos)
    np.testing.assert_allclose(_st(written.k), _st(ref.cache.k), atol=1e-5)
    np.testing.assert_allclose(_st(written.v), _st(ref.cache.v), atol=1e-5)


def test_per_layer_buffers_keep_the_stacks_logical_axes(target):
    """The decoding layout's buffers carry the stack's axes less "layers" (a fused buffer: its
    input axis), so `sharding.state_shardings` lays them on a mesh as it lays the stack."""
    from dspark_jax.sharding import make_mesh, state_shardings

    per_layer = target.decoding_layout(True)
    st = nnx.state(per_layer.model.layers)
    leaves = jax.tree.leaves(st, is_leaf=lambda x: isinstance(x, nnx.Variable))
    named = {}
    for path, v in jax.tree_util.tree_flatten_with_path(
            st, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        axes = v.get_metadata().get("axes")
        assert axes is not None and len(axes) == v.get_value().ndim, (path, axes)
        named[jax.tree_util.keystr(path)] = axes
    assert leaves
    some = {k.split("'")[-2]: a for k, a in named.items() if "[0]" in k}
    assert some["wo"] == ("q_heads", "head_dim", "embed")
    assert some["w_qkv"] == ("embed", None) and some["w_gate_up"] == ("embed", None)
    assert jax.tree.leaves(state_shardings(st, make_mesh(devices=jax.devices()[:1])))
