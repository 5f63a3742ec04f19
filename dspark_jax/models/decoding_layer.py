"""A Llama / Qwen3 decoder layer's pieces while decoding, as few kernels as a GPU can run them
(SPEC §1–2: the target's forward in the one-token step, the verification of a drafted block and
prefill over a cache).

While decoding a few tokens a row the layer's work is its weights' bytes, and every kernel in
between costs its launch, ramp and tail for kilobytes. On a GPU, for the decoding layout (one
buffer per layer, q/k/v and gate/up fused), a layer runs as five kernels: the residual sum, the
input norm and the q/k/v product in one (`pallas_kernels.row_gemm.norm_gemm`: `input_norm`);
the attention (`pallas_kernels.decode_attention.layer_attention`: the q/k norms, the rotary
embedding, the attention over the cache splits and the token's own keys, and the write of its
K/V rows into the cache); the merge of the splits with the o product (`row_gemm.merge_gemm`:
`attention_and_mlp_input`); the residual sum, the post-attention norm and the gate/up product
in one (`norm_product`); the activation and the down product in one
(`row_gemm.swiglu_gemm`), whose parts the next layer's first kernel sums. A verification's
cells are gathered from its requests' grid in the o product's kernel, and a DSpark / DFlash
drafter's layer runs the same five over its block (`block_attention_and_mlp_input`). A draft
tree's nodes keep the merge a kernel of its own and XLA's o product, split along K
(`split_k_parts`), the kernel that reads it summing its parts, where XLA would sum its own
split in a kernel of its own. Shapes the row kernels do not
take (more than `row_gemm.MAX_ROWS` rows, sizes not a multiple of 16, a mesh of several
devices) keep a kernel for each residual sum and norm (`pallas_kernels.norms.add_rms_norm`),
the products split along K for it to sum.
Elsewhere (CPU, TPU, shapes the kernels do not take, or inside `layers.flash_kernels(False)`)
the same arithmetic runs as XLA ops; a stacked or tensor-parallel layout keeps XLA's attention
and q/k/v product and takes the norm kernels. The branch is chosen
for the platform being compiled for, so an ahead-of-time compile for a GPU takes the kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dspark_jax.models import layers as L
from dspark_jax.models.config import RopeConfig
from dspark_jax.sharding import constrain, shard_kernel

_ROWS = ("batch", None, "act_embed")
_QKV = ("batch", None, None, "head_dim")
_PER_ROW = ("batch", None, None)

# Split-K products on the kernels' path. At a few rows a GEMM's output columns alone leave
# most of a GPU's multiprocessors idle, so the contraction is split into parts whose f32 sums
# another kernel adds up; XLA does the same and sums the parts in a kernel of its own. Here the
# parts go to the kernel that reads the product (the attention kernel, `add_rms_norm`), which
# sums them as it loads its rows: one kernel fewer a product. Parts: enough for about
# `SPLIT_K_COLUMNS` output columns (1,536 programs of 16), at most `SPLIT_K_MAX_PARTS`, each
# at least `SPLIT_K_MIN_CHUNK` deep; products of more than `SPLIT_K_MAX_ROWS` rows, or under
# a mesh of several devices, are not split.
SPLIT_K_COLUMNS = 24576
SPLIT_K_MAX_PARTS = 8
SPLIT_K_MIN_CHUNK = 512
SPLIT_K_MAX_ROWS = 64


def pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def split_k_parts(rows: int, depth: int, columns: int) -> int:
    """The parts a [rows, depth] @ [depth, columns] product is split into on the kernels' path
    (1: not split)."""
    if rows > SPLIT_K_MAX_ROWS or not L.kernels_called_directly():
        return 1
    parts = 1
    while (parts < SPLIT_K_MAX_PARTS and parts * columns < SPLIT_K_COLUMNS
           and depth % (2 * parts) == 0 and depth // (2 * parts) >= SPLIT_K_MIN_CHUNK):
        parts *= 2
    return parts


def product_parts(x_btk: jax.Array, w_kf: jax.Array, parts: int) -> jax.Array:
    """x @ w as `parts` f32 products over consecutive chunks of the contraction,
    [parts, B, T', F]: T' = T, or 2 for a single row (XLA would take a one-row product per part
    as a multiply and a sum over a transposed copy of w; two rows stay one GEMM, the second row
    a copy of the first that no reader reads)."""
    b, t, k = x_btk.shape
    if b * t == 1:
        x_btk, t = jnp.broadcast_to(x_btk, (1, 2, k)), 2
    return jnp.einsum("BTPK,PKF->PBTF", x_btk.reshape(b, t, parts, k // parts),
                      w_kf.reshape(parts, k // parts, -1), preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Product:
    """x @ w [B, T, F] @ [F, D] left to the kernel that reads it (`add_rms_norm`), which on a
    GPU takes it as split-K parts it sums itself; `value()` anywhere else."""

    x: jax.Array
    w: jax.Array

    @property
    def parts(self) -> int:
        b, t, k = self.x.shape
        return split_k_parts(b * t, k, self.w.shape[-1])

    def value(self) -> jax.Array:
        return jnp.einsum("BTF,FD->BTD", self.x, self.w)


def product(x: jax.Array, w: jax.Array) -> "jax.Array | Product":
    """x @ w [B, T, F] @ [F, D]: left untaken (a `Product`) where the kernels' path splits it
    along K, for `add_rms_norm` to take; taken here otherwise."""
    p = Product(x, w)
    return p if p.parts > 1 else p.value()


@dataclasses.dataclass(frozen=True)
class GatedProduct:
    """(silu(gate) · up) @ w for gu = [gate | up] [B, T, 2F] and w [F, D]: the SwiGLU MLP's
    down product left to the kernel that reads it, which on a GPU takes the activation and the
    product in one kernel (`pallas_kernels.row_gemm.swiglu_gemm`) as split-K parts it sums
    itself; `value()` anywhere else."""

    gu: jax.Array
    w: jax.Array

    def value(self) -> jax.Array:
        gate, up = jnp.split(self.gu, 2, axis=-1)
        act = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
        return jnp.einsum("BTF,FD->BTD", act, self.w)


@dataclasses.dataclass(frozen=True)
class Projected:
    """A layer's q/k/v product [B, T, (N + 2Kh)·H] of its normed input, taken with the
    residual sum and the norm in one kernel (`input_norm`); `cached_attention` takes it in
    place of the normed rows."""

    qkv: jax.Array

    def rows(self, fn: Callable[[jax.Array], jax.Array]) -> "Projected":
        """The product of the rows `fn` takes from [B, T] (a gather of verification cells)."""
        return Projected(fn(self.qkv))


#: a residual delta: rows, a product left to the kernel that reads it, or None (the sum taken
#: already: the layer's h is its output)
Delta = jax.Array | Product | GatedProduct | None


def value(delta: Delta) -> jax.Array:
    """A residual delta as an array (a `Product` or `GatedProduct` taken)."""
    return delta.value() if isinstance(delta, (Product, GatedProduct)) else delta


def rows_of(x: "jax.Array | Projected", fn: Callable[[jax.Array], jax.Array]
            ) -> "jax.Array | Projected":
    """`fn` of a layer's attention input: the normed rows or their `Projected` product."""
    return x.rows(fn) if isinstance(x, Projected) else fn(x)


def row_kernels_take(rows: int, depth: int, columns: int) -> bool:
    """Whether a [rows, depth] @ [depth, columns] product of the decoding layer runs as
    `pallas_kernels.row_gemm`'s kernels on the kernels' path: at most `row_gemm.MAX_ROWS`
    rows, both sizes multiples of 16 (the kernels' smallest tiles), no mesh of several
    devices around it."""
    from pallas_kernels.row_gemm import MAX_ROWS

    return (rows <= MAX_ROWS and depth % 16 == 0 and columns % 16 == 0
            and L.kernels_called_directly())


def _delta_leaves(delta: Delta) -> tuple[str, tuple[jax.Array, ...]]:
    """A delta as (its kind, its arrays), to pass through `layers.on_gpu`."""
    if delta is None:
        return "none", ()
    if isinstance(delta, GatedProduct):
        return "gated", (delta.gu, delta.w)
    if isinstance(delta, Product):
        return ("parts", (delta.x, delta.w)) if delta.parts > 1 else ("row", (delta.value(),))
    return "row", (delta,)


def _delta_value(kind: str, leaves: tuple[jax.Array, ...]) -> jax.Array | None:
    if kind == "none":
        return None
    if kind == "gated":
        return GatedProduct(*leaves).value()
    return Product(*leaves).value() if kind == "parts" else leaves[0]


def _kernel_delta(kind: str, leaves: tuple[jax.Array, ...], dim: int, dtype: Any,
                  interpret: bool) -> jax.Array | None:
    """A delta as the row kernels read it: rows [R, D], or the f32 parts [P, ≥ R, D] of its
    split-K product (the SwiGLU down product's from `swiglu_gemm`), or None."""
    if kind == "none":
        return None
    if kind == "gated":
        from pallas_kernels.row_gemm import swiglu_gemm

        gu, w = leaves
        return swiglu_gemm(gu.reshape(-1, gu.shape[-1]), w.astype(dtype), interpret=interpret)
    if kind == "parts":
        x, w = leaves
        parts = Product(x, w).parts
        return product_parts(x, w, parts).reshape(parts, -1, dim)
    return leaves[0].reshape(-1, dim)


def norm_product(h_btd: jax.Array, delta: Delta, weight_d: jax.Array,
                 w_dn: "jax.Array | tuple[jax.Array, ...]", eps: float
                 ) -> tuple[jax.Array, jax.Array]:
    """(s, RMSNorm(s) · weight @ w) with s = h + delta: the residual sum, and the product of
    its norm [B, T, N] (of several weights, their columns concatenated, each read where it
    lies). For products `row_kernels_take` (its callers check): on a GPU one kernel,
    `pallas_kernels.row_gemm.norm_gemm`, after the delta's own (a `GatedProduct`'s
    activation and down product in one, a `Product`'s split-K GEMM); elsewhere `add_rms_norm`
    and the products, XLA's ops."""
    b, t, d = h_btd.shape
    kind, leaves = _delta_leaves(delta)
    ws = tuple(w_dn) if isinstance(w_dn, (tuple, list)) else (w_dn,)
    n_w = len(ws)

    def gpu(h, weight, *args, interpret):
        from pallas_kernels.row_gemm import norm_gemm

        w, leaves = args[:n_w], args[n_w:]
        s, y = norm_gemm(h.reshape(b * t, d), _kernel_delta(kind, leaves, d, h.dtype, interpret),
                         weight.astype(h.dtype), tuple(x.astype(h.dtype) for x in w), eps=eps,
                         interpret=interpret)
        return s.reshape(h.shape), y.reshape(b, t, -1)

    def default(h, weight, *args):
        w, leaves = args[:n_w], args[n_w:]
        s, x = add_rms_norm(h, _delta_value(kind, leaves), weight, eps, kernel=False)
        ys = [jnp.einsum("BTD,DF->BTF", x, x_w) for x_w in w]
        return s, ys[0] if n_w == 1 else jnp.concatenate(ys, axis=-1)

    return L.on_gpu(gpu, default, h_btd, weight_d, *ws, *leaves)


def input_norm(lp: dict[str, jax.Array], h_btd: jax.Array, delta: Delta, eps: float,
               products: tuple[str, ...] = ("w_qkv",)
               ) -> tuple[jax.Array, "jax.Array | Projected"]:
    """A decoder layer's residual sum and input norm: (s, the attention's input). Where the
    layer has its q/k/v `products` (a target layer's fused `w_qkv`, a drafter layer's `wq`
    and `w_kv`) and `row_kernels_take` them, the input is their product itself (`Projected`:
    on a GPU the sum, the norm and the product in one kernel, `norm_product`); otherwise the
    normed rows (`add_rms_norm`)."""
    b, t, d = h_btd.shape
    if all(w in lp for w in products):
        ws = tuple(lp[w].reshape(d, -1) for w in products)
        if all(row_kernels_take(b * t, d, w.shape[-1]) for w in ws):
            s, qkv = norm_product(h_btd, delta, lp["input_norm"], ws, eps)
            return s, Projected(qkv)
    return add_rms_norm(h_btd, delta, lp["input_norm"], eps)


def add_rms_norm(h_btd: jax.Array, delta_btd: Delta, weight_d: jax.Array | None,
                 eps: float, kernel: bool = True, *, delta_weight: jax.Array | None = None,
                 scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """(s, RMSNorm(s) · weight) with s = h + delta: the residual sum and the norm after it, one
    kernel on a GPU (`kernel`), XLA's ops elsewhere; `weight` None: (s, None). A `Product`
    delta is taken here: on a GPU as split-K parts the kernel sums (when `Product.parts` > 1);
    a `GatedProduct` likewise, its parts from the activation's and down product's kernel.
    Gemma's residual updates: `delta_weight` norms the delta first (s = h + RMSNorm(delta) ·
    delta_weight) and `scale` (one value) multiplies the sum, in the same kernel."""
    if delta_btd is None:   # the sum taken already
        return h_btd, (None if weight_d is None else L.rms_norm(h_btd, weight_d, eps))
    # the weights present, in the kernel's order: the delta's norm, the output norm, the scale
    extras = tuple(w for w in (delta_weight, weight_d, scale) if w is not None)
    has = (delta_weight is not None, weight_d is not None, scale is not None)

    def split(ws):   # the extras back in their places
        it = iter(ws)
        return tuple(next(it) if h else None for h in has)

    def xla(h, d, *ws):
        wd, w, sc = split(ws)
        s = h + (d if wd is None else L.rms_norm(d, wd, eps))
        s = s if sc is None else s * sc.astype(s.dtype)
        return s, (None if w is None else L.rms_norm(s, w, eps))

    def fused(h, d, ws, interpret):   # d: [R, D] or the parts [P, R', D]
        from pallas_kernels.norms import add_rms_norm as kernel_

        b, t, dim = h.shape
        wd, w, sc = (None if x is None else x.astype(h.dtype) for x in split(ws))
        s, n = kernel_(h.reshape(b * t, dim), d, w, eps=eps, delta_weight=wd, scale=sc,
                       interpret=interpret)
        return s.reshape(h.shape), (None if n is None else n.reshape(h.shape))

    if not kernel or not L.kernels_enabled():
        return xla(h_btd, value(delta_btd), *extras)
    if isinstance(delta_btd, GatedProduct):
        b, t, dim = h_btd.shape
        if not row_kernels_take(b * t, delta_btd.w.shape[0], dim):
            delta_btd = delta_btd.value()
        else:   # the activation and the down product in one kernel, its parts summed here
            def gpu_gated(h, gu, w_fd, *ws, interpret):
                parts = _kernel_delta("gated", (gu, w_fd), dim, h.dtype, interpret)
                return fused(h, parts, ws, interpret)

            def default_gated(h, gu, w_fd, *ws):
                return xla(h, GatedProduct(gu, w_fd).value(), *ws)

            return L.on_gpu(gpu_gated, default_gated, h_btd, delta_btd.gu, delta_btd.w,
                            *extras)
    if isinstance(delta_btd, Product):
        n_parts = delta_btd.parts
        if n_parts > 1:   # no mesh of several devices: no shard_map around the kernel
            def gpu_parts(h, x, w_kd, *ws, interpret):
                parts = product_parts(x, w_kd, n_parts)
                return fused(h, parts.reshape(n_parts, -1, h.shape[-1]), ws, interpret)

            def default(h, x, w_kd, *ws):
                return xla(h, Product(x, w_kd).value(), *ws)

            return L.on_gpu(gpu_parts, default, h_btd, delta_btd.x, delta_btd.w, *extras)
        delta_btd = delta_btd.value()

    def gpu(h, d, *ws, interpret):
        return fused(h, d.reshape(-1, h.shape[-1]), ws, interpret)

    def local(h, d, *ws):
        return L.on_gpu(gpu, xla, h, d, *ws)

    vec = ("act_embed",)   # the norms' weights [D]; the scale is one value, replicated
    axes = tuple(ax for ax, here in zip((vec, vec, ()), has) if here)
    return shard_kernel(local, (h_btd, delta_btd.astype(h_btd.dtype), *extras),
                        (_ROWS, _ROWS, *axes), (_ROWS, _ROWS if has[1] else None))


def fused_kernels_take(lp: dict[str, jax.Array], cache_k: jax.Array, dtype: Any,
                       rows: int, products: tuple[str, ...] = ("w_qkv",)) -> bool:
    """Whether `cached_attention` (or `block_attention`) may run its kernels: the fused
    `products` (q/k/v in one; a drafter's q and k|v), both q/k norms or neither, power-of-two
    head sizes and query heads a key head, a cache in the compute dtype whose length the
    attention's tiles divide, and at most `layers.DECODE_KERNEL_MAX_ROWS` query heads a key
    head (`rows` = T·G)."""
    if (any(w not in lp for w in products) or ("q_norm" in lp) != ("k_norm" in lp)
            or not L.kernels_enabled()):
        return False
    n, h = lp["wo"].shape[:2]
    kh = cache_k.shape[-2]
    return (pow2(h) and h >= 32 and pow2(n // kh) and cache_k.dtype == dtype
            and cache_k.shape[-3] % L.DECODE_KERNEL_TILE == 0
            and rows <= L.DECODE_KERNEL_MAX_ROWS)


def _attention_fns(lp: dict[str, jax.Array], t: int, kh: int, eps: float, write: bool,
                   rope: RopeConfig) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`cached_attention`'s two branches over the raw q/k/v product [(parts,) B, T, ·]:
    (xla, gpu)(qkv, cache k, cache v, start, positions, own mask) → (attention, k|v rows)
    or, with `write`, (attention, cache k, cache v); `gpu(..., merge=False)` gives the
    attention as its cache splits' partials (`layer_attention`). The GPU's kernel rotates
    the tokens at start + t (the positions a chain's tokens have) with the angles it takes
    itself, where XLA's branch computes cos / sin of the positions first."""
    n, h = lp["wo"].shape[:2]
    norms = (lp["q_norm"], lp["k_norm"]) if "q_norm" in lp else None

    def xla(qkv, ck, cv, start, pos, mask):   # a device's rows under a mesh
        bl = qkv.shape[0]
        q = qkv[..., :n * h].reshape(bl, t, n, h)
        k = qkv[..., n * h:(n + kh) * h].reshape(bl, t, kh, h)
        v = qkv[..., (n + kh) * h:].reshape(bl, t, kh, h)
        if norms is not None:
            q, k = L.rms_norm(q, norms[0], eps), L.rms_norm(k, norms[1], eps)
        cos, sin = L.rope_cos_sin(pos, rope, h)
        q, k = L.rotate_half(q, cos, sin), L.rotate_half(k, cos, sin)
        attn = L.attend_cache_and_own_xla(q, ck, cv, start, k, v, mask)
        if write:
            rows = (jnp.arange(bl)[:, None], pos)
            return (attn, ck.at[rows].set(k, mode="drop"), cv.at[rows].set(v, mode="drop"))
        return attn, jnp.concatenate([k, v], axis=2)

    def gpu(qkv, ck, cv, start, pos, mask, interpret, merge=True):
        from pallas_kernels.decode_attention import layer_attention

        qkv = qkv.reshape(*qkv.shape[:-1], n + 2 * kh, h)   # [(parts,) B, T, heads, H]
        attn, a, c = layer_attention(qkv, *(norms or (None, None)), L.rope_freq(rope, h),
                                     start, ck, cv, num_q_heads=n, eps=eps, scale=h ** -0.5,
                                     write=write, merge=merge, interpret=interpret,
                                     num_tokens=t)
        return (attn, a, c) if write else (attn, jnp.concatenate([a, c], axis=2))

    return xla, gpu


def merged_o_takes(lp: dict[str, jax.Array], x: "jax.Array | Projected", cache_k: jax.Array,
                   dim: int, cells: int | None = None,
                   products: tuple[str, ...] = ("w_qkv",)) -> bool:
    """Whether `attention_and_mlp_input` (or, with a drafter layer's `products`,
    `block_attention_and_mlp_input`) may take the layer: its q/k/v product taken
    (`Projected` [B, T, ·]), the attention kernel taking its tokens over `cache_k`
    (`fused_kernels_take`), the row kernels its o, gate/up and down products, and the rows
    `row_gemm.merge_gemm` reads fitting its tile: the B rows' query tiles of
    `layer_attention` padded, or the `cells` gathered from them."""
    from pallas_kernels.common import next_pow2
    from pallas_kernels.row_gemm import MAX_ROWS

    if not isinstance(x, Projected):
        return False
    batch, tokens = x.qkv.shape[:2]
    n, h = lp["wo"].shape[:2]
    group = n // cache_k.shape[-2]
    rows = batch * tokens if cells is None else cells
    t_pad = max(next_pow2(tokens), 16 // max(1, group))
    tile = max(next_pow2(batch), 16 // t_pad) * t_pad if cells is None else next_pow2(cells)
    return ("w_gate_up" in lp
            and fused_kernels_take(lp, cache_k, x.qkv.dtype, tokens * group, products)
            and row_kernels_take(rows, n * h, dim)
            and row_kernels_take(rows, dim, lp["w_gate_up"].shape[-1])
            and row_kernels_take(rows, lp["w_down"].shape[0], dim) and tile <= MAX_ROWS)


def _merged_o_mlp_input(partials: tuple[jax.Array, ...], h: jax.Array, wo: jax.Array,
                        post: jax.Array, w_gu: jax.Array, eps: float, tokens: int,
                        cell: tuple[jax.Array, ...], interpret: bool
                        ) -> tuple[jax.Array, jax.Array]:
    """The GPU's kernels after the attention's: its cache splits' partials merged in the o
    product's kernel (`row_gemm.merge_gemm`, gathering the `cell` [K] of the tokens' grid
    when given), then the residual sum h + o, the post-attention norm and the gate/up product
    in one (`row_gemm.norm_gemm`) → (s, gu), h's rows [B, T | 1, K, ·]."""
    from pallas_kernels.row_gemm import merge_gemm, norm_gemm

    rows, d = h.shape[0] * h.shape[1], h.shape[-1]
    index = dict(cells=(cell[0] // tokens, cell[0] % tokens)) if cell else {}
    o = merge_gemm(*partials, wo.astype(h.dtype), num_tokens=rows if cell else tokens,
                   dtype=h.dtype, interpret=interpret, **index)   # [P, (B, T | K), D]
    s, gu = norm_gemm(h.reshape(rows, d), o.reshape(o.shape[0], rows, d),
                      post.astype(h.dtype), w_gu.astype(h.dtype), eps=eps, interpret=interpret)
    return s.reshape(h.shape), gu.reshape(*h.shape[:2], -1)


def _o_mlp_input(attn_btf: jax.Array, h: jax.Array, wo: jax.Array, post: jax.Array,
                 w_gu: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """`_merged_o_mlp_input` with XLA's ops, from the merged attention [B, T, N·H]."""
    o = jnp.einsum("BTF,FD->BTD", attn_btf, wo)
    s, normed = add_rms_norm(h, o, post, eps, kernel=False)
    return s, jnp.einsum("BTD,DF->BTF", normed, w_gu)


def attention_and_mlp_input(lp: dict[str, jax.Array], h_btd: jax.Array, x: Projected,
                            positions_bt: jax.Array, rope: RopeConfig, eps: float,
                            cache_k: jax.Array, cache_v: jax.Array, start_b: jax.Array,
                            own_mask_btq: jax.Array, write: bool = True,
                            cells: jax.Array | None = None
                            ) -> tuple[jax.Array, GatedProduct, jax.Array, jax.Array]:
    """`cached_attention` and `attn_out_and_mlp` of a layer whose q/k/v product is taken
    (`input_norm`): → (h, the MLP's delta, k, v). With `write` the attention kernel writes
    the rows into the layer's cache buffer and k, v are the cache's; otherwise the cache is
    only read and k, v are the tokens' rows [B, T, Kh, H], or with `cells` [K] (a
    verification: x holds its requests' cells [R, Q], h its K tokens [1, K, D], token k being
    cell `cells[k]` of the grid flattened) the K tokens' rows [1, K, Kh, H].

    On a GPU (where `merged_o_takes`) the attention's cache splits are merged in the o
    product's kernel (`pallas_kernels.row_gemm.merge_gemm`, gathering the cells), whose parts
    the next kernel sums with the post-attention norm and the gate/up product (`norm_gemm`):
    two kernels after the attention's where the merge, the o product and that one take three;
    elsewhere XLA's ops as `cached_attention` and `attn_out_and_mlp` take them."""
    b, t = x.qkv.shape[:2]
    n, h = lp["wo"].shape[:2]
    kh = cache_k.shape[-2]
    d = h_btd.shape[-1]
    rows = b * t if cells is None else cells.shape[0]
    if write and cells is not None:
        raise ValueError("attention_and_mlp_input: cells are a read-only verification's")
    xla, gpu = _attention_fns(lp, t, kh, eps, write, rope)

    def gpu_merged(qkv, ck, cv, start, pos, mask, h_, wo, post, w_gu, *cell, interpret):
        partials, *kv = gpu(qkv, ck, cv, start, pos, mask, interpret=interpret,
                            merge=False)   # kv: the cache's k and v, or the rows' k|v
        return (*_merged_o_mlp_input(partials, h_, wo, post, w_gu, eps, t, cell, interpret),
                *kv)

    def default(qkv, ck, cv, start, pos, mask, h_, wo, post, w_gu, *cell):
        attn, *kv = xla(qkv, ck, cv, start, pos, mask)
        attn = attn.reshape(b * t, n * h)
        attn = attn[cell[0]][None] if cell else attn.reshape(b, t, n * h)
        return (*_o_mlp_input(attn, h_, wo, post, w_gu, eps), *kv)

    s, gu, *kv = L.on_gpu(gpu_merged, default, x.qkv, cache_k, cache_v,
                           start_b.astype(jnp.int32), positions_bt.astype(jnp.int32),
                           own_mask_btq, h_btd, lp["wo"].reshape(n * h, d), lp["post_norm"],
                           lp["w_gate_up"], *(() if cells is None else (cells,)))
    s = constrain(s, ("batch", "seq", "act_embed"))
    if write:   # the cache's k and v, the rows written
        return s, GatedProduct(gu, lp["w_down"]), *kv
    kv = kv[0] if cells is None else kv[0].reshape(b * t, 2 * kh, h)[cells][None]
    return s, GatedProduct(gu, lp["w_down"]), kv[:, :, :kh], kv[:, :, kh:]   # the rows


def cached_attention(lp: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array,
                     rope: RopeConfig, eps: float, cache_k: jax.Array, cache_v: jax.Array,
                     start_b: jax.Array, own_mask_btq: jax.Array, write: bool = False,
                     causal: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention half of a layer over a cache layer [B, S, Kh, H]: q/k/v of the normed
    input x (or x their product already, `Projected`), the q/k norms, RoPE at
    `positions_bt`, and attention over the cache below `start_b` [B] and the call's own keys
    (`own_mask_btq`, `layers.attend_cache_and_own`).

    Returns (attention [B, T, N, H], k, v): the rows [B, T, Kh, H] for the caller to write,
    or with `write` (for `fused_kernels_take` layers only; the own keys then must be the T
    tokens at start + t, causal) the cache layer's k and v with the rows written at
    `positions_bt` (a position ≥ S dropped). On a GPU the attention kernel stores them in
    place; elsewhere the rows are written after the attention has read the cache. The GPU's
    layer kernel takes the own keys as a chain (`causal`: the T tokens at start + t, a query
    seeing the keys up to its own, as `own_mask_btq` then marks them, or a superset of the rows
    whose outputs are used); a draft tree's nodes (`causal=False`) take XLA's q/k/v, norms and
    RoPE, then the decode-attention kernel under their ancestor mask."""
    projected = isinstance(x_btd, Projected)
    rows = x_btd.qkv if projected else x_btd
    b, t = rows.shape[:2]
    n, h = lp["wo"].shape[:2]
    kh = cache_k.shape[-2]
    if not causal or not fused_kernels_take(lp, cache_k, rows.dtype, t * (n // kh)):
        if write:
            raise ValueError("cached_attention: write needs a layer the kernels take")
        q, k, v = (L.split_qkv(lp, x_btd.qkv, eps) if projected
                   else L.project_qkv(lp, x_btd, eps))
        q, k = L.apply_rope(q, positions_bt, rope), L.apply_rope(k, positions_bt, rope)
        attn = L.attend_cache_and_own(q, cache_k.astype(k.dtype), cache_v.astype(v.dtype),
                                      start_b, k, v, own_mask_btq)
        return attn, k, v
    xla, gpu = _attention_fns(lp, t, kh, eps, write, rope)
    rest = (cache_k, cache_v, start_b.astype(jnp.int32), positions_bt.astype(jnp.int32),
            own_mask_btq)
    parts = 1 if projected else split_k_parts(b * t, x_btd.shape[-1], lp["w_qkv"].shape[-1])
    if parts > 1:   # on a GPU the attention kernel sums the product's split-K parts (no mesh
        # of several devices, `split_k_parts`: the kernel needs no shard_map)
        out = L.on_gpu(lambda x, w, *a, interpret: gpu(product_parts(x, w, parts), *a,
                                                       interpret=interpret),
                       lambda x, w, *a: xla(jnp.einsum("BTD,DF->BTF", x, w), *a),
                       x_btd, lp["w_qkv"], *rest)
        return out if write else (out[0], out[1][:, :, :kh], out[1][:, :, kh:])
    # the product stays [B, T, (N + 2Kh)·H] outside the kernels, sliced as `project_qkv` slices
    # it (taken as heads, XLA:TPU re-lays w_qkv out for the dot)
    qkv = x_btd.qkv if projected else jnp.einsum("BTD,DF->BTF", x_btd, lp["w_qkv"])

    def local(*args):
        return L.on_gpu(gpu, xla, *args)

    args = (qkv, *rest)
    axes = (_PER_ROW, L._CACHE_AXES, L._CACHE_AXES, ("batch",), ("batch", None), _PER_ROW)
    if write:
        return shard_kernel(local, args, axes, (_QKV, L._CACHE_AXES, L._CACHE_AXES))
    attn, kv = shard_kernel(local, args, axes, (_QKV, _QKV))
    return attn, kv[:, :, :kh], kv[:, :, kh:]


DRAFT_PRODUCTS = ("wq", "w_kv")   # a drafter layer's q and k|v products (`FUSED_KV`)


def _block_attention_fns(lp: dict[str, jax.Array], kh: int, rope: RopeConfig, eps: float,
                         xla: Callable[..., jax.Array]
                         ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`block_attention`'s two branches over the raw q | k|v product [B, T, N + 2Kh, H]:
    (default, gpu)(qkv, context k, context v, start, positions) → attention [B, T, N, H];
    `gpu(..., merge=False)` gives it as its cache splits' partials (`layer_attention`)."""
    n, h = lp["wo"].shape[:2]
    norms = (lp["q_norm"], lp["k_norm"]) if "q_norm" in lp else None

    def default(qkv, ck, cv, start, pos):
        q, k, v = qkv[:, :, :n], qkv[:, :, n:n + kh], qkv[:, :, n + kh:]
        if norms is not None:
            q, k = L.rms_norm(q, norms[0], eps), L.rms_norm(k, norms[1], eps)
        q, k = L.apply_rope(q, pos, rope), L.apply_rope(k, pos, rope)
        return xla(q, k, v, ck, cv, start)

    def gpu(qkv, ck, cv, start, pos, interpret, merge=True):
        from pallas_kernels.decode_attention import layer_attention

        return layer_attention(qkv, *(norms or (None, None)), L.rope_freq(rope, h), start,
                               ck, cv, num_q_heads=n, eps=eps, scale=h ** -0.5, causal=False,
                               merge=merge, interpret=interpret, num_tokens=pos.shape[1])[0]

    return default, gpu


def block_attention(lp: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array,
                    rope: RopeConfig, eps: float, ctx_k: jax.Array, ctx_v: jax.Array,
                    start_b: jax.Array, xla: Callable[..., jax.Array]) -> jax.Array:
    """The attention half of a DSpark / DFlash draft layer while decoding (SPEC §3): the T block
    tokens at `positions_bt`, normed input x (or x their q | k|v product already,
    `Projected`), attend to the layer's context cache
    [B, S, Kh, H] below their anchor (`start_b` [B]) and to all T block keys. The q and k|v
    products are taken here (a drafter layer's `wq` and `w_kv`,
    `layers.UnstackedLayers.FUSED_KV`: its context's k|v product reads `w_kv` alone).

    On a GPU, for a layer `fused_kernels_take` accepts, the q/k norms, RoPE and the attention
    run in `pallas_kernels.decode_attention.layer_attention`'s two kernels; elsewhere
    `xla(q, k, v, ctx_k, ctx_v, start_b)` (normed, rotated q / k [B, T, ·, H]) gives the
    attention with XLA's ops. → [B, T, N, H]."""
    projected = isinstance(x_btd, Projected)
    rows = x_btd.qkv if projected else x_btd
    b, t = rows.shape[:2]
    n, h = lp["wo"].shape[:2]
    kh = ctx_k.shape[-2]
    if not fused_kernels_take(lp, ctx_k, rows.dtype, t * (n // kh), DRAFT_PRODUCTS):
        if projected:   # q, then k|v, of the product taken already, normed as the projections
            q = x_btd.qkv[..., :n * h].reshape(b, t, n, h)
            k, v = jnp.split(x_btd.qkv[..., n * h:].reshape(b, t, 2 * kh, h), 2, axis=2)
            q = L.rms_norm(q, lp["q_norm"], eps) if "q_norm" in lp else q
            k = L.rms_norm(k, lp["k_norm"], eps) if "k_norm" in lp else k
        else:   # q from its own handle on x: XLA would merge the q and k|v dots into one over
            # their weights concatenated every call (a copy of them)
            x_q, wq = jax.lax.optimization_barrier((x_btd, lp["wq"]))
            q, (k, v) = L.project_q({**lp, "wq": wq}, x_q, eps), L.project_kv(lp, x_btd, eps)
        q, k = L.apply_rope(q, positions_bt, rope), L.apply_rope(k, positions_bt, rope)
        return xla(q, k, v, ctx_k, ctx_v, start_b)
    # the raw products, normed and rotated in each branch as `project_q` / `project_kv` do; as
    # one array, XLA takes the two dots as one GEMM (reading both weights where they lie) whose
    # output the kernel reads whole
    wq = lp["wq"].reshape(lp["wq"].shape[0], -1)

    def raw_qkv(x, wq, w_kv):
        return jnp.concatenate([jnp.einsum("BTD,DF->BTF", x, wq),
                                jnp.einsum("BTD,DF->BTF", x, w_kv)], axis=-1)

    default, gpu = _block_attention_fns(lp, kh, rope, eps, xla)

    def local(*args):
        return L.on_gpu(gpu, default, *args)

    rest = (ctx_k, ctx_v, start_b.astype(jnp.int32), positions_bt.astype(jnp.int32))
    parts = 1 if projected else split_k_parts(b * t, x_btd.shape[-1], (n + 2 * kh) * h)
    if parts > 1:   # on a GPU the attention kernel sums the product's split-K parts, the two
        # weights read where they lie by the one GEMM (no mesh of several devices)
        def gpu_parts(x, wq, w_kv, *a, interpret):
            w = jnp.concatenate([wq, w_kv], axis=-1)
            qkv = product_parts(x, w, parts)   # [parts, B, ≥ T, F]: rows past T unread
            return gpu(qkv.reshape(*qkv.shape[:3], n + 2 * kh, h), *a, interpret=interpret)

        return L.on_gpu(gpu_parts,
                        lambda x, wq, w_kv, *a: default(
                            raw_qkv(x, wq, w_kv).reshape(b, t, n + 2 * kh, h), *a),
                        x_btd, wq, lp["w_kv"], *rest)
    qkv = (x_btd.qkv if projected else raw_qkv(x_btd, wq, lp["w_kv"])).reshape(
        b, t, n + 2 * kh, h)
    axes = (_QKV, L._CACHE_AXES, L._CACHE_AXES, ("batch",), ("batch", None))
    return shard_kernel(local, (qkv, *rest), axes, _QKV)


def block_attention_and_mlp_input(lp: dict[str, jax.Array], h_btd: jax.Array, x: Projected,
                                  positions_bt: jax.Array, rope: RopeConfig, eps: float,
                                  ctx_k: jax.Array, ctx_v: jax.Array, start_b: jax.Array,
                                  xla: Callable[..., jax.Array]
                                  ) -> tuple[jax.Array, GatedProduct]:
    """`block_attention` and `attn_out_and_mlp` of a draft layer whose q and k|v product is
    taken (`input_norm`), where `merged_o_takes` it (the drafter's `products`): → (h, the
    MLP's delta). On a GPU the attention kernel's cache splits are merged in the o product's
    kernel, whose parts the next kernel sums with the post-attention norm and the gate/up
    product, as `attention_and_mlp_input` takes a target layer's; elsewhere XLA's ops as
    `block_attention` and `attn_out_and_mlp` take them."""
    b, t = x.qkv.shape[:2]
    n, h = lp["wo"].shape[:2]
    kh = ctx_k.shape[-2]
    default, gpu = _block_attention_fns(lp, kh, rope, eps, xla)

    def gpu_merged(qkv, ck, cv, start, pos, h_, wo, post, w_gu, interpret):
        partials = gpu(qkv, ck, cv, start, pos, interpret=interpret, merge=False)
        return _merged_o_mlp_input(partials, h_, wo, post, w_gu, eps, t, (), interpret)

    def xla_merged(qkv, ck, cv, start, pos, h_, wo, post, w_gu):
        attn = default(qkv, ck, cv, start, pos)
        return _o_mlp_input(attn.reshape(b, t, n * h), h_, wo, post, w_gu, eps)

    s, gu = L.on_gpu(gpu_merged, xla_merged, x.qkv.reshape(b, t, n + 2 * kh, h), ctx_k, ctx_v,
                     start_b.astype(jnp.int32), positions_bt.astype(jnp.int32), h_btd,
                     lp["wo"].reshape(n * h, -1), lp["post_norm"], lp["w_gate_up"])
    return constrain(s, ("batch", "seq", "act_embed")), GatedProduct(gu, lp["w_down"])


def attn_out_and_mlp(lp: dict[str, jax.Array], h_btd: jax.Array, attn_btnh: jax.Array,
                     eps: float) -> tuple[jax.Array, jax.Array]:
    """The layer's second half with its MLP's residual sum left for the next input norm: the o
    projection summed into h and normed (`add_rms_norm`), then SwiGLU → (h, delta), the layer's
    output being h + delta. On the kernels' path the o product goes to `add_rms_norm` as
    split-K parts the kernel sums; with gate and up fused (per-layer buffers) the down product
    is returned untaken (a `Product`, the delta) for the next `add_rms_norm` to take the same
    way. Where `row_kernels_take` the gate/up and down products, the sum, the norm and the
    gate/up product are one kernel (`norm_product`) and the delta is the activation's and the
    down product's (`GatedProduct`), taken by the next layer's input norm."""
    B, T, N, H = attn_btnh.shape
    o = product(attn_btnh.reshape(B, T, N * H), lp["wo"].reshape(N * H, -1))
    if ("w_gate_up" in lp and row_kernels_take(B * T, h_btd.shape[-1], lp["w_gate_up"].shape[-1])
            and row_kernels_take(B * T, lp["w_down"].shape[0], lp["w_down"].shape[1])):
        h, gu = norm_product(h_btd, o, lp["post_norm"], lp["w_gate_up"], eps)
        return constrain(h, ("batch", "seq", "act_embed")), GatedProduct(gu, lp["w_down"])
    h, x = add_rms_norm(h_btd, o, lp["post_norm"], eps)
    h = constrain(h, ("batch", "seq", "act_embed"))
    if "w_gate_up" not in lp:   # gate and up apart (a stack in a scan, a tensor-parallel layout)
        return h, L.swiglu(x, lp)
    return h, product(L.swiglu_activation(x, lp), lp["w_down"])
