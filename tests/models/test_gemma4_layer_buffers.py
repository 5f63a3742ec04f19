"""Gemma4's decoding layout (`with_layer_buffers`: one buffer per layer, unrolled, one cache
buffer per K/V-owning layer) computes what the stacked layers compute, fp32, on tiny random
configs with sliding windows, KV sharing and per-layer inputs: the causal forward, prefill over
a cache, one-token steps and verification chunks, the ragged verification pass and the K/V they
write; greedy speculative decoding on it equals greedy autoregressive decoding."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models import init_draft, load_target
from dspark_jax.models.decoder import (has_layer_buffers, prefill, ragged_forward,
                                       with_layer_buffers)
from dspark_jax.models.gemma4.layer_buffers import Gemma4Layers
from dspark_jax.models.target import Target
from hf_tiny import save_tiny_gemma4

TAPS = (-1, 0, 3, 7)   # embeddings, an owning sliding layer, a full one, a KV-shared one


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> tuple[Target, Target]:
    """(stacked, per-layer) views of the all-features tiny Gemma4 (8 layers, window 5, 2
    KV-shared layers, k=v full layers with their own head shape, per-layer inputs)."""
    stacked = load_target(save_tiny_gemma4(tmp_path_factory.mktemp("g4"), "all_features"))
    gd, st = with_layer_buffers(stacked.graphdef, stacked.state)
    return stacked, dataclasses.replace(stacked, graphdef=gd, state=st)


def _ids(b: int, s: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 97, (b, s)).astype(np.int32)


def _close(got: jax.Array, want: jax.Array, tol: float = 2e-4) -> None:
    """max |got − want| ≤ tol relative to the values' scale (at least 1). Each layout is
    within 1e-4 × scale of transformers' float64 forward on this config (up to 1.4e-4 at a
    scale of 1.7 where XLA:CPU emits AVX-512 code); the unrolled layers and the scan sum in
    different orders, so two such fp32 results lie within twice that of each other."""
    got, want = np.asarray(got), np.asarray(want)
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol} × scale {scale:.3g}"


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _step(graphdef, state, toks, cache):
    """A cached forward that commits its tokens → (logits, taps, cache)."""
    m = nnx.merge(graphdef, state)
    T = toks.shape[1]
    out = m(toks, cache=cache, tap_layer_ids=TAPS, advance=jnp.full(toks.shape[:1], T))
    return m.logits(out.hidden), out.taps, out.cache


def _owner_rows(stacked: Target, cache) -> list[tuple[np.ndarray, np.ndarray]]:
    """A stacked Gemma4 cache's (k, v) [B, S, K, H] per K/V-owning layer, in layer order."""
    layers = stacked.model.layers
    owning = [g for seg, _, g in layers.group_index() if seg.owns_kv]
    out = []
    for i in range(stacked.config.first_kv_shared_layer):
        g, n = layers.layer_location(i)
        c = owning.index(g)
        out.append((np.asarray(cache.k[c][n]), np.asarray(cache.v[c][n])))
    return out


def test_the_layout_is_one_buffer_per_layer(targets):
    stacked, view = targets
    cfg = view.config
    layers = view.model.layers
    assert isinstance(layers, Gemma4Layers) and has_layer_buffers(view.model)
    assert not has_layer_buffers(stacked.model)
    assert len(layers.per_layer) == cfg.num_hidden_layers
    names = layers.names
    assert "w_qk" in names[1] and "w_qkv" in names[0]       # full layers: k = v
    assert "wq" in names[-1] and "wk" not in names[-1]      # KV-shared: no K/V projection
    assert all("w_gate_up" in n for n in names)
    cache = view.init_cache(2, 16)
    assert len(cache.k) == cfg.first_kv_shared_layer and all(c.shape[0] == 1 for c in cache.k)
    assert with_layer_buffers(view.graphdef, view.state)[0] is view.graphdef


