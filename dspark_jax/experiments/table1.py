"""Small-scale Table 1 (DSpark paper §4: Table 1 and Figure 2): DSpark, DFlash and Eagle3
drafters for one target trained on the same prompts, regenerated data, steps and batch, then
compared by speculative decoding (measured τ), with a held-out learning curve.

    python -m dspark_jax.experiments.table1 --workdir DIR [--steps N]
        [--eval-data ../shared/eval_datasets] [--eval-samples K] [--regenerated PATH]

Stages, each skipped when its output is already there, so a rerun resumes where the last one
stopped (an interrupted drafter continues from its Orbax checkpoint):
  1. data (DIR/shared): prompts → ONE regeneration by the target → records → the target-feature
     cache, by `python -m dspark_jax.train` with train.max_steps=0 (or `--regenerated PATH`
     reused); with --eval-data the prompts sharing a 13-gram with it are dropped first;
  2. evaluation prompts (DIR/eval_prompts, DeepSpec `{"turns"}` files): the held-out prompts'
     first user turns, and K prompts per benchmark of --eval-data (DeepSpec's seeded shuffle,
     keeping only prompts of at most --max-prompt-tokens);
  3. per drafter (configs/smollm2_table1_<drafter>.py, workdir DIR/<drafter>): training with the
     held-out teacher-forced evaluation every --eval-every steps (the learning curve), export in
     the format that holds the drafter exactly (DIR/<drafter>/export; with a draft vocabulary
     speculators' for DSpark / DFlash, EAGLE-3's layout for Eagle3: the τ measured is the
     trained drafter's), speculative decoding at each temperature on the
     evaluation prompts (`dspark_jax.evaluate`, DIR/<drafter>/table1_eval/T<t>), and for a drafter
     with a confidence head Sequential Temperature Scaling on the held-out prompts
     (`dspark_jax.calibrate` → DIR/<drafter>/export/confidence_calibration.json);
  4. the report (`experiments.table1_report`): DIR/table1.{md,json} (τ per drafter × evaluation
     set, the ratios DSpark/DFlash and DSpark/Eagle3, per-position conditional acceptance,
     training times), DIR/learning_curve.png and DIR/conditional_acceptance.png.
Every stage logs (progress bars included) to DIR/logs/<stage>.log; the console gets a line per
stage. The arguments are stored in DIR/table1_settings.json and a rerun with other ones is
refused (a finished drafter would otherwise be silently reused under new settings).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import random
import shlex
import sys
import time
from typing import Any, Callable, Iterator, Sequence

DRAFTERS = ("dspark", "dflash", "eagle3")
HELDOUT = "heldout"
SETTINGS_FILE = "table1_settings.json"
DEFAULT_CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
DEFAULT_EVAL_SAMPLES = 4
DEFAULT_MAX_PROMPT_TOKENS = 1024
CURVE_POINTS = 10


class Table1Error(ValueError):
    """Bad arguments or a work directory started with other settings (the message says which)."""


def log(msg: str) -> None:
    print(f"[table1 {time.strftime('%H:%M:%S')}] {msg}", file=sys.__stdout__, flush=True)


@contextlib.contextmanager
def logged(path: pathlib.Path) -> Iterator[None]:
    """stdout and stderr (tqdm bars included) of a stage appended to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f, contextlib.redirect_stdout(f), \
            contextlib.redirect_stderr(f):
        print(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
        yield


def _write_json(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ arguments

def parse_sets(items: Sequence[str], drafters: Sequence[str]) -> dict[str, list[str]]:
    """`--set [DRAFTER:]KEY=VALUE` → per drafter the `--config.KEY=VALUE` overrides."""
    out: dict[str, list[str]] = {d: [] for d in drafters}
    for item in items:
        who, _, rest = item.partition(":") if ":" in item.split("=", 1)[0] else ("", "", item)
        key, eq, value = rest.partition("=")
        if not eq or not key:
            raise Table1Error(f"--set {item!r}: expected [DRAFTER:]KEY=VALUE")
        if who and who not in DRAFTERS:
            raise Table1Error(f"--set {item!r}: {who!r} is not one of {DRAFTERS}")
        for d in ([who] if who else drafters):
            if d in out:
                out[d].append(f"--config.{key}={value}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.experiments.table1",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="all outputs (resumable)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps of every drafter (default: the configs' train.max_steps)")
    p.add_argument("--eval-data", default=None,
                   help="directory of DeepSpec {'turns'} benchmark files (e.g. "
                        "../shared/eval_datasets); also decontaminates the training prompts")
    p.add_argument("--eval-samples", type=int, default=DEFAULT_EVAL_SAMPLES,
                   help="prompts per benchmark (seeded subsample; default %(default)s)")
    p.add_argument("--datasets", default=None,
                   help="comma-separated benchmarks of --eval-data (default: every .jsonl there)")
    p.add_argument("--regenerated", default=None,
                   help="an existing regenerated JSONL to train on instead of regenerating")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"held-out teacher-forced evaluation every N steps (default: steps/"
                        f"{CURVE_POINTS})")
    p.add_argument("--temperatures", default="0,1",
                   help="speculative-decoding temperatures (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per evaluated prompt (default: eval.speculative_max_new_tokens)")
    p.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                   help="benchmark prompts longer than this (rendered) are not drawn "
                        "(default %(default)s)")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help="speculative-decoding batch (default: eval.speculative_batch_size)")
    p.add_argument("--drafters", default=",".join(DRAFTERS),
                   help="which rows to run, in order (default %(default)s)")
    p.add_argument("--config-dir", default=str(DEFAULT_CONFIG_DIR),
                   help="where smollm2_table1_<drafter>.py live (default: the repo's configs/)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="[D:]KEY=VALUE",
                   help="config override for every drafter, or only drafter D "
                        "(e.g. --set train.lr=1e-3, --set eagle3:train.lr=5e-4); repeatable")
    return p


