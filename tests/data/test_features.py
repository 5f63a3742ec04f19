"""The offline target-feature cache: round trip against the target, the size formula, refusal on a
short disk, manifest validation, and feeding the cache through the grain pipeline."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from dspark_jax.data import features as F
from dspark_jax.data.pipeline import PipelineConfig, make_dataset
from dspark_jax.models import load_target
from hf_tiny import save_tiny_hf

LAYERS = (-1, 0, 2)
D = 32


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("tiny_llama"), "llama"))


@pytest.fixture(scope="module")
def records():
    rng = np.random.default_rng(1)
    return [{"input_ids": rng.integers(0, 97, n).astype(np.int32),
             "loss_mask": (rng.random(n) < 0.5).astype(np.int32)} for n in (7, 70, 33, 5, 64, 12, 41)]


@pytest.fixture(scope="module")
def cache_dir(target, records, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "feats"
    F.write_feature_cache(target, records, out, LAYERS, batch_size=3, shard_tokens=80, progress=False)
    return out


def _bf16_close(got: np.ndarray, want: np.ndarray) -> None:
    # one bf16 rounding (≤ 2^-8 relative) plus float noise from a padded batch
    err = np.abs(got - want)
    assert np.all(err <= 2.0**-8 * np.abs(want) + 1e-5), float((err - 2.0**-8 * np.abs(want)).max())


def test_round_trip_equals_the_target(target, records, cache_dir):
    cache = F.FeatureCache(cache_dir, expected_target=target.name, expected_layer_ids=LAYERS)
    assert len(cache) == len(records)
    assert cache.lengths.tolist() == [len(r["input_ids"]) for r in records]
    assert len(json.loads((cache_dir / F.MANIFEST).read_text())["shards"]) > 1
    # reference: one right-padded batch (causal, so the padding does not change real positions)
    S = max(len(r["input_ids"]) for r in records)
    ids = np.zeros((len(records), S), np.int32)
    for i, rec in enumerate(records):
        ids[i, :len(rec["input_ids"])] = rec["input_ids"]
    taps = target.hidden_states(ids, LAYERS)
    gd = target.graphdef
    hidden = np.asarray(jax.jit(lambda st, x: nnx.merge(gd, st)(x).hidden)(target.state, ids))
    logits = target.logits(ids)
    lm_head = jax.jit(lambda st, h: nnx.merge(gd, st).logits(h))
    for i, rec in enumerate(records):
        n = len(rec["input_ids"])
        item = cache[i]
        np.testing.assert_array_equal(item["input_ids"], rec["input_ids"])
        np.testing.assert_array_equal(item["loss_mask"], rec["loss_mask"])
        assert item["input_ids"].dtype == np.int32 and item["loss_mask"].dtype == np.int32
        assert item["features"].dtype == np.float32 and item["features"].shape == (n, 3 * D)
        _bf16_close(item["features"], taps[i, :n])
        assert item["target_hidden"].shape == (n, D)
        _bf16_close(item["target_hidden"], hidden[i, :n])
        # the final hidden gives the target's logits (the soft labels of training)
        got = np.asarray(lm_head(target.state, np.pad(item["target_hidden"], ((0, S - n), (0, 0)))))
        assert np.abs(got[:n] - logits[i, :n]).max() < 0.05


def test_size_formula_matches_the_files(records, cache_dir):
    assert F.estimate_cache_bytes(10, 4, 2) == 10 * (4 + 2 + 2 * 4 * 3)
    total = sum(len(r["input_ids"]) for r in records)
    data = sum(np.load(p, mmap_mode="r", allow_pickle=False).nbytes for p in cache_dir.glob("*.npy"))
    assert data == F.estimate_cache_bytes(total, D, len(LAYERS))


def test_refuses_when_the_disk_is_short(target, records, tmp_path, monkeypatch, capsys):
    total = sum(len(r["input_ids"]) for r in records)
    need = F.estimate_cache_bytes(total, D, len(LAYERS))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real(p)._replace(free=need - 1))
    out = tmp_path / "nope"
    with pytest.raises(F.InsufficientDiskError, match="nothing was written"):
        F.write_feature_cache(target, records, out, LAYERS, batch_size=2, progress=False)
    assert not out.exists()
    assert f"{total} tokens" in capsys.readouterr().err  # the size is reported first
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=need))
    F.write_feature_cache(target, records[:1], out, LAYERS, batch_size=2, progress=False)
    assert (out / F.MANIFEST).is_file()


def test_manifest_mismatch_and_damage_are_clear_errors(target, records, cache_dir, tmp_path):
    manifest = str(cache_dir / F.MANIFEST)
    with pytest.raises(F.FeatureCacheError, match="expected 'other'") as e:
        F.FeatureCache(cache_dir, expected_target="other")
    assert manifest in str(e.value)
    with pytest.raises(F.FeatureCacheError, match=r"layer ids \[-1, 0, 2\], expected \[0, 1\]") as e:
        F.FeatureCache(cache_dir, expected_layer_ids=[0, 1])
    assert manifest in str(e.value)
    with pytest.raises(F.FeatureCacheError, match="not .* feature cache"):
        F.FeatureCache(tmp_path)
    with pytest.raises(F.FeatureCacheError, match="already"):
        F.write_feature_cache(target, records, cache_dir, LAYERS, batch_size=2, progress=False)
    broken = tmp_path / "broken"
    shutil.copytree(cache_dir, broken)
    victim = sorted(broken.glob("shard-00001.features.npy"))[0]
    victim.unlink()
    with pytest.raises(F.FeatureCacheError, match="shard-00001.features.npy"):
        F.FeatureCache(broken)


def test_cache_feeds_the_pipeline(records, cache_dir):
    cache = F.FeatureCache(cache_dir)
    pc = PipelineConfig(batch_size=2, max_length=48, shuffle=False, num_epochs=1, drop_remainder=False)
    batches = list(make_dataset(cache, pc, shard_index=0, shard_count=1))
    assert len(batches) == 4
    b = batches[0]
    assert b["features"].shape == (2, 48, 3 * D) and b["features"].dtype == np.float32
    assert b["target_hidden"].shape == (2, 48, D)
    n0 = len(records[0]["input_ids"])
    np.testing.assert_array_equal(b["features"][0, :n0], cache[0]["features"])
    assert not b["features"][0, n0:].any() and not b["target_hidden"][0, n0:].any()
    np.testing.assert_array_equal(b["features"][1], cache[1]["features"][:48])  # truncated
