"""Tests for dspark_jax.data.prompts: eval files + DeepSpec subsampling, training JSONL, HumanEval,
held-out split, and error messages naming file/line/field."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from dspark_jax.data import prompts as P

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "data"
EVAL_DIR = FIX / "eval"
SHARED_EVAL = Path("/work/shared/eval_datasets")  # optional; never copied into the repo


# ---------------------------------------------------------------- eval files


def test_list_eval_datasets() -> None:
    assert P.list_eval_datasets(EVAL_DIR) == ["tiny-chat", "tiny-qa"]


def test_read_eval_file_ids_skip_blank_lines() -> None:
    convs = P.read_eval_file(EVAL_DIR / "tiny-qa.jsonl")
    assert len(convs) == 12
    ids = [c.id for c in convs]
    # line 6 (index 5) is blank: skipped, but ids keep the physical line index
    assert ids[:5] == [f"tiny-qa-{i}" for i in range(5)]
    assert ids[5:] == [f"tiny-qa-{i}" for i in range(6, 13)]
    assert convs[0].messages == [{"role": "user", "content": "What is 2 + 3?"}]
    assert convs[5].messages[0]["content"] == "Explain recursion in one sentence."


def test_first_turn_only_and_all_turns() -> None:
    first = P.load_eval_dataset(EVAL_DIR, "tiny-chat", None)
    assert [len(c.messages) for c in first] == [1, 1, 1]
    every = P.load_eval_dataset(EVAL_DIR, "tiny-chat", None, first_turn_only=False)
    assert [len(c.messages) for c in every] == [2, 3, 1]
    assert all(m["role"] == "user" for c in every for m in c.messages)
    assert every[1].messages[2]["content"] == "Shorter, please."


def test_deepspec_subsampling_rule() -> None:
    full = P.read_eval_file(EVAL_DIR / "tiny-qa.jsonl")
    got = P.load_eval_dataset(EVAL_DIR, "tiny-qa", 5)
    # DeepSpec: shuffle the whole record list with random.Random(seed), keep the first n.
    order = list(range(len(full)))
    random.Random(980406).shuffle(order)
    assert [c.id for c in got] == [full[i].id for i in order[:5]]
    assert [c.id for c in got] == ["tiny-qa-2", "tiny-qa-1", "tiny-qa-0", "tiny-qa-8", "tiny-qa-11"]
    # deterministic, and the seed matters
    assert [c.id for c in P.load_eval_dataset(EVAL_DIR, "tiny-qa", 5)] == [c.id for c in got]
    assert [c.id for c in P.load_eval_dataset(EVAL_DIR, "tiny-qa", 5, seed=1)] != [c.id for c in got]
    # no shuffle when the file is not longer than max_samples (DeepSpec keeps file order)
    assert [c.id for c in P.load_eval_dataset(EVAL_DIR, "tiny-qa", 12)] == [c.id for c in full]
    assert [c.id for c in P.load_eval_dataset(EVAL_DIR, "tiny-qa", "default")] == [c.id for c in full]
    assert P.load_eval_dataset(EVAL_DIR, "tiny-qa", 0) == []
    with pytest.raises(ValueError):
        P.load_eval_dataset(EVAL_DIR, "tiny-qa", -1)
    with pytest.raises(ValueError):
        P.load_eval_dataset(EVAL_DIR, "tiny-qa", "all")


def test_default_sample_table_matches_spec() -> None:
    assert P.DEFAULT_EVAL_SAMPLES == {
        "gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 256,
        "livecodebench": 500, "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500,
    }
    assert P.DEEPSPEC_EVAL_SEED == 980406


def test_missing_eval_dataset_lists_available() -> None:
    with pytest.raises(FileNotFoundError, match="tiny-qa"):
        P.load_eval_dataset(EVAL_DIR, "gsm8k")


@pytest.mark.skipif(not SHARED_EVAL.is_dir(), reason="shared eval_datasets not present")
def test_shared_eval_datasets_protocol() -> None:
    gsm = P.load_eval_dataset(SHARED_EVAL, "gsm8k")
    assert len(gsm) == 500 and len({c.id for c in gsm}) == 500
    assert [c.id for c in gsm[:3]] == ["gsm8k-435", "gsm8k-902", "gsm8k-303"]
    mt = P.load_eval_dataset(SHARED_EVAL, "mt-bench")
    assert len(mt) == 80 and mt[0].id == "mt-bench-0"  # 80 ≤ 80: file order


# ---------------------------------------------------------------- training conversations


def test_load_conversations_roles_and_ids() -> None:
    convs = P.load_conversations(FIX / "conversations.jsonl")
    assert [c.id for c in convs] == ["single", "multi-sys", "7", "short", "unicode"]
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert convs[4].messages[1]["content"].startswith("Japanese: ありがとう")
    assert all(set(m) == {"role", "content"} for c in convs for m in c.messages)


def test_sharegpt_mapping_and_fallback_id() -> None:
    convs = P.load_conversations([FIX / "sharegpt.jsonl"])
    assert [c.id for c in convs] == ["sg-1", "sharegpt-1"]
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant"]
    assert convs[1].messages[0] == {"role": "user", "content": "Give me a fun fact."}


def test_gzip_and_messages_key(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (conv,) = P.load_conversations(path)
    assert conv.id == "train-0" and conv.messages == [{"role": "user", "content": "hi"}]


def test_malformed_json_names_file_and_line() -> None:
    with pytest.raises(P.PromptDataError) as err:
        P.load_conversations(FIX / "malformed.jsonl")
    assert f"{FIX / 'malformed.jsonl'}:3: malformed JSON" in str(err.value)


BAD_RECORDS = [
    ({"id": "a"}, "conversations", "missing field"),
    ({"conversations": []}, "conversations", "empty conversation"),
    ({"conversations": "hi"}, "conversations", "expected a list"),
    ({"conversations": [{"role": "user", "content": "  "}]}, "conversations[0].content", "empty content"),
    ({"conversations": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
     "conversations[1].role", "unknown role"),
    ({"conversations": [{"role": "user"}]}, "conversations[0].content", "missing field"),
    ({"conversations": [{"content": "x"}]}, "conversations[0].role", "missing field"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "conversations[0].from", "unknown role"),
    ({"conversations": [{"from": "human", "value": ""}]}, "conversations[0].value", "empty content"),
    ({"conversations": [{"text": "x"}]}, "conversations[0].role", "missing field"),
    ({"conversations": [{"role": "user", "content": 5}]}, "conversations[0].content", "expected a string"),
    ({"id": ["x"], "conversations": [{"role": "user", "content": "x"}]}, "id", "expected a non-empty"),
]


@pytest.mark.parametrize("record,field,problem", BAD_RECORDS)
def test_bad_training_record_names_file_line_field(tmp_path: Path, record: dict, field: str, problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"conversations": [{"role": "user", "content": "fine"}]})
    path.write_text(good + "\n\n" + json.dumps(record) + "\n")  # the bad record is on line 3
    with pytest.raises(P.PromptDataError) as err:
        P.load_conversations(path)
    assert str(err.value).startswith(f"{path}:3: {field}: {problem}")


@pytest.mark.parametrize(
    "line,field",
    [('{"turns": []}', "turns"), ('{"prompt": "x"}', "turns"), ('{"turns": ["ok", ""]}', "turns[1]"),
     ('{"turns": [1]}', "turns[0]"), ('["x"]', None)],
)
def test_bad_eval_record(tmp_path: Path, line: str, field: str | None) -> None:
    path = tmp_path / "evalset.jsonl"
    path.write_text('{"turns": ["fine"]}\n' + line + "\n")
    with pytest.raises(P.PromptDataError) as err:
        P.load_eval_dataset(tmp_path, "evalset", None)
    assert str(err.value).startswith(f"{path}:2: " + (f"{field}: " if field else ""))


def test_non_utf8_line(tmp_path: Path) -> None:
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["caf\xe9"]}\n')
    with pytest.raises(P.PromptDataError, match=r"latin\.jsonl:2: not valid UTF-8"):
        P.read_eval_file(path)


# ---------------------------------------------------------------- HumanEval


def test_humaneval_prompts() -> None:
    convs = P.load_humaneval()
    assert len(convs) == 164
    assert convs[0].id == "humaneval-0" and convs[163].id == "humaneval-163"
    text = convs[0].messages[0]["content"]
    assert text.startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    )
    assert "def has_close_elements(" in text and text.endswith("\n```")
    raw = P.load_humaneval(template="{prompt}")
    assert raw[0].messages[0]["content"].startswith("from typing import List")


@pytest.mark.skipif(not (SHARED_EVAL / "humaneval.jsonl").is_file(), reason="shared eval_datasets not present")
def test_humaneval_matches_deepspec_file() -> None:
    ours = P.load_humaneval()
    theirs = P.load_eval_dataset(SHARED_EVAL, "humaneval")
    assert [c.messages for c in ours] == [c.messages for c in theirs]
    assert [c.id for c in ours] == [c.id for c in theirs]


# ---------------------------------------------------------------- held-out split


def _convs(n: int, prefix: str = "c") -> list[P.Conversation]:
    return [P.Conversation(f"{prefix}{i}", [{"role": "user", "content": str(i)}]) for i in range(n)]


def test_split_fraction_deterministic_disjoint_stable() -> None:
    data = _convs(2000)
    train, held = P.split_train_heldout(data, 0.1, seed=3)
    assert {c.id for c in train}.isdisjoint({c.id for c in held})
    assert len(train) + len(held) == 2000 and 150 < len(held) < 250
    train_ids = {c.id for c in train}
    assert [c.id for c in train] == [c.id for c in data if c.id in train_ids]  # input order kept
    again = P.split_train_heldout(list(data), 0.1, seed=3)
    assert [c.id for c in again[1]] == [c.id for c in held]
    # growing the input (new records anywhere) never moves an existing id
    grown = _convs(500, "new") + data[:1000] + _convs(300, "more") + data[1000:]
    g_train, g_held = P.split_train_heldout(grown, 0.1, seed=3)
    held_ids = {c.id for c in held}
    assert {c.id for c in g_held if not c.id.startswith(("new", "more"))} == held_ids
    assert not held_ids & {c.id for c in g_train}
    # another seed gives another split; 0.0 holds out nothing
    assert {c.id for c in P.split_train_heldout(data, 0.1, seed=4)[1]} != held_ids
    assert P.split_train_heldout(data, 0.0)[1] == []


def test_split_count_and_duplicates() -> None:
    data = _convs(300)
    train, held = P.split_train_heldout(data, 25, seed=0)
    assert len(held) == 25 and len(train) == 275
    train_ids = {c.id for c in train}
    grown = data + _convs(300, "x")
    g_train, g_held = P.split_train_heldout(grown, 25, seed=0)
    assert len(g_held) == 25
    assert train_ids <= {c.id for c in g_train}  # a training id never becomes held-out
    dup = data + [P.Conversation(c.id, [{"role": "user", "content": "dup"}]) for c in data[:50]]
    d_train, d_held = P.split_train_heldout(dup, 0.2, seed=1)
    assert {c.id for c in d_train}.isdisjoint({c.id for c in d_held})
    d_train, d_held = P.split_train_heldout(dup, 10, seed=1)
    assert len({c.id for c in d_held}) == 10 and {c.id for c in d_train}.isdisjoint({c.id for c in d_held})


@pytest.mark.parametrize("bad", [1.0, -0.1, -1, True, "0.1"])
def test_split_rejects_bad_heldout(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        P.split_train_heldout(_convs(3), bad)  # type: ignore[arg-type]
