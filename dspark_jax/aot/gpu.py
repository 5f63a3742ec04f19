"""The GPU side of ahead-of-time compilation: compile-only CUDA devices on a machine with no GPU
(`jax.experimental.topologies` with a `GpuTargetConfigProto`, the "deviceless" compile of
JAX's own AOT tests), and each GPU's HBM size, bandwidth and dense bf16 peak, against which a
decoding step (paper §3.2.2, §5.2–5.3) is measured.

Needs the CUDA plugin without its CUDA wheels: ``pip install --no-deps
jax-cuda13-plugin==<jaxlib's version> jax-cuda13-pjrt`` (the `gpu-aot` extra names them). The
target configs in `gpu_targets/` describe the chips (SM count, memory, bandwidth, compute
capability); no GEMM is autotuned without a device, so the compiled program's structure
(kernels, copies, bytes) is what it shows, not its timings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from typing import Any

from dspark_jax.aot.topology import AotError, GiB, hidden_xla_flags, parse_flags_now

GPU_INSTALL_HINT = ("pip install --no-deps jax-cuda13-plugin==$(python -c 'import jaxlib; "
                    "print(jaxlib.__version__)') jax-cuda13-pjrt==0.11.2")
_TARGETS = pathlib.Path(__file__).with_name("gpu_targets")


@dataclasses.dataclass(frozen=True)
class GpuChip:
    """HBM size and bandwidth, dense bf16 peak (public specifications) and the target config."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    target_config: str      # file in gpu_targets/

    def config_text(self) -> str:
        return (_TARGETS / self.target_config).read_text()


GPU_CHIPS = {
    "h200": GpuChip("h200", 141 * 10**9, 989e12, 4.8e12, "h200.txtpb"),
    "h100": GpuChip("h100", 80 * GiB, 989e12, 3.35e12, "h100.txtpb"),
}


def has_cuda_plugin() -> bool:
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None


def gpu_devices(chip: str, count: int = 1) -> list[Any]:
    """`count` compile-only devices of GPU `chip`, the GPUs of one host (no GPU is opened)."""
    if chip not in GPU_CHIPS:
        raise AotError(f"--chip {chip!r}: known GPUs {sorted(GPU_CHIPS)}")
    if not has_cuda_plugin():
        raise AotError(f"compiling for a GPU without one needs the CUDA plugin: "
                       f"{GPU_INSTALL_HINT}")
    from jax.experimental import topologies

    # besides the CPU compiler's own flags, its fake host devices and the LLVM optimisation
    # level of fast test compiles configure nothing for a GPU program
    with hidden_xla_flags(("xla_cpu_", "xla_force_host_platform_device_count",
                           "xla_backend_optimization_level")):
        try:
            topo = topologies.get_topology_desc(platform="cuda",
                                                target_config=GPU_CHIPS[chip].config_text(),
                                                topology=f"1x1x{count}")
        except Exception as e:   # the plugin names the problem (version, config)
            raise AotError(f"--chip {chip}: the CUDA plugin could not describe the device: "
                           f"{e}") from None
        devices = list(topo.devices)
        parse_flags_now(devices[0])
    return devices
