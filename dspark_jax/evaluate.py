"""Offline evaluation of a drafter with speculative decoding: DeepSpec's protocol (SPEC §6, §7).

What this module implements:

* DeepSpec's offline evaluation protocol (SPEC §6; DeepSpec's evaluator): the benchmark prompt
  files `<data_dir>/<name>.jsonl` (`{"turns": [...]}` records), DeepSpec's per-dataset sample
  caps and seeded subsampling (seed 980406, `data.prompts.load_eval_dataset`), the first turn
  only, rendered with the chat template with the generation prompt on and thinking disabled
  (`data.chat.render_prompt`), T = 1.0 and 2048 new tokens. Every default can be overridden.
* The paper's measurements (DSpark paper §4, Table 1 and Figure 2): the pooled accepted length
  τ = Σ(acceptance length)/#rounds per dataset, counted as DeepSpec's evaluator counts it
  (accepted drafts + 1 per round; a round whose accepted drafts hold a stop token counts the
  drafts up to and including it, no bonus; rounds run under DeepSpec's token-budget rule), and
  its macro mean, DeepSpec's verify_rate and cumulative accept_rate@k, the paper's
  position-wise conditional acceptance, all from `eval.acceptance`; a markdown table in the
  layout of Table 1 with the paper's row for reference; PNG plots of τ per dataset and of the
  conditional acceptance by position (Figure 2).
* Confidence calibration of the DSpark confidence head (paper §3.2.1; SPEC §7): per-slot ECE
  (20 bins), AUROC, Brier and a reliability diagram of the predicted prefix survival
  Π_{j≤k} σ(c_j) against "slots ≤ k accepted", from the confidence logits recorded in every
  round (`eval.calibration`).
* Throughput: generated tokens per second of wall time per dataset (and with XLA compilation
  time, measured through `jax.monitoring`, taken out), mean output length, and with
  `baseline=True` plain autoregressive decoding of the same prompts and the speedup.

Prompts of a dataset are sorted by length and decoded in batches of `batch_size` with
`serving.speculative_generate` — the serving engine (lossless rejection sampling,
SPEC §1; any scheduler mode, `scheduler=`) — by the evaluation driver `eval.runner`, which
`calibrate` shares. One cache length is used for the whole run so the rounds compile once per
batch size (the prefill once per batch's total prompt length). A prompt whose length + max_new_tokens + γ + 1 does not fit the cache
limit (default: the target's `max_position_embeddings`) is skipped and counted, not decoded.

Outputs written to `out_dir`:

* `results.json` — everything below (schema `dspark_jax.evaluate/1`);
* `results.md` — the Table-1 style τ table, per-dataset details, acceptance by position and
  calibration tables;
* `records.jsonl` — the raw per-round records: one line per decoded prompt
  `{"dataset", "index", "id", "prompt_tokens", "output_tokens", "proposed": [..],
  "accepted": [..], "acceptance": [..]}` (DeepSpec's per-round proposal length, accepted drafts
  and acceptance length; + `"output_ids"`, `"text"`, `"baseline_output_ids"` on request);
* `confidence.npz` — (drafts with a confidence head) per dataset a float32 [R, γ] array of the
  confidence logits of every round, rows in the order of `records.jsonl` (dataset, then
  records, then rounds);
* `tau.png`, `conditional_acceptance.png`, `accept_rate.png`, and `reliability.png` (with a
  confidence head).

CLI: `python -m dspark_jax.evaluate --target NAME_OR_DIR --draft CKPT_DIR --data-dir DIR ...`
(see `build_parser`). Python API: :func:`evaluate`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from dspark_jax.data.prompts import DEEPSPEC_EVAL_SEED, DEFAULT_EVAL_SAMPLES
from dspark_jax.decoding.pallas_backend import check_offered
from dspark_jax.decoding.scheduler import MODES
from dspark_jax.eval import runner
from dspark_jax.eval.acceptance import (PAPER_DATASETS, PAPER_TABLE1_TAU, AcceptanceStats,
                                        acceptance_stats, macro_mean)
from dspark_jax.eval.calibration import CalibrationReport, calibration_report, verified_mask
from dspark_jax.eval.results import RESULTS_FILE, pooled_rounds, write_rounds
from dspark_jax.eval.runner import EvalDatasetError

__all__ = ["evaluate", "main", "build_parser", "EvalDatasetError", "RESULTS_SCHEMA",
           "DEFAULT_DATASETS", "paper_reference_for", "render_markdown"]

RESULTS_SCHEMA = "dspark_jax.evaluate/1"
#: The DeepSpec protocol's datasets in the column order of the paper's Table 1.
DEFAULT_DATASETS: tuple[str, ...] = PAPER_DATASETS
DEFAULT_MAX_NEW_TOKENS = 2048
DEFAULT_TEMPERATURE = 1.0
DEFAULT_BATCH_SIZE = 8
DEFAULT_OUT_DIR = "eval_results"

_PAPER_TARGET_NAMES = {"qwen3_4b": "Qwen3-4B", "qwen3_8b": "Qwen3-8B", "qwen3_14b": "Qwen3-14B",
                       "gemma4_12b": "Gemma4-12B"}
_PAPER_DRAFTER_NAMES = {"eagle3": "Eagle3", "dflash": "DFlash", "dspark": "DSpark"}


# ------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------

def _jf(x: float | None) -> float | None:
    """JSON-safe float (NaN/inf → None)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _safe_div(a: float, b: float) -> float:
    return float(a) / float(b) if b else math.nan