def _temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise Table1Error(f"--temperatures {text!r}: expected comma-separated numbers") from None
    if not temps or any(t < 0 for t in temps):
        raise Table1Error(f"--temperatures {text!r}: give one or more temperatures ≥ 0")
    return temps


class Plan:
    """The validated arguments: paths, the three training configs and the evaluation settings."""

    def __init__(self, a: argparse.Namespace):
        from dspark_jax.train.job_config import parse_config

        self.workdir = pathlib.Path(a.workdir).absolute()
        self.drafters = [d.strip() for d in a.drafters.split(",") if d.strip()]
        bad = [d for d in self.drafters if d not in DRAFTERS] or (
            [] if self.drafters else ["(none)"])
        if bad or len(set(self.drafters)) != len(self.drafters):
            raise Table1Error(f"--drafters {a.drafters!r}: choose distinct drafters of {DRAFTERS}")
        config_dir = pathlib.Path(a.config_dir)
        self.config_files = {d: config_dir / f"smollm2_table1_{d}.py" for d in DRAFTERS}
        for d, f in self.config_files.items():
            if not f.is_file():
                raise Table1Error(f"--config-dir: {f} not found")
        if a.eval_samples < 1:
            raise Table1Error(f"--eval-samples {a.eval_samples}: must be ≥ 1")
        if a.max_prompt_tokens < 1:
            raise Table1Error(f"--max-prompt-tokens {a.max_prompt_tokens}: must be ≥ 1")
        self.eval_data = pathlib.Path(a.eval_data).absolute() if a.eval_data else None
        if self.eval_data is not None and not self.eval_data.is_dir():
            raise Table1Error(f"--eval-data {a.eval_data!r} is not a directory")
        self.regenerated = pathlib.Path(a.regenerated).absolute() if a.regenerated else None
        if self.regenerated is not None and not self.regenerated.is_file():
            raise Table1Error(f"--regenerated {a.regenerated!r} is not a file")
        self.temperatures = _temperatures(a.temperatures)
        self.sets = parse_sets(a.sets, DRAFTERS)
        # every row's config with the user's overrides (parsed = validated, keys checked)
        self.configs = {d: parse_config(["table1", f"--config={self.config_files[d]}",
                                         *self.sets[d]]) for d in DRAFTERS}
        c = self.configs[DRAFTERS[0]]
        self.steps = a.steps if a.steps is not None else int(c.train.max_steps)
        if self.steps < 1:
            raise Table1Error(f"--steps {self.steps}: must be ≥ 1")
        self.eval_every = a.eval_every if a.eval_every is not None else max(
            1, self.steps // CURVE_POINTS)
        if self.eval_every < 1:
            raise Table1Error(f"--eval-every {self.eval_every}: must be ≥ 1")
        self._check_shared()
        self.max_new_tokens = a.max_new_tokens or (
            c.eval.speculative_max_new_tokens if c.eval.speculative_max_new_tokens > 0
            else c.data.max_new_tokens)
        self.eval_batch_size = a.eval_batch_size or int(c.eval.speculative_batch_size)
        if self.max_new_tokens < 1 or self.eval_batch_size < 1:
            raise Table1Error("--max-new-tokens and --eval-batch-size must be ≥ 1")
        self.datasets = ([x.strip() for x in a.datasets.split(",") if x.strip()]
                         if a.datasets else None)
        if self.datasets is not None and self.eval_data is None:
            raise Table1Error("--datasets needs --eval-data")
        self.max_prompt_tokens = a.max_prompt_tokens
        self.eval_samples = a.eval_samples
        self.shared = self.workdir / "shared"
        self.regen_path = self.regenerated or self.shared / "data" / "regenerated.jsonl"
        self.features = self.shared / "data" / "features"
        self.prompts_dir = self.workdir / "eval_prompts"
        self.logs = self.workdir / "logs"
        self.command = ""

    def _check_shared(self) -> None:
        """The rows must share the data (one regeneration, one feature cache), steps and batch."""
        ref_name = DRAFTERS[0]
        ref = self.configs[ref_name]
        for d in DRAFTERS[1:]:
            c = self.configs[d]
            for what, a, b in (
                    ("target", ref.target, c.target),
                    ("data", ref.data.to_dict(), c.data.to_dict()),
                    ("draft.target_layer_ids", tuple(ref.draft.target_layer_ids),
                     tuple(c.draft.target_layer_ids)),
                    ("train.global_batch_size", ref.train.global_batch_size,
                     c.train.global_batch_size),
                    ("train.max_steps", ref.train.max_steps, c.train.max_steps)):
                if a != b:
                    raise Table1Error(f"the Table 1 rows must share {what}, but {d} has {b!r} "
                                      f"and {ref_name} {a!r} (check --set)")

    def settings(self) -> dict[str, Any]:
        """What a rerun must repeat (fault-injection `debug.*` overrides excluded)."""
        sets = {d: [s for s in v if not s.startswith("--config.debug.")]
                for d, v in self.sets.items()}
        return {"steps": self.steps, "eval_every": self.eval_every,
                "eval_data": str(self.eval_data) if self.eval_data else None,
                "datasets": self.datasets, "eval_samples": self.eval_samples,
                "regenerated": str(self.regenerated) if self.regenerated else None,
                "temperatures": self.temperatures, "max_new_tokens": self.max_new_tokens,
                "max_prompt_tokens": self.max_prompt_tokens,
                "eval_batch_size": self.eval_batch_size, "sets": sets,
                "configs": {d: str(f) for d, f in self.config_files.items()}}

    def check_settings(self) -> None:
        path = self.workdir / SETTINGS_FILE
        now = self.settings()
        if path.is_file():
            before = json.loads(path.read_text(encoding="utf-8"))
            diff = sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k))
            if diff:
                raise Table1Error(
                    f"{self.workdir} was started with other settings ({', '.join(diff)}: "
                    + "; ".join(f"{k} was {before.get(k)!r}, now {now.get(k)!r}" for k in diff)
                    + "); rerun with the same arguments or use a new --workdir")
        else:
            self.workdir.mkdir(parents=True, exist_ok=True)
            _write_json(path, now)

    def train_argv(self, drafter: str) -> list[str]:
        return ["dspark_jax.train", f"--config={self.config_files[drafter]}",
                *self.sets[drafter],
                f"--config.workdir={self.workdir / drafter}",
                f"--config.data.regenerated={self.regen_path}",
                f"--config.data.feature_cache={self.features}",
                f"--config.train.max_steps={self.steps}",
                f"--config.eval.every_steps={self.eval_every}",
                "--config.eval.speculative=False"]

    def data_argv(self) -> list[str]:
        argv = ["dspark_jax.train", f"--config={self.config_files[DRAFTERS[0]]}",
                *self.sets[DRAFTERS[0]], f"--config.workdir={self.shared}",
                "--config.train.max_steps=0"]
        if self.regenerated is not None:
            argv.append(f"--config.data.regenerated={self.regenerated}")
        elif self.eval_data is not None:
            argv.append(f"--config.data.decontaminate={self.eval_data}")
        return argv


