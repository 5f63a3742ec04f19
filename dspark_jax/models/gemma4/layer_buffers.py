"""Gemma4's decoding layout: one buffer per decoder layer, the layers run unrolled (SPEC §1–2:
the target's forward in prefill over a cache, the one-token step and the ragged verification).

A scan over `Gemma4Stack`'s period groups slices each layer's weights out of its group, and XLA
materialises every slice before the dot reads it, so a one-token step streams the weights three
times. `Gemma4Layers` holds each layer's weights as its own buffers (q with k, and with v where
the layer has a v projection, as one product `w_qkv` / `w_qk`; gate/up as one `w_gate_up`), the
per-layer-input tables as they are, and `forward` runs the layers one after another, each dot
reading its weights where they lie. Its K/V cache is one buffer [1, B, S_max, K, H] per
K/V-owning layer (`decoder.init_kv(per_layer=True)`), which the KV-shared layers read as their
producer's.

Over a cache each layer attends to the cached keys below its row's first new token (sliding
layers: within the window) and to the call's own new keys, as one softmax, the cache read where
it lies. An owning layer that `kernel_attention` takes writes its new K/V into its cache once
its attention has read it (on a GPU the attention kernel stores them in place), unless KV-shared
layers read them; the other owning layers' rows are written after the last layer (a cache
written in the loop and read back is copied whole by XLA first). The ragged verification pass
writes and reads per token as the stacked layout does (models/gemma4/decoder.py). Same
arithmetic as the stacked layers.

On a GPU, one device, a K/V-owning layer that the kernels take (`layer_kernel_product`: its
q/k/v fused, heads of 32 or more) runs a one-token step or a chain as nine kernels: the q/k/v
product (split along K); `layer_attention` (the product's parts summed, the q/k norms, the
unscaled v norm, RoPE, the attention over the cache within a sliding layer's window and over
the own keys, the rows stored into the cache: `kernel_attention`); the merge of its cache
splits; the o product; the residual sum with the norms around it (`residual_updates`,
`decoding_layer.add_rms_norm`); the gate/up product; the GeGLU; the down product; the next
layer's input norm taking the last residual update. The other layers (KV-shared, heads under
32) take XLA's q/k/v, norms and RoPE, and the attention over the cache in
`pallas_kernels.decode_attention` (`attend_cache_and_own`; a sliding layer's with its window).
Elsewhere (CPU, TPU, a mesh of several devices) the same arithmetic runs as XLA's ops.

`Gemma4GroupLayers` is the drafting layout of a Gemma4 drafter's layers (one `Gemma4Group`). On
a GPU, one device, a DSpark / DFlash draft layer that the kernels take runs its attention half
over its context cache as three kernels (`block_attention`): the q and k(|v) products as one
GEMM over both weights, `layer_attention` over the context below the anchor and the whole
block, and its merge.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models import decoding_layer as DL
from dspark_jax.models import layers as L
from dspark_jax.models.config import DecoderConfig
from dspark_jax.models.gemma4 import decoder as G
from dspark_jax.sharding import constrain, on_several_devices

# fused products: name → the stacked matrices it concatenates along its output columns (a
# product is fused where every member is present and none is fused already; a KV-shared layer
# keeps its lone `wq`, a k=v layer's `wk` stays alone under `KV`)
FUSED = {"w_qkv": ("wq", "wk", "wv"), "w_qk": ("wq", "wk"), "w_kv": ("wk", "wv"),
         "w_gate_up": ("w_gate", "w_up")}
QKV = ("w_qkv", "w_qk", "w_gate_up")   # the target's and Eagle3's layers: one q/k(/v) product
KV = ("w_kv", "w_gate_up")             # DSpark / DFlash draft layers: their context's k|v
                                       # product reads `w_kv` (or `wk`) alone


class Gemma4Layers(nnx.Module):
    """The parameters of a `Gemma4Stack` as one buffer per layer, in layer order. `fuse`: q/k(/v)
    and gate/up as one buffer each (fewer dots); False keeps the stack's matrices, which a
    tensor-parallel mesh splits by head and MLP column (a fused buffer's output mixes heads and
    stays whole). Each buffer keeps its group's logical axes less "layers" (a fused one names
    its input axis only). The per-layer-input tables are the stack's parameters themselves."""

    def __init__(self, stack: G.Gemma4Stack, fuse: bool = True):
        index = {}   # layer id → (group, period index)
        for seg, j, g in stack.group_index():
            for n, i in enumerate(seg.layer_ids(j)):
                index[i] = (g, n)
        self.num_layers = len(index)
        layers = [layer_buffers(stack.groups[index[i][0]], index[i][1], QKV if fuse else ())
                  for i in range(self.num_layers)]
        self.names = tuple(tuple(layer) for layer in layers)   # static: graphdefs must hash
        self.per_layer = nnx.List([nnx.Dict(layer) for layer in layers])
        if hasattr(stack, "ple_embed"):
            self.ple_embed = stack.ple_embed
            self.ple_model_proj = stack.ple_model_proj
            self.ple_proj_norm = stack.ple_proj_norm

    def layer_params(self, dtype: Any) -> list[dict[str, jax.Array]]:
        """One dict of arrays per layer, cast to the compute dtype."""
        return [{m: layer[m].get_value().astype(dtype) for m in names}
                for names, layer in zip(self.names, self.per_layer)]

    def forward(self, *args: Any) -> tuple[jax.Array, jax.Array | None, Any]:
        """These layers over a batch: this module's `forward` with `decoder.forward`'s
        arguments after the stack (`decoder.forward` hands them over)."""
        return forward(self, *args)


