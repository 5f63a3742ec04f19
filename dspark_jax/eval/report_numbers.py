"""The numbers of the evaluation reports (SPEC §6/§7): ratios, means over datasets or draft
slots, and floats written to JSON files.

One rule for a value that is not a number: NaN, +inf, -inf and None all mean "undefined".

* :func:`ratio` — ``num / den`` as a float; NaN when ``den`` is 0 (an empty denominator makes
  the statistic undefined, not an error).
* :func:`nanmean` — the mean of the finite values, added up in their order and divided by
  their count; NaN, ±inf and None are skipped; NaN when no finite value is left.
* :func:`json_float` — ``float(x)`` for a finite ``x``; None for NaN, ±inf and None, so
  ``json.dumps`` writes ``null`` and the file stays strict JSON (no ``NaN``/``Infinity``).

Since :func:`json_float` turns every undefined value into None and :func:`nanmean` skips None,
the mean of values read back from a results file equals the mean of the values written.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

__all__ = ["ratio", "nanmean", "json_float", "is_number"]


def is_number(x: Any) -> bool:
    """True for a finite number; False for NaN, ±inf and None."""
    return x is not None and math.isfinite(float(x))


def ratio(num: float, den: float) -> float:
    """``num / den`` as a float; NaN when ``den`` is 0."""
    return float(num) / float(den) if den != 0 else math.nan


def nanmean(values: Iterable[float | None]) -> float:
    """Mean of the finite values (in order: ``sum / count``); NaN when there are none.

    NaN, ±inf and None are skipped."""
    finite = [float(v) for v in values if is_number(v)]
    return sum(finite) / len(finite) if finite else math.nan


def json_float(x: float | None) -> float | None:
    """``float(x)`` when ``x`` is finite; None for NaN, ±inf and None."""
    return float(x) if is_number(x) else None
