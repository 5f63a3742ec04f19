"""Pallas kernel for DSpark's vanilla Markov head, sampled left to right (SPEC §3, paper §3.2).

The Markov step is batched across requests: one program serves a block of BB rows, so each W2
tile is read once per pass for all of them instead of once per row. Slot k, for the BB rows:
  E = W1[x_{k−1}]                       (BB dynamic row loads, x_{−1} = the anchors)  [BB, r]
  logits = U_k + E · W2ᵀ                (per V tile: one [BB, r] × [r, BV] dot)      [BB, BV]
  pass 1 over V tiles: online max / sum of exp(logits / T) per row, and the running argmax
  pass 2 over V tiles: recompute the logits, write p_d,k, prefix-sum the unnormalised weights
                       and count CDF entries ≤ u_k · Σ → x_k (inverse CDF with the given uniform)
x_k becomes the previous token of slot k+1, so the head's bias really conditions on the sampled
token. Pass 2 recomputes the W2 product instead of re-reading pass 1's stores: a global-memory
round trip inside one program would need a barrier between differently-laid-out threads.

One algorithm body (`_markov_body`) runs on two access layers. Triton (`_markov_kernel`):
operands are plain refs in global memory; power-of-two tiles (V padded with −inf logits / zero
weight rows, r zero-padded, B padded to the row block, γ padded for the token vector), no dynamic
shapes, every dot dimension ≥ 16, f32 operands with HIGHEST precision (no TF32). TPU / Mosaic
(`_markov_kernel_tpu`): logits, probabilities and W1/W2 stay in HBM and tiles are DMA'd into
VMEM scratch (lane-aligned V tiles, sublane-aligned row blocks, W1 rows via aligned 16-row
windows, slot-major logits so no tiled dim is indexed by the slot), and the prefix sum is a
matmul with a triangular ones matrix (Mosaic has no cumsum). Both are exercised in interpret
mode on CPU; the TPU one compiles ahead of time for v5e with libtpu, the Triton one exports
for CUDA (tests/kernels/test_lowering.py).
`ref_markov_sample` is the pure-JAX oracle (sequential scan, one inverse-CDF draw per slot):
same uniforms → same tokens, probabilities within f32 rounding. Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import GREEDY_T_EPS, inverse_cdf_sample, probs_from_logits

__all__ = ["BACKENDS", "DEFAULT_BLOCK_V", "MAX_TILE_ELEMS", "markov_sample", "ref_markov_sample",
           "check_markov_inputs", "default_backend", "default_block_v", "default_block_b"]

# Tile over the vocabulary, capped so the [BV, r] W2 tile stays ≤ MAX_TILE_ELEMS values (BV = 32
# at DeepSpec's r = 256). Untuned: no GPU was available when written.
DEFAULT_BLOCK_V = 1024
MAX_TILE_ELEMS = 8192
#: Rows per program: the dot's M dimension (≥ 16 for tl.dot); more rows than this → more programs.
MIN_BLOCK_B, MAX_BLOCK_B = 16, 64
DEFAULT_NUM_WARPS = 4


def default_block_v(vocab: int, rank: int) -> int:
    """The V tile used when none is given: a power of two ≤ DEFAULT_BLOCK_V and ≤ next_pow2(V)."""
    r_pad = max(pl.next_power_of_2(rank), 16)
    return max(16, min(DEFAULT_BLOCK_V, MAX_TILE_ELEMS // r_pad, pl.next_power_of_2(vocab)))


def default_block_b(batch: int) -> int:
    """Rows served by one program (one pass over W2 per pass and slot): a power of two in
    [MIN_BLOCK_B, MAX_BLOCK_B]."""
    return min(max(pl.next_power_of_2(batch), MIN_BLOCK_B), MAX_BLOCK_B)


def check_markov_inputs(uniforms: jax.Array, base_logits: jax.Array, w1: jax.Array,
                        w2: jax.Array, anchor: jax.Array, temperature: jax.Array | float
                        ) -> tuple[int, int, int, int]:
    """Validates shapes/dtypes; returns (B, γ, V, r)."""
    if base_logits.ndim != 3:
        raise ValueError(f"base_logits must be [B, γ, V], got shape {base_logits.shape}")
    B, G, V = base_logits.shape
    if G < 1:
        raise ValueError("need γ ≥ 1 draft slots")
    if w1.ndim != 2 or w1.shape[0] != V:
        raise ValueError(f"w1 must be [V, r] with V={V}, got shape {w1.shape}")
    r = w1.shape[1]
    if tuple(w2.shape) != (V, r):
        raise ValueError(f"w2 must be [V, r] = {(V, r)} (DeepSpec layout), got {w2.shape}")
    if tuple(anchor.shape) != (B,):
        raise ValueError(f"anchor must have shape {(B,)}, got {anchor.shape}")
    if tuple(uniforms.shape) != (B, G):
        raise ValueError(f"uniforms must have shape {(B, G)}, got {uniforms.shape}")
    t_shape = jnp.shape(temperature)
    if t_shape not in ((), (B,)):
        raise ValueError(f"temperature must be a scalar or [B]={B}, got shape {t_shape}")
    for name, arr in (("base_logits", base_logits), ("w1", w1), ("w2", w2),
                      ("uniforms", uniforms)):
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {arr.dtype}")
    if not jnp.issubdtype(anchor.dtype, jnp.integer):
        raise TypeError(f"anchor must be an integer array, got {anchor.dtype}")
    return B, G, V, r


def ref_markov_sample(uniforms: jax.Array, base_logits: jax.Array, w1: jax.Array,
                      w2: jax.Array, anchor: jax.Array, temperature: jax.Array | float
                      ) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX oracle with the kernel's signature: (tokens [B, γ] int32, probs [B, γ, V] f32).

    Slot k: logits = U_k + W2·W1[x_{k−1}] in f32, p = softmax(logits / T) (one-hot argmax for
    T ≤ 0), x_k = inverse-CDF draw from p with uniforms[:, k]; x_{−1} = anchor.
    """
    check_markov_inputs(uniforms, base_logits, w1, w2, anchor, temperature)
    B = base_logits.shape[0]
    t_b1 = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))[:, None]   # [B, 1]
    w1_f, w2_f = w1.astype(jnp.float32), w2.astype(jnp.float32)

    def slot(prev_b, xs):
        U_bv, u_b = xs
        e_br = jnp.take(w1_f, prev_b, axis=0)                                        # [B, r]
        bias_bv = jnp.einsum("BR,VR->BV", e_br, w2_f, precision=jax.lax.Precision.HIGHEST)
        probs_bv = probs_from_logits(U_bv.astype(jnp.float32) + bias_bv, t_b1)
        tok_b = inverse_cdf_sample(probs_bv, u_b)
        return tok_b, (tok_b, probs_bv)

    xs = (jnp.moveaxis(base_logits, 1, 0), jnp.moveaxis(uniforms.astype(jnp.float32), 1, 0))
    _, (toks_gb, probs_gbv) = jax.lax.scan(slot, anchor.astype(jnp.int32), xs)
    return jnp.moveaxis(toks_gb, 0, 1), jnp.moveaxis(probs_gbv, 0, 1)


