"""Gemma4 Hugging Face tensors ⇄ the TargetDecoder's Gemma4 layers (SPEC §2; models/io/hf.py
maps the embeddings, final norm and LM head, named as every family's).

Reads `Gemma4ForCausalLM` checkpoints (`model.layers.i.…`) and the text decoder of multimodal
`Gemma4ForConditionalGeneration` ones (`model.language_model.layers.i.…`; vision/audio tensors
are skipped with a log line). Per-layer tensors are regrouped into the period-slot stacks of
models/gemma4/decoder.py; a tensor whose shape disagrees with config.json fails naming file,
tensor and the config field that sets the expected shape. Writes back the `Gemma4ForCausalLM`
layout. The same per-layer names are DeepSpec's for the layers of its Gemma4 drafters.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from dspark_jax.models.config import DecoderConfig
from dspark_jax.models.gemma4.decoder import plan_segments
from dspark_jax.models.io.errors import CheckpointError, checked_tensor

log = logging.getLogger(__name__)

PREFIXES = ("model.language_model.", "model.")


def text_prefix(tensors: Mapping[str, np.ndarray], source: str) -> str:
    for p in PREFIXES:
        if p + "embed_tokens.weight" in tensors:
            other = sorted({k.split(".")[1] for k in tensors
                            if k.startswith("model.") and not k.startswith(p)
                            and k.split(".")[1] in ("vision_tower", "audio_tower",
                                                     "embed_vision", "embed_audio")})
            if other:
                log.info("%s: loading the text decoder only; ignoring %s", source,
                         ", ".join(other))
            return p
    raise CheckpointError(f"{source}: missing tensor 'model.embed_tokens.weight' (or "
                          "'model.language_model.embed_tokens.weight' for a multimodal Gemma4 "
                          "checkpoint)")


def _layer_tensors(cfg: DecoderConfig, i: int, attn_in_dim: int | None = None
                   ) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Our name → (HF suffix, HF shape, config field that sets it) for layer i."""
    D, N = cfg.hidden_size, cfg.num_attention_heads
    A = attn_in_dim or D
    t = cfg.layer_type(i)
    K, H = cfg.attn_shape(t)
    F = cfg.mlp_size(i)
    # the config.json fields that set these shapes: full-attention layers (and every layer of
    # a DeepSpec drafter) take global_head_dim, and with k=v num_global_key_value_heads
    full = t == "full_attention"
    hd_field = "global_head_dim" if full else "head_dim"
    f_field = "use_double_wide_mlp" if F != cfg.intermediate_size else "intermediate_size"
    kv_field = ("num_global_key_value_heads"
                if full and (cfg.attention_k_eq_v or K != cfg.num_key_value_heads)
                else "num_key_value_heads")
    out = {
        "input_norm": ("input_layernorm.weight", (D,), "hidden_size"),
        "post_attn_norm": ("post_attention_layernorm.weight", (D,), "hidden_size"),
        "pre_ff_norm": ("pre_feedforward_layernorm.weight", (D,), "hidden_size"),
        "post_ff_norm": ("post_feedforward_layernorm.weight", (D,), "hidden_size"),
        "wq": ("self_attn.q_proj.weight", (N * H, A), hd_field),
        "q_norm": ("self_attn.q_norm.weight", (H,), hd_field),
        "wo": ("self_attn.o_proj.weight", (D, N * H), hd_field),
        "w_gate": ("mlp.gate_proj.weight", (F, D), f_field),
        "w_up": ("mlp.up_proj.weight", (F, D), f_field),
        "w_down": ("mlp.down_proj.weight", (D, F), f_field),
        "layer_scalar": ("layer_scalar", (1,), "num_hidden_layers"),
    }
    if cfg.kv_producer(i) == i:
        out["wk"] = ("self_attn.k_proj.weight", (K * H, A), kv_field)
        out["k_norm"] = ("self_attn.k_norm.weight", (H,), hd_field)
        if cfg.has_v_proj(t):
            out["wv"] = ("self_attn.v_proj.weight", (K * H, A), kv_field)
    P = cfg.hidden_size_per_layer_input
    if P:
        out["ple_gate"] = ("per_layer_input_gate.weight", (P, D), "hidden_size_per_layer_input")
        out["ple_proj"] = ("per_layer_projection.weight", (D, P), "hidden_size_per_layer_input")
        out["ple_norm"] = ("post_per_layer_input_norm.weight", (D,), "hidden_size")
    return out


def layer_tensor_names(cfg: DecoderConfig, i: int, attn_in_dim: int | None = None) -> list[str]:
    """Hugging Face / DeepSpec tensor names (without the layer prefix) of Gemma4 layer i."""
    return [suffix for suffix, _, _ in _layer_tensors(cfg, i, attn_in_dim).values()]


