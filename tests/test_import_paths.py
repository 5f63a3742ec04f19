"""Old import paths kept for users and scripts: each is the module it names (the same object, so
attributes set through either path are seen through both), and a command line's old
`python -m` path runs the command."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

ALIASES = {
    "dspark_jax.eval.deepspec_loop": "dspark_jax.interop.deepspec_loop",
    "dspark_jax.bench.llamacpp_interop": "dspark_jax.interop.llamacpp_loop",
    "dspark_jax.bench.table1": "dspark_jax.experiments.table1",
    "dspark_jax.bench.table1_report": "dspark_jax.experiments.table1_report",
    "dspark_jax.bench.tree_tau": "dspark_jax.experiments.tree_tau",
    "dspark_jax.serving.generate": "dspark_jax.serving.generation",
    "dspark_jax.data.regenerate": "dspark_jax.data.regeneration",
    "dspark_jax.aot.train_step": "dspark_jax.aot.training",
}


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_old_path_is_the_module(old):
    assert importlib.import_module(old) is importlib.import_module(ALIASES[old])


def test_moved_names_import_from_their_old_paths():
    from dspark_jax.bench.common import StealMeter, host_facts, print_table, save_json
    from dspark_jax.bench.llamacpp_interop import InteropError, write_target_hf
    from dspark_jax.measurement import host_facts as hf
    from dspark_jax.models.io.gguf_to_hf import write_target_hf as w
    from dspark_jax.serving import Engine, speculative_generate
    from dspark_jax.serving.generate import SpecSettings, check_compatible

    assert write_target_hf is w and host_facts is hf
    assert all((StealMeter, print_table, save_json, InteropError, Engine, speculative_generate,
                SpecSettings, check_compatible))


CLI_ALIASES = {"dspark_jax.data.regenerate": "dspark_jax.data.regeneration",
               "dspark_jax.bench.tree_tau": "dspark_jax.experiments.tree_tau"}


@pytest.mark.parametrize("old, new", sorted(CLI_ALIASES.items()))
def test_old_cli_path_runs_the_command(old, new):
    r = subprocess.run([sys.executable, "-m", old, "--help"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m {new}")
