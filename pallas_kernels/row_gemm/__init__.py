"""Products of a few rows with the work before them in one kernel: `norm_gemm` (the residual
sum and RMS norm, then the product), `swiglu_gemm` (the SwiGLU activation, then the product in
split-K parts) and `merge_gemm` (the merge of the attention's cache splits, then the product in
parts); oracles `ref_norm_gemm`, `ref_swiglu_gemm`, `ref_merge_gemm`."""

from pallas_kernels.row_gemm.kernel import (MAX_ROWS, merge_gemm, merge_parts, norm_gemm,
                                            ref_merge_gemm, ref_norm_gemm, ref_swiglu_gemm,
                                            swiglu_gemm, swiglu_parts)

__all__ = ["MAX_ROWS", "merge_gemm", "merge_parts", "norm_gemm", "ref_merge_gemm",
           "ref_norm_gemm", "ref_swiglu_gemm", "swiglu_gemm", "swiglu_parts"]
