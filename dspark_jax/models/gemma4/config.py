"""Gemma4 `config.json` ⇄ DecoderConfig (SPEC §2: the frozen target; the paper's Gemma4-12B).

Reads a `Gemma4ForCausalLM` config (`model_type: gemma4_text`) or the `text_config` of a
multimodal `Gemma4ForConditionalGeneration` checkpoint, with Hugging Face's defaults for absent
fields (5:1 sliding/full layer pattern, per-type `rope_parameters`, `global_head_dim` 512).
Per-layer head shapes come from `per_layer_config` (what transformers ≥ 5.24 writes) or from
`global_head_dim` / `num_global_key_value_heads` (what Google's checkpoints and DeepSpec use).
Variants whose numerics dspark_jax does not implement (MoE blocks, bidirectional attention,
audio/vision-only configs) are refused with an error naming the file and field.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from dspark_jax.models.config import (LAYER_TYPES, ConfigError, DecoderConfig, hf_shape_fields,
                                      hf_token_fields, rope_from_hf)

log = logging.getLogger(__name__)

# Hugging Face Gemma4TextConfig defaults (used when a field is absent from config.json)
_HF_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}
_TEXT_MODEL_TYPES = ("gemma4_text", "gemma4")


def text_config_of(cfg: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], str]:
    """The text-decoder part of a Gemma4 config (itself, or a multimodal `text_config`)."""
    model_type = cfg.get("model_type")
    if model_type in ("gemma4_audio", "gemma4_vision"):
        raise ConfigError(f"{source}: field 'model_type' is {model_type!r}: only the Gemma4 text "
                          "decoder is supported (no audio/vision-only models)")
    if "text_config" in cfg or model_type == "gemma4":
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError(f"{source}: field 'text_config' is missing: a multimodal Gemma4 "
                              "checkpoint without a text decoder (audio/vision only) is not "
                              "supported")
        ignored = [k for k in ("vision_config", "audio_config") if cfg.get(k)]
        if ignored:
            log.info("%s: using text_config only; ignoring %s and their weights", source,
                     " and ".join(ignored))
        merged = dict(text)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if key not in merged and key in cfg:
                merged[key] = cfg[key]
        return merged, f"{source}: text_config"
    return cfg, source


def _layer_shapes(cfg: Mapping[str, Any], layer_types: list[str], k_eq_v: bool, src: str
                  ) -> tuple[int | None, int | None]:
    """(global_head_dim, num_global_key_value_heads) of the full-attention layers."""
    plc = cfg.get("per_layer_config")
    if plc:
        if not isinstance(plc, Mapping):
            raise ConfigError(f"{src}: field 'per_layer_config' must be a mapping")
        shapes = set()
        for key, over in plc.items():
            try:
                i = int(key)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{src}: field 'per_layer_config' key {key!r} is not a "
                                  "layer index") from e
            if not 0 <= i < len(layer_types):
                raise ConfigError(f"{src}: field 'per_layer_config' names layer {i}, outside "
                                  f"[0, {len(layer_types) - 1}]")
            extra = set(over) - {"head_dim", "num_key_value_heads"}
            if extra or layer_types[i] != "full_attention":
                raise ConfigError(f"{src}: field 'per_layer_config' overrides {sorted(over)} on "
                                  f"layer {i} ({layer_types[i]}); only head_dim/"
                                  "num_key_value_heads of full-attention layers are supported")
            shapes.add((over.get("head_dim"), over.get("num_key_value_heads")))
        missing = [i for i, t in enumerate(layer_types)
                   if t == "full_attention" and str(i) not in {str(k) for k in plc}]
        if missing or len(shapes) != 1:
            raise ConfigError(f"{src}: field 'per_layer_config' must give every full-attention "
                              f"layer the same shape (got {sorted(shapes, key=str)}, layers "
                              f"without an entry: {missing})")
        hd, kv = shapes.pop()
        return (int(hd) if hd else None), (int(kv) if kv else None)
    hd = int(cfg.get("global_head_dim", 512))
    kv = cfg.get("num_global_key_value_heads")
    return hd, (int(kv) if (kv and k_eq_v) else None)


def gemma4_from_hf(cls: type, raw: Mapping[str, Any], source: str) -> DecoderConfig:
    cfg, src = text_config_of(raw, source)
    if cfg.get("model_type") not in (None,) + _TEXT_MODEL_TYPES:
        raise ConfigError(f"{src}: field 'model_type' is {cfg.get('model_type')!r}, expected "
                          "'gemma4_text'")
    if cfg.get("enable_moe_block"):
        raise ConfigError(f"{src}: field 'enable_moe_block' is true: Gemma4 MoE models are not "
                          "supported (dense Gemma4 text models only)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{src}: field 'use_bidirectional_attention' = "
                          f"{cfg['use_bidirectional_attention']!r} is not supported (causal only)")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{src}: field 'hidden_activation' {act!r} is not supported "
                          "(Gemma4 uses gelu_pytorch_tanh)")

    def need(key: str) -> Any:
        if key not in cfg:
            raise ConfigError(f"{src}: missing required field {key!r}")
        return cfg[key]

    n_layers = int(need("num_hidden_layers"))
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # Hugging Face default: 5 sliding : 1 full, last layer full
        layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                       for i in range(n_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != n_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ConfigError(f"{src}: field 'layer_types' must list {n_layers} entries from "
                          f"{LAYER_TYPES}, got {layer_types}")
    if layer_types[-1] != "full_attention":  # as transformers: the last layer is always full
        log.warning("%s: last layer type %r forced to full_attention (as transformers does)",
                    src, layer_types[-1])
        layer_types[-1] = "full_attention"

    rope_params = cfg.get("rope_parameters") or _HF_DEFAULT_ROPE
    if not all(t in rope_params for t in set(layer_types)):
        raise ConfigError(f"{src}: field 'rope_parameters' must have an entry per layer type "
                          f"{sorted(set(layer_types))}, got {sorted(rope_params)}")
    rope = {t: rope_from_hf({"rope_parameters": rope_params[t]}, f"{src} rope_parameters.{t}")
            for t in set(layer_types)}

    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    global_hd, global_kv = _layer_shapes(cfg, layer_types, k_eq_v, src)
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    n_kv = int(cfg.get("num_key_value_heads") or heads)
    if global_kv == n_kv:  # one canonical form, so configs round-trip exactly
        global_kv = None
    eos = cfg.get("eos_token_id", 1)
    try:
        out = cls(
            family="gemma4",
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=n_kv,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope.get("full_attention", rope[layer_types[0]]),
            sliding_rope=rope.get("sliding_attention"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qk_norm=True,
            attention_bias=bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131_072)),
            bos_token_id=cfg.get("bos_token_id", 2),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=cfg.get("pad_token_id", 0),
            layer_types=tuple(layer_types),
            sliding_window=int(cfg.get("sliding_window", 512)),
            global_head_dim=global_hd,
            num_global_key_value_heads=global_kv,
            attention_k_eq_v=k_eq_v,
            hidden_size_per_layer_input=int(cfg.get("hidden_size_per_layer_input", 256) or 0),
            vocab_size_per_layer_input=int(cfg.get("vocab_size_per_layer_input", 262_144)),
            num_kv_shared_layers=int(cfg.get("num_kv_shared_layers", 0) or 0),
            use_double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
            hidden_act="gelu_pytorch_tanh",
            final_logit_softcapping=(None if cfg.get("final_logit_softcapping") is None
                                     else float(cfg["final_logit_softcapping"])),
        )
    except ConfigError as e:
        raise ConfigError(f"{src}: {e}") from e
    for i in range(out.first_kv_shared_layer, n_layers):
        try:
            out.kv_producer(i)
        except ConfigError as e:
            raise ConfigError(f"{src}: field {e}") from e
    return out


def _rope_dict(r: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "proportional":
        d["partial_rotary_factor"] = r.partial_rotary_factor
    if r.rope_type != "default":
        d["factor"] = r.factor
    return d


def gemma4_to_hf(c: DecoderConfig) -> dict[str, Any]:
    """A `Gemma4ForCausalLM` config.json (both per_layer_config and global_* are written so
    transformers ≥ 5.24 and DeepSpec-style readers agree)."""
    full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
    kv, hd = c.attn_shape("full_attention")
    rope = {"full_attention": _rope_dict(c.rope)}
    if "sliding_attention" in c.layer_types:
        rope["sliding_attention"] = _rope_dict(c.sliding_rope or c.rope)
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        **hf_shape_fields(c),
        "global_head_dim": hd,
        # k=v full layers: always an int (DeepSpec's drafters read int(...) of it)
        "num_global_key_value_heads": kv if c.attention_k_eq_v else c.num_global_key_value_heads,
        "per_layer_config": {str(i): {"head_dim": hd, "num_key_value_heads": kv} for i in full},
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": rope,
        "layer_types": list(c.layer_types),
        "sliding_window": c.sliding_window or 512,
        "attention_k_eq_v": c.attention_k_eq_v,
        "hidden_size_per_layer_input": c.hidden_size_per_layer_input,
        "vocab_size_per_layer_input": c.vocab_size_per_layer_input or c.vocab_size,
        "num_kv_shared_layers": c.num_kv_shared_layers,
        "use_double_wide_mlp": c.use_double_wide_mlp,
        "enable_moe_block": False,
        "hidden_activation": c.hidden_act,
        "final_logit_softcapping": c.final_logit_softcapping,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "max_position_embeddings": c.max_position_embeddings,
        **hf_token_fields(c),
    }


def num_params(c: DecoderConfig) -> int:
    d, h = c.hidden_size, c.num_attention_heads
    total = c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + d
    p = c.hidden_size_per_layer_input
    if p:
        total += (c.vocab_size_per_layer_input or c.vocab_size) * c.num_hidden_layers * p
        total += d * c.num_hidden_layers * p + p
    for i in range(c.num_hidden_layers):
        t = c.layer_type(i)
        kv, hd = c.attn_shape(t)
        n = d * hd * 2 * h + hd + 4 * d + 3 * d * c.mlp_size(i) + 1
        if c.kv_producer(i) == i:
            n += d * hd * kv * (2 if c.has_v_proj(t) else 1) + hd
        if p:
            n += 2 * d * p + d
        total += n
    return total


def claims_model_type(model_type: Any) -> bool:
    """Gemma4 model types ("gemma4", "gemma4_text", and the audio/vision ones, which
    `text_config_of` refuses by name)."""
    return str(model_type).startswith("gemma4")
