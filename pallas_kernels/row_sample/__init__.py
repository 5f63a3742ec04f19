"""Inverse-CDF draws from rows of probabilities across the whole GPU (SPEC §1 steps 1 and 3):
`row_sample`, two Triton kernels a draw; oracle `pallas_kernels.common.inverse_cdf_sample`."""

from pallas_kernels.row_sample.kernel import DEFAULT_BLOCK_V, row_sample

__all__ = ["DEFAULT_BLOCK_V", "row_sample"]
