"""A decoding layer's residual sum with its RMS norm as one kernel (`add_rms_norm`); oracles
`ref_add_rms_norm`, `ref_rms_norm`."""

from pallas_kernels.norms.kernel import add_rms_norm, ref_add_rms_norm, ref_rms_norm

__all__ = ["add_rms_norm", "ref_add_rms_norm", "ref_rms_norm"]
