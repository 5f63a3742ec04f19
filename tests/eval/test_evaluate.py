"""Offline evaluation (dspark_jax.evaluate; SPEC §6/§7): the numbers in results.json are the
ones the raw per-round records imply, files are valid, the protocol's prompt handling and the
bad-input paths behave, and the CLI runs in-process.

The tiny setup is a random 3-layer target with the SmolLM2 vocabulary (49152 ids) saved next to
the SmolLM2 tokenizer files, so the real chat template renders the prompts; the drafter is a
random 1-layer DSpark with a confidence head. `tiny_models` builds them once per session and
`tiny_eval_env` adds one evaluation run; `test_calibrate.py` and `test_notebook.py` reuse them.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any

import numpy as np
import pytest

from dspark_jax.data.chat import render_prompt
from dspark_jax.data.prompts import load_eval_dataset
from dspark_jax.eval import runner
from dspark_jax.eval.calibration import calibration_report, verified_mask
from dspark_jax.eval.results import load_results
from dspark_jax.evaluate import (EvalDatasetError, RESULTS_SCHEMA, build_parser, evaluate, main,
                                 paper_reference_for)
from dspark_jax.models import Draft
from dspark_jax.models.config import ConfigError

PROMPTS = {
    "alpha": ["What is 2+2?", "Name a colour.", "Say hi to the reader."],
    # the second prompt (~300 tokens) does not fit the tiny target's 256-token cache limit
    "beta": ["Count to three.", "word " * 300, "Why is the sky blue?"],
}
DRAFT_CFG = dict(block_size=4, num_draft_layers=1, mask_token_id=0, markov_rank=8)
MAX_NEW = 12
RUN_KW = dict(max_new_tokens=MAX_NEW, batch_size=2, progress=False)

_MODELS: dict[str, Any] = {}
_ENV: dict[str, Any] = {}


def _write_datasets(root: pathlib.Path) -> pathlib.Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, turns in PROMPTS.items():
        lines = [json.dumps({"turns": [t, "a second turn that must be ignored"]}) for t in turns]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _build_models(base: pathlib.Path) -> None:
    from dspark_jax.models import init_draft, load_target
    from dspark_jax.models.config import DecoderConfig
    from dspark_jax.models.decoder import create_target
    from dspark_jax.models.io.hf import export_hf_target
    from dspark_jax.models.tokenizer import load_tokenizer

    cfg = DecoderConfig(family="llama", vocab_size=49152, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, tie_word_embeddings=True, max_position_embeddings=256,
                        bos_token_id=1, eos_token_id=2)
    export_hf_target(create_target(cfg, seed=0), base / "target")
    load_tokenizer("smollm2-135m-instruct").hf.save_pretrained(base / "target")
    target = load_target(base / "target")
    init_draft(target, DRAFT_CFG, seed=1).save(base / "draft")
    _write_datasets(base / "data")
    (base / "models.done").touch()


def _shared(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, Any]:
    """The session's shared directory and its lock (under pytest-xdist: one for all workers)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return root / "tiny_eval_shared", FileLock(str(root / "tiny_eval_shared.lock"))


def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny target and drafter (loaded, and their directories) and the prompt datasets.

    Built once per test session: under pytest-xdist the first worker builds them in the
    session's shared temp root (under a file lock) and the others load them.
    """
    if _MODELS:
        return _MODELS
    from dspark_jax.models import load_draft, load_target

    shared, lock = _shared(tmp_path_factory)
    with lock:
        if not (shared / "models.done").is_file():
            _build_models(shared)
    target = load_target(shared / "target")
    _MODELS.update(target=target, draft=load_draft(shared / "draft", target=target),
                   target_dir=shared / "target", draft_dir=shared / "draft",
                   data=shared / "data")
    return _MODELS


def tiny_eval_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`tiny_models` and one finished evaluation of them (`out`, `results`), once per session
    like the models."""
    if _ENV:
        return _ENV
    m = tiny_models(tmp_path_factory)
    shared, lock = _shared(tmp_path_factory)
    out = shared / "run"
    with lock:
        if (out / "results.json").is_file():
            results = json.loads((out / "results.json").read_text())
        else:
            results = evaluate(m["target"], m["draft"], m["data"], datasets=["alpha", "beta"],
                               out_dir=out, baseline=True, save_outputs=True, **RUN_KW)
    _ENV.update(m, out=out, results=results)
    return _ENV


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return tiny_eval_env(tmp_path_factory)