def test_unfused_buffers_keep_the_stack_matrices(targets):
    """`fuse=False` (a tensor-parallel mesh): each layer's q/k/v and gate/up stay apart, with
    the stack's logical axes less "layers", and the forward is the same."""
    stacked, _ = targets
    gd, st = with_layer_buffers(stacked.graphdef, stacked.state, fuse=False)
    view = dataclasses.replace(stacked, graphdef=gd, state=st)
    layer = view.model.layers.per_layer[0]
    assert {"wq", "wk", "wv", "w_gate", "w_up"} <= set(view.model.layers.names[0])
    assert layer["wq"].get_metadata()["axes"] == ("embed", "q_heads", "head_dim")
    ids = _ids(2, 16, seed=4)
    _close(view.logits(ids), stacked.logits(ids))


def test_forward_and_prefill_equal_the_stacked_layers(targets):
    stacked, view = targets
    ids = _ids(2, 16, seed=1)
    _close(view.logits(ids), stacked.logits(ids))
    _close(view.hidden_states(ids, TAPS), stacked.hidden_states(ids, TAPS))
    outs = [jax.jit(lambda st, t, gd=t_.graphdef: prefill(nnx.merge(gd, st), t, 8, TAPS))(
        t_.state, jnp.asarray(ids)) for t_ in targets]                      # two chunks of 8
    _close(outs[1].hidden, outs[0].hidden)
    _close(outs[1].taps, outs[0].taps)
    for (k0, v0), k1, v1 in zip(_owner_rows(stacked, outs[0].cache), outs[1].cache.k,
                                outs[1].cache.v):
        _close(k1[0], k0)
        _close(v1[0], v0)


def test_steps_and_verification_equal_the_stacked_layers(targets):
    """Past the sliding window (5): a 12-token prompt, one-token steps, a 4-token block."""
    stacked, view = targets
    B, S = 3, 32
    seq = _ids(B, 20, seed=2)
    caches = [t.init_cache(B, S) for t in targets]
    start = 0
    for n in (12, 1, 1, 4, 1):
        outs = []
        for i, t in enumerate(targets):
            toks = jnp.asarray(seq[:, start:start + n])
            logits, taps, caches[i] = _step(t.graphdef, t.state, toks, caches[i])
            outs.append((logits, taps))
        _close(outs[1][0], outs[0][0])
        _close(outs[1][1], outs[0][1])
        start += n
    assert list(caches[1].lengths) == [start] * B
    for (k0, v0), k1, v1 in zip(_owner_rows(stacked, caches[0]), caches[1].k, caches[1].v):
        _close(k1[0], k0)
        _close(v1[0], v0)
    full = stacked.logits(seq[:, :start])          # and both equal the uncached forward
    _close(outs[1][0][:, -1], full[:, -1])


def test_ragged_verification_equals_the_stacked_layers(targets):
    """Requests at different lengths, tokens out of slot order, padding that writes nothing."""
    stacked, view = targets
    lens = np.asarray([9, 12, 6])
    R, S = len(lens), 32
    toks = _ids(R, 16, seed=5)
    caches = []
    for t in targets:
        _, _, c = _step(t.graphdef, t.state, jnp.asarray(toks), t.init_cache(R, S))
        caches.append(c.with_lengths(jnp.asarray(lens, jnp.int32)))
    seq = _ids(R, 5, seed=6)
    ell, K = [4, 0, 2], 12
    tok, slot, pos, valid = (np.zeros(K, np.int32) for _ in range(4))
    order = [(r, j) for r in (2, 0, 1) for j in range(ell[r] + 1)]
    for k, (r, j) in enumerate(order):
        tok[k], slot[k], pos[k], valid[k] = seq[r, j], r, lens[r] + j, 1
    slot[len(order):], pos[len(order):] = 7, 3
    outs = []
    for t, c in zip(targets, caches):
        m = t.model
        out = jax.jit(lambda *a, m=m: ragged_forward(m, *a, tap_layer_ids=TAPS))(
            jnp.asarray(tok), jnp.asarray(slot), jnp.asarray(pos), jnp.asarray(valid, bool), c)
        outs.append((m.logits(out.hidden), out))
    _close(outs[1][0], outs[0][0])
    _close(outs[1][1].taps, outs[0][1].taps)
    for (k0, v0), k1, v1 in zip(_owner_rows(stacked, outs[0][1].cache), outs[1][1].cache.k,
                                outs[1][1].cache.v):
        _close(k1[0], k0)
        _close(v1[0], v0)


