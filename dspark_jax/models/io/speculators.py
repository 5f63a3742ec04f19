"""vLLM's `speculators` checkpoint format for DSpark / DFlash drafters (SPEC §3).

What `speculators==0.9.0`'s `DSparkDraftModel` saves and loads, and what vLLM's DSpark path and
llama.cpp's `DSparkModel` converter read:

config.json
    `speculators_model_type: "dspark"`, `architectures: ["DSparkDraftModel"]`,
    `transformer_layer_config` (the draft layers' Qwen3 config), `draft_vocab_size`,
    `aux_hidden_state_layer_ids` (hidden-state indices, counted from 1: DeepSpec's
    `target_layer_ids` + 1), `block_size`, `mask_token_id`, `sample_from_anchor` (True: DeepSpec's
    block convention, slot k predicts p+k+1), `markov_rank`, `markov_head_type`,
    `enable_confidence_head`, `confidence_head_with_markov`, and `speculators_config` (the
    proposal method and the verifier: the target's name or directory and architecture).
    Our exact DraftConfig fields ride along under `dspark_jax` (ignored by the others).
tensors
    DeepSpec's names without a prefix (`layers.N.…` with q/k norms, `norm`, `fc`, `hidden_norm`,
    `markov_head.*`, `confidence_head.proj.*`, `embed_tokens`), and for a draft vocabulary of K
    ids: `lm_head.weight` [K, D] (the rows of those ids, in increasing id order),
    `markov_head.markov_w2.weight` [K, r] (the Markov bias over the same K logits; `markov_w1`
    keeps V rows: the previous token is any target id), `d2t` int64 [K] with
    target_id = draft_id + d2t[draft_id], and `t2d` bool [V] marking the K ids.

So a draft-vocabulary drafter travels faithfully: the consumer proposes from exactly the K ids
with exactly our logits over them. Reading maps it back (ids = arange(K) + d2t; the rows of
other ids are zero, and decoding masks them to probability 0 as it always does). The d2t / t2d
convention, its writer and its checked reader are models/io/deepspec.py's (EAGLE-3's, shared by
its Eagle3 export).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Callable, Mapping

import numpy as np
from flax import nnx

from dspark_jax.models.config import ConfigError, DecoderConfig
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.families import family
from dspark_jax.models.io.drafter_layouts import block_model_type
from dspark_jax.models.io.deepspec import (canonical_tensors, deepspec_tensors_from_pure,
                                           draft_pure_from_deepspec, draft_vocab_tensors,
                                           write_json_atomic)
from dspark_jax.models.io.errors import CheckpointError, ExportError
from dspark_jax.models.io.hf import read_safetensors_dir, write_safetensors

SPECULATORS_VERSION = "0.9.0"
MODEL_TYPE = "dspark"
LAYER_FAMILY = "qwen3"      # DSparkDraftModel's layers (speculators, vLLM, llama.cpp)


def is_speculators_config(raw: Mapping[str, Any]) -> bool:
    return "speculators_model_type" in raw


def check_exportable(cfg: DraftConfig) -> None:
    """The drafters this format holds and its consumers (vLLM, llama.cpp) run; `ExportError`
    naming the field otherwise."""
    if not cfg.kind.speculators_exportable:
        arch = family(cfg.layer_family).deepspec_prefix + cfg.kind.deepspec_architectures[0]
        raise ExportError(f"model_type: {cfg.model_type!r} drafters export with --format "
                          f"deepspec ({arch}Model; with a draft vocabulary, the "
                          f"{cfg.kind.pruned_vocab_format!r} layout); the speculators export "
                          "writes DSpark/DFlash")
    if cfg.layer_family != LAYER_FAMILY:
        raise ExportError(f"layer_family: {cfg.layer_family!r} draft layers; speculators' "
                          "DSpark drafter (and vLLM's, llama.cpp's) has Qwen3 layers only")
    if cfg.has_markov and cfg.markov_head_type != "vanilla":
        raise ExportError(f"markov_head_type: {cfg.markov_head_type!r}; vLLM and llama.cpp run "
                          "only the vanilla Markov head (export --format deepspec keeps it)")
    if cfg.block_convention != "deepspec":
        raise ExportError(f"block_convention: {cfg.block_convention!r}; the speculators export "
                          "writes DeepSpec's convention (sample_from_anchor)")


def speculators_config_dict(cfg: DraftConfig, verifier: str | None = None,
                            verifier_architecture: str | None = None) -> dict[str, Any]:
    layer = cfg.layer_config().to_hf_dict()
    n = cfg.num_draft_layers
    layer.pop("architectures", None)
    layer.update(tie_word_embeddings=False, attention_dropout=0.0,
                 layer_types=["full_attention"] * n, use_sliding_window=False,
                 sliding_window=None, max_window_layers=n)
    k = cfg.draft_vocab_size if cfg.pruned_vocab else cfg.target.vocab_size
    arch = verifier_architecture or family(cfg.target.family).hf_architectures[0]
    out = {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": k,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,
        "markov_rank": cfg.markov_rank if cfg.has_markov else 0,
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.has_confidence,
        "confidence_head_with_markov": bool(cfg.has_confidence and cfg.has_markov
                                            and cfg.confidence_head_with_markov),
        "tie_word_embeddings": False,
        "dtype": "float32",
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": cfg.num_drafts,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [arch]},
        },
    }
    out["dspark_jax"] = cfg.to_dict()          # every field, the target's shape included
    return out


def speculators_tensors(cfg: DraftConfig, pure: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """DeepSpec's tensors with the draft vocabulary's rows selected and d2t / t2d added."""
    return draft_vocab_tensors(cfg, deepspec_tensors_from_pure(cfg, pure))


def write_speculators_dir(cfg: DraftConfig, state: Any, path: str | os.PathLike,
                          verifier: str | None = None,
                          progress: Callable[[str, int, int], None] | None = None
                          ) -> pathlib.Path:
    """Exports a DSpark/DFlash drafter in speculators' format (each file atomically);
    `progress(name, nbytes, total_bytes)` follows each tensor written (`write_safetensors`)."""
    check_exportable(cfg)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pure = state if isinstance(state, Mapping) and not isinstance(state, nnx.State) \
        else nnx.to_pure_dict(state)
    tensors = speculators_tensors(cfg, pure)
    write_safetensors(path / "model.safetensors", tensors, progress=progress)
    write_json_atomic(path / "config.json", speculators_config_dict(cfg, verifier))
    return path


def draft_config_from_speculators(raw: Mapping[str, Any], source: str,
                                  target: DecoderConfig | None = None) -> DraftConfig:
    if raw.get("speculators_model_type") != MODEL_TYPE:
        raise ConfigError(f"{source}: speculators_model_type "
                          f"{raw.get('speculators_model_type')!r}; dspark_jax reads 'dspark'")
    ours = dict(raw.get("dspark_jax") or {})
    layer = dict(raw.get("transformer_layer_config") or {})
    if not layer:
        raise ConfigError(f"{source}: missing required field 'transformer_layer_config'")
    layer.setdefault("model_type", "qwen3")
    shape = DecoderConfig.from_hf_dict(layer, source=f"{source} transformer_layer_config")
    if "target" in ours:
        tcfg = DecoderConfig.from_hf_dict(ours.pop("target"), source=f"{source} dspark_jax.target")
    else:
        aux = [int(i) for i in raw.get("aux_hidden_state_layer_ids") or ()]
        tcfg = shape.replace(family="llama" if layer["model_type"] == "llama" else "qwen3",
                             num_hidden_layers=max(aux) + 1 if aux else 2)
    target = target or tcfg
    if ours:
        known = {f for f in DraftConfig.__dataclass_fields__ if f != "target"}
        unknown = sorted(set(ours) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown fields {unknown} under 'dspark_jax'")
        for k in ("target_layer_ids", "draft_vocab"):
            ours[k] = tuple(ours.get(k) or ())
        return DraftConfig(target=target, **ours)
    rank = int(raw.get("markov_rank") or 0)
    conf = bool(raw.get("enable_confidence_head", False))
    return DraftConfig(
        target=target, model_type=block_model_type(rank, conf),
        num_draft_layers=shape.num_hidden_layers, block_size=int(raw["block_size"]),
        target_layer_ids=tuple(int(i) - 1 for i in raw["aux_hidden_state_layer_ids"]),
        mask_token_id=int(raw["mask_token_id"]), markov_rank=rank,
        markov_head_type=str(raw.get("markov_head_type") or "vanilla"),
        enable_confidence_head=conf,
        confidence_head_with_markov=bool(raw.get("confidence_head_with_markov", True)),
        # the ids come from d2t (read_speculators_dir); K = V is the full vocabulary
        draft_vocab_size=0)


def read_speculators_dir(path: str | os.PathLike, target: DecoderConfig | None = None
                         ) -> tuple[DraftConfig, dict[str, Any]]:
    """A speculators-format drafter → (DraftConfig, pure dict for DSparkDraft)."""
    path = pathlib.Path(path)
    raw = json.loads((path / "config.json").read_text())
    source = str(path / "config.json")
    cfg = draft_config_from_speculators(raw, source, target)
    t = read_safetensors_dir(path)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name not in t:
            raise CheckpointError(f"{path}: missing tensor {name!r} (dspark_jax reads "
                                  "self-contained speculators exports; pass the target's "
                                  "embeddings by exporting with dspark_jax)")
    cfg, t = canonical_tensors(cfg, t, str(path))      # the draft vocabulary from d2t / t2d
    return cfg, draft_pure_from_deepspec(cfg, t, str(path))
