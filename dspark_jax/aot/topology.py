"""The TPU side of ahead-of-time compilation: a topology's compile-only devices from `libtpu`
(`jax.experimental.topologies`; no TPU is opened, so a CPU-only machine compiles for a pod
slice) and each chip generation's HBM size, HBM bandwidth and bf16 peak, against which the
training step (SPEC §4's batch on a slice, `aot/train_step.py`) and the serving round (paper
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
    with _xla_flags_for_libtpu():
        try:
            devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                                        **kw).devices)
        except Exception as e:  # libtpu names the problem (bad generation / shape)
            raise AotError(f"--topology {topology!r}: {e}") from None
        _parse_libtpu_flags(devices[0])
    return devices


_LIBTPU_FLAGS_PARSED = False


@contextlib.contextmanager
def _xla_flags_for_libtpu() -> Iterator[None]:
    """libtpu carries its own XLA, which reads $XLA_FLAGS once, at its first compilation, and
    aborts the process on a flag it does not know. The CPU backend's flags (`--xla_cpu_*`,
    e.g. `--xla_cpu_use_fusion_emitters`, newer than libtpu's XLA) configure nothing there, so
    they are hidden from it meanwhile; the CPU backend read its flags when it started."""
    old = os.environ.get("XLA_FLAGS")
    if old is None:
        yield
        return
    os.environ["XLA_FLAGS"] = " ".join(f for f in old.split()
                                       if not f.lstrip("-").startswith("xla_cpu_"))
    try:
        yield
    finally:
        os.environ["XLA_FLAGS"] = old


def _parse_libtpu_flags(device: Any) -> None:
    """Makes libtpu read $XLA_FLAGS now (a trivial compilation), under `_xla_flags_for_libtpu`."""
    global _LIBTPU_FLAGS_PARSED
    if _LIBTPU_FLAGS_PARSED:
        return
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    x = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=SingleDeviceSharding(device))
    jax.jit(lambda v: v + 1).lower(x).compile()
    _LIBTPU_FLAGS_PARSED = True
