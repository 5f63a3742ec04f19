"""Token sampling shared by plain and speculative decoding (SPEC §1 steps 1 and 3; DeepSpec's
evaluator samples the target and the drafter at temperature T the same way).

`probs_from_logits` defines the distribution the target and the drafter sample from at
temperature T (T = 0 → one-hot argmax, which makes greedy decoding a special case of the
lossless rejection rule). Top-k / top-p filtering applies to plain decoding, regeneration and
every verified position of the serving engine. Pure JAX, it imports nothing from the package.
`probs_from_logits` is the kernels' own (`pallas_kernels.common`), which the drafter models
import directly: models sit below decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# softmax(logits / T) in f32, T ≤ 0 → one-hot argmax: the kernels' convention (they stand alone,
# below the package), so the drafter models, decoding and the kernels share one definition
from pallas_kernels.common import GREEDY_T_EPS, probs_from_logits

__all__ = ["GREEDY_T_EPS", "filter_logits", "filter_logits_rows", "filtered_probs",
           "probs_from_logits", "sample_logits", "sample_probs"]


def filter_logits(logits: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Masks logits [..., V] outside the top-k set and outside the top-p nucleus (static k, p)."""
    neg = jnp.finfo(jnp.float32).min
    logits = logits.astype(jnp.float32)
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it is kept)
        cum_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = cum_before < top_p
        threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1,
                            keepdims=True)
        logits = jnp.where(logits < threshold, neg, logits)
    return logits


def sample_logits(key: jax.Array, logits: jax.Array, temperature: jax.Array | float,
                  top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Samples token ids [...] from logits [..., V]; greedy when temperature ≤ 0."""
    t = jnp.asarray(temperature, jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    filtered = filter_logits(logits, top_k, top_p)
    sampled = jax.random.categorical(key, filtered / jnp.maximum(t, GREEDY_T_EPS), axis=-1)
    return jnp.where(t > 0, sampled, greedy).astype(jnp.int32)


def sample_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Samples from explicit probabilities [..., V] (inverse CDF with one uniform per row)."""
    u = jax.random.uniform(key, probs.shape[:-1] + (1,), jnp.float32)
    cdf = jnp.cumsum(probs, axis=-1)
    cdf = cdf / jnp.maximum(cdf[..., -1:], 1e-30)
    idx = jnp.sum(cdf <= u, axis=-1)
    return jnp.minimum(idx, probs.shape[-1] - 1).astype(jnp.int32)


def filter_logits_rows(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`filter_logits` with per-row settings (traced, so each request keeps its own).

    logits [..., V]; top_k, top_p broadcast to logits.shape[:-1] (top_k ≤ 0 or ≥ V: no top-k;
    top_p ≥ 1: no nucleus). Same rule as `filter_logits`: top-k by value (ties with the k-th
    kept), then the smallest nucleus reaching top_p among the survivors.
    """
    neg = jnp.finfo(jnp.float32).min
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    lead = logits.shape[:-1]
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), lead)
    p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), lead)
    sorted_desc = -jnp.sort(-logits, axis=-1)                                # [..., V]
    use_k = (k > 0) & (k < V)
    kth = jnp.take_along_axis(sorted_desc, jnp.clip(k - 1, 0, V - 1)[..., None], axis=-1)
    kth = jnp.where(use_k[..., None], kth, -jnp.inf)
    logits = jnp.where(logits < kth, neg, logits)
    sorted_k = jnp.where(sorted_desc < kth, neg, sorted_desc)
    sorted_probs = jax.nn.softmax(sorted_k, axis=-1)
    cum_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = (cum_before < p[..., None]) | (p[..., None] >= 1.0)
    threshold = jnp.min(jnp.where(keep, sorted_k, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, neg, logits)


def filtered_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                   top_p: jax.Array) -> jax.Array:
    """The distribution a request samples from: per-row top-k/top-p on the raw logits, then
    softmax(·/T) (T ≤ 0: one-hot argmax) — what `sample_logits` draws from, as probabilities.
    temperature/top_k/top_p broadcast to logits.shape[:-1]."""
    lead = logits.shape[:-1]
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), lead)[..., None]
    needs = jnp.any((jnp.asarray(top_k) > 0) | (jnp.asarray(top_p) < 1.0))
    lg = jax.lax.cond(needs, lambda x: filter_logits_rows(x, top_k, top_p),
                      lambda x: x.astype(jnp.float32), logits)
    return probs_from_logits(lg, t)
