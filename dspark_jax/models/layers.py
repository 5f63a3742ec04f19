"""Transformer building blocks shared by the target decoder and the drafters (SPEC §2–3, §5).

Pure functions over arrays (RMSNorm, RoPE, GQA attention, SwiGLU, GeGLU) plus `DecoderLayers`,
an NNX module that holds the parameters of L Llama/Qwen3 pre-norm decoder layers stacked on a
leading "layers" axis so the forward can `lax.scan` over them (one compiled layer body instead
of L), and `RaggedRows`, the cache addressing of the flattened verification pass.
Parameter layouts are einsum-friendly: q_proj is [L, D, N, H] ('BTD,DNH->BTNH').
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models.config import DecoderConfig, RopeConfig, rope_inv_freq
from dspark_jax.sharding import constrain, on_several_devices, shard_kernel

NEG_INF = -1e30


def param(rngs: nnx.Rngs | None, shape: Sequence[int], axes: Sequence[str | None],
          dtype: Any, init: str = "normal", std: float = 0.02) -> nnx.Param:
    """A parameter with logical axis names in its `axes` metadata."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        assert rngs is not None
        value = (std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)).astype(dtype)
    return nnx.Param(value, axes=tuple(axes))


def embed(table_vd: jax.Array, tokens: jax.Array, scaled: bool = False) -> jax.Array:
    """Token embeddings table[tokens] [..., D] in the table's dtype; `scaled`: × √D rounded to
    that dtype, as Hugging Face's Gemma (the Gemma4 target and its drafters)."""
    emb = jnp.take(table_vd, tokens, axis=0)
    if scaled:
        emb = emb * jnp.asarray(table_vd.shape[-1] ** 0.5, table_vd.dtype)
    return emb


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32, cast back to the input dtype before the scale (as Hugging Face)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, rope: RopeConfig) -> jax.Array:
    """Rotary embedding, rotate-half convention (Hugging Face Llama/Qwen3)."""
    return rotate_half(x_btnh, *rope_cos_sin(positions_bt, rope, x_btnh.shape[-1]))


def rope_freq(rope: RopeConfig, head_dim: int) -> jax.Array:
    """The rotary inverse frequencies [H/2] (fp32, the model's scaling applied): a token's
    angles are its position times these (the GPU's attention kernel takes them so)."""
    return jnp.asarray(np.asarray(rope_inv_freq(rope, head_dim), np.float32))


def rope_cos_sin(positions_bt: jax.Array, rope: RopeConfig, head_dim: int
                 ) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, H/2] (fp32) of each token's rotary angles."""
    angles = positions_bt.astype(jnp.float32)[..., None] * rope_freq(rope, head_dim)
    return jnp.cos(angles), jnp.sin(angles)


def rotate_half(x_btnh: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array) -> jax.Array:
    """x [B, T, N, H] rotated by the tokens' cos / sin [B, T, H/2], in fp32."""
    cos, sin = cos_bth[:, :, None, :], sin_bth[:, :, None, :]
    xf = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


def rms_norm_noscale(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a learned scale (Gemma4's value norm)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def masked_softmax(scores: jax.Array, mask: jax.Array, axis: int) -> jax.Array:
    """Softmax over the visible keys along `axis`; a row with no visible key gives zeros."""
    probs = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=axis)
    return jnp.where(jnp.any(mask, axis=axis, keepdims=True), probs, 0.0)


def attend(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
           mask_bts: jax.Array, scale: float | None = None) -> jax.Array:
    """Grouped-query attention with a boolean visibility mask; fully masked rows give zeros.

    `scale` multiplies the scores (default head_dim^-0.5; Gemma4 uses 1, its q/k norms set it).
    """
    b, t, n, h = q_btnh.shape
    kvh = k_bskh.shape[2]
    scale = h ** -0.5 if scale is None else scale
    q = q_btnh.reshape(b, t, kvh, n // kvh, h)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k_bskh,
                        preferred_element_type=jnp.float32) * scale
    probs = masked_softmax(scores, mask_bts[:, None, None, :, :], axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v_bskh.dtype), v_bskh,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q_btnh.dtype)


# a sequence a multiple of this many tokens runs the flash-attention kernels (their tiles)
FLASH_BLOCK = 128


def causal_mask(b: int, t: int, segment_ids_bt: jax.Array | None = None) -> jax.Array:
    """[B, T, T]: token i sees tokens j ≤ i (of its own segment, with `segment_ids_bt`)."""
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    if segment_ids_bt is not None:
        mask = mask & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
    return mask


_flash_kernels: contextvars.ContextVar[bool] = contextvars.ContextVar("flash_kernels",
                                                                     default=True)


