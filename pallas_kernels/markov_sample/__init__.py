"""Vanilla Markov-head sampling kernels (SPEC §3): `markov_sample` (one program a block of rows
walks every slot), `markov_sample_tiled` (two kernels a slot spread over the vocabulary: what a
GPU round drafts with); oracle `ref_markov_sample`."""

from pallas_kernels.markov_sample.kernel import (DEFAULT_BLOCK_V, MAX_TILE_ELEMS,
                                                 check_markov_inputs, default_block_b,
                                                 default_block_v, markov_sample,
                                                 ref_markov_sample)
from pallas_kernels.markov_sample.tiled import markov_sample_tiled, tiled_block_v

__all__ = ["DEFAULT_BLOCK_V", "MAX_TILE_ELEMS", "check_markov_inputs", "default_block_b",
           "default_block_v", "markov_sample", "markov_sample_tiled", "ref_markov_sample",
           "tiled_block_v"]
