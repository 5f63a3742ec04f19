"""The jitted, sharded drafter training step (SPEC §4 optimisation).

One `jax.jit` function with explicit in/out shardings over a (data, fsdp, tensor) mesh that
donates the train state. Only `nnx.Param` leaves are trained; the embedding and LM head copied
from the target are `FrozenParam` and live outside the gradient and the optimizer state.
Micro-batches (strided rows, so each spans every data shard) are scanned with fp32 gradient
accumulation. How the loss is normalised over them is `DraftConfig.loss_normalization` (SPEC §4):
  "deepspec" (default)  each micro-step's loss is its sums divided by its own Σw — Σw over the
                        whole micro-batch, which is DeepSpec's all-reduce of the denominators over
                        the data-parallel group — and divided by the accumulation count, so every
                        micro-batch weighs the same;
  "global"              the accumulated sums are divided by one global Σw at the end, which makes
                        the result equal to one big batch.
Target features are computed inside the step from the frozen target (online) or read from the
batch (offline cache).

`precision` (`train.precision`) is what the forward and backward pass run on; the train state
always holds fp32 master weights and fp32 Adam moments:
  "fp32" (default)      the forward reads the fp32 master weights; each drafter layer casts what
                        it multiplies to the model's compute dtype (`train.compute_dtype`);
  "bf16"                DeepSpec's BF16Optimizer recipe: every drafter parameter (trained and
                        frozen) and the target features / final hidden states are cast to
                        bfloat16 before the forward, so the forward and backward pass run on a
                        bf16 model; the gradient flows back through the cast to fp32, and the
                        accumulation over micro-batches, the clipping and AdamW run on fp32
                        against the fp32 master, which the next step casts again.

A step whose loss or gradient norm is not finite changes nothing: the new params, optimizer
state and RNG key are selected with `jnp.where` against the old ones (only `step` advances), so
the run goes on exactly as if that batch had not been there. Its metrics carry `nonfinite` = 1
(0 otherwise); the training loop counts, reports and bounds such steps (train_stage.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.drafters.dspark import FrozenParam
from dspark_jax.models.layers import flash_kernels
from dspark_jax.sharding import (abstract_on_mesh, constrain, logical_to_spec, put_on_mesh,
                                 state_shardings, use_mesh)
from dspark_jax.train.drafter_loss import LossOptions, loss_for


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """SPEC §4 defaults: AdamW(6e-4, .9, .999, 1e-8, wd 0), clip 1.0, 4% warmup, cosine to 0."""

    lr: float = 6e-4
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    warmup_ratio: float = 0.04
    total_steps: int = 1000


def make_schedule(oc: OptimConfig) -> optax.Schedule:
    """DeepSpec's learning rate at its optimizer step k (0-based), as its
    `CosineAnnealingWarmupLR` gives it under the pinned torch, W = int(warmup_ratio ·
    total_steps) warmup steps and T = total_steps − W: lr · (k + 1) / W while k < W (the first
    step already trains); then lr · (1 + cos(π (k − W) / T)) / (1 + cos(π / T)). The second
    part is torch's recursive `CosineAnnealingLR` taking over from the warmup one step early in
    its phase: step W runs a little above lr, step W + 1 at lr, and the rest follow the cosine
    scaled by the same factor (1 + cos(π/T)) / 2 ≈ 1 − 2.5/T²). W = 0: that from the first step."""
    warmup = int(oc.warmup_ratio * oc.total_steps)
    T = max(oc.total_steps - warmup, 2)
    scale = 1.0 + math.cos(math.pi / T)

    def schedule(count: jax.Array) -> jax.Array:
        ramp = oc.lr * (count + 1) / max(warmup, 1)
        t = jnp.clip(count - warmup, 0, T)
        return jnp.where(count < warmup, ramp, oc.lr * (1.0 + jnp.cos(jnp.pi * t / T)) / scale)

    return schedule


def make_optimizer(oc: OptimConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(oc.clip_norm),
        optax.adamw(make_schedule(oc), b1=oc.b1, b2=oc.b2, eps=oc.eps,
                    weight_decay=oc.weight_decay),
    )


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any        # nnx.State of trainable nnx.Param (fp32 master weights)
    opt_state: Any
    key: jax.Array


def split_draft(model: nnx.Module) -> tuple[Any, Any, Any]:
    """graphdef, trainable params, frozen params."""
    graphdef, params, frozen = nnx.split(model, nnx.Param, FrozenParam)
    return graphdef, params, frozen


def init_train_state(params: Any, tx: optax.GradientTransformation, seed: int,
                     mesh: jax.sharding.Mesh) -> tuple[TrainState, TrainState]:
    """A train state placed on the mesh (params by their logical axes, Adam moments like their
    params, scalars replicated) and the matching tree of shardings."""
    repl = NamedSharding(mesh, P())
    params = put_on_mesh(params, state_shardings(params, mesh))
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_state = jax.jit(tx.init)(params)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, opt_state, param_sh,
                                   transform_non_params=lambda _: repl)
    opt_state = put_on_mesh(opt_state, opt_sh)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                       key=jax.random.key(seed))
    state = put_on_mesh(state, TrainState(step=repl, params=param_sh, opt_state=opt_sh,
                                          key=repl))
    shardings = TrainState(step=repl, params=param_sh, opt_state=opt_sh, key=repl)
    return state, shardings


def abstract_train_state(params: Any, tx: optax.GradientTransformation,
                         mesh: jax.sharding.Mesh) -> tuple[TrainState, TrainState]:
    """The train state as jax.ShapeDtypeStructs carrying their shardings, and the shardings
    (the same layout as `init_train_state`), without allocating anything: for ahead-of-time
    compilation. `params` may itself be abstract (from `nnx.eval_shape`)."""
    repl = NamedSharding(mesh, P())
    params = abstract_on_mesh(params, mesh)
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_state = jax.eval_shape(tx.init, params)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, opt_state, param_sh,
                                   transform_non_params=lambda _: repl)
    shardings = TrainState(step=repl, params=param_sh, opt_state=opt_sh, key=repl)
    key = jax.eval_shape(lambda: jax.random.key(0))
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                       opt_state=opt_state, key=key)
    with_sh = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    return jax.tree.map(with_sh, state, shardings), shardings


BATCH_KEYS_ONLINE = ("input_ids", "loss_mask", "positions", "segment_ids")
BATCH_KEYS_OFFLINE = BATCH_KEYS_ONLINE + ("features", "target_hidden")


PRECISIONS = ("fp32", "bf16")


def check_precision(precision: str) -> None:
    """ValueError naming `train.precision` unless it is one of PRECISIONS."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision: {precision!r} is not one of {PRECISIONS}")


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Every floating-point leaf of `tree` cast to `dtype` (integer leaves unchanged)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)