class Gemma4GroupLayers(L.UnstackedLayers):
    """The n layers of one `Gemma4Group` (a Gemma4 drafter's draft layers, one shape) as one
    buffer per layer: the drafting layout, an `UnstackedLayers` as the other drafters' is (the
    drafters and their caches take it where they take those). `fused`: the products to fuse
    (`QKV` for Eagle3, `KV` for DSpark / DFlash, () to keep the group's matrices)."""

    def __init__(self, group: G.Gemma4Group, fused: tuple[str, ...] = QKV):
        self.num_layers = int(group.layer_scalar.get_value().shape[0])
        self.qk_norm = True
        layers = [layer_buffers(group, n, fused) for n in range(self.num_layers)]
        self.names = tuple(layers[0])
        self.per_layer = nnx.List([nnx.Dict(layer) for layer in layers])


def layer_buffers(group: G.Gemma4Group, n: int, fused: tuple[str, ...]) -> dict[str, nnx.Param]:
    """Layer n of `group` as its own buffers, the products named in `fused` (`FUSED`) each one
    [in, out] buffer whose input axis keeps its logical name."""
    present = [m for m in G.Gemma4Group.NAMES if hasattr(group, m)]
    groups: dict[str, tuple[str, ...]] = {}
    for name in fused:
        members = FUSED[name]
        taken = {m for ms in groups.values() for m in ms}
        if all(m in present and m not in taken for m in members):
            groups[name] = members
    parts = {m for members in groups.values() for m in members}
    layer = {m: nnx.Param(getattr(group, m).get_value()[n], axes=_axes(group, m))
             for m in present if m not in parts}
    for name, members in groups.items():
        first = _axes(group, members[0])
        layer[name] = nnx.Param(
            jnp.concatenate([_flat(getattr(group, m).get_value()[n]) for m in members], axis=1),
            axes=None if first is None else (first[0], None))
    return layer


def _flat(w: jax.Array) -> jax.Array:
    """A layer's matrix [in, …] as [in, out]."""
    return w.reshape(w.shape[0], -1)


def _axes(group: nnx.Module, name: str) -> tuple[str | None, ...] | None:
    """A group parameter's logical axes less the leading "layers"."""
    stacked = getattr(group, name).get_metadata().get("axes")
    return None if stacked is None else tuple(stacked[1:])


