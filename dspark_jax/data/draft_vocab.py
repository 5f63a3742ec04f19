"""Choosing a pruned draft vocabulary from the training records (EAGLE-3's draft vocabulary,
used here for the DSpark / DFlash block drafter; `DraftConfig.draft_vocab`).

The drafter may only propose K of the target's V ids. Which K: the tokens the drafter is trained
to predict, most frequent first — the assistant (loss-masked) tokens of the training records —
then tokens of the prompts, then the lowest remaining ids (byte-level BPE numbers its merges
roughly by frequency), plus ids that must always be proposable (the stop tokens). Speculative
decoding stays lossless for any K (a token outside it is simply never drafted: the target's
correction supplies it); K trades the training step's LM-head cost (∝ K) against the share of
target tokens the drafter can propose at all, which `coverage` measures on held-out records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np


def _counts(records: Iterable[Mapping[str, np.ndarray]], vocab_size: int, loss: bool
            ) -> np.ndarray:
    out = np.zeros(vocab_size, np.int64)
    for r in records:
        ids = np.asarray(r["input_ids"])
        m = np.asarray(r["loss_mask"]).astype(bool)
        out += np.bincount(ids[m if loss else ~m], minlength=vocab_size)[:vocab_size]
    return out


def choose_draft_vocab(records: Sequence[Mapping[str, np.ndarray]], size: int, vocab_size: int,
                       always: Iterable[int] = ()) -> tuple[int, ...]:
    """The `size` target ids (sorted) a pruned drafter proposes: `always` first, then assistant
    tokens of `records` by count (ties: lower id), then prompt tokens by count, then the lowest
    remaining ids. Deterministic in the records, so a resumed run chooses the same ids."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} outside [1, {vocab_size}]")
    always = sorted({int(i) for i in always})
    if any(not 0 <= i < vocab_size for i in always):
        raise ValueError(f"always-included ids {always} outside [0, {vocab_size})")
    if len(always) > size:
        raise ValueError(f"{len(always)} always-included ids do not fit a draft vocabulary of "
                         f"{size}")
    resp, prompt = _counts(records, vocab_size, True), _counts(records, vocab_size, False)
    ids = np.arange(vocab_size)
    # one stable ordering: always-included, then (response count, prompt count) descending, id
    pinned = np.zeros(vocab_size, bool)
    pinned[always] = True
    order = np.lexsort((ids, -prompt, -resp, ~pinned))
    return tuple(int(i) for i in np.sort(order[:size]))


def coverage(records: Iterable[Mapping[str, np.ndarray]], draft_vocab: Sequence[int],
             vocab_size: int) -> float:
    """Share of the assistant (loss-masked) tokens of `records` inside the draft vocabulary."""
    counts = _counts(records, vocab_size, True)
    total = int(counts.sum())
    if total == 0:
        return float("nan")
    return float(counts[np.asarray(draft_vocab, np.int64)].sum() / total)
