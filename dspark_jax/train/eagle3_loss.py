"""Eagle3 training-time-test loss and metrics (SPEC §5; DeepSpec `compute_eagle3_loss`).

For TTT step s and position t the drafter predicts x_{t+2+s}; its target is the target model's
own distribution there, softmax(lm_head(target_hidden[t+1+s])) at T = 1 (soft cross-entropy,
no draft-vocabulary pruning). The term is masked by loss_mask[t+s] (DeepSpec shifts the loss
mask left by one per step), by t+1+s < S and, for packed rows, by t and t+1+s sharing a
segment (which also drops each sequence's last token, whose next position is padding).

Normalisation, `DraftConfig.eagle3_loss_normalization`:
  "local_mean" (default, DeepSpec's only mode)  step s's loss is each sequence's masked sum
      divided by the sequence's length T (DeepSpec: masked sum / (B·T) with one sequence per
      device), averaged over the sequences; the loss is Σ_s 0.8^s · step loss. Every sequence
      weighs the same — DeepSpec disables a valid-token mean because long sequences then
      dominate and accepted length drops. A sequence is a packed segment (segment id > 0), or
      the whole row of length S when no segment ids are given.
  "pooled"  one valid-token mean Σ_s 0.8^s Σ_t m·CE / Σ_s 0.8^s Σ_t m.
Either way the step accumulates additive sums (`objective`, `weight`); loss = objective / weight.

Metrics (DeepSpec's names): per step `ploss_{s}`, `accuracy@{s}` (draft argmax == target
argmax), `accept_rate@{s}` (1 − ½‖p_d − p_t‖₁, clamped), `valid_tokens@{s}`; over the TTT chain
started at every valid position, `tau_greedy` = 1 + Σ_s Π_{j≤s} correct_j and
`tau_probabilistic` = 1 + Σ_s Π_{j≤s} accept_j.

Memory and compute: the [B, S, V] logits are never materialised for all steps at once. The
draft hidden of step s at t is aligned with the target index j = t+1+s; each row's positions
that some step supervises are gathered to the row's front, and a checkpointed scan over chunks
of j computes the target softmax once per chunk and the T draft logits against it, keeping only
[T, B, C, V] live (recomputed in the backward pass) and skipping the chunks past the longest
row's supervised count — most prompt and padding positions cost no LM-head matmul. With a pruned
draft vocabulary (`DraftConfig.draft_vocab`) V is its K ids: both distributions are over those
rows of the frozen LM head (the target's renormalised there), and `correct` compares argmaxes
within them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.models import layers as L
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.train.drafter_loss import DrafterLoss, LossOptions


def _aligned_steps(hs_tbsd: jax.Array, loss_mask_bs: jax.Array,
                   segment_ids_bs: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Shifts step s right by 1+s so index j holds (s, t = j−1−s).
    → hidden [T, B, S, D] and loss weight [T, B, S] (f32)."""
    T, B, S, D = hs_tbsd.shape
    lm = loss_mask_bs.astype(jnp.float32)
    lm_prev = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), lm[:, :-1]], axis=1)  # lm[j−1]
    hs, ms = [], []
    for s in range(T):
        sh = 1 + s
        if sh >= S:
            hs.append(jnp.zeros((B, S, D), hs_tbsd.dtype))
            ms.append(jnp.zeros((B, S), jnp.float32))
            continue
        hs.append(jnp.concatenate([jnp.zeros((B, sh, D), hs_tbsd.dtype), hs_tbsd[s, :, :S - sh]],
                                  axis=1))
        m = lm_prev * (jnp.arange(S) >= sh)[None]
        if segment_ids_bs is not None:
            seg = segment_ids_bs
            seg_t = jnp.concatenate([jnp.full((B, sh), -1, seg.dtype), seg[:, :S - sh]], axis=1)
            m = m * (seg_t == seg)
        ms.append(m)
    return jnp.stack(hs), jnp.stack(ms)


