"""Regeneration by the target: a SIGKILLed CLI run resumes to exactly the output of an
uninterrupted run; multi-turn replay; skip rules; resume safety checks."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dspark_jax.data import regeneration as R
from dspark_jax.data.prompts import Conversation, load_conversations
from dspark_jax.models import load_target
from dspark_jax.models.tokenizer import load_tokenizer
from hf_tiny import save_tiny_hf

REPO = Path(__file__).resolve().parents[2]
SETTINGS = dict(max_new_tokens=8, batch_size=2, seed=5, system_prompt="Hi")
CLI_SETTINGS = ["--max-new-tokens", "8", "--batch-size", "2", "--seed", "5", "--system-prompt", "Hi"]


def _conversations() -> list[dict]:
    out = []
    for i in range(10):
        turns = [{"role": "user", "content": f"Question {i}: what is {'ab' * i}?"},
                 {"role": "assistant", "content": "original reply"}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": f"And then {i}?"},
                      {"role": "assistant", "content": "original second reply"}]
        if i == 4:
            turns.insert(0, {"role": "system", "content": "Be brief."})
        out.append({"id": f"c{i}", "conversations": turns})
    return out


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template (vocab 49152)."""
    path = tmp_path_factory.mktemp("tiny_smollm")
    save_tiny_hf(path, "llama", vocab=49152, layers=2)
    load_tokenizer("smollm2-135m-instruct").hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    t = load_target(target_dir)
    assert t.tokenizer is not None and t.config.vocab_size == 49152
    return t


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in _conversations()))
    return path


@pytest.fixture(scope="module")
def reference(target, prompts_file, tmp_path_factory) -> tuple[dict[str, dict], R.RegenStats]:
    """An uninterrupted run, in process."""
    out = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    stats = R.regenerate(target, load_conversations(prompts_file), out, progress=False, **SETTINGS)
    lines = out.read_text(encoding="utf-8").splitlines()
    return {json.loads(line)["id"]: json.loads(line) for line in lines}, stats


def test_killed_run_resumes_to_the_uninterrupted_output(target_dir, prompts_file, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dspark_jax.data.regeneration", "--target", str(target_dir),
           "--prompts", str(prompts_file), "--out", str(out), "--no-progress", *CLI_SETTINGS]
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if out.exists() and out.read_bytes().count(b"\n") >= 1:  # the first batch is on disk
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    kept = out.read_bytes().count(b"\n")
    assert 1 <= kept < 10, "the kill should land mid-way"
    with open(out, "ab") as fh:  # and a write torn by the kill
        fh.write(b'{"id": "c9", "conversations": [{"role": "us')

    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=180)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    stats = json.loads(res.stdout.decode().strip().splitlines()[-1])
    assert stats["already_done"] == kept and stats["written"] == 10 - kept

    raw = out.read_text(encoding="utf-8")
    assert raw.endswith("\n")
    records = [json.loads(line) for line in raw.splitlines()]
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(c["id"] for c in _conversations())  # no gaps
    assert len(set(ids)) == len(ids)  # no duplicates
    want, _ = reference
    assert {r["id"]: r for r in records} == want


def test_multi_turn_replay_gives_one_reply_per_user_turn(reference):
    got, stats = reference
    source = {c["id"]: c["conversations"] for c in _conversations()}
    assert stats.written == 10 and stats.turns_generated == sum(
        sum(m["role"] == "user" for m in turns) for turns in source.values())
    for cid, turns in source.items():
        msgs = got[cid]["conversations"]
        system = [m for m in turns if m["role"] == "system"] or [{"role": "system", "content": "Hi"}]
        users = [m for m in turns if m["role"] == "user"]
        assert msgs[0] == system[0]
        assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * len(users)
        assert msgs[1::2] == users
        replies = [m["content"] for m in msgs[2::2]]
        assert all(r.strip() and "original" not in r for r in replies)


