"""Pallas kernel for lossless speculative verification (SPEC §1 steps 4–5).

One program per batch row. It walks the ℓ verified slots left to right doing the ratio test
u_k·p_d(x_k) < p_t(x_k) (two scalar loads per slot), stops at the first rejection j, then
samples the emitted token from row j: the residual max(p_t − p_d, 0) (p_t when its mass is
≤ 1e-8, or when all ℓ were accepted and row j = ℓ is the bonus row) by inverse CDF over V tiles:
pass 1 sums the masses, pass 2 runs a tiled prefix sum and counts CDF entries ≤ u·mass.

One algorithm body (`_verify_body`) runs on two access layers: Triton (`_verify_kernel`, plain
refs) and TPU / Mosaic (`_verify_kernel_tpu`: probabilities stay in HBM, p(x_k) is read from a
DMA'd 128-lane window, V tiles are DMA'd into VMEM, the prefix sum is a triangular matmul, the
per-row scalars live in SMEM). Triton constraints honoured: every load/store is a power-of-two
vector (V is zero-padded to a multiple of the tile, γ to a power of two), no dynamic shapes,
boolean outputs are stored as int32. `ref_verify` is the pure-JAX oracle (the standard
speculative-sampling rule, vectorised, its inverse CDF searched in tiles as well:
`pallas_kernels.common.inverse_cdf_from_tiles`): the kernel consumes the same uniforms, so
tokens and counts agree exactly (barring a uniform landing within f32 rounding of a CDF step,
where the two sum in different orders).
Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import inverse_cdf_from_tiles, prefix_sums, tile_sums, tile_width

__all__ = ["BACKENDS", "DEFAULT_BLOCK_V", "RESIDUAL_EPS", "VerifyResult", "verify", "ref_verify",
           "check_verify_inputs", "default_backend"]

# Residual mass below which the correction is drawn from p_t instead (SPEC §1 step 5).
RESIDUAL_EPS = 1e-8


class VerifyResult(NamedTuple):
    """Outcome of verifying one round for every batch row."""

    num_accepted: jax.Array   # [B] int32 in [0, ℓ]
    next_token: jax.Array     # [B] int32: correction at the first rejected slot, or the bonus
    accepted_mask: jax.Array  # [B, γ] bool: a prefix of length num_accepted

# Tile over the vocabulary. Untuned (no GPU was available when written): 1024 f32 per tile keeps
# the two live vectors of pass 2 in registers with 4 warps.
DEFAULT_BLOCK_V = 1024
DEFAULT_NUM_WARPS = 4


def check_verify_inputs(accept_u: jax.Array, sample_u: jax.Array, target_probs: jax.Array,
                        draft_probs: jax.Array, draft_tokens: jax.Array,
                        verify_len: jax.Array) -> tuple[int, int, int]:
    """Validates shapes/dtypes; returns (B, γ, V)."""
    if target_probs.ndim != 3:
        raise ValueError(f"target_probs must be [B, γ+1, V], got shape {target_probs.shape}")
    B, G1, V = target_probs.shape
    G = G1 - 1
    if G < 1:
        raise ValueError(f"need γ ≥ 1 draft slots (target_probs has {G1} rows, expected γ+1)")
    expected = {
        "draft_probs": (draft_probs, (B, G, V)),
        "draft_tokens": (draft_tokens, (B, G)),
        "verify_len": (verify_len, (B,)),
        "accept_u": (accept_u, (B, G)),
        "sample_u": (sample_u, (B,)),
    }
    for name, (arr, shape) in expected.items():
        if tuple(arr.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (B={B}, γ={G}, V={V}), "
                             f"got {tuple(arr.shape)}")
    for name, arr in (("target_probs", target_probs), ("draft_probs", draft_probs),
                      ("accept_u", accept_u), ("sample_u", sample_u)):
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {arr.dtype}")
    for name, arr in (("draft_tokens", draft_tokens), ("verify_len", verify_len)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {arr.dtype}")
    return B, G, V


def ref_verify(accept_u: jax.Array, sample_u: jax.Array, target_probs: jax.Array,
               draft_probs: jax.Array, draft_tokens: jax.Array, verify_len: jax.Array
               ) -> VerifyResult:
    """Pure-JAX oracle with the kernel's signature.

    Accept draft x_k (k < ℓ) iff u_k · p_d(x_k) < p_t(x_k), stop at the first rejection n, then
    draw the emitted token from norm(max(p_t,n − p_d,n, 0)) (p_t,n if that mass ≤ RESIDUAL_EPS)
    or, when all ℓ were accepted, the bonus from p_t,ℓ — inverse CDF with sample_u.
    """
    B, G, V = check_verify_inputs(accept_u, sample_u, target_probs, draft_probs, draft_tokens,
                                  verify_len)
    tp = target_probs.astype(jnp.float32)                                    # [B, γ+1, V]
    dp = draft_probs.astype(jnp.float32)                                     # [B, γ, V]
    ell = jnp.clip(verify_len.astype(jnp.int32), 0, G)                       # [B]
    x = jnp.clip(draft_tokens.astype(jnp.int32), 0, V - 1)                   # [B, γ]
    pt_x = jnp.take_along_axis(tp[:, :G], x[..., None], axis=-1)[..., 0]     # [B, γ]
    pd_x = jnp.take_along_axis(dp, x[..., None], axis=-1)[..., 0]            # [B, γ]
    slot = jnp.arange(G, dtype=jnp.int32)[None]
    ok = (accept_u.astype(jnp.float32) * pd_x < pt_x) & (slot < ell[:, None])
    # n, the first rejection: the count of leading accepts, unrolled over the static γ
    # (elementwise, so XLA computes it inside the fusions that read it)
    run = ok[:, 0]
    n = run.astype(jnp.int32)
    for k in range(1, G):
        run = run & ok[:, k]
        n = n + run.astype(jnp.int32)
    pt_n = jnp.take_along_axis(tp, n[:, None, None], axis=1)[:, 0]           # [B, V]
    pd_n = jnp.take_along_axis(dp, jnp.minimum(n, G - 1)[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(pt_n - pd_n, 0.0)                                    # [B, V]
    # the kernel's two passes: tile masses of both candidate rows, then the tiled search
    block = tile_width(V)
    sums = tile_sums(jnp.stack([resid, pt_n]), block)                      # [2, B, tiles]
    cdf = prefix_sums(sums)
    use_resid = ((n < ell) & (cdf[0, :, -1] > RESIDUAL_EPS))[:, None]
    pick = lambda res, pt: jnp.where(use_resid, res, pt)  # noqa: E731
    return VerifyResult(n, inverse_cdf_from_tiles(pick(resid, pt_n), pick(*cdf), sample_u, block),
                        slot < n[:, None])


class _Access(NamedTuple):
    """How the shared body reaches its operands (plain refs on Triton, DMAs on TPU)."""

    prob_at: Callable     # (which "t"/"d", k, x) → p[k, x] as [1, 1] f32
    tile: Callable        # (which, k, i) → p[k, tile i] as [1, BV] f32
    prefix_sum: Callable  # [1, BV] → inclusive prefix sums
    token: Callable       # k → draft token x_k (int scalar)
    accept_u: Callable    # k → u_k as [1, 1] f32


def _verify_body(acc: _Access, ell, sample_u, *, gamma: int, vocab: int, n_tiles: int,
                 block_v: int):
    """One row: ratio tests, then the correction/bonus draw. Returns (n, next_token) scalars.

    ell: clipped verify length (scalar); sample_u [1, 1] f32.
    """
    def ratio_test(k, carry):
        n, alive = carry
        x = jnp.clip(acc.token(k), 0, vocab - 1)
        ok = (acc.accept_u(k) * acc.prob_at("d", k, x) < acc.prob_at("t", k, x))
        ok = jnp.sum((ok & (k < ell)).astype(jnp.int32)) * alive   # scalar 0/1
        return n + ok, ok

    n, _ = jax.lax.fori_loop(0, gamma, ratio_test, (jnp.int32(0), jnp.int32(1)))
    jd = jnp.minimum(n, gamma - 1)  # draft row paired with p_t,n (unused for the bonus row)
    row_sum = lambda x: jnp.sum(x, axis=1, keepdims=True)  # noqa: E731
    row_max = lambda x: jnp.max(x, axis=1, keepdims=True)  # noqa: E731
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, block_v), 1)

    def tile(i):
        pt = acc.tile("t", n, i)                                             # [1, BV]
        return pt, jnp.maximum(pt - acc.tile("d", jd, i), 0.0)

    def masses(i, carry):
        m_res, m_pt = carry
        pt, res = tile(i)
        return m_res + row_sum(res), m_pt + row_sum(pt)

    zero = jnp.zeros((1, 1), jnp.float32)
    m_res, m_pt = jax.lax.fori_loop(0, n_tiles, masses, (zero, zero))
    use_res = (n < ell) & (m_res > RESIDUAL_EPS)                             # [1, 1]
    thr = sample_u * jnp.where(use_res, m_res, m_pt)

    def search(i, carry):
        cum, count, last_pos = carry
        pt, res = tile(i)
        w = jnp.where(use_res, res, pt)
        cdf = cum + acc.prefix_sum(w)
        idx = i * block_v + lane
        count = count + row_sum((cdf <= thr).astype(jnp.int32))
        last_pos = jnp.maximum(last_pos, row_max(jnp.where(w > 0, idx, 0)))
        return row_max(cdf), count, last_pos   # max(cdf) is its last entry: the running total

    izero = jnp.zeros((1, 1), jnp.int32)
    _, count, last_pos = jax.lax.fori_loop(0, n_tiles, search, (zero, izero, izero))
    return n, jnp.sum(jnp.minimum(count, last_pos))


def _verify_kernel(tp_ref, dp_ref, tok_ref, len_ref, au_ref, su_ref,   # inputs
                   nacc_ref, next_ref, mask_ref,                        # outputs
                   *, gamma: int, vocab: int, block_v: int):
    """Triton / interpret. tp [γ+1, Vp], dp [γ, Vp], tok/au/mask [Gp], len/su/nacc/next
    scalars (this row's blocks)."""
    refs = {"t": tp_ref, "d": dp_ref}
    tile = lambda i: pl.ds(pl.multiple_of(i * block_v, block_v), block_v)  # noqa: E731
    acc = _Access(
        prob_at=lambda w, k, x: jnp.reshape(refs[w][k, x].astype(jnp.float32), (1, 1)),
        tile=lambda w, k, i: refs[w][k, tile(i)].astype(jnp.float32)[None, :],
        prefix_sum=lambda w: jnp.cumsum(w, axis=1),
        token=lambda k: tok_ref[k],
        accept_u=lambda k: jnp.reshape(au_ref[k], (1, 1)))
    n, nxt = _verify_body(acc, jnp.clip(len_ref[...], 0, gamma),
                          jnp.reshape(su_ref[...], (1, 1)), gamma=gamma, vocab=vocab,
                          n_tiles=tp_ref.shape[-1] // block_v, block_v=block_v)
    nacc_ref[...] = n
    next_ref[...] = nxt
    slots = jax.lax.broadcasted_iota(jnp.int32, mask_ref.shape, 0)
    mask_ref[...] = (slots < n).astype(jnp.int32)


def _verify_kernel_tpu(tok_ref, len_ref, au_ref, su_ref, tp_hbm, dp_hbm, tri_ref,  # inputs
                       nacc_ref, next_ref, mask_ref,                              # outputs
                       win_t, win_d, tile_t, tile_d,                              # scratch
                       *, gamma: int, vocab: int, block_v: int):
    """TPU (Mosaic), one program per row. Probabilities stay in HBM as [B, γ(+1), 1, Vp] (the
    unit dim keeps row and slot off the tiled dims); p(x_k) comes from a DMA'd 128-lane window,
    tiles are DMA'd synchronously (untuned), the prefix sum is a matmul with the triangular
    ones matrix. tok/au [B, Gp], len/su [B] and the outputs live in SMEM."""
    from jax.experimental.pallas import tpu as pltpu

    b = pl.program_id(0)
    hbm = {"t": tp_hbm, "d": dp_hbm}
    wins, tiles = {"t": win_t, "d": win_d}, {"t": tile_t, "d": tile_d}
    win = win_t.shape[-1]
    lanes = jax.lax.broadcasted_iota(jnp.int32, (1, win), 1)
    tile = lambda i: pl.ds(pl.multiple_of(i * block_v, block_v), block_v)  # noqa: E731

    def prob_at(w, k, x):
        start = pl.multiple_of(jax.lax.div(x, jnp.int32(win)) * win, win)   # x ≥ 0
        pltpu.sync_copy(hbm[w].at[b, k, :, pl.ds(start, win)], wins[w])
        vals = wins[w][...].astype(jnp.float32)
        return jnp.sum(jnp.where(lanes == x - start, vals, 0.0), axis=1, keepdims=True)

    def load_tile(w, k, i):
        pltpu.sync_copy(hbm[w].at[b, k, :, tile(i)], tiles[w])
        return tiles[w][...].astype(jnp.float32)

    def prefix_sum(w):
        return jax.lax.dot_general(w, tri_ref[...], (((1,), (0,)), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)

    acc = _Access(prob_at=prob_at, tile=load_tile, prefix_sum=prefix_sum,
                  token=lambda k: tok_ref[b, k],
                  accept_u=lambda k: jnp.full((1, 1), au_ref[b, k], jnp.float32))
    n, nxt = _verify_body(acc, jnp.clip(len_ref[b], 0, gamma),
                          jnp.full((1, 1), su_ref[b], jnp.float32), gamma=gamma, vocab=vocab,
                          n_tiles=tp_hbm.shape[-1] // block_v, block_v=block_v)
    nacc_ref[b] = n
    next_ref[b] = nxt
    for k in range(mask_ref.shape[1]):
        mask_ref[b, k] = (k < n).astype(jnp.int32)


def _pad_axis(x: jax.Array, axis: int, size: int, value) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


BACKENDS = ("triton", "mosaic")
#: TPU: V tile (lane-aligned) and the window p(x_k) is read from.
TPU_BLOCK_V, TPU_WINDOW = 512, 128


def default_backend() -> str:
    """"mosaic" when JAX's default backend is a TPU, else "triton"."""
    return "mosaic" if jax.default_backend() == "tpu" else "triton"


@functools.partial(jax.jit, static_argnames=("block_v", "interpret", "num_warps", "backend"))
def verify(accept_u: jax.Array, sample_u: jax.Array, target_probs: jax.Array,
           draft_probs: jax.Array, draft_tokens: jax.Array, verify_len: jax.Array, *,
           block_v: int | None = None, interpret: bool = False,
           num_warps: int = DEFAULT_NUM_WARPS, backend: str | None = None) -> VerifyResult:
    """Kernel version of `ref_verify` (same arguments and result).

    accept_u [B, γ], sample_u [B] f32 in [0, 1); target_probs [B, γ+1, V]; draft_probs [B, γ, V]
    (f32 or bf16; computed in f32); draft_tokens [B, γ] int; verify_len [B] int. `backend`:
    "triton" (GPU) or "mosaic" (TPU); default from the JAX backend.
    """
    B, G, V = check_verify_inputs(accept_u, sample_u, target_probs, draft_probs, draft_tokens,
                                  verify_len)
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    tpu = backend == "mosaic"
    if block_v is None:
        block_v = (min(TPU_BLOCK_V, max(TPU_WINDOW, pl.next_power_of_2(V))) if tpu
                   else min(DEFAULT_BLOCK_V, pl.next_power_of_2(V)))
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if tpu and block_v % TPU_WINDOW:
        raise ValueError(f"the TPU kernel needs block_v % {TPU_WINDOW} == 0, got {block_v}")
    Vp = pl.cdiv(V, block_v) * block_v
    Gp = pl.next_power_of_2(G)

    tp = _pad_axis(target_probs, 2, Vp, 0)                                     # [B, γ+1, Vp]
    dp = _pad_axis(draft_probs, 2, Vp, 0)                                      # [B, γ, Vp]
    tok = _pad_axis(draft_tokens.astype(jnp.int32), 1, Gp, 0)                  # [B, Gp]
    au = _pad_axis(accept_u.astype(jnp.float32), 1, Gp, 1.0)                   # [B, Gp]
    su = sample_u.astype(jnp.float32)                                          # [B]
    vlen = verify_len.astype(jnp.int32)                                        # [B]
    out_shape = [jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32),
                 jax.ShapeDtypeStruct((B, Gp), jnp.int32)]

    if tpu:
        from jax.experimental.pallas import tpu as pltpu

        smem = pl.BlockSpec(memory_space=pltpu.SMEM)
        hbm = pl.BlockSpec(memory_space=pl.ANY)
        kernel = functools.partial(_verify_kernel_tpu, gamma=G, vocab=V, block_v=block_v)
        nacc, nxt, mask = pl.pallas_call(
            kernel,
            grid=(B,),
            in_specs=[smem, smem, smem, smem, hbm, hbm,
                      pl.BlockSpec((block_v, block_v), lambda b: (0, 0))],
            out_specs=[smem, smem, smem],
            out_shape=out_shape,
            scratch_shapes=[pltpu.VMEM((1, TPU_WINDOW), tp.dtype),
                            pltpu.VMEM((1, TPU_WINDOW), dp.dtype),
                            pltpu.VMEM((1, block_v), tp.dtype),
                            pltpu.VMEM((1, block_v), dp.dtype)],
            # every row writes its own SMEM entries of whole-array outputs: run the rows in order
            compiler_params=None if interpret else pltpu.CompilerParams(
                dimension_semantics=("arbitrary",)),
            interpret=interpret,
            name="dspark_verify",
        )(tok, vlen, au, su, tp[:, :, None, :], dp[:, :, None, :],
          jnp.triu(jnp.ones((block_v, block_v), jnp.float32)))
        return VerifyResult(nacc, nxt, mask[:, :G] > 0)

    row = lambda b: (b,)  # noqa: E731
    kernel = functools.partial(_verify_kernel, gamma=G, vocab=V, block_v=block_v)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    nacc, nxt, mask = pl.pallas_call(
        kernel,
        grid=(B,),
        in_specs=[
            pl.BlockSpec((None, G + 1, Vp), lambda b: (b, 0, 0)),
            pl.BlockSpec((None, G, Vp), lambda b: (b, 0, 0)),
            pl.BlockSpec((None, Gp), lambda b: (b, 0)),
            pl.BlockSpec((None,), row),
            pl.BlockSpec((None, Gp), lambda b: (b, 0)),
            pl.BlockSpec((None,), row),
        ],
        out_specs=[
            pl.BlockSpec((None,), row),
            pl.BlockSpec((None,), row),
            pl.BlockSpec((None, Gp), lambda b: (b, 0)),
        ],
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params,
        name="dspark_verify",
    )(tp, dp, tok, vlen, au, su)
    return VerifyResult(nacc, nxt, mask[:, :G] > 0)