def _nanmean(xs: Sequence[float | None]) -> float:
    v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return float(np.mean(v)) if v else math.nan


def _batch_seed(seed: int, dataset: str, batch_index: int) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(dataset.encode()) + batch_index) % (2 ** 31)


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


def _max_samples_for(name: str, max_samples: Any) -> int | None:
    if isinstance(max_samples, Mapping):
        return max_samples.get(name, DEFAULT_EVAL_SAMPLES.get(name))
    if max_samples == "default":
        return DEFAULT_EVAL_SAMPLES.get(name)
    if max_samples is None or max_samples == "all":
        return None
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 0:
        raise ValueError(f"max_samples must be 'default', None/'all', an int ≥ 0 or a mapping; "
                         f"got {max_samples!r}")
    return int(max_samples)


def _stats_dict(st: AcceptanceStats) -> dict[str, Any]:
    d = st.to_dict()
    d.pop("name", None)
    return d


# ------------------------------------------------------------------------------------------
# the evaluation
# ------------------------------------------------------------------------------------------

def evaluate(target: Any, draft: Any, data_dir: str | os.PathLike, *,
             datasets: Sequence[str] | str | None = None,
             max_samples: int | None | str | Mapping[str, int] = "default",
             seed: int = DEEPSPEC_EVAL_SEED, temperature: float = DEFAULT_TEMPERATURE,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, batch_size: int = DEFAULT_BATCH_SIZE,
             out_dir: str | os.PathLike | None = None, baseline: bool = False,
             verifier: str = "jax", max_cache_len: int | None = None,
             enable_thinking: bool = False, system_prompt: str | None = None,
             stop_token_ids: Sequence[int] | None = None, tokenizer: Any = None,
             dtype: str = "float32", paper_reference: str | None = "auto",
             save_outputs: bool = False, progress: bool = True, plots: bool = True,
             scheduler: str = "fixed") -> dict[str, Any]:
    """Evaluates `draft` on `target` over DeepSpec-format prompt files; returns results.json.

    Decoding runs through the serving engine (`dspark_jax.serving.Engine`, one slot per prompt
    of a batch) with `scheduler` ("fixed" = DeepSpec's protocol: verify all γ drafts; any
    engine mode works, e.g. "adaptive").

    `target`: a loaded `Target` or a name/directory for `load_target`; `draft`: a `Draft` or a
    DeepSpec-format checkpoint directory (`load_draft`). `datasets`: names (or a comma
    separated string) of `<data_dir>/<name>.jsonl`; None = the protocol's datasets present.
    `max_samples`: "default" (DeepSpec's caps), None/"all", an int for every dataset or
    {name: int}. `max_cache_len`: cache limit in tokens (default the target's
    max_position_embeddings); longer prompts are skipped and counted. `save_outputs` adds the
    generated ids and text to records.jsonl. With `out_dir` the files listed in the module
    docstring are written there.

    Raises `EvalDatasetError` for missing datasets, `ConfigError` for a drafter built for
    another target, `ValueError` for bad arguments.
    """
    from dspark_jax.serving.generate import SpecSettings, check_compatible
    from dspark_jax.models import Draft, Target, load_draft, load_target

    runner.check_settings(max_new_tokens, batch_size, temperature)
    if verifier not in ("jax", "pallas"):
        raise ValueError(f"verifier must be 'jax' or 'pallas', got {verifier!r}")
    if verifier == "pallas":
        check_offered("verifier='pallas'")
    data_dir = Path(data_dir)
    names = runner.resolve_datasets(data_dir, datasets, DEFAULT_DATASETS)
    per_ds_max = {n: _max_samples_for(n, max_samples) for n in names}

    target_label = str(target) if not isinstance(target, Target) else (target.name or "target")
    if not isinstance(target, Target):
        target = load_target(target, dtype=dtype)
    draft_label = "draft"
    if not isinstance(draft, Draft):
        draft_label = str(draft)
        draft = load_draft(draft, target=target)
    check_compatible(target, draft)  # ConfigError before any work
    dcfg = draft.config
    gamma = int(dcfg.num_drafts)
    draft_type = dcfg.model_type
    if draft_label == "draft":
        draft_label = draft_type
    has_conf = bool(dcfg.has_confidence)
    tok = tokenizer if tokenizer is not None else target.tokenizer
    if tok is None:
        raise ValueError("the target has no tokenizer (a directory without tokenizer.json?); "
                         "pass tokenizer=")
    limit = int(max_cache_len if max_cache_len is not None
                else target.config.max_position_embeddings)
    if limit < 2:
        raise ValueError(f"max_cache_len must be ≥ 2, got {limit}")

    # ---------------------------------------------------------------- prompts
    prepared = runner.prepare(data_dir, names, tok, max_samples=per_ds_max, seed=seed,
                              max_new_tokens=max_new_tokens, gamma=gamma, limit=limit,
                              system_prompt=system_prompt, enable_thinking=enable_thinking)
    # one cache length for the run: the rounds compile once per batch size
    cache_len = runner.cache_length([len(q) for p in prepared.values() for q in p.prompts],
                                    max_new_tokens, gamma, limit)
    settings = SpecSettings(verifier=verifier, record_confidence=has_conf)
    run_kw = dict(batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature,
                  cache_len=cache_len, stop_token_ids=stop_token_ids)

    total = sum(len(p.keep) for p in prepared.values())
    bar = runner.Progress(total, "speculative", enabled=progress)
    t_run = time.perf_counter()
    per_ds: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    conf_arrays: dict[str, np.ndarray] = {}
    stats_by_ds: dict[str, AcceptanceStats] = {}
    for name, p in prepared.items():
        bar.dataset(name)
        dec = runner.decode(target, draft, p.prompts,
                            batch_seed=functools.partial(_batch_seed, seed, name),
                            settings=settings, scheduler=scheduler, progress=bar, **run_kw)
        # per-dataset aggregation, records in the subsampled order
        recs, prop_all, acc_all, alen_all, conf_rows = [], [], [], [], []
        for i, o in zip(p.keep, dec.outputs):
            rec = {"dataset": name, "index": i, "id": p.convs[i].id,
                   "prompt_tokens": len(p.ids[i]), "output_tokens": len(o.tokens),
                   "proposed": o.proposed, "accepted": o.accepted, "acceptance": o.acceptance}
            if save_outputs:
                rec["output_ids"] = o.tokens
                rec["text"] = tok.decode(o.tokens)
            recs.append(rec)
            prop_all += o.proposed
            acc_all += o.accepted
            alen_all += o.acceptance
            if o.confidence is not None:
                conf_rows.append(o.confidence)
        records[name] = recs
        st = acceptance_stats(prop_all, acc_all, gamma=gamma, name=name, acceptance=alen_all)
        stats_by_ds[name] = st
        n_tok = sum(r["output_tokens"] for r in recs)
        wall, compile_s = dec.wall_s, dec.compile_s
        entry: dict[str, Any] = {
            "num_prompts": len(p.convs),
            "num_evaluated": len(p.keep),
            "num_skipped": len(p.skipped),
            "skipped_ids": p.skipped_ids,
            **_stats_dict(st),
            "num_output_tokens": n_tok,
            "mean_output_tokens": _jf(_safe_div(n_tok, len(recs))),
            "mean_prompt_tokens": _jf(_safe_div(sum(r["prompt_tokens"] for r in recs),
                                                len(recs))),
            "wall_s": wall,
            "compile_s": compile_s,
            "tokens_per_s": _jf(_safe_div(n_tok, wall)),
            "tokens_per_s_excl_compile": _jf(_safe_div(n_tok, max(wall - compile_s, 0.0))),
            "calibration": None,
            "baseline": None,
        }
        if has_conf:
            logits = (np.concatenate(conf_rows, axis=0) if conf_rows
                      else np.zeros((0, gamma), np.float32))
            conf_arrays[name] = logits.astype(np.float32)
            if logits.shape[0]:
                rep = calibration_report(logits, np.asarray(acc_all),
                                         mask=verified_mask(np.asarray(prop_all), gamma))
                entry["calibration"] = rep.to_dict()
        per_ds[name] = entry
    bar.close()

    # ---------------------------------------------------------------- baseline
    if baseline:
        bar = runner.Progress(total, "autoregressive", enabled=progress)
        for name, p in prepared.items():
            bar.dataset(name)
            dec = runner.decode_autoregressive(
                target, p.prompts, batch_seed=functools.partial(_batch_seed, seed, name),
                progress=bar, **run_kw)
            if save_outputs:
                base_out = dict(zip(p.keep, dec.outputs))
                for rec in records[name]:
                    rec["baseline_output_ids"] = base_out[rec["index"]].tokens
            e = per_ds[name]
            n_tok, wall = sum(len(o.tokens) for o in dec.outputs), dec.wall_s
            tps = _safe_div(n_tok, wall)
            tps_x = _safe_div(n_tok, max(wall - dec.compile_s, 0.0))
            e["baseline"] = {
                "num_output_tokens": n_tok,
                "mean_output_tokens": _jf(_safe_div(n_tok, len(p.keep))),
                "wall_s": wall,
                "compile_s": dec.compile_s,
                "tokens_per_s": _jf(tps),
                "tokens_per_s_excl_compile": _jf(tps_x),
                "speedup": _jf(_safe_div(e["tokens_per_s"] or math.nan, tps)),
                "speedup_excl_compile": _jf(_safe_div(
                    e["tokens_per_s_excl_compile"] or math.nan, tps_x)),
            }
        bar.close()

    # ---------------------------------------------------------------- aggregation
    evaluated = {n: s for n, s in stats_by_ds.items() if s.rounds > 0}
    mean_stats = macro_mean(evaluated, name="mean")
    mean: dict[str, Any] = {
        "datasets": list(evaluated),
        **_stats_dict(mean_stats),
        "num_evaluated": sum(e["num_evaluated"] for e in per_ds.values()),
        "num_skipped": sum(e["num_skipped"] for e in per_ds.values()),
        "mean_output_tokens": _jf(_nanmean([per_ds[n]["mean_output_tokens"] for n in evaluated])),
        "tokens_per_s": _jf(_nanmean([per_ds[n]["tokens_per_s"] for n in evaluated])),
        "tokens_per_s_excl_compile": _jf(_nanmean(
            [per_ds[n]["tokens_per_s_excl_compile"] for n in evaluated])),
        "speedup": None,
        "speedup_excl_compile": None,
    }
    if baseline:
        mean["speedup"] = _jf(_nanmean([per_ds[n]["baseline"]["speedup"] for n in evaluated]))
        mean["speedup_excl_compile"] = _jf(_nanmean(
            [per_ds[n]["baseline"]["speedup_excl_compile"] for n in evaluated]))
    pooled_calib: CalibrationReport | None = None
    if has_conf and any(a.shape[0] for a in conf_arrays.values()):
        logits, prop, acc = pooled_rounds(records, names, conf_arrays)
        pooled_calib = calibration_report(logits, acc, mask=verified_mask(prop, gamma))

    ref_key = paper_reference_for(target_label, draft_type, paper_reference)
    paper_ref = None
    if ref_key is not None and any(n in PAPER_DATASETS for n in names):
        row = PAPER_TABLE1_TAU[ref_key[0]][ref_key[1]]
        common = [n for n in names if n in row]
        label = (f"{_PAPER_TARGET_NAMES[ref_key[0]]} {_PAPER_DRAFTER_NAMES[ref_key[1]]}"
                 " (paper, T=1, γ=7)")
        paper_ref = {"target": ref_key[0], "drafter": ref_key[1], "label": label,
                     "tau": dict(row),
                     "mean_over_evaluated": _jf(_nanmean([row[n] for n in common]))}

    import jax

    results: dict[str, Any] = {
        "schema": RESULTS_SCHEMA,
        "config": {
            "target": target_label,
            "draft": draft_label,
            "draft_type": draft_type,
            "gamma": gamma,
            "has_confidence_head": has_conf,
            "data_dir": str(data_dir),
            "datasets": names,
            "max_samples": per_ds_max,
            "seed": int(seed),
            "temperature": float(temperature),
            "max_new_tokens": int(max_new_tokens),
            "batch_size": int(batch_size),
            "max_cache_len": limit,
            "cache_len": int(cache_len),
            "verifier": verifier,
            "scheduler": scheduler,
            "baseline": bool(baseline),
            "first_turn_only": True,
            "add_generation_prompt": True,
            "enable_thinking": bool(enable_thinking),
            "system_prompt": system_prompt,
            "stop_token_ids": None if stop_token_ids is None else [int(x) for x in stop_token_ids],
        },
        "environment": {"jax": jax.__version__, "backend": jax.default_backend(),
                        "devices": [str(d.device_kind) for d in jax.devices()][:1],
                        "num_devices": jax.device_count()},
        "datasets": per_ds,
        "mean": mean,
        "calibration": None if pooled_calib is None else pooled_calib.to_dict(),
        "paper_reference": paper_ref,
        "total_wall_s": time.perf_counter() - t_run,
        "files": {},
    }
    if out_dir is not None:
        _write_outputs(Path(out_dir), results, records, conf_arrays, stats_by_ds, pooled_calib,
                       plots=plots)
    return results


