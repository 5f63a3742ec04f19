"""Ahead-of-time compilation of one serving round for a TPU topology (`python -m dspark_jax.aot
--decode`, `aot/command.py`).

A round of the serving engine (paper §3.2.2, §5.2–5.3; SPEC §8–9;
`decoding/speculative_round.py`) is compiled as the engine runs it — `speculative_rounds`, whole
rounds in one call (`round_call`, at the one capacity bucket K) — and as its two parts: the
drafter's draft step (`draft_and_schedule`: γ proposals and the scheduler's lengths for every
request slot) and the verification step (`verify_and_commit`: the target's ragged forward over
a capacity bucket of K flattened tokens, `models.decoder.ragged_forward`, the lossless
verification and the commit into both caches). All three are compiled here for R request
slots, a context of `max_len` tokens per slot and one capacity bucket K, with the target, the
drafter and the caches built abstractly and laid on the topology's mesh (weights over fsdp ×
tensor, request slots over data × fsdp, KV heads over tensor). So are the other programs the
engine runs on the same weights and caches: its largest prefill call (`prefill_prompts`:
prompts as long as the cache, as many as one call takes, `EngineSettings.prefill_tokens`,
`prefill_call`) and, for a scheduler that may skip drafting (`adaptive`), the rounds that
verify the anchors alone (`anchor_rounds`, `anchor_call`). The report has the training
report's keys, per program and for the whole (the largest peak of the programs; the FLOPs and
time bounds are the round's two parts').

Bounds: the FLOPs bound is matmul FLOPs / (chips × bf16 peak); decoding is usually
memory-bound, so the report also gives the HBM-traffic bound (every argument byte, i.e. the
weights and the caches, read once per program / the chip's HBM bandwidth) and takes the larger.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

from dspark_jax.aot.memory import fmt_bytes, memory_and_kernels
from dspark_jax.aot.shapes import mesh_and_configs, target_hf_dict
from dspark_jax.aot.devices import slice_devices
from dspark_jax.aot.topology import AotError, libtpu_version


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """Request slots R, context tokens per slot S_max, the capacity bucket K, the draft
    trees' node budget N (0: the chain of γ drafts) and their most children a node (0: the
    engine's default, `decoding.tree.DEFAULT_BRANCHING`)."""

    requests: int
    max_len: int
    capacity: int
    tree_budget: int = 0
    tree_branching: int = 0

    def per_request(self, gamma: int) -> int:
        """Tokens a request verifies besides its anchor: γ drafts or N tree nodes."""
        return self.tree_budget or gamma

    def check(self, gamma: int) -> None:
        if self.requests < 1:
            raise AotError(f"--requests must be ≥ 1, got {self.requests}")
        if self.max_len < gamma + 2:
            raise AotError(f"--max-len {self.max_len} cannot hold a round of γ={gamma} drafts")
        if self.tree_branching < 0:
            raise AotError(f"--tree-branching must be ≥ 1 (0: the default), got "
                           f"{self.tree_branching}")
        if self.tree_budget and self.tree_budget < gamma:
            raise AotError(f"--tree-budget {self.tree_budget} is below the block's {gamma} "
                           "drafts")
        top = self.requests * (self.per_request(gamma) + 1)
        if not self.requests <= self.capacity <= top:
            raise AotError(f"--capacity {self.capacity} must be between --requests "
                           f"{self.requests} (one anchor per slot) and R·(γ+1) (trees: "
                           f"R·(N+1)) = {top}")