# ----------------------------------------------------------------------------- layer pieces
def project(lp: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array, rope: Any,
            eps: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """q [B, T, N, H] and, for a K/V-owning layer, (k, v) [B, T, K, H] as `decoder.project_q`
    and `decoder.project_kv` take them, from the fused product where the layer has one."""
    fused = "w_qkv" if "w_qkv" in lp else "w_qk" if "w_qk" in lp else None
    if fused is None:
        q = G.project_q(lp, x_btd, positions_bt, rope, eps)
        has_kv = "wk" in lp or "w_kv" in lp
        return q, (project_kv(lp, x_btd, positions_bt, rope, eps) if has_kv else None)
    B, T = x_btd.shape[:2]
    N, H = lp["wo"].shape[:2]
    out = jnp.einsum("BTD,DF->BTF", x_btd, lp[fused])
    kh = (out.shape[-1] - N * H) // (2 if fused == "w_qkv" else 1)
    q_raw = out[..., :N * H].reshape(B, T, N, H)
    k_raw = out[..., N * H:N * H + kh].reshape(B, T, kh // H, H)
    v_raw = out[..., N * H + kh:].reshape(B, T, kh // H, H) if fused == "w_qkv" else k_raw
    q = L.apply_rope(L.rms_norm(q_raw, lp["q_norm"], eps), positions_bt, rope)
    k = L.apply_rope(L.rms_norm(k_raw, lp["k_norm"], eps), positions_bt, rope)
    return q, (k, L.rms_norm_noscale(v_raw, eps))


def project_kv(lp: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array, rope: Any,
               eps: float) -> tuple[jax.Array, jax.Array]:
    """`decoder.project_kv`, from a fused k|v product (`w_kv`) where the layer has one."""
    if "w_kv" not in lp:
        return G.project_kv(lp, x_btd, positions_bt, rope, eps)
    B, T = x_btd.shape[:2]
    H = lp["wo"].shape[1]
    kv = jnp.einsum("BTD,DF->BTF", x_btd, lp["w_kv"])
    kh = kv.shape[-1] // 2
    k_raw, v_raw = kv[..., :kh].reshape(B, T, kh // H, H), kv[..., kh:].reshape(B, T, kh // H, H)
    k = L.apply_rope(L.rms_norm(k_raw, lp["k_norm"], eps), positions_bt, rope)
    return k, L.rms_norm_noscale(v_raw, eps)


def attend_cache_and_own(q_btnh: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                         cache_mask_bts: jax.Array, own_k: jax.Array, own_v: jax.Array,
                         own_mask_btq: jax.Array, start_b: jax.Array | None = None,
                         window: int = 0) -> jax.Array:
    """Grouped-query attention (scale 1) of T queries a row over a read-only cache
    [B, S, K, H] (`cache_mask_bts`) and this call's own keys [B, Q, K, H] (`own_mask_btq`), as
    one softmax over both; the cache is read where it lies. A row with no visible key gives
    zeros.

    Given the rows' first positions `start_b` [B] (query t at start + t; the cache mask then
    is the positions below start, above start + t − `window` for a sliding layer), on a GPU,
    one device, for the head sizes and own keys it takes, this is the decode-attention kernel
    (`pallas_kernels.decode_attention`: a sliding layer reads its window's cache tiles
    alone); elsewhere XLA's ops below."""
    b, t, n, h = q_btnh.shape
    kvh = cache_k.shape[2]
    if (start_b is None or not L.kernels_called_directly()
            or not (DL.pow2(h) and h >= 16 and DL.pow2(n // kvh))
            or own_k.shape[1] > L.DECODE_KERNEL_MAX_OWN
            or cache_k.shape[1] % L.DECODE_KERNEL_TILE):
        return _attend_xla(q_btnh, cache_k, cache_v, cache_mask_bts, own_k, own_v, own_mask_btq)

    def gpu(q, ck, cv, start, ok, ov, om, cm, interpret):
        from pallas_kernels.decode_attention import decode_attention

        return decode_attention(q, ck, cv, start, ok, ov, om, scale=1.0, window=int(window),
                                interpret=interpret)

    def default(q, ck, cv, start, ok, ov, om, cm):
        return _attend_xla(q, ck, cv, cm, ok, ov, om)

    return L.on_gpu(gpu, default, q_btnh, cache_k, cache_v, start_b.astype(jnp.int32),
                    own_k.astype(cache_k.dtype), own_v.astype(cache_v.dtype), own_mask_btq,
                    cache_mask_bts)


def _kernel_product(lp: dict[str, jax.Array], cache_k: jax.Array, dtype: Any, tokens: int,
                    fused: str, alone: str, beside: tuple[str, ...] = ()) -> str | None:
    """The buffer (`fused`, or a k=v layer's `alone`: no v projection) that `layer_attention`
    runs a layer from beside the weights `beside`, or None: one device, both q/k norms and
    `decoding_layer.fused_kernels_take`'s shapes for the `tokens` (power-of-two head sizes
    ≥ 32 and query heads a key head, a cache in the compute dtype that the attention's tiles
    divide, at most `layers.DECODE_KERNEL_MAX_ROWS` query heads a key head)."""
    name = fused if fused in lp else alone if alone in lp and "wv" not in lp else None
    if (name is None or any(w not in lp for w in beside) or "q_norm" not in lp
            or on_several_devices()):
        return None
    rows = tokens * (lp["wo"].shape[0] // cache_k.shape[-2])
    return name if DL.fused_kernels_take(lp, cache_k, dtype, rows, (*beside, name)) else None


def layer_kernel_product(lp: dict[str, jax.Array], cache_k: jax.Array, dtype: Any,
                         tokens: int) -> str | None:
    """The fused product a K/V-owning layer's attention over its cache layer [B, S, K, H] runs
    `layer_attention` from (`kernel_attention`): `w_qkv`, a k=v layer's `w_qk` (its values the
    raw k heads), or None where the kernels do not take it (`_kernel_product`)."""
    return _kernel_product(lp, cache_k, dtype, tokens, "w_qkv", "w_qk")


def kernel_attention(lp: dict[str, jax.Array], product: str, x_btd: jax.Array,
                     positions_bt: jax.Array, rope: Any, eps: float, cache_k: jax.Array,
                     cache_v: jax.Array, cache_mask_bts: jax.Array, own_mask_btq: jax.Array,
                     window: int = 0, write: bool = False
                     ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """A K/V-owning layer's attention over its cache buffer [1, B, S, K, H] and the call's T
    own tokens at `positions_bt` (consecutive from the row's first), for a layer
    `layer_kernel_product` takes (its `product`): (attention [B, T, N, H], (k, v) rows
    [B, T, K, H]), the rows left for the caller to write; with `write`, (attention, (cache k,
    cache v)) with the rows written at `positions_bt` (a position ≥ S dropped).

    On a GPU, two kernels from the raw fused product (its split-K parts where
    `decoding_layer.split_k_parts` splits it, summed in the kernel):
    `pallas_kernels.decode_attention.layer_attention` norms q and k (scaled) and v (unscaled),
    rotates q and k (at the tokens' positions by the layer's RoPE frequencies: a full layer's
    proportional RoPE leaves the pairs past its rotated fraction at angle 0), attends with
    scale 1 to the cache below the row's first position and to the own keys up to the
    query's (a sliding layer within its `window`), and returns the rows or stores them into
    the cache in place; the merge of its cache splits is the second. Elsewhere `project`,
    `attend_cache_and_own`'s XLA ops under the masks and, with `write`, the rows scattered
    into the cache after them."""
    b, t = x_btd.shape[:2]
    n, h = lp["wo"].shape[:2]
    heads = lp[product].shape[-1] // h

    def default(x, w, ck, cv, start, cm, om):
        q, (k, v) = project({**lp, product: w}, x, positions_bt, rope, eps)
        attn = _attend_xla(q, ck[0], cv[0], cm, k, v, om)
        if not write:
            return attn, (k, v)
        index = (0, jnp.arange(b)[:, None], positions_bt)
        return attn, (ck.at[index].set(k.astype(ck.dtype), mode="drop"),
                      cv.at[index].set(v.astype(cv.dtype), mode="drop"))

    def gpu(x, w, ck, cv, start, cm, om, interpret):
        from pallas_kernels.decode_attention import layer_attention

        parts = DL.split_k_parts(b * t, x.shape[-1], w.shape[-1])
        if parts > 1:   # [parts, B, T' ≥ T, F], rows past T unread
            qkv = DL.product_parts(x, w, parts)
        else:
            qkv = jnp.einsum("BTD,DF->BTF", x, w)
        qkv = qkv.reshape(*qkv.shape[:-1], heads, h)
        attn, k, v = layer_attention(qkv, lp["q_norm"], lp["k_norm"], L.rope_freq(rope, h),
                                     start, ck[0], cv[0], num_q_heads=n, eps=eps, scale=1.0,
                                     v_norm=True, window=int(window),
                                     v_from_k=product == "w_qk", write=write,
                                     interpret=interpret, num_tokens=t)
        return attn, ((k[None], v[None]) if write else (k, v))

    return L.on_gpu(gpu, default, x_btd, lp[product], cache_k, cache_v,
                    positions_bt[:, 0].astype(jnp.int32), cache_mask_bts, own_mask_btq)


def block_kernel_product(lp: dict[str, jax.Array], ctx_k: jax.Array, dtype: Any,
                         tokens: int) -> str | None:
    """The k(|v) buffer a DSpark / DFlash draft layer (the drafting layout, `KV` fused) runs
    `block_attention`'s kernels from beside its `wq` over its context cache layer
    [B, S, K, H]: `w_kv`, a k=v layer's lone `wk` (its values the raw k heads), or None where
    the kernels do not take it (`_kernel_product`, for the `tokens` block tokens)."""
    return _kernel_product(lp, ctx_k, dtype, tokens, "w_kv", "wk", ("wq",))

def block_attention(lp: dict[str, jax.Array], product: str, x_btd: jax.Array,
                    positions_bt: jax.Array, rope: Any, eps: float, ctx_k: jax.Array,
                    ctx_v: jax.Array, start_b: jax.Array, xla: Any) -> jax.Array:
    """The attention half of a Gemma4 DSpark / DFlash draft layer over its context cache layer
    [B, S, K, H] (normed, rotated keys; values normed without a scale) for a layer
    `block_kernel_product` takes (its k(|v) `product`): the T block tokens at `positions_bt`
    (consecutive from the anchor's `start_b` [B]), normed input x, attend to the context below
    the anchor and to all T block keys → [B, T, N, H] (a draft layer attends to all its
    context: every draft layer is a full-attention layer, `drafters.gemma4_draft_layer_config`).

    On a GPU, the q and k(|v) products as one GEMM over `wq` and the `product` where they lie
    (its split-K parts where `decoding_layer.split_k_parts` splits it, summed in the kernel),
    then `pallas_kernels.decode_attention.layer_attention` (`causal=False`): the q/k norms
    (scaled), the unscaled v norm (a k=v layer's values from its raw k heads), RoPE at the
    tokens' positions, the attention with scale 1, and the merge of its cache splits. Elsewhere
    `xla(x, ctx_k, ctx_v, start_b)`."""
    b, t, d = x_btd.shape
    n, h = lp["wo"].shape[:2]
    wq, w_kv = lp["wq"].reshape(d, -1), lp[product].reshape(d, -1)
    heads = (wq.shape[-1] + w_kv.shape[-1]) // h

    def default(x, wq, w_kv, ck, cv, start):
        return xla(x, ck, cv, start)

    def gpu(x, wq, w_kv, ck, cv, start, interpret):
        from pallas_kernels.decode_attention import layer_attention

        parts = DL.split_k_parts(b * t, d, heads * h)
        if parts > 1:   # [parts, B, T' ≥ T, F], rows past T unread
            qkv = DL.product_parts(x, jnp.concatenate([wq, w_kv], axis=-1), parts)
        else:   # one array: XLA takes the two dots as one GEMM over both weights
            qkv = jnp.concatenate([jnp.einsum("BTD,DF->BTF", x, wq),
                                   jnp.einsum("BTD,DF->BTF", x, w_kv)], axis=-1)
        qkv = qkv.reshape(*qkv.shape[:-1], heads, h)
        return layer_attention(qkv, lp["q_norm"], lp["k_norm"], L.rope_freq(rope, h), start,
                               ck, cv, num_q_heads=n, eps=eps, scale=1.0, causal=False,
                               v_norm=True, v_from_k=product == "wk", interpret=interpret,
                               num_tokens=t)[0]

    return L.on_gpu(gpu, default, x_btd, wq, w_kv, ctx_k, ctx_v, start_b.astype(jnp.int32))


def _attend_xla(q_btnh: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                cache_mask_bts: jax.Array, own_k: jax.Array, own_v: jax.Array,
                own_mask_btq: jax.Array) -> jax.Array:
    """`attend_cache_and_own` in XLA's ops: every score materialised, under the masks."""
    b, t, n, h = q_btnh.shape
    kvh = cache_k.shape[2]
    q = q_btnh.reshape(b, t, kvh, n // kvh, h)
    s_c = jnp.einsum("BTKGH,BSKH->BKGTS", q, cache_k, preferred_element_type=jnp.float32)
    s_o = jnp.einsum("BTKGH,BQKH->BKGTQ", q, own_k, preferred_element_type=jnp.float32)
    S = cache_k.shape[1]
    mask = jnp.concatenate([cache_mask_bts, own_mask_btq], axis=-1)[:, None, None]
    probs = L.masked_softmax(jnp.concatenate([s_c, s_o], axis=-1), mask, axis=-1)
    out = (jnp.einsum("BKGTS,BSKH->BTKGH", probs[..., :S].astype(cache_v.dtype), cache_v,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("BKGTQ,BQKH->BTKGH", probs[..., S:].astype(own_v.dtype), own_v,
                        preferred_element_type=jnp.float32))
    return out.reshape(b, t, n, h).astype(q_btnh.dtype)


def _split_masks(cfg: DecoderConfig, positions_bt: jax.Array, S: int
                 ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Per layer type, which cached keys [B, T, S] (below the row's first new position) and
    which of the call's own keys [B, T, T] (up to the query's own) a query sees; sliding
    layers within the window (pos_q − W < pos_k)."""
    B, T = positions_bt.shape
    key_pos = jnp.arange(S, dtype=jnp.int32)
    cached = jnp.broadcast_to(key_pos[None, None, :] < positions_bt[:, :1, None], (B, T, S))
    own = L.causal_mask(B, T)
    cache_masks, own_masks = {"full_attention": cached}, {"full_attention": own}
    if "sliding_attention" in cfg.layer_types:
        W = cfg.sliding_window
        cache_masks["sliding_attention"] = cached & (
            positions_bt[:, :, None] - key_pos[None, None, :] < W)
        own_masks["sliding_attention"] = own & (
            positions_bt[:, :, None] - positions_bt[:, None, :] < W)
    return cache_masks, own_masks


# ----------------------------------------------------------------------------- forward
def residual_updates(lp: dict[str, jax.Array], h: jax.Array, attn_btnh: jax.Array, eps: float,
                     ple_btp: jax.Array | None) -> tuple[jax.Array, tuple[Any, jax.Array,
                                                                           jax.Array]]:
    """`decoder.attn_out_and_mlp` with its residual sums and norms in the decoding layer's
    kernels (`decoding_layer.add_rms_norm`; on a GPU, one kernel each): h + RMSNorm(o) with the
    pre-MLP norm, the MLP, then (with per-layer inputs) h + RMSNorm(mlp) and the PLE gate. The
    layer's last update — h' = (h + RMSNorm(delta) · w) · layer scalar — is returned untaken,
    (delta, w, scalar), for the next layer's input norm to take in the same kernel; its delta
    a `decoding_layer.Product` where the product is split along K."""
    B, T, N, H = attn_btnh.shape
    o = DL.product(attn_btnh.reshape(B, T, N * H), lp["wo"].reshape(N * H, -1))
    h, x = DL.add_rms_norm(h, o, lp["pre_ff_norm"], eps, delta_weight=lp["post_attn_norm"])
    h = constrain(h, ("batch", "seq", "act_embed"))
    m = DL.product(L.geglu_activation(x, lp), lp["w_down"])
    if ple_btp is None:
        return h, (m, lp["post_ff_norm"], lp["layer_scalar"])
    h = DL.add_rms_norm(h, m, None, eps, delta_weight=lp["post_ff_norm"])[0]
    g = L.gelu_tanh(jnp.einsum("BTD,DP->BTP", h, lp["ple_gate"])) * ple_btp
    return h, (DL.product(g, lp["ple_proj"]), lp["ple_norm"], lp["layer_scalar"])


def take_pending(h: jax.Array, pending: tuple[Any, jax.Array, jax.Array] | None,
                 weight: jax.Array | None, eps: float) -> tuple[jax.Array, jax.Array | None]:
    """(h with a layer's untaken last update `pending` (`residual_updates`) taken, its RMS norm
    by `weight`) in one kernel on a GPU; None pending: (h, its norm); None weight: no norm."""
    if pending is None:
        return h, (None if weight is None else L.rms_norm(h, weight, eps))
    delta, delta_weight, scale = pending
    return DL.add_rms_norm(h, delta, weight, eps, delta_weight=delta_weight, scale=scale)


def forward(layers: Gemma4Layers, cfg: DecoderConfig, tokens_bt: jax.Array, h: jax.Array,
            positions_bt: jax.Array, cache_kv: tuple[tuple[jax.Array, ...],
                                                     tuple[jax.Array, ...]] | None,
            segment_ids_bt: jax.Array | None, tap_ids: Sequence[int], dtype: Any,
            ragged: L.RaggedRows | None = None) -> tuple[jax.Array, jax.Array | None, Any]:
    """`decoder.forward` over per-layer buffers: the same inputs and outputs, its caches one
    buffer per K/V-owning layer. With a cache and no `ragged`, token t of row b sits at
    `positions_bt[b, 0]` + t (consecutive, as `TargetDecoder` passes them)."""
    B, T, D = h.shape
    eps = cfg.rms_norm_eps
    cached = cache_kv is not None
    G.check_ragged(ragged, cached, B)
    params = layers.layer_params(dtype)
    ple = (G.per_layer_inputs(layers, cfg, tokens_bt, h, dtype)
           if cfg.hidden_size_per_layer_input else None)
    taps: list[jax.Array | None] = [h if lid == -1 else None for lid in tap_ids]
    ck = list(cache_kv[0]) if cached else []
    cv = list(cache_kv[1]) if cached else []
    S = ck[0].shape[2] if cached else T
    if not cached:
        masks = G._masks(cfg, positions_bt, False, T, segment_ids_bt)
    elif ragged is None:
        cache_masks, own_masks = _split_masks(cfg, positions_bt, S)
    else:   # each token its own batch row of one query: masks [T, 1, S]
        masks = {t: m & ragged.valid_k[:, None, None]
                 for t, m in G._masks(cfg, positions_bt.T, True, S, None).items()}
    fresh: dict[int, tuple[jax.Array, jax.Array]] = {}   # owning layer → this call's (k, v)
    shared_owners = {cfg.kv_producer(i) for i in range(cfg.first_kv_shared_layer, len(params))}
    pending = None   # the previous layer's last residual update, taken with this input norm
    for i, lp in enumerate(params):
        ltype = cfg.layer_type(i)
        window = cfg.sliding_window if ltype == "sliding_attention" else 0
        h, x = take_pending(h, pending, lp["input_norm"], eps)
        owner, rope = cfg.kv_producer(i), cfg.rope_for(ltype)
        product = (layer_kernel_product(lp, ck[i], dtype, T)
                   if cached and ragged is None and owner == i else None)
        if product is not None:   # q/k/v, their norms, RoPE and the attention in the kernels
            # (which write the rows into the cache where no KV-shared layer reads them)
            write = i not in shared_owners
            attn, out = kernel_attention(lp, product, x, positions_bt, rope, eps, ck[i], cv[i],
                                         cache_masks[ltype], own_masks[ltype], window, write)
            if write:
                ck[i], cv[i] = out
            else:
                fresh[i] = out
        else:
            q, kv = project(lp, x, positions_bt, rope, eps)
            if kv is not None:
                fresh[i] = kv
            k, v = fresh[owner]
            if not cached:
                attn = L.attend(q, k, v, masks[ltype], scale=1.0)
            elif ragged is None:   # the cache read where it lies ⊕ the call's own keys
                attn = attend_cache_and_own(
                    q, ck[owner][0], cv[owner][0], cache_masks[ltype], k, v, own_masks[ltype],
                    positions_bt[:, 0], window)
            else:   # each token writes its row, then reads its request's cache row
                if kv is not None:
                    index = (0, ragged.write_k[None], positions_bt)
                    ck[i] = ck[i].at[index].set(k.astype(ck[i].dtype), mode="drop")
                    cv[i] = cv[i].at[index].set(v.astype(cv[i].dtype), mode="drop")
                keys, vals = ck[owner][0][ragged.read_k], cv[owner][0][ragged.read_k]
                attn = jnp.swapaxes(L.attend(jnp.swapaxes(q, 0, 1), keys, vals, masks[ltype],
                                             scale=1.0), 0, 1)   # keys, vals [T, S, K, H]
        h, pending = residual_updates(lp, h, attn, eps, None if ple is None else ple[:, :, i])
        if i in tap_ids or i == len(params) - 1:   # the layer's output itself
            h, pending = take_pending(h, pending, None, eps)[0], None
        for slot, lid in enumerate(tap_ids):
            if lid == i:
                taps[slot] = h
    taps_out = jnp.stack(taps) if tap_ids else None
    if not cached:
        return h, taps_out, None
    if ragged is None:   # the rows not written in the loop, at their positions (≥ S: dropped)
        index = (0, jnp.arange(B)[:, None], positions_bt)
        for i, (k, v) in fresh.items():
            ck[i] = ck[i].at[index].set(k.astype(ck[i].dtype), mode="drop")
            cv[i] = cv[i].at[index].set(v.astype(cv[i].dtype), mode="drop")
    return h, taps_out, (tuple(ck), tuple(cv))

