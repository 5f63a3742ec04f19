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

Triton constraints honoured: power-of-two tiles (V padded with −inf logits / zero weight rows,
r zero-padded, B padded to the row block, γ padded for the token vector), no dynamic shapes,
every tile dimension of the dot ≥ 16, f32 operands with HIGHEST precision (no TF32).
`ref_markov_sample` is the pure-JAX oracle (sequential scan, one inverse-CDF draw per slot):
same uniforms → same tokens, probabilities within f32 rounding. Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import GREEDY_T_EPS, inverse_cdf_sample, probs_from_logits

__all__ = ["DEFAULT_BLOCK_V", "MAX_TILE_ELEMS", "markov_sample", "ref_markov_sample",
           "check_markov_inputs", "default_block_v", "default_block_b"]

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


def _markov_kernel(u_ref, logit_ref, w1_ref, w2_ref, anchor_ref, temp_ref,   # inputs
                   tok_ref, probs_ref,                                      # outputs
                   *, gamma: int, vocab: int, block_v: int):
    # u/tok [BB, Gp], logits/probs [BB, γ, Vp], w1/w2 [Vp, rp] (whole), anchor/temp [BB].
    BB = u_ref.shape[0]
    n_tiles = logit_ref.shape[-1] // block_v
    t = temp_ref[...]                                                        # [BB]
    greedy = t <= 0.0
    t_safe = jnp.maximum(t, GREEDY_T_EPS)[:, None]                           # [BB, 1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (BB,), 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (BB, block_v), 1)
    cols = jax.lax.broadcasted_iota(jnp.int32, tok_ref.shape, 1)
    f32_min = jnp.float32(jnp.finfo(jnp.float32).min)
    big = jnp.int32(2**30)

    def gather_rows(prev):                                                   # [BB] → [BB, rp]
        e = jnp.zeros((BB, w1_ref.shape[1]), jnp.float32)
        for b in range(BB):  # BB small dynamic row loads; W2 is what is worth batching
            pb = jnp.sum(jnp.where(rows == b, prev, 0))
            e = jnp.where((rows == b)[:, None], w1_ref[pb, :].astype(jnp.float32)[None, :], e)
        return e

    def slot(k, carry):
        prev, toks = carry
        e = gather_rows(prev)                                                # [BB, rp]
        u = jnp.sum(jnp.where(cols == k, u_ref[...], 0.0), axis=1)            # [BB]

        def logits(i):
            sl = pl.ds(pl.multiple_of(i * block_v, block_v), block_v)
            w2 = w2_ref[sl, :].astype(jnp.float32)                           # [BV, rp]
            bias = jax.lax.dot_general(e, w2, (((1,), (1,)), ((), ())),
                                       precision=jax.lax.Precision.HIGHEST,
                                       preferred_element_type=jnp.float32)   # [BB, BV]
            return logit_ref[:, k, sl].astype(jnp.float32) + bias, i * block_v + lane

        def stats(i, c):
            m, s, best, arg = c
            x, idx = logits(i)
            z = x / t_safe
            m_new = jnp.maximum(m, jnp.max(z, axis=1))
            s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
            tile_best = jnp.max(x, axis=1)
            tile_arg = jnp.min(jnp.where(x == tile_best[:, None], idx, big), axis=1)
            better = tile_best > best                                        # keeps the 1st max
            return m_new, s, jnp.where(better, tile_best, best), jnp.where(better, tile_arg, arg)

        init = (jnp.full((BB,), f32_min), jnp.zeros((BB,), jnp.float32),
                jnp.full((BB,), -jnp.inf, jnp.float32), jnp.zeros((BB,), jnp.int32))
        m, s, _, arg = jax.lax.fori_loop(0, n_tiles, stats, init)
        total = jnp.where(greedy, jnp.float32(1.0), s)                       # [BB]
        thr = (u * total)[:, None]

        def search(i, c):
            cum, count, last_pos = c
            x, idx = logits(i)
            w = jnp.where(greedy[:, None], (idx == arg[:, None]).astype(jnp.float32),
                          jnp.exp(x / t_safe - m[:, None]))
            probs_ref[:, k, pl.ds(pl.multiple_of(i * block_v, block_v), block_v)] = (
                w / total[:, None])
            cdf = cum[:, None] + jnp.cumsum(w, axis=1)
            count = count + jnp.sum((cdf <= thr).astype(jnp.int32), axis=1)
            last_pos = jnp.maximum(last_pos, jnp.max(jnp.where(w > 0, idx, 0), axis=1))
            return jnp.max(cdf, axis=1), count, last_pos   # max(cdf) is its last entry

        zeros_i = jnp.zeros((BB,), jnp.int32)
        _, count, last_pos = jax.lax.fori_loop(0, n_tiles, search,
                                               (jnp.zeros((BB,), jnp.float32), zeros_i, zeros_i))
        x_k = jnp.minimum(count, last_pos)
        return x_k, jnp.where(cols == k, x_k[:, None], toks)

    anchor = jnp.clip(anchor_ref[...], 0, vocab - 1)
    _, toks = jax.lax.fori_loop(0, gamma, slot, (anchor, jnp.zeros(tok_ref.shape, jnp.int32)))
    tok_ref[...] = toks


