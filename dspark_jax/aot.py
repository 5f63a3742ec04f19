"""Ahead-of-time compilation of the training step for a TPU topology, on a CPU-only machine.

`python -m dspark_jax.aot --config configs/NAME.py --topology v5p:2x4x4 [--num-slices N]
[--json PATH] [--config.key=value ...]`

Builds the frozen target, the drafter, the optimizer state and the global batch abstractly
(`nnx.eval_shape` / `jax.eval_shape`: no weights are read, no device memory is used), lays the
config's (data, fsdp, tensor) mesh on the topology's devices (from `libtpu`, via
`jax.experimental.topologies`), compiles the real jitted training step (`train.step`) and reports
per chip: argument, output, temporary and generated-code bytes, their total against the chip's
HBM, the step's matmul FLOPs (loops counted, remat recompute included), the step-time lower bound
at peak and the implied MFU ceiling (model FLOPs / executed FLOPs). Exits 1 with the shortfall
when the step does not fit, 2 on a usage error (e.g. libtpu missing). This is how issue 9 shows
that the paper's settings (SPEC §4: batch 512 × 4096, 512 anchors, γ 7) fit a pod slice.

`--decode [--requests R] [--max-len S] [--capacity K]` compiles a serving round instead (the
drafter's draft step and the target's ragged verification step at R request slots, S context
tokens each and capacity bucket K, on a tensor × fsdp serving mesh): `aot_decode.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import sys
import time
from typing import Any, Sequence

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip HBM size and bandwidth and dense bf16 peak (public TPU specifications)."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float


CHIPS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1228e9),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9),
}
_DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
                 "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}

# Target shapes of the paper's Qwen3 checkpoints (their Hugging Face config.json), so the
# paper's configs compile without the weights on disk.
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
              head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)
KNOWN_TARGETS = {
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-14b": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
}

INSTALL_HINT = "pip install -e '.[tpu]'"


class AotError(ValueError):
    """A usage problem (the message says what to change)."""


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def chip_for(device_kind: str) -> Chip:
    for kind, name in sorted(_DEVICE_KINDS.items(), key=lambda kv: -len(kv[0])):
        if device_kind.startswith(kind):
            return CHIPS[name]
    raise AotError(f"unknown TPU device kind {device_kind!r}; known: {sorted(_DEVICE_KINDS)}")


def topology_devices(topology: str, num_slices: int = 1) -> list[Any]:
    """Compile-only devices of a TPU topology such as "v5p:2x4x4" (needs libtpu, not a TPU)."""
    if not has_libtpu():
        raise AotError(f"compiling for a TPU topology needs libtpu: {INSTALL_HINT}")
    # compile-only: no TPU is opened, so several compiling processes may share libtpu
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    kw = {"num_slices": num_slices} if num_slices > 1 else {}
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                                 **kw).devices)
    except Exception as e:  # libtpu names the problem (bad generation / shape)
        raise AotError(f"--topology {topology!r}: {e}") from None


def target_hf_dict(c: Any) -> dict[str, Any]:
    """The target's config.json: from `config.target` (a Hugging Face directory or one of
    KNOWN_TARGETS), else the Qwen3 size named by the config (qwen3_8b_* → qwen3-8b)."""
    from dspark_jax.models.hf_io import read_config_json

    t = str(c.target)
    if t and pathlib.Path(t, "config.json").is_file():
        return dict(read_config_json(pathlib.Path(t)))
    for name in (t.lower(), str(c.name).lower().replace("_", "-")):
        for known, cfg in KNOWN_TARGETS.items():
            if name == known or name.startswith(known + "-"):
                return dict(cfg)
    raise AotError(f"config.target {t!r}: give a Hugging Face directory (only its config.json "
                   f"is read) or one of {sorted(KNOWN_TARGETS)}")


# ------------------------------------------------------------------------------ abstract job


@dataclasses.dataclass
class AbstractJob:
    """Everything the jitted step takes, as ShapeDtypeStructs, plus the built step."""

    fns: Any
    args: tuple
    sums_fn: Any
    target_fn: Any
    mesh: Any
    micro_batches: int


def mesh_and_configs(c: Any, devices: Sequence[Any]) -> tuple[Any, Any, Any]:
    """The config's mesh over `devices`, the target's DecoderConfig (from its config.json or
    preset, no weights) and the DraftConfig — what every abstract program here starts from."""
    from dspark_jax.models.config import DecoderConfig
    from dspark_jax.models.draft_config import DraftConfig
    from dspark_jax.sharding import make_mesh

    try:
        mesh = make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, devices=devices)
    except ValueError as e:
        raise AotError(f"config.mesh: {e}") from None
    t_cfg = DecoderConfig.from_hf_dict(target_hf_dict(c), source=f"target of {c.name}")
    fields = dict(c.draft.to_dict())
    fields["target_layer_ids"] = tuple(int(i) for i in fields["target_layer_ids"])
    if fields["mask_token_id"] == -1:   # auto: no tokenizer here; any row works for shapes
        fields["mask_token_id"] = t_cfg.vocab_size - 1
    if 0 < fields.get("draft_vocab_size", 0) < t_cfg.vocab_size:   # the data chooses the ids;
        fields["draft_vocab"] = tuple(range(fields["draft_vocab_size"]))   # shapes need K only
    return mesh, t_cfg, DraftConfig(target=t_cfg, **fields)


def build_abstract_job(c: Any, devices: Sequence[Any]) -> AbstractJob:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from dspark_jax.models.decoder import TargetDecoder
    from dspark_jax.models.draft import create_draft_module
    from dspark_jax.models.target import resolve_dtype
    from dspark_jax.sharding import abstract_on_mesh
    from dspark_jax.train.job_config import attn_key_chunk
    from dspark_jax.train.step import (BATCH_KEYS_ONLINE, BATCH_KEYS_OFFLINE, OptimConfig,
                                       abstract_train_state, build_train_step, make_optimizer,
                                       make_loss_sums_fn, make_schedule, split_draft)

    mesh, t_cfg, d_cfg = mesh_and_configs(c, devices)
    t_dtype, c_dtype = resolve_dtype(c.train.target_dtype), resolve_dtype(c.train.compute_dtype)
    online = c.data.features == "online"

    target = nnx.eval_shape(lambda: TargetDecoder(t_cfg, rngs=nnx.Rngs(0), dtype=t_dtype,
                                                  param_dtype=t_dtype))
    t_graphdef, t_state = nnx.split(target)
    draft = nnx.eval_shape(lambda: create_draft_module(d_cfg, c.seed, c_dtype, jnp.float32))
    graphdef, params, frozen = split_draft(draft)
    oc = OptimConfig(lr=c.train.lr, total_steps=1000)
    tx, schedule = make_optimizer(oc), make_schedule(oc)
    state, state_sh = abstract_train_state(params, tx, mesh)
    frozen_abs = abstract_on_mesh(frozen, mesh)
    t_state_abs = abstract_on_mesh(t_state, mesh) if online else None
    micro = int(c.train.micro_batches)
    fns = build_train_step(graphdef, d_cfg, tx, schedule,
                           target_graphdef=t_graphdef if online else None, mesh=mesh,
                           state_sh=state_sh, frozen=frozen, target_state=t_state if online
                           else None, micro_batches=micro, anchor_chunk=c.train.anchor_chunk,
                           attn_key_chunk=attn_key_chunk(c), remat=bool(c.train.remat))
    B, S = int(c.train.global_batch_size), int(c.data.max_length)
    sh: NamedSharding = fns.batch_sharding
    batch = {k: jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=sh) for k in BATCH_KEYS_ONLINE}
    if not online:
        D = t_cfg.hidden_size
        batch["features"] = jax.ShapeDtypeStruct((B, S, d_cfg.num_features * D), t_dtype,
                                                 sharding=sh)
        batch["target_hidden"] = jax.ShapeDtypeStruct((B, S, D), t_dtype, sharding=sh)
        assert set(batch) == set(BATCH_KEYS_OFFLINE)
    sums_fn = make_loss_sums_fn(graphdef, d_cfg, t_graphdef if online else None,
                                c.train.anchor_chunk, attn_key_chunk=attn_key_chunk(c),
                                remat=bool(c.train.remat))

    def target_fn(ts, mb):
        out = nnx.merge(t_graphdef, ts)(mb["input_ids"], positions_bt=mb["positions"],
                                        segment_ids_bt=mb["segment_ids"],
                                        tap_layer_ids=d_cfg.target_layer_ids)
        return out.taps, out.hidden

    return AbstractJob(fns=fns, args=(state, frozen_abs, t_state_abs, batch), sums_fn=sums_fn,
                       target_fn=target_fn if online else None, mesh=mesh, micro_batches=micro)


def step_flops(job: AbstractJob) -> tuple[int, int]:
    """(executed, model) matmul FLOPs of one step, all chips together. Model FLOPs: the frozen
    target's forward once plus 3× (forward + backward) the rest of the loss."""
    import jax

    from dspark_jax.jaxpr_flops import matmul_flops
    from dspark_jax.sharding import use_mesh

    state, frozen, t_state, batch = job.args
    with use_mesh(job.mesh):
        executed = matmul_flops(job.fns.train, *job.args)
        key = jax.eval_shape(lambda: jax.random.key(0))
        loss_fwd = matmul_flops(job.sums_fn, state.params, frozen, t_state, batch, key)
        target_fwd = matmul_flops(job.target_fn, t_state, batch) if job.target_fn else 0
    return executed, target_fwd + 3 * (loss_fwd - target_fwd)


