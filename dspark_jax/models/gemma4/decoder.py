"""The Gemma4 text decoder layers inside the target decoder (SPEC §1–2; the paper's Gemma4-12B).

`TargetDecoder` (models/decoder.py) runs these layers through the "gemma4" family
(models/families.py). A Gemma4 layer is
  x = input_norm(h);  q = q_norm(x·Wq) + RoPE;  k = k_norm(x·Wk) + RoPE;  v = v_norm(x·Wv)
  (v_norm has no scale; k=v layers take v from x·Wk);  attention with scale 1 (the norms set it)
  h += post_attn_norm(attn·Wo);  h += post_ff_norm(GeGLU(pre_ff_norm(h)))
  h += post_ple_norm(gelu(h·Wg) · ple_i)·Wp   (per-layer input embeddings, if enabled)
  h *= layer_scalar
with the layer type (sliding window / full) choosing RoPE, head shape and mask. KV-shared
layers (the last `num_kv_shared_layers`) have no K/V projections and attend with the K/V of
the last earlier layer of their type.

Layers with different shapes cannot share one stacked scan body, so layers are planned into
segments (the K/V-owning layers, then the KV-shared ones), each scanned over the shortest
period of its layer-type pattern (6 for the 5:1 pattern): slot j of a period stacks the
parameters of layers start + j + P·n over n, and the scan body runs the P slots in order.
The decoding layout, one buffer per layer run unrolled, is models/gemma4/layer_buffers.py.

KV cache: every K/V-owning layer keeps a FULL-LENGTH cache [n, B, S_max, K, H] per period slot,
and sliding-window layers apply the window as a mask (key visible iff pos_q − W < pos_k ≤ pos_q)
rather than a ring buffer. Memory costs S_max instead of W slots per sliding layer, but rollback
stays a move of `lengths` and a rejected draft never overwrites a slot a later query still needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models import layers as L
from dspark_jax.models.config import DecoderConfig
from dspark_jax.sharding import constrain


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers start … start + period·n_periods − 1, scanned period by period."""

    start: int
    period: int
    n_periods: int
    owns_kv: bool

    def layer_ids(self, slot: int) -> list[int]:
        return [self.start + slot + self.period * n for n in range(self.n_periods)]


