"""results.md: an offline evaluation's report in markdown, rendered from its results.json
document: the τ row in the layout of the paper's Table 1 (with the paper's row for reference),
the per-dataset details (samples, rounds, verify rate, throughput, speedup, calibration),
acceptance by draft position (paper Figure 2) and the pooled confidence calibration (SPEC §7).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dspark_jax.eval.paper_table import PAPER_DRAFTER_NAMES, PAPER_TARGET_NAMES
from dspark_jax.eval.report_numbers import is_number

__all__ = ["render_markdown"]


def _fmt(x: Any, nd: int = 2) -> str:
    if not is_number(x):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{float(x):.{nd}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _md_tau(results: Mapping[str, Any]) -> list[str]:
    """The run's summary and the τ row in the layout of Table 1 (+ the paper's row)."""
    cfg = results["config"]
    names = list(cfg["datasets"])
    ds, mean = results["datasets"], results["mean"]
    out = ["# Speculative decoding evaluation", "",
           f"- target: `{cfg['target']}`; draft: `{cfg['draft']}` ({cfg['draft_type']}, "
           f"γ = {int(cfg['gamma'])})",
           f"- T = {cfg['temperature']:g}, max_new_tokens = {cfg['max_new_tokens']}, "
           f"seed = {cfg['seed']}, batch size = {cfg['batch_size']}, verifier = {cfg['verifier']}, "
           f"thinking {'on' if cfg['enable_thinking'] else 'off'}, first turn only",
           f"- prompts evaluated: {mean['num_evaluated']}, skipped (prompt + output over the "
           f"cache limit {cfg['max_cache_len']}): {mean['num_skipped']}", "",
           "## Accepted length τ (paper Table 1 layout)", ""]
    header = ["target", "drafter"] + names + ["Mean"]
    rows = [[f"`{cfg['target']}`", f"{cfg['draft_type']} (ours)"]
            + [_fmt(ds[n]["tau"]) for n in names] + [_fmt(mean["tau"])]]
    ref = results.get("paper_reference")
    if ref is not None:
        rows.append([PAPER_TARGET_NAMES[ref["target"]],
                     f"{PAPER_DRAFTER_NAMES[ref['drafter']]} (paper)"]
                    + [_fmt(ref["tau"].get(n)) for n in names] + [_fmt(ref["mean_over_evaluated"])])
    out += _table(header, rows)
    if ref is not None:
        out += ["", f"Paper row: {ref['label']}; its Mean is over the datasets evaluated here."]
    return out


def _md_details_row(results: Mapping[str, Any], n: str) -> list[str]:
    cfg, mean = results["config"], results["mean"]
    e = results["datasets"][n] if n != "mean" else mean
    r = [f"**{n}**" if n == "mean" else n, _fmt(e["num_evaluated"]), _fmt(e["num_skipped"]),
         _fmt(e["rounds"]), _fmt(e["tau"]), _fmt(e["verify_rate"], 3),
         _fmt(e["tokens_per_s"], 1), _fmt(e["tokens_per_s_excl_compile"], 1),
         _fmt(e["mean_output_tokens"], 1)]
    if cfg["baseline"]:
        b = e.get("baseline") if n != "mean" else None
        if n == "mean":
            r += ["", _fmt(mean["speedup_excl_compile"]) + "×", _fmt(mean["speedup"]) + "×"]
        else:
            r += [_fmt(b and b["tokens_per_s_excl_compile"], 1),
                  _fmt(b and b["speedup_excl_compile"]) + "×", _fmt(b and b["speedup"]) + "×"]
    if cfg["has_confidence_head"]:
        c = e.get("calibration") if n != "mean" else results.get("calibration")
        r += [_fmt(c and c["mean_ece"], 3), _fmt(c and c["mean_auroc"], 3)]
    return r


def _md_details(results: Mapping[str, Any]) -> list[str]:
    """Per dataset (and the mean): samples, rounds, τ, throughput, speedup, calibration."""
    cfg = results["config"]
    header = ["dataset", "samples", "skipped", "rounds", "τ", "verify rate", "tok/s",
              "tok/s (excl. compile)", "mean out len"]
    if cfg["baseline"]:
        header += ["AR tok/s (excl. compile)", "speedup (excl. compile)", "speedup (wall)"]
    if cfg["has_confidence_head"]:
        header += ["mean ECE", "mean AUROC"]
    rows = [_md_details_row(results, n) for n in list(cfg["datasets"]) + ["mean"]]
    return ["", "## Per dataset", ""] + _table(header, rows)


def _md_positions(results: Mapping[str, Any]) -> list[str]:
    """Cumulative and conditional acceptance by draft position."""
    cfg = results["config"]
    out = ["", "## Acceptance by draft position", "",
           "Cumulative accept_rate@k = P(first k drafts all accepted) (DeepSpec); conditional "
           "= accept_rate@k / accept_rate@k−1 (paper Figure 2).", ""]
    header = ["dataset", "kind"] + [f"@{k + 1}" for k in range(int(cfg["gamma"]))]
    rows = []
    for n in list(cfg["datasets"]) + ["mean"]:
        e = results["datasets"][n] if n != "mean" else results["mean"]
        rows.append([n, "cumulative"] + [_fmt(v, 3) for v in e["accept_rate_at"]])
        rows.append([n, "conditional"] + [_fmt(v, 3) for v in e["conditional_acceptance"]])
    return out + _table(header, rows)


def _md_calibration(cal: Mapping[str, Any]) -> list[str]:
    """The pooled per-slot calibration table."""
    out = ["", "## Confidence calibration (all datasets pooled)", "",
           "Predicted prefix survival Π_{j≤k} σ(c_j) vs. slots ≤ k accepted; ECE with 20 "
           "bins (SPEC §7).", ""]
    rows = [[str(s["slot"] + 1), str(s["n"]), _fmt(s["mean_confidence"], 3),
             _fmt(s["accuracy"], 3), _fmt(s["ece"], 3), _fmt(s["auroc"], 3),
             _fmt(s["brier"], 3)] for s in cal["slots"]]
    rows.append(["mean", "", "", "", _fmt(cal["mean_ece"], 3), _fmt(cal["mean_auroc"], 3),
                 _fmt(cal["mean_brier"], 3)])
    return out + _table(["slot", "n", "mean confidence", "accuracy", "ECE", "AUROC", "Brier"],
                        rows)


def render_markdown(results: Mapping[str, Any]) -> str:
    """results.md: Table-1 style τ row (+ the paper's row), details, positions, calibration."""
    out = _md_tau(results) + _md_details(results) + _md_positions(results)
    cal = results.get("calibration")
    if cal is not None:
        out += _md_calibration(cal)
    plots = results.get("files", {}).get("plots", {})
    if plots:
        out += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()]
    return "\n".join(out) + "\n"
