"""Eagle3 drafter: the autoregressive baseline trained with training-time test (SPEC §5).

Architecture (DeepSpec's `Qwen3Eagle3Model`, after EAGLE-3 / SpecForge):
  g_t = fc(features_t)                                   (n·d → d, no bias, no norm)
  layer i: x = [input_layernorm(embed(x_{t+1})) ; hidden_norm_i(h)]   (2d wide)
           h = h + o_proj(attn(q/k/v(x)))                (residual = the un-normed h; h = g_t
                                                          for the first layer)
           h = h + SwiGLU(post_attention_layernorm(h))
  logits = frozen lm_head(norm(h))
Position t pairs the target feature g_t with the next token x_{t+1} and predicts x_{t+2}.
With more than one draft layer (not in DeepSpec's checkpoints, which have one), each layer
reads the same token embedding and the previous layer's output as its "hidden" half — our
generalisation, consistent with DeepSpec's per-layer `layers.{i}.hidden_norm` names.

Training-time test (TTT, `ttt_length` steps): step 0 runs the layer over the sequence with
causal attention; step s > 0 feeds step s−1's output hidden (pre-final-norm) in place of g and
embed(x_{t+1+s}), at RoPE position t+s; its query at t sees the step-0 keys at positions ≤ t
and the keys at its own position t from steps 1..s (`ttt_base_mask`, `ttt_diag_valid`).

Inference (`Eagle3Cache`, `commit`, `propose`) is the same computation unrolled as a chain:
committed pairs are step-0 keys, the γ−1 chain steps are the diagonal keys, written as scratch
after the committed ones and never committed.

Position bookkeeping for the speculative decoding engine (cache position = t of pair
(g_t, x_{t+1})):
  * after prefill of a prompt x_0..x_{P−1}, the target samples the anchor x_P and the features
    g_0..g_{P−1} are known: `commit(feats[0..P−1], next_tokens=[x_1..x_P], count=P)` →
    lengths = P, last pair (g_{P−1}, x_P), so `last_logits` predicts x_{P+1} (draft 1);
  * `propose` chain step s ≥ 1 runs at position lengths−1+s on (output hidden of step s−1,
    embed(draft s)) and predicts draft s+1;
  * after verification with a accepted drafts and the correction/bonus token c, the new
    features g_P..g_{P+a} (anchor + accepted drafts) are paired with their next tokens
    [d_1..d_a, c]: `commit(feats, [d_1..d_a, c], count=a+1)`; the scratch K/V of the
    previous chain are overwritten.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models import layers as L
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.drafters.dspark import (FrozenParam, draft_vocab_ids, frozen,
                                      restrict_to_draft_vocab)
from dspark_jax.sharding import constrain


# ----------------------------------------------------------------------------- TTT geometry
def base_positions(batch: int, seq: int, segment_ids_bs: jax.Array | None = None) -> jax.Array:
    """Step-0 RoPE positions [B, S]: 0..S−1, restarting at every segment start (packed rows)."""
    idx = jnp.arange(seq, dtype=jnp.int32)
    if segment_ids_bs is None:
        return jnp.broadcast_to(idx, (batch, seq))
    seg = segment_ids_bs
    is_start = jnp.concatenate([jnp.ones((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(is_start, idx[None], 0), axis=1)
    return (idx[None] - start).astype(jnp.int32)


def ttt_positions(base_bs: jax.Array, step: int | jax.Array) -> jax.Array:
    """RoPE positions of TTT step s: t + s (SPEC §5)."""
    return base_bs + jnp.asarray(step, jnp.int32)


def ttt_base_mask(batch: int, seq: int, segment_ids_bs: jax.Array | None = None) -> jax.Array:
    """Visibility of the step-0 keys [B, S(query t), S(key u)]: u ≤ t within the same segment.

    Shared by every TTT step: a query never sees a step-0 key after its own position."""
    idx = jnp.arange(seq)
    mask = jnp.broadcast_to(idx[None, :, None] >= idx[None, None, :], (batch, seq, seq))
    if segment_ids_bs is not None:
        mask = mask & (segment_ids_bs[:, :, None] == segment_ids_bs[:, None, :])
    return mask


def ttt_diag_valid(step: int | jax.Array, ttt_length: int) -> jax.Array:
    """[T−1] bool: diagonal slot j holds the keys of step j+1; step s sees slots j+1 ≤ s."""
    return jnp.arange(1, ttt_length) <= step


def ttt_dense_mask(base_mask_bts: jax.Array, step: int) -> jax.Array:
    """The full visibility [B, S, (s+1)·S] of TTT step s over keys laid out step-major
    (key j·S+u = step j, position u): `base_mask` for step 0, the diagonal (u = t) for steps
    1..s. Reference/diagnostic form of what `ttt_attend` computes in factored form."""
    B, S, _ = base_mask_bts.shape
    eye = jnp.broadcast_to(jnp.eye(S, dtype=bool), (B, S, S))
    return jnp.concatenate([base_mask_bts] + [eye] * step, axis=-1)


def _ttt_attend_rows(q_btnh: jax.Array, k0_bskh: jax.Array, v0_bskh: jax.Array,
                     kd_jbtkh: jax.Array, vd_jbtkh: jax.Array, base_mask_bts: jax.Array,
                     diag_valid_j: jax.Array) -> jax.Array:
    """`ttt_attend` for all T query rows at once (scores [B, K, G, T, S + J])."""
    B, T, N, H = q_btnh.shape
    K = k0_bskh.shape[2]
    q = q_btnh.reshape(B, T, K, N // K, H)
    scale = H ** -0.5
    s_base = jnp.einsum("BTKGH,BSKH->BKGTS", q, k0_bskh,
                        preferred_element_type=jnp.float32) * scale
    s_diag = jnp.einsum("BTKGH,JBTKH->BKGTJ", q, kd_jbtkh,
                        preferred_element_type=jnp.float32) * scale
    s_base = jnp.where(base_mask_bts[:, None, None], s_base, L.NEG_INF)
    s_diag = jnp.where(diag_valid_j, s_diag, L.NEG_INF)
    S = k0_bskh.shape[1]
    probs = jax.nn.softmax(jnp.concatenate([s_base, s_diag], axis=-1), axis=-1)
    probs = probs.astype(v0_bskh.dtype)
    out = (jnp.einsum("BKGTS,BSKH->BTKGH", probs[..., :S], v0_bskh,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("BKGTJ,JBTKH->BTKGH", probs[..., S:], vd_jbtkh,
                        preferred_element_type=jnp.float32))
    return out.reshape(B, T, N, H).astype(q_btnh.dtype)


def map_query_chunks(fn: Any, chunk: int | None, rows: Sequence[tuple[jax.Array, int]]
                     ) -> jax.Array:
    """fn(*rows) for attention whose query rows are independent, computed C = `chunk` query
    rows at a time: each row operand (array, its query axis) is padded to a multiple of C and
    split, each chunk is a checkpointed step of `lax.map` (recomputed in the backward pass), and
    the [B, T, ...] outputs are joined and cut back to T rows. The f32 scores then live as
    [.., C, S] instead of [.., T, S]. chunk None/0 or ≥ T: fn(*rows) at once."""
    T = rows[0][0].shape[rows[0][1]]
    if not chunk or int(chunk) >= T:
        return fn(*(x for x, _ in rows))
    C = int(chunk)
    n = -(-T // C)
    pad = n * C - T

    def split(x, axis):   # [.., T, ..] → [n, .., C, ..]
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths)
        return jnp.moveaxis(x.reshape(x.shape[:axis] + (n, C) + x.shape[axis + 1:]), axis, 0)

    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), tuple(split(x, ax) for x, ax in rows))
    B = out.shape[1]
    return jnp.moveaxis(out, 0, 1).reshape((B, n * C) + out.shape[3:])[:, :T]


def ttt_attend(q_btnh: jax.Array, k0_bskh: jax.Array, v0_bskh: jax.Array,
               kd_jbtkh: jax.Array, vd_jbtkh: jax.Array, base_mask_bts: jax.Array,
               diag_valid_j: jax.Array, query_chunk: int | None = None) -> jax.Array:
    """Attention of one TTT step over [step-0 keys ; own-position keys of steps 1..T−1]
    without materialising the (s+1)·S-wide key axis: the diagonal keys only ever meet the
    query at the same position, so their scores are a per-position dot product.
    q [B,T,N,H]; k0/v0 [B,S,K,H]; kd/vd [J,B,T,K,H] (J = ttt_length − 1); → [B,T,N,H].
    `query_chunk`: C query rows at a time (`map_query_chunks`): scores [B, K, G, C, S] instead
    of the S² term [B, K, G, T, S] (2.5 GiB f32 per layer-step at Qwen3-14B, S = 4096). Padded
    rows see no step-0 key (finite NEG_INF scores: no NaN) and are cut."""
    def rows(q, kd, vd, mask):
        return _ttt_attend_rows(q, k0_bskh, v0_bskh, kd, vd, mask, diag_valid_j)

    return map_query_chunks(rows, query_chunk, ((q_btnh, 1), (kd_jbtkh, 2), (vd_jbtkh, 2),
                                                (base_mask_bts, 1)))


# ----------------------------------------------------------------------------- inference state
@flax.struct.dataclass
class Eagle3Cache:
    """Draft K/V of committed pairs and the chain's starting point (see module docstring)."""

    k: jax.Array            # [Ld, B, S_max, K, H]
    v: jax.Array            # [Ld, B, S_max, K, H]
    lengths: jax.Array      # [B] int32 committed pairs
    last_hidden: jax.Array  # [B, D] output hidden (pre-final-norm) of the last committed pair
    last_logits: jax.Array  # [B, V] f32 logits of that pair (predict the first draft token)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


