"""The frozen target decoder Mt (SPEC §1–2) as a functional Flax NNX module.

Built for speculative decoding: a static-shape KV cache with per-sequence lengths (a ragged
batch), prefill and multi-token extension at arbitrary per-sequence positions (the verification
pass), and rollback by moving a length. Every forward can return the hidden-state taps the
drafters condition on (output of layer i before the final norm, −1 = embeddings) and the final
normed hidden state, from which logits are taken at whichever positions the caller needs.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models import layers as L
from dspark_jax.models.config import DecoderConfig
from dspark_jax.sharding import constrain

CACHE_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")


@flax.struct.dataclass
class KVCache:
    """Keys/values [L, B, S_max, K, H] and committed lengths [B] (int32).

    (Gemma4: k and v are tuples with one [n, B, S_max, K, H] array per K/V-owning layer group,
    since layer types differ in head shape; see models/gemma4.py.)

    Positions ≥ lengths[b] hold stale entries that are overwritten before they become visible,
    so rolling back rejected draft tokens is just `with_lengths(...)`.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        k = self.k[0] if isinstance(self.k, tuple) else self.k
        return k.shape[2]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return self.replace(lengths=lengths.astype(jnp.int32))


def init_cache(cfg: DecoderConfig, batch: int, max_len: int, dtype: Any = jnp.float32,
               num_layers: int | None = None) -> KVCache:
    if cfg.is_gemma4:
        from dspark_jax.models.gemma4 import cache_shapes

        shapes = cache_shapes(cfg, batch, max_len)
        return KVCache(k=tuple(jnp.zeros(s, dtype) for s in shapes),
                       v=tuple(jnp.zeros(s, dtype) for s in shapes),
                       lengths=jnp.zeros((batch,), jnp.int32))
    shape = (num_layers or cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads,
             cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))


@flax.struct.dataclass
class DecoderOutput:
    hidden: jax.Array          # [B, T, D] final-normed hidden state
    taps: jax.Array | None     # [B, T, n·D] layer outputs for tap_layer_ids, concatenated
    cache: KVCache | None


