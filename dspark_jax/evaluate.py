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
import dataclasses
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
from dspark_jax.decoding.scheduler import MODES
from dspark_jax.decoding.tree import DEFAULT_BRANCHING
from dspark_jax.eval import runner
from dspark_jax.eval.acceptance import (PAPER_DATASETS, PAPER_TABLE1_TAU, AcceptanceStats,
                                        acceptance_stats, macro_mean)
from dspark_jax.eval.calibration import CalibrationReport, calibration_report, verified_mask
from dspark_jax.eval.report_numbers import is_number, json_float, nanmean, ratio
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
# the evaluation: settings, models, decoding, baseline, aggregation, results
# ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Settings:
    """The arguments of `evaluate` that define the run (datasets resolved, caps per dataset)."""

    data_dir: Path
    names: list[str]
    max_samples: dict[str, int | None]
    seed: int
    temperature: float
    max_new_tokens: int
    batch_size: int
    verifier: str
    scheduler: str
    baseline: bool
    enable_thinking: bool
    system_prompt: str | None
    stop_token_ids: Sequence[int] | None
    save_outputs: bool
    progress: bool
    tree_budget: int = 0
    tree_branching: int = DEFAULT_BRANCHING


@dataclasses.dataclass(frozen=True)
class _Models:
    """The run's target, drafter and tokenizer, the labels results.json gives them, and the
    cache limit in tokens."""

    target: Any
    draft: Any
    tokenizer: Any
    target_label: str
    draft_label: str
    limit: int

    @property
    def gamma(self) -> int:
        return int(self.draft.config.num_drafts)

    @property
    def draft_type(self) -> str:
        return self.draft.config.model_type

    @property
    def has_conf(self) -> bool:
        return bool(self.draft.config.has_confidence)


@dataclasses.dataclass
class _Run:
    """The speculative decoding of every dataset: results.json's per-dataset entries, the raw
    records and confidence logits (records.jsonl, confidence.npz), the acceptance statistics,
    and the `time.perf_counter()` at which the decoding started."""

    started: float
    per_ds: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    records: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    conf_arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    stats: dict[str, AcceptanceStats] = dataclasses.field(default_factory=dict)


def _check_dtype(target: Any, dtype: str | None) -> None:
    """ValueError when `dtype` is given and is not the loaded `target`'s compute dtype."""
    if dtype is None:
        return
    import jax.numpy as jnp

    from dspark_jax.models.target import resolve_dtype

    have = jnp.dtype(target.dtype)
    if jnp.dtype(resolve_dtype(dtype)) != have:
        raise ValueError(f"dtype={dtype!r}, but the loaded target computes in {have.name}: pass "
                         "dtype=None (or the target's dtype) with a loaded target, or the "
                         "target's name or directory to load it in another dtype")


def _load_models(target: Any, draft: Any, *, tokenizer: Any, dtype: str | None,
                 max_cache_len: int | None) -> _Models:
    """Loads what is not loaded yet; ConfigError for a drafter built for another target,
    ValueError for a conflicting dtype, a missing tokenizer or a cache limit below 2."""
    from dspark_jax.models import Draft, Target, load_draft, load_target
    from dspark_jax.serving.generation import check_compatible

    target_label = str(target) if not isinstance(target, Target) else (target.name or "target")
    loaded_here = not isinstance(target, Target)
    if loaded_here:
        target = load_target(target, dtype="float32" if dtype is None else dtype)
    else:
        _check_dtype(target, dtype)
    draft_label = "draft"
    if not isinstance(draft, Draft):
        draft_label = str(draft)
        draft = load_draft(draft, target=target)
    check_compatible(target, draft)  # ConfigError before any work
    if loaded_here:   # decode in one layout, the stacked layers released (weights held once)
        target = target.decoding_layout()
    if draft_label == "draft":
        draft_label = draft.config.model_type
    tok = tokenizer if tokenizer is not None else target.tokenizer
    if tok is None:
        raise ValueError("the target has no tokenizer (a directory without tokenizer.json?); "
                         "pass tokenizer=")
    limit = int(max_cache_len if max_cache_len is not None
                else target.config.max_position_embeddings)
    if limit < 2:
        raise ValueError(f"max_cache_len must be ≥ 2, got {limit}")
    return _Models(target=target, draft=draft, tokenizer=tok, target_label=target_label,
                   draft_label=draft_label, limit=limit)


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