def micro_batches_of(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] → [m, B/m, ...] with micro-batch i = rows i, i+m, i+2m, … (strided).

    The batch axis is sharded in contiguous row blocks over (data, fsdp); a strided micro-batch
    takes B/(m·shards) rows from every block, so each micro-step keeps the batch sharding and
    all devices work on it (contiguous row ranges would live on 1/m of the devices and force a
    reshard every micro-step). Accumulating sums makes the grouping irrelevant to the result.
    """
    return jnp.swapaxes(x.reshape((x.shape[0] // m, m) + x.shape[1:]), 0, 1)


def make_loss_sums_fn(draft_graphdef: Any, cfg: DraftConfig, target_graphdef: Any | None,
                      anchor_chunk: int, max_segments: int = 1,
                      attn_key_chunk: int | None = 512, remat: bool = True,
                      attn_kernel: bool = True, precision: str = "fp32") -> Callable:
    """(params, frozen, target_state, micro_batch, key) → sums. The objective numerator is
    `sums["objective"]` (divide by Σw = `sums["weight"]` for the loss). `max_segments`: the most
    packed sequences in a row (each gets up to num_anchors anchors). `remat`: recompute the
    drafter's layers and each anchor chunk's logits in the backward pass (memory ∝ one chunk)
    instead of keeping them (one LM-head matmul fewer per chunk: faster where memory allows).
    `attn_key_chunk`: the drafter attention's memory chunk — context keys per online-softmax
    chunk of the DSpark/DFlash block attention, query rows per chunk of the Eagle3 TTT
    attention (None: dense scores). `attn_kernel`: compiled for a GPU, the DSpark/DFlash block
    attention runs its fused Triton kernel instead of the chunks, and on a GPU or TPU the
    target's forward over training rows its flash-attention kernel (`layers.flash_kernels`).
    `precision` "bf16": the drafter's params and frozen params and the target features and
    final hidden states enter the forward in bfloat16 (module docstring); the gradient with
    respect to fp32 `params` comes back through the cast in fp32."""
    check_precision(precision)
    bf16 = precision == "bf16"
    loss = loss_for(cfg)
    opts = LossOptions(anchor_chunk=anchor_chunk, max_segments=max_segments,
                       attn_key_chunk=attn_key_chunk, remat=remat, attn_kernel=attn_kernel)

    def fn(params, frozen, target_state, mb, key):
        if bf16:
            params = cast_floating(params, jnp.bfloat16)
            frozen = cast_floating(frozen, jnp.bfloat16)
        draft = nnx.merge(draft_graphdef, params, frozen)
        if target_graphdef is not None:
            target = nnx.merge(target_graphdef, target_state)
            with flash_kernels(attn_kernel):
                out = target(mb["input_ids"], positions_bt=mb["positions"],
                             segment_ids_bt=mb["segment_ids"], tap_layer_ids=cfg.target_layer_ids)
            feats, hidden = jax.lax.stop_gradient(out.taps), jax.lax.stop_gradient(out.hidden)
        else:
            feats, hidden = mb["features"], mb["target_hidden"]
        if bf16:
            feats, hidden = feats.astype(jnp.bfloat16), hidden.astype(jnp.bfloat16)
        sums = loss.sums(draft, feats, hidden, mb, key, opts)
        sums["objective"] = loss.objective(sums, cfg)
        return sums

    return fn


def metrics_fn(cfg: DraftConfig) -> Callable:
    """sums → the logged scalars of `cfg`'s kind (`DrafterLoss.metrics`)."""
    loss = loss_for(cfg)
    return lambda sums: loss.metrics(sums, cfg)


