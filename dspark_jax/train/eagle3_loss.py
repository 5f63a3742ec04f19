"""Eagle3 training-time-test loss (SPEC §5; DeepSpec/SpecForge `OnlineEagle3Model.forward`).

For TTT step s and position t the drafter predicts x_{t+2+s}; its target is the target model's
own distribution there, softmax(lm_head(target_hidden[t+1+s])) at T = 1 (soft cross-entropy,
no draft-vocabulary pruning). The term is masked by loss_mask[t+s] (SpecForge shifts the loss
mask left by one per step), by t+1+s < S and, for packed rows, by t and t+1+s sharing a
segment. The loss is ONE global token-weighted mean with weights w_{s,t} = 0.8^s · m_{s,t}
(`step_loss_decay`): Σ w·CE / Σ w — the same form as the DSpark losses (SPEC §4), so that
micro-batch accumulation of the sums is exact. (SpecForge instead sums 0.8^s · mean_s; with
m_{s,·} nearly equal across steps the two differ by about the constant Σ_s 0.8^s.)

Memory: the [B, S, V] logits are never materialised for all steps at once. The draft hidden of
step s at t is aligned with the target index j = t+1+s, and a checkpointed scan over chunks of
j computes the target softmax once per chunk and the T draft logits against it, keeping only
[T, B, C, V] live (and recomputing it in the backward pass).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.models import layers as L


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


def eagle3_loss_sums(model: Any, feats_bsf: jax.Array, input_ids_bs: jax.Array,
                     loss_mask_bs: jax.Array, target_hidden_bsd: jax.Array, *,
                     segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                     chunk_size: int = 64, remat: bool = False) -> dict[str, jax.Array]:
    """Additive sums of the TTT loss over a (micro-)batch (what the train step accumulates).

    feats [B, S, n·d] target taps; input_ids [B, S]; loss_mask [B, S]; target_hidden [B, S, d]
    the target's final-normed hidden; segment_ids [B, S] for packed rows and positions [B, S]
    (restarting per segment; derived from segment_ids when omitted) are optional.
    → `objective` = Σ_s decay^s Σ_t m·CE and `weight` = Σ_s decay^s Σ_t m (loss = objective /
    weight over the global batch), plus per-step `step_loss_sum`, `step_correct` (draft argmax
    == target argmax) and `step_tokens` [T].
    """
    cfg = model.cfg
    T = cfg.ttt_length
    B, S = input_ids_bs.shape
    hs = model.ttt_hidden(feats_bsf, input_ids_bs, segment_ids, T, remat=remat,
                          positions_bs=positions)                         # [T,B,S,D]
    h_al, m_al = _aligned_steps(hs, loss_mask_bs, segment_ids)
    D = hs.shape[-1]

    C = max(1, min(chunk_size, S))
    n_chunks = -(-S // C)
    pad = n_chunks * C - S
    tgt = target_hidden_bsd.astype(model.dtype)
    if pad:
        h_al = jnp.pad(h_al, ((0, 0), (0, 0), (0, pad), (0, 0)))
        m_al = jnp.pad(m_al, ((0, 0), (0, 0), (0, pad)))
        tgt = jnp.pad(tgt, ((0, 0), (0, pad), (0, 0)))
    h_c = jnp.moveaxis(h_al.reshape(T, B, n_chunks, C, D), 2, 0)      # [nC,T,B,C,D]
    m_c = jnp.moveaxis(m_al.reshape(T, B, n_chunks, C), 2, 0)         # [nC,T,B,C]
    t_c = jnp.moveaxis(tgt.reshape(B, n_chunks, C, D), 1, 0)          # [nC,B,C,D]

    eps = cfg.target.rms_norm_eps
    norm_w = model.norm.get_value()
    lm_w = jax.lax.stop_gradient(model.lm_head.get_value()).astype(model.dtype)  # [V,D]
    cap = cfg.target.final_logit_softcapping  # Gemma4: target and draft logits are softcapped
    capped = (lambda z: z) if cap is None else (lambda z: jnp.tanh(z / cap) * cap)

    def chunk(carry, xs):
        h_tbcd, tgt_bcd, m_tbc = xs
        t_logits = capped(jnp.einsum("BCD,VD->BCV", tgt_bcd, lm_w,
                                     preferred_element_type=jnp.float32))
        t_logits = jax.lax.stop_gradient(t_logits)
        t_p = jax.nn.softmax(t_logits, axis=-1)                        # [B,C,V]
        x = L.rms_norm(h_tbcd, norm_w, eps)
        d_logits = capped(jnp.einsum("TBCD,VD->TBCV", x, lm_w,
                                     preferred_element_type=jnp.float32))
        ce = -jnp.sum(t_p[None] * jax.nn.log_softmax(d_logits, axis=-1), axis=-1)  # [T,B,C]
        correct = (jnp.argmax(d_logits, -1) == jnp.argmax(t_logits, -1)[None])
        loss_sum, corr, cnt = carry
        return (loss_sum + jnp.sum(ce * m_tbc, axis=(1, 2)),
                corr + jnp.sum(correct * m_tbc, axis=(1, 2)),
                cnt + jnp.sum(m_tbc, axis=(1, 2))), None

    zeros = jnp.zeros((T,), jnp.float32)
    (loss_sum, correct, tokens), _ = jax.lax.scan(jax.checkpoint(chunk), (zeros, zeros, zeros),
                                                  (h_c, t_c, m_c))
    decay = step_weights(cfg.step_loss_decay, T)
    return {"objective": jnp.sum(decay * loss_sum), "weight": jnp.sum(decay * tokens),
            "step_loss_sum": loss_sum, "step_correct": correct, "step_tokens": tokens}


def step_weights(decay: float, ttt_length: int) -> jax.Array:
    """[T] per-step loss weights decay^s (0.8^s)."""
    return jnp.asarray([decay ** s for s in range(ttt_length)], jnp.float32)


def eagle3_metrics_from_sums(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Scalars for logging: `loss`, `loss_tokens`, and per step s `step_loss@s` (mean soft CE)
    and `step_acc@s` (draft argmax == target argmax)."""
    tokens = jnp.maximum(sums["step_tokens"], 1.0)
    out = {"loss": sums["objective"] / jnp.maximum(sums["weight"], 1e-6),
           "loss_tokens": sums["step_tokens"][0]}
    for s in range(sums["step_tokens"].shape[0]):
        out[f"step_loss@{s}"] = sums["step_loss_sum"][s] / tokens[s]
        out[f"step_acc@{s}"] = sums["step_correct"][s] / tokens[s]
    return out


