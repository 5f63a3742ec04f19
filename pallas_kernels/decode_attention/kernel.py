"""Attention of a few queries a row over a KV cache prefix and the call's own new keys (Triton).

The target's attention while decoding (SPEC §1–2: the one-token step, the verification of a
drafted block, the nodes of a draft tree): each of a row's T queries sees the cache positions
below the row's `start` and its own keys, under one softmax. XLA runs this as about fifteen
kernels a layer (q/k norms, RoPE, scores, their maximum, exponentials, sums, converts, the
weighted values, the cache writes, each a pass through HBM); here it is two: the partial
attention of every (row, key head, cache split) in one program each, then their merge.

  `decode_attention`      own keys given apart, under any mask (a draft tree's).
  `layer_attention`       from a layer's raw q/k/v product: each program norms and rotates its
                          own query rows (the RoPE angles of the tokens at start + t taken
                          in the program from the inverse frequencies); the last program of
                          a (row, key head) also norms and rotates the T new keys, attends
                          to them (causally for the target's tokens, all to all for a
                          drafter's parallel block), returns them and can store them into
                          the cache in place (input/output aliasing);
                          Gemma4's unscaled v norm, k=v heads and sliding window as options.
  `ref_decode_attention`, `ref_layer_attention`  the pure-JAX oracles (every score
                          materialised; Hugging Face's norm and rotate-half RoPE).

Layout. A row's T queries act as M = T·G query heads of each of the Kh key heads (N = Kh·G),
so one program reads each cache tile once for all of them: a program reads its key head's G
query heads for T queries as one [Tp, G, H] tile (Tp·G ≥ 16, Triton's smallest dot; reads past
T masked) and the merge writes them back the same way, so nothing is regrouped around the
kernels. Where T·G exceeds `MAX_TILE_ROWS` (a draft tree's nodes) `decode_attention` splits the
queries into tiles of `TILED_ROWS` rows, the grid's last axis: the programs of one cache split
run side by side and read its tiles once from HBM, the others from L2. Where the query tiles
alone fill the GPU, the cache is one split and each program writes its rows' attention itself:
no partials, no merge. The cache stays where it lies, [B, S, Kh, H]: a program reads its key head's column of
each tile in place. Partial programs: grid (B, Kh, P), program p walks the cache tiles of its
split of [0, start) (a split past `start` does nothing), and the last program also takes the
own keys, so every partial is an online softmax (FlashAttention-2) over disjoint keys. P is
chosen so B·Kh·P programs cover the GPU's multiprocessors: at B = 1 a decoding step's eight key
heads alone would leave most of the chip idle while it reads the cache.

Scores are taken in base 2 (exp2) with the scale folded in; rows that see no key give zeros.
Nothing here imports dspark_jax, except the norm oracle from `pallas_kernels.norms`.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (LOG2E, MASKED_SCORE, load_rows, next_pow2, normed_rotated,
                                   ref_rotate_half)

__all__ = ["DEFAULT_BLOCK_K", "decode_attention", "layer_attention", "ref_decode_attention",
           "ref_layer_attention", "splits_for"]

DEFAULT_BLOCK_K = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
# programs to aim for: about two per multiprocessor of an H100 / H200 (132)
TARGET_PROGRAMS = 256
# query rows (T·G) one program takes whole; beyond it `decode_attention` tiles the queries,
# `TILED_ROWS` rows a program (FlashAttention-2's [128, H] accumulator, eight warps)
MAX_TILE_ROWS = 64
TILED_ROWS = 128
TILED_NUM_WARPS = 8
# a program's query rows × head size past which its tiles and a second pipeline stage of
# H-wide K/V tiles overflow an H100 / H200's shared memory (228 KB; read off the deviceless
# compile's shared-memory check at H = 256 and 512): one stage there, and query tiles of at
# most this many elements
STAGED_ROWS_X_HEAD = 16384
TILE_ROWS_X_HEAD = 32768


def _fit_stages(rows: int, head: int, num_stages: int) -> int:
    """The pipeline stages a program of `rows` query rows × `head` runs with."""
    return 1 if rows * head > STAGED_ROWS_X_HEAD else num_stages



def splits_for(batch: int, kv_heads: int, seq: int, block_k: int = DEFAULT_BLOCK_K) -> int:
    """Cache splits a row and key head: a power of two ≥ 2 (the merge reads them as one tile)
    with B·Kh·P ≈ `TARGET_PROGRAMS`, no more than the cache has tiles where that allows."""
    want = max(1, -(-TARGET_PROGRAMS // max(1, batch * kv_heads)))
    tiles = max(1, -(-seq // block_k))
    return max(2, min(next_pow2(want), 1 << (tiles.bit_length() - 1)))


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b accumulated in f32: bf16 tiles on the tensor cores; f32 tiles at full precision
    (IEEE, never TF32), as decoding runs a model that computes in fp32."""
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return jnp.dot(a, b, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST if exact else None)


