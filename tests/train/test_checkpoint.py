"""Checkpointing of training runs: round trip into abstract targets with other shardings, the
grain iterator position, keep-N, uncommitted directories ignored, mismatch and corruption errors,
resuming past an unreadable latest step, a failed save that keeps the committed steps; and whole
runs: a SIGKILLed and a SIGTERMed run that resume to exactly the uninterrupted result on exactly
the same batches, and a run stopped by non-finite steps."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import grain
import jax
import numpy as np
import pytest

from dspark_jax.models import init_draft, load_target
from dspark_jax.sharding import make_mesh
from dspark_jax.train.checkpoint import (COMMIT_MARKER, CheckpointCorruptError,
                                         CheckpointMismatchError, CheckpointSaveError,
                                         TrainCheckpointer,
                                         abstract_storable, key_impl_name, make_meta)
from dspark_jax.train.metrics_log import read_jsonl
from dspark_jax.train.step import OptimConfig, init_train_state, make_optimizer, split_draft
from hf_tiny import save_tiny_hf
from tiny_job import REPO, TINY_CONFIG, make_tiny_target, write_regenerated
from xla_flags import cpu_flags

DRAFT = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1), mask_token_id=96,
             markov_rank=8, num_anchors=6)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16, layers=4))


def _state(target, mesh, seed=0, draft_kw=None):
    draft = init_draft(target, dict(DRAFT, **(draft_kw or {})), seed=seed)
    _, params, _ = split_draft(draft.model)
    tx = make_optimizer(OptimConfig(total_steps=10))
    state, sh = init_train_state(params, tx, seed, mesh)
    return draft, state, sh


def _meta(target, draft, state, name="tiny"):
    return make_meta(name, target.config.to_hf_dict(), draft.config.to_dict(),
                     key_impl_name(state.key))


def _advance(state, k=1):
    """A different state: perturbed params, a later key and step (no optimizer needed)."""
    params = jax.tree.map(lambda x: x + 0.01 * k, state.params)
    return state.replace(params=params, step=state.step + k, key=jax.random.split(state.key)[0])


def _iterator():
    return iter(grain.MapDataset.range(50).shuffle(seed=3).batch(4).to_iter_dataset())


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_roundtrip_into_other_shardings_with_iterator(target, tmp_path):
    one = make_mesh(devices=jax.devices()[:1])
    draft, state, _ = _state(target, one)
    state = _advance(state, 3)
    it = _iterator()
    for _ in range(3):
        next(it)
    ck = TrainCheckpointer(tmp_path / "ck", _meta(target, draft, state), every_steps=1,
                           async_save=True)
    assert ck.save(3, state, it)
    ck.close()
    expected_next = next(it)

    # restore on an 8-device (data, fsdp, tensor) mesh: the shardings come from the abstract target
    eight = make_mesh(data=2, fsdp=2, tensor=2)
    _, fresh, sh8 = _state(target, eight, seed=5)
    it2 = _iterator()
    ck2 = TrainCheckpointer(tmp_path / "ck", _meta(target, draft, fresh))
    r = ck2.restore(abstract_storable(fresh, sh8), it2)
    assert r is not None and r.step == 3 and int(r.state.step) == int(state.step)
    for a, b in zip(_leaves(r.state.params), _leaves(state.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(r.state.opt_state), _leaves(state.opt_state)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.random.key_data(r.state.key), jax.random.key_data(state.key))
    assert jax.dtypes.issubdtype(r.state.key.dtype, jax.dtypes.prng_key)
    got_sh = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, r.state.params))
    want_sh = jax.tree.leaves(sh8.params)
    assert any(len(s.device_set) == 8 for s in got_sh)
    assert all(g.is_equivalent_to(w, np.ndim(x)) for g, w, x in
               zip(got_sh, want_sh, jax.tree.leaves(r.state.params)))
    np.testing.assert_array_equal(next(it2), expected_next)   # the data position came back
    ck2.close()


def test_keep_n_and_resume_from_latest(target, tmp_path):
    mesh = make_mesh(devices=jax.devices()[:1])
    draft, state, sh = _state(target, mesh)
    ck = TrainCheckpointer(tmp_path, _meta(target, draft, state), keep=2, every_steps=2,
                           async_save=False)
    saved = [s for s in range(1, 8) if ck.save(s, _advance(state, s))]
    assert saved == [2, 4, 6]                       # the interval decides
    assert ck.save(7, _advance(state, 7), force=True)
    ck.close()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [6, 7]
    ck = TrainCheckpointer(tmp_path, _meta(target, draft, state))
    r = ck.restore(abstract_storable(state, sh))
    assert r.step == 7
    np.testing.assert_array_equal(_leaves(r.state.params)[0], _leaves(_advance(state, 7).params)[0])
    ck.close()


def _stored_bytes(step_dir: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in (step_dir / "state").rglob("*") if p.is_file())


def test_the_state_is_written_uncompressed_unless_asked_and_either_restores(target, tmp_path):
    """Default saves write the train state's bytes plainly; `compress=True` zstd-compresses them
    (an all-zero state shrinks to almost nothing); a default checkpointer restores both."""
    mesh = make_mesh(devices=jax.devices()[:1])
    draft, state, sh = _state(target, mesh)
    zeros = state.replace(params=jax.tree.map(np.zeros_like, state.params),
                          opt_state=jax.tree.map(np.zeros_like, state.opt_state))
    raw = sum(np.asarray(x).nbytes for x in jax.tree.leaves((zeros.params, zeros.opt_state)))
    meta = _meta(target, draft, state)
    ck = TrainCheckpointer(tmp_path, meta, every_steps=1, async_save=False, compress=True)
    ck.save(1, zeros)
    ck.close()
    ck = TrainCheckpointer(tmp_path, meta, every_steps=1, async_save=False)
    ck.save(2, zeros)
    ck.close()
    assert _stored_bytes(tmp_path / "2") >= raw > 5 * _stored_bytes(tmp_path / "1")
    for step in (1, 2):
        r = TrainCheckpointer(tmp_path, meta).restore(abstract_storable(state, sh), step=step)
        assert r.step == step
        for a, b in zip(_leaves((r.state.params, r.state.opt_state)),
                        _leaves((zeros.params, zeros.opt_state))):
            np.testing.assert_array_equal(a, b)


def test_uncommitted_and_temporary_directories_are_ignored(target, tmp_path):
    mesh = make_mesh(devices=jax.devices()[:1])
    draft, state, sh = _state(target, mesh)
    ck = TrainCheckpointer(tmp_path, _meta(target, draft, state), every_steps=1, async_save=False)
    ck.save(2, _advance(state, 2))
    ck.close()
    # a step directory whose write never committed (no marker), and an orbax temporary directory
    shutil.copytree(tmp_path / "2", tmp_path / "9")
    (tmp_path / "9" / COMMIT_MARKER).unlink()
    shutil.copytree(tmp_path / "2", tmp_path / "11.orbax-checkpoint-tmp-1234567")
    ck = TrainCheckpointer(tmp_path, _meta(target, draft, state), every_steps=1, async_save=False)
    assert ck.all_steps() == [2] and ck.latest_step() == 2
    r = ck.restore(abstract_storable(state, sh))
    assert r.step == 2
    assert ck.save(9, _advance(state, 9))           # the uncommitted 9 does not block a real one
    ck.close()
    assert TrainCheckpointer(tmp_path, _meta(target, draft, state)).latest_step() == 9


def test_mismatching_target_or_drafter_is_a_clear_error(target, tmp_path):
    mesh = make_mesh(devices=jax.devices()[:1])
    draft, state, sh = _state(target, mesh)
    ck = TrainCheckpointer(tmp_path, _meta(target, draft, state), every_steps=1, async_save=False)
    ck.save(1, state)
    ck.close()
    other_draft, _, _ = _state(target, mesh, draft_kw=dict(block_size=5))
    cases = [(_meta(target, other_draft, state), "draft.block_size"),
             (_meta(target, draft, state, name="another-target"), "target.name")]
    bigger = load_target(save_tiny_hf(tmp_path / "t2", "qwen3", head_dim=16, layers=5))
    cases.append((make_meta("tiny", bigger.config.to_hf_dict(), draft.config.to_dict(),
                            key_impl_name(state.key)), "target.config.num_hidden_layers"))
    for meta, field in cases:
        with pytest.raises(CheckpointMismatchError) as e:
            TrainCheckpointer(tmp_path, meta).restore(abstract_storable(state, sh))
        assert field in str(e.value) and str(tmp_path / "1") in str(e.value), str(e.value)


@pytest.mark.parametrize("damage", ["state_files", "meta"])
def test_corrupted_checkpoint_is_a_clear_error(target, tmp_path, damage):
    mesh = make_mesh(devices=jax.devices()[:1])
    draft, state, sh = _state(target, mesh)
    ck = TrainCheckpointer(tmp_path, _meta(target, draft, state), every_steps=1, async_save=False)
    ck.save(4, state)
    ck.close()
    step_dir = tmp_path / "4"
    if damage == "state_files":
        for p in (step_dir / "state").rglob("*"):
            if p.is_file() and p.stat().st_size > 0:
                p.write_bytes(b"\x00garbage")
    else:
        for p in (step_dir / "meta").iterdir():
            if p.is_file():
                p.write_text("{not json")
    with pytest.raises(CheckpointCorruptError) as e:
        TrainCheckpointer(tmp_path, _meta(target, draft, state)).restore(abstract_storable(state, sh))
    assert str(step_dir) in str(e.value) and "corrupt" in str(e.value)


def _largest_state_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def test_resume_passes_over_an_unreadable_latest_step(target, tmp_path, caplog):
    mesh = make_mesh(devices=jax.devices()[:1])
    draft, state, sh = _state(target, mesh)
    ck = TrainCheckpointer(tmp_path, _meta(target, draft, state), every_steps=2, async_save=False)
    for s in (2, 4):
        ck.save(s, _advance(state, s))
    ck.close()
    bad = _largest_state_file(tmp_path / "4")            # a tensor file of the latest step
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    files = sorted(str(p.relative_to(tmp_path / "4")) for p in (tmp_path / "4").rglob("*"))

    ck = TrainCheckpointer(tmp_path, _meta(target, draft, state), every_steps=2, async_save=False)
    with caplog.at_level("WARNING", logger="dspark_jax.train.checkpoint"):
        r = ck.restore(abstract_storable(state, sh))
    assert r.step == 2 and [s for s, _ in r.skipped] == [4]
    np.testing.assert_array_equal(_leaves(r.state.params)[0], _leaves(_advance(state, 2).params)[0])
    assert "step 4" in caplog.text and "corrupt" in caplog.text
    # moved aside whole, not deleted; the step can be written again
    aside = tmp_path / "4.corrupt"
    assert not (tmp_path / "4").exists()
    assert sorted(str(p.relative_to(aside)) for p in aside.rglob("*")) == files
    assert ck.all_steps() == [2] and ck.save(4, _advance(state, 4))
    ck.close()

    # nothing restorable: today's error, and nothing moved
    for step in (2, 4):
        f = _largest_state_file(tmp_path / str(step))
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    ck = TrainCheckpointer(tmp_path, _meta(target, draft, state))
    with pytest.raises(CheckpointCorruptError) as e:
        ck.restore(abstract_storable(state, sh))
    assert str(tmp_path / "4") in str(e.value) and "corrupt" in str(e.value)
    assert (tmp_path / "2").is_dir() and (tmp_path / "4").is_dir()


# the failed step's state writes are abandoned by Orbax: their futures end unraised
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("go_on", [False, True])
def test_a_failed_save_keeps_the_committed_steps(target, tmp_path, monkeypatch, caplog,
                                                 async_save, go_on):
    """The write of a step fails (as on a full disk) after its state was written: the committed
    step stays readable; the save raises a clear error or, with continue_on_save_error, warns
    and later saves work."""
    import orbax.checkpoint as ocp

    mesh = make_mesh(devices=jax.devices()[:1])
    draft, state, sh = _state(target, mesh)
    meta = _meta(target, draft, state)
    ck = TrainCheckpointer(tmp_path, meta, every_steps=2, async_save=async_save,
                           continue_on_save_error=go_on)
    assert ck.save(2, _advance(state, 2))
    ck.wait()

    class FullDisk:                  # the write of `meta` fails where it would finish
        def result(self, timeout=None):
            raise OSError(28, "No space left on device")

    async def full_disk(self, directory, *args, **kwargs):
        return [FullDisk()]

    with monkeypatch.context() as m:
        m.setattr(ocp.handlers.JsonCheckpointHandler, "async_save", full_disk)
        if go_on:
            with caplog.at_level("WARNING", logger="dspark_jax.train.checkpoint"):
                ck.save(4, _advance(state, 4))
                ck.wait()
            msg = caplog.text
        else:
            with pytest.raises(CheckpointSaveError) as e:
                ck.save(4, _advance(state, 4))
                ck.wait()
            msg = str(e.value)
    assert "step 4" in msg and "No space left" in msg and str(tmp_path / "2") in msg
    assert "checkpoint.continue_on_save_error" in msg
    if go_on:
        assert ck.save(6, _advance(state, 6))
    ck.close()

    ck = TrainCheckpointer(tmp_path, meta)
    assert ck.all_steps() == ([2, 6] if go_on else [2])
    r = ck.restore(abstract_storable(state, sh), step=2)
    np.testing.assert_array_equal(_leaves(r.state.params)[0], _leaves(_advance(state, 2).params)[0])
    ck.close()


# ------------------------------------------------------------------------- kill -9 and resume


def _env(cache: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(1),
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _train(target, workdir, regenerated, cache, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dspark_jax.train", f"--config={TINY_CONFIG}",
           f"--config.target={target}", f"--config.workdir={workdir}",
           f"--config.data.regenerated={regenerated}",
           "--config.train.max_steps=10", "--config.checkpoint.every_steps=3",
           "--config.checkpoint.async_save=True", "--config.data.heldout=0", *extra]
    return subprocess.run(cmd, cwd=REPO, env=_env(cache), capture_output=True, text=True,
                          timeout=300)


def _batches(workdir) -> dict[int, str]:
    """step → fingerprint of the batch it trained on (a re-run step overwrites its entry)."""
    return {r["step"]: r["batch_hash"] for r in read_jsonl(workdir / "metrics.jsonl")
            if "batch_hash" in r}


def _params(workdir) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(workdir / "export" / "model.safetensors")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target, one regenerated file, a shared JAX compilation cache (only the first run
    compiles) and the uninterrupted 10-step reference run. Regeneration is exercised by
    test_cli; here all runs train on the same file."""
    root = tmp_path_factory.mktemp("runs")
    tgt = make_tiny_target(root / "target")
    data = write_regenerated(root / "regenerated.jsonl")
    cache = root / "jax_cache"
    ref = root / "uninterrupted"
    a = _train(tgt, ref, data, cache)
    assert a.returncode == 0, a.stderr[-3000:]
    return tgt, data, cache, ref


