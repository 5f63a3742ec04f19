"""Tests for dspark_jax.eval.acceptance (hand-computed examples, DeepSpec's count on stop rounds)
and the tau / Figure-2 plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dspark_jax.eval import acceptance as acc_mod
from dspark_jax.eval.acceptance import (
    PAPER_DATASETS,
    PAPER_TABLE1_TAU,
    AcceptanceStats,
    acceptance_stats,
    macro_mean,
    stats_from_records,
    summarize,
)
from dspark_jax.eval.plots import plot_conditional_acceptance, plot_tau


def test_fixed_block_hand_example() -> None:
    # gamma = 3, every round proposes 3 drafts.
    s = acceptance_stats([3, 3, 3, 3], [0, 1, 3, 2], gamma=3)
    assert s.rounds == 4 and s.gamma == 3
    assert s.tau == pytest.approx(10 / 4)  # (1 + 2 + 4 + 3) / 4
    assert s.verify_rate == pytest.approx(10 / 16)  # 10 / (12 + 4)
    assert s.accept_rate_at == pytest.approx((3 / 4, 2 / 4, 1 / 4))
    assert s.conditional_acceptance == pytest.approx((0.75, 2 / 3, 0.5))
    assert s.total_accepted == 6 and s.total_proposed == 12


def test_variable_lengths_hand_example() -> None:
    # Scheduler-style rounds with different verification lengths.
    s = acceptance_stats([3, 1, 2, 0], [2, 1, 0, 0], gamma=3)
    assert s.tau == pytest.approx(7 / 4)  # (3 + 2 + 1 + 1) / 4
    assert s.verify_rate == pytest.approx(7 / 10)  # 7 / (6 + 4)
    # k=0: accepted>=1 in rounds {0,1} / proposed>0 in {0,1,2}; k=1: {0} / {0,2}; k=2: {} / {0}
    assert s.accept_rate_at == pytest.approx((2 / 3, 1 / 2, 0.0))
    assert s.conditional_acceptance == pytest.approx((2 / 3, 0.75, 0.0))


def test_stop_round_counts_eos_pos_plus_one_as_deepspec() -> None:
    # DeepSpec's verify_draft_tokens: a stop token among the accepted drafts at index e makes
    # accepted = proposed = e + 1 and the acceptance length e + 1 (no bonus token).
    # Rounds: plain (3, 1) -> 2; stop at e = 1 -> (2, 2) -> 2; plain (3, 3) -> 4; stop at e = 0.
    prop, acc, alen = [3, 2, 3, 1], [1, 2, 3, 1], [2, 2, 4, 1]
    s = acceptance_stats(prop, acc, gamma=3, acceptance=alen)
    assert s.tau == pytest.approx(9 / 4)  # DeepSpec: acceptance_length_sum / proposal_count
    assert s.verify_rate == pytest.approx(9 / (9 + 4))  # ... / (proposal_length_sum + count)
    # accepted_at_pos / proposals_at_pos: k=0: 4/4, k=1: {2,3}/{0,1,2}, k=2: {3}/{0,2}
    assert s.accept_rate_at == pytest.approx((1.0, 2 / 3, 1 / 2))
    assert s.total_accepted == 7 and s.total_proposed == 9
    # counting accepted + 1 on every round (no `acceptance`) differs exactly on the stop rounds
    old = acceptance_stats(prop, acc, gamma=3)
    assert old.tau == pytest.approx(11 / 4) and old.tau - s.tau == pytest.approx(2 / 4)
    assert old.accept_rate_at == s.accept_rate_at
    # no stop round: acceptance = accepted + 1 is the default
    plain = acceptance_stats([3, 3], [0, 3], acceptance=[1, 4])
    assert plain == acceptance_stats([3, 3], [0, 3])
    recs = [{"proposed": p, "accepted": a, "acceptance": x} for p, a, x in zip(prop, acc, alen)]
    assert stats_from_records(recs, gamma=3) == s


@pytest.mark.parametrize(
    "proposed,accepted,acceptance",
    [([3], [1], [3]),      # more than accepted + 1
     ([3], [1], [1]),      # "stop round" that did not end the proposal at the stop token
     ([2], [0], [0]),      # a stop round accepts at least the stop token
     ([2, 2], [1, 1], [2])],
)
def test_invalid_acceptance_lengths(proposed, accepted, acceptance) -> None:
    with pytest.raises(ValueError):
        acceptance_stats(proposed, accepted, acceptance=acceptance)
    with pytest.raises(ValueError, match="some records"):
        stats_from_records([{"proposed": 1, "accepted": 0, "acceptance": 1},
                            {"proposed": 1, "accepted": 0}])


def test_default_gamma_and_records() -> None:
    recs = [{"proposed": 2, "accepted": 1}, {"proposed": 2, "accepted": 2}]
    with pytest.warns(UserWarning, match="records"):
        s = stats_from_records(recs, name="x")
    assert s.gamma == 2 and s.name == "x"
    assert s.tau == pytest.approx(2.5)
    assert s.accept_rate_at == pytest.approx((1.0, 0.5))


def test_records_without_acceptance_lengths_warn_naming_the_file(tmp_path, recwarn) -> None:
    path = tmp_path / "records.jsonl"
    recs = [{"proposed": 3, "accepted": 1}, {"proposed": 3, "accepted": 3}]
    with pytest.warns(UserWarning, match=r"records\.jsonl: no per-round 'acceptance'") as w:
        s = stats_from_records(recs, source=path)
    assert str(path) in str(w[0].message) and w[0].filename == __file__
    assert s.tau == pytest.approx((2 + 4) / 2)  # accepted + 1 on every round
    # with the lengths, or without any record: nothing to warn about
    stats_from_records([dict(r, acceptance=r["accepted"] + 1) for r in recs], source=path)
    stats_from_records([], source=path)
    assert not [x for x in recwarn if issubclass(x.category, UserWarning)]


def test_nan_safe_and_json() -> None:
    s = acceptance_stats([1, 1], [0, 0], gamma=3)
    assert s.accept_rate_at[0] == 0.0
    assert math.isnan(s.accept_rate_at[1]) and math.isnan(s.accept_rate_at[2])
    # 0 / 0 for the conditional at k=1, NaN propagates.
    assert s.conditional_acceptance[0] == 0.0
    assert all(math.isnan(v) for v in s.conditional_acceptance[1:])
    d = s.to_dict()
    text = json.dumps(d, allow_nan=False)  # strict JSON
    assert json.loads(text)["accept_rate_at"] == [0.0, None, None]
    back = AcceptanceStats.from_dict(d)
    assert back.tau == s.tau and math.isnan(back.accept_rate_at[1])

    empty = acceptance_stats([], [])
    assert empty.rounds == 0 and empty.gamma == 0 and math.isnan(empty.tau)
    json.dumps(empty.to_dict(), allow_nan=False)

    # Conditional at k when the previous survival is 0: 0/0 -> NaN.
    z = acceptance_stats([2, 2], [0, 0])
    assert z.accept_rate_at == (0.0, 0.0)
    assert z.conditional_acceptance[0] == 0.0 and math.isnan(z.conditional_acceptance[1])


@pytest.mark.parametrize(
    "proposed,accepted,gamma",
    [([1, 2], [2, 0], None), ([1], [-1], None), ([3], [1], 2), ([1, 2], [0], None)],
)
def test_invalid_inputs(proposed, accepted, gamma) -> None:
    with pytest.raises(ValueError):
        acceptance_stats(proposed, accepted, gamma=gamma)


def test_geometric_acceptance_conditional_is_flat() -> None:
    # Each slot accepted with prob p given the previous ones: conditional acceptance ~ p at every k.
    rng = np.random.default_rng(0)
    gamma, p, n = 7, 0.8, 20000
    u = rng.random((n, gamma)) < p
    accepted = np.cumprod(u, axis=1).sum(axis=1)
    s = acceptance_stats(np.full(n, gamma), accepted, gamma=gamma)
    assert np.allclose(s.conditional_acceptance, p, atol=0.03)
    assert np.allclose(s.accept_rate_at, p ** np.arange(1, gamma + 1), atol=0.02)
    expected_tau = 1 + sum(p**k for k in range(1, gamma + 1))
    assert s.tau == pytest.approx(expected_tau, abs=0.05)
    assert s.verify_rate == pytest.approx(s.tau / (gamma + 1))


def test_macro_mean_and_summary() -> None:
    a = acceptance_stats([2, 2], [2, 0], name="a")  # tau 2.0, rates (0.5, 0.5)
    b = acceptance_stats([3, 3, 3, 3], [3, 3, 3, 3], name="b")  # tau 4.0, rates (1, 1, 1)
    m = macro_mean({"a": a, "b": b})
    assert m.tau == pytest.approx(3.0)  # unweighted over datasets, not over rounds
    assert m.rounds == 6 and m.gamma == 3
    assert m.accept_rate_at == pytest.approx((0.75, 0.75, 1.0))  # 3rd slot: only b defines it
    assert m.conditional_acceptance == pytest.approx((0.75, 1.0, 1.0))
    assert m.verify_rate == pytest.approx((4 / 6 + 16 / 16) / 2)
    out = summarize({"a": a, "b": b})
    assert set(out) == {"a", "b", "mean"}
    json.dumps(out, allow_nan=False)


def test_macro_mean_reproduces_paper_claim() -> None:
    # Paper §4.2: DSpark improves the Qwen3-4B macro-average tau over Eagle3 by 30.9%.
    def as_stats(row):
        return [
            AcceptanceStats(1, 7, row[d], math.nan, (), (), 0, 0, d) for d in PAPER_DATASETS
        ]

    table = PAPER_TABLE1_TAU["qwen3_4b"]
    gain = macro_mean(as_stats(table["dspark"])).tau / macro_mean(as_stats(table["eagle3"])).tau
    assert gain - 1 == pytest.approx(0.309, abs=0.0015)
    gain_dflash = macro_mean(as_stats(table["dspark"])).tau / macro_mean(as_stats(table["dflash"])).tau
    assert gain_dflash - 1 == pytest.approx(0.163, abs=0.0015)


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_write_png(tmp_path) -> None:
    s1 = acceptance_stats([7] * 4, [7, 3, 0, 5], name="gsm8k")
    s2 = acceptance_stats([7] * 3, [1, 2, 2], name="mt-bench")
    p = plot_tau(
        {"gsm8k": s1.tau, "mt-bench": s2.tau},
        tmp_path / "sub" / "tau.png",
        reference=PAPER_TABLE1_TAU["qwen3_4b"],
        title="tau",
    )
    assert p.exists() and p.stat().st_size > 1000 and _is_png(p)
    q = plot_conditional_acceptance(
        {"gsm8k": s1.conditional_acceptance, "mt-bench": s2.conditional_acceptance},
        tmp_path / "cond.png",
    )
    assert q.exists() and q.stat().st_size > 1000 and _is_png(q)


def test_module_exports() -> None:
    for name in acc_mod.__all__:
        assert hasattr(acc_mod, name)
