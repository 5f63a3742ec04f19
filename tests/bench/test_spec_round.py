"""`python -m dspark_jax.bench.spec_round`: the round's anatomy — plain step, verify at
each K, draft, host overhead, whole round, each as a ratio to the plain step, for each number of
requests — timed on the serving engine (the path users run), with the drafter a trained export
(`--draft DIR`, or the main job's by default) or random weights, and the pure-JAX and Pallas
sampler / verifier rows (interpreted on CPU, and labelled so)."""

from __future__ import annotations

import argparse
import json

import pytest

from dspark_jax.bench import spec_round
from dspark_jax.bench.spec_round import anatomy_table, bars, main, per_request_ks
from hf_tiny import save_tiny_hf


def test_verified_ks_double_up_to_the_rounds_k():
    assert per_request_ks(7) == [1, 2, 4, 8]
    assert per_request_ks(3) == [1, 2, 4]
    assert per_request_ks(4) == [1, 2, 4, 5]
    assert per_request_ks(7, [1, 3, 99]) == [1, 3, 8]   # γ+1 always, none past it


def _fake(R: int, plain: float, verify8: float, draft: float, whole: float) -> dict:
    return dict(requests=R, context=128, max_len=230, gamma=7, round_k=8, plain_step_ms=plain,
                plain_step_in_generate_ms=None, plain_steps_per_call=16,
                plain_device_step_ms=plain * 0.9,
                verify_ms={1: plain * 1.2, 2: plain * 1.3, 4: plain * 1.5, 8: verify8},
                draft_ms=draft, round_ms=whole, host_ms=whole - draft - verify8,
                sequential_stage_ms=0.1, sequential_share=0.1 / whole,
                steady_state_recompiles=0,
                engine_rounds=[dict(sampler="jax", verifier="jax", round_ms=whole, rounds=8,
                                    interpreted=False)])


def test_anatomy_table_gives_ratios_and_flags_the_cpu_bars():
    res = {"backend": "cpu",
           "drafter": dict(layers=2, block_size=7, draft_vocab=8192, pruned_vocab=True),
           "anatomy": [_fake(1, 30.0, 74.0, 14.7, 89.0), _fake(4, 50.0, 60.0, 5.0, 70.0)]}
    table = anatomy_table(res)
    rows = {ln.split(" | ")[0].lstrip("| "): ln for ln in table.splitlines()}
    assert "R=1 ms | × plain | R=4 ms | × plain | bar" in table.splitlines()[0]
    assert "| 30.0 | 1.00 |" in rows["plain decode step (1 token a request, engine `none`, "
                                     "one step a call)"]
    v8 = rows["verify K = 8 tokens a request (R·8)"]
    assert "2.47 FAIL" in v8 and "1.20 pass" in v8 and "≤ 1.5×" in v8
    d = next(ln for k, ln in rows.items() if k.startswith("draft ("))
    assert "draft vocab 8192" in d and "0.49 FAIL" in d and "0.10 pass" in d and "≤ 0.2×" in d
    w = next(ln for k, ln in rows.items() if k.startswith("whole round"))
    assert "2.97 FAIL" in w and "1.40 pass" in w and "≤ 1.6×" in w
    h = next(ln for k, ln in rows.items() if k.startswith("host overhead"))
    assert "| 0.3 |" in h                     # 89 − 14.7 − 74
    assert "sampler=pallas" not in table      # no Pallas rows were run
    assert bars("cpu", False)["draft"] == 0.3 and bars("gpu", True) == dict(
        verify=None, draft=None, round=1.15)


