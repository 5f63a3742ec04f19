"""The DSpark paper's Table 1 (paper §4): the accepted length τ of each target and drafter on
the nine benchmark datasets (T = 1, γ = 7, fixed blocks), and the choice of the row an
evaluation shows next to its own numbers.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from dspark_jax.eval.report_numbers import json_float, nanmean

__all__ = ["PAPER_DATASETS", "PAPER_TABLE1_TAU", "PAPER_TARGET_NAMES", "PAPER_DRAFTER_NAMES",
           "paper_reference_for", "paper_reference"]

#: Dataset keys (file stems of ``eval_datasets/``) in the column order of the paper's Table 1.
PAPER_DATASETS: tuple[str, ...] = (
    "gsm8k", "math500", "aime25", "mbpp", "humaneval", "livecodebench", "mt-bench", "alpaca",
    "arena-hard-v2",
)


def _row(*values: float) -> dict[str, float]:
    return dict(zip(PAPER_DATASETS, values))


#: Paper Table 1: tau (incl. bonus token), T = 1, gamma = 7, fixed blocks (no scheduler).
#: ``PAPER_TABLE1_TAU[target][drafter][dataset]``.
PAPER_TABLE1_TAU: dict[str, dict[str, dict[str, float]]] = {
    "qwen3_4b": {
        "eagle3": _row(5.14, 4.62, 3.92, 3.69, 4.16, 3.77, 2.39, 2.26, 2.55),
        "dflash": _row(5.40, 4.85, 4.15, 4.40, 4.74, 4.18, 3.07, 2.96, 2.83),
        "dspark": _row(6.11, 5.70, 4.89, 5.13, 5.38, 4.86, 3.64, 3.54, 3.29),
    },
    "qwen3_8b": {
        "eagle3": _row(5.30, 4.77, 3.91, 3.96, 4.33, 4.17, 2.66, 2.54, 2.54),
        "dflash": _row(5.33, 4.91, 4.07, 4.36, 4.64, 4.39, 3.11, 2.98, 2.81),
        "dspark": _row(6.17, 5.78, 5.01, 5.16, 5.52, 5.17, 3.72, 3.58, 3.21),
    },
    "qwen3_14b": {
        "eagle3": _row(5.24, 4.60, 3.71, 3.81, 4.14, 4.01, 2.62, 2.47, 2.48),
        "dflash": _row(5.41, 4.84, 3.98, 4.44, 4.59, 4.33, 3.10, 2.94, 2.72),
        "dspark": _row(6.21, 5.74, 4.94, 5.26, 5.43, 5.02, 3.70, 3.58, 3.13),
    },
    "gemma4_12b": {
        "eagle3": _row(5.87, 5.46, 4.83, 4.72, 5.37, 4.16, 3.19, 3.06, 2.72),
        "dflash": _row(5.45, 5.04, 4.22, 4.39, 4.95, 3.70, 2.98, 2.84, 2.59),
        "dspark": _row(6.05, 5.78, 5.12, 5.11, 5.64, 4.51, 3.49, 3.35, 2.92),
    },
}

#: How the paper names its targets and drafters (the labels of the reference row).
PAPER_TARGET_NAMES = {"qwen3_4b": "Qwen3-4B", "qwen3_8b": "Qwen3-8B", "qwen3_14b": "Qwen3-14B",
                      "gemma4_12b": "Gemma4-12B"}
PAPER_DRAFTER_NAMES = {"eagle3": "Eagle3", "dflash": "DFlash", "dspark": "DSpark"}


def paper_reference_for(target_name: str, drafter: str = "dspark",
                        spec: str | None = "auto") -> tuple[str, str] | None:
    """Which row of the paper's Table 1 to show next to our numbers.

    `spec`: "auto" — the paper target whose name appears in `target_name` (qwen3-4b/8b/14b,
    gemma4-12b) with the drafter type `drafter`, else Qwen3-4B DSpark; "none"/None — no row;
    "TARGET/DRAFTER" (e.g. "qwen3_8b/dflash") — that row.
    """
    if spec is None or str(spec).lower() in ("none", "off", ""):
        return None
    if str(spec).lower() != "auto":
        parts = str(spec).lower().replace("-", "_").split("/")
        if len(parts) != 2 or parts[0] not in PAPER_TABLE1_TAU or \
                parts[1] not in PAPER_TABLE1_TAU[parts[0]]:
            rows = [f"{t}/{d}" for t in PAPER_TABLE1_TAU for d in PAPER_TABLE1_TAU[t]]
            raise ValueError(f"unknown paper reference {spec!r}; "
                             f"choose auto, none or one of {rows}")
        return parts[0], parts[1]
    name = str(target_name).lower()
    target = "qwen3_4b"
    m = re.search(r"qwen3[-_]?(4|8|14)b", name)
    if m:
        target = f"qwen3_{m.group(1)}b"
    elif re.search(r"gemma[-_]?4[-_]?12b", name):
        target = "gemma4_12b"
    drafter = drafter if drafter in PAPER_TABLE1_TAU[target] else "dspark"
    return target, drafter


def paper_reference(target_name: str, drafter: str, spec: str | None,
                    names: Sequence[str]) -> dict[str, Any] | None:
    """results.json's `paper_reference`: the row `paper_reference_for` picks and its mean over
    the datasets `names` evaluated here; None without a row or without a paper dataset."""
    key = paper_reference_for(target_name, drafter, spec)
    if key is None or not any(n in PAPER_DATASETS for n in names):
        return None
    row = PAPER_TABLE1_TAU[key[0]][key[1]]
    common = [n for n in names if n in row]
    label = f"{PAPER_TARGET_NAMES[key[0]]} {PAPER_DRAFTER_NAMES[key[1]]} (paper, T=1, γ=7)"
    return {"target": key[0], "drafter": key[1], "label": label, "tau": dict(row),
            "mean_over_evaluated": json_float(nanmean([row[n] for n in common]))}
