"""Confidence calibration of the DSpark confidence head (paper §3.2.1 "Post-hoc Calibration"; SPEC §7).

The confidence head emits one logit per draft slot, ``c_k = sigmoid(logit_k)``, modelling the
*conditional* probability that slot ``k`` is accepted given that slots ``< k`` were.  By the chain
rule the predicted prefix survival at slot ``k`` is ``a_k = prod_{j <= k} c_j`` and its label is
"slots ``0..k`` were all accepted", i.e. ``accepted >= k + 1`` (0-based slots).

This module computes, per slot ``k``: ECE with 20 equal-width bins, AUROC (rank based, ties get
average ranks), Brier score and reliability-diagram data; and implements Sequential Temperature
Scaling (STS): for ``k = 0..gamma-1`` in order, a 1-D grid search for the temperature ``T_k`` of
slot ``k``'s logit that minimises the ECE of the cumulative product ``a_k``, keeping the already
calibrated slots ``< k`` fixed.  Temperature scaling (``T > 0``) is order preserving per slot.

Unverified slots: a round that verified only ``l`` drafts says nothing about slots ``>= l``; pass a
``mask`` [R, gamma] of the slots that were actually verified (see :func:`verified_mask`); masked-out
entries are ignored by every metric and by STS.

Everything is numpy (no scipy / sklearn); :func:`apply_temperatures` also accepts JAX arrays so it
can be used inside the decoding loop.

The fitted temperatures travel with the drafter: :func:`save_temperatures` writes
``<draft dir>/confidence_calibration.json`` (format ``dspark_jax.sts.v1``, written atomically by
``python -m dspark_jax.calibrate``) and :func:`load_temperatures` reads and validates it (the
drafter loader attaches the result as ``Draft.confidence_temperatures``). Both live with the
drafter's other checkpoint files in ``dspark_jax.models.io.calibration_file`` and are
re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from dspark_jax.eval.report_numbers import json_float, nanmean
from dspark_jax.models.io.calibration_file import (CALIBRATION_FILE, CALIBRATION_FORMAT,
                                                   CalibrationFileError, load_temperatures,
                                                   save_temperatures)

__all__ = [
    "sigmoid",
    "logit",
    "prefix_labels",
    "verified_mask",
    "apply_temperatures",
    "prefix_survival_from_logits",
    "expected_calibration_error",
    "reliability_curve",
    "auroc",
    "brier_score",
    "ReliabilityDiagram",
    "SlotCalibration",
    "CalibrationReport",
    "calibration_report",
    "sequential_temperature_scaling",
    "DEFAULT_TEMPERATURE_GRID",
    "CALIBRATION_FILE",
    "CALIBRATION_FORMAT",
    "CalibrationFileError",
    "save_temperatures",
    "load_temperatures",
]

DEFAULT_N_BINS = 20
#: Coarse STS grid (log-spaced, contains 1.0); a local refinement follows the coarse search.
DEFAULT_TEMPERATURE_GRID: np.ndarray = np.unique(np.concatenate([np.geomspace(0.05, 20.0, 241), [1.0]]))


# --------------------------------------------------------------------------------------------
# Basic transforms
# --------------------------------------------------------------------------------------------


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Numerically stable logistic function (numpy)."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def logit(p: np.ndarray, eps: float = 1e-7) -> np.ndarray:
    """Inverse of :func:`sigmoid` with clipping to ``[eps, 1 - eps]``."""
    p = np.clip(np.asarray(p, dtype=np.float64), eps, 1.0 - eps)
    return np.log(p) - np.log1p(-p)


def prefix_labels(accepted: np.ndarray, gamma: int) -> np.ndarray:
    """[R] accepted counts -> [R, gamma] bool labels ``accepted >= k + 1``."""
    acc = np.asarray(accepted).reshape(-1, 1)
    return acc >= np.arange(1, gamma + 1)[None, :]


def verified_mask(proposed: np.ndarray, gamma: int) -> np.ndarray:
    """[R] proposed (verified) counts -> [R, gamma] bool mask ``k < proposed``."""
    prop = np.asarray(proposed).reshape(-1, 1)
    return np.arange(gamma)[None, :] < prop


def apply_temperatures(logits: Any, temperatures: Any) -> Any:
    """Calibrated per-slot confidences ``sigmoid(logits / T)``; logits [..., gamma], T [gamma].

    Returns a JAX array for JAX input (usable under ``jit``), numpy otherwise.  These are the
    *conditional* confidences ``c_k`` the scheduler consumes (it forms the cumulative product).
    """
    import jax
    import jax.numpy as jnp

    if isinstance(logits, jax.Array):
        return jax.nn.sigmoid(logits / jnp.asarray(temperatures, logits.dtype))
    return sigmoid(np.asarray(logits, np.float64) / np.asarray(temperatures, np.float64))


def prefix_survival_from_logits(logits: np.ndarray, temperatures: np.ndarray | None = None
                                ) -> np.ndarray:
    """Predicted prefix survival from confidence-head logits [R, gamma]:
    ``a[r, k] = prod_{j <= k} sigmoid(logit[r, j] / T_j)``, [R, gamma] (numpy; T = 1 without
    ``temperatures``). `decoding.scheduler.prefix_survival` is the same product on
    probabilities (JAX)."""
    logits = np.asarray(logits, np.float64)
    t = np.ones(logits.shape[-1]) if temperatures is None else np.asarray(temperatures, np.float64)
    return np.cumprod(apply_temperatures(logits, t), axis=-1)


# --------------------------------------------------------------------------------------------
# Metrics (1-D, optional mask)
# --------------------------------------------------------------------------------------------


def _flat(probs: np.ndarray, labels: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(probs, np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(np.float64)
    if p.shape != y.shape:
        raise ValueError(f"probs {p.shape} and labels {y.shape} differ")
    if mask is not None:
        m = np.asarray(mask, bool).reshape(-1)
        if m.shape != p.shape:
            raise ValueError("mask shape differs from probs")
        p, y = p[m], y[m]
    return p, y


def _bin_index(p: np.ndarray, n_bins: int) -> np.ndarray:
    return np.clip(np.floor(np.clip(p, 0.0, 1.0) * n_bins).astype(np.int64), 0, n_bins - 1)


def _ece_flat(p: np.ndarray, y: np.ndarray, n_bins: int) -> float:
    if p.size == 0:
        return math.nan
    idx = _bin_index(p, n_bins)
    sum_p = np.bincount(idx, weights=p, minlength=n_bins)
    sum_y = np.bincount(idx, weights=y, minlength=n_bins)
    # sum_b n_b/N * |mean_p_b - mean_y_b| = sum_b |sum_p_b - sum_y_b| / N
    return float(np.abs(sum_p - sum_y).sum() / p.size)


def expected_calibration_error(
    probs: np.ndarray, labels: np.ndarray, n_bins: int = DEFAULT_N_BINS, mask: np.ndarray | None = None
) -> float:
    """ECE with ``n_bins`` equal-width bins on [0, 1] (last bin closed); NaN if no samples."""
    p, y = _flat(probs, labels, mask)
    return _ece_flat(p, y, n_bins)


@dataclass(frozen=True)
class ReliabilityDiagram:
    """Reliability-diagram data: per equal-width bin, mean confidence, accuracy and count."""

    bin_edges: tuple[float, ...]  # [n_bins + 1]
    confidence: tuple[float, ...]  # [n_bins] mean predicted probability (NaN if empty)
    accuracy: tuple[float, ...]  # [n_bins] empirical frequency of label 1 (NaN if empty)
    count: tuple[int, ...]  # [n_bins]

    def to_dict(self) -> dict[str, Any]:
        return {
            "bin_edges": [float(v) for v in self.bin_edges],
            "confidence": [json_float(v) for v in self.confidence],
            "accuracy": [json_float(v) for v in self.accuracy],
            "count": [int(v) for v in self.count],
        }


def reliability_curve(
    probs: np.ndarray, labels: np.ndarray, n_bins: int = DEFAULT_N_BINS, mask: np.ndarray | None = None
) -> ReliabilityDiagram:
    """Bin statistics behind a reliability diagram (same bins as the ECE)."""
    p, y = _flat(probs, labels, mask)
    idx = _bin_index(p, n_bins)
    cnt = np.bincount(idx, minlength=n_bins)
    sp = np.bincount(idx, weights=p, minlength=n_bins)
    sy = np.bincount(idx, weights=y, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        conf = np.where(cnt > 0, sp / np.maximum(cnt, 1), np.nan)
        acc = np.where(cnt > 0, sy / np.maximum(cnt, 1), np.nan)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    return ReliabilityDiagram(
        tuple(float(e) for e in edges),
        tuple(float(c) for c in conf),
        tuple(float(a) for a in acc),
        tuple(int(c) for c in cnt),
    )


def auroc(scores: np.ndarray, labels: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Area under the ROC curve via the Mann-Whitney U statistic with average ranks for ties.

    Equals ``P(s+ > s-) + 0.5 P(s+ == s-)`` over positive/negative pairs; NaN if one class is absent.
    """
    s, y = _flat(scores, labels, mask)
    pos = y > 0.5
    n_pos = int(pos.sum())
    n_neg = int(s.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])  # ranks before each group
    avg_rank = start + (counts + 1) / 2.0  # 1-based average rank of each tie group
    ranks = avg_rank[inverse.reshape(-1)]
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def brier_score(probs: np.ndarray, labels: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Mean squared error between predicted probability and the 0/1 label; NaN if no samples."""
    p, y = _flat(probs, labels, mask)
    return float(np.mean((p - y) ** 2)) if p.size else math.nan


# --------------------------------------------------------------------------------------------
# Per-slot report
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotCalibration:
    """Calibration of the predicted prefix survival at one draft slot (0-based)."""

    slot: int
    n: int  # number of verified rounds at this slot
    mean_confidence: float  # mean predicted prefix survival
    accuracy: float  # empirical prefix survival
    ece: float
    auroc: float
    brier: float
    reliability: ReliabilityDiagram

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "n": self.n,
            "mean_confidence": json_float(self.mean_confidence),
            "accuracy": json_float(self.accuracy),
            "ece": json_float(self.ece),
            "auroc": json_float(self.auroc),
            "brier": json_float(self.brier),
            "reliability": self.reliability.to_dict(),
        }


@dataclass(frozen=True)
class CalibrationReport:
    """Per-slot calibration metrics, their unweighted means and the temperatures used (if any)."""

    slots: tuple[SlotCalibration, ...]
    temperatures: tuple[float, ...] | None = None
    mean_ece: float = field(default=math.nan)
    mean_auroc: float = field(default=math.nan)
    mean_brier: float = field(default=math.nan)

    @property
    def ece(self) -> tuple[float, ...]:
        return tuple(s.ece for s in self.slots)

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperatures": None if self.temperatures is None else [float(t) for t in self.temperatures],
            "mean_ece": json_float(self.mean_ece),
            "mean_auroc": json_float(self.mean_auroc),
            "mean_brier": json_float(self.mean_brier),
            "slots": [s.to_dict() for s in self.slots],
        }


def _labels_2d(accepted_or_labels: np.ndarray, gamma: int) -> np.ndarray:
    arr = np.asarray(accepted_or_labels)
    if arr.ndim == 2:
        if arr.shape[1] != gamma:
            raise ValueError(f"labels have {arr.shape[1]} slots, logits {gamma}")
        return arr.astype(bool)
    return prefix_labels(arr, gamma)


def _mask_2d(mask: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    if mask is None:
        return np.ones(shape, bool)
    m = np.asarray(mask, bool)
    if m.shape != shape:
        raise ValueError(f"mask shape {m.shape} != {shape}")
    return m


def calibration_report(
    logits: np.ndarray,  # [R, gamma] confidence-head logits
    accepted: np.ndarray,  # [R] accepted counts, or [R, gamma] bool prefix labels
    mask: np.ndarray | None = None,  # [R, gamma] verified slots
    temperatures: np.ndarray | None = None,  # [gamma]
    n_bins: int = DEFAULT_N_BINS,
) -> CalibrationReport:
    """ECE / AUROC / Brier / reliability of the predicted prefix survival at every slot."""
    logits = np.asarray(logits, np.float64)
    r_, g_ = logits.shape
    labels = _labels_2d(accepted, g_)
    m = _mask_2d(mask, (r_, g_))
    surv = prefix_survival_from_logits(logits, temperatures)
    slots = []
    for k in range(g_):
        p, y = surv[m[:, k], k], labels[m[:, k], k]
        slots.append(
            SlotCalibration(
                slot=k,
                n=int(p.size),
                mean_confidence=float(p.mean()) if p.size else math.nan,
                accuracy=float(y.mean()) if p.size else math.nan,
                ece=expected_calibration_error(p, y, n_bins),
                auroc=auroc(p, y),
                brier=brier_score(p, y),
                reliability=reliability_curve(p, y, n_bins),
            )
        )
    return CalibrationReport(
        slots=tuple(slots),
        temperatures=None if temperatures is None else tuple(float(t) for t in np.asarray(temperatures)),
        mean_ece=nanmean([s.ece for s in slots]),
        mean_auroc=nanmean([s.auroc for s in slots]),
        mean_brier=nanmean([s.brier for s in slots]),
    )


# --------------------------------------------------------------------------------------------
# Sequential Temperature Scaling
# --------------------------------------------------------------------------------------------


def _best_temperature(
    prefix: np.ndarray, z: np.ndarray, y: np.ndarray, grid: np.ndarray, n_bins: int
) -> tuple[float, float]:
    """argmin_T ECE(prefix * sigmoid(z / T)); ties -> temperature closest to 1 (in log)."""
    eces = np.array([_ece_flat(prefix * sigmoid(z / t), y, n_bins) for t in grid])
    best = eces.min()
    cand = np.flatnonzero(eces <= best + 1e-12)
    pick = cand[np.argmin(np.abs(np.log(grid[cand])))]
    return float(grid[pick]), float(eces[pick])


def sequential_temperature_scaling(
    logits: np.ndarray,  # [R, gamma] confidence-head logits on held-out rounds
    accepted: np.ndarray,  # [R] accepted counts, or [R, gamma] bool prefix labels
    mask: np.ndarray | None = None,  # [R, gamma] verified slots
    grid: Sequence[float] | np.ndarray | None = None,
    n_bins: int = DEFAULT_N_BINS,
    refine: bool | None = None,
) -> np.ndarray:
    """Sequential Temperature Scaling; returns temperatures [gamma] (all > 0).

    For ``k = 0..gamma-1`` in order: with the calibrated survival ``a_{k-1}`` of the previous slots
    fixed, pick ``T_k`` from ``grid`` minimising the ECE of ``a_{k-1} * sigmoid(logit_k / T_k)``
    over the rounds that verified slot ``k``.  With the default grid (log-spaced 0.05..20 plus 1.0)
    a second, finer log-spaced grid around the coarse optimum follows (``refine``; default True
    only for the default grid).  Slots without verified rounds keep ``T = 1``.
    """
    logits = np.asarray(logits, np.float64)
    r_, g_ = logits.shape
    labels = _labels_2d(accepted, g_).astype(np.float64)
    m = _mask_2d(mask, (r_, g_))
    if grid is None:
        coarse = DEFAULT_TEMPERATURE_GRID
        refine = True if refine is None else refine
    else:
        coarse = np.asarray(grid, np.float64).reshape(-1)
        refine = bool(refine)
    if coarse.size == 0 or np.any(~(coarse > 0)) or np.any(~np.isfinite(coarse)):
        raise ValueError("temperature grid must be non-empty, finite and > 0")
    temps = np.ones(g_)
    prefix_all = np.ones(r_)  # calibrated survival of slots < k, for every round
    for k in range(g_):
        rows = m[:, k]
        if rows.any():
            z, y, pre = logits[rows, k], labels[rows, k], prefix_all[rows]
            t, _ = _best_temperature(pre, z, y, coarse, n_bins)
            if refine:
                ratio = float(np.exp(np.log(coarse[-1] / coarse[0]) / max(coarse.size - 1, 1)))
                fine = np.unique(np.concatenate([np.geomspace(t / ratio, t * ratio, 41), [t]]))
                t, _ = _best_temperature(pre, z, y, fine, n_bins)
            temps[k] = t
        prefix_all = prefix_all * sigmoid(logits[:, k] / temps[k])
    return temps