def _assert_same_run(ref: pathlib.Path, run: pathlib.Path) -> None:
    """Same batch at every step, the same per-step losses and the same final parameters."""
    want, got = _batches(ref), _batches(run)
    assert sorted(want) == list(range(1, 11))
    assert got == want
    assert len(set(want.values())) > 1
    loss = lambda w: {r["step"]: r["loss"] for r in read_jsonl(w / "metrics.jsonl") if "loss" in r}
    assert loss(run) == pytest.approx(loss(ref), abs=1e-6)
    pa, pb = _params(ref), _params(run)
    assert pa.keys() == pb.keys()
    worst = max(float(np.abs(pa[k].astype(np.float64) - pb[k]).max()) for k in pa)
    assert worst <= 1e-6, worst


def test_sigkill_mid_run_then_resume_equals_uninterrupted(tiny_run, tmp_path):
    tgt, data, cache, ref = tiny_run
    run = tmp_path / "killed"
    b = _train(tgt, run, data, cache, "--config.debug.sigkill_at_step=7")
    assert b.returncode == -9, (b.returncode, b.stderr[-3000:])
    assert not (run / "export").exists()
    first = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in first] == list(range(1, 8))

    c = _train(tgt, run, data, cache)
    assert c.returncode == 0, c.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    resumed = summary["resumed_from_step"]
    assert resumed in (3, 6), resumed               # the last committed checkpoint before the kill
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl")]
    assert steps == list(range(1, 8)) + list(range(resumed + 1, 11))
    _assert_same_run(ref, run)


