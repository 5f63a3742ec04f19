"""Tests for dspark_jax.eval.calibration (ECE, AUROC, Brier, STS) and the reliability plot."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.eval import calibration as C
from dspark_jax.eval.plots import plot_reliability


def _brute_force_auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos = scores[labels == 1]
    neg = scores[labels == 0]
    wins = 0.0
    for p in pos:
        for q in neg:
            wins += 1.0 if p > q else (0.5 if p == q else 0.0)
    return wins / (len(pos) * len(neg))


def _simulate(n: int, gamma: int, seed: int, loc: float = 1.5, scale: float = 1.5):
    """Rounds whose true conditional acceptance at slot k is sigmoid(z[:, k]) (perfectly calibrated)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(loc, scale, (n, gamma))
    u = rng.random((n, gamma)) < C.sigmoid(z)
    accepted = np.cumprod(u, axis=1).sum(axis=1)
    return z, accepted


@pytest.mark.parametrize("seed", range(5))
def test_auroc_matches_pair_count_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 60
    scores = rng.integers(0, 6, n).astype(float) / 5.0  # many ties
    labels = (rng.random(n) < 0.4).astype(int)
    labels[0], labels[1] = 0, 1  # both classes present
    assert C.auroc(scores, labels) == pytest.approx(_brute_force_auroc(scores, labels), abs=1e-12)
    cont = rng.random(n)
    assert C.auroc(cont, labels) == pytest.approx(_brute_force_auroc(cont, labels), abs=1e-12)


def test_auroc_edge_cases() -> None:
    assert C.auroc([0.1, 0.9], [0, 1]) == 1.0
    assert C.auroc([0.9, 0.1], [0, 1]) == 0.0
    assert C.auroc([0.5, 0.5, 0.5], [0, 1, 1]) == 0.5
    assert math.isnan(C.auroc([0.2, 0.3], [1, 1]))
    # mask drops the entries that would make it perfect
    assert C.auroc([0.1, 0.9, 0.95], [0, 1, 0], mask=[True, True, False]) == 1.0


def test_ece_brier_reliability_hand_example() -> None:
    p = np.array([0.1, 0.1, 0.9, 0.9])
    y = np.array([0, 1, 1, 1])
    # bin [0.10, 0.15): |0.1 - 0.5| * 2/4; bin [0.90, 0.95): |0.9 - 1.0| * 2/4
    assert C.expected_calibration_error(p, y) == pytest.approx(0.25)
    assert C.brier_score(p, y) == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)
    rel = C.reliability_curve(p, y)
    assert len(rel.bin_edges) == 21 and sum(rel.count) == 4
    assert rel.count[2] == 2 and rel.count[18] == 2
    assert rel.accuracy[2] == pytest.approx(0.5) and rel.confidence[18] == pytest.approx(0.9)
    assert math.isnan(rel.accuracy[0])
    json.dumps(rel.to_dict(), allow_nan=False)
    # p = 1.0 falls in the last (closed) bin; exact predictions have zero ECE.
    assert C.expected_calibration_error([1.0, 0.0], [1, 0]) == 0.0
    assert math.isnan(C.expected_calibration_error([], []))


def test_labels_and_masks() -> None:
    lab = C.prefix_labels(np.array([0, 2, 3]), 3)
    assert lab.tolist() == [[False, False, False], [True, True, False], [True, True, True]]
    m = C.verified_mask(np.array([0, 2, 3]), 3)
    assert m.tolist() == [[False, False, False], [True, True, False], [True, True, True]]


def test_calibrated_synthetic_has_small_ece() -> None:
    z, accepted = _simulate(20000, 5, seed=0)
    rep = C.calibration_report(z, accepted)
    assert len(rep.slots) == 5
    assert max(rep.ece) < 0.02
    assert all(s.auroc > 0.6 for s in rep.slots)
    # predicted and empirical prefix survival agree on average
    for s in rep.slots:
        assert s.mean_confidence == pytest.approx(s.accuracy, abs=0.015)
    json.dumps(rep.to_dict(), allow_nan=False)


def test_sequential_temperature_scaling_fixes_miscalibration() -> None:
    z, accepted = _simulate(20000, 4, seed=1)
    scales = np.array([3.0, 0.5, 2.0, 1.0])  # over-, under-, over-confident, calibrated
    raw = z * scales
    before = C.calibration_report(raw, accepted)
    temps = C.sequential_temperature_scaling(raw, accepted)
    after = C.calibration_report(raw, accepted, temperatures=temps)
    assert temps.shape == (4,) and np.all(temps > 0)
    assert np.allclose(temps, scales, rtol=0.15)
    assert before.ece[0] > 0.08 and before.mean_ece > 0.04
    assert max(after.ece) < 0.02
    assert after.mean_ece < before.mean_ece / 3
    # order preserving per slot; AUROC of slot 0 unchanged
    cal = C.apply_temperatures(raw, temps)
    for k in range(4):
        assert np.array_equal(np.argsort(raw[:, k], kind="stable"), np.argsort(cal[:, k], kind="stable"))
    assert after.slots[0].auroc == pytest.approx(before.slots[0].auroc)


