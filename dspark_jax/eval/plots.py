"""PNG figures for the offline evaluation (paper Table 1 as bars, Figure 2, calibration diagrams).

Uses matplotlib's object-oriented API with the Agg canvas directly (``Figure`` +
``FigureCanvasAgg``), so importing this module never changes the global matplotlib backend and
works headless.  Every writer creates the parent directory and returns the written path.

* :func:`plot_tau` — accepted length tau per dataset (grouped bars), optionally next to paper
  reference values (e.g. ``paper_table.PAPER_TABLE1_TAU["qwen3_4b"]``).
* :func:`plot_conditional_acceptance` — position-wise conditional acceptance, one line per
  dataset or drafter (paper Figure 2).
* :func:`plot_reliability` — reliability diagram(s) from
  :class:`dspark_jax.eval.calibration.ReliabilityDiagram`.
* :func:`write_evaluation_plots` — the plots of one evaluation, from its results.json document.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dspark_jax.eval.acceptance import AcceptanceStats
from dspark_jax.eval.calibration import CalibrationReport, ReliabilityDiagram

__all__ = ["plot_tau", "plot_conditional_acceptance", "plot_reliability", "write_evaluation_plots"]

PathLike = Union[str, Path]


def _save(fig: Figure, path: PathLike, dpi: int) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, format="png", dpi=dpi)
    return out


def _nan(v: float | None) -> float:
    return math.nan if v is None else float(v)


def plot_tau(
    tau: Mapping[str, float] | Mapping[str, Mapping[str, float]],
    path: PathLike,
    reference: Mapping[str, float] | Mapping[str, Mapping[str, float]] | None = None,
    title: str | None = None,
    label: str = "ours",
    dpi: int = 110,
) -> Path:
    """Grouped bar chart of tau per dataset.

    ``tau`` is ``{dataset: tau}`` (one series named ``label``) or ``{series: {dataset: tau}}``.
    ``reference`` (optional, drawn hatched) has the same two forms; a flat mapping is labelled
    "paper".  Datasets are taken in first-seen order over all series; missing values are skipped.
    """

    def series_of(m: Mapping | None, default: str) -> dict[str, Mapping[str, float]]:
        if not m:
            return {}
        first = next(iter(m.values()))
        return {str(k): v for k, v in m.items()} if isinstance(first, Mapping) else {default: m}

    ours = series_of(tau, label)
    refs = series_of(reference, "paper")
    datasets: list[str] = []
    for s in list(ours.values()) + list(refs.values()):
        for d in s:
            if d not in datasets:
                datasets.append(d)
    all_series = [(n, s, False) for n, s in ours.items()] + [(f"{n}", s, True) for n, s in refs.items()]
    n_series = max(len(all_series), 1)
    fig = Figure(figsize=(max(6.0, 1.1 * len(datasets) + 2), 4.0))
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(datasets))
    width = 0.8 / n_series
    for i, (name, s, is_ref) in enumerate(all_series):
        vals = np.array([_nan(s.get(d)) for d in datasets], dtype=float)
        bars = ax.bar(
            x + (i - (n_series - 1) / 2) * width,
            np.nan_to_num(vals, nan=0.0),
            width,
            label=name,
            hatch="//" if is_ref else None,
            alpha=0.6 if is_ref else 0.9,
        )
        for b, v in zip(bars, vals):
            if math.isfinite(v):
                ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                            fontsize=6)
    ax.set_xticks(x)
    ax.set_xticklabels(datasets, rotation=30, ha="right")
    ax.set_ylabel("accepted length τ")
    ax.set_title(title or "Accepted length per dataset")
    if all_series:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path, dpi)


def plot_conditional_acceptance(
    curves: Mapping[str, Sequence[float | None]],
    path: PathLike,
    title: str | None = None,
    ylabel: str = "conditional acceptance",
    dpi: int = 110,
) -> Path:
    """Position-wise conditional acceptance (paper Figure 2): one line per key, x = 1..gamma.

    Values are e.g. ``AcceptanceStats.conditional_acceptance``; NaN/None leave gaps.
    """
    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    gamma = 0
    for name, vals in curves.items():
        y = np.array([_nan(v) for v in vals], dtype=float)
        gamma = max(gamma, y.size)
        ax.plot(np.arange(1, y.size + 1), y, marker="o", label=str(name))
    if gamma:
        ax.set_xticks(np.arange(1, gamma + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "Position-wise conditional acceptance")
    if curves:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path, dpi)


def plot_reliability(
    diagrams: ReliabilityDiagram | Mapping[str, ReliabilityDiagram],
    path: PathLike,
    title: str | None = None,
    dpi: int = 110,
) -> Path:
    """Reliability diagram(s): empirical accuracy vs mean confidence per bin, with the diagonal.

    ``diagrams`` is one :class:`ReliabilityDiagram` or ``{label: diagram}`` (e.g. one per slot, or
    "raw" vs "STS").  Marker area grows with the bin count; a lower panel shows bin counts.
    """
    if isinstance(diagrams, ReliabilityDiagram):
        diagrams = {"": diagrams}
    fig = Figure(figsize=(5.0, 6.0))
    ax = fig.add_axes([0.13, 0.36, 0.82, 0.58])
    axc = fig.add_axes([0.13, 0.08, 0.82, 0.2])
    ax.plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=1, label="perfect")
    for name, d in diagrams.items():
        conf = np.array(d.confidence, float)
        acc = np.array(d.accuracy, float)
        cnt = np.array(d.count, float)
        ok = np.isfinite(conf) & np.isfinite(acc)
        size = 10 + 90 * cnt / max(cnt.max(), 1.0)
        line = ax.plot(conf[ok], acc[ok], marker=None, label=str(name) or None)[0]
        ax.scatter(conf[ok], acc[ok], s=size[ok], color=line.get_color())
        edges = np.array(d.bin_edges, float)
        axc.step(edges[:-1], cnt, where="post", color=line.get_color())
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("empirical prefix survival")
    ax.set_title(title or "Reliability diagram")
    if len(diagrams) > 1 or any(diagrams):
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    axc.set_xlim(0, 1)
    axc.set_xlabel("predicted prefix survival")
    axc.set_ylabel("count")
    return _save(fig, path, dpi)


def write_evaluation_plots(out: Path, results: Mapping[str, Any],
                           stats: Mapping[str, AcceptanceStats],
                           pooled_calib: CalibrationReport | None) -> dict[str, str]:
    """An evaluation's PNG plots in `out` (τ per dataset beside the paper's row, conditional
    and cumulative acceptance by position, the reliability diagram of a confidence head), from
    its results.json document and statistics; returns {plot: file name}."""
    evaluated = [n for n, s in stats.items() if s.rounds > 0]
    pngs: dict[str, str] = {}
    taus = {n: stats[n].tau for n in evaluated}
    ref = results["paper_reference"]
    ref_series = None
    if ref is not None:
        ref_series = {ref["label"]: {n: ref["tau"][n] for n in evaluated if n in ref["tau"]}}
        if not next(iter(ref_series.values())):
            ref_series = None
    cfg = results["config"]
    plot_tau(taus, out / "tau.png", reference=ref_series, label=f"{cfg['draft_type']} (ours)",
             title=f"Accepted length τ (T={cfg['temperature']:g}, γ={cfg['gamma']})")
    pngs["tau"] = "tau.png"
    curves = {n: list(stats[n].conditional_acceptance) for n in evaluated}
    if len(evaluated) > 1:
        curves["mean"] = results["mean"]["conditional_acceptance"]
    plot_conditional_acceptance(curves, out / "conditional_acceptance.png",
                                title="Position-wise conditional acceptance (paper Fig. 2)")
    pngs["conditional_acceptance"] = "conditional_acceptance.png"
    cum = {n: list(stats[n].accept_rate_at) for n in evaluated}
    plot_conditional_acceptance(cum, out / "accept_rate.png",
                                title="Cumulative acceptance accept_rate@k (DeepSpec)",
                                ylabel="P(first k drafts accepted)")
    pngs["accept_rate"] = "accept_rate.png"
    if pooled_calib is not None:
        diagrams = {f"slot {s.slot + 1} (ECE {s.ece:.3f})": s.reliability
                    for s in pooled_calib.slots if s.n > 0}
        if diagrams:
            plot_reliability(diagrams, out / "reliability.png",
                             title="Confidence head: predicted vs empirical prefix survival")
            pngs["reliability"] = "reliability.png"
    return pngs
