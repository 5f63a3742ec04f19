"""Multi-process training on one machine (launch/local_multiprocess.sh): 2 processes × 2 fake
CPU devices train exactly as 1 process × 4 devices, and a process killed with SIGKILL resumes
exactly after a relaunch. Slow: each tiny run starts JAX processes and compiles the step."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from dspark_jax.train.metrics_log import read_jsonl
from tiny_job import REPO, TINY_CONFIG, make_tiny_target, write_regenerated

pytestmark = pytest.mark.slow
LAUNCH = REPO / "launch" / "local_multiprocess.sh"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp")
    return (make_tiny_target(root / "target"), write_regenerated(root / "regen.jsonl", n=12),
            root)


def launch(job, name: str, num: int, local_devices: int, *extra: str, check: bool = True):
    target, regen, root = job
    env = dict(os.environ, PYTHON=sys.executable, LOCAL_DEVICES=str(local_devices),
               LOG_DIR=str(root / f"logs_{name}"))
    env.pop("XLA_FLAGS", None)
    args = [f"--config.target={target}", f"--config.workdir={root / name}",
            f"--config.data.regenerated={regen}", "--config.mesh.num_devices=-1",
            "--config.eval.batch_size=4", "--config.train.max_steps=4",
            "--config.logging.tensorboard=False", *extra]
    proc = subprocess.run(["bash", str(LAUNCH), str(num), TINY_CONFIG, *args], env=env,
                          capture_output=True, text=True, timeout=1500, cwd=REPO)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, root / name


def exported(workdir: pathlib.Path) -> dict[str, np.ndarray]:
    return load_file(str(workdir / "export" / "model.safetensors"))


def hashes(workdir: pathlib.Path) -> dict[int, str]:
    return {r["step"]: r["batch_hash"] for r in read_jsonl(workdir / "metrics.jsonl")
            if "batch_hash" in r}


def assert_same_params(a: pathlib.Path, b: pathlib.Path, atol: float = 1e-6) -> None:
    pa, pb = exported(a), exported(b)
    assert sorted(pa) == sorted(pb)
    worst = max(float(np.abs(pa[k].astype(np.float64) - pb[k]).max()) for k in pa)
    assert worst <= atol, worst


def test_two_processes_equal_one_and_resume_after_sigkill(job):
    _, one = launch(job, "one_x4", 1, 4)
    _, two = launch(job, "two_x2", 2, 2)
    assert hashes(one) == hashes(two) and len(hashes(one)) == 4
    assert_same_params(one, two)
    # only process 0 wrote the summary / export; both took part
    assert (two / "summary.json").is_file()
    logs = job[2] / "logs_two_x2"
    assert "trained dspark drafter" in (logs / "process_0.log").read_text()
    assert "trained dspark drafter" not in (logs / "process_1.log").read_text()

    # SIGKILL process 1 after step 2 (checkpointed at step 2): the launcher fails ...
    proc, killed = launch(job, "killed", 2, 2, "--config.debug.sigkill_at_step=2",
                          "--config.debug.sigkill_process=1", check=False)
    assert proc.returncode != 0
    assert "process 1" in proc.stderr and "failed" in proc.stderr
    assert (killed / "checkpoints" / "2").is_dir()
    assert not (killed / "export").exists()
    # ... and the same command without the fault resumes from step 2 and ends where the
    # uninterrupted run did
    proc, resumed = launch(job, "killed", 2, 2)
    assert "resumed from" in (job[2] / "logs_killed" / "process_0.log").read_text()
    h = hashes(resumed)
    assert {s: h[s] for s in (3, 4)} == {s: hashes(two)[s] for s in (3, 4)}
    assert_same_params(resumed, two)
