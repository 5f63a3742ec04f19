"""Where the decoding Pallas kernels run (SPEC §9; DEVICE.md): `pallas_kernels/verify` (the
acceptance rule) and `pallas_kernels/markov_sample` (Markov head sampling).

A kernel is offered on a backend only where it is no slower than the pure-JAX path it replaces,
and neither is on an accelerator (figures: `python -m dspark_jax.bench.kernel_traffic`):
- GPU: both Triton kernels lose to XLA on an H200. The Markov sampler's grid is one program per
  block of rows, so at a few requests one program streams all of W2 for every slot while XLA
  spreads the same product over the chip; the verification kernel's per-row programs do the
  same with the probabilities. (A GPU round drafts with the tiled Markov kernels instead,
  `markov_sample_tiled`, two kernels a slot over the whole chip, without a sampler flag:
  `decoding.speculative_round`; and every other draw from a row of probabilities with
  `row_sample`, two kernels where XLA's inverse CDF takes nine or ten, and fewer bytes:
  `acceptance_rule.draw_rows`.)
- TPU: compiled for a v5e, the Markov kernel streams W2 twice a slot (its two passes) and its
  wrapper pads W1, W2 and the logits every call: more than twice the HBM traffic of the pure-JAX
  path at B = 1; the verification kernel's padding doubles the traffic at B = 16.
On a CPU the kernels run in the Pallas interpreter, which is how the tests hold them to their
oracles; the engine never picks them by default. The lowerings still compile for both
accelerators (tests/kernels/test_lowering.py), for whoever tunes them."""

from __future__ import annotations

import jax

# backends a "pallas" sampler / verifier may run on: the interpreter on CPU (tests)
OFFERED_BACKENDS = ("cpu",)
_WHY = {"gpu": "its Triton kernel is slower than the pure-JAX path there",
        "tpu": "its Mosaic kernel reads more HBM than the pure-JAX path there"}


def check_offered(what: str, backend: str | None = None) -> None:
    """Raises ValueError naming `what` (e.g. "sampler='pallas'") when the Pallas kernels are not
    offered on `backend` (default: JAX's default backend)."""
    backend = backend or jax.default_backend()
    if backend not in OFFERED_BACKENDS:
        why = _WHY.get(backend, "it is not built for this backend")
        raise ValueError(f"{what} is not offered on {backend}: {why} (python -m "
                         "dspark_jax.bench.kernel_traffic measures it); use 'jax'")


def kernel_mode() -> dict[str, object]:
    """Keyword arguments for `verify` / `markov_sample` on JAX's default backend: the Pallas
    interpreter on a CPU; an accelerator raises (`check_offered`)."""
    check_offered("a Pallas decoding kernel")
    return dict(interpret=True, backend="triton")
