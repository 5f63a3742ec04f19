"""Speculative-verification kernel (SPEC §1 steps 4–5): `verify`, its oracle `ref_verify`."""

from pallas_kernels.verify.kernel import (DEFAULT_BLOCK_V, RESIDUAL_EPS, VerifyResult,
                                          check_verify_inputs, ref_verify, verify)

__all__ = ["DEFAULT_BLOCK_V", "RESIDUAL_EPS", "VerifyResult", "check_verify_inputs", "ref_verify",
           "verify"]
