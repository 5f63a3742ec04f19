"""What `dspark_jax.huge_pages` does on this machine: the kernel's transparent huge page mode,
glibc's version, `GLIBC_TUNABLES` as this process sees it, and how much of a 64 MiB block from
glibc's `malloc` (every page touched, as XLA's host buffers are) the kernel placed on huge pages
(`AnonHugePages` of /proc/self/smaps_rollup). numpy asks for huge pages for its own large
arrays, so the block is taken from `malloc` directly.

  python -m dspark_jax.bench.huge_pages                     # as every `python -m dspark_jax.…`
  DSPARK_JAX_HUGE_PAGES=0 python -m dspark_jax.bench.huge_pages    # without
"""

from __future__ import annotations

import ctypes
import os

from dspark_jax.huge_pages import anon_huge_pages_kib, glibc_version, thp_mode

BLOCK = 64 << 20


def malloc_block_on_huge_pages_mib() -> int | None:
    """MiB of a fresh, fully written `malloc(64 MiB)` block on huge pages (None: unknown)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = anon_huge_pages_kib()
    block = libc.malloc(BLOCK)
    if not block:
        return None
    try:
        ctypes.memset(block, 1, BLOCK)
        after = anon_huge_pages_kib()
    finally:
        libc.free(block)
    return None if before is None or after is None else max(0, after - before) // 1024


def main() -> dict:
    version = glibc_version()
    facts = {"thp_mode": thp_mode(), "glibc": ".".join(map(str, version)) if version else None,
             "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
             "malloc_64mib_on_huge_pages_mib": malloc_block_on_huge_pages_mib()}
    for k, v in facts.items():
        print(f"{k:32s}{v}")
    return facts


if __name__ == "__main__":
    main()
