"""`python -m dspark_jax.export SRC --format deepspec|speculators --out DIR`: one export command
for every destination of a trained drafter (SPEC §3, §5 name the formats).

SRC is a drafter directory (either format; what `load_draft` reads) or a training workdir (its
`export/`). Formats:

  deepspec     DeepSpec's `Qwen3DSparkModel` / `Qwen3Eagle3Model` / `Gemma4…` checkpoint: what
               DeepSpec's eval.py, SGLang and llama.cpp's converter read. An Eagle3 drafter with
               a draft vocabulary is written in EAGLE-3's own layout (its released checkpoints',
               SpecForge's; vLLM's and SGLang's Eagle3 loaders read it): a `draft_vocab_size`-row
               `lm_head`, `d2t` (target_id = draft_id + d2t[draft_id]) and `t2d`, and
               `draft_vocab_size` in config.json. DeepSpec's DSpark format has no draft
               vocabulary: a DSpark / DFlash drafter trained with one is refused unless
               `--full-vocab-fallback` (the same weights proposing from every id; DeepSpec's loop
               then measures another τ).
  speculators  vLLM's checkpoint format (`speculators_model_type: "dspark"`): the draft vocabulary
               travels as `d2t`/`t2d` with a `draft_vocab_size`-row `lm_head`; read by vLLM,
               `speculators` and llama.cpp's converter. DSpark/DFlash drafters with the vanilla
               Markov head (the only head vLLM and llama.cpp run).

The directory is written beside OUT and moved into place when complete, so OUT is either the
old export or the new one, never half of each. Errors name the field that makes a drafter
unexportable; the exit status is 2.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Any, Callable, Sequence

FORMATS = ("deepspec", "speculators")


def resolve_source(src: str | os.PathLike) -> pathlib.Path:
    """A drafter directory: SRC itself when it holds config.json, else a training workdir's
    `export/`."""
    p = pathlib.Path(src)
    if (p / "config.json").exists() and any(p.glob("*.safetensors")):
        return p
    if (p / "export" / "config.json").exists():
        return p / "export"
    raise FileNotFoundError(f"{p}: neither a drafter directory (config.json + *.safetensors) nor "
                            "a training workdir with an export/ directory (a job exports there "
                            "when its training finishes)")


def write_export(draft: Any, out: str | os.PathLike, fmt: str, *,
                 full_vocab_fallback: bool = False, verifier: str | None = None,
                 source_dir: str | os.PathLike | None = None,
                 progress: Callable[[str], None] | None = None) -> pathlib.Path:
    """Writes `draft` (a `Draft`) to `out` in `fmt`, atomically as a directory; the confidence
    calibration of `source_dir` (confidence_calibration.json) travels with it."""
    from dspark_jax.models.io.deepspec import ExportError, write_deepspec_dir
    from dspark_jax.models.io.speculators import write_speculators_dir

    if fmt not in FORMATS:
        raise ExportError(f"format: {fmt!r} is not one of {FORMATS}")
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if fmt == "deepspec":
            write_deepspec_dir(draft.config, draft.state, tmp,
                               full_vocab_fallback_ok=full_vocab_fallback, progress=progress)
        else:
            write_speculators_dir(draft.config, draft.state, tmp, verifier=verifier,
                                  progress=progress)
        if source_dir is not None:
            from dspark_jax.eval.calibration import CALIBRATION_FILE

            calib = pathlib.Path(source_dir) / CALIBRATION_FILE
            if calib.exists():
                shutil.copy2(calib, tmp / CALIBRATION_FILE)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def replace_dir(new: pathlib.Path, dst: pathlib.Path) -> None:
    """Moves the complete directory `new` to `dst`, replacing an old `dst` (two renames)."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(new, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, dst)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="drafter directory or training workdir")
    p.add_argument("--format", required=True, help=" | ".join(FORMATS))
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.add_argument("--full-vocab-fallback", action="store_true",
                   help="deepspec: write a draft-vocabulary DSpark / DFlash drafter as the "
                   "full-vocabulary drafter DeepSpec can hold (warns; recorded in config.json); "
                   "a draft-vocabulary Eagle3 needs none (EAGLE-3's layout)")
    p.add_argument("--verifier", default=None,
                   help="speculators: the target's Hugging Face name or directory "
                   "(speculators_config.verifier.name_or_path)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> pathlib.Path:
    args = parse_args(argv)
    from dspark_jax.models.config import ConfigError
    from dspark_jax.models.io.deepspec import ExportError
    from dspark_jax.models.drafters.draft import load_draft
    from dspark_jax.models.io.hf import CheckpointError

    try:
        if args.format not in FORMATS:
            raise ExportError(f"--format: {args.format!r} is not one of {FORMATS}")
        src = resolve_source(args.source)
        draft = load_draft(src)
        bar = None
        if not args.no_progress:
            from tqdm.auto import tqdm

            bar = tqdm(desc=f"export {args.format}", unit="group")
        progress = None if bar is None else (lambda g: (bar.set_postfix_str(g), bar.update(1)))
        out = write_export(draft, args.out, args.format,
                           full_vocab_fallback=args.full_vocab_fallback,
                           verifier=args.verifier, source_dir=src, progress=progress)
        if bar is not None:
            bar.close()
    except (ExportError, ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.format} drafter written to {out}")
    return out


if __name__ == "__main__":
    main()
