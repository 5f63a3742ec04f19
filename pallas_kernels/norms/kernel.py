"""The RMS norms of a decoding layer as one kernel each (Triton).

A decoder layer (SPEC §1–2, the target's forward) normalises three times around its two
matrix products: the residual sum and its RMS norm before the attention and before the MLP,
and the per-head q / k norms and rotary embedding between the fused q/k/v product and the
attention. XLA runs each norm as two kernels (the reduction, then the scaling) and the residual
sum as a third; while decoding a few tokens every kernel costs its launch, ramp and tail for a
few kilobytes of work. Here:

  `add_rms_norm`   h + delta and its RMS norm, one program a row: [R, D] → ([R, D], [R, D]).
  `qk_norm_rope`   per head of a fused q/k/v product [B, T, N + 2Kh, H]: the q heads and the
                   k heads RMS-normed (their own weights) and rotated (rotate-half RoPE, the
                   cos / sin of each token given), the v heads copied: one program a head.
  `ref_add_rms_norm`, `ref_qk_norm_rope`  the pure-JAX oracles, Hugging Face's arithmetic:
                   the norm in fp32, cast to the input dtype before the scale.

Lengths need not be powers of two: a row is read as a power-of-two tile with the tail masked.
Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import next_pow2

__all__ = ["add_rms_norm", "qk_norm_rope", "ref_add_rms_norm", "ref_qk_norm_rope"]



def _compiler_params(interpret: bool, num_warps: int):
    from jax.experimental.pallas import triton as plgpu

    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _load(ref, n: int):
    """The first n entries of a 1-D ref as a power-of-two f32 tile, zeros past n."""
    from jax.experimental.pallas import triton as plgpu

    width = next_pow2(n)
    if width == n:
        return ref[...].astype(jnp.float32)
    ok = lax.broadcasted_iota(jnp.int32, (width,), 0) < n
    return plgpu.load(ref.at[pl.ds(0, width)], mask=ok, other=0).astype(jnp.float32)


def _store(ref, x, n: int) -> None:
    from jax.experimental.pallas import triton as plgpu

    width = x.shape[0]
    if width == n:
        ref[...] = x.astype(ref.dtype)
        return
    ok = lax.broadcasted_iota(jnp.int32, (width,), 0) < n
    plgpu.store(ref.at[pl.ds(0, width)], x.astype(ref.dtype), mask=ok)


def _normed(x, weight, n: int, eps: float, dtype):
    """RMS norm of f32 x over its first n entries, cast to `dtype` and then scaled."""
    r = lax.rsqrt(jnp.sum(x * x) / n + eps)
    return (weight.astype(dtype).astype(jnp.float32)
            * (x * r).astype(dtype).astype(jnp.float32)).astype(dtype)


def _add_norm_kernel(h_ref, d_ref, w_ref, sum_ref, out_ref, *, eps: float):
    n = h_ref.shape[0]
    dtype = sum_ref.dtype
    s = (_load(h_ref, n) + _load(d_ref, n)).astype(dtype)
    _store(sum_ref, s, n)
    _store(out_ref, _normed(s.astype(jnp.float32), _load(w_ref, n), n, eps, dtype), n)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def add_rms_norm(h: jax.Array, delta: jax.Array, weight: jax.Array, *, eps: float,
                 interpret: bool = False, num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """(h + delta, RMSNorm(h + delta) · weight) for h, delta [R, D] (h's dtype), weight [D]."""
    if h.shape != delta.shape or h.ndim != 2 or weight.shape != h.shape[1:]:
        raise ValueError(f"h, delta must be [R, D] and weight [D]: {h.shape}, {delta.shape}, "
                         f"{weight.shape}")
    R, D = h.shape
    row = pl.BlockSpec((None, D), lambda r: (r, 0))
    return tuple(pl.pallas_call(
        functools.partial(_add_norm_kernel, eps=eps), grid=(R,),
        in_specs=[row, row, pl.BlockSpec((D,), lambda r: (0,))], out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct(h.shape, h.dtype)] * 2,
        compiler_params=_compiler_params(interpret, num_warps), interpret=interpret,
        name="add_rms_norm",
    )(h, delta.astype(h.dtype), weight))


def _qk_kernel(x_ref, qw_ref, kw_ref, cos_ref, sin_ref, *refs, num_q: int, num_kv: int,
               eps: float, normed: bool, write: bool):
    if write:   # (positions, caches in, rows out, caches out): the caches are aliased
        pos_ref, _, _, o_ref, ck_ref, cv_ref = refs
    else:
        (o_ref,) = refs
    j = pl.program_id(2)
    h2 = x_ref.shape[0] // 2
    dtype = o_ref.dtype
    first, second = pl.ds(0, h2), pl.ds(h2, h2)
    x1 = x_ref[first].astype(jnp.float32)
    x2 = x_ref[second].astype(jnp.float32)
    if write:
        pos = pos_ref[...]
        in_cache = pos < ck_ref.shape[0]

    @pl.when(j >= num_q + num_kv)          # a v head: as it is
    def _():
        o_ref[...] = x_ref[...]
        if write:
            @pl.when(in_cache)
            def _():
                cv_ref[pos, j - num_q - num_kv, :] = x_ref[...].astype(cv_ref.dtype)

    @pl.when(j < num_q + num_kv)           # a q or k head: normed, then rotated
    def _():
        y1, y2 = x1, x2
        if normed:
            is_q = j < num_q
            w1 = jnp.where(is_q, qw_ref[first].astype(jnp.float32),
                           kw_ref[first].astype(jnp.float32))
            w2 = jnp.where(is_q, qw_ref[second].astype(jnp.float32),
                           kw_ref[second].astype(jnp.float32))
            r = lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / (2 * h2) + eps)
            y1 = (w1.astype(dtype).astype(jnp.float32)
                  * (x1 * r).astype(dtype).astype(jnp.float32)).astype(dtype)
            y2 = (w2.astype(dtype).astype(jnp.float32)
                  * (x2 * r).astype(dtype).astype(jnp.float32)).astype(dtype)
            y1, y2 = y1.astype(jnp.float32), y2.astype(jnp.float32)
        c, s = cos_ref[...], sin_ref[...]
        r1, r2 = (y1 * c - y2 * s).astype(dtype), (y2 * c + y1 * s).astype(dtype)
        o_ref[first], o_ref[second] = r1, r2
        if write:
            @pl.when((j >= num_q) & in_cache)
            def _():
                ck_ref[pos, j - num_q, first] = r1.astype(ck_ref.dtype)
                ck_ref[pos, j - num_q, second] = r2.astype(ck_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "num_kv_heads", "eps", "interpret",
                                             "num_warps"),
                   donate_argnames=("cache_k", "cache_v"))
