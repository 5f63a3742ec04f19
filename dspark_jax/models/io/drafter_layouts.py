"""The two DeepSpec drafter checkpoint layouts (SPEC §3, §5), as the parts a `DrafterKind`
record names: the config.json fields, tensor names and tensors each kind adds to what every
drafter shares (embeddings, LM head, final norm, `fc` and the draft layers, which
models/io/deepspec.py writes and reads).

- `block_*`: DeepSpec's Qwen3DSparkModel (DSpark and DFlash): one `hidden_norm`, the Markov head
  `markov_head.*` and the confidence head `confidence_head.proj.*` when present.
- `chain_*`: DeepSpec's Qwen3Eagle3Model: a `hidden_norm` in every layer, whose first attention
  reads 2·D (the token embedding beside the fused features).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from dspark_jax.models.config import DecoderConfig
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.io.errors import checked_tensor

# config.json fields DeepSpec's Qwen3DSparkModel.__init__ / build_draft_config / the DSpark
# evaluator read (besides the Qwen3 shape), and those it writes only in some cases
DSPARK_FIELDS = ("num_target_layers", "block_size", "target_layer_ids", "mask_token_id",
                 "num_anchors", "enable_confidence_head", "markov_rank")
DSPARK_IF_MARKOV = ("markov_head_type",)                 # markov_rank > 0
DSPARK_IF_CONFIDENCE = ("confidence_head_with_markov",)  # enable_confidence_head
# … Qwen3Eagle3Model.__init__ / build_draft_config / the Eagle3 evaluator
EAGLE3_FIELDS = ("num_target_layers", "target_layer_ids", "ttt_length", "step_loss_decay",
                 "draft_num_hidden_layers")

_MARKOV_EXTRA = {"gated": "gate_proj", "rnn": "joint_proj"}
_MARKOV_PURE = {"gate_w": "gate_proj.weight", "gate_b": "gate_proj.bias",
                "joint_w": "joint_proj.weight", "joint_b": "joint_proj.bias"}


def _np(x: Any) -> np.ndarray:
    return np.asarray(jax.device_get(x))


# ----------------------------------------------------------------------------- block drafters
def block_deepspec_config(cfg: DraftConfig) -> dict[str, Any]:
    hf: dict[str, Any] = dict(block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                              num_anchors=cfg.num_anchors,
                              enable_confidence_head=cfg.has_confidence,
                              markov_rank=cfg.markov_rank if cfg.has_markov else 0)
    if cfg.has_markov:
        hf["markov_head_type"] = cfg.markov_head_type
    if cfg.has_confidence:
        hf["confidence_head_with_markov"] = cfg.confidence_head_with_markov and cfg.has_markov
    return hf


def block_model_type(markov_rank: int, confidence_head: bool) -> str:
    """DSpark with a Markov or confidence head, else DFlash (their checkpoints are written
    alike: DeepSpec's and speculators' DSpark layout)."""
    return "dspark" if (markov_rank > 0 or confidence_head) else "dflash"


def block_config_from_deepspec(raw: Mapping[str, Any], n_draft: int, vocab_size: int
                               ) -> dict[str, Any]:
    del vocab_size
    rank = int(raw.get("markov_rank", 0) or 0)
    conf = bool(raw.get("enable_confidence_head", False))
    return dict(model_type=block_model_type(rank, conf),
                num_draft_layers=n_draft, block_size=int(raw.get("block_size", 7)),
                mask_token_id=int(raw.get("mask_token_id", 0)),
                num_anchors=int(raw.get("num_anchors", 512)), markov_rank=rank,
                markov_head_type=str(raw.get("markov_head_type") or "vanilla"),
                enable_confidence_head=conf,
                confidence_head_with_markov=bool(raw.get("confidence_head_with_markov", True)))


def block_tensor_names(cfg: DraftConfig) -> list[str]:
    names = ["hidden_norm.weight"]
    if cfg.has_markov:
        names += ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
        extra = _MARKOV_EXTRA.get(cfg.markov_head_type)
        if extra:
            names += [f"markov_head.{extra}.weight", f"markov_head.{extra}.bias"]
    if cfg.has_confidence:
        names += ["confidence_head.proj.weight", "confidence_head.proj.bias"]
    return names


def block_pure_from_tensors(cfg: DraftConfig, tensors: Mapping[str, np.ndarray], source: str
                            ) -> dict[str, Any]:
    V, D = cfg.target.vocab_size, cfg.target.hidden_size
    g = lambda k, s: checked_tensor(tensors, k, s, source)  # noqa: E731
    pure: dict[str, Any] = {"hidden_norm": g("hidden_norm.weight", (D,))}
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


def block_tensors_from_pure(cfg: DraftConfig, pure: Mapping[str, Any]) -> dict[str, np.ndarray]:
    del cfg
    out = {"hidden_norm.weight": _np(pure["hidden_norm"])}
    if "markov" in pure:
        mk = pure["markov"]
        out["markov_head.markov_w1.weight"] = _np(mk["w1"])
        out["markov_head.markov_w2.weight"] = _np(mk["w2"])
        for k, name in _MARKOV_PURE.items():
            if k in mk:
                out[f"markov_head.{name}"] = _np(mk[k])
    if "confidence" in pure:
        out["confidence_head.proj.weight"] = _np(pure["confidence"]["w"])
        out["confidence_head.proj.bias"] = _np(pure["confidence"]["b"])
    return out


def no_attn_in_dim(layer_cfg: DecoderConfig) -> None:
    """The draft layers' attention reads the hidden state itself."""
    return None