def test_sts_is_sequential() -> None:
    # Slot 1's temperature depends on the calibrated slot 0: fixing slot 0 first must matter.
    z, accepted = _simulate(20000, 2, seed=2)
    raw = z * np.array([3.0, 1.0])
    temps = C.sequential_temperature_scaling(raw, accepted)
    assert temps[0] == pytest.approx(3.0, rel=0.15)
    assert temps[1] == pytest.approx(1.0, rel=0.15)


def test_masked_slots_are_ignored() -> None:
    rng = np.random.default_rng(3)
    z, accepted = _simulate(6000, 4, seed=3)
    proposed = rng.integers(0, 5, z.shape[0])
    accepted = np.minimum(accepted, proposed)
    mask = C.verified_mask(proposed, 4)
    labels = C.prefix_labels(accepted, 4)
    rep = C.calibration_report(z * 2, labels, mask=mask)
    temps = C.sequential_temperature_scaling(z * 2, labels, mask=mask, refine=False, grid=np.geomspace(0.5, 4, 61))
    garbage = labels.copy()
    garbage[~mask] = rng.random(int((~mask).sum())) < 0.5
    rep2 = C.calibration_report(z * 2, garbage, mask=mask)
    temps2 = C.sequential_temperature_scaling(z * 2, garbage, mask=mask, refine=False, grid=np.geomspace(0.5, 4, 61))
    assert rep.to_dict() == rep2.to_dict()
    assert np.array_equal(temps, temps2)
    assert [s.n for s in rep.slots] == mask.sum(axis=0).tolist()
    # a slot never verified keeps T = 1 and NaN metrics
    mask0 = mask.copy()
    mask0[:, 3] = False
    t0 = C.sequential_temperature_scaling(z, labels, mask=mask0, grid=[0.5, 1.0, 2.0])
    assert t0[3] == 1.0
    assert math.isnan(C.calibration_report(z, labels, mask=mask0).slots[3].ece)


def test_apply_temperatures_numpy_and_jax_agree() -> None:
    z = np.linspace(-4, 4, 12).reshape(3, 4)
    t = np.array([0.5, 1.0, 2.0, 4.0])
    np_out = C.apply_temperatures(z, t)
    jx_out = np.asarray(C.apply_temperatures(jnp.asarray(z, jnp.float32), t))
    assert np.allclose(np_out, jx_out, atol=1e-6)
    assert np.allclose(C.prefix_survival_from_logits(z, t), np.cumprod(np_out, axis=1))
    assert np.allclose(C.sigmoid(C.logit(np.array([0.1, 0.5, 0.99]))), [0.1, 0.5, 0.99])


def test_invalid_grid() -> None:
    z, accepted = _simulate(50, 2, seed=4)
    with pytest.raises(ValueError):
        C.sequential_temperature_scaling(z, accepted, grid=[0.0, 1.0])


def test_reliability_plot(tmp_path) -> None:
    z, accepted = _simulate(3000, 3, seed=5)
    rep = C.calibration_report(z * 3, accepted)
    temps = C.sequential_temperature_scaling(z * 3, accepted)
    cal = C.calibration_report(z * 3, accepted, temperatures=temps)
    path = plot_reliability(
        {"raw slot 1": rep.slots[0].reliability, "STS slot 1": cal.slots[0].reliability},
        tmp_path / "rel.png",
    )
    assert path.exists() and path.stat().st_size > 1000
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    single = plot_reliability(rep.slots[2].reliability, tmp_path / "rel2.png")
    assert single.stat().st_size > 1000


def test_save_and_load_temperatures(tmp_path) -> None:
    from dspark_jax.eval.calibration import (CALIBRATION_FILE, CALIBRATION_FORMAT,
                                             CalibrationFileError, load_temperatures,
                                             save_temperatures)

    assert load_temperatures(tmp_path) is None  # no file: uncalibrated
    path = save_temperatures(tmp_path, [0.5, 1, 2.25], before={"mean_ece": 0.1},
                             after={"mean_ece": 0.01}, num_rounds=7, data={"seed": 0})
    assert path == tmp_path / CALIBRATION_FILE and not list(tmp_path.glob("*.tmp*"))
    doc = json.loads(path.read_text())
    assert doc["format"] == CALIBRATION_FORMAT and doc["gamma"] == 3
    assert doc["num_rounds"] == 7 and doc["after"] == {"mean_ece": 0.01}
    assert load_temperatures(tmp_path) == (0.5, 1.0, 2.25) == load_temperatures(path, gamma=3)
    with pytest.raises(CalibrationFileError, match="γ = 4"):
        load_temperatures(tmp_path, gamma=4)
    with pytest.raises(CalibrationFileError, match=r"temperatures\[1\]"):
        save_temperatures(tmp_path, [1.0, 0.0])
    for bad, field in [({**doc, "format": "x"}, "'format'"),
                       ({**doc, "temperatures": []}, "'temperatures'"),
                       ({**doc, "temperatures": [1.0, "a", 1.0]}, r"'temperatures\[1\]'"),
                       ({**doc, "temperatures": [1.0, float("inf"), 1.0]}, r"'temperatures\[1\]'"),
                       ({**doc, "gamma": 2}, "'gamma'"),
                       ([1, 2], "JSON object")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(CalibrationFileError, match=field) as e:
            load_temperatures(tmp_path)
        assert str(path) in str(e.value)