def test_sigterm_saves_the_step_and_the_same_command_resumes_exactly(tiny_run, tmp_path):
    """SIGTERM after step 5 (off the every-3-steps interval), and a second one while that
    checkpoint is being written (async): exit status 0 with step 5 committed; the re-run
    resumes there and ends exactly as the uninterrupted run."""
    tgt, data, cache, ref = tiny_run
    run = tmp_path / "preempted"
    b = _train(tgt, run, data, cache, "--config.debug.sigterm_at_step=5")
    assert b.returncode == 0, (b.returncode, b.stderr[-3000:])
    assert "SIGTERM again" in b.stderr and "pre-empted" in b.stdout
    assert not (run / "export").exists()
    assert (run / "checkpoints" / "5" / COMMIT_MARKER).is_file()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 6))

    c = _train(tgt, run, data, cache)
    assert c.returncode == 0, c.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 5
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 11))
    _assert_same_run(ref, run)


@pytest.mark.slow
def test_bf16_run_in_deepspecs_order_keeps_fp32_masters_and_resumes_exactly(tiny_run, tmp_path):
    """`train.precision=bf16` with `data.order=deepspec`: the checkpoint holds the fp32 master
    weights and fp32 Adam moments, a run SIGTERMed after step 5 resumes to exactly the
    uninterrupted run, and its batches are not the default order's."""
    import orbax.checkpoint as ocp

    tgt, data, cache, default = tiny_run
    opts = ("--config.train.precision=bf16", "--config.train.compute_dtype=bfloat16",
            "--config.data.order=deepspec", "--config.data.data_seed=42")
    ref = tmp_path / "uninterrupted"
    a = _train(tgt, ref, data, cache, *opts)
    assert a.returncode == 0, a.stderr[-3000:]
    run = tmp_path / "preempted"
    b = _train(tgt, run, data, cache, *opts, "--config.debug.sigterm_at_step=5")
    assert b.returncode == 0, (b.returncode, b.stderr[-3000:])
    stored = ocp.PyTreeCheckpointer().metadata(run / "checkpoints" / "5" / "state")
    stored = getattr(stored, "item_metadata", stored)
    dtypes = {str(m.dtype) for m in jax.tree.leaves(stored["params"])}
    dtypes |= {str(m.dtype) for m in jax.tree.leaves(stored["opt_state"])
               if np.issubdtype(m.dtype, np.floating) and len(m.shape) > 0}
    assert dtypes == {"float32"}, dtypes
    c = _train(tgt, run, data, cache, *opts)
    assert c.returncode == 0, c.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 5
    _assert_same_run(ref, run)
    assert _batches(ref) != _batches(default)


