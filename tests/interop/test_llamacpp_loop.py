"""llama.cpp's DSpark loop against ours: `dspark_jax.interop.llamacpp_loop`.

The slow test converts the SmolLM2 target and two exported drafters (full vocabulary, DeepSpec
format; pruned 8,192-id vocabulary, speculators format) with llama.cpp's own converter, runs
`llama-speculative-simple --spec-type draft-dspark` at T = 0 on 2 mbpp prompts × 32 tokens and
requires llama.cpp's output and accepted drafts per round to equal our engine's. It needs
`LLAMA_CPP_DIR` (a llama.cpp tree: convert_hf_to_gguf.py, gguf-py/) and `LLAMA_CPP_BUILD` (its
CMake build with bin/llama-speculative-simple; ../shared/reference/PEERS.md says how to build
it), optionally `LLAMA_CPP_CONVERT_PYTHON` (an interpreter with torch, sentencepiece,
safetensors and transformers; default this one), `LLAMA_CPP_THREADS` (llama.cpp's -t; default
1) and ../shared/eval_datasets. Example:

  LLAMA_CPP_DIR=/work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp \\
  LLAMA_CPP_BUILD=/work/peers/llama-build \\
  LLAMA_CPP_CONVERT_PYTHON=/work/peers/venv-convert/bin/python \\
  python -m pytest -m llamacpp tests/interop/test_llamacpp_loop.py

The drafters: `init_draft(from_target=True)` alone has llama.cpp and us agree on zero accepted
drafts everywhere, which would compare little. Its vanilla Markov head is therefore made a
bigram model of the target's greedy outputs on the two prompts (w1[prev] and w2[next] share a
rank direction, bias 36), with the final norm scaled by 0.1 so the backbone's logits decide the
rest by margins far above float noise; rounds then accept 0..7 drafts. The pruned drafter's
vocabulary is not contiguous, so its d2t offsets are not all zero.
"""

from __future__ import annotations

import collections
import os
import pathlib
import sys

import numpy as np
import pytest

from dspark_jax.interop import llamacpp_loop as li

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "eval_datasets"

LOG = """\
0.01.391.637 I load: printing all EOG tokens:
0.01.393.865 I load:   - 0 ('<|endoftext|>')
0.01.393.884 I load:   - 2 ('<|im_end|>')
0.01.394.119 I load: special tokens cache size = 17
0.07.147.043 D  - seq_id 0, draft candidate   0, pos   0:    216 (   0.919) ' '
0.07.147.065 D  - seq_id 0, draft candidate   1, pos   0:    582 (   0.016) ' one'
0.07.147.076 D  - seq_id 0, draft candidate   0, pos   1:     11 (   1.000) '
'
0.07.147.077 D  - seq_id 0, draft candidate   1, pos   1:    198 (   0.000) '
'
0.07.147.100 D spec common_specu: called impl draft-dspark, hist size = 11, call_count = 1, gen = 2
 Berlin0.07.745.343 D accepted 1/2 draft tokens, the last target token is: (11452)
0.07.852.368 D  - seq_id 0, draft candidate   0, pos   0:      6 (   0.951) '<filename>'
0.07.852.400 D spec common_specu: called impl draft-dspark, hist size = 13, call_count = 2, gen = 1
0.07.853.000 D accepted 0/1 draft tokens, the last target token is: (2)
0.13.293.983 I encoded   12 tokens in    0.961 seconds, speed:   12.491 t/s
0.13.294.000 I decoded    3 tokens in    6.247 seconds, speed:    0.480 t/s
"""


def test_parse_llama_log_rounds_tokens_and_timing():
    run = li.parse_llama_log(LOG)
    assert [(r.drafts, r.drafted, r.accepted, r.last) for r in run.rounds] == [
        ([216, 11], 2, 1, 11452), ([6], 1, 0, 2)]
    assert run.rounds[0].probs[0] == [0.919, 0.016]
    assert run.tokens() == [216, 11452, 2]
    assert run.eog == {0, 2} and run.hist_size == 11
    assert (run.decoded, run.decode_s) == (3, 6.247)


def test_compare_rounds_aligns_on_g1_and_skips_short_blocks():
    # ours: g1=5, round 0 accepts 1 (emits 7, 8), round 1 accepts 0 (emits 9), round 2 short
    ours = {"tokens": [5, 7, 8, 9, 10], "accepted": [1, 0, 0], "proposed": [2, 2, 2]}
    lc = li.LcRun(rounds=[li.LcRound([7, 1], [[1.0]] * 2, 2, 1, 8),
                          li.LcRound([3, 3], [[1.0]] * 2, 2, 0, 9),
                          li.LcRound([10], [[1.0]], 1, 0, 10)],
                  eog=set(), hist_size=None, decoded=None, decode_s=None, log="")
    cmp = li.compare_rounds(ours, lc, gamma=2, stops={2})
    assert (cmp["compared_rounds"], cmp["identical_rounds"], cmp["first_different"]) == (2, 2, None)
    assert [r["status"] for r in cmp["rows"]] == ["identical", "identical", "short block"]
    lc.rounds[1] = li.LcRound([9, 4], [[1.0]] * 2, 2, 1, 4)    # llama.cpp accepts one more
    cmp = li.compare_rounds(ours, lc, gamma=2, stops={2})
    assert cmp["first_different"] == 1 and cmp["identical_rounds"] == 1


