"""One categorical draw per row of probabilities, by inverse CDF with an explicit uniform, in two
Triton kernels spread over the vocabulary (SPEC §1 steps 1 and 3: the drafter's draws, chain
step by chain step, and the first token after a prefill).

XLA compiles `inverse_cdf_sample` into a tree of kernels a draw (the cumulative sum over V) and
the tiled search (`inverse_cdf_sample_tiled`) into seven; for a chain drafter that draws γ times
a round, those launches cost more than the bytes they read. Here a draw is:

  `row_tiles`  grid (row blocks, V tiles): each tile's mass Σ w, for every row.
  `row_pick`   grid (rows): u·Σ located among the tiles' prefix sums, skipping trailing zero
               tiles, then inside the chosen tile (its weights re-read) the count of CDF steps
               at or below it, never past the tile's last positive weight.

The search lands on a positive weight whatever the rounding (a zero weight repeats the step
before it); an all-zero row returns 0. Oracle: `inverse_cdf_sample` (the same index, barring a
u·Σ within f32 rounding of a CDF step: the sums run by tile). Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import next_pow2

__all__ = ["DEFAULT_BLOCK_V", "MAX_TILE_ELEMS", "row_sample"]

# the vocabulary tile (a power of two): at Qwen3's 151,936 ids, 149 tiles, so `row_pick` walks
# 256 tile sums and one tile of 1024 weights, and `row_tiles` spreads over the chip even for
# one row. Untuned (written without a GPU), as the verification kernel's tile.
DEFAULT_BLOCK_V = 1024
# elements a `row_tiles` program loads at once (rows × tile), kept in registers with 4 warps
MAX_TILE_ELEMS = 16 * 1024


def _tiles_kernel(w_ref, sums_ref, *, rows: int, block_r: int, vocab: int, block_v: int):
    """The mass of one vocabulary tile for one block of rows."""
    from jax.experimental.pallas import triton as plgpu

    r, i = pl.program_id(0), pl.program_id(1)
    r_iota = r * block_r + lax.broadcasted_iota(jnp.int32, (block_r, 1), 0)
    c_iota = i * block_v + lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    ok = (r_iota < rows) & (c_iota < vocab)
    w = plgpu.load(w_ref.at[pl.ds(r * block_r, block_r), pl.ds(i * block_v, block_v)],
                   mask=ok, other=0)
    s = jnp.sum(w.astype(jnp.float32), axis=1)                               # [block_r]
    plgpu.store(sums_ref.at[pl.ds(r * block_r, block_r), i], s, mask=r_iota[:, 0] < rows)


def _pick_kernel(w_ref, sums_ref, u_ref, idx_ref, *, vocab: int, block_v: int, tiles: int):
    """Row b's index from its tiles' masses and, inside the chosen tile, its weights."""
    from jax.experimental.pallas import triton as plgpu

    b = pl.program_id(0)
    tp = next_pow2(tiles)
    t_iota = lax.broadcasted_iota(jnp.int32, (tp,), 0)
    sums = plgpu.load(sums_ref.at[b, pl.ds(0, tp)], mask=t_iota < tiles, other=0.0)
    cdf = jnp.cumsum(sums)                                                   # [tp]
    total = jnp.max(cdf)                 # the last step: the weights are ≥ 0
    thr = u_ref[b] * total
    # the tile whose step crosses u·Σ: steps at or below it, the last (trailing zeros) excluded
    j = jnp.sum(((cdf <= thr) & (cdf < total)).astype(jnp.int32))
    before = jnp.sum(jnp.where(t_iota == j - 1, cdf, 0.0))                   # ≤ u·Σ
    c_iota = lax.broadcasted_iota(jnp.int32, (block_v,), 0)
    idx = j * block_v + c_iota
    w = plgpu.load(w_ref.at[b, pl.ds(j * block_v, block_v)], mask=idx < vocab, other=0)
    # the CDF within the tile from the mass before it, so a zero weight repeats its step
    local = jnp.cumsum(jnp.where(c_iota == 0, before, 0.0) + w.astype(jnp.float32))
    steps = (local <= thr) & (local < jnp.max(local))
    idx_ref[b] = j * block_v + jnp.sum(steps.astype(jnp.int32))


def _params(interpret: bool, num_warps: int):
    from jax.experimental.pallas import triton as plgpu

    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


@functools.partial(jax.jit, static_argnames=("block_v", "interpret", "num_warps"))
def row_sample(weights: jax.Array, u: jax.Array, *, block_v: int = DEFAULT_BLOCK_V,
               interpret: bool = False, num_warps: int = 4) -> jax.Array:
    """`inverse_cdf_sample` in two Triton kernels (module doc): weights [..., V] ≥ 0
    (unnormalised, any float dtype, read where they lie), u [...] in [0, 1) → int32 [...].
    `block_v`: the vocabulary tile, a power of two ≥ 16; `interpret` runs the kernels on any
    device (tests)."""
    if weights.ndim < 1 or u.shape != weights.shape[:-1]:
        raise ValueError(f"weights [..., V] and u [...] must share their leading shape, got "
                         f"{weights.shape} and {u.shape}")
    if block_v < 16 or block_v != next_pow2(block_v):
        raise ValueError(f"block_v must be a power of two ≥ 16, got {block_v}")
    lead, V = weights.shape[:-1], weights.shape[-1]
    w = weights.reshape(-1, V)
    N = w.shape[0]
    if N == 0 or V == 0:
        return jnp.zeros(lead, jnp.int32)
    block_v = min(block_v, next_pow2(V))
    tiles = pl.cdiv(V, block_v)
    block_r = max(1, min(next_pow2(N), MAX_TILE_ELEMS // block_v))
    sums = pl.pallas_call(
        functools.partial(_tiles_kernel, rows=N, block_r=block_r, vocab=V, block_v=block_v),
        grid=(pl.cdiv(N, block_r), tiles),
        out_shape=jax.ShapeDtypeStruct((N, tiles), jnp.float32),
        compiler_params=_params(interpret, num_warps), interpret=interpret,
        name="row_tiles")(w)
    idx = pl.pallas_call(
        functools.partial(_pick_kernel, vocab=V, block_v=block_v, tiles=tiles),
        grid=(N,), out_shape=jax.ShapeDtypeStruct((N,), jnp.int32),
        compiler_params=_params(interpret, num_warps), interpret=interpret,
        name="row_pick")(w, sums, u.reshape(N).astype(jnp.float32))
    return idx.reshape(lead)