def _pad_to(x: jax.Array, shape: tuple[int, ...], value) -> jax.Array:
    if tuple(x.shape) == shape:
        return x
    return jnp.pad(x, [(0, n - d) for d, n in zip(x.shape, shape)], constant_values=value)


@functools.partial(jax.jit, static_argnames=("block_v", "block_b", "interpret", "num_warps"))
def markov_sample(uniforms: jax.Array, base_logits: jax.Array, w1: jax.Array, w2: jax.Array,
                  anchor: jax.Array, temperature: jax.Array | float, *,
                  block_v: int | None = None, block_b: int | None = None,
                  interpret: bool = False, num_warps: int = DEFAULT_NUM_WARPS
                  ) -> tuple[jax.Array, jax.Array]:
    """Kernel version of `ref_markov_sample` (same arguments and result).

    uniforms [B, γ] in [0, 1); base_logits [B, γ, V] (f32/bf16); w1, w2 [V, r]; anchor [B] int;
    temperature scalar or [B] (≤ 0 → greedy). Returns (tokens [B, γ] int32, probs [B, γ, V] f32).
    `block_b` rows share each pass over W2 (default `default_block_b(B)`).
    """
    B, G, V, r = check_markov_inputs(uniforms, base_logits, w1, w2, anchor, temperature)
    block_v = default_block_v(V, r) if block_v is None else block_v
    block_b = default_block_b(B) if block_b is None else block_b
    for name, v in (("block_v", block_v), ("block_b", block_b)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    Vp = pl.cdiv(V, block_v) * block_v
    Bp = pl.cdiv(B, block_b) * block_b
    rp = max(pl.next_power_of_2(r), 16)
    Gp = pl.next_power_of_2(G)

    u = _pad_to(uniforms.astype(jnp.float32), (Bp, Gp), 0.0)                  # [Bp, Gp]
    logits = _pad_to(base_logits, (Bp, G, Vp), -jnp.inf)                      # [Bp, γ, Vp]
    w1p = _pad_to(w1, (Vp, rp), 0)                                            # [Vp, rp]
    w2p = _pad_to(w2, (Vp, rp), 0)                                            # [Vp, rp]
    anc = _pad_to(anchor.astype(jnp.int32), (Bp,), 0)                         # [Bp]
    temp = _pad_to(jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,)), (Bp,), 0.0)

    rows = lambda b: (b,)  # noqa: E731
    whole = lambda b: (0, 0)  # noqa: E731
    kernel = functools.partial(_markov_kernel, gamma=G, vocab=V, block_v=block_v)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    toks, probs = pl.pallas_call(
        kernel,
        grid=(Bp // block_b,),
        in_specs=[
            pl.BlockSpec((block_b, Gp), lambda b: (b, 0)),
            pl.BlockSpec((block_b, G, Vp), lambda b: (b, 0, 0)),
            pl.BlockSpec((Vp, rp), whole),
            pl.BlockSpec((Vp, rp), whole),
            pl.BlockSpec((block_b,), rows),
            pl.BlockSpec((block_b,), rows),
        ],
        out_specs=[
            pl.BlockSpec((block_b, Gp), lambda b: (b, 0)),
            pl.BlockSpec((block_b, G, Vp), lambda b: (b, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((Bp, Gp), jnp.int32),
            jax.ShapeDtypeStruct((Bp, G, Vp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params,
        name="dspark_markov_sample",
    )(u, logits, w1p, w2p, anc, temp)
    return toks[:B, :G], probs[:B, :, :V]
