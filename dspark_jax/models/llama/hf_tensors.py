"""Llama / Qwen3 Hugging Face tensors ⇄ stacked layer parameters (SPEC §2 targets; the Qwen3
draft layers of DeepSpec's drafter checkpoints, SPEC §3, §5).

Hugging Face keeps one tensor per layer in torch `Linear` layout ([out, in]) under
`{prefix}{i}.self_attn.q_proj.weight`, …; we keep one einsum-layout array per parameter stacked
over the layers (layers.DecoderLayers). A tensor that is missing or has the wrong shape is a
CheckpointError naming the source and the tensor.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dspark_jax.models.config import DecoderConfig
from dspark_jax.models.io.errors import checked_tensor

LAYER_TENSORS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight")
QK_NORM_TENSORS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def _linear_in(w_oi: np.ndarray) -> np.ndarray:
    """torch Linear weight [out, in] → [in, out]."""
    return np.asarray(w_oi).T


def layer_tensor_names(cfg: DecoderConfig, i: int, attn_in_dim: int | None = None) -> list[str]:
    """Hugging Face / DeepSpec tensor names (without the layer prefix) of layer i."""
    return list(LAYER_TENSORS) + (list(QK_NORM_TENSORS) if cfg.qk_norm else [])


def import_layer_stack(tensors: Mapping[str, np.ndarray], prefix: str, num_layers: int,
                       cfg: DecoderConfig, source: str, attn_in_dim: int | None = None
                       ) -> dict[str, np.ndarray]:
    """HF per-layer tensors `{prefix}{i}.…` → our stacked arrays (see layers.DecoderLayers)."""
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    A = attn_in_dim or D

    def get(i: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return checked_tensor(tensors, f"{prefix}{i}.{name}", shape, source)

    F = cfg.intermediate_size
    per: dict[str, list[np.ndarray]] = {n: [] for n in
                                        ("input_norm", "wq", "wk", "wv", "wo", "post_norm",
                                         "w_gate", "w_up", "w_down")}
    if cfg.qk_norm:
        per["q_norm"], per["k_norm"] = [], []
    for i in range(num_layers):
        per["input_norm"].append(get(i, "input_layernorm.weight", (D,)))
        per["wq"].append(_linear_in(get(i, "self_attn.q_proj.weight", (N * H, A))).reshape(A, N, H))
        per["wk"].append(_linear_in(get(i, "self_attn.k_proj.weight", (K * H, A))).reshape(A, K, H))
        per["wv"].append(_linear_in(get(i, "self_attn.v_proj.weight", (K * H, A))).reshape(A, K, H))
        per["wo"].append(_linear_in(get(i, "self_attn.o_proj.weight", (D, N * H))).reshape(N, H, D))
        if cfg.qk_norm:
            per["q_norm"].append(get(i, "self_attn.q_norm.weight", (H,)))
            per["k_norm"].append(get(i, "self_attn.k_norm.weight", (H,)))
        per["post_norm"].append(get(i, "post_attention_layernorm.weight", (D,)))
        per["w_gate"].append(_linear_in(get(i, "mlp.gate_proj.weight", (F, D))))
        per["w_up"].append(_linear_in(get(i, "mlp.up_proj.weight", (F, D))))
        per["w_down"].append(_linear_in(get(i, "mlp.down_proj.weight", (D, F))))
    return {k: np.stack(v) for k, v in per.items()}


def export_layer_stack(stack: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Inverse of `import_layer_stack`."""
    out: dict[str, np.ndarray] = {}
    L = stack["wq"].shape[0]
    for i in range(L):
        A, N, H = stack["wq"][i].shape
        K = stack["wk"][i].shape[1]
        D = stack["wo"][i].shape[-1]
        p = f"{prefix}{i}."
        out[p + "input_layernorm.weight"] = stack["input_norm"][i]
        out[p + "self_attn.q_proj.weight"] = stack["wq"][i].reshape(A, N * H).T
        out[p + "self_attn.k_proj.weight"] = stack["wk"][i].reshape(A, K * H).T
        out[p + "self_attn.v_proj.weight"] = stack["wv"][i].reshape(A, K * H).T
        out[p + "self_attn.o_proj.weight"] = stack["wo"][i].reshape(N * H, D).T
        if "q_norm" in stack:
            out[p + "self_attn.q_norm.weight"] = stack["q_norm"][i]
            out[p + "self_attn.k_norm.weight"] = stack["k_norm"][i]
        out[p + "post_attention_layernorm.weight"] = stack["post_norm"][i]
        out[p + "mlp.gate_proj.weight"] = stack["w_gate"][i].T
        out[p + "mlp.up_proj.weight"] = stack["w_up"][i].T
        out[p + "mlp.down_proj.weight"] = stack["w_down"][i].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def import_all_layers(tensors: Mapping[str, np.ndarray], prefix: str, cfg: DecoderConfig,
                  source: str, attn_in_dim: int | None = None) -> dict[str, np.ndarray]:
    """Every layer of `cfg` (`import_layer_stack` over cfg.num_hidden_layers)."""
    return import_layer_stack(tensors, prefix, cfg.num_hidden_layers, cfg, source, attn_in_dim)


def export_all_layers(stack: Mapping[str, np.ndarray], prefix: str, cfg: DecoderConfig
                  ) -> dict[str, np.ndarray]:
    return export_layer_stack(stack, prefix)


def target_prefix(tensors: Mapping[str, np.ndarray], source: str) -> str:
    """The checkpoint's decoder prefix: always `model.` (no multimodal Llama / Qwen3)."""
    return "model."


def target_layers_from_hf(tensors: Mapping[str, np.ndarray], prefix: str, cfg: DecoderConfig,
                          source: str) -> dict[str, np.ndarray]:
    """A LlamaForCausalLM / Qwen3ForCausalLM checkpoint's layers → TargetDecoder's `layers`
    (models/io/hf.py reads the embeddings, final norm and LM head)."""
    return import_layer_stack(tensors, f"{prefix}layers.", cfg.num_hidden_layers, cfg, source)


def target_layers_to_hf(layers: Mapping[str, Any], cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """Inverse of `target_layers_from_hf` (numpy arrays in, the LlamaForCausalLM layout out)."""
    return export_layer_stack({k: np.asarray(v) for k, v in layers.items()}, "model.layers.")
