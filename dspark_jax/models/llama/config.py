"""Llama / Qwen3 `config.json` ⇄ DecoderConfig (SPEC §2: the frozen target; SPEC §3, §5: the
drafter's layers, which DeepSpec builds as the target's config with fewer layers).

`model_type` "llama" (SmolLM2, Llama 2/3: RoPE scaling "linear" / "llama3", tied embeddings by
default) or "qwen3" (per-head q/k RMSNorm, head_dim independent of hidden/heads, untied).
"""

from __future__ import annotations

from typing import Any, Mapping

from dspark_jax.models.config import (ConfigError, DecoderConfig, hf_shape_fields,
                                      hf_token_fields, rope_from_hf)
from dspark_jax.models.drafters.config import DraftConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def config_from_hf(cls: type, cfg: Mapping[str, Any], source: str, family: str
                   ) -> DecoderConfig:
    """A Llama or Qwen3 (`family`) config.json dict → `cls` (a DecoderConfig)."""
    def need(key: str) -> Any:
        if key not in cfg:
            raise ConfigError(f"{source}: missing required field {key!r}")
        return cfg[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = cfg.get("head_dim") or hidden // heads
    return cls(
        family=family,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(cfg, source),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "llama")),
        qk_norm=family == "qwen3",
        attention_bias=bool(cfg.get("attention_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=(tuple(cfg["eos_token_id"]) if isinstance(cfg.get("eos_token_id"), list)
                      else cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"),
    )


def config_to_hf(c: DecoderConfig) -> dict[str, Any]:
    """A `LlamaForCausalLM` / `Qwen3ForCausalLM` config.json dict."""
    rope_scaling = None
    if c.rope.rope_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": c.rope.factor}
    elif c.rope.rope_type == "llama3":
        rope_scaling = {
            "rope_type": "llama3", "factor": c.rope.factor,
            "low_freq_factor": c.rope.low_freq_factor,
            "high_freq_factor": c.rope.high_freq_factor,
            "original_max_position_embeddings": c.rope.original_max_position_embeddings,
        }
    return {
        "architectures": [ARCHITECTURES[c.family]],
        "model_type": c.family,
        **hf_shape_fields(c),
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        **hf_token_fields(c),
    }


def num_params(c: DecoderConfig) -> int:
    d, f, h, kv, hd = (c.hidden_size, c.intermediate_size, c.num_attention_heads,
                       c.num_key_value_heads, c.head_dim)
    per_layer = d * hd * (2 * h + 2 * kv) + 3 * d * f + 2 * d + (2 * hd if c.qk_norm else 0)
    emb = c.vocab_size * d * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * per_layer + emb + d


def draft_layer_config(target: DecoderConfig, n: int, family: str) -> DecoderConfig:
    """n drafter layers of `family` with the target's shapes: Qwen3 layers (q/k RMSNorm, the
    layers of DeepSpec's Qwen3DSparkModel / Qwen3Eagle3Model) or, for legacy dspark_jax exports
    with Llama draft layers, Llama layers (no q/k norm)."""
    return target.replace(num_hidden_layers=n, family=family, qk_norm=family == "qwen3",
                          tie_word_embeddings=False)


def deepspec_layer_config(raw: Mapping[str, Any], source: str, family: str) -> DecoderConfig:
    """A DeepSpec drafter config.json (the target's config with the draft layer count) → the
    DecoderConfig of its Llama / Qwen3 draft layers."""
    shape = dict(raw)
    shape["architectures"] = [ARCHITECTURES[family]]
    shape["model_type"] = family
    return DecoderConfig.from_hf_dict(shape, source=source)


def deepspec_base_config(cfg: DraftConfig) -> dict[str, Any]:
    """The Llama / Qwen3 part of a DeepSpec drafter config.json: the draft layers' own
    config.json (the target's, with `num_hidden_layers` = draft layers, untied)."""
    return cfg.layer_config().to_hf_dict()


def check_draft_shapes(layer_shape: DecoderConfig, target: DecoderConfig, source: str) -> None:
    """Nothing beyond the vocabulary and width the DeepSpec reader checks: Llama / Qwen3 draft
    layers may have their own head counts."""


def claims_model_type(model_type: Any, family: str) -> bool:
    return model_type == family
