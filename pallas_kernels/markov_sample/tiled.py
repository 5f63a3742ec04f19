"""DSpark's vanilla Markov head sampled across the whole GPU: two Triton kernels a draft slot
(SPEC §3, paper §3.2). Oracle: `ref_markov_sample` (same arguments, same result).

While decoding a few requests, one slot's work is one pass over W2 [V, r] (about 78 MB at
Qwen3's vocabulary and r = 256), and the slots are sequential: slot k's bias needs the token
sampled at slot k−1. `markov_sample` walks all γ slots inside one program per block of rows,
so at a few requests one program streams W2 γ times while the chip idles; XLA's ops take
about forty kernels a slot (the bias GEMM, the softmax's reductions, the prefix sum of the
inverse-CDF draw, ...). Here each slot is:

  `markov_tiles`  grid (V tiles): for every row, the logits of one vocabulary tile,
                  U_k + W1[x_{k−1}]·W2ᵀ, stored for the pick, with the tile's softmax
                  partials (max and sum of exp(logits / T)) and its first argmax. The previous
                  tokens x_{k−1} [B] (the anchor at slot 0, else column k−1 of the tokens
                  the picks write) come in as an operand, clamped into [0, V − 1]; each
                  program gathers the rows W1[x_{k−1}] itself with one masked load (rows past
                  B and columns past r masked); W1 and W2 are read in place and masked at the
                  edges.
  `markov_pick`   grid (rows): the tiles' partials merged, u·Σ located among the tiles' sums,
                  then inside the chosen tile (its logits re-read): the inverse-CDF draw with
                  the given uniform, as `inverse_cdf_sample` takes it, or the first argmax for
                  T ≤ 0; the token and log Σ stored in column k of the draft's [B, γ] tokens
                  and log Σ, which every pick after the first writes in place (its outputs
                  aliased to the previous pick's), so no stack copies them.

The probabilities the draft reports, softmax(logits / T) a slot (one-hot at T ≤ 0), are taken
from the stored logits and log Σ after the last slot by XLA (one elementwise pass). Same
uniforms → the oracle's tokens, barring f32 rounding at a CDF step (the sums run by tile).
Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import GREEDY_T_EPS, MASKED_SCORE, next_pow2
from pallas_kernels.markov_sample.kernel import check_markov_inputs

__all__ = ["TILE_BYTES", "markov_sample_tiled", "tiled_block_v"]

# bytes of W2 a `markov_tiles` program holds for its dot (shared memory: an H100 / H200 SM has
# 228 KB); at Qwen3's vocabulary and r = 256 in bf16, 128-id tiles: ~1200 programs
TILE_BYTES = 64 * 1024
_BIG = 2 ** 30


def tiled_block_v(rank: int, itemsize: int) -> int:
    """The vocabulary tile: a power of two in [16, 512] whose W2 tile fits `TILE_BYTES`."""
    rp = next_pow2(max(rank, 16))
    return max(16, min(512, 1 << (TILE_BYTES // (rp * itemsize)).bit_length() - 1))


def _tiles_kernel(prev_ref, w1_ref, logit_ref, w2_ref, temp_ref,           # inputs
                  x_ref, m_ref, s_ref, best_ref, arg_ref,                    # outputs
                  *, rows: int, batch: int, vocab: int, rank: int, block_v: int, slot: int):
    """One vocabulary tile for every row (`rows` ≥ 16, the rows past `batch` masked); the
    previous tokens are the anchors [B] at slot 0, else column slot − 1 of the tokens
    [B, γ]."""
    from jax.experimental.pallas import triton as plgpu

    i = pl.program_id(0)
    rp = next_pow2(max(rank, 16))
    r_iota = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    c_iota = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    k_iota = lax.broadcasted_iota(jnp.int32, (1, rp), 1)
    row_ok, rank_ok = r_iota < batch, k_iota < rank
    idx = i * block_v + c_iota                                               # [1, BV]
    col_ok = idx < vocab
    one = r_iota[:, 0] < batch
    # the previous tokens (rows past `batch` masked to 0), clamped into the vocabulary; then
    # W1's rows gathered with one [rows, rp] pair of index arrays (row: the token, column:
    # 0..rp−1), rows past `batch` and columns past r masked
    prev_at = ((pl.ds(0, rows),) if slot == 0
               else (pl.ds(0, rows), jnp.asarray(slot - 1, jnp.int32)))
    prev = plgpu.load(prev_ref.at[prev_at], mask=one, other=0)
    prev = jnp.clip(prev, 0, vocab - 1)[:, None]                             # [rows, 1]
    e = plgpu.load(w1_ref.at[jnp.broadcast_to(prev, (rows, rp)),
                             jnp.broadcast_to(k_iota, (rows, rp))],
                   mask=row_ok & rank_ok, other=0)                           # [rows, rp]
    v_rows = i * block_v + lax.broadcasted_iota(jnp.int32, (block_v, 1), 0)
    w2 = plgpu.load(w2_ref.at[pl.ds(i * block_v, block_v), pl.ds(0, rp)],
                    mask=(v_rows < vocab) & rank_ok, other=0)
    # W1's rows and W2 in their own dtype: bf16 products are exact in the f32 accumulator, as
    # the oracle's f32 dot of the upcast values; f32 weights multiply at full precision
    exact = w2.dtype == jnp.float32
    bias = lax.dot_general(e, w2, (((1,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST if exact else None,
                           preferred_element_type=jnp.float32)
    k = jnp.asarray(slot, jnp.int32)   # an index of the ref, not a static slice
    u = plgpu.load(logit_ref.at[pl.ds(0, rows), k, pl.ds(i * block_v, block_v)],
                   mask=row_ok & col_ok, other=0)
    ok = row_ok & col_ok
    x = jnp.where(ok, u.astype(jnp.float32) + bias, MASKED_SCORE)            # [rows, BV]
    t = jnp.maximum(plgpu.load(temp_ref.at[pl.ds(0, rows)], mask=one, other=1.0),
                    GREEDY_T_EPS)[:, None]
    z = x / t
    m = jnp.max(z, axis=1)
    s = jnp.sum(jnp.where(ok, jnp.exp(z - m[:, None]), 0.0), axis=1)
    best = jnp.max(x, axis=1)
    arg = jnp.min(jnp.where(x == best[:, None], idx, _BIG), axis=1)
    plgpu.store(x_ref.at[pl.ds(0, rows), pl.ds(i * block_v, block_v)], x, mask=ok)
    for ref, val in ((m_ref, m), (s_ref, s), (best_ref, best), (arg_ref, arg)):
        plgpu.store(ref.at[pl.ds(0, rows), i], val, mask=one)


def _pick_kernel(x_ref, m_ref, s_ref, best_ref, arg_ref, u_ref, temp_ref, *refs,
                 vocab: int, block_v: int, tiles: int, slot: int):
    """Row b's token from the tiles' partials and, inside the chosen tile, its logits, into
    column `slot` of the outputs tokens and log Σ [B, γ] (the last two refs; after slot 0 the
    two refs before them are the same buffers as inputs, aliased and not read)."""
    from jax.experimental.pallas import triton as plgpu

    tok_ref, logz_ref = refs[-2:]
    b = pl.program_id(0)
    tp = next_pow2(tiles)
    t_iota = lax.broadcasted_iota(jnp.int32, (tp,), 0)
    t_ok = t_iota < tiles
    load = lambda ref, other: plgpu.load(ref.at[b, pl.ds(0, tp)], mask=t_ok,  # noqa: E731
                                         other=other)
    m, s = load(m_ref, MASKED_SCORE), load(s_ref, 0.0)
    best, arg = load(best_ref, MASKED_SCORE), load(arg_ref, _BIG)
    temp = temp_ref[b]
    greedy_tok = jnp.min(jnp.where(best == jnp.max(best), arg, _BIG))
    top = jnp.max(m)
    w = jnp.where(t_ok, s * jnp.exp(m - top), 0.0)                           # [tiles]
    total = jnp.sum(w)
    thr = u_ref[b, jnp.asarray(slot, jnp.int32)] * total
    cdf = jnp.cumsum(w)
    last_tile = jnp.max(jnp.where(w > 0, t_iota, 0))
    j = jnp.minimum(jnp.sum((cdf <= thr).astype(jnp.int32)), last_tile)
    before = jnp.sum(jnp.where(t_iota < j, w, 0.0))
    c_iota = lax.broadcasted_iota(jnp.int32, (block_v,), 0)
    idx = j * block_v + c_iota
    x = plgpu.load(x_ref.at[b, pl.ds(j * block_v, block_v)], mask=idx < vocab,
                   other=MASKED_SCORE)
    wt = jnp.where(idx < vocab, jnp.exp(x / jnp.maximum(temp, GREEDY_T_EPS) - top), 0.0)
    count = jnp.sum((before + jnp.cumsum(wt) <= thr).astype(jnp.int32))
    last = jnp.max(jnp.where(wt > 0, c_iota, 0))
    sampled = j * block_v + jnp.minimum(count, last)
    k = jnp.asarray(slot, jnp.int32)
    tok_ref[b, k] = jnp.where(temp > 0, sampled, greedy_tok).astype(jnp.int32)
    logz_ref[b, k] = top + jnp.log(jnp.maximum(total, 1e-30))


def _params(interpret: bool, num_warps: int):
    from jax.experimental.pallas import triton as plgpu

    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


@functools.partial(jax.jit, static_argnames=("block_v", "interpret", "num_warps"))
def markov_sample_tiled(uniforms: jax.Array, base_logits: jax.Array, w1: jax.Array,
                        w2: jax.Array, anchor: jax.Array, temperature: jax.Array | float, *,
                        block_v: int | None = None, interpret: bool = False,
                        num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """`ref_markov_sample` in two Triton kernels a slot (module doc): uniforms [B, γ] in
    [0, 1); base_logits U [B, γ, V]; w1, w2 [V, r] (read where they lie, never padded);
    anchor [B] int; temperature a scalar or [B] (≤ 0 → greedy). Returns (tokens [B, γ] int32,
    probs [B, γ, V] f32). `block_v`: the vocabulary tile (default `tiled_block_v`);
    `interpret` runs the kernels on any device (tests)."""
    B, G, V, r = check_markov_inputs(uniforms, base_logits, w1, w2, anchor, temperature)
    if w1.dtype != w2.dtype:
        raise TypeError(f"w1 ({w1.dtype}) and w2 ({w2.dtype}) must share a dtype")
    if block_v is None:
        block_v = tiled_block_v(r, w2.dtype.itemsize)
    if block_v < 16 or block_v != next_pow2(block_v):
        raise ValueError(f"block_v must be a power of two ≥ 16, got {block_v}")
    tiles = pl.cdiv(V, block_v)
    rows = max(16, next_pow2(B))
    temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))
    u = uniforms.astype(jnp.float32)
    prev = anchor.astype(jnp.int32)          # clamped by `markov_tiles`
    partial = [jax.ShapeDtypeStruct((B, tiles), dt)
               for dt in (jnp.float32, jnp.float32, jnp.float32, jnp.int32)]
    xs, written = [], ()    # the tokens and log Σ [B, γ] the picks write, column by column
    for k in range(G):
        x, m, s, best, arg = pl.pallas_call(
            functools.partial(_tiles_kernel, rows=rows, batch=B, vocab=V, rank=r,
                              block_v=block_v, slot=k),
            grid=(tiles,), out_shape=[jax.ShapeDtypeStruct((B, V), jnp.float32)] + partial,
            compiler_params=_params(interpret, num_warps), interpret=interpret,
            name="markov_tiles")(prev, w1, base_logits, w2, temp)
        written = pl.pallas_call(
            functools.partial(_pick_kernel, vocab=V, block_v=block_v, tiles=tiles, slot=k),
            grid=(B,), out_shape=[jax.ShapeDtypeStruct((B, G), jnp.int32),
                                  jax.ShapeDtypeStruct((B, G), jnp.float32)],
            input_output_aliases={7: 0, 8: 1} if written else {},
            compiler_params=_params(interpret, 1), interpret=interpret,
            name="markov_pick")(x, m, s, best, arg, u, temp, *written)
        prev = written[0]
        xs.append(x)
    x = jnp.stack(xs, axis=1)                                                 # [B, γ, V]
    tokens, logz = written[0], written[1][..., None]
    t = temp[:, None, None]
    soft = jnp.exp(x / jnp.maximum(t, GREEDY_T_EPS) - logz)
    hard = (jnp.arange(V, dtype=jnp.int32) == tokens[..., None]).astype(jnp.float32)
    return tokens, jnp.where(t > 0, soft, hard)
