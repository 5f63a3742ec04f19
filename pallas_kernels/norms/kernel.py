"""The residual sum and RMS norm of a decoding layer as one kernel (Triton).

A decoder layer (SPEC §1–2, the target's forward) adds a residual and RMS-normalises the sum
before its attention and before its MLP. XLA runs that as three kernels (the sum, the
reduction, the scaling); while decoding a few tokens every kernel costs its launch, ramp and
tail for a few kilobytes of work. Here:

  `add_rms_norm`      h + delta and its RMS norm, one program a row: [R, D] → ([R, D], [R, D]).
  `ref_add_rms_norm`  the pure-JAX oracle; `ref_rms_norm` Hugging Face's arithmetic (the norm
                      in fp32, cast to the input dtype before the scale).

A row need not be a power of two long: it is read as a power-of-two tile with the tail masked.
Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import next_pow2

__all__ = ["add_rms_norm", "ref_add_rms_norm", "ref_rms_norm"]



def _compiler_params(interpret: bool, num_warps: int):
    from jax.experimental.pallas import triton as plgpu

    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _load(ref, n: int, part: int | None = None):
    """The first n entries of a 1-D ref (of its `part`, a [parts, n] ref's) as a power-of-two
    f32 tile, zeros past n."""
    from jax.experimental.pallas import triton as plgpu

    width = next_pow2(n)
    if width == n:
        return (ref[...] if part is None else ref[part, :]).astype(jnp.float32)
    ok = lax.broadcasted_iota(jnp.int32, (width,), 0) < n
    at = pl.ds(0, width) if part is None else (jnp.int32(part), pl.ds(0, width))
    return plgpu.load(ref.at[at], mask=ok, other=0).astype(jnp.float32)


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


def _add_norm_kernel(h_ref, d_ref, w_ref, sum_ref, out_ref, *, eps: float, parts: int | None):
    n = h_ref.shape[0]
    dtype = sum_ref.dtype
    if parts is None:
        d = _load(d_ref, n)
    else:   # the f32 sum of a split-K product's parts, rounded as the product would be
        d = functools.reduce(operator.add, (_load(d_ref, n, part=i) for i in range(parts)))
        d = d.astype(dtype).astype(jnp.float32)
    s = (_load(h_ref, n) + d).astype(dtype)
    _store(sum_ref, s, n)
    _store(out_ref, _normed(s.astype(jnp.float32), _load(w_ref, n), n, eps, dtype), n)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def add_rms_norm(h: jax.Array, delta: jax.Array, weight: jax.Array, *, eps: float,
                 interpret: bool = False, num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """(h + delta, RMSNorm(h + delta) · weight) for h, delta [R, D] (h's dtype), weight [D].

    `delta` may also be the f32 parts of a split-K product, [parts, Rp, D] with Rp ≥ R (rows
    past R unread): each program sums its row's parts and rounds the sum to h's dtype, as XLA
    sums its own split-K parts, so the product's sum costs no kernel of its own."""
    parts = delta.shape[0] if delta.ndim == 3 else None
    rows_ok = (delta.shape == h.shape if parts is None else
               delta.dtype == jnp.float32 and delta.shape[1] >= h.shape[0]
               and delta.shape[2:] == h.shape[1:])
    if not rows_ok or h.ndim != 2 or weight.shape != h.shape[1:]:
        raise ValueError(f"h must be [R, D], delta [R, D] or f32 [parts, ≥ R, D], weight [D]: "
                         f"{h.shape}, {delta.shape} {delta.dtype}, {weight.shape}")
    R, D = h.shape
    row = pl.BlockSpec((None, D), lambda r: (r, 0))
    d_row = row if parts is None else pl.BlockSpec((parts, None, D), lambda r: (0, r, 0))
    return tuple(pl.pallas_call(
        functools.partial(_add_norm_kernel, eps=eps, parts=parts), grid=(R,),
        in_specs=[row, d_row, pl.BlockSpec((D,), lambda r: (0,))], out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct(h.shape, h.dtype)] * 2,
        compiler_params=_compiler_params(interpret, num_warps), interpret=interpret,
        name="add_rms_norm",
    )(h, delta if parts is not None else delta.astype(h.dtype), weight))


def ref_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def ref_add_rms_norm(h: jax.Array, delta: jax.Array, weight: jax.Array, *, eps: float
                     ) -> tuple[jax.Array, jax.Array]:
    if delta.ndim == h.ndim + 1:   # a split-K product's parts, summed in f32
        delta = delta.sum(axis=0)[:h.shape[0]]
    s = h + delta.astype(h.dtype)
    return s, ref_rms_norm(s, weight, eps)
