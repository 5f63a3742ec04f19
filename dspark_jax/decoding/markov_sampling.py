"""Markov head sampling: the drafting side of DSpark's vanilla Markov head (paper §3.2; SPEC §3
inference; DeepSpec's `markov_head` sampling loop).

logits_k = U_k + W2·W1[x_{k−1}]: the γ slots of a parallel block are sampled left to right,
each conditioned on the token actually sampled at the slot before it (x_0 is the anchor). The
probabilities each slot was drawn from are returned with the tokens: verification
(`decoding.acceptance_rule`) needs them as p_d.

There is one copy of the sampler: the pure-JAX oracle `ref_markov_sample` beside its batched
Pallas kernel in `pallas_kernels/markov_sample`. This module adds the key-taking wrapper and the
kernel path the engine's round runs with `sampler="pallas"`. Every categorical draw is an
inverse-CDF search with an explicit uniform, so kernel and oracle emit the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.decoding.pallas_backend import kernel_mode
from pallas_kernels.markov_sample.kernel import markov_sample as markov_sample_kernel
from pallas_kernels.markov_sample.kernel import ref_markov_sample

__all__ = [
    "markov_uniforms",
    "sequential_markov_sample",
    "sequential_markov_sample_with_uniforms",
    "pallas_markov_sample_with_uniforms",
]


def markov_uniforms(key: jax.Array, batch: int, gamma: int) -> jax.Array:
    """One uniform per draft slot, [B, γ] f32 in [0, 1)."""
    return jax.random.uniform(key, (batch, gamma), jnp.float32)


def sequential_markov_sample_with_uniforms(uniforms: jax.Array, base_logits: jax.Array,
                                           w1: jax.Array, w2: jax.Array, anchor: jax.Array,
                                           temperature: jax.Array | float
                                           ) -> tuple[jax.Array, jax.Array]:
    """Samples x_1..x_γ left to right with the vanilla Markov head: the oracle
    `ref_markov_sample`.

    uniforms [B, γ] in [0, 1); base_logits U [B, γ, V] (any float dtype); w1, w2 [V, r];
    anchor x_0 [B] int; temperature a scalar or [B] (≤ 0 → greedy one-hot).
    Returns (tokens [B, γ] int32, probs p_d [B, γ, V] f32), probs[:, k] being the distribution
    x_{k+1} was drawn from — the draft_probs that verification needs.
    """
    return ref_markov_sample(uniforms, base_logits, w1, w2, anchor, temperature)


def pallas_markov_sample_with_uniforms(uniforms: jax.Array, base_logits: jax.Array,
                                       w1: jax.Array, w2: jax.Array, anchor: jax.Array,
                                       temperature: jax.Array | float
                                       ) -> tuple[jax.Array, jax.Array]:
    """`sequential_markov_sample_with_uniforms` through the batched Pallas kernel
    (`kernel_mode` backend): same uniforms → same tokens."""
    return markov_sample_kernel(uniforms, base_logits, w1, w2, anchor, temperature,
                                **kernel_mode())


def sequential_markov_sample(key: jax.Array, base_logits: jax.Array, w1: jax.Array,
                             w2: jax.Array, anchor: jax.Array, temperature: jax.Array | float
                             ) -> tuple[jax.Array, jax.Array]:
    """`sequential_markov_sample_with_uniforms` with uniforms drawn from key."""
    B, G, _ = base_logits.shape
    return sequential_markov_sample_with_uniforms(markov_uniforms(key, B, G), base_logits, w1, w2,
                                                  anchor, temperature)
