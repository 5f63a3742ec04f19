"""The offline prompt source (size, mixture, diversity, determinism, naming) and the n-gram
contamination filter (planted contaminated prompts dropped, clean ones kept, bad input)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from dspark_jax.data import contamination as C
from dspark_jax.data import offline_prompts as O
from dspark_jax.data import prompt_sources as S
from dspark_jax.data import prompts as P
from dspark_jax.data.regeneration import load_prompt_files

SHARED_EVAL = Path("/work/shared/eval_datasets")


@pytest.fixture(scope="module")
def mix() -> list[P.Conversation]:
    return S.load_named_prompts("offline-mix")


def _text(c: P.Conversation) -> str:
    return c.messages[0]["content"]


def test_offline_mix_size_kinds_and_diversity(mix) -> None:
    assert len(mix) >= 5000
    assert len({c.id for c in mix}) == len(mix)
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in mix)
    kinds = Counter(c.id.split("-")[1] for c in mix)
    assert set(kinds) == {"code", "math", "chat"} and min(kinds.values()) >= 1500
    texts = [_text(c) for c in mix]
    assert len(set(texts)) == len(texts)
    # diverse, not one template: many distinct openings and a wide spread of lengths
    openings = {" ".join(C.words(t)[:6]) for t in texts}
    assert len(openings) > 0.3 * len(texts)
    lengths = sorted(len(t) for t in texts)
    assert lengths[len(lengths) // 10] < 120 and lengths[-len(lengths) // 10] > 300
    vocab = {w for t in texts for w in C.words(t)}
    assert len(vocab) > 5000
    # the kinds are interleaved (a prefix of the list is already a mixture)
    assert set(c.id.split("-")[1] for c in mix[:30]) == {"code", "math", "chat"}
    code = [t for c, t in zip(mix, texts) if "-code-" in c.id]
    shown = [t for t in code if "```python\ndef " in t]
    short = [t for t in code if "```" not in t]   # a task statement alone: written from scratch
    assert len(shown) + len(short) == len(code) and 0.15 < len(short) / len(code) < 0.35
    assert all(t.startswith("Write a ") and t.endswith(".") and len(t) < 220 for t in short)


def test_offline_prompts_are_deterministic_and_seeded(mix) -> None:
    again = O.build_offline_prompts(0)
    assert [(c.id, c.messages) for c in again] == [(c.id, c.messages) for c in mix]
    other = O.build_offline_prompts(1, code=50, math=50, chat=50)
    assert len(other) == 150
    assert {_text(c) for c in other} != {_text(c) for c in mix if c.id in {o.id for o in other}}


def test_named_sources_and_bad_names(tmp_path: Path) -> None:
    math = S.load_named_prompts("offline-math")
    assert len(math) == O.DEFAULT_SIZES["math"] and all("-math-" in c.id for c in math)
    assert len(S.load_named_prompts("humaneval")) == 164
    with pytest.raises(ValueError, match="unknown prompt source 'offline-poetry'.*offline-mix"):
        S.load_named_prompts("offline-poetry")
    with pytest.raises(ValueError, match="code count must be >= 0"):
        O.build_offline_prompts(0, code=-1)
    with pytest.raises(ValueError, match="only .* chat prompts available"):
        O.build_offline_prompts(0, code=0, math=0, chat=10**6)
    # the regeneration CLI's loader takes names and files alike
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["hello there"]}) + "\n")
    convs = load_prompt_files([str(f), "offline-chat"])
    assert convs[0].messages[0]["content"] == "hello there"
    assert len(convs) == 1 + O.DEFAULT_SIZES["chat"]


def _eval_dir(tmp_path: Path) -> Path:
    d = tmp_path / "evals"
    d.mkdir()
    (d / "qa.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in [
        ["Natalia sold clips to forty eight of her friends in April and then she sold half as "
         "many clips in May how many clips did she sell altogether"],
        ["Write a poem.", "Now make the poem rhyme with orange and purple please"],
    ]))
    (d / "code.jsonl").write_text(json.dumps({"turns": [
        "def strange_sort(lst): return the list in strange order, starting with the minimum "
        "then the maximum of the remaining integers and so on"]}) + "\n")
    (d / "notes.txt").write_text("not an eval file: never read")
    return d


def test_filter_drops_planted_prompts_and_keeps_clean_ones(tmp_path: Path) -> None:
    d = _eval_dir(tmp_path)
    user = lambda i, t: P.Conversation(i, [{"role": "user", "content": t}])  # noqa: E731
    convs = [
        user("clean-1", "Explain how a heat pump works, step by step, for a homeowner."),
        # a benchmark question pasted into a longer prompt, with other case and punctuation
        user("planted-qa", "Solve this: NATALIA sold clips to forty-eight of her friends in "
                           "April, and then she sold half as many clips in May. Thanks!"),
        user("clean-2", "Natalia sold apples to her friends in April."),  # shares < 13 words
        P.Conversation("planted-turn2", [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "now make the poem rhyme with orange and purple please "
                                        "and also with lemon"}]),
        user("planted-code", "Return the list in strange order starting with the minimum then "
                             "the maximum of the remaining integers and so on, in Rust."),
        user("short-equal", "write a poem"),  # shorter than n: compared whole
        user("short-clean", "write a sonnet"),
    ]
    kept, report = C.filter_contaminated(convs, d)
    assert [c.id for c in kept] == ["clean-1", "clean-2", "short-clean"]
    assert report.dropped_ids == ("planted-qa", "planted-turn2", "planted-code", "short-equal")
    assert (report.kept, report.dropped, report.n) == (3, 4, 13)
    assert report.eval_files == ("code", "qa")
    assert report.dropped_by_file == {"code": 1, "qa": 3}
    assert "dropped 4, kept 3" in report.summary()
    # deterministic; a longer n lets the partial overlaps through
    assert C.filter_contaminated(convs, d)[1] == report
    kept_30, _ = C.filter_contaminated(convs, d, n=30)
    assert "planted-qa" in {c.id for c in kept_30}
    # assistant turns are not prompts: they are never matched
    reply_only = [P.Conversation("a", [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": _text(convs[1])}])]
    assert C.filter_contaminated(reply_only, d)[1].dropped == 0


def test_filter_bad_input(tmp_path: Path) -> None:
    convs = [P.Conversation("x", [{"role": "user", "content": "hello"}])]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        C.filter_contaminated(convs, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.jsonl evaluation files"):
        C.filter_contaminated(convs, tmp_path / "empty")
    d = _eval_dir(tmp_path)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="n must be a positive integer"):
            C.filter_contaminated(convs, d, n=bad)  # type: ignore[arg-type]
    (d / "broken.jsonl").write_text('{"turns": ["fine"]}\n{"prompt": "no turns"}\n')
    with pytest.raises(P.PromptDataError, match=r"broken\.jsonl:2: turns: missing field"):
        C.filter_contaminated(convs, d)


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_EVAL.is_dir(), reason="shared eval_datasets not present")
def test_offline_mix_against_the_shared_benchmarks(mix) -> None:
    gsm = P.read_eval_file(SHARED_EVAL / "gsm8k.jsonl")[7]
    planted = P.Conversation("planted", [{"role": "user", "content": gsm.messages[0]["content"]}])
    kept, report = C.filter_contaminated(mix[:300] + [planted], SHARED_EVAL)
    assert "planted" in report.dropped_ids and report.dropped_by_file["gsm8k"] >= 1
    assert report.kept >= 295  # the generated prompts are (nearly all) clean


def test_training_config_takes_named_sources_and_decontaminates(tmp_path: Path) -> None:
    from dspark_jax.train import cli, data_stage

    def prompts(*overrides: str) -> list[P.Conversation]:
        c = cli.parse_config(["p", "--config=configs/tiny.py", "--config.target=x", *overrides])
        return data_stage.load_prompts(c)

    assert len(prompts("--config.data.prompts=('offline-chat',)")) == O.DEFAULT_SIZES["chat"]
    d = tmp_path / "evals"
    d.mkdir()
    chat = S.load_named_prompts("offline-chat")
    (d / "bench.jsonl").write_text(json.dumps({"turns": [_text(chat[5])]}) + "\n")
    kept = prompts("--config.data.prompts=('offline-chat',)", f"--config.data.decontaminate={d}")
    assert [c.id for c in kept] == [c.id for c in chat if c.id != chat[5].id]
    with pytest.raises(cli.UsageError, match="'offline-poems' not found .*named source"):
        prompts("--config.data.prompts=('offline-poems',)")
