"""How the decoding Pallas kernels run on this backend (SPEC §9; DEVICE.md): compiled Mosaic on
TPU, the interpreter on CPU; on GPU they are not offered. Shared by the acceptance rule
(`pallas_kernels/verify`) and Markov head sampling (`pallas_kernels/markov_sample`).

A kernel is offered on a backend only where it is no slower than the pure-JAX path it replaces.
On an H200 both Triton lowerings lose to XLA's (figures: BENCHMARKS.md, "GPU (H200)"): the
Markov sampler's grid is one program per block of rows, so at a few requests one program
streams all of W2 for every slot while XLA spreads the same product over the whole chip, and
the verification kernel's per-row programs do the same with the target's probabilities. The
Triton lowerings still compile (tests/kernels/test_lowering.py), for whoever tunes them."""

from __future__ import annotations

import jax

# backends a "pallas" sampler / verifier may run on: TPU compiled, CPU interpreted (tests)
OFFERED_BACKENDS = ("tpu", "cpu")


def check_offered(what: str, backend: str | None = None) -> None:
    """Raises ValueError naming `what` (e.g. "sampler='pallas'") when the Pallas kernels are not
    offered on `backend` (default: JAX's default backend)."""
    backend = backend or jax.default_backend()
    if backend not in OFFERED_BACKENDS:
        raise ValueError(f"{what} is not offered on {backend}: its Triton kernel is slower than "
                         "the pure-JAX path there (BENCHMARKS.md, \"GPU (H200)\"); use 'jax'")


def kernel_mode() -> dict[str, object]:
    """Keyword arguments for `verify` / `markov_sample` on JAX's default backend: TPU → compiled
    Mosaic, CPU → the Pallas interpreter (the only way a kernel runs there); a GPU raises
    (`check_offered`)."""
    backend = jax.default_backend()
    check_offered("a Pallas decoding kernel", backend)
    if backend == "tpu":
        return dict(interpret=False, backend="mosaic")
    return dict(interpret=True, backend="triton")