def qk_norm_rope(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None,
                 cos: jax.Array, sin: jax.Array, positions: jax.Array | None = None,
                 cache_k: jax.Array | None = None, cache_v: jax.Array | None = None, *,
                 num_q_heads: int, num_kv_heads: int, eps: float, interpret: bool = False,
                 num_warps: int = 1) -> Any:
    """qkv [B, T, N + 2Kh, H] → the same heads with q (heads < N) and k (the next Kh) RMS-normed
    by `q_norm` / `k_norm` [H] (both None: no norm, Llama) and rotated by cos / sin
    [B, T, H/2] (f32), v copied. With `positions` [B, T] and a cache layer's k / v
    [B, S, Kh, H]: also each token's k and v written to the cache at its position (in place;
    a position ≥ S is dropped), returning (heads, cache k, cache v)."""
    B, T, J, H = qkv.shape
    if J != num_q_heads + 2 * num_kv_heads:
        raise ValueError(f"qkv has {J} heads, not {num_q_heads} + 2·{num_kv_heads}")
    if H % 2 or H // 2 != next_pow2(H // 2) or cos.shape != (B, T, H // 2) \
            or sin.shape != cos.shape:
        raise ValueError(f"head size {H} must be twice a power of two and cos / sin "
                         f"[B, T, H/2]: {cos.shape}, {sin.shape}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    write = cache_k is not None
    if write and (positions is None or positions.shape != (B, T) or cache_v is None
                  or cache_k.shape != cache_v.shape or cache_k.shape[0] != B
                  or cache_k.shape[2:] != (num_kv_heads, H)):
        raise ValueError(f"a cache write needs positions [B, T] = {(B, T)} and cache k / v "
                         f"[B, S, {num_kv_heads}, {H}]")
    normed = q_norm is not None
    if not normed:
        q_norm = k_norm = jnp.ones((H,), qkv.dtype)
    head = pl.BlockSpec((None, None, None, H), lambda b, t, j: (b, t, j, 0))
    weight = pl.BlockSpec((H,), lambda b, t, j: (0,))
    trig = pl.BlockSpec((None, None, H // 2), lambda b, t, j: (b, t, 0))
    in_specs = [head, weight, weight, trig, trig]
    args = [qkv, q_norm, k_norm, cos.astype(jnp.float32), sin.astype(jnp.float32)]
    out_specs, out_shape, aliases = head, jax.ShapeDtypeStruct(qkv.shape, qkv.dtype), {}
    if write:
        S = cache_k.shape[1]
        row = pl.BlockSpec((None, S, num_kv_heads, H), lambda b, t, j: (b, 0, 0, 0))
        in_specs += [pl.BlockSpec((None, None), lambda b, t, j: (b, t)), row, row]
        args += [positions.astype(jnp.int32), cache_k, cache_v]
        out_specs = [head, row, row]
        out_shape = [out_shape, jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
                     jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype)]
        aliases = {6: 1, 7: 2}
    out = pl.pallas_call(
        functools.partial(_qk_kernel, num_q=num_q_heads, num_kv=num_kv_heads, eps=eps,
                          normed=normed, write=write),
        grid=(B, T, J), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_compiler_params(interpret, num_warps), interpret=interpret,
        name="qk_norm_rope",
    )(*args)
    return tuple(out) if write else out


def _ref_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def ref_add_rms_norm(h: jax.Array, delta: jax.Array, weight: jax.Array, *, eps: float
                     ) -> tuple[jax.Array, jax.Array]:
    s = h + delta.astype(h.dtype)
    return s, _ref_norm(s, weight, eps)


def ref_qk_norm_rope(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None,
                     cos: jax.Array, sin: jax.Array, *, num_q_heads: int, num_kv_heads: int,
                     eps: float) -> jax.Array:
    n, kh = num_q_heads, num_kv_heads
    q, k, v = qkv[:, :, :n], qkv[:, :, n:n + kh], qkv[:, :, n + kh:]
    if q_norm is not None:
        q, k = _ref_norm(q, q_norm, eps), _ref_norm(k, k_norm, eps)

    def rope(x):
        xf = x.astype(jnp.float32)
        x1, x2 = jnp.split(xf, 2, axis=-1)
        c, s = cos[:, :, None], sin[:, :, None]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).astype(x.dtype)

    return jnp.concatenate([rope(q), rope(k), v], axis=2)
