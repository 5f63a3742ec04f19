"""Compile the training step or a serving round for a TPU topology, on a CPU-only machine.

`python -m dspark_jax.aot --config configs/NAME.py --topology v5p:2x4x4 [--num-slices N]
[--json PATH] [--config.key=value ...]` compiles the training step (SPEC §4, `training.py`);
`--decode [--requests R] [--max-len S] [--capacity K]` compiles a serving round instead (the
drafter's draft step and the target's ragged verification step at R request slots, S context
tokens each and capacity bucket K, on a tensor × fsdp serving mesh; paper §5.2–5.3,
`decode.py`). Prints the per-chip report (and writes it as JSON with `--json`). Exits 1 with
the shortfall when the program does not fit, 2 on a usage error (e.g. libtpu missing).

`--topology h200:8` compiles for the eight H200s of one host instead (no GPU needed: the CUDA
plugin's compile-only devices; mesh preset: FSDP over the host's GPUs).

`--chip h200` compiles for one chip: a GPU without one (`h200`, `h100`: the CUDA plugin, which
the test command installs) or one TPU chip (`v5e`, `v5p`, `v6e`). Alone it compiles the
training step and adds the compiled program's traffic to the report (bytes accessed a step,
kernels, the costliest ones, the step's memory-bound time). With `--decode [--requests R]
[--max-len S] [--capacity K] [--programs a,b]` it compiles the decoding programs (the plain
step, the draft, the verification, the round; `decode_floor.py`) and reports per program the
bytes it accesses a step against the weights and cache it must read, the weights copied
before a dot reads them, the kernels per step and the temporary memory.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from typing import Sequence

from dspark_jax.aot.memory import verdict
from dspark_jax.aot.devices import gpu_topology
from dspark_jax.aot.topology import INSTALL_HINT, AotError, has_libtpu


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m dspark_jax.aot", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="configs/NAME.py")
    ap.add_argument("--topology", default="",
                    help="TPU topology, e.g. v5e:2x2, v5p:2x4x4, or the GPUs of one host, "
                         "e.g. h200:8 (compiled without a GPU)")
    ap.add_argument("--chip", default="",
                    help="one chip (h200, h100: compiled without a GPU; v5e, v5p, v6e: one TPU "
                         "chip): the training step with its traffic, or with --decode the "
                         "decoding programs against their floor")
    ap.add_argument("--programs", default="",
                    help="--decode: the programs to compile; --chip: of decode_step, "
                         "plain_step, draft, verify, round (default all); --topology: the "
                         "round and any of draft, verify, anchor, prefill (default all)")
    ap.add_argument("--stacked-layers", action="store_true",
                    help="--decode: compile the layers stacked (the CPU's and training's "
                         "layout) instead of one buffer per layer, to compare")
    ap.add_argument("--num-slices", type=int, default=1)
    ap.add_argument("--tree-budget", type=int, default=0,
                    help="with --decode: rounds that draft trees of this many nodes (the "
                         "round and the draft step; 0: the chain)")
    ap.add_argument("--tree-branching", type=int, default=0,
                    help="with --tree-budget: a tree node's most children, as `evaluate "
                         "--tree-branching` (0: the engine's default)")
    ap.add_argument("--json", default="", help="also write the report as one JSON object")
    ap.add_argument("--no-preset", action="store_true",
                    help="keep the config's mesh and micro_batches instead of the topology's preset")
    ap.add_argument("--decode", action="store_true",
                    help="compile a serving round (draft step + ragged verification step) "
                         "instead of the training step")
    ap.add_argument("--requests", type=int, default=0,
                    help="--decode: request slots R (default 64 on a topology, 1 with --chip)")
    ap.add_argument("--max-len", type=int, default=8192,
                    help="--decode: context tokens per request slot")
    ap.add_argument("--capacity", type=int, default=0,
                    help="--decode: capacity bucket K of the verification step (0: R·(γ+1))")
    args, overrides = ap.parse_known_args(argv[1:])
    bad = [o for o in overrides if not re.match(r"^--?(no)?config\.", o)]
    if bad:
        ap.error(f"unrecognised arguments: {bad}")
    if bool(args.chip) == bool(args.topology):
        ap.error("give one of --topology (a TPU slice) or --chip (one chip)")
    if args.programs and not args.decode:
        ap.error("--programs picks decoding programs: it needs --decode")
    if args.stacked_layers and not args.decode:
        ap.error("--stacked-layers compares decoding layouts: it needs --decode")
    if args.num_slices < 1:
        ap.error(f"--num-slices must be ≥ 1, got {args.num_slices}")
    if args.num_slices > 1 and not args.topology:
        ap.error("--num-slices joins slices of a TPU topology: it needs --topology")
    try:
        report, text = _compile(argv[0], args, overrides)
    except AotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text, flush=True)
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.chip and args.decode:   # the floor report holds no memory verdict
        return 0
    code, message = verdict(report)
    if code:
        print(f"error: {message}", file=sys.stderr)
    return code


def _compile(prog: str, args: argparse.Namespace, overrides: list[str]) -> tuple[dict, str]:
    """(report, its text) of what the arguments ask for: a topology's training step or serving
    round, or one chip's training step or decoding programs against their floor."""
    if args.topology and gpu_topology(args.topology) is None and not has_libtpu():
        raise AotError(f"compiling for a TPU topology needs libtpu: {INSTALL_HINT}")
    from dspark_jax.aot.decode import DecodeShape
    from dspark_jax.train.job_config import UsageError, parse_config

    try:
        c = parse_config([prog, f"--config={args.config}", *overrides], require_target=False)
    except UsageError as e:
        raise AotError(str(e)) from None
    programs = [p for p in args.programs.split(",") if p]
    if args.chip and args.decode:
        from dspark_jax.aot.decode_floor import (PROGRAMS as FLOOR_PROGRAMS, decode_floor_report,
                                                 format_floor_report)

        shape = DecodeShape(args.requests or 1, args.max_len, args.capacity, args.tree_budget,
                            args.tree_branching)
        report = decode_floor_report(c, args.chip, shape,
                                     programs or list(FLOOR_PROGRAMS),
                                     layer_buffers=not args.stacked_layers)
        return report, format_floor_report(report)
    if args.chip:
        from dspark_jax.aot.training import chip_train_report, format_report

        report = chip_train_report(c, args.chip)
        return report, format_report(report)
    if args.decode:
        from dspark_jax.aot.decode import decode_report, format_decode_report

        shape = DecodeShape(args.requests or 64, args.max_len, args.capacity,
                            args.tree_budget, args.tree_branching)
        report = decode_report(c, args.topology, shape, args.num_slices,
                               default_mesh=not args.no_preset,
                               layer_buffers=not args.stacked_layers,
                               programs=programs or None)
        return report, format_decode_report(report)
    from dspark_jax.aot.training import format_report, train_report

    report = train_report(c, args.topology, args.num_slices, preset=not args.no_preset)
    return report, format_report(report)
