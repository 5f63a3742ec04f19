"""The training job's stage (e) outside a full run: a failed import inside dspark_jax is an error,
never a skipped evaluation; a missing optional dependency (PyTorch, DeepSpec's source) skips the
DeepSpec-loop check with the reason; the export passes the verifier to the format that records
it."""

from __future__ import annotations

import json
import sys

import pytest

from dspark_jax.models import init_draft, load_target
from dspark_jax.train import eval_stage
from dspark_jax.train.job_config import parse_config
from hf_tiny import save_tiny_hf
from tiny_job import TINY_CONFIG


def _config(*overrides: str):
    return parse_config(["p", f"--config={TINY_CONFIG}", "--config.target=some/target",
                         *overrides])


def test_an_import_error_inside_the_package_propagates(monkeypatch, tmp_path):
    """dspark_jax.evaluate fails to import (here: a module it imports is unavailable): the
    speculative evaluation raises instead of reporting itself skipped."""
    monkeypatch.delitem(sys.modules, "dspark_jax.evaluate", raising=False)
    monkeypatch.setitem(sys.modules, "dspark_jax.eval.results_markdown", None)
    with pytest.raises(ImportError, match="dspark_jax.eval.results_markdown"):
        eval_stage.speculative_hook(_config("--config.eval.speculative=True"), None, None, [],
                                    tmp_path)


def test_missing_optional_dependencies_skip_with_the_reason(monkeypatch, tmp_path):
    c = _config(f"--config.eval.deepspec_src={tmp_path}", "--config.eval.deepspec_check_samples=1")
    monkeypatch.setitem(sys.modules, "deepspec", None)        # not installed
    out = eval_stage.deepspec_check(c, None, tmp_path / "export", [])
    assert "no deepspec/ package there" in out["skipped"] and str(tmp_path) in out["skipped"]
    monkeypatch.setitem(sys.modules, "torch", None)
    out = eval_stage.deepspec_check(c, None, tmp_path / "export", [])
    assert out == {"skipped": "PyTorch is not installed (pip install -e '.[interop]')"}


def test_export_draft_gives_the_verifier_to_speculators_only(tmp_path):
    from dspark_jax.train.step import split_draft

    target = load_target(save_tiny_hf(tmp_path / "t", "qwen3", layers=3))
    base = dict(block_size=4, num_draft_layers=1, target_layer_ids=(0, 1), mask_token_id=96,
                markov_rank=4)
    full = init_draft(target, base, seed=0)
    out = eval_stage.export_draft(*split_draft(full.model), tmp_path / "full", verifier="tgt")
    assert out["format"] == "deepspec" and out["deepspec"] == tmp_path / "full"
    pruned = init_draft(target, dict(base, draft_vocab_size=8, draft_vocab=tuple(range(8))),
                        seed=0)
    out = eval_stage.export_draft(*split_draft(pruned.model), tmp_path / "pruned",
                                  verifier="tgt")
    cfg = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert out["format"] == "speculators"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tgt"
    assert (tmp_path / "pruned-deepspec-fullvocab" / "config.json").is_file()