def _records(out: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()
            if line.strip()]


# ------------------------------------------------------------------------------------------
# results.json contents
# ------------------------------------------------------------------------------------------

DATASET_KEYS = {"num_prompts", "num_evaluated", "num_skipped", "skipped_ids", "rounds", "gamma",
                "tau", "verify_rate", "accept_rate_at", "conditional_acceptance",
                "total_accepted", "total_proposed", "num_output_tokens", "mean_output_tokens",
                "mean_prompt_tokens", "wall_s", "compile_s", "tokens_per_s",
                "tokens_per_s_excl_compile", "calibration", "baseline"}


def test_results_json_has_documented_keys(env):
    res = json.loads((env["out"] / "results.json").read_text())
    assert res["schema"] == RESULTS_SCHEMA
    assert {"schema", "config", "environment", "datasets", "mean", "calibration",
            "paper_reference", "total_wall_s", "files"} <= set(res)
    cfg = res["config"]
    assert cfg["datasets"] == ["alpha", "beta"] and cfg["gamma"] == 4
    assert cfg["temperature"] == 1.0 and cfg["max_new_tokens"] == MAX_NEW
    assert cfg["enable_thinking"] is False and cfg["first_turn_only"] is True
    assert cfg["has_confidence_head"] is True and cfg["baseline"] is True
    for name in ("alpha", "beta"):
        e = res["datasets"][name]
        assert DATASET_KEYS <= set(e), DATASET_KEYS - set(e)
        assert e["rounds"] > 0 and e["tau"] >= 1.0
        assert len(e["accept_rate_at"]) == len(e["conditional_acceptance"]) == 4
        assert e["tokens_per_s"] > 0 and 0 <= e["compile_s"] <= e["wall_s"]
        assert set(e["baseline"]) >= {"tokens_per_s", "speedup", "speedup_excl_compile",
                                      "wall_s", "num_output_tokens"}
        assert e["baseline"]["speedup"] > 0
        assert set(e["calibration"]) >= {"mean_ece", "mean_auroc", "mean_brier", "slots"}
        assert len(e["calibration"]["slots"]) == 4
    assert {"tau", "verify_rate", "accept_rate_at", "conditional_acceptance", "speedup",
            "tokens_per_s"} <= set(res["mean"])
    # alpha/beta are not paper datasets: no reference row
    assert res["paper_reference"] is None
    # the returned dict is what was written (up to float formatting)
    returned = env["results"]["datasets"]["alpha"]["tau"]
    assert res["datasets"]["alpha"]["tau"] == pytest.approx(returned)


def test_statistics_recomputed_from_raw_records(env):
    res = json.loads((env["out"] / "results.json").read_text())
    recs = _records(env["out"])
    g = res["config"]["gamma"]
    taus = []
    for name in ("alpha", "beta"):
        rs = [r for r in recs if r["dataset"] == name]
        e = res["datasets"][name]
        assert len(rs) == e["num_evaluated"]
        prop = np.array([p for r in rs for p in r["proposed"]])
        acc = np.array([a for r in rs for a in r["accepted"]])
        alen = np.array([x for r in rs for x in r["acceptance"]])
        assert len(prop) == len(alen) == e["rounds"] and (acc <= prop).all()
        # DeepSpec's bookkeeping: accepted + 1, or on a stop round eos_pos + 1 for all three
        stop = alen == acc
        assert ((alen == acc + 1) | (stop & (prop == acc) & (acc >= 1))).all()
        assert (prop[~stop] == g).all()
        tau = alen.sum() / len(alen)
        assert e["tau"] == pytest.approx(tau, rel=1e-12)
        assert e["verify_rate"] == pytest.approx(alen.sum() / (prop.sum() + len(prop)))
        cum = [np.sum(acc >= k + 1) / np.sum(prop > k) for k in range(g)]
        assert e["accept_rate_at"] == pytest.approx(cum)
        for k in range(g):
            assert 0.0 <= e["accept_rate_at"][k] <= 1.0
            c = e["conditional_acceptance"][k]
            if k == 0:
                assert c == pytest.approx(cum[0])
            elif cum[k - 1] > 0:
                assert c == pytest.approx(cum[k] / cum[k - 1])
                assert 0.0 <= c <= 1.0
            else:
                assert c is None
        # DeepSpec's budget rule (`while start < max_length`): every round starts with at most
        # MAX_NEW tokens out (the prefill's token + the rounds' acceptance lengths), and the
        # output is what the rounds committed, cut at MAX_NEW
        # and it ends on a stop token or past MAX_NEW (a round that lands exactly on MAX_NEW is
        # followed by one more, as in DeepSpec's loop)
        t = env["target"]
        stops = set(getattr(t.tokenizer, "stop_token_ids", None) or t.config.stop_token_ids)
        for r in rs:
            out = 1 + np.cumsum([0] + r["acceptance"])   # tokens out before each round, after
            assert (out[:-1] <= MAX_NEW).all()
            assert r["output_tokens"] == len(r["output_ids"]) == min(out[-1], MAX_NEW)
            assert out[-1] > MAX_NEW or r["output_ids"][-1] in stops
        n_tok = sum(r["output_tokens"] for r in rs)
        assert e["num_output_tokens"] == n_tok
        assert e["mean_output_tokens"] == pytest.approx(n_tok / len(rs))
        taus.append(tau)
    assert res["mean"]["tau"] == pytest.approx(np.mean(taus))