def decode_mesh_shape(num_chips: int, num_kv_heads: int) -> dict[str, int]:
    """Default serving mesh: tensor parallel over the KV heads (the largest divisor of both
    the chip count and the head count), fsdp over the remaining chips, data 1."""
    tensor = max(t for t in range(1, num_kv_heads + 1)
                 if num_kv_heads % t == 0 and num_chips % t == 0)
    return {"data": 1, "fsdp": num_chips // tensor, "tensor": tensor}


@dataclasses.dataclass
class AbstractRound:
    """The two jitted programs of a round, with static arguments bound, and their inputs."""

    draft_fn: Any            # (args) → outputs, for the FLOPs count
    draft_lower: Any         # (args) → jax.stages.Lowered
    draft_args: tuple
    verify_fn: Any
    verify_lower: Any
    verify_args: tuple
    round_fn: Any            # the fused call the engine runs (`speculative_rounds`, bucket K)
    round_lower: Any
    round_args: tuple
    prefill_fn: Any          # the engine's largest prefill call (`prefill_prompts`)
    prefill_lower: Any
    prefill_args: tuple
    anchor_fn: Any           # rounds that skip drafting (`anchor_rounds`); None: never run
    anchor_lower: Any
    anchor_args: tuple
    mesh: Any
    scheduler: str
    gamma: int
    shape: DecodeShape
    layer_buffers: bool = False   # the layout compiled: one buffer per layer, or the stack
    param_bytes: dict[str, int] = dataclasses.field(default_factory=dict)   # target, draft


def decoding_layouts(t_gd: Any, t_state: Any, d_gd: Any, d_state: Any, fuse: bool = True
                     ) -> tuple[Any, Any, Any, Any]:
    """The target and the drafter in the serving engine's decoding layout (one buffer per
    layer: `models.decoder.with_layer_buffers`, `drafters.dspark.with_layer_buffers`), built
    abstractly from abstract states; `fuse=False` for a tensor-parallel mesh."""
    import jax

    from dspark_jax.models.decoder import with_layer_buffers
    from dspark_jax.models.drafters.dspark import with_layer_buffers as draft_layer_buffers

    out = {}

    def target(st: Any) -> Any:
        out["t"], s2 = with_layer_buffers(t_gd, st, fuse)
        return s2

    def draft(st: Any) -> Any:
        out["d"], s2 = draft_layer_buffers(d_gd, st, fuse)
        return s2

    t_state = jax.eval_shape(target, t_state)
    d_state = jax.eval_shape(draft, d_state)
    return out["t"], t_state, out["d"], d_state


def _abstract_models(c: Any, mesh: Any, t_cfg: Any, d_cfg: Any, layer_buffers: bool
                     ) -> tuple[Any, Any, bool, dict[str, int]]:
    """The target and the drafter of config `c`, built abstractly in the engine's decoding
    layout on an accelerator (one buffer per layer, `layer_buffers`, which every family has:
    `Target.decoding_layout`) → (`Target`, `Draft`, whether the layout is per-layer, the
    stored parameter bytes of each)."""
    import jax
    from flax import nnx

    from dspark_jax.models.decoder import TargetDecoder
    from dspark_jax.models.drafters.draft import Draft, create_draft_module
    from dspark_jax.models.target import Target, resolve_dtype

    dtype = resolve_dtype(c.train.target_dtype)       # serving: bf16 weights and caches
    target = nnx.eval_shape(lambda: TargetDecoder(t_cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                  param_dtype=dtype))
    t_gd, t_state = nnx.split(target)
    d_gd, d_state = nnx.split(nnx.eval_shape(
        lambda: create_draft_module(d_cfg, c.seed, dtype, dtype)))
    layer_buffers = layer_buffers and Target(config=t_cfg, graphdef=t_gd,
                                             state=t_state).supports_layer_buffers
    param_bytes = {name: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(st))
                   for name, st in (("target", t_state), ("draft", d_state))}
    if layer_buffers:   # fused q/k/v and gate/up buffers unless the heads split over chips
        t_gd, t_state, d_gd, d_state = decoding_layouts(
            t_gd, t_state, d_gd, d_state, fuse=int(mesh.shape.get("tensor", 1)) == 1)
    return (Target(config=t_cfg, graphdef=t_gd, state=t_state),
            Draft(config=d_cfg, graphdef=d_gd, state=d_state), layer_buffers, param_bytes)


def _abstract_spec(settings: Any, target: Any, draft: Any, layer_buffers: bool,
                   mesh: Any) -> Any:
    """The engine's spec (`serving.engine_spec.engine_spec`, the function the engine builds
    its own with) built abstractly under `jax.eval_shape`, laid on `mesh`: the weights over
    fsdp × tensor, the drafter's vocabulary rows replicated, the small arrays by `_slot_rule`."""
    import dataclasses as dc

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from dspark_jax.serving.engine_spec import engine_spec
    from dspark_jax.sharding import abstract_on_mesh

    t_abs, d_abs = abstract_on_mesh(target.state, mesh), abstract_on_mesh(draft.state, mesh)
    # the drafter's embedding and LM head are the target's, as the engine holds them
    d_abs = dc.replace(draft, state=d_abs).sharing_tables_with(
        dc.replace(target, state=t_abs)).state
    spec = jax.eval_shape(lambda t, d: engine_spec(
        settings, dc.replace(target, state=t), dc.replace(draft, state=d),
        layer_buffers=layer_buffers, default_stops=target.config.stop_token_ids), t_abs, d_abs)
    replicated = NamedSharding(mesh, PartitionSpec())
    small = _slot_rule(mesh, settings.max_requests)
    arrays = small(spec.arrays.replace(target_state=None, draft_state=None, vocab_weights=None))
    return spec.replace(arrays=arrays.replace(
        target_state=t_abs, draft_state=d_abs, vocab_weights=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
            spec.arrays.vocab_weights)))


