"""One chip's decoding programs against their memory floor, compiled ahead of time (`python -m
dspark_jax.aot --chip h200 --decode`): does every step read the weights where they lie, and
how close does its traffic come to the bytes it must read?

A decoding step on an accelerator is bound by memory: its floor is the bytes of the weights
and the KV cache it reads once. Five programs are compiled for one chip, as the serving engine
and the benchmarks run them, with the target and drafter in the engine's decoding layout (one
buffer per layer) and bf16 weights and caches:

  decode_step  `autoregressive.ar_decode` (`bench.decode_step`'s program), per step
  plain_step   the engine's plain decoding step (`plain_steps.plain_steps`), per step
  draft        the drafter's γ proposals and the scheduler (`draft_and_schedule`, paper §3.2)
  verify       the target's verification of capacity K and the commit (`verify_and_commit`)
  round        whole rounds as the engine fuses them (`speculative_rounds`), per round

Each program's optimized HLO is read by `hlo_traffic.Program`: bytes accessed per step, the
weight and cache bytes among its arguments, the bytes of weights copied before a dot reads
them, the kernels per step and the temporary memory.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

from dspark_jax.aot.decode import DecodeShape, build_abstract_round
from dspark_jax.aot.hlo_traffic import Program, compile_with_text, weights_or_cache
from dspark_jax.aot.topology import AotError

# argument paths (JAX's op_name of each entry parameter) of the weights and of the caches
WEIGHT_ARGS = ("state[", "target_state[", "arrays.target_state", "arrays.draft_state",
               "arrays.vocab_weights")
CACHE_ARGS = ("s.cache.k", "s.cache.v", "state.cache.k", "state.cache.v", "state.draft_cache")
DRAFTER_WEIGHT_ARGS = ("arrays.draft_state", "arrays.vocab_weights")
PROGRAMS = ("decode_step", "plain_step", "draft", "verify", "round")

# The kernel-cost model a GPU program's time is projected with, an estimate and not a timing:
# bytes at the bandwidth one H200 achieved and a fixed cost per kernel (its ramp, tail and
# gap), both read off the only H200 measurement of a decode step (others', at 2c31213: the
# stacked Qwen3-8B step, 43.17 GB in 1,368 kernels, took 12.79 ms: 4.3 TB/s with 2 µs a kernel).
ACHIEVED_BANDWIDTH_FRACTION = 4.3e12 / 4.8e12
KERNEL_COST_S = 2e-6


def single_chip_devices(chip: str) -> tuple[list[Any], Any]:
    """(compile-only devices, chip facts) of one GPU (`gpu.GPU_CHIPS`) or one TPU chip
    (`topology.CHIPS`: v5e, v5p, v6e, v4)."""
    from dspark_jax.aot import gpu, topology

    if chip in gpu.GPU_CHIPS:
        return gpu.gpu_devices(chip), gpu.GPU_CHIPS[chip]
    if chip in topology.CHIPS:
        shape = {"v5e": "1x1", "v6e": "1x1"}.get(chip, "1x1x1")
        devices = topology.topology_devices(f"{chip}:{shape}")[:1]
        return devices, topology.CHIPS[chip]
    raise AotError(f"--chip {chip!r}: choose from {sorted(gpu.GPU_CHIPS)} (GPU) or "
                   f"{sorted(topology.CHIPS)} (TPU)")


def _programs(c: Any, devices: Sequence[Any], shape: DecodeShape, layer_buffers: bool = True
              ) -> tuple[dict[str, tuple[Callable[..., Any], tuple]], Any, Any]:
    """name → (lower function, abstract arguments), the mesh and the abstract round, in the
    engine's layout on an accelerator (one buffer per layer) or the stacked one."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.decoding.autoregressive import ARState, ar_decode
    from dspark_jax.decoding.plain_steps import plain_steps

    rnd = build_abstract_round(c, devices, shape, layer_buffers=layer_buffers)
    arrays, state, params = rnd.verify_args[:3]
    t_gd, t_abs, stop_ids = arrays.target_graphdef, arrays.target_state, arrays.stop_ids
    R = shape.requests
    rep = jax.sharding.NamedSharding(rnd.mesh, jax.sharding.PartitionSpec())

    def arr(shp: tuple[int, ...], dt: Any) -> Any:
        return jax.ShapeDtypeStruct(shp, dt, sharding=rep)

    ar_state = ARState(cache=state.cache, last_token=arr((R,), jnp.int32),
                       out=arr((R, 64), jnp.int32), num_out=arr((R,), jnp.int32),
                       done=arr((R,), jnp.bool_), key_data=arr((R, 2), jnp.uint32),
                       steps=arr((), jnp.int32))
    programs = {
        "decode_step": (functools.partial(ar_decode.lower, t_gd),
                        (t_abs, ar_state, arr((), jnp.float32), stop_ids),
                        dict(num_steps=arr((), jnp.int32))),
        "plain_step": (functools.partial(plain_steps.lower, t_gd, max_steps=16),
                       (t_abs, state, params, stop_ids, arr((), jnp.int32),
                        arr((), jnp.int32)), {}),
        "draft": (rnd.draft_lower, rnd.draft_args, {}),
        "verify": (rnd.verify_lower, rnd.verify_args, {}),
        "round": (rnd.round_lower, rnd.round_args, {}),
    }
    return programs, rnd.mesh, rnd