def _add_dataset(run: _Run, name: str, p: runner.PreparedDataset, dec: runner.Decoded,
                 models: _Models, save_outputs: bool) -> None:
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


def _decode_datasets(models: _Models, prepared: Mapping[str, runner.PreparedDataset],
                     s: _Settings, run_kw: Mapping[str, Any]) -> _Run:
    """Speculative decoding of every dataset through the serving engine."""
    from dspark_jax.serving.generation import SpecSettings

    # a tree's accepted path need not be the chain its confidences score: no calibration
    settings = SpecSettings(verifier=s.verifier,
                            record_confidence=models.has_conf and not s.tree_budget)
    total = sum(len(p.keep) for p in prepared.values())
    bar = runner.Progress(total, "speculative", enabled=s.progress)
    run = _Run(started=time.perf_counter())
    for name, p in prepared.items():
        bar.dataset(name)
        dec = runner.decode(models.target, models.draft, p.prompts,
                            batch_seed=functools.partial(_batch_seed, s.seed, name),
                            settings=settings, scheduler=s.scheduler, progress=bar,
                            tree_budget=s.tree_budget, tree_branching=s.tree_branching,
                            **run_kw)
        _add_dataset(run, name, p, dec, models, s.save_outputs)
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


def _decode_baseline(target: Any, prepared: Mapping[str, runner.PreparedDataset], run: _Run,
                     s: _Settings, run_kw: Mapping[str, Any]) -> None:
    """Plain autoregressive decoding of the same batches: adds each entry's `baseline` (and the
    records' `baseline_output_ids` with `save_outputs`)."""
    total = sum(len(p.keep) for p in prepared.values())
    bar = runner.Progress(total, "autoregressive", enabled=s.progress)
    for name, p in prepared.items():
        bar.dataset(name)
        dec = runner.decode_autoregressive(
            target, p.prompts, batch_seed=functools.partial(_batch_seed, s.seed, name),
            progress=bar, **run_kw)
        if s.save_outputs:
            base_out = dict(zip(p.keep, dec.outputs))
            for rec in run.records[name]:
                rec["baseline_output_ids"] = base_out[rec["index"]].tokens
        run.per_ds[name]["baseline"] = _baseline_entry(run.per_ds[name], dec, len(p.keep))
    bar.close()


def _aggregate(run: _Run, baseline: bool) -> dict[str, Any]:
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


def _pooled_calibration(run: _Run, names: Sequence[str],
                        models: _Models) -> CalibrationReport | None:
    """The calibration report of all datasets' rounds pooled (None without a confidence head
    or without rounds)."""
    if not (models.has_conf and any(a.shape[0] for a in run.conf_arrays.values())):
        return None
    logits, prop, acc = pooled_rounds(run.records, names, run.conf_arrays)
    return calibration_report(logits, acc, mask=verified_mask(prop, models.gamma))


def _paper_reference(models: _Models, spec: str | None,
                     names: Sequence[str]) -> dict[str, Any] | None:
    """results.json's `paper_reference`: the paper's Table 1 row picked by `spec`
    (`paper_reference_for`) and its mean over the datasets evaluated here."""
    ref_key = paper_reference_for(models.target_label, models.draft_type, spec)
    if ref_key is None or not any(n in PAPER_DATASETS for n in names):
        return None
    row = PAPER_TABLE1_TAU[ref_key[0]][ref_key[1]]
    common = [n for n in names if n in row]
    label = (f"{_PAPER_TARGET_NAMES[ref_key[0]]} {_PAPER_DRAFTER_NAMES[ref_key[1]]}"
             " (paper, T=1, γ=7)")
    return {"target": ref_key[0], "drafter": ref_key[1], "label": label, "tau": dict(row),
            "mean_over_evaluated": json_float(nanmean([row[n] for n in common]))}


