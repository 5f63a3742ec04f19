"""Vanilla Markov-head sampling kernel (SPEC §3): `markov_sample`; oracle `ref_markov_sample`."""

from pallas_kernels.markov_sample.kernel import (DEFAULT_BLOCK_V, MAX_TILE_ELEMS,
                                                 check_markov_inputs, default_block_b,
                                                 default_block_v, markov_sample,
                                                 ref_markov_sample)

__all__ = ["DEFAULT_BLOCK_V", "MAX_TILE_ELEMS", "check_markov_inputs", "default_block_b",
           "default_block_v", "markov_sample", "ref_markov_sample"]
