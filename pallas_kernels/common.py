"""Conventions shared by the kernels and their oracles: sampling (SPEC §1 step 3), the tile
arithmetic of the Triton attention kernels, and their masked row loads (`load_rows`, called
inside a Triton kernel).

Pure JAX, nothing from dspark_jax: the kernels stand alone. Every categorical draw is an
inverse-CDF search with one explicit uniform, so a kernel and its `ref_<op>` consume the same
randomness and must return the same token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["GREEDY_T_EPS", "LOG2E", "MASKED_SCORE", "inverse_cdf_from_tiles",
           "inverse_cdf_sample", "inverse_cdf_sample_tiled", "load_rows", "next_pow2",
           "normed_rotated", "prefix_sums", "probs_from_logits", "ref_rotate_half", "tile_sums",
           "tile_width"]

#: A finite "minus infinity" for masked scores: a running maximum stays finite (no inf − inf).
MASKED_SCORE = -0.7 * float(jnp.finfo(jnp.float32).max)
#: log2(e): scores taken in base 2 (exp2) with the softmax scale folded in.
LOG2E = math.log2(math.e)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (Triton's tiles are powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


def load_rows(ref, n: int, rows: int, cols=slice(None), part: int | None = None
              ) -> jax.Array:
    """Inside a Triton kernel: the first `rows` rows of a [n, …] ref (of its `part`, a
    [parts, n, …] ref's), columns `cols`, as a tile whose rows past n are zeros (a block of a
    power-of-two height over fewer rows)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    ok = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < n
    at = (pl.ds(0, rows), cols) if part is None else (jnp.int32(part), pl.ds(0, rows), cols)
    return plgpu.load(ref.at[at], mask=ok, other=0)


def ref_rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The oracles' rotate-half RoPE: x [..., H] in f32 by cos / sin broadcasting against
    [..., H/2], back in x's dtype (Hugging Face's arithmetic)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def normed_rotated(x1, x2, w_ref, cos, sin, *, eps: float, normed: bool, dtype):
    """Inside a Triton kernel: rows [M, H] given as halves x1, x2 (f32): RMS-normed by `w_ref`
    [H] (unless not `normed`), cast to `dtype` before the scale as Hugging Face does, then
    rotated by cos / sin [M, H/2] (rotate-half RoPE) and cast to `dtype`: the halves, in
    `dtype`."""
    from jax import lax
    from jax.experimental import pallas as pl

    h2 = x1.shape[1]
    if normed:
        r = lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / (2 * h2) + eps)
        w1 = w_ref[pl.ds(0, h2)].astype(dtype).astype(jnp.float32)
        w2 = w_ref[pl.ds(h2, h2)].astype(dtype).astype(jnp.float32)
        x1 = (w1[None, :] * (x1 * r[:, None]).astype(dtype).astype(jnp.float32)).astype(dtype)
        x2 = (w2[None, :] * (x2 * r[:, None]).astype(dtype).astype(jnp.float32)).astype(dtype)
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)


#: Temperatures are floored at this value before dividing (T ≤ 0 means greedy one-hot).
GREEDY_T_EPS = 1e-6


def probs_from_logits(logits: jax.Array, temperature: jax.Array | float) -> jax.Array:
    """softmax(logits / T) in f32 over the last axis; T ≤ 0 → one-hot of the first argmax."""
    logits = logits.astype(jnp.float32)
    t = jnp.asarray(temperature, jnp.float32)
    soft = jax.nn.softmax(logits / jnp.maximum(t, GREEDY_T_EPS), axis=-1)
    hard = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(t > 0, soft, hard)


