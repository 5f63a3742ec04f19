"""The compile-only devices of a slice, TPU or GPU: a TPU topology's from `libtpu`
(`topology.topology_devices`) or the GPUs of one host from the CUDA plugin (`gpu.gpu_devices`),
with the chip facts the reports measure against."""

from __future__ import annotations

from typing import Any

from dspark_jax.aot.gpu import GPU_CHIPS, gpu_devices
from dspark_jax.aot.topology import AotError, chip_for, topology_devices


def gpu_topology(topology: str) -> tuple[str, int] | None:
    """("h200", 8) for a GPU topology "h200:8" (8 GPUs of one host), None for a TPU one."""
    chip, _, count = topology.partition(":")
    if chip not in GPU_CHIPS:
        return None
    if not count.isdigit() or int(count) < 1:
        raise AotError(f"--topology {topology!r}: a GPU topology is CHIP:COUNT, the GPUs of one "
                       f"host (e.g. {chip}:8)")
    return chip, int(count)


def slice_devices(topology: str, num_slices: int = 1) -> tuple[list[Any], Any]:
    """(compile-only devices, chip facts) of a TPU topology ("v5p:2x4x4", `topology_devices`)
    or of a GPU host ("h200:8": eight H200s, compiled without a GPU, `gpu.gpu_devices`)."""
    gpus = gpu_topology(topology)
    if gpus is None:
        devices = topology_devices(topology, num_slices)
        return devices, chip_for(devices[0].device_kind)
    if num_slices != 1:
        raise AotError(f"--num-slices is for TPU slices, not the GPU topology {topology!r}")
    return gpu_devices(gpus[0], gpus[1]), GPU_CHIPS[gpus[0]]
