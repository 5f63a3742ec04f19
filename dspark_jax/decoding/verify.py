"""Lossless verification and the vanilla Markov head's sequential sampler (SPEC §1, §3).

* `rejection_verify` is steps 3–5 of a speculative round (paper §2, the standard
  speculative-sampling rule): accept draft x_k iff u_k < min(1, p_t(x_k) / p_d(x_k)), stop at the
  first rejection and sample the correction from norm(max(p_t − p_d, 0)) (p_t if that mass is
  ≤ 1e-8), or the bonus from p_t,ℓ when all ℓ verified drafts were accepted. The emitted
  tokens are then distributed exactly as the target's, whatever the drafter proposed.
* `sequential_markov_sample` is the drafting side of DSpark's vanilla Markov head (paper §3.2,
  SPEC §3): logits_k = U_k + W2·W1[x_{k−1}], each slot conditioned on the token actually sampled
  at the slot before it.

Both are pure-JAX, jit-able and batched, and are the oracles that the Pallas kernels in
`pallas_kernels/{verify,markov_sample}` must reproduce. To make that reproduction exact, all
randomness enters as explicit uniforms (`*_with_uniforms`) and every categorical draw is an
inverse-CDF search (`inverse_cdf_sample`); the key-taking wrappers only draw those uniforms.
Temperature is folded into the probabilities by the caller (`sampling.probs_from_logits`); T = 0
gives one-hot rows, for which the rule reduces to exact greedy prefix matching.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from dspark_jax.decoding.sampling import probs_from_logits

__all__ = [
    "RESIDUAL_EPS",
    "VerifyResult",
    "Verifier",
    "VERIFIERS",
    "get_verifier",
    "inverse_cdf_sample",
    "verify_uniforms",
    "rejection_verify",
    "rejection_verify_with_uniforms",
    "pallas_verify",
    "markov_uniforms",
    "markov_logits_step",
    "sequential_markov_sample",
    "sequential_markov_sample_with_uniforms",
]

# Residual mass below which the correction is drawn from p_t instead (SPEC §1 step 5).
RESIDUAL_EPS = 1e-8


class VerifyResult(NamedTuple):
    """Outcome of verifying one round for every batch row."""

    num_accepted: jax.Array   # [B] int32 in [0, ℓ]
    next_token: jax.Array     # [B] int32: correction at the first rejected slot, or the bonus
    accepted_mask: jax.Array  # [B, γ] bool: a prefix of length num_accepted


class Verifier(Protocol):
    """Anything that verifies a round like `rejection_verify` (a kernel can stand in for it)."""

    def __call__(self, key: jax.Array, target_probs: jax.Array, draft_probs: jax.Array,
                 draft_tokens: jax.Array, verify_len: jax.Array) -> VerifyResult: ...


# ------------------------------------------------------------------------------------------
# Inverse-CDF sampling: the one sampling convention shared with the kernels
# ------------------------------------------------------------------------------------------

def inverse_cdf_sample(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Index i with cdf[i−1] ≤ u·total < cdf[i]: weights [..., V] ≥ 0, u [...] in [0, 1).

    The weights need not be normalised. The result is clamped to the last index with positive
    weight, so a rounding slip at the top of the CDF can never return a zero-weight (e.g. padded)
    token; an all-zero row returns 0.
    """
    w = weights.astype(jnp.float32)
    cdf = jnp.cumsum(w, axis=-1)                                             # [..., V]
    thr = u.astype(jnp.float32) * cdf[..., -1]                               # [...]
    count = jnp.sum((cdf <= thr[..., None]).astype(jnp.int32), axis=-1)
    idx = jax.lax.broadcasted_iota(jnp.int32, w.shape, w.ndim - 1)
    last_pos = jnp.max(jnp.where(w > 0, idx, 0), axis=-1)
    return jnp.minimum(count, last_pos).astype(jnp.int32)


# ------------------------------------------------------------------------------------------
# Verification (SPEC §1 steps 3–5)
# ------------------------------------------------------------------------------------------

def verify_uniforms(key: jax.Array, batch: int, gamma: int) -> tuple[jax.Array, jax.Array]:
    """(accept_u [B, γ], sample_u [B]) f32 in [0, 1): the only randomness of a verification."""
    k_acc, k_smp = jax.random.split(key)
    return (jax.random.uniform(k_acc, (batch, gamma), jnp.float32),
            jax.random.uniform(k_smp, (batch,), jnp.float32))


