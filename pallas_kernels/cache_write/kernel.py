"""Every layer's new K/V rows written into per-layer caches in one kernel (Triton), in place.

After a verification or a drafter's commit, each of the T tokens' K and V rows [Kh, H] goes
to (row, position) of every layer's cache buffer [1, B, S, Kh, H]. XLA writes them as one
scatter per layer and per K / V: 72 kernels for a 36-layer target, each moving kilobytes.
Here one program a token stores its rows into all 2L buffers, which are the kernel's outputs
aliased to its inputs, so nothing is copied. The new rows come stacked, [L, T, Kh, H], or as
each layer's own buffer [1, T, Kh, H] (as the layers produced them), which no stack copies. A token whose row or position is out of range is
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

__all__ = ["NewRows", "ref_write_rows", "write_rows"]

# a K or V's new rows: stacked [L, T, Kh, H], or each layer's buffer [1, T, Kh, H]
NewRows = jax.Array | tuple[jax.Array, ...]


def _kernel(rows_ref, pos_ref, *refs, layers: int, stacked: bool, batch: int, seq: int,
            kv_heads: int):
    """Token w's K and V rows into every layer's buffers (the last 2L refs, aliased); the new
    rows are one stacked ref for the keys and one for the values, or (not `stacked`) L each."""
    from jax.experimental.pallas import triton as plgpu

    n_new = 1 if stacked else layers
    news = (refs[:n_new], refs[n_new:2 * n_new])
    outs = refs[2 * n_new + 2 * layers:]
    w = pl.program_id(0)
    row, pos = rows_ref[w], pos_ref[w]
    ok = (row >= 0) & (row < batch) & (pos >= 0) & (pos < seq)
    row, pos = jnp.clip(row, 0, batch - 1), jnp.clip(pos, 0, seq - 1)
    kp = next_pow2(kv_heads)
    heads = pl.ds(0, kp)
    h_ok = lax.broadcasted_iota(jnp.int32, (kp, 1), 0) < kv_heads
    zero = jnp.asarray(0, jnp.int32)   # indices of the refs, not static slices
    for i, new in enumerate(news):
        for layer in range(layers):
            out = outs[i * layers + layer]
            ref, at = (new[0], layer) if stacked else (new[layer], 0)
            x = plgpu.load(ref.at[jnp.asarray(at, jnp.int32), w, heads, :], mask=h_ok,
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
    if rows.shape != positions.shape or rows.ndim != 1:
        raise ValueError(f"rows {rows.shape} and positions {positions.shape}: one each a token")
    if isinstance(k_new, (tuple, list)) != isinstance(v_new, (tuple, list)):
        raise ValueError("the new keys and values must both be stacked or both per layer")
    for new in (k_new, v_new):
        if isinstance(new, (tuple, list)):
            want = (1, W) + shape[3:]
            if len(new) != L or any(x.shape != want for x in new):
                raise ValueError(f"new rows must be L = {L} buffers [1, T, Kh, H] = {want}: "
                                 f"{[x.shape for x in new]}")
        elif new.shape != (L, W) + shape[3:]:
            raise ValueError(f"new rows must be [L, T, Kh, H] = {(L, W) + shape[3:]}: "
                             f"{new.shape}")


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_rows(caches_k: tuple[jax.Array, ...], caches_v: tuple[jax.Array, ...],
               rows: jax.Array, positions: jax.Array, k_new: NewRows, v_new: NewRows, *,
               interpret: bool = False) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Token t's rows k_new / v_new (stacked [L, T, Kh, H], or L buffers [1, T, Kh, H], both
    in the same form) written at (`rows[t]`, `positions[t]`) of every layer's caches (tuples of
    L buffers [1, B, S, Kh, H]); a row or position out of range drops the token. → the caches,
    written in place (input/output aliasing)."""
    _check(caches_k, caches_v, rows, positions, k_new, v_new)
    stacked = not isinstance(k_new, (tuple, list))
    L = len(caches_k)
    _, B, S, Kh, H = caches_k[0].shape
    caches = tuple(caches_k) + tuple(caches_v)
    news = (k_new, v_new) if stacked else (*k_new, *v_new)
    kernel = functools.partial(_kernel, layers=L, stacked=stacked, batch=B, seq=S, kv_heads=Kh)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params = plgpu.CompilerParams(num_warps=1, num_stages=1)
    out = pl.pallas_call(
        kernel, grid=(rows.shape[0],),
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={2 + len(news) + i: i for i in range(2 * L)},
        compiler_params=params, interpret=interpret, name="cache_write_rows",
    )(rows.astype(jnp.int32), positions.astype(jnp.int32), *news, *caches)
    return tuple(out[:L]), tuple(out[L:])


def ref_write_rows(caches_k: tuple[jax.Array, ...], caches_v: tuple[jax.Array, ...],
                   rows: jax.Array, positions: jax.Array, k_new: NewRows, v_new: NewRows
                   ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The oracle: one XLA scatter a layer and a K / V, out-of-range tokens dropped."""
    _check(caches_k, caches_v, rows, positions, k_new, v_new)

    def put(cs, new):
        new = [n[0] for n in new] if isinstance(new, (tuple, list)) else new
        return tuple(c.at[0, rows, positions].set(n.astype(c.dtype), mode="drop")
                     for c, n in zip(cs, new))

    return put(caches_k, k_new), put(caches_v, v_new)
