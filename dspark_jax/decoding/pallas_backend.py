"""How the decoding Pallas kernels run on this backend (SPEC §9; DEVICE.md): compiled Triton on
GPU, compiled Mosaic on TPU, the interpreter only on CPU. Shared by the acceptance rule
(`pallas_kernels/verify`) and Markov head sampling (`pallas_kernels/markov_sample`)."""

from __future__ import annotations

import jax


def kernel_mode() -> dict[str, object]:
    """Keyword arguments for `verify` / `markov_sample` on JAX's default backend. GPU → compiled
    Triton, TPU → compiled Mosaic; anything else (CPU) → the Pallas interpreter, which is the
    only way a kernel runs there."""
    backend = jax.default_backend()
    if backend == "gpu":
        return dict(interpret=False, backend="triton")
    if backend == "tpu":
        return dict(interpret=False, backend="mosaic")
    return dict(interpret=True, backend="triton")
