"""`bench.train_step --checkpoint`: the checkpointing row (a step with an async save in flight
against a plain step) runs at the tiny config through the command line and reports its figures
(the figures themselves are measured by hand, BENCHMARKS.md)."""

import json
import pathlib

from dspark_jax.bench import train_step

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.py")


def test_config_sets_the_step_and_flags_win():
    a = train_step.parse_args(["--config", TINY, "--seq", "64"])
    assert (a.target, a.batch, a.seq, a.gamma, a.rank, a.anchors) == ("tiny", 4, 64, 4, 8, 8)
    assert a.features == "online" and a.attn_key_chunk == 32 and a.keep == 2
    assert not a.checkpoint and a.saves >= 1 and a.plain_steps >= 1


def test_checkpoint_row_at_the_tiny_config(tmp_path, capsys):
    out = tmp_path / "r.json"
    # 8 rows: the tests' 8 fake CPU devices split the batch
    r = train_step.main(["--config", TINY, "--batch", "8", "--seq", "64", "--repeats", "1",
                         "--checkpoint", "--saves", "1", "--plain-steps", "2",
                         "--checkpoint-dir", str(tmp_path), "--json", str(out)])
    for key in ("ckpt_plain_step_s", "ckpt_inflight_step_s", "ckpt_ratio", "ckpt_save_call_s",
                "ckpt_save_wall_s", "ckpt_state_mb"):
        assert r[key] > 0, key
    assert r["ckpt_saves"] == 1 and r["ckpt_plain_steps"] == 2 and r["ckpt_steps_in_flight"] >= 1
    assert json.loads(out.read_text())["ckpt_ratio"] == r["ckpt_ratio"]
    assert list(tmp_path.iterdir()) == [out]          # the row's checkpoints are removed
    table = capsys.readouterr().out
    assert "checkpoint: save in flight" in table and "× plain (bar ≤ 1.1×)" in table
