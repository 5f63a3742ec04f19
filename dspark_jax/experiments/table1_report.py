"""The report of the small-scale Table 1 (`experiments.table1`; DSpark paper §4, Table 1 and
Figure 2) from what its stages left in the work directory: τ per drafter × evaluation set and
temperature (the held-out prompts, each benchmark, their macro mean), the ratios DSpark/DFlash
and DSpark/Eagle3, the position-wise conditional acceptance, training and evaluation times,
calibration, and the held-out learning curves. Writes table1.json, table1.md,
learning_curve.png and conditional_acceptance.png; reads only files, so it can be rerun alone.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping, Sequence

from dspark_jax.eval.acceptance import AcceptanceStats, macro_mean
from dspark_jax.eval.report_numbers import is_number

REPORT_SCHEMA = "dspark_jax.table1/1"
DRAFTERS = ("dspark", "dflash", "eagle3")
LABELS = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "Eagle3"}
HELDOUT = "heldout"
BENCH_MEAN = "benchmark mean"
RATIOS = (("dspark", "dflash"), ("dspark", "eagle3"))


def _read_json(path: pathlib.Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _f(x: Any, nd: int = 2) -> str:
    return f"{float(x):.{nd}f}" if is_number(x) else "–"


def learning_curve(metrics_jsonl: pathlib.Path, key: str = "tau_probabilistic"
                   ) -> list[tuple[int, float]]:
    """(step, held-out teacher-forced `key`) from the `"split": "heldout"` rows of a training
    run's metrics.jsonl, sorted by step; a step logged twice (a resumed run) keeps its last row."""
    if not metrics_jsonl.is_file():
        return []
    by_step: dict[int, float] = {}
    for line in metrics_jsonl.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("split") == HELDOUT and is_number(row.get(key)):
            by_step[int(row["step"])] = float(row[key])
    return sorted(by_step.items())


def set_stats(results: Mapping[str, Any], sets: Sequence[str], benchmarks: Sequence[str]
              ) -> dict[str, AcceptanceStats]:
    """Acceptance statistics per evaluation set of one `dspark_jax.evaluate` run, plus the
    macro mean over the benchmarks (each counts once, as the paper's Mean column)."""
    per = {n: AcceptanceStats.from_dict(results["datasets"][n]) for n in sets
           if n in results["datasets"]}
    evaluated = {n: s for n, s in per.items() if n in benchmarks and s.rounds > 0}
    if evaluated:
        per[BENCH_MEAN] = macro_mean(evaluated, name=BENCH_MEAN)
    return per


def build_report(workdir: pathlib.Path, selection: Mapping[str, Any], settings: Mapping[str, Any],
                 command: str = "") -> dict[str, Any]:
    """Everything table1.json holds (drafters without outputs yet are left out)."""
    sets = list(selection["sets"])
    benchmarks = list(selection["benchmarks"])
    columns = sets + ([BENCH_MEAN] if benchmarks else [])
    temps = [f"{float(t):g}" for t in settings["temperatures"]]
    drafters = [d for d in DRAFTERS if (workdir / d / "summary.json").is_file()]
    training, curves = {}, {}
    tau: dict[str, dict[str, dict[str, float | None]]] = {t: {} for t in temps}
    cond: dict[str, dict[str, dict[str, list]]] = {t: {} for t in temps}
    evals: dict[str, dict[str, Any]] = {t: {} for t in temps}
    for d in drafters:
        s = _read_json(workdir / d / "summary.json")
        h = s.get("heldout_teacher_forced") or {}
        cal = _read_json(workdir / d / "calibration" / "calibration.json")
        training[d] = {
            "steps": s["steps"], "resumed_from_step": s.get("resumed_from_step"),
            "training_s": (s.get("timings_s") or {}).get("training"),
            "job_wall_s": s.get("wall_time_s"),
            "tokens_per_s": (s.get("train_final") or {}).get("tokens_per_s"),
            "heldout_tau_probabilistic": h.get("tau_probabilistic"),
            "heldout_accept_rate@0": h.get("accept_rate@0"),
            "export": (s.get("outputs") or {}).get("export"),
            "calibration": None if cal is None else {
                "file": cal.get("calibration_file"), "temperatures": cal.get("temperatures"),
                "mean_ece_before": cal["before"]["mean_ece"],
                "mean_ece_after": cal["after"]["mean_ece"]}}
        curves[d] = learning_curve(workdir / d / "metrics.jsonl")
        for t in temps:
            r = _read_json(workdir / d / "table1_eval" / f"T{t}" / "results.json")
            if r is None:
                continue
            st = set_stats(r, sets, benchmarks)
            tau[t][d] = {n: (st[n].tau if n in st and is_number(st[n].tau) else None)
                         for n in columns}
            cond[t][d] = {n: [v if is_number(v) else None for v in st[n].conditional_acceptance]
                          for n in columns if n in st}
            evals[t][d] = {"wall_s": r.get("total_wall_s"),
                           "prompts": r["mean"]["num_evaluated"],
                           "out_dir": str(workdir / d / "table1_eval" / f"T{t}")}
    ratios: dict[str, dict[str, dict[str, float | None]]] = {t: {} for t in temps}
    for t in temps:
        for num, den in RATIOS:
            if num in tau[t] and den in tau[t]:
                a, b = tau[t][num], tau[t][den]
                ratios[t][f"{num}/{den}"] = {
                    n: (a[n] / b[n] if is_number(a[n]) and is_number(b[n]) and b[n] else None)
                    for n in columns}
    return {"schema": REPORT_SCHEMA, "command": command, "settings": dict(settings),
            "sets": sets, "benchmarks": benchmarks, "columns": columns,
            "left_out": selection.get("left_out", {}), "drafters": drafters,
            "training": training, "tau": tau, "ratios": ratios,
            "conditional_acceptance": cond, "evaluation": evals,
            "learning_curve": {d: [[s, v] for s, v in c] for d, c in curves.items()},
            "files": {}}


