"""DSpark / DFlash training losses and metrics (SPEC §4, paper §3.4).

Per block slot k with weight w_k = eval_mask_k · decay_k:
  CE   −log p_d,k(x*_k)
  L1   ‖p_d,k − p_t,k‖₁            (DeepSpec's full L1, no ½; the paper's total variation ×2)
  Conf BCE-with-logits(c_k, c*_k),  c*_k = clamp(1 − ½‖p_d,k − p_t,k‖₁, 0, 1) detached
Each is a token-weighted mean Σ w·term / Σ w. We return the sums and let the step divide by the
denominators (per micro-step or global: `DraftConfig.loss_normalization`, see train/step.py).
Metrics carry DeepSpec's names (`ce_loss`, `l1_loss`, `confidence_loss`, `accept_rate@k`,
`tau_probabilistic`, `confidence_abs_error` / `confidence_bias` / `confidence_cumprod_bias`
weighted with the decayed loss weights, and the anchor-sampler statistics of anchors.py).
Logits are [B, A, γ, V]: we compute them (draft and target) one chunk of anchors at a time and
rematerialise in the backward pass, so the full tensor never exists for V ≈ 152k.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.models.drafters.block_attention import ContextMask
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.train.anchors import (AnchorBlocks, build_blocks, position_weights, sample_anchors,
                                     sampler_stats)
from dspark_jax.train.drafter_loss import DrafterLoss, LossOptions, loss_for

SAMPLER_KEYS = ("valid_anchors", "valid_anchors_ratio", "sampled_anchors",
                "sampled_anchors_ratio", "block_supervised_tokens", "block_supervised_tokens_ratio")


def _gather_bs(x_bsd: jax.Array, idx_bn: jax.Array) -> jax.Array:
    """x [B, S, ...] gathered at idx [B, ...] along S."""
    B = x_bsd.shape[0]
    flat = idx_bn.reshape(B, -1)
    out = jnp.take_along_axis(x_bsd, flat.reshape(flat.shape + (1,) * (x_bsd.ndim - 2)), axis=1)
    return out.reshape(idx_bn.shape + x_bsd.shape[2:])


def _ce_l1_forward(d_logits: jax.Array, t_probs: jax.Array, labels: jax.Array
                   ) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """CE −log q(y) and L1 ‖q − p‖₁ with q = softmax(d_logits) over the last axis."""
    d_logp = jax.nn.log_softmax(d_logits, axis=-1)
    q = jnp.exp(d_logp)
    ce = -jnp.take_along_axis(d_logp, labels[..., None], axis=-1)[..., 0]
    diff = q - t_probs
    l1 = jnp.sum(jnp.abs(diff), axis=-1)
    return (ce, l1), (q, jnp.sign(diff))


@jax.custom_vjp
def ce_l1_terms(d_logits: jax.Array, t_probs: jax.Array, labels: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """Per-token CE and L1 of the draft distribution q = softmax(d_logits) against the label and
    the (detached) target distribution p: ([...], [...]) for d_logits/t_probs [..., V].

    The gradient is written in closed form — ∂CE/∂z = q − e_y and ∂L1/∂z = q ⊙ (s − ⟨q, s⟩) with
    s = sign(q − p) — from q and s kept by the forward pass, instead of differentiating
    log_softmax → exp → abs over [..., V] (several more full-vocabulary passes on CPU). The
    target side gets no gradient (it is stop-gradient in the losses anyway)."""
    return _ce_l1_forward(d_logits, t_probs, labels)[0]


def _ce_l1_fwd(d_logits, t_probs, labels):
    out, (q, sgn) = _ce_l1_forward(d_logits, t_probs, labels)
    return out, (q, sgn, labels)


def _ce_l1_bwd(res, cts):
    q, sgn, labels = res
    ce_bar, l1_bar = cts
    onehot = jax.nn.one_hot(labels, q.shape[-1], dtype=q.dtype)
    qs = jnp.sum(q * sgn, axis=-1, keepdims=True)
    g = ce_bar[..., None] * (q - onehot) + l1_bar[..., None] * q * (sgn - qs)
    return g.astype(q.dtype), None, None


ce_l1_terms.defvjp(_ce_l1_fwd, _ce_l1_bwd)


def draft_vocab_label_map(cfg: DraftConfig, vocab_ids: jax.Array) -> jax.Array:
    """[V] int32: a target id's column in the draft vocabulary, −1 where it is not in it."""
    K = vocab_ids.shape[0]
    return jnp.full((cfg.target.vocab_size,), -1, jnp.int32).at[vocab_ids].set(
        jnp.arange(K, dtype=jnp.int32))


