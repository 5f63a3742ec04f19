"""Hardware-aware prefix scheduler (DSpark paper §3.2.2 Algorithm 1, §5.2, Appendix A; SPEC §8).

Given calibrated per-slot confidences ``c[r, j]`` (the probability that draft slot ``j`` of request
``r`` is accepted given that slots ``< j`` were), the scheduler chooses how many draft tokens of
each request the target verifies in the next forward pass:

* prefix survival ``a[r, j] = prod_{i <= j} c[r, i]`` (non-increasing in ``j``);
* every active request always verifies its anchor, so ``B = sum_r (1 + l_r)`` tokens and the
  expected number of committed tokens is ``tau = sum_r (1 + sum_{j <= l_r} a[r, j])``;
* objective ``Theta = tau * SPS(B)`` where ``SPS`` is a table of target steps/second profiled once
  per engine over its capacity buckets (the cost profile, ``dspark_jax.serving.cost_profile``).

Algorithm 1 sorts all candidates ``(r, j)`` with ``a > 0`` by ``a`` descending (which respects
the prefixes because ``a`` is monotone in ``j``), admits them one by one and *stops at the first
candidate that does not strictly improve Theta*.  The early stop is what keeps speculative
decoding lossless (Appendix A): without it the admission of slot ``j`` could depend on the
confidence of slot ``j + 1``, which is computed from the realised draft token ``x_j``.

Conventions of this module
--------------------------
* The SPS table is a 1-D array ``sps[B]`` indexed by the number of batch tokens ``B``
  (``sps[0]`` is never used in a product that matters).  A token count beyond the end of the table
  has ``SPS = 0``: the table length doubles as a hard token capacity.
* Ties in ``a`` are broken by the flat index ``r * gamma + j`` (request first, then slot), both in
  the JAX implementation and in the tests' numpy oracles, so the result is deterministic.  Within a
  request the lower slot always comes first, hence admitted sets are always prefixes.
* Confidences are clipped to ``[0, 1]`` and NaN is treated as 0.  Candidates with ``a == 0`` and
  all slots of inactive requests are never admitted; inactive requests do not count in ``R``.
* Tensors have static shapes (``R`` rows, ``gamma`` slots) so that :func:`schedule_verification`
  can run inside a jitted decoding round; the search over the sorted candidates is expressed with
  a cumulative product of an "improved" flag instead of a Python loop.

Production variant (§5.2): the batch capacity ``K`` (number of draft tokens) is computed with the
*global* search (no early stop, argmax over the whole admission path) from confidences two steps
old, and the current step admits the top ``K`` current candidates.  Because ``K`` only depends on
stale information, the admission of a current token cannot depend on its own realisation.  See
:func:`global_capacity`, :func:`topk_admission` and :func:`production_schedule`.  The serving
engine runs it in two modes: ``production`` is exactly this (objective ``tau * SPS(B)``, every
round drafts; the paper's algorithm measured by itself), and ``adaptive`` adds the drafter's cost
to the objective and may skip drafting for a round altogether (``dspark_jax.serving.policy``).

The speculative round (``decoding.speculative_round``) schedules with its config's mode
(:class:`RoundScheduler`, ``RoundConfig.mode``); the modes, from plain decoding and DeepSpec's
fixed γ or static confidence cut (``--confidence-threshold``) to Algorithm 1 and the §5.2 variant
(``production``, and ``adaptive`` with our drafting choice), are ``dspark_jax.serving.modes``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

__all__ = [
    "Schedule",
    "prefix_survival",
    "sps_lookup",
    "schedule_verification",
    "global_capacity",
    "topk_admission",
    "init_capacity_queue",
    "production_schedule",
    "RoundScheduler",
    "confidence_probs",
    "stale_capacity_schedule",
    "drafting_pays",
]


class Schedule(NamedTuple):
    """Result of a scheduling decision (a pytree, usable inside ``jax.jit``).

    Attributes:
      lengths: [R] int32, verification length ``l_r`` in ``0..gamma`` (0 for inactive rows).
      mask: [R, gamma] bool, ``mask[r, j] = j < l_r``: the draft slots sent to the target.
      batch_tokens: [] int32, ``B = sum_{active r} (1 + l_r)``.
      expected_accepts: [] float, ``tau = sum_{active r} (1 + sum_{j < l_r} a[r, j])``.
      throughput: [] float, ``tau * SPS(B)``.
    """

    lengths: jax.Array
    mask: jax.Array
    batch_tokens: jax.Array
    expected_accepts: jax.Array
    throughput: jax.Array


# --------------------------------------------------------------------------------------------
# JAX implementation
# --------------------------------------------------------------------------------------------


def _float_dtype(x: jax.Array) -> jnp.dtype:
    return jnp.result_type(x.dtype, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32


def prefix_survival(conf: jax.Array) -> jax.Array:
    """``a[r, j] = prod_{i <= j} clip(c[r, i], 0, 1)`` (NaN -> 0).  conf: [..., gamma]."""
    conf = jnp.asarray(conf)
    c = jnp.clip(jnp.nan_to_num(conf.astype(_float_dtype(conf)), nan=0.0), 0.0, 1.0)
    return jnp.cumprod(c, axis=-1)


def sps_lookup(sps: jax.Array, tokens: jax.Array) -> jax.Array:
    """``SPS(tokens)`` from a table indexed by token count; 0 outside ``[0, len(sps))``."""
    n = sps.shape[0]
    idx = jnp.clip(tokens, 0, n - 1)
    return jnp.where((tokens >= 0) & (tokens < n), sps[idx], jnp.zeros((), sps.dtype))


class _Path(NamedTuple):
    order: jax.Array  # [N] flat candidate index (r * gamma + j) in admission order
    valid_sorted: jax.Array  # [N] bool, candidate is admissible (active row and a > 0)
    tau: jax.Array  # [N] expected accepts after admitting candidates 0..i
    theta: jax.Array  # [N] throughput after admitting candidates 0..i
    tau0: jax.Array  # [] expected accepts with only the anchors (= #active)
    theta0: jax.Array  # [] throughput with only the anchors
    n_active: jax.Array  # [] int32


def _admission_path(conf: jax.Array, active: jax.Array, sps: jax.Array) -> _Path:
    """Sorted candidate pool and the Theta curve along the greedy admission path."""
    r_, g_ = conf.shape
    a = prefix_survival(conf)  # [R, G]
    dt = a.dtype
    sps = jnp.asarray(sps).astype(dt)
    active = jnp.asarray(active).astype(bool)  # [R]
    valid = active[:, None] & (a > 0)  # [R, G]
    # Ascending sort of -a (stable): most confident first, ties by flat index; invalid last.
    key = jnp.where(valid, -a, jnp.ones((), dt)).reshape(-1)  # [N]
    order = jnp.argsort(key, stable=True)  # [N]
    valid_sorted = valid.reshape(-1)[order]  # [N]
    a_sorted = jnp.where(valid_sorted, a.reshape(-1)[order], jnp.zeros((), dt))  # [N]
    n_active = jnp.sum(active).astype(jnp.int32)
    tau0 = n_active.astype(dt)
    theta0 = tau0 * sps_lookup(sps, n_active)
    tau = tau0 + jnp.cumsum(a_sorted)  # [N]
    tokens = n_active + jnp.arange(1, r_ * g_ + 1, dtype=jnp.int32)  # [N]
    theta = tau * sps_lookup(sps, tokens)  # [N]
    return _Path(order, valid_sorted, tau, theta, tau0, theta0, n_active)


def _finish(path: _Path, admitted_sorted: jax.Array, r_: int, g_: int) -> Schedule:
    """Count each request's admitted candidates and assemble the :class:`Schedule`. Candidate s
    of the sorted path is request order[s] // G's: a masked sum per request counts them (one
    reduction, where scattering the flags back to [R, G] writes a zeroed buffer first)."""
    request = path.order // g_                                               # [R·G]
    mine = request[None, :] == jnp.arange(r_)[:, None]                       # [R, R·G]
    lengths = jnp.sum(mine & admitted_sorted[None, :], axis=-1).astype(jnp.int32)  # [R]
    mask = jnp.arange(g_)[None, :] < lengths[:, None]  # [R, G]
    n_adm = jnp.sum(admitted_sorted).astype(jnp.int32)
    last = jnp.maximum(n_adm - 1, 0)
    tau = jnp.where(n_adm > 0, path.tau[last], path.tau0)
    theta = jnp.where(n_adm > 0, path.theta[last], path.theta0)
    return Schedule(lengths, mask, path.n_active + n_adm, tau, theta)


@partial(jax.jit, static_argnames=("early_stop",))
def schedule_verification(
    conf: jax.Array,  # [R, gamma] calibrated confidences c[r, j] in [0, 1]
    active: jax.Array,  # [R] bool
    sps: jax.Array,  # [B_max + 1] steps/second indexed by batch-token count
    early_stop: bool = True,
) -> Schedule:
    """Paper Algorithm 1 (hardware-aware prefix scheduler), jittable, static shapes.

    ``early_stop=True`` is the causal (lossless) scheduler: admission stops at the first candidate
    whose Theta is not strictly larger than the best so far (= the previous one, since every
    admitted step improved).  ``early_stop=False`` is the retrospective *global* search (argmax
    of Theta over the whole admission path, first maximum on ties); it is NOT lossless when the
    confidences are current (Appendix A) and is only meant for stale confidences (§5.2, see
    :func:`global_capacity`) and for demonstrating the bias.
    """
    conf = jnp.asarray(conf)
    r_, g_ = conf.shape
    path = _admission_path(conf, active, sps)
    if early_stop:
        prev = jnp.concatenate([path.theta0[None], path.theta[:-1]])  # [N]
        improved = path.valid_sorted & (path.theta > prev)
        admitted_sorted = jnp.cumprod(improved.astype(jnp.int32)).astype(bool)
    else:
        neg_inf = jnp.full((), -jnp.inf, path.theta.dtype)
        curve = jnp.concatenate([path.theta0[None], jnp.where(path.valid_sorted, path.theta, neg_inf)])
        n_best = jnp.argmax(curve)  # first maximum; 0 = anchors only
        admitted_sorted = jnp.arange(r_ * g_) < n_best
    return _finish(path, admitted_sorted, r_, g_)


@jax.jit
def topk_admission(
    conf: jax.Array,  # [R, gamma] current calibrated confidences
    active: jax.Array,  # [R] bool
    capacity: jax.Array,  # [] int, number of draft tokens K that may be verified
    sps: jax.Array | None = None,  # optional, only used for the reported throughput
) -> Schedule:
    """§5.2 admission: the ``K`` current candidates with the largest ``a[r, j]`` (a > 0, active).

    No early stop: ``K`` is fixed beforehand from stale confidences.  Ties are broken by flat
    index, so admitted sets are prefixes.  ``batch_tokens`` = ``#active + min(K, #candidates)``.
    """
    conf = jnp.asarray(conf)
    r_, g_ = conf.shape
    if sps is None:
        sps = jnp.ones((r_ * (g_ + 1) + 1,), jnp.float32)
    path = _admission_path(conf, active, sps)
    admitted_sorted = path.valid_sorted & (jnp.arange(r_ * g_) < jnp.asarray(capacity, jnp.int32))
    return _finish(path, admitted_sorted, r_, g_)


@jax.jit
def global_capacity(
    conf: jax.Array,  # [R, gamma] confidences (in production: from two steps ago)
    active: jax.Array,  # [R] bool
    sps: jax.Array,  # [B_max + 1]
) -> jax.Array:
    """§5.2 capacity ``K`` (number of draft tokens, anchors excluded) from the global search."""
    return jnp.sum(schedule_verification(conf, active, sps, early_stop=False).lengths).astype(jnp.int32)


def init_capacity_queue(initial_capacity: int = 0) -> jax.Array:
    """State for :func:`production_schedule`: the capacities computed one and two steps ago, [2]."""
    return jnp.full((2,), initial_capacity, jnp.int32)


@jax.jit
def production_schedule(
    conf: jax.Array,  # [R, gamma] current calibrated confidences
    active: jax.Array,  # [R] bool
    sps: jax.Array,  # [B_max + 1]
    capacity_queue: jax.Array,  # [2] int32: K computed at steps t-2, t-1
) -> tuple[Schedule, jax.Array]:
    """Asynchronous production scheduler of §5.2 (one decoding step ``t``).

    Admits the top ``K_{t-2}`` current candidates where ``K_{t-2}`` was computed by the global
    search on the confidences of step ``t - 2``; computes ``K_t`` from the current confidences and
    returns the shifted queue ``[K_{t-1}, K_t]`` for the next step.
    """
    k_use = capacity_queue[0]
    sched = topk_admission(conf, active, k_use, sps)
    k_new = global_capacity(conf, active, sps)
    new_queue = jnp.stack([capacity_queue[1], k_new]).astype(jnp.int32)
    return sched, new_queue


# --------------------------------------------------------------------------------------------
# What the engine's round asks of a scheduler mode
# --------------------------------------------------------------------------------------------


class RoundScheduler(Protocol):
    """What the speculative round calls on its scheduler mode (`RoundConfig.mode`; the modes
    themselves: `serving.modes`). Hashable: it is part of the round's static config."""

    def schedule(self, conf: jax.Array, active: jax.Array, gamma: int, threshold: jax.Array,
                 sps: jax.Array, capacity: jax.Array, sps_draft: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """→ (ℓ [R] int32, the capacity K for two rounds later, G its expected accepts)."""
        ...


def confidence_probs(conf_logits: jax.Array, temperatures: jax.Array | None) -> jax.Array:
    """σ(c_k / T_k) [R, γ]: calibrated per-slot acceptance probabilities."""
    c = conf_logits.astype(jnp.float32)
    if temperatures is not None:
        c = c / temperatures[None, :]
    return jax.nn.sigmoid(c)


def stale_capacity_schedule(conf: jax.Array, active: jax.Array, capacity: jax.Array,
                            sps: jax.Array, objective: jax.Array
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The §5.2 schedule of one round: ℓ [R] admits the top `capacity` current candidates (K,
    computed two rounds before), and the global search of τ · `objective`(B) on these
    confidences gives the K for two rounds later with G, its expected accepted drafts.
    `objective` [B] is SPS itself (the paper's) or the drafting rounds per second
    1 / (t_d + t_v(B)) (`serving.policy`)."""
    lengths = topk_admission(conf, active, capacity, sps).lengths
    glob = schedule_verification(conf, active, objective, early_stop=False)
    n_act = jnp.sum(active).astype(jnp.float32)
    return (lengths, jnp.sum(glob.lengths).astype(jnp.int32),
            (glob.expected_accepts - n_act).astype(jnp.float32))


def drafting_pays(capacity: jax.Array, gain: jax.Array, n_then: jax.Array, n_active: jax.Array,
                  ratio: jax.Array, sps_draft: jax.Array, plain_sps: jax.Array, gamma: int
                  ) -> jax.Array:
    """The ``adaptive`` mode's per-round choice on device (``serving.policy.plain_or_draft``'s
    rule in float32, for the rounds after the first of a device call): draft iff
    ``Θ_b = (n + ρ·G·n / n_then) · sps_draft(n + min(K, n·γ)) ≥ Θ_a = n · plain_sps(n)``,
    where ``K``, ``G`` and ``n_then`` are the estimate of two rounds before (``n_then = 0``:
    none, so the host decides), ``ρ`` the calibration ratio, ``sps_draft [B]`` the drafting
    rounds per second ``1 / (t_d + t_v(B))`` and ``plain_sps [n]`` the plain rounds per
    second by active requests."""
    n = n_active.astype(jnp.int32)
    k = jnp.minimum(capacity.astype(jnp.int32), n * int(gamma))
    g = ratio * gain * n.astype(jnp.float32) / jnp.maximum(n_then, 1).astype(jnp.float32)
    b = jnp.minimum(n + k, sps_draft.shape[0] - 1)
    theta_draft = (n.astype(jnp.float32) + g) * sps_draft[b]
    theta_plain = n.astype(jnp.float32) * plain_sps[jnp.minimum(n, plain_sps.shape[0] - 1)]
    return (n_then > 0) & (theta_draft >= theta_plain)