# ------------------------------------------------------------------------------ stages

def prepare_shared_data(plan: Plan) -> dict[str, Any]:
    """Stage 1: the one regeneration and feature cache all rows train on (resumable)."""
    from dspark_jax.train import cli

    marker = plan.shared / "data_ready.json"
    if marker.is_file():
        log(f"data: ready ({plan.regen_path})")
        return json.loads(marker.read_text(encoding="utf-8"))
    log(f"data: {'features for ' + str(plan.regenerated) if plan.regenerated else 'regeneration'}"
        f" → {plan.shared} (log: {plan.logs / 'data.log'})")
    t0 = time.perf_counter()
    with logged(plan.logs / "data.log"):
        out = cli.main(plan.data_argv())
    info = {"regenerated": str(plan.regen_path), "features": str(plan.features),
            "data": out.get("data"), "wall_s": round(time.perf_counter() - t0, 1)}
    _write_json(marker, info)
    log(f"data: done in {info['wall_s']}s")
    return info


def held_out_prompts(plan: Plan) -> list[Any]:
    """The held-out conversations of the shared regeneration (the training job's split)."""
    from dspark_jax.data.prompts import load_conversations, split_train_heldout
    from dspark_jax.train.data_stage import heldout_arg

    c = plan.configs[DRAFTERS[0]]
    _, held = split_train_heldout(load_conversations(plan.regen_path),
                                  heldout_arg(c.data.heldout), seed=c.data.split_seed)
    if not held:
        raise Table1Error("no held-out prompts (config.data.heldout): the learning curve and the "
                          "held-out τ need some")
    return held


