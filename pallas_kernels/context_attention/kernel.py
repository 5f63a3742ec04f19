"""Flash attention of query rows over a shared context with a key limit per row (Triton).

The context half of DSpark's training-time block attention (SPEC §3, paper §3.2): query row r
of batch row b (one draft slot of one anchor's block) sees the context keys s < limit[b, r]
whose segment id equals the row's. Because every row carries its own limit, the rows of all
anchors of a sequence share one pass over the context, and a tile of rows only walks the key
tiles below its largest limit: with anchors sorted by position (as training samples them) that
skips about half of the score tiles, and no score ever leaves the chip.

  `context_attention`      forward: the output normalised over the context keys, and its
                           log-sum-exp (natural log), so a caller can merge another softmax part
                           (the block's own keys) by log-sum-exp.
  `context_attention_bwd`  backward for a merged softmax: it takes the merged log-sum-exp and
                           delta = rowsum(dO · O) of the merged output, and returns dq, dk, dv
                           of the context part (FlashAttention-2, Algorithm 2). dk and dv sum
                           the query heads that share a key head in one program.
  `ref_context_attention`  the pure-JAX oracle of the forward (all scores materialised).

Shapes: q [B, R, N, H]; k, v [B, S, Kh, H] with N = Kh · G (query head n reads key head
n // G); limit, q_seg [B, R] int32; k_seg [B, S] int32. Rows with no visible key return zeros
and a log-sum-exp of −inf. The wrappers pad R, S and H to the tiles (padded keys lie at or past
S, beyond every limit; padded rows have limit 0). Scores are computed in base 2 (exp2) with
the scale folded in, as Triton's fused-attention tutorial does. Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import LOG2E, MASKED_SCORE, next_pow2

__all__ = ["DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K", "context_attention", "context_attention_bwd",
           "ref_context_attention"]

# Tiles of query rows and context keys. 64 × 64 keeps a [64, 64] f32 score tile and the
# [64, H] accumulators in registers with four warps at H = 128, and gives a Qwen3-4B training
# step (4 × 3584 rows × 32 heads) thousands of programs.
DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
_LN2 = math.log(2.0)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b accumulated in f32 (bf16 tiles on the tensor cores)."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _visible(lim, qseg, kseg, start_k, block_k):
    """[bq, bk]: key start_k + j is below the row's limit and in the row's segment."""
    span = start_k * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    return (span < lim[:, None]) & (kseg[None, :] == qseg[:, None])


def _key_tiles(lim, block_k, n_k):
    """Key tiles a row tile must walk: those below its largest limit."""
    return jnp.minimum(lax.div(jnp.max(lim) + block_k - 1, block_k), n_k)


def _fwd_kernel(q_ref, k_ref, v_ref, lim_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *,
                qk_scale: float, block_k: int):
    n_k = k_ref.shape[0] // block_k
    q = q_ref[...]
    lim, qseg = lim_ref[...], qseg_ref[...]
    bq, h = q.shape

    def body(j, carry):
        acc, m, l = carry
        ks = pl.ds(j * block_k, block_k)
        mask = _visible(lim, qseg, kseg_ref[ks], j, block_k)
        s = jnp.where(mask, _dot(q, k_ref[ks, :].T) * qk_scale, MASKED_SCORE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
        corr = jnp.exp2(m - m_new)
        v = v_ref[ks, :]
        acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l * corr + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), MASKED_SCORE, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, _key_tiles(lim, block_k, n_k), body, init)
    seen = l > 0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * _LN2, -jnp.inf)


def _dq_kernel(q_ref, k_ref, v_ref, lim_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *, qk_scale: float, scale: float, block_k: int):
    n_k = k_ref.shape[0] // block_k
    q, do = q_ref[...], do_ref[...]
    lim, qseg = lim_ref[...], qseg_ref[...]
    lse2, delta = lse_ref[...] * LOG2E, delta_ref[...]

    def body(j, dq):
        ks = pl.ds(j * block_k, block_k)
        k, v = k_ref[ks, :], v_ref[ks, :]
        mask = _visible(lim, qseg, kseg_ref[ks], j, block_k)
        p = jnp.where(mask, jnp.exp2(_dot(q, k.T) * qk_scale - lse2[:, None]), 0.0)
        ds = p * (_dot(do, v.T) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, _key_tiles(lim, block_k, n_k), body,
                       jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, lim_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref,
                tile_max_ref, dk_ref, dv_ref, *, qk_scale: float, scale: float, block_q: int,
                groups: int):
    start_k = pl.program_id(2)
    k, v, kseg = k_ref[...], v_ref[...], kseg_ref[...]
    block_k = k.shape[0]
    # row tiles holding a row that sees a key of this tile: [lo, hi) (empty when none)
    tile_max = tile_max_ref[...]
    tiles = lax.broadcasted_iota(jnp.int32, tile_max.shape, 0)
    needed = tile_max > start_k * block_k
    lo = jnp.min(jnp.where(needed, tiles, tile_max.shape[0]))
    hi = jnp.max(jnp.where(needed, tiles + 1, 0))
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for g in range(groups):          # the query heads that read this key head

        def body(i, carry, g=g):
            dk, dv = carry
            qs = pl.ds(i * block_q, block_q)
            q, do = q_ref[qs, g, :], do_ref[qs, g, :]
            mask = _visible(lim_ref[qs], qseg_ref[qs], kseg, start_k, block_k)
            lse2 = lse_ref[g, qs] * LOG2E
            p = jnp.where(mask, jnp.exp2(_dot(q, k.T) * qk_scale - lse2[:, None]), 0.0)
            dv = dv + _dot(p.astype(do.dtype).T, do)
            ds = p * (_dot(do, v.T) - delta_ref[g, qs][:, None])
            return dk + _dot(ds.astype(q.dtype).T, q), dv

        dk, dv = lax.fori_loop(lo, hi, body, (dk, dv))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ------------------------------------------------------------------ wrappers (padding, specs)



def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _padded(q, k, v, limit, q_seg, k_seg, block_q, block_k):
    """Inputs padded to whole tiles and a power-of-two head size (≥ 16, Triton's dot)."""
    R, S, H = q.shape[1], k.shape[1], q.shape[3]
    Rp, Sp, Hp = -(-R // block_q) * block_q, -(-S // block_k) * block_k, max(16, next_pow2(H))
    q, k, v = (_pad_axis(_pad_axis(x, 1, n), 3, Hp) for x, n in ((q, Rp), (k, Sp), (v, Sp)))
    return (q, k, v, _pad_axis(limit.astype(jnp.int32), 1, Rp),
            _pad_axis(q_seg.astype(jnp.int32), 1, Rp), _pad_axis(k_seg.astype(jnp.int32), 1, Sp))


def _check(q, k, v, limit, q_seg, k_seg):
    B, R, N, H = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != H:
        raise ValueError(f"k, v must be [B, S, Kh, H] matching q {q.shape}: {k.shape}, {v.shape}")
    if N % k.shape[2]:
        raise ValueError(f"{N} query heads do not group over {k.shape[2]} key heads")
    for name, x, want in (("limit", limit, (B, R)), ("q_seg", q_seg, (B, R)),
                          ("k_seg", k_seg, (B, k.shape[1]))):
        if x.shape != want:
            raise ValueError(f"{name} must be {want}, got {x.shape}")


def _row_tile_specs(block_q: int, Sp: int, Hp: int, G: int) -> dict[str, pl.BlockSpec]:
    """Block specs of the forward and dq grids (batch, query head, row tile): a row tile of
    [B, R, N, H] arrays, the whole context of the head's key head, a row tile of [B, R] and
    [B, N, R] arrays, the key segments."""
    return dict(
        q_tile=pl.BlockSpec((None, block_q, None, Hp), lambda b, n, i: (b, i, n, 0)),
        kv_all=pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
        rows=pl.BlockSpec((None, block_q), lambda b, n, i: (b, i)),
        head_rows=pl.BlockSpec((None, None, block_q), lambda b, n, i: (b, n, i)),
        keys=pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0)))


