"""Pallas kernel for DSpark's vanilla Markov head, sampled left to right (SPEC §3, paper §3.2).

One program per batch row, sequential over the γ slots. Slot k:
  e = W1[x_{k−1}]                      (one dynamic row load, x_{−1} = the anchor)
  logits = U_k + W2 · e                (per V tile: [BV, r] tile times e, reduced over r)
  pass 1 over V tiles: online max / sum of exp(logits / T), and the running argmax (for T ≤ 0)
  pass 2 over V tiles: recompute the logits, write p_d,k, prefix-sum the unnormalised weights
                       and count CDF entries ≤ u_k · Σ  → x_k (inverse-CDF with the given uniform)
x_k becomes the previous token of slot k+1, so the head's bias really conditions on the sampled
token. Pass 2 recomputes the W2 product instead of re-reading pass 1's stores: a global-memory
round trip inside one program would need a barrier between differently-laid-out threads.

Triton constraints honoured: power-of-two tiles (V padded with −inf logits / zero weight rows,
r zero-padded, γ padded for the token vector), no dynamic shapes, the bias is an elementwise
product + row sum rather than tl.dot (a [1, r] operand is below tl.dot's minimum and would run
in TF32). `ref_markov_sample` (the pure-JAX `sequential_markov_sample_with_uniforms`) is the
oracle: same uniforms → same tokens, probabilities within f32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dspark_jax.decoding.verify import sequential_markov_sample_with_uniforms

__all__ = ["DEFAULT_BLOCK_V", "MAX_TILE_ELEMS", "markov_sample", "ref_markov_sample",
           "check_markov_inputs", "default_block_v"]

# Tile over the vocabulary, capped so the [BV, r] W2 tile stays ≤ MAX_TILE_ELEMS values (64 per
# thread at 4 warps: BV = 64 at DeepSpec's r = 256). Untuned: no GPU was available when written.
DEFAULT_BLOCK_V = 1024
MAX_TILE_ELEMS = 8192
DEFAULT_NUM_WARPS = 4


def default_block_v(vocab: int, rank: int) -> int:
    """The V tile used when none is given: a power of two ≤ DEFAULT_BLOCK_V and ≤ next_pow2(V)."""
    r_pad = pl.next_power_of_2(rank)
    return max(1, min(DEFAULT_BLOCK_V, MAX_TILE_ELEMS // r_pad, pl.next_power_of_2(vocab)))


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
    """Pure-JAX oracle with the kernel's signature: (tokens [B, γ] int32, probs [B, γ, V] f32)."""
    check_markov_inputs(uniforms, base_logits, w1, w2, anchor, temperature)
    return sequential_markov_sample_with_uniforms(uniforms, base_logits, w1, w2, anchor,
                                                  temperature)


def _markov_kernel(u_ref, logit_ref, w1_ref, w2_ref, anchor_ref, temp_ref,   # inputs
                   tok_ref, probs_ref,                                      # outputs
                   *, gamma: int, vocab: int, block_v: int):
    # u/tok [Gp], logits/probs [γ, Vp], w1/w2 [Vp, rp] (whole), anchor/temp scalars.
    n_tiles = logit_ref.shape[-1] // block_v
    t = temp_ref[...]
    greedy = t <= 0.0
    t_safe = jnp.maximum(t, 1e-6)           # same guard as sampling.probs_from_logits
    lane = jax.lax.broadcasted_iota(jnp.int32, (block_v,), 0)
    f32_min = jnp.float32(jnp.finfo(jnp.float32).min)

    def slot(k, carry):
        prev, toks = carry
        e = w1_ref[prev, :].astype(jnp.float32)                              # [rp]

        def logits(i):
            sl = pl.ds(pl.multiple_of(i * block_v, block_v), block_v)
            w2 = w2_ref[sl, :].astype(jnp.float32)                           # [BV, rp]
            x = logit_ref[k, sl].astype(jnp.float32) + jnp.sum(w2 * e[None, :], axis=1)
            return x, i * block_v + lane                                     # [BV], [BV]

        def stats(i, c):
            m, s, best, arg = c
            x, idx = logits(i)
            z = x / t_safe
            m_new = jnp.maximum(m, jnp.max(z))
            s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new))
            tile_best = jnp.max(x)
            tile_arg = jnp.min(jnp.where(x == tile_best, idx, jnp.int32(2**30)))
            better = tile_best > best                                      # keeps the 1st max
            return m_new, s, jnp.where(better, tile_best, best), jnp.where(better, tile_arg, arg)

        init = (f32_min, jnp.float32(0.0), jnp.float32(-jnp.inf), jnp.int32(0))
        m, s, _, arg = jax.lax.fori_loop(0, n_tiles, stats, init)
        total = jnp.where(greedy, jnp.float32(1.0), s)
        thr = u_ref[k] * total

        def search(i, c):
            cum, count, last_pos = c
            x, idx = logits(i)
            w = jnp.where(greedy, (idx == arg).astype(jnp.float32), jnp.exp(x / t_safe - m))
            probs_ref[k, pl.ds(pl.multiple_of(i * block_v, block_v), block_v)] = w / total
            cdf = cum + jnp.cumsum(w)
            count = count + jnp.sum((cdf <= thr).astype(jnp.int32))
            last_pos = jnp.maximum(last_pos, jnp.max(jnp.where(w > 0, idx, 0)))
            return jnp.max(cdf), count, last_pos     # max(cdf) is its last entry

        _, count, last_pos = jax.lax.fori_loop(0, n_tiles, search,
                                               (jnp.float32(0.0), jnp.int32(0), jnp.int32(0)))
        x_k = jnp.minimum(count, last_pos)
        toks = jnp.where(jax.lax.broadcasted_iota(jnp.int32, toks.shape, 0) == k, x_k, toks)
        return x_k, toks

    anchor = jnp.clip(anchor_ref[...], 0, vocab - 1)
    toks0 = jnp.zeros(tok_ref.shape, jnp.int32)
    _, toks = jax.lax.fori_loop(0, gamma, slot, (anchor, toks0))
    tok_ref[...] = toks


