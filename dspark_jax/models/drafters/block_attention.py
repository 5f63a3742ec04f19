"""Block attention of the DSpark / DFlash backbone (SPEC §3; paper §3.2, training-time form).

Every block query (anchor a, slot t) attends to (1) the projected target context at positions
strictly before its anchor (`ctx_visible`, also segment-restricted when packing) and (2) the γ
keys of its own block, bidirectionally. Three implementations with the same visibility:

  `dense_block_attend`   the oracle: builds the [B, A, K, G, γ, S] f32 scores at once
                         (≈ 1.9 GB per sequence per layer at S 4096, A 512, γ 7, 32 heads).
  `chunked_block_attend` online softmax over context-key chunks (flash-attention style) with a
                         custom VJP that recomputes each chunk's probabilities from the saved
                         log-sum-exp, so neither the forward nor the backward holds more than
                         one [B, A, K, G, γ, chunk] score tile; the residuals are q, k, v, the
                         output and the [B, A, K, G, γ] log-sum-exp. XLA still writes each
                         score tile to memory and reads it back.
  `fused_block_attend`   the context part in a Triton flash-attention kernel
                         (pallas_kernels/context_attention: forward, dq and dk/dv), merged with
                         the own block's softmax by log-sum-exp; the visibility is given as a
                         `ContextMask` (a key limit per anchor), so a tile of slots skips the
                         context past its anchors. `block_attend` takes it when compiling for a
                         GPU.

Shapes: q [B,A,T,N,H]; ctx_k/v [B,S,K,H]; blk_k/v [B,A,U,K,H] (U = T = γ); ctx_visible
[B,A,S] (or a `ContextMask`); blk_valid [B,A]. N query heads share K key heads in groups of
G = N / K. Rows of invalid anchors (blk_valid False) return zeros and receive no gradient.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.models.layers import NEG_INF
from dspark_jax.sharding import shard_kernel

# the Triton kernel keeps a [tile, H] accumulator per program in registers: larger heads take
# the chunked path
FUSED_MAX_HEAD_DIM = 256


def _grouped(q_batnh: jax.Array, num_kv: int) -> jax.Array:
    B, A, T, N, H = q_batnh.shape
    return q_batnh.reshape(B, A, T, num_kv, N // num_kv, H)


def dense_block_attend(q_batnh: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array, blk_k: jax.Array,
                       blk_v: jax.Array, ctx_visible_bas: jax.Array, blk_valid_ba: jax.Array
                       ) -> jax.Array:
    """The oracle: one softmax over [context ; own block] with all scores materialised."""
    B, A, T, N, H = q_batnh.shape
    q = _grouped(q_batnh, ctx_k.shape[2])
    scale = H ** -0.5
    s_ctx = jnp.einsum("BATKGH,BSKH->BAKGTS", q, ctx_k, preferred_element_type=jnp.float32)
    s_blk = jnp.einsum("BATKGH,BAUKH->BAKGTU", q, blk_k, preferred_element_type=jnp.float32)
    s_ctx = jnp.where(ctx_visible_bas[:, :, None, None, None, :], s_ctx * scale, NEG_INF)
    valid = blk_valid_ba[:, :, None, None, None, None]
    s_blk = jnp.where(valid, s_blk * scale, NEG_INF)
    S = ctx_k.shape[1]
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    probs = jnp.where(valid, probs, 0.0).astype(ctx_v.dtype)
    out = (jnp.einsum("BAKGTS,BSKH->BATKGH", probs[..., :S], ctx_v,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("BAKGTU,BAUKH->BATKGH", probs[..., S:], blk_v,
                        preferred_element_type=jnp.float32))
    return out.reshape(B, A, T, N, H).astype(q_batnh.dtype)


# ------------------------------------------------------------------ chunked (online softmax)


def _chunks(x: jax.Array, axis: int, chunk: int, pad_value=0) -> jax.Array:
    """Splits `axis` into [n, …, chunk, …] (chunk axis moved to the front), padding the end."""
    S = x.shape[axis]
    n = -(-S // chunk)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n * chunk - S)
    x = jnp.pad(x, widths, constant_values=pad_value)
    x = x.reshape(x.shape[:axis] + (n, chunk) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _ctx_scores(q, k_c, vis_c, scale):
    """Scores of one context chunk [B,A,K,G,T,C] (f32, masked)."""
    s = jnp.einsum("BATKGH,BCKH->BAKGTC", q, k_c, preferred_element_type=jnp.float32) * scale
    return jnp.where(vis_c[:, :, None, None, None, :], s, NEG_INF)


def _blk_scores(q, blk_k, valid, scale):
    s = jnp.einsum("BATKGH,BAUKH->BAKGTU", q, blk_k, preferred_element_type=jnp.float32) * scale
    return jnp.where(valid[:, :, None, None, None, None], s, NEG_INF)


def _forward(q, ctx_k, ctx_v, blk_k, blk_v, vis, valid, chunk):
    """Output [B,A,T,K,G,H] (f32) and log-sum-exp [B,A,K,G,T]."""
    H = q.shape[-1]
    scale = H ** -0.5
    # the own block is always visible to a valid anchor: start the running max from it, so the
    # running max is a real score for every valid row whatever the context mask is
    s_b = _blk_scores(q, blk_k, valid, scale)
    m = jnp.max(s_b, axis=-1)
    p_b = jnp.exp(s_b - m[..., None])
    l = jnp.sum(p_b, axis=-1)
    acc = jnp.einsum("BAKGTU,BAUKH->BAKGTH", p_b.astype(blk_v.dtype), blk_v,
                     preferred_element_type=jnp.float32)

    def step(carry, xs):
        m, l, acc = carry
        k_c, v_c, vis_c = xs
        s = _ctx_scores(q, k_c, vis_c, scale)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("BAKGTC,BCKH->BAKGTH", p.astype(v_c.dtype), v_c,
                                                 preferred_element_type=jnp.float32)
        return (m_new, l, acc), None

    xs = (_chunks(ctx_k, 1, chunk), _chunks(ctx_v, 1, chunk), _chunks(vis, 2, chunk, False))
    (m, l, acc), _ = jax.lax.scan(step, (m, l, acc), xs)
    keep = valid[:, :, None, None, None]
    out = jnp.where(keep[..., None], acc / l[..., None], 0.0)                # [B,A,K,G,T,H]
    lse = m + jnp.log(l)
    return jnp.einsum("BAKGTH->BATKGH", out), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _chunked(q, ctx_k, ctx_v, blk_k, blk_v, vis, valid, chunk):
    out, _ = _forward(q, ctx_k, ctx_v, blk_k, blk_v, vis, valid, chunk)
    return out.astype(q.dtype)


def _chunked_fwd(q, ctx_k, ctx_v, blk_k, blk_v, vis, valid, chunk):
    out, lse = _forward(q, ctx_k, ctx_v, blk_k, blk_v, vis, valid, chunk)
    out = out.astype(q.dtype)
    return out, (q, ctx_k, ctx_v, blk_k, blk_v, vis, valid, out, lse)


def _bwd_prelude(q, valid, d_out, out):
    """dO of valid rows (invalid rows output zeros: they pass no gradient back) and
    delta = rowsum(dO · O), both [B,A,K,G,T(,H)] in f32."""
    do = jnp.where(valid[:, :, None, None, None, None], d_out.astype(jnp.float32), 0.0)
    do = jnp.einsum("BATKGH->BAKGTH", do)
    o = jnp.einsum("BATKGH->BAKGTH", out.astype(jnp.float32))
    return do, jnp.sum(do * o, axis=-1)


def _own_block_grads(q, blk_k, blk_v, valid, do, delta, lse, scale):
    """dq, d_blk_k, d_blk_v of the own-block part of the softmax whose log-sum-exp is `lse`."""
    keep = valid[:, :, None, None, None, None]
    p_b = jnp.where(keep, jnp.exp(_blk_scores(q, blk_k, valid, scale) - lse[..., None]), 0.0)
    d_blk_v = jnp.einsum("BAKGTU,BAKGTH->BAUKH", p_b, do)
    dp = jnp.einsum("BAKGTH,BAUKH->BAKGTU", do, blk_v.astype(jnp.float32))
    ds = p_b * (dp - delta[..., None]) * scale
    dq = jnp.einsum("BAKGTU,BAUKH->BATKGH", ds, blk_k.astype(jnp.float32))
    d_blk_k = jnp.einsum("BAKGTU,BATKGH->BAUKH", ds, q.astype(jnp.float32))
    return dq, d_blk_k, d_blk_v


def _chunked_bwd(chunk, res, d_out):
    q, ctx_k, ctx_v, blk_k, blk_v, vis, valid, out, lse = res
    S, H = ctx_k.shape[1], q.shape[-1]
    scale = H ** -0.5
    keep = valid[:, :, None, None, None]
    do, delta = _bwd_prelude(q, valid, d_out, out)
    qf = q.astype(jnp.float32)

    def probs(s):
        return jnp.where(keep[..., None], jnp.exp(s - lse[..., None]), 0.0)

    dq, d_blk_k, d_blk_v = _own_block_grads(q, blk_k, blk_v, valid, do, delta, lse, scale)

    def step(dq, xs):
        k_c, v_c, vis_c = xs
        p = probs(_ctx_scores(q, k_c, vis_c, scale))                        # [B,A,K,G,T,C]
        dv_c = jnp.einsum("BAKGTC,BAKGTH->BCKH", p, do)
        dp = jnp.einsum("BAKGTH,BCKH->BAKGTC", do, v_c.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("BAKGTC,BCKH->BATKGH", ds, k_c.astype(jnp.float32))
        dk_c = jnp.einsum("BAKGTC,BATKGH->BCKH", ds, qf)
        return dq, (dk_c, dv_c)

    xs = (_chunks(ctx_k, 1, chunk), _chunks(ctx_v, 1, chunk), _chunks(vis, 2, chunk, False))
    dq, (dk, dv) = jax.lax.scan(step, dq, xs)

    def unchunk(x):                                                         # [n,B,C,K,H] → [B,S,K,H]
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :S]

    return (dq.astype(q.dtype), unchunk(dk).astype(ctx_k.dtype), unchunk(dv).astype(ctx_v.dtype),
            d_blk_k.astype(blk_k.dtype), d_blk_v.astype(blk_v.dtype), None, None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ------------------------------------------------------------------ fused (Triton, on GPUs)


class ContextMask(NamedTuple):
    """Which context keys an anchor's block sees, as limits: the positions s < limit[b, a]
    (0 for an invalid anchor) whose segment id (`key_seg_bs`) is the anchor's
    (`anchor_seg_ba`; both None without packing). The fused kernel takes this form; `dense`
    gives the [B, A, S] mask the other paths take."""

    limit_ba: jax.Array
    anchor_seg_ba: jax.Array | None = None
    key_seg_bs: jax.Array | None = None

    def dense(self, num_keys: int) -> jax.Array:
        vis = jnp.arange(num_keys)[None, None, :] < self.limit_ba[..., None]
        if self.key_seg_bs is not None:
            vis = vis & (self.key_seg_bs[:, None, :] == self.anchor_seg_ba[..., None])
        return vis

    def arrays(self, num_keys: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(limit, anchor segment, key segment) as int32 arrays (zeros without packing)."""
        lim = self.limit_ba.astype(jnp.int32)
        if self.key_seg_bs is None:
            return lim, jnp.zeros_like(lim), jnp.zeros((lim.shape[0], num_keys), jnp.int32)
        return lim, self.anchor_seg_ba.astype(jnp.int32), self.key_seg_bs.astype(jnp.int32)


