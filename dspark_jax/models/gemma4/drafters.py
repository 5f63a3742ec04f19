"""DSpark / DFlash / Eagle3 drafters for a Gemma4 target, as DeepSpec's `Gemma4DSparkModel` and
`Gemma4Eagle3Model` build them (SPEC §3, §5; the paper's cross-family Gemma4-12B result).

The parallel block backbone, context injection, Markov and confidence heads are those of
models/drafters/dspark.py; what changes is the draft layer, which follows Gemma4's full-attention
layer: head dim `global_head_dim`, K/V heads `num_global_key_value_heads` when `attention_k_eq_v`
(then no v_proj: values are the v-normed k_proj output) else `num_key_value_heads`, q/k norms
and the scale-free v norm on context and block K/V alike, attention scale 1, sandwich norms,
GELU-tanh MLP, a per-layer scalar, the full-attention (proportional) RoPE, a √D-scaled token
embedding and `final_logit_softcapping` on the draft logits. Eagle3's fused layer is the same
layer reading [input_layernorm(embed) ; hidden_norm(h)] (2·D wide) with the un-normed h as its
residual. Like DeepSpec, targets with per-layer input embeddings or MoE blocks are refused.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models import layers as L
from dspark_jax.models.config import ConfigError, DecoderConfig
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.drafters.block_attention import block_attend
from dspark_jax.models.drafters.dspark import DSparkDraft
from dspark_jax.models.drafters.eagle3 import Eagle3Draft
from dspark_jax.models.gemma4 import decoder as G
from dspark_jax.models.gemma4 import layer_buffers as LB
from dspark_jax.models.gemma4.config import gemma4_from_hf, gemma4_to_hf
from dspark_jax.sharding import constrain


def gemma4_draft_layer_config(target: DecoderConfig, n: int) -> DecoderConfig:
    """n full-attention layers with the target's full-attention head shapes (DeepSpec's
    `build_draft_config`: layer_types all full, the target's rope_parameters)."""
    if target.hidden_size_per_layer_input:
        raise ConfigError("Gemma4 drafters: targets with per-layer input embeddings "
                          "(hidden_size_per_layer_input > 0) are not supported (nor by DeepSpec)")
    kv, hd = target.attn_shape("full_attention")
    return target.replace(
        num_hidden_layers=n, layer_types=("full_attention",) * n, head_dim=hd,
        num_key_value_heads=kv, global_head_dim=None, num_global_key_value_heads=None,
        num_kv_shared_layers=0, use_double_wide_mlp=False, sliding_rope=None,
        tie_word_embeddings=False)


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def qkv(lp: Any, x: jax.Array, pos: jax.Array, lc: DecoderConfig, own_q: bool = False
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gemma4 q/k/v of a draft layer's input x (q/k norms, scale-free v norm, its RoPE). The
    shared attention helpers (block_attend, L.attend, ttt_attend) scale scores by H^-½ while
    Gemma4 attends with scale 1 (its q/k norms set the scale): q is pre-multiplied by H^½.
    A fused q|k(|v) product is one dot. `own_q` (per-layer buffers with q apart from k|v): q's
    dot takes its own handle on x, or XLA merges the q and k(|v) dots into one over their
    weights concatenated every call (a copy of them)."""
    eps = lc.rms_norm_eps
    if own_q and "wq" in lp:
        x_q, wq = jax.lax.optimization_barrier((x, lp["wq"]))
        q = G.project_q({**lp, "wq": wq}, x_q, pos, lc.rope, eps)
        kv = LB.project_kv(lp, x, pos, lc.rope, eps)
    else:
        q, kv = LB.project(lp, x, pos, lc.rope, eps)
    return (q * lc.head_dim ** 0.5, *kv)


def draft_layers(lc: DecoderConfig, n: int, *, rngs: nnx.Rngs, param_dtype: Any,
                 attn_in_dim: int | None = None) -> G.Gemma4Group:
    """The n full-attention draft layers (each computes its own K/V) of both drafters."""
    return G.Gemma4Group(lc, list(range(n)), True, rngs=rngs, param_dtype=param_dtype,
                         attn_in_dim=attn_in_dim)


def _unstacked(layers: nnx.Module, products: tuple[str, ...], fuse: bool
               ) -> LB.Gemma4GroupLayers | None:
    """A drafter's `Gemma4Group` as `LB.Gemma4GroupLayers` with `products` fused (none unless
    `fuse`); None for layers already unstacked."""
    if type(layers) is not G.Gemma4Group:
        return None
    return LB.Gemma4GroupLayers(layers, products if fuse else ())


class Gemma4DSparkDraft(DSparkDraft):
    """DSpark (Markov + confidence heads) or DFlash drafter with Gemma4 draft layers."""

    make_layers = staticmethod(draft_layers)

    def unstacked_layers(self, fuse: bool) -> nnx.Module | None:
        """The draft layers as one buffer per layer (k|v, or k alone on k=v layers, and gate|up
        fused unless not `fuse`), or None if they are already: for
        `drafters.dspark.with_layer_buffers`."""
        return _unstacked(self.layers, LB.KV, fuse)

    def context_kv(self, feats_bsf: jax.Array, positions_bs: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
        """Per-layer context K/V [Ld, B, S, K, H] (k_norm + RoPE on K, v_norm on V)."""
        ctx = self.context(feats_bsf)
        lc = self.cfg.layer_config()
        if isinstance(self.layers, LB.Gemma4GroupLayers):   # the drafting layout
            def own(lp):   # each layer's k(|v) product from its own handle on ctx, as
                # `DSparkDraft.context_kv` takes them (no merged dot over copied weights)
                w = {n: lp[n] for n in ("w_kv", "wk", "wv") if n in lp}
                x, w = jax.lax.optimization_barrier((ctx, w))
                return LB.project_kv({**lp, **w}, x, positions_bs, lc.rope, lc.rms_norm_eps)

            ks, vs = zip(*(own(lp) for lp in self.layers.layer_params(self.dtype)))
            return jnp.stack(ks), jnp.stack(vs)
        stack = self.layers.stacked(self.dtype)
        return jax.vmap(lambda lp: G.project_kv(lp, ctx, positions_bs, lc.rope,
                                                lc.rms_norm_eps))(stack)

    # the block backbone is DSparkDraft.backbone; Gemma4 changes the three layer pieces
    def embed_block(self, toks: jax.Array) -> jax.Array:
        """Gemma4 scales the embeddings by √D."""
        return L.embed(self.embed.get_value(), toks, scaled=True).astype(self.dtype)

    def block_qkv(self, lp: Any, x: jax.Array, pos: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Gemma4 q/k/v, q pre-scaled for block_attend (`qkv`)."""
        return qkv(lp, x, pos, self.cfg.layer_config(),
                   own_q=isinstance(self.layers, LB.Gemma4GroupLayers))

    def backbone_over_cache(self, anchor_b: jax.Array, anchor_pos_b: jax.Array,
                            ctx_k: Any, ctx_v: Any) -> jax.Array:
        """`DSparkDraft.backbone_over_cache`: one block a row over the cached context below
        each anchor → final-normed [B, γ, D]. Per-layer buffers (the drafting layout) run
        unrolled, each layer's attention over its own context buffer where it lies and its
        residual updates as the target's per-layer layers take them
        (`layer_buffers.residual_updates`: one kernel each on a GPU); stacked layers take
        `DSparkDraft`'s path. On a GPU, one device, a layer that
        `layer_buffers.block_kernel_product` takes runs its attention half as
        `layer_buffers.block_attention`'s kernels (the q and k(|v) products in one GEMM, then
        `layer_attention`: norms, RoPE, the attention over the context below the anchor and
        the whole block, and its merge); elsewhere, and for the other layers, `block_qkv` and
        `block_attend` (XLA's ops)."""
        if not isinstance(self.layers, LB.Gemma4GroupLayers):
            return super().backbone_over_cache(anchor_b, anchor_pos_b, ctx_k, ctx_v)
        lc = self.cfg.layer_config()
        eps = lc.rms_norm_eps
        g, B = self.cfg.block_size, anchor_b.shape[0]
        S = L.cache_positions(ctx_k)
        pos = anchor_pos_b[:, None].astype(jnp.int32) + jnp.arange(g, dtype=jnp.int32)
        ones = jnp.ones((B, 1), bool)
        h = self.embed_block(self.block_tokens(anchor_b))                    # [B,γ,D]
        pending = None   # a layer's last residual update, taken with the next norm
        for i, lp in enumerate(self.layers.layer_params(self.dtype)):
            h, x = LB.take_pending(h, pending, lp["input_norm"], eps)
            ck, cv = (L.cache_layer(c, i).astype(self.dtype) for c in (ctx_k, ctx_v))

            def dense(x, ck, cv, start, lp=lp):   # XLA's block attention, one block a row
                q, k, v = self.block_qkv(lp, x, pos)
                visible = (jnp.arange(S)[None] < start[:, None])[:, None, :]     # [B,1,S]
                return block_attend(q[:, None], ck, cv, k[:, None], v[:, None], visible,
                                    ones)[:, 0]

            product = LB.block_kernel_product(lp, ck, self.dtype, g)
            if product is None:
                attn = dense(x, ck, cv, anchor_pos_b)
            else:
                attn = LB.block_attention(lp, product, x, pos, lc.rope, eps, ck, cv,
                                          anchor_pos_b, dense)
            h, pending = LB.residual_updates(lp, h, attn, eps, None)
        _, h = LB.take_pending(h, pending, self.norm.get_value(), eps)
        return constrain(h, ("batch", None, "act_embed"))

    def attn_out_and_mlp(self, lp: Any, h: jax.Array, attn: jax.Array) -> jax.Array:
        """Gemma4's sandwich norms, GELU-tanh MLP and layer scalar."""
        return G.attn_out_and_mlp(lp, h, attn, self.cfg.layer_config().rms_norm_eps)

    def lm_logits(self, h: jax.Array, rows: jax.Array | None = None) -> jax.Array:
        """Softcapped LM-head logits (DeepSpec's `compute_logits`); heads add on top."""
        return softcap(super().lm_logits(h, rows), self.cfg.target.final_logit_softcapping)