def _online(carry, s, mask, v):
    """One tile of an online softmax: scores s [M, n] (base 2), visible `mask`, values [n, H]."""
    acc, m, l = carry
    s = jnp.where(mask, s, MASKED_SCORE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
    corr = jnp.exp2(m - m_new)
    acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l * corr + jnp.sum(p, axis=1)


def _query_rows_ok(shape: tuple[int, ...], num_tokens: int, tile=0) -> jax.Array:
    """[tp, g, …] (`shape`): which rows of query tile `tile` are the row's queries (t < T). A
    block's rows past T lie in the next batch row's queries or past the array, and Triton
    reads and writes a block as it is told: they are loaded masked and never stored."""
    t = tile * shape[0] + lax.broadcasted_iota(jnp.int32, shape, 0)
    return t < num_tokens


def _cache_part(q, k_ref, v_ref, lo, hi, *, qk_scale: float, block_k: int, row_lo=None):
    """Online softmax of the rows q [M, H] over the cache positions [lo, hi) (`lo` a whole
    tile), each row's from `row_lo` [M] on where given (a sliding window: the tiles wholly
    below every row's are skipped): (acc, max, sum). q may also come as column pieces
    ((rows [M, h_i], the keys' columns), …), their scores summed (a rotated row's halves)."""
    pieces = q if isinstance(q, tuple) else ((q, slice(None)),)
    mp, h = pieces[0][0].shape[0], v_ref.shape[-1]
    offsets = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    if row_lo is not None:
        lo = jnp.maximum(lo, jnp.min(row_lo) // block_k * block_k)

    def tile(i, carry):
        first = lo + i * block_k
        keys = pl.ds(pl.multiple_of(first, block_k), block_k)
        k = [k_ref[keys, cols] for _, cols in pieces]
        v = v_ref[keys, :]
        s = functools.reduce(operator.add, (_dot(x, kc.T) for (x, _), kc in zip(pieces, k)))
        s = s * qk_scale
        seen = first + offsets < hi
        if row_lo is not None:
            seen = seen & (first + offsets >= row_lo[:, None])
        return _online(carry, s, seen, v)

    init = (jnp.zeros((mp, h), jnp.float32), jnp.full((mp,), MASKED_SCORE, jnp.float32),
            jnp.zeros((mp,), jnp.float32))
    return lax.fori_loop(0, jnp.maximum(hi - lo + block_k - 1, 0) // block_k, tile, init)


def _partial_kernel(q_ref, k_ref, v_ref, start_ref, ok_ref, ov_ref, mask_ref, *out_refs,
                    qk_scale: float, block_k: int, split_len: int, seq: int, own_rows: int,
                    num_tokens: int, window: int = 0):
    """A split of the cache below `start`; the last split also takes the own keys. Its
    partial softmax (acc, max, sum) into three outputs, or, with one output (the whole cache
    a single split), the normalised attention of its rows. `window` > 0: query t (at
    start + t) sees the cache positions above start + t − window only."""
    from jax.experimental.pallas import triton as plgpu

    p_id, n_p = pl.program_id(2), pl.num_programs(2)
    tp, g, h = q_ref.shape
    rows_ok = _query_rows_ok((tp, g, h), num_tokens, pl.program_id(3))
    q = plgpu.load(q_ref.at[:, :, :], mask=rows_ok, other=0.0).reshape(tp * g, h)   # [M, H]
    start = start_ref[...]
    lo = p_id * split_len
    hi = jnp.minimum(jnp.minimum(lo + split_len, start), seq)
    carry = _cache_part(q, k_ref, v_ref, lo, hi, qk_scale=qk_scale, block_k=block_k,
                        row_lo=_window_lo(start, window, tp, g, pl.program_id(3)))

    def own(carry):   # the Q own rows read as a [Qp, H] tile, the rows past Q masked
        from jax.experimental.pallas import triton as plgpu

        rows = pl.ds(0, own_rows)
        ok_mask = (lax.broadcasted_iota(jnp.int32, (own_rows, 1), 0) < ok_ref.shape[0])
        ok = plgpu.load(ok_ref.at[rows, :], mask=ok_mask, other=0.0)
        ov = plgpu.load(ov_ref.at[rows, :], mask=ok_mask, other=0.0)
        s = _dot(q, ok.T) * qk_scale                                         # [M, Qp]
        return _online(carry, s, mask_ref[...] != 0, ov)

    acc, m, l = lax.cond(p_id == n_p - 1, own, lambda c: c, carry)
    if len(out_refs) == 1:
        out_ref, = out_refs
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        plgpu.store(out_ref.at[:, :, :], out.reshape(out_ref.shape).astype(out_ref.dtype),
                    mask=rows_ok)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def _window_lo(start, window: int, tp: int, g: int, tile=0):
    """A sliding window's first visible cache position [tp·g] of each row of query tile `tile`
    ([tp, g] rows: query t at start + t sees the positions above start + t − window); None
    without a window."""
    if not window:
        return None
    t = tile * tp + lax.broadcasted_iota(jnp.int32, (tp * g,), 0) // g
    return start + t - window + 1


def _noscale_norm(x, *, eps: float, dtype):
    """Rows [M, H] RMS-normed without a scale in f32, cast to `dtype` (Gemma4's value norm)."""
    xf = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(xf * xf, axis=1) / xf.shape[1] + eps)
    return (xf * r[:, None]).astype(dtype)


def _layer_kernel(x_ref, ok_ref, ov_ref, qw_ref, kw_ref, freq_ref, start_ref, k_ref, v_ref,
                  *refs, qk_scale: float, block_k: int, split_len: int, seq: int,
                  num_tokens: int, own_len: int, eps: float, normed: bool, write: bool,
                  causal: bool, parts: int | None, v_norm: bool = False, window: int = 0):
    """`_partial_kernel` on the raw q/k/v product (or the f32 sum of its `parts`, rounded to the
    cache's dtype): each program norms and rotates its own query rows; the last also norms and
    rotates the T own keys, takes their values (RMS-normed without a scale with `v_norm`),
    attends to them (causally, or all of them to all), returns them (and v) as rows and, with
    `write`, stores them into the cache at start + t. Token t's RoPE angles are its position
    start + t times the inverse frequencies, taken here in f32 (a product, then cos / sin).
    `window` > 0: query t (at start + t) sees the cache positions above start + t − window and
    the own keys within the window only."""
    from jax.experimental.pallas import triton as plgpu

    if write:   # the caches' outputs alias k_ref / v_ref's buffers
        o_ref, m_ref, l_ref, kr_ref, vr_ref, ck_ref, cv_ref = refs
    else:
        o_ref, m_ref, l_ref, kr_ref, vr_ref = refs
    kh, p_id, n_p = pl.program_id(1), pl.program_id(2), pl.num_programs(2)
    tp, g, h = x_ref.shape[-3:]
    h2, mp, dtype = h // 2, tp * g, k_ref.dtype
    first, second = pl.ds(0, h2), pl.ds(h2, h2)
    start = start_ref[...]

    def trig(n):   # cos, sin [n, H/2] of the first n tokens' angles, at start + t
        pos = start + lax.broadcasted_iota(jnp.int32, (n, 1), 0)
        angles = pos.astype(jnp.float32) * freq_ref[...][None, :]
        return jnp.cos(angles), jnp.sin(angles)

    def per_query(x):   # a token's [tp, H/2] row for each of its G query heads
        return jnp.broadcast_to(x[:, None, :], (tp, g, h2)).reshape(mp, h2)

    rows_ok = _query_rows_ok((tp, g, h2), num_tokens)

    def queries(cols):   # the query rows' columns (the sum of the product's parts, rounded)
        at = lambda *i: x_ref.at[(*i, slice(None), slice(None), cols)]   # noqa: E731
        if parts is None:
            x = plgpu.load(at(), mask=rows_ok, other=0.0)
        else:
            x = functools.reduce(operator.add, (plgpu.load(at(jnp.int32(i)), mask=rows_ok,
                                                           other=0.0) for i in range(parts)))
        return x.astype(dtype).reshape(mp, h2).astype(jnp.float32)

    def own_rows(ref, n, cols=slice(None)):   # the same for the own k / v rows
        if parts is None:
            return load_rows(ref, num_tokens, n, cols)
        return functools.reduce(operator.add, (load_rows(ref, num_tokens, n, cols, part=i)
                                               for i in range(parts))).astype(dtype)

    cos, sin = trig(tp)
    q1, q2 = normed_rotated(queries(first), queries(second), qw_ref, per_query(cos),
                            per_query(sin), eps=eps, normed=normed, dtype=dtype)
    lo = p_id * split_len
    hi = jnp.minimum(jnp.minimum(lo + split_len, start), seq)
    carry = _cache_part(((q1, first), (q2, second)), k_ref, v_ref, lo, hi, qk_scale=qk_scale,
                        block_k=block_k, row_lo=_window_lo(start, window, tp, g))

    def own(carry):
        qp = own_len
        k1, k2 = normed_rotated(own_rows(ok_ref, qp, first).astype(jnp.float32),
                                own_rows(ok_ref, qp, second).astype(jnp.float32),
                                kw_ref, *trig(qp), eps=eps, normed=normed, dtype=dtype)
        v = own_rows(ov_ref, qp)
        if v_norm:
            v = _noscale_norm(v, eps=eps, dtype=dtype)
        token = lax.broadcasted_iota(jnp.int32, (mp, 1), 0) // g
        col = lax.broadcasted_iota(jnp.int32, (1, qp), 1)
        s = (_dot(q1, k1.T) + _dot(q2, k2.T)) * qk_scale                      # [M, Qp]
        row_ok = lax.broadcasted_iota(jnp.int32, (qp, 1), 0) < num_tokens
        plgpu.store(kr_ref.at[pl.ds(0, qp), first], k1, mask=row_ok)
        plgpu.store(kr_ref.at[pl.ds(0, qp), second], k2, mask=row_ok)
        plgpu.store(vr_ref.at[pl.ds(0, qp), :], v, mask=row_ok)
        if write:   # the rows into the cache at start + t (a position ≥ S dropped)
            at = pl.ds(start, qp)
            in_cache = row_ok & (start + lax.broadcasted_iota(jnp.int32, (qp, 1), 0) < seq)
            plgpu.store(ck_ref.at[at, kh, first], k1.astype(ck_ref.dtype), mask=in_cache)
            plgpu.store(ck_ref.at[at, kh, second], k2.astype(ck_ref.dtype), mask=in_cache)
            plgpu.store(cv_ref.at[at, kh, :], v.astype(cv_ref.dtype), mask=in_cache)
        seen = (col <= token) & (col < num_tokens) if causal else col < num_tokens
        if window:
            seen = seen & (token - col < window)
        return _online(carry, s, seen, v)

    acc, m, l = lax.cond(p_id == n_p - 1, own, lambda c: c, carry)
    o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, num_tokens: int):
    """The P partials of one (row, key head) under their shared maximum, stored for the rows
    that are the row's queries (t < T)."""
    from jax.experimental.pallas import triton as plgpu

    m = m_ref[...]                                                           # [P, M]
    top = jnp.max(m, axis=0)
    w = jnp.exp2(m - top[None, :])
    den = jnp.sum(l_ref[...] * w, axis=0)

    def part(i, acc):
        wi = jnp.exp2(m_ref[i, :] - top)
        return acc + o_ref[i, :, :] * wi[:, None]

    acc = lax.fori_loop(0, m.shape[0], part, jnp.zeros(o_ref.shape[1:], jnp.float32))
    out = acc / jnp.where(den > 0, den, 1.0)[:, None]
    plgpu.store(out_ref.at[:, :, :], out.reshape(out_ref.shape).astype(out_ref.dtype),
                mask=_query_rows_ok(out_ref.shape, num_tokens, pl.program_id(2)))


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


def _merge(o, m, l, q, tp: int, g: int, interpret: bool, n_tiles: int = 1) -> jax.Array:
    """The merge kernel, one program a (row, key head, query tile): each row's queries written
    where q has them, [B, T, N, H]."""
    B, Kh, P, _, H = o.shape
    Mp = tp * g
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_tokens=q.shape[1]), grid=(B, Kh, n_tiles),
        in_specs=[pl.BlockSpec((None, None, P, Mp, H), lambda b, k, j: (b, k, 0, j, 0)),
                  pl.BlockSpec((None, None, P, Mp), lambda b, k, j: (b, k, 0, j)),
                  pl.BlockSpec((None, None, P, Mp), lambda b, k, j: (b, k, 0, j))],
        out_specs=pl.BlockSpec((None, tp, g, H), lambda b, k, j: (b, j, k, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(interpret, 1, 1), interpret=interpret,
        name="decode_attention_merge",
    )(o, m, l)


@functools.partial(jax.jit, static_argnames=("scale", "window", "block_k", "splits",
                                             "interpret", "num_warps", "num_stages"))
def decode_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, start: jax.Array,
                     own_k: jax.Array, own_v: jax.Array, own_mask: jax.Array, *, scale: float,
                     window: int = 0, block_k: int = DEFAULT_BLOCK_K,
                     splits: int | None = None, interpret: bool = False,
                     num_warps: int = DEFAULT_NUM_WARPS,
                     num_stages: int = DEFAULT_NUM_STAGES) -> jax.Array:
    """Grouped-query attention of q [B, T, N, H] over cache k / v [B, S, Kh, H] at positions
    below `start` [B] and over own k / v [B, Q, Kh, H] where `own_mask` [B, T, Q] is set (any
    mask: a draft tree's); [B, T, N, H] in q's dtype. `window` > 0 (a sliding-window layer,
    query t at position start + t): the cache positions above start + t − window only, the
    tiles below every query's window never read (the own keys' window is `own_mask`'s).
    `splits`: cache splits a row and key head (default `splits_for`; a power of two ≥ 2)."""
    _check(q, cache_k, cache_v, start, own_k, own_v, own_mask)
    B, T, N, H = q.shape
    S, Kh = cache_k.shape[1], cache_k.shape[2]
    G, Q = N // Kh, own_k.shape[1]
    P, Tp, split_len = _tiling(B, T, G, Kh, S, block_k, splits)
    n_tiles = 1
    if Tp * G > MAX_TILE_ROWS:   # query tiles of TILED_ROWS rows, the grid's last axis
        Tp = max(1, min(TILED_ROWS, TILE_ROWS_X_HEAD // H) // G)
        n_tiles = -(-T // Tp)
        num_warps = max(num_warps, TILED_NUM_WARPS)
        if splits is None and B * Kh * n_tiles >= TARGET_PROGRAMS:
            # the query tiles fill the GPU alone: one split, no partials and no merge
            P, split_len = 1, -(-S // block_k) * block_k
    Mp, Qp = Tp * G, max(16, next_pow2(Q))
    num_stages = _fit_stages(Mp, H, num_stages)
    mask = jnp.broadcast_to(own_mask[:, :, None, :], (B, T, G, Q)).reshape(B, T * G, Q)
    mask = jnp.pad(mask.astype(jnp.int32), ((0, 0), (0, n_tiles * Mp - T * G), (0, Qp - Q)))
    kernel = functools.partial(_partial_kernel, qk_scale=scale * LOG2E, block_k=block_k,
                               split_len=split_len, seq=S, own_rows=Qp, num_tokens=T,
                               window=int(window))
    if P == 1:   # each program's rows normalised where q has them, [B, T, N, H]
        out_specs = pl.BlockSpec((None, Tp, G, H), lambda b, k, p, j: (b, j, k, 0))
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_specs = _partial_specs(Mp, H)
        out_shape = _partial_shapes(B, Kh, P, n_tiles * Mp, H)
    out = pl.pallas_call(
        kernel, grid=(B, Kh, P, n_tiles),
        in_specs=[_query_rows(Tp, G, H), _key_head(S, H), _key_head(S, H), _per_row(),
                  _key_head(Q, H), _key_head(Q, H),
                  pl.BlockSpec((None, Mp, Qp), lambda b, k, p, j: (b, j, 0))],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        interpret=interpret, name="decode_attention_splits",
    )(q, cache_k, cache_v, start.astype(jnp.int32), own_k.astype(cache_k.dtype),
      own_v.astype(cache_v.dtype), mask)
    return out if P == 1 else _merge(*out, q, Tp, G, interpret, n_tiles)


def _tiling(B: int, T: int, G: int, Kh: int, S: int, block_k: int, splits: int | None
            ) -> tuple[int, int, int]:
    """(cache splits P, the row's queries padded Tp, positions a split)."""
    P = splits_for(B, Kh, S, block_k) if splits is None else int(splits)
    if P < 2 or P != next_pow2(P):
        raise ValueError(f"splits={P} is not a power of two ≥ 2")
    if S % block_k:
        raise ValueError(f"cache length {S} is not a multiple of block_k={block_k}")
    # a program's query rows: the row's T queries (padded to Tp) × the G heads of its key head
    return P, max(next_pow2(T), 16 // G), -(-(-(-S // P)) // block_k) * block_k


def _query_rows(tp: int, g: int, h: int) -> pl.BlockSpec:
    """A key head's G query heads for Tp of the row's queries: query tile j (the grid's fourth
    axis where there is one). Rows past T are the kernels' to mask (`_query_rows_ok`)."""
    return pl.BlockSpec((None, tp, g, h), lambda b, k, p=0, j=0: (b, j, k, 0))


def _key_head(n: int, h: int, first: int = 0) -> pl.BlockSpec:
    """Key head k's column of a [B, n, heads, H] array, its heads counted from `first`."""
    return pl.BlockSpec((None, n, None, h), lambda b, k, *_: (b, 0, first + k, 0))


def _per_row() -> pl.BlockSpec:
    return pl.BlockSpec((None,), lambda b, *_: (b,))


def _partial_specs(mp: int, h: int) -> list[pl.BlockSpec]:
    """Program (b, k, p[, j])'s partial softmax: rows [j·mp, (j + 1)·mp) of split p."""
    return [pl.BlockSpec((None, None, None, mp, h), lambda b, k, p, j=0: (b, k, p, j, 0)),
            pl.BlockSpec((None, None, None, mp), lambda b, k, p, j=0: (b, k, p, j)),
            pl.BlockSpec((None, None, None, mp), lambda b, k, p, j=0: (b, k, p, j))]


def _partial_shapes(B: int, Kh: int, P: int, mp: int, h: int) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct((B, Kh, P, mp, h), jnp.float32),
            jax.ShapeDtypeStruct((B, Kh, P, mp), jnp.float32),
            jax.ShapeDtypeStruct((B, Kh, P, mp), jnp.float32)]


@functools.partial(jax.jit, static_argnames=("num_q_heads", "eps", "scale", "write", "causal",
                                             "v_norm", "window", "v_from_k", "block_k",
                                             "splits", "merge", "interpret", "num_warps",
                                             "num_stages", "num_tokens"))
def layer_attention(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None,
                    inv_freq: jax.Array, start: jax.Array, cache_k: jax.Array,
                    cache_v: jax.Array, *, num_q_heads: int, eps: float, scale: float,
                    write: bool = False, causal: bool = True, v_norm: bool = False,
                    window: int = 0, v_from_k: bool = False,
                    block_k: int = DEFAULT_BLOCK_K, splits: int | None = None,
                    merge: bool = True, interpret: bool = False,
                    num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = DEFAULT_NUM_STAGES,
                    num_tokens: int | None = None
                    ) -> tuple[Any, jax.Array, jax.Array]:
    """A decoder layer's attention from its raw q/k/v product [B, T, N + 2Kh, H]: the q and k
    heads RMS-normed by `q_norm` / `k_norm` [H] (both None: no norm, Llama) and rotated at
    the tokens' positions start + t by the angles (start + t) · `inv_freq` [H/2], taken in the
    kernel in f32 (the frequencies with the model's RoPE scaling; a zero leaves its pair
    still), then the T tokens attend to the cache below `start` [B] and to each other:
    causally, or with `causal=False` every token to all T (a DSpark / DFlash draft block). One
    kernel does all of it (each program norms and rotates its own rows) and the merge a
    second.

    Gemma4's layers: `v_norm` RMS-norms the v rows without a scale (f32, cast to the dtype)
    before they are attended to, returned or written; `window` > 0 (a sliding layer) lets
    query t (at start + t) see the cache positions above start + t − window and the own keys
    within the window only (the cache tiles below every query's window unread); `v_from_k` (a
    k=v layer) takes a product [B, T, N + Kh, H] without v heads, the values being the raw k
    heads (normed without a scale with `v_norm`).

    The product may also come as the f32 parts of a split-K GEMM, [parts, B, Tq, N + 2Kh, H]
    with Tq ≥ T = `num_tokens` (rows past T unread): each program sums its rows' parts and
    rounds them to the cache's dtype, as XLA's sum of its own split-K parts would, one kernel
    fewer.

    Returns (attention [B, T, N, H], k rows, v rows [B, T, Kh, H]: the tokens' normed, rotated
    keys and their values); with `write`, (attention, cache k, cache v) with those rows
    written into the cache [B, S, Kh, H] at start + t in place (a position ≥ S dropped).
    `merge=False`: the attention comes unmerged, as the cache splits' partial softmaxes
    (acc [B, Kh, P, Mp, H], max and sum [B, Kh, P, Mp], base 2; row t·G + g of a key head's
    Mp = Tp·G is token t's query head g), for the kernel that reads it to merge
    (`pallas_kernels.row_gemm.merge_gemm`)."""
    parts = qkv.shape[0] if qkv.ndim == 5 else None
    B, T, J, H = (*qkv.shape[-4:-2], *qkv.shape[-2:]) if parts is None else (
        qkv.shape[1], num_tokens, *qkv.shape[-2:])
    if parts is not None and num_tokens is None:
        raise ValueError("a split-K product's parts need num_tokens (their rows are padded)")
    if parts is not None and (qkv.dtype != jnp.float32 or qkv.shape[2] < T):
        raise ValueError(f"the product's parts must be f32 [parts, B, ≥ T, heads, H]: "
                         f"{qkv.shape} {qkv.dtype}, T = {T}")
    dtype = cache_k.dtype if parts is not None else qkv.dtype
    Kh = cache_k.shape[2]
    N = num_q_heads
    kv_heads = Kh if v_from_k else 2 * Kh
    if J != N + kv_heads:
        raise ValueError(f"qkv has {J} heads, not {N} + {kv_heads // Kh}·{Kh}")
    if write and not causal:
        raise ValueError("write stores the rows of causal tokens at start + t")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if inv_freq.shape != (H // 2,):
        raise ValueError(f"inv_freq must be [H/2] = {(H // 2,)}: {inv_freq.shape}")
    q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
    own = jax.ShapeDtypeStruct((B, T, Kh, H), dtype)
    _check(q, cache_k, cache_v, start, own, own, jax.ShapeDtypeStruct((B, T, T), jnp.bool_))
    if cache_k.dtype != dtype:
        raise ValueError(f"the cache ({cache_k.dtype}) must be in the product's dtype "
                         f"({qkv.dtype})")
    S, G = cache_k.shape[1], N // Kh
    P, Tp, split_len = _tiling(B, T, G, Kh, S, block_k, splits)
    Mp, Qp = Tp * G, max(16, next_pow2(T))
    num_stages = _fit_stages(Mp, H, num_stages)
    normed = q_norm is not None
    if not normed:
        q_norm = k_norm = jnp.ones((H,), dtype)
    weight = pl.BlockSpec((H,), lambda b, k, p: (0,))
    freq = pl.BlockSpec((H // 2,), lambda b, k, p: (0,))
    product = [_query_rows(Tp, G, H), _key_head(T, H, N),
               _key_head(T, H, N if v_from_k else N + Kh)]
    if parts is not None:   # every part of a program's block
        product = [pl.BlockSpec((parts, *b.block_shape),
                                lambda *ids, b=b: (0, *b.index_map(*ids))) for b in product]
    in_specs = product + [weight, weight, freq, _per_row(), _key_head(S, H),
                          _key_head(S, H)]
    args = [qkv, qkv, qkv, q_norm, k_norm, inv_freq.astype(jnp.float32),
            start.astype(jnp.int32), cache_k, cache_v]
    out_specs = _partial_specs(Mp, H) + [_key_head(T, H), _key_head(T, H)]
    out_shape = _partial_shapes(B, Kh, P, Mp, H) + [own, own]
    aliases = {}
    if write:   # the caches, read per key head, are also two outputs the last programs store
        # rows into: one buffer each (passed twice, XLA would copy the cache for the call)
        whole = pl.BlockSpec((None, S, Kh, H), lambda b, k, p: (b, 0, 0, 0))
        out_specs += [whole, whole]
        out_shape += [jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
                      jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype)]
        aliases = {7: 5, 8: 6}
    kernel = functools.partial(
        _layer_kernel, qk_scale=scale * LOG2E, block_k=block_k, split_len=split_len, seq=S,
        num_tokens=T, own_len=Qp, eps=eps, normed=normed, write=write, causal=causal,
        parts=parts, v_norm=v_norm, window=int(window))
    outs = pl.pallas_call(
        kernel, grid=(B, Kh, P), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        interpret=interpret, name="layer_attention_splits",
    )(*args)
    o, m, l, k_rows, v_rows = outs[:5]
    attn = _merge(o, m, l, q, Tp, G, interpret) if merge else (o, m, l)
    return (attn, outs[5], outs[6]) if write else (attn, k_rows, v_rows)


def ref_decode_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                         start: jax.Array, own_k: jax.Array, own_v: jax.Array,
                         own_mask: jax.Array, *, scale: float, window: int = 0) -> jax.Array:
    """The oracle: the same attention over the concatenated keys, every score materialised."""
    _check(q, cache_k, cache_v, start, own_k, own_v, own_mask)
    B, T, N, H = q.shape
    S, Kh = cache_k.shape[1], cache_k.shape[2]
    G = N // Kh
    keys = jnp.concatenate([cache_k, own_k.astype(cache_k.dtype)], axis=1).astype(jnp.float32)
    vals = jnp.concatenate([cache_v, own_v.astype(cache_v.dtype)], axis=1).astype(jnp.float32)
    pos = jnp.arange(S)[None, None, :]
    cached = pos < start[:, None, None]                                      # [B, 1, S]
    if window:
        cached = cached & (pos > start[:, None, None] + jnp.arange(T)[None, :, None] - window)
    visible = jnp.concatenate([jnp.broadcast_to(cached, (B, T, S)), own_mask.astype(bool)],
                              axis=2)                                        # [B, T, S+Q]
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


def ref_layer_attention(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None,
                        inv_freq: jax.Array, start: jax.Array, cache_k: jax.Array,
                        cache_v: jax.Array, *, num_q_heads: int, eps: float, scale: float,
                        causal: bool = True, v_norm: bool = False, window: int = 0,
                        v_from_k: bool = False, num_tokens: int | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The oracle of `layer_attention` (without the write): Hugging Face's q/k norms and
    rotate-half RoPE at the angles (start + t) · inv_freq (f32), Gemma4's unscaled v norm with
    `v_norm` (v the raw k heads with `v_from_k`), then `ref_decode_attention` with the T
    tokens as own keys, causal or (`causal=False`) all seen by all, within `window` where
    given. Parts of a split-K product [parts, B, Tq, ·, H] are summed and rounded to the
    cache's dtype first (its first `num_tokens` rows)."""
    from pallas_kernels.norms import ref_rms_norm

    if qkv.ndim == 5:
        if num_tokens is None:
            raise ValueError("a split-K product's parts need num_tokens")
        qkv = qkv.sum(axis=0)[:, :num_tokens].astype(cache_k.dtype)
    B, T = qkv.shape[:2]
    n, kh = num_q_heads, cache_k.shape[2]
    q, k = qkv[:, :, :n], qkv[:, :, n:n + kh]
    v = k if v_from_k else qkv[:, :, n + kh:]
    if v_norm:
        vf = v.astype(jnp.float32)
        v = (vf * lax.rsqrt(jnp.mean(vf * vf, axis=-1, keepdims=True) + eps)).astype(v.dtype)
    if q_norm is not None:
        q, k = ref_rms_norm(q, q_norm, eps), ref_rms_norm(k, k_norm, eps)

    positions = start.astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]      # [B, T, 1, H/2]
    q, k = (ref_rotate_half(x, cos, sin) for x in (q, k))
    seen = jnp.tril(jnp.ones((T, T), bool)) if causal else jnp.ones((T, T), bool)
    if window:
        seen = seen & (jnp.arange(T)[:, None] - jnp.arange(T)[None, :] < window)
    seen = jnp.broadcast_to(seen, (B, T, T))
    return (ref_decode_attention(q, cache_k, cache_v, start, k, v, seen, scale=scale,
                                 window=window), k, v)