# ----------------------------------------------------------------------------- chain drafters
def chain_deepspec_config(cfg: DraftConfig) -> dict[str, Any]:
    hf: dict[str, Any] = dict(ttt_length=cfg.ttt_length, step_loss_decay=cfg.step_loss_decay,
                              draft_num_hidden_layers=cfg.draft_num_hidden_layers)
    if cfg.pruned_vocab:       # EAGLE-3's layout (models/io/deepspec.py)
        hf["draft_vocab_size"] = cfg.draft_vocab_size
    return hf


def chain_config_from_deepspec(raw: Mapping[str, Any], n_draft: int, vocab_size: int
                               ) -> dict[str, Any]:
    ttt = int(raw.get("ttt_length", 7))
    # EAGLE-3's key (= V: the full vocabulary); the ids are d2t's (deepspec.canonical_tensors)
    k = int(raw.get("draft_vocab_size") or 0)
    return dict(model_type="eagle3", ttt_length=ttt,
                step_loss_decay=float(raw.get("step_loss_decay", 0.8)),
                draft_num_hidden_layers=int(raw.get("draft_num_hidden_layers", n_draft)),
                block_size=ttt, markov_rank=0, enable_confidence_head=False,
                draft_vocab_size=k if k != vocab_size else 0)


def chain_attn_in_dim(layer_cfg: DecoderConfig) -> int:
    """The first attention reads [embedding, fused features]: 2·D."""
    return 2 * layer_cfg.hidden_size


def chain_tensor_names(cfg: DraftConfig) -> list[str]:
    return [f"layers.{i}.hidden_norm.weight"
            for i in range(cfg.layer_config().num_hidden_layers)]


def chain_pure_from_tensors(cfg: DraftConfig, tensors: Mapping[str, np.ndarray], source: str
                            ) -> dict[str, Any]:
    D = cfg.target.hidden_size
    return {"hidden_norm": np.stack([
        checked_tensor(tensors, f"layers.{i}.hidden_norm.weight", (D,), source)
        for i in range(cfg.layer_config().num_hidden_layers)])}


def chain_tensors_from_pure(cfg: DraftConfig, pure: Mapping[str, Any]) -> dict[str, np.ndarray]:
    del cfg
    return {f"layers.{i}.hidden_norm.weight": w for i, w in enumerate(_np(pure["hidden_norm"]))}
