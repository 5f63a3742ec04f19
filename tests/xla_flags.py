"""XLA flags for every test process: pytest's own and the subprocesses tests start.

XLA:CPU spends most of a test's time compiling: tiny shapes run in microseconds, while LLVM's
optimisation passes take seconds a program. Optimisation level 0 cuts compile CPU by 30-40%
(tests/train/test_dspark_training.py: 231 s -> 137 s user on the 2-core CI machine) and keeps
every numeric tolerance. XLA:CPU's newer MLIR fusion emitters compile slower still than its
older LLVM IR emitters: turning them off (`--xla_cpu_use_fusion_emitters=false`) halves the
compile CPU again (tests/serving/test_engine.py's six greedy-mode tests: 71-75 s -> 35-42 s user,
two interleaved runs each).
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def cpu_flags(devices: int) -> str:
    """XLA_FLAGS for a CPU process with `devices` fake devices, compiled fast."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