def chunk_terms(draft: Any, h: jax.Array, target_hidden: jax.Array, blocks: AnchorBlocks,
                lm_head: jax.Array, weights: jax.Array, cfg: DraftConfig,
                label_map: jax.Array | None = None) -> dict[str, jax.Array]:
    """Loss sums for one chunk of anchors: h [B, Ac, γ, D]; blocks sliced to the chunk.

    With a pruned draft vocabulary, `lm_head` holds its K rows and `label_map` maps target ids to
    columns (draft_vocab_label_map): the draft distribution is over those K tokens (the ones it
    can propose) and the target's is renormalised over them, so logits cost K columns instead of
    V; a label outside the draft vocabulary (which the drafter can never propose) adds no CE."""
    pruned = label_map is not None
    d_logits, conf_logits = draft.heads_teacher_forced(
        h, blocks.prev_tokens, lm_head_rows=lm_head if pruned else None)      # [B,Ac,γ,V|K]
    t_hidden = _gather_bs(target_hidden, blocks.target_pos)                      # [B,Ac,γ,D]
    t_logits = jnp.einsum("...D,VD->...V", t_hidden.astype(h.dtype), lm_head.astype(h.dtype),
                          preferred_element_type=jnp.float32)
    cap = cfg.target.final_logit_softcapping  # Gemma4: the target's logits are softcapped
    if cap is not None:
        t_logits = jnp.tanh(t_logits / cap) * cap
    t_probs = jax.lax.stop_gradient(jax.nn.softmax(t_logits, axis=-1))
    labels = blocks.labels
    if pruned:
        col = jnp.take(label_map, labels)
        ce, l1 = ce_l1_terms(d_logits, t_probs, jnp.maximum(col, 0))             # [B,Ac,γ]
        ce = jnp.where(col >= 0, ce, 0.0)
    else:
        ce, l1 = ce_l1_terms(d_logits, t_probs, labels)                          # [B,Ac,γ]
    accept = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    m = blocks.eval_mask
    w = m * weights
    out = {"ce": jnp.sum(w * ce), "l1": jnp.sum(w * l1), "weight": jnp.sum(w),
           "mask": jnp.sum(m, axis=(0, 1)), "accept": jnp.sum(accept * m, axis=(0, 1))}
    surv = jnp.cumprod(accept * m, axis=-1)
    out["tau_sum"], out["tau_blocks"] = tau_sums(accept, m, blocks.valid)
    if conf_logits is not None:
        bce = (jnp.maximum(conf_logits, 0) - conf_logits * accept
               + jnp.log1p(jnp.exp(-jnp.abs(conf_logits))))
        sig = jax.lax.stop_gradient(jax.nn.sigmoid(conf_logits))
        out["conf"] = jnp.sum(w * bce)
        out["conf_abs_err"] = jnp.sum(jnp.abs(sig - accept) * w)
        out["conf_bias"] = jnp.sum((sig - accept) * w)
        out["conf_cumprod_bias"] = jnp.sum((jnp.cumprod(sig * m, axis=-1) - surv) * w)
    else:
        zero = jnp.zeros((), jnp.float32)
        out.update(conf=zero, conf_abs_err=zero, conf_bias=zero, conf_cumprod_bias=zero)
    return out