def must_read_bytes(param_bytes: dict[str, float], weights: float, cache: float,
                    draft_slots: int = 0, stepwise_drafter: bool = False
                    ) -> tuple[float, float, float]:
    """(floor, gathered, per-slot) bytes of a program's arguments: the bytes it must read.

    The weights and the caches, once each, less the tables it gathers a row per token from
    (an untied input embedding; the Markov head's W1, paper §3.2), plus, in a program that
    drafts `draft_slots` > 0 slots, the Markov head's output matrix W2 once per further slot:
    slot k's bias depends on the token sampled at slot k − 1, so the slots run in sequence
    and each streams all of W2 ([V, r], larger than a GPU's L2 at the full vocabulary). A
    `stepwise_drafter` (Eagle3: one pass of its layers and LM head a draft token, the first
    with the commit) reads all of its weights, less the tables it gathers from, once per
    further pass instead (`draft_slots`: its passes)."""
    untied = any("['lm_head']" in k for k in param_bytes)

    def gathers(k: str) -> bool:
        return (untied and "['embed']" in k) or "['markov']['w1']" in k

    gathered = sum(b for k, b in param_bytes.items() if k.startswith(WEIGHT_ARGS) and gathers(k))
    if stepwise_drafter:
        per_pass = sum(b for k, b in param_bytes.items()
                       if k.startswith(DRAFTER_WEIGHT_ARGS) and not gathers(k))
    else:
        per_pass = sum(b for k, b in param_bytes.items() if k.startswith(WEIGHT_ARGS) and (
            "['markov']['w2']" in k or "['markov_w2']" in k))
    per_slot = max(draft_slots - 1, 0) * per_pass
    return weights - gathered + cache + per_slot, gathered, per_slot


# the function that runs a DSpark / DFlash drafter's layers while decoding: its kernels are the
# drafter's per-layer count, the rest of drafting (LM head, sequential head, sampling) apart
DRAFTER_LAYERS_FUNCTION = "backbone_over_cache"
# the functions that run one Llama / Qwen3 target layer over the cache (`llama.decoder`: the
# one-token step's and prefill's, verification's): a program's kernels inside them are its
# target layers' chain, the rest (embedding, final norm, LM head, sampling, bookkeeping) apart
TARGET_LAYER_FUNCTIONS = ("cached_body", "ragged_body")


def program_report(lowered: Any, draft_slots: int = 0, stepwise_drafter: bool = False
                   ) -> dict[str, Any]:
    """A lowered program compiled → its traffic summary (`hlo_traffic.Program.summary`: each
    conditional's costliest branch), the bytes with each conditional's cheapest branch
    (`bytes_cheapest`, `kernels_cheapest`: e.g. greedy requests, where sampling sits behind a
    `cond`), the floor it
    is held to (`must_read_bytes`), its temporary memory and the kernels of the drafter's
    layers (`drafter_layer_kernels`)."""
    t0 = time.perf_counter()
    compiled, text = compile_with_text(lowered)
    classify = weights_or_cache(WEIGHT_ARGS, CACHE_ARGS)
    prog = Program(text, classify)
    out = prog.summary()
    cheapest = Program(text, classify, branch="cheapest").summary()
    out["bytes_cheapest"] = cheapest["bytes_accessed"]
    out["kernels_cheapest"] = cheapest["kernels_per_step"]
    mem = compiled.memory_analysis()
    floor, gathered, per_slot = must_read_bytes(prog.param_bytes, out["weights_bytes"],
                                                out["cache_bytes"], draft_slots,
                                                stepwise_drafter)
    out.update(gathered_bytes=gathered, per_slot_bytes=per_slot,
               temp_bytes=int(mem.temp_size_in_bytes) if mem is not None else -1,
               floor_bytes=floor,
               bytes_over_floor=out["bytes_accessed"] / floor if floor else 0.0,
               top_kernels=prog.top_kernels(6), compile_s=round(time.perf_counter() - t0, 1),
               drafter_layer_kernels=prog.kernels_within(DRAFTER_LAYERS_FUNCTION),
               target_layer_kernels=sum(prog.kernels_within(f) for f in TARGET_LAYER_FUNCTIONS))
    return out


