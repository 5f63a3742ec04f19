"""Every layer's new K/V rows written into per-layer caches in one kernel (Triton), in place.

After a verification or a drafter's commit, each of the T tokens' K and V rows [Kh, H] goes
to (row, position) of every layer's cache buffer [1, B, S, Kh, H]. XLA writes them as one
scatter per layer and per K / V: 72 kernels for a 36-layer target, each moving kilobytes.
Here one program a token stores its rows into all 2L buffers, which are the kernel's outputs
aliased to its inputs, so nothing is copied. A token whose row or position is out of range is
dropped, as `.at[...].set(..., mode="drop")` does.

  `write_rows`       the kernel.
  `ref_write_rows`   the oracle: the same writes as XLA scatters.
Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import next_pow2

__all__ = ["ref_write_rows", "write_rows"]


def _kernel(rows_ref, pos_ref, k_ref, v_ref, *refs, layers: int, batch: int, seq: int,
            kv_heads: int):
    """Token w's K and V rows into every layer's buffers (the last 2L refs, aliased)."""
    from jax.experimental.pallas import triton as plgpu

    outs = refs[2 * layers:]
    w = pl.program_id(0)
    row, pos = rows_ref[w], pos_ref[w]
    ok = (row >= 0) & (row < batch) & (pos >= 0) & (pos < seq)
    row, pos = jnp.clip(row, 0, batch - 1), jnp.clip(pos, 0, seq - 1)
    kp = next_pow2(kv_heads)
    heads = pl.ds(0, kp)
    h_ok = lax.broadcasted_iota(jnp.int32, (kp, 1), 0) < kv_heads
    zero = jnp.asarray(0, jnp.int32)   # indices of the refs, not static slices
    for i, new in enumerate((k_ref, v_ref)):
        for layer in range(layers):
            out = outs[i * layers + layer]
            x = plgpu.load(new.at[jnp.asarray(layer, jnp.int32), w, heads, :], mask=h_ok,
                           other=0)
            plgpu.store(out.at[zero, row, pos, heads, :], x.astype(out.dtype), mask=h_ok & ok)


def _check(caches_k, caches_v, rows, positions, k_new, v_new):
    L = len(caches_k)
    if L == 0 or len(caches_v) != L:
        raise ValueError(f"{L} key and {len(caches_v)} value caches: one each a layer")
    shape = caches_k[0].shape
    if len(shape) != 5 or shape[0] != 1:
        raise ValueError(f"a cache buffer is [1, B, S, Kh, H], got {shape}")
    for c in caches_k + caches_v:
        if c.shape != shape or c.dtype != caches_k[0].dtype:
            raise ValueError(f"cache buffers must share shape and dtype: {c.shape} {c.dtype}")
    W = rows.shape[0]
    want = (L, W) + shape[3:]
    if rows.shape != positions.shape or rows.ndim != 1:
        raise ValueError(f"rows {rows.shape} and positions {positions.shape}: one each a token")
    if k_new.shape != want or v_new.shape != want:
        raise ValueError(f"new rows must be [L, T, Kh, H] = {want}: {k_new.shape}, "
                         f"{v_new.shape}")


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_rows(caches_k: tuple[jax.Array, ...], caches_v: tuple[jax.Array, ...],
               rows: jax.Array, positions: jax.Array, k_new: jax.Array, v_new: jax.Array, *,
               interpret: bool = False) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Token t's rows k_new / v_new [L, T, Kh, H] written at (`rows[t]`, `positions[t]`) of
    every layer's caches (tuples of L buffers [1, B, S, Kh, H]); a row or position out of
    range drops the token. → the caches, written in place (input/output aliasing)."""
    _check(caches_k, caches_v, rows, positions, k_new, v_new)
    L, W = k_new.shape[:2]
    _, B, S, Kh, H = caches_k[0].shape
    caches = tuple(caches_k) + tuple(caches_v)
    kernel = functools.partial(_kernel, layers=L, batch=B, seq=S, kv_heads=Kh)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params = plgpu.CompilerParams(num_warps=1, num_stages=1)
    out = pl.pallas_call(
        kernel, grid=(W,),
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={4 + i: i for i in range(2 * L)},
        compiler_params=params, interpret=interpret, name="cache_write_rows",
    )(rows.astype(jnp.int32), positions.astype(jnp.int32), k_new, v_new, *caches)
    return tuple(out[:L]), tuple(out[L:])


def ref_write_rows(caches_k: tuple[jax.Array, ...], caches_v: tuple[jax.Array, ...],
                   rows: jax.Array, positions: jax.Array, k_new: jax.Array, v_new: jax.Array
                   ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The oracle: one XLA scatter a layer and a K / V, out-of-range tokens dropped."""
    _check(caches_k, caches_v, rows, positions, k_new, v_new)

    def put(cs, new):
        return tuple(c.at[0, rows, positions].set(n.astype(c.dtype), mode="drop")
                     for c, n in zip(cs, new))

    return put(caches_k, k_new), put(caches_v, v_new)