# ------------------------------------------------------------------------------------------
# outputs
# ------------------------------------------------------------------------------------------

def _write_outputs(out: Path, results: dict[str, Any], records: Mapping[str, list[dict]],
                   conf_arrays: Mapping[str, np.ndarray], stats: Mapping[str, AcceptanceStats],
                   pooled_calib: CalibrationReport | None, *, plots: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {"results_json": RESULTS_FILE, "results_md": "results.md"}
    files.update(write_rounds(out, results["config"]["datasets"], records, conf_arrays))
    if plots:
        from dspark_jax.eval.plots import plot_conditional_acceptance, plot_reliability, plot_tau

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
        mean = results["mean"]
        curves = {n: list(stats[n].conditional_acceptance) for n in evaluated}
        if len(evaluated) > 1:
            curves["mean"] = mean["conditional_acceptance"]
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
        files["plots"] = pngs
    results["files"] = files
    (out / "results.md").write_text(render_markdown(results), encoding="utf-8")
    tmp = out / (RESULTS_FILE + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, out / RESULTS_FILE)


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{float(x):.{nd}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def render_markdown(results: Mapping[str, Any]) -> str:
    """results.md: Table-1 style τ row (+ the paper's row), details, positions, calibration."""
    cfg = results["config"]
    names = list(cfg["datasets"])
    ds = results["datasets"]
    mean = results["mean"]
    g = int(cfg["gamma"])
    out = ["# Speculative decoding evaluation", "",
           f"- target: `{cfg['target']}`; draft: `{cfg['draft']}` ({cfg['draft_type']}, γ = {g})",
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
        rows.append([_PAPER_TARGET_NAMES[ref["target"]],
                     f"{_PAPER_DRAFTER_NAMES[ref['drafter']]} (paper)"]
                    + [_fmt(ref["tau"].get(n)) for n in names] + [_fmt(ref["mean_over_evaluated"])])
    out += _table(header, rows)
    if ref is not None:
        out += ["", f"Paper row: {ref['label']}; its Mean is over the datasets evaluated here."]
    out += ["", "## Per dataset", ""]
    base = cfg["baseline"]
    header = ["dataset", "samples", "skipped", "rounds", "τ", "verify rate", "tok/s",
              "tok/s (excl. compile)", "mean out len"]
    if base:
        header += ["AR tok/s (excl. compile)", "speedup (excl. compile)", "speedup (wall)"]
    if cfg["has_confidence_head"]:
        header += ["mean ECE", "mean AUROC"]
    rows = []
    for n in names + ["mean"]:
        e = ds[n] if n != "mean" else mean
        r = [f"**{n}**" if n == "mean" else n, _fmt(e["num_evaluated"]), _fmt(e["num_skipped"]),
             _fmt(e["rounds"]), _fmt(e["tau"]), _fmt(e["verify_rate"], 3),
             _fmt(e["tokens_per_s"], 1), _fmt(e["tokens_per_s_excl_compile"], 1),
             _fmt(e["mean_output_tokens"], 1)]
        if base:
            b = e.get("baseline") if n != "mean" else None
            if n == "mean":
                r += ["", _fmt(mean["speedup_excl_compile"]) + "×", _fmt(mean["speedup"]) + "×"]
            else:
                r += [_fmt(b and b["tokens_per_s_excl_compile"], 1),
                      _fmt(b and b["speedup_excl_compile"]) + "×", _fmt(b and b["speedup"]) + "×"]
        if cfg["has_confidence_head"]:
            c = e.get("calibration") if n != "mean" else results.get("calibration")
            r += [_fmt(c and c["mean_ece"], 3), _fmt(c and c["mean_auroc"], 3)]
        rows.append(r)
    out += _table(header, rows)
    out += ["", "## Acceptance by draft position", "",
            "Cumulative accept_rate@k = P(first k drafts all accepted) (DeepSpec); conditional "
            "= accept_rate@k / accept_rate@k−1 (paper Figure 2).", ""]
    header = ["dataset", "kind"] + [f"@{k + 1}" for k in range(g)]
    rows = []
    for n in names + ["mean"]:
        e = ds[n] if n != "mean" else mean
        rows.append([n, "cumulative"] + [_fmt(v, 3) for v in e["accept_rate_at"]])
        rows.append([n, "conditional"] + [_fmt(v, 3) for v in e["conditional_acceptance"]])
    out += _table(header, rows)
    cal = results.get("calibration")
    if cal is not None:
        out += ["", "## Confidence calibration (all datasets pooled)", "",
                "Predicted prefix survival Π_{j≤k} σ(c_j) vs. slots ≤ k accepted; ECE with 20 "
                "bins (SPEC §7).", ""]
        rows = [[str(s["slot"] + 1), str(s["n"]), _fmt(s["mean_confidence"], 3),
                 _fmt(s["accuracy"], 3), _fmt(s["ece"], 3), _fmt(s["auroc"], 3),
                 _fmt(s["brier"], 3)] for s in cal["slots"]]
        rows.append(["mean", "", "", "", _fmt(cal["mean_ece"], 3), _fmt(cal["mean_auroc"], 3),
                     _fmt(cal["mean_brier"], 3)])
        out += _table(["slot", "n", "mean confidence", "accuracy", "ECE", "AUROC", "Brier"], rows)
    plots = results.get("files", {}).get("plots", {})
    if plots:
        out += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------

def _max_samples_arg(text: str) -> int | str | None:
    if text in ("default", "all"):
        return None if text == "all" else "default"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, 'default' or 'all', got {text!r}")
    if n < 0:
        raise argparse.ArgumentTypeError("must be ≥ 0")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.evaluate",
        description="Offline speculative-decoding evaluation of a drafter (DeepSpec protocol: "
                    "SPEC §6/§7): τ, acceptance by position, throughput, calibration.")
    p.add_argument("--target", required=True,
                   help="embedded target name (smollm2-135m-instruct) or a Hugging Face directory")
    p.add_argument("--draft", required=True, help="drafter checkpoint directory (DeepSpec or speculators format)")
    p.add_argument("--data-dir", required=True,
                   help="directory of <name>.jsonl prompt files ({'turns': [...]} per line)")
    p.add_argument("--datasets", default=None,
                   help="comma-separated dataset names (default: the DeepSpec datasets present)")
    p.add_argument("--max-samples", type=_max_samples_arg, default="default",
                   help="samples per dataset: an int, 'all', or 'default' (DeepSpec's caps: "
                        + ", ".join(f"{k} {v}" for k, v in DEFAULT_EVAL_SAMPLES.items()) + ")")
    p.add_argument("--seed", type=int, default=DEEPSPEC_EVAL_SEED,
                   help="subsampling and sampling seed (default %(default)s)")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="cache limit; longer prompt + max_new_tokens are skipped "
                        "(default: the target's max_position_embeddings)")
    p.add_argument("--out", default=DEFAULT_OUT_DIR, help="output directory (default %(default)s)")
    p.add_argument("--baseline", action="store_true",
                   help="also run plain autoregressive decoding and report the speedup")
    p.add_argument("--verifier", choices=("jax", "pallas"), default="jax")
    p.add_argument("--scheduler", default="fixed",
                   choices=MODES,
                   help="verification scheduler of the serving engine (default: DeepSpec's "
                        "fixed γ)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="target compute/param dtype")
    p.add_argument("--enable-thinking", action="store_true",
                   help="render prompts with thinking enabled (protocol: off)")
    p.add_argument("--system-prompt", default=None, help="system prompt (protocol: none)")
    p.add_argument("--paper-ref", default="auto",
                   help="paper Table 1 row to show: auto, none, or TARGET/DRAFTER "
                        "(e.g. qwen3_4b/dspark)")
    p.add_argument("--save-outputs", action="store_true",
                   help="store generated ids and text in records.jsonl")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad input)."""
    args = build_parser().parse_args(argv)
    from dspark_jax.models.config import ConfigError

    try:
        results = evaluate(
            args.target, args.draft, args.data_dir, datasets=args.datasets,
            max_samples=args.max_samples, seed=args.seed, temperature=args.temperature,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, out_dir=args.out,
            baseline=args.baseline, verifier=args.verifier, max_cache_len=args.max_cache_len,
            scheduler=args.scheduler,
            enable_thinking=args.enable_thinking, system_prompt=args.system_prompt,
            dtype=args.dtype, paper_reference=args.paper_ref, save_outputs=args.save_outputs,
            progress=not args.no_progress,
            plots=not args.no_plots)
    except (EvalDatasetError, ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render_markdown(results))
    print(f"wrote {Path(args.out) / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
