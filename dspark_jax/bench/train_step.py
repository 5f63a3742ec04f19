"""Drafter training-step benchmark (../shared/docs/PERFORMANCE.md training bar).

Builds the real jitted step (online or cached target features, chunked losses, AdamW) for a
target and a DSpark drafter, times it, and prints step time, tokens/s, an MFU estimate and peak
memory.
  python -m dspark_jax.bench.train_step --target smollm2-135m-instruct --batch 4 --seq 512
The embedded default job's step (cached features, 16 anchors, dense block attention):
  python -m dspark_jax.bench.train_step --batch 8 --seq 384 --anchors 16 --features offline \
      --attn-key-chunk 0
`--config FILE` takes the step's shape from a training config instead (the flags given still
win; a config without a target, configs/tiny.py, gets `--target tiny`, a random 4-layer Qwen3
of the tests' tiny size):
  python -m dspark_jax.bench.train_step --config configs/smollm2_dspark.py

`--checkpoint` adds the checkpointing row: the training loop's step (next batch from a
grain iterator, the jitted step, blocked on its result) with an asynchronous save of the full
train state and the data iterator in flight, `TrainCheckpointer.save(step, state, data_iter)`
with async_save=True as `train_stage.train_loop` calls it, against the same step without one.
Each of `--saves` rounds times `--plain-steps` plain steps, starts a save, then times every step
that starts before the save commits; it reports the median of each, their ratio (bar: ≤ 1.1×),
the time `save()` blocks the loop, and the save's wall time until committed (one untimed save
first: Orbax's first save sets up its handlers).
  python -m dspark_jax.bench.train_step --config configs/tiny.py --checkpoint
  python -m dspark_jax.bench.train_step --config configs/smollm2_dspark.py --checkpoint
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from dspark_jax.bench.common import build_target, device_name, median, print_table, save_json
from dspark_jax.models import init_draft
from dspark_jax.models.config import DecoderConfig, RopeConfig
from dspark_jax.models.drafters.config import default_target_layer_ids
from dspark_jax.serving.cost_profile import time_call
from dspark_jax.sharding import make_mesh
from dspark_jax.train.step import (OptimConfig, build_train_step, init_train_state,
                                   make_optimizer, make_schedule, split_draft)


# `--target tiny`: the tests' tiny random target (tests/hf_tiny.py: qwen3, head_dim 16, 4 layers)
TINY_TARGET = DecoderConfig(family="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
                            qk_norm=True, max_position_embeddings=256, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0)


def make_target(name: str, dtype: str):
    if name != "tiny":
        return build_target(name, dtype)
    from dspark_jax.models.decoder import create_target
    from dspark_jax.models.target import Target, resolve_dtype

    dt = resolve_dtype(dtype)
    graphdef, state = nnx.split(create_target(TINY_TARGET, 0, dt, dt))
    return Target(config=TINY_TARGET, graphdef=graphdef, state=state, name="tiny")


def peak_memory_gb() -> float:
    dev = jax.devices()[0]
    stats = getattr(dev, "memory_stats", lambda: None)()
    if stats and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB → GB (host RSS)


def run(a: argparse.Namespace) -> dict:
    target = make_target(a.target, a.dtype)
    cfg = target.config
    draft = init_draft(target, dict(
        block_size=a.gamma, num_draft_layers=a.draft_layers, num_anchors=a.anchors,
        target_layer_ids=default_target_layer_ids(cfg.num_hidden_layers),
        mask_token_id=cfg.vocab_size - 1, markov_rank=a.rank,
        # timing only needs K ids: the lowest ones (a real run chooses them from its data)
        draft_vocab_size=a.draft_vocab, draft_vocab=tuple(range(a.draft_vocab))),
        seed=0, dtype=a.dtype, param_dtype="float32")
    gd, params, frozen = split_draft(draft.model)
    oc = OptimConfig(total_steps=1000)
    tx = make_optimizer(oc)
    mesh = make_mesh()
    state, sh = init_train_state(params, tx, 0, mesh)
    online = a.features == "online"
    fns = build_train_step(gd, draft.config, tx, make_schedule(oc),
                           target_graphdef=target.graphdef if online else None, mesh=mesh,
                           state_sh=sh, frozen=frozen, target_state=target.state,
                           micro_batches=a.micro_batches, anchor_chunk=a.anchor_chunk,
                           attn_key_chunk=a.attn_key_chunk or None, remat=not a.no_remat,
                           attn_kernel=not a.no_attn_kernel, precision=a.precision)
    B, S = a.batch, a.seq
    rng = np.random.RandomState(0)
    batch = dict(input_ids=rng.randint(0, cfg.vocab_size - 1, (B, S)).astype(np.int32),
                 loss_mask=np.ones((B, S), np.int32),
                 positions=np.tile(np.arange(S, dtype=np.int32), (B, 1)),
                 segment_ids=np.ones((B, S), np.int32))
    if not online:  # what the feature cache stores: the taps and the final hidden state
        out = jax.jit(lambda st, ids: nnx.merge(target.graphdef, st)(
            ids, tap_layer_ids=draft.config.target_layer_ids))(target.state, batch["input_ids"])
        batch["features"], batch["target_hidden"] = np.asarray(out.taps), np.asarray(out.hidden)
    host_batch = batch
    batch = jax.device_put(batch, fns.batch_sharding)
    box = {"state": state}

    def step():
        box["state"], m = fns.train(box["state"], frozen, target.state, batch)
        return m["loss"]

    times = time_call(step, repeats=a.repeats, warmup=1)
    t = median(times)
    ckpt_row = (checkpoint_row(a, target, draft, box, frozen, fns, host_batch)
                if a.checkpoint else {})
    n_train = sum(x.size for x in jax.tree.leaves(params))
    n_target = cfg.num_params()
    anchor_tokens = B * min(a.anchors, S) * a.gamma
    flops = 6 * n_train * anchor_tokens + 2 * n_target * B * S
    if not online:
        flops -= 2 * n_target * B * S
    return {"target": a.target, "device": device_name(), "dtype": a.dtype, "batch": B, "seq": S,
            "features": a.features, "attn_key_chunk": a.attn_key_chunk, "remat": not a.no_remat,
            "attn_kernel": not a.no_attn_kernel,
            "draft_layers": a.draft_layers, "anchors": a.anchors, "gamma": a.gamma,
            "draft_vocab": a.draft_vocab or cfg.vocab_size,
            "trainable_params_m": n_train / 1e6, "step_s": t, "tokens_per_s": B * S / t,
            "tflops_per_s": flops / t / 1e12,
            "mfu": flops / t / (a.peak_tflops * 1e12) if a.peak_tflops else None,
            "peak_memory_gb": peak_memory_gb(), "config": a.config, **ckpt_row}


class _CommitWatch:
    """Notes when the manager's save in flight has committed (polls from a thread, so the
    save's wall time does not depend on how long the training steps are)."""

    def __init__(self, manager: Any, t0: float, poll_s: float = 0.002):
        self.manager, self.t0, self.poll_s = manager, t0, poll_s
        self.committed_at: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.manager.is_saving_in_progress():
            time.sleep(self.poll_s)
        self.committed_at = time.perf_counter()

    @property
    def in_flight(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> float:
        self._thread.join()
        return self.committed_at - self.t0


def checkpoint_row(a: argparse.Namespace, target: Any, draft: Any, box: dict, frozen: Any,
                   fns: Any, host_batch: dict) -> dict:
    """The checkpointing row (module docstring): plain loop steps against steps with an async
    save of the train state + grain iterator in flight."""
    from dspark_jax.data.pipeline import PipelineConfig, make_dataset, to_global_batch
    from dspark_jax.train.checkpoint import TrainCheckpointer, key_impl_name, make_meta

    B, S = a.batch, a.seq
    # the loop's data path: the step's rows as records of a shuffled, endlessly repeating stream
    records = [{k: v[i] for k, v in host_batch.items()
                if k in ("input_ids", "loss_mask", "features", "target_hidden")} for i in range(B)]
    it = iter(make_dataset(records, PipelineConfig(batch_size=B, max_length=S, shuffle=True,
                                                   seed=0, num_epochs=None)))
    meta = make_meta(a.target, target.config.to_hf_dict(), draft.config.to_dict(),
                     key_impl_name(box["state"].key), extra={"global_batch_size": B})
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=a.checkpoint_dir or None)
    ckpt = TrainCheckpointer(root, meta, keep=a.keep, every_steps=1, async_save=True)
    done = [int(jax.device_get(box["state"].step))]

    def loop_step() -> float:
        t0 = time.perf_counter()
        batch = to_global_batch(next(it), fns.batch_sharding)
        box["state"], m = fns.train(box["state"], frozen, target.state, batch)
        jax.block_until_ready((box["state"], m))
        done[0] += 1
        return time.perf_counter() - t0

    def save() -> tuple[float, float, list[float]]:
        """(save() blocking s, wall s until committed, the steps timed while in flight)."""
        t0 = time.perf_counter()
        if not ckpt.save(done[0], box["state"], it, force=True):
            raise RuntimeError(f"checkpoint step {done[0]} was not saved")
        call_s = time.perf_counter() - t0
        watch = _CommitWatch(ckpt.manager, t0)
        steps = [loop_step()]       # the loop's next step (the save may commit before it ends)
        while watch.in_flight:
            steps.append(loop_step())
        wall = watch.join()
        ckpt.wait()                 # a failed save raises here (CheckpointSaveError)
        return call_s, wall, steps

    plain: list[float] = []
    flight: list[float] = []
    calls: list[float] = []
    walls: list[float] = []
    per_save: list[int] = []
    runs: list[tuple[float, list[float]]] = []
    try:
        loop_step()                 # warm-up: the iterator's first batch
        save()                      # warm-up: Orbax's first save builds its handlers
        for _ in range(max(1, a.saves)):
            plain += [loop_step() for _ in range(max(1, a.plain_steps))]
            call_s, wall, steps = save()
            calls.append(call_s)
            walls.append(wall)
            flight += steps
            per_save.append(len(steps))
            runs.append((call_s, steps))
    finally:
        ckpt.close()
        shutil.rmtree(root, ignore_errors=True)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(box["state"])
                      if hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype,
                                                                         jax.dtypes.prng_key))
    plain_s, flight_s = median(plain), median(flight)
    # what a save costs the loop: its blocking call plus the slowdown of the steps it overlaps
    lost = median([c + sum(st) - len(st) * plain_s for c, st in runs])
    return {"ckpt_plain_step_s": plain_s, "ckpt_inflight_step_s": flight_s,
            "ckpt_ratio": flight_s / plain_s, "ckpt_save_call_s": median(calls),
            "ckpt_save_wall_s": median(walls), "ckpt_lost_per_save_s": lost,
            "ckpt_saves": len(walls),
            "ckpt_plain_steps": len(plain), "ckpt_steps_in_flight": len(flight),
            "ckpt_steps_per_save": per_save, "ckpt_state_mb": state_bytes / 1e6,
            "ckpt_dir_parent": os.path.dirname(root)}