def test_a_reply_does_not_depend_on_its_batch(target):
    tok = target.tokenizer
    a, b = tok.encode("first prompt"), tok.encode("another, different prompt")
    keys = np.stack([R.sample_key_data(1, "a", 0), R.sample_key_data(1, "b", 0)])
    kw = dict(max_new_tokens=8, batch_size=2, temperature=0.7, top_k=20, top_p=0.8,
              stop_token_ids=tok.stop_token_ids)
    ab = R.generate_rows(target, [np.asarray(a), np.asarray(b)], keys, **kw)
    ba = R.generate_rows(target, [np.asarray(b), np.asarray(a)], keys[::-1], **kw)
    alone = R.generate_rows(target, [np.asarray(a)], keys[:1], **kw)
    assert ab[0] == ba[1] == alone[0] and ab[1] == ba[0]
    other = R.generate_rows(target, [np.asarray(a)], R.sample_key_data(2, "a", 0)[None], **kw)
    assert other[0] != alone[0]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_refill_engine_equals_the_static_one(target, prompts_file, tmp_path, temperature):
    """The serving engine's plain decoding (refill) writes the records of the on-device loop
    (static): same replies token for token, greedy and sampled (top-k 20, top-p 0.8)."""
    user = lambda s: {"role": "user", "content": s}  # noqa: E731
    convs = load_conversations(prompts_file) + [
        Conversation("too-long", [user("word " * 300)]),
        Conversation("long-second", [user("short"), user("word " * 300)])]
    kw = SETTINGS | dict(temperature=temperature, batch_size=3, max_prompt_tokens=200,
                         progress=False)
    static = R.regenerate(target, convs, tmp_path / "s.jsonl", engine="static", **kw)
    refill = R.regenerate(target, convs, tmp_path / "r.jsonl", engine="refill", **kw)

    def records(path):
        return {json.loads(x)["id"]: json.loads(x) for x in path.read_text().splitlines()}

    assert records(tmp_path / "r.jsonl") == records(tmp_path / "s.jsonl")
    assert len(records(tmp_path / "r.jsonl")) == 11
    timing = dict(elapsed_s=0, refill_s=0, decode_s=0, decode_steps=0)
    same = lambda st: dataclasses.asdict(st) | timing  # noqa: E731
    assert same(refill) == same(static)
    # the refill engine says where its time went; the static one has no breakdown
    assert static.decode_steps == 0 and static.ms_per_decode_step == 0.0
    assert refill.refill_s > 0 and refill.decode_s > 0
    assert refill.refill_s + refill.decode_s <= refill.elapsed_s
    # every generated token but each reply's first (sampled by its prefill) takes a decode step
    # of a batch of 3, and every step advances at least one reply
    per_step_tokens = refill.generated_tokens - refill.turns_generated
    assert per_step_tokens / 3 <= refill.decode_steps <= per_step_tokens
    assert static.skipped_prompt_too_long == 1 and static.ended_early == 1
    with pytest.raises(ValueError, match="engine must be one of"):
        R.regenerate(target, convs, tmp_path / "x.jsonl", engine="fast", **kw)


