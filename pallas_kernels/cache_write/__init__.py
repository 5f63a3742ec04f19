"""Every layer's new K/V rows into per-layer caches in one kernel: `write_rows`; a drafter's
context rows, keys normed and rotated on the way, `write_context_rows`; oracles
`ref_write_rows`, `ref_write_context_rows`."""

from pallas_kernels.cache_write.kernel import (context_rows_take, ref_write_context_rows,
                                               ref_write_rows, write_context_rows, write_rows)

__all__ = ["context_rows_take", "ref_write_context_rows", "ref_write_rows",
           "write_context_rows", "write_rows"]