def _slot_rule(mesh: Any, num_slots: int) -> Any:
    """tree → the same tree of abstract arrays, those of R rows ([R, …]) laid like the caches'
    slots, the others replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from dspark_jax.decoding.placement import slot_sharding

    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x: Any) -> Any:
        sharding = (slot_sharding(x, mesh) if x.shape and x.shape[0] == num_slots
                    else replicated)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return lambda tree: jax.tree.map(one, tree)


def build_abstract_round(c: Any, devices: Sequence[Any], shape: DecodeShape,
                         layer_buffers: bool = False) -> AbstractRound:
    """The round programs of config `c` for `devices`, as the engine builds them: the spec is
    the engine's (`_abstract_spec`) for the settings the shape names, with the scheduler the
    engine takes for the drafter's kind (trees: `fixed`) and the round config compiled with
    bucket K alone, and the state, slot settings and schedule come from its factories."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.decoding import speculative_round as R_
    from dspark_jax.decoding.placement import prefill_call_tokens, slot_sharding
    from dspark_jax.decoding.prefill_plan import pow2_rows, prefill_length, rows_within
    from dspark_jax.decoding.tree import DEFAULT_BRANCHING
    from dspark_jax.models.drafters.kind import drafter_kind
    from dspark_jax.serving.modes import Fixed, scheduler_mode
    from dspark_jax.serving.settings import EngineSettings

    mesh, t_cfg, d_cfg = mesh_and_configs(c, devices)
    gamma = int(d_cfg.num_drafts)
    if shape.capacity == 0:     # the top bucket: every slot verifies all γ drafts (N nodes)
        shape = dataclasses.replace(
            shape, capacity=shape.requests * (shape.per_request(gamma) + 1))
    if not shape.tree_branching:
        shape = dataclasses.replace(shape, tree_branching=DEFAULT_BRANCHING)
    shape.check(gamma)
    R, S, K, V = shape.requests, shape.max_len, shape.capacity, t_cfg.vocab_size
    target, draft, layer_buffers, param_bytes = _abstract_models(c, mesh, t_cfg, d_cfg,
                                                                 layer_buffers)
    # the engine's scheduler for the drafter's kind (DSpark: the load-aware `adaptive`)
    mode = Fixed() if shape.tree_budget else scheduler_mode(
        drafter_kind(d_cfg.model_type).default_scheduler)
    settings = EngineSettings(
        max_requests=R, max_len=S, scheduler=mode, capacity_buckets=(K,),
        tree_budget=shape.tree_budget, tree_branching=shape.tree_branching,
        layer_buffers=layer_buffers,
        confidence_temperatures=(1.0,) * gamma if mode.needs_confidence else None).validate()
    try:   # what the engine refuses to serve, refused here with its words
        settings.check_models(target, draft)
    except ValueError as e:
        raise AotError(str(e)) from None
    spec = _abstract_spec(settings, target, draft, layer_buffers, mesh)
    small = _slot_rule(mesh, R)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=slot_sharding(x, mesh)),
                         jax.eval_shape(lambda: spec.fresh_state(S)))
    params = small(jax.eval_shape(lambda: spec.empty_slots().to_device()))
    config = spec.config_through(spec.buckets.index(K) + 1)   # the rounds of bucket K alone
    policy = spec.mode.new_policy(spec.policy_inputs())
    schedule = small(jax.eval_shape(lambda: spec.schedule_state(*policy.device_schedule(K))))
    arrays, scalar = spec.arrays, jax.ShapeDtypeStruct((), jnp.int32)
    draft_args = (arrays, state, params, small(scalar))
    verify_args = (arrays, state, params, small(jax.ShapeDtypeStruct((R, gamma), jnp.int32)),
                   small(jax.ShapeDtypeStruct((R, gamma, V), jnp.float32)),
                   small(jax.ShapeDtypeStruct((R,), jnp.int32)))
    round_args = (arrays, state, params, schedule, small(scalar), small(scalar))
    # the engine's largest prefill call (`run_loop._prefill`): prompts as long as the cache, as
    # many as join at once within `prefill_tokens` a slot shard, in `prefill_chunk` chunks
    width = prefill_length(S, settings.len_bucket, settings.prefill_chunk, S)
    rows = pow2_rows(rows_within(R, width, prefill_call_tokens(settings.prefill_tokens, mesh)))
    prefill_args = (arrays, state, params, small(jax.ShapeDtypeStruct((rows, width), jnp.int32)),
                    *(small(jax.ShapeDtypeStruct((rows,), jnp.int32)),) * 2)
    chunk = min(width, settings.prefill_chunk)
    # the modes that price drafting run plain stretches: the anchors alone, one per slot
    anchor = (functools.partial(R_.anchor_rounds, config, capacity=R)
              if mode.prices_drafting else None)
    return AbstractRound(
        draft_fn=functools.partial(R_.draft_and_schedule, config),
        draft_lower=functools.partial(R_.draft_and_schedule.lower, config),
        draft_args=draft_args,
        verify_fn=functools.partial(R_.verify_and_commit, config, capacity=K),
        verify_lower=functools.partial(R_.verify_and_commit.lower, config, capacity=K),
        verify_args=verify_args, round_fn=functools.partial(R_.speculative_rounds, config),
        round_lower=functools.partial(R_.speculative_rounds.lower, config),
        round_args=round_args,
        prefill_fn=functools.partial(R_.prefill_prompts, config, chunk=chunk),
        prefill_lower=functools.partial(R_.prefill_prompts.lower, config, chunk=chunk),
        prefill_args=prefill_args, anchor_fn=anchor,
        anchor_lower=anchor and functools.partial(R_.anchor_rounds.lower, config, capacity=R),
        anchor_args=(arrays, state, params, small(scalar), small(scalar)),
        mesh=mesh, scheduler=mode.name, gamma=gamma, shape=shape,
        layer_buffers=layer_buffers, param_bytes=param_bytes)