def test_tau_counts_a_stop_round_as_deepspec(env, tmp_path, monkeypatch):
    """results.json's τ is DeepSpec's: a round whose accepted drafts hold a stop token at index
    e counts e + 1 (no bonus), with e + 1 as its accepted and proposed counts too. The decoding
    is replaced by fixed per-round records (two requests, γ = 4):

        request 0: proposed [4, 4, 2], accepted [1, 4, 2], acceptance [2, 5, 2]  (stop at e = 1)
        request 1: proposed [4, 1],    accepted [0, 1],    acceptance [1, 1]     (stop at e = 0)

    DeepSpec: τ = (2 + 5 + 2 + 1 + 1) / 5 = 2.2; counting accepted + 1 every round would give
    (2 + 5 + 3 + 1 + 2) / 5 = 2.6."""
    import dspark_jax.serving.generation as spec_mod

    fake = dict(proposed=[[4, 4, 2], [4, 1]], accepted=[[1, 4, 2], [0, 1]],
                acceptance=[[2, 5, 2], [1, 1]], tokens=[[5] * 10, [6] * 2])

    def fake_generate(target, draft, prompts, **kw):
        n = len(prompts)
        return spec_mod.SpecResult(
            tokens=fake["tokens"][:n], proposed=fake["proposed"][:n],
            accepted=fake["accepted"][:n], rounds=3,
            confidence=[np.zeros((len(p), 4), np.float32) for p in fake["proposed"][:n]],
            acceptance=fake["acceptance"][:n])

    monkeypatch.setattr(spec_mod, "speculative_generate", fake_generate)
    res = evaluate(env["target"], env["draft"], env["data"], datasets="alpha", max_samples=2,
                   out_dir=tmp_path, plots=False, **RUN_KW)
    a = res["datasets"]["alpha"]
    assert a["rounds"] == 5
    assert a["tau"] == pytest.approx(11 / 5)
    assert a["verify_rate"] == pytest.approx(11 / (15 + 5))
    # per position (DeepSpec's accepted_at_pos / proposals_at_pos): the stop rounds proposed 2
    # and 1 drafts
    assert a["accept_rate_at"] == pytest.approx([4 / 5, 2 / 4, 1 / 3, 1 / 3])
    recs = _records(tmp_path)
    assert sorted(r["acceptance"] for r in recs) == sorted(fake["acceptance"])
    assert json.loads((tmp_path / "results.json").read_text())["datasets"]["alpha"]["tau"] == \
        pytest.approx(2.2)


