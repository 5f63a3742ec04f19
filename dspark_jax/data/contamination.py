"""N-gram overlap filter between training prompts and evaluation benchmarks (SPEC §6: the
benchmarks measure acceptance on prompts the drafter never trained on).

Text is normalised to lower-case word tokens (runs of letters/digits); a training prompt is
contaminated when any of its word n-grams (default n = 13, the usual decontamination length)
occurs in any turn of any evaluation file; evaluation turns shorter than n words are matched
whole (`EvalIndex`), so short benchmark prompts are caught too without dropping every training
prompt that shares a few common words with one.
Every `*.jsonl` file of the evaluation directory is read in DeepSpec's `{"turns": [...]}`
format (all turns), sorted by name; the result is deterministic and keeps the input order.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from dspark_jax.data.prompts import Conversation, list_eval_datasets, read_eval_file

DEFAULT_N = 13
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> Iterable[tuple[str, ...]]:
    return (tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


@dataclasses.dataclass(frozen=True)
class FilterReport:
    """What `filter_contaminated` did: per evaluation file, how many prompts it matched."""

    kept: int
    dropped: int
    n: int
    eval_files: tuple[str, ...]
    dropped_by_file: dict[str, int]
    dropped_ids: tuple[str, ...]

    def summary(self) -> str:
        per = ", ".join(f"{k}: {v}" for k, v in self.dropped_by_file.items() if v) or "none"
        return (f"contamination filter ({self.n}-grams vs {len(self.eval_files)} eval files): "
                f"dropped {self.dropped}, kept {self.kept} (by file: {per})")


class EvalIndex:
    """The n-grams of every turn of every evaluation file in a directory, plus its short turns.

    A text matches when (a) one of its n-grams is an n-gram of an evaluation turn, (b) it
    contains a whole evaluation turn of at least n/2 (but fewer than n) words, or (c) its word
    sequence equals an evaluation turn (any length: "Write a poem." drops only that prompt).
    """

    def __init__(self, eval_dir: str | os.PathLike[str], n: int = DEFAULT_N):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"contamination filter: n must be a positive integer, got {n!r}")
        eval_dir = Path(eval_dir)
        if not eval_dir.is_dir():
            raise FileNotFoundError(f"contamination filter: evaluation directory {eval_dir} "
                                    "does not exist")
        names = list_eval_datasets(eval_dir)
        if not names:
            raise FileNotFoundError(f"contamination filter: no *.jsonl evaluation files in {eval_dir}")
        self.n = n
        self.files = tuple(names)
        self._grams: dict[tuple[str, ...], str] = {}          # n-gram → first file holding it
        self._whole: dict[tuple[str, ...], str] = {}          # every turn, whole
        self._short: dict[int, dict[tuple[str, ...], str]] = {}  # turns of n/2 ≤ m < n words
        for name in names:
            for conv in read_eval_file(eval_dir / f"{name}.jsonl", name=name, first_turn_only=False):
                for m in conv.messages:
                    toks = words(m["content"])
                    self._whole.setdefault(tuple(toks), name)
                    if (n + 1) // 2 <= len(toks) < n:
                        self._short.setdefault(len(toks), {}).setdefault(tuple(toks), name)
                    for g in ngrams(toks, n):
                        self._grams.setdefault(g, name)

    def match(self, text: str) -> str | None:
        """The evaluation file a text overlaps with, or None."""
        toks = words(text)
        if not toks:
            return None
        hit = self._whole.get(tuple(toks))
        if hit is not None:
            return hit
        for g in ngrams(toks, self.n):
            hit = self._grams.get(g)
            if hit is not None:
                return hit
        for m, table in sorted(self._short.items()):
            for g in ngrams(toks, m):
                hit = table.get(g)
                if hit is not None:
                    return hit
        return None


def filter_contaminated(conversations: Sequence[Conversation], eval_dir: str | os.PathLike[str],
                        n: int = DEFAULT_N) -> tuple[list[Conversation], FilterReport]:
    """Drops conversations any of whose user/system turns overlaps an evaluation file."""
    index = EvalIndex(eval_dir, n)
    kept: list[Conversation] = []
    dropped_ids: list[str] = []
    by_file = {name: 0 for name in index.files}
    for conv in conversations:
        hit = None
        for m in conv.messages:
            if m["role"] != "assistant":
                hit = index.match(m["content"])
                if hit is not None:
                    break
        if hit is None:
            kept.append(conv)
        else:
            by_file[hit] += 1
            dropped_ids.append(conv.id)
    return kept, FilterReport(kept=len(kept), dropped=len(dropped_ids), n=n,
                              eval_files=index.files, dropped_by_file=by_file,
                              dropped_ids=tuple(dropped_ids))


__all__ = ["DEFAULT_N", "EvalIndex", "FilterReport", "filter_contaminated", "words", "ngrams"]
