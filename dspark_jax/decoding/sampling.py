"""Token sampling shared by plain and speculative decoding (SPEC §1 steps 1 and 3; DeepSpec's
evaluator samples the target and the drafter at temperature T the same way).

`probs_from_logits` defines the distribution the target and the drafter sample from at
temperature T (T = 0 → one-hot argmax, which makes greedy decoding a special case of the
lossless rejection rule). Top-k / top-p filtering applies to plain decoding, regeneration and
every verified position of the serving engine. Pure JAX, it imports nothing from the package.
`probs_from_logits` is the kernels' own (`pallas_kernels.common`), which the drafter models
import directly: models sit below decoding.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

# softmax(logits / T) in f32, T ≤ 0 → one-hot argmax: the kernels' convention (they stand alone,
# below the package), so the drafter models, decoding and the kernels share one definition
from pallas_kernels.common import GREEDY_T_EPS, probs_from_logits

__all__ = ["FILTER_CAP", "GREEDY_T_EPS", "check_sampling", "filter_logits", "filter_logits_rows",
           "filter_within_top", "filtered_probs", "probs_from_logits", "sample_logits",
           "sample_probs", "sample_request_rows", "top_k_cap_for"]


def filter_logits(logits: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Masks logits [..., V] outside the top-k set and outside the top-p nucleus (static k, p)."""
    neg = jnp.finfo(jnp.float32).min
    logits = logits.astype(jnp.float32)
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it is kept)
        cum_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = cum_before < top_p
        threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1,
                            keepdims=True)
        logits = jnp.where(logits < threshold, neg, logits)
    return logits


def sample_logits(key: jax.Array, logits: jax.Array, temperature: jax.Array | float,
                  top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Samples token ids [...] from logits [..., V]; greedy when temperature ≤ 0."""
    t = jnp.asarray(temperature, jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    filtered = filter_logits(logits, top_k, top_p)
    sampled = jax.random.categorical(key, filtered / jnp.maximum(t, GREEDY_T_EPS), axis=-1)
    return jnp.where(t > 0, sampled, greedy).astype(jnp.int32)


def sample_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Samples from explicit probabilities [..., V] (inverse CDF with one uniform per row)."""
    u = jax.random.uniform(key, probs.shape[:-1] + (1,), jnp.float32)
    cdf = jnp.cumsum(probs, axis=-1)
    cdf = cdf / jnp.maximum(cdf[..., -1:], 1e-30)
    idx = jnp.sum(cdf <= u, axis=-1)
    return jnp.minimum(idx, probs.shape[-1] - 1).astype(jnp.int32)


def filter_logits_rows(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`filter_logits` with per-row settings (traced, so each request keeps its own).

    logits [..., V]; top_k, top_p broadcast to logits.shape[:-1] (top_k ≤ 0 or ≥ V: no top-k;
    top_p ≥ 1: no nucleus). Same rule as `filter_logits`: top-k by value (ties with the k-th
    kept), then the smallest nucleus reaching top_p among the survivors.
    """
    logits = logits.astype(jnp.float32)
    return _below(logits, _sorted_threshold(logits, top_k, top_p))


# the candidates `filter_within_top` keeps: a top-k up to this many (Qwen3 asks for 20, Gemma
# for 64, Hugging Face's default is 50) is filtered without sorting the vocabulary; XLA:TPU's
# top_k keeps more temporaries for more candidates than this
FILTER_CAP = 64


def filter_within_top(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                      cap: int = FILTER_CAP) -> jax.Array:
    """`filter_logits_rows` for rows whose 0 < top_k ≤ cap, or that do not filter at all: the
    top-k survivors and the nucleus among them lie within the row's `cap` largest logits, so
    `lax.top_k` stands in for the sort of the vocabulary (the softmax's normaliser is one
    reduction over the survivors). Same keep set as `filter_logits_rows`, up to f32 rounding of
    the normaliser and the cumulative sum at the top_p boundary; a row with top_p < 1 and no
    top-k ≤ cap is outside its contract (`filtered_probs` sends those to the sort)."""
    logits = logits.astype(jnp.float32)
    return _below(logits, _top_threshold(logits, top_k, top_p, cap))


def _below(logits: jax.Array, threshold: jax.Array) -> jax.Array:
    return jnp.where(logits < threshold, jnp.finfo(jnp.float32).min, logits)


def _settings(logits: jax.Array, top_k: jax.Array, top_p: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    lead = logits.shape[:-1]
    return (jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), lead),
            jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), lead)[..., None])


def _sorted_threshold(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[..., 1] the smallest logit the filter keeps, read off the sorted vocabulary."""
    return _threshold(logits, top_k, top_p, -jnp.sort(-logits, axis=-1))


def _top_threshold(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   cap: int) -> jax.Array:
    """`_sorted_threshold` from the `cap` largest logits (`filter_within_top`'s contract)."""
    top = jax.lax.top_k(logits, min(int(cap), logits.shape[-1]))[0]       # [..., cap]
    return _threshold(logits, top_k, top_p, top)


def _threshold(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
               desc: jax.Array) -> jax.Array:
    """[..., 1] the smallest logit kept: the k-th largest (ties kept), raised to the nucleus's
    last token among the survivors. desc [..., n]: the row's n largest logits, largest first,
    holding every survivor of the nucleus; the softmax's normaliser is summed over the row."""
    neg = jnp.finfo(jnp.float32).min
    V, n = logits.shape[-1], desc.shape[-1]
    k, p = _settings(logits, top_k, top_p)
    use_k = (k > 0) & (k < V)
    kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, n - 1)[..., None], axis=-1)
    kth = jnp.where(use_k[..., None], kth, -jnp.inf)
    m = desc[..., :1]
    total = jnp.sum(jnp.where(logits < kth, 0.0, jnp.exp(logits - m)), axis=-1, keepdims=True)
    desc = jnp.where(desc < kth, neg, desc)
    probs = jnp.exp(desc - m) / total
    keep = (jnp.cumsum(probs, axis=-1) - probs) < p       # the token crossing top_p is kept
    nucleus = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(p >= 1.0, kth, jnp.maximum(nucleus, kth))