@contextlib.contextmanager
def flash_kernels(enabled: bool) -> Iterator[None]:
    """Whether the attention traced inside the block may take its kernels (default yes): the
    flash-attention kernels of `causal_attention` and the decode-attention kernel of
    `attend_cache_and_own`; False keeps XLA's path on every platform, to compare the two."""
    token = _flash_kernels.set(bool(enabled))
    try:
        yield
    finally:
        _flash_kernels.reset(token)


def kernels_enabled() -> bool:
    """Whether attention traced here may take its kernels (`flash_kernels`)."""
    return _flash_kernels.get()


def kernels_called_directly() -> bool:
    """Whether code traced here may call a decoding kernel as it is: kernels enabled and no
    mesh of several devices around it (where a kernel needs `shard_kernel`)."""
    return kernels_enabled() and not on_several_devices()


_interpret_kernels: contextvars.ContextVar[bool] = contextvars.ContextVar("interpret_kernels",
                                                                         default=False)


@contextlib.contextmanager
def interpret_kernels() -> Iterator[None]:
    """Inside the block the decoding kernels' GPU branches (`on_gpu`) are taken on every
    platform, their kernels run by the Pallas interpreter: on a CPU, a test runs the program a
    GPU compiles, kernels included."""
    token = _interpret_kernels.set(True)
    try:
        yield
    finally:
        _interpret_kernels.reset(token)


def on_gpu(gpu: Callable[..., Any], default: Callable[..., Any], *args: Any) -> Any:
    """`gpu(*args, interpret=False)` where the program is compiled for a GPU, `default(*args)`
    elsewhere (`lax.platform_dependent`); inside `interpret_kernels()`,
    `gpu(*args, interpret=True)` everywhere."""
    if _interpret_kernels.get():
        return gpu(*args, interpret=True)
    return jax.lax.platform_dependent(*args, cuda=functools.partial(gpu, interpret=False),
                                      default=default)


# logical axes of the flash kernels' arguments: q grouped by KV head [B, T, K, G, H], so a
# tensor-parallel mesh splits the query heads with their KV head; k / v [B, T, K, H]
_Q_AXES = ("batch", "seq", "kv_heads", None, "head_dim")
_KV_AXES = ("batch", "seq", "kv_heads", "head_dim")
_SEG_AXES = ("batch", "seq")


