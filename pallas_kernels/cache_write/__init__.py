"""Every layer's new K/V rows into per-layer caches in one kernel: `write_rows`; oracle
`ref_write_rows`."""

from pallas_kernels.cache_write.kernel import ref_write_rows, write_rows

__all__ = ["ref_write_rows", "write_rows"]