def _config(s: _Settings, models: _Models, cache_len: int) -> dict[str, Any]:
    """results.json's `config`: the run's settings as used."""
    return {
        "target": models.target_label,
        "draft": models.draft_label,
        "draft_type": models.draft_type,
        "gamma": models.gamma,
        "has_confidence_head": models.has_conf,
        "data_dir": str(s.data_dir),
        "datasets": s.names,
        "max_samples": s.max_samples,
        "seed": int(s.seed),
        "temperature": float(s.temperature),
        "max_new_tokens": int(s.max_new_tokens),
        "batch_size": int(s.batch_size),
        "max_cache_len": models.limit,
        "cache_len": int(cache_len),
        "verifier": s.verifier,
        "scheduler": s.scheduler,
        "tree_budget": int(s.tree_budget),
        "tree_branching": int(s.tree_branching),
        "baseline": bool(s.baseline),
        "first_turn_only": True,
        "add_generation_prompt": True,
        "enable_thinking": bool(s.enable_thinking),
        "system_prompt": s.system_prompt,
        "stop_token_ids": (None if s.stop_token_ids is None
                           else [int(x) for x in s.stop_token_ids]),
    }


def _results(config: dict[str, Any], run: _Run, mean: dict[str, Any],
             pooled_calib: CalibrationReport | None,
             paper_ref: dict[str, Any] | None) -> dict[str, Any]:
    """The results.json document (schema `RESULTS_SCHEMA`); `files` is filled on writing."""
    import jax

    return {
        "schema": RESULTS_SCHEMA,
        "config": config,
        "environment": {"jax": jax.__version__, "backend": jax.default_backend(),
                        "devices": [str(d.device_kind) for d in jax.devices()][:1],
                        "num_devices": jax.device_count()},
        "datasets": run.per_ds,
        "mean": mean,
        "calibration": None if pooled_calib is None else pooled_calib.to_dict(),
        "paper_reference": paper_ref,
        "total_wall_s": time.perf_counter() - run.started,
        "files": {},
    }