def _compiler_params(interpret: bool, num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plgpu

    return None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "interpret",
                                             "num_warps", "num_stages"))
def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, limit: jax.Array,
                      q_seg: jax.Array, k_seg: jax.Array, *, scale: float,
                      block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
                      interpret: bool = False, num_warps: int = DEFAULT_NUM_WARPS,
                      num_stages: int = DEFAULT_NUM_STAGES) -> tuple[jax.Array, jax.Array]:
    """(o [B, R, N, H] f32 normalised over the visible context keys, lse [B, N, R] f32)."""
    _check(q, k, v, limit, q_seg, k_seg)
    B, R, N, H = q.shape
    qp, kp, vp, lim, qseg, kseg = _padded(q, k, v, limit, q_seg, k_seg, block_q, block_k)
    Rp, Sp, Hp = qp.shape[1], kp.shape[1], qp.shape[3]
    sp = _row_tile_specs(block_q, Sp, Hp, N // k.shape[2])
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, qk_scale=scale * LOG2E, block_k=block_k),
        grid=(B, N, Rp // block_q),
        in_specs=[sp["q_tile"], sp["kv_all"], sp["kv_all"], sp["rows"], sp["rows"], sp["keys"]],
        out_specs=[sp["q_tile"], sp["head_rows"]],
        out_shape=[jax.ShapeDtypeStruct((B, Rp, N, Hp), jnp.float32),
                   jax.ShapeDtypeStruct((B, N, Rp), jnp.float32)],
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        interpret=interpret, name="context_attention_fwd",
    )(qp, kp, vp, lim, qseg, kseg)
    return o[:, :R, :, :H], lse[:, :, :R]


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "interpret",
                                             "num_warps", "num_stages"))