def inverse_sequence_lengths(batch: int, seq: int, segment_ids_bs: jax.Array | None
                             ) -> jax.Array:
    """[B, S] f32: 1 / (length of the sequence position t belongs to); 0 on padding (segment 0).
    Without segment ids every row is one sequence of length S. Summed over positions it counts
    the sequences."""
    if segment_ids_bs is None:
        return jnp.full((batch, seq), 1.0 / seq, jnp.float32)
    seg = segment_ids_bs.astype(jnp.int32)
    flat = (jnp.arange(batch, dtype=jnp.int32)[:, None] * (seq + 1) + seg).reshape(-1)
    counts = jax.ops.segment_sum(jnp.ones_like(flat, jnp.float32), flat,
                                 num_segments=batch * (seq + 1))
    inv = 1.0 / jnp.maximum(counts[flat].reshape(batch, seq), 1.0)
    return jnp.where(seg > 0, inv, 0.0)


def _unshift(x_tbs: jax.Array) -> jax.Array:
    """Aligned index j = t+1+s back to the chain start t: out[s, :, t] = x[s, :, t+1+s]."""
    T, B, S = x_tbs.shape
    rows = []
    for s in range(T):
        sh = min(1 + s, S)
        rows.append(jnp.concatenate([x_tbs[s, :, sh:], jnp.zeros((B, sh), x_tbs.dtype)], axis=1))
    return jnp.stack(rows)


