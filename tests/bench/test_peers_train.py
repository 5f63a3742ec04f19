"""`bench.peers_train`'s plumbing on a tiny target: two steps of both trainers (ours and
DeepSpec's own, imported from ../shared/reference/deepspec) on the data stage's records, the
held-out acceptance of both drafters, the summary, the JSON and the plot (marked slow: it
imports torch and DeepSpec and compiles both trainers' steps). Skipped where DeepSpec's source
is absent; the benchmark then prints one line saying so."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from dspark_jax.bench import peers_train
from train.tiny_job import TINY_CONFIG, make_tiny_target, write_regenerated

DEEPSPEC = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepspec"


def test_without_deepspec_it_says_so_and_returns(tmp_path, capsys):
    assert peers_train.main(["--deepspec-src", str(tmp_path / "nowhere"), "--steps", "2",
                             "--warmup-steps", "1"]) is None
    assert "peers_train: skipped: DeepSpec's source is not at" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning",
                            "ignore:To get the last learning rate computed:UserWarning")
def test_two_steps_of_both_trainers(tmp_path):
    if not (DEEPSPEC / "deepspec").is_dir():
        pytest.skip(f"DeepSpec's source is not at {DEEPSPEC} (../shared/reference is absent)")
    pytest.importorskip("torch", reason="DeepSpec's trainer is PyTorch")
    target = make_tiny_target(tmp_path / "target", seed=3)
    data = tmp_path / "data"
    write_regenerated(data / "regenerated.jsonl", n=10)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    result = peers_train.main([
        "--config", str(TINY_CONFIG), "--set", f"target={target}", "--data-dir", str(data),
        "--workdir", str(tmp_path / "w"), "--steps", "2", "--warmup-steps", "1",
        "--seeds", "0", "--precisions", "fp32", "--eval-every", "1",
        "--deepspec-src", str(DEEPSPEC), "--json", str(out_json), "--plot", str(out_png)])
    (run,) = result["runs"]
    for who in ("ours", "deepspec"):
        assert len(run[who]["loss"]) == len(run[who]["seconds"]) == 2
        assert all(math.isfinite(x) for x in run[who]["loss"] + run[who]["ce_loss"])
        held = run[who]["heldout"]
        assert held["blocks_kept"] > 0 and held["blocks_counted"] <= held["blocks_kept"]
        assert 1.0 <= held["tau_probabilistic"] and 1.0 <= held["tau_kept_blocks"]
    assert [x["step"] for x in run["heldout_curve"]] == [1, 2]
    assert run["heldout_curve"][-1]["deepspec"] == run["deepspec"]["heldout"]["tau_probabilistic"]
    # the same schedule on both sides (DeepSpec logs the next step's lr)
    assert run["ours"]["lr"][1] == pytest.approx(run["deepspec"]["lr"][0], rel=1e-5)
    s = result["summary"]["fp32"]
    (pair,) = run["pairs"]                        # step 2: step 1 is the warm-up
    assert pair["step"] == 2 and pair["ratio"] == pytest.approx(pair["ours"] / pair["deepspec"])
    assert pair["others_cores"] is None or pair["others_cores"] >= 0
    assert s["all"]["ratio_median"] == pytest.approx(pair["ratio"])
    assert s["judged_on"] == "all"                # fewer quiet pairs than the bar needs
    assert json.loads(out_json.read_text())["summary"]["fp32"]["bar"] == peers_train.GOAL_RATIO
    assert out_png.stat().st_size > 0


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning",
                            "ignore:To get the last learning rate computed:UserWarning")
def test_deepspec_alone(tmp_path):
    if not (DEEPSPEC / "deepspec").is_dir():
        pytest.skip(f"DeepSpec's source is not at {DEEPSPEC} (../shared/reference is absent)")
    pytest.importorskip("torch", reason="DeepSpec's trainer is PyTorch")
    target = make_tiny_target(tmp_path / "target", seed=3)
    data = tmp_path / "data"
    write_regenerated(data / "regenerated.jsonl", n=10)
    result = peers_train.main([
        "--config", str(TINY_CONFIG), "--set", f"target={target}", "--data-dir", str(data),
        "--workdir", str(tmp_path / "w"), "--steps", "2", "--warmup-steps", "1",
        "--seeds", "0", "--precisions", "bf16", "--trainers", "deepspec",
        "--deepspec-src", str(DEEPSPEC), "--plot", str(tmp_path / "r.png")])
    (run,) = result["runs"]
    assert "ours" not in run and run["pairs"] == []
    assert len(run["deepspec"]["loss"]) == 2
    assert run["deepspec"]["heldout"]["tau_probabilistic"] >= 1
    s = result["summary"]["bf16"]
    assert s["met"] is None and s["deepspec_tau_probabilistic"] == [
        run["deepspec"]["heldout"]["tau_probabilistic"]]
