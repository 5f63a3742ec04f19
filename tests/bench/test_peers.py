"""`bench.peers` without any peer installed (seconds): the runner protocol, the skip lines, the
identity count and the ratios on fake results."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

from dspark_jax.bench import peers, peers_runner
from dspark_jax.bench.peers import AUTOREGRESSIVE, ENGINE, LLAMACPP, VLLM, Peer, SystemRun


def test_result_tag_is_the_runners():
    assert peers.RESULT_TAG == peers_runner.RESULT_TAG


def test_parse_runner_output_takes_the_last_tagged_line():
    out = ("INFO vllm says hello\n"
           f"{peers.RESULT_TAG} {json.dumps({'ok': False, 'error': 'first'})}\n"
           "more log\n"
           f"{peers.RESULT_TAG} {json.dumps({'ok': True, 'batches': []})}\n")
    assert peers.parse_runner_output(out) == {"ok": True, "batches": []}
    with pytest.raises(peers.PeerError, match="no result line"):
        peers.parse_runner_output("INFO only logs\n")


def test_runner_times_warm_up_plus_repeats():
    calls = []

    def gen(prompts, n):
        calls.append(len(prompts))
        return [[7] * n for _ in prompts]

    out = peers_runner.timed_batches(gen, {"max_new_tokens": 3, "repeats": 2, "batches": [
        {"batch": 1, "prompts": [[1, 2]]}, {"batch": 2, "prompts": [[1], [2, 3]]}]})
    assert calls == [1, 1, 1, 2, 2, 2]
    assert [b["batch"] for b in out] == [1, 2]
    assert out[1]["tokens"] == [[7, 7, 7], [7, 7, 7]]
    assert len(out[0]["all_seconds"]) == 2 and out[0]["seconds"] >= 0


def _peer(tmp_path: pathlib.Path, python: pathlib.Path, key: str = "vllm") -> Peer:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return Peer(VLLM, key, python, model, setup=f"bash peers_setup.sh {key}")


def test_missing_interpreter_is_skipped_with_how_to_install(tmp_path):
    runs = peers.run_peer(_peer(tmp_path, tmp_path / "nope" / "bin" / "python"),
                          {1: [[1, 2]], 16: [[1]] * 16}, 4, 1, None, tmp_path)
    assert set(runs) == {1, 16}
    for r in runs.values():
        assert r.seconds is None and r.tokens is None
        assert "no interpreter at" in r.skipped and str(tmp_path / "nope") in r.skipped
        assert "install it with `bash peers_setup.sh vllm`" in r.skipped


def test_missing_model_is_skipped(tmp_path):
    peer = Peer(LLAMACPP, "llamacpp", pathlib.Path(sys.executable), tmp_path / "absent.gguf",
                setup="x")
    r = peers.run_peer(peer, {1: [[1]]}, 4, 1, None, tmp_path)[1]
    assert "absent.gguf is missing" in r.skipped


def test_missing_package_in_the_peers_interpreter_is_skipped(tmp_path):
    """The real runner, run by an interpreter without vLLM (the project's, whose own
    environment must never hold the peers)."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable here")
    runs = peers.run_peer(_peer(tmp_path, pathlib.Path(sys.executable)), {1: [[1, 2]]}, 2, 1,
                          None, tmp_path)
    assert "cannot import 'vllm'" in runs[1].skipped
    assert "install it with" in runs[1].skipped
    assert (tmp_path / "vllm.log").exists()


def test_identical_count():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert peers.identical_count(ref, ref, 3) == 3
    assert peers.identical_count(ref, [[1, 2, 3], [4, 5, 0], [7, 8, 9, 10]], 3) == 2
    assert peers.identical_count(ref, [[1, 2, 3]], 3) == 1           # rows missing
    assert peers.identical_count(ref, [[1, 2], [4, 5], [7, 8]], 3) == 0  # too short
    assert peers.identical_count([[1, 2]], [[1, 2]], 3) == 0              # both too short
    assert peers.identical_count(ref, [[1, 2, 0], [4, 5, 0], [7, 8, 0]], 2) == 3


def _fake_runs() -> list[SystemRun]:
    toks = [[1, 2, 3, 4]]
    return [SystemRun(ENGINE, 1, seconds=4.0, tokens=toks),             # 1 tok/s
            SystemRun(AUTOREGRESSIVE, 1, seconds=2.0, tokens=toks),     # 2 tok/s
            SystemRun(LLAMACPP, 1, seconds=2.5, tokens=[[1, 2, 3, 9]]),  # 1.6 tok/s
            SystemRun(VLLM, 1, skipped="skipped: no interpreter at /x; install it with `y`"),
            SystemRun(ENGINE, 16, seconds=8.0, tokens=[[5, 5, 5, 5]] * 16),
            SystemRun(AUTOREGRESSIVE, 16, seconds=8.0, tokens=[[5, 5, 5, 5]] * 16),
            SystemRun(VLLM, 16, seconds=4.0, tokens=[[5, 5, 5, 5]] * 15 + [[5, 5, 5, 6]])]


