"""A decoding layer's products of a few rows with the work before them in the same kernel
(Triton): the residual sum and RMS norm before the q/k/v and gate/up products, the SwiGLU
activation before the down product, the merge of the attention's cache splits before the o
product (SPEC §1–2, the target's forward while decoding and verifying).

While a layer decodes a few tokens a row, each product reads its weight once and every
kernel around it costs its launch, ramp and tail for a few kilobytes. XLA runs the residual
sum with the norm, and the activation, as kernels of their own, and the attention's merge is
a kernel of its own; here the product's programs compute them as they load their rows:

  `norm_gemm`    s = h + delta (delta a row, the f32 parts of a split-K product, or none) and
                 RMSNorm(s) · weight @ w (one weight or two, read where they lie), one program
                 per tile of output columns, each taking the whole contraction:
                 → (s [R, D], the product [R, N]).
  `swiglu_gemm`  (silu(gate) · up) @ w for the gate/up product [R, 2F], split along the
                 contraction into parts whose f32 sums the next kernel adds up (`norm_gemm`,
                 `pallas_kernels.norms.add_rms_norm`): → [parts, R, N].
  `merge_gemm`   attention @ w from the attention kernel's cache splits
                 (`decode_attention.layer_attention(merge=False)`), each head merged as the
                 merge kernel merges it, its rows every (row, token) or gathered cells:
                 → [parts, rows, N].
  `ref_norm_gemm`, `ref_swiglu_gemm`, `ref_merge_gemm`  the pure-JAX oracles, XLA's
                 arithmetic and roundings.

Rows (R ≤ `MAX_ROWS`) are read as one power-of-two tile of at least 16 (the tensor cores'
smallest), the rows past R masked. Every program of `norm_gemm` reads the whole of its rows to
take their norm, and every program of `merge_gemm` its heads' splits: some percent more bytes,
from the L2, than the weights it streams. Nothing here imports dspark_jax.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import MASKED_SCORE, load_rows, next_pow2

__all__ = ["MAX_ROWS", "merge_gemm", "merge_parts", "norm_gemm", "ref_merge_gemm",
           "ref_norm_gemm", "ref_swiglu_gemm", "swiglu_gemm", "swiglu_parts"]

#: the most rows a call takes (a verification block of 64 query rows)
MAX_ROWS = 64
#: programs a call aims at: about one a multiprocessor of an H100 / H200 (132)
TARGET_PROGRAMS = 128


#: shared memory the pipelined loads of a program may take (an H100 / H200 has 228 KB)
STAGE_BYTES = 160 * 1024
_DEPTHS = (128, 64, 32, 16)


def _compiler_params(interpret: bool, num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plgpu

    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _depth_and_stages(depth: int, row_bytes: int, w_bytes: int, num_stages: int,
                      exact: bool, loops: int = 1) -> tuple[int | None, int]:
    """The contraction step (the widest of `_DEPTHS` dividing `depth` whose loads fit two
    pipeline stages in a loop's share of `STAGE_BYTES`, else the narrowest dividing it) and
    the stages its loads fit, at most `num_stages`. A step's loads: `row_bytes` (the rows'
    tile, the parts of a delta included) and `w_bytes` (the weight tile) per unit of depth.
    Triton keeps every load of a loop in shared memory once per stage, and each of the
    kernel's `loops` product loops (one a weight, each in a branch of its own) its own; an
    fp32 product at full precision takes its tiles more than twice over (read off the
    deviceless compile's shared-memory check), counted 3×."""
    fits = [k for k in _DEPTHS if depth % k == 0]
    if not fits:
        return None, 1
    budget = STAGE_BYTES // loops
    per = (row_bytes + w_bytes) * (3 if exact else 1)
    k = next((k for k in fits if 2 * k * per <= budget), fits[-1])
    return k, max(1, min(num_stages, budget // (k * per)))


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b accumulated in f32 (fp32 tiles at full precision, never TF32)."""
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return jnp.dot(a, b, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST if exact else None)


def _store_rows(ref, x: jax.Array, n: int, cols) -> None:
    from jax.experimental.pallas import triton as plgpu

    ok = lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0) < n
    plgpu.store(ref.at[pl.ds(0, x.shape[0]), cols], x.astype(ref.dtype), mask=ok)


# ------------------------------------------------------------------------------ norm_gemm

def _norm_gemm_kernel(*refs, rows: int, tile: int, parts: int | None, eps: float,
                      block_k: int, has_h: bool, has_delta: bool, first_tiles: tuple[int, ...]):
    """One tile of output columns: the rows' sum s (program 0 stores it), its norm, then the
    product over the whole contraction, `block_k` at a time, with the weight whose columns
    the tile is (`first_tiles`: each weight's first tile, the first weight's 0). Without h
    (`has_h` False) s is the delta's parts summed."""
    refs = list(refs)
    h_ref = refs.pop(0) if has_h else None
    d_ref = refs.pop(0) if has_delta else None
    nw_ref, *w_refs, s_ref, y_ref = refs
    dim = s_ref.shape[1]
    dtype = s_ref.dtype
    steps = dim // block_k

    def summed(i):   # s's columns [i·block_k, +block_k) in f32, rounded as XLA rounds
        cols = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        if not has_delta:
            return cols, load_rows(h_ref, rows, tile, cols).astype(jnp.float32)
        if parts is None:
            d = load_rows(d_ref, rows, tile, cols).astype(jnp.float32)
        else:   # the f32 sum of a split-K product's parts, rounded as the product would be
            d = functools.reduce(operator.add, (load_rows(d_ref, rows, tile, cols, part=p)
                                                for p in range(parts)))
            d = d.astype(dtype).astype(jnp.float32)
        if not has_h:
            return cols, d
        s = (load_rows(h_ref, rows, tile, cols).astype(jnp.float32) + d).astype(dtype)
        return cols, s.astype(jnp.float32)

    def squares(i, acc):
        _, s = summed(i)
        return acc + jnp.sum(s * s, axis=1, keepdims=True)

    ss = lax.fori_loop(0, steps, squares, jnp.zeros((tile, 1), jnp.float32))
    r = lax.rsqrt(ss / dim + eps)                                             # [tile, 1]
    j = pl.program_id(0)

    def product(w_ref, i, acc):
        cols, s = summed(i)

        @pl.when(j == 0)
        def _():
            _store_rows(s_ref, s, rows, cols)

        nw = nw_ref[cols].astype(dtype).astype(jnp.float32)
        x = (nw[None, :] * (s * r).astype(dtype).astype(jnp.float32)).astype(dtype)
        return acc + _dot(x, w_ref[cols, :].astype(dtype))

    def with_weight(w_ref):
        return lambda: lax.fori_loop(0, steps, functools.partial(product, w_ref),
                                     jnp.zeros((tile, y_ref.shape[1]), jnp.float32))

    acc = with_weight(w_refs[-1])
    for first, w_ref in zip(first_tiles[:0:-1], w_refs[-2::-1]):   # the tile's own weight
        acc = functools.partial(lax.cond, j < first, with_weight(w_ref), acc)
    _store_rows(y_ref, acc(), rows, slice(None))


@functools.partial(jax.jit, static_argnames=("eps", "block_n", "block_k", "interpret",
                                             "num_warps", "num_stages"))
def norm_gemm(h: jax.Array | None, delta: jax.Array | None, weight: jax.Array,
              w: jax.Array | tuple[jax.Array, ...], *, eps: float, block_n: int | None = None,
              block_k: int | None = None, interpret: bool = False, num_warps: int = 4,
              num_stages: int = 3) -> tuple[jax.Array, jax.Array]:
    """(s, RMSNorm(s) · weight @ w) with s = h + delta: h [R, D] (the dtype of everything),
    delta [R, D] or the f32 parts of a split-K product [parts, ≥ R, D] (summed, rounded to
    h's dtype, then added: `pallas_kernels.norms.add_rms_norm`'s arithmetic), weight [D],
    w [D, N] → (s [R, D], product [R, N]), the product accumulated in f32 and rounded.
    `delta` None: s = h (a row summed already). `h` None: s = the delta, split-K parts
    [parts, R, D] summed and rounded to `weight`'s dtype (a product's norm: the drafter's
    context, fc(features)). `w` may be several weights [D, N_i], each read where it lies: the
    product is theirs with their columns concatenated, [R, ΣN_i].

    One program per `block_n` output columns (default `_columns`), each reading the contraction
    `block_k` at a time (default `_depth_and_stages`)."""
    if h is None and (delta is None or delta.ndim != 3):
        raise ValueError("norm_gemm: without h, delta must be a product's parts [parts, R, D]")
    R, D = h.shape if h is not None else delta.shape[1:]
    dtype = h.dtype if h is not None else weight.dtype
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    widths = [x.shape[-1] for x in ws]
    N = sum(widths)
    parts = delta.shape[0] if delta is not None and delta.ndim == 3 else None
    rows_ok = (delta is None or (delta.shape == h.shape if parts is None else
                                 delta.dtype == jnp.float32 and delta.shape[1] >= R
                                 and delta.shape[2] == D))
    block_n = block_n or _columns(N, widths)
    tile = max(16, next_pow2(R))
    size = jnp.dtype(dtype).itemsize
    step, stages = _depth_and_stages(
        D, tile * ((size if h is not None else 0)
                   + (4 * parts if parts else size if delta is not None else 0)),
        (block_n or 16) * size, num_stages, jnp.dtype(dtype) == jnp.float32, len(ws))
    block_k = block_k or step
    if ((h is not None and h.ndim != 2) or not rows_ok or weight.shape != (D,)
            or any(x.shape != (D, n) for x, n in zip(ws, widths))
            or not 1 <= R <= MAX_ROWS or block_k is None or block_n is None
            or D % block_k or any(n % block_n for n in widths)):
        raise ValueError(f"norm_gemm: h must be [R ≤ {MAX_ROWS}, D], delta [R, D] or f32 "
                         f"[parts, ≥ R, D], weight [D], each w [D, N], D and N "
                         f"multiples of 16: {None if h is None else h.shape}, "
                         f"{None if delta is None else (delta.shape, delta.dtype)}, "
                         f"{weight.shape}, {[x.shape for x in ws]}")
    whole = lambda x: pl.BlockSpec(x.shape, lambda j: (0,) * x.ndim)   # noqa: E731
    deltas = [] if delta is None else [delta if parts is not None else delta.astype(dtype)]
    hs = [] if h is None else [h]
    firsts = tuple(sum(widths[:i]) // block_n for i in range(len(ws)))

    def weight_tiles(first: int, tiles: int) -> pl.BlockSpec:   # a program's tile of its weight
        return pl.BlockSpec((D, block_n), lambda j: (0, jnp.clip(j - first, 0, tiles - 1)))

    s, y = pl.pallas_call(
        functools.partial(_norm_gemm_kernel, rows=R, tile=tile, parts=parts, eps=eps,
                          block_k=block_k, has_h=h is not None, has_delta=delta is not None,
                          first_tiles=firsts),
        grid=(N // block_n,),
        in_specs=[*map(whole, hs), *map(whole, deltas), whole(weight),
                  *(weight_tiles(f, n // block_n) for f, n in zip(firsts, widths))],
        out_specs=[pl.BlockSpec((R, D), lambda j: (0, 0)),
                   pl.BlockSpec((R, block_n), lambda j: (0, j))],
        out_shape=[jax.ShapeDtypeStruct((R, D), dtype), jax.ShapeDtypeStruct((R, N), dtype)],
        compiler_params=_compiler_params(interpret, num_warps, stages),
        interpret=interpret, name="norm_gemm",
    )(*hs, *deltas, weight, *ws)
    return s, y


def _columns(n: int, widths: list[int] | None = None) -> int | None:
    """The output tile of a product with n columns (of weights `widths` wide, each a whole
    number of tiles): the widest of 128, 64, 32 dividing them that leaves `TARGET_PROGRAMS`
    programs, else the narrowest of 32, 16 dividing them (a program's weight rows stay at
    least 32 bytes, a memory sector)."""
    fits = [b for b in (128, 64, 32, 16) if all(x % b == 0 for x in widths or [n])]
    wide = [b for b in fits if b >= 32 and n // b >= TARGET_PROGRAMS]
    return wide[0] if wide else next((b for b in fits if b <= 32), None)


# ------------------------------------------------------------------------------ swiglu_gemm

def _round(x: jax.Array, dtype) -> jax.Array:
    """x rounded to `dtype`, back in f32."""
    return x.astype(dtype).astype(jnp.float32)


def _silu_sigmoid(g: jax.Array, dtype) -> jax.Array:
    """1 / (1 + exp(−g)) in f32, each step rounded to `dtype` as `jax.nn.silu`'s ops round
    in that dtype."""
    g = g.astype(jnp.float32)
    return _round(1.0 / _round(1.0 + _round(jnp.exp(-g), dtype), dtype), dtype)


def _swiglu_kernel(gu_ref, w_ref, out_ref, *, rows: int, tile: int, hidden: int,
                   block_k: int):
    """One (column tile, part): the part's contraction `block_k` at a time, each chunk's
    activation silu(gate) · up taken as it is loaded."""
    chunk = w_ref.shape[0]
    lo = pl.program_id(1) * chunk
    dtype = gu_ref.dtype

    def product(i, acc):
        at = lo + i * block_k
        g = load_rows(gu_ref, rows, tile, pl.ds(pl.multiple_of(at, block_k), block_k))
        u = load_rows(gu_ref, rows, tile, pl.ds(pl.multiple_of(hidden + at, block_k), block_k))
        g = g.astype(jnp.float32)
        a = (_round(g * _silu_sigmoid(g, dtype), dtype) * u.astype(jnp.float32)).astype(dtype)
        w = w_ref[pl.ds(pl.multiple_of(i * block_k, block_k), block_k), :].astype(dtype)
        return acc + _dot(a, w)

    acc = lax.fori_loop(0, chunk // block_k, product,
                        jnp.zeros((tile, out_ref.shape[-1]), jnp.float32))
    _store_rows(out_ref, acc, rows, slice(None))


def swiglu_parts(hidden: int, columns: int) -> int:
    """The parts `swiglu_gemm` splits a [·, hidden] @ [hidden, columns] product into:
    enough for about `TARGET_PROGRAMS` programs, at most 8, each part a whole number of 16
    rows of w deep."""
    n_tiles = columns // (_columns(columns) or columns)
    parts = 1
    while (parts < 8 and n_tiles * parts < TARGET_PROGRAMS
           and hidden % (2 * parts * 16) == 0):
        parts *= 2
    return parts


@functools.partial(jax.jit, static_argnames=("parts", "block_n", "block_k", "interpret",
                                             "num_warps", "num_stages"))
def swiglu_gemm(gu: jax.Array, w: jax.Array, *, parts: int | None = None,
                block_n: int | None = None, block_k: int | None = None,
                interpret: bool = False, num_warps: int = 4, num_stages: int = 3) -> jax.Array:
    """(silu(gate) · up) @ w for gu = [gate | up] [R, 2F] and w [F, N] (gu's dtype), the
    activation rounded as XLA rounds it: → the f32 parts [parts, R, N] of the product split
    along F (default `swiglu_parts`), for the kernel that reads it to sum."""
    R, two_f = gu.shape
    F = two_f // 2
    N = w.shape[-1]
    parts = parts or swiglu_parts(F, N)
    block_n = block_n or _columns(N)
    chunk = F // parts if parts and F % parts == 0 else 0
    tile = max(16, next_pow2(R))
    size = jnp.dtype(gu.dtype).itemsize
    step, stages = _depth_and_stages(chunk, 2 * tile * size, (block_n or 16) * size, num_stages,
                                     jnp.dtype(gu.dtype) == jnp.float32)
    block_k = block_k or step
    if (gu.ndim != 2 or two_f % 2 or w.shape != (F, N) or not 1 <= R <= MAX_ROWS
            or block_n is None or N % block_n or not chunk or block_k is None
            or chunk % block_k):
        raise ValueError(f"swiglu_gemm: gu must be [R ≤ {MAX_ROWS}, 2F], w [F, N], N a "
                         f"multiple of 16 and F of 16 × {parts} parts: {gu.shape}, {w.shape}")
    return pl.pallas_call(
        functools.partial(_swiglu_kernel, rows=R, tile=tile, hidden=F, block_k=block_k),
        grid=(N // block_n, parts),
        in_specs=[pl.BlockSpec(gu.shape, lambda j, p: (0, 0)),
                  pl.BlockSpec((chunk, block_n), lambda j, p: (p, j))],
        out_specs=pl.BlockSpec((None, R, block_n), lambda j, p: (p, 0, j)),
        out_shape=jax.ShapeDtypeStruct((parts, R, N), jnp.float32),
        compiler_params=_compiler_params(interpret, num_warps, stages),
        interpret=interpret, name="swiglu_gemm",
    )(gu, w)


# ------------------------------------------------------------------------------ merge_gemm

def _merge_gemm_kernel(o_ref, m_ref, l_ref, *refs, batch: int, tokens: int, tile_b: int,
                       group: int, heads: int, splits: int, dtype, gathered: bool):
    """One (column tile, part): the part's query heads one at a time, each head's cache splits
    merged under their shared maximum (`decode_attention`'s merge) for every row, rounded to
    `dtype`, and multiplied into the head's rows of w. The rows: every (row, token) of the
    partials ([tile_b, Tp] at once), or (`gathered`) the `tokens` cells (row, token) the two
    index refs name ([tile_b] at once)."""
    from jax.experimental.pallas import triton as plgpu

    if gathered:
        b_ref, t_ref, w_ref, out_ref = refs
        tp = 1
        cell = lax.broadcasted_iota(jnp.int32, (tile_b,), 0)
        ok = cell < tokens
        b_idx = plgpu.load(b_ref.at[pl.ds(0, tile_b)], mask=ok, other=0)
        t_idx = plgpu.load(t_ref.at[pl.ds(0, tile_b)], mask=ok, other=0)
        ok = ok.reshape(tile_b, 1)
    else:
        w_ref, out_ref = refs
        tp = o_ref.shape[3]
        bt = lax.broadcasted_iota(jnp.int32, (tile_b, tp), 0)
        ok = (bt < batch) & (lax.broadcasted_iota(jnp.int32, (tile_b, tp), 1) < tokens)
    hd = o_ref.shape[5]
    first = pl.program_id(1) * heads

    def load(ref, kh, split, g, other):   # a head's [tile_b, tp(, H)] block of one split
        if gathered:   # every index an array (the interpreter gathers no mixed slices)
            if ref.ndim == 5:
                x = plgpu.load(ref.at[(b_idx, kh, split, t_idx, g)], mask=ok[:, 0], other=other)
            else:
                cols = lax.broadcasted_iota(jnp.int32, (1, hd), 1)
                x = plgpu.load(ref.at[(b_idx[:, None], kh, split, t_idx[:, None], g, cols)],
                               mask=ok, other=other)
            return x.reshape(tile_b, 1, *x.shape[1:])
        mask = ok if ref.ndim == 5 else ok[..., None]
        return plgpu.load(ref.at[(pl.ds(0, tile_b), kh, split, pl.ds(0, tp), g)], mask=mask,
                          other=other)

    def head(i, acc):
        n = first + i
        kh, g = n // group, n % group

        def top(split, t):
            return jnp.maximum(t, load(m_ref, kh, split, g, MASKED_SCORE))

        mx = lax.fori_loop(0, splits, top, jnp.full((tile_b, tp), MASKED_SCORE, jnp.float32))

        def part(split, carry):
            num, den = carry
            w = jnp.exp2(load(m_ref, kh, split, g, MASKED_SCORE) - mx)
            o = load(o_ref, kh, split, g, 0.0)
            return num + o * w[..., None], den + load(l_ref, kh, split, g, 0.0) * w

        num, den = lax.fori_loop(0, splits, part, (jnp.zeros((tile_b, tp, hd), jnp.float32),
                                                   jnp.zeros((tile_b, tp), jnp.float32)))
        merged = (num / jnp.where(den > 0, den, 1.0)[..., None]).astype(dtype)
        rows = pl.ds(pl.multiple_of(i * hd, hd), hd)
        return acc + _dot(merged.reshape(tile_b * tp, hd), w_ref[rows, :].astype(dtype))

    acc = lax.fori_loop(0, heads, head,
                        jnp.zeros((tile_b * tp, out_ref.shape[-1]), jnp.float32))
    if gathered:
        plgpu.store(out_ref.at[pl.ds(0, tile_b), :], acc, mask=ok)
    else:
        plgpu.store(out_ref.at[pl.ds(0, tile_b), pl.ds(0, tp), :],
                    acc.reshape(tile_b, tp, -1), mask=ok[..., None])


def merge_parts(columns: int, heads: int) -> int:
    """The parts `merge_gemm` splits its query heads into: enough for about
    `TARGET_PROGRAMS` programs of 128-column tiles, at most 8, dividing the heads."""
    tiles = max(1, columns // 128)
    parts = 1
    while parts < 8 and tiles * parts < TARGET_PROGRAMS and heads % (2 * parts) == 0:
        parts *= 2
    return parts


@functools.partial(jax.jit, static_argnames=("num_tokens", "dtype", "parts", "block_n",
                                             "interpret", "num_warps", "num_stages"))
def merge_gemm(o: jax.Array, m: jax.Array, l: jax.Array, w: jax.Array, *, num_tokens: int,
               dtype, cells: tuple[jax.Array, jax.Array] | None = None,
               parts: int | None = None, block_n: int | None = None, interpret: bool = False,
               num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """attention @ w with the attention given as its cache splits' partial softmaxes (o
    [B, Kh, P, Tp·G, H], m and l [B, Kh, P, Tp·G], base 2: `decode_attention.layer_attention`
    with `merge=False`) and w [N·H, D], N = Kh·G query heads: each head's splits merged
    as `decode_attention`'s merge kernel merges them and rounded to `dtype`, then the product
    over the heads split into `parts` (default `merge_parts`) → f32 [parts, B, T, D] for the
    kernel that reads it to sum (T = `num_tokens` ≤ Tp). One kernel where the merge and the
    product take two. `cells` = (row [K], token [K]) int32: the product of those K cells
    only, in their order, → [parts, K, D] (a verification's admitted tokens, gathered from
    its per-request grid; K = `num_tokens` ≤ `MAX_ROWS`)."""
    B, Kh, P, Mp, H = o.shape
    D = w.shape[-1]
    N = w.shape[0] // H if H else 0
    G = N // Kh if Kh else 0
    Tp = Mp // G if G else 0
    parts = parts or merge_parts(D, N)
    block_n = block_n or block_for(D)
    gathered = cells is not None
    tile_b = (max(16, next_pow2(num_tokens)) if gathered
              else max(next_pow2(B), 16 // max(Tp, 1)))
    rows_ok = (tile_b <= MAX_ROWS and all(c.shape == (num_tokens,) for c in cells)
               if gathered else 1 <= num_tokens <= Tp and tile_b * Tp <= MAX_ROWS)
    if (m.shape != o.shape[:4] or l.shape != m.shape or w.shape != (N * H, D) or G * Kh != N
            or Tp * G != Mp or not rows_ok or N % parts or block_n is None):
        raise ValueError(f"merge_gemm: o must be [B, Kh, P, Tp·G, H], m and l [B, Kh, P, Tp·G], "
                         f"w [Kh·G·H, D] (D a multiple of 16), B·Tp ≤ {MAX_ROWS}, 1 ≤ "
                         f"num_tokens ≤ Tp: {o.shape}, {m.shape}, {l.shape}, {w.shape}, "
                         f"num_tokens={num_tokens}")
    heads = N // parts
    six = lambda x: x.reshape(B, Kh, P, Tp, G, *x.shape[4:])   # noqa: E731
    whole = lambda x: pl.BlockSpec(x.shape, lambda j, p: (0,) * x.ndim)   # noqa: E731
    o6, m6, l6 = six(o), six(m), six(l)
    index = [c.astype(jnp.int32) for c in cells] if gathered else []
    rows = (num_tokens,) if gathered else (B, num_tokens)
    return pl.pallas_call(
        functools.partial(_merge_gemm_kernel, batch=B, tokens=num_tokens, tile_b=tile_b,
                          group=G, heads=heads, splits=P, dtype=jnp.dtype(dtype),
                          gathered=gathered),
        grid=(D // block_n, parts),
        in_specs=[whole(o6), whole(m6), whole(l6), *map(whole, index),
                  pl.BlockSpec((heads * H, block_n), lambda j, p: (p, j))],
        out_specs=pl.BlockSpec((None, *rows, block_n), lambda j, p: (p, *(0,) * len(rows), j)),
        out_shape=jax.ShapeDtypeStruct((parts, *rows, D), jnp.float32),
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        interpret=interpret, name="merge_gemm",
    )(o6, m6, l6, *index, w)


def block_for(n: int) -> int | None:
    """The widest of `_DEPTHS` dividing n."""
    return next((b for b in _DEPTHS if n % b == 0), None)


# ------------------------------------------------------------------------------ oracles

def ref_norm_gemm(h: jax.Array | None, delta: jax.Array | None, weight: jax.Array,
                  w: jax.Array | tuple[jax.Array, ...], *, eps: float
                  ) -> tuple[jax.Array, jax.Array]:
    from pallas_kernels.norms import ref_add_rms_norm, ref_rms_norm

    if h is None:   # the parts' sum alone
        h, delta = delta.sum(axis=0).astype(weight.dtype), None

    s, x = (h, ref_rms_norm(h, weight, eps)) if delta is None else ref_add_rms_norm(
        h, delta, weight, eps=eps)
    w = jnp.concatenate(w, axis=-1) if isinstance(w, (tuple, list)) else w
    return s, jnp.einsum("RD,DN->RN", x, w.astype(h.dtype),
                         preferred_element_type=jnp.float32).astype(h.dtype)


def ref_swiglu_gemm(gu: jax.Array, w: jax.Array, *, parts: int) -> jax.Array:
    gate, up = jnp.split(gu, 2, axis=-1)
    a = jax.nn.silu(gate) * up                                               # [R, F]
    R, F = a.shape
    return jnp.einsum("RPK,PKN->PRN", a.reshape(R, parts, F // parts),
                      w.astype(gu.dtype).reshape(parts, F // parts, -1),
                      preferred_element_type=jnp.float32)


def ref_merge_gemm(o: jax.Array, m: jax.Array, l: jax.Array, w: jax.Array, *,
                   num_tokens: int, dtype, parts: int,
                   cells: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    B, Kh, P, Mp, H = o.shape
    top = jnp.max(m, axis=2, keepdims=True)
    wt = jnp.exp2(m - top)
    den = jnp.sum(l * wt, axis=2)                                            # [B, Kh, Mp]
    num = jnp.sum(o * wt[..., None], axis=2)                                 # [B, Kh, Mp, H]
    attn = (num / jnp.where(den > 0, den, 1.0)[..., None]).astype(dtype)
    N = w.shape[0] // H
    G = N // Kh
    attn = jnp.transpose(attn.reshape(B, Kh, Mp // G, G, H), (0, 2, 1, 3, 4))  # [B,Tp,Kh,G,H]
    attn = attn[cells][None] if cells is not None else attn[:, :num_tokens]
    attn = attn.reshape(*attn.shape[:2], parts, N // parts * H)
    out = jnp.einsum("BTPK,PKD->PBTD", attn, w.astype(dtype).reshape(parts, N // parts * H, -1),
                     preferred_element_type=jnp.float32)
    return out[:, 0] if cells is not None else out