def test_prompt_file_survives_llama_cpps_trailing_newline_cut(tmp_path):
    p = li.write_prompt_file("a\\nb\n", tmp_path / "p.txt")
    text = p.read_bytes().decode()
    # llama.cpp's -f drops exactly one trailing newline: what it keeps is the prompt itself
    assert text.endswith("\n") and text[:-1] == "a\\nb\n"


def _llama_cpp_or_skip() -> tuple[li.LlamaCpp, str]:
    src, build = os.environ.get("LLAMA_CPP_DIR"), os.environ.get("LLAMA_CPP_BUILD")
    if not src or not build:
        pytest.skip("set LLAMA_CPP_DIR (a llama.cpp tree with convert_hf_to_gguf.py and gguf-py) "
                    "and LLAMA_CPP_BUILD (its CMake build with bin/llama-speculative-simple; "
                    "../shared/reference/PEERS.md) to compare llama.cpp's DSpark loop with ours")
    try:
        lc = li.locate_llama_cpp(src, build)
        py = os.environ.get("LLAMA_CPP_CONVERT_PYTHON", sys.executable)
        li.check_converter_python(py, lc)
    except li.InteropError as e:
        pytest.skip(str(e))
    if not (DATA / "mbpp.jsonl").exists():
        pytest.skip(f"no DeepSpec eval prompts at {DATA}")
    return lc, py


def _bigram_drafters(out: pathlib.Path, n_prompts: int, max_new: int) -> list[pathlib.Path]:
    from dspark_jax.decoding.autoregressive import autoregressive_generate
    from dspark_jax.export import write_export
    from dspark_jax.models import load_target
    from dspark_jax.models.drafters.draft import Draft, init_draft

    target = load_target(li.TARGET_NAME)
    prompts = li.bench_prompts(str(DATA), "mbpp", n_prompts, target.tokenizer)
    gen = autoregressive_generate(target, prompts, max_new_tokens=max_new, temperature=0.0,
                                  stop_token_ids=list(target.tokenizer.stop_token_ids))
    base = dict(block_size=7, num_draft_layers=2, markov_rank=64, mask_token_id=16,
                target_layer_ids=(1, 8, 14, 20, 27))
    # a non-contiguous draft vocabulary (ids 0..4095 and every 11th above), so the exported d2t
    # holds non-zero offsets
    vocab = sorted(set(range(4096)) | set(range(4096, target.config.vocab_size, 11)))[:8192]
    paths = []
    for name, fmt, extra, allowed in (
            ("full-deepspec", "deepspec", dict(draft_vocab_size=0),
             set(range(target.config.vocab_size))),
            ("pruned-speculators", "speculators",
             dict(draft_vocab_size=8192, draft_vocab=tuple(vocab)), set(vocab))):
        counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        freq: collections.Counter = collections.Counter()
        for p, g in zip(prompts, gen):
            seq = p[-1:] + list(g)
            for a, b in zip(seq, seq[1:]):
                if b in allowed:
                    counts[a][b] += 1
                    freq[a] += 1
        m = init_draft(target, dict(base, **extra), seed=0, from_target=True).model
        w1, w2 = np.array(m.markov.w1.get_value()), np.array(m.markov.w2.get_value())
        for i, (a, _) in enumerate(freq.most_common(64)):
            w1[a, i] += 6.0
            w2[counts[a].most_common(1)[0][0], i] += 6.0
        m.markov.w1.set_value(w1)
        m.markov.w2.set_value(w2)
        m.norm.set_value(m.norm.get_value() * 0.1)
        paths.append(write_export(Draft.from_model(m), out / name, fmt))
    return paths


@pytest.mark.slow
@pytest.mark.llamacpp
def test_llama_cpp_dspark_loop_equals_ours(tmp_path):
    lc, py = _llama_cpp_or_skip()
    n, m = 2, 32
    drafts = _bigram_drafters(tmp_path / "drafters", n, m)
    argv = ["--llama-cpp", str(lc.source), "--build", str(lc.build), "--convert-python", py,
            "--prompts", str(n), "--max-new-tokens", str(m), "--work", str(tmp_path / "work"),
            "--data-dir", str(DATA), "--json", str(tmp_path / "out.json"),
            # one thread: llama.cpp's default (one per core) crawls on a machine busy with others
            "--threads", os.environ.get("LLAMA_CPP_THREADS", "1")]
    for d in drafts:
        argv += ["--draft", str(d)]
    out = li.main(argv)
    rows = {r["drafter"]: r for r in out["drafters"]}
    assert [(r["format"], r["vocabulary"]) for r in rows.values()] == [
        ("deepspec", "full"), ("speculators", "K=8192")]
    for name, r in rows.items():
        assert r["identical_outputs"] == n, (name, li.print_differences([r]))
        assert r["compared_rounds"] > 0 and r["identical_rounds"] == r["compared_rounds"], (
            name, li.print_differences([r]))
        assert r["llama_cpp_tau"] == r["ours_tau"] and r["llama_cpp_tau"] > 1.0, name
        for p in r["per_prompt"]:
            assert p["plain"]["identical"] and p["aligned"]["identical"], (name, p["prompt"])
