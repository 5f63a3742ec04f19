"""Transparent huge pages for the host memory of a `python -m dspark_jax.…` run.

On a CPU the weights, the KV cache and XLA's buffers are host memory that glibc's `malloc`
hands out in 4 KiB pages. A decode step streams every weight byte, so with 4 KiB pages it takes
a TLB miss every 4 KiB, and in a virtual machine each miss walks two page tables. glibc (2.35
and later) backs its allocations with transparent huge pages (2 MiB) when the tunable
`glibc.malloc.hugetlb=1` is set, which glibc reads only when the process starts. So when the
package is run as a program (`python -m dspark_jax.<module>`), the interpreter restarts itself
once, before anything heavy is imported, with that tunable added to `GLIBC_TUNABLES`: the same
arguments, environment and process id. It does so only on Linux with glibc ≥ 2.35 and the
kernel's huge-page mode `madvise` (under `always` the kernel already uses them, under `never`
nothing would). `DSPARK_JAX_HUGE_PAGES=0` turns it off; importing the package as a library
never restarts anything. The measured effect is in BENCHMARKS.md ("Huge pages").

`python -m dspark_jax.bench.huge_pages` shows what a machine does with it.
"""

from __future__ import annotations

import os
import sys

ENV = "DSPARK_JAX_HUGE_PAGES"
TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), None if unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def module_run(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether the package is being imported to run one of its modules as the program
    (`python [options] -m dspark_jax[.…]`): while the interpreter locates a `-m` module its
    `sys.argv[0]` is "-m"."""
    if argv[:1] != ["-m"]:
        return False
    return any(a == "-m" and (m == "dspark_jax" or m.startswith("dspark_jax."))
               for a, m in zip(orig_argv[1:], orig_argv[2:]))


def restart_needed(environ: dict[str, str], argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this process should restart itself with the tunable (module docstring)."""
    return (environ.get(ENV, "1") != "0"
            and TUNABLE not in environ.get("GLIBC_TUNABLES", "").split(":")
            and sys.platform.startswith("linux") and module_run(argv, orig_argv)
            and thp_mode() == "madvise" and (glibc_version() or (0, 0)) >= (2, 35))


def restart_with_huge_pages() -> None:
    """Replaces the process with itself plus `GLIBC_TUNABLES=…:glibc.malloc.hugetlb=1` when
    `restart_needed`; returns (doing nothing) otherwise or if the restart cannot be made."""
    argv = list(getattr(sys, "orig_argv", []) or [])
    if not restart_needed(dict(os.environ), list(sys.argv), argv):
        return
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES", ""), TUNABLE) if t)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    try:
        os.execve(sys.executable, argv, dict(os.environ, GLIBC_TUNABLES=tunables))
    except OSError:
        return


def anon_huge_pages_kib(path: str = "/proc/self/smaps_rollup") -> int | None:
    """This process's anonymous memory on transparent huge pages, KiB (None: not reported)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


__all__ = ["anon_huge_pages_kib", "ENV", "TUNABLE", "glibc_version", "module_run", "restart_needed",
           "restart_with_huge_pages", "thp_mode"]
