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


def _every_start_oracle(lengths, max_rows, bucket, chunk, cache_len, compiled, new_tokens,
                        group_tokens=64, max_tokens=None):
    """The split search trying every start of the last group (O(n · max_rows)): the cost of a
    group is its cheapest shape, a power-of-two rows at its own width or a compiled shape
    that holds it, a new shape counting `new_tokens` more; the earliest start wins a tie. A
    shape of more than one row holds at most `max_tokens` tokens (None: any)."""
    from dspark_jax.decoding.prefill_plan import pow2_rows

    def within(r, p):
        return r == 1 or max_tokens is None or r * p <= max_tokens

    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = [(0, None)]
    for j in range(1, len(order) + 1):
        width = prefill_length(lengths[order[j - 1]], bucket, chunk, cache_len)
        cands = []
        for i in range(max(0, j - max_rows), j):
            if not within(pow2_rows(j - i), width):
                continue
            opts = [(pow2_rows(j - i), width)] + [(r, p) for r, p in compiled
                                                    if r >= j - i and p >= width
                                                    and within(r, p)]
            cost, r, p = min((r * p + (0 if (r, p) in compiled else new_tokens), r, p)
                             for r, p in opts)
            cands.append((best[i][0] + cost + group_tokens, i, r, p))
        total, i, r, p = min(cands, key=lambda c: (c[0], c[1]))
        best.append((total, (i, r, p)))
    groups, j = [], len(order)
    while j > 0:
        i, r, p = best[j][1]
        groups.append((order[i:j], r, p))
        j = i
    return groups[::-1]


def test_split_search_equals_trying_every_start():
    """The planners try O(log R) starts for the last group; the same splits and shapes as
    trying all R, on random lengths, row caps (powers of two and not) and compiled shapes."""
    from dspark_jax.decoding.prefill_plan import shaped_prefill_groups

    rng = np.random.RandomState(2)
    for trial in range(60):
        n = int(rng.randint(1, 70))
        lengths = rng.randint(1, 400, n).tolist()
        max_rows = int(rng.choice([1, 3, 6, 8, 16, 64]))
        compiled = {(int(rng.choice([2 ** rng.randint(0, 6), rng.randint(1, 70)])),
                     int(64 * rng.randint(1, 8))) for _ in range(rng.randint(0, 4))}
        new_tokens = int(rng.choice([0, 256, 1024]))
        budget = [None, 256, 1000, 2048][trial % 4]
        want = _every_start_oracle(lengths, max_rows, 64, 128, 512, compiled, new_tokens,
                                   max_tokens=budget)
        got = shaped_prefill_groups(lengths, max_rows, 64, 128, 512, compiled, new_tokens,
                                    max_tokens=budget)
        assert got == want, (trial, lengths, max_rows, compiled, new_tokens, budget)
        plain = _every_start_oracle(lengths, max_rows, 64, 128, 512, set(), 0,
                                    max_tokens=budget)
        assert prefill_groups(lengths, max_rows, 64, 128, 512, max_tokens=budget) == [
            g for g, _, _ in plain]


def test_a_call_takes_at_most_the_token_budget_unless_one_prompt_is_longer():
    """16 prompts of 8,000 tokens joining a cache of 8,192: calls of 2 rows × 8,064 tokens
    within the default 16,384 (one call of all 16 would hold a second cache as large as the
    slots'); a budget below one prompt leaves each its own call; a compiled shape larger than
    the budget is not reused."""
    from dspark_jax.decoding.prefill_plan import PREFILL_TOKENS, shaped_prefill_groups

    assert PREFILL_TOKENS == 16384
    groups = prefill_groups([8000] * 16, 16, 64, 128, 8192)
    assert sorted(i for g in groups for i in g) == list(range(16))
    assert [len(g) for g in groups] == [2] * 8
    assert [len(g) for g in prefill_groups([8000] * 3, 16, 64, 128, 8192, max_tokens=4096)
            ] == [1, 1, 1]
    assert [len(g) for g in prefill_groups([8000] * 16, 16, 64, 128, 8192,
                                           max_tokens=None)] == [16]
    shaped = shaped_prefill_groups([8000] * 4, 16, 64, 128, 8192, {(4, 8192)}, 1 << 20)
    assert [(len(g), r, w) for g, r, w in shaped] == [(2, 2, 8064)] * 2


def test_thousands_of_joining_prompts_cost_a_few_evaluations_each(monkeypatch):
    """4096 prompts joining at once into 4096 rows: a few dozen cost evaluations a prompt
    (trying every start would be 4096 a prompt, 16.8 million in all)."""
    from dspark_jax.decoding import prefill_plan

    calls = []
    real = prefill_plan.pow2_rows
    monkeypatch.setattr(prefill_plan, "pow2_rows", lambda n: calls.append(n) or real(n))
    lengths = np.random.RandomState(3).randint(1, 500, 4096).tolist()
    groups = prefill_plan.shaped_prefill_groups(lengths, 4096, 64, 128, 1024, {(4096, 64)}, 1024)
    prefill_plan.prefill_groups(lengths, 4096, 64, 128, 1024)
    assert 0 < len(calls) < 50 * len(lengths)
    assert sorted(i for g, _, _ in groups for i in g) == list(range(4096))


def test_the_engine_prefills_a_join_in_calls_within_its_budget(tmp_path, monkeypatch):
    """`EngineSettings.prefill_tokens`: four prompts joining at once are prefilled in calls of
    at most that many padded tokens, and decode to the same tokens (greedy, sampled) as one
    call of all four."""
    from dspark_jax.decoding import speculative_round as round_
    from dspark_jax.models import init_draft, load_target
    from dspark_jax.serving import Engine, EngineSettings
    from hf_tiny import save_tiny_hf

    target = load_target(save_tiny_hf(tmp_path / "t", "qwen3", head_dim=16, layers=2, seed=1))
    draft = init_draft(target, dict(block_size=3, num_draft_layers=1, target_layer_ids=(-1, 0),
                                    mask_token_id=96, markov_rank=8), seed=3)
    prompts = [[5 + i + j for j in range(9 + 4 * i)] for i in range(4)]   # 9–21 tokens
    shapes: list[tuple[int, int]] = []
    real = round_.prefill_prompts

    def prefill(config, arrays, state, slots, tokens, *a, **kw):
        shapes.append(tuple(tokens.shape))
        return real(config, arrays, state, slots, tokens, *a, **kw)

    monkeypatch.setattr(round_, "prefill_prompts", prefill)
    out = {}
    for budget in (1 << 14, 32):
        shapes.clear()
        settings = EngineSettings(max_requests=4, max_len=64, scheduler="fixed",
                                  prefill_chunk=8, len_bucket=8, prefill_tokens=budget,
                                  stop_token_ids=[])
        eng = Engine(target, draft, settings=settings)
        out[budget] = [eng.generate(prompts, max_new_tokens=6, temperature=t, seed=2).tokens
                       for t in (0.0, 1.0)]
        if budget == 32:
            assert len(shapes) >= 3 and all(r * w <= 32 or r == 1 for r, w in shapes), shapes
        else:
            assert shapes[0] == (4, 24), shapes
    assert out[32] == out[1 << 14]