def context_attention_bwd(q: jax.Array, k: jax.Array, v: jax.Array, limit: jax.Array,
                          q_seg: jax.Array, k_seg: jax.Array, do: jax.Array, lse: jax.Array,
                          delta: jax.Array, *, scale: float, block_q: int = DEFAULT_BLOCK_Q,
                          block_k: int = DEFAULT_BLOCK_K, interpret: bool = False,
                          num_warps: int = DEFAULT_NUM_WARPS,
                          num_stages: int = DEFAULT_NUM_STAGES
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq [B, R, N, H], dk, dv [B, S, Kh, H] (the inputs' dtypes) of the context part of a
    softmax whose (merged) log-sum-exp is `lse` [B, N, R] and whose output O has
    delta = rowsum(dO · O) [B, N, R]; `do` [B, R, N, H] is dO."""
    _check(q, k, v, limit, q_seg, k_seg)
    B, R, N, H = q.shape
    Kh = k.shape[2]
    G = N // Kh
    qp, kp, vp, lim, qseg, kseg = _padded(q, k, v, limit, q_seg, k_seg, block_q, block_k)
    Rp, Sp, Hp = qp.shape[1], kp.shape[1], qp.shape[3]
    dop = _pad_axis(_pad_axis(do.astype(q.dtype), 1, Rp), 3, Hp)
    lse_p = _pad_axis(jnp.where(jnp.isfinite(lse), lse, 0.0).astype(jnp.float32), 2, Rp)
    delta_p = _pad_axis(delta.astype(jnp.float32), 2, Rp)
    n_q = Rp // block_q
    tile_max = _pad_axis(jnp.max(lim.reshape(B, n_q, block_q), axis=2), 1, next_pow2(n_q))
    params = _compiler_params(interpret, num_warps, num_stages)
    qk = dict(qk_scale=scale * LOG2E, scale=scale)

    sp = _row_tile_specs(block_q, Sp, Hp, G)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_k=block_k, **qk),
        grid=(B, N, n_q),
        in_specs=[sp["q_tile"], sp["kv_all"], sp["kv_all"], sp["rows"], sp["rows"], sp["keys"],
                  sp["q_tile"], sp["head_rows"], sp["head_rows"]],
        out_specs=sp["q_tile"], out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params, interpret=interpret, name="context_attention_dq",
    )(qp, kp, vp, lim, qseg, kseg, dop, lse_p, delta_p)

    q_group = pl.BlockSpec((None, Rp, G, Hp), lambda b, h, j: (b, 0, h, 0))
    kv_tile = pl.BlockSpec((None, block_k, None, Hp), lambda b, h, j: (b, j, h, 0))
    group_rows = pl.BlockSpec((None, G, Rp), lambda b, h, j: (b, h, 0))
    all_rows = pl.BlockSpec((None, Rp), lambda b, h, j: (b, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, block_q=block_q, groups=G, **qk),
        grid=(B, Kh, Sp // block_k),
        in_specs=[q_group, kv_tile, kv_tile, all_rows, all_rows,
                  pl.BlockSpec((None, block_k), lambda b, h, j: (b, j)), q_group, group_rows,
                  group_rows, pl.BlockSpec((None, tile_max.shape[1]), lambda b, h, j: (b, 0))],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype),
                   jax.ShapeDtypeStruct(vp.shape, v.dtype)],
        compiler_params=params, interpret=interpret, name="context_attention_dkv",
    )(qp, kp, vp, lim, qseg, kseg, dop, lse_p, delta_p, tile_max)
    S = k.shape[1]
    return dq[:, :R, :, :H], dk[:, :S, :, :H], dv[:, :S, :, :H]


def ref_context_attention(q: jax.Array, k: jax.Array, v: jax.Array, limit: jax.Array,
                          q_seg: jax.Array, k_seg: jax.Array, *, scale: float
                          ) -> tuple[jax.Array, jax.Array]:
    """The oracle: the same (o, lse) with every score materialised."""
    _check(q, k, v, limit, q_seg, k_seg)
    B, R, N, H = q.shape
    G = N // k.shape[2]
    kk = jnp.repeat(k, G, axis=2).astype(jnp.float32)
    vv = jnp.repeat(v, G, axis=2).astype(jnp.float32)
    s = jnp.einsum("brnh,bsnh->bnrs", q.astype(jnp.float32), kk) * scale
    span = jnp.arange(k.shape[1])
    mask = (span[None, None, :] < limit[:, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])
    s = jnp.where(mask[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)                                       # [B, N, R]
    p = jnp.where(mask[:, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]),
                  0.0)
    return jnp.einsum("bnrs,bsnh->brnh", p, vv), lse