def _ns(**kw) -> argparse.Namespace:
    base = dict(draft=None, gamma=None, draft_layers=None, rank=None, head=None,
                dtype="float32")
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target and a drafter saved for it (an 'export')."""
    from dspark_jax.models import init_draft, load_target
    from dspark_jax.models.drafters.config import default_target_layer_ids

    root = tmp_path_factory.mktemp("round_bench")
    tdir = save_tiny_hf(root / "t", "qwen3", head_dim=16, layers=2, seed=1)
    target = load_target(str(tdir), with_tokenizer=False)
    cfg = target.config
    d = init_draft(target, dict(block_size=2, num_draft_layers=1, markov_rank=8,
                                target_layer_ids=default_target_layer_ids(
                                    cfg.num_hidden_layers),
                                mask_token_id=cfg.vocab_size - 1), seed=3)
    d.save(root / "export")
    return target, tdir, root / "export"


def test_drafter_choice(tiny, tmp_path, monkeypatch):
    target, _, export = tiny
    monkeypatch.chdir(tmp_path)   # no runs/smollm2_dspark/export here: a random drafter
    d, desc = spec_round.build_drafter(target, _ns())
    assert desc["source"] == "random weights" and "no runs" in desc["note"]
    assert desc["gamma"] == 7 and desc["layers"] == 5
    monkeypatch.setattr(spec_round, "DEFAULT_DRAFT", str(export))
    d, desc = spec_round.build_drafter(target, _ns())
    assert desc["source"] == f"trained: {export}" and desc["gamma"] == 2
    # a random-drafter shape option picks a random drafter even with the export present
    d, desc = spec_round.build_drafter(target, _ns(gamma=3, draft_layers=1, rank=8))
    assert desc["source"] == "random weights" and desc["gamma"] == 3
    d, desc = spec_round.build_drafter(target, _ns(draft=str(export)))
    assert desc["source"] == f"trained: {export}" and not desc["pruned_vocab"]


@pytest.mark.slow
def test_anatomy_on_cpu_with_a_saved_drafter(tiny, tmp_path, capsys):
    _, tdir, export = tiny
    out = tmp_path / "r.json"
    main(["--target", str(tdir), "--dtype", "float32", "--draft", str(export),
          "--requests", "2", "--context", "6", "--verify-ks", "1", "--rounds", "3",
          "--repeats", "1", "--no-kernels", "--tree-budgets", "4", "--json", str(out)])
    r = json.loads(out.read_text())
    (an,) = r["anatomy"]
    assert an["requests"] == 2 and an["gamma"] == 2 and an["round_k"] == 3
    assert set(an["verify_ms"]) == {"1", "3"}
    assert all(v > 0 for v in an["verify_ms"].values())
    assert an["plain_step_ms"] > 0 and an["draft_ms"] > 0 and an["round_ms"] > 0
    assert an["plain_device_step_ms"] > 0 and len(an["samples_ms"]["round"]) == 3
    assert an["host_ms"] == pytest.approx(an["round_ms"] - an["draft_ms"]
                                          - an["verify_ms"]["3"])
    assert an["steady_state_recompiles"] == 0
    rows = {(x["sampler"], x["verifier"]): x for x in an["engine_rounds"]}
    assert set(rows) == {("jax", "jax"), ("pallas", "jax"), ("jax", "pallas")}
    assert rows[("jax", "jax")]["round_ms"] == pytest.approx(an["round_ms"])
    assert not rows[("jax", "jax")]["interpreted"] and rows[("pallas", "jax")]["interpreted"]
    # the first R's figures under the keys bench.suite reads
    assert r["round_ms"] == pytest.approx(an["round_ms"]) and r["batch"] == 2
    assert r["round_over_step"] == pytest.approx(an["round_ms"] / an["plain_step_ms"])
    assert r["drafter"]["source"] == f"trained: {export}"
    text = capsys.readouterr().out
    assert "interpreted on CPU" in text and "whole round at K = 3" in text
    assert "verify K = 1 token a request" in text and "device call alone" in text
    (tree,) = an["trees"]
    assert tree["budget"] == 4 and min(tree["draft_ms"], tree["verify_ms"], tree["round_ms"]) > 0
    assert "tree of 4 nodes: whole round" in text
