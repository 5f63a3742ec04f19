"""The residual sum and RMS norm of a decoding layer as one kernel (Triton).

A decoder layer (SPEC §1–2, the target's forward) adds a residual and RMS-normalises the sum
before its attention and before its MLP. XLA runs that as three kernels (the sum, the
reduction, the scaling); while decoding a few tokens every kernel costs its launch, ramp and
tail for a few kilobytes of work. Here:

  `add_rms_norm`      h + delta and its RMS norm, one program a row: [R, D] → ([R, D], [R, D]);
                      the delta may come as a split-K product's parts or be normed first
                      (Gemma's sandwich norms), the sum scaled (Gemma's layer scalar).
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


def _add_norm_kernel(*refs, eps: float, parts: int | None, delta_normed: bool, scaled: bool,
                     normed: bool):
    """One row: s = (h + delta') · scale, delta' the delta (the f32 sum of its parts, rounded)
    or its own RMS norm; then the RMS norm of s. The optional refs come in that order."""
    refs = list(refs)
    h_ref, d_ref = refs.pop(0), refs.pop(0)
    wd_ref = refs.pop(0) if delta_normed else None
    w_ref = refs.pop(0) if normed else None
    scale_ref = refs.pop(0) if scaled else None
    sum_ref = refs.pop(0)
    n = h_ref.shape[0]
    dtype = sum_ref.dtype
    if parts is None:
        d = _load(d_ref, n)
    else:   # the f32 sum of a split-K product's parts, rounded as the product would be
        d = functools.reduce(operator.add, (_load(d_ref, n, part=i) for i in range(parts)))
        d = d.astype(dtype).astype(jnp.float32)
    if delta_normed:   # a sandwich norm: the delta normed before the residual sum (Gemma)
        d = _normed(d, _load(wd_ref, n), n, eps, dtype).astype(jnp.float32)
    s = (_load(h_ref, n) + d).astype(dtype)
    if scaled:
        s = (s.astype(jnp.float32) * scale_ref[0].astype(jnp.float32)).astype(dtype)
    _store(sum_ref, s, n)
    if normed:
        _store(refs.pop(0), _normed(s.astype(jnp.float32), _load(w_ref, n), n, eps, dtype), n)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def add_rms_norm(h: jax.Array, delta: jax.Array, weight: jax.Array | None, *, eps: float,
                 delta_weight: jax.Array | None = None, scale: jax.Array | None = None,
                 interpret: bool = False, num_warps: int = 4
                 ) -> tuple[jax.Array, jax.Array | None]:
    """(s, RMSNorm(s) · weight) with s = h + delta, for h, delta [R, D] (h's dtype), weight [D]
    (None: s alone, the second output None).

    `delta` may also be the f32 parts of a split-K product, [parts, Rp, D] with Rp ≥ R (rows
    past R unread): each program sums its row's parts and rounds the sum to h's dtype, as XLA
    sums its own split-K parts, so the product's sum costs no kernel of its own.
    `delta_weight` [D]: the delta is RMS-normed by it first, s = h + RMSNorm(delta) ·
    delta_weight (Gemma's sandwich norms); `scale` [1]: s is multiplied by it (Gemma's layer
    scalar), each product rounded to h's dtype as XLA rounds it."""
    parts = delta.shape[0] if delta.ndim == 3 else None
    rows_ok = (delta.shape == h.shape if parts is None else
               delta.dtype == jnp.float32 and delta.shape[1] >= h.shape[0]
               and delta.shape[2:] == h.shape[1:])
    weights_ok = all(w is None or w.shape == h.shape[1:] for w in (weight, delta_weight))
    if not rows_ok or h.ndim != 2 or not weights_ok or (scale is not None
                                                       and scale.size != 1):
        raise ValueError(f"h must be [R, D], delta [R, D] or f32 [parts, ≥ R, D], weight and "
                         f"delta_weight [D], scale one value: {h.shape}, {delta.shape} "
                         f"{delta.dtype}, {None if weight is None else weight.shape}, "
                         f"{None if delta_weight is None else delta_weight.shape}, "
                         f"{None if scale is None else scale.shape}")
    R, D = h.shape
    row = pl.BlockSpec((None, D), lambda r: (r, 0))
    vec = pl.BlockSpec((D,), lambda r: (0,))
    args = [h, delta if parts is not None else delta.astype(h.dtype)]
    specs = [row, row if parts is None else pl.BlockSpec((parts, None, D), lambda r: (0, r, 0))]
    for w in (delta_weight, weight):
        if w is not None:
            args.append(w)
            specs.append(vec)
    if scale is not None:
        args.append(scale.reshape(1))
        specs.append(pl.BlockSpec((1,), lambda r: (0,)))
    outs = pl.pallas_call(
        functools.partial(_add_norm_kernel, eps=eps, parts=parts,
                          delta_normed=delta_weight is not None, scaled=scale is not None,
                          normed=weight is not None), grid=(R,),
        in_specs=specs, out_specs=[row] * (1 + (weight is not None)),
        out_shape=[jax.ShapeDtypeStruct(h.shape, h.dtype)] * (1 + (weight is not None)),
        compiler_params=_compiler_params(interpret, num_warps), interpret=interpret,
        name="add_rms_norm",
    )(*args)
    return outs[0], (outs[1] if weight is not None else None)


def ref_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def ref_add_rms_norm(h: jax.Array, delta: jax.Array, weight: jax.Array | None, *, eps: float,
                     delta_weight: jax.Array | None = None, scale: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array | None]:
    if delta.ndim == h.ndim + 1:   # a split-K product's parts, summed in f32
        delta = delta.sum(axis=0)[:h.shape[0]]
    delta = delta.astype(h.dtype)
    if delta_weight is not None:
        delta = ref_rms_norm(delta, delta_weight, eps)
    s = h + delta
    if scale is not None:
        s = s * scale.astype(h.dtype)
    return s, None if weight is None else ref_rms_norm(s, weight, eps)