def _memory(m: Any) -> dict[str, Any]:
    return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
            "generated_code": m.generated_code_size_in_bytes}


def _compile_time_oom(message: str) -> dict[str, Any] | None:
    """XLA's CompileTimeHbmOom ("HLO temporaries (47.84G) exceeds available HBM"): the
    temporaries it needed (arguments etc. unknown, counted as 0), or None for other errors."""
    m = re.search(r"temporaries \(([\d.]+)([KMGT])\)", message)
    if "RESOURCE_EXHAUSTED" not in message or m is None:
        return None
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": GiB, "T": 2 ** 40}[m.group(2)]
    return {"argument": 0, "output": 0, "alias": 0, "generated_code": 0,
            "temp": int(float(m.group(1)) * scale), "error": message.splitlines()[0][:300]}


def memory_report(lowered: Any) -> dict[str, Any]:
    """Compiles a lowered program → its per-chip byte counts (`_memory`), or the temporaries
    of a compile-time HBM OOM (with `error`)."""
    try:
        return _memory(lowered.compile().memory_analysis())
    except Exception as e:   # the TPU compiler refuses a program whose temporaries exceed HBM
        mem = _compile_time_oom(str(e))
        if mem is None:
            raise
        return mem


def libtpu_version() -> str:
    try:
        import libtpu
        v = getattr(libtpu, "__version__", "")
    except ImportError:
        return ""
    if not v:
        from importlib.metadata import version
        v = version("libtpu")
    return v


