"""Anchor blocks for DSpark/DFlash training (SPEC §4: anchors, labels, masks, teacher forcing).

From one packed/padded row we draw up to `num_anchors` anchor positions a (uniformly without
replacement among positions i ≤ S−2 with loss_mask[i] = loss_mask[i+1] = 1), and for each block
slot k build the label x[a+k+1], the teacher-forced previous token x[a+k] and the evaluation mask
(a contiguous prefix: cumulative product over k).
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


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int,
                   segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """min(num_anchors, #candidates) anchors per row, uniformly without replacement, sorted."""
    cand = anchor_candidates(loss_mask, segment_ids)
    B, S = cand.shape
    A = min(num_anchors, S)
    scores = jnp.where(cand, jax.random.uniform(key, (B, S)), -1.0)
    top_scores, idx = jax.lax.top_k(scores, A)
    valid = top_scores >= 0
    # sort kept anchors ascending; pads go last
    order_key = jnp.where(valid, idx, S + jnp.arange(A))
    perm = jnp.argsort(order_key, axis=-1)
    idx = jnp.take_along_axis(idx, perm, axis=-1)
    valid = jnp.take_along_axis(valid, perm, axis=-1)
    return jnp.where(valid, idx, 0).astype(jnp.int32), valid


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