class _Access(NamedTuple):
    """How the shared body reaches its operands (plain refs on Triton, DMAs on TPU)."""

    logits: Callable      # (k, i) → U_k tile [BB, BV]
    w2: Callable          # i → W2 tile [BV, rp]
    w1_rows: Callable     # prev [BB, 1] int → W1[prev] [BB, rp] f32
    store_probs: Callable  # (k, i, tile [BB, BV] f32) → None
    prefix_sum: Callable  # [BB, BV] → inclusive prefix sums along the tile


def _markov_body(acc: _Access, u_all, anchor, temp, *, gamma: int, n_tiles: int, block_v: int,
                 gp: int):
    """Sequential sampling of γ slots for BB rows; returns tokens [BB, gp] int32.

    u_all [BB, gp] uniforms, anchor [BB, 1] int32 (clipped), temp [BB, 1] f32.
    """
    BB = u_all.shape[0]
    greedy = temp <= 0.0                                                     # [BB, 1]
    t_safe = jnp.maximum(temp, GREEDY_T_EPS)
    lane = jax.lax.broadcasted_iota(jnp.int32, (BB, block_v), 1)
    cols = jax.lax.broadcasted_iota(jnp.int32, (BB, gp), 1)
    f32_min = jnp.float32(jnp.finfo(jnp.float32).min)
    big = jnp.int32(2**30)
    row_max = lambda x: jnp.max(x, axis=1, keepdims=True)  # noqa: E731
    row_sum = lambda x: jnp.sum(x, axis=1, keepdims=True)  # noqa: E731

    def slot(k, carry):
        prev, toks = carry                                                   # [BB,1], [BB,gp]
        e = acc.w1_rows(prev)                                                # [BB, rp]
        u = row_sum(jnp.where(cols == k, u_all, 0.0))                        # [BB, 1]

        def logits(i):
            bias = jax.lax.dot_general(e, acc.w2(i).astype(jnp.float32), (((1,), (1,)), ((), ())),
                                       precision=jax.lax.Precision.HIGHEST,
                                       preferred_element_type=jnp.float32)   # [BB, BV]
            return acc.logits(k, i).astype(jnp.float32) + bias, i * block_v + lane

        def stats(i, c):
            m, s, best, arg = c
            x, idx = logits(i)
            z = x / t_safe
            m_new = jnp.maximum(m, row_max(z))
            s = s * jnp.exp(m - m_new) + row_sum(jnp.exp(z - m_new))
            tile_best = row_max(x)
            tile_arg = jnp.min(jnp.where(x == tile_best, idx, big), axis=1, keepdims=True)
            better = tile_best > best                                        # keeps the 1st max
            return m_new, s, jnp.where(better, tile_best, best), jnp.where(better, tile_arg, arg)

        col = lambda v, dt: jnp.full((BB, 1), v, dt)  # noqa: E731
        init = (col(f32_min, jnp.float32), col(0.0, jnp.float32), col(-jnp.inf, jnp.float32),
                col(0, jnp.int32))
        m, s, _, arg = jax.lax.fori_loop(0, n_tiles, stats, init)
        total = jnp.where(greedy, jnp.float32(1.0), s)                       # [BB, 1]
        thr = u * total

        def search(i, c):
            cum, count, last_pos = c
            x, idx = logits(i)
            w = jnp.where(greedy, (idx == arg).astype(jnp.float32), jnp.exp(x / t_safe - m))
            acc.store_probs(k, i, w / total)
            cdf = cum + acc.prefix_sum(w)
            count = count + row_sum((cdf <= thr).astype(jnp.int32))
            last_pos = jnp.maximum(last_pos, row_max(jnp.where(w > 0, idx, 0)))
            return row_max(cdf), count, last_pos   # max(cdf) is its last entry

        _, count, last_pos = jax.lax.fori_loop(
            0, n_tiles, search, (col(0.0, jnp.float32), col(0, jnp.int32), col(0, jnp.int32)))
        x_k = jnp.minimum(count, last_pos)                                   # [BB, 1]
        return x_k, jnp.where(cols == k, x_k, toks)

    _, toks = jax.lax.fori_loop(0, gamma, slot, (anchor, jnp.zeros((BB, gp), jnp.int32)))
    return toks