def evaluate(target: Any, draft: Any, data_dir: str | os.PathLike, *,
             datasets: Sequence[str] | str | None = None,
             max_samples: int | None | str | Mapping[str, int] = "default",
             seed: int = DEEPSPEC_EVAL_SEED, temperature: float = DEFAULT_TEMPERATURE,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, batch_size: int = DEFAULT_BATCH_SIZE,
             out_dir: str | os.PathLike | None = None, baseline: bool = False,
             verifier: str = "jax", max_cache_len: int | None = None,
             enable_thinking: bool = False, system_prompt: str | None = None,
             stop_token_ids: Sequence[int] | None = None, tokenizer: Any = None,
             dtype: str | None = None, paper_reference: str | None = "auto",
             save_outputs: bool = False, progress: bool = True, plots: bool = True,
             scheduler: str = "fixed", tree_budget: int = 0,
             tree_branching: int = DEFAULT_BRANCHING) -> dict[str, Any]:
    """Evaluates `draft` on `target` over DeepSpec-format prompt files; returns results.json.

    Decoding runs through the serving engine (`dspark_jax.serving.Engine`, one slot per prompt
    of a batch) with `scheduler` ("fixed" = DeepSpec's protocol: verify all γ drafts; any
    engine mode works, e.g. "adaptive"). `tree_budget` > 0 drafts trees of that many nodes
    (at most `tree_branching` children a node; docs/TREES.md) instead of the chain, under
    DeepSpec's protocol otherwise: τ is then the tree's accepted length + 1 per round, and no
    calibration is reported (a tree's accepted path need not be the chain its confidences
    score).

    `target`: a loaded `Target` or a name/directory for `load_target`; `draft`: a `Draft` or a
    DeepSpec-format checkpoint directory (`load_draft`). `dtype`: the dtype a name/directory
    is loaded in (None: float32); a loaded `Target` runs in its own dtype, so `dtype` must then
    be None or that dtype — another one raises ValueError, as the run cannot honour it without
    loading the weights again. `datasets`: names (or a comma separated string) of
    `<data_dir>/<name>.jsonl`; None = the protocol's datasets present. `max_samples`:
    "default" (DeepSpec's caps), None/"all", an int for every dataset or {name: int}.
    `max_cache_len`: cache limit in tokens (default the target's max_position_embeddings);
    longer prompts are skipped and counted. `save_outputs` adds the generated ids and text to
    records.jsonl. With `out_dir` the files listed in the module docstring are written there.

    Raises `EvalDatasetError` for missing datasets, `ConfigError` for a drafter built for
    another target, `ValueError` for bad arguments.
    """
    from dspark_jax.serving.settings import check_verifier

    runner.check_settings(max_new_tokens, batch_size, temperature)
    check_verifier(verifier)
    data_dir = Path(data_dir)
    names = runner.resolve_datasets(data_dir, datasets, DEFAULT_DATASETS)
    s = _Settings(
        data_dir=data_dir, names=names,
        max_samples={n: _max_samples_for(n, max_samples) for n in names}, seed=seed,
        temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
        verifier=verifier, scheduler=scheduler, baseline=baseline,
        enable_thinking=enable_thinking, system_prompt=system_prompt,
        stop_token_ids=stop_token_ids, save_outputs=save_outputs, progress=progress,
        tree_budget=int(tree_budget), tree_branching=int(tree_branching))
    models = _load_models(target, draft, tokenizer=tokenizer, dtype=dtype,
                          max_cache_len=max_cache_len)
    prepared = runner.prepare(data_dir, names, models.tokenizer, max_samples=s.max_samples,
                              seed=seed, max_new_tokens=max_new_tokens, gamma=models.gamma,
                              limit=models.limit, system_prompt=system_prompt,
                              enable_thinking=enable_thinking)
    # one cache length for the run: the rounds compile once per batch size
    cache_len = runner.cache_length([len(q) for p in prepared.values() for q in p.prompts],
                                    max_new_tokens, models.gamma, models.limit)
    run_kw = dict(batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature,
                  cache_len=cache_len, stop_token_ids=stop_token_ids)
    run = _decode_datasets(models, prepared, s, run_kw)
    if baseline:
        _decode_baseline(models.target, prepared, run, s, run_kw)
    mean = _aggregate(run, baseline)
    pooled_calib = _pooled_calibration(run, names, models)
    paper_ref = _paper_reference(models, paper_reference, names)
    results = _results(_config(s, models, cache_len), run, mean, pooled_calib, paper_ref)
    if out_dir is not None:
        _write_outputs(Path(out_dir), results, run, pooled_calib, plots=plots)
    return results


# ------------------------------------------------------------------------------------------
# outputs: the files, the plots, results.md
# ------------------------------------------------------------------------------------------

def _write_plots(out: Path, results: Mapping[str, Any], stats: Mapping[str, AcceptanceStats],
                 pooled_calib: CalibrationReport | None) -> dict[str, str]:
    """The PNG plots; returns {plot: file name}."""
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


def _write_outputs(out: Path, results: dict[str, Any], run: _Run,
                   pooled_calib: CalibrationReport | None, *, plots: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {"results_json": RESULTS_FILE, "results_md": "results.md"}
    files.update(write_rounds(out, results["config"]["datasets"], run.records,
                              run.conf_arrays))
    if plots:
        files["plots"] = _write_plots(out, results, run.stats, pooled_calib)
    results["files"] = files
    (out / "results.md").write_text(render_markdown(results), encoding="utf-8")
    tmp = out / (RESULTS_FILE + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, out / RESULTS_FILE)


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
        rows.append([_PAPER_TARGET_NAMES[ref["target"]],
                     f"{_PAPER_DRAFTER_NAMES[ref['drafter']]} (paper)"]
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
    p.add_argument("--tree-budget", type=int, default=0,
                   help="draft trees of this many nodes instead of the chain (0: chain; "
                        "scheduler fixed)")
    p.add_argument("--tree-branching", type=int, default=DEFAULT_BRANCHING,
                   help="a tree node's most children (default %(default)s)")
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
            scheduler=args.scheduler, tree_budget=args.tree_budget,
            tree_branching=args.tree_branching,
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
    from dspark_jax.cli_support import run_main

    run_main(main)
