"""The models of an offline evaluation: the target, the drafter and the tokenizer, loaded where
`EvalConfig` names them by path, checked against each other, with the labels results.json gives
them and the cache limit of the run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dspark_jax.eval.eval_config import EvalConfig

__all__ = ["EvalModels", "load_models", "check_dtype"]


@dataclasses.dataclass(frozen=True)
class EvalModels:
    """The run's target, drafter and tokenizer, the labels results.json gives them, and the
    cache limit in tokens."""

    target: Any
    draft: Any
    tokenizer: Any
    target_label: str
    draft_label: str
    limit: int

    @property
    def gamma(self) -> int:
        return int(self.draft.config.num_drafts)

    @property
    def draft_type(self) -> str:
        return self.draft.config.model_type

    @property
    def has_conf(self) -> bool:
        return bool(self.draft.config.has_confidence)


def check_dtype(target: Any, dtype: str | None) -> None:
    """ValueError when `dtype` is given and is not the loaded `target`'s compute dtype."""
    if dtype is None:
        return
    import jax.numpy as jnp

    from dspark_jax.models.target import resolve_dtype

    have = jnp.dtype(target.dtype)
    if jnp.dtype(resolve_dtype(dtype)) != have:
        raise ValueError(f"dtype={dtype!r}, but the loaded target computes in {have.name}: pass "
                         "dtype=None (or the target's dtype) with a loaded target, or the "
                         "target's name or directory to load it in another dtype")


def load_models(config: EvalConfig) -> EvalModels:
    """Loads what is not loaded yet; ConfigError for a drafter built for another target,
    ValueError for a conflicting dtype, a missing tokenizer or a cache limit below 2."""
    from dspark_jax.models import Draft, Target, load_draft, load_target
    from dspark_jax.serving.generation import check_compatible

    target, draft, dtype = config.target, config.draft, config.dtype
    target_label = str(target) if not isinstance(target, Target) else (target.name or "target")
    loaded_here = not isinstance(target, Target)
    if loaded_here:
        target = load_target(target, dtype="float32" if dtype is None else dtype)
    else:
        check_dtype(target, dtype)
    draft_label = "draft"
    if not isinstance(draft, Draft):
        draft_label = str(draft)
        draft = load_draft(draft, target=target)
    check_compatible(target, draft)  # ConfigError before any work
    if loaded_here:   # decode in one layout, the stacked layers released (weights held once)
        target = target.decoding_layout()
    if draft_label == "draft":
        draft_label = draft.config.model_type
    tok = config.tokenizer if config.tokenizer is not None else target.tokenizer
    if tok is None:
        raise ValueError("the target has no tokenizer (a directory without tokenizer.json?); "
                         "pass tokenizer=")
    limit = int(config.max_cache_len if config.max_cache_len is not None
                else target.config.max_position_embeddings)
    if limit < 2:
        raise ValueError(f"max_cache_len must be ≥ 2, got {limit}")
    return EvalModels(target=target, draft=draft, tokenizer=tok, target_label=target_label,
                      draft_label=draft_label, limit=limit)