def resident_bytes(args: tuple) -> dict[str, int]:
    """The bytes of a decoding program's arguments that stay resident between calls, in all
    and per chip (each abstract argument's shard shape): the target's weights, the drafter's
    (less the tables it holds of the target's, `Draft.sharing_tables_with`: those are
    `draft_shared_bytes`), the drafter's vocabulary rows (`draft_adapters.vocab_weights`,
    gathered once) and the KV caches (target and drafter)."""
    import math

    import jax

    from dspark_jax.decoding.round_types import EngineArrays

    arrays = next(a for a in args if isinstance(a, EngineArrays))
    state = args[list(args).index(arrays) + 1]
    held = {id(x) for x in jax.tree.leaves(arrays.target_state)}

    def nbytes(x: Any, per_chip: bool) -> int:
        shape = (x.sharding.shard_shape(x.shape) if per_chip and getattr(x, "sharding", None)
                 else x.shape)
        return math.prod(shape) * x.dtype.itemsize

    def size(tree: Any, per_chip: bool) -> int:   # the target's tables counted with it alone
        mine = tree is arrays.target_state
        return sum(nbytes(x, per_chip) for x in jax.tree.leaves(tree)
                   if mine or id(x) not in held)

    parts = {"target_weights": arrays.target_state, "draft_weights": arrays.draft_state,
             "draft_vocab_rows": arrays.vocab_weights,
             "kv_cache": (state.cache, state.draft_cache)}
    out = {f"{k}_bytes": size(v, False) for k, v in parts.items()}
    out["draft_shared_bytes"] = sum(nbytes(x, False) for x in jax.tree.leaves(arrays.draft_state)
                                    if id(x) in held)
    out |= {f"{k}_bytes_per_chip": size(v, True) for k, v in parts.items()}
    out["weights_bytes_per_chip"] = sum(out[f"{k}_bytes_per_chip"] for k in
                                        ("target_weights", "draft_weights", "draft_vocab_rows"))
    return out


