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

`--full-vocab-fallback` applies to deepspec only, `--verifier` to speculators only; either with
the other format is an error.

The directory is written in a temporary directory beside OUT and moved into place when complete
(`replace_dir`), so OUT is either the old export or the new one, never half of each, and
never missing where the file system swaps two directories in one step. The progress bar counts
the bytes of model.safetensors as they are written. Errors name the field that makes a drafter
unexportable, or the option that does not apply; the exit status is 2.
"""

from __future__ import annotations

import argparse
import errno
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Any, Callable, Sequence

FORMATS = ("deepspec", "speculators")


def resolve_source(src: str | os.PathLike) -> pathlib.Path:
    """A drafter directory: SRC itself when it holds one, else a training workdir's `export/`
    (`models.drafters.draft.drafter_dir`)."""
    from dspark_jax.models.drafters.draft import drafter_dir

    return drafter_dir(src)


def check_options(fmt: str, *, full_vocab_fallback: bool = False,
                  verifier: str | None = None) -> None:
    """An `ExportError` for an unknown format, or an option that `fmt` does not take."""
    from dspark_jax.models.io.errors import ExportError

    if fmt not in FORMATS:
        raise ExportError(f"--format: {fmt!r} is not one of {FORMATS}")
    if full_vocab_fallback and fmt != "deepspec":
        raise ExportError(f"--full-vocab-fallback applies to --format deepspec only; --format "
                          f"{fmt} carries the draft vocabulary itself")
    if verifier is not None and fmt != "speculators":
        raise ExportError(f"--verifier applies to --format speculators only "
                          f"(speculators_config.verifier); --format {fmt} records no target")


def write_export(draft: Any, out: str | os.PathLike, fmt: str, *,
                 full_vocab_fallback: bool = False, verifier: str | None = None,
                 source_dir: str | os.PathLike | None = None,
                 progress: Callable[[str, int, int], None] | None = None) -> pathlib.Path:
    """Writes `draft` (a `Draft`) to `out` in `fmt`, atomically as a directory (`replace_dir`);
    the confidence calibration of `source_dir` (confidence_calibration.json) travels with it.
    `progress(name, nbytes, total_bytes)` follows each tensor written."""
    from dspark_jax.models.io.deepspec import write_deepspec_dir
    from dspark_jax.models.io.speculators import write_speculators_dir

    check_options(fmt, full_vocab_fallback=full_vocab_fallback, verifier=verifier)
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


def aside_path(dst: pathlib.Path) -> pathlib.Path:
    """Where the two-phase swap of `replace_dir` keeps the old `dst`: `.<name>.old` beside it."""
    return dst.with_name(f".{dst.name}.old")


def recover_dir(dst: pathlib.Path) -> None:
    """Finishes a two-phase swap that a process left half done: with `dst` missing, the old
    directory at `aside_path(dst)` moves back; with both present, the new one was in place and
    only the old one's deletion was missed, so it is deleted."""
    old = aside_path(dst)
    if not old.exists():
        return
    if dst.exists():
        shutil.rmtree(old)
    else:
        os.replace(old, dst)


def exchange_paths(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swaps two existing paths in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where
    the kernel, the C library or the file system does not offer it."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def replace_dir(new: pathlib.Path, dst: pathlib.Path) -> None:
    """Moves the complete directory `new` to `dst`, replacing an old `dst`.

    Where the file system can swap two directories in one step (`exchange_paths`), `new` and
    `dst` trade places and the old directory is deleted: `dst` is never missing. Elsewhere it is
    a two-phase swap: the old `dst` is renamed to `aside_path(dst)`, `new` is renamed to `dst`,
    the old one is deleted; a process that dies between the two renames leaves the old
    directory aside, and `recover_dir`, which the next call runs first, puts it back."""
    recover_dir(dst)
    if not dst.exists():
        os.replace(new, dst)
        return
    if exchange_paths(new, dst):
        shutil.rmtree(new, ignore_errors=True)      # `new` now holds the old directory
        return
    old = aside_path(dst)
    os.replace(dst, old)
    os.replace(new, dst)
    shutil.rmtree(old, ignore_errors=True)


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
    from dspark_jax.cli_support import exit_with_error
    from dspark_jax.models.config import ConfigError
    from dspark_jax.models.drafters.draft import load_draft
    from dspark_jax.models.io.errors import CheckpointError

    bar = None

    def progress(name: str, nbytes: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm.auto import tqdm

            bar = tqdm(desc=f"export {args.format}", total=total, unit="B", unit_scale=True,
                       unit_divisor=1024)
        bar.set_postfix_str(name, refresh=False)
        bar.update(nbytes)

    try:
        check_options(args.format, full_vocab_fallback=args.full_vocab_fallback,
                      verifier=args.verifier)
        src = resolve_source(args.source)
        draft = load_draft(src)
        out = write_export(draft, args.out, args.format,
                           full_vocab_fallback=args.full_vocab_fallback,
                           verifier=args.verifier, source_dir=src,
                           progress=None if args.no_progress else progress)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:   # ExportError included
        exit_with_error(e)
    finally:
        if bar is not None:
            bar.close()
    print(f"{args.format} drafter written to {out}")
    return out


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main)