def plot_learning_curves(curves: Mapping[str, Sequence[Sequence[float]]], path: pathlib.Path,
                         title: str) -> pathlib.Path:
    """Held-out teacher-forced τ against training step, one line per drafter."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    for d, pts in curves.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                    label=LABELS.get(d, d))
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out τ (teacher-forced, expected)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if any(curves.values()):
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=110)
    return path


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def render_table1_markdown(r: Mapping[str, Any]) -> str:
    s = r["settings"]
    cols = r["columns"]
    out = ["# Small-scale Table 1: DSpark vs DFlash vs Eagle3", ""]
    if r.get("command"):
        out += [f"Command: `{r['command']}`", ""]
    out += [f"- {s['steps']} training steps per drafter, held-out curve every {s['eval_every']}; "
            f"speculative decoding: γ = 7 (fixed), {s['max_new_tokens']} new tokens, batch "
            f"{s['eval_batch_size']}",
            f"- evaluation sets: {HELDOUT} (the training job's held-out prompts)"
            + (f" and {s['eval_samples']} prompts (≤ {s['max_prompt_tokens']} tokens) from each "
               f"of {', '.join(r['benchmarks'])}" if r["benchmarks"] else ""),
            ]
    if r["left_out"]:
        out.append("- benchmarks left out: " + ", ".join(f"{k} ({v})"
                                                       for k, v in r["left_out"].items()))
    for t, by_d in r["tau"].items():
        out += ["", f"## Accepted length τ, T = {t}", ""]
        rows = [[LABELS[d]] + [_f(by_d[d].get(n)) for n in cols] for d in DRAFTERS if d in by_d]
        for name, by_n in r["ratios"][t].items():
            num, den = name.split("/")
            cells = [_f(by_n.get(n)) + "×" if is_number(by_n.get(n)) else "–" for n in cols]
            rows.append([f"{LABELS[num]}/{LABELS[den]}"] + cells)
        out += _table(["drafter"] + cols, rows)
    for t, by_d in r["conditional_acceptance"].items():
        out += ["", f"## Conditional acceptance by draft position, T = {t}", ""]
        rows = []
        for d in DRAFTERS:
            for n, vals in (by_d.get(d) or {}).items():
                if n in (HELDOUT, BENCH_MEAN):
                    rows.append([LABELS[d], n] + [_f(v, 3) for v in vals])
        g = max((len(row) - 2 for row in rows), default=0)
        out += _table(["drafter", "set"] + [f"@{k + 1}" for k in range(g)], rows)
    out += ["", "## Training and evaluation", ""]
    rows = []
    for d in r["drafters"]:
        tr = r["training"][d]
        cal = tr["calibration"]
        ev = " / ".join(_f((r["evaluation"][t].get(d) or {}).get("wall_s"), 0)
                        for t in r["evaluation"])
        rows.append([LABELS[d], str(tr["steps"]), _f(tr["training_s"], 0), _f(tr["job_wall_s"], 0),
                     _f(tr["tokens_per_s"], 0), _f(tr["heldout_tau_probabilistic"], 3), ev,
                     "–" if cal is None else f"{_f(cal['mean_ece_before'], 3)} → "
                                             f"{_f(cal['mean_ece_after'], 3)}"])
    out += _table(["drafter", "steps", "training s", "job s", "train tok/s",
                   "held-out τ (teacher-forced)",
                   "eval s (T = " + " / ".join(r["evaluation"]) + ")", "calibration ECE"], rows)
    files = r.get("files") or {}
    if files:
        out += ["", "## Figures", ""] + [f"![{k}]({v})" for k, v in files.items()]
    return "\n".join(out) + "\n"


def write_report(plan: Any, selection: Mapping[str, Any]) -> dict[str, Any]:
    """Builds the report for `plan` (a `experiments.table1.Plan`) and writes its files."""
    from dspark_jax.eval.plots import plot_conditional_acceptance

    wd = plan.workdir
    r = build_report(wd, selection, plan.settings(), getattr(plan, "command", ""))
    plot_learning_curves(r["learning_curve"], wd / "learning_curve.png",
                         title=f"Held-out τ during training ({', '.join(map(str, r['drafters']))})")
    r["files"]["learning_curve"] = "learning_curve.png"
    t0 = next(iter(r["conditional_acceptance"]), None)
    if t0 is not None and r["conditional_acceptance"][t0]:
        curves = {f"{LABELS[d]} {n}": v for d, by_n in r["conditional_acceptance"][t0].items()
                  for n, v in by_n.items() if n in (HELDOUT, BENCH_MEAN)}
        plot_conditional_acceptance(curves, wd / "conditional_acceptance.png",
                                    title=f"Conditional acceptance by position (T = {t0})")
        r["files"]["conditional_acceptance"] = "conditional_acceptance.png"
    (wd / "table1.json").write_text(json.dumps(r, indent=2), encoding="utf-8")
    (wd / "table1.md").write_text(render_table1_markdown(r), encoding="utf-8")
    return r
