"""Every layer's new K/V rows written into per-layer caches in one kernel (Triton), in place.

After a verification or a drafter's commit, each of the T tokens' K and V rows [Kh, H] goes
to (row, position) of every layer's cache buffer [1, B, S, Kh, H]. XLA writes them as one
scatter per layer and per K / V: 72 kernels for a 36-layer target, each moving kilobytes.
Here one program a token stores its rows into all 2L buffers, which are the kernel's outputs
aliased to its inputs, so nothing is copied. A token whose row or position is out of range is
dropped, as `.at[...].set(..., mode="drop")` does. The new rows come stacked, [L, T, Kh, H],
or as each layer's own buffer [1, T, Kh, H] (as the layers produced them), which no stack
copies.

  `write_rows`       the kernel.
  `ref_write_rows`   the oracle: the same writes as XLA scatters.

A drafter's context rows (DSpark / DFlash, paper §3.1: the K/V every draft layer projects from
the target's features) come from one product, each token's k|v of every layer side by side;
their keys still take the layer's k norm and RoPE. `write_context_rows` takes that product as
it is, [T, L, 2, Kh, H], and each program norms and rotates its token's keys (at the position
it writes them, its angles taken there) on the way into the caches, where XLA would take the
angles, a transpose, the norm and RoPE as kernels of their own before the write.

  `write_context_rows`       the kernel.
  `ref_write_context_rows`   the oracle: the norm and RoPE in XLA, then `ref_write_rows`.
Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import next_pow2, normed_rotated, ref_rotate_half

__all__ = ["NewRows", "context_rows_take", "ref_write_context_rows", "ref_write_rows",
           "write_context_rows", "write_rows"]

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


# ------------------------------------------------------------------------------ context rows

def context_rows_take(head_dim: int) -> bool:
    """Whether `write_context_rows` takes heads of `head_dim`: halves a power of two (the
    kernel's tiles), at least 16 wide."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half == next_pow2(half)


def _context_kernel(rows_ref, pos_ref, kv_ref, freq_ref, *refs, layers: int, normed: bool,
                    batch: int, seq: int, kv_heads: int, eps: float):
    """Token w's keys (k-normed with `normed`, rotated) and values of every layer into the
    layers' buffers (the last 2L refs, aliased); the L k norms [H] first when `normed`."""
    from jax.experimental.pallas import triton as plgpu

    norms = refs[:layers] if normed else (None,) * layers
    outs = refs[(layers if normed else 0) + 2 * layers:]
    w = pl.program_id(0)
    row, pos = rows_ref[w], pos_ref[w]
    angles = pos.astype(jnp.float32) * freq_ref[...][None, :]                # [1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    ok = (row >= 0) & (row < batch) & (pos >= 0) & (pos < seq)
    row, pos = jnp.clip(row, 0, batch - 1), jnp.clip(pos, 0, seq - 1)
    kp = next_pow2(kv_heads)
    heads = pl.ds(0, kp)
    h_ok = lax.broadcasted_iota(jnp.int32, (kp, 1), 0) < kv_heads
    h2 = kv_ref.shape[-1] // 2
    halves = (pl.ds(0, h2), pl.ds(h2, h2))
    zero = jnp.asarray(0, jnp.int32)   # indices of the refs, not static slices
    for layer in range(layers):
        at = jnp.asarray(layer, jnp.int32)
        k_out, v_out = outs[layer], outs[layers + layer]
        k1, k2 = (plgpu.load(kv_ref.at[w, at, zero, heads, half], mask=h_ok,
                             other=0).astype(jnp.float32) for half in halves)
        k1, k2 = normed_rotated(k1, k2, norms[layer], cos, sin, eps=eps, normed=normed,
                                dtype=k_out.dtype)
        for x, half in zip((k1, k2), halves):
            plgpu.store(k_out.at[zero, row, pos, heads, half], x, mask=h_ok & ok)
        v = plgpu.load(kv_ref.at[w, at, jnp.asarray(1, jnp.int32), heads, :], mask=h_ok,
                       other=0)
        plgpu.store(v_out.at[zero, row, pos, heads, :], v.astype(v_out.dtype), mask=h_ok & ok)


def _check_context(caches_k, caches_v, rows, positions, kv, k_norms, inv_freq):
    L = len(caches_k)
    T = rows.shape[0]
    shape = caches_k[0].shape
    rows_of_layers = jax.ShapeDtypeStruct((L, T) + shape[3:], kv.dtype)   # what is written
    _check(caches_k, caches_v, rows, positions, rows_of_layers, rows_of_layers)
    H = shape[-1]
    if kv.shape != (T, L, 2) + shape[3:]:
        raise ValueError(f"kv must be [T, L, 2, Kh, H] = {(T, L, 2) + shape[3:]}: {kv.shape}")
    if k_norms is not None and (len(k_norms) != L or any(w.shape != (H,) for w in k_norms)):
        raise ValueError(f"k_norms must be L = {L} weights [H = {H}]: "
                         f"{[w.shape for w in k_norms]}")
    if inv_freq.shape != (H // 2,):
        raise ValueError(f"inv_freq must be [H/2] = {(H // 2,)}: {inv_freq.shape}")


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def write_context_rows(caches_k: tuple[jax.Array, ...], caches_v: tuple[jax.Array, ...],
                       rows: jax.Array, positions: jax.Array, kv: jax.Array,
                       k_norms: tuple[jax.Array, ...] | None, inv_freq: jax.Array, *,
                       eps: float, interpret: bool = False
                       ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Token t's context rows written at (`rows[t]`, `positions[t]`) of every layer's caches
    (tuples of L buffers [1, B, S, Kh, H]), a row or position out of range dropping the token:
    its keys kv[t, l, 0] [Kh, H] RMS-normed by layer l's `k_norms[l]` [H] (None: no norm), cast
    before the scale as Hugging Face does, then rotated at their position (rotate-half RoPE:
    angles positions[t] · inv_freq [H/2], in f32), its values kv[t, l, 1] as they are. → the
    caches, written in place (input/output aliasing). The heads' halves must be a power of two
    (`context_rows_take`)."""
    _check_context(caches_k, caches_v, rows, positions, kv, k_norms, inv_freq)
    L, W = len(caches_k), rows.shape[0]
    _, B, S, Kh, H = caches_k[0].shape
    if not context_rows_take(H):
        raise ValueError(f"write_context_rows: head_dim {H} has halves that are not a power "
                         f"of two ≥ 16")
    caches = tuple(caches_k) + tuple(caches_v)
    norms = tuple(k_norms) if k_norms is not None else ()
    kernel = functools.partial(_context_kernel, layers=L, normed=k_norms is not None,
                               batch=B, seq=S, kv_heads=Kh, eps=eps)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params = plgpu.CompilerParams(num_warps=1, num_stages=1)
    ins = (rows.astype(jnp.int32), positions.astype(jnp.int32), kv,
           inv_freq.astype(jnp.float32), *norms)
    out = pl.pallas_call(
        kernel, grid=(W,),
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={len(ins) + i: i for i in range(2 * L)},
        compiler_params=params, interpret=interpret, name="cache_write_context_rows",
    )(*ins, *caches)
    return tuple(out[:L]), tuple(out[L:])


def ref_write_context_rows(caches_k: tuple[jax.Array, ...], caches_v: tuple[jax.Array, ...],
                           rows: jax.Array, positions: jax.Array, kv: jax.Array,
                           k_norms: tuple[jax.Array, ...] | None, inv_freq: jax.Array, *,
                           eps: float
                           ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The oracle: each layer's keys normed (`pallas_kernels.norms.ref_rms_norm`) and rotated
    in XLA, then `ref_write_rows`."""
    from pallas_kernels.norms import ref_rms_norm

    _check_context(caches_k, caches_v, rows, positions, kv, k_norms, inv_freq)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)                               # [T, H/2]
    dtype = caches_k[0].dtype
    ks = [kv[:, layer, 0].astype(dtype) for layer in range(len(caches_k))]      # [T, Kh, H]
    if k_norms is not None:
        ks = [ref_rms_norm(k, w, eps) for k, w in zip(ks, k_norms)]
    ks = [ref_rotate_half(k, cos[:, None], sin[:, None]) for k in ks]
    vs = [kv[:, layer, 1] for layer in range(len(caches_k))]
    return ref_write_rows(caches_k, caches_v, rows, positions, jnp.stack(ks), jnp.stack(vs))