def _pad_to(x: jax.Array, shape: tuple[int, ...], value) -> jax.Array:
    if tuple(x.shape) == shape:
        return x
    return jnp.pad(x, [(0, n - d) for d, n in zip(x.shape, shape)], constant_values=value)


@functools.partial(jax.jit, static_argnames=("block_v", "interpret", "num_warps"))
def markov_sample(uniforms: jax.Array, base_logits: jax.Array, w1: jax.Array, w2: jax.Array,
                  anchor: jax.Array, temperature: jax.Array | float, *,
                  block_v: int | None = None, interpret: bool = False,
                  num_warps: int = DEFAULT_NUM_WARPS) -> tuple[jax.Array, jax.Array]:
    """Kernel version of `sequential_markov_sample_with_uniforms` (same arguments and result).

    uniforms [B, γ] in [0, 1); base_logits [B, γ, V] (f32/bf16); w1, w2 [V, r]; anchor [B] int;
    temperature scalar or [B] (≤ 0 → greedy). Returns (tokens [B, γ] int32, probs [B, γ, V] f32).
    """
    B, G, V, r = check_markov_inputs(uniforms, base_logits, w1, w2, anchor, temperature)
    if block_v is None:
        block_v = default_block_v(V, r)
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    Vp = pl.cdiv(V, block_v) * block_v
    rp = pl.next_power_of_2(r)
    Gp = pl.next_power_of_2(G)

    u = _pad_to(uniforms.astype(jnp.float32), (B, Gp), 0.0)                   # [B, Gp]
    logits = _pad_to(base_logits, (B, G, Vp), -jnp.inf)                       # [B, γ, Vp]
    w1p = _pad_to(w1, (Vp, rp), 0)                                            # [Vp, rp]
    w2p = _pad_to(w2, (Vp, rp), 0)                                            # [Vp, rp]
    anc = anchor.astype(jnp.int32)                                            # [B]
    temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))      # [B]

    row = lambda b: (b,)  # noqa: E731
    whole = lambda b: (0, 0)  # noqa: E731
    kernel = functools.partial(_markov_kernel, gamma=G, vocab=V, block_v=block_v)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    toks, probs = pl.pallas_call(
        kernel,
        grid=(B,),
        in_specs=[
            pl.BlockSpec((None, Gp), lambda b: (b, 0)),
            pl.BlockSpec((None, G, Vp), lambda b: (b, 0, 0)),
            pl.BlockSpec((Vp, rp), whole),
            pl.BlockSpec((Vp, rp), whole),
            pl.BlockSpec((None,), row),
            pl.BlockSpec((None,), row),
        ],
        out_specs=[
            pl.BlockSpec((None, Gp), lambda b: (b, 0)),
            pl.BlockSpec((None, G, Vp), lambda b: (b, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Gp), jnp.int32),
            jax.ShapeDtypeStruct((B, G, Vp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params,
        name="dspark_markov_sample",
    )(u, logits, w1p, w2p, anc, temp)
    return toks[:, :G], probs[:, :, :V]