def filtered_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                   top_p: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """The distribution a request samples from: per-row top-k/top-p on the raw logits, then
    softmax(·/T) (T ≤ 0: one-hot argmax) — what `sample_logits` draws from, as probabilities.
    temperature/top_k/top_p broadcast to logits.shape[:-1]; or, with `rows` [...] (logits'
    leading shape), they are per request [R] and row i is request rows[i]'s.

    One `lax.switch` on the settings picks each row's smallest kept logit: none when no row
    filters; from the candidates of `lax.top_k` when every filtering row has
    0 < top_k ≤ FILTER_CAP (`filter_within_top`); from the sorted vocabulary otherwise
    (`filter_logits_rows`). The softmax applies it as it reads the logits."""
    lead = logits.shape[:-1]
    V = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    pick = (lambda x: x) if rows is None else (lambda x: jnp.asarray(x)[rows])  # noqa: E731
    t = jnp.broadcast_to(pick(jnp.asarray(temperature, jnp.float32)), lead)[..., None]
    k, p = jnp.asarray(top_k), jnp.asarray(top_p)
    filters = ((k > 0) & (k < V)) | (p < 1.0)
    bounded = ~filters | ((k > 0) & (k <= min(FILTER_CAP, V)))
    branch = jnp.where(jnp.any(filters), jnp.where(jnp.all(bounded), 1, 2), 0)
    threshold = jax.lax.switch(branch, (
        lambda x, k, p: jnp.full(lead + (1,), -jnp.inf, jnp.float32),
        lambda x, k, p: _top_threshold(x, pick(k), pick(p), FILTER_CAP),
        lambda x, k, p: _sorted_threshold(x, pick(k), pick(p))), logits, top_k, top_p)
    return _probs_one_pass(_below(logits, threshold), t)


def _probs_one_pass(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """`probs_from_logits` with each row's maximum, first argmax and Σ exp taken in one
    variadic reduction (an online softmax: partial sums rescaled to the larger maximum), where
    the softmax and the argmax make three; equal to it up to f32 rounding of the sum.
    logits [..., V] f32, temperature broadcasting to [..., 1]."""
    t = jnp.asarray(temperature, jnp.float32)
    z = logits / jnp.maximum(t, GREEDY_T_EPS)         # T ≤ 0: ×10⁶ keeps the argmax
    index = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)

    def combine(a, b):
        (m_a, s_a, i_a), (m_b, s_b, i_b) = a, b
        m = jnp.maximum(m_a, m_b)
        scaled = lambda m_x, s_x: jnp.where(m_x == m, s_x, s_x * jnp.exp(m_x - m))  # noqa: E731
        first = jnp.where(m_a == m_b, jnp.minimum(i_a, i_b), jnp.where(m_a > m_b, i_a, i_b))
        return m, scaled(m_a, s_a) + scaled(m_b, s_b), first

    m, total, first = jax.lax.reduce(
        (z, jnp.ones_like(z), index),
        (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.int32(z.shape[-1])), combine,
        (z.ndim - 1,))
    soft = jnp.exp(z - m[..., None]) / total[..., None]
    hard = (index == first[..., None]).astype(jnp.float32)
    return jnp.where(t > 0, soft, hard)