def test_calibration_recomputed_from_confidence_logits(env):
    res = json.loads((env["out"] / "results.json").read_text())
    recs = _records(env["out"])
    conf = np.load(env["out"] / "confidence.npz")
    all_l, all_p, all_a = [], [], []
    for name in ("alpha", "beta"):
        rs = [r for r in recs if r["dataset"] == name]
        prop = np.array([p for r in rs for p in r["proposed"]])
        acc = np.array([a for r in rs for a in r["accepted"]])
        logits = conf[name]
        assert logits.shape == (len(acc), 4) and np.isfinite(logits).all()
        rep = calibration_report(logits, acc, mask=verified_mask(prop, 4))
        got = res["datasets"][name]["calibration"]
        assert got["mean_ece"] == pytest.approx(rep.mean_ece)
        assert [s["ece"] for s in got["slots"]] == pytest.approx([s.ece for s in rep.slots])
        assert [s["brier"] for s in got["slots"]] == pytest.approx([s.brier for s in rep.slots])
        all_l.append(logits), all_p.append(prop), all_a.append(acc)
    pooled = calibration_report(np.concatenate(all_l), np.concatenate(all_a),
                                mask=verified_mask(np.concatenate(all_p), 4))
    assert res["calibration"]["mean_ece"] == pytest.approx(pooled.mean_ece)
    assert [s["n"] for s in res["calibration"]["slots"]] == [s.n for s in pooled.slots]


def test_protocol_prompts_subsampling_and_overlong_skip(env):
    res = env["results"]
    recs = _records(env["out"])
    tok = env["target"].tokenizer
    beta = res["datasets"]["beta"]
    assert beta["num_prompts"] == 3 and beta["num_evaluated"] == 2 and beta["num_skipped"] == 1
    assert beta["skipped_ids"] == ["beta-1"]
    assert res["mean"]["num_skipped"] == 1
    assert {r["id"] for r in recs} == {"alpha-0", "alpha-1", "alpha-2", "beta-0", "beta-2"}
    for r in recs:
        conv = load_eval_dataset(env["data"], r["dataset"], None)[r["index"]]
        assert conv.id == r["id"] and len(conv.messages) == 1  # first turn only
        ids = render_prompt(conv.messages, tok, enable_thinking=False)
        assert r["prompt_tokens"] == len(ids)
    # the generation prompt is on: the rendered prompt ends with the assistant header
    ids = render_prompt(load_eval_dataset(env["data"], "alpha", None)[0].messages, tok)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_png_files_are_valid(env):
    import matplotlib.image

    res = json.loads((env["out"] / "results.json").read_text())
    plots = res["files"]["plots"]
    assert set(plots) == {"tau", "conditional_acceptance", "accept_rate", "reliability"}
    for rel in plots.values():
        path = env["out"] / rel
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(path)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert float(img[..., :3].std()) > 0.01  # not a blank canvas


def test_results_markdown(env):
    md = (env["out"] / "results.md").read_text()
    res = env["results"]
    assert "| target | drafter | alpha | beta | Mean |" in md
    assert f"{res['datasets']['alpha']['tau']:.2f}" in md
    assert f"{res['mean']['tau']:.2f}" in md
    assert "conditional" in md and "ECE" in md and "speedup" in md


def test_greedy_speculative_equals_autoregressive_baseline(env, tmp_path):
    res = evaluate(env["target"], env["draft"], env["data"], datasets="alpha,beta",
                   temperature=0.0, baseline=True,
                   save_outputs=True, out_dir=tmp_path, plots=False, **RUN_KW)
    recs = _records(tmp_path)
    assert len(recs) == 5
    for r in recs:  # lossless: T = 0 speculative output is the target's greedy output
        assert r["output_ids"] == r["baseline_output_ids"]
    assert res["mean"]["speedup"] > 0
    assert not (tmp_path / "tau.png").exists()


def test_tree_budget_evaluates_trees_losslessly(env, tmp_path):
    """--tree-budget: greedy tree decoding equals the baseline, results.json records the
    budget, τ is the tree's and no calibration is claimed for it."""
    res = evaluate(env["target"], env["draft"], env["data"], datasets="alpha,beta",
                   temperature=0.0, baseline=True, save_outputs=True, out_dir=tmp_path,
                   plots=False, tree_budget=8, tree_branching=3, **RUN_KW)
    assert res["config"]["tree_budget"] == 8 and res["config"]["tree_branching"] == 3
    assert env["results"]["config"]["tree_budget"] == 0
    for r in _records(tmp_path):
        assert r["output_ids"] == r["baseline_output_ids"]
    assert res["calibration"] is None
    assert all(ds["tau"] >= 1.0 for ds in res["datasets"].values())


