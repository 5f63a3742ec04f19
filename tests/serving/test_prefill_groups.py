"""The engine's prefill grouping (`decoding.prefill_plan.prefill_groups`): every joining prompt in
exactly one group of at most R rows, fewer padded tokens than one group of everything when
the lengths differ, one group when they do not."""

from __future__ import annotations

import numpy as np

from dspark_jax.decoding.prefill_plan import prefill_groups, prefill_length


def _padded(lengths, groups, bucket, chunk, cache_len):
    return sum((1 << (len(g) - 1).bit_length())
               * prefill_length(max(lengths[i] for i in g), bucket, chunk, cache_len)
               for g in groups)


def test_groups_cover_every_prompt_once_and_pad_less():
    lengths = [308, 41, 126, 43, 46, 111, 49, 49, 93, 50, 50, 88, 51, 79, 60, 61]
    groups = prefill_groups(lengths, 16, 64, 384, 384)
    assert sorted(i for g in groups for i in g) == list(range(16))
    assert all(1 <= len(g) <= 16 for g in groups)
    spans = sorted((min(lengths[i] for i in g), max(lengths[i] for i in g)) for g in groups)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))   # runs of the sorted lengths
    one = _padded(lengths, [list(range(16))], 64, 384, 384)
    split = _padded(lengths, groups, 64, 384, 384)
    assert one == 16 * 320 and split < one / 2


def test_equal_lengths_stay_one_group_and_rows_are_capped():
    assert prefill_groups([5, 5, 5], 16, 64, 128, 512) == [[0, 1, 2]]
    rng = np.random.RandomState(0)
    lengths = rng.randint(1, 60, 40).tolist()
    groups = prefill_groups(lengths, 8, 64, 128, 512)
    assert all(len(g) <= 8 for g in groups)
    assert sorted(i for g in groups for i in g) == list(range(40))


def test_shaped_groups_reuse_compiled_shapes_and_count_new_ones():
    from dspark_jax.decoding.prefill_plan import shaped_prefill_groups

    lengths = [48, 49, 43, 54, 47, 48]
    # free new shapes: the plain split (fewer padding rows); costly ones: one shape of 8 rows
    free = shaped_prefill_groups(lengths, 16, 64, 128, 128, set(), 0)
    assert [(sorted(i for i in g), r, w) for g, r, w in free] == \
        [(sorted(g), 1 << (len(g) - 1).bit_length(), 64) for g in prefill_groups(
            lengths, 16, 64, 128, 128)]
    assert shaped_prefill_groups(lengths, 16, 64, 128, 128, set(), 1024) == \
        [([2, 4, 0, 5, 1, 3], 8, 64)]
    # one prompt joins: a wider or taller compiled shape beats compiling its own
    assert shaped_prefill_groups([100], 32, 64, 128, 256, {(2, 128), (1, 192)}, 1024) == \
        [([0], 1, 192)]
    assert shaped_prefill_groups([100], 32, 64, 128, 256, {(2, 128)}, 1024) == [([0], 2, 128)]
    rng = np.random.RandomState(1)
    lengths = rng.randint(1, 300, 40).tolist()
    groups = shaped_prefill_groups(lengths, 8, 64, 128, 512, {(4, 128)}, 256)
    assert sorted(i for g, _, _ in groups for i in g) == list(range(40))
    assert all(len(g) <= rows <= 8 and max(lengths[i] for i in g) <= width
               for g, rows, width in groups)
