"""The Llama / Qwen3 decoder layers inside the target decoder (SPEC §1–2; the paper's Qwen3
targets). `TargetDecoder` (models/decoder.py) runs them through the "llama" / "qwen3" families.

All layers share one shape, so their parameters are stacked on a leading "layers" axis
(`layers.DecoderLayers`) and one `lax.scan` body runs them; with one buffer per layer
(`layers.UnstackedLayers`, the decoding layout) the same body runs unrolled
(`layers.run_layers`). The KV cache is one array per k/v, [L, B, S_max, K, H]; a token attends
to every cached key at a position below its row's first new token and to its row's new tokens
up to itself. The layer loop only reads the cache, each layer's attention taking the cached
keys where they lie and this call's own keys beside them (`layers.attend_cache_and_own`), and
the new K/V are written at their positions after the last layer, one scatter per cache: a
cache written inside the loop and then read, or concatenated with the new rows, is copied
whole by the compiler (XLA:GPU and XLA:CPU alike) before attention reads it.
`ragged_forward` is the verification pass of load-aware decoding (paper §5.2–5.3, SPEC §9):
flattened tokens of many requests, each its own attention row over its request's cache row.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models import decoding_layer as DL
from dspark_jax.models import layers as L
from dspark_jax.models.config import DecoderConfig
from dspark_jax.sharding import constrain


def make_stack(cfg: DecoderConfig, *, rngs: nnx.Rngs, param_dtype: Any) -> L.DecoderLayers:
    return L.DecoderLayers(cfg, cfg.num_hidden_layers, rngs=rngs, param_dtype=param_dtype)


def init_kv(cfg: DecoderConfig, batch: int, max_len: int, dtype: Any,
            num_layers: int | None = None, per_layer: bool = False) -> tuple[Any, Any]:
    """Zero K and V caches [L, B, S_max, K, H] (`num_layers` overrides L); `per_layer`: a
    tuple of L buffers [1, B, S_max, K, H] each (the decoding layout, `layers.cache_layer`)."""
    n = num_layers or cfg.num_hidden_layers
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    if per_layer:
        return (tuple(jnp.zeros((1,) + shape, dtype) for _ in range(n)),
                tuple(jnp.zeros((1,) + shape, dtype) for _ in range(n)))
    return jnp.zeros((n,) + shape, dtype), jnp.zeros((n,) + shape, dtype)


# The taps as the layers fill them: a buffer [n, B, T, D] where a scan carries them, or for
# per-layer buffers (a Python loop, static slots) a tuple of the n taps (None until filled),
# stacked once at the end (`_taps_out`): one kernel, where each layer's update of a buffer
# would be its own
Taps = jax.Array | tuple[jax.Array | None, ...]


def _taps_init(tap_ids: Sequence[int], h: jax.Array, num_layers: int, per_layer: bool
               ) -> tuple[Taps, list[int]]:
    """The taps (embedding taps filled; a tuple for `per_layer` buffers, else the buffer
    [max(n, 1), B, T, D]) and each layer's tap slot."""
    slot_of_layer = [-1] * num_layers
    for slot, lid in enumerate(tap_ids):
        if lid >= 0:
            slot_of_layer[lid] = slot
    if per_layer:
        return tuple(h if lid == -1 else None for lid in tap_ids), slot_of_layer
    taps0 = jnp.zeros((max(len(tap_ids), 1),) + h.shape, h.dtype)
    for slot, lid in enumerate(tap_ids):
        if lid == -1:
            taps0 = taps0.at[slot].set(h)
    return taps0, slot_of_layer


def _tapped(taps: Taps, slot: Any, h: jax.Array) -> Taps:
    """The taps with a layer's output h [B, T, D] in its slot (`slot` < 0: not tapped)."""
    if isinstance(taps, tuple):
        return taps if slot < 0 else taps[:slot] + (h,) + taps[slot + 1:]
    cur = taps[jnp.maximum(slot, 0)]
    return taps.at[jnp.maximum(slot, 0)].set(jnp.where(slot >= 0, h, cur))


