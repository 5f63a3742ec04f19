"""Conventions shared by the kernels and their oracles: sampling (SPEC §1 step 3) and the tile
arithmetic of the Triton attention kernels.

Pure JAX, nothing from dspark_jax: the kernels stand alone. Every categorical draw is an
inverse-CDF search with one explicit uniform, so a kernel and its `ref_<op>` consume the same
randomness and must return the same token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["GREEDY_T_EPS", "LOG2E", "MASKED_SCORE", "inverse_cdf_sample", "next_pow2",
           "probs_from_logits"]

#: A finite "minus infinity" for masked scores: a running maximum stays finite (no inf − inf).
MASKED_SCORE = -0.7 * float(jnp.finfo(jnp.float32).max)
#: log2(e): scores taken in base 2 (exp2) with the softmax scale folded in.
LOG2E = math.log2(math.e)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (Triton's tiles are powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


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
