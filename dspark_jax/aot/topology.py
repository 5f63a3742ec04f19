"""The TPU side of ahead-of-time compilation: a topology's compile-only devices from `libtpu`
(`jax.experimental.topologies`; no TPU is opened, so a CPU-only machine compiles for a pod
slice) and each chip generation's HBM size, HBM bandwidth and bf16 peak, against which the
training step (SPEC §4's batch on a slice, `aot/training.py`) and the serving round (paper
§5.2–5.3, `aot/decode.py`) are measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from typing import Any, Iterator

GiB = 1024 ** 3
INSTALL_HINT = "pip install -e '.[tpu]'"


class AotError(ValueError):
    """A usage problem (the message says what to change)."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip HBM size and bandwidth and dense bf16 peak (public TPU specifications)."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float


CHIPS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1228e9),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9),
}
_DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
                 "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def libtpu_version() -> str:
    try:
        import libtpu
        v = getattr(libtpu, "__version__", "")
    except ImportError:
        return ""
    if not v:
        from importlib.metadata import version
        v = version("libtpu")
    return v


def chip_for(device_kind: str) -> Chip:
    for kind, name in sorted(_DEVICE_KINDS.items(), key=lambda kv: -len(kv[0])):
        if device_kind.startswith(kind):
            return CHIPS[name]
    raise AotError(f"unknown TPU device kind {device_kind!r}; known: {sorted(_DEVICE_KINDS)}")


def topology_devices(topology: str, num_slices: int = 1) -> list[Any]:
    """Compile-only devices of a TPU topology such as "v5p:2x4x4" (needs libtpu, not a TPU)."""
    if not has_libtpu():
        raise AotError(f"compiling for a TPU topology needs libtpu: {INSTALL_HINT}")
    # compile-only: no TPU is opened, so several compiling processes may share libtpu
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    kw = {"num_slices": num_slices} if num_slices > 1 else {}
    with hidden_xla_flags(("xla_cpu_",)):
        try:
            devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                                        **kw).devices)
        except Exception as e:  # libtpu names the problem (bad generation / shape)
            raise AotError(f"--topology {topology!r}: {e}") from None
        parse_flags_now(devices[0])
    return devices


_FLAGS_PARSED: set[str] = set()


@contextlib.contextmanager
def hidden_xla_flags(prefixes: tuple[str, ...]) -> Iterator[None]:
    """$XLA_FLAGS without the flags that start with `prefixes`, meanwhile. A compile-only
    backend (libtpu, the CUDA plugin) carries its own XLA, which reads $XLA_FLAGS once, at its
    first compilation, and aborts the process on a flag it does not know; the CPU backend's
    flags configure nothing there, and the CPU backend read them when it started."""
    old = os.environ.get("XLA_FLAGS")
    if old is None:
        yield
        return
    os.environ["XLA_FLAGS"] = " ".join(f for f in old.split()
                                       if not f.lstrip("-").startswith(prefixes))
    try:
        yield
    finally:
        os.environ["XLA_FLAGS"] = old


def parse_flags_now(device: Any) -> None:
    """Makes `device`'s backend read $XLA_FLAGS now, with a trivial compilation (once per
    platform), under `hidden_xla_flags`."""
    if device.platform in _FLAGS_PARSED:
        return
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    x = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=SingleDeviceSharding(device))
    jax.jit(lambda v: v + 1).lower(x).compile()
    _FLAGS_PARSED.add(device.platform)