def _program_report(fn: Any, lower: Any, args: tuple, mesh: Any, n: int, chip: Any
                    ) -> dict[str, Any]:
    from dspark_jax.jaxpr_flops import matmul_flops
    from dspark_jax.sharding import use_mesh

    t0 = time.perf_counter()
    platform = mesh.devices.flat[0].platform
    with use_mesh(mesh):
        mem = memory_and_kernels(lower(*args), via_dump=platform == "tpu")
        flops = matmul_flops(fn, *args, platform={"gpu": "cuda"}.get(platform, platform))
    peak = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"]
    flops_s = flops / (n * chip.peak_bf16_flops)
    traffic_s = mem["argument"] / chip.hbm_bytes_per_s
    return resident_bytes(args) | {"argument_bytes_per_chip": int(mem["argument"]),
            "output_bytes_per_chip": int(mem["output"]), "alias_bytes_per_chip": int(mem["alias"]),
            "temp_bytes_per_chip": int(mem["temp"]),
            "generated_code_bytes_per_chip": int(mem["generated_code"]),
            "peak_bytes_per_chip": int(peak), "fits": bool(peak <= chip.hbm_bytes),
            "flops_per_step": int(flops), "flops_bound_s": flops_s,
            "hbm_traffic_bound_s": traffic_s, "step_time_lower_bound_s": max(flops_s, traffic_s),
            "pallas_kernels": mem["pallas_kernels"], "kernel_gathers": mem["kernel_gathers"],
            "compile_error": mem.get("error", ""),
            "compile_s": round(time.perf_counter() - t0, 1)}


def decode_report(c: Any, topology: str, shape: DecodeShape, num_slices: int = 1, *,
                  default_mesh: bool = True, layer_buffers: bool = True,
                  programs: Sequence[str] | None = None) -> dict[str, Any]:
    """Compiles the programs the engine runs for config `c` on `topology` → report: the round,
    and those of `OPTIONAL_PROGRAMS` that `programs` names (None: all of them; the peak, the
    time bound and the FLOPs are then of the ones compiled).
    `default_mesh`: the serving mesh of `decode_mesh_shape` (else the config's mesh.*).
    `layer_buffers`: the engine's layout on accelerators, one buffer per layer (False: the
    stacked layers, to compare)."""
    import jax

    wanted = set(OPTIONAL_PROGRAMS if programs is None else programs) - {"round"}
    if wanted - set(OPTIONAL_PROGRAMS):
        raise AotError(f"unknown program {sorted(wanted - set(OPTIONAL_PROGRAMS))[0]!r}; choose "
                       f"from {['round', *OPTIONAL_PROGRAMS]} (the round always compiles)")
    devices, chip = slice_devices(topology, num_slices)
    if default_mesh:
        kv_heads = int(target_hf_dict(c)["num_key_value_heads"])
        for k, v in decode_mesh_shape(len(devices), kv_heads).items():
            c.mesh[k] = v
    rnd = build_abstract_round(c, devices, shape, layer_buffers=layer_buffers)
    shape = rnd.shape
    n = len(devices)

    def report(fn: Any, lower: Any, args: tuple) -> dict[str, Any]:
        return _program_report(fn, lower, args, rnd.mesh, n, chip)

    fused = report(rnd.round_fn, rnd.round_lower, rnd.round_args)
    parts = {"draft_step": report(rnd.draft_fn, rnd.draft_lower, rnd.draft_args)
             if "draft" in wanted else None}
    # a tree's verification runs only inside the round (the separate step verifies chains)
    parts["verify_step"] = (fused if shape.tree_budget and "verify" in wanted else
                            report(rnd.verify_fn, rnd.verify_lower, rnd.verify_args)
                            if "verify" in wanted else None)
    # what else the engine runs on the same weights and caches: the joins' prefill, and the
    # plain stretches of a scheduler that may skip drafting
    parts["prefill_call"] = (report(rnd.prefill_fn, rnd.prefill_lower, rnd.prefill_args)
                             if "prefill" in wanted else None)
    parts["anchor_call"] = (report(rnd.anchor_fn, rnd.anchor_lower, rnd.anchor_args)
                            if rnd.anchor_fn and "anchor" in wanted else None)
    others = {k: v for k, v in parts.items() if v is not None}
    draft, verify = others.get("draft_step"), others.get("verify_step")
    peak = max(p["peak_bytes_per_chip"] for p in (fused, *others.values()))
    # one round: the draft and verification steps where both were compiled, else the round
    split = draft is not None and verify is not None and not shape.tree_budget
    bound = (draft["step_time_lower_bound_s"] + verify["step_time_lower_bound_s"] if split
             else fused["step_time_lower_bound_s"])
    flops = (draft["flops_per_step"] + verify["flops_per_step"] if split
             else fused["flops_per_step"])
    return {
        "mode": "decode", "config": c.name, "topology": topology, "num_slices": num_slices,
        "num_chips": n, "chip": chip.name, "mesh": dict(rnd.mesh.shape),
        "requests": shape.requests, "max_len": shape.max_len, "capacity": shape.capacity,
        "gamma": rnd.gamma, "scheduler": rnd.scheduler, "tree_budget": shape.tree_budget,
        "tree_branching": rnd.shape.tree_branching,
        "layout": "per-layer" if rnd.layer_buffers else "stacked",
        "target_param_bytes": rnd.param_bytes["target"],
        "draft_param_bytes": rnd.param_bytes["draft"],
        "hbm_bytes_per_chip": chip.hbm_bytes, "hbm_bytes_per_s_per_chip": chip.hbm_bytes_per_s,
        "peak_bytes_per_chip": int(peak), "headroom_bytes_per_chip": int(chip.hbm_bytes - peak),
        "fits": bool(peak <= chip.hbm_bytes),
        "flops_per_step": flops,
        "peak_flops_per_chip": chip.peak_bf16_flops, "step_time_lower_bound_s": bound,
        "tokens_per_s_upper_bound": shape.capacity / bound if bound else 0.0,
        "round_call": fused, **others,
        "prefill_rows": rnd.prefill_args[3].shape[0],
        "prefill_tokens": rnd.prefill_args[3].shape[1],
        "compile_error": next((p["compile_error"] for p in (fused, *others.values())
                               if p["compile_error"]), ""),
        "jax": jax.__version__,
        "libtpu": libtpu_version() if devices[0].platform == "tpu" else "",
    }


