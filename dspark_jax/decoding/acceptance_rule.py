"""The acceptance rule: lossless verification of a speculative round (paper §2; SPEC §1
steps 3–5; DeepSpec's evaluator's rejection sampling).

Accept draft x_k iff u_k < min(1, p_t(x_k) / p_d(x_k)), stop at the first rejection and sample
the correction from norm(max(p_t − p_d, 0)) (p_t if that mass is ≤ 1e-8), or the bonus from
p_t,ℓ when all ℓ verified drafts were accepted. The emitted tokens are then distributed exactly
as the target's, whatever the drafter proposed. Temperature is folded into the probabilities by
the caller (`decoding.sampling`); T = 0 gives one-hot rows, for which the rule reduces to exact
greedy prefix matching.

There is one copy of the rule: the pure-JAX oracle `ref_verify` beside its Pallas kernel in
`pallas_kernels/verify` (kernels stand alone; decoding imports them, never the reverse). This
module adds the γ = 0 case of plain decoding, the key-taking wrappers, `VERIFIERS`, the
registry the engine's round picks a rule from by name, and `draw_rows`, the inverse-CDF draw the
rest of decoding makes from a row of probabilities (two kernels on a GPU). All randomness enters as explicit
uniforms (`*_with_uniforms`), so the kernel and the pure-JAX path given the same uniforms emit
the same tokens.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from dspark_jax.decoding.pallas_backend import kernel_mode
from dspark_jax.models import layers as L
from pallas_kernels.common import inverse_cdf_sample
from pallas_kernels.row_sample import row_sample
from pallas_kernels.verify.kernel import RESIDUAL_EPS, VerifyResult, ref_verify
from pallas_kernels.verify.kernel import verify as verify_kernel

__all__ = [
    "RESIDUAL_EPS",
    "VerifyResult",
    "Verifier",
    "VERIFIERS",
    "draw_rows",
    "get_verifier",
    "inverse_cdf_sample",
    "verify_uniforms",
    "rejection_verify",
    "rejection_verify_with_uniforms",
    "pallas_verify",
    "pallas_verify_with_uniforms",
    "greedy_verify",
]


class Verifier(Protocol):
    """A verification rule with explicit uniforms, like `rejection_verify_with_uniforms` (a
    kernel can stand in for it)."""

    def __call__(self, accept_u: jax.Array, sample_u: jax.Array, target_probs: jax.Array,
                 draft_probs: jax.Array, draft_tokens: jax.Array,
                 verify_len: jax.Array) -> VerifyResult: ...


def verify_uniforms(key: jax.Array, batch: int, gamma: int) -> tuple[jax.Array, jax.Array]:
    """(accept_u [B, γ], sample_u [B]) f32 in [0, 1): the only randomness of a verification."""
    k_acc, k_smp = jax.random.split(key)
    return (jax.random.uniform(k_acc, (batch, gamma), jnp.float32),
            jax.random.uniform(k_smp, (batch,), jnp.float32))


def draw_rows(probs: jax.Array, u: jax.Array) -> jax.Array:
    """`inverse_cdf_sample(probs, u)`: one draw per row of probs [..., V] with its uniform u
    [...]. Compiled for one GPU, by `row_sample`'s two Triton kernels, where XLA makes the
    cumulative sum over the vocabulary a tree of kernels a draw (same index, barring a u·Σ
    within f32 rounding of a CDF step)."""
    if not L.kernels_called_directly():
        return inverse_cdf_sample(probs, u)

    def gpu(probs: jax.Array, u: jax.Array, interpret: bool) -> jax.Array:
        return row_sample(probs, u, interpret=interpret)

    return L.on_gpu(gpu, inverse_cdf_sample, probs, u)


def _no_drafts(sample_u: jax.Array, target_probs: jax.Array) -> VerifyResult:
    """γ = 0 (plain decoding through the speculative machinery): draw the next token from p_t."""
    B = target_probs.shape[0]
    return VerifyResult(jnp.zeros((B,), jnp.int32),
                        draw_rows(target_probs[:, 0], sample_u),
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


def greedy_verify(target_argmax: jax.Array, draft_tokens: jax.Array,
                  verify_len: jax.Array) -> VerifyResult:
    """The rule for one-hot target rows (T = 0), from the target's argmax alone: accept the
    drafts while each equals the target's argmax at its slot, then emit the argmax at the first
    mismatch (or the bonus slot). Equal to `rejection_verify_with_uniforms` on the one-hot rows
    `probs_from_logits` gives at T = 0, for any draft probabilities and uniforms (p_t(x) = 1
    accepts, 0 rejects; the residual of a one-hot p_t is that one-hot), without building
    [B, γ+1, V] probabilities. target_argmax [B, γ+1], draft_tokens [B, γ], verify_len [B]."""
    B, g = draft_tokens.shape
    ell = jnp.clip(verify_len, 0, g)
    match = (draft_tokens == target_argmax[:, :g]) & (jnp.arange(g)[None] < ell[:, None])
    accepted = jnp.cumprod(match.astype(jnp.int32), axis=1).astype(bool)
    n_acc = jnp.sum(accepted, axis=1).astype(jnp.int32)
    return VerifyResult(n_acc, target_argmax[jnp.arange(B), n_acc].astype(jnp.int32), accepted)


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


# the rules the engine's round verifies with, by name (`EngineSettings(verifier=...)`)
VERIFIERS: dict[str, Verifier] = {"jax": rejection_verify_with_uniforms,
                                  "pallas": pallas_verify_with_uniforms}


def get_verifier(name: str) -> Verifier:
    """The verification rule registered under name ("jax" or "pallas")."""
    try:
        return VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; choose from {sorted(VERIFIERS)}") from None
