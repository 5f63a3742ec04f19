"""Lossless verification and the vanilla Markov head's sequential sampler (SPEC §1, §3).

* `rejection_verify` is steps 3–5 of a speculative round (paper §2, the standard
  speculative-sampling rule): accept draft x_k iff u_k < min(1, p_t(x_k) / p_d(x_k)), stop at the
  first rejection and sample the correction from norm(max(p_t − p_d, 0)) (p_t if that mass is
  ≤ 1e-8), or the bonus from p_t,ℓ when all ℓ verified drafts were accepted. The emitted
  tokens are then distributed exactly as the target's, whatever the drafter proposed.
* `sequential_markov_sample` is the drafting side of DSpark's vanilla Markov head (paper §3.2,
  SPEC §3): logits_k = U_k + W2·W1[x_{k−1}], each slot conditioned on the token actually sampled
  at the slot before it.

There is one copy of each rule: the pure-JAX oracles `ref_verify` / `ref_markov_sample` that
sit beside their Pallas kernels in `pallas_kernels/{verify,markov_sample}` (kernels stand alone;
decoding imports them, never the reverse). This module adds the key-taking wrappers, the γ = 0
case of plain decoding, and `kernel_mode`, which picks how the kernels run on this backend
(compiled Triton on GPU, compiled Mosaic on TPU, the interpreter only on CPU). All randomness
enters as explicit uniforms (`*_with_uniforms`) and every categorical draw is an inverse-CDF
search (`inverse_cdf_sample`), so a kernel and the pure-JAX path given the same uniforms emit
the same tokens. Temperature is folded into the probabilities by the caller
(`sampling.probs_from_logits`); T = 0 gives one-hot rows, for which the rule reduces to exact
greedy prefix matching.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from pallas_kernels.common import inverse_cdf_sample
from pallas_kernels.markov_sample.kernel import markov_sample as markov_sample_kernel
from pallas_kernels.markov_sample.kernel import ref_markov_sample
from pallas_kernels.verify.kernel import RESIDUAL_EPS, VerifyResult, ref_verify
from pallas_kernels.verify.kernel import verify as verify_kernel

__all__ = [
    "RESIDUAL_EPS",
    "VerifyResult",
    "Verifier",
    "VERIFIERS",
    "get_verifier",
    "inverse_cdf_sample",
    "kernel_mode",
    "verify_uniforms",
    "rejection_verify",
    "rejection_verify_with_uniforms",
    "pallas_verify",
    "pallas_verify_with_uniforms",
    "markov_uniforms",
    "sequential_markov_sample",
    "sequential_markov_sample_with_uniforms",
    "pallas_markov_sample_with_uniforms",
]


class Verifier(Protocol):
    """Anything that verifies a round like `rejection_verify` (a kernel can stand in for it)."""

    def __call__(self, key: jax.Array, target_probs: jax.Array, draft_probs: jax.Array,
                 draft_tokens: jax.Array, verify_len: jax.Array) -> VerifyResult: ...


def kernel_mode() -> dict[str, object]:
    """How the Pallas kernels run on JAX's default backend: keyword arguments for
    `verify` / `markov_sample`. GPU → compiled Triton, TPU → compiled Mosaic; anything else
    (CPU) → the Pallas interpreter, which is the only way a kernel runs there."""
    backend = jax.default_backend()
    if backend == "gpu":
        return dict(interpret=False, backend="triton")
    if backend == "tpu":
        return dict(interpret=False, backend="mosaic")
    return dict(interpret=True, backend="triton")


# ------------------------------------------------------------------------------------------
# Verification (SPEC §1 steps 3–5)
# ------------------------------------------------------------------------------------------

def verify_uniforms(key: jax.Array, batch: int, gamma: int) -> tuple[jax.Array, jax.Array]:
    """(accept_u [B, γ], sample_u [B]) f32 in [0, 1): the only randomness of a verification."""
    k_acc, k_smp = jax.random.split(key)
    return (jax.random.uniform(k_acc, (batch, gamma), jnp.float32),
            jax.random.uniform(k_smp, (batch,), jnp.float32))


def _no_drafts(sample_u: jax.Array, target_probs: jax.Array) -> VerifyResult:
    """γ = 0 (plain decoding through the speculative machinery): draw the next token from p_t."""
    B = target_probs.shape[0]
    return VerifyResult(jnp.zeros((B,), jnp.int32),
                        inverse_cdf_sample(target_probs[:, 0], sample_u),
                        jnp.zeros((B, 0), bool))


def rejection_verify_with_uniforms(accept_u: jax.Array, sample_u: jax.Array,
                                   target_probs: jax.Array, draft_probs: jax.Array,
                                   draft_tokens: jax.Array, verify_len: jax.Array
                                   ) -> VerifyResult:
    """Lossless verification with explicit uniforms: the kernel package's oracle `ref_verify`.

    accept_u [B, γ] and sample_u [B] in [0, 1); target_probs [B, γ+1, V] (row k is p_t for the
    token at slot k+1; row γ is the bonus row); draft_probs [B, γ, V]; draft_tokens [B, γ] in
    [0, V); verify_len [B] in [0, γ] (clipped). γ = 0 samples the next token from p_t.
    """
    if target_probs.shape[1] == 1:
        return _no_drafts(sample_u, target_probs)
    return ref_verify(accept_u, sample_u, target_probs, draft_probs, draft_tokens, verify_len)


def pallas_verify_with_uniforms(accept_u: jax.Array, sample_u: jax.Array,
                                target_probs: jax.Array, draft_probs: jax.Array,
                                draft_tokens: jax.Array, verify_len: jax.Array
                                ) -> VerifyResult:
    """`rejection_verify_with_uniforms` through the Pallas kernel (`kernel_mode` backend)."""
    if target_probs.shape[1] == 1:
        return _no_drafts(sample_u, target_probs)
    return verify_kernel(accept_u, sample_u, target_probs, draft_probs, draft_tokens,
                         verify_len, **kernel_mode())


def rejection_verify(key: jax.Array, target_probs: jax.Array, draft_probs: jax.Array,
                     draft_tokens: jax.Array, verify_len: jax.Array) -> VerifyResult:
    """Lossless verification (shapes as `rejection_verify_with_uniforms`), uniforms from key."""
    B, G1, _ = target_probs.shape
    accept_u, sample_u = verify_uniforms(key, B, G1 - 1)
    return rejection_verify_with_uniforms(accept_u, sample_u, target_probs, draft_probs,
                                          draft_tokens, verify_len)


def pallas_verify(key: jax.Array, target_probs: jax.Array, draft_probs: jax.Array,
                  draft_tokens: jax.Array, verify_len: jax.Array, *,
                  interpret: bool | None = None) -> VerifyResult:
    """`rejection_verify` through the Pallas kernel: same key → same result.

    interpret=None takes `kernel_mode()` (compiled on GPU and TPU, interpreted on CPU).
    """
    mode = kernel_mode()
    if interpret is not None:
        mode["interpret"] = interpret
    B, G1, _ = target_probs.shape
    accept_u, sample_u = verify_uniforms(key, B, G1 - 1)
    return verify_kernel(accept_u, sample_u, target_probs, draft_probs, draft_tokens, verify_len,
                         **mode)


VERIFIERS: dict[str, Verifier] = {"jax": rejection_verify, "pallas": pallas_verify}


def get_verifier(name: str) -> Verifier:
    """The verifier registered under name ("jax" or "pallas")."""
    try:
        return VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; choose from {sorted(VERIFIERS)}") from None


# ------------------------------------------------------------------------------------------
# Vanilla Markov head, sequential sampling (SPEC §3)
# ------------------------------------------------------------------------------------------

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
