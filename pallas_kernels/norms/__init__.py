"""A decoding layer's RMS norms as one kernel each: the residual sum with its norm
(`add_rms_norm`) and the q / k head norms with the rotary embedding (`qk_norm_rope`); oracles
`ref_add_rms_norm`, `ref_qk_norm_rope`."""

from pallas_kernels.norms.kernel import (add_rms_norm, qk_norm_rope, ref_add_rms_norm,
                                         ref_qk_norm_rope)

__all__ = ["add_rms_norm", "qk_norm_rope", "ref_add_rms_norm", "ref_qk_norm_rope"]