def _to_ours(name: str, t: np.ndarray, cfg: DecoderConfig, i: int) -> np.ndarray:
    """HF [out, in] layout → our einsum layout."""
    D, N = cfg.hidden_size, cfg.num_attention_heads
    K, H = cfg.attn_shape(cfg.layer_type(i))
    if name == "wq":
        return t.T.reshape(-1, N, H)
    if name in ("wk", "wv"):
        return t.T.reshape(-1, K, H)
    if name == "wo":
        return t.T.reshape(N, H, D)
    if name in ("w_gate", "w_up", "w_down", "ple_gate", "ple_proj"):
        return t.T
    if name == "layer_scalar":
        return t.reshape(())
    return t


def _to_hf(name: str, t: np.ndarray) -> np.ndarray:
    if name in ("wq", "wk", "wv"):
        return t.reshape(t.shape[0], -1).T
    if name == "wo":
        return t.reshape(-1, t.shape[-1]).T
    if name in ("w_gate", "w_up", "w_down", "ple_gate", "ple_proj"):
        return t.T
    if name == "layer_scalar":
        return t.reshape(1)
    return t


def import_layers(tensors: Mapping[str, np.ndarray], prefix: str, cfg: DecoderConfig,
                  layer_ids: list[int], source: str, attn_in_dim: int | None = None
                  ) -> dict[str, np.ndarray]:
    """HF per-layer tensors `{prefix}{i}.…` for `layer_ids` → one stacked Gemma4Group dict."""
    per: dict[str, list[np.ndarray]] = {}
    for i in layer_ids:
        for name, (suffix, shape, field) in _layer_tensors(cfg, i, attn_in_dim).items():
            t = checked_tensor(tensors, f"{prefix}{i}.{suffix}", shape, source, field)
            per.setdefault(name, []).append(_to_ours(name, t, cfg, i))
    return {k: np.stack(v) for k, v in per.items()}


def export_layers(group: Mapping[str, Any], prefix: str, cfg: DecoderConfig,
                  layer_ids: list[int]) -> dict[str, np.ndarray]:
    """Inverse of `import_layers`."""
    out = {}
    for n, i in enumerate(layer_ids):
        for name, (suffix, _, _) in _layer_tensors(cfg, i).items():
            out[f"{prefix}{i}.{suffix}"] = np.ascontiguousarray(
                _to_hf(name, np.asarray(group[name])[n]))
    return out


def import_all_layers(tensors: Mapping[str, np.ndarray], prefix: str, cfg: DecoderConfig,
                      source: str, attn_in_dim: int | None = None) -> dict[str, np.ndarray]:
    """Every layer of `cfg` as one stacked group (a drafter's layers, all the same type)."""
    return import_layers(tensors, prefix, cfg, list(range(cfg.num_hidden_layers)), source,
                         attn_in_dim)


def export_all_layers(group: Mapping[str, Any], prefix: str, cfg: DecoderConfig
                      ) -> dict[str, np.ndarray]:
    """Inverse of `import_all_layers`."""
    return export_layers(group, prefix, cfg, list(range(cfg.num_hidden_layers)))


def _groups(cfg: DecoderConfig) -> list[list[int]]:
    """The layer ids of each period-slot group, in TargetDecoder's `groups` order."""
    return [seg.layer_ids(j) for seg in plan_segments(cfg) for j in range(seg.period)]


def target_layers_from_hf(tensors: Mapping[str, np.ndarray], prefix: str, cfg: DecoderConfig,
                          source: str) -> dict[str, Any]:
    """A Gemma4 checkpoint's layers and per-layer input embeddings under `prefix`
    (`text_prefix`) → a Gemma4 TargetDecoder's `layers` (models/io/hf.py reads the
    embeddings, final norm and LM head)."""
    layers: dict[str, Any] = {
        "groups": {g: import_layers(tensors, f"{prefix}layers.", cfg, ids, source)
                   for g, ids in enumerate(_groups(cfg))}}
    P, Lh = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
    if P:
        Vp = cfg.vocab_size_per_layer_input or cfg.vocab_size
        get = lambda key, shape: checked_tensor(tensors, prefix + key, shape, source,
                                                "hidden_size_per_layer_input")
        layers["ple_embed"] = get("embed_tokens_per_layer.weight", (Vp, Lh * P))
        layers["ple_model_proj"] = get("per_layer_model_projection.weight",
                                       (Lh * P, cfg.hidden_size)).T
        layers["ple_proj_norm"] = get("per_layer_projection_norm.weight", (P,))
    return layers


def target_layers_to_hf(layers: Mapping[str, Any], cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """Inverse of `target_layers_from_hf`, in the Gemma4ForCausalLM layout."""
    out: dict[str, np.ndarray] = {}
    for g, ids in enumerate(_groups(cfg)):
        out.update(export_layers(layers["groups"][g], "model.layers.", cfg, ids))
    if cfg.hidden_size_per_layer_input:
        out["model.embed_tokens_per_layer.weight"] = np.asarray(layers["ple_embed"])
        out["model.per_layer_model_projection.weight"] = np.asarray(layers["ple_model_proj"]).T
        out["model.per_layer_projection_norm.weight"] = np.asarray(layers["ple_proj_norm"])
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