# ------------------------------------------------------------------------------------------
# the driver (eval.runner) and reading a run back (eval.results)
# ------------------------------------------------------------------------------------------

def test_runner_prepares_prompts_and_batches(env, tmp_path):
    data = env["data"]
    assert runner.resolve_datasets(data, None) == ["alpha", "beta"]  # no default: all there
    assert runner.resolve_datasets(data, "beta, alpha,beta") == ["beta", "alpha"]
    with pytest.raises(EvalDatasetError) as e:
        runner.resolve_datasets(data, ["gamma"])
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvalDatasetError, match="no <name>.jsonl prompt files in .*empty"):
        runner.resolve_datasets(tmp_path / "empty", None)
    tok = env["target"].tokenizer
    prep = runner.prepare(data, ["alpha", "beta"], tok, max_samples={"alpha": 2, "beta": None},
                          seed=980406, max_new_tokens=MAX_NEW, gamma=4, limit=256)
    a, b = prep["alpha"], prep["beta"]
    assert [c.id for c in a.convs] == [c.id for c in load_eval_dataset(data, "alpha", 2)]
    assert b.keep == [0, 2] and b.skipped == [1] and b.skipped_ids == ["beta-1"]
    assert b.prompts == [b.ids[0], b.ids[2]]
    assert all(runner.fits(len(q), MAX_NEW, 4, 256) for p in prep.values() for q in p.prompts)
    assert not runner.fits(len(b.ids[1]), MAX_NEW, 4, 256)
    # one cache length: longest prompt + output + γ + 2, up to a multiple of 64, capped
    assert runner.cache_length([10, 50], 12, 4, 256) == 128
    assert runner.cache_length([10, 46], 12, 4, 256) == 64
    assert runner.cache_length([200], 100, 4, 256) == 256
    assert runner.length_batches([5, 3, 5, 1, 3], 2) == [[3, 1], [4, 0], [2]]


def test_runner_decode_keeps_prompt_order_and_seeds_batches(env, monkeypatch):
    """Outputs come back in the prompts' order, batches run shortest first, batch b samples
    with batch_seed(b), and DeepSpec's acceptance lengths / confidence rows are kept."""
    import dspark_jax.serving.generation as spec_mod

    calls = []

    def fake_generate(target, draft, prompts, *, seed, max_cache_len, **kw):
        calls.append((list(map(len, prompts)), seed, max_cache_len))
        n = len(prompts)
        return spec_mod.SpecResult(
            tokens=[[len(p)] * 3 for p in prompts], proposed=[[4, 4]] * n,
            accepted=[[1, 4]] * n, rounds=2, acceptance=[[2, 5]] * n,
            confidence=[np.full(8, len(p), np.float32) for p in prompts])

    monkeypatch.setattr(spec_mod, "speculative_generate", fake_generate)
    prompts = [[1] * 5, [1] * 2, [1] * 7, [1] * 3]
    dec = runner.decode(env["target"], env["draft"], prompts, batch_size=3,
                        batch_seed=lambda b: 100 + b, max_new_tokens=4, temperature=1.0,
                        cache_len=64)
    assert calls == [([2, 3, 5], 100, 64), ([7], 101, 64)]
    assert dec.order == [1, 3, 0, 2]
    assert [o.tokens for o in dec.outputs] == [[5] * 3, [2] * 3, [7] * 3, [3] * 3]
    o = dec.outputs[2]
    assert (o.proposed, o.accepted, o.acceptance) == ([4, 4], [1, 4], [2, 5])
    assert o.confidence.shape == (2, 4) and (o.confidence == 7).all()
    assert dec.wall_s >= 0 and dec.compile_s >= 0


