"""Anchor blocks for DSpark/DFlash training (SPEC §4: anchors, labels, masks, teacher forcing).

From every sequence we draw up to `num_anchors` anchor positions a (uniformly without
replacement among positions i ≤ S−2 with loss_mask[i] = loss_mask[i+1] = 1), and for each block
slot k build the label x[a+k+1], the teacher-forced previous token x[a+k] and the evaluation mask
(a contiguous prefix: cumulative product over k). A sequence is a packed segment (segment id > 0)
— DeepSpec's sampler works per sample, so a packed row of n sequences gets up to n·num_anchors
anchors in `anchor_slots(num_anchors, S, n)` static slots — or the whole row without segment ids.
`sampler_stats` gives DeepSpec's per-sample anchor-sampler statistics as additive sums.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class AnchorBlocks:
    anchors: jax.Array       # [B, A] positions (sorted; pads point at 0)
    valid: jax.Array         # [B, A] bool — block kept
    labels: jax.Array        # [B, A, γ] x[a+k+1]
    prev_tokens: jax.Array   # [B, A, γ] x[a+k] (slot 0: the anchor itself)
    eval_mask: jax.Array     # [B, A, γ] f32 contiguous prefix mask
    target_pos: jax.Array    # [B, A, γ] a+k: where the target distribution for slot k is read


def anchor_candidates(loss_mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """[B, S] bool: i ≤ S−2 with loss_mask[i] = loss_mask[i+1] = 1 (same packed segment)."""
    lm = loss_mask.astype(bool)
    nxt = jnp.pad(lm[:, 1:], ((0, 0), (0, 1)))
    cand = lm & nxt
    if segment_ids is not None:
        same = jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (0, 1)))
        cand = cand & same
    return cand


def anchor_slots(num_anchors: int, seq_len: int, max_segments: int = 1) -> int:
    """Static anchor slots per row: num_anchors per sequence for up to `max_segments` packed
    sequences, never more than the row has positions."""
    return max(1, min(seq_len, num_anchors * max(1, max_segments)))


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int,
                   segment_ids: jax.Array | None = None, max_segments: int = 1
                   ) -> tuple[jax.Array, jax.Array]:
    """min(num_anchors, #candidates) anchors per sequence, uniformly without replacement, sorted
    by position, in `anchor_slots(num_anchors, S, max_segments)` slots per row (pads last).
    With one sequence per row this is the row-level draw: the num_anchors best random scores."""
    cand = anchor_candidates(loss_mask, segment_ids)
    B, S = cand.shape
    A = anchor_slots(num_anchors, S, max_segments)
    scores = jnp.where(cand, jax.random.uniform(key, (B, S)), -1.0)
    seg = jnp.zeros((B, S), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    # rank of each position's score within its sequence (0 = highest)
    order = jnp.lexsort((-scores, seg), axis=-1)                   # by sequence, then score ↓
    seg_sorted = jnp.take_along_axis(seg, order, axis=-1)
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    is_first = jnp.concatenate([jnp.ones((B, 1), bool),
                                seg_sorted[:, 1:] != seg_sorted[:, :-1]], axis=1)
    rank_sorted = idx - jax.lax.cummax(jnp.where(is_first, idx, 0), axis=1)
    rank = jnp.take_along_axis(rank_sorted, jnp.argsort(order, axis=-1), axis=-1)
    keep = cand & (rank < num_anchors)
    # the kept positions into A slots (a uniform subset if max_segments undercounts: the
    # per-row budget), sorted ascending with pads last
    top_scores, top = jax.lax.top_k(jnp.where(keep, scores, -1.0), A)
    valid = top_scores >= 0
    perm = jnp.argsort(jnp.where(valid, top, S + jnp.arange(A)), axis=-1)
    top = jnp.take_along_axis(top, perm, axis=-1)
    valid = jnp.take_along_axis(valid, perm, axis=-1)
    return jnp.where(valid, top, 0).astype(jnp.int32), valid


def sequence_ids(segment_ids: jax.Array | None, batch: int, seq: int) -> tuple[jax.Array, int]:
    """A flat sequence index [B, S] for `jax.ops.segment_sum` (segment s of row b →
    b·(S+1) + s; 0 = padding when segment ids are given) and the number of indices."""
    seg = (jnp.ones((batch, seq), jnp.int32) if segment_ids is None
           else segment_ids.astype(jnp.int32))
    return jnp.arange(batch, dtype=jnp.int32)[:, None] * (seq + 1) + seg, batch * (seq + 1)


def sampler_stats(loss_mask: jax.Array, segment_ids: jax.Array | None, blocks: "AnchorBlocks",
                  num_anchors: int, block_size: int) -> dict[str, jax.Array]:
    """DeepSpec's `log_sampler_stats` per sample (sequence), as sums over the sequences:
    candidate anchors (and / sequence length), sampled anchors (and / num_anchors), supervised
    tokens per sampled block (and / block size); `samples` counts the sequences."""
    B, S = loss_mask.shape
    sid, n = sequence_ids(segment_ids, B, S)
    per_seq = lambda x, ids: jax.ops.segment_sum(x.reshape(-1), ids.reshape(-1), num_segments=n)
    length = per_seq(jnp.ones((B, S), jnp.float32), sid)
    present = (length > 0) & (jnp.arange(n) % (S + 1) > 0)       # index 0 of a row: padding
    cand = per_seq(anchor_candidates(loss_mask, segment_ids).astype(jnp.float32), sid)
    a_sid = jnp.take_along_axis(sid, blocks.anchors, axis=1)                  # [B,A]
    valid = blocks.valid.astype(jnp.float32)
    sampled = per_seq(valid, a_sid)
    supervised = per_seq(jnp.sum(blocks.eval_mask, axis=-1) * valid, a_sid)
    per_block = supervised / jnp.maximum(sampled, 1.0)
    f = present.astype(jnp.float32)
    return {"samples": jnp.sum(f),
            "valid_anchors": jnp.sum(cand * f),
            "valid_anchors_ratio": jnp.sum(cand / jnp.maximum(length, 1.0) * f),
            "sampled_anchors": jnp.sum(sampled * f),
            "sampled_anchors_ratio": jnp.sum(sampled / max(num_anchors, 1) * f),
            "block_supervised_tokens": jnp.sum(per_block * f),
            "block_supervised_tokens_ratio": jnp.sum(per_block / block_size * f)}


def build_blocks(input_ids: jax.Array, loss_mask: jax.Array, anchors: jax.Array,
                 valid: jax.Array, block_size: int,
                 segment_ids: jax.Array | None = None) -> AnchorBlocks:
    B, S = input_ids.shape
    k = jnp.arange(block_size, dtype=jnp.int32)
    label_pos = anchors[..., None] + k + 1                                 # [B,A,γ]
    in_range = label_pos < S
    lp = jnp.minimum(label_pos, S - 1)
    gather = lambda x, p: jnp.take_along_axis(x, p.reshape(B, -1), axis=1).reshape(p.shape)
    labels = gather(input_ids, lp)
    prev_pos = jnp.minimum(anchors[..., None] + k, S - 1)
    prev = gather(input_ids, prev_pos)
    m = in_range & gather(loss_mask.astype(bool), lp) & valid[..., None]
    if segment_ids is not None:
        seg_a = jnp.take_along_axis(segment_ids, anchors, axis=1)[..., None]
        m = m & (gather(segment_ids, lp) == seg_a)
    eval_mask = jnp.cumprod(m.astype(jnp.float32), axis=-1)
    return AnchorBlocks(anchors=anchors, valid=valid, labels=labels, prev_tokens=prev,
                        eval_mask=eval_mask, target_pos=prev_pos)


def position_weights(num_slots: int, decay_gamma: float, convention: str,
                     block_size: int | None = None) -> jax.Array:
    """w_k before masking for draft slots k = 0..num_slots−1: DeepSpec exp(−k/g)
    (g = loss_decay_gamma) or the paper's exp(−(k₁−1)/γ) with k₁ 1-based (= exp(−k/γ),
    γ = block size)."""
    k = jnp.arange(num_slots, dtype=jnp.float32)
    g = decay_gamma if convention == "deepspec" else float(block_size or num_slots)
    return jnp.exp(-k / g)
