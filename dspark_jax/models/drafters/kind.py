"""What differs between drafter kinds, as data: one `DrafterKind` record per kind (SPEC §3: DSpark
and DFlash, SPEC §5: Eagle3), the drafters' counterpart of the target `Family`.

A kind is named by `DraftConfig.model_type`. Code that depends on it asks its record —
`drafter_kind(name)` — instead of testing the name. The records themselves are built in
models/drafter_kinds.py, which registers them here when `dspark_jax.models` is imported.

The record covers every layer of the package. What lives in models/ (the NNX module, the config
rules, the checkpoint layouts) it holds directly; the serving adapter (decoding/) and the
training loss (train/) sit in layers above models/, so the record names them by import path
(`Ref`) and each is imported only by the layer that uses it (`adapter_for`, `loss_for`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Mapping

from dspark_jax.models.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Ref:
    """An object named by import path, `module:attribute`, loaded on first use."""

    path: str

    def load(self) -> Any:
        return _load(self.path)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True, eq=False)   # compared and hashed by identity
class DrafterKind:
    """Everything dspark_jax does differently for one drafter kind."""

    name: str                                    # DraftConfig.model_type
    # ---- the model (models/drafters)
    module: type                                 # NNX class (Family.drafter_classes overrides)
    parallel_block: bool                         # one pass drafts γ slots (block conventions,
                                                 #  `Draft.block_logits`, target-layer init)
    sequential_heads: bool                       # may carry the Markov and confidence heads
    layers_field: str                            # DraftConfig field: the draft layer count
    gamma_field: str                             # DraftConfig field `block_size` follows
    init_from_target: bool                       # `train.init_from_target` applies
    # ---- config defaults (train/config_base.py)
    recipe: Callable[..., None]                  # (c.draft, draft_layers=, markov_rank=,
                                                 #  num_anchors=) → DeepSpec's recipe
    # ---- DeepSpec drafter checkpoints (models/io/deepspec.py)
    deepspec_architectures: tuple[str, ...]      # "DSpark" of Qwen3DSparkModel: the first
                                                 #  is written, each is read
    deepspec_aliases: tuple[str, ...]            # whole architecture names read as this kind
    deepspec_fields: tuple[str, ...]             # config.json fields DeepSpec reads
    deepspec_config: Callable[..., dict[str, Any]]  # DraftConfig → those fields' values
    config_from_deepspec: Callable[..., dict[str, Any]]  # (config.json, draft layers, V) →
                                                 #  DraftConfig fields
    tensor_aliases: tuple[tuple[str, str], ...]  # name prefixes read as others
    attn_in_dim: Callable[[Any], int | None]     # layer config → first layer's attention input
    tensor_names: Callable[..., list[str]]       # DraftConfig → names past the shared ones
    pure_from_tensors: Callable[..., dict[str, Any]]  # (cfg, tensors, source) → pure dict part
    tensors_from_pure: Callable[..., dict[str, Any]]  # (cfg, pure) → tensors part
    pruned_vocab_format: str                     # export format holding a draft vocabulary
    # ---- vLLM speculators checkpoints (models/io/speculators.py)
    speculators_exportable: bool
    # ---- serving (decoding/, serving/) and training (train/)
    adapter: Ref                                 # decoding.draft_adapters: drives the round
    loss: Ref                                    # train: a `DrafterLoss` (sums, objective,
                                                 #  metrics)
    default_scheduler: str                       # the scheduler mode it serves with by default


_KINDS: dict[str, DrafterKind] = {}


def register_drafter_kind(kind: DrafterKind) -> DrafterKind:
    """Adds `kind` to the registry (a later record of the same name replaces it)."""
    _KINDS[kind.name] = kind
    return kind


def drafter_kind(name: str) -> DrafterKind:
    """The drafter kind called `name` (ConfigError naming the known ones)."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ConfigError(f"unknown drafter kind (model_type) {name!r}; known: "
                          f"{sorted(_KINDS)}") from None


def drafter_kinds() -> Mapping[str, DrafterKind]:
    """Every registered drafter kind by name, in registration order."""
    return dict(_KINDS)


def kind_by_deepspec_architecture(suffix: str) -> DrafterKind | None:
    """The first kind that reads the DeepSpec architecture `suffix` ("DSpark", "Eagle3", …)."""
    return next((k for k in _KINDS.values() if suffix in k.deepspec_architectures), None)


__all__ = ["DrafterKind", "Ref", "register_drafter_kind", "drafter_kind", "drafter_kinds",
           "kind_by_deepspec_architecture"]
