"""Attention of a few queries a row over a KV cache prefix and the call's own new keys (Triton).

The target's attention while decoding (SPEC §1–2: the one-token step, the verification of a
drafted block, the nodes of a draft tree): each of a row's T queries sees the cache positions
below the row's `start` and the own keys its `own_mask` marks, under one softmax. XLA runs this
as about fifteen kernels a layer (scores, their maximum, exponentials, sums, converts and the
weighted values, each a pass through HBM); here it is two: the partial attention of every
(row, key head, cache split) in one program each, then their merge.

  `decode_attention`      the attention, [B, T, N, H] in q's dtype.
  `ref_decode_attention`  the pure-JAX oracle (every score materialised).

Layout. A row's T queries act as M = T·G query heads of each of the Kh key heads (N = Kh·G),
so one program reads each cache tile once for all of them: q is regrouped to [B, Kh, M, H]
(rows t-major, padded to a power of two ≥ 16, Triton's smallest dot). The cache stays where
it lies, [B, S, Kh, H]: a program reads its key head's column of each tile in place, never a
copy. Partial programs: grid (B, Kh, P), program p walks the cache tiles of its split of
[0, start) (a split past `start` does nothing), and the last program also takes the own keys,
so every partial is an online softmax (FlashAttention-2) over disjoint keys; with P = 1 that
program normalises and writes the output itself and the merge is skipped. P is chosen so
B·Kh·P programs cover the GPU's multiprocessors: at B = 1 a decoding step's eight key heads
alone would leave most of the chip idle while it reads the cache.

Scores are taken in base 2 (exp2) with the scale folded in; rows that see no key give zeros.
Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import LOG2E, MASKED_SCORE, next_pow2

__all__ = ["DEFAULT_BLOCK_K", "decode_attention", "ref_decode_attention", "splits_for"]

DEFAULT_BLOCK_K = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
# programs to aim for: about two per multiprocessor of an H100 / H200 (132)
TARGET_PROGRAMS = 256



def splits_for(batch: int, kv_heads: int, seq: int, block_k: int = DEFAULT_BLOCK_K) -> int:
    """Cache splits a row and key head: a power of two ≥ 2 (the merge reads them as one tile)
    with B·Kh·P ≈ `TARGET_PROGRAMS`, no more than the cache has tiles where that allows."""
    want = max(1, -(-TARGET_PROGRAMS // max(1, batch * kv_heads)))
    tiles = max(1, -(-seq // block_k))
    return max(2, min(next_pow2(want), 1 << (tiles.bit_length() - 1)))


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _online(carry, s, mask, v):
    """One tile of an online softmax: scores s [M, n] (base 2), visible `mask`, values [n, H]."""
    acc, m, l = carry
    s = jnp.where(mask, s, MASKED_SCORE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
    corr = jnp.exp2(m - m_new)
    acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l * corr + jnp.sum(p, axis=1)


def _cache_part(q, k_ref, v_ref, lo, hi, row_limit, *, qk_scale: float, block_k: int):
    """Online softmax of the rows q [M, H] over the cache positions [lo, hi) (each row's also
    below `row_limit` [M, 1] where given): (acc, max, sum)."""
    mp, h = q.shape
    offsets = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

    def tile(i, carry):
        first = lo + i * block_k
        keys = pl.ds(pl.multiple_of(first, block_k), block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = _dot(q, k.T) * qk_scale
        seen = first + offsets < hi
        if row_limit is not None:
            seen = seen & (first + offsets < row_limit)
        return _online(carry, s, seen, v)

    init = (jnp.zeros((mp, h), jnp.float32), jnp.full((mp,), MASKED_SCORE, jnp.float32),
            jnp.zeros((mp,), jnp.float32))
    return lax.fori_loop(0, jnp.maximum(hi - lo + block_k - 1, 0) // block_k, tile, init)


def _partial_kernel(q_ref, k_ref, v_ref, start_ref, ok_ref, ov_ref, mask_ref, o_ref, m_ref,
                    l_ref, *, qk_scale: float, block_k: int, split_len: int, seq: int,
                    own_rows: int):
    """A split of the cache below `start`; the last split also takes the own keys."""
    p_id, n_p = pl.program_id(2), pl.num_programs(2)
    tp, g, h = q_ref.shape
    q = q_ref[...].reshape(tp * g, h)                                        # [M, H]
    lo = p_id * split_len
    hi = jnp.minimum(jnp.minimum(lo + split_len, start_ref[...]), seq)
    carry = _cache_part(q, k_ref, v_ref, lo, hi, None, qk_scale=qk_scale, block_k=block_k)

    def own(carry):   # the Q own rows read as a [Qp, H] tile, the rows past Q masked
        from jax.experimental.pallas import triton as plgpu

        rows = pl.ds(0, own_rows)
        ok_mask = (lax.broadcasted_iota(jnp.int32, (own_rows, 1), 0) < ok_ref.shape[0])
        ok = plgpu.load(ok_ref.at[rows, :], mask=ok_mask, other=0.0)
        ov = plgpu.load(ov_ref.at[rows, :], mask=ok_mask, other=0.0)
        s = _dot(q, ok.T) * qk_scale                                         # [M, Qp]
        return _online(carry, s, mask_ref[...] != 0, ov)

    acc, m, l = lax.cond(p_id == n_p - 1, own, lambda c: c, carry)
    o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def _written_kernel(q_ref, k_ref, v_ref, start_ref, o_ref, m_ref, l_ref, *, qk_scale: float,
                    block_k: int, split_len: int, seq: int, num_tokens: int):
    """A split of the cache when the call's own keys are in it already: the row's token t
    (at position start + t) sees the positions up to its own."""
    p_id = pl.program_id(2)
    tp, g, h = q_ref.shape
    q = q_ref[...].reshape(tp * g, h)                                        # [M, H]
    start = start_ref[...]
    lo = p_id * split_len
    hi = jnp.minimum(jnp.minimum(lo + split_len, start + num_tokens), seq)
    token = lax.broadcasted_iota(jnp.int32, (tp * g, 1), 0) // g
    o_ref[...], m_ref[...], l_ref[...] = _cache_part(
        q, k_ref, v_ref, lo, hi, start + token + 1, qk_scale=qk_scale, block_k=block_k)


def _merge_kernel(o_ref, m_ref, l_ref, out_ref):
    """The P partials of one (row, key head) under their shared maximum."""
    m = m_ref[...]                                                           # [P, M]
    top = jnp.max(m, axis=0)
    w = jnp.exp2(m - top[None, :])
    den = jnp.sum(l_ref[...] * w, axis=0)

    def part(i, acc):
        wi = jnp.exp2(m_ref[i, :] - top)
        return acc + o_ref[i, :, :] * wi[:, None]

    acc = lax.fori_loop(0, m.shape[0], part, jnp.zeros(o_ref.shape[1:], jnp.float32))
    out = acc / jnp.where(den > 0, den, 1.0)[:, None]
    out_ref[...] = out.reshape(out_ref.shape).astype(out_ref.dtype)


def _check(q, cache_k, cache_v, start, own_k, own_v, own_mask):
    B, T, N, H = q.shape
    if cache_k.ndim != 4 or cache_k.shape != cache_v.shape or cache_k.shape[0] != B \
            or cache_k.shape[3] != H:
        raise ValueError(f"cache k, v must be [B, S, Kh, H] matching q {q.shape}: "
                         f"{cache_k.shape}, {cache_v.shape}")
    Kh = cache_k.shape[2]
    if N % Kh:
        raise ValueError(f"{N} query heads do not group over {Kh} key heads")
    if own_k.shape != own_v.shape or own_k.shape[0] != B or own_k.shape[2:] != (Kh, H):
        raise ValueError(f"own k, v must be [B, Q, Kh, H]: {own_k.shape}, {own_v.shape}")
    if own_mask.shape != (B, T, own_k.shape[1]):
        raise ValueError(f"own_mask must be {(B, T, own_k.shape[1])}, got {own_mask.shape}")
    if start.shape != (B,):
        raise ValueError(f"start must be [B] = {(B,)}, got {start.shape}")
    if H < 16 or H != next_pow2(H):
        raise ValueError(f"head size {H} is not a power of two ≥ 16 (Triton's tiles)")
    if N // Kh != next_pow2(N // Kh):
        raise ValueError(f"{N // Kh} query heads a key head is not a power of two (a program "
                         f"reads its key head's queries as one tile)")


def _compiler_params(interpret: bool, num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plgpu

    return None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "splits", "interpret",
                                             "num_warps", "num_stages", "num_q_heads"))
def decode_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, start: jax.Array,
                     own_k: jax.Array | None = None, own_v: jax.Array | None = None,
                     own_mask: jax.Array | None = None, *, scale: float,
                     num_q_heads: int | None = None, block_k: int = DEFAULT_BLOCK_K,
                     splits: int | None = None, interpret: bool = False,
                     num_warps: int = DEFAULT_NUM_WARPS,
                     num_stages: int = DEFAULT_NUM_STAGES) -> jax.Array:
    """Grouped-query attention of T queries a row over cache k / v [B, S, Kh, H] at positions
    below `start` [B] and over the call's own keys; [B, T, N, H] in q's dtype.

    q is [B, T, N, H], or a fused q/k/v product [B, T, N + 2Kh, H] with `num_q_heads` = N
    (read in place: its q heads are the queries, its k / v heads the own keys). The own keys:
      own k / v [B, Q, Kh, H] where `own_mask` [B, T, Q] is set;
      without own k / v, with `own_mask` [B, T, T]: the fused product's own k / v heads;
      without `own_mask`: none apart from the cache, which holds them already: token t of a
        row sits at start + t and sees the positions up to its own.
    `splits`: cache splits a row and key head (default `splits_for`; a power of two ≥ 2)."""
    Kh = cache_k.shape[2]
    qkv = q
    if num_q_heads is not None:
        if q.shape[2] != num_q_heads + 2 * Kh:
            raise ValueError(f"a fused q/k/v product must have N + 2·{Kh} heads with "
                             f"num_q_heads = N: {q.shape}, num_q_heads={num_q_heads}")
        q = jax.ShapeDtypeStruct(q.shape[:2] + (num_q_heads, q.shape[3]), q.dtype)
    written = own_mask is None
    if own_k is None and not written:
        if num_q_heads is None:
            raise ValueError("own keys from q need a fused q/k/v product (num_q_heads)")
        own_k = own_v = jax.ShapeDtypeStruct(qkv.shape[:2] + (Kh, qkv.shape[3]), qkv.dtype)
        from_qkv = True
    else:
        from_qkv = False
    B, T, N, H = q.shape
    if written:
        own_k = own_v = jax.ShapeDtypeStruct((B, 1, Kh, H), q.dtype)
        own_mask = jax.ShapeDtypeStruct((B, T, 1), jnp.bool_)
    _check(q, cache_k, cache_v, start, own_k, own_v, own_mask)
    S = cache_k.shape[1]
    G, Q = N // Kh, own_k.shape[1]
    P = splits_for(B, Kh, S, block_k) if splits is None else int(splits)
    if P < 2 or P != next_pow2(P):
        raise ValueError(f"splits={P} is not a power of two ≥ 2")
    if S % block_k:
        raise ValueError(f"cache length {S} is not a multiple of block_k={block_k}")
    # a program's query rows: the row's T queries (padded to Tp) × the G heads of its key head
    Tp = max(next_pow2(T), 16 // G)
    Mp, Qp = Tp * G, max(16, next_pow2(Q))
    split_len = -(-(-(-S // P)) // block_k) * block_k
    q_rows = pl.BlockSpec((None, Tp, G, H), lambda b, k, *_: (b, 0, k, 0))  # reads past T masked

    def kv_head(n: int, first: int = 0) -> pl.BlockSpec:   # key head k's column, from `first`
        return pl.BlockSpec((None, n, None, H), lambda b, k, p: (b, 0, first + k, 0))

    common = dict(qk_scale=scale * LOG2E, block_k=block_k, split_len=split_len, seq=S)
    in_specs = [q_rows, kv_head(S), kv_head(S), pl.BlockSpec((None,), lambda b, k, p: (b,))]
    args = [qkv, cache_k, cache_v, start.astype(jnp.int32)]
    if written:
        kernel = functools.partial(_written_kernel, num_tokens=T, **common)
    else:
        kernel = functools.partial(_partial_kernel, own_rows=Qp, **common)
        mask = jnp.broadcast_to(own_mask[:, :, None, :], (B, T, G, Q)).reshape(B, T * G, Q)
        mask = jnp.pad(mask.astype(jnp.int32), ((0, 0), (0, Mp - T * G), (0, Qp - Q)))
        in_specs += ([kv_head(Q, N), kv_head(Q, N + Kh)] if from_qkv else
                     [kv_head(Q), kv_head(Q)]) + [
            pl.BlockSpec((None, Mp, Qp), lambda b, k, p: (b, 0, 0))]
        args += ([qkv, qkv] if from_qkv else
                 [own_k.astype(cache_k.dtype), own_v.astype(cache_v.dtype)]) + [mask]
    o, m, l = pl.pallas_call(
        kernel, grid=(B, Kh, P), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, Mp, H), lambda b, k, p: (b, k, p, 0, 0)),
                   pl.BlockSpec((None, None, None, Mp), lambda b, k, p: (b, k, p, 0)),
                   pl.BlockSpec((None, None, None, Mp), lambda b, k, p: (b, k, p, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Kh, P, Mp, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, Kh, P, Mp), jnp.float32),
                   jax.ShapeDtypeStruct((B, Kh, P, Mp), jnp.float32)],
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        interpret=interpret, name="decode_attention_splits",
    )(*args)
    # the merge writes each row's queries where q had them: [B, T, N, H], no regrouping copy
    return pl.pallas_call(
        _merge_kernel, grid=(B, Kh),
        in_specs=[pl.BlockSpec((None, None, P, Mp, H), lambda b, k: (b, k, 0, 0, 0)),
                  pl.BlockSpec((None, None, P, Mp), lambda b, k: (b, k, 0, 0)),
                  pl.BlockSpec((None, None, P, Mp), lambda b, k: (b, k, 0, 0))],
        out_specs=q_rows, out_shape=jax.ShapeDtypeStruct((B, T, N, H), q.dtype),
        compiler_params=_compiler_params(interpret, 1, 1), interpret=interpret,
        name="decode_attention_merge",
    )(o, m, l)


def ref_decode_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                         start: jax.Array, own_k: jax.Array, own_v: jax.Array,
                         own_mask: jax.Array, *, scale: float) -> jax.Array:
    """The oracle: the same attention over the concatenated keys, every score materialised."""
    _check(q, cache_k, cache_v, start, own_k, own_v, own_mask)
    B, T, N, H = q.shape
    S, Kh = cache_k.shape[1], cache_k.shape[2]
    G = N // Kh
    keys = jnp.concatenate([cache_k, own_k.astype(cache_k.dtype)], axis=1).astype(jnp.float32)
    vals = jnp.concatenate([cache_v, own_v.astype(cache_v.dtype)], axis=1).astype(jnp.float32)
    visible = jnp.concatenate(
        [jnp.broadcast_to((jnp.arange(S)[None, :] < start[:, None])[:, None], (B, T, S)),
         own_mask.astype(bool)], axis=2)                                     # [B, T, S+Q]
    s = jnp.einsum("btkgh,bskh->btkgs", q.astype(jnp.float32).reshape(B, T, Kh, G, H),
                   keys, precision=lax.Precision.HIGHEST) * scale
    s = jnp.where(visible[:, :, None, None], s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(visible[:, :, None, None], jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0)),
                  0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    out = jnp.einsum("btkgs,bskh->btkgh", p, vals, precision=lax.Precision.HIGHEST)
    return out.reshape(B, T, N, H).astype(q.dtype)
