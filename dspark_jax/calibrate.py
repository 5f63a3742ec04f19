"""Fits the confidence head's Sequential Temperature Scaling on held-out rounds (paper §3.2.1
"Post-hoc Calibration", §3.2.2; SPEC §7) and stores the per-slot temperatures with the drafter.

The scheduler (paper §3.2.2, Algorithm 1) ranks draft slots by the predicted prefix survival
Π_{j≤k} σ(c_j / T_j), so it needs calibrated confidences. This command

1. decodes held-out prompts (`<data_dir>/<name>.jsonl`, DeepSpec's `{"turns": [...]}` records,
   first turn, chat template with the generation prompt) with
   `serving.speculative_generate`, every round verifying all γ drafts, and keeps per round the
   confidence logits of the proposed tokens and how many drafts were verified and accepted;
2. splits the PROMPTS (seeded) into a fit part and a disjoint report part, so no round that
   fitted a temperature is used to judge it;
3. fits STS on the fit rounds (`eval.calibration.sequential_temperature_scaling`) and reports
   ECE / AUROC / Brier per slot on the report rounds before (T = 1) and after;
4. writes `<draft>/confidence_calibration.json` atomically (format `dspark_jax.sts.v1`; the
   drafter loader picks it up as `Draft.confidence_temperatures`) and, in `--out-dir`,
   `calibration.json` (the full report), `rounds.npz` (the raw rounds and their split) and
   `reliability.png` (raw vs STS on the report rounds).

CLI: `python -m dspark_jax.calibrate --target T --draft DIR --data-dir D [--datasets a,b]
[--max-samples N] [--max-new-tokens M] [--batch-size B] [--seed S] [--temperature T]
[--fit-fraction F] [--out-dir O]`. Python API: :func:`collect_rounds`, :func:`calibrate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dspark_jax.eval import runner
from dspark_jax.eval.calibration import (CalibrationFileError, CalibrationReport,
                                         calibration_report, prefix_labels,
                                         prefix_survival_from_logits, reliability_curve,
                                         save_temperatures, sequential_temperature_scaling,
                                         verified_mask)
from dspark_jax.eval.report_numbers import json_float

__all__ = ["Rounds", "collect_rounds", "split_by_prompt", "calibrate", "metrics_summary",
           "format_table", "build_parser", "main"]

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BATCH_SIZE = 8
DEFAULT_FIT_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Rounds:
    """Speculative rounds pooled over prompts: one row per round."""

    logits: np.ndarray     # [R, γ] f32 confidence logits of the proposed tokens
    proposed: np.ndarray   # [R] int drafts verified
    accepted: np.ndarray   # [R] int drafts accepted
    prompt: np.ndarray     # [R] int index into `prompt_ids`
    prompt_ids: tuple[str, ...]  # conversation id of every decoded prompt
    skipped: tuple[str, ...]     # prompts too long for the cache limit

    @property
    def gamma(self) -> int:
        return int(self.logits.shape[1])

    def select(self, prompts: np.ndarray) -> "Rounds":
        keep = np.isin(self.prompt, prompts)
        return dataclasses.replace(self, logits=self.logits[keep], proposed=self.proposed[keep],
                                   accepted=self.accepted[keep], prompt=self.prompt[keep])


def collect_rounds(target: Any, draft: Any, data_dir: str | os.PathLike, *,
                   datasets: Sequence[str] | None = None, max_samples: int | None = None,
                   max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                   batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                   temperature: float = 1.0, min_prompts: int = 1) -> Rounds:
    """Decodes the prompts of `data_dir` and returns every round's confidence logits and counts.

    `datasets`: names of `<data_dir>/<name>.jsonl` (default: all there); `max_samples`: at most
    that many prompts per dataset (seeded subsample; None = all). Prompts that do not fit the
    target's `max_position_embeddings` with `max_new_tokens` are skipped (listed in `skipped`);
    fewer than `min_prompts` left is an error raised before anything is decoded. The prompts
    of all datasets are decoded together, sorted by length (`eval.runner`).
    """
    runner.check_settings(max_new_tokens, batch_size, temperature)
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be ≥ 1 (or None for all), got {max_samples}")
    cfg = draft.config
    if not cfg.has_confidence:
        raise ValueError(f"the drafter ({cfg.model_type}) has no confidence head "
                         "(enable_confidence_head is false): nothing to calibrate")
    tok = target.tokenizer
    if tok is None:
        raise ValueError("the target has no tokenizer (a directory without tokenizer.json?)")
    names = runner.resolve_datasets(data_dir, list(datasets) if datasets else None)
    gamma = int(cfg.num_drafts)
    limit = int(target.config.max_position_embeddings)
    prepared = runner.prepare(data_dir, names, tok, max_samples=dict.fromkeys(names, max_samples),
                              seed=seed, max_new_tokens=max_new_tokens, gamma=gamma, limit=limit)
    ids = [p.convs[i].id for p in prepared.values() for i in p.keep]
    prompts = [q for p in prepared.values() for q in p.prompts]
    skipped = [c for p in prepared.values() for c in p.skipped_ids]
    if len(prompts) < max(min_prompts, 1):
        raise ValueError(f"need at least {max(min_prompts, 1)} prompts, got {len(prompts)} from "
                         f"{names} ({len(skipped)} skipped: prompt + max_new_tokens="
                         f"{max_new_tokens} exceed the cache limit {limit}); raise --max-samples "
                         "or add prompts")
    dec = runner.decode(target, draft, prompts, batch_size=batch_size,
                        batch_seed=lambda b: (int(seed) * 1_000_003 + b * batch_size) % (2 ** 31),
                        max_new_tokens=max_new_tokens, temperature=temperature,
                        cache_len=runner.cache_length([len(p) for p in prompts], max_new_tokens,
                                                      gamma, limit),
                        record_confidence=True)
    # rows in decoding order (length-sorted batches), as rounds.npz has always stored them
    outs = [(i, dec.outputs[i]) for i in dec.order]
    return Rounds(logits=np.concatenate([o.confidence for _, o in outs], axis=0),
                  proposed=np.asarray([x for _, o in outs for x in o.proposed], np.int64),
                  accepted=np.asarray([x for _, o in outs for x in o.accepted], np.int64),
                  prompt=np.asarray([i for i, o in outs for _ in range(len(o.confidence))],
                                    np.int64),
                  prompt_ids=tuple(ids), skipped=tuple(skipped))


def split_by_prompt(num_prompts: int, fit_fraction: float, seed: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (fit, report) prompt indices from a seeded permutation; both non-empty."""
    if not 0.0 < fit_fraction < 1.0:
        raise ValueError(f"fit_fraction must be in (0, 1), got {fit_fraction}")
    if num_prompts < 2:
        raise ValueError(f"need at least 2 decoded prompts to fit on one part and report on "
                         f"another, got {num_prompts} (raise --max-samples)")
    perm = np.random.default_rng(zlib.crc32(b"sts-split") + int(seed)).permutation(num_prompts)
    n_fit = min(max(int(round(fit_fraction * num_prompts)), 1), num_prompts - 1)
    return np.sort(perm[:n_fit]), np.sort(perm[n_fit:])


