"""Multi-process training on one machine (launch/local_multiprocess.sh): 2 processes × 2 fake
CPU devices train exactly as 1 process × 4 devices, and a process killed with SIGKILL resumes
exactly after a relaunch. Slow: each tiny run starts JAX processes and compiles the step."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from dspark_jax.data.features import FeatureCache
from dspark_jax.train.metrics_log import read_jsonl
from tiny_job import (REPO, TINY_CONFIG, make_tiny_target, write_prompt_files,
                      write_regenerated)
from xla_flags import FAST_COMPILE

pytestmark = pytest.mark.slow
LAUNCH = REPO / "launch" / "local_multiprocess.sh"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp")
    return (make_tiny_target(root / "target"), write_regenerated(root / "regen.jsonl", n=12),
            root)


def launch(job, name: str, num: int, local_devices: int, *extra: str, check: bool = True,
           regenerated: bool = True):
    target, regen, root = job
    env = dict(os.environ, PYTHON=sys.executable, LOCAL_DEVICES=str(local_devices),
               LOG_DIR=str(root / f"logs_{name}"))
    env.pop("XLA_FLAGS", None)
    env["EXTRA_XLA_FLAGS"] = FAST_COMPILE
    data = [f"--config.data.regenerated={regen}"] if regenerated else []
    args = [f"--config.target={target}", f"--config.workdir={root / name}",
            *data, "--config.mesh.num_devices=-1",
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
    """Two processes train as one does; killed, a relaunch on another process count refuses
    and the same command resumes exactly."""
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
    # a relaunch on one process refuses in one line naming both counts, and moves nothing
    proc, _ = launch(job, "killed", 1, 4, check=False)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr + (job[2] / "logs_killed" / "process_0.log").read_text()
    assert "saved by 2 processes and this run has 1" in said, said[-3000:]
    assert (killed / "checkpoints" / "2").is_dir()
    assert not list((killed / "checkpoints").glob("*.corrupt*"))
    # ... and the same command without the fault resumes from step 2 and ends where the
    # uninterrupted run did
    proc, resumed = launch(job, "killed", 2, 2)
    assert "resumed from" in (job[2] / "logs_killed" / "process_0.log").read_text()
    h = hashes(resumed)
    assert {s: h[s] for s in (3, 4)} == {s: hashes(two)[s] for s in (3, 4)}
    assert_same_params(resumed, two)


def test_two_processes_regenerate_and_cache_features_as_one_does(job):
    """No regenerated file and offline features: each of 2 processes regenerates its share of
    the prompts and caches its share of the features with its own copy of the target; the
    merged outputs, the batches and the trained parameters equal 1 process × 4 devices'."""
    prompts = write_prompt_files(job[2] / "prompts")
    extra = (f"--config.data.prompts=({','.join(map(repr, prompts))},)",
             "--config.data.features=offline")
    _, one = launch(job, "regen_one", 1, 4, *extra, regenerated=False)
    _, two = launch(job, "regen_two", 2, 2, *extra, regenerated=False)
    regen_one = (one / "data" / "regenerated.jsonl").read_text()
    assert regen_one and regen_one == (two / "data" / "regenerated.jsonl").read_text()
    assert list((two / "data").glob("regenerated.jsonl.part-*-of-2.jsonl"))  # made in parts
    assert (two / "data" / "features" / "part-1-of-2").is_dir()
    # the cached features agree to bf16 rounding (the stored dtype): the local target copies
    # are FSDP over 2 and 4 devices, so fp32 sums differ in the last bits and a few values
    # round to the neighbouring bf16; the parameters then agree to 1e-5 after 4 steps
    c1, c2 = FeatureCache(one / "data" / "features"), FeatureCache(two / "data" / "features")
    assert len(c1) == len(c2) > 0
    for r in range(len(c1)):
        a, b = c1[r], c2[r]
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        for f in ("features", "target_hidden"):
            np.testing.assert_allclose(np.asarray(a[f], np.float32), np.asarray(b[f], np.float32),
                                       rtol=2 ** -7, atol=1e-3, err_msg=f)
    assert hashes(one) == hashes(two) and len(hashes(one)) == 4
    assert_same_params(one, two, atol=1e-5)


def test_two_processes_save_on_sigterm_at_one_step_and_resume_exactly(job):
    """Both processes get SIGTERM after step 1: JAX's pre-emption sync point picks one step for
    both, both save it and exit 0; the same command resumes and ends where the uninterrupted
    two-process run did."""
    _, ref = launch(job, "two_x2_ref", 2, 2)
    proc, run = launch(job, "sigterm", 2, 2, "--config.debug.sigterm_at_step=1")
    logs = [(job[2] / "logs_sigterm" / f"process_{i}.log").read_text() for i in (0, 1)]
    assert "pre-empted" in logs[0] and "Reached preemption sync point" in logs[1]
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and 1 < saved[-1] < 4 and not (run / "export").exists()
    launch(job, "sigterm", 2, 2)
    assert f"resumed from {run / 'checkpoints' / str(saved[-1])}" in (
        job[2] / "logs_sigterm" / "process_0.log").read_text()
    assert hashes(run) == hashes(ref) and len(hashes(ref)) == 4
    assert_same_params(run, ref)


def test_two_processes_decode_speculatively_as_one_does(job):
    """`eval.speculative`: every process decodes with the target sharded over all of them, so
    the engine lays its request slots on a mesh that spans the two processes
    (`decoding.placement`); the held-out rounds and τ equal one process × 4 devices'."""
    extra = ("--config.eval.speculative=True", "--config.eval.speculative_temperatures=(0.0,)")
    _, one = launch(job, "spec_one", 1, 4, *extra)
    _, two = launch(job, "spec_two", 2, 2, *extra)
    rounds = [[(r["output_tokens"], r["accepted"]) for r in map(json.loads, (
        w / "speculative" / "T0" / "records.jsonl").open())] for w in (one, two)]
    assert rounds[0] and rounds[0] == rounds[1]
    taus = [json.loads((w / "summary.json").read_text())["speculative"]["mean"]["tau"]
            for w in (one, two)]
    assert taus[0] == taus[1] and taus[0] >= 1.0
