"""The measurements of an offline evaluation (DeepSpec's protocol, SPEC §6/§7; paper §4): every
dataset decoded speculatively through `eval.runner`, its raw per-round records, acceptance
statistics (`eval.acceptance`), throughput and the calibration of its confidence logits
(`eval.calibration`); optionally the same batches decoded plainly and the speedup; and the
macro mean over the datasets.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import zlib
from typing import Any, Mapping, Sequence

import numpy as np

from dspark_jax.eval import runner
from dspark_jax.eval.acceptance import AcceptanceStats, acceptance_stats, macro_mean
from dspark_jax.eval.calibration import CalibrationReport, calibration_report, verified_mask
from dspark_jax.eval.eval_config import EvalConfig
from dspark_jax.eval.model_loading import EvalModels
from dspark_jax.eval.report_numbers import json_float, nanmean, ratio
from dspark_jax.eval.results import pooled_rounds

__all__ = ["DatasetRuns", "batch_seed", "decode_datasets", "decode_baseline", "mean_entry",
           "pooled_calibration"]


@dataclasses.dataclass
class DatasetRuns:
    """The speculative decoding of every dataset: results.json's per-dataset entries, the raw
    records and confidence logits (records.jsonl, confidence.npz), the acceptance statistics,
    and the `time.perf_counter()` at which the decoding started."""

    started: float
    per_ds: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    records: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    conf_arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    stats: dict[str, AcceptanceStats] = dataclasses.field(default_factory=dict)


def batch_seed(seed: int, dataset: str, batch_index: int) -> int:
    """The sampling seed of a dataset's batch (the same for the speculative and plain runs)."""
    return (int(seed) * 1_000_003 + zlib.crc32(dataset.encode()) + batch_index) % (2 ** 31)


def _stats_dict(st: AcceptanceStats) -> dict[str, Any]:
    d = st.to_dict()
    d.pop("name", None)
    return d


def _records(name: str, p: runner.PreparedDataset, dec: runner.Decoded, tokenizer: Any,
             save_outputs: bool) -> list[dict[str, Any]]:
    """records.jsonl's lines of one dataset, in the subsampled order."""
    recs = []
    for i, o in zip(p.keep, dec.outputs):
        rec = {"dataset": name, "index": i, "id": p.convs[i].id,
               "prompt_tokens": len(p.ids[i]), "output_tokens": len(o.tokens),
               "proposed": o.proposed, "accepted": o.accepted, "acceptance": o.acceptance}
        if save_outputs:
            rec["output_ids"] = o.tokens
            rec["text"] = tokenizer.decode(o.tokens)
        recs.append(rec)
    return recs


def _dataset_entry(p: runner.PreparedDataset, recs: Sequence[Mapping[str, Any]],
                   st: AcceptanceStats, dec: runner.Decoded) -> dict[str, Any]:
    """results.json's entry of one dataset (calibration and baseline added later)."""
    n_tok = sum(r["output_tokens"] for r in recs)
    wall, compile_s = dec.wall_s, dec.compile_s
    return {
        "num_prompts": len(p.convs),
        "num_evaluated": len(p.keep),
        "num_skipped": len(p.skipped),
        "skipped_ids": p.skipped_ids,
        **_stats_dict(st),
        "num_output_tokens": n_tok,
        "mean_output_tokens": json_float(ratio(n_tok, len(recs))),
        "mean_prompt_tokens": json_float(ratio(sum(r["prompt_tokens"] for r in recs),
                                               len(recs))),
        "wall_s": wall,
        "compile_s": compile_s,
        "tokens_per_s": json_float(ratio(n_tok, wall)),
        "tokens_per_s_excl_compile": json_float(ratio(n_tok, max(wall - compile_s, 0.0))),
        "calibration": None,
        "baseline": None,
    }


def _add_dataset(run: DatasetRuns, name: str, p: runner.PreparedDataset, dec: runner.Decoded,
                 models: EvalModels, save_outputs: bool) -> None:
    """Adds one decoded dataset to `run`: records, statistics, entry, confidence logits and
    the calibration report of its rounds."""
    gamma = models.gamma
    recs = _records(name, p, dec, models.tokenizer, save_outputs)
    prop_all = [x for r in recs for x in r["proposed"]]
    acc_all = [x for r in recs for x in r["accepted"]]
    alen_all = [x for r in recs for x in r["acceptance"]]
    st = acceptance_stats(prop_all, acc_all, gamma=gamma, name=name, acceptance=alen_all)
    run.records[name], run.stats[name] = recs, st
    entry = _dataset_entry(p, recs, st, dec)
    if models.has_conf:
        conf_rows = [o.confidence for o in dec.outputs if o.confidence is not None]
        logits = (np.concatenate(conf_rows, axis=0) if conf_rows
                  else np.zeros((0, gamma), np.float32))
        run.conf_arrays[name] = logits.astype(np.float32)
        if logits.shape[0]:
            rep = calibration_report(logits, np.asarray(acc_all),
                                     mask=verified_mask(np.asarray(prop_all), gamma))
            entry["calibration"] = rep.to_dict()
    run.per_ds[name] = entry


