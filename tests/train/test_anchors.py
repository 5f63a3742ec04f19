"""Anchor sampling per sequence: with packed rows every segment gets up to
num_anchors anchors, as DeepSpec's sampler gives every sample; unpacked rows are unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.data.pipeline import PipelineConfig, max_segments_per_row, pack_rows
from dspark_jax.models import init_draft, load_target
from dspark_jax.train.anchors import anchor_candidates, anchor_slots, sample_anchors
from dspark_jax.train.losses import dspark_loss_sums, metrics_from_sums
from hf_tiny import save_tiny_hf


def _packed_row():
    """One row of S = 30: sequence 1 (12 tokens, 8 candidates), sequence 2 (10 tokens,
    7 candidates), sequence 3 (5 tokens, 2 candidates), 3 padding positions."""
    seg = np.asarray([1] * 12 + [2] * 10 + [3] * 5 + [0] * 3, np.int32)
    lm = np.zeros(30, np.int32)
    lm[3:12] = 1
    lm[14:22] = 1
    lm[24:27] = 1
    return lm[None], seg[None]


def test_every_packed_sequence_gets_its_own_num_anchors():
    lm, seg = _packed_row()
    cand = np.asarray(anchor_candidates(jnp.asarray(lm), jnp.asarray(seg)))[0]
    per_seq = {k: int(cand[seg[0] == k].sum()) for k in (1, 2, 3)}
    assert per_seq == {1: 8, 2: 7, 3: 2}
    for key in range(20):
        anchors, valid = map(np.asarray, sample_anchors(jax.random.key(key), jnp.asarray(lm), 4,
                                                        jnp.asarray(seg), max_segments=3))
        assert anchors.shape == (1, anchor_slots(4, 30, 3)) == (1, 12)
        kept = anchors[0][valid[0]]
        assert np.all(np.diff(kept) > 0) and np.all(cand[kept])          # sorted candidates
        got = {k: int(np.sum(seg[0][kept] == k)) for k in (1, 2, 3)}
        assert got == {1: 4, 2: 4, 3: 2}, got                              # min(4, #cand) each
    # one sequence per row: the row-level draw (top num_anchors scores) is unchanged
    one = jnp.asarray(lm * (seg == 1))
    key = jax.random.key(3)
    anchors, valid = map(np.asarray, sample_anchors(key, one, 4, jnp.asarray((seg > 0) * 1)))
    scores = np.where(np.asarray(anchor_candidates(one)), np.asarray(
        jax.random.uniform(key, one.shape)), -1.0)[0]
    assert set(anchors[0][valid[0]]) == set(np.argsort(-scores)[:4])


def test_draw_within_a_sequence_is_uniform():
    lm, seg = _packed_row()
    draw = jax.jit(jax.vmap(lambda k: sample_anchors(k, jnp.asarray(lm), 4, jnp.asarray(seg),
                                                     max_segments=3)))
    anchors, valid = map(np.asarray, draw(jax.random.split(jax.random.key(0), 4000)))
    counts = np.bincount(anchors[valid], minlength=30) / 4000
    cand = np.asarray(anchor_candidates(jnp.asarray(lm), jnp.asarray(seg)))[0]
    for k, n in ((1, 8), (2, 7)):
        p = counts[(seg[0] == k) & cand]
        # each candidate of a sequence with n candidates is kept with probability 4/n
        np.testing.assert_allclose(p, 4 / n, atol=5 * np.sqrt(4 / n * (1 - 4 / n) / 4000))
    np.testing.assert_array_equal(counts[(seg[0] == 3) & cand], 1.0)


def test_max_segments_per_row_follows_the_packing_plan():
    lengths = [5, 7, 3, 9, 2, 4]
    pc = PipelineConfig(batch_size=2, max_length=12, pack=True, seed=1)
    rows = pack_rows(lengths, 12, seed=1)
    assert max_segments_per_row(lengths, pc) == max(len(r) for r in rows) > 1
    assert max_segments_per_row(lengths, PipelineConfig(batch_size=2, max_length=12)) == 1


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                    layers=4))


# packing is off by default; the per-segment anchor tests above stay in the default suite
@pytest.mark.slow
def test_packed_row_trains_like_its_sequences_unpacked(target):
    """Two sequences packed in one row give the losses of the same two sequences in two rows
    (num_anchors = 6 ≥ each sequence's candidates, so every candidate is drawn either way);
    under a per-row budget the packed row would keep only 6 anchors in total."""
    draft = init_draft(target, dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1),
                                    mask_token_id=96, markov_rank=8, num_anchors=6), seed=2)
    rng = np.random.RandomState(0)
    n1, n2, S = 9, 8, 20
    ids = [rng.randint(3, 90, n).astype(np.int32) for n in (n1, n2)]
    lms = [np.r_[np.zeros(2), np.ones(n - 2)].astype(np.int32) for n in (n1, n2)]
    outs = [target.model(jnp.asarray(x)[None], tap_layer_ids=(0, 1)) for x in ids]

    def pad(x, n=S):
        return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])

    # unpacked: one sequence per row (right padding, segment 0 on padding)
    rows = dict(input_ids=np.stack([pad(x) for x in ids]), loss_mask=np.stack([pad(m) for m in lms]),
                positions=np.stack([pad(np.arange(n, dtype=np.int32)) for n in (n1, n2)]),
                segment_ids=np.stack([pad(np.ones(n, np.int32)) for n in (n1, n2)]))
    feats = np.stack([pad(np.asarray(o.taps[0])) for o in outs])
    hidden = np.stack([pad(np.asarray(o.hidden[0])) for o in outs])
    # packed: both sequences in one row, positions restarting, segments 1 and 2
    cat = lambda xs: pad(np.concatenate(xs))[None]
    packed = dict(input_ids=cat(ids), loss_mask=cat(lms),
                  positions=cat([np.arange(n1, dtype=np.int32), np.arange(n2, dtype=np.int32)]),
                  segment_ids=cat([np.full(n1, 1, np.int32), np.full(n2, 2, np.int32)]))
    p_feats = cat([np.asarray(o.taps[0]) for o in outs])
    p_hidden = cat([np.asarray(o.hidden[0]) for o in outs])

    def sums(b, f, h, max_segments):
        out = dspark_loss_sums(draft.model, jnp.asarray(f), jnp.asarray(h),
                               jnp.asarray(b["input_ids"]), jnp.asarray(b["loss_mask"]),
                               jax.random.key(1), positions=jnp.asarray(b["positions"]),
                               segment_ids=jnp.asarray(b["segment_ids"]),
                               max_segments=max_segments)
        return {k: np.asarray(v) for k, v in out.items()}

    ref = sums(rows, feats, hidden, 1)
    got = sums(packed, p_feats, p_hidden, 2)
    assert ref["sampled_anchors"] == 6 + 5 and ref["samples"] == 2     # every candidate
    for k in ("ce", "l1", "conf", "weight", "mask", "accept", "tau_sum", "samples",
              "valid_anchors", "sampled_anchors", "block_supervised_tokens"):
        np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=1e-6, err_msg=k)
    m_ref, m_got = (metrics_from_sums(x, draft.config) for x in (ref, got))
    for k in ("valid_anchors_ratio", "sampled_anchors_ratio", "block_supervised_tokens_ratio",
              "ce_loss", "l1_loss", "confidence_loss", "tau_probabilistic"):
        np.testing.assert_allclose(float(m_got[k]), float(m_ref[k]), rtol=2e-5, err_msg=k)
    # a per-row budget (max_segments=1): 6 anchors for the whole packed row
    few = sums(packed, p_feats, p_hidden, 1)
    assert few["sampled_anchors"] == 6 and few["weight"] < ref["weight"]