def check_sampling(temperature: "Sequence[float] | float" = 0.0,
                   top_k: "Sequence[int] | int" = 0, top_p: "Sequence[float] | float" = 1.0,
                   *, where: str = "") -> None:
    """ValueError naming the first bad sampling setting (each one value, or one per request):
    `temperature` finite and ≥ 0 (0: greedy), `top_k` ≥ 0 (0: every token), `top_p` in
    (0, 1] (1: every token). A setting outside these would otherwise fall silently into
    greedy decoding or no filter. `where` prefixes the message (e.g. "request 3: ")."""
    def values(x: "Sequence[float] | float") -> list[float]:
        return [float(v) for v in (x if hasattr(x, "__iter__") else [x])]

    for name, xs, ok, rule in (
            ("temperature", values(temperature), lambda v: math.isfinite(v) and v >= 0,
             "finite and ≥ 0 (0: greedy)"),
            ("top_k", values(top_k), lambda v: v >= 0 and v == int(v),
             "an integer ≥ 0 (0: every token)"),
            ("top_p", values(top_p), lambda v: 0.0 < v <= 1.0, "in (0, 1] (1: every token)")):
        bad = next((v for v in xs if not ok(v)), None)
        if bad is not None:
            raise ValueError(f"{where}{name} must be {rule}, got {bad:g}")


def top_k_cap_for(top_k: "Sequence[int] | int", vocab_size: int) -> int:
    """The static candidate count of `sample_request_rows` for requests with these top-k
    settings: their largest k when every request has 0 < k < V, else 0 (the full vocabulary)."""
    ks = [int(k) for k in (top_k if hasattr(top_k, "__iter__") else [top_k])]
    if not ks or any(k <= 0 or k >= vocab_size for k in ks):
        return 0
    return max(ks)


def sample_request_rows(key_data: jax.Array, index: jax.Array, logits: jax.Array,
                        temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                        top_k_cap: int = 0) -> jax.Array:
    """Token number `index[b]` of request b, drawn from its own key (`fold_in(key_b, index_b)`)
    under its own temperature / top-k / top-p: plain decoding's sampler (the on-device loop,
    regeneration and the serving engine's plain steps), so a request's reply does not depend
    on the batch, the slot or the order it ran in.

    key_data [B, 2] uint32 (threefry), index [B], logits [B, V]; temperature / top_k / top_p
    broadcast to [B]. Distribution: top-k, then the top-p nucleus of the untempered survivors,
    then softmax(·/T); T ≤ 0 is greedy (argmax). `top_k_cap` (static, `top_k_cap_for`): when
    every row has 0 < top_k ≤ cap, the draw is made among the cap best candidates only — no
    sort and no noise over the whole vocabulary, which on CPU costs more than the forward
    itself (the sampling row of docs/benchmark-log/main-job-tests-cpu-reference.md); 0
    filters the whole vocabulary per row.
    """
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (B,))
    p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (B,))
    t_div = jnp.maximum(t, GREEDY_T_EPS)[:, None]

    def sampled() -> jax.Array:
        keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        keys = jax.vmap(jax.random.fold_in)(keys, index)
        if not top_k_cap or top_k_cap >= V:
            filtered = filter_logits_rows(logits, k, p)
            return jax.vmap(jax.random.categorical)(keys, filtered / t_div).astype(jnp.int32)
        vals, ids = jax.lax.top_k(logits, top_k_cap)          # [B, cap] sorted, largest first
        vals = jnp.where(jnp.arange(top_k_cap)[None] < k[:, None], vals, -jnp.inf)
        probs = jax.nn.softmax(vals, axis=-1)
        keep = ((jnp.cumsum(probs, axis=-1) - probs) < p[:, None]) | (p[:, None] >= 1.0)
        vals = jnp.where(keep, vals, -jnp.inf)                # the crossing token is kept
        choice = jax.vmap(jax.random.categorical)(keys, vals / t_div)
        return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.any(t > 0), sampled, lambda: greedy)
    return jnp.where(t > 0, drawn, greedy)
