"""dspark_jax.eval.report_numbers: one rule for undefined values (NaN, ±inf, None) in ratios,
means and the floats written to JSON."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dspark_jax.eval.report_numbers import is_number, json_float, nanmean, ratio

UNDEFINED = [math.nan, math.inf, -math.inf, None, np.float32("nan"), np.float64("inf")]


@pytest.mark.parametrize("x", UNDEFINED)
def test_undefined_values_are_none_in_json_and_skipped_by_the_mean(x) -> None:
    assert not is_number(x)
    assert json_float(x) is None
    assert nanmean([1.0, x, 2.0]) == 1.5
    assert math.isnan(nanmean([x, x]))


def test_json_float_keeps_finite_values_exactly() -> None:
    for x in (0.1, -2.5, 1e300, 5e-324, 0.0, -0.0):
        assert json_float(x) == x and type(json_float(x)) is float
        assert repr(json_float(x)) == repr(x)  # byte-identical in json.dumps
    assert json_float(3) == 3.0 and type(json_float(3)) is float
    assert json_float(np.float32(0.25)) == 0.25 and type(json_float(np.float32(0.25))) is float
    assert json_float(np.int64(7)) == 7.0
    text = json.dumps([json_float(x) for x in [0.5, *UNDEFINED]], allow_nan=False)
    assert json.loads(text) == [0.5] + [None] * len(UNDEFINED)


def test_nanmean_adds_in_order_and_divides_by_the_count() -> None:
    assert math.isnan(nanmean([]))
    vals = [0.1 * (k + 1) ** 1.5 for k in range(9)]
    total = 0.0
    for v in vals:
        total += v
    assert nanmean(vals) == total / 9
    assert nanmean(iter([1, 2, 4])) == pytest.approx(7 / 3)
    assert type(nanmean([np.float32(1.0), 2])) is float


def test_mean_of_values_read_back_from_json_equals_the_mean_written() -> None:
    raw = [1.25, math.nan, 3.5, math.inf, None, 0.75, -math.inf]
    back = json.loads(json.dumps([json_float(x) for x in raw], allow_nan=False))
    assert nanmean(back) == nanmean(raw) == (1.25 + 3.5 + 0.75) / 3


def test_ratio() -> None:
    assert ratio(3, 4) == 0.75 and type(ratio(3, 4)) is float
    assert math.isnan(ratio(1, 0)) and math.isnan(ratio(0, 0.0))
    assert math.isnan(ratio(math.nan, 2))
    assert ratio(1, math.inf) == 0.0