def eagle3_loss_sums(model: Any, feats_bsf: jax.Array, input_ids_bs: jax.Array,
                     loss_mask_bs: jax.Array, target_hidden_bsd: jax.Array, *,
                     segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                     chunk_size: int = 64, remat: bool = False,
                     query_chunk: int | None = None) -> dict[str, jax.Array]:
    """Additive sums of the TTT loss over a (micro-)batch (what the train step accumulates).

    feats [B, S, n·d] target taps; input_ids [B, S]; loss_mask [B, S]; target_hidden [B, S, d]
    the target's final-normed hidden; segment_ids [B, S] for packed rows and positions [B, S]
    (restarting per segment; derived from segment_ids when omitted) are optional.
    → `objective` = Σ_s decay^s · step_num[s] and `weight` (loss = objective / weight over the
    global batch; see the module docstring for both normalisations), and per step [T]
    `step_num` (normalised masked CE sums), `step_den` (their divisors), `step_tokens`,
    `step_correct`, `step_accept`; `tau_greedy_sum`, `tau_prob_sum`, `tau_count`.
    """
    cfg = model.cfg
    T = cfg.ttt_length
    B, S = input_ids_bs.shape
    hs = model.ttt_hidden(feats_bsf, input_ids_bs, segment_ids, T, remat=remat,
                          positions_bs=positions, query_chunk=query_chunk)                         # [T,B,S,D]
    h_al, m_al = _aligned_steps(hs, loss_mask_bs, segment_ids)
    D = hs.shape[-1]
    local_mean = cfg.eagle3_loss_normalization == "local_mean"
    inv_len = inverse_sequence_lengths(B, S, segment_ids)               # [B,S]
    # j and its chain start t share a sequence wherever m_al > 0, so j's length is t's
    w_pos = inv_len if local_mean else jnp.ones((B, S), jnp.float32)

    # Only positions some step supervises need logits (on a padded row of prompt + reply that
    # is about a third). Each row's supervised positions are moved to its front (a stable
    # per-row sort: the batch axis stays sharded as it is), the chunks past the longest row's
    # count are skipped (`lax.cond`), and per-position results are scattered back; the sums are
    # those of the dense loop up to summation order.
    C = max(1, min(chunk_size, S))
    n_chunks = -(-S // C)
    pad = n_chunks * C - S
    used = jnp.max(m_al, axis=0) > 0                                   # [B,S] any step's weight
    order = jnp.argsort(~used, axis=1, stable=True)                    # used first, per row
    n_used = jnp.max(jnp.sum(used.astype(jnp.int32), axis=1))
    h_p = jnp.take_along_axis(h_al, order[None, :, :, None], axis=2)    # [T,B,S,D] sorted
    m_p = jnp.take_along_axis(m_al, order[None], axis=2)                # [T,B,S]
    w_p = jnp.take_along_axis(w_pos, order, axis=1)                     # [B,S]
    tgt = jnp.take_along_axis(target_hidden_bsd.astype(model.dtype), order[..., None], axis=1)
    if pad:
        h_p = jnp.pad(h_p, ((0, 0), (0, 0), (0, pad), (0, 0)))
        m_p = jnp.pad(m_p, ((0, 0), (0, 0), (0, pad)))
        w_p = jnp.pad(w_p, ((0, 0), (0, pad)))
        tgt = jnp.pad(tgt, ((0, 0), (0, pad), (0, 0)))
    h_c = jnp.moveaxis(h_p.reshape(T, B, n_chunks, C, D), 2, 0)       # [nC,T,B,C,D]
    m_c = jnp.moveaxis(m_p.reshape(T, B, n_chunks, C), 2, 0)          # [nC,T,B,C]
    w_c = jnp.moveaxis(w_p.reshape(B, n_chunks, C), 1, 0)             # [nC,B,C]
    t_c = jnp.moveaxis(tgt.reshape(B, n_chunks, C, D), 1, 0)          # [nC,B,C,D]
    starts = jnp.arange(n_chunks, dtype=jnp.int32) * C

    eps = cfg.target.rms_norm_eps
    norm_w = model.norm.get_value()
    lm_w = jax.lax.stop_gradient(model.lm_head.get_value()).astype(model.dtype)  # [V,D]
    vocab_ids = model.vocab_ids()
    if vocab_ids is not None:   # pruned draft vocabulary: both distributions over its K ids
        lm_w = jnp.take(lm_w, vocab_ids, axis=0)                                  # [K,D]
    cap = cfg.target.final_logit_softcapping  # Gemma4: target and draft logits are softcapped
    capped = (lambda z: z) if cap is None else (lambda z: jnp.tanh(z / cap) * cap)

    def chunk_terms(h_tbcd, tgt_bcd, m_tbc, w_bc):
        t_logits = capped(jnp.einsum("BCD,VD->BCV", tgt_bcd, lm_w,
                                     preferred_element_type=jnp.float32))
        t_logits = jax.lax.stop_gradient(t_logits)
        t_p = jax.nn.softmax(t_logits, axis=-1)                        # [B,C,V]
        x = L.rms_norm(h_tbcd, norm_w, eps)
        d_logits = capped(jnp.einsum("TBCD,VD->TBCV", x, lm_w,
                                     preferred_element_type=jnp.float32))
        d_logp = jax.nn.log_softmax(d_logits, axis=-1)
        ce = -jnp.sum(t_p[None] * d_logp, axis=-1)                     # [T,B,C]
        correct = (jnp.argmax(d_logits, -1) == jnp.argmax(t_logits, -1)[None])
        l1 = jnp.sum(jnp.abs(jnp.exp(d_logp) - t_p[None]), axis=-1)
        accept = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
        return (jnp.sum(ce * m_tbc * w_bc[None], axis=(1, 2)),
                (correct * m_tbc).astype(jnp.float32), accept * m_tbc)

    def chunk(num, xs):
        start, h_tbcd, tgt_bcd, m_tbc, w_bc = xs
        skip = lambda *_: (jnp.zeros((T,), jnp.float32), jnp.zeros((T, B, C), jnp.float32),
                           jnp.zeros((T, B, C), jnp.float32))
        add, corr, acc = jax.lax.cond(start < n_used, chunk_terms, skip,
                                      h_tbcd, tgt_bcd, m_tbc, w_bc)
        return num + add, (corr, acc)

    step_num, (corr_c, acc_c) = jax.lax.scan(jax.checkpoint(chunk), jnp.zeros((T,), jnp.float32),
                                             (starts, h_c, t_c, m_c, w_c))
    b_idx = jnp.arange(B)[:, None]

    def back(y: jax.Array) -> jax.Array:   # [nC,T,B,C] in sorted order → [T,B,S] in place
        y = jnp.moveaxis(y, 0, 2).reshape(T, B, n_chunks * C)[..., :S]
        return jnp.zeros((T, B, S), y.dtype).at[:, b_idx, order].set(y)

    corr_al, acc_al = back(corr_c), back(acc_c)
    tokens = jnp.sum(m_al, axis=(1, 2))
    decay = step_weights(cfg.step_loss_decay, T)
    n_seq = jnp.sum(inv_len)
    step_den = jnp.full((T,), n_seq) if local_mean else tokens
    weight = n_seq if local_mean else jnp.sum(decay * tokens)
    # TTT chains started at every valid position t: Π over steps of correct / accept at t
    start = _unshift(m_al)[0]                                           # [B,S]
    chain_g = jnp.cumprod(_unshift(corr_al), axis=0)
    chain_p = jnp.cumprod(_unshift(acc_al), axis=0)
    count = jnp.sum(start)
    return {"objective": jnp.sum(decay * step_num), "weight": weight,
            "step_num": step_num, "step_den": step_den, "step_tokens": tokens,
            "step_correct": jnp.sum(corr_al, axis=(1, 2)), "step_accept": jnp.sum(acc_al, axis=(1, 2)),
            "tau_greedy_sum": count + jnp.sum(chain_g * start[None]),
            "tau_prob_sum": count + jnp.sum(chain_p * start[None]), "tau_count": count}


def step_weights(decay: float, ttt_length: int) -> jax.Array:
    """[T] per-step loss weights decay^s (0.8^s)."""
    return jnp.asarray([decay ** s for s in range(ttt_length)], jnp.float32)


def eagle3_metrics_from_sums(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Scalars for logging with DeepSpec's names: `loss`, `loss_tokens`, per step s
    `ploss_{s}`, `accuracy@{s}`, `accept_rate@{s}`, `valid_tokens@{s}`, and `tau_greedy`,
    `tau_probabilistic`."""
    tokens = jnp.maximum(sums["step_tokens"], 1.0)
    den = jnp.maximum(sums["step_den"], 1e-6)
    count = jnp.maximum(sums["tau_count"], 1.0)
    out = {"loss": sums["objective"] / jnp.maximum(sums["weight"], 1e-6),
           "loss_tokens": sums["step_tokens"][0],
           "tau_greedy": sums["tau_greedy_sum"] / count,
           "tau_probabilistic": sums["tau_prob_sum"] / count}
    for s in range(sums["step_tokens"].shape[0]):
        out[f"ploss_{s}"] = sums["step_num"][s] / den[s]
        out[f"accuracy@{s}"] = sums["step_correct"][s] / tokens[s]
        out[f"accept_rate@{s}"] = sums["step_accept"][s] / tokens[s]
        out[f"valid_tokens@{s}"] = sums["step_tokens"][s]
    return out


def eagle3_loss(model: Any, feats_bsf: jax.Array, input_ids_bs: jax.Array,
                loss_mask_bs: jax.Array, target_hidden_bsd: jax.Array, *,
                segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                chunk_size: int = 64, remat: bool = False, query_chunk: int | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TTT loss of an `Eagle3Draft` on one batch → (loss, metrics).

    loss = objective / weight (see `eagle3_loss_sums`); metrics hold `eagle3_metrics_from_sums`
    plus the arrays `step_loss` (= ploss_s), `step_acc`, `step_tokens` [T]. jit-able and
    differentiable w.r.t. the drafter's nnx.Param leaves.
    """
    sums = eagle3_loss_sums(model, feats_bsf, input_ids_bs, loss_mask_bs, target_hidden_bsd,
                            segment_ids=segment_ids, positions=positions,
                            chunk_size=chunk_size, remat=remat, query_chunk=query_chunk)
    metrics = eagle3_metrics_from_sums(sums)
    tokens = jnp.maximum(sums["step_tokens"], 1.0)
    metrics.update(step_loss=sums["step_num"] / jnp.maximum(sums["step_den"], 1e-6),
                   step_acc=sums["step_correct"] / tokens, step_tokens=sums["step_tokens"])
    return metrics["loss"], metrics


def eagle3_batch_sums(draft: Any, feats: jax.Array, hidden: jax.Array,
                      mb: dict[str, jax.Array], key: jax.Array, opts: LossOptions
                      ) -> dict[str, jax.Array]:
    """`eagle3_loss_sums` over one micro-batch of the train step (its objective included)."""
    del key
    return eagle3_loss_sums(draft, feats, mb["input_ids"], mb["loss_mask"], hidden,
                            segment_ids=mb["segment_ids"], remat=opts.remat,
                            query_chunk=opts.attn_key_chunk)


def _eagle3_terms(cfg: DraftConfig) -> tuple[tuple[float, str], ...]:
    del cfg
    return ((1.0, "objective"),)          # eagle3_loss_sums weighs its steps itself


EAGLE3_LOSS = DrafterLoss(sums=eagle3_batch_sums, terms=_eagle3_terms,
                          metrics=lambda sums, cfg: eagle3_metrics_from_sums(sums))

__all__ = ["EAGLE3_LOSS", "eagle3_loss", "eagle3_loss_sums", "eagle3_metrics_from_sums",
           "step_weights", "inverse_sequence_lengths"]