# ----------------------------------------------------------------------------- the drafter
class Eagle3Draft(nnx.Module):
    """EAGLE-3 drafter with DeepSpec's parameter layout (mapped by models/io/deepspec.py)."""

    make_layers = staticmethod(L.DecoderLayers)   # as DSparkDraft.make_layers

    def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        t = cfg.target
        V, D, n = t.vocab_size, t.hidden_size, cfg.num_features
        Ld = cfg.draft_num_hidden_layers
        self.cfg = cfg
        self.dtype = dtype
        self.embed: FrozenParam = frozen((V, D), ("vocab", "embed"), param_dtype)
        self.lm_head: FrozenParam = frozen((V, D), ("vocab", "embed"), param_dtype)
        self.fc = L.param(rngs, (n * D, D), ("features", "embed"), param_dtype)   # [in, out]
        self.hidden_norm = L.param(None, (Ld, D), ("layers", "norm"), param_dtype, "ones")
        self.layers = self.make_layers(cfg.layer_config(), Ld, rngs=rngs,
                                       param_dtype=param_dtype, attn_in_dim=2 * D)
        self.norm = L.param(None, (D,), ("norm",), param_dtype, "ones")

    # ------------------------------------------------------------------ pieces
    @property
    def _eps(self) -> float:
        return self.cfg.target.rms_norm_eps

    def project(self, feats_btf: jax.Array) -> jax.Array:
        """g = fc(features) [B, T, D] (no norm: it is the first layer's residual stream)."""
        g = jnp.einsum("BTF,FD->BTD", feats_btf.astype(self.dtype),
                       self.fc.get_value().astype(self.dtype))
        return constrain(g, ("batch", "seq", "act_embed"))

    def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
        return jnp.take(self.embed.get_value(), tokens_bt, axis=0).astype(self.dtype)

    def lm_logits(self, h_btd: jax.Array) -> jax.Array:
        """float32 logits [..., V] = lm_head(norm(h)) from output hiddens (pre-final-norm)."""
        x = L.rms_norm(h_btd.astype(self.dtype), self.norm.get_value(), self._eps)
        return jnp.einsum("...D,VD->...V", x, self.lm_head.get_value().astype(self.dtype),
                          preferred_element_type=jnp.float32)

    def vocab_ids(self) -> jax.Array | None:
        return draft_vocab_ids(self.cfg)

    def logits(self, h_btd: jax.Array) -> jax.Array:
        """The drafting logits: `lm_logits`, ids outside a pruned draft vocabulary at −1e9."""
        return restrict_to_draft_vocab(self.cfg, self.lm_logits(h_btd))

    def unstacked_layers(self, fuse: bool) -> nnx.Module | None:
        """These draft layers as one buffer per layer (`layers.UnstackedLayers`, q|k|v and
        gate|up fused unless not `fuse`), or None where they are not one `DecoderLayers` stack:
        what `drafters.dspark.with_layer_buffers` installs."""
        if type(self.layers) is not L.DecoderLayers:
            return None
        return L.UnstackedLayers(self.layers, fuse=True if fuse else {})

    def _layer_buffers(self) -> bool:
        """Whether the layers are one buffer per layer (`layers.UnstackedLayers`, the drafting
        layout: `drafters.dspark.with_layer_buffers`)."""
        return isinstance(self.layers, L.UnstackedLayers)

    def _stack(self) -> tuple[dict[str, jax.Array], jax.Array]:
        if self._layer_buffers():
            raise ValueError("Eagle3 training runs the stacked layers; one buffer per layer "
                             "(`drafters.dspark.with_layer_buffers`) is the drafting layout")
        return self.layers.stacked(self.dtype), self.hidden_norm.get_value().astype(self.dtype)

    def _layer_out(self, lp: dict[str, jax.Array], h_btd: jax.Array, attn_btnh: jax.Array
                   ) -> jax.Array:
        """o_proj + residual, then the MLP block (the family's layer tail)."""
        return L.attn_out_and_mlp(lp, h_btd, attn_btnh, self._eps)

    def _qkv(self, lp: dict[str, jax.Array], hn_d: jax.Array, emb_btd: jax.Array,
             h_btd: jax.Array, positions_bt: jax.Array
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B,T,N,H], k/v [B,T,K,H] from [input_layernorm(emb) ; hidden_norm(h)] (2D wide)."""
        eps, rope = self._eps, self.cfg.target.rope
        x = jnp.concatenate([L.rms_norm(emb_btd, lp["input_norm"], eps),
                             L.rms_norm(h_btd, hn_d, eps)], axis=-1)     # [B,T,2D]
        q, k, v = L.project_qkv(lp, x, eps)   # one dot where q/k/v are one buffer (`w_qkv`)
        return L.apply_rope(q, positions_bt, rope), L.apply_rope(k, positions_bt, rope), v

    # ------------------------------------------------------------------ training (TTT)
    def ttt_hidden(self, feats_bsf: jax.Array, input_ids_bs: jax.Array,
                   segment_ids_bs: jax.Array | None = None, ttt_length: int | None = None,
                   remat: bool = False, positions_bs: jax.Array | None = None,
                   query_chunk: int | None = None) -> jax.Array:
        """Output hiddens (pre-final-norm) of every TTT step [T, B, S, D] (SPEC §5).

        Step s at position t reads embed(x_{t+1+s}) (token 0 past the end; such positions are
        masked by the loss) and, for s > 0, step s−1's output at t in place of g_t. Step-0
        RoPE positions are `positions_bs` if given, else 0..S−1 restarting per segment.
        `query_chunk`: attention query rows per chunk in every step (`map_query_chunks`;
        None: all S rows at once)."""
        T = int(ttt_length or self.cfg.ttt_length)
        B, S = input_ids_bs.shape
        stack, hn = self._stack()
        pos0 = (base_positions(B, S, segment_ids_bs) if positions_bs is None
                else positions_bs.astype(jnp.int32))
        base_mask = ttt_base_mask(B, S, segment_ids_bs)
        ids_pad = jnp.concatenate([input_ids_bs.astype(jnp.int32),
                                   jnp.zeros((B, T), jnp.int32)], axis=1)   # [B, S+T]

        def step_tokens(s):
            return jax.lax.dynamic_slice_in_dim(ids_pad, 1 + s, S, axis=1)  # x_{t+1+s}

        # step 0: causal attention over the step-0 keys
        emb0 = self.embed_tokens(step_tokens(0))

        def layer0(h, xs):
            lp, hn_d = xs
            q, k, v = self._qkv(lp, hn_d, emb0, h, pos0)
            attn = map_query_chunks(lambda q_, m_: L.attend(q_, k, v, m_), query_chunk,
                                    ((q, 1), (base_mask, 1)))
            return self._layer_out(lp, h, attn), (k, v)

        if remat:
            layer0 = jax.checkpoint(layer0)
        h0, (k0, v0) = jax.lax.scan(layer0, self.project(feats_bsf), (stack, hn))
        if T == 1:
            return h0[None]

        # steps 1..T−1: diagonal keys accumulate in slots j = s−1
        J = T - 1
        kd0 = jnp.zeros((stack["wq"].shape[0], J) + k0.shape[1:], k0.dtype)  # [Ld,J,B,S,K,H]

        def step(carry, s):
            h_prev, kd, vd = carry
            emb = self.embed_tokens(step_tokens(s))
            pos = ttt_positions(pos0, s)
            valid = ttt_diag_valid(s, T)

            def layer(h, xs):
                lp, hn_d, k0_l, v0_l, kd_l, vd_l = xs
                q, k, v = self._qkv(lp, hn_d, emb, h, pos)
                kd_l = jax.lax.dynamic_update_index_in_dim(kd_l, k, s - 1, axis=0)
                vd_l = jax.lax.dynamic_update_index_in_dim(vd_l, v, s - 1, axis=0)
                attn = ttt_attend(q, k0_l, v0_l, kd_l, vd_l, base_mask, valid, query_chunk)
                return self._layer_out(lp, h, attn), (kd_l, vd_l)

            if remat:
                layer = jax.checkpoint(layer)
            h, (kd, vd) = jax.lax.scan(layer, h_prev, (stack, hn, k0, v0, kd, vd))
            return (h, kd, vd), h

        _, hs = jax.lax.scan(step, (h0, kd0, kd0),
                             jnp.arange(1, T, dtype=jnp.int32))
        return jnp.concatenate([h0[None], hs], axis=0)

    # ------------------------------------------------------------------ inference
    def init_cache(self, batch: int, max_len: int) -> Eagle3Cache:
        lc = self.cfg.layer_config()
        shape = (lc.num_hidden_layers, batch, max_len, lc.num_key_value_heads, lc.head_dim)
        D, V = lc.hidden_size, lc.vocab_size
        return Eagle3Cache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                           lengths=jnp.zeros((batch,), jnp.int32),
                           last_hidden=jnp.zeros((batch, D), self.dtype),
                           last_logits=jnp.zeros((batch, V), jnp.float32))

    def _cached_forward(self, g_btd: jax.Array, emb_btd: jax.Array, positions_bt: jax.Array,
                        k_cache: jax.Array, v_cache: jax.Array
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Runs the layers on T new inputs at per-row positions; each writes its K/V at its
        position and sees every cached key at a position ≤ its own. → (h [B,T,D], k, v).
        Stacked layers run as one scanned body; one buffer per layer (`_layer_buffers`, the
        drafting layout) unrolled, each dot reading its layer's weights where they lie (the
        cache keeps its [Ld, B, S_max, K, H] layout). The per-row positions must be the T
        consecutive positions from the row's first (`commit`, `propose`) where the decoding
        layer's kernels take the layers (`_kernel_layers_take`): on a GPU they then run as
        `_kernel_layers`, elsewhere as `_xla_layers`."""
        if self._layer_buffers():
            params = self.layers.layer_params(self.dtype)
            hn = self.hidden_norm.get_value().astype(self.dtype)
            args = (g_btd.astype(self.dtype), emb_btd, positions_bt, k_cache, v_cache)
            if self._kernel_layers_take(params, k_cache, positions_bt.shape[1]):
                return L.on_gpu(lambda *a, interpret: self._kernel_layers(params, hn, *a),
                                lambda *a: self._xla_layers(params, hn, *a), *args)
            return self._xla_layers(params, hn, *args)
        b_idx, mask = _rows_and_mask(positions_bt, k_cache.shape[2])
        stack, hn = self._stack()

        def layer(h, xs):
            lp, hn_d, kc, vc = xs
            q, k, v = self._qkv(lp, hn_d, emb_btd, h, positions_bt)
            kc = kc.at[b_idx, positions_bt].set(k.astype(kc.dtype), mode="drop")
            vc = vc.at[b_idx, positions_bt].set(v.astype(vc.dtype), mode="drop")
            attn = L.attend(q, kc.astype(self.dtype), vc.astype(self.dtype), mask)
            return self._layer_out(lp, h, attn), (kc, vc)

        h, (k_new, v_new) = jax.lax.scan(layer, g_btd.astype(self.dtype),
                                         (stack, hn, k_cache, v_cache))
        return h, k_new, v_new

    def _xla_layers(self, params: list[dict[str, jax.Array]], hn_ld: jax.Array,
                    h_btd: jax.Array, emb_btd: jax.Array, positions_bt: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`_cached_forward`'s per-layer buffers in XLA's ops: each layer `_qkv`, its K/V rows
        scattered into the cache, `layers.attend` over the whole cache layer under the mask of
        the positions ≤ the query's, then `_layer_out`."""
        b_idx, mask = _rows_and_mask(positions_bt, k_cache.shape[2])
        h = h_btd
        for i, lp in enumerate(params):
            q, k, v = self._qkv(lp, hn_ld[i], emb_btd, h, positions_bt)
            k_cache = k_cache.at[i, b_idx, positions_bt].set(k.astype(k_cache.dtype),
                                                             mode="drop")
            v_cache = v_cache.at[i, b_idx, positions_bt].set(v.astype(v_cache.dtype),
                                                             mode="drop")
            attn = L.attend(q, k_cache[i].astype(self.dtype), v_cache[i].astype(self.dtype),
                            mask)
            h = self._layer_out(lp, h, attn)
        return h, k_cache, v_cache

    def _kernel_layers_take(self, params: list[dict[str, jax.Array]], k_cache: jax.Array,
                            t: int) -> bool:
        """Whether `_kernel_layers` computes these layers: one buffer per layer in this class's
        arithmetic (`_qkv`, `_layer_out`; a subclass that replaces either keeps `_xla_layers`),
        outside a mesh of several devices, every layer one that
        `decoding_layer.fused_kernels_take` accepts for T = `t` queries a row (q/k/v fused as
        `w_qkv`, the cache in the compute dtype, its length a whole number of tiles)."""
        from dspark_jax.models import decoding_layer as DL
        from dspark_jax.sharding import on_several_devices

        if (type(self)._qkv is not Eagle3Draft._qkv
                or type(self)._layer_out is not Eagle3Draft._layer_out or on_several_devices()):
            return False
        lc = self.cfg.layer_config()
        rows = t * (lc.num_attention_heads // lc.num_key_value_heads)
        return all(DL.fused_kernels_take(lp, k_cache[i], self.dtype, rows)
                   for i, lp in enumerate(params))

    def _kernel_layers(self, params: list[dict[str, jax.Array]], hn_ld: jax.Array,
                       h_btd: jax.Array, emb_btd: jax.Array, positions_bt: jax.Array,
                       k_cache: jax.Array, v_cache: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`_xla_layers` on the decoding layer's kernels (`models.decoding_layer`), for the T
        consecutive positions from each row's first: a layer's attention half is
        `cached_attention` over x = [input_layernorm(emb) ; hidden_norm(h)] (the `w_qkv`
        product, the q/k norms, RoPE, attention over the cache below the row's first position
        and the T own keys, causal, and the rows written into the cache layer in place), put
        back in the [Ld, B, S_max, K, H] cache (with one layer, Ld = 1, the layer is the whole
        buffer and nothing is copied; with more, XLA copies each layer's slice out for the
        kernel and back); its second half `attn_out_and_mlp`, whose MLP delta is summed into
        h with the next layer's hidden norm (`add_rms_norm`), the last layer's alone."""
        from dspark_jax.models import decoding_layer as DL

        eps, rope = self._eps, self.cfg.target.rope
        B, T = positions_bt.shape
        start_b = positions_bt[:, 0]
        own_mask = L.causal_mask(B, T)
        h, delta = h_btd, None
        for i, lp in enumerate(params):
            if delta is None:
                h_n = L.rms_norm(h, hn_ld[i], eps)
            else:
                h, h_n = DL.add_rms_norm(h, delta, hn_ld[i], eps)
            x = jnp.concatenate([L.rms_norm(emb_btd, lp["input_norm"], eps), h_n], axis=-1)
            attn, k_i, v_i = DL.cached_attention(lp, x, positions_bt, rope, eps, k_cache[i],
                                                 v_cache[i], start_b, own_mask, write=True)
            k_cache = jax.lax.dynamic_update_index_in_dim(k_cache, k_i, i, axis=0)
            v_cache = jax.lax.dynamic_update_index_in_dim(v_cache, v_i, i, axis=0)
            h, delta = DL.attn_out_and_mlp(lp, h, attn, eps)
        h = DL.add_rms_norm(h, delta, None, eps)[0]
        return constrain(h, ("batch", "seq", "act_embed")), k_cache, v_cache

    def commit(self, cache: Eagle3Cache, feats_btf: jax.Array, next_tokens_bt: jax.Array,
               count_b: jax.Array) -> Eagle3Cache:
        """Appends pairs (g_t = fc(feats[t]), x_{t+1} = next_tokens[t]) for t < count[b] at
        positions lengths[b]+t (causal within the chunk, all committed keys visible); sets
        last_hidden/last_logits from each row's last valid pair (rows with count 0 keep
        theirs); lengths += count. Requires S_max ≥ lengths + count (+ γ−1 for `propose`)."""
        B, T = next_tokens_bt.shape
        count_b = count_b.astype(jnp.int32)
        pos = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]   # [B,T]
        h, k, v = self._cached_forward(self.project(feats_btf),
                                       self.embed_tokens(next_tokens_bt), pos, cache.k, cache.v)
        last = jnp.clip(count_b - 1, 0, T - 1)
        h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]    # [B,D]
        logits = self.logits(h_last)                                          # [B,V]
        has = count_b > 0
        return Eagle3Cache(
            k=k, v=v, lengths=cache.lengths + count_b,
            last_hidden=jnp.where(has[:, None], h_last.astype(cache.last_hidden.dtype),
                                  cache.last_hidden),
            last_logits=jnp.where(has[:, None], logits, cache.last_logits))

    def propose(self, cache: Eagle3Cache, key: jax.Array, temperature: jax.Array | float,
                gamma: int, sample_fn: Callable[[jax.Array, jax.Array], jax.Array],
                probs_fn: Callable[[jax.Array], jax.Array] | None = None,
                stop_ids: jax.Array | None = None) -> dict[str, jax.Array]:
        """γ autoregressive draft tokens (SPEC §5 inference). Draft 1 ~ softmax(last_logits/T);
        chain step s = 1..γ−1 reads (previous output hidden, embed(draft s)) at position
        lengths−1+s, writing scratch K/V visible to later steps only (lengths unchanged).
        → tokens [B, γ] int32, probs [B, γ, V] f32 (the distributions sampled from), and
        "cache": the cache with that scratch written past each row's committed pairs. The
        scratch is never read before a later chain or `commit` writes its position again, so a
        caller may keep this cache in place of its own: XLA then writes the scratch where the
        cache lies instead of copying it.
        `probs_fn(logits [B, V])` replaces softmax(·/T); with `stop_ids` [n] the chain stops at
        a drafted stop token like DeepSpec's evaluator: "length" [B] = drafts up to and
        including the first stop token (γ without one)."""
        from pallas_kernels.common import probs_from_logits

        if probs_fn is None:
            probs_fn = lambda lg: probs_from_logits(lg, temperature)  # noqa: E731

        keys = jax.random.split(key, gamma)
        p0 = probs_fn(cache.last_logits)                # [B,V]
        t0 = sample_fn(keys[0], p0).astype(jnp.int32)
        if gamma == 1:
            return _with_stop_length({"tokens": t0[:, None], "probs": p0[:, None],
                                      "cache": cache}, stop_ids)

        def step(carry, xs):
            h_prev, tok, kc, vc = carry
            s, k = xs
            pos = (cache.lengths - 1 + s)[:, None]                            # [B,1]
            h, kc, vc = self._cached_forward(h_prev[:, None], self.embed_tokens(tok[:, None]),
                                             pos, kc, vc)
            p = probs_fn(self.logits(h[:, 0]))
            nt = sample_fn(k, p).astype(jnp.int32)
            return (h[:, 0], nt, kc, vc), (nt, p)

        init = (cache.last_hidden.astype(self.dtype), t0, cache.k, cache.v)
        xs = (jnp.arange(1, gamma, dtype=jnp.int32), keys[1:])
        # compiled for a GPU the γ − 1 steps run unrolled: XLA then computes once what every
        # step shares (the uniforms' keys, the filter's predicate) and writes each step's
        # outputs in place. Elsewhere as a loop: XLA:TPU, unrolled, stops writing the chain's
        # scratch into the cache in place.
        (_, _, k, v), (toks, probs) = L.on_gpu(
            lambda init, xs, interpret: jax.lax.scan(step, init, xs, unroll=True),
            lambda init, xs: jax.lax.scan(step, init, xs), init, xs)
        tokens = jnp.concatenate([t0[:, None], toks.T], axis=1)
        probs = jnp.concatenate([p0[:, None], jnp.moveaxis(probs, 0, 1)], axis=1)
        return _with_stop_length({"tokens": tokens, "probs": probs,
                                  "cache": cache.replace(k=k, v=v)}, stop_ids)


def _rows_and_mask(positions_bt: jax.Array, s_max: int) -> tuple[jax.Array, jax.Array]:
    """(the batch rows [B, 1] that scatter a token's K/V at its position, the cache positions
    [B, T, S_max] each token sees: those ≤ its own)."""
    key_pos = jnp.arange(s_max, dtype=jnp.int32)
    return (jnp.arange(positions_bt.shape[0])[:, None],
            key_pos[None, None, :] <= positions_bt[:, :, None])


def _with_stop_length(out: dict[str, jax.Array], stop_ids: jax.Array | None
                      ) -> dict[str, jax.Array]:
    """Adds "length" [B]: drafts up to and including the first drafted stop token. (The chain
    is static-shape, so later slots are still computed, but never proposed.)"""
    if stop_ids is None:
        return out
    toks = out["tokens"]
    g = toks.shape[1]
    hit = jnp.any(toks[..., None] == stop_ids, axis=-1)                        # [B, γ]
    out["length"] = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, g
                              ).astype(jnp.int32)
    return out


__all__ = ["Eagle3Draft", "Eagle3Cache", "base_positions", "ttt_positions", "ttt_base_mask",
           "ttt_diag_valid", "ttt_dense_mask", "ttt_attend"]
