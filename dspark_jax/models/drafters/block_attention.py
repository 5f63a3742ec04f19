"""Block attention of the DSpark / DFlash backbone (SPEC §3; paper §3.2, training-time form).

Every block query (anchor a, slot t) attends to (1) the projected target context at positions
strictly before its anchor (`ctx_visible`, also segment-restricted when packing) and (2) the γ
keys of its own block, bidirectionally. Two implementations with the same visibility:

  `dense_block_attend`   the oracle: builds the [B, A, K, G, γ, S] f32 scores at once
                         (≈ 1.9 GB per sequence per layer at S 4096, A 512, γ 7, 32 heads).
  `chunked_block_attend` online softmax over context-key chunks (flash-attention style) with a
                         custom VJP that recomputes each chunk's probabilities from the saved
                         log-sum-exp, so neither the forward nor the backward holds more than
                         one [B, A, K, G, γ, chunk] score tile; the residuals are q, k, v, the
                         output and the [B, A, K, G, γ] log-sum-exp.

Shapes: q [B,A,T,N,H]; ctx_k/v [B,S,K,H]; blk_k/v [B,A,U,K,H] (U = T = γ); ctx_visible [B,A,S];
blk_valid [B,A]. N query heads share K key heads in groups of G = N / K. Rows of invalid anchors
(blk_valid False) return zeros and receive no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dspark_jax.models.layers import NEG_INF


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


def _chunked_bwd(chunk, res, d_out):
    q, ctx_k, ctx_v, blk_k, blk_v, vis, valid, out, lse = res
    S, H = ctx_k.shape[1], q.shape[-1]
    scale = H ** -0.5
    keep = valid[:, :, None, None, None]
    # rows of invalid anchors output zeros: they pass no gradient back
    do = jnp.where(valid[:, :, None, None, None, None], d_out.astype(jnp.float32), 0.0)
    do = jnp.einsum("BATKGH->BAKGTH", do)
    o = jnp.einsum("BATKGH->BAKGTH", out.astype(jnp.float32))
    delta = jnp.sum(do * o, axis=-1)                                        # [B,A,K,G,T]
    qf = q.astype(jnp.float32)

    def probs(s):
        return jnp.where(keep[..., None], jnp.exp(s - lse[..., None]), 0.0)

    # own block
    p_b = probs(_blk_scores(q, blk_k, valid, scale))                        # [B,A,K,G,T,U]
    d_blk_v = jnp.einsum("BAKGTU,BAKGTH->BAUKH", p_b, do)
    dp = jnp.einsum("BAKGTH,BAUKH->BAKGTU", do, blk_v.astype(jnp.float32))
    ds = p_b * (dp - delta[..., None]) * scale
    dq = jnp.einsum("BAKGTU,BAUKH->BATKGH", ds, blk_k.astype(jnp.float32))
    d_blk_k = jnp.einsum("BAKGTU,BATKGH->BAUKH", ds, qf)

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
                 blk_v: jax.Array, ctx_visible_bas: jax.Array, blk_valid_ba: jax.Array,
                 key_chunk: int | None = None) -> jax.Array:
    """The dense oracle when `key_chunk` is None or ≤ 0, the chunked online softmax otherwise."""
    if key_chunk is None or key_chunk <= 0:
        return dense_block_attend(q_batnh, ctx_k, ctx_v, blk_k, blk_v, ctx_visible_bas,
                                  blk_valid_ba)
    return chunked_block_attend(q_batnh, ctx_k, ctx_v, blk_k, blk_v, ctx_visible_bas,
                                blk_valid_ba, key_chunk)