def test_nonfinite_steps_in_a_row_stop_the_run_with_a_checkpoint(tiny_run, tmp_path):
    """lr 1e30: step 1 (DeepSpec's warmup trains from the first step) makes the parameters
    huge, every later loss is not finite. Those steps are skipped, logged with their batch and
    counted; the second in a row stops the run with one line naming the step, after a
    checkpoint of that step."""
    tgt, data, cache, _ = tiny_run
    run = tmp_path / "diverged"
    b = _train(tgt, run, data, cache, "--config.train.lr=1e30",
               "--config.train.max_nonfinite_steps=2")
    assert b.returncode == 2, (b.returncode, b.stderr[-3000:])
    last = b.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stopped at step 3: steps 2-3"), last
    assert "train.max_nonfinite_steps" in last
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    assert [rows[s]["nonfinite_steps"] for s in (1, 2, 3)] == [0, 1, 2]
    assert f"step 2: non-finite loss or gradient norm, update skipped (batch " \
           f"{rows[2]['batch_hash']}" in b.stdout
    assert (run / "checkpoints" / "3" / COMMIT_MARKER).is_file()
    assert not (run / "export").exists()


def test_another_process_count_is_refused_naming_both(target, tmp_path, monkeypatch):
    """A run saved by one process and resumed by two (simulated: `jax.process_count` as the
    checkpointer sees it) is refused in one line naming both counts, with nothing moved aside;
    the weights alone (no data position) still restore."""
    from dspark_jax.train import checkpoint as ck_mod

    one = make_mesh(devices=jax.devices()[:1])
    draft, state, sh = _state(target, one)
    ck = TrainCheckpointer(tmp_path / "ck", _meta(target, draft, state), every_steps=1,
                           async_save=False)
    assert ck.save(2, state, _iterator())
    ck.close()
    monkeypatch.setattr(ck_mod, "run_processes", lambda: 2)
    ck2 = TrainCheckpointer(tmp_path / "ck", _meta(target, draft, state))
    with pytest.raises(CheckpointMismatchError, match="saved by 1 processes and this run has 2"):
        ck2.restore(abstract_storable(state, sh), _iterator())
    assert (tmp_path / "ck" / "2").is_dir() and not list((tmp_path / "ck").glob("*.corrupt*"))
    assert ck2.restore(abstract_storable(state, sh)).step == 2
    ck2.close()


