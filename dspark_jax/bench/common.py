"""Shared benchmark plumbing: named target shapes, random-weight targets; the host facts, table and
JSON helpers of `dspark_jax.measurement`, imported here for the benchmarks (the device calls are
timed by `serving.cost_profile.time_call`, the package's one timer).

Dense-model speed does not depend on weight values, so the GPU benchmarks use random bf16
weights created directly on the device (../shared/docs/PERFORMANCE.md).
"""

from __future__ import annotations

import statistics

import jax
from flax import nnx

from dspark_jax.measurement import (StealMeter, cpu_model, host_facts,  # noqa: F401
                                    memory_copy_gbs, print_table, save_json)
from dspark_jax.models.config import DecoderConfig, RopeConfig
from dspark_jax.models.decoder import create_target
from dspark_jax.models.target import Target, load_target, resolve_dtype

SHAPES = {
    "qwen3-4b": DecoderConfig(family="qwen3", vocab_size=151936, hidden_size=2560,
                              intermediate_size=9728, num_hidden_layers=36,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
                              tie_word_embeddings=True, qk_norm=True,
                              max_position_embeddings=40960),
    "qwen3-8b": DecoderConfig(family="qwen3", vocab_size=151936, hidden_size=4096,
                              intermediate_size=12288, num_hidden_layers=36,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
                              tie_word_embeddings=False, qk_norm=True,
                              max_position_embeddings=40960),
}


def build_target(name: str, dtype: str = "bfloat16", seed: int = 0) -> Target:
    """A named random-weight shape (created on device) or a real target by name/path."""
    if name in SHAPES:
        cfg = SHAPES[name]
        dt = resolve_dtype(dtype)

        @jax.jit
        def make():
            return nnx.split(create_target(cfg, seed, dt, dt))[1]

        graphdef = nnx.graphdef(nnx.eval_shape(lambda: create_target(cfg, seed, dt, dt)))
        return Target(config=cfg, graphdef=graphdef, state=make(), name=name)
    return load_target(name, dtype=dtype, with_tokenizer=False)


def weight_bytes(target: Target) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(target.state))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')} x{jax.device_count()}"


