"""DSpark / DFlash drafter: parallel block backbone with target-feature KV injection (SPEC §3).

The backbone reads γ block tokens `[x0, M, …, M]` at positions a..a+γ−1 and attends to
(1) the projected target context `ctx = hidden_norm(fc(features))` at positions strictly before
the anchor a, and (2) all γ keys of its own block (bidirectional). Context K/V depend only on
target features, so inference caches them per draft layer and grows them as tokens commit.
DFlash is this backbone with no sequential head; DSpark adds the Markov/gated/RNN head and the
confidence head (heads.py).

A pruned draft vocabulary (`DraftConfig.draft_vocab`, EAGLE-3's technique applied to the block
drafter) restricts proposals to K target ids: inference keeps [.., V] logits with the other
columns at −1e9 (probability exactly 0, so verification stays lossless for any K), and training
asks for the compact [.., K] logits over those columns of the frozen LM head.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models import layers as L
from dspark_jax.models.drafters.block_attention import ContextMask, block_attend
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.drafters.heads import ConfidenceHead, MarkovHead
from dspark_jax.sharding import constrain


def _context_product(fc: jax.Array | None, parts: jax.Array | None, weight: jax.Array,
                     ws: tuple[jax.Array, ...], eps: float, interpret: bool) -> jax.Array:
    """On a GPU: the context's norm and every draft layer's k|v product of it in one kernel
    (`pallas_kernels.row_gemm.norm_gemm`), each weight read where it lies, from the fc
    product's rows fc [..., D] or its split-K parts [P, rows, D] (f32, summed in the kernel)
    → [rows, Σ 2·Kh·H], the layers' k|v side by side."""
    from pallas_kernels.row_gemm import norm_gemm

    dtype = weight.dtype if fc is None else fc.dtype
    _, kv = norm_gemm(None if fc is None else fc.reshape(-1, fc.shape[-1]), parts,
                      weight.astype(dtype), tuple(w.astype(dtype) for w in ws), eps=eps,
                      interpret=interpret)
    return kv


def draft_vocab_ids(cfg: DraftConfig) -> jax.Array | None:
    """The draft vocabulary [K] (int32, sorted), or None when it is the full vocabulary."""
    if not cfg.pruned_vocab:
        return None
    if not cfg.draft_vocab:
        raise ValueError("draft config: draft_vocab_size is set but draft_vocab holds no ids "
                         "(the training data stage chooses them: data/draft_vocab.py)")
    return jnp.asarray(cfg.draft_vocab, jnp.int32)


def restrict_to_draft_vocab(cfg: DraftConfig, logits: jax.Array) -> jax.Array:
    """Final drafting logits [..., V] with ids outside a pruned draft vocabulary at −1e9
    (probability exactly 0 at any temperature); unchanged for the full vocabulary. The mask is a
    trace-time constant, so the decode loop pays one add, not a scatter per round."""
    if not cfg.pruned_vocab:
        return logits
    draft_vocab_ids(cfg)   # the error for unresolved ids
    bias = np.full((cfg.target.vocab_size,), -1e9, np.float32)
    bias[np.asarray(cfg.draft_vocab)] = 0.0
    return logits + bias


class FrozenParam(nnx.Variable):
    """Copied from the target and frozen: saved in checkpoints, never differentiated."""


def frozen(shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: Any) -> FrozenParam:
    return FrozenParam(jnp.zeros(shape, dtype), axes=axes)


@flax.struct.dataclass
class DraftCache:
    """Per-draft-layer context keys/values (features of committed tokens): stacked
    [Ld, B, S_max, K, H], or one [1, B, S_max, K, H] buffer a layer beside the decoding
    layout's per-layer weights (`layers.cache_layer` reads either)."""

    k: jax.Array
    v: jax.Array


