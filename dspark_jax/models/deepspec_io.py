"""DeepSpec checkpoint interop for drafters (SPEC §3, §5; issue: DeepSpec's released checkpoints).

A DeepSpec drafter directory holds `config.json` (architectures `Qwen3DSparkModel` /
`Qwen3Eagle3Model`, the target-shaped fields with `num_hidden_layers` = draft layers, and
`block_size`, `target_layer_ids`, `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`, `mask_token_id`, RoPE) and safetensors with DeepSpec's names.
We read and write exactly that format; our own extra training fields ride along under a
`dspark_jax` key that DeepSpec ignores, so the round trip is exact.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx

from dspark_jax.models.config import ConfigError, DecoderConfig
from dspark_jax.models.draft_config import DraftConfig
from dspark_jax.models.hf_io import (CheckpointError, export_layer_stack, import_layer_stack,
                                     read_config_json, read_safetensors_dir, write_safetensors)

_ARCH = re.compile(r"^(Qwen3|Llama|Gemma4)(DSpark|DFlash|Eagle3)(Model|ForCausalLM)?$")
_FAMILY = {"Qwen3": "qwen3", "Llama": "llama", "Gemma4": "gemma4"}


def _arch_info(raw: Mapping[str, Any], source: str) -> tuple[str, str]:
    for a in raw.get("architectures") or []:
        m = _ARCH.match(a)
        if m:
            family = _FAMILY[m.group(1)]
            return family, m.group(2).lower()
    raise ConfigError(f"{source}: not a DeepSpec drafter (architectures "
                      f"{raw.get('architectures')!r}; expected e.g. Qwen3DSparkModel, "
                      "Qwen3Eagle3Model)")


def draft_config_from_deepspec(raw: Mapping[str, Any], source: str = "config.json",
                               target: DecoderConfig | None = None) -> DraftConfig:
    """DeepSpec config.json → DraftConfig (the target shape comes from `target` if given)."""
    family, kind = _arch_info(raw, source)
    ours = dict(raw.get("dspark_jax") or {})
    if family == "gemma4":
        from dspark_jax.models import gemma4_draft

        layer_shape = gemma4_draft.layer_shape_from_deepspec(raw, source)
        if target is not None:
            gemma4_draft.check_draft_shapes(layer_shape, target, source)
    else:
        shape = dict(raw)
        shape["architectures"] = ["Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM"]
        layer_shape = DecoderConfig.from_hf_dict(shape, source=source)
    n_draft = layer_shape.num_hidden_layers
    ids = tuple(int(i) for i in raw.get("target_layer_ids") or ours.get("target_layer_ids") or ())
    if not ids:
        raise ConfigError(f"{source}: missing required field 'target_layer_ids'")
    if target is not None:
        for field in ("vocab_size", "hidden_size"):
            if getattr(layer_shape, field) != getattr(target, field):
                raise ConfigError(
                    f"{source}: drafter was built for a target with {field}="
                    f"{getattr(layer_shape, field)}, but the target has {getattr(target, field)}")
    else:
        n_target = int(raw.get("num_target_layers") or ours.get("num_target_layers")
                       or max(ids) + 2)
        target = layer_shape.replace(num_hidden_layers=n_target)
        if family == "gemma4":
            target = target.replace(layer_types=("full_attention",) * n_target)
    rank = int(raw.get("markov_rank", 0) or 0)
    conf = bool(raw.get("enable_confidence_head", False))
    model_type = "eagle3" if kind == "eagle3" else ("dspark" if (rank > 0 or conf or kind == "dspark") else "dflash")
    if model_type == "dspark" and rank == 0 and not conf:
        model_type = "dflash"
    fields = dict(
        model_type=model_type,
        block_size=int(raw.get("block_size", ours.get("block_size", 7))),
        target_layer_ids=ids,
        mask_token_id=int(raw.get("mask_token_id", ours.get("mask_token_id", 0))),
        markov_rank=rank,
        markov_head_type=str(raw.get("markov_head_type", "vanilla") or "vanilla"),
        enable_confidence_head=conf,
        confidence_head_with_markov=bool(raw.get("confidence_head_with_markov", True)),
    )
    if model_type == "eagle3":
        fields["draft_num_hidden_layers"] = n_draft
        fields["ttt_length"] = int(raw.get("ttt_length", ours.get("ttt_length", 7)))
        # γ at inference; DeepSpec's Eagle3 checkpoints tie it to the TTT length
        fields["block_size"] = int(raw.get("block_size", raw.get("ttt_length", 7)))
    else:
        fields["num_draft_layers"] = n_draft
    # our training-only fields, if this checkpoint was written by dspark_jax
    for key in ("num_anchors", "confidence_head_alpha", "loss_decay_gamma", "decay_convention",
                "block_convention",
                "ce_loss_alpha", "l1_loss_alpha", "step_loss_decay"):
        if key in ours:
            fields[key] = ours[key]
    return DraftConfig(target=target, **fields)


def deepspec_config_dict(cfg: DraftConfig) -> dict[str, Any]:
    layer_cfg = cfg.layer_config()
    if cfg.target.is_gemma4:
        from dspark_jax.models.gemma4_draft import deepspec_base_config

        hf = deepspec_base_config(cfg)
    else:
        hf = layer_cfg.to_hf_dict()
    prefix = {"qwen3": "Qwen3", "llama": "Llama", "gemma4": "Gemma4"}[cfg.target.family]
    kind = {"dspark": "DSpark", "dflash": "DSpark", "eagle3": "Eagle3"}[cfg.model_type]
    hf["architectures"] = [f"{prefix}{kind}Model"]
    hf.update(
        block_size=cfg.block_size,
        target_layer_ids=list(cfg.target_layer_ids),
        mask_token_id=cfg.mask_token_id,
        markov_rank=cfg.markov_rank if cfg.has_markov else 0,
        markov_head_type=cfg.markov_head_type,
        enable_confidence_head=cfg.has_confidence,
        confidence_head_with_markov=cfg.confidence_head_with_markov,
        num_target_layers=cfg.target.num_hidden_layers,
    )
    if cfg.model_type == "eagle3":
        hf["ttt_length"] = cfg.ttt_length
    hf["dspark_jax"] = {k: v for k, v in cfg.to_dict().items() if k != "target"}
    return hf


# ----------------------------------------------------------------------------- tensors
def _get(tensors: Mapping[str, np.ndarray], key: str, shape: tuple[int, ...], source: str
         ) -> np.ndarray:
    if key not in tensors:
        raise CheckpointError(f"{source}: missing tensor {key!r}")
    t = np.asarray(tensors[key])
    if t.shape != tuple(shape):
        raise CheckpointError(f"{source}: tensor {key!r} has shape {t.shape}, expected {shape}")
    return t


def draft_pure_from_deepspec(cfg: DraftConfig, tensors: Mapping[str, np.ndarray], source: str
                             ) -> dict[str, Any]:
    """DeepSpec tensor names → nested dict matching DSparkDraft / Eagle3Draft."""
    t = cfg.target
    V, D, n = t.vocab_size, t.hidden_size, cfg.num_features
    lc = cfg.layer_config()
    g = lambda k, s: _get(tensors, k, s, source)
    pure: dict[str, Any] = {
        "embed": g("embed_tokens.weight", (V, D)),
        "lm_head": g("lm_head.weight", (V, D)),
        "norm": g("norm.weight", (D,)),
        "fc": g("fc.weight", (D, n * D)).T,
    }
    if cfg.model_type == "eagle3":
        if lc.is_gemma4:
            from dspark_jax.models.gemma4_io import import_layers

            pure["layers"] = import_layers(tensors, "layers.", lc,
                                           list(range(lc.num_hidden_layers)), source,
                                           attn_in_dim=2 * D)
        else:
            pure["layers"] = import_layer_stack(tensors, "layers.", lc.num_hidden_layers, lc,
                                                source, attn_in_dim=2 * D)
        pure["hidden_norm"] = np.stack([g(f"layers.{i}.hidden_norm.weight", (D,))
                                        for i in range(lc.num_hidden_layers)])
        return pure
    pure["hidden_norm"] = g("hidden_norm.weight", (D,))
    if lc.is_gemma4:
        from dspark_jax.models.gemma4_io import import_layers

        pure["layers"] = import_layers(tensors, "layers.", lc, list(range(lc.num_hidden_layers)),
                                       source)
    else:
        pure["layers"] = import_layer_stack(tensors, "layers.", lc.num_hidden_layers, lc, source)
    if cfg.has_markov:
        r = cfg.markov_rank
        mk = {"w1": g("markov_head.markov_w1.weight", (V, r)),
              "w2": g("markov_head.markov_w2.weight", (V, r))}
        if cfg.markov_head_type == "gated":
            mk["gate_w"] = g("markov_head.gate_proj.weight", (r, D + r))
            mk["gate_b"] = g("markov_head.gate_proj.bias", (r,))
        elif cfg.markov_head_type == "rnn":
            mk["joint_w"] = g("markov_head.joint_proj.weight", (3 * r, 2 * r + D))
            mk["joint_b"] = g("markov_head.joint_proj.bias", (3 * r,))
        pure["markov"] = mk
    if cfg.has_confidence:
        width = D + (cfg.markov_rank if cfg.confidence_head_with_markov and cfg.has_markov else 0)
        pure["confidence"] = {"w": g("confidence_head.proj.weight", (1, width)),
                              "b": g("confidence_head.proj.bias", (1,))}
    return pure


def deepspec_tensors_from_pure(cfg: DraftConfig, pure: Mapping[str, Any]) -> dict[str, np.ndarray]:
    to_np = lambda x: np.asarray(jax.device_get(x))
    layers = {k: to_np(v) for k, v in pure["layers"].items()}
    if cfg.target.is_gemma4:
        from dspark_jax.models.gemma4_io import export_layers

        lc = cfg.layer_config()
        layer_tensors = export_layers(layers, "layers.", lc, list(range(lc.num_hidden_layers)))
    else:
        layer_tensors = export_layer_stack(layers, "layers.")
    out = {
        "embed_tokens.weight": to_np(pure["embed"]),
        "lm_head.weight": to_np(pure["lm_head"]),
        "norm.weight": to_np(pure["norm"]),
        "fc.weight": to_np(pure["fc"]).T,
        **layer_tensors,
    }
    if cfg.model_type == "eagle3":
        for i, w in enumerate(to_np(pure["hidden_norm"])):
            out[f"layers.{i}.hidden_norm.weight"] = w
        return {k: np.ascontiguousarray(v) for k, v in out.items()}
    out["hidden_norm.weight"] = to_np(pure["hidden_norm"])
    if "markov" in pure:
        mk = pure["markov"]
        out["markov_head.markov_w1.weight"] = to_np(mk["w1"])
        out["markov_head.markov_w2.weight"] = to_np(mk["w2"])
        names = {"gate_w": "gate_proj.weight", "gate_b": "gate_proj.bias",
                 "joint_w": "joint_proj.weight", "joint_b": "joint_proj.bias"}
        for k, name in names.items():
            if k in mk:
                out[f"markov_head.{name}"] = to_np(mk[k])
    if "confidence" in pure:
        out["confidence_head.proj.weight"] = to_np(pure["confidence"]["w"])
        out["confidence_head.proj.bias"] = to_np(pure["confidence"]["b"])
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def read_deepspec_dir(path: str | os.PathLike, target: DecoderConfig | None = None
                      ) -> tuple[DraftConfig, dict[str, Any]]:
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a DeepSpec drafter directory)")
    raw = read_config_json(path)
    cfg = draft_config_from_deepspec(raw, str(path / "config.json"), target)
    tensors = read_safetensors_dir(path)
    return cfg, draft_pure_from_deepspec(cfg, tensors, str(path))


def write_deepspec_dir(cfg: DraftConfig, state: Any, path: str | os.PathLike) -> pathlib.Path:
    """Exports a drafter (nnx.State or pure dict) in DeepSpec's format, atomically per file."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pure = state if isinstance(state, Mapping) and not isinstance(state, nnx.State) \
        else nnx.to_pure_dict(state)
    write_safetensors(path / "model.safetensors", deepspec_tensors_from_pure(cfg, pure))
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(deepspec_config_dict(cfg), indent=2))
    os.replace(tmp, path / "config.json")
    return path
