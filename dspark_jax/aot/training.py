"""Ahead-of-time compilation of the training step (SPEC §4) for a TPU topology or one chip, on a
CPU-only machine (`python -m dspark_jax.aot --config configs/NAME.py --topology v5p:2x4x4` or
`--chip h200`, `aot/command.py`).

Builds the frozen target, the drafter, the optimizer state and the global batch abstractly
(`nnx.eval_shape` / `jax.eval_shape`: no weights are read, no device memory is used), lays the
config's (data, fsdp, tensor) mesh on the topology's devices (from `libtpu`, via
`jax.experimental.topologies`), compiles the real jitted training step (`train.step`) and reports
per chip: argument, output, temporary and generated-code bytes, their total against the chip's
HBM, the step's matmul FLOPs (loops counted, remat recompute included), the step-time lower bound
at peak and the implied MFU ceiling (model FLOPs / executed FLOPs): whether the paper's settings
(SPEC §4: batch 512 × 4096, 512 anchors, γ 7) fit a pod slice. For one chip the compiled
program's traffic is added (`chip_train_report`), so the step's memory-bound time and its
costliest kernels show beside its FLOPs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from dspark_jax.aot.memory import fmt_bytes, memory_and_kernels, memory_of
from dspark_jax.aot.shapes import mesh_and_configs
from dspark_jax.aot.devices import slice_devices
from dspark_jax.aot.topology import AotError, libtpu_version


# argument paths of the training step's weights (its arguments are positional): the drafter's
# parameters, its frozen part and the target's (online features)
TRAIN_WEIGHT_ARGS = ("args[0].params", "args[1]", "args[2]")


@dataclasses.dataclass
class AbstractJob:
    """Everything the jitted step takes, as ShapeDtypeStructs, plus the built step."""

    fns: Any
    args: tuple
    sums_fn: Any
    target_fn: Any
    mesh: Any
    micro_batches: int


def build_abstract_job(c: Any, devices: Sequence[Any]) -> AbstractJob:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from dspark_jax.models.decoder import TargetDecoder
    from dspark_jax.models.layers import flash_kernels
    from dspark_jax.models.drafters.draft import create_draft_module
    from dspark_jax.models.target import resolve_dtype
    from dspark_jax.sharding import abstract_on_mesh
    from dspark_jax.train.job_config import attn_kernel, attn_key_chunk
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
                           attn_key_chunk=attn_key_chunk(c), remat=bool(c.train.remat),
                           attn_kernel=attn_kernel(c), precision=c.train.precision)
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
                                remat=bool(c.train.remat), attn_kernel=attn_kernel(c))

    def target_fn(ts, mb):   # the target's forward as the step runs it (kernels or not)
        with flash_kernels(attn_kernel(c)):
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


def compile_report(c: Any, topology: str, num_slices: int = 1) -> dict[str, Any]:
    """Compiles the train step of config `c` for `topology` and returns the report dict."""
    devices, chip = slice_devices(topology, num_slices)
    return _report(c, devices, chip, topology, num_slices)


def chip_train_report(c: Any, chip: str) -> dict[str, Any]:
    """The train step of config `c` compiled for one chip (`decode_floor.single_chip_devices`:
    an H200 or H100 without a GPU, or one TPU chip), with the compiled program's traffic: bytes
    accessed a step, kernels, the costliest kernels, and the step's lower bound as the larger of
    its FLOPs at peak and its bytes at the HBM bandwidth."""
    from dspark_jax.aot.decode_floor import single_chip_devices

    for k in ("data", "fsdp", "tensor"):
        c.mesh[k] = 1
    devices, facts = single_chip_devices(chip)
    return _report(c, devices, facts, chip, 1, traffic=True)


def _report(c: Any, devices: Sequence[Any], chip: Any, topology: str, num_slices: int,
            traffic: bool = False) -> dict[str, Any]:
    import jax

    from dspark_jax.train.job_config import attn_kernel

    job = build_abstract_job(c, devices)
    t0 = time.perf_counter()
    lowered = job.fns.train.lower(*job.args)
    extra: dict[str, Any] = {}
    if traffic:
        from dspark_jax.aot.hlo_traffic import Program, compile_with_text, weights_or_cache

        from dspark_jax.aot.hlo_traffic import collectives_feeding_kernels, pallas_kernels

        compiled, text = compile_with_text(lowered, via_dump=devices[0].platform == "tpu")
        mem = memory_of(compiled.memory_analysis()) | {
            "pallas_kernels": len(pallas_kernels(text)),
            "kernel_gathers": collectives_feeding_kernels(text)}
        prog = Program(text, weights_or_cache(TRAIN_WEIGHT_ARGS, ()))
        summary = prog.summary()
        extra = {k: summary[k] for k in ("bytes_accessed", "weights_bytes", "weight_copy_bytes",
                                         "kernels_per_step", "weight_copies")}
        extra["top_kernels"] = prog.top_kernels(12)
        extra["hbm_bytes_per_s"] = chip.hbm_bytes_per_s
    else:
        mem = memory_and_kernels(lowered, via_dump=devices[0].platform == "tpu")
    compile_s = time.perf_counter() - t0
    executed, model = step_flops(job)
    n = len(devices)
    peak = (mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"])
    lower_bound = executed / (n * chip.peak_bf16_flops)
    if traffic:
        extra["memory_time_lower_bound_s"] = extra["bytes_accessed"] / chip.hbm_bytes_per_s
        extra["mfu_at_lower_bound"] = model / (
            n * chip.peak_bf16_flops * max(lower_bound, extra["memory_time_lower_bound_s"]))
    return extra | {
        "config": c.name, "topology": topology, "num_slices": num_slices, "num_chips": n,
        "chip": chip.name, "mesh": dict(job.mesh.shape),
        "global_batch_size": int(c.train.global_batch_size), "seq_len": int(c.data.max_length),
        "micro_batches": job.micro_batches, "num_anchors": int(c.draft.num_anchors),
        "block_size": int(c.draft.block_size), "features": c.data.features,
        "attn_key_chunk": int(c.train.attn_key_chunk),
        "attn_kernel": attn_kernel(c), "remat": bool(c.train.remat),
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
        "pallas_kernels": mem["pallas_kernels"], "kernel_gathers": mem["kernel_gathers"],
        "compile_error": mem.get("error", ""),
        "compile_s": round(compile_s, 1), "jax": jax.__version__,
        "libtpu": libtpu_version() if devices[0].platform == "tpu" else "",
    }


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
    lines.append(kernel_line(r))
    lines.append(f"FLOPs per step {r['flops_per_step']:.3e} (model {r['model_flops_per_step']:.3e}); "
                 f"step time ≥ {r['step_time_lower_bound_s']:.3f} s at peak; MFU ceiling "
                 f"{r['mfu_ceiling']:.1%}")
    if "bytes_accessed" in r:
        lines.append(f"bytes accessed per step {r['bytes_accessed'] / 1e9:.1f} GB → step time ≥ "
                     f"{r['memory_time_lower_bound_s']:.3f} s at the HBM bandwidth; "
                     f"{r['kernels_per_step']} kernels; weights copied "
                     f"{r['weight_copy_bytes'] / 1e9:.2f} GB; MFU at the larger bound "
                     f"{r['mfu_at_lower_bound']:.1%}")
        lines.append("  costliest kernels (MB read + written per step):")
        for k in r["top_kernels"]:
            lines.append(f"    {k['mb']:10.1f}  {k['name']} x{k['times']}")
    return "\n".join(lines)


def kernel_line(r: dict[str, Any]) -> str:
    """The report's line on its Pallas kernels: how many, and whether any is fed by a gather."""
    n, gathers = r["pallas_kernels"], r["kernel_gathers"]
    if n < 0:
        return "Pallas kernels: unknown (the program did not compile)"
    if n == 0:
        return "Pallas kernels: none"
    if not gathers:
        return f"Pallas kernels: {n}, each on its own shards (no collective feeds one)"
    first = gathers[0]
    return (f"Pallas kernels: {n}; {len(gathers)} operands gathered in front of one, e.g. "
            f"{first['kernel']} ← {first['collective']}")


def train_report(c: Any, topology: str, num_slices: int = 1, *, preset: bool = True
                 ) -> dict[str, Any]:
    """`compile_report` after the mesh preset of `config.mesh.preset` (default: `topology`)
    is applied; `preset=False` keeps the config's mesh and micro-batches."""
    from dspark_jax.train.config_base import apply_mesh_preset

    if preset:
        try:
            apply_mesh_preset(c, c.mesh.preset or topology, num_slices)
        except ValueError as e:
            raise AotError(str(e)) from None
    return compile_report(c, topology, num_slices)