# the programs a topology's report holds, in the order it prints them
PROGRAM_KEYS = ("draft_step", "verify_step", "round_call", "anchor_call", "prefill_call")
# the programs besides the round a topology's report may leave out (`--programs`)
OPTIONAL_PROGRAMS = ("draft", "verify", "anchor", "prefill")


def format_decode_report(r: dict[str, Any]) -> str:
    g = fmt_bytes

    lines = [f"{r['config']} serving round on {r['topology']}: {r['num_chips']} {r['chip']} "
             f"chips, mesh {r['mesh']}, {r['requests']} request slots × {r['max_len']} tokens, "
             f"capacity bucket {r['capacity']}, scheduler {r['scheduler']}, "
             f"{r.get('layout', 'stacked')} layers",
             f"  {'per chip':14s}{'weights':>12s}{'KV cache':>12s}{'argument':>12s}"
             f"{'temp':>12s}{'peak':>12s}  {'GFLOPs':>10s}  FLOPs-bound   HBM-bound"]
    for name in PROGRAM_KEYS:
        if name not in r:
            continue
        p = r[name]
        lines.append(f"  {name:14s}{g(p['weights_bytes_per_chip'])}"
                     f"{g(p['kv_cache_bytes_per_chip'])}{g(p['argument_bytes_per_chip'])}"
                     f"{g(p['temp_bytes_per_chip'])}"
                     f"{g(p['peak_bytes_per_chip'])}  {p['flops_per_step'] / 1e9:10.1f}  "
                     f"{p['flops_bound_s'] * 1e3:8.3f} ms {p['hbm_traffic_bound_s'] * 1e3:8.3f} ms")
    notes = ([f"prefill_call: {r['prefill_rows']} prompts × {r['prefill_tokens']} tokens, the "
              "engine's largest prefill call"] if "prefill_call" in r else []) + (
        ["anchor_call: the rounds that skip drafting"] if "anchor_call" in r else [])
    if notes:
        lines.append("  " + "; ".join(notes))
    lines.append(f"  peak (the largest program's) {g(r['peak_bytes_per_chip']).strip()} of "
                 f"{g(r['hbm_bytes_per_chip']).strip()} HBM → "
                 + ("fits" if r["fits"] else "DOES NOT FIT")
                 + f", headroom {g(r['headroom_bytes_per_chip']).strip()}; round ≥ "
                 f"{r['step_time_lower_bound_s'] * 1e3:.3f} ms (≤ "
                 f"{r['tokens_per_s_upper_bound']:.0f} verified tokens/s)")
    kernels = {name: r[name]["pallas_kernels"] for name in PROGRAM_KEYS if name in r}
    gathers = sum(len(r[name]["kernel_gathers"]) for name in kernels)
    lines.append("  Pallas kernels: " + ", ".join(f"{k} {v}" for k, v in kernels.items())
                 + ("; none fed by a collective" if not gathers
                    else f"; {gathers} operands gathered in front of one"))
    return "\n".join(lines)