def _one_row(rows_bb1: jax.Array, prev_bb1: jax.Array, b: int) -> jax.Array:
    return jnp.sum(jnp.where(rows_bb1 == b, prev_bb1, 0))                   # scalar prev[b]


def _markov_kernel(u_ref, logit_ref, w1_ref, w2_ref, anchor_ref, temp_ref,   # inputs
                   tok_ref, probs_ref,                                      # outputs
                   *, gamma: int, vocab: int, block_v: int):
    """Triton / interpret: every operand is a ref (global memory on GPU), read tile by tile.

    u/tok [BB, Gp], logits/probs [BB, γ, Vp], w1/w2 [Vp, rp] (whole), anchor/temp [BB, 1].
    """
    BB = u_ref.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (BB, 1), 0)
    tile = lambda i: pl.ds(pl.multiple_of(i * block_v, block_v), block_v)  # noqa: E731

    def w1_rows(prev):  # BB small dynamic row loads; W2 is what is worth batching
        e = jnp.zeros((BB, w1_ref.shape[1]), jnp.float32)
        for b in range(BB):
            row = w1_ref[_one_row(rows, prev, b), :].astype(jnp.float32)
            e = jnp.where(rows == b, row[None, :], e)
        return e

    def store_probs(k, i, val):
        probs_ref[:, k, tile(i)] = val

    acc = _Access(logits=lambda k, i: logit_ref[:, k, tile(i)], w2=lambda i: w2_ref[tile(i), :],
                  w1_rows=w1_rows, store_probs=store_probs,
                  prefix_sum=lambda w: jnp.cumsum(w, axis=1))
    anchor = jnp.clip(anchor_ref[...], 0, vocab - 1)
    tok_ref[...] = _markov_body(acc, u_ref[...], anchor, temp_ref[...], gamma=gamma,
                                n_tiles=logit_ref.shape[-1] // block_v, block_v=block_v,
                                gp=tok_ref.shape[1])