def _kernel_rows(q, lim, aseg):
    """The kernel's query rows (one per draft slot, heads ungrouped) with their anchor's key
    limit and segment: (q [B, A·T, N, H], limit [B, A·T], segment [B, A·T])."""
    B, A, T, K, G, H = q.shape
    return (q.reshape(B, A * T, K * G, H), jnp.repeat(lim, T, axis=1),
            jnp.repeat(aseg, T, axis=1))


def _fused_forward(q, ctx_k, ctx_v, blk_k, blk_v, lim, aseg, kseg, valid, interpret):
    """`_forward`'s outputs, the context part from the Triton kernel (one row per draft slot,
    the anchor's limit and segment repeated over its γ slots) merged with the own block's
    softmax by log-sum-exp."""
    from pallas_kernels.context_attention import context_attention

    B, A, T, K, G, H = q.shape
    scale = H ** -0.5
    q_r, lim_r, seg_r = _kernel_rows(q, lim, aseg)
    o_c, lse_c = context_attention(q_r, ctx_k, ctx_v, lim_r, seg_r, kseg, scale=scale,
                                   interpret=interpret)
    o_c = jnp.einsum("BATKGH->BAKGTH", o_c.reshape(B, A, T, K, G, H))
    lse_c = jnp.einsum("BKGAT->BAKGT", lse_c.reshape(B, K, G, A, T))
    s_b = _blk_scores(q, blk_k, valid, scale)
    lse = jnp.logaddexp(lse_c, jax.nn.logsumexp(s_b, axis=-1))
    out = (jnp.exp(lse_c - lse)[..., None] * o_c
           + jnp.einsum("BAKGTU,BAUKH->BAKGTH", jnp.exp(s_b - lse[..., None]).astype(blk_v.dtype),
                        blk_v, preferred_element_type=jnp.float32))
    out = jnp.where(valid[:, :, None, None, None, None], out, 0.0)
    return jnp.einsum("BAKGTH->BATKGH", out), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _fused(q, ctx_k, ctx_v, blk_k, blk_v, lim, aseg, kseg, valid, interpret):
    out, _ = _fused_forward(q, ctx_k, ctx_v, blk_k, blk_v, lim, aseg, kseg, valid, interpret)
    return out.astype(q.dtype)