@dataclasses.dataclass
class StepFns:
    graphdef: Any            # the drafter's graphdef (merge with params + frozen)
    train: Callable          # (state, frozen, target_state, batch) → (state, metrics)
    evaluate: Callable       # (params, frozen, target_state, batch, key) → metrics
    state_shardings: Any
    batch_sharding: Any


def build_train_step(draft_graphdef: Any, cfg: DraftConfig, tx: optax.GradientTransformation,
                     schedule: optax.Schedule, *, target_graphdef: Any | None,
                     mesh: jax.sharding.Mesh, state_sh: TrainState, frozen: Any,
                     target_state: Any | None, micro_batches: int = 1,
                     anchor_chunk: int = 64, max_segments: int = 1,
                     attn_key_chunk: int | None = 512, remat: bool = True,
                     attn_kernel: bool = True, precision: str = "fp32") -> StepFns:
    """Returns the jitted train/eval functions with explicit shardings (donating the state).
    `precision`: "fp32" or "bf16" (the module docstring); the state's params stay fp32."""
    sums_fn = make_loss_sums_fn(draft_graphdef, cfg, target_graphdef, anchor_chunk, max_segments,
                                attn_key_chunk, remat, attn_kernel, precision)
    to_metrics = metrics_fn(cfg)
    per_micro_step = cfg.loss_normalization == "deepspec"

    def train_step(state: TrainState, frozen, target_state, batch):
        key, step_key = jax.random.split(state.key)
        mbs = jax.tree.map(lambda x: constrain(micro_batches_of(x, micro_batches), (None, "batch")),
                           batch)
        keys = jax.random.split(step_key, micro_batches)

        def accumulate(carry, xs):
            grads_acc, sums_acc, loss_acc = carry
            mb, k = xs

            def objective(params):
                sums = sums_fn(params, frozen, target_state, mb, k)
                obj = sums["objective"]
                if per_micro_step:
                    denom = jnp.maximum(jax.lax.stop_gradient(sums["weight"]), 1e-6)
                    obj = obj / (denom * micro_batches)
                return obj, sums

            (obj, sums), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
            grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
            sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
            return (grads_acc, sums_acc, loss_acc + obj), None

        zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        zero_grads = jax.lax.with_sharding_constraint(zero_grads, state_sh.params)
        sums_shape = jax.eval_shape(lambda: sums_fn(state.params, frozen, target_state,
                                                    jax.tree.map(lambda x: x[0], mbs), keys[0]))
        zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
        zero_loss = jnp.zeros((), jnp.float32)
        (grads, sums, loss), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums, zero_loss),
                                              (mbs, keys))
        if not per_micro_step:
            denom = jnp.maximum(sums["weight"], 1e-6)
            grads = jax.tree.map(lambda g: g / denom, grads)
            loss = loss / denom
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep_if_finite = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o),
                                                       new, old)
        metrics = to_metrics(sums)
        metrics["loss"] = loss     # the objective this step optimised
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = schedule(state.step)
        metrics["nonfinite"] = jnp.logical_not(finite).astype(jnp.int32)
        new_state = TrainState(step=state.step + 1,
                               params=keep_if_finite(params, state.params),
                               opt_state=keep_if_finite(opt_state, state.opt_state),
                               key=jnp.where(finite, key, state.key))
        return new_state, metrics

    def eval_step(params, frozen, target_state, batch, key):
        return to_metrics(sums_fn(params, frozen, target_state, batch, key))

    param_sh = state_sh.params
    frozen_sh = state_shardings(frozen, mesh)
    target_sh = state_shardings(target_state, mesh) if target_state is not None else None
    repl = NamedSharding(mesh, P())
    batch_sh = NamedSharding(mesh, logical_to_spec(("batch",)))

    def wrap(fn):
        def inner(*args):
            with use_mesh(mesh):
                return fn(*args)
        return inner

    train = jax.jit(wrap(train_step), in_shardings=(state_sh, frozen_sh, target_sh, batch_sh),
                    out_shardings=(state_sh, repl), donate_argnums=(0,))
    evaluate = jax.jit(wrap(eval_step), in_shardings=(param_sh, frozen_sh, target_sh, batch_sh,
                                                      repl), out_shardings=repl)
    return StepFns(graphdef=draft_graphdef, train=train, evaluate=evaluate, state_shardings=state_sh,
                   batch_sharding=batch_sh)