def _markov_kernel_tpu(u_ref, logit_hbm, w1_hbm, w2_hbm, anchor_ref, temp_ref, tri_ref,
                       tok_ref, probs_hbm,                                  # outputs
                       logit_buf, w2_buf, w1_win, probs_buf,                # VMEM scratch
                       *, gamma: int, vocab: int, block_v: int):
    """TPU (Mosaic): the large operands stay in HBM and tiles are DMA'd into VMEM scratch
    (synchronously: untuned, no double buffering); W1 rows come from aligned 16-row windows;
    the prefix sum is a matmul with the upper-triangular ones matrix `tri` (Mosaic has no
    cumsum). logits/probs [γ, Bp, Vp] (slot-major: the slot index must not be a tiled dim)
    and w1/w2 [Vp, rp] in HBM; u/tok [BB, Gp] and anchor/temp [BB, 1] in VMEM."""
    from jax.experimental.pallas import tpu as pltpu

    BB = u_ref.shape[0]
    win = w1_win.shape[0]
    b0 = pl.multiple_of(pl.program_id(0) * BB, BB)
    rows = jax.lax.broadcasted_iota(jnp.int32, (BB, 1), 0)
    win_rows = jax.lax.broadcasted_iota(jnp.int32, (win, 1), 0)
    tile = lambda i: pl.ds(pl.multiple_of(i * block_v, block_v), block_v)  # noqa: E731

    def load_logits(k, i):
        pltpu.sync_copy(logit_hbm.at[k, pl.ds(b0, BB), tile(i)], logit_buf)
        return logit_buf[...]

    def load_w2(i):
        pltpu.sync_copy(w2_hbm.at[tile(i)], w2_buf)
        return w2_buf[...]

    def w1_rows(prev):
        e = jnp.zeros((BB, w1_win.shape[1]), jnp.float32)
        for b in range(BB):
            pb = _one_row(rows, prev, b)
            start = pl.multiple_of(jax.lax.div(pb, jnp.int32(win)) * win, win)  # pb ≥ 0
            pltpu.sync_copy(w1_hbm.at[pl.ds(start, win)], w1_win)
            row = jnp.sum(jnp.where(win_rows == pb - start, w1_win[...].astype(jnp.float32), 0.0),
                          axis=0, keepdims=True)                            # [1, rp]
            e = jnp.where(rows == b, row, e)
        return e

    def store_probs(k, i, val):
        probs_buf[...] = val
        pltpu.sync_copy(probs_buf, probs_hbm.at[k, pl.ds(b0, BB), tile(i)])

    def prefix_sum(w):
        return jax.lax.dot_general(w, tri_ref[...], (((1,), (0,)), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)

    acc = _Access(logits=load_logits, w2=load_w2, w1_rows=w1_rows, store_probs=store_probs,
                  prefix_sum=prefix_sum)
    anchor = jnp.clip(anchor_ref[...], 0, vocab - 1)
    tok_ref[...] = _markov_body(acc, u_ref[...], anchor, temp_ref[...], gamma=gamma,
                                n_tiles=logit_hbm.shape[-1] // block_v, block_v=block_v,
                                gp=tok_ref.shape[1])


def _pad_to(x: jax.Array, shape: tuple[int, ...], value) -> jax.Array:
    if tuple(x.shape) == shape:
        return x
    return jnp.pad(x, [(0, n - d) for d, n in zip(x.shape, shape)], constant_values=value)


BACKENDS = ("triton", "mosaic")
#: TPU tiles: lane-aligned V tiles, sublane-aligned row blocks, W1 windows of 16 rows.
TPU_BLOCK_V, TPU_W1_WINDOW = 512, 16


def default_backend() -> str:
    """"mosaic" when JAX's default backend is a TPU, else "triton"."""
    return "mosaic" if jax.default_backend() == "tpu" else "triton"


@functools.partial(jax.jit, static_argnames=("block_v", "block_b", "interpret", "num_warps",
                                             "backend"))
def markov_sample(uniforms: jax.Array, base_logits: jax.Array, w1: jax.Array, w2: jax.Array,
                  anchor: jax.Array, temperature: jax.Array | float, *,
                  block_v: int | None = None, block_b: int | None = None,
                  interpret: bool = False, num_warps: int = DEFAULT_NUM_WARPS,
                  backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Kernel version of `ref_markov_sample` (same arguments and result).

    uniforms [B, γ] in [0, 1); base_logits [B, γ, V] (f32/bf16); w1, w2 [V, r]; anchor [B] int;
    temperature scalar or [B] (≤ 0 → greedy). Returns (tokens [B, γ] int32, probs [B, γ, V] f32).
    `block_b` rows share each pass over W2 (default `default_block_b(B)`). `backend`: "triton"
    (GPU) or "mosaic" (TPU); default from the JAX backend. `interpret` runs it on any device.
    """
    B, G, V, r = check_markov_inputs(uniforms, base_logits, w1, w2, anchor, temperature)
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    tpu = backend == "mosaic"
    if block_v is None:
        block_v = min(TPU_BLOCK_V, max(128, pl.next_power_of_2(V))) if tpu else \
            default_block_v(V, r)
    block_b = default_block_b(B) if block_b is None else block_b
    for name, v in (("block_v", block_v), ("block_b", block_b)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if tpu and (block_v % 128 or block_b % 8):
        raise ValueError(f"the TPU kernel needs block_v % 128 == 0 and block_b % 8 == 0, got "
                         f"block_v={block_v}, block_b={block_b}")
    Vp = pl.cdiv(V, block_v) * block_v
    Bp = pl.cdiv(B, block_b) * block_b
    rp = max(pl.next_power_of_2(r), 16 if not tpu else 128)
    Gp = pl.next_power_of_2(G)

    u = _pad_to(uniforms.astype(jnp.float32), (Bp, Gp), 0.0)                  # [Bp, Gp]
    logits = _pad_to(base_logits, (Bp, G, Vp), -jnp.inf)                      # [Bp, γ, Vp]
    w1p = _pad_to(w1, (Vp, rp), 0)                                            # [Vp, rp]
    w2p = _pad_to(w2, (Vp, rp), 0)                                            # [Vp, rp]
    anc = _pad_to(anchor.astype(jnp.int32), (Bp,), 0)[:, None]                # [Bp, 1]
    temp = _pad_to(jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,)), (Bp,),
                   0.0)[:, None]                                              # [Bp, 1]
    per_row = lambda b: (b, 0)  # noqa: E731
    toks_shape = jax.ShapeDtypeStruct((Bp, Gp), jnp.int32)
    common = dict(grid=(Bp // block_b,), interpret=interpret, name="dspark_markov_sample")
    if tpu:
        from jax.experimental.pallas import tpu as pltpu

        hbm = pl.BlockSpec(memory_space=pl.ANY)
        tri = jnp.triu(jnp.ones((block_v, block_v), jnp.float32))              # [BV, BV]
        kernel = functools.partial(_markov_kernel_tpu, gamma=G, vocab=V, block_v=block_v)
        toks, probs_gbv = pl.pallas_call(
            kernel,
            in_specs=[pl.BlockSpec((block_b, Gp), per_row), hbm, hbm, hbm,
                      pl.BlockSpec((block_b, 1), per_row), pl.BlockSpec((block_b, 1), per_row),
                      pl.BlockSpec((block_v, block_v), lambda b: (0, 0))],
            out_specs=[pl.BlockSpec((block_b, Gp), per_row), hbm],
            scratch_shapes=[pltpu.VMEM((block_b, block_v), logits.dtype),
                            pltpu.VMEM((block_v, rp), w2p.dtype),
                            pltpu.VMEM((TPU_W1_WINDOW, rp), w1p.dtype),
                            pltpu.VMEM((block_b, block_v), jnp.float32)],
            compiler_params=None if interpret else pltpu.CompilerParams(
                dimension_semantics=("parallel",)),
            out_shape=[toks_shape, jax.ShapeDtypeStruct((G, Bp, Vp), jnp.float32)],
            **common)(u, jnp.moveaxis(logits, 1, 0), w1p, w2p, anc, temp, tri)
        return toks[:B, :G], jnp.moveaxis(probs_gbv, 0, 1)[:B, :, :V]
    kernel = functools.partial(_markov_kernel, gamma=G, vocab=V, block_v=block_v)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    whole = lambda b: (0, 0)  # noqa: E731
    toks, probs = pl.pallas_call(
        kernel,
        in_specs=[
            pl.BlockSpec((block_b, Gp), per_row),
            pl.BlockSpec((block_b, G, Vp), lambda b: (b, 0, 0)),
            pl.BlockSpec((Vp, rp), whole),
            pl.BlockSpec((Vp, rp), whole),
            pl.BlockSpec((block_b, 1), per_row),
            pl.BlockSpec((block_b, 1), per_row),
        ],
        out_specs=[
            pl.BlockSpec((block_b, Gp), per_row),
            pl.BlockSpec((block_b, G, Vp), lambda b: (b, 0, 0)),
        ],
        out_shape=[toks_shape, jax.ShapeDtypeStruct((Bp, G, Vp), jnp.float32)],
        compiler_params=compiler_params,
        **common)(u, logits, w1p, w2p, anc, temp)
    return toks[:B, :G], probs[:B, :, :V]