def _taps_out(taps: Taps) -> jax.Array:
    """The taps [n, B, T, D]."""
    return jnp.stack(taps) if isinstance(taps, tuple) else taps


def _no_delta(h: jax.Array, params: Any) -> jax.Array | None:
    """The first layer's residual delta: none (per-layer buffers, unrolled), or zeros where a
    scan carries it."""
    return jnp.zeros_like(h) if isinstance(params, dict) else None


def _tap_output(taps: Taps, slot: Any, h: jax.Array, delta: Any
                ) -> tuple[Taps, jax.Array, Any]:
    """(taps with the layer's output h + delta in its slot, h, delta) for the next layer: a
    layer with no slot (a static slot < 0) leaves them as they are, its delta possibly untaken
    (`decoding_layer.Product`, `GatedProduct`); so does a tapped layer whose delta is a
    `GatedProduct` (one buffer per layer, a static slot): the next sum takes it, in the next
    layer's input norm or the last sum, and `_tap_sum` writes the tap from that sum (on a GPU
    the kernel that sums its parts, so a tapped layer costs no kernel of its own); any other
    delta is taken here, as its value."""
    if isinstance(slot, int) and (slot < 0 or isinstance(delta, DL.GatedProduct)):
        return taps, h, delta
    delta = DL.value(delta)
    return _tapped(taps, slot, h + delta), h, delta


def _pending_tap(delta: Any, slot_of_layer: Sequence[int], layer: Any) -> int:
    """The tap slot of the layer before `layer` whose sum `_tap_output` left to the next one
    (its delta still a `GatedProduct`), or −1."""
    if isinstance(delta, DL.GatedProduct) and isinstance(layer, int) and layer > 0:
        return slot_of_layer[layer - 1]
    return -1


def _tap_sum(taps: Taps, pending: int, s: jax.Array) -> Taps:
    """Taps with the sum s the layer after a pending tap took (`_pending_tap`) in its slot."""
    return taps if pending < 0 else _tapped(taps, pending, s)


def _last_sum(h: jax.Array, delta: Any, final_norm: jax.Array | None, eps: float
              ) -> tuple[jax.Array, jax.Array]:
    """(the last MLP's residual sum h + delta, or with `final_norm` its final norm; the sum):
    on a GPU one kernel with the norm, after the activation's and down product's
    (`decoding_layer.add_rms_norm`)."""
    s, normed = DL.add_rms_norm(h, delta, final_norm, eps)
    return constrain(s if final_norm is None else normed, ("batch", "seq", "act_embed")), s