def test_ratios_on_fake_results():
    q = {(r["ours"], r["peer"], r["batch"]): r for r in peers.ratios(_fake_runs(), 4)}
    assert set(q) == {(ENGINE, LLAMACPP, 1), (AUTOREGRESSIVE, LLAMACPP, 1),
                      (ENGINE, VLLM, 16), (AUTOREGRESSIVE, VLLM, 16)}
    assert q[(ENGINE, LLAMACPP, 1)]["ratio"] == pytest.approx(2.5 / 4.0)
    assert q[(AUTOREGRESSIVE, LLAMACPP, 1)]["ratio"] == pytest.approx(2.5 / 2.0)
    assert q[(ENGINE, VLLM, 16)]["ratio"] == pytest.approx(0.5)
    assert q[(ENGINE, LLAMACPP, 1)]["goal"] and not q[(ENGINE, LLAMACPP, 1)]["meets_goal"]
    assert q[(AUTOREGRESSIVE, LLAMACPP, 1)]["meets_goal"]
    assert q[(ENGINE, VLLM, 16)]["goal"] and not q[(ENGINE, VLLM, 16)]["meets_goal"]


def test_table_rows_on_fake_results():
    rows = dict(peers.table_rows(_fake_runs(), 4))
    text = "\n".join(f"{k} {v}" for k, v in peers.table_rows(_fake_runs(), 4))
    assert "identical 0/1" in rows[f"  {LLAMACPP}"]          # batch 1: its last token differs
    assert "1.6 tok/s" in rows[f"  {LLAMACPP}"]
    assert "reference" in rows[f"  {AUTOREGRESSIVE}"]
    assert "identical 15/16" in text and "identical 16/16" in text
    assert "skipped: no interpreter at /x" in text
    assert "engine / llama.cpp f32 0.62× (goal ≥ 0.67: NOT met)" in text
    assert "autoregressive / llama.cpp f32 1.25× (goal ≥ 0.67: met)" in text
    assert "engine / vLLM CPU f32 0.50× (goal ≥ 0.67: NOT met)" in text


def test_rounds_take_ratios_within_each_round_and_their_median():
    def rnd(engine_s, llama_s):
        return [SystemRun(ENGINE, 1, seconds=engine_s, tokens=[[1, 2, 3, 4]]),
                SystemRun(AUTOREGRESSIVE, 1, seconds=engine_s, tokens=[[1, 2, 3, 4]]),
                SystemRun(LLAMACPP, 1, seconds=llama_s, tokens=[[1, 2, 3, 4]]),
                SystemRun(VLLM, 1, skipped="skipped: --skip")]

    # the machine slows by 2x between rounds: each round's ratio is 0.5, 0.8, 0.7
    rounds = [rnd(2.0, 1.0), rnd(5.0, 4.0), rnd(10.0, 7.0)]
    merged = {(r.system, r.batch): r for r in peers.merge_rounds(rounds)}
    assert merged[(ENGINE, 1)].seconds == pytest.approx(5.0)     # median of 2, 5, 10
    assert merged[(LLAMACPP, 1)].seconds == pytest.approx(4.0)
    assert merged[(VLLM, 1)].skipped == "skipped: --skip"
    q = {(r["ours"], r["peer"]): r for r in peers.round_ratios(rounds, 4)}
    engine = q[(ENGINE, LLAMACPP)]
    assert engine["per_round"] == pytest.approx([0.5, 0.8, 0.7])
    assert engine["ratio"] == pytest.approx(0.7)                 # not 4 / 5 of the medians
    assert engine["meets_goal"]
    text = "\n".join(f"{k} {v}" for k, v in peers.table_rows(
        peers.merge_rounds(rounds), 4, peers.round_ratios(rounds, 4)))
    assert "engine / llama.cpp f32 0.70× (median of rounds 0.50 / 0.80 / 0.70) (goal ≥ 0.67: met)" \
        in text
    even = peers.round_ratios(rounds[:2], 4)[0]
    assert even["ratio"] == pytest.approx(0.65) and not even["meets_goal"]


def test_dspark_row_is_skipped_without_a_drafter(tmp_path):
    a = peers.parse_args(["--max-new-tokens", "8"])
    label, text = peers.dspark_loop_row(a, tmp_path)
    assert text.startswith("skipped: no --dspark-draft")


def test_setup_script_refuses_a_folder_inside_the_repository(tmp_path):
    import os
    import subprocess

    repo = pathlib.Path(peers.__file__).resolve().parents[2]
    r = subprocess.run(["bash", str(peers.SETUP), "vllm"], capture_output=True, text=True,
                       env=dict(os.environ, DSPARK_PEERS_DIR=str(repo / "peers-here")),
                       timeout=60)
    assert r.returncode == 2 and "inside the repository" in r.stderr
    assert not (repo / "peers-here").exists()
