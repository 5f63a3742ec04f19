"""XLA flags for every test process: pytest's own and the subprocesses tests start.

XLA:CPU spends most of a test's time compiling: tiny shapes run almost at once, while LLVM's
optimisation passes are slow on every program. Optimisation level 0 cuts the compile CPU time
markedly and keeps every numeric tolerance. XLA:CPU's MLIR fusion emitters compile slower than
its LLVM IR emitters: turning them off (`--xla_cpu_use_fusion_emitters=false`) cuts the compile
CPU time again (figures: BENCHMARKS.md). Each program's code is generated in one piece
(`--xla_cpu_parallel_codegen_split_count=1`): two test workers already keep both cores busy,
and test processes have died intermittently of a segfault inside XLA:CPU's compile; codegen
on one thread takes its thread pool out of that path (the dated log has the runs).
"""

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")


def cpu_flags(devices: int) -> str:
    """XLA_FLAGS for a CPU process with `devices` fake devices, compiled fast."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