def compile_report(c: Any, topology: str, num_slices: int = 1) -> dict[str, Any]:
    """Compiles the train step of config `c` for `topology` and returns the report dict."""
    import jax

    devices = topology_devices(topology, num_slices)
    chip = chip_for(devices[0].device_kind)
    job = build_abstract_job(c, devices)
    t0 = time.perf_counter()
    mem = memory_report(job.fns.train.lower(*job.args))
    compile_s = time.perf_counter() - t0
    executed, model = step_flops(job)
    n = len(devices)
    peak = (mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"])
    lower_bound = executed / (n * chip.peak_bf16_flops)
    return {
        "config": c.name, "topology": topology, "num_slices": num_slices, "num_chips": n,
        "chip": chip.name, "mesh": dict(job.mesh.shape),
        "global_batch_size": int(c.train.global_batch_size), "seq_len": int(c.data.max_length),
        "micro_batches": job.micro_batches, "num_anchors": int(c.draft.num_anchors),
        "block_size": int(c.draft.block_size), "features": c.data.features,
        "attn_key_chunk": int(c.train.attn_key_chunk), "remat": bool(c.train.remat),
        "hbm_bytes_per_chip": chip.hbm_bytes,
        "argument_bytes_per_chip": int(mem["argument"]),
        "output_bytes_per_chip": int(mem["output"]),
        "alias_bytes_per_chip": int(mem["alias"]),
        "temp_bytes_per_chip": int(mem["temp"]),
        "generated_code_bytes_per_chip": int(mem["generated_code"]),
        "peak_bytes_per_chip": int(peak), "headroom_bytes_per_chip": int(chip.hbm_bytes - peak),
        "fits": bool(peak <= chip.hbm_bytes),
        "flops_per_step": int(executed), "model_flops_per_step": int(model),
        "peak_flops_per_chip": chip.peak_bf16_flops,
        "step_time_lower_bound_s": lower_bound,
        "mfu_ceiling": model / executed if executed else 0.0,
        "compile_error": mem.get("error", ""),
        "compile_s": round(compile_s, 1), "jax": jax.__version__, "libtpu": libtpu_version(),
    }


def fmt_bytes(b: float) -> str:
    """Bytes as a fixed-width GiB (or MiB below 0.1 GiB) figure for the report tables."""
    return f"{b / GiB:8.2f} GiB" if abs(b) >= GiB / 10 else f"{b / 2**20:8.2f} MiB"


def format_report(r: dict[str, Any]) -> str:
    g = fmt_bytes
    lines = [f"{r['config']} on {r['topology']} × {r['num_slices']} slice(s): {r['num_chips']} "
             f"{r['chip']} chips, mesh {r['mesh']}, batch {r['global_batch_size']}×{r['seq_len']} "
             f"in {r['micro_batches']} micro-batches (compiled in {r['compile_s']} s)",
             "per chip:"]
    for key in ("argument", "output", "alias", "temp", "generated_code"):
        lines.append(f"  {key + ' bytes':22s}{g(r[key + '_bytes_per_chip'])}")
    lines.append(f"  {'peak (arg+out−alias+temp+code)':22s}{g(r['peak_bytes_per_chip'])} of "
                 f"{g(r['hbm_bytes_per_chip']).strip()} HBM → "
                 + ("fits" if r["fits"] else "DOES NOT FIT")
                 + f", headroom {g(r['headroom_bytes_per_chip']).strip()}")
    lines.append(f"FLOPs per step {r['flops_per_step']:.3e} (model {r['model_flops_per_step']:.3e}); "
                 f"step time ≥ {r['step_time_lower_bound_s']:.3f} s at peak; MFU ceiling "
                 f"{r['mfu_ceiling']:.1%}")
    return "\n".join(lines)


def markdown_table(reports: Sequence[dict[str, Any]]) -> str:
    """The BENCHMARKS.md table of several reports (one row each)."""
    rows = ["| config | topology | chips | mesh (data×fsdp×tensor) | micro-batches | attention "
            "| peak GiB/chip | HBM GiB | headroom GiB | fits | PFLOPs/step | step ≥ s | MFU ceiling |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        m = r["mesh"]
        attn = f"chunk {r['attn_key_chunk']}" if r["attn_key_chunk"] else "dense"
        rows.append(
            f"| {r['config']} | {r['topology']}" + (f" ×{r['num_slices']}" if r["num_slices"] > 1
                                                    else "")
            + f" | {r['num_chips']} | {m['data']}×{m['fsdp']}×{m['tensor']} | "
            f"{r['micro_batches']} | {attn} | {r['peak_bytes_per_chip'] / GiB:.2f} | "
            f"{r['hbm_bytes_per_chip'] / GiB:.0f} | {r['headroom_bytes_per_chip'] / GiB:.2f} | "
            f"{'yes' if r['fits'] else '**no**'} | {r['flops_per_step'] / 1e15:.1f} | "
            f"{r['step_time_lower_bound_s']:.2f} | {r['mfu_ceiling']:.1%} |")
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m dspark_jax.aot", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="configs/NAME.py")
    ap.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:2x2, v5p:2x4x4")
    ap.add_argument("--num-slices", type=int, default=1)
    ap.add_argument("--json", default="", help="also write the report as one JSON object")
    ap.add_argument("--no-preset", action="store_true",
                    help="keep the config's mesh and micro_batches instead of the topology's preset")
    ap.add_argument("--decode", action="store_true",
                    help="compile a serving round (draft step + ragged verification step) "
                         "instead of the training step")
    ap.add_argument("--requests", type=int, default=64, help="--decode: request slots R")
    ap.add_argument("--max-len", type=int, default=8192,
                    help="--decode: context tokens per request slot")
    ap.add_argument("--capacity", type=int, default=0,
                    help="--decode: capacity bucket K of the verification step (0: R·(γ+1))")
    args, overrides = ap.parse_known_args(argv[1:])
    bad = [o for o in overrides if not re.match(r"^--?(no)?config\.", o)]
    if bad:
        ap.error(f"unrecognised arguments: {bad}")
    try:
        if not has_libtpu():
            raise AotError(f"compiling for a TPU topology needs libtpu: {INSTALL_HINT}")
        from dspark_jax.train.job_config import UsageError, parse_config

        try:
            c = parse_config([argv[0], f"--config={args.config}", *overrides],
                             require_target=False)
        except UsageError as e:
            raise AotError(str(e)) from None
        if args.decode:
            from dspark_jax.aot_decode import DecodeShape, decode_report, format_decode_report

            shape = DecodeShape(args.requests, args.max_len, args.capacity)
            report = decode_report(c, args.topology, shape, args.num_slices,
                                   default_mesh=not args.no_preset)
            text = format_decode_report(report)
        else:
            report = _train_report(c, args, args.no_preset)
            text = format_report(report)
    except AotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text, flush=True)
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    code, message = verdict(report)
    if code:
        print(f"error: {message}", file=sys.stderr)
    return code


def _train_report(c: Any, args: argparse.Namespace, no_preset: bool) -> dict[str, Any]:
    from dspark_jax.train.config_base import apply_mesh_preset

    if not no_preset:
        preset = c.mesh.preset or args.topology
        try:
            apply_mesh_preset(c, preset, args.num_slices)
        except ValueError as e:
            raise AotError(str(e)) from None
    return compile_report(c, args.topology, args.num_slices)


def verdict(report: dict[str, Any]) -> tuple[int, str]:
    """(exit code, message): 1 with the per-chip shortfall when the step does not fit."""
    need, have = report["peak_bytes_per_chip"], report["hbm_bytes_per_chip"]
    if need <= have:
        return 0, f"fits: {need / GiB:.2f} of {have / GiB:.2f} GiB per chip"
    return 1, (f"the step does not fit: {need / GiB:.2f} GiB per chip needed, {have / GiB:.2f} "
               f"GiB available (short by {(need - have) / GiB:.2f} GiB)")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