def config_defaults(path: str) -> dict:
    """The benchmark's flags that a training config file sets (draft, batch, sequence, step)."""
    if not os.path.isfile(path):
        raise SystemExit(f"--config: file {path!r} not found")
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if root not in sys.path:          # configs import each other (`from configs.qwen3 import …`)
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location("_bench_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    d, t = c.draft, c.train
    if d.get("model_type", "dspark") != "dspark":
        raise SystemExit(f"--config {path}: a {d.model_type} drafter; this benchmark builds "
                         "DSpark drafters")
    return dict(target=c.target or "tiny", dtype=t.compute_dtype, batch=t.global_batch_size,
                seq=c.data.max_length, draft_layers=d.num_draft_layers, anchors=d.num_anchors,
                anchor_chunk=t.anchor_chunk, gamma=d.block_size, rank=d.markov_rank,
                micro_batches=t.micro_batches, draft_vocab=d.get("draft_vocab_size") or 0,
                features=c.data.features, attn_key_chunk=t.attn_key_chunk or 0,
                no_remat=not t.remat, no_attn_kernel=not t.attn_kernel, keep=c.checkpoint.keep,
                precision=t.get("precision", "fp32"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (`bench.suite`'s presets and the GPU check pass theirs)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="a training config file (configs/*.py) whose drafter, batch, sequence "
                        "and step settings become the defaults")
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="an embedded target, a Hugging Face directory, a random shape "
                        "(qwen3-4b, qwen3-8b) or `tiny` (a random 4-layer Qwen3 of width 32)")
    p.add_argument("--dtype", default="float32", help="compute dtype (master weights fp32)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="train.precision: bf16 casts the drafter and the features to bf16 for "
                        "the step (fp32 master weights), as DeepSpec trains")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--anchor-chunk", type=int, default=16)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="a pruned draft vocabulary of K ids (0: the full vocabulary)")
    p.add_argument("--features", choices=("online", "offline"), default="online",
                   help="online: the target runs inside the step; offline: cached features")
    p.add_argument("--no-remat", action="store_true",
                   help="keep activations and chunk logits for the backward pass (train.remat=False)")
    p.add_argument("--attn-key-chunk", type=int, default=512,
                   help="keys per online-softmax chunk of the block attention; 0: dense scores")
    p.add_argument("--no-attn-kernel", action="store_true",
                   help="on a GPU, XLA's chunked block attention instead of the Triton kernel "
                        "(train.attn_kernel=False)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="device peak (bf16 dense) for MFU; H200 ≈ 989")
    p.add_argument("--checkpoint", action="store_true",
                   help="add the checkpointing row: a step with an async save in flight")
    p.add_argument("--saves", type=int, default=3, help="timed saves of the checkpointing row")
    p.add_argument("--plain-steps", type=int, default=5,
                   help="plain steps timed before each save of the checkpointing row")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (checkpoint.keep)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="parent of the row's temporary checkpoint directory (default: $TMPDIR)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.config:
        p.set_defaults(**config_defaults(a.config))
        a = p.parse_args(argv)
    if a.precision == "bf16" and a.dtype not in ("bfloat16", "bf16"):
        p.error("--precision bf16 computes in bf16: pass --dtype bfloat16 too")
    return a


def checkpoint_rows(r: dict) -> list[tuple[str, str]]:
    if "ckpt_ratio" not in r:
        return []
    return [
        ("checkpoint: plain step", f"{r['ckpt_plain_step_s'] * 1e3:.1f} ms "
                                   f"(median of {r['ckpt_plain_steps']}, data + step)"),
        ("checkpoint: save in flight", f"{r['ckpt_inflight_step_s'] * 1e3:.1f} ms per step "
         f"(median of {r['ckpt_steps_in_flight']} over {r['ckpt_saves']} saves), "
         f"{r['ckpt_ratio']:.2f}× plain (bar ≤ 1.1×)"),
        ("checkpoint: save", f"{r['ckpt_state_mb']:.1f} MB state + data iterator; save() blocks "
         f"{r['ckpt_save_call_s'] * 1e3:.1f} ms, committed after "
         f"{r['ckpt_save_wall_s']:.3f} s (median)"),
        ("checkpoint: loop time lost", f"{r['ckpt_lost_per_save_s'] * 1e3:.1f} ms per save "
         "(blocking call + slowdown of the overlapped steps, median)"),
    ]


def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    r = run(a)
    save_json(r, a.json)
    print_table([
        ("target / device", f"{r['target']} / {r['device']}"),
        ("batch × seq, anchors × γ", f"{r['batch']} × {r['seq']}, {r['anchors']} × {r['gamma']}"),
        ("draft", f"{r['draft_layers']} layers, {r['trainable_params_m']:.1f}M trainable, "
                  f"vocabulary {r['draft_vocab']}"),
        ("features, block attention", f"{r['features']}, "
         + (f"key chunk {r['attn_key_chunk']}" if r["attn_key_chunk"] else "dense")
         + ("" if r.get("attn_kernel", True) else ", no attention kernel")
         + (", remat" if r["remat"] else ", no remat")),
        ("step time", f"{r['step_s'] * 1e3:.1f} ms"),
        ("tokens/s", f"{r['tokens_per_s']:.0f}"),
        ("achieved", f"{r['tflops_per_s']:.3f} TFLOP/s"
                     + (f" (MFU {100 * r['mfu']:.1f}%)" if r["mfu"] else "")),
        ("peak memory", f"{r['peak_memory_gb']:.2f} GB"),
    ] + checkpoint_rows(r), "draft training step benchmark"
        + (f" ({r['config']})" if r.get("config") else ""))
    return r


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