class DSparkDraft(nnx.Module):
    """DSpark (markov_rank > 0) or DFlash (markov_rank = 0, no confidence head)."""

    # (layer config, n, rngs=, param_dtype=, attn_in_dim=) → the draft layers' parameters; a
    # family's drafter (gemma4/drafters.py) swaps in its own layers
    make_layers = staticmethod(L.DecoderLayers)

    def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        t = cfg.target
        V, D, n = t.vocab_size, t.hidden_size, cfg.num_features
        self.cfg = cfg
        self.dtype = dtype
        self.embed = frozen((V, D), ("vocab", "embed"), param_dtype)
        self.lm_head = frozen((V, D), ("vocab", "embed"), param_dtype)
        self.fc = L.param(rngs, (n * D, D), ("features", "embed"), param_dtype)
        self.hidden_norm = L.param(None, (D,), ("norm",), param_dtype, "ones")
        self.layers = self.make_layers(cfg.layer_config(), cfg.num_draft_layers, rngs=rngs,
                                       param_dtype=param_dtype)
        self.norm = L.param(None, (D,), ("norm",), param_dtype, "ones")
        if cfg.has_markov:
            self.markov = MarkovHead(cfg, rngs=rngs, param_dtype=param_dtype)
        if cfg.has_confidence:
            self.confidence = ConfidenceHead(cfg, rngs=rngs, param_dtype=param_dtype)

    # ------------------------------------------------------------------ context
    def context(self, feats_bsf: jax.Array) -> jax.Array:
        """ctx = hidden_norm(fc(features)) [B, S, D]."""
        return L.rms_norm(self._fc(feats_bsf), self.hidden_norm.get_value(),
                          self.cfg.target.rms_norm_eps)

    def _fc(self, feats_bsf: jax.Array) -> jax.Array:
        """fc(features) [B, S, D], before the hidden norm."""
        return jnp.einsum("BSF,FD->BSD", feats_bsf.astype(self.dtype),
                          self.fc.get_value().astype(self.dtype))

    def context_kv(self, feats_bsf: jax.Array, positions_bs: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
        """Per-layer context K/V [Ld, B, S, K, H] (k_norm and RoPE applied)."""
        eps, rope = self.cfg.target.rms_norm_eps, self.cfg.target.rope

        def one(lp, x):
            k, v = L.project_kv(lp, x, eps)
            return L.apply_rope(k, positions_bs, rope), v

        if not isinstance(self.layers, L.UnstackedLayers):
            ctx = self.context(feats_bsf)
            return jax.vmap(lambda lp: one(lp, ctx))(self.layers.stacked(self.dtype))
        layers = list(self.layers.layer_params(self.dtype))   # the decoding layout
        if all("w_kv" in lp for lp in layers):
            return self._stacked_context_kv(layers, self._fc(feats_bsf), positions_bs)
        ctx = self.context(feats_bsf)

        def own(lp):   # each layer's product from its own handle on ctx: XLA would merge the
            # layers' k|v dots of one input into one GEMM over their weights concatenated
            # every call (a copy of them)
            w = {n: lp[n] for n in ("w_kv", "wk", "wv") if n in lp}
            x, w = jax.lax.optimization_barrier((ctx, w))
            return one({**lp, **w}, x)

        ks, vs = zip(*(own(lp) for lp in layers))
        return jnp.stack(ks), jnp.stack(vs)

    def _stacked_context_kv(self, layers: list[dict[str, jax.Array]], fc: jax.Array,
                            positions_bs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`context_kv` over per-layer buffers with k|v fused (`w_kv`), from the fc product
        [B, S, D]: its norm and every layer's k|v product of it, each from its own handle on
        the normed rows (XLA would merge the dots of one input into one GEMM over their weights
        concatenated every call: a copy of them), then the k norms and RoPE once over the
        products stacked [Ld, B, S, 2·K·H]: one pass where a layer at a time takes a kernel a
        layer and the stack another. On a GPU, where the row kernels take the rows, the norm
        and the products are one kernel reading each layer's weight where it lies
        (`pallas_kernels.row_gemm.norm_gemm`)."""
        from dspark_jax.models import decoding_layer as DL

        eps, rope = self.cfg.target.rms_norm_eps, self.cfg.target.rope
        H = layers[0]["wo"].shape[1]
        b, s, d = fc.shape
        ws = tuple(lp["w_kv"] for lp in layers)
        half = ws[0].shape[-1] // 2

        def xla(fc, weight, *ws):
            ctx = L.rms_norm(fc, weight, eps)
            kvs = [jnp.einsum("BSD,DF->BSF", *jax.lax.optimization_barrier((ctx, w)))
                   for w in ws]
            return (jnp.stack([kv[..., :half] for kv in kvs]),
                    jnp.stack([kv[..., half:] for kv in kvs]))

        def gpu(fc, weight, *ws, interpret):
            kv = _context_product(fc, None, weight, ws, eps, interpret)
            kv = kv.reshape(b, s, len(ws), 2, half)                     # [B, S, Ld, k|v, ·]
            return tuple(jnp.moveaxis(kv[:, :, :, i], 2, 0) for i in (0, 1))

        args = (fc, self.hidden_norm.get_value(), *ws)
        k, v = (L.on_gpu(gpu, xla, *args)
                if all(DL.row_kernels_take(b * s, d, w.shape[-1]) for w in ws) else xla(*args))
        k, v = (a.reshape(*a.shape[:3], half // H, H) for a in (k, v))
        if "k_norm" in layers[0]:
            # the norm apart from its scale: XLA:GPU's row-normalisation fusion takes a weight
            # broadcast along the row alone and would materialise the layers' weights broadcast
            # to every row (a copy of them); the scale joins RoPE's element-wise pass instead
            normed = jax.lax.optimization_barrier(L.rms_norm_noscale(k, eps))
            w = jnp.stack([lp["k_norm"] for lp in layers]).astype(k.dtype)
            k = w[:, None, None, None] * normed   # `layers.rms_norm`'s arithmetic
        return L.apply_rope(k, positions_bs, rope), v

    def write_context(self, caches: tuple[Any, Any], rows: jax.Array, positions: jax.Array,
                      feats_tf: jax.Array) -> tuple[Any, Any]:
        """The context K/V (`context_kv`) of T tokens' features [T, F], token t's written at
        (`rows[t]`, `positions[t]`) of the (k, v) caches and rotated at `positions[t]`, a row
        or position out of range dropping it (`layers.cache_scatter_kv`) → the caches.

        On a GPU, for the decoding layout (per-layer buffers with k|v fused, the row kernels
        taking the products, heads whose halves are a power of two): three kernels. The fc
        product as one part a feature (a target layer's tap), f32, which the features' own
        layout gives without a transpose; the parts' sum, its norm and every layer's k|v
        product (`pallas_kernels.row_gemm.norm_gemm`); and the write, which norms and rotates
        each token's keys on their way into the caches
        (`pallas_kernels.cache_write.write_context_rows`). XLA would take the fc product's
        split-K sum, the keys' angles, norm and RoPE and the values' transpose each as a
        kernel."""
        from dspark_jax.models import decoding_layer as DL
        from pallas_kernels.cache_write import context_rows_take

        ck, cv = caches
        rows, positions = rows.astype(jnp.int32), positions.astype(jnp.int32)

        def apart(*_: Any) -> tuple[Any, Any]:   # the products, norm and RoPE, then the write
            k, v = self.context_kv(feats_tf[None], positions[None])           # [Ld,1,T,Kh,H]
            return L.cache_scatter_kv(ck, cv, (rows, positions), k[:, 0], v[:, 0])

        layers = (list(self.layers.layer_params(self.dtype))
                  if isinstance(self.layers, L.UnstackedLayers) else [])
        t, d = feats_tf.shape[0], self.cfg.target.hidden_size
        H = layers[0]["wo"].shape[1] if layers else 0
        if not (layers and all("w_kv" in lp for lp in layers) and context_rows_take(H)
                and isinstance(ck, tuple) and isinstance(cv, tuple)
                and all(c.shape[0] == 1 and c.dtype == ck[0].dtype for c in ck + cv)
                and all(DL.row_kernels_take(t, d, lp["w_kv"].shape[-1]) for lp in layers)):
            return apart()
        eps = self.cfg.target.rms_norm_eps
        ws = tuple(lp["w_kv"] for lp in layers)
        norms = (tuple(lp["k_norm"].astype(ck[0].dtype) for lp in layers)
                 if "k_norm" in layers[0] else ())
        inv_freq = L.rope_freq(self.cfg.target.rope, H)
        sizes = np.cumsum([0, len(ws), len(norms), len(ck), len(cv)])
        n_feat = self.cfg.num_features

        def gpu(feats, fc_w, weight, rows, positions, inv_freq, *args, interpret):
            from pallas_kernels.cache_write import write_context_rows

            ws, norms, k, v = (args[a:b] for a, b in zip(sizes[:-1], sizes[1:]))
            parts = jnp.einsum("TPF,PFD->PTD", feats.reshape(t, n_feat, -1),
                               fc_w.reshape(n_feat, -1, fc_w.shape[-1]),
                               preferred_element_type=jnp.float32)      # [taps, T, D]
            kv = _context_product(None, parts, weight.astype(self.dtype), ws, eps, interpret)
            kv = kv.reshape(t, len(ws), 2, -1, H)                      # [T, Ld, k|v, Kh, H]
            return write_context_rows(k, v, rows, positions, kv, norms or None, inv_freq,
                                      eps=eps, interpret=interpret)

        return L.on_gpu(gpu, apart, feats_tf.astype(self.dtype),
                        self.fc.get_value().astype(self.dtype), self.hidden_norm.get_value(),
                        rows, positions, inv_freq, *ws, *norms, *ck, *cv)

    # ------------------------------------------------------------------ backbone
    def block_tokens(self, anchor_tokens: jax.Array) -> jax.Array:
        """[..., γ] block inputs: the anchor then γ−1 mask tokens (DeepSpec convention)."""
        g = self.cfg.block_size
        mask = jnp.full(anchor_tokens.shape + (g - 1,), self.cfg.mask_token_id, jnp.int32)
        return jnp.concatenate([anchor_tokens[..., None].astype(jnp.int32), mask], axis=-1)

    def embed_block(self, toks: jax.Array) -> jax.Array:
        """Block token embeddings [..., D] (the draft layers' input)."""
        return jnp.take(self.embed.get_value(), toks, axis=0).astype(self.dtype)

    def block_qkv(self, lp: Any, x: jax.Array, pos: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v of the normed block inputs x [B, T, D] at positions pos [B, T] (RoPE on q, k;
        block_attend scales the scores by H^-½)."""
        eps, rope = self.cfg.target.rms_norm_eps, self.cfg.target.rope
        q = L.apply_rope(L.project_q(lp, x, eps), pos, rope)
        k, v = L.project_kv(lp, x, eps)
        return q, L.apply_rope(k, pos, rope), v

    def attn_out_and_mlp(self, lp: Any, h: jax.Array, attn: jax.Array) -> jax.Array:
        """The rest of a draft layer after attention: output projection, residuals, MLP."""
        return L.attn_out_and_mlp(lp, h, attn, self.cfg.target.rms_norm_eps)

    def backbone(self, anchor_tokens_ba: jax.Array, anchor_pos_ba: jax.Array,
                 ctx_k: jax.Array, ctx_v: jax.Array, ctx_visible_bas: jax.Array | ContextMask,
                 blk_valid_ba: jax.Array, remat: bool = False,
                 key_chunk: int | None = None) -> jax.Array:
        """Final-normed block hidden states h [B, A, γ, D]. `key_chunk`: context keys per
        online-softmax chunk of the block attention (None: dense scores, block_attention.py)."""
        eps = self.cfg.layer_config().rms_norm_eps
        g = self.cfg.block_size
        toks = self.block_tokens(anchor_tokens_ba)                          # [B,A,γ]
        pos = anchor_pos_ba[..., None] + jnp.arange(g, dtype=jnp.int32)     # [B,A,γ]
        B, A = toks.shape[:2]
        h = self.embed_block(toks)                                          # [B,A,γ,D]
        flat_pos = pos.reshape(B, A * g)

        def layer(h, xs):
            lp, ck, cv = xs
            x = L.rms_norm(h, lp["input_norm"], eps).reshape(B, A * g, -1)
            q, k, v = self.block_qkv(lp, x, flat_pos)
            split = lambda t: t.reshape((B, A, g) + t.shape[2:])
            attn = block_attend(split(q), ck, cv, split(k), split(v), ctx_visible_bas,
                                blk_valid_ba, key_chunk)
            h_flat = self.attn_out_and_mlp(lp, h.reshape(B, A * g, -1),
                                           attn.reshape(B, A * g, *attn.shape[3:]))
            return h_flat.reshape(h.shape), None

        if remat:
            layer = jax.checkpoint(layer)
        ck, cv = ctx_k.astype(self.dtype), ctx_v.astype(self.dtype)
        if isinstance(self.layers, L.UnstackedLayers):   # the decoding layout: unrolled, each
            # layer's weights read where they lie (a scan's slices of the stack are copies)
            for i, lp in enumerate(self.layers.layer_params(self.dtype)):
                h, _ = layer(h, (lp, ck[i], cv[i]))
        else:
            h, _ = jax.lax.scan(layer, h, (self.layers.stacked(self.dtype), ck, cv))
        h = L.rms_norm(h, self.norm.get_value(), eps)
        return constrain(h, ("batch", None, None, "act_embed"))

    def backbone_over_cache(self, anchor_b: jax.Array, anchor_pos_b: jax.Array,
                            ctx_k: Any, ctx_v: Any) -> jax.Array:
        """`backbone` for one block a row while decoding: final-normed block hidden states
        [B, γ, D] of the anchors `anchor_b` [B] at `anchor_pos_b` [B], over the cached context
        K/V (a `DraftCache`'s k / v, in either layout) below each anchor.

        For the decoding layout (one buffer per draft layer) the layers run as the target's
        do while decoding (`models.decoding_layer`): on a GPU five kernels a layer (the
        residual sum, norm and q | k|v product; the q/k norms, RoPE and the attention over
        the context cache and the block; the merge of its splits with the o product; the
        residual sum, norm and gate/up product; the activation and the down product). The
        arithmetic is `backbone`'s, whose dense block attention runs on other platforms;
        stacked layers take `backbone`."""
        if not isinstance(self.layers, L.UnstackedLayers):
            if isinstance(ctx_k, tuple):   # per-layer buffers: one stack
                ctx_k, ctx_v = jnp.concatenate(ctx_k), jnp.concatenate(ctx_v)
            S, B = ctx_k.shape[2], anchor_b.shape[0]
            visible = (jnp.arange(S)[None] < anchor_pos_b[:, None])[:, None, :]
            return self.backbone(anchor_b[:, None], anchor_pos_b[:, None], ctx_k, ctx_v,
                                 visible, jnp.ones((B, 1), bool))[:, 0]
        from dspark_jax.models import decoding_layer as DL

        eps = self.cfg.layer_config().rms_norm_eps
        rope = self.cfg.target.rope
        g = self.cfg.block_size
        B = anchor_b.shape[0]
        S = L.cache_positions(ctx_k)
        pos = anchor_pos_b[:, None].astype(jnp.int32) + jnp.arange(g, dtype=jnp.int32)
        h = self.embed_block(self.block_tokens(anchor_b))                    # [B,γ,D]
        ones = jnp.ones((B, 1), bool)

        def dense(q, k, v, ck, cv, start):   # `backbone`'s block attention, one block a row
            visible = (jnp.arange(S)[None] < start[:, None])[:, None, :]
            return block_attend(q[:, None], ck, cv, k[:, None], v[:, None], visible,
                                ones)[:, 0]

        delta = None   # the first layer's input has no residual delta
        for i, lp in enumerate(self.layers.layer_params(self.dtype)):
            h, x = DL.input_norm(lp, h, delta, eps, DL.DRAFT_PRODUCTS)
            ck, cv = (L.cache_layer(c, i).astype(self.dtype) for c in (ctx_k, ctx_v))
            if DL.merged_o_takes(lp, x, ck, h.shape[-1], products=DL.DRAFT_PRODUCTS):
                h, delta = DL.block_attention_and_mlp_input(lp, h, x, pos, rope, eps, ck, cv,
                                                            anchor_pos_b, dense)
            else:
                attn = DL.block_attention(lp, x, pos, rope, eps, ck, cv, anchor_pos_b, dense)
                h, delta = DL.attn_out_and_mlp(lp, h, attn, eps)
        _, h = DL.add_rms_norm(h, delta, self.norm.get_value(), eps)
        return constrain(h, ("batch", None, "act_embed"))

    def draft_slots(self, h: jax.Array) -> jax.Array:
        """The block outputs that predict draft tokens, [..., γ_drafts, D] (drops slot 0 under
        z-lab's convention, where it sits on the anchor)."""
        return h[..., 1:, :] if self.cfg.block_convention == "zlab" else h

    def vocab_ids(self) -> jax.Array | None:
        return draft_vocab_ids(self.cfg)

    def lm_logits(self, h: jax.Array, rows: jax.Array | None = None) -> jax.Array:
        """lm_head(h) [..., V] in f32, or over the given LM-head rows [K, D] → [..., K]."""
        w = self.lm_head.get_value() if rows is None else rows
        return jnp.einsum("...D,VD->...V", h, w.astype(h.dtype),
                          preferred_element_type=jnp.float32)

    def base_logits(self, h: jax.Array) -> jax.Array:
        """U_k = lm_head(h_k) [..., V] (f32), tokens outside a pruned draft vocabulary at −1e9."""
        return restrict_to_draft_vocab(self.cfg, self.lm_logits(h))

    def draft_vocab_weights(self) -> dict[str, jax.Array] | None:
        """The rows of a pruned draft vocabulary (`vocab_ids()` order) of the LM head and of
        the Markov head's output matrix, gathered once: a decoder passes them to every
        `sample_block` call (on XLA:CPU a gather of lm_head rows inside the drafting program
        costs more than the rest of the draft). None for the full vocabulary."""
        ids = self.vocab_ids()
        if ids is None:
            return None
        out = {"lm_head": jnp.take(self.lm_head.get_value(), ids, axis=0)}
        if self.cfg.has_markov:
            out["markov_w2"] = jnp.take(self.markov.w2.get_value(), ids, axis=0)
        return out

    def draft_vocab_logits(self, h: jax.Array,
                           vocab_weights: dict[str, jax.Array] | None = None) -> jax.Array:
        """U_k over the draft vocabulary (f32): [..., K] for a pruned vocabulary of K ids
        (`vocab_ids()` order; only lm_head[ids] is read, from `vocab_weights` when given),
        else [..., V]."""
        if self.vocab_ids() is None:
            return self.base_logits(h)
        w = vocab_weights or self.draft_vocab_weights()
        return self.lm_logits(h, w["lm_head"])

    # ------------------------------------------------------------------ heads
    def heads_teacher_forced(self, h: jax.Array, prev_tokens: jax.Array,
                             lm_head_rows: jax.Array | None = None
                             ) -> tuple[jax.Array, jax.Array | None]:
        """Draft logits [..., γ, V] (f32) and confidence logits [..., γ] with given x_{k−1}.

        With a pruned draft vocabulary and `lm_head_rows` = lm_head[vocab_ids()] [K, D]
        (gathered once by the caller), the logits are the compact [..., γ, K] over the draft
        vocabulary (training); without it they are [..., γ, V] with the other columns at −1e9."""
        ids = self.vocab_ids() if lm_head_rows is not None else None
        if ids is None:
            logits = self.base_logits(h)
        else:
            logits = self.lm_logits(h, lm_head_rows)
        emb = None
        if self.cfg.has_markov:
            logits = logits + self.markov.teacher_forced(h, prev_tokens, rows=ids)
            emb = self.markov.embed_prev(prev_tokens, h.dtype)
        conf = self.confidence(h, emb) if self.cfg.has_confidence else None
        return logits, conf

    def sample_block(self, h_btd: jax.Array, anchor_b: jax.Array, key: jax.Array,
                     temperature: jax.Array, sample_fn: Any, probs_fn: Any = None,
                     vocab_weights: dict[str, jax.Array] | None = None
                     ) -> dict[str, jax.Array]:
        """Sampling over the γ slots, in sequence where a Markov head conditions each slot on
        the token sampled before it, else all at once. h [B, γ, D] → tokens [B, γ], probs
        [B, γ, V], confidence logits [B, γ].
        `probs_fn(logits [B, n]) → probs` replaces softmax(·/T) (e.g. per-request top-k/top-p).
        `vocab_weights`: `draft_vocab_weights()`, gathered once by the caller.

        With a pruned draft vocabulary of K ids, the LM head, the Markov bias and the sampling
        run over those K columns only (lm_head[ids]: K·D weights read, not V·D); the sampled
        index maps back to its id, and the probabilities are scattered into [V] for the
        verifier (zero elsewhere, as the −1e9 mask of `base_logits` gives). The ids are sorted,
        so the inverse-CDF draw picks the same token as over the masked full vocabulary."""
        from pallas_kernels.common import probs_from_logits

        B, g, _ = h_btd.shape
        ids = self.vocab_ids()
        if ids is not None and vocab_weights is None:
            vocab_weights = self.draft_vocab_weights()
        base = self.draft_vocab_logits(h_btd, vocab_weights)                # [B,γ,K or V]
        w2 = None if vocab_weights is None else vocab_weights.get("markov_w2")
        keys = jax.random.split(key, g)
        has_markov, has_conf = self.cfg.has_markov, self.cfg.has_confidence
        state0 = (self.markov.init_state((B,), h_btd.dtype) if has_markov
                  else jnp.zeros((B, 1), h_btd.dtype))

        def slot(carry, xs):
            prev, state = carry
            h, u, k = xs
            logits = u
            emb = None
            if has_markov:
                bias, state = self.markov.step(h, prev, state, rows=ids, w2_rows=w2)
                logits = logits + bias
                emb = self.markov.embed_prev(prev, h.dtype)
            conf = self.confidence(h, emb) if has_conf else jnp.zeros((B,), jnp.float32)
            p = (probs_fn(logits) if probs_fn is not None
                 else probs_from_logits(logits, temperature))
            tok = sample_fn(k, p)
            if ids is not None:
                tok = ids[tok]
            return (tok, state), (tok, p, conf)

        xs = (jnp.moveaxis(h_btd, 1, 0), jnp.moveaxis(base, 1, 0), keys)
        start = (anchor_b.astype(jnp.int32), state0)
        if has_markov:
            _, (toks, probs, conf) = jax.lax.scan(slot, start, xs)
        else:   # no slot reads the token before it (DFlash): every slot at once, the same
            # arithmetic a slot at a time, as one batch of γ·B rows
            toks, probs, conf = jax.vmap(lambda *x: slot(start, x)[1])(*xs)
        if ids is not None:   # [γ, B, K] → [γ, B, V]
            probs = jnp.zeros(probs.shape[:2] + (self.cfg.target.vocab_size,),
                              probs.dtype).at[..., ids].set(probs)
        return {"tokens": toks.T, "probs": jnp.moveaxis(probs, 0, 1), "confidence": conf.T}


def with_layer_buffers(graphdef: Any, state: Any, fuse: bool = True) -> tuple[Any, Any]:
    """(graphdef, state) of the same drafter with one buffer per draft layer
    (`layers.UnstackedLayers`), the serving engine's drafting layout: a scan over the stacked
    layers makes XLA copy every layer's weights out of the stack each draft. DSpark / DFlash
    fuse k|v and gate|up (their context's k|v product reads `w_kv` alone); a drafter class
    with `unstacked_layers(fuse)` builds its own (Eagle3: q|k|v and gate|up; Gemma4's
    drafters: `gemma4.layer_buffers.Gemma4GroupLayers`). A drafter already unstacked comes
    back as is; the stacked state stays valid (training and export use it). `fuse=False`
    keeps the stack's matrices (a tensor-parallel mesh: `models.decoder.with_layer_buffers`)."""
    model = nnx.merge(graphdef, state)
    own = getattr(model, "unstacked_layers", None)
    if own is not None:
        layers = own(fuse)
    elif type(model) is DSparkDraft and type(model.layers) is L.DecoderLayers:
        layers = L.UnstackedLayers(model.layers,
                                   fuse=L.UnstackedLayers.FUSED_KV if fuse else {})
    else:
        layers = None
    if layers is None:
        return graphdef, state
    model.layers = layers
    return nnx.split(model)
    if type(model.layers) is not L.DecoderLayers:
        return graphdef, state
    if type(model) is DSparkDraft:
        groups = L.UnstackedLayers.FUSED_KV
    elif type(model) is Eagle3Draft:
        groups = L.UnstackedLayers.FUSED
    else:
        return graphdef, state
    model.layers = L.UnstackedLayers(model.layers, fuse=groups if fuse else {})
    return nnx.split(model)
