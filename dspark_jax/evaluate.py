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
(see `build_parser`). Python API: :func:`evaluate` of an :class:`EvalConfig`.

This module is the command line and the order of the steps; each step is a module of
`dspark_jax.eval`: the settings (`eval_config`), loading the models (`model_loading`), the
prompts and the decoding (`runner`), the measurements (`dataset_runs`), the paper's Table 1
(`paper_table`), results.json and the files (`results_document`), results.md
(`results_markdown`) and the plots (`plots`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from dspark_jax.data.prompts import DEEPSPEC_EVAL_SEED, DEFAULT_EVAL_SAMPLES
from dspark_jax.decoding.tree import DEFAULT_BRANCHING
from dspark_jax.eval import runner
from dspark_jax.eval.dataset_runs import (decode_baseline, decode_datasets, mean_entry,
                                          pooled_calibration)
from dspark_jax.eval.eval_config import (DEFAULT_BATCH_SIZE, DEFAULT_DATASETS,
                                         DEFAULT_MAX_NEW_TOKENS, DEFAULT_OUT_DIR,
                                         DEFAULT_TEMPERATURE, EvalConfig,
                                         config_from_fields)
from dspark_jax.eval.model_loading import load_models
from dspark_jax.eval.paper_table import paper_reference, paper_reference_for
from dspark_jax.eval.results_document import (RESULTS_SCHEMA, results_document, run_config,
                                              write_outputs)
from dspark_jax.eval.results_markdown import render_markdown
from dspark_jax.eval.runner import EvalDatasetError
from dspark_jax.serving.modes import mode_names

__all__ = ["EvalConfig", "evaluate", "main", "build_parser", "config_from_args",
           "EvalDatasetError", "RESULTS_SCHEMA", "DEFAULT_DATASETS", "paper_reference_for",
           "render_markdown"]


def evaluate(config: EvalConfig, *fields: Any, **named: Any) -> dict[str, Any]:
    """Runs the evaluation `config` describes; returns its results.json document (and writes
    the files listed in the module docstring to `config.out_dir` when it is set).

    Decoding runs through the serving engine (`dspark_jax.serving.Engine`, one slot per prompt
    of a batch) with `config.engine_settings()`.

    Raises `EvalDatasetError` for missing datasets, `ConfigError` for a drafter built for
    another target, `ValueError` for bad settings. Deprecated, kept for existing callers:
    `evaluate(target, draft, data_dir, **fields)`, the `EvalConfig` fields as arguments, runs
    `evaluate(EvalConfig(target, draft, data_dir, **fields))` with a `DeprecationWarning`
    (`eval_config.config_from_fields`; TypeError naming a keyword that is no field).
    """
    if not isinstance(config, EvalConfig):
        config = config_from_fields((config, *fields), named)
    elif fields or named:
        raise TypeError("evaluate(config) takes the EvalConfig alone")
    data_dir = Path(config.data_dir)
    names = runner.resolve_datasets(data_dir, config.datasets, DEFAULT_DATASETS)
    models = load_models(config)
    prepared = runner.prepare(data_dir, names, models.tokenizer,
                              max_samples={n: config.samples_for(n) for n in names},
                              seed=config.seed, max_new_tokens=config.max_new_tokens,
                              gamma=models.gamma, limit=models.limit,
                              system_prompt=config.system_prompt,
                              enable_thinking=config.enable_thinking)
    # one cache length for the run: the rounds compile once per batch size
    cache_len = runner.cache_length([len(q) for p in prepared.values() for q in p.prompts],
                                    config.max_new_tokens, models.gamma, models.limit)
    run_kw = dict(batch_size=config.batch_size, max_new_tokens=config.max_new_tokens,
                  temperature=config.temperature, cache_len=cache_len)
    run = decode_datasets(models, prepared, config, run_kw)
    if config.baseline:
        decode_baseline(models.target, prepared, run, config, run_kw)
    pooled = pooled_calibration(run, names, models)
    paper_ref = paper_reference(models.target_label, models.draft_type,
                                config.paper_reference, names)
    results = results_document(run_config(config, models, names, cache_len), run,
                               mean_entry(run, config.baseline), pooled, paper_ref)
    if config.out_dir is not None:
        write_outputs(Path(config.out_dir), results, run, pooled, plots=config.plots)
    return results


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
                   choices=mode_names(),
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


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The `EvalConfig` of parsed command-line arguments (`build_parser`)."""
    return EvalConfig(
        target=args.target, draft=args.draft, data_dir=args.data_dir, datasets=args.datasets,
        max_samples=args.max_samples, seed=args.seed, temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, out_dir=args.out,
        baseline=args.baseline, verifier=args.verifier, max_cache_len=args.max_cache_len,
        scheduler=args.scheduler, tree_budget=args.tree_budget,
        tree_branching=args.tree_branching, enable_thinking=args.enable_thinking,
        system_prompt=args.system_prompt, dtype=args.dtype, paper_reference=args.paper_ref,
        save_outputs=args.save_outputs, progress=not args.no_progress, plots=not args.no_plots)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad input)."""
    args = build_parser().parse_args(argv)
    from dspark_jax.models.config import ConfigError

    try:
        results = evaluate(config_from_args(args))
    except (EvalDatasetError, ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render_markdown(results))
    print(f"wrote {Path(args.out) / 'results.json'}")
    return 0


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main)
