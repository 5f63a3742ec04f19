"""results.json, the document of one offline evaluation (schema `dspark_jax.evaluate/1`): the
run's settings as used, the environment, every dataset's entry, their macro mean, the pooled
calibration and the paper's reference row; and writing an evaluation's files (results.json,
results.md, records.jsonl, confidence.npz and the plots). Reading them back is `eval.results`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from dspark_jax.eval.calibration import CalibrationReport
from dspark_jax.eval.dataset_runs import DatasetRuns
from dspark_jax.eval.eval_config import EvalConfig
from dspark_jax.eval.model_loading import EvalModels
from dspark_jax.eval.results import RESULTS_FILE, write_rounds
from dspark_jax.eval.results_markdown import render_markdown

__all__ = ["RESULTS_SCHEMA", "run_config", "results_document", "write_outputs"]

RESULTS_SCHEMA = "dspark_jax.evaluate/1"


def run_config(config: EvalConfig, models: EvalModels, names: Sequence[str],
               cache_len: int) -> dict[str, Any]:
    """results.json's `config`: the run's settings as used (datasets resolved to `names`, the
    sample cap of each)."""
    return {
        "target": models.target_label,
        "draft": models.draft_label,
        "draft_type": models.draft_type,
        "gamma": models.gamma,
        "has_confidence_head": models.has_conf,
        "data_dir": str(Path(config.data_dir)),
        "datasets": list(names),
        "max_samples": {n: config.samples_for(n) for n in names},
        "seed": int(config.seed),
        "temperature": float(config.temperature),
        "max_new_tokens": int(config.max_new_tokens),
        "batch_size": int(config.batch_size),
        "max_cache_len": models.limit,
        "cache_len": int(cache_len),
        "verifier": config.verifier,
        "scheduler": config.scheduler,
        "tree_budget": int(config.tree_budget),
        "tree_branching": int(config.tree_branching),
        "baseline": bool(config.baseline),
        "first_turn_only": True,
        "add_generation_prompt": True,
        "enable_thinking": bool(config.enable_thinking),
        "system_prompt": config.system_prompt,
        "stop_token_ids": (None if config.stop_token_ids is None
                           else [int(x) for x in config.stop_token_ids]),
    }


def results_document(config: dict[str, Any], run: DatasetRuns, mean: dict[str, Any],
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


def write_outputs(out: Path, results: dict[str, Any], run: DatasetRuns,
                  pooled_calib: CalibrationReport | None, *, plots: bool) -> None:
    """Writes the evaluation's files to `out` and lists them in `results["files"]`;
    results.json last, through a temporary file."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {"results_json": RESULTS_FILE, "results_md": "results.md"}
    files.update(write_rounds(out, results["config"]["datasets"], run.records,
                              run.conf_arrays))
    if plots:
        from dspark_jax.eval.plots import write_evaluation_plots

        files["plots"] = write_evaluation_plots(out, results, run.stats, pooled_calib)
    results["files"] = files
    (out / "results.md").write_text(render_markdown(results), encoding="utf-8")
    tmp = out / (RESULTS_FILE + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, out / RESULTS_FILE)