@pytest.mark.slow
def test_longest_padding_run_resumes_exactly(tiny_run, tmp_path):
    """`data.pad_to=longest`: a run SIGTERMed after step 5 resumes to exactly the uninterrupted
    run (each batch's width is a function of its step), and its batches are the default run's
    records, some in rows narrower than max_length (other fingerprints)."""
    tgt, data, cache, default = tiny_run
    opts = ("--config.data.pad_to=longest", "--config.data.pad_multiple=8")
    ref = tmp_path / "uninterrupted"
    a = _train(tgt, ref, data, cache, *opts)
    assert a.returncode == 0, a.stderr[-3000:]
    run = tmp_path / "preempted"
    b = _train(tgt, run, data, cache, *opts, "--config.debug.sigterm_at_step=5")
    assert b.returncode == 0, (b.returncode, b.stderr[-3000:])
    c = _train(tgt, run, data, cache, *opts)
    assert c.returncode == 0, c.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 5
    _assert_same_run(ref, run)
    cands = lambda w: [r["valid_anchors_abs"] for r in read_jsonl(w / "metrics.jsonl")
                       if "valid_anchors_abs" in r]
    assert len(cands(ref)) == 10 and cands(ref) == cands(default)   # the same records each step
    narrower = [s for s, h in _batches(ref).items() if h != _batches(default)[s]]
    assert narrower, "no batch narrower than max_length"