def decode_floor_report(c: Any, chip: str, shape: DecodeShape,
                        programs: Sequence[str] = PROGRAMS, layer_buffers: bool = True
                        ) -> dict[str, Any]:
    """Compiles `programs` of config `c` for one `chip` → report (per program: bytes_accessed,
    weights_bytes, cache_bytes, weight_copy_bytes, kernels_per_step, temp_bytes, ...), in the
    layout the engine decodes in on an accelerator (`layer_buffers`: one buffer per layer) or,
    to compare, with the layers stacked as the CPU and training keep them."""
    import jax

    from dspark_jax.models.decoder import aligned_length
    from dspark_jax.models.drafters.kind import drafter_kind
    from dspark_jax.models.layers import flash_kernels
    from dspark_jax.sharding import use_mesh
    from dspark_jax.train.job_config import attn_kernel

    for k in ("data", "fsdp", "tensor"):
        c.mesh[k] = 1
    # the engine's cache for `max_len` (`Engine.cache_lengths`)
    shape = dataclasses.replace(shape, max_len=aligned_length(shape.max_len))
    devices, facts = single_chip_devices(chip)
    built, mesh, rnd = _programs(c, devices, shape, layer_buffers)
    from dspark_jax.aot.shapes import target_hf_dict

    # (target layers, drafter layers): a program's kernels per layer of the model it runs
    kind = drafter_kind(c.draft.model_type)
    stepwise = not kind.parallel_block   # a pass of the drafter a draft token (Eagle3)
    layers = (int(target_hf_dict(c)["num_hidden_layers"]), int(c.draft[kind.layers_field]))
    report: dict[str, Any] = {
        "mode": "decode_floor", "config": c.name, "chip": chip,
        "hbm_bytes_per_s": facts.hbm_bytes_per_s, "requests": shape.requests,
        "max_len": shape.max_len, "capacity": rnd.shape.capacity, "gamma": rnd.gamma,
        "scheduler": rnd.scheduler, "jax": jax.__version__,
        "layout": "per-layer" if layer_buffers else "stacked", "programs": {}}
    if shape.tree_budget and "verify" in programs:   # trees verify inside the round only
        programs = [p for p in programs if p != "verify"]
    report.update(tree_budget=shape.tree_budget, tree_branching=rnd.shape.tree_branching)
    for name in programs:
        if name not in built:
            raise AotError(f"unknown program {name!r}; choose from {list(PROGRAMS)}")
        lower, args, kw = built[name]
        slots = rnd.gamma if name in ("draft", "round") else 0
        if stepwise and name == "draft":   # its first token's logits come with the commit
            slots -= 1
        with use_mesh(mesh), flash_kernels(attn_kernel(c)):
            r = program_report(lower(*args, **kw), slots, stepwise_drafter=stepwise)
        r["floor_s"] = r["floor_bytes"] / facts.hbm_bytes_per_s
        # the floor at the bandwidth the projection assumes: what the projected time is over it
        # is the kernels' cost and the bytes beyond the floor, nothing else
        r["floor_achieved_s"] = r["floor_s"] / ACHIEVED_BANDWIDTH_FRACTION
        r["traffic_s"] = r["bytes_accessed"] / facts.hbm_bytes_per_s
        r["model_layers"] = layers[name == "draft"]
        r["kernels_per_layer"] = r["kernels_per_step"] / layers[name == "draft"]
        if r["target_layer_kernels"] and name != "draft":   # the layers' chain, one layer's
            r["target_layer_chain"] = r["target_layer_kernels"] / layers[0]
            r["outside_layer_kernels"] = r["kernels_per_step"] - r["target_layer_kernels"]
        if name == "draft" and r["drafter_layer_kernels"]:   # the layers apart from the heads
            r["kernels_per_layer"] = r["drafter_layer_kernels"] / layers[1]
            r["drafting_head_kernels"] = r["kernels_per_step"] - r["drafter_layer_kernels"]
        r["projected_s"] = projected_seconds(r["bytes_accessed"], r["kernels_per_step"], facts,
                                             chip)
        report["programs"][name] = r
    progs = report["programs"]
    if "round" in progs and "plain_step" in progs and progs["plain_step"]["projected_s"]:
        report["round_over_plain_step_projected"] = (progs["round"]["projected_s"]
                                                     / progs["plain_step"]["projected_s"])
        # what no kernel count can remove: the round must read the drafter's weights besides
        # the target's (its floor bytes over the plain step's)
        report["round_over_plain_step_floor"] = (progs["round"]["floor_bytes"]
                                                 / progs["plain_step"]["floor_bytes"])
    return report