def dspark_loss_sums(draft: Any, feats: jax.Array, target_hidden: jax.Array,
                     input_ids: jax.Array, loss_mask: jax.Array, key: jax.Array, *,
                     positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                     anchor_chunk: int = 64, remat: bool = True, max_segments: int = 1,
                     key_chunk: int | None = 512, attn_kernel: bool = True
                     ) -> dict[str, jax.Array]:
    """Sums of loss terms and metric numerators for one (micro-)batch. `key_chunk`: context
    keys per online-softmax chunk of the block attention (None: the dense oracle);
    `attn_kernel`: compiled for a GPU, the block attention's fused Triton kernel instead of the
    chunks (block_attention.py).

    feats [B, S, n·d] target taps; target_hidden [B, S, d] final-normed target hidden;
    `max_segments` (static) bounds the packed sequences per row: each gets up to num_anchors.
    """
    cfg: DraftConfig = draft.cfg
    B, S = input_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    anchors, valid = sample_anchors(key, loss_mask, cfg.num_anchors, segment_ids, max_segments)
    A = anchors.shape[1]
    g = cfg.num_drafts
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, g, segment_ids)

    ctx_k, ctx_v = draft.context_kv(feats, positions)
    # context strictly before each anchor, in its own packed sequence (none for a pad anchor)
    visible = ContextMask(jnp.where(valid, anchors, 0),
                          None if segment_ids is None
                          else jnp.take_along_axis(segment_ids, anchors, axis=1), segment_ids)
    if not attn_kernel:             # a dense mask takes the chunked path on every platform
        visible = visible.dense(S)
    anchor_tok = jnp.take_along_axis(input_ids, anchors, axis=1)
    anchor_pos = jnp.take_along_axis(positions, anchors, axis=1)
    h = draft.draft_slots(draft.backbone(anchor_tok, anchor_pos, ctx_k, ctx_v, visible, valid,
                                         remat=remat, key_chunk=key_chunk))                       # [B,A,γ,D]

    weights = position_weights(g, cfg.loss_decay_gamma, cfg.decay_convention, cfg.block_size)
    lm_head = draft.lm_head.get_value()
    vocab_ids = draft.vocab_ids()
    label_map = None
    if vocab_ids is not None:                     # pruned draft vocabulary: its K rows only
        lm_head = jnp.take(lm_head, vocab_ids, axis=0)
        label_map = draft_vocab_label_map(cfg, vocab_ids)
    c = max(1, min(anchor_chunk, A))
    n_chunks = -(-A // c)
    pad = n_chunks * c - A

    def split(x: jax.Array) -> jax.Array:        # [B, A, ...] → [n, B, c, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((B, n_chunks, c) + x.shape[2:]), 1, 0)

    xs = (split(h), jax.tree.map(split, blocks))

    def body(acc, x):
        hc, bc = x
        terms = chunk_terms(draft, hc, target_hidden, bc, lm_head, weights, cfg, label_map)
        return jax.tree.map(jnp.add, acc, terms), None

    if remat:
        body = jax.checkpoint(body)
    zeros = {k: jnp.zeros((), jnp.float32) for k in ("ce", "l1", "weight", "conf", "conf_abs_err",
                                                      "conf_bias", "conf_cumprod_bias", "tau_sum",
                                                      "tau_blocks")}
    zeros["mask"] = jnp.zeros((g,), jnp.float32)
    zeros["accept"] = jnp.zeros((g,), jnp.float32)
    sums, _ = jax.lax.scan(body, zeros, xs)
    sums.update(sampler_stats(loss_mask, segment_ids, blocks, cfg.num_anchors, g))
    return sums


def total_loss(sums: dict[str, jax.Array], cfg: DraftConfig) -> jax.Array:
    """Combines sums into the scalar objective (global token-weighted means of the kind's
    terms, `DrafterLoss.terms`)."""
    w = jnp.maximum(sums["weight"], 1e-6)
    (c0, k0), *rest = loss_for(cfg).terms(cfg)
    loss = c0 * sums[k0] / w
    for c, k in rest:
        loss = loss + c * sums[k] / w
    return loss


def tau_sums(accept_bag: jax.Array, eval_mask_bag: jax.Array, keep_ba: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """`tau_probabilistic`'s numerator and block count, as DeepSpec counts them
    (`deepspec/modeling/dspark/loss.py`): a block's expected τ is 1 + Σ_k Π_{j≤k} accept_j over
    its supervised prefix, and the blocks counted are the kept ones with at least one
    supervised slot (a kept block whose slots all fall past the reply counts for nothing).
    accept / eval_mask [B, A, γ], keep [B, A]."""
    counted = (keep_ba & jnp.any(eval_mask_bag > 0, axis=-1)).astype(jnp.float32)
    surv = jnp.cumprod(accept_bag * eval_mask_bag, axis=-1)
    return jnp.sum((1.0 + jnp.sum(surv, axis=-1)) * counted), jnp.sum(counted)


def metrics_from_sums(sums: dict[str, jax.Array], cfg: DraftConfig) -> dict[str, jax.Array]:
    """The logged scalars, with DeepSpec's names (`loss` is the pooled objective; the train step
    replaces it with the one it optimised)."""
    w = jnp.maximum(sums["weight"], 1e-6)
    out = {"loss": total_loss(sums, cfg), "ce_loss": sums["ce"] / w,
           "tau_probabilistic": sums["tau_sum"] / jnp.maximum(sums["tau_blocks"], 1e-6),
           "loss_tokens": sums["weight"]}
    if any(k == "l1" for _, k in loss_for(cfg).terms(cfg)) and cfg.l1_loss_alpha > 0:
        out["l1_loss"] = sums["l1"] / w
    acc = sums["accept"] / jnp.maximum(sums["mask"], 1e-6)
    for k in range(cfg.num_drafts):
        out[f"accept_rate@{k}"] = acc[k]
    if cfg.has_confidence:
        out["confidence_loss"] = sums["conf"] / w
        out["confidence_abs_error"] = sums["conf_abs_err"] / w
        out["confidence_bias"] = sums["conf_bias"] / w
        out["confidence_cumprod_bias"] = sums["conf_cumprod_bias"] / w
    n = jnp.maximum(sums["samples"], 1.0)
    for k in SAMPLER_KEYS:
        name = k if k.endswith("_ratio") else k + "_abs"
        out[name] = sums[k] / n
    return out


def dspark_terms(cfg: DraftConfig) -> tuple[tuple[float, str], ...]:
    """CE·α_ce + L1·α_l1, plus the confidence BCE·α_conf with a confidence head."""
    terms = ((cfg.ce_loss_alpha, "ce"), (cfg.l1_loss_alpha, "l1"))
    if cfg.has_confidence:
        terms += ((cfg.confidence_head_alpha, "conf"),)
    return terms


def dflash_terms(cfg: DraftConfig) -> tuple[tuple[float, str], ...]:
    """CE only (DeepSpec's DFlash)."""
    del cfg
    return ((1.0, "ce"),)


def block_batch_sums(draft: Any, feats: jax.Array, hidden: jax.Array,
                     mb: dict[str, jax.Array], key: jax.Array, opts: LossOptions
                     ) -> dict[str, jax.Array]:
    """`dspark_loss_sums` over one micro-batch of the train step."""
    return dspark_loss_sums(draft, feats, hidden, mb["input_ids"], mb["loss_mask"], key,
                            positions=mb["positions"], segment_ids=mb["segment_ids"],
                            anchor_chunk=opts.anchor_chunk, max_segments=opts.max_segments,
                            key_chunk=opts.attn_key_chunk, remat=opts.remat,
                            attn_kernel=opts.attn_kernel)


DSPARK_LOSS = DrafterLoss(sums=block_batch_sums, terms=dspark_terms, metrics=metrics_from_sums)
DFLASH_LOSS = DrafterLoss(sums=block_batch_sums, terms=dflash_terms, metrics=metrics_from_sums)