def test_evaluate_seeds_each_dataset_batch(env, tmp_path, monkeypatch):
    """evaluate's seed rule (`_batch_seed(seed, dataset, batch index)`), unchanged by the
    shared driver."""
    import zlib

    import dspark_jax.serving.generation as spec_mod

    seeds = []

    def fake_generate(target, draft, prompts, *, seed, **kw):
        seeds.append(seed)
        n = len(prompts)
        return spec_mod.SpecResult(tokens=[[5]] * n, proposed=[[4]] * n, accepted=[[0]] * n,
                                   rounds=1, acceptance=[[1]] * n,
                                   confidence=[np.zeros((1, 4), np.float32)] * n)

    monkeypatch.setattr(spec_mod, "speculative_generate", fake_generate)
    evaluate(env["target"], env["draft"], env["data"], datasets="alpha,beta", seed=7,
             plots=False, **RUN_KW)
    want = [(7 * 1_000_003 + zlib.crc32(n.encode()) + b) % 2 ** 31
            for n, nb in (("alpha", 2), ("beta", 1)) for b in range(nb)]
    assert seeds == want


def test_load_results_reads_the_run_back(env):
    run = load_results(env["out"])  # the directory or its results.json
    assert run.path == env["out"] / "results.json"
    assert run.results["datasets"]["alpha"]["tau"] == pytest.approx(
        env["results"]["datasets"]["alpha"]["tau"])
    assert run.evaluated == ["alpha", "beta"]
    assert [r["id"] for r in run.records["beta"]] == ["beta-0", "beta-2"]
    logits, prop, acc = run.pooled_rounds()
    assert logits.shape == (len(prop), 4) and len(acc) == len(prop)
    assert len(prop) == sum(run.results["datasets"][n]["rounds"] for n in ("alpha", "beta"))
    np.testing.assert_array_equal(logits[:len(run.confidence["alpha"])], run.confidence["alpha"])
    with pytest.raises(FileNotFoundError, match="python -m dspark_jax.evaluate"):
        load_results(env["out"] / "nope" / "results.json")


# ------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------

def test_missing_dataset_lists_available(env):
    with pytest.raises(EvalDatasetError, match=r"\['nope'\].*available: \['alpha', 'beta'\]"):
        evaluate(env["target"], env["draft"], env["data"], datasets=["alpha", "nope"], **RUN_KW)
    # no protocol dataset in the directory and none requested
    with pytest.raises(EvalDatasetError, match="available: \\['alpha', 'beta'\\]"):
        evaluate(env["target"], env["draft"], env["data"], **RUN_KW)
    with pytest.raises(EvalDatasetError, match="does not exist"):
        evaluate(env["target"], env["draft"], env["data"] / "missing", datasets="alpha", **RUN_KW)


def test_draft_for_another_target_raises_config_error(env):
    d = env["draft"]
    other = d.config.replace(target=d.config.target.replace(hidden_size=64))
    with pytest.raises(ConfigError, match="hidden_size"):
        evaluate(env["target"], Draft(other, d.graphdef, d.state), env["data"],
                 datasets="alpha", **RUN_KW)


def test_bad_arguments(env):
    for kw in (dict(max_new_tokens=0), dict(batch_size=0), dict(temperature=-1.0),
               dict(verifier="cuda"), dict(max_samples="some")):
        with pytest.raises(ValueError):
            evaluate(env["target"], env["draft"], env["data"], datasets="alpha",
                     **{**RUN_KW, **kw})


def test_dtype_other_than_the_loaded_targets_raises(env):
    with pytest.raises(ValueError, match="dtype='bfloat16', but the loaded target computes in "
                                         "float32"):
        evaluate(env["target"], env["draft"], env["data"], datasets="alpha", dtype="bfloat16",
                 **RUN_KW)
    # the target's own dtype (or None) passes; max_cache_len=1 then stops before any decoding
    for dtype in (None, "float32", "fp32"):
        with pytest.raises(ValueError, match="max_cache_len must be ≥ 2"):
            evaluate(env["target"], env["draft"], env["data"], datasets="alpha", dtype=dtype,
                     max_cache_len=1, **RUN_KW)


def test_all_prompts_too_long_for_cache_limit_are_skipped(env, tmp_path):
    res = evaluate(env["target"], env["draft"], env["data"], datasets="alpha",
                   max_cache_len=20, out_dir=tmp_path, plots=False, **RUN_KW)
    a = res["datasets"]["alpha"]
    assert a["num_skipped"] == 3 and a["num_evaluated"] == 0 and a["rounds"] == 0
    assert a["tau"] is None
    assert json.loads((tmp_path / "results.json").read_text())["mean"]["num_skipped"] == 3


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------