class Gemma4Eagle3Draft(Eagle3Draft):
    """EAGLE-3 drafter with Gemma4 fused draft layers (DeepSpec's `Gemma4Eagle3Model`)."""

    make_layers = staticmethod(draft_layers)

    def unstacked_layers(self, fuse: bool) -> nnx.Module | None:
        """The draft layers as one buffer per layer (q|k(|v) and gate|up fused unless not
        `fuse`), or None if they are already: for `drafters.dspark.with_layer_buffers`."""
        return _unstacked(self.layers, LB.QKV, fuse)

    def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
        return L.embed(self.embed.get_value(), tokens_bt, scaled=True).astype(self.dtype)

    def lm_logits(self, h_btd: jax.Array) -> jax.Array:
        return softcap(super().lm_logits(h_btd), self.cfg.target.final_logit_softcapping)

    def _qkv(self, lp: dict[str, jax.Array], hn_d: jax.Array, emb_btd: jax.Array,
             h_btd: jax.Array, positions_bt: jax.Array
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
        lc = self.cfg.layer_config()
        eps = lc.rms_norm_eps
        x = jnp.concatenate([L.rms_norm(emb_btd, lp["input_norm"], eps),
                             L.rms_norm(h_btd, hn_d, eps)], axis=-1)     # [B,T,2D]
        return qkv(lp, x, positions_bt, lc)

    def _layer_out(self, lp: dict[str, jax.Array], h_btd: jax.Array, attn_btnh: jax.Array
                   ) -> jax.Array:
        return G.attn_out_and_mlp(lp, h_btd, attn_btnh, self.cfg.target.rms_norm_eps)


# ----------------------------------------------------------------------------- DeepSpec layout
def deepspec_base_config(cfg: DraftConfig) -> dict[str, Any]:
    """The Gemma4 part of a DeepSpec drafter config.json: the target's text config with
    `num_hidden_layers` = draft layers, all full attention, untied (DeepSpec's
    `build_draft_config`), keeping `global_head_dim` / `num_global_key_value_heads`."""
    t, n = cfg.target, cfg.layer_config().num_hidden_layers
    hf = gemma4_to_hf(t)
    kv, hd = t.attn_shape("full_attention")
    hf.update(num_hidden_layers=n, layer_types=["full_attention"] * n, tie_word_embeddings=False,
              per_layer_config={str(i): {"head_dim": hd, "num_key_value_heads": kv}
                                for i in range(n)},
              hidden_size_per_layer_input=0, num_kv_shared_layers=0,
              target_model_type="gemma4", target_text_model_type="gemma4_text")
    if cfg.model_type == "eagle3":  # fields DeepSpec's Gemma4Eagle3Model requires
        hf.update(ttt_length=cfg.ttt_length, step_loss_decay=cfg.step_loss_decay)
    if "sliding_attention" not in t.layer_types:
        hf["rope_parameters"].pop("sliding_attention", None)
    return hf


def layer_shape_from_deepspec(raw: dict[str, Any], source: str) -> DecoderConfig:
    """A Gemma4 drafter config.json → DecoderConfig of its (full-attention) draft layers."""
    shape = dict(raw)
    shape["architectures"] = ["Gemma4ForCausalLM"]
    shape.setdefault("model_type", "gemma4_text")
    if shape["model_type"] == "gemma4":  # DeepSpec copies the *text* config; accept both
        shape["model_type"] = "gemma4_text"
    if "global_head_dim" in shape:  # a per_layer_config copied from the target is stale
        shape.pop("per_layer_config", None)
    return gemma4_from_hf(DecoderConfig, shape, source)


def check_draft_shapes(layer_shape: DecoderConfig, target: DecoderConfig, source: str) -> None:
    """The checkpoint's draft layers must have the target's full-attention head shapes."""
    got, want = layer_shape.attn_shape("full_attention"), target.attn_shape("full_attention")
    for field, a, b in (("num_global_key_value_heads", got[0], want[0]),
                        ("global_head_dim", got[1], want[1])):
        if a != b:
            raise ConfigError(f"{source}: field {field!r} gives draft layers {a}, but the "
                              f"target's full-attention layers have {b}")