def causal_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                     segment_ids_bt: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention of T tokens over themselves (no cache), each token seeing
    the tokens of its own segment up to itself where `segment_ids_bt` [B, T] packs several
    sequences into a row: the target's forward over training rows (online features, SPEC §4).

    On a GPU or TPU, for T a multiple of `FLASH_BLOCK`, a flash-attention Pallas kernel
    (JAX's `pallas.ops.gpu.attention.mha`, `pallas.ops.tpu.flash_attention`) keeps the [T, T]
    scores on chip, where `attend` writes and re-reads them in HBM, several bytes per score
    per layer; on a CPU, for other lengths and inside `flash_kernels(False)`, `attend` with the
    dense mask. The branch is
    chosen for the platform being compiled for (`lax.platform_dependent`), so an ahead-of-time
    compile for a GPU or TPU on a CPU machine takes the kernel. Inside a sharded program the
    kernel runs per device on its batch rows and KV-head groups (`sharding.shard_kernel`)."""
    b, t, n, h = q_btnh.shape
    kvh = k_btkh.shape[2]
    if t % FLASH_BLOCK or h > 256 or not _flash_kernels.get():
        return attend(q_btnh, k_btkh, v_btkh, causal_mask(b, t, segment_ids_bt))

    def local(q_g, k, v, seg=None):
        """One device's rows and KV heads: [b, T, k, G, H] queries."""
        bl, tl, kl, g, hl = q_g.shape
        q = q_g.reshape(bl, tl, kl * g, hl)

        def dense(q, k, v, seg=None):
            return attend(q, k, v, causal_mask(bl, tl, seg))

        args = (q, k, v) + (() if seg is None else (seg,))
        out = jax.lax.platform_dependent(*args, cuda=flash_attention_gpu,
                                         tpu=flash_attention_tpu, default=dense)
        return out.reshape(q_g.shape)

    q_g = q_btnh.reshape(b, t, kvh, n // kvh, h)
    args = (q_g, k_btkh, v_btkh) + (() if segment_ids_bt is None else (segment_ids_bt,))
    axes = (_Q_AXES, _KV_AXES, _KV_AXES, _SEG_AXES)[:len(args)]
    return shard_kernel(local, args, axes, _Q_AXES).reshape(b, t, n, h)


def _heads_like_q(x: jax.Array, n: int) -> jax.Array:
    """K/V [B, T, Kh, H] repeated to the n query heads (the kernels take no groups)."""
    return jnp.repeat(x, n // x.shape[2], axis=2)


def flash_attention_gpu(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None = None,
                        interpret: bool = False) -> jax.Array:
    """`causal_attention` through the Triton flash-attention kernel (`interpret`: on any
    device, for tests)."""
    from jax.experimental.pallas.ops.gpu import attention

    n, h = q.shape[2], q.shape[3]
    out = attention.mha(q, _heads_like_q(k, n).astype(q.dtype), _heads_like_q(v, n).astype(q.dtype),
                        None if seg is None else seg.astype(jnp.int32), sm_scale=h ** -0.5,
                        causal=True, interpret=interpret)
    return out.astype(q.dtype)


def flash_attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array,
                        seg: jax.Array | None = None) -> jax.Array:
    """`causal_attention` through the Mosaic flash-attention kernel ([B, N, T, H] layout)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    n, h = q.shape[2], q.shape[3]
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    ids = None if seg is None else fa.SegmentIds(q=seg.astype(jnp.int32),
                                                 kv=seg.astype(jnp.int32))
    with jax.default_matmul_precision("default"):   # Mosaic takes no HIGHEST bf16 dot
        out = fa.flash_attention(heads_first(q),
                                 heads_first(_heads_like_q(k, n).astype(q.dtype)),
                                 heads_first(_heads_like_q(v, n).astype(q.dtype)),
                                 segment_ids=ids, causal=True, sm_scale=h ** -0.5)
    return heads_first(out).astype(q.dtype)


# up to this many queries a row, attention over a cache runs as multiply-reduce loops (with a
# verification block's 8 queries XLA:GPU re-lays the whole cache out in fp32 for them)
CACHE_REDUCE_MAX_QUERIES = 1
# query heads a row and key head (T·G) up to which the layer-attention kernel takes a call
# (`decoding_layer.cached_attention`): decoding steps and verification blocks
DECODE_KERNEL_MAX_ROWS = 64
# own keys a row up to which the decode-attention kernel takes a call: one [Q, H] tile beside
# the queries (a draft tree's nodes); its queries it tiles as it needs (prefill chunks, with
# more own keys, stay with XLA's dots)
DECODE_KERNEL_MAX_OWN = 128
# the decode-attention kernels' cache tile (`pallas_kernels.decode_attention.DEFAULT_BLOCK_K`):
# a cache they take is a whole number of tiles long
DECODE_KERNEL_TILE = 64
# logical axes of the decode-attention kernel's cache and per-row arguments
_CACHE_AXES = ("batch", "cache_seq", "kv_heads", "head_dim")


def attend_cache_and_own(q_btnh: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                         cache_start_b: jax.Array, own_k: jax.Array, own_v: jax.Array,
                         own_mask_btq: jax.Array) -> jax.Array:
    """Grouped-query attention of T queries a row over a read-only cache [B, S, K, H], of
    which the row's queries all see the positions below `cache_start_b` [B], and over this
    call's own new keys [B, Q, K, H] (`own_mask_btq`), as one softmax over both: the cache is
    read where it lies, never concatenated with the new rows (a concatenation, or a slice of a
    cache just written, materialises the whole cache layer before attention reads it). A row
    with no visible key gives zeros.

    On a GPU, for power-of-two head sizes and query heads a key head, and up to
    `DECODE_KERNEL_MAX_OWN` own keys, this is the decode-attention kernel
    (`pallas_kernels.decode_attention`: the partial softmaxes of cache splits and query tiles
    in one Triton kernel, then their merge), two kernels where XLA takes about fifteen and
    materialises every score; elsewhere, and inside
    `flash_kernels(False)`, `attend_cache_and_own_xla`. The branch is chosen for the platform
    being compiled for, so an ahead-of-time compile for a GPU takes the kernel. Inside a
    sharded program the kernel runs per device on its rows and KV heads."""
    b, t, n, h = q_btnh.shape
    kvh = cache_k.shape[2]
    g = n // kvh
    start = cache_start_b.astype(jnp.int32)
    pow2 = lambda x: x >= 1 and not x & (x - 1)  # noqa: E731
    if (not (pow2(h) and h >= 16 and pow2(g)) or own_k.shape[1] > DECODE_KERNEL_MAX_OWN
            or cache_k.shape[1] % DECODE_KERNEL_TILE or not _flash_kernels.get()):
        return attend_cache_and_own_xla(q_btnh, cache_k, cache_v, start, own_k, own_v,
                                        own_mask_btq)

    def local(q_g, ck, cv, st, ok, ov, om):
        """One device's rows and KV heads: [b, T, k, G, H] queries."""
        bl, tl, kl, g, hl = q_g.shape
        q = q_g.reshape(bl, tl, kl * g, hl)

        def kernel(q, ck, cv, st, ok, ov, om, interpret):
            from pallas_kernels.decode_attention import decode_attention

            return decode_attention(q, ck, cv, st, ok, ov, om, scale=hl ** -0.5,
                                    interpret=interpret)

        out = on_gpu(kernel, attend_cache_and_own_xla, q, ck, cv, st, ok, ov, om)
        return out.reshape(q_g.shape)

    args = (q_btnh.reshape(b, t, kvh, n // kvh, h), cache_k, cache_v, start,
            own_k.astype(cache_k.dtype), own_v.astype(cache_v.dtype), own_mask_btq)
    axes = (_Q_AXES, _CACHE_AXES, _CACHE_AXES, ("batch",), _KV_AXES, _KV_AXES,
            ("batch", None, None))
    return shard_kernel(local, args, axes, _Q_AXES).reshape(b, t, n, h)


def attend_cache_and_own_xla(q_btnh: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                             cache_start_b: jax.Array, own_k: jax.Array, own_v: jax.Array,
                             own_mask_btq: jax.Array) -> jax.Array:
    """`attend_cache_and_own` in XLA: each part's scores are taken where its keys lie and the
    two are combined under a shared maximum. Equal to `attend` over the concatenated keys up
    to summation order.

    A row's T queries act as T·G query heads. With one query a row (T ≤
    `CACHE_REDUCE_MAX_QUERIES`: decoding steps) the cache part runs as fused multiply-reduce
    loops over the cache in its [B, S, K, H] layout, which read each cache layer once where it
    lies; as batched dots (verification blocks, prefill chunks), XLA:GPU copies and pads each
    layer's slice of the cache for the GEMM first."""
    b, t, n, h = q_btnh.shape
    kvh = cache_k.shape[2]
    g = n // kvh
    scale = h ** -0.5
    cache_mask_bs = jnp.arange(cache_k.shape[1], dtype=jnp.int32)[None, :] < cache_start_b[:, None]
    qm = jnp.transpose(q_btnh.reshape(b, t, kvh, g, h), (0, 2, 1, 3, 4)).reshape(
        b, kvh, t * g, h)                                                    # [B,K,M,H]
    reduce = t <= CACHE_REDUCE_MAX_QUERIES
    if reduce:   # [B,1,K,M,H] · [B,S,K,1,H] summed over H
        s_c = jnp.sum(qm.astype(jnp.float32)[:, None]
                      * cache_k.astype(jnp.float32)[:, :, :, None, :], axis=-1)
    else:
        s_c = jnp.einsum("BKMH,BSKH->BSKM", qm, cache_k, preferred_element_type=jnp.float32)
    s_c = s_c * scale                                                        # [B,S,K,M]
    s_o = jnp.einsum("BKMH,BQKH->BKMQ", qm, own_k,
                     preferred_element_type=jnp.float32) * scale             # [B,K,M,Q]
    m_c = cache_mask_bs[:, :, None, None]
    m_o = jnp.broadcast_to(own_mask_btq[:, None, :, None, :],
                           (b, 1, t, g, own_mask_btq.shape[-1])).reshape(b, 1, t * g, -1)
    s_c, s_o = jnp.where(m_c, s_c, NEG_INF), jnp.where(m_o, s_o, NEG_INF)
    top = jnp.maximum(jnp.max(s_c, axis=1), jnp.max(s_o, axis=-1))           # [B,K,M]
    e_c = jnp.where(m_c, jnp.exp(s_c - top[:, None]), 0.0)
    e_o = jnp.where(m_o, jnp.exp(s_o - top[..., None]), 0.0)
    denom = jnp.sum(e_c, axis=1) + jnp.sum(e_o, axis=-1)
    inv = jnp.where(denom > 0, 1.0 / jnp.maximum(denom, 1e-30), 0.0)
    p_c = (e_c * inv[:, None]).astype(cache_v.dtype)
    p_o = (e_o * inv[..., None]).astype(own_v.dtype)
    if reduce:   # [B,S,K,M,1] · [B,S,K,1,H] summed over S
        out_c = jnp.sum(p_c.astype(jnp.float32)[..., None]
                        * cache_v.astype(jnp.float32)[:, :, :, None, :], axis=1)
    else:
        out_c = jnp.einsum("BSKM,BSKH->BKMH", p_c, cache_v, preferred_element_type=jnp.float32)
    out_o = jnp.einsum("BKMQ,BQKH->BKMH", p_o, own_v, preferred_element_type=jnp.float32)
    out = (out_c + out_o).reshape(b, kvh, t, g, h)
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(b, t, n, h).astype(q_btnh.dtype)


def swiglu_activation(x_btd: jax.Array, lp: dict[str, jax.Array]) -> jax.Array:
    """silu(x·W_gate) · (x·W_up) [B, T, F]: the SwiGLU MLP before its down projection."""
    if "w_gate_up" in lp:   # per-layer buffers: gate and up as one [D, 2F] dot
        gate, up = jnp.split(jnp.einsum("BTD,DF->BTF", x_btd, lp["w_gate_up"]), 2, axis=-1)
    else:
        gate = jnp.einsum("BTD,DF->BTF", x_btd, lp["w_gate"])
        up = jnp.einsum("BTD,DF->BTF", x_btd, lp["w_up"])
    return constrain(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))


def swiglu(x_btd: jax.Array, lp: dict[str, jax.Array]) -> jax.Array:
    return jnp.einsum("BTF,FD->BTD", swiglu_activation(x_btd, lp), lp["w_down"])


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation (PyTorch's gelu_pytorch_tanh)."""
    return jax.nn.gelu(x, approximate=True)


def geglu_activation(x_btd: jax.Array, lp: dict[str, jax.Array]) -> jax.Array:
    """gelu_tanh(x·W_gate) · (x·W_up) [B, T, F]: the GeGLU MLP (Gemma4) before its down
    projection; per-layer buffers take gate and up as one [D, 2F] dot."""
    if "w_gate_up" in lp:
        gate, up = jnp.split(jnp.einsum("BTD,DF->BTF", x_btd, lp["w_gate_up"]), 2, axis=-1)
    else:
        gate = jnp.einsum("BTD,DF->BTF", x_btd, lp["w_gate"])
        up = jnp.einsum("BTD,DF->BTF", x_btd, lp["w_up"])
    return constrain(gelu_tanh(gate) * up, ("batch", "seq", "act_mlp"))


def geglu(x_btd: jax.Array, lp: dict[str, jax.Array]) -> jax.Array:
    """Gated GELU-tanh MLP (Gemma4): down(gelu_tanh(gate(x)) · up(x))."""
    return jnp.einsum("BTF,FD->BTD", geglu_activation(x_btd, lp), lp["w_down"])


class DecoderLayers(nnx.Module):
    """Parameters of `num_layers` stacked Llama/Qwen3 decoder layers.

    `attn_in_dim` is the width the q/k/v projections read (2·d for Eagle3's fused layer).
    """

    NAMES = ("input_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "post_norm",
             "w_gate", "w_up", "w_down")

    def __init__(self, cfg: DecoderConfig, num_layers: int, *, rngs: nnx.Rngs,
                 param_dtype: Any = jnp.float32, attn_in_dim: int | None = None):
        L, D, F = num_layers, cfg.hidden_size, cfg.intermediate_size
        N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        A = attn_in_dim or D
        pd = param_dtype
        self.num_layers = L
        self.qk_norm = cfg.qk_norm
        self.input_norm = param(None, (L, D), ("layers", "norm"), pd, "ones")
        self.wq = param(rngs, (L, A, N, H), ("layers", "embed", "q_heads", "head_dim"), pd)
        self.wk = param(rngs, (L, A, K, H), ("layers", "embed", "kv_heads", "head_dim"), pd)
        self.wv = param(rngs, (L, A, K, H), ("layers", "embed", "kv_heads", "head_dim"), pd)
        self.wo = param(rngs, (L, N, H, D), ("layers", "q_heads", "head_dim", "embed"), pd)
        if cfg.qk_norm:
            self.q_norm = param(None, (L, H), ("layers", "norm"), pd, "ones")
            self.k_norm = param(None, (L, H), ("layers", "norm"), pd, "ones")
        self.post_norm = param(None, (L, D), ("layers", "norm"), pd, "ones")
        self.w_gate = param(rngs, (L, D, F), ("layers", "embed", "mlp"), pd)
        self.w_up = param(rngs, (L, D, F), ("layers", "embed", "mlp"), pd)
        self.w_down = param(rngs, (L, F, D), ("layers", "mlp", "embed"), pd)

    def stacked(self, dtype: Any) -> dict[str, jax.Array]:
        """The stacked parameters as a dict of arrays cast to the compute dtype."""
        return {n: getattr(self, n).get_value().astype(dtype)
                for n in self.NAMES if hasattr(self, n)}

    def layer_params(self, dtype: Any) -> dict[str, jax.Array]:
        """What `run_layers` runs: here the stacked dict (one scanned layer body)."""
        return self.stacked(dtype)


class UnstackedLayers(nnx.Module):
    """The parameters of a `DecoderLayers` stack as one buffer per layer: the decoding layout.
    A scan over stacked weights slices each layer's weights out of the stack, and XLA (GPU and
    CPU alike) materialises every slice before the dot reads it, so a one-token step streams
    the weights three times (read, write the copy, read it). With a buffer per layer the layers
    run unrolled and each dot reads its weights where they lie. The q/k/v projections are one
    [A, (N + 2K)·H] buffer (`w_qkv`) and gate/up one [D, 2F] (`w_gate_up`): fewer, larger dots
    stream the same bytes with fewer kernels. `fuse` names the groups to fuse: the drafters
    take `FUSED_KV` (k|v as `w_kv`, their q read apart; left apart, XLA merges the k and v dots
    itself by concatenating their weights every call) and `{}` keeps the stack's matrices.
    Same values, same forward (`Target.decoding_layout` builds it; the stacked
    state stays the source). Each buffer keeps the stack's logical axes less "layers", so a
    mesh shards it the same way; a fused buffer names only its input axis (its output mixes
    q, k and v heads, or gate and up, and stays whole)."""

    FUSED = {"w_qkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}

    FUSED_KV = {"w_kv": ("wk", "wv"), "w_gate_up": ("w_gate", "w_up")}

    def __init__(self, stack: DecoderLayers,
                 fuse: bool | dict[str, tuple[str, ...]] = True):
        self.num_layers = stack.num_layers
        self.qk_norm = stack.qk_norm
        fused = dict(self.FUSED if fuse is True else fuse or {})
        parts = {n for group in fused.values() for n in group}
        self.names = tuple(n for n in DecoderLayers.NAMES
                           if hasattr(stack, n) and n not in parts) + tuple(fused)

        def layer(i: int) -> dict[str, nnx.Param]:
            def flat(n: str) -> jax.Array:   # [in, …] → [in, out]
                w = getattr(stack, n).get_value()[i]
                return w.reshape(w.shape[0], -1)

            def axes(n: str) -> tuple[str | None, ...] | None:   # the stack's, less "layers"
                stacked = getattr(stack, n).get_metadata().get("axes")
                return None if stacked is None else tuple(stacked[1:])

            out = {n: nnx.Param(getattr(stack, n).get_value()[i], axes=axes(n))
                   for n in self.names if n not in fused}
            for name, group in fused.items():   # [in, out]: the input axis keeps its name
                first = axes(group[0])
                out[name] = nnx.Param(jnp.concatenate([flat(n) for n in group], axis=1),
                                      axes=None if first is None else (first[0], None))
            return out

        self.per_layer = nnx.List([nnx.Dict(layer(i)) for i in range(stack.num_layers)])

    def layer_params(self, dtype: Any) -> list[dict[str, jax.Array]]:
        """One dict of arrays per layer, cast to the compute dtype (`run_layers` unrolls)."""
        return [{n: layer[n].get_value().astype(dtype) for n in self.names}
                for layer in self.per_layer]


def run_layers(body: Any, carry: Any, params: dict[str, jax.Array] | list[dict[str, jax.Array]],
               per_layer_xs: Sequence[np.ndarray]) -> tuple[Any, Any]:
    """Runs `body(carry, (layer params, *per-layer values)) → (carry, y)` over the layers:
    `lax.scan` over stacked params (a dict of [L, …] arrays) or, for per-layer buffers (a list of
    dicts, `UnstackedLayers`), a Python loop with each layer's values as Python scalars. → (the
    final carry, the ys in the layers' layout: stacked on a leading layer axis, as `lax.scan`
    returns them, or for per-layer buffers each leaf a tuple of L layer groups [1, …], the
    per-layer caches' layout (`cache_like`), so no stack copies them)."""
    if isinstance(params, dict):
        return jax.lax.scan(body, carry, (params, *(jnp.asarray(x) for x in per_layer_xs)))
    ys = []
    for i, lp in enumerate(params):
        carry, y = body(carry, (lp, *(int(x[i]) for x in per_layer_xs)))
        ys.append(y)
    return carry, jax.tree.map(lambda *a: tuple(x[None] for x in a), *ys)


# ------------------------------------------------------------------ KV cache layouts
# A cache array is stacked, [L, B, S, K, H], or a tuple of layer groups [n, B, S, K, H]: one
# group per layer (n = 1) is the decoding layout, beside `UnstackedLayers`, because a GEMM reads
# a per-layer buffer where it lies while a layer's slice of a stack is copied out first
# (XLA:GPU); Gemma4's stacked groups are its layer types, its decoding layout one buffer per
# K/V-owning layer.

def cache_positions(c: jax.Array | tuple[jax.Array, ...]) -> int:
    """S, the positions of a cache array in either layout."""
    return (c[0] if isinstance(c, tuple) else c).shape[2]


def cache_layer(c: jax.Array | tuple[jax.Array, ...], i: Any) -> jax.Array:
    """Layer `i`'s keys or values [B, S, K, H]: a stacked cache's slice (`i` may be traced) or
    a per-layer cache's buffer (`i` a Python int)."""
    return c[i][0] if isinstance(c, tuple) else c[i]


def cache_like(x: jax.Array | tuple[jax.Array, ...], like: jax.Array | tuple[jax.Array, ...]
               ) -> jax.Array | tuple[jax.Array, ...]:
    """Cache array `x` in `like`'s layout: a stack split into `like`'s groups, groups
    concatenated into a stack, or `x` itself where the layouts agree."""
    if isinstance(like, tuple) and not isinstance(x, tuple):
        sizes = np.cumsum([0] + [g.shape[0] for g in like])
        return tuple(x[int(a):int(b)] for a, b in zip(sizes[:-1], sizes[1:]))
    if isinstance(x, tuple) and not isinstance(like, tuple):
        return jnp.concatenate(x, axis=0)
    return x


def cache_scatter(c: jax.Array | tuple[jax.Array, ...], index: tuple[Any, ...],
                  rows: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
    """`c.at[:, *index].set(rows)` for every layer at once (`rows` [L, …] in either layout,
    stacked or layer groups), in `c`'s layout; out-of-range indices are dropped."""
    at = (slice(None),) + tuple(index)
    if isinstance(c, tuple):
        return tuple(g.at[at].set(r.astype(g.dtype), mode="drop")
                     for g, r in zip(c, cache_like(rows, c)))
    return c.at[at].set(cache_like(rows, c).astype(c.dtype), mode="drop")


def cache_scatter_kv(ck: jax.Array | tuple[jax.Array, ...], cv: jax.Array | tuple[jax.Array, ...],
                     index: tuple[jax.Array, jax.Array], k_rows: jax.Array | tuple[jax.Array, ...],
                     v_rows: jax.Array | tuple[jax.Array, ...]) -> tuple[Any, Any]:
    """`cache_scatter` of the keys and of the values: token t's rows (`k_rows` / `v_rows`
    [L, T, Kh, H], stacked or as L layer groups [1, T, Kh, H]) at (`index[0][t]`,
    `index[1][t]`) of every layer, out-of-range tokens dropped. For per-layer caches (the
    decoding layout) on a GPU, outside a multi-device mesh, one kernel writes every layer's
    rows in place (`pallas_kernels.cache_write`) where XLA takes two scatters a layer;
    elsewhere, and inside `flash_kernels(False)`, the scatters."""
    def xla(ck, cv, rows, pos, k, v):
        return cache_scatter(ck, (rows, pos), k), cache_scatter(cv, (rows, pos), v)

    one_layer_groups = (isinstance(ck, tuple) and isinstance(cv, tuple)
                        and all(c.shape[0] == 1 for c in ck + cv))
    if (not one_layer_groups or len({c.dtype for c in ck + cv}) != 1
            or any(jnp.ndim(i) != 1 for i in index) or not _flash_kernels.get()
            or on_several_devices()):
        return xla(ck, cv, *index, k_rows, v_rows)
    n, dtype = len(ck), ck[0].dtype
    groups = isinstance(k_rows, tuple)
    ks, vs = (tuple(x.astype(dtype) for x in (r if groups else (r,))) for r in (k_rows, v_rows))

    def split(args):   # (caches, index, rows) back in their places
        k, v = args[2 * n + 2:2 * n + 2 + len(ks)], args[2 * n + 2 + len(ks):]
        return (args[:n], args[n:2 * n], *args[2 * n:2 * n + 2],
                *((k, v) if groups else (k[0], v[0])))

    def gpu(*args, interpret):
        from pallas_kernels.cache_write import write_rows

        return write_rows(*split(args), interpret=interpret)

    def default(*args):
        return xla(*split(args))

    return on_gpu(gpu, default, *ck, *cv, index[0].astype(jnp.int32),
                  index[1].astype(jnp.int32), *ks, *vs)


def cache_set_layer(c: jax.Array | tuple[jax.Array, ...], i: Any, index: tuple[Any, ...],
                    rows: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
    """`c[i].at[*index].set(rows)` for layer `i` alone, in `c`'s layout; out-of-range indices
    are dropped."""
    if isinstance(c, tuple):
        g = c[i].at[(0,) + tuple(index)].set(rows.astype(c[i].dtype), mode="drop")
        return c[:i] + (g,) + c[i + 1:]
    return c.at[(i,) + tuple(index)].set(rows.astype(c.dtype), mode="drop")


@dataclasses.dataclass(frozen=True)
class RaggedRows:
    """Cache addressing of a ragged call (B = 1, T = K flattened tokens; paper §5.2–5.3):
    token k reads cache row `read_k[k]` and writes row `write_k[k]` (out of range: dropped,
    for padding); `valid_k` masks padding's queries.

    `grid_rq` / `cell_k` (optional, both or neither): the same tokens laid out per request, Q
    cells a request. `grid_rq[r, q]` is the token in cell q of request r (≥ K: an empty cell)
    and `cell_k[k] = r·Q + q` the cell of token k. With them the Llama family attends request by
    request ([R, Q] queries against the [R, S] cache, each cache row read once) instead of
    gathering an [S] row for every token; the result is the same.

    `own_mask_rqq` (optional, with the grid and deferred writes): which of its request's cells
    each cell sees among this call's own tokens, [R, Q, Q] (default: the cells up to its own,
    a chain). A draft tree passes its ancestor matrix, its tokens placed at their depths."""

    read_k: jax.Array
    write_k: jax.Array
    valid_k: jax.Array
    grid_rq: jax.Array | None = None
    cell_k: jax.Array | None = None
    own_mask_rqq: jax.Array | None = None


def project_q(lp: dict[str, jax.Array], x_btd: jax.Array, eps: float) -> jax.Array:
    q = jnp.einsum("BTD,DNH->BTNH", x_btd, lp["wq"])
    return rms_norm(q, lp["q_norm"], eps) if "q_norm" in lp else q


def project_kv(lp: dict[str, jax.Array], x_btd: jax.Array, eps: float
               ) -> tuple[jax.Array, jax.Array]:
    """k (k-normed where the layer has a k norm) and v [B, T, K, H]: from `UnstackedLayers`'
    fused `w_kv` [A, 2·K·H] in one dot, else from `wk` and `wv`."""
    if "w_kv" in lp:
        B, T = x_btd.shape[:2]
        H = lp["wo"].shape[1]
        kv = jnp.einsum("BTD,DF->BTF", x_btd, lp["w_kv"])
        kh = kv.shape[-1] // 2
        k, v = kv[..., :kh].reshape(B, T, kh // H, H), kv[..., kh:].reshape(B, T, kh // H, H)
    else:
        k = jnp.einsum("BTD,DKH->BTKH", x_btd, lp["wk"])
        v = jnp.einsum("BTD,DKH->BTKH", x_btd, lp["wv"])
    if "k_norm" in lp:
        k = rms_norm(k, lp["k_norm"], eps)
    return k, v


def project_qkv(lp: dict[str, jax.Array], x_btd: jax.Array, eps: float
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, N, H], k and v [B, T, K, H] (q/k normed where the layer has q/k norms): from
    `UnstackedLayers`' fused `w_qkv` [A, (N + 2K)·H] in one dot, else `project_q` and
    `project_kv`."""
    if "w_qkv" not in lp:
        return (project_q(lp, x_btd, eps), *project_kv(lp, x_btd, eps))
    return split_qkv(lp, jnp.einsum("BTD,DF->BTF", x_btd, lp["w_qkv"]), eps)


def split_qkv(lp: dict[str, jax.Array], qkv: jax.Array, eps: float
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`project_qkv` from the fused product [B, T, (N + 2K)·H] taken already."""
    B, T = qkv.shape[:2]
    N, H = lp["wo"].shape[:2]
    kh = (qkv.shape[-1] - N * H) // 2
    q = qkv[..., :N * H].reshape(B, T, N, H)
    k = qkv[..., N * H:N * H + kh].reshape(B, T, kh // H, H)
    v = qkv[..., N * H + kh:].reshape(B, T, kh // H, H)
    if "q_norm" in lp:
        q = rms_norm(q, lp["q_norm"], eps)
    if "k_norm" in lp:
        k = rms_norm(k, lp["k_norm"], eps)
    return q, k, v


def attn_out(lp: dict[str, jax.Array], attn_btnh: jax.Array) -> jax.Array:
    """The o projection of the attention [B, T, N, H] → [B, T, D]."""
    B, T, N, H = attn_btnh.shape   # heads flattened first: XLA:CPU then reads wo as stored
    wo = lp["wo"].reshape(N * H, -1)   # (with [N, H] contracted it copies wo transposed)
    return jnp.einsum("BTF,FD->BTD", attn_btnh.reshape(B, T, N * H), wo)


def attn_out_and_mlp(lp: dict[str, jax.Array], resid_btd: jax.Array, attn_btnh: jax.Array,
                     eps: float) -> jax.Array:
    """o_proj + residual, then post-attention norm → SwiGLU → residual."""
    h = resid_btd + attn_out(lp, attn_btnh)
    h = h + swiglu(rms_norm(h, lp["post_norm"], eps), lp)
    return constrain(h, ("batch", "seq", "act_embed"))