def metrics_summary(rep: CalibrationReport) -> dict[str, Any]:
    """The per-slot numbers of a report without the reliability bins (for the drafter file)."""
    return {
        "mean_ece": json_float(rep.mean_ece), "mean_auroc": json_float(rep.mean_auroc),
        "mean_brier": json_float(rep.mean_brier),
        "slots": [{"slot": s.slot, "n": s.n, "ece": json_float(s.ece),
                   "auroc": json_float(s.auroc), "brier": json_float(s.brier),
                   "mean_confidence": json_float(s.mean_confidence),
                   "accuracy": json_float(s.accuracy)} for s in rep.slots],
    }


def _pooled_diagram(r: Rounds, temperatures: np.ndarray | None):
    surv = prefix_survival_from_logits(r.logits, temperatures)
    return reliability_curve(surv, prefix_labels(r.accepted, r.gamma),
                             mask=verified_mask(r.proposed, r.gamma))


def calibrate(rounds: Rounds, *, fit_fraction: float = DEFAULT_FIT_FRACTION, seed: int = 0
              ) -> dict[str, Any]:
    """Fits STS on one prompt split and reports on the other; returns the JSON-able result.

    Keys: temperatures, gamma, before/after (report split, T = 1 / fitted), fit_before/fit_after
    (the fit split), split (prompt ids and round counts); not for JSON: "_reports"
    (CalibrationReport objects), "_diagrams" (pooled reliability, report split) and
    "_fit_prompt_index".
    """
    g = rounds.gamma
    fit_p, rep_p = split_by_prompt(len(rounds.prompt_ids), fit_fraction, seed)
    fit, rep = rounds.select(fit_p), rounds.select(rep_p)
    mask = lambda r: verified_mask(r.proposed, g)  # noqa: E731
    temps = sequential_temperature_scaling(fit.logits, fit.accepted, mask=mask(fit))
    reports = {
        "before": calibration_report(rep.logits, rep.accepted, mask=mask(rep)),
        "after": calibration_report(rep.logits, rep.accepted, mask=mask(rep), temperatures=temps),
        "fit_before": calibration_report(fit.logits, fit.accepted, mask=mask(fit)),
        "fit_after": calibration_report(fit.logits, fit.accepted, mask=mask(fit),
                                        temperatures=temps),
    }
    out: dict[str, Any] = {"gamma": g, "temperatures": [float(t) for t in temps]}
    out.update({k: metrics_summary(v) for k, v in reports.items()})
    out["split"] = {
        "by": "prompt", "seed": int(seed), "fit_fraction": float(fit_fraction),
        "fit_prompts": [rounds.prompt_ids[i] for i in fit_p],
        "report_prompts": [rounds.prompt_ids[i] for i in rep_p],
        "fit_rounds": int(fit.logits.shape[0]), "report_rounds": int(rep.logits.shape[0]),
    }
    out["_reports"] = reports
    out["_fit_prompt_index"] = fit_p
    out["_diagrams"] = {"raw (T = 1)": _pooled_diagram(rep, None),
                        "STS": _pooled_diagram(rep, temps)}
    return out


