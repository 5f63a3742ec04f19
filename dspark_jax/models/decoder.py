"""The frozen target decoder Mt (SPEC §1–2) as a functional Flax NNX module.

Built for speculative decoding: a static-shape KV cache with per-sequence lengths (a ragged
batch), prefill and multi-token extension at arbitrary per-sequence positions (the verification
pass), and rollback by moving a length. Every forward can return the hidden-state taps the
drafters condition on (output of layer i before the final norm, −1 = embeddings) and the final
normed hidden state, from which logits are taken at whichever positions the caller needs.

The module is the same for every family: embeddings, final norm, LM head and the cache
bookkeeping live here; the decoder layers (their parameters, their forward, their cache
layout) are the family's (models/families.py: models/llama/decoder.py, models/gemma4/decoder.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models import layers as L
from dspark_jax.models.config import DecoderConfig
from dspark_jax.models.families import family_of
from dspark_jax.models.gemma4.decoder import Gemma4Stack
from dspark_jax.models.gemma4.layer_buffers import Gemma4Layers
from dspark_jax.sharding import constrain

CACHE_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")


@flax.struct.dataclass
class KVCache:
    """Keys/values [L, B, S_max, K, H] and committed lengths [B] (int32).

    k and v may instead be tuples of layer groups [n, B, S_max, K, H]: one group per layer
    (n = 1) is the decoding layout (`init_cache(per_layer=True)`, beside the target's per-layer
    weights), whose buffers a GEMM reads where they lie (`layers.cache_layer`); Gemma4's
    stacked layout keeps one group per K/V-owning period slot, since layer types differ in head
    shape (models/gemma4/decoder.py), and its decoding layout one buffer per K/V-owning layer.

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

    def grown(self, max_len: int) -> "KVCache":
        """The same cache with room for `max_len` ≥ `self.max_len` positions (zero-padded)."""
        if int(max_len) < self.max_len:
            raise ValueError(f"cannot shrink the cache from {self.max_len} to {max_len}")

        def pad(x: jax.Array) -> jax.Array:
            return grown_positions(x, max_len)

        return self.replace(k=jax.tree.map(pad, self.k), v=jax.tree.map(pad, self.v))

    def put_rows(self, prompt: "KVCache", rows: jax.Array, lens: jax.Array) -> "KVCache":
        """Writes the n rows of `prompt` (a cache of P positions, e.g. `prefill`'s) into rows
        `rows` [n] of this cache at positions 0..P−1 and sets their lengths to `lens` [n]; a
        row ≥ B (padding) and positions ≥ max_len are dropped."""
        P = prompt.max_len

        def put(old: jax.Array, new: jax.Array) -> jax.Array:   # [.., B, S, K, H] ← [.., n, P]
            return old.at[:, rows[:, None], jnp.arange(P)[None]].set(new.astype(old.dtype),
                                                                      mode="drop")

        return self.replace(k=jax.tree.map(put, self.k, L.cache_like(prompt.k, self.k)),
                            v=jax.tree.map(put, self.v, L.cache_like(prompt.v, self.v)),
                            lengths=self.lengths.at[rows].set(lens.astype(jnp.int32),
                                                              mode="drop"))


# a cache whose positions are a multiple of this is read by a verification GEMM where it lies;
# XLA:GPU pads (copies) every layer's cache to the next multiple for its tiles otherwise
CACHE_ALIGN = 128


def aligned_length(n: int) -> int:
    """`n` positions rounded up to a multiple of `CACHE_ALIGN` past it (a shorter cache stays
    as it is: the padding would cost more than the copy it saves)."""
    n = int(n)
    return n if n <= CACHE_ALIGN else -(-n // CACHE_ALIGN) * CACHE_ALIGN


def grown_positions(x: jax.Array, max_len: int) -> jax.Array:
    """A cache array [L, B, S, K, H] (the target's or a drafter's; S is axis 2) zero-padded to
    `max_len` ≥ S positions."""
    return jnp.pad(x, [(0, int(max_len) - x.shape[2]) if a == 2 else (0, 0)
                       for a in range(x.ndim)])


def init_cache(cfg: DecoderConfig, batch: int, max_len: int, dtype: Any = jnp.float32,
               num_layers: int | None = None, per_layer: bool = False) -> KVCache:
    """An empty cache of `batch` rows × `max_len` positions; `per_layer`: one buffer per
    layer (Gemma4: per K/V-owning layer), the layout that decoding with per-layer weights
    (`with_layer_buffers`) reads in place."""
    extra = dict(per_layer=True) if per_layer else {}
    k, v = family_of(cfg).init_kv(cfg, batch, max_len, dtype, num_layers, **extra)
    return KVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))


