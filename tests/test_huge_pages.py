"""`python -m dspark_jax.…` restarts once with glibc's malloc on transparent huge pages; a
library import, an opted-out run and a machine without the mode never restart."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dspark_jax import huge_pages as H

RUN = ["python", "-m", "dspark_jax.train", "--config", "c.py"]


@pytest.mark.parametrize("argv, orig, expected", [
    (["-m", "--config", "c.py"], RUN, True),
    (["-m"], ["python", "-X", "dev", "-W", "ignore", "-m", "dspark_jax"], True),
    (["-m", "-q"], ["python", "-m", "pytest", "-q"], False),       # another program's import
    (["-c"], ["python", "-c", "import dspark_jax"], False),
    (["/x/train/__main__.py"], RUN, False),                        # past the start: too late
    (["-m"], ["python", "-m", "dspark_jaxx.train"], False),
])
def test_only_a_module_run_of_the_package_restarts(argv, orig, expected):
    assert H.module_run(argv, orig) is expected


def test_an_opted_out_or_already_tuned_process_does_not_restart(monkeypatch):
    monkeypatch.setattr(H, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(H, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(H.sys, "platform", "linux")
    argv = ["-m", "--config", "c.py"]
    assert H.restart_needed({}, argv, RUN)
    assert not H.restart_needed({H.ENV: "0"}, argv, RUN)
    assert not H.restart_needed({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{H.TUNABLE}"},
                                argv, RUN)
    for mode, version in (("always", (2, 36)), ("never", (2, 36)), ("madvise", (2, 34)),
                          (None, (2, 36)), ("madvise", None)):
        monkeypatch.setattr(H, "thp_mode", lambda mode=mode: mode)
        monkeypatch.setattr(H, "glibc_version", lambda version=version: version)
        assert not H.restart_needed({}, argv, RUN), (mode, version)


def test_the_kernel_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert H.thp_mode(str(f)) == "madvise"
    f.write_text("garbage\n")
    assert H.thp_mode(str(f)) is None
    assert H.thp_mode(str(tmp_path / "missing")) is None


def _facts(*cmd: str, **env: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", H.ENV)}
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, check=True,
                         env=dict(environ, **env), timeout=120).stdout
    return dict((line.split(None, 1) + [""])[:2] for line in out.strip().splitlines())


def test_a_module_run_puts_mallocs_blocks_on_huge_pages_where_the_machine_can():
    eligible = H.thp_mode() == "madvise" and (H.glibc_version() or (0, 0)) >= (2, 35)
    run = _facts("-m", "dspark_jax.bench.huge_pages")
    off = _facts("-m", "dspark_jax.bench.huge_pages", **{H.ENV: "0"})
    library = _facts("-c", "import dspark_jax, os; "
                     "print('glibc_tunables', os.environ.get('GLIBC_TUNABLES', ''))")
    assert H.TUNABLE not in off.get("glibc_tunables", "")
    assert H.TUNABLE not in library.get("glibc_tunables", "")
    if not eligible:
        assert H.TUNABLE not in run.get("glibc_tunables", "")
        return
    assert H.TUNABLE in run["glibc_tunables"].split(":")
    assert int(run["malloc_64mib_on_huge_pages_mib"]) >= 32
    assert int(off["malloc_64mib_on_huge_pages_mib"]) < 32
