"""How a batch of joining prompts is prefilled (host-side planning, SPEC §1's plain decoding
and §9's serving engine alike): the padded token length of a prefill group and the split of
the prompts into length groups that computes the fewest padded tokens. Used by the serving
engine's joins and by `autoregressive_generate`; the device side is `models.decoder.prefill`
plus `KVCache.put_rows`."""

from __future__ import annotations

from typing import Collection, Sequence

# The most prompt tokens (padded rows × padded length) one prefill call takes, unless one prompt
# alone is longer. A call holds a fresh cache of its rows and every token's features until it
# moves them into the slots, so its temporary memory grows with its tokens: a join of every
# slot at once would hold a second KV cache as large as the slots' own. Past some thousands
# of tokens a prefill is bound by compute, so a larger join split into calls of this size
# loses nothing.
PREFILL_TOKENS = 16384


def round_up(x: int, m: int) -> int:
    return ((x + m - 1) // m) * m


def prefill_length(longest: int, len_bucket: int, chunk: int, cache_len: int) -> int:
    """Token length P a prefill group of prompts up to `longest` tokens is padded to: a
    `len_bucket` multiple (at most the cache's length), a `chunk` multiple past `chunk`."""
    P = min(round_up(longest, len_bucket), cache_len)
    return round_up(P, chunk) if P > chunk else P


def rows_within(max_rows: int, width: int, max_tokens: int | None) -> int:
    """The most prompts a prefill group of `width` padded tokens may hold: `max_rows`, fewer
    where their power-of-two rows × `width` would pass `max_tokens` (None: no limit), and
    never fewer than one."""
    if not max_tokens:
        return max_rows
    fit = max(int(max_tokens) // int(width), 1)
    return min(max_rows, 1 << (fit.bit_length() - 1))


def prefill_groups(lengths: Sequence[int], max_rows: int, len_bucket: int, chunk: int,
                   cache_len: int, group_tokens: int = 64,
                   max_tokens: int | None = PREFILL_TOKENS) -> list[list[int]]:
    """The joining prompts (indices into `lengths`) split into prefill groups of at most
    `max_rows` (and at most `max_tokens` padded tokens, `rows_within`), each padded to a
    power-of-two rows × `prefill_length` tokens: the split of the length-sorted prompts that
    computes the fewest padded tokens, a group counting `group_tokens` more (its device call).
    One group of everything pads every prompt to the longest (16 chat prompts of 41-308
    tokens: 5,120 tokens for 1,305); this pays ~1,900."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best, cut = [0] * (n + 1), [0] * (n + 1)
    for j in range(1, n + 1):
        P = prefill_length(lengths[order[j - 1]], len_bucket, chunk, cache_len)
        most = rows_within(max_rows, P, max_tokens)
        best[j], cut[j] = min((best[i] + pow2_rows(j - i) * P + group_tokens, i)
                              for i in _last_group_starts(j, most, ()))
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def _last_group_starts(j: int, max_rows: int, rows: Collection[int]) -> set[int]:
    """Where the last group of the first j sorted prompts may start, for a split search whose
    cost is the best cost of the prompts before it (never less for more prompts: dropping the
    longest prompt of a split never makes it dearer) plus a cost that depends on the group's
    size only through its row count. For each row count, the largest group that fits is the
    cheapest, and the earliest start among equal costs is the one a scan over every start
    keeps: the power-of-two row counts up to `max_rows`, and each of `rows`, give the only
    starts to try (O(log max_rows) instead of O(max_rows) a prompt)."""
    most = min(max_rows, j)
    sizes = {most} | {min(r, most) for r in rows}
    r = 1
    while r < most:
        sizes.add(r)
        r *= 2
    return {j - s for s in sizes if s >= 1}


def pow2_rows(n: int) -> int:
    """A group of n prompts is prefilled as the next power of two of rows (padding rows)."""
    return 1 << (int(n) - 1).bit_length()


def shaped_prefill_groups(lengths: Sequence[int], max_rows: int, len_bucket: int, chunk: int,
                          cache_len: int, compiled: Collection[tuple[int, int]],
                          new_shape_tokens: int, group_tokens: int = 64,
                          max_tokens: int | None = PREFILL_TOKENS
                          ) -> list[tuple[list[int], int, int]]:
    """`prefill_groups` for a caller that pays to compile every new prefill shape: each group
    also gets its shape → [(prompt indices, rows, width)]. A group may run in a larger shape
    already compiled (`compiled`: (rows, width) pairs; more padding rows, or a wider width,
    within `max_tokens` unless one row), and a shape not compiled yet counts
    `new_shape_tokens` more padded tokens (its compilation), so a short job prefills its
    prompts in the few shapes it has instead of compiling one per length group."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    known = {(r, P) for r, P in compiled if r == 1 or not max_tokens or r * P <= max_tokens}

    def shape(size: int, width: int) -> tuple[int, int, int]:
        """(cost, rows, width) of the cheapest shape for `size` prompts of ≤ `width` tokens."""
        rows = pow2_rows(size)
        options = [(rows, width)] + [(r, P) for r, P in known if r >= size and P >= width]
        return min((r * P + (0 if (r, P) in known else int(new_shape_tokens)), r, P)
                   for r, P in options)

    best: list = [(0, None)] + [None] * n
    known_rows = {r for r, _ in known}
    for j in range(1, n + 1):
        width = prefill_length(lengths[order[j - 1]], len_bucket, chunk, cache_len)
        most = rows_within(max_rows, width, max_tokens)
        total, i = min((best[i][0] + shape(j - i, width)[0] + group_tokens, i)
                       for i in _last_group_starts(j, most, known_rows))
        best[j] = (total, (i, *shape(j - i, width)[1:]))
    groups, j = [], n
    while j > 0:
        i, rows, P = best[j][1]
        groups.append((order[i:j], rows, P))
        j = i
    return groups[::-1]


__all__ = ["PREFILL_TOKENS", "round_up", "prefill_length", "prefill_groups", "pow2_rows",
           "rows_within", "shaped_prefill_groups"]