class TargetDecoder(nnx.Module):
    """Llama / Qwen3 / Gemma4 decoder-only LM. `dtype` is the compute dtype, `param_dtype` the
    storage. Gemma4's layers live in a `gemma4.Gemma4Stack` the forward dispatches to."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = L.param(rngs, (V, D), ("vocab", "embed"), param_dtype)
        if cfg.is_gemma4:
            from dspark_jax.models.gemma4 import Gemma4Stack

            self.layers = Gemma4Stack(cfg, rngs=rngs, param_dtype=param_dtype)
        else:
            self.layers = L.DecoderLayers(cfg, cfg.num_hidden_layers, rngs=rngs,
                                          param_dtype=param_dtype)
        self.final_norm = L.param(None, (D,), ("norm",), param_dtype, "ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = L.param(rngs, (V, D), ("vocab", "embed"), param_dtype)

    # ------------------------------------------------------------------ pieces
    def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
        table = self.embed.get_value()
        emb = jnp.take(table, tokens_bt, axis=0)
        if self.cfg.is_gemma4:  # scaled by √D rounded to the storage dtype, as Hugging Face
            emb = emb * jnp.asarray(self.cfg.hidden_size ** 0.5, table.dtype)
        emb = emb.astype(self.dtype)
        return constrain(emb, ("batch", "seq", "act_embed"))

    def lm_head_weight(self) -> jax.Array:
        w = self.embed if self.cfg.tie_word_embeddings else self.lm_head
        return w.get_value()

    def logits(self, hidden_btd: jax.Array) -> jax.Array:
        """float32 logits [..., V] from final-normed hidden states (Gemma4: softcapped)."""
        w = self.lm_head_weight().astype(self.dtype)
        out = jnp.einsum("...D,VD->...V", hidden_btd.astype(self.dtype), w,
                         preferred_element_type=jnp.float32)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            out = jnp.tanh(out / cap) * cap
        return out

    def tap_slots(self, tap_layer_ids: Sequence[int]) -> list[int]:
        n = self.cfg.num_hidden_layers
        ids = list(tap_layer_ids)
        for i in ids:
            if not -1 <= i < n:
                raise ValueError(f"target layer id {i} out of range [-1, {n - 1}]")
        return ids

    # ------------------------------------------------------------------ forward
    def __call__(self, tokens_bt: jax.Array, *, positions_bt: jax.Array | None = None,
                 cache: KVCache | None = None, segment_ids_bt: jax.Array | None = None,
                 tap_layer_ids: Sequence[int] = (), advance: jax.Array | None = None
                 ) -> DecoderOutput:
        """Runs the decoder on `tokens_bt` [B, T].

        Without a cache: a causal forward over the T tokens (positions default to 0..T−1;
        `segment_ids_bt` restricts attention to equal non-zero segments, for packed rows).
        With a cache: token t of row b sits at position `cache.lengths[b] + t`; its K/V are
        written there and it sees every cached key at a position ≤ its own. The returned cache
        has lengths advanced by `advance` [B] (default: unchanged — the caller commits).
        """
        cfg = self.cfg
        B, T = tokens_bt.shape
        if cache is not None:
            positions_bt = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        elif positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        positions_bt = positions_bt.astype(jnp.int32)

        h = self.embed_tokens(tokens_bt)
        tap_ids = self.tap_slots(tap_layer_ids)
        if cfg.is_gemma4:
            return self._gemma4_call(tokens_bt, h, positions_bt, cache, segment_ids_bt, tap_ids,
                                     advance)
        n_taps = len(tap_ids)
        slot_of_layer = [-1] * cfg.num_hidden_layers
        for slot, lid in enumerate(tap_ids):
            if lid >= 0:
                slot_of_layer[lid] = slot
        taps0 = jnp.zeros((max(n_taps, 1), B, T, cfg.hidden_size), self.dtype)
        for slot, lid in enumerate(tap_ids):
            if lid == -1:
                taps0 = taps0.at[slot].set(h)

        if cache is None:
            idx = jnp.arange(T)
            mask = jnp.broadcast_to(idx[None, :, None] >= idx[None, None, :], (B, T, T))
            if segment_ids_bt is not None:
                seg = segment_ids_bt
                mask = mask & (seg[:, :, None] == seg[:, None, :])
            kv_state = None
        else:
            key_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
            mask = key_pos[None, None, :] <= positions_bt[:, :, None]  # [B,T,S]
            kv_state = (cache.k.astype(self.dtype), cache.v.astype(self.dtype))

        stack = self.layers.stacked(self.dtype)
        eps = cfg.rms_norm_eps
        b_idx = jnp.arange(B)[:, None]

        def body(carry, xs):
            h, taps, kv = carry
            lp, layer_idx, slot = xs
            x = L.rms_norm(h, lp["input_norm"], eps)
            q = L.apply_rope(L.project_q(lp, x, eps), positions_bt, cfg.rope)
            k, v = L.project_kv(lp, x, eps)
            k = L.apply_rope(k, positions_bt, cfg.rope)
            if kv is None:
                attn = L.attend(q, k, v, mask)
            else:
                kc, vc = kv
                # scatter this step's K/V at per-row positions; out-of-range rows are dropped
                kc = kc.at[layer_idx, b_idx, positions_bt].set(k, mode="drop")
                vc = vc.at[layer_idx, b_idx, positions_bt].set(v, mode="drop")
                kv = (kc, vc)
                attn = L.attend(q, kc[layer_idx], vc[layer_idx], mask, one_query_reduce=True)
            h = L.attn_out_and_mlp(lp, h, attn, eps)
            if n_taps:
                cur = taps[jnp.maximum(slot, 0)]
                taps = taps.at[jnp.maximum(slot, 0)].set(jnp.where(slot >= 0, h, cur))
            return (h, taps, kv), None

        xs = (stack, jnp.arange(cfg.num_hidden_layers), jnp.asarray(slot_of_layer, jnp.int32))
        (h, taps, kv_state), _ = jax.lax.scan(body, (h, taps0, kv_state), xs)
        hidden = L.rms_norm(h, self.final_norm.get_value(), eps)

        new_cache = None
        if cache is not None:
            lengths = cache.lengths if advance is None else cache.lengths + advance
            new_cache = KVCache(k=kv_state[0].astype(cache.k.dtype),
                                v=kv_state[1].astype(cache.v.dtype),
                                lengths=lengths.astype(jnp.int32))
        taps_out = None
        if n_taps:
            taps_out = jnp.transpose(taps, (1, 2, 0, 3)).reshape(B, T, n_taps * cfg.hidden_size)
        return DecoderOutput(hidden=hidden, taps=taps_out, cache=new_cache)

    def _gemma4_call(self, tokens_bt: jax.Array, h: jax.Array, positions_bt: jax.Array,
                     cache: KVCache | None, segment_ids_bt: jax.Array | None,
                     tap_ids: list[int], advance: jax.Array | None) -> DecoderOutput:
        from dspark_jax.models import gemma4

        cfg = self.cfg
        B, T = tokens_bt.shape
        kv = None
        if cache is not None:
            kv = (tuple(k.astype(self.dtype) for k in cache.k),
                  tuple(v.astype(self.dtype) for v in cache.v))
        h, taps, kv = gemma4.forward(self.layers, cfg, tokens_bt, h, positions_bt, kv,
                                     segment_ids_bt, tap_ids, self.dtype)
        hidden = L.rms_norm(h, self.final_norm.get_value(), cfg.rms_norm_eps)
        new_cache = None
        if cache is not None:
            lengths = cache.lengths if advance is None else cache.lengths + advance
            new_cache = KVCache(k=tuple(a.astype(b.dtype) for a, b in zip(kv[0], cache.k)),
                                v=tuple(a.astype(b.dtype) for a, b in zip(kv[1], cache.v)),
                                lengths=lengths.astype(jnp.int32))
        taps_out = None
        if taps is not None:
            n = len(tap_ids)
            taps_out = jnp.transpose(taps, (1, 2, 0, 3)).reshape(B, T, n * cfg.hidden_size)
        return DecoderOutput(hidden=hidden, taps=taps_out, cache=new_cache)


@flax.struct.dataclass
class RaggedOutput:
    hidden: jax.Array          # [K, D] final-normed hidden state per flattened token
    taps: jax.Array | None     # [K, n·D] layer outputs for tap_layer_ids, concatenated
    cache: KVCache             # K/V of the valid tokens written; lengths unchanged


def ragged_forward(model: TargetDecoder, tokens_k: jax.Array, slot_k: jax.Array,
                   position_k: jax.Array, valid_k: jax.Array, cache: KVCache,
                   tap_layer_ids: Sequence[int] = ()) -> RaggedOutput:
    """The verification forward of load-aware decoding (paper §5.2–5.3; SPEC §9).

    The admitted tokens of all requests are flattened along one token axis of static capacity
    K: token k belongs to request `slot_k[k]` of the static cache [R, S_max] and sits at
    `position_k[k]`. Valid tokens write their K/V at (slot, position) (padding writes nothing:
    its scatter index is out of range and dropped) and attend to their request's cache at
    positions ≤ their own — the committed prefix plus the request's own earlier admitted
    tokens, which are written first. Every matmul runs over the K tokens only, so the cost of a
    step scales with the tokens admitted, not with R·(γ+1). Lengths are not advanced (the
    caller commits by moving them). Gemma4 runs the same addressing through its own layers
    (`_gemma4_ragged`).
    """
    cfg = model.cfg
    if cfg.is_gemma4:
        return _gemma4_ragged(model, tokens_k, slot_k, position_k, valid_k, cache, tap_layer_ids)
    K = tokens_k.shape[0]
    R, S = cache.k.shape[1], cache.k.shape[2]
    pos_1k = position_k.astype(jnp.int32)[None]                               # [1,K]
    slot_r = jnp.clip(slot_k.astype(jnp.int32), 0, R - 1)                     # read index
    slot_w = jnp.where(valid_k, slot_r, R)                                    # write: R = drop
    key_pos = jnp.arange(S, dtype=jnp.int32)
    mask_k1s = ((key_pos[None, :] <= position_k[:, None]) & valid_k[:, None])[:, None, :]

    h = model.embed_tokens(tokens_k[None])                                    # [1,K,D]
    tap_ids = model.tap_slots(tap_layer_ids)
    n_taps = len(tap_ids)
    slot_of_layer = [-1] * cfg.num_hidden_layers
    for t, lid in enumerate(tap_ids):
        if lid >= 0:
            slot_of_layer[lid] = t
    taps0 = jnp.zeros((max(n_taps, 1), 1, K, cfg.hidden_size), model.dtype)
    for t, lid in enumerate(tap_ids):
        if lid == -1:
            taps0 = taps0.at[t].set(h)

    stack = model.layers.stacked(model.dtype)
    eps = cfg.rms_norm_eps

    def body(carry, xs):
        h, taps, kc, vc = carry
        lp, layer_idx, tap_slot = xs
        x = L.rms_norm(h, lp["input_norm"], eps)
        q = L.apply_rope(L.project_q(lp, x, eps), pos_1k, cfg.rope)           # [1,K,N,H]
        k, v = L.project_kv(lp, x, eps)
        k = L.apply_rope(k, pos_1k, cfg.rope)                                 # [1,K,Kh,H]
        kc = kc.at[layer_idx, slot_w, position_k].set(k[0], mode="drop")
        vc = vc.at[layer_idx, slot_w, position_k].set(v[0], mode="drop")
        # each token is its own attention row over its request's cache: [K, 1, ·] vs [K, S, ·]
        k_tok, v_tok = kc[layer_idx][slot_r], vc[layer_idx][slot_r]           # [K,S,Kh,H]
        attn = L.attend(q[0][:, None], k_tok, v_tok, mask_k1s)[:, 0][None]    # [1,K,N,H]
        h = L.attn_out_and_mlp(lp, h, attn, eps)
        if n_taps:
            cur = taps[jnp.maximum(tap_slot, 0)]
            taps = taps.at[jnp.maximum(tap_slot, 0)].set(jnp.where(tap_slot >= 0, h, cur))
        return (h, taps, kc, vc), None

    xs = (stack, jnp.arange(cfg.num_hidden_layers), jnp.asarray(slot_of_layer, jnp.int32))
    init = (h, taps0, cache.k.astype(model.dtype), cache.v.astype(model.dtype))
    (h, taps, kc, vc), _ = jax.lax.scan(body, init, xs)
    hidden = L.rms_norm(h, model.final_norm.get_value(), eps)[0]
    taps_out = None
    if n_taps:
        taps_out = jnp.transpose(taps[:, 0], (1, 0, 2)).reshape(K, n_taps * cfg.hidden_size)
    return RaggedOutput(hidden=hidden, taps=taps_out,
                        cache=cache.replace(k=kc.astype(cache.k.dtype),
                                            v=vc.astype(cache.v.dtype)))


def _gemma4_ragged(model: TargetDecoder, tokens_k: jax.Array, slot_k: jax.Array,
                   position_k: jax.Array, valid_k: jax.Array, cache: KVCache,
                   tap_layer_ids: Sequence[int]) -> RaggedOutput:
    """`ragged_forward` for Gemma4: the K tokens as one row of `gemma4.forward`, each reading
    and writing its own request's row of every per-group cache (sliding windows, KV sharing and
    per-layer inputs as in the dense path, whose layer math it runs)."""
    from dspark_jax.models import gemma4

    cfg = model.cfg
    K = tokens_k.shape[0]
    R = cache.k[0].shape[1]
    slot_r = jnp.clip(slot_k.astype(jnp.int32), 0, R - 1)                     # read index
    rows = gemma4.RaggedRows(read_k=slot_r, write_k=jnp.where(valid_k, slot_r, R),  # R = drop
                             valid_k=valid_k.astype(bool))
    tokens_1k = tokens_k.astype(jnp.int32)[None]
    h = model.embed_tokens(tokens_1k)                                         # [1,K,D]
    tap_ids = model.tap_slots(tap_layer_ids)
    kv = (tuple(k.astype(model.dtype) for k in cache.k),
          tuple(v.astype(model.dtype) for v in cache.v))
    h, taps, kv = gemma4.forward(model.layers, cfg, tokens_1k, h,
                                 position_k.astype(jnp.int32)[None], kv, None, tap_ids,
                                 model.dtype, ragged=rows)
    hidden = L.rms_norm(h, model.final_norm.get_value(), cfg.rms_norm_eps)[0]
    taps_out = None
    if taps is not None:
        taps_out = jnp.transpose(taps[:, 0], (1, 0, 2)).reshape(K, len(tap_ids) * cfg.hidden_size)
    return RaggedOutput(hidden=hidden, taps=taps_out, cache=cache.replace(
        k=tuple(a.astype(b.dtype) for a, b in zip(kv[0], cache.k)),
        v=tuple(a.astype(b.dtype) for a, b in zip(kv[1], cache.v))))


def create_target(cfg: DecoderConfig, seed: int = 0, dtype: Any = jnp.float32,
                  param_dtype: Any = jnp.float32) -> TargetDecoder:
    return TargetDecoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)


def abstract_target(cfg: DecoderConfig, dtype: Any = jnp.float32,
                    param_dtype: Any = jnp.float32) -> TargetDecoder:
    """A TargetDecoder whose parameters are ShapeDtypeStructs (nothing materialised)."""
    return nnx.eval_shape(lambda: create_target(cfg, 0, dtype, param_dtype))


__all__ = ["KVCache", "init_cache", "DecoderOutput", "TargetDecoder", "create_target",
           "abstract_target", "RaggedOutput", "ragged_forward"]