def plan_segments(cfg: DecoderConfig) -> list[Segment]:
    """K/V-owning layers then KV-shared layers, each with the shortest period of its types."""
    first = cfg.first_kv_shared_layer
    out = []
    for lo, hi, owns in ((0, first, True), (first, cfg.num_hidden_layers, False)):
        n = hi - lo
        if n == 0:
            continue
        types = [cfg.layer_type(i) for i in range(lo, hi)]
        period = next(p for p in range(1, n + 1)
                      if n % p == 0 and all(types[i] == types[i % p] for i in range(n)))
        out.append(Segment(lo, period, n // period, owns))
    return out


class Gemma4Group(nnx.Module):
    """Stacked parameters of the n layers sitting in one period slot (identical shapes)."""

    def __init__(self, cfg: DecoderConfig, layer_ids: Sequence[int], owns_kv: bool, *,
                 rngs: nnx.Rngs, param_dtype: Any, attn_in_dim: int | None = None):
        n, D, N = len(layer_ids), cfg.hidden_size, cfg.num_attention_heads
        A = attn_in_dim or D  # width q/k/v read (2·D for Eagle3's fused layer)
        ltype = cfg.layer_type(layer_ids[0])
        K, H = cfg.attn_shape(ltype)
        F = cfg.mlp_size(layer_ids[0])
        P = cfg.hidden_size_per_layer_input
        pd = param_dtype
        ax = lambda *a: ("layers",) + a
        for name in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm"):
            setattr(self, name, L.param(None, (n, D), ax("norm"), pd, "ones"))
        self.wq = L.param(rngs, (n, A, N, H), ax("embed", "q_heads", "head_dim"), pd)
        self.q_norm = L.param(None, (n, H), ax("norm"), pd, "ones")
        self.wo = L.param(rngs, (n, N, H, D), ax("q_heads", "head_dim", "embed"), pd)
        if owns_kv:
            self.wk = L.param(rngs, (n, A, K, H), ax("embed", "kv_heads", "head_dim"), pd)
            self.k_norm = L.param(None, (n, H), ax("norm"), pd, "ones")
            if cfg.has_v_proj(ltype):
                self.wv = L.param(rngs, (n, A, K, H), ax("embed", "kv_heads", "head_dim"), pd)
        self.w_gate = L.param(rngs, (n, D, F), ax("embed", "mlp"), pd)
        self.w_up = L.param(rngs, (n, D, F), ax("embed", "mlp"), pd)
        self.w_down = L.param(rngs, (n, F, D), ax("mlp", "embed"), pd)
        if P:
            self.ple_gate = L.param(rngs, (n, D, P), ax("embed", None), pd)
            self.ple_proj = L.param(rngs, (n, P, D), ax(None, "embed"), pd)
            self.ple_norm = L.param(None, (n, D), ax("norm"), pd, "ones")
        self.layer_scalar = L.param(None, (n,), ("layers",), pd, "ones")

    NAMES = ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "wq", "q_norm", "wo",
             "wk", "k_norm", "wv", "w_gate", "w_up", "w_down", "ple_gate", "ple_proj",
             "ple_norm", "layer_scalar")

    stacked = L.DecoderLayers.stacked   # this group's NAMES, cast to the compute dtype


class Gemma4Stack(nnx.Module):
    """All Gemma4 layers (one `Gemma4Group` per period slot of each segment) plus the shared
    per-layer-input embedding table and its projection."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
        self.segments = tuple(plan_segments(cfg))  # static: graphdefs must hash
        self.groups = nnx.List([
            Gemma4Group(cfg, seg.layer_ids(j), seg.owns_kv, rngs=rngs, param_dtype=param_dtype)
            for seg in self.segments for j in range(seg.period)])
        P, Lh, D = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers, cfg.hidden_size
        if P:
            Vp = cfg.vocab_size_per_layer_input or cfg.vocab_size
            self.ple_embed = L.param(rngs, (Vp, Lh * P), ("vocab", None), param_dtype)
            self.ple_model_proj = L.param(rngs, (D, Lh * P), ("embed", None), param_dtype)
            self.ple_proj_norm = L.param(None, (P,), ("norm",), param_dtype, "ones")

    def group_index(self) -> list[tuple[Segment, int, int]]:
        """(segment, slot, index into `groups`) for every group, in order."""
        out, g = [], 0
        for seg in self.segments:
            for j in range(seg.period):
                out.append((seg, j, g))
                g += 1
        return out

    def layer_location(self, layer: int) -> tuple[int, int]:
        """(group index, period index) holding `layer`."""
        for seg, j, g in self.group_index():
            ids = seg.layer_ids(j)
            if layer in ids:
                return g, ids.index(layer)
        raise ValueError(f"layer {layer} not in the plan")


def make_stack(cfg: DecoderConfig, *, rngs: nnx.Rngs, param_dtype: Any) -> Gemma4Stack:
    return Gemma4Stack(cfg, rngs=rngs, param_dtype=param_dtype)


# ----------------------------------------------------------------------------- cache
def init_kv(cfg: DecoderConfig, batch: int, max_len: int, dtype: Any,
            num_layers: int | None = None, per_layer: bool = False
            ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Zero K and V caches: one [n, B, S_max, K, H] array per K/V-owning group (`cache_shapes`;
    `num_layers` is the Llama family's option and does not apply); `per_layer`: one
    [1, B, S_max, K, H] buffer per K/V-owning layer, layers 0 … `first_kv_shared_layer` − 1 in
    order (the decoding layout, models/gemma4/layer_buffers.py)."""
    if per_layer:
        shapes = [(1, batch, max_len) + cfg.attn_shape(cfg.layer_type(i))
                  for i in range(cfg.first_kv_shared_layer)]
    else:
        shapes = cache_shapes(cfg, batch, max_len)
    return tuple(jnp.zeros(s, dtype) for s in shapes), tuple(jnp.zeros(s, dtype) for s in shapes)


def cache_shapes(cfg: DecoderConfig, batch: int, max_len: int) -> list[tuple[int, ...]]:
    """Shapes of the per-group caches of the K/V-owning groups, in group order."""
    out = []
    for seg in plan_segments(cfg):
        if not seg.owns_kv:
            continue
        for j in range(seg.period):
            K, H = cfg.attn_shape(cfg.layer_type(seg.start + j))
            out.append((seg.n_periods, batch, max_len, K, H))
    return out


# ----------------------------------------------------------------------------- layer pieces
def project_q(lp: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array,
              rope: Any, eps: float) -> jax.Array:
    """q = RoPE(q_norm(x·Wq)) [B, T, N, H]."""
    q = L.rms_norm(jnp.einsum("BTD,DNH->BTNH", x_btd, lp["wq"]), lp["q_norm"], eps)
    return L.apply_rope(q, positions_bt, rope)


def project_kv(lp: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array,
               rope: Any, eps: float) -> tuple[jax.Array, jax.Array]:
    """k = RoPE(k_norm(x·Wk)), v = v_norm(x·Wv) (k=v layers: v_norm(x·Wk)) [B, T, K, H]."""
    k_raw = jnp.einsum("BTD,DKH->BTKH", x_btd, lp["wk"])
    v_raw = jnp.einsum("BTD,DKH->BTKH", x_btd, lp["wv"]) if "wv" in lp else k_raw
    k = L.apply_rope(L.rms_norm(k_raw, lp["k_norm"], eps), positions_bt, rope)
    return k, L.rms_norm_noscale(v_raw, eps)


def attn_out_and_mlp(lp: dict[str, jax.Array], h: jax.Array, attn_btnh: jax.Array,
                     eps: float, ple_btp: jax.Array | None = None) -> jax.Array:
    """The sandwich-normed residual updates after attention, the PLE gate, the layer scalar."""
    o = L.attn_out(lp, attn_btnh)
    h = h + L.rms_norm(o, lp["post_attn_norm"], eps)
    m = L.geglu(L.rms_norm(h, lp["pre_ff_norm"], eps), lp)
    h = h + L.rms_norm(m, lp["post_ff_norm"], eps)
    if ple_btp is not None:
        g = L.gelu_tanh(jnp.einsum("BTD,DP->BTP", h, lp["ple_gate"])) * ple_btp
        g = jnp.einsum("BTP,PD->BTD", g, lp["ple_proj"])
        h = h + L.rms_norm(g, lp["ple_norm"], eps)
    return constrain(h * lp["layer_scalar"], ("batch", "seq", "act_embed"))


# ----------------------------------------------------------------------------- forward
def per_layer_inputs(stack: Any, cfg: DecoderConfig, tokens_bt: jax.Array,
                     emb_btd: jax.Array, dtype: Any) -> jax.Array:
    """PLE [B, T, L, P]: (norm(emb·Wm / √D) + table[tok]·√P) / √2 (`stack`: a `Gemma4Stack` or
    `layer_buffers.Gemma4Layers`, which hold the same tables)."""
    P, Lh, D = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers, cfg.hidden_size
    B, T = tokens_bt.shape
    table = stack.ple_embed.get_value()
    tok = jnp.take(table, tokens_bt, axis=0) * jnp.asarray(P ** 0.5, table.dtype)
    tok = tok.astype(dtype).reshape(B, T, Lh, P)
    proj = jnp.einsum("BTD,DE->BTE", emb_btd, stack.ple_model_proj.get_value().astype(dtype))
    proj = (proj * (D ** -0.5)).reshape(B, T, Lh, P)
    proj = L.rms_norm(proj, stack.ple_proj_norm.get_value().astype(dtype), cfg.rms_norm_eps)
    return (proj + tok) * (2.0 ** -0.5)


def _masks(cfg: DecoderConfig, positions_bt: jax.Array, cached: bool, S: int,
           segment_ids_bt: jax.Array | None) -> dict[str, jax.Array]:
    """Boolean visibility [B, T, S] per layer type."""
    B, T = positions_bt.shape
    if cached:
        key_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        full = key_pos[:, None, :] <= positions_bt[:, :, None]
    else:
        idx = jnp.arange(T)
        full = jnp.broadcast_to(idx[None, :, None] >= idx[None, None, :], (B, T, T))
        if segment_ids_bt is not None:
            full = full & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
        key_pos = positions_bt
    out = {"full_attention": full}
    if "sliding_attention" in cfg.layer_types:
        out["sliding_attention"] = full & (
            positions_bt[:, :, None] - key_pos[:, None, :] < cfg.sliding_window)
    return out


def check_ragged(ragged: L.RaggedRows | None, cached: bool, batch: int) -> None:
    """A ragged call (`ragged_forward`) needs a cache and one flattened row."""
    if ragged is not None and (not cached or batch != 1):
        raise ValueError("gemma4.forward: a ragged call needs a cache and one flattened row "
                         f"(got batch {batch}, cache {'given' if cached else 'None'})")


def forward(stack: Gemma4Stack | nnx.Module, cfg: DecoderConfig, tokens_bt: jax.Array,
            h: jax.Array, positions_bt: jax.Array,
            cache_kv: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]] | None,
            segment_ids_bt: jax.Array | None, tap_ids: Sequence[int], dtype: Any,
            ragged: L.RaggedRows | None = None, final_norm: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array | None, Any]:
    """Runs every layer on the embedded tokens h [B, T, D].

    Returns (h before the final norm, or with `final_norm` [D] after it, taps [n, B, T, D] or
    None, updated cache (k, v) tuples).
    With `cache_kv`, token t of row b is written at `positions_bt[b, t]` of each owning layer's
    cache and attends over the cache; without, over the T tokens (packed by `segment_ids_bt`).
    With `ragged` (and a cache), the T tokens of the single row are independent queries: token
    k writes and reads the cache row `ragged` names, so attention is one [1, S] row per token
    (sliding layers: keys with pos − W < key_pos ≤ pos; KV-shared layers: their producer's
    cache row) and every other matmul runs over the T tokens only.

    Per-layer buffers (`layer_buffers.Gemma4Layers`, the decoding layout) run their own
    unrolled forward (`Gemma4Layers.forward`), their caches one buffer per K/V-owning layer.
    """
    if not isinstance(stack, Gemma4Stack):
        h, taps, new_cache = stack.forward(cfg, tokens_bt, h, positions_bt, cache_kv,
                                           segment_ids_bt, tap_ids, dtype, ragged)
        return _final(h, final_norm, cfg), taps, new_cache
    B, T, D = h.shape
    eps = cfg.rms_norm_eps
    cached = cache_kv is not None
    check_ragged(ragged, cached, B)
    S = cache_kv[0][0].shape[2] if cached else T
    if ragged is None:
        masks = _masks(cfg, positions_bt, cached, S, segment_ids_bt)
        write_rows = jnp.arange(B)[:, None]
        read = lambda c: c                                                 # [B,S,K,H]
    else:  # each token its own batch row of one query: masks [T, 1, S]
        masks = {t: m & ragged.valid_k[:, None, None]
                 for t, m in _masks(cfg, positions_bt.T, True, S, None).items()}
        write_rows = ragged.write_k[None]                                  # [1,T]
        read = lambda c: c[ragged.read_k]                                  # [T,S,K,H]
    ple = (per_layer_inputs(stack, cfg, tokens_bt, h, dtype)
           if cfg.hidden_size_per_layer_input else None)
    n_taps = len(tap_ids)
    taps = jnp.zeros((max(n_taps, 1), B, T, D), dtype)
    slot_of_layer = [-1] * cfg.num_hidden_layers
    for slot, lid in enumerate(tap_ids):
        if lid == -1:
            taps = taps.at[slot].set(h)
        else:
            slot_of_layer[lid] = slot
    caches_k = list(cache_kv[0]) if cached else []
    caches_v = list(cache_kv[1]) if cached else []
    # K/V each layer type's KV-shared layers read: (group, period) of the producer layer
    producers: dict[str, tuple[int, int]] = {}
    for i in range(cfg.first_kv_shared_layer, cfg.num_hidden_layers):
        producers[cfg.layer_type(i)] = stack.layer_location(cfg.kv_producer(i))
    fresh_kv: dict[int, tuple[jax.Array, jax.Array]] = {}  # no-cache: producer group → ys
    keep_fresh = cfg.num_kv_shared_layers > 0

    def layer(lp: dict[str, jax.Array], h: jax.Array, ltype: str, kv_in: Any,
              ple_i: jax.Array | None) -> tuple[jax.Array, Any]:
        rope = cfg.rope_for(ltype)
        x = L.rms_norm(h, lp["input_norm"], eps)
        q = project_q(lp, x, positions_bt, rope, eps)
        if "wk" in lp:
            k, v = project_kv(lp, x, positions_bt, rope, eps)
            kv_out = (k, v)
            if kv_in is not None:  # this group's caches [n, B, S, K, H]: write, attend over row n
                kc_all, vc_all, n = kv_in
                kc_all = kc_all.at[n, write_rows, positions_bt].set(k.astype(kc_all.dtype),
                                                                    mode="drop")
                vc_all = vc_all.at[n, write_rows, positions_bt].set(v.astype(vc_all.dtype),
                                                                    mode="drop")
                kv_out = (kc_all, vc_all)
                k, v = read(kc_all[n]).astype(dtype), read(vc_all[n]).astype(dtype)
        else:  # KV-shared: attend with the producer's keys/values (read once, outside the scan)
            k, v = kv_in[0].astype(dtype), kv_in[1].astype(dtype)
            kv_out = None
        if ragged is None:
            attn = L.attend(q, k, v, masks[ltype], scale=1.0)
        else:  # [1,T,N,H] → T rows of one query against their own cache row
            attn = jnp.swapaxes(L.attend(jnp.swapaxes(q, 0, 1), k, v, masks[ltype], scale=1.0),
                                0, 1)
        return attn_out_and_mlp(lp, h, attn, eps, ple_i), kv_out

    groups = stack.group_index()
    cache_slot = {g: c for c, g in enumerate(g for seg, _, g in groups if seg.owns_kv)}
    for seg in stack.segments:
        gids = [g for s, _, g in groups if s is seg]
        types = [cfg.layer_type(seg.start + j) for j in range(seg.period)]
        params = tuple(stack.groups[g].stacked(dtype) for g in gids)
        tap_slot = tuple(jnp.asarray([slot_of_layer[i] for i in seg.layer_ids(j)], jnp.int32)
                         for j in range(seg.period))
        ple_xs = None
        if ple is not None:
            ple_xs = tuple(jnp.moveaxis(ple[:, :, jnp.asarray(seg.layer_ids(j))], 2, 0)
                           for j in range(seg.period))
        if seg.owns_kv:
            kv0 = (tuple(caches_k[cache_slot[g]] for g in gids),
                   tuple(caches_v[cache_slot[g]] for g in gids)) if cached else None
        else:
            shared = {}
            for t, (pg, pn) in producers.items():
                if cached:
                    c = cache_slot[pg]
                    shared[t] = (read(caches_k[c][pn]), read(caches_v[c][pn]))
                else:
                    ks, vs = fresh_kv[pg]
                    shared[t] = (ks[pn], vs[pn])
            kv0 = None

        def body(carry, xs, seg=seg, types=types, shared=None if seg.owns_kv else shared):
            h, taps, kv = carry
            lps, n, slots, ples = xs
            outs = []
            for j in range(seg.period):
                kv_in = None
                if seg.owns_kv and kv is not None:
                    kv_in = (kv[0][j], kv[1][j], n)
                elif not seg.owns_kv:
                    kv_in = shared[types[j]]
                h, kv_out = layer(lps[j], h, types[j], kv_in, None if ples is None else ples[j])
                if seg.owns_kv and kv is not None:
                    kv = (kv[0][:j] + (kv_out[0],) + kv[0][j + 1:],
                          kv[1][:j] + (kv_out[1],) + kv[1][j + 1:])
                # no cache: keep fresh K/V only where KV-shared layers will read them
                outs.append(kv_out if (seg.owns_kv and kv is None and keep_fresh) else None)
                if n_taps:
                    s = slots[j]
                    cur = taps[jnp.maximum(s, 0)]
                    taps = taps.at[jnp.maximum(s, 0)].set(jnp.where(s >= 0, h, cur))
            return (h, taps, kv), tuple(outs)

        xs = (params, jnp.arange(seg.n_periods), tap_slot, ple_xs)
        (h, taps, kv), ys = jax.lax.scan(body, (h, taps, kv0), xs)
        if seg.owns_kv and cached:
            for j, g in enumerate(gids):
                caches_k[cache_slot[g]] = kv[0][j]
                caches_v[cache_slot[g]] = kv[1][j]
        if seg.owns_kv and not cached:
            for j, g in enumerate(gids):
                fresh_kv[g] = ys[j]
    new_cache = (tuple(caches_k), tuple(caches_v)) if cached else None
    return _final(h, final_norm, cfg), (taps if n_taps else None), new_cache


def _final(h: jax.Array, final_norm: jax.Array | None, cfg: DecoderConfig) -> jax.Array:
    return h if final_norm is None else L.rms_norm(h, final_norm, cfg.rms_norm_eps)


def ragged_forward(stack: Gemma4Stack | nnx.Module, cfg: DecoderConfig,
                   tokens_1k: jax.Array, h: jax.Array, positions_1k: jax.Array, cache_kv: Any,
                   rows: L.RaggedRows, tap_ids: Sequence[int], dtype: Any,
                   final_norm: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array | None, Any]:
    """The ragged verification pass (paper §5.2–5.3): the K tokens as one row of `forward`,
    each reading and writing its own request's row of every per-group (or per-layer) cache
    (sliding windows, KV sharing and per-layer inputs as in the dense path, whose layer math
    it runs)."""
    return forward(stack, cfg, tokens_1k, h, positions_1k, cache_kv, None, tap_ids, dtype,
                   ragged=rows, final_norm=final_norm)
