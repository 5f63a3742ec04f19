"""The children of a draft tree's frontier, greedy, without their vocabulary-wide logits in HBM
(Triton). Oracle: `ref_top_children` (same arguments, same result up to f32 summation order).

Growing a draft tree (docs/TREES.md §2) takes, at every depth, the `c` most likely children of
each of F frontier nodes of each of R requests, and the softmax mass of each rank. A node's
children's logits are the request's base logits at that depth U [V] plus the sequential head's
low-rank bias z·W2ᵀ (z [r] the node's rank-r projection of its token and state, W2 [V, r]).
XLA materialises those logits, [R, F, V] in f32 (2.5 GB at R = F = 64 and Qwen3's vocabulary),
then reads them back for the top-c, the maximum and the sum of exponentials: four passes a
depth. Here one kernel reads U and W2 and writes only its partials:

  `top_children`  grid (vocabulary chunks, R, frontier blocks): a program walks its chunk's
                  tiles for a block of one request's frontier rows, keeps each row's running
                  top-c (values and ids, ties to the lower id, as `lax.top_k`) and its online
                  log-sum-exp, and stores them per chunk; XLA merges the chunks (a top-c of
                  chunks·c candidates a row). A tile is merged into the running top-c only
                  when one of its rows' maxima beats that row's c-th value, so past the first
                  tiles most are only a dot and a few reductions. The programs of one chunk
                  are adjacent in the grid, so its W2 tile is read from HBM about once.

Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import MASKED_SCORE, next_pow2

__all__ = ["ref_top_children", "top_children"]

# bytes of W2 a program holds for one tile's dot (an H100 / H200 SM has 228 KB of shared memory)
TILE_BYTES = 64 * 1024
# programs to aim for: about two per multiprocessor of an H100 / H200 (132)
TARGET_PROGRAMS = 256
_BIG = 2 ** 30


def _check(u: jax.Array, z: jax.Array, w2: jax.Array, c: int) -> tuple[int, int, int, int]:
    if u.ndim != 2 or z.ndim != 3 or w2.ndim != 2:
        raise ValueError(f"u must be [R, V], z [R, F, r], w2 [V, r]: {u.shape}, {z.shape}, "
                         f"{w2.shape}")
    R, V = u.shape
    if z.shape[0] != R or w2.shape != (V, z.shape[2]):
        raise ValueError(f"z {z.shape} and w2 {w2.shape} do not match u {u.shape}")
    if not 1 <= c <= V:
        raise ValueError(f"c = {c} children of a {V}-token vocabulary")
    return R, z.shape[1], V, z.shape[2]


def _merge_top(val, ids, x, cols, c: int):
    """The top-c of a row's running (val, ids) [rows, C] and a tile's scores x [rows, BV] at ids
    `cols` [1, BV]: c rounds of taking the larger head, ties to the lower id (the running
    entries, from earlier tiles, come first)."""
    slot = lax.broadcasted_iota(jnp.int32, val.shape, 1)
    new_val = jnp.full(val.shape, MASKED_SCORE, jnp.float32)
    new_ids = jnp.full(ids.shape, _BIG, jnp.int32)
    for i in range(c):
        best_run, best_x = jnp.max(val, axis=1), jnp.max(x, axis=1)
        run_id = jnp.min(jnp.where(val == best_run[:, None], ids, _BIG), axis=1)
        x_id = jnp.min(jnp.where(x == best_x[:, None], cols, _BIG), axis=1)
        from_run = best_run >= best_x
        pick_val = jnp.where(from_run, best_run, best_x)
        pick_id = jnp.where(from_run, run_id, x_id)
        new_val = jnp.where(slot == i, pick_val[:, None], new_val)
        new_ids = jnp.where(slot == i, pick_id[:, None], new_ids)
        val = jnp.where(from_run[:, None] & (ids == run_id[:, None]), MASKED_SCORE, val)
        x = jnp.where(~from_run[:, None] & (cols == x_id[:, None]), MASKED_SCORE, x)
    return new_val, new_ids


def _kernel(u_ref, z_ref, w2_ref, val_ref, ids_ref, m_ref, s_ref, *, rows: int, frontier: int,
            vocab: int, rank: int, block_v: int, tiles: int, c: int, width: int):
    """Chunk `program_id(0)` of the vocabulary for rows [f·rows, (f + 1)·rows) of request
    `program_id(1)`'s frontier."""
    from jax.experimental.pallas import triton as plgpu

    chunk, b, f = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rp = next_pow2(max(rank, 16))
    row_ok = f * rows + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < frontier
    rank_ok = lax.broadcasted_iota(jnp.int32, (1, rp), 1) < rank
    z = plgpu.load(z_ref.at[b, pl.ds(f * rows, rows), pl.ds(0, rp)], mask=row_ok & rank_ok,
                   other=0)
    exact = w2_ref.dtype == jnp.float32
    c_iota = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    slot_ok = lax.broadcasted_iota(jnp.int32, (1, width), 1) < c
    v_iota = lax.broadcasted_iota(jnp.int32, (block_v, 1), 0)

    def tile(t, carry):
        val, ids, m, s = carry
        first = (chunk * tiles + t) * block_v
        cols = first + c_iota                                                # [1, BV]
        col_ok = cols < vocab
        w2 = plgpu.load(w2_ref.at[pl.ds(first, block_v), pl.ds(0, rp)],
                        mask=(first + v_iota < vocab) & rank_ok, other=0)
        bias = lax.dot_general(z, w2, (((1,), (1,)), ((), ())),
                               precision=lax.Precision.HIGHEST if exact else None,
                               preferred_element_type=jnp.float32)           # [rows, BV]
        u = plgpu.load(u_ref.at[b, pl.ds(first, block_v)], mask=col_ok[0], other=0)
        x = jnp.where(col_ok, u.astype(jnp.float32)[None, :] + bias, MASKED_SCORE)
        top = jnp.max(x, axis=1)
        m_new = jnp.maximum(m, top)
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.where(col_ok, jnp.exp(x - m_new[:, None]),
                                                       0.0), axis=1)
        kth = jnp.min(jnp.where(slot_ok, val, -MASKED_SCORE), axis=1)       # the c-th value
        beats = jnp.max(jnp.where(row_ok[:, 0], top - kth, -1.0)) > 0
        val, ids = lax.cond(beats, lambda: _merge_top(val, ids, x, cols, c), lambda: (val, ids))
        return val, ids, m_new, s

    init = (jnp.full((rows, width), MASKED_SCORE, jnp.float32),
            jnp.full((rows, width), _BIG, jnp.int32),
            jnp.full((rows,), MASKED_SCORE, jnp.float32), jnp.zeros((rows,), jnp.float32))
    n_tiles = jnp.clip(pl.cdiv(vocab, block_v) - chunk * tiles, 0, tiles)
    val, ids, m, s = lax.fori_loop(0, n_tiles, tile, init)
    one = row_ok[:, 0]
    plgpu.store(val_ref.at[b, pl.ds(f * rows, rows), chunk, pl.ds(0, width)], val,
                mask=row_ok)
    plgpu.store(ids_ref.at[b, pl.ds(f * rows, rows), chunk, pl.ds(0, width)], ids,
                mask=row_ok)
    plgpu.store(m_ref.at[b, pl.ds(f * rows, rows), chunk], m, mask=one)
    plgpu.store(s_ref.at[b, pl.ds(f * rows, rows), chunk], s, mask=one)


