"""Drafter training-step benchmark (PERFORMANCE.md training bar).

Builds the real jitted step (online or cached target features, chunked losses, AdamW) for a
target and a DSpark drafter, times it, and prints step time, tokens/s, an MFU estimate and peak
memory.
  python -m dspark_jax.bench.train_step --target smollm2-135m-instruct --batch 4 --seq 512
The embedded default job's step (cached features, 16 anchors, dense block attention):
  python -m dspark_jax.bench.train_step --batch 8 --seq 384 --anchors 16 --features offline \
      --attn-key-chunk 0
"""

from __future__ import annotations

import argparse
import resource
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from dspark_jax.bench.common import build_target, device_name, median, print_table, save_json
from dspark_jax.models import init_draft
from dspark_jax.models.drafters.config import default_target_layer_ids
from dspark_jax.serving.cost_profile import time_call
from dspark_jax.sharding import make_mesh
from dspark_jax.train.step import (OptimConfig, build_train_step, init_train_state,
                                   make_optimizer, make_schedule, split_draft)


def peak_memory_gb() -> float:
    dev = jax.devices()[0]
    stats = getattr(dev, "memory_stats", lambda: None)()
    if stats and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB → GB (host RSS)


def run(a: argparse.Namespace) -> dict:
    target = build_target(a.target, a.dtype)
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
                           attn_kernel=not a.no_attn_kernel)
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
    batch = jax.device_put(batch, fns.batch_sharding)
    box = {"state": state}

    def step():
        box["state"], m = fns.train(box["state"], frozen, target.state, batch)
        return m["loss"]

    times = time_call(step, repeats=a.repeats, warmup=1)
    t = median(times)
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
            "peak_memory_gb": peak_memory_gb()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (`bench.suite`'s presets and the GPU check pass theirs)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", help="compute dtype (master weights fp32)")
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
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


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
    ], "draft training step benchmark")
    return r


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
