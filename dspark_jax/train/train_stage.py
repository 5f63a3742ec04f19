"""Stage 2 of the training job, the training loop (SPEC §4 optimisation): the (data, fsdp,
tensor) mesh, the drafter and its train state, the jitted sharded step, the Orbax checkpointer
(automatic exact resume, grain iterator included) and metrics logging, step by step.

Between steps the loop also (run_guards.py):
- counts the steps the jitted step skipped for a non-finite loss or gradient norm
  (`nonfinite_steps` in metrics.jsonl and TensorBoard, a log line per such step with its batch
  fingerprint) and, after `train.max_nonfinite_steps` of them in a row, saves the state (the
  last good parameters: skipped steps change none) and raises `NonFiniteStepsError`;
- on SIGTERM (one process) or at JAX's pre-emption sync point (several), saves a checkpoint at
  the step just done, waits for it to commit and returns `TrainResult(preempted=True)`, after
  which the job exits with status 0; re-running the same command resumes from that step.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
from typing import Any

import ml_collections

from dspark_jax.train.job_config import UsageError, attn_kernel, attn_key_chunk


def job_mesh(c: ml_collections.ConfigDict):
    """The config's mesh (a `mesh.preset` topology applied first) with the batch checks."""
    from dspark_jax.sharding import make_mesh, select_devices

    if c.mesh.preset:
        from dspark_jax.train.config_base import apply_mesh_preset

        try:
            apply_mesh_preset(c, c.mesh.preset, _num_slices())
        except ValueError as e:
            raise UsageError(str(e)) from None
    try:
        devices = select_devices(c.mesh.num_devices)
    except ValueError as e:
        raise UsageError(f"config.mesh.num_devices: {e}") from None
    try:
        mesh = make_mesh(data=c.mesh.data, fsdp=c.mesh.fsdp, tensor=c.mesh.tensor,
                         devices=devices)
    except ValueError as e:
        raise UsageError(f"config.mesh: {e}") from None
    n_batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    gbs = c.train.global_batch_size
    if (gbs // c.train.micro_batches) % n_batch_shards:
        raise UsageError(f"config.train.global_batch_size {gbs} / micro_batches "
                         f"{c.train.micro_batches} must be divisible by the mesh's data×fsdp = "
                         f"{n_batch_shards}")
    if c.eval.batch_size % n_batch_shards:
        raise UsageError(f"config.eval.batch_size {c.eval.batch_size} must be divisible by the "
                         f"mesh's data×fsdp = {n_batch_shards}")
    return mesh


def _num_slices() -> int:
    import jax

    return len({getattr(d, "slice_index", 0) for d in jax.devices()})


def _global_tokens(local: dict, n_proc: int) -> int:
    import numpy as np

    return int((np.asarray(local["segment_ids"]) > 0).sum()) * n_proc


def global_batch_fingerprint(local: dict, process_index: int, process_count: int) -> str:
    """A hash of the GLOBAL batch (token ids and loss mask of every row, with its global row
    index) from this process's rows: a sum mod 2⁶⁴ of per-row hashes, so process partial sums
    add up to the same value whatever the number of processes (1 × 4 devices ≡ 2 × 2)."""
    import hashlib

    import numpy as np

    ids, mask = np.asarray(local["input_ids"]), np.asarray(local["loss_mask"])
    rows = ids.shape[0]
    part = 0
    for r in range(rows):
        h = hashlib.blake2b(digest_size=8)
        h.update(str(process_index * rows + r).encode())
        h.update(np.ascontiguousarray(ids[r]).tobytes())
        h.update(np.ascontiguousarray(mask[r]).tobytes())
        part = (part + int.from_bytes(h.digest(), "little")) % 2 ** 64
    if process_count > 1:
        from jax.experimental import multihost_utils

        chunks = np.array([(part >> (16 * i)) & 0xFFFF for i in range(4)], np.int32)
        every = np.asarray(multihost_utils.process_allgather(chunks)).reshape(process_count, 4)
        part = sum(sum(int(c) << (16 * i) for i, c in enumerate(p)) for p in every) % 2 ** 64
    return f"{part:016x}"


def schedule_length(c: ml_collections.ConfigDict, data: Any) -> tuple[Any, int, int]:
    """(pipeline config, steps per epoch, total steps) of the training data."""
    from dspark_jax.data.pipeline import PipelineConfig, record_lengths, steps_per_epoch

    gbs = c.train.global_batch_size
    pc = PipelineConfig(batch_size=gbs, max_length=c.data.max_length, pack=c.data.pack,
                        shuffle=True, seed=c.data.data_seed, num_epochs=None, drop_remainder=True,
                        order=c.data.order, micro_batches=c.train.micro_batches,
                        pad_to=c.data.pad_to, pad_multiple=c.data.pad_multiple)
    if len(data.records) < gbs:
        raise UsageError(f"{len(data.records)} training records make no global batch of {gbs}; "
                         "lower config.train.global_batch_size or add prompts")
    spe = steps_per_epoch(len(data.records), pc,
                          lengths=record_lengths(data.source) if c.data.pack else None)
    total = c.train.max_steps if c.train.max_steps >= 0 else spe * c.train.epochs
    return pc, spe, total


def periodic_heldout_eval(c: ml_collections.ConfigDict, fns_mesh: Any, draft_cfg: Any,
                          target: Any, held_records: list) -> Any:
    """`eval.every_steps` > 0: the held-out teacher-forced evaluation the loop runs every that
    many steps (a learning curve: rows `"split": "heldout"` in metrics.jsonl); else None."""
    if c.eval.every_steps <= 0 or not held_records:
        return None
    from dspark_jax.train.eval_stage import heldout_evaluator

    return heldout_evaluator(c, fns_mesh, draft_cfg, target, held_records)


@dataclasses.dataclass
class TrainResult:
    graphdef: Any
    state: Any               # the final TrainState
    frozen: Any              # the drafter's frozen embedding / LM head
    fns: Any                 # StepFns (batch sharding for the evaluation)
    logger: Any              # MetricsLogger, still open (the evaluation logs into it)
    start: int               # the step training resumed from (0: fresh)
    resumed: bool
    ckpt_dir: pathlib.Path
    preempted: bool = False  # stopped early on SIGTERM / pre-emption, a checkpoint at `end`
    end: int = 0             # the last step trained


def train_loop(c: ml_collections.ConfigDict, target: Any, draft_cfg: Any, mesh: Any, data: Any,
               pc: Any, total: int, workdir: pathlib.Path, is_main: bool) -> TrainResult:
    import jax

    from dspark_jax.data.pipeline import (make_dataset, max_segments_per_row, record_lengths,
                                          to_global_batch)
    from dspark_jax.models import init_draft
    from dspark_jax.sharding import put_on_mesh, state_shardings
    from dspark_jax.train.checkpoint import (TrainCheckpointer, abstract_storable,
                                             key_impl_name, make_meta)
    from dspark_jax.train.metrics_log import MetricsLogger
    from dspark_jax.train.run_guards import NonFiniteGuard, PreemptionWatch
    from dspark_jax.train.step import (OptimConfig, build_train_step, init_train_state,
                                       make_optimizer, make_schedule, split_draft)

    online = c.data.features == "online"
    oc = OptimConfig(lr=c.train.lr, b1=c.train.b1, b2=c.train.b2, eps=c.train.eps,
                     weight_decay=c.train.weight_decay, clip_norm=c.train.clip_norm,
                     warmup_ratio=c.train.warmup_ratio, total_steps=max(total, 1))
    tx, schedule = make_optimizer(oc), make_schedule(oc)
    draft = init_draft(target, draft_cfg, seed=c.seed, dtype=c.train.compute_dtype,
                       param_dtype="float32", from_target=bool(c.train.init_from_target))
    graphdef, params, frozen = split_draft(draft.model)
    frozen = put_on_mesh(frozen, state_shardings(frozen, mesh))
    state, state_sh = init_train_state(params, tx, c.seed, mesh)
    target_state = target.state if online else None
    fns = build_train_step(graphdef, draft_cfg, tx, schedule,
                           target_graphdef=target.graphdef if online else None, mesh=mesh,
                           state_sh=state_sh, frozen=frozen, target_state=target_state,
                           micro_batches=c.train.micro_batches, anchor_chunk=c.train.anchor_chunk,
                           attn_key_chunk=attn_key_chunk(c), remat=bool(c.train.remat),
                           attn_kernel=attn_kernel(c), precision=c.train.precision,
                           max_segments=(max_segments_per_row(record_lengths(data.source), pc)
                                         if c.data.pack else 1))

    ckpt_dir = pathlib.Path(c.checkpoint.directory or workdir / "checkpoints")
    meta = make_meta(target.name or c.target, target.config.to_hf_dict(), draft_cfg.to_dict(),
                     key_impl_name(state.key),
                     extra={"global_batch_size": c.train.global_batch_size,
                            "data_seed": c.data.data_seed, "data_order": c.data.order,
                            "precision": c.train.precision})
    ckpt = TrainCheckpointer(ckpt_dir, meta, keep=c.checkpoint.keep,
                             every_steps=c.checkpoint.every_steps,
                             async_save=c.checkpoint.async_save,
                             compress=c.checkpoint.compress,
                             continue_on_save_error=c.checkpoint.continue_on_save_error)
    it = iter(make_dataset(data.source, pc))
    restored = ckpt.restore(abstract_storable(state, state_sh), it)
    start = 0
    counters: dict[str, int] = {}
    if restored is not None:
        state, start, counters = restored.state, restored.step, restored.counters
        for bad, why in restored.skipped:
            print(f"warning: checkpoint step {bad} skipped ({why}); moved aside as "
                  f"{ckpt_dir / str(bad)}.corrupt*", flush=True)
        print(f"resumed from {ckpt_dir / str(start)} (step {start} of {total})", flush=True)

    logger = MetricsLogger(workdir, total, start, enabled=is_main,
                           progress=c.logging.progress, tensorboard=c.logging.tensorboard,
                           jsonl=c.logging.jsonl)
    guard = NonFiniteGuard(c.train.max_nonfinite_steps,
                           total=counters.get("nonfinite_steps", 0),
                           in_a_row=counters.get("nonfinite_in_a_row", 0),
                           write=logger.write)
    watch = PreemptionWatch(ckpt.manager)
    periodic = periodic_heldout_eval(c, (mesh, fns.batch_sharding, graphdef), draft_cfg, target,
                                     data.held_records)
    n_proc = jax.process_count()
    done, preempted = start, False
    try:
        for step in range(start, total):
            local = next(it)
            fingerprint = global_batch_fingerprint(local, jax.process_index(), n_proc)
            tokens = _global_tokens(local, n_proc)
            batch = to_global_batch(local, fns.batch_sharding)
            state, metrics = fns.train(state, frozen, target_state, batch)
            done = step + 1
            guard.defer(done, metrics.pop("nonfinite"), fingerprint)
            fetch = done % c.train.log_every == 0 or done == total or step == start
            host = None
            if fetch:
                host = jax.device_get(metrics)
                guard.resolve()
                host["nonfinite_steps"] = guard.total
            logger.log(done, host, tokens=tokens, batch_hash=fingerprint)
            if periodic is not None and done % c.eval.every_steps == 0 and done < total:
                logger.log_eval(done, periodic(state.params, frozen))   # the run's end: cli.py
            if done == c.debug.sigterm_at_step:
                os.kill(os.getpid(), signal.SIGTERM)
            preempted = watch.reached(done)
            if guard.tripped or preempted or ckpt.should_save(done):
                guard.resolve()
            if guard.tripped:
                ckpt.save(done, state, it, force=True, counters=guard.counters())
                ckpt.close()
                logger.close(final=False)
                raise guard.error(str(ckpt_dir / str(ckpt.latest_step())))
            if preempted:
                break
            ckpt.save(done, state, it, counters=guard.counters())
            if done == c.debug.sigkill_at_step and c.debug.sigkill_process in (
                    -1, jax.process_index()):
                os.kill(os.getpid(), signal.SIGKILL)
        guard.resolve()
        ckpt.save(done, state, it, force=True, counters=guard.counters())
        if preempted and done == c.debug.sigterm_at_step:
            os.kill(os.getpid(), signal.SIGTERM)    # a second SIGTERM while the save is in flight
        ckpt.close()
    finally:
        watch.close()
    if preempted:
        logger.write(f"pre-empted: checkpoint {ckpt_dir / str(done)} committed after step "
                     f"{done} of {total}; run the same command again to resume")
    return TrainResult(graphdef=graphdef, state=state, frozen=frozen, fns=fns, logger=logger,
                       start=start, resumed=restored is not None, ckpt_dir=ckpt_dir,
                       preempted=preempted, end=done)
