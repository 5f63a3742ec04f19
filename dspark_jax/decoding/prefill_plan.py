"""How a batch of joining prompts is prefilled (host-side planning, SPEC §1's plain decoding
and §9's serving engine alike): the padded token length of a prefill group and the split of
the prompts into length groups that computes the fewest padded tokens. Used by the serving
engine's joins and by `autoregressive_generate`; the device side is `models.decoder.prefill`
plus `KVCache.put_rows`."""

from __future__ import annotations

from typing import Sequence


def round_up(x: int, m: int) -> int:
    return ((x + m - 1) // m) * m


def prefill_length(longest: int, len_bucket: int, chunk: int, cache_len: int) -> int:
    """Token length P a prefill group of prompts up to `longest` tokens is padded to: a
    `len_bucket` multiple (at most the cache's length), a `chunk` multiple past `chunk`."""
    P = min(round_up(longest, len_bucket), cache_len)
    return round_up(P, chunk) if P > chunk else P


def prefill_groups(lengths: Sequence[int], max_rows: int, len_bucket: int, chunk: int,
                   cache_len: int, group_tokens: int = 64) -> list[list[int]]:
    """The joining prompts (indices into `lengths`) split into prefill groups of at most
    `max_rows`, each padded to a power-of-two rows × `prefill_length` tokens: the split of the
    length-sorted prompts that computes the fewest padded tokens, a group counting
    `group_tokens` more (its device call). One group of everything pads every prompt to the
    longest (16 chat prompts of 41-308 tokens: 5,120 tokens for 1,305); this pays ~1,900."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best, cut = [0] + [None] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        P = prefill_length(lengths[order[j - 1]], len_bucket, chunk, cache_len)
        for i in range(max(0, j - max_rows), j):
            cost = best[i] + (1 << (j - i - 1).bit_length()) * P + group_tokens
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


__all__ = ["round_up", "prefill_length", "prefill_groups"]