def test_cli_defaults_follow_the_protocol():
    args = build_parser().parse_args(["--target", "t", "--draft", "d", "--data-dir", "x"])
    assert (args.temperature, args.max_new_tokens, args.seed, args.max_samples) == \
        (1.0, 2048, 980406, "default")
    assert args.batch_size == 8 and not args.baseline and args.verifier == "jax"
    assert not args.enable_thinking and args.system_prompt is None
    args = build_parser().parse_args(["--target", "t", "--draft", "d", "--data-dir", "x",
                                      "--max-samples", "all", "--verifier", "pallas"])
    assert args.max_samples is None and args.verifier == "pallas"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--target", "t", "--draft", "d", "--data-dir", "x",
                                   "--max-samples", "-3"])


def test_cli_runs_in_process(env, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["--target", str(env["target_dir"]), "--draft", str(env["draft_dir"]),
               "--data-dir", str(env["data"]), "--datasets", "alpha", "--max-samples", "2",
               "--max-new-tokens", str(MAX_NEW), "--batch-size", "2", "--temperature", "0",
               "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["max_samples"] == {"alpha": 2} and res["config"]["temperature"] == 0.0
    assert res["datasets"]["alpha"]["num_prompts"] == 2
    # DeepSpec's seeded subsample of 2 out of 3
    want = [c.id for c in load_eval_dataset(env["data"], "alpha", 2, seed=980406)]
    assert sorted(r["id"] for r in _records(out)) == sorted(want)
    assert "| target | drafter | alpha | Mean |" in capsys.readouterr().out
    # errors: missing dataset → exit 2 with the available names
    rc = main(["--target", str(env["target_dir"]), "--draft", str(env["draft_dir"]),
               "--data-dir", str(env["data"]), "--datasets", "gsm8k", "--out", str(out),
               "--no-progress"])
    assert rc == 2
    assert "available: ['alpha', 'beta']" in capsys.readouterr().err


def test_paper_reference_selection():
    assert paper_reference_for("smollm2-135m-instruct", "dspark") == ("qwen3_4b", "dspark")
    assert paper_reference_for("/ckpt/Qwen3-8B", "dflash") == ("qwen3_8b", "dflash")
    assert paper_reference_for("x", "dspark", "qwen3_14b/eagle3") == ("qwen3_14b", "eagle3")
    assert paper_reference_for("x", "dspark", "none") is None
    with pytest.raises(ValueError):
        paper_reference_for("x", "dspark", "llama/dspark")


# ------------------------------------------------------------------------------------------
# real model
# ------------------------------------------------------------------------------------------

EVAL_DIR = pathlib.Path("/work/shared/eval_datasets")


@pytest.mark.slow
def test_real_smollm2_random_draft_gsm8k(tmp_path):
    if not (EVAL_DIR / "gsm8k.jsonl").is_file():
        pytest.skip(f"{EVAL_DIR}/gsm8k.jsonl not available")
    from dspark_jax.models import init_draft, load_target

    target = load_target("smollm2-135m-instruct")
    draft = init_draft(target, dict(block_size=4, num_draft_layers=1, markov_rank=16), seed=0)
    res = evaluate(target, draft, EVAL_DIR, datasets="gsm8k", max_samples=2, max_new_tokens=24,
                   batch_size=2, out_dir=tmp_path, progress=False)
    g = res["datasets"]["gsm8k"]
    assert g["num_evaluated"] == 2 and g["rounds"] > 0
    recs = _records(tmp_path)
    alen = np.array([x for r in recs for x in r["acceptance"]])
    assert g["tau"] == pytest.approx(alen.mean())
    assert 1.0 <= g["tau"] <= 5.0
    want = [c.id for c in load_eval_dataset(EVAL_DIR, "gsm8k", 2)]
    assert sorted(r["id"] for r in recs) == sorted(want)
    # gsm8k is a paper dataset: the Qwen3-4B DSpark row is shown for reference
    assert res["paper_reference"]["tau"]["gsm8k"] == pytest.approx(6.11)
    assert "DSpark (paper)" in (tmp_path / "results.md").read_text()
    assert math.isfinite(res["calibration"]["mean_ece"])