def eagle3_loss(model: Any, feats_bsf: jax.Array, input_ids_bs: jax.Array,
                loss_mask_bs: jax.Array, target_hidden_bsd: jax.Array, *,
                segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                chunk_size: int = 64, remat: bool = False
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TTT loss of an `Eagle3Draft` on one batch → (loss, metrics).

    loss = Σ_s 0.8^s Σ_t m_{s,t} CE_{s,t} / Σ_s 0.8^s Σ_t m_{s,t} (see `eagle3_loss_sums`);
    metrics hold `eagle3_metrics_from_sums` plus the arrays `step_loss`, `step_acc`,
    `step_tokens` [T]. jit-able and differentiable w.r.t. the drafter's nnx.Param leaves.
    """
    sums = eagle3_loss_sums(model, feats_bsf, input_ids_bs, loss_mask_bs, target_hidden_bsd,
                            segment_ids=segment_ids, positions=positions,
                            chunk_size=chunk_size, remat=remat)
    metrics = eagle3_metrics_from_sums(sums)
    tokens = jnp.maximum(sums["step_tokens"], 1.0)
    metrics.update(step_loss=sums["step_loss_sum"] / tokens,
                   step_acc=sums["step_correct"] / tokens, step_tokens=sums["step_tokens"])
    return metrics["loss"], metrics


__all__ = ["eagle3_loss", "eagle3_loss_sums", "eagle3_metrics_from_sums", "step_weights"]
