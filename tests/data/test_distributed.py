"""Regeneration and feature caching split across processes: two simulated processes (explicit
index, count) and the merge give the single-process result; parts are disjoint, balanced and
resumable; merging unfinished or mismatched parts is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dspark_jax.data import distributed as D
from dspark_jax.data.features import FeatureCache, FeatureCacheError, write_feature_cache
from dspark_jax.data.prompts import Conversation
from dspark_jax.data.regeneration import RegenerationError, regenerate
from dspark_jax.models import load_target
from dspark_jax.models.tokenizer import load_tokenizer
from hf_tiny import save_tiny_hf

KW = dict(max_new_tokens=6, batch_size=2, seed=3, progress=False)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_smollm_dist")
    save_tiny_hf(path, "llama", vocab=49152, layers=2)
    load_tokenizer("smollm2-135m-instruct").hf.save_pretrained(path)
    return load_target(path)


def _convs(n: int = 9) -> list[Conversation]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Tell me about item {i} {'x' * i}"}]
        if i % 4 == 0:
            msgs += [{"role": "assistant", "content": "old"}, {"role": "user", "content": "More?"}]
        out.append(Conversation(f"q{i}", msgs))
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_two_processes_regenerate_what_one_does(target, tmp_path):
    convs = _convs()
    single = tmp_path / "single.jsonl"
    regenerate(target, convs, single, **KW)
    out = tmp_path / "merged.jsonl"
    parts = [D.conversations_of_part(convs, i, 2) for i in range(2)]
    assert sorted(c.id for p in parts for c in p) == sorted(c.id for c in convs)
    assert all(parts) and not {c.id for c in parts[0]} & {c.id for c in parts[1]}

    D.regenerate_part(target, convs, out, 0, 2, **KW)
    with pytest.raises(RegenerationError, match="part 1 of 2 is not finished"):
        D.merge_regenerated(convs, out, 2)
    D.regenerate_part(target, convs, out, 1, 2, **KW)
    D.merge_regenerated(convs, out, 2)
    merged = _lines(out)
    assert {r["id"]: r for r in merged} == {r["id"]: r for r in _lines(single)}
    assert [r["id"] for r in merged] == [c.id for c in convs]  # canonical: input order
    # a single-process output (completion order) put in input order is the merge, byte for byte
    D.put_in_input_order(convs, single)
    assert single.read_bytes() == out.read_bytes()
    # a finished part is resumed, not redone; merging again gives the same bytes
    again = D.regenerate_part(target, convs, out, 0, 2, **KW)
    assert again.written == 0 and again.already_done == len(parts[0])
    before = out.read_bytes()
    D.merge_regenerated(convs, out, 2)
    assert out.read_bytes() == before
    # a part written with other settings is refused by the merge
    other = tmp_path / "other.jsonl"
    D.regenerate_part(target, convs, other, 0, 2, **KW)
    D.regenerate_part(target, convs, other, 1, 2, **(KW | {"seed": 4}))
    with pytest.raises(RegenerationError, match="settings differ"):
        D.merge_regenerated(convs, other, 2)


def test_bad_process_index_or_count():
    with pytest.raises(ValueError, match=r"process index must be in \[0, 2\)"):
        D.conversations_of_part(_convs(), 2, 2)
    with pytest.raises(ValueError, match="process count must be a positive integer"):
        D.records_of_part([3, 4], 0, 0)


@pytest.fixture(scope="module")
def feature_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_feat")
    save_tiny_hf(path, "llama", vocab=97, layers=3)
    return load_target(path, with_tokenizer=False)


def _records(n: int = 11) -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        L = int(rng.integers(3, 90))
        out.append({"input_ids": rng.integers(0, 97, L).astype(np.int32),
                    "loss_mask": (rng.random(L) < 0.5).astype(np.int32)})
    return out


def test_two_processes_cache_features_as_one_does(feature_target, tmp_path):
    records = _records()
    lengths = [len(r["input_ids"]) for r in records]
    layers = [0, 2]
    parts = [D.records_of_part(lengths, i, 2) for i in range(2)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(records)))
    tokens = [sum(lengths[i] for i in p) for p in parts]
    assert abs(tokens[0] - tokens[1]) <= max(lengths)  # balanced by tokens

    single = write_feature_cache(feature_target, records, tmp_path / "single", layers,
                                 batch_size=4, progress=False)
    out = tmp_path / "merged"
    D.write_feature_cache_part(feature_target, records, out, layers, 1, 2, batch_size=4,
                               progress=False)
    with pytest.raises(FeatureCacheError, match="part 0 of 2 is not finished"):
        D.merge_feature_cache_parts(out, len(records), lengths, 2)
    D.write_feature_cache_part(feature_target, records, out, layers, 0, 2, batch_size=4,
                               progress=False)
    stamp = (out / "part-0-of-2" / "manifest.json").stat().st_mtime_ns
    D.write_feature_cache_part(feature_target, records, out, layers, 0, 2, batch_size=4,
                               progress=False)  # finished: not recomputed
    assert (out / "part-0-of-2" / "manifest.json").stat().st_mtime_ns == stamp
    D.merge_feature_cache_parts(out, len(records), lengths, 2)

    a, b = FeatureCache(single), FeatureCache(out, expected_layer_ids=layers)
    assert len(b) == len(records) and np.array_equal(a.lengths, b.lengths)
    for r in range(len(records)):
        x, y = a[r], b[r]
        assert np.array_equal(x["input_ids"], y["input_ids"])
        assert np.array_equal(y["input_ids"], records[r]["input_ids"])
        assert np.array_equal(x["loss_mask"], y["loss_mask"])
        for f in ("features", "target_hidden"):  # bf16 storage: equal up to one bf16 step
            np.testing.assert_allclose(y[f], x[f], rtol=1e-2, atol=1e-2)
    # other records (or another process count) do not match the parts
    with pytest.raises(FeatureCacheError, match="the split expects"):
        D.merge_feature_cache_parts(out, len(records) - 1, lengths[:-1], 2)
