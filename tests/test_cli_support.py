"""What every command line shares (dspark_jax/cli_support.py): a truncated or corrupt checkpoint
is one `error:` line on stderr and exit status 2, not a traceback; the persistent compilation
cache's directory, its environment variable, and a compiled program stored there."""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import shutil
import subprocess
import sys
import warnings

import pytest

from dspark_jax import cli_support
from tests.train.tiny_job import TINY_CONFIG, make_tiny_target

REPO = pathlib.Path(__file__).resolve().parents[1]


def _truncate(f: pathlib.Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A good tiny target (with a tokenizer), a copy with half its model.safetensors, a copy with
    a cut config.json, a drafter with half its model.safetensors, and a prompt file."""
    from dspark_jax.models import init_draft, load_target

    root = tmp_path_factory.mktemp("cli_ckpts")
    good = make_tiny_target(root / "target")
    bad_target = root / "bad_target"
    shutil.copytree(good, bad_target)
    _truncate(bad_target / "model.safetensors")
    bad_config = root / "bad_config"
    shutil.copytree(good, bad_config)
    cfg = (bad_config / "config.json").read_text()
    (bad_config / "config.json").write_text(cfg[: len(cfg) // 2])
    init_draft(load_target(good), dict(block_size=4, num_draft_layers=1, target_layer_ids=(0, 2),
                                       mask_token_id=99, markov_rank=4), seed=0).save(root / "draft")
    _truncate(root / "draft" / "model.safetensors")
    data = root / "data"
    data.mkdir()
    (data / "tiny.jsonl").write_text(json.dumps({"turns": ["Why rain?"]}) + "\n")
    return dict(target=good, bad_target=bad_target, bad_config=bad_config,
                bad_draft=root / "draft", data=data)


# module run as `python -m MODULE`, its arguments, the file the error names
CLIS = {
    "generate": ("dspark_jax.generate", lambda c, t: [
        "--target", c["target"], "--draft", c["bad_draft"], "--prompt", "hi", "--no-progress"],
        "bad_draft"),
    "evaluate": ("dspark_jax.evaluate", lambda c, t: [
        "--target", c["target"], "--draft", c["bad_draft"], "--data-dir", c["data"],
        "--datasets", "tiny", "--out", t / "eval", "--no-progress", "--no-plots"], "bad_draft"),
    "calibrate": ("dspark_jax.calibrate", lambda c, t: [
        "--target", c["target"], "--draft", c["bad_draft"], "--data-dir", c["data"],
        "--out-dir", t / "calib", "--no-plots"], "bad_draft"),
    "export": ("dspark_jax.export", lambda c, t: [
        c["bad_draft"], "--format", "deepspec", "--out", t / "out", "--no-progress"],
        "bad_draft"),
    "regenerate": ("dspark_jax.data.regeneration", lambda c, t: [
        "--target", c["bad_target"], "--prompts", c["data"] / "tiny.jsonl",
        "--out", t / "regen.jsonl", "--no-progress"], "bad_target"),
    "train": ("dspark_jax.train", lambda c, t: [
        f"--config={TINY_CONFIG}", f"--config.target={c['bad_target']}",
        f"--config.workdir={t / 'work'}"], "bad_target"),
    "aot": ("dspark_jax.aot", lambda c, t: [
        f"--config={TINY_CONFIG}", "--topology", "v5e:2x2",
        f"--config.target={c['bad_config']}"], "bad_config"),
    "bench.load": ("dspark_jax.bench.load", lambda c, t: [
        "--target", c["target"], "--draft", c["bad_draft"], "--concurrency", "1"], "bad_draft"),
}


@pytest.mark.parametrize("name", list(CLIS))
def test_a_bad_checkpoint_is_one_error_line_and_exit_2(name, ckpts, tmp_path, monkeypatch,
                                                       capsys):
    """`python -m MODULE` (its `__main__` code, run here by runpy) on a truncated checkpoint."""
    module, args, bad = CLIS[name]
    if name == "aot":
        from dspark_jax.aot.topology import has_libtpu

        if not has_libtpu():
            pytest.skip("aot --topology needs libtpu (the tpu extra)")
    monkeypatch.setattr(sys, "argv", [module, *map(str, args(ckpts, tmp_path))])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as e:
        warnings.simplefilter("ignore", RuntimeWarning)   # runpy: module already imported
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and str(ckpts[bad]) in lines[0], err


def test_generate_process_on_a_truncated_drafter(ckpts):
    """The process itself: exit status 2 and stderr exactly one line."""
    proc = subprocess.run([sys.executable, "-m", "dspark_jax.generate", "--target",
                           str(ckpts["target"]), "--draft", str(ckpts["bad_draft"]),
                           "--prompt", "hi", "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: ") and "model.safetensors" in proc.stderr


def test_run_main_exit_status_and_usage_errors(capsys):
    class Usage(Exception):
        pass

    def raises(exc):
        def main():
            raise exc
        return main

    from dspark_jax.models.io.errors import CheckpointError

    for main, code in ((lambda: 3, 3), (lambda: ["reply"], 0), (lambda: None, 0)):
        with pytest.raises(SystemExit) as e:
            cli_support.run_main(main, compilation_cache=False)
        assert e.value.code == code
    with pytest.raises(SystemExit) as e:
        cli_support.run_main(raises(CheckpointError("a.safetensors: cut\nshort")),
                             compilation_cache=False)
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: a.safetensors: cut short\n"
    with pytest.raises(SystemExit) as e:
        cli_support.run_main(raises(Usage("--x: bad")), errors=(Usage,), compilation_cache=False)
    assert e.value.code == 2 and capsys.readouterr().err == "error: --x: bad\n"
    with pytest.raises(KeyError):                  # anything else stays a traceback
        cli_support.run_main(raises(KeyError("k")), compilation_cache=False)


def test_compilation_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(cli_support.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli_support.compilation_cache_dir() == tmp_path / "xdg" / "dspark_jax" / "jax_cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cli_support.compilation_cache_dir() == (tmp_path / "home" / ".cache" / "dspark_jax"
                                                   / "jax_cache")
    monkeypatch.setenv(cli_support.CACHE_ENV, str(tmp_path / "mine"))
    assert cli_support.compilation_cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(cli_support.CACHE_ENV, "")
    assert cli_support.compilation_cache_dir() is None
    assert cli_support.enable_compilation_cache() is None       # off: JAX's setting untouched


def test_the_test_suite_keeps_the_cache_off():
    assert os.environ[cli_support.CACHE_ENV] == ""


def test_a_command_stores_its_compiled_programs(ckpts, tmp_path):
    """`python -m dspark_jax.generate` writes its compiled programs into the directory the
    variable names (every program: JAX's minimum compile time set to 0 here)."""
    cache = tmp_path / "cache"
    env = dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               **{cli_support.CACHE_ENV: str(cache)})
    proc = subprocess.run([sys.executable, "-m", "dspark_jax.generate", "--target",
                           str(ckpts["target"]), "--prompt", "hi", "--max-new-tokens", "2",
                           "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert cache.is_dir() and any(cache.iterdir())
