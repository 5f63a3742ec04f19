"""The grain input pipeline: seeded per-epoch order, host sharding, padding/packing, and exact
resumption from the iterator state."""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import numpy as np
import pytest

from dspark_jax.data.pipeline import (PipelineConfig, batch_sharding, batch_width, make_dataset,
                                      pack_rows, record_lengths, records_from_conversations,
                                      steps_per_epoch, to_global_batch)

N = 23
TAG = 1000  # record i starts with token TAG + i, so every row says which records it holds


def _records(n: int = N) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        length = int(rng.integers(3, 21))
        ids = rng.integers(1, 900, length).astype(np.int32)
        ids[0] = TAG + i
        mask = (rng.random(length) < 0.6).astype(np.int32)
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


def _take(ds, k: int) -> list[dict[str, np.ndarray]]:
    return list(itertools.islice(iter(ds), k))


def _segments(batch: dict[str, np.ndarray]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every segment in a batch."""
    out = []
    for r, seg in enumerate(batch["segment_ids"]):
        for s in range(1, int(seg.max()) + 1):
            where = np.flatnonzero(seg == s)
            assert len(where) and np.all(np.diff(where) == 1), "segment not contiguous"
            out.append((r, int(where[0]), int(where[-1]) + 1))
    return out


def _record_ids(batches) -> list[int]:
    return [int(b["input_ids"][r, s]) - TAG for b in batches for r, s, _ in _segments(b)]


def _check_rows(batches, records, S: int) -> None:
    """Every segment equals its (truncated) record; positions restart; padding is zero."""
    for b in batches:
        assert all(b[k].shape == b["input_ids"].shape and b[k].dtype == np.int32
                   for k in ("input_ids", "loss_mask", "positions", "segment_ids"))
        assert b["input_ids"].shape[1] == S
        pad = b["segment_ids"] == 0
        assert not b["input_ids"][pad].any() and not b["loss_mask"][pad].any()
        assert not b["positions"][pad].any()
        for r, s, e in _segments(b):
            rec = records[int(b["input_ids"][r, s]) - TAG]
            n = min(len(rec["input_ids"]), S)
            assert e - s == n
            np.testing.assert_array_equal(b["input_ids"][r, s:e], rec["input_ids"][:n])
            np.testing.assert_array_equal(b["loss_mask"][r, s:e], rec["loss_mask"][:n])
            np.testing.assert_array_equal(b["positions"][r, s:e], np.arange(n))


@pytest.mark.parametrize("pack", [False, True])
def test_order_is_seeded_and_changes_every_epoch(pack):
    recs = _records()
    pc = PipelineConfig(batch_size=4, max_length=24, pack=pack, seed=3, num_epochs=2,
                        drop_remainder=False)
    steps = steps_per_epoch(N, pc, lengths=record_lengths(recs))
    a, b = list(make_dataset(recs, pc, shard_index=0, shard_count=1)), \
        list(make_dataset(recs, pc, shard_index=0, shard_count=1))
    assert len(a) == 2 * steps
    for x, y in zip(a, b):
        assert all(np.array_equal(x[k], y[k]) for k in x)
    e0, e1 = _record_ids(a[:steps]), _record_ids(a[steps:])
    assert sorted(e0) == list(range(N)) and sorted(e1) == list(range(N))  # each once per epoch
    assert e0 != e1
    other = list(make_dataset(recs, PipelineConfig(batch_size=4, max_length=24, pack=pack, seed=4,
                                                   num_epochs=2, drop_remainder=False),
                              shard_index=0, shard_count=1))
    assert _record_ids(other) != _record_ids(a)
    _check_rows(a, recs, 24)


def test_no_shuffle_keeps_input_order_and_drop_remainder():
    recs = _records()
    pc = PipelineConfig(batch_size=5, max_length=32, shuffle=False, num_epochs=1)
    batches = list(make_dataset(recs, pc, shard_index=0, shard_count=1))
    assert len(batches) == steps_per_epoch(N, pc) == N // 5
    assert _record_ids(batches) == list(range(N // 5 * 5))
    _check_rows(batches, recs, 32)


def test_partial_last_batch_is_filled_with_padding_rows():
    recs = _records()
    pc = PipelineConfig(batch_size=5, max_length=32, shuffle=False, num_epochs=1,
                        drop_remainder=False)
    batches = list(make_dataset(recs, pc, shard_index=0, shard_count=1))
    assert len(batches) == 5 and all(b["input_ids"].shape == (5, 32) for b in batches)
    assert (batches[-1]["segment_ids"].max(axis=1) > 0).tolist() == [True, True, True, False, False]
    assert _record_ids(batches) == list(range(N))


@pytest.mark.parametrize("pack", [False, True])
def test_host_shards_are_disjoint_and_cover_the_global_batch(pack):
    recs = _records()
    H = 4
    pc = PipelineConfig(batch_size=8, max_length=24, pack=pack, seed=1, num_epochs=1,
                        drop_remainder=False)
    glob = list(make_dataset(recs, pc, shard_index=0, shard_count=1))
    hosts = [list(make_dataset(recs, pc, shard_index=h, shard_count=H)) for h in range(H)]
    assert all(len(h) == len(glob) for h in hosts)  # lockstep
    for step, g in enumerate(glob):
        for k in g:
            np.testing.assert_array_equal(np.concatenate([h[step][k] for h in hosts]), g[k])
    per_host = [_record_ids(h) for h in hosts]
    flat = [i for ids in per_host for i in ids]
    assert sorted(flat) == list(range(N))  # disjoint and covering
    assert all(h[0]["input_ids"].shape[0] == 2 for h in hosts)


def test_packing_keeps_segments_intact():
    recs = _records(40)
    pc = PipelineConfig(batch_size=2, max_length=32, pack=True, num_epochs=1, drop_remainder=False)
    batches = list(make_dataset(recs, pc, shard_index=0, shard_count=1))
    _check_rows(batches, recs, 32)
    assert sorted(_record_ids(batches)) == list(range(40))
    assert max(int(b["segment_ids"].max()) for b in batches) >= 2  # rows really hold several
    rows = pack_rows(record_lengths(recs), 32, seed=0)
    assert sorted(i for r in rows for i in r) == list(range(40))
    assert all(sum(len(recs[i]["input_ids"]) for i in r) <= 32 for r in rows)
    # a record longer than a row is truncated into a row of its own
    long = recs + [{"input_ids": np.concatenate([[TAG + 40], np.ones(50, np.int32)]).astype(np.int32),
                    "loss_mask": np.ones(51, np.int32)}]
    batches = list(make_dataset(long, pc, shard_index=0, shard_count=1))
    _check_rows(batches, long, 32)
    assert sorted(_record_ids(batches)) == list(range(41))


@pytest.mark.parametrize("pack", [False, True])
def test_state_restore_resumes_with_the_same_batches(pack):
    recs = _records()
    pc = PipelineConfig(batch_size=4, max_length=24, pack=pack, seed=7, num_epochs=None)
    ds = make_dataset(recs, pc, shard_index=1, shard_count=2)
    it = iter(ds)
    for _ in range(4):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(9)]  # crosses an epoch boundary
    fresh = iter(make_dataset(recs, pc, shard_index=1, shard_count=2))
    fresh.set_state(state)
    got = [next(fresh) for _ in range(9)]
    for x, y in zip(expected, got):
        assert all(np.array_equal(x[k], y[k]) for k in x)
    # and restoring an earlier state rewinds
    fresh.set_state(state)
    assert np.array_equal(next(fresh)["input_ids"], expected[0]["input_ids"])


def test_config_errors():
    recs = _records()
    with pytest.raises(ValueError, match="divisible"):
        make_dataset(recs, PipelineConfig(batch_size=6, max_length=16), shard_index=0, shard_count=4)
    with pytest.raises(ValueError, match="no full global batch"):
        make_dataset(recs, PipelineConfig(batch_size=64, max_length=16), shard_index=0, shard_count=1)
    with pytest.raises(ValueError, match="empty"):
        make_dataset([], PipelineConfig(batch_size=2, max_length=16), shard_index=0, shard_count=1)
    with pytest.raises(ValueError, match="lengths"):
        steps_per_epoch(N, PipelineConfig(batch_size=2, max_length=16, pack=True))


def _with_features(recs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The records with per-token `features` [L, 3] and `target_hidden` [L, 2] (a feature
    cache's fields), nonzero on every real token."""
    rng = np.random.default_rng(1)
    return [dict(r, features=rng.random((len(r["input_ids"]), 3), np.float32) + 1,
                 target_hidden=rng.random((len(r["input_ids"]), 2), np.float32) + 1) for r in recs]


@pytest.mark.parametrize("multiple,max_length", [(1, 32), (8, 32), (8, 20)])
def test_pad_to_longest_pads_each_global_batch_to_its_rounded_longest(multiple, max_length):
    """pad_to "longest": each batch is as wide as its longest record (truncated to max_length)
    rounded up to pad_multiple and capped at max_length; its real tokens, masks and features are
    those of the max_length batch, which holds only padding beyond that width."""
    recs = _with_features(_records())
    kw = dict(batch_size=4, max_length=max_length, seed=3, num_epochs=2, drop_remainder=False)
    full = list(make_dataset(recs, PipelineConfig(**kw), shard_index=0, shard_count=1))
    got = list(make_dataset(recs, PipelineConfig(**kw, pad_to="longest", pad_multiple=multiple),
                            shard_index=0, shard_count=1))
    assert len(got) == len(full) == 2 * steps_per_epoch(N, PipelineConfig(**kw))
    widths = []
    for f, b in zip(full, got):
        longest = min(max(len(recs[i]["input_ids"]) for i in _record_ids([f])), max_length)
        width = min(max_length, -(-longest // multiple) * multiple)
        assert b["input_ids"].shape == (4, width), (b["input_ids"].shape, longest)
        assert int((b["segment_ids"] > 0).sum(axis=1).max()) == longest
        for k in f:
            assert b[k].dtype == f[k].dtype and b[k].shape[1] == width
            np.testing.assert_array_equal(b[k], f[k][:, :width], err_msg=k)
            assert not f[k][:, width:].any(), k
        widths.append(width)
    if max_length == 32:     # records are 3..20 tokens: the widths vary, none is max_length
        assert len(set(widths)) > 1 and max(widths) < max_length, widths
    else:                    # some batches capped at max_length, some below it
        assert min(widths) < max_length == max(widths), widths
    assert batch_width(np.array([5, 40]), 32, 8) == 32 and batch_width(np.array([9]), 32, 8) == 16


@pytest.mark.parametrize("order", ["grain", "deepspec"])
def test_pad_to_longest_agrees_across_hosts_and_resumes_exactly(order):
    """Every host pads to the GLOBAL batch's longest (its own rows may all be shorter), so the
    hosts' rows form the single-host global batch; a resumed iterator yields the same batches,
    widths included."""
    recs = _records()
    pc = PipelineConfig(batch_size=4, max_length=24, seed=5, pad_to="longest", pad_multiple=4,
                        order=order, micro_batches=2)
    H = 2
    glob = _take(make_dataset(recs, pc, shard_index=0, shard_count=1), 8)
    hosts = [_take(make_dataset(recs, pc, shard_index=h, shard_count=H), 8) for h in range(H)]
    short_host = 0       # steps where a host's own rows would round to a narrower width
    for step, g in enumerate(glob):
        for k in g:
            np.testing.assert_array_equal(np.concatenate([h[step][k] for h in hosts]), g[k])
        own = [batch_width((h[step]["segment_ids"] > 0).sum(axis=1), 24, 4) for h in hosts]
        short_host += min(own) < g["input_ids"].shape[1]
    assert len({g["input_ids"].shape[1] for g in glob}) > 1 and short_host > 0
    it = iter(make_dataset(recs, pc, shard_index=1, shard_count=H))
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(5)]    # crosses the epoch boundary (5 steps an epoch)
    fresh = iter(make_dataset(recs, pc, shard_index=1, shard_count=H))
    fresh.set_state(state)
    for x, y in zip(expected, (next(fresh) for _ in range(5))):
        assert all(x[k].shape == y[k].shape and np.array_equal(x[k], y[k]) for k in x)


def test_pad_options_are_checked():
    with pytest.raises(ValueError, match="pad_to must be one of"):
        PipelineConfig(batch_size=2, max_length=16, pad_to="shortest")
    for bad in (0, -8, 1.5, True):
        with pytest.raises(ValueError, match="pad_multiple must be an integer >= 1"):
            PipelineConfig(batch_size=2, max_length=16, pad_to="longest", pad_multiple=bad)
    with pytest.raises(ValueError, match="pad_to 'longest'.*pack=False"):
        PipelineConfig(batch_size=2, max_length=16, pad_to="longest", pack=True)
    PipelineConfig(batch_size=2, max_length=16, pad_to="max_length", pack=True)


def test_to_global_batch_on_a_data_mesh():
    from dspark_jax.sharding import make_mesh

    mesh = make_mesh(data=-1)
    n = mesh.devices.size
    recs = _records()
    batch = _take(make_dataset(recs, PipelineConfig(batch_size=n, max_length=16), shard_index=0,
                               shard_count=1), 1)[0]
    glob = to_global_batch(batch, batch_sharding(mesh))
    for k, v in batch.items():
        assert isinstance(glob[k], jax.Array) and glob[k].shape == v.shape
        np.testing.assert_array_equal(np.asarray(glob[k]), v)
    assert len(glob["input_ids"].sharding.device_set) == n


def test_records_from_conversations_renders_loss_masks():
    from dspark_jax.data.prompts import load_conversations
    from dspark_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    convs = load_conversations(Path(__file__).resolve().parents[1] / "fixtures" / "data" / "conversations.jsonl")
    recs, stats = records_from_conversations(convs, tok, max_length=512)
    assert stats["seen"] == len(convs) and stats["kept"] == len(recs) > 0
    assert stats["kept"] + stats["dropped_min_loss_tokens"] == len(convs)
    for r in recs:
        assert r["input_ids"].dtype == np.int32 and r["input_ids"].shape == r["loss_mask"].shape
        assert r["loss_mask"].sum() >= 14
    batch = _take(make_dataset(recs, PipelineConfig(batch_size=1, max_length=512, shuffle=False),
                               shard_index=0, shard_count=1), 1)[0]
    np.testing.assert_array_equal(batch["loss_mask"][0, :len(recs[0]["loss_mask"])], recs[0]["loss_mask"])
