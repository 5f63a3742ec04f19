"""The small-scale Table 1 (`python -m dspark_jax.experiments.table1`): its three configs share
data, steps and batch; end to end on the tiny target, interrupted (SIGKILL) in the second
drafter's training and rerun: the finished drafter is skipped, the interrupted one resumes from
its checkpoint, and the table, ratios, conditional acceptance, learning curve PNG, DeepSpec
exports and the calibration file are written."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from dspark_jax.experiments import table1, table1_report
from dspark_jax.train.job_config import parse_config
from train.tiny_job import REPO, make_tiny_target, write_prompt_files

CONFIGS = REPO / "configs"
STEPS, EVERY, KILL_AT = 4, 2, 2
LONG = "Explain in great detail " + "why the sky is blue and the sea is green " * 4


def _table1_config(drafter: str):
    return parse_config(["p", f"--config={CONFIGS / f'smollm2_table1_{drafter}.py'}",
                         "--config.target=some/target"])


def test_table1_configs_share_data_steps_and_batch():
    cs = {d: _table1_config(d) for d in table1.DRAFTERS}
    ref = cs["dspark"].to_dict()
    for d, c in cs.items():
        other = c.to_dict()
        for key in ("data", "train", "eval", "checkpoint", "mesh", "target"):
            assert other[key] == ref[key], (d, key)
        assert c.draft.model_type == d and c.name == f"smollm2_table1_{d}"
        assert tuple(c.draft.target_layer_ids) == tuple(cs["dspark"].draft.target_layer_ids)
    assert cs["dspark"].train.max_steps > 0 and cs["dspark"].eval.every_steps > 0
    assert tuple(cs["dspark"].data.prompts) == ("offline-mix",)
    ds, df, e3 = cs["dspark"].draft, cs["dflash"].draft, cs["eagle3"].draft
    # DeepSpec's recipes scaled down: DSpark and DFlash share the backbone depth / block / anchors
    assert (ds.num_draft_layers, ds.block_size, ds.num_anchors) == (
        df.num_draft_layers, df.block_size, df.num_anchors)
    assert ds.markov_rank > 0 and ds.enable_confidence_head and (ds.ce_loss_alpha,
                                                                  ds.l1_loss_alpha) == (0.1, 0.9)
    assert df.markov_rank == 0 and not df.enable_confidence_head and (df.ce_loss_alpha,
                                                                      df.l1_loss_alpha) == (1, 0)
    assert (e3.draft_num_hidden_layers, e3.ttt_length, e3.step_loss_decay) == (1, 7, 0.8)
    assert (cs["dspark"].seed, cs["dflash"].seed, cs["eagle3"].seed) == (42, 42, 0)


def test_learning_curve_keeps_the_last_row_of_a_step(tmp_path):
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "split": "heldout", "tau_probabilistic": 1.1},
            {"step": 4, "split": "heldout", "tau_probabilistic": 1.3},
            {"step": 2, "split": "heldout", "tau_probabilistic": 1.2}]   # re-logged on resume
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert table1_report.learning_curve(p) == [(2, 1.2), (4, 1.3)]


def test_set_overrides_are_per_drafter_or_global():
    out = table1.parse_sets(["train.lr=1e-3", "eagle3:train.lr=5e-4"], table1.DRAFTERS)
    assert out["dspark"] == ["--config.train.lr=1e-3"]
    assert out["eagle3"] == ["--config.train.lr=1e-3", "--config.train.lr=5e-4"]
    with pytest.raises(table1.Table1Error, match="medusa"):
        table1.parse_sets(["medusa:train.lr=1"], table1.DRAFTERS)
    with pytest.raises(table1.Table1Error, match="KEY=VALUE"):
        table1.parse_sets(["train.lr"], table1.DRAFTERS)


def _write_eval_dir(d: pathlib.Path) -> pathlib.Path:
    d.mkdir(parents=True)
    (d / "alpha.jsonl").write_text("".join(json.dumps({"turns": [f"Name a colour, {w}."]}) + "\n"
                                           for w in ("please", "now", "quickly")))
    (d / "beta.jsonl").write_text(json.dumps({"turns": [LONG]}) + "\n"
                                  + json.dumps({"turns": ["Count to three."]}) + "\n")
    return d


def _args(target: pathlib.Path, prompts: list[str], evals: pathlib.Path,
          workdir: pathlib.Path) -> list[str]:
    sets = [f"target={target}", "draft.target_layer_ids=()", "draft.mask_token_id=-1",
            f"data.prompts=({','.join(map(repr, prompts))},)", "data.max_prompts=-1",
            "data.heldout=3.0", "data.max_new_tokens=24", "data.max_length=128",
            "data.regen_batch_size=8", "data.temperature=1.0", "data.top_k=0", "data.top_p=1.0",
            "draft.num_anchors=8", "dspark:draft.markov_rank=8", "train.global_batch_size=4",
            "train.anchor_chunk=8", "draft.draft_vocab_size=40", "mesh.num_devices=1",
            "checkpoint.every_steps=2",
            "checkpoint.async_save=False", "eval.batch_size=4", "logging.tensorboard=False"]
    return (["--workdir", str(workdir), "--steps", str(STEPS), "--eval-every", str(EVERY),
             "--eval-data", str(evals), "--eval-samples", "1", "--max-prompt-tokens", "60",
             "--max-new-tokens", "8", "--eval-batch-size", "4"]
            + [x for s in sets for x in ("--set", s)])


@pytest.fixture(scope="module")
def interrupted_then_resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("table1")
    target = make_tiny_target(root / "target")
    prompts = write_prompt_files(root / "prompts")
    evals = _write_eval_dir(root / "evals")
    work = root / "work"
    args = _args(target, prompts, evals, work)
    # 1) killed (SIGKILL, no clean-up) right after dflash's step-2 checkpoint
    proc = subprocess.run([sys.executable, "-m", "dspark_jax.experiments.table1", *args,
                           "--set", f"dflash:debug.sigkill_at_step={KILL_AT}"],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]
    before = {"dspark_metrics": (work / "dspark" / "metrics.jsonl").read_text(),
              "dspark_summary": (work / "dspark" / "summary.json").read_text(),
              "dflash_ckpts": sorted(os.listdir(work / "dflash" / "checkpoints")),
              "dflash_summary": (work / "dflash" / "summary.json").exists(),
              "eagle3": (work / "eagle3").exists(), "stdout": proc.stdout}
    # 2) the same command again, in process
    assert table1.main(args) == 0
    return work, args, before


@pytest.mark.slow
def test_rerun_skips_finished_and_resumes_interrupted(interrupted_then_resumed, monkeypatch):
    work, args, before = interrupted_then_resumed
    assert str(KILL_AT) in before["dflash_ckpts"] and not before["dflash_summary"]
    assert not before["eagle3"]
    assert "dspark: trained in" in before["stdout"]
    # dspark was not trained again
    assert (work / "dspark" / "metrics.jsonl").read_text() == before["dspark_metrics"]
    assert (work / "dspark" / "summary.json").read_text() == before["dspark_summary"]
    s_df = json.loads((work / "dflash" / "summary.json").read_text())
    s_e3 = json.loads((work / "eagle3" / "summary.json").read_text())
    assert s_df["resumed_from_step"] == KILL_AT and s_df["steps"] == STEPS
    assert s_e3["resumed_from_step"] is None
    # each training step exactly once across the two processes
    steps = [r["step"] for r in map(json.loads, (work / "dflash" / "metrics.jsonl").open())
             if "batch_hash" in r]
    assert steps == list(range(1, STEPS + 1))
    # a third run has nothing left to do (not even loading the target) and changes no result
    results = {p: p.read_text() for p in work.glob("*/table1_eval/T*/results.json")}
    assert len(results) == 6

    def no_target(*a, **k):
        raise AssertionError("a finished Table 1 loaded the target again")

    monkeypatch.setattr("dspark_jax.models.load_target", no_target)
    assert table1.main(args) == 0
    assert {p: p.read_text() for p in results} == results
    # other settings in the same workdir are refused, naming the setting
    assert table1.main([*args, "--steps", str(STEPS + 1)]) == 2


@pytest.mark.slow
def test_table1_outputs(interrupted_then_resumed):
    from dspark_jax.models import load_draft, load_target

    work, _, _ = interrupted_then_resumed
    # one regeneration, shared by the three rows (and their feature cache)
    regen = work / "shared" / "data" / "regenerated.jsonl"
    assert regen.is_file() and not list(work.glob("d*/data/regenerated.jsonl"))
    for d in table1.DRAFTERS:
        s = json.loads((work / d / "summary.json").read_text())
        assert s["data"]["regenerated"] == {"path": str(regen), "reused": True}
        assert s["model_type"] == d and s["steps"] == STEPS
    # evaluation prompts: every held-out prompt, one per benchmark, never the long one
    sel = json.loads((work / "eval_prompts" / "selection.json").read_text())
    assert sel["sets"] == ["heldout", "alpha", "beta"] and len(sel["ids"]["heldout"]) == 3
    assert sel["ids"]["beta"] == ["beta-1"] and LONG not in (work / "eval_prompts"
                                                              / "beta.jsonl").read_text()
    r = json.loads((work / "table1.json").read_text())
    cols = ["heldout", "alpha", "beta", "benchmark mean"]
    assert r["columns"] == cols and r["drafters"] == list(table1.DRAFTERS)
    for t in ("0", "1"):
        tau = r["tau"][t]
        for d in table1.DRAFTERS:
            res = json.loads((work / d / "table1_eval" / f"T{t}" / "results.json").read_text())
            assert tau[d]["heldout"] == pytest.approx(res["datasets"]["heldout"]["tau"])
            assert tau[d]["benchmark mean"] == pytest.approx(
                (res["datasets"]["alpha"]["tau"] + res["datasets"]["beta"]["tau"]) / 2)
            assert all(1.0 <= tau[d][c] <= 8.0 for c in cols)
            cond = r["conditional_acceptance"][t][d]
            assert set(cond) == set(cols) and all(len(v) == 7 for v in cond.values())
            assert cond["heldout"] == res["datasets"]["heldout"]["conditional_acceptance"]
        for num, den in (("dspark", "dflash"), ("dspark", "eagle3")):
            for c in cols:
                assert r["ratios"][t][f"{num}/{den}"][c] == pytest.approx(tau[num][c] / tau[den][c])
    # the learning curve: held-out teacher-forced τ every EVERY steps, the last one at the end
    for d in table1.DRAFTERS:
        curve = r["learning_curve"][d]
        assert [s for s, _ in curve] == list(range(EVERY, STEPS + 1, EVERY))
        assert all(1.0 <= v <= 8.0 for _, v in curve)
    for png in ("learning_curve.png", "conditional_acceptance.png"):
        assert (work / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (work / "table1.md").read_text()
    assert "DSpark/DFlash" in md and "DSpark/Eagle3" in md and "learning_curve.png" in md
    # the drafters in DeepSpec format, DSpark with its calibration file
    target = load_target(r["settings"]["sets"]["dspark"][0].split("=", 1)[1])
    for d in table1.DRAFTERS:
        draft = load_draft(work / d / "export", target)
        assert draft.config.model_type == d
        cal = work / d / "export" / "confidence_calibration.json"
        assert cal.is_file() == (d == "dspark")
    assert load_draft(work / "dspark" / "export", target).confidence_temperatures is not None
    assert r["training"]["dspark"]["calibration"]["file"] == str(
        work / "dspark" / "export" / "confidence_calibration.json")
    # progress bars and logs went to files
    assert "train" in (work / "logs" / "dflash.log").read_text()