@pytest.mark.parametrize("engine", R.ENGINES)
def test_skip_rules(target, tmp_path, monkeypatch, engine):
    tok = target.tokenizer
    calls: list[int] = []

    def fake_generate(target, prompts, key_data, **kw):  # scripted replies, no model
        calls.append(len(prompts))
        out = []
        for p in prompts:
            text = tok.decode(p.tolist())
            if "EMPTY" in text.split("<|im_start|>user")[-1]:
                out.append([tok.eos_token_id])
            elif "ENDLESS" in text:
                out.append(tok.encode(" and so on") * 2)  # no stop token: hit max_new_tokens
            else:
                out.append(tok.encode("Sure.") + [tok.eos_token_id])
        return out

    class FakeEngine:  # the refill engine's seam: same scripted replies, batches of 4
        def __init__(self, target, draft, **kw):
            pass

        def serve(self, requests, on_reply, *, max_new_tokens, after_replies=None):
            queue = list(requests)
            while queue:
                batch, queue = queue[:4], queue[4:]
                for req, reply in zip(batch, fake_generate(None, [r.prompt for r in batch], None)):
                    queue += on_reply(req, reply)
                after_replies()
            return SimpleNamespace(rounds=[], wall_s=0.0)

    monkeypatch.setattr(R, "generate_rows", fake_generate)
    monkeypatch.setattr(R, "Engine", FakeEngine)
    user = lambda s: {"role": "user", "content": s}  # noqa: E731
    convs = [
        Conversation("ok", [user("hello")]),
        Conversation("ok", [user("duplicate id")]),
        Conversation("sys-only", [{"role": "system", "content": "nothing to answer"}]),
        Conversation("long", [user("word " * 200)]),
        Conversation("empty", [user("EMPTY please")]),
        Conversation("ends", [user("short"), {"role": "assistant", "content": "x"}, user("word " * 200)]),
        Conversation("ends-empty", [user("short"), user("EMPTY now")]),
        Conversation("endless", [user("ENDLESS")]),
    ]
    out = tmp_path / "o.jsonl"
    stats = R.regenerate(target, convs, out, max_new_tokens=8, batch_size=4, progress=False,
                         max_prompt_tokens=100, engine=engine)
    got = {json.loads(line)["id"]: json.loads(line)["conversations"] for line in out.read_text().splitlines()}
    assert set(got) == {"ok", "ends", "ends-empty", "endless"}
    assert (stats.duplicate_ids, stats.skipped_no_user_turn, stats.skipped_prompt_too_long,
            stats.skipped_empty_reply, stats.ended_early) == (1, 1, 1, 1, 2)
    assert stats.replies_hit_max_new_tokens == 1 and stats.written == 4
    assert got["ok"] == [user("hello"), {"role": "assistant", "content": "Sure."}]
    assert got["ends"] == [user("short"), {"role": "assistant", "content": "Sure."}]
    assert got["ends-empty"] == got["ends"]
    assert got["endless"][-1]["content"] == " and so on and so on"
    assert max(calls) <= 4
    # a second call finds everything done and generates nothing new
    calls.clear()
    again = R.regenerate(target, convs, out, max_new_tokens=8, batch_size=4, progress=False,
                         max_prompt_tokens=100, engine=engine)
    assert again.written == 0 and again.already_done == 4
    assert len(out.read_text().splitlines()) == 4


def test_resume_safety_checks(target, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(R, "generate_rows", lambda target, prompts, key_data, **kw:
                        [target.tokenizer.encode("Fine.") + [2] for _ in prompts])
    convs = [Conversation(f"x{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(3)]
    out = tmp_path / "o.jsonl"
    R.regenerate(target, convs, out, max_new_tokens=4, batch_size=2, progress=False,
                 engine="static")
    with pytest.raises(R.RegenerationError, match="other settings"):
        R.regenerate(target, convs, out, max_new_tokens=4, batch_size=2, seed=1, progress=False)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    with pytest.raises(R.RegenerationError, match=r"o.jsonl:2"):
        R.regenerate(target, convs, out, max_new_tokens=4, batch_size=2, progress=False)
    out.write_text(lines[0] + "garbage\n")  # a bad LAST line is a torn write: dropped, redone
    stats = R.regenerate(target, convs, out, max_new_tokens=4, batch_size=2, progress=False,
                         engine="static")
    assert stats.already_done == 1 and stats.written == 2
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == ["x0", "x1", "x2"]
    with pytest.raises(ValueError, match="empty prompt set"):
        R.regenerate(target, [], tmp_path / "e.jsonl", max_new_tokens=4, batch_size=2)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert R.main(["--target", "unused", "--prompts", str(empty), "--out", str(tmp_path / "e.jsonl")]) == 2
    assert "no conversations" in capsys.readouterr().err