def _first_user_turn(conv: Any) -> str:
    return next(m["content"] for m in conv.messages if m["role"] == "user")


def select_eval_prompts(plan: Plan, get_target: Callable[[], Any]) -> dict[str, Any]:
    """Stage 2: DIR/eval_prompts/<set>.jsonl for the held-out prompts and K prompts per
    benchmark; `selection.json` records the original ids and the benchmarks left out.
    `get_target()` loads the target (its tokenizer measures the prompts) only when needed."""
    from dspark_jax.data.chat import render_prompt
    from dspark_jax.data.prompts import DEEPSPEC_EVAL_SEED, list_eval_datasets, read_eval_file

    manifest = plan.prompts_dir / "selection.json"
    if manifest.is_file():
        return json.loads(manifest.read_text(encoding="utf-8"))
    plan.prompts_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = get_target().tokenizer
    fits = lambda text: len(render_prompt([{"role": "user", "content": text}],  # noqa: E731
                                          tokenizer)) <= plan.max_prompt_tokens
    chosen: dict[str, list[tuple[str, str]]] = {
        HELDOUT: [(conv.id, _first_user_turn(conv)) for conv in held_out_prompts(plan)]}
    left_out: dict[str, str] = {}
    if plan.eval_data is not None:
        available = list_eval_datasets(plan.eval_data)
        names = plan.datasets or available
        missing = [n for n in names if n not in available]
        if missing:
            raise Table1Error(f"--datasets {missing} not in {plan.eval_data}; available: "
                              f"{available}")
        if HELDOUT in names:
            raise Table1Error(f"{plan.eval_data}/{HELDOUT}.jsonl: the name is taken by the "
                              "held-out prompts; rename the file or leave it out (--datasets)")
        for name in names:
            convs = read_eval_file(plan.eval_data / f"{name}.jsonl", name=name)
            random.Random(DEEPSPEC_EVAL_SEED).shuffle(convs)   # DeepSpec's subsampling order
            picked = []
            for conv in convs:
                text = _first_user_turn(conv)
                if fits(text):
                    picked.append((conv.id, text))
                    if len(picked) == plan.eval_samples:
                        break
            if picked:
                chosen[name] = picked
            else:
                left_out[name] = f"no prompt of at most {plan.max_prompt_tokens} tokens"
    for name, items in chosen.items():
        (plan.prompts_dir / f"{name}.jsonl").write_text(
            "".join(json.dumps({"turns": [t]}, ensure_ascii=False) + "\n" for _, t in items),
            encoding="utf-8")
    info = {"sets": list(chosen), "benchmarks": [n for n in chosen if n != HELDOUT],
            "ids": {n: [i for i, _ in items] for n, items in chosen.items()},
            "left_out": left_out, "max_prompt_tokens": plan.max_prompt_tokens,
            "eval_samples": plan.eval_samples}
    _write_json(manifest, info)
    log(f"eval prompts: {len(chosen[HELDOUT])} held-out + {plan.eval_samples} × "
        f"{len(info['benchmarks'])} benchmarks in {plan.prompts_dir}"
        + (f" (left out: {', '.join(left_out)})" if left_out else ""))
    return info


def train_drafter(plan: Plan, drafter: str) -> dict[str, Any]:
    """Stage 3a: the training job of one row (skipped when finished, resumed when interrupted)."""
    from dspark_jax.train import cli

    workdir = plan.workdir / drafter
    summary = workdir / "summary.json"
    if summary.is_file():
        log(f"{drafter}: trained ({summary})")
        return json.loads(summary.read_text(encoding="utf-8"))
    resuming = (workdir / "checkpoints").is_dir() and any((workdir / "checkpoints").iterdir())
    log(f"{drafter}: {'resuming' if resuming else 'training'} {plan.steps} steps "
        f"(log: {plan.logs / (drafter + '.log')})")
    with logged(plan.logs / f"{drafter}.log"):
        out = cli.main(plan.train_argv(drafter))
    h = out.get("heldout_teacher_forced") or {}
    log(f"{drafter}: trained in {out['wall_time_s']}s"
        + (f" (resumed from step {out['resumed_from_step']})"
           if out.get("resumed_from_step") is not None else "")
        + (f", held-out teacher-forced τ {h['tau_probabilistic']:.3f}"
           if "tau_probabilistic" in h else ""))
    return out