def decode_datasets(models: EvalModels, prepared: Mapping[str, runner.PreparedDataset],
                    config: EvalConfig, run_kw: Mapping[str, Any]) -> DatasetRuns:
    """Speculative decoding of every dataset through the serving engine. `run_kw`: the
    batches' size, token budget, temperature and cache length (`runner.decode`)."""
    # a tree's accepted path need not be the chain its confidences score: no calibration
    record = models.has_conf and not config.tree_budget
    total = sum(len(p.keep) for p in prepared.values())
    bar = runner.Progress(total, "speculative", enabled=config.progress)
    run = DatasetRuns(started=time.perf_counter())
    for name, p in prepared.items():
        bar.dataset(name)
        dec = runner.decode(models.target, models.draft, p.prompts,
                            batch_seed=functools.partial(batch_seed, config.seed, name),
                            settings=config.engine_settings(), record_confidence=record,
                            progress=bar, **run_kw)
        _add_dataset(run, name, p, dec, models, config.save_outputs)
    bar.close()
    return run


def _baseline_entry(entry: Mapping[str, Any], dec: runner.Decoded,
                    num_prompts: int) -> dict[str, Any]:
    """The `baseline` of a dataset's entry: plain decoding's throughput and the speedup."""
    n_tok, wall = sum(len(o.tokens) for o in dec.outputs), dec.wall_s
    tps = ratio(n_tok, wall)
    tps_x = ratio(n_tok, max(wall - dec.compile_s, 0.0))
    return {
        "num_output_tokens": n_tok,
        "mean_output_tokens": json_float(ratio(n_tok, num_prompts)),
        "wall_s": wall,
        "compile_s": dec.compile_s,
        "tokens_per_s": json_float(tps),
        "tokens_per_s_excl_compile": json_float(tps_x),
        "speedup": json_float(ratio(entry["tokens_per_s"] or math.nan, tps)),
        "speedup_excl_compile": json_float(ratio(
            entry["tokens_per_s_excl_compile"] or math.nan, tps_x)),
    }


def decode_baseline(target: Any, prepared: Mapping[str, runner.PreparedDataset],
                    run: DatasetRuns, config: EvalConfig, run_kw: Mapping[str, Any]) -> None:
    """Plain autoregressive decoding of the same batches: adds each entry's `baseline` (and the
    records' `baseline_output_ids` with `save_outputs`)."""
    total = sum(len(p.keep) for p in prepared.values())
    bar = runner.Progress(total, "autoregressive", enabled=config.progress)
    for name, p in prepared.items():
        bar.dataset(name)
        dec = runner.decode_autoregressive(
            target, p.prompts, batch_seed=functools.partial(batch_seed, config.seed, name),
            stop_token_ids=config.stop_token_ids, progress=bar, **run_kw)
        if config.save_outputs:
            base_out = dict(zip(p.keep, dec.outputs))
            for rec in run.records[name]:
                rec["baseline_output_ids"] = base_out[rec["index"]].tokens
        run.per_ds[name]["baseline"] = _baseline_entry(run.per_ds[name], dec, len(p.keep))
    bar.close()


def mean_entry(run: DatasetRuns, baseline: bool) -> dict[str, Any]:
    """results.json's `mean`: the macro mean over the datasets with at least one round."""
    per_ds = run.per_ds
    evaluated = {n: st for n, st in run.stats.items() if st.rounds > 0}

    def over(get: Any) -> float | None:
        return json_float(nanmean([get(per_ds[n]) for n in evaluated]))

    mean: dict[str, Any] = {
        "datasets": list(evaluated),
        **_stats_dict(macro_mean(evaluated, name="mean")),
        "num_evaluated": sum(e["num_evaluated"] for e in per_ds.values()),
        "num_skipped": sum(e["num_skipped"] for e in per_ds.values()),
        "mean_output_tokens": over(lambda e: e["mean_output_tokens"]),
        "tokens_per_s": over(lambda e: e["tokens_per_s"]),
        "tokens_per_s_excl_compile": over(lambda e: e["tokens_per_s_excl_compile"]),
        "speedup": None,
        "speedup_excl_compile": None,
    }
    if baseline:
        mean["speedup"] = over(lambda e: e["baseline"]["speedup"])
        mean["speedup_excl_compile"] = over(lambda e: e["baseline"]["speedup_excl_compile"])
    return mean


def pooled_calibration(run: DatasetRuns, names: Sequence[str],
                       models: EvalModels) -> CalibrationReport | None:
    """The calibration report of all datasets' rounds pooled (None without a confidence head
    or without rounds)."""
    if not (models.has_conf and any(a.shape[0] for a in run.conf_arrays.values())):
        return None
    logits, prop, acc = pooled_rounds(run.records, names, run.conf_arrays)
    return calibration_report(logits, acc, mask=verified_mask(prop, models.gamma))
