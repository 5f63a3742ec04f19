"""One way to pass serving settings: `settings=EngineSettings(...)` to `Engine` and
`speculative_generate`, an `EvalConfig` to `evaluate`. The keyword forms that existing code
still calls (`EngineSettings` fields as keywords, a `SpecSettings`, `evaluate(target, draft,
data_dir, **fields)`) give the same result with a `DeprecationWarning` naming the call to
write; a keyword that is no setting is a TypeError naming it; the library calls only the one
way."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import warnings

import numpy as np
import pytest

from dspark_jax import evaluate as evaluate_mod
from dspark_jax.eval.eval_config import EvalConfig
from dspark_jax.models import init_draft, load_target
from dspark_jax.serving import (Engine, EngineSettings, SpecSettings, generation_settings,
                                speculative_generate)
from hf_tiny import save_tiny_hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRAFT = dict(block_size=4, num_draft_layers=1, target_layer_ids=(0, 1), mask_token_id=96,
             markov_rank=8)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]
RUN = dict(max_new_tokens=8, temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                      layers=3, seed=1))
    return target, init_draft(target, DRAFT, seed=3)


def _same(a, b) -> None:
    assert a.tokens == b.tokens and a.proposed == b.proposed and a.accepted == b.accepted
    assert a.acceptance == b.acceptance and a.rounds == b.rounds
    if a.confidence is None or b.confidence is None:
        assert a.confidence is b.confidence is None
    else:
        for x, y in zip(a.confidence, b.confidence):
            np.testing.assert_array_equal(x, y)


def test_keyword_form_warns_and_decodes_as_the_settings_form(models):
    target, draft = models
    ours = speculative_generate(target, draft, PROMPTS, **RUN, settings=generation_settings(
        stop_token_ids=[], verifier="jax"))
    with pytest.warns(DeprecationWarning, match=r"pass settings=generation_settings\("
                                                r"stop_token_ids=\[\], verifier='jax'\)") as rec:
        old = speculative_generate(target, draft, PROMPTS, **RUN, stop_token_ids=[],
                                   verifier="jax")
    assert rec[0].filename == __file__   # the warning points at the caller's line
    _same(ours, old)
    with pytest.warns(DeprecationWarning, match=r"dataclasses\.replace\(settings, "
                                                r"stop_token_ids=\[\]\)"):
        beside = speculative_generate(target, draft, PROMPTS, **RUN,
                                      settings=generation_settings(verifier="jax"),
                                      stop_token_ids=[])
    _same(ours, beside)
    with pytest.warns(DeprecationWarning, match=r"SpecSettings.*generation_settings\("
                                                r"verifier='jax'\), top_k=0"):
        spec = speculative_generate(target, draft, PROMPTS, **RUN, stop_token_ids=[],
                                    settings=SpecSettings(verifier="jax"))
    _same(ours, spec)


def test_the_settings_form_does_not_warn(models):
    target, draft = models
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        speculative_generate(target, draft, PROMPTS[:1], max_new_tokens=2,
                             settings=generation_settings(stop_token_ids=[]))
        Engine(target, draft, settings=EngineSettings(scheduler="fixed", max_requests=1,
                                                      max_len=32, stop_token_ids=[]))


def test_engine_keyword_form_warns_and_builds_the_same_settings(models):
    target, draft = models
    fields = dict(scheduler="fixed", max_requests=2, max_len=32, stop_token_ids=[])
    ours = Engine(target, draft, settings=EngineSettings(**fields))
    with pytest.warns(DeprecationWarning, match=r"pass settings=EngineSettings\("
                                                r"scheduler='fixed', max_requests=2") as rec:
        old = Engine(target, draft, **fields)
    assert rec[0].filename == __file__
    assert dataclasses.asdict(old.spec.settings) == dataclasses.asdict(ours.spec.settings)
    assert old.generate(PROMPTS, max_new_tokens=4).tokens == ours.generate(
        PROMPTS, max_new_tokens=4).tokens


def test_evaluate_fields_form_warns_and_runs_the_same_config(monkeypatch, tmp_path):
    seen = []

    def stop(config):
        seen.append(config)
        raise RuntimeError("models not needed")

    monkeypatch.setattr(evaluate_mod, "load_models", stop)
    monkeypatch.setattr(evaluate_mod.runner, "resolve_datasets", lambda *a: ["alpha"])
    config = EvalConfig("t", "d", tmp_path, datasets="alpha", max_new_tokens=8)
    with pytest.raises(RuntimeError, match="models not needed"):
        evaluate_mod.evaluate(config)
    with pytest.warns(DeprecationWarning, match=r"pass evaluate\(EvalConfig\(target, draft, "
                                                r"data_dir, datasets=..., max_new_tokens=...\)\)"
                      ) as rec:
        with pytest.raises(RuntimeError, match="models not needed"):
            evaluate_mod.evaluate("t", "d", tmp_path, datasets="alpha", max_new_tokens=8)
    assert seen[0] == seen[1] == config
    assert rec[0].filename == __file__


@pytest.mark.parametrize("call", ["speculative_generate", "Engine", "evaluate"])
def test_an_unknown_keyword_is_a_type_error_naming_it(models, call, tmp_path):
    target, draft = models
    calls = {
        "speculative_generate": lambda: speculative_generate(target, draft, PROMPTS,
                                                             max_new_tokens=4, schedular="none"),
        "Engine": lambda: Engine(target, draft, schedular="none"),
        "evaluate": lambda: evaluate_mod.evaluate(target, draft, tmp_path, schedular="none"),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)   # refused before any warning
        with pytest.raises(TypeError, match=rf"{call}\(\) got unexpected keyword "
                                            r"argument\(s\) 'schedular'"):
            calls[call]()
    with pytest.raises(TypeError, match="takes an EngineSettings, got dict"):
        speculative_generate(target, draft, PROMPTS, max_new_tokens=4,
                             settings={"scheduler": "none"})
    with pytest.raises(TypeError, match=r"Engine\(settings=...\) takes an EngineSettings"):
        Engine(target, draft, settings={"scheduler": "none"})


# the parameters each call takes besides settings fields; any other keyword is a setting
_PARAMETERS = {
    "Engine": {"settings"},
    "speculative_generate": {"max_new_tokens", "settings", "temperature", "seed", "top_k",
                             "top_p", "max_cache_len", "record_confidence", "progress"},
}


def _keyword_forms(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", None))
        kws = {k.arg for k in node.keywords}
        if name in _PARAMETERS and (None in kws or kws - _PARAMETERS[name]):
            found.append(f"{name}(...) at line {node.lineno}")
        if name == "evaluate" and len(node.args) >= 3:
            found.append(f"evaluate(target, draft, ...) at line {node.lineno}")
    return found


def test_the_library_passes_settings_one_way():
    """Every call of `Engine`, `speculative_generate` and `evaluate` in the package passes
    its settings as `settings=` / an `EvalConfig`."""
    offenders = {}
    for path in sorted((ROOT / "dspark_jax").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found = _keyword_forms(path)
        if found:
            offenders[rel] = found
    assert not offenders
