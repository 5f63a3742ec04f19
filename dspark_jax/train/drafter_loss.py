"""What the train step asks of a drafter kind's loss (SPEC §4, §5): a `DrafterLoss`, which its
`DrafterKind.loss` names (models/drafter_kinds.py) — the additive sums over a micro-batch,
the objective's weighted terms and the logged metrics.

`losses.py` holds DSpark's and DFlash's, `eagle3_loss.py` Eagle3's; `step.py` drives any of
them the same way: it accumulates the sums over micro-batches and divides the objective
(Σ coefficient · sums[term]) by `sums["weight"]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from dspark_jax.models.drafters.config import DraftConfig


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """How the step computes the sums (train/step.py `make_loss_sums_fn`)."""

    anchor_chunk: int = 64                # anchors per chunk of the block logits
    max_segments: int = 1                 # the most packed sequences in a row
    attn_key_chunk: int | None = 512      # the drafter attention's memory chunk (None: dense)
    remat: bool = True                    # recompute layers / chunks in the backward pass
    attn_kernel: bool = True              # fused attention kernels where compiled for one


Sums = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class DrafterLoss:
    """One drafter kind's training loss."""

    # (draft module, target taps [B,S,n·d], target final hidden [B,S,D], micro-batch dict,
    #  key, LossOptions) → additive sums, `weight` (Σw) among them
    sums: Callable[[Any, jax.Array, jax.Array, dict[str, jax.Array], jax.Array, LossOptions],
                   Sums]
    # the objective's numerator as (coefficient, sums key) pairs, summed in order
    terms: Callable[[DraftConfig], tuple[tuple[float, str], ...]]
    # (accumulated sums, cfg) → the logged scalars, with DeepSpec's names
    metrics: Callable[[Sums, DraftConfig], dict[str, jax.Array]]

    def objective(self, sums: Sums, cfg: DraftConfig) -> jax.Array:
        """Σ coefficient · sums[term] over `terms(cfg)` (divide by Σw for the loss)."""
        (c0, k0), *rest = self.terms(cfg)
        obj = c0 * sums[k0]
        for c, k in rest:
            obj = obj + c * sums[k]
        return obj


def loss_for(cfg: DraftConfig) -> DrafterLoss:
    """The `DrafterLoss` of `cfg`'s kind (`DrafterKind.loss`)."""
    loss = cfg.kind.loss.load()
    if not isinstance(loss, DrafterLoss):
        raise TypeError(f"drafter kind {cfg.model_type!r}: its loss {loss!r} is not a "
                        "DrafterLoss")
    return loss


__all__ = ["DrafterLoss", "LossOptions", "loss_for"]
