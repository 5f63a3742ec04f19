"""The launch scripts (launch/): each runs the training job with the environment it promises,
and the XLA flags it sets are ones the compilers it launches accept. An XLA or libtpu that meets
a flag it does not know stops the process before the first step, so a wrong flag name in
launch/tpu_pod.sh or launch/multi_gpu.sh would stop every run it starts. The flags are handed
to the compilers themselves: libtpu as the tpu extra pins it (a v5e slice, compile-only), the
CPU backend, and the GPU's XLA (the CUDA plugin's compile-only H200)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from dspark_jax.aot import topology

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _launched(tmp_path: pathlib.Path, script: str, **env: str) -> tuple[dict[str, str], list[str]]:
    """(environment, arguments) `launch/<script>` runs `python` with, read by a stand-in
    `python` first on the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text('#!/usr/bin/env bash\nenv -0 > "$DUMP_ENV"\n'
                    'printf "%s\\n" "$@" > "$DUMP_ARGS"\n')
    fake.chmod(0o755)
    dump_env, dump_args = tmp_path / "env", tmp_path / "args"
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "SLURM_NTASKS", "COORDINATOR")}
    run_env |= {"PATH": f"{bin_dir}:{os.environ['PATH']}", "DUMP_ENV": str(dump_env),
                "DUMP_ARGS": str(dump_args), **env}
    out = subprocess.run(["bash", str(ROOT / "launch" / script), "configs/tiny.py",
                          "--config.train.max_steps=1"], env=run_env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pairs = (kv.split("=", 1) for kv in dump_env.read_text().split("\0") if "=" in kv)
    return dict(pairs), dump_args.read_text().split()


def _compiles_with(env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    keep = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT,
                          env=keep | {"JAX_PLATFORMS": "cpu", "DSPARK_JAX_HUGE_PAGES": "0"}
                          | env)


TPU_INIT = "from dspark_jax.aot.topology import topology_devices; topology_devices('v5e:2x2')"


@pytest.mark.tpu
@pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu: pip install -e '.[tpu]'")
def test_the_tpu_pod_script_sets_flags_libtpu_accepts(tmp_path):
    env, args = _launched(tmp_path, "tpu_pod.sh")
    assert args == ["-m", "dspark_jax.train", "--config", "configs/tiny.py",
                    "--config.train.max_steps=1"]
    assert env["DSPARK_DISTRIBUTED"] == "1"
    flags = env["LIBTPU_INIT_ARGS"].split()
    assert "--xla_tpu_enable_async_collective_fusion=true" in flags
    ok = _compiles_with({"LIBTPU_INIT_ARGS": " ".join(flags)}, TPU_INIT)
    assert ok.returncode == 0, ok.stderr[-2000:]
    # the check can fail: a flag libtpu does not know stops it
    bad = _compiles_with({"LIBTPU_INIT_ARGS": " ".join(flags + ["--xla_enable_async_typo=1"])},
                         TPU_INIT)
    assert bad.returncode != 0 and "xla_enable_async_typo" in bad.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("dspark_jax.aot.gpu", fromlist=["x"]).has_cuda_plugin(),
                    reason="needs the CUDA plugin (jax-cuda13-plugin, jax-cuda13-pjrt)")
def test_the_gpu_script_sets_flags_the_gpu_compiler_accepts(tmp_path):
    env, args = _launched(tmp_path, "multi_gpu.sh")
    assert args[:4] == ["-m", "dspark_jax.train", "--config", "configs/tiny.py"]
    assert "DSPARK_DISTRIBUTED" not in env          # one host, one process
    flags = env["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    gpu = ("import jax.numpy as jnp; jnp.ones(2).block_until_ready(); "
           "from dspark_jax.aot.gpu import gpu_devices; gpu_devices('h200')")
    ok = _compiles_with({"XLA_FLAGS": " ".join(flags)}, gpu)
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = _compiles_with({"XLA_FLAGS": " ".join(flags + ["--xla_gpu_typo=true"])}, gpu)
    assert bad.returncode != 0 and "xla_gpu_typo" in bad.stderr
    # several hosts started by hand: the coordinator reaches jax.distributed.initialize()
    env, _ = _launched(tmp_path, "multi_gpu.sh", COORDINATOR="host0:1234", NUM_PROCESSES="4",
                       PROCESS_ID="2")
    assert (env["DSPARK_DISTRIBUTED"], env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"],
            env["JAX_PROCESS_ID"]) == ("1", "host0:1234", "4", "2")