def _fused_fwd(q, ctx_k, ctx_v, blk_k, blk_v, lim, aseg, kseg, valid, interpret):
    out, lse = _fused_forward(q, ctx_k, ctx_v, blk_k, blk_v, lim, aseg, kseg, valid, interpret)
    out = out.astype(q.dtype)
    return out, (q, ctx_k, ctx_v, blk_k, blk_v, lim, aseg, kseg, valid, out, lse)


def _fused_bwd(interpret, res, d_out):
    from pallas_kernels.context_attention import context_attention_bwd

    q, ctx_k, ctx_v, blk_k, blk_v, lim, aseg, kseg, valid, out, lse = res
    B, A, T, K, G, H = q.shape
    scale = H ** -0.5
    do, delta = _bwd_prelude(q, valid, d_out, out)
    lse = jnp.where(valid[:, :, None, None, None], lse, 0.0)
    dq, d_blk_k, d_blk_v = _own_block_grads(q, blk_k, blk_v, valid, do, delta, lse, scale)
    heads = lambda x: jnp.einsum("BAKGT->BKGAT", x).reshape(B, K * G, A * T)  # noqa: E731
    do_rows = jnp.einsum("BAKGTH->BATKGH", do).reshape(B, A * T, K * G, H)
    q_r, lim_r, seg_r = _kernel_rows(q, lim, aseg)
    dq_c, dk, dv = context_attention_bwd(
        q_r, ctx_k, ctx_v, lim_r, seg_r, kseg, do_rows.astype(q.dtype), heads(lse), heads(delta),
        scale=scale, interpret=interpret)
    dq = dq + dq_c.reshape(B, A, T, K, G, H).astype(jnp.float32)
    return (dq.astype(q.dtype), dk, dv, d_blk_k.astype(blk_k.dtype),
            d_blk_v.astype(blk_v.dtype), None, None, None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


# logical axes of the fused kernel's arguments (grouped queries [B, A, T, K, G, H], context
# keys [B, S, K, H], block keys [B, A, U, K, H], per-anchor and per-key rows) and its output
_FUSED_Q_AXES = ("batch", None, None, "kv_heads", None, "head_dim")
_FUSED_AXES = (_FUSED_Q_AXES, ("batch", None, "kv_heads", "head_dim"),
               ("batch", None, "kv_heads", "head_dim"),
               ("batch", None, None, "kv_heads", "head_dim"),
               ("batch", None, None, "kv_heads", "head_dim"),
               ("batch", None), ("batch", None), ("batch", None), ("batch", None))


def fused_block_attend(q_batnh: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                       blk_k: jax.Array, blk_v: jax.Array, ctx_mask: ContextMask,
                       blk_valid_ba: jax.Array, interpret: bool = False) -> jax.Array:
    """Block attention whose context part runs in the Triton kernel of
    `pallas_kernels.context_attention` (forward and backward): no score tile leaves the chip,
    and a tile of slots walks only the context below its anchors' limits. Inside a sharded
    program each device runs it on its own rows and KV heads (`sharding.shard_kernel`).
    `interpret` runs the kernel on any device (tests)."""
    B, A, T, N, H = q_batnh.shape
    lim, aseg, kseg = ctx_mask.arrays(ctx_k.shape[1])

    def local(q, ck, cv, bk, bv, lim, aseg, kseg, valid):
        return _fused(q, ck, cv, bk, bv, lim, aseg, kseg, valid, interpret)

    args = (_grouped(q_batnh, ctx_k.shape[2]), ctx_k, ctx_v, blk_k, blk_v, lim, aseg, kseg,
            blk_valid_ba.astype(bool))
    out = shard_kernel(local, args, _FUSED_AXES, _FUSED_Q_AXES)
    return out.reshape(B, A, T, N, H)


def chunked_block_attend(q_batnh: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                         blk_k: jax.Array, blk_v: jax.Array, ctx_visible_bas: jax.Array,
                         blk_valid_ba: jax.Array, key_chunk: int) -> jax.Array:
    """Online-softmax block attention over context chunks of `key_chunk` keys (see module doc)."""
    if key_chunk < 1:
        raise ValueError(f"key_chunk must be ≥ 1, got {key_chunk}")
    B, A, T, N, H = q_batnh.shape
    chunk = min(int(key_chunk), max(ctx_k.shape[1], 1))
    out = _chunked(_grouped(q_batnh, ctx_k.shape[2]), ctx_k, ctx_v, blk_k, blk_v,
                   ctx_visible_bas.astype(bool), blk_valid_ba.astype(bool), chunk)
    return out.reshape(B, A, T, N, H)


def block_attend(q_batnh: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array, blk_k: jax.Array,
                 blk_v: jax.Array, ctx_visible: jax.Array | ContextMask, blk_valid_ba: jax.Array,
                 key_chunk: int | None = None) -> jax.Array:
    """The dense oracle when `key_chunk` is None or ≤ 0, the chunked online softmax otherwise;
    compiled for a GPU with `ctx_visible` given as a `ContextMask` (and heads of at most
    `FUSED_MAX_HEAD_DIM`), the fused Triton kernel instead. The branch is chosen for the
    platform being compiled for, so an ahead-of-time compile for an H200 takes the kernel."""
    S, H = ctx_k.shape[1], q_batnh.shape[-1]
    if isinstance(ctx_visible, ContextMask):
        if key_chunk is not None and key_chunk > 0 and H <= FUSED_MAX_HEAD_DIM:
            def chunked(q, ck, cv, bk, bv, lim, aseg, kseg, valid):
                vis = ContextMask(lim, aseg, kseg).dense(S)
                return chunked_block_attend(q, ck, cv, bk, bv, vis, valid, key_chunk)

            def fused(q, ck, cv, bk, bv, lim, aseg, kseg, valid):
                return fused_block_attend(q, ck, cv, bk, bv, ContextMask(lim, aseg, kseg), valid)

            return jax.lax.platform_dependent(
                q_batnh, ctx_k, ctx_v, blk_k, blk_v, *ctx_visible.arrays(S), blk_valid_ba,
                cuda=fused, default=chunked)
        ctx_visible = ctx_visible.dense(S)
    if key_chunk is None or key_chunk <= 0:
        return dense_block_attend(q_batnh, ctx_k, ctx_v, blk_k, blk_v, ctx_visible,
                                  blk_valid_ba)
    return chunked_block_attend(q_batnh, ctx_k, ctx_v, blk_k, blk_v, ctx_visible,
                                blk_valid_ba, key_chunk)
