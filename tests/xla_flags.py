"""XLA flags for every test process: pytest's own and the subprocesses tests start.

XLA:CPU spends most of a test's time compiling: tiny shapes run almost at once, while LLVM's
optimisation passes are slow on every program. Optimisation level 0 cuts the compile CPU time
markedly and keeps every numeric tolerance. XLA:CPU's MLIR fusion emitters compile slower than
its LLVM IR emitters: turning them off (`--xla_cpu_use_fusion_emitters=false`) cuts the compile
CPU time again (figures: BENCHMARKS.md).
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def cpu_flags(devices: int) -> str:
    """XLA_FLAGS for a CPU process with `devices` fake devices, compiled fast."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