def test_greedy_speculative_on_layer_buffers_equals_autoregressive(tmp_path):
    """DeepSpec's Gemma4 drafters take targets without per-layer inputs: the target here has
    sliding and k=v full layers; both decoders run on the per-layer layout."""
    from dspark_jax.decoding import autoregressive_generate
    from dspark_jax.serving import speculative_generate

    stacked = load_target(save_tiny_gemma4(
        tmp_path / "t", "all_features", seed=2, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0))
    view = stacked.decoding_layout(True)
    assert isinstance(view.model.layers, Gemma4Layers)
    draft = init_draft(stacked, dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1, 2),
                                     mask_token_id=4, markov_rank=8), seed=1)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]
    ref = autoregressive_generate(stacked, prompts, max_new_tokens=12, stop_token_ids=[],
                                  layer_buffers=False)
    assert autoregressive_generate(view, prompts, max_new_tokens=12, stop_token_ids=[]) == ref
    res = speculative_generate(view, draft, prompts, max_new_tokens=12, stop_token_ids=[])
    assert res.tokens == ref


def test_greedy_autoregressive_on_layer_buffers_equals_the_stacked_layers(targets):
    """Per-layer inputs and KV-shared layers on: the autoregressive loop's prefill and steps."""
    from dspark_jax.decoding import autoregressive_generate

    stacked, view = targets
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]
    ref = autoregressive_generate(stacked, prompts, max_new_tokens=12, stop_token_ids=[],
                                  layer_buffers=False)
    assert autoregressive_generate(view, prompts, max_new_tokens=12, stop_token_ids=[]) == ref


@pytest.mark.parametrize("variant,head_dims,split", [
    ("all_features", (16, 32), False), ("all_features", (16, 32), True),
    ("all_features", (32, 64), True), ("untied_plain", (32, 64), False),
    ("untied_plain", (32, 64), True)])