def inverse_cdf_sample(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Index i with cdf[i−1] ≤ u·total < cdf[i]: weights [..., V] ≥ 0 (unnormalised), u [...].

    Clamped to the last index with positive weight (a rounding slip at the top of the CDF never
    returns a zero-weight or padded token); an all-zero row returns 0.
    """
    w = weights.astype(jnp.float32)
    cdf = jnp.cumsum(w, axis=-1)                                             # [..., V]
    thr = u.astype(jnp.float32) * cdf[..., -1]                               # [...]
    count = jnp.sum((cdf <= thr[..., None]).astype(jnp.int32), axis=-1)
    idx = jax.lax.broadcasted_iota(jnp.int32, w.shape, w.ndim - 1)
    last_pos = jnp.max(jnp.where(w > 0, idx, 0), axis=-1)
    return jnp.minimum(count, last_pos).astype(jnp.int32)


# ------------------------------------------------------------------------------ tiled inverse CDF
# The inverse CDF of a long row (the vocabulary) in tiles, as the verify kernel walks it: tile
# sums, a prefix over the tiles, then a prefix within the one tile the draw falls in. Each
# prefix is one masked reduction (no scan): compiled by XLA, the search is a few kernels, where
# a cumulative sum over V is a tree of them.

def tile_width(vocab: int) -> int:
    """The tile of the tiled search: the multiple of 128 at or above √V, at most V (both
    prefixes then cost about V·√V additions, each a single reduction)."""
    return min(int(vocab), 128 * max(1, math.ceil(math.sqrt(vocab) / 128)))


def _tiles(w: jax.Array, block: int) -> jax.Array:
    """w [..., V] zero-padded to whole tiles: [..., V / block, block]."""
    pad = -w.shape[-1] % block
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)])
    return w.reshape(w.shape[:-1] + (w.shape[-1] // block, block))


def tile_sums(w: jax.Array, block: int) -> jax.Array:
    """Sums of w [..., V] over tiles of `block` (the last zero-padded): [..., ⌈V / block⌉]."""
    return jnp.sum(_tiles(w.astype(jnp.float32), block), axis=-1)


def prefix_sums(x: jax.Array) -> jax.Array:
    """Inclusive prefix sums over the last axis (short: n² work) as one masked reduction.
    Entry i sums x[:i+1] and zeros in one fixed order, so for x ≥ 0 the sums never decrease
    and a zero entry repeats its predecessor exactly."""
    n = x.shape[-1]
    lower = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]                # [i, k]: k ≤ i
    return jnp.sum(jnp.where(lower, x[..., None, :], 0.0), axis=-1)


def _steps_below(cdf: jax.Array, thr: jax.Array) -> jax.Array:
    """#{i : cdf[i] ≤ thr, cdf[i] < cdf[-1]}: for a non-decreasing cdf, the index of its first
    step above thr, never past its last step (a positive weight)."""
    return jnp.sum((cdf <= thr[..., None]) & (cdf < cdf[..., -1:]), axis=-1).astype(jnp.int32)


def inverse_cdf_from_tiles(weights: jax.Array, tile_cdf: jax.Array, u: jax.Array,
                           block: int) -> jax.Array:
    """`inverse_cdf_sample` of weights [..., V] ≥ 0 given the `prefix_sums` of their
    `tile_sums` [..., ⌈V / block⌉]: the tile whose step crosses u·total, then the index within
    it. It lands on a positive weight (an all-zero row: 0) and equals the untiled search but
    for a u·total within f32 rounding of a CDF step."""
    thr = u.astype(jnp.float32) * tile_cdf[..., -1]                          # [...]
    j = _steps_below(tile_cdf, thr)                                          # [...] its tile
    tile = jnp.take_along_axis(_tiles(weights.astype(jnp.float32), block),
                               j[..., None, None], axis=-2)[..., 0, :]      # [..., block]
    # the CDF within the tile, from the mass of the tiles before it (≤ u·total: tile j − 1's
    # step is below it), so a zero weight repeats the step before it and is never chosen
    before = jnp.take_along_axis(tile_cdf, jnp.maximum(j - 1, 0)[..., None], axis=-1)
    before = jnp.where(j[..., None] > 0, before, 0.0)                        # [..., 1]
    cdf = prefix_sums(jnp.concatenate([before, tile], axis=-1))[..., 1:]     # [..., block]
    # the tile's offset is summed with its steps: one reduction gives the index
    steps = ((cdf <= thr[..., None]) & (cdf < cdf[..., -1:])).astype(jnp.int32)
    return jnp.sum(jnp.concatenate([steps, (j * block)[..., None]], axis=-1), axis=-1)


def inverse_cdf_sample_tiled(weights: jax.Array, u: jax.Array) -> jax.Array:
    """`inverse_cdf_sample` by the tiled search (`inverse_cdf_from_tiles`)."""
    block = tile_width(weights.shape[-1])
    return inverse_cdf_from_tiles(weights, prefix_sums(tile_sums(weights, block)), u, block)