def _f(x: float | None, nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def format_table(result: dict[str, Any]) -> str:
    """Per-slot ECE / AUROC before → after on the report split, and the fitted temperatures."""
    b, a = result["before"], result["after"]
    head = ["slot", "n", "T", "ECE before", "ECE after", "AUROC before", "AUROC after",
            "Brier before", "Brier after"]
    rows = []
    for sb, sa, t in zip(b["slots"], a["slots"], result["temperatures"]):
        rows.append([str(sb["slot"] + 1), str(sb["n"]), f"{t:.3f}", _f(sb["ece"]), _f(sa["ece"]),
                     _f(sb["auroc"]), _f(sa["auroc"]), _f(sb["brier"]), _f(sa["brier"])])
    rows.append(["mean", "", "", _f(b["mean_ece"]), _f(a["mean_ece"]), _f(b["mean_auroc"]),
                 _f(a["mean_auroc"]), _f(b["mean_brier"]), _f(a["mean_brier"])])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def run(target: Any, draft: Any, draft_dir: str | os.PathLike, data_dir: str | os.PathLike, *,
        out_dir: str | os.PathLike | None = None, datasets: Sequence[str] | None = None,
        max_samples: int | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0, temperature: float = 1.0,
        fit_fraction: float = DEFAULT_FIT_FRACTION, target_label: str = "", plots: bool = True
        ) -> dict[str, Any]:
    """collect → split → fit → report → write; returns the result (without the raw reports)."""
    split_by_prompt(2, fit_fraction, seed)  # bad --fit-fraction fails before decoding
    rounds = collect_rounds(target, draft, data_dir, datasets=datasets, max_samples=max_samples,
                            max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                            temperature=temperature, min_prompts=2)
    result = calibrate(rounds, fit_fraction=fit_fraction, seed=seed)
    reports, diagrams = result.pop("_reports"), result.pop("_diagrams")
    fit_index = result.pop("_fit_prompt_index")
    data = {"target": target_label, "data_dir": str(data_dir),
            "datasets": list(datasets) if datasets else None, "max_samples": max_samples,
            "max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
            "seed": int(seed), "batch_size": int(batch_size), "num_prompts": len(rounds.prompt_ids),
            "skipped_prompts": list(rounds.skipped), "split": result["split"]}
    num_rounds = {"total": int(rounds.logits.shape[0]), "fit": result["split"]["fit_rounds"],
                  "report": result["split"]["report_rounds"]}
    path = save_temperatures(draft_dir, result["temperatures"], before=result["before"],
                             after=result["after"], num_rounds=num_rounds, data=data)
    result.update(num_rounds=num_rounds, data=data, calibration_file=str(path))
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        split = np.where(np.isin(rounds.prompt, fit_index), 0, 1)  # 0 = fit, 1 = report
        np.savez(out / "rounds.npz", logits=rounds.logits, proposed=rounds.proposed,
                 accepted=rounds.accepted, prompt=rounds.prompt, split=split,
                 prompt_ids=np.asarray(rounds.prompt_ids))
        full = dict(result, report_before=reports["before"].to_dict(),
                    report_after=reports["after"].to_dict())
        tmp = out / "calibration.json.tmp"
        tmp.write_text(json.dumps(full, indent=2, allow_nan=False), encoding="utf-8")
        os.replace(tmp, out / "calibration.json")
        if plots:
            from dspark_jax.eval.plots import plot_reliability

            labels = {f"{k}, mean ECE {_f(result[s]['mean_ece'])}": diagrams[k]
                      for k, s in (("raw (T = 1)", "before"), ("STS", "after"))}
            plot_reliability(labels, out / "reliability.png",
                             title="Held-out prefix survival, all slots: raw vs STS")
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.calibrate",
                                description="Fit Sequential Temperature Scaling of a DSpark "
                                            "confidence head on held-out rounds (SPEC §7).")
    p.add_argument("--target", required=True,
                   help="embedded target name (smollm2-135m-instruct) or a Hugging Face directory")
    p.add_argument("--draft", required=True,
                   help="drafter directory (DeepSpec or speculators format); the temperatures are "
                        "written here")
    p.add_argument("--data-dir", required=True, help="directory of <name>.jsonl prompt files")
    p.add_argument("--datasets", default=None,
                   help="comma-separated dataset names (default: every .jsonl in --data-dir)")
    p.add_argument("--max-samples", type=int, default=None,
                   help="prompts per dataset (default all)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--seed", type=int, default=0,
                   help="subsampling, sampling and fit/report split seed")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--fit-fraction", type=float, default=DEFAULT_FIT_FRACTION,
                   help="share of the prompts whose rounds fit the temperatures (rest: report)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out-dir", default="calibration_results",
                   help="report, raw rounds and reliability.png (default %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="skip reliability.png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad input)."""
    a = build_parser().parse_args(argv)
    from dspark_jax.models import load_draft, load_target
    from dspark_jax.models.config import ConfigError

    datasets = [d.strip() for d in a.datasets.split(",") if d.strip()] if a.datasets else None
    try:
        target = load_target(a.target, dtype=a.dtype)
        draft = load_draft(a.draft, target=target)
        result = run(target, draft, a.draft, a.data_dir, out_dir=a.out_dir, datasets=datasets,
                     max_samples=a.max_samples, max_new_tokens=a.max_new_tokens,
                     batch_size=a.batch_size, seed=a.seed, temperature=a.temperature,
                     fit_fraction=a.fit_fraction, target_label=str(a.target),
                     plots=not a.no_plots)
    except (ConfigError, CalibrationFileError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s = result["split"]
    print(f"Sequential Temperature Scaling, γ = {result['gamma']}: fitted on {s['fit_rounds']} "
          f"rounds ({len(s['fit_prompts'])} prompts), reported on {s['report_rounds']} held-out "
          f"rounds ({len(s['report_prompts'])} prompts)")
    print(format_table(result))
    print(f"wrote {result['calibration_file']}")
    if a.out_dir:
        print(f"wrote {Path(a.out_dir) / 'calibration.json'}, rounds.npz"
              + ("" if a.no_plots else ", reliability.png"))
    return 0


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main)
