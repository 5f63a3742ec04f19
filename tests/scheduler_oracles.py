"""Literal numpy oracles of the prefix scheduler (`dspark_jax.decoding.scheduler`): Python-loop
transcriptions of Algorithm 1 and of top-K admission that the jitted versions must match, with
the same tie-breaking (a descending, then request, then slot)."""

from __future__ import annotations

from typing import Any

import numpy as np


def _np_sps(sps: np.ndarray, b: int) -> Any:
    return sps[b] if 0 <= b < sps.shape[0] else sps.dtype.type(0)


def _np_candidates(conf: np.ndarray, active: np.ndarray, dtype: Any) -> tuple[np.ndarray, list]:
    conf = np.nan_to_num(np.asarray(conf, dtype=dtype), nan=0.0)
    conf = np.clip(conf, 0, 1).astype(dtype)
    r_, g_ = conf.shape
    a = np.zeros((r_, g_), dtype)
    for r in range(r_):
        acc = dtype(1.0)
        for j in range(g_):
            acc = dtype(acc * conf[r, j])
            a[r, j] = acc
    cands = [(r, j, a[r, j]) for r in range(r_) for j in range(g_) if active[r] and a[r, j] > 0]
    cands.sort(key=lambda t: (-t[2], t[0], t[1]))  # a descending, then request, then slot
    return a, cands


def schedule_verification_reference(
    conf: np.ndarray,
    active: np.ndarray,
    sps: np.ndarray,
    early_stop: bool = True,
    dtype: Any = np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """Literal Python-loop transcription of Algorithm 1; returns ``(lengths [R], mask [R, G])``."""
    conf = np.asarray(conf)
    active = np.asarray(active, bool)
    sps = np.asarray(sps, dtype)
    r_, g_ = conf.shape
    _, cands = _np_candidates(conf, active, dtype)
    n_act = int(active.sum())
    ell = np.zeros(r_, np.int64)
    best_ell = ell.copy()
    b = n_act
    tau = dtype(n_act)
    theta_best = dtype(tau * _np_sps(sps, b))
    for r, j, a in cands:
        ell[r] = j + 1
        b += 1
        tau = dtype(tau + a)
        theta = dtype(tau * _np_sps(sps, b))
        if theta > theta_best:
            theta_best = theta
            best_ell = ell.copy()
        elif early_stop:
            break
    mask = np.arange(g_)[None, :] < best_ell[:, None]
    return best_ell, mask


def topk_admission_reference(
    conf: np.ndarray, active: np.ndarray, capacity: int, dtype: Any = np.float64
) -> tuple[np.ndarray, np.ndarray]:
    """Literal loop for :func:`topk_admission`; returns ``(lengths [R], mask [R, G])``."""
    conf = np.asarray(conf)
    active = np.asarray(active, bool)
    r_, g_ = conf.shape
    _, cands = _np_candidates(conf, active, dtype)
    ell = np.zeros(r_, np.int64)
    for r, j, _a in cands[: max(int(capacity), 0)]:
        ell[r] = j + 1
    return ell, np.arange(g_)[None, :] < ell[:, None]