def projected_seconds(bytes_accessed: float, kernels: int, facts: Any, chip: str
                      ) -> float | None:
    """A GPU program's time by the kernel-cost model (`KERNEL_COST_S`,
    `ACHIEVED_BANDWIDTH_FRACTION`): an estimate, not a timing; None on a TPU (no calibration)."""
    from dspark_jax.aot import gpu

    if chip not in gpu.GPU_CHIPS:
        return None
    return (bytes_accessed / (ACHIEVED_BANDWIDTH_FRACTION * facts.hbm_bytes_per_s)
            + kernels * KERNEL_COST_S)


def format_floor_report(r: dict[str, Any]) -> str:
    gb = 1e9
    lines = [f"{r['config']} decoding programs on one {r['chip']} (jax {r['jax']}): "
             f"{r['requests']} request slots x {r['max_len']} tokens, capacity {r['capacity']}, "
             f"gamma {r['gamma']}, scheduler {r['scheduler']}, {r['layout']} layers",
             f"  {'program':12s}{'bytes GB':>10s}{'cheapest':>10s}{'weights':>9s}{'cache':>8s}"
             f"{'floor x':>9s}{'w-copy GB':>11s}{'kernels':>9s}{'/layer':>8s}{'temp MB':>9s}"
             f"  floor ms  projected ms (x floor, x floor at achieved bandwidth)"]
    for name, p in r["programs"].items():
        lines.append(f"  {name:12s}{p['bytes_accessed'] / gb:10.3f}"
                     f"{p['bytes_cheapest'] / gb:10.3f}"
                     f"{p['weights_bytes'] / gb:9.3f}"
                     f"{p['cache_bytes'] / gb:8.3f}{p['bytes_over_floor']:9.3f}"
                     f"{p['weight_copy_bytes'] / gb:11.3f}{p['kernels_per_step']:9d}"
                     f"{p['kernels_per_layer']:8.1f}"
                     f"{p['temp_bytes'] / 1e6:9.1f}  {p['floor_s'] * 1e3:8.3f}"
                     + (f"  {p['projected_s'] * 1e3:8.3f} ({p['projected_s'] / p['floor_s']:.2f}, "
                        f"{p['projected_s'] / p['floor_achieved_s']:.3f})"
                        if p.get("projected_s") else ""))
    kinds = next(iter(r["programs"].values()), {}).get("kernels_by_kind")
    if kinds:
        lines.append("  kernels per layer by kind (gemm / attention / norm / elementwise / copy "
                     "/ other):")
        for name, p in r["programs"].items():
            per = p.get("model_layers") or 1
            lines.append(f"    {name:12s}" + " / ".join(
                f"{p['kernels_by_kind'][k] / per:.1f}" for k in
                ("gemm", "attention", "norm", "elementwise", "copy", "other")))
    cheap = [f"{name} {p['kernels_cheapest']}" for name, p in r["programs"].items()
             if p.get("kernels_cheapest", p["kernels_per_step"]) != p["kernels_per_step"]]
    if cheap:
        lines.append("  kernels on each conditional's cheapest branch (every request greedy, no "
                     "top-k / top-p): " + ", ".join(cheap))
    chains = [f"{name} {p['target_layer_chain']:.1f} a layer + {p['outside_layer_kernels']}"
              for name, p in r["programs"].items() if p.get("target_layer_chain")]
    if chains:
        lines.append("  kernels in the target layers' chain and outside them (embedding, final "
                     "norm, LM head, sampling, bookkeeping): " + ", ".join(chains))
    for name, p in r["programs"].items():
        if p.get("drafting_head_kernels"):
            lines.append(f"  {name}: {p['drafter_layer_kernels']} kernels in the drafter's "
                         f"layers ({p['kernels_per_layer']:.1f} a layer), "
                         f"{p['drafting_head_kernels']} in its LM head, sequential head and "
                         "sampling (the by-kind line counts both)")
    if r.get("round_over_plain_step_projected"):
        lines.append(f"  projected round / plain step: {r['round_over_plain_step_projected']:.2f} "
                     f"(kernel-cost model: {KERNEL_COST_S * 1e6:.0f} us a kernel, "
                     f"{ACHIEVED_BANDWIDTH_FRACTION:.0%} of the HBM bandwidth; an estimate); "
                     f"its floor, the round's floor bytes over the plain step's: "
                     f"{r['round_over_plain_step_floor']:.2f}")
    return "\n".join(lines)