def has_layer_buffers(model: "TargetDecoder") -> bool:
    """Whether `model` runs one buffer per layer (`with_layer_buffers`): its caches then take
    the per-layer layout too."""
    return isinstance(model.layers, (L.UnstackedLayers, Gemma4Layers))


def _cast(kv: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda a: a.astype(dtype), kv)


def _cast_like(kv: Any, like: Any) -> Any:
    return jax.tree.map(lambda a, b: a.astype(b.dtype), kv, like)


@flax.struct.dataclass
class DecoderOutput:
    hidden: jax.Array          # [B, T, D] final-normed hidden state
    taps: jax.Array | None     # [B, T, n·D] layer outputs for tap_layer_ids, concatenated
    cache: KVCache | None
    new_kv: Any = None         # defer_writes: (k, v) [L, B, T, Kh, H] still to write (stacked or
                               # layer groups, `layers.cache_like`), else None


class TargetDecoder(nnx.Module):
    """Llama / Qwen3 / Gemma4 decoder-only LM. `dtype` is the compute dtype, `param_dtype` the
    storage. `layers` holds the family's decoder layers, which its forward runs."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = L.param(rngs, (V, D), ("vocab", "embed"), param_dtype)
        self.layers = family_of(cfg).make_stack(cfg, rngs=rngs, param_dtype=param_dtype)
        self.final_norm = L.param(None, (D,), ("norm",), param_dtype, "ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = L.param(rngs, (V, D), ("vocab", "embed"), param_dtype)

    # ------------------------------------------------------------------ pieces
    def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
        emb = L.embed(self.embed.get_value(), tokens_bt,
                      scaled=family_of(self.cfg).scale_embeddings).astype(self.dtype)
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
                 tap_layer_ids: Sequence[int] = (), advance: jax.Array | None = None,
                 defer_writes: bool = False) -> DecoderOutput:
        """Runs the decoder on `tokens_bt` [B, T].

        Without a cache: a causal forward over the T tokens (positions default to 0..T−1;
        `segment_ids_bt` restricts attention to equal segments, for packed rows).
        With a cache: token t of row b sits at position `cache.lengths[b] + t`; its K/V are
        written there and it sees every cached key at a position ≤ its own. The returned cache
        has lengths advanced by `advance` [B] (default: unchanged — the caller commits).
        `defer_writes` (with a cache, where the family supports it: `Family.defers_writes`):
        the cache is only read, and the new K/V rows come back in `new_kv` for the caller to
        write (`write_ragged` with each row's positions); the returned cache holds the input's
        arrays. Verification inside a `lax.switch` branch needs this (XLA copies a cache
        written in a branch).
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
        kv = None if cache is None else _cast((cache.k, cache.v), self.dtype)
        family = family_of(cfg)
        defer = bool(defer_writes and cache is not None and family.defers_writes)
        extra = dict(defer_writes=True) if defer else {}
        hidden, taps, kv = family.forward(self.layers, cfg, tokens_bt, h, positions_bt, kv,
                                          segment_ids_bt, tap_ids, self.dtype,
                                          final_norm=self.final_norm.get_value(), **extra)
        new_cache, new_kv = None, None
        if cache is not None:
            lengths = cache.lengths if advance is None else cache.lengths + advance
            if defer:
                new_kv, (k, v) = kv, (cache.k, cache.v)
            else:
                k, v = _cast_like(kv, (cache.k, cache.v))
            new_cache = KVCache(k=k, v=v, lengths=lengths.astype(jnp.int32))
        taps_out = None
        if taps is not None:
            n = len(tap_ids)
            taps_out = jnp.transpose(taps, (1, 2, 0, 3)).reshape(B, T, n * cfg.hidden_size)
        return DecoderOutput(hidden=hidden, taps=taps_out, cache=new_cache, new_kv=new_kv)


@flax.struct.dataclass
class RaggedOutput:
    hidden: jax.Array          # [K, D] final-normed hidden state per flattened token
    taps: jax.Array | None     # [K, n·D] layer outputs for tap_layer_ids, concatenated
    cache: KVCache             # K/V of the valid tokens written; lengths unchanged
    new_kv: Any = None         # defer_writes: (k, v) [L, K, Kh, H] still to write (stacked or
                               # layer groups, `layers.cache_like`), else None


def ragged_forward(model: TargetDecoder, tokens_k: jax.Array, slot_k: jax.Array,
                   position_k: jax.Array, valid_k: jax.Array, cache: KVCache,
                   tap_layer_ids: Sequence[int] = (),
                   grid: tuple[jax.Array, jax.Array] | None = None,
                   defer_writes: bool = False,
                   own_mask: jax.Array | None = None) -> RaggedOutput:
    """The verification forward of load-aware decoding (paper §5.2–5.3; SPEC §9).

    The admitted tokens of all requests are flattened along one token axis of static capacity
    K: token k belongs to request `slot_k[k]` of the static cache [R, S_max] and sits at
    `position_k[k]`. Valid tokens write their K/V at (slot, position) (padding writes nothing:
    its scatter index is out of range and dropped) and attend to their request's cache at
    positions ≤ their own — the committed prefix plus the request's own earlier admitted
    tokens, which are written first. Every matmul runs over the K tokens only, so the cost of a
    step scales with the tokens admitted, not with R·(γ+1). Lengths are not advanced (the
    caller commits by moving them). The family runs the addressing through its own layers.

    `grid` = (grid_rq [R, Q], cell_k [K]) lays the same tokens out per request (`RaggedRows`):
    the Llama family then attends request by request, reading each cache row once instead of
    once per token (verification: Q = γ + 1). Gemma4 gathers per token.

    `defer_writes` (with `grid`, where the family supports it: `Family.defers_writes`):
    the layers only read the cache and the K/V rows come back in `new_kv` for the caller to
    write (`write_ragged`); the returned cache is the input's. Verification inside the
    engine's `lax.switch` over capacity buckets needs this (XLA copies a cache written in a
    branch). Otherwise each layer writes its rows into the cache before it attends over it,
    and `new_kv` is None (`decoding.plain_steps` with one slot; from two slots up plain
    steps run the dense cached forward).

    `own_mask` [R, Q, Q] (with `grid` and `defer_writes`): which of its request's cells each
    cell sees among the call's own tokens, for a draft tree its ancestor matrix (default: the
    chain's lower triangle).
    """
    cfg = model.cfg
    K = tokens_k.shape[0]
    R = cache.k[0].shape[1] if isinstance(cache.k, tuple) else cache.k.shape[1]
    slot_r = jnp.clip(slot_k.astype(jnp.int32), 0, R - 1)                     # read index
    rows = L.RaggedRows(read_k=slot_r, write_k=jnp.where(valid_k, slot_r, R),  # R = drop
                        valid_k=valid_k.astype(bool),
                        grid_rq=None if grid is None else grid[0].astype(jnp.int32),
                        cell_k=None if grid is None else grid[1].astype(jnp.int32),
                        own_mask_rqq=own_mask)
    tokens_1k = tokens_k.astype(jnp.int32)[None]
    h = model.embed_tokens(tokens_1k)                                         # [1,K,D]
    tap_ids = model.tap_slots(tap_layer_ids)
    kv = _cast((cache.k, cache.v), model.dtype)
    family = family_of(cfg)
    defer = bool(defer_writes and grid is not None and family.defers_writes)
    if own_mask is not None and not defer:
        raise ValueError(f"an own-token mask (draft trees) needs the per-request grid and a "
                         f"family that defers its cache writes; {cfg.model_type!r} does not")
    extra = dict(defer_writes=True) if defer else {}
    hidden, taps, kv = family.ragged_forward(model.layers, cfg, tokens_1k, h,
                                             position_k.astype(jnp.int32)[None], kv, rows,
                                             tap_ids, model.dtype,
                                             final_norm=model.final_norm.get_value(), **extra)
    hidden = hidden[0]
    taps_out = None
    if taps is not None:
        taps_out = jnp.transpose(taps[:, 0], (1, 0, 2)).reshape(K, len(tap_ids) * cfg.hidden_size)
    if defer:
        return RaggedOutput(hidden=hidden, taps=taps_out, cache=cache, new_kv=kv)
    k, v = _cast_like(kv, (cache.k, cache.v))
    return RaggedOutput(hidden=hidden, taps=taps_out, cache=cache.replace(k=k, v=v))


def decode_one(model: TargetDecoder, tokens_r: jax.Array, cache: KVCache, live_r: jax.Array
               ) -> tuple[jax.Array, KVCache]:
    """One token a row through the dense cached forward over [R, 1]: the layers read the cache
    where it lies and each row's new K/V are written after the last layer (a row that is not
    live writes past its length, where nothing reads it). → (final-normed hidden [R, D], the
    cache with each live row's length moved by one). The plain decoding steps of the engine
    and of `autoregressive_generate` both take this step."""
    lengths = cache.lengths
    out = model(tokens_r[:, None], cache=cache)
    return out.hidden[:, 0], out.cache.with_lengths(lengths + live_r.astype(jnp.int32))


def prefill(model: TargetDecoder, tokens_np: jax.Array, chunk: int,
            tap_layer_ids: Sequence[int] = (), cache_dtype: Any = None) -> DecoderOutput:
    """Causal forward of n right-padded prompts `tokens_np` [n, P] on a fresh cache of P
    positions (`KVCache.put_rows` moves it into request slots): dense, so every matmul runs
    over the prompt tokens with no per-token gather of a slot's cache. P > `chunk` runs in
    chunks of `chunk` tokens (P must then be a multiple of it) through the cache, so
    attention's scores stay [n, chunk, P]. → hidden [n, P, D], taps [n, P, n·D] (or None),
    the prompt cache (lengths P)."""
    n, P = tokens_np.shape
    fresh = init_cache(model.cfg, n, P, cache_dtype or model.dtype,
                       per_layer=has_layer_buffers(model))
    if P <= chunk:
        out = model(tokens_np, cache=fresh, tap_layer_ids=tap_layer_ids)
        return out.replace(cache=out.cache.with_lengths(jnp.full((n,), P, jnp.int32)))
    if P % chunk:
        raise ValueError(f"prefill: {P} prompt positions are not a multiple of chunk {chunk}")
    step = jnp.full((n,), chunk, jnp.int32)

    def body(cache: KVCache, tokens_nc: jax.Array):
        out = model(tokens_nc, cache=cache, tap_layer_ids=tap_layer_ids, advance=step)
        return out.cache, (out.hidden, out.taps)

    chunks = jnp.moveaxis(tokens_np.reshape(n, P // chunk, chunk), 1, 0)      # [c, n, chunk]
    cache, (hidden, taps) = jax.lax.scan(body, fresh, chunks)

    def joined(x: jax.Array | None) -> jax.Array | None:   # [c, n, chunk, F] → [n, P, F]
        return None if x is None else jnp.moveaxis(x, 0, 1).reshape(n, P, x.shape[-1])

    return DecoderOutput(hidden=joined(hidden), taps=joined(taps), cache=cache)


def write_ragged(cache: KVCache, new_kv: Any, write_k: jax.Array,
                 position_k: jax.Array) -> KVCache:
    """Writes a deferred ragged call's K/V rows ([L, K, Kh, H] each) at (`write_k`,
    `position_k`) of the cache [L, R, S, Kh, H] (or its per-layer buffers); a row ≥ R
    (padding) is dropped. No-op for `new_kv=None` (the call wrote them itself)."""
    if new_kv is None:
        return cache
    k, v = L.cache_scatter_kv(cache.k, cache.v, (write_k, position_k), *new_kv)
    return cache.replace(k=k, v=v)


def create_target(cfg: DecoderConfig, seed: int = 0, dtype: Any = jnp.float32,
                  param_dtype: Any = jnp.float32) -> TargetDecoder:
    return TargetDecoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)


def with_layer_buffers(graphdef: Any, state: Any, fuse: bool = True) -> tuple[Any, Any]:
    """(graphdef, state) of the same target with one buffer per decoder layer, the decoding
    layout on accelerators: `layers.UnstackedLayers` for a `DecoderLayers` stack (Llama /
    Qwen3), `gemma4.layer_buffers.Gemma4Layers` for Gemma4's segments; a target already
    unstacked comes back as is. `fuse`: q/k/v and gate/up as one buffer each (fewer dots);
    False keeps the stack's matrices, which a tensor-parallel mesh splits by head and by MLP
    column as it splits the stack (a fused buffer's output mixes heads and stays whole on every
    chip). The per-layer buffers are copies: the stacked state stays valid."""
    model = nnx.merge(graphdef, state)
    if isinstance(model.layers, L.DecoderLayers):
        model.layers = L.UnstackedLayers(model.layers, fuse=True if fuse else {})
    elif isinstance(model.layers, Gemma4Stack):
        model.layers = Gemma4Layers(model.layers, fuse=fuse)
    else:
        return graphdef, state
    return nnx.split(model)


def abstract_target(cfg: DecoderConfig, dtype: Any = jnp.float32,
                    param_dtype: Any = jnp.float32) -> TargetDecoder:
    """A TargetDecoder whose parameters are ShapeDtypeStructs (nothing materialised)."""
    return nnx.eval_shape(lambda: create_target(cfg, 0, dtype, param_dtype))


__all__ = ["KVCache", "init_cache", "DecoderOutput", "TargetDecoder", "create_target",
           "abstract_target", "RaggedOutput", "ragged_forward", "write_ragged",
           "with_layer_buffers", "has_layer_buffers", "CACHE_ALIGN", "aligned_length"]