def test_steps_through_the_decode_attention_kernel_equal_the_stacked_layers(
        tmp_path, monkeypatch, variant, head_dims, split):
    """The program a GPU compiles, its kernels interpreted (`layers.interpret_kernels`): each
    K/V-owning layer with heads of 32 or more runs its q/k/v norms, RoPE and attention in
    `layer_attention` (a sliding layer with its window, a k=v full layer's values from its k
    heads, a full layer's proportional RoPE), which writes its rows into the cache unless a
    KV-shared layer reads them; the other layers' attention over the cache in the
    decode-attention kernel, past the window; the residual updates in the norm kernel (the
    sandwich norms, the layer scalar taken with the next input norm); logits and caches equal
    to the stacked layers'."""
    import pallas_kernels.decode_attention as DA
    import pallas_kernels.norms as NK
    from dspark_jax.models import layers as L

    windows, norms, layer_calls, writes = [], set(), [], []
    kernel, norm_kernel, layer_kernel = DA.decode_attention, NK.add_rms_norm, DA.layer_attention

    def counted(*args, **kw):
        windows.append(kw.get("window", 0))
        return kernel(*args, **kw)

    def counted_norm(*args, **kw):
        norms.add((kw.get("delta_weight") is not None, kw.get("scale") is not None,
                   args[2] is not None))
        return norm_kernel(*args, **kw)

    def counted_layer(*args, **kw):
        layer_calls.append((args[0].shape[-1], kw["window"], kw["v_from_k"], kw["v_norm"],
                            args[0].ndim == 5))
        writes.append(kw["write"])
        return layer_kernel(*args, **kw)

    monkeypatch.setattr(DA, "decode_attention", counted)
    monkeypatch.setattr(DA, "layer_attention", counted_layer)
    monkeypatch.setattr(NK, "add_rms_norm", counted_norm)
    parts: list[int] = []
    if split:   # the q/k/v, o, down and PLE products split along K (the threshold lowered)
        from dspark_jax.models import decoding_layer as DL

        monkeypatch.setattr(DL, "SPLIT_K_MIN_CHUNK", 8)
        real = DL.product_parts
        monkeypatch.setattr(DL, "product_parts",
                            lambda x, w, p: parts.append(p) or real(x, w, p))
    # sliding heads of 16 (the decode-attention kernel's smallest tile; `layer_attention`
    # takes heads of 32 or more) or 32; windows of 5 / 3 within the 15 tokens
    head_dim, global_head_dim = head_dims
    stacked = load_target(save_tiny_gemma4(tmp_path, variant, head_dim=head_dim,
                                           global_head_dim=global_head_dim))
    gd, st = with_layer_buffers(stacked.graphdef, stacked.state)
    targets = (stacked, dataclasses.replace(stacked, graphdef=gd, state=st))
    B, S = 2, 64                     # the kernel's cache tile divides the cache
    seq = _ids(B, 20, seed=5)
    caches = [t.init_cache(B, S) for t in targets]
    start = 0
    with L.interpret_kernels():
        for n in (9, 1, 4, 1):
            outs = []
            for i, t in enumerate(targets):
                toks = jnp.asarray(seq[:, start:start + n])
                m = nnx.merge(t.graphdef, t.state)
                out = m(toks, cache=caches[i], advance=jnp.full((B,), n))
                caches[i] = out.cache
                outs.append(m.logits(out.hidden))
            _close(outs[1], outs[0])
            start += n
    # the rows the kernels wrote into the caches (and those written after the layers)
    for (k0, v0), k1, v1 in zip(_owner_rows(stacked, caches[0]), caches[1].k, caches[1].v):
        _close(k1[0], k0)
        _close(v1[0], v0)
    cfg = stacked.config
    window = cfg.sliding_window
    assert window < start
    k_eq_v = cfg.attention_k_eq_v
    # `layer_attention`'s calls (head size, window, k=v, v norm, split-K parts): the full
    # layers' (k=v in all_features), and the sliding layers' at heads of 32
    want = {(global_head_dim, 0, k_eq_v, True, split)}
    if head_dim >= 32:
        want.add((head_dim, window, False, True, split))
    assert set(layer_calls) == want, layer_calls
    owners = [cfg.layer_type(i) for i in range(cfg.first_kv_shared_layer)]
    taken = owners.count("full_attention") + (
        owners.count("sliding_attention") if head_dim >= 32 else 0)
    assert len(layer_calls) == 4 * taken, layer_calls    # every owning layer the kernels take
    # each writes its rows into its cache, but for the layers KV-shared layers read
    assert set(writes) == ({True, False} if cfg.num_kv_shared_layers else {True}), writes
    # the decode-attention kernel: the KV-shared layers' and the sliding layers' at heads of 16
    want_windows = set()
    if head_dim < 32 or cfg.num_kv_shared_layers:
        want_windows.add(window)
    if cfg.num_kv_shared_layers:
        want_windows.add(0)
    assert set(windows) == want_windows, windows
    # (sandwich norm, scale, output norm): after the attention; the PLE's; the next input's
    want_norms = {(True, False, True), (True, True, True)}
    if cfg.hidden_size_per_layer_input:
        want_norms.add((True, False, False))
    assert want_norms <= norms, norms
    assert (min(parts) >= 2) if split else not parts, parts