def rejection_verify_with_uniforms(accept_u: jax.Array, sample_u: jax.Array,
                                   target_probs: jax.Array, draft_probs: jax.Array,
                                   draft_tokens: jax.Array, verify_len: jax.Array
                                   ) -> VerifyResult:
    """Lossless verification with explicit uniforms.

    accept_u [B, γ] and sample_u [B] in [0, 1); target_probs [B, γ+1, V] (row k is p_t for the
    token at slot k+1; row γ is the bonus row); draft_probs [B, γ, V]; draft_tokens [B, γ] in
    [0, V); verify_len [B] in [0, γ] (clipped). Probabilities may be any float dtype (computed in
    f32).
    """
    B, G1, V = target_probs.shape
    G = G1 - 1
    tp = target_probs.astype(jnp.float32)                                    # [B, γ+1, V]
    dp = draft_probs.astype(jnp.float32)                                     # [B, γ, V]
    ell = jnp.clip(verify_len.astype(jnp.int32), 0, G)                       # [B]
    x = jnp.clip(draft_tokens.astype(jnp.int32), 0, V - 1)                   # [B, γ]

    pt_x = jnp.take_along_axis(tp[:, :G], x[..., None], axis=-1)[..., 0]     # [B, γ]
    pd_x = jnp.take_along_axis(dp, x[..., None], axis=-1)[..., 0]            # [B, γ]
    # u < min(1, p_t/p_d) written without the division: identical for u ∈ [0, 1) and p_d > 0,
    # and a token the drafter gave zero mass is accepted iff the target gives it mass.
    ok = accept_u.astype(jnp.float32) * pd_x < pt_x                          # [B, γ]
    in_len = jnp.arange(G, dtype=jnp.int32)[None, :] < ell[:, None]
    accepted = jnp.cumprod((ok & in_len).astype(jnp.int32), axis=-1) > 0     # stop at 1st reject
    n = jnp.sum(accepted.astype(jnp.int32), axis=-1)                         # [B]

    # The emitted token lives at slot j = n: a correction if j < ℓ, else the bonus from p_t,ℓ.
    rejected = n < ell
    pt_j = jnp.take_along_axis(tp, n[:, None, None], axis=1)[:, 0]           # [B, V]
    if G > 0:
        pd_j = jnp.take_along_axis(dp, jnp.minimum(n, G - 1)[:, None, None], axis=1)[:, 0]
    else:
        pd_j = jnp.zeros_like(pt_j)
    resid = jnp.maximum(pt_j - pd_j, 0.0)                                    # [B, V]
    use_resid = rejected & (jnp.sum(resid, axis=-1) > RESIDUAL_EPS)
    dist = jnp.where(use_resid[:, None], resid, pt_j)
    next_token = inverse_cdf_sample(dist, sample_u)
    return VerifyResult(n, next_token, accepted)


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

    interpret=None runs the compiled kernel on GPU and the interpreter elsewhere.
    """
    from pallas_kernels.verify.kernel import verify as verify_kernel  # kernels depend on us

    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    B, G1, _ = target_probs.shape
    accept_u, sample_u = verify_uniforms(key, B, G1 - 1)
    return verify_kernel(accept_u, sample_u, target_probs, draft_probs, draft_tokens, verify_len,
                         interpret=interpret)


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


def markov_logits_step(base_logits_bv: jax.Array, w1_vr: jax.Array, w2_vr: jax.Array,
                       prev_b: jax.Array) -> jax.Array:
    """logits = U + W2·W1[x_prev] in f32: U [B, V], W1/W2 [V, r] (DeepSpec layout), prev [B]."""
    e_br = jnp.take(w1_vr, prev_b, axis=0).astype(jnp.float32)              # [B, r]
    bias_bv = jnp.einsum("BR,VR->BV", e_br, w2_vr.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
    return base_logits_bv.astype(jnp.float32) + bias_bv


def sequential_markov_sample_with_uniforms(uniforms: jax.Array, base_logits: jax.Array,
                                           w1: jax.Array, w2: jax.Array, anchor: jax.Array,
                                           temperature: jax.Array | float
                                           ) -> tuple[jax.Array, jax.Array]:
    """Samples x_1..x_γ left to right with the vanilla Markov head.

    uniforms [B, γ] in [0, 1); base_logits U [B, γ, V] (any float dtype); w1, w2 [V, r];
    anchor x_0 [B] int; temperature a scalar or [B] (≤ 0 → greedy one-hot).
    Returns (tokens [B, γ] int32, probs p_d [B, γ, V] f32), probs[:, k] being the distribution
    x_{k+1} was drawn from — the draft_probs that verification needs.
    """
    B = base_logits.shape[0]
    t_b1 = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))[:, None]   # [B, 1]
    U_gbv = jnp.moveaxis(base_logits, 1, 0)                                          # [γ, B, V]
    u_gb = jnp.moveaxis(uniforms.astype(jnp.float32), 1, 0)                         # [γ, B]

    def slot(prev_b, xs):
        U_bv, u_b = xs
        probs_bv = probs_from_logits(markov_logits_step(U_bv, w1, w2, prev_b), t_b1)
        tok_b = inverse_cdf_sample(probs_bv, u_b)
        return tok_b, (tok_b, probs_bv)

    _, (toks_gb, probs_gbv) = jax.lax.scan(slot, anchor.astype(jnp.int32), (U_gbv, u_gb))
    return jnp.moveaxis(toks_gb, 0, 1), jnp.moveaxis(probs_gbv, 0, 1)


def sequential_markov_sample(key: jax.Array, base_logits: jax.Array, w1: jax.Array,
                             w2: jax.Array, anchor: jax.Array, temperature: jax.Array | float
                             ) -> tuple[jax.Array, jax.Array]:
    """`sequential_markov_sample_with_uniforms` with uniforms drawn from key."""
    B, G, _ = base_logits.shape
    return sequential_markov_sample_with_uniforms(markov_uniforms(key, B, G), base_logits, w1, w2,
                                                  anchor, temperature)
