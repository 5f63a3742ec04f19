"""Token sampling shared by plain and speculative decoding (SPEC §1 step 3).

`probs_from_logits` defines the distribution the target and the drafter sample from at
temperature T (T = 0 → one-hot argmax, which makes greedy decoding a special case of the
lossless rejection rule). Top-k / top-p filtering applies to plain decoding and regeneration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def probs_from_logits(logits: jax.Array, temperature: jax.Array | float) -> jax.Array:
    """softmax(logits / T) in fp32; T ≤ 0 gives the one-hot argmax distribution."""
    logits = logits.astype(jnp.float32)
    t = jnp.asarray(temperature, jnp.float32)
    soft = jax.nn.softmax(logits / jnp.maximum(t, 1e-6), axis=-1)
    hard = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(t > 0, soft, hard)


def sample_logits(key: jax.Array, logits: jax.Array, temperature: jax.Array | float,
                  top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Samples token ids [...] from logits [..., V]; greedy when temperature ≤ 0."""
    t = jnp.asarray(temperature, jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    filtered = filter_logits(logits, top_k, top_p)
    sampled = jax.random.categorical(key, filtered / jnp.maximum(t, 1e-6), axis=-1)
    return jnp.where(t > 0, sampled, greedy).astype(jnp.int32)


def sample_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Samples from explicit probabilities [..., V] (inverse CDF with one uniform per row)."""
    u = jax.random.uniform(key, probs.shape[:-1] + (1,), jnp.float32)
    cdf = jnp.cumsum(probs, axis=-1)
    cdf = cdf / jnp.maximum(cdf[..., -1:], 1e-30)
    idx = jnp.sum(cdf <= u, axis=-1)
    return jnp.minimum(idx, probs.shape[-1] - 1).astype(jnp.int32)
