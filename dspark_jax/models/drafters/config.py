"""Drafter configuration with DeepSpec's field names (SPEC §3–5).

`DraftConfig` holds everything a DSpark / DFlash / Eagle3 drafter needs besides the target's
shape (`target`, a DecoderConfig the draft layers follow). Validation happens at construction
so a bad block size, layer id, rank or mask token fails before anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dspark_jax.models.config import ConfigError, DecoderConfig, family_spec, registered_families
from dspark_jax.models.drafters.kind import DrafterKind, drafter_kind, drafter_kinds

# "deepspec": slot k of the block [x0, M, …, M] predicts position p+k+1 (γ drafts);
# "zlab": z-lab's DFlash, slot k predicts position p+k (slot 0 is the anchor: γ−1 drafts)
BLOCK_CONVENTIONS = ("deepspec", "zlab")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# The drafter's decoder layers are those of a model family (`layer_family`; each family's
# `draft_layer_families` lists what its targets take, the first by default). Llama and Qwen3
# targets: "qwen3", the layers of DeepSpec's Qwen3DSparkModel / Qwen3Eagle3Model, q/k RMSNorm
# included — the only layers DeepSpec, vLLM, SGLang, llama.cpp and speculators build for a
# non-Gemma drafter — or "llama" (no q/k norm), only for reading legacy dspark_jax exports with
# Llama draft layers. Gemma4 targets: "gemma4".
DECAY_CONVENTIONS = ("deepspec", "paper")
# DSpark/DFlash with gradient accumulation (SPEC §4): "deepspec" divides each micro-step's sums by
# that micro-step's Σw (over the whole micro-batch, i.e. all-reduced over the data axis) and
# averages the micro-steps; "global" divides the accumulated sums by one global Σw.
LOSS_NORMALIZATIONS = ("deepspec", "global")
# Eagle3 per-step loss (SPEC §5): "local_mean" divides each sequence's masked sum by its length
# (DeepSpec's masked sum / (B·T) at its one sequence per device) and averages the sequences;
# "pooled" is one valid-token mean Σ 0.8^s·m·CE / Σ 0.8^s·m.
EAGLE3_LOSS_NORMALIZATIONS = ("local_mean", "pooled")


def default_target_layer_ids(num_target_layers: int, n: int = 5) -> tuple[int, ...]:
    """n points evenly spaced from 1 to L_t − 3 (reproduces DeepSpec's Qwen3 lists)."""
    if num_target_layers < 4:
        # tiny targets: spread over the non-final layers
        lo, hi = 0, max(num_target_layers - 2, 0)
    else:
        lo, hi = 1, num_target_layers - 3
    n = min(n, hi - lo + 1)
    if n <= 1:
        return (lo,)
    return tuple(sorted({round(lo + (hi - lo) * i / (n - 1)) for i in range(n)}))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A drafter for a given target. Defaults are DeepSpec's DSpark recipe."""

    target: DecoderConfig
    model_type: str = "dspark"
    block_size: int = 7
    num_draft_layers: int = 5
    target_layer_ids: tuple[int, ...] = ()
    mask_token_id: int = 0
    num_anchors: int = 512
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_alpha: float = 1.0
    confidence_head_with_markov: bool = True
    loss_decay_gamma: float = 4.0
    decay_convention: str = "deepspec"
    block_convention: str = "deepspec"
    ce_loss_alpha: float = 0.1
    l1_loss_alpha: float = 0.9
    loss_normalization: str = "deepspec"
    # Draft vocabulary (EAGLE-3's pruning, for every drafter): the drafter proposes only these
    # target ids (sorted), so training computes draft and target logits over K columns of the
    # frozen LM head instead of V. 0 / (): the full vocabulary (DeepSpec). `draft_vocab` is data,
    # chosen from the training records by data/draft_vocab.py; `draft_vocab_size` is the recipe.
    draft_vocab_size: int = 0
    draft_vocab: tuple[int, ...] = ()
    # the draft layers' family (see above); "" resolves to the target's consumer family
    layer_family: str = ""
    # Eagle3
    ttt_length: int = 7
    step_loss_decay: float = 0.8
    draft_num_hidden_layers: int = 1
    eagle3_loss_normalization: str = "local_mean"

    def __post_init__(self) -> None:
        t = self.target
        if not self.target_layer_ids:
            object.__setattr__(self, "target_layer_ids",
                               default_target_layer_ids(t.num_hidden_layers))
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        ids = self.target_layer_ids

        def bad(field: str, why: str) -> None:
            raise ConfigError(f"draft config field {field!r}: {why}")

        serves = family_spec(t.family).draft_layer_families
        if not self.layer_family:
            object.__setattr__(self, "layer_family", serves[0])
        layer_families = layer_family_names()
        if self.layer_family not in layer_families:
            bad("layer_family", f"{self.layer_family!r} not one of {layer_families}")
        if self.layer_family not in serves:
            bad("layer_family", f"{self.layer_family!r} draft layers cannot serve a "
                f"{t.family} target ({t.family} targets take {' or '.join(serves)} layers)")
        if self.model_type not in drafter_kinds():
            bad("model_type", f"{self.model_type!r} is not one of {tuple(drafter_kinds())}")
        if self.block_size < 1:
            bad("block_size", f"must be ≥ 1, got {self.block_size}")
        if self.num_draft_layers < 1:
            bad("num_draft_layers", f"must be ≥ 1, got {self.num_draft_layers}")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            bad("target_layer_ids", f"must be strictly increasing, got {list(ids)}")
        for i in ids:
            if not -1 <= i < t.num_hidden_layers:
                bad("target_layer_ids", f"id {i} outside [-1, {t.num_hidden_layers - 1}]")
        if ids and ids[-1] == t.num_hidden_layers - 1:
            bad("target_layer_ids", f"the target's last layer ({ids[-1]}) is not allowed: its "
                "Hugging Face hidden state is post-norm")
        if not 0 <= self.mask_token_id < t.vocab_size:
            bad("mask_token_id", f"{self.mask_token_id} outside the vocabulary [0, {t.vocab_size})")
        if self.markov_rank < 0:
            bad("markov_rank", f"must be ≥ 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            bad("markov_head_type", f"{self.markov_head_type!r} not one of {MARKOV_HEAD_TYPES}")
        if self.num_anchors < 1:
            bad("num_anchors", f"must be ≥ 1, got {self.num_anchors}")
        if self.loss_decay_gamma <= 0:
            bad("loss_decay_gamma", "must be > 0")
        if self.decay_convention not in DECAY_CONVENTIONS:
            bad("decay_convention", f"{self.decay_convention!r} not one of {DECAY_CONVENTIONS}")
        if self.block_convention not in BLOCK_CONVENTIONS:
            bad("block_convention", f"{self.block_convention!r} not one of {BLOCK_CONVENTIONS}")
        if self.block_convention == "zlab" and self.block_size < 2:
            bad("block_size", "the zlab convention needs block_size ≥ 2 (slot 0 is the anchor)")
        if self.loss_normalization not in LOSS_NORMALIZATIONS:
            bad("loss_normalization",
                f"{self.loss_normalization!r} not one of {LOSS_NORMALIZATIONS}")
        if self.eagle3_loss_normalization not in EAGLE3_LOSS_NORMALIZATIONS:
            bad("eagle3_loss_normalization",
                f"{self.eagle3_loss_normalization!r} not one of {EAGLE3_LOSS_NORMALIZATIONS}")
        if self.ttt_length < 1:
            bad("ttt_length", "must be ≥ 1")
        object.__setattr__(self, "draft_vocab", tuple(int(i) for i in self.draft_vocab))
        if not 0 <= self.draft_vocab_size <= t.vocab_size:
            bad("draft_vocab_size", f"{self.draft_vocab_size} outside [0, {t.vocab_size}] "
                "(0: the full vocabulary)")
        if self.draft_vocab:
            v = self.draft_vocab
            if len(v) != self.draft_vocab_size:
                bad("draft_vocab", f"{len(v)} ids but draft_vocab_size is "
                    f"{self.draft_vocab_size}")
            if any(b <= a for a, b in zip(v, v[1:])) or v[0] < 0 or v[-1] >= t.vocab_size:
                bad("draft_vocab", f"must be strictly increasing ids in [0, {t.vocab_size})")
        kind = self.kind
        if self.block_size != getattr(self, kind.gamma_field):
            # e.g. Eagle3 drafts ttt_length tokens a round, as DeepSpec's evaluator does
            # (max_proposal_tokens = ttt_length): one number, so no consumer drafts another γ
            object.__setattr__(self, "block_size", getattr(self, kind.gamma_field))
        if not kind.sequential_heads and (self.markov_rank or self.enable_confidence_head):
            # no sequential or confidence head: normalise so round trips are exact
            object.__setattr__(self, "markov_rank", 0)
            object.__setattr__(self, "enable_confidence_head", False)

    # ------------------------------------------------------------------ derived
    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def kind(self) -> DrafterKind:
        """The drafter kind's record (models/drafter_kinds.py)."""
        return drafter_kind(self.model_type)

    @property
    def has_markov(self) -> bool:
        return self.kind.sequential_heads and self.markov_rank > 0

    @property
    def has_confidence(self) -> bool:
        return self.kind.sequential_heads and self.enable_confidence_head

    @property
    def pruned_vocab(self) -> bool:
        """The drafter proposes only `draft_vocab` (resolved ids of a draft_vocab_size < V)."""
        return 0 < self.draft_vocab_size < self.target.vocab_size

    @property
    def num_drafts(self) -> int:
        """Draft tokens per round γ: the block size (DeepSpec convention, Eagle3's chain) or
        block size − 1 under z-lab's convention."""
        if self.kind.parallel_block and self.block_convention == "zlab":
            return self.block_size - 1
        return self.block_size

    def layer_config(self) -> DecoderConfig:
        """The draft layers: the target's shapes in the consumers' family (`layer_family`):
        Qwen3 layers (q/k RMSNorm) for Llama and Qwen3 targets, Gemma4 layers for Gemma4."""
        n = getattr(self, self.kind.layers_field)
        return self.target.draft_layer_config(n, self.layer_family)

    def replace(self, **kw: Any) -> "DraftConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target"] = self.target.to_hf_dict()
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["draft_vocab"] = list(self.draft_vocab)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DraftConfig":
        d = dict(d)
        target = DecoderConfig.from_hf_dict(d.pop("target"), source="draft config target")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown draft config fields {unknown}")
        d["target_layer_ids"] = tuple(d.get("target_layer_ids", ()))
        d["draft_vocab"] = tuple(d.get("draft_vocab", ()))
        return cls(target=target, **d)


def layer_family_names() -> tuple[str, ...]:
    """Every drafter layer family some registered target family takes."""
    names: dict[str, None] = {}
    for fam in registered_families():
        names.update(dict.fromkeys(fam.draft_layer_families))
    return tuple(names)


def validate_against_target(draft: DraftConfig, target: DecoderConfig,
                            source: str = "draft") -> None:
    """A drafter must have been built for this target (vocabulary, width, layer ids)."""
    t = draft.target
    for field in ("vocab_size", "hidden_size"):
        if getattr(t, field) != getattr(target, field):
            raise ConfigError(f"{source} was built for a target with {field}={getattr(t, field)}, "
                              f"but the target has {field}={getattr(target, field)}")
    for i in draft.target_layer_ids:
        if not -1 <= i < target.num_hidden_layers - 1:
            raise ConfigError(f"{source}: target_layer_ids {list(draft.target_layer_ids)} do not "
                              f"fit a target with {target.num_hidden_layers} layers")