def forward(stack: L.DecoderLayers | L.UnstackedLayers, cfg: DecoderConfig,
            tokens_bt: jax.Array, h: jax.Array, positions_bt: jax.Array,
            cache_kv: tuple[jax.Array, jax.Array] | None, segment_ids_bt: jax.Array | None,
            tap_ids: Sequence[int], dtype: Any, defer_writes: bool = False,
            final_norm: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array | None, tuple[jax.Array, jax.Array] | None]:
    """Runs every layer on the embedded tokens h [B, T, D].

    Returns (h before the final norm, or with `final_norm` [D] after it, taps [n, B, T, D] or
    None, the updated (k, v) caches).
    Without `cache_kv`: causal attention over the T tokens (restricted to equal
    `segment_ids_bt`, for packed rows; `layers.causal_attention`). With it: token t of row b
    sits at `positions_bt[b, t]` = `positions_bt[b, 0]` + t (consecutive, as `TargetDecoder`
    passes them), sees the cached
    keys below `positions_bt[b, 0]` and its row's tokens up to itself, and its K/V are written
    at its position (out of range: dropped) after the last layer; the layers only read the
    cache. `defer_writes` (with `cache_kv`): the third output is the new K/V rows
    ([L, B, T, K, H] each) for the caller to write instead: inside a `lax.switch` or
    `lax.cond` branch XLA copies a cache the branch writes.
    """
    B, T = tokens_bt.shape
    n_taps = len(tap_ids)
    params = stack.layer_params(dtype)
    taps0, slot_of_layer = _taps_init(tap_ids, h, cfg.num_hidden_layers,
                                      per_layer=isinstance(params, list))
    if cache_kv is not None:   # the committed prefix: cached keys below the row's first new one
        cache_start = positions_bt[:, 0]                                       # [B]
        own_mask = L.causal_mask(B, T)

    eps = cfg.rms_norm_eps

    def body(carry, xs):
        h, taps = carry
        lp, layer_idx, slot = xs
        x = L.rms_norm(h, lp["input_norm"], eps)
        q, k, v = L.project_qkv(lp, x, eps)
        q = L.apply_rope(q, positions_bt, cfg.rope)
        k = L.apply_rope(k, positions_bt, cfg.rope)
        attn = L.causal_attention(q, k, v, segment_ids_bt)   # flash on GPU/TPU
        h = L.attn_out_and_mlp(lp, h, attn, eps)
        if n_taps:
            taps = _tapped(taps, slot, h)
        return (h, taps), None

    def cached_body(carry, xs):
        """A layer over the cache. The carry holds the residual stream before the MLP's sum
        (h, delta), so that sum is taken with the next layer's input norm
        (`decoding_layer.add_rms_norm`, one kernel on a GPU), and, where the layer writes its
        rows itself (`in_layer`), the per-layer caches; otherwise the cache is only read and
        the rows are the layer's output."""
        (h, delta), taps, caches = carry
        lp, layer_idx, slot = xs
        pending = _pending_tap(delta, slot_of_layer, layer_idx)
        h, x = DL.input_norm(lp, h, delta, eps)
        taps = _tap_sum(taps, pending, h)
        layer_cache = [L.cache_layer(c, layer_idx) for c in caches or cache_kv]
        if DL.merged_o_takes(lp, x, layer_cache[0], h.shape[-1]):
            # the attention's cache splits merged in the o product's kernel
            h, delta, k, v = DL.attention_and_mlp_input(lp, h, x, positions_bt, cfg.rope, eps,
                                                        *layer_cache, cache_start, own_mask,
                                                        write=caches is not None)
        else:
            attn, k, v = DL.cached_attention(lp, x, positions_bt, cfg.rope, eps, *layer_cache,
                                             cache_start, own_mask, write=caches is not None)
            h, delta = DL.attn_out_and_mlp(lp, h, attn, eps)
        if n_taps:
            taps, h, delta = _tap_output(taps, slot, h, delta)
        if caches is not None:   # k, v: the layer's cache buffers with its rows written
            caches = tuple(c[:layer_idx] + (new[None],) + c[layer_idx + 1:]
                           for c, new in zip(caches, (k, v)))
            return ((h, delta), taps, caches), None
        return ((h, delta), taps, None), (k, v)

    per_layer = (np.arange(cfg.num_hidden_layers), np.asarray(slot_of_layer, np.int32))
    if cache_kv is None:
        (h, taps), _ = L.run_layers(body, (h, taps0), params, per_layer)
        h = h if final_norm is None else L.rms_norm(h, final_norm, eps)
        return h, (_taps_out(taps) if n_taps else None), None
    # the decoding layout on a GPU: each layer's attention kernel writes its rows into the
    # layer's own cache buffer in place
    in_layer = (not defer_writes and isinstance(cache_kv[0], tuple) and isinstance(params, list)
                and DL.fused_kernels_take(params[0], L.cache_layer(cache_kv[0], 0), dtype,
                                          T * cfg.num_attention_heads
                                          // cfg.num_key_value_heads))
    ((h, delta), taps, caches), new_kv = L.run_layers(
        cached_body, ((h, _no_delta(h, params)), taps0, cache_kv if in_layer else None),
        params, per_layer)
    pending = _pending_tap(delta, slot_of_layer, cfg.num_hidden_layers)
    h, s = _last_sum(h, delta, final_norm, eps)
    taps = _taps_out(_tap_sum(taps, pending, s)) if n_taps else None
    if in_layer:
        return h, taps, caches
    if defer_writes:
        return h, taps, new_kv
    # every layer's new K/V [L, B, T, K, H] at the rows' positions (out of range: dropped),
    # one in-place scatter per cache buffer
    index = (jnp.arange(B)[:, None], positions_bt)
    kv = (L.cache_scatter(cache_kv[0], index, new_kv[0]),
          L.cache_scatter(cache_kv[1], index, new_kv[1]))
    return h, taps, kv


def ragged_forward(stack: L.DecoderLayers | L.UnstackedLayers, cfg: DecoderConfig,
                   tokens_1k: jax.Array, h: jax.Array, positions_1k: jax.Array,
                   cache_kv: tuple[jax.Array, jax.Array], rows: L.RaggedRows,
                   tap_ids: Sequence[int], dtype: Any, defer_writes: bool = False,
                   final_norm: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array | None, tuple[jax.Array, jax.Array]]:
    """`forward` for K flattened tokens (one row, B = 1): token k writes its K/V at
    (`rows.write_k[k]`, position) and is its own attention row over cache row `rows.read_k[k]`
    at positions ≤ its own, so every matmul runs over the K tokens only. With `rows.grid_rq`
    the attention runs request by request (each cache row read once, not once a token).

    `defer_writes` (with `rows.grid_rq`): the cache stays read-only — each request's tokens
    attend to its committed prefix (positions below its cell 0) in the cache and to its own
    tokens (cells ≤ theirs) from this call's K/V — and the new K/V come back as
    ([L, K, Kh, H], [L, K, Kh, H]; per-layer buffers: L layer groups [1, K, Kh, H] each, which
    no stack copies) for the caller to write (`models.decoder.write_ragged`).
    Inside a `lax.switch` over capacity buckets this keeps XLA from copying the whole cache."""
    S = L.cache_positions(cache_kv[0])
    K = tokens_1k.shape[1]
    position_k = positions_1k[0]
    key_pos = jnp.arange(S, dtype=jnp.int32)
    by_request = rows.grid_rq is not None
    if by_request:   # queries per request [R, Q]; an empty cell sees nothing (zeros)
        R, Q = rows.grid_rq.shape
        cell_ok = rows.grid_rq < K
        grid = jnp.clip(rows.grid_rq, 0, K - 1)
        pos_rq = jnp.where(cell_ok, position_k[grid], -1)
        mask_rqs = key_pos[None, None, :] <= pos_rq[:, :, None]
        cell_k = jnp.clip(rows.cell_k, 0, R * Q - 1)
        if defer_writes:   # committed prefix from the cache ⊕ the request's own new tokens
            start_r = jnp.where(cell_ok[:, 0], pos_rq[:, 0], 0)
            own_mask = (jnp.arange(Q)[None, :, None] >= jnp.arange(Q)[None, None, :]
                        if rows.own_mask_rqq is None else rows.own_mask_rqq)
            own_mask = own_mask & cell_ok[:, None, :] & cell_ok[:, :, None]     # [R,Q,Q]
    elif defer_writes:
        raise ValueError("ragged_forward: defer_writes needs the per-request grid")
    if rows.own_mask_rqq is not None and not (by_request and defer_writes):
        raise ValueError("ragged_forward: an own-token mask needs the grid and defer_writes")
    else:
        mask_k1s = ((key_pos[None, :] <= position_k[:, None]) & rows.valid_k[:, None])[:, None, :]
    n_taps = len(tap_ids)
    params = stack.layer_params(dtype)
    taps0, slot_of_layer = _taps_init(tap_ids, h, cfg.num_hidden_layers,
                                      per_layer=isinstance(params, list))
    eps = cfg.rms_norm_eps

    def ragged_body(carry, xs):
        (h, delta), taps, kc, vc = carry   # the MLP's sum is taken with the next input norm
        lp, layer_idx, tap_slot = xs
        pending = _pending_tap(delta, slot_of_layer, layer_idx)
        if defer_writes:   # the cache is read where it lies, never written: [R, S] ⊕ own [R, Q]
            # each request's cells [R, Q] of the normed tokens (or of their q/k/v product)
            # through the attention half (`decoding_layer.cached_attention`: the GPU's
            # kernels for a chain), back to [1, K], or, for a chain the row kernels take,
            # through the whole layer with the cells gathered in the o product's kernel
            h, x = DL.input_norm(lp, h, delta, eps)
            taps = _tap_sum(taps, pending, h)
            x = DL.rows_of(x, lambda a: a[0][grid])
            layer_cache = [L.cache_layer(c, layer_idx) for c in cache_kv]
            if (rows.own_mask_rqq is None
                    and DL.merged_o_takes(lp, x, layer_cache[0], h.shape[-1], cells=K)):
                h, delta, k, v = DL.attention_and_mlp_input(
                    lp, h, x, pos_rq, cfg.rope, eps, *layer_cache, start_r, own_mask,
                    write=False, cells=cell_k)
            else:   # the K/V rows stay in the grid's cells, every layer's gathered at once
                attn, k, v = DL.cached_attention(lp, x, pos_rq, cfg.rope, eps, *layer_cache,
                                                 start_r, own_mask,
                                                 causal=rows.own_mask_rqq is None)
                attn = attn.reshape(R * Q, *attn.shape[2:])[cell_k][None]
                k, v = (a.reshape(1, R * Q, *a.shape[2:]) for a in (k, v))
                in_cells.append(True)
                h, delta = DL.attn_out_and_mlp(lp, h, attn, eps)
        else:   # each layer writes its rows, then attends over its cache
            h, x = DL.add_rms_norm(h, delta, lp["input_norm"], eps)
            taps = _tap_sum(taps, pending, h)
            q, k, v = L.project_qkv(lp, x, eps)
            q = L.apply_rope(q, positions_1k, cfg.rope)                       # [1,K,N,H]
            k = L.apply_rope(k, positions_1k, cfg.rope)                       # [1,K,Kh,H]
            kc = L.cache_set_layer(kc, layer_idx, (rows.write_k, position_k), k[0])
            vc = L.cache_set_layer(vc, layer_idx, (rows.write_k, position_k), v[0])
            keys, vals = L.cache_layer(kc, layer_idx), L.cache_layer(vc, layer_idx)
            if by_request:   # each request's tokens against its cache row: [R, Q] vs [R, S]
                attn = L.attend(q[0][grid], keys, vals, mask_rqs)               # [R,Q,N,H]
                attn = attn.reshape(R * Q, *attn.shape[2:])[cell_k][None]         # [1,K,N,H]
            else:   # each token its own attention row over its request's cache: [K, 1, ·]
                k_tok, v_tok = keys[rows.read_k], vals[rows.read_k]             # [K,S,Kh,H]
                attn = L.attend(q[0][:, None], k_tok, v_tok, mask_k1s)[:, 0][None]
            h, delta = DL.attn_out_and_mlp(lp, h, attn, eps)
        if n_taps:
            taps, h, delta = _tap_output(taps, tap_slot, h, delta)
        return ((h, delta), taps, kc, vc), ((k[0], v[0]) if defer_writes else None)

    per_layer = (np.arange(cfg.num_hidden_layers), np.asarray(slot_of_layer, np.int32))
    # no cache in the carry when the writes are deferred: the new K/V rows are the outputs
    caches = (None, None) if defer_writes else cache_kv
    in_cells: list[bool] = []   # a layer left its K/V rows in the grid's cells [R·Q]
    ((h, delta), taps, kc, vc), new_kv = L.run_layers(
        ragged_body, ((h, _no_delta(h, params)), taps0, *caches), params, per_layer)
    if in_cells:   # the layers' rows stacked and gathered back to the K tokens in one pass
        new_kv = tuple(L.cache_like(x, jnp.zeros(()))[:, cell_k] for x in new_kv)
    pending = _pending_tap(delta, slot_of_layer, cfg.num_hidden_layers)
    h, s = _last_sum(h, delta, final_norm, eps)
    taps = _taps_out(_tap_sum(taps, pending, s)) if n_taps else None
    return h, taps, (new_kv if defer_writes else (kc, vc))