def eval_dir(plan: Plan, drafter: str, t: float) -> pathlib.Path:
    return plan.workdir / drafter / "table1_eval" / f"T{t:g}"


def evaluate_drafter(plan: Plan, drafter: str, get_target: Callable[[], Any],
                     sets: Sequence[str]) -> None:
    """Stage 3b: measured τ by speculative decoding at every temperature."""
    from dspark_jax.evaluate import EvalConfig, evaluate
    from dspark_jax.models import load_draft

    todo = [t for t in plan.temperatures
            if not (eval_dir(plan, drafter, t) / "results.json").is_file()]
    if not todo:
        log(f"{drafter}: evaluated")
        return
    target = get_target()
    draft = load_draft(plan.workdir / drafter / "export", target)
    for t in todo:
        out = eval_dir(plan, drafter, t)
        log(f"{drafter}: speculative decoding T={t:g} on {', '.join(sets)} → {out}")
        with logged(plan.logs / f"{drafter}_eval_T{t:g}.log"):
            r = evaluate(EvalConfig(
                target, draft, plan.prompts_dir, datasets=list(sets), max_samples=None,
                max_new_tokens=plan.max_new_tokens, batch_size=plan.eval_batch_size,
                temperature=t, out_dir=out, paper_reference=None))
        log(f"{drafter}: T={t:g} held-out τ {r['datasets'][HELDOUT]['tau']:.3f} "
            f"({r['total_wall_s']:.0f}s)")


def calibrate_drafter(plan: Plan, drafter: str, get_target: Callable[[], Any]) -> str | None:
    """Stage 3c: STS calibration of a confidence head on the held-out prompts (DeepSpec-format
    drafter + its calibration file); None for drafters without one."""
    from dspark_jax import calibrate
    from dspark_jax.models import load_draft

    export = plan.workdir / drafter / "export"
    out = plan.workdir / drafter / "calibration"
    d = plan.configs[drafter].draft
    if not (d.model_type == "dspark" and d.enable_confidence_head):   # DraftConfig.has_confidence
        return None
    if (out / "calibration.json").is_file():
        log(f"{drafter}: calibrated")
        return str(export / "confidence_calibration.json")
    target = get_target()
    draft = load_draft(export, target)
    log(f"{drafter}: confidence calibration on the held-out prompts → {export}")
    with logged(plan.logs / f"{drafter}_calibrate.log"):
        r = calibrate.run(target, draft, export, plan.prompts_dir, out_dir=out,
                          datasets=[HELDOUT], max_new_tokens=plan.max_new_tokens,
                          batch_size=plan.eval_batch_size, temperature=1.0,
                          target_label=str(plan.configs[drafter].target))
    log(f"{drafter}: calibrated, mean ECE {r['before']['mean_ece']} → {r['after']['mean_ece']}")
    return r["calibration_file"]


def run(plan: Plan) -> dict[str, Any]:
    """All stages; returns the report (also written to DIR/table1.json)."""
    from dspark_jax.experiments.table1_report import write_report

    plan.check_settings()
    prepare_shared_data(plan)
    target = None

    def the_target() -> Any:
        """The target for evaluation, loaded once and only if a stage needs it."""
        nonlocal target
        if target is None:
            from dspark_jax.models import load_target

            c = plan.configs[DRAFTERS[0]]
            target = load_target(c.target, dtype=c.train.target_dtype)
        return target

    selection = None
    for d in plan.drafters:
        train_drafter(plan, d)
        if selection is None:
            selection = select_eval_prompts(plan, the_target)
        evaluate_drafter(plan, d, the_target, selection["sets"])
        calibrate_drafter(plan, d, the_target)
    report = write_report(plan, selection)
    log(f"report: {plan.workdir / 'table1.md'}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad arguments or settings)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    from dspark_jax.models.config import ConfigError
    from dspark_jax.train.job_config import UsageError

    try:
        plan = Plan(a)
        plan.command = "python -m dspark_jax.experiments.table1 " + shlex.join(argv)
        report = run(plan)
    except (Table1Error, UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dspark_jax.experiments.table1_report import render_table1_markdown

    print(render_table1_markdown(report))
    return 0


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # its wall times include compilation