def _tiling(R: int, F: int, V: int, r: int, itemsize: int, block_v: int | None,
            chunks: int | None) -> tuple[int, int, int, int]:
    """(rows a program, vocabulary tile, tiles a chunk, chunks)."""
    rows = max(16, min(64, next_pow2(F)))
    if block_v is None:   # a power of two in [16, 512] whose W2 tile fits TILE_BYTES
        rp = next_pow2(max(r, 16))
        block_v = max(16, min(512, 1 << (TILE_BYTES // (rp * itemsize)).bit_length() - 1))
    if block_v < 16 or block_v != next_pow2(block_v):
        raise ValueError(f"block_v must be a power of two ≥ 16, got {block_v}")
    n_tiles = pl.cdiv(V, block_v)
    if chunks is None:
        chunks = pl.cdiv(TARGET_PROGRAMS, R * pl.cdiv(F, rows))
    chunks = max(1, min(int(chunks), n_tiles))
    tiles = pl.cdiv(n_tiles, chunks)
    return rows, block_v, tiles, pl.cdiv(n_tiles, tiles)


@functools.partial(jax.jit, static_argnames=("c", "block_v", "chunks", "interpret",
                                             "num_warps"))
def top_children(u: jax.Array, z: jax.Array, w2: jax.Array, *, c: int,
                 block_v: int | None = None, chunks: int | None = None,
                 interpret: bool = False, num_warps: int = 4
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Of every row's logits x = u[R] + z[R, F]·W2ᵀ (u [R, V], z [R, F, r], w2 [V, r]; never
    stored): (the c largest values [R, F, c] f32, descending, and their ids [R, F, c] int32, ties
    to the lower id, as `lax.top_k`; log Σ exp x [R, F] f32). `block_v`: the vocabulary tile,
    `chunks`: vocabulary chunks the grid spreads (defaults fill a GPU); `interpret` runs the
    kernel on any device (tests)."""
    R, F, V, r = _check(u, z, w2, c)
    rows, block_v, tiles, n_chunks = _tiling(R, F, V, r, w2.dtype.itemsize, block_v, chunks)
    width = max(16, next_pow2(c))
    part = lambda *tail, dt: jax.ShapeDtypeStruct((R, F, n_chunks) + tail, dt)  # noqa: E731
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    val, ids, m, s = pl.pallas_call(
        functools.partial(_kernel, rows=rows, frontier=F, vocab=V, rank=r, block_v=block_v,
                          tiles=tiles, c=c, width=width),
        grid=(n_chunks, R, pl.cdiv(F, rows)),
        out_shape=[part(width, dt=jnp.float32), part(width, dt=jnp.int32),
                   part(dt=jnp.float32), part(dt=jnp.float32)],
        compiler_params=params, interpret=interpret, name="tree_top_children",
    )(u, z.astype(w2.dtype), w2)
    top = jnp.max(m, axis=-1)
    lse = top + jnp.log(jnp.sum(s * jnp.exp(m - top[..., None]), axis=-1))
    best, at = lax.top_k(val.reshape(R, F, n_chunks * width), c)   # chunk order = id order
    return best, jnp.take_along_axis(ids.reshape(R, F, n_chunks * width), at, axis=-1), lse


def ref_top_children(u: jax.Array, z: jax.Array, w2: jax.Array, *, c: int
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The oracle: the logits materialised, then `lax.top_k` and the log-sum-exp."""
    _check(u, z, w2, c)
    x = u.astype(jnp.float32)[:, None] + jnp.einsum(
        "RFr,Vr->RFV", z.astype(w2.dtype), w2, preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST)
    best, ids = lax.top_k(x, c)
    return best, ids.astype(jnp.int32), jax.nn.logsumexp(x, axis=-1)
