"""Acceptance statistics of speculative decoding (SPEC §1 step 7 and §6; paper §4 Table 1, Figure 2).

Per dataset, from per-round records (one verification round = one target forward), in
DeepSpec's bookkeeping (its ``generate_decoding_sample`` / ``verify_draft_tokens``):

* ``proposed[r]``: draft tokens proposed, i.e. sent to verification, in round ``r``;
* ``accepted[r]``: accepted drafts in round ``r`` (``0..proposed[r]``);
* ``acceptance[r]``: the round's acceptance length: ``accepted[r] + 1`` (the accepted drafts and
  the correction/bonus token), except on a round whose accepted drafts hold a stop token at
  index ``e``, which ends the request there: DeepSpec then records ``e + 1`` as the acceptance
  length, the accepted count *and* the proposal length (the drafts up to and including the stop
  token, no bonus). Without ``acceptance`` every round counts ``accepted + 1``, which is exact
  only when no round ended on a stop token among its accepted drafts.

The rounds themselves must be DeepSpec's too: its loop runs ``while start < max_length``, i.e. a
request runs another full-block round while it has emitted at most ``max_new_tokens`` tokens
(one more round than needed when a round ends exactly on the budget) and the output is truncated
afterwards. ``serving.EngineSettings(budget_rule="deepspec")`` does this, as
``serving.speculative_generate`` and ``dspark_jax.evaluate`` use it.

Statistics (DeepSpec conventions, pooled over the dataset; identical to its evaluator's
``build_metrics_row``):

* ``tau = sum(acceptance) / R`` — DeepSpec's ``acceptance_length``;
* ``verify_rate = sum(acceptance) / (sum(proposed) + R)`` — committed tokens per verified
  token (the anchor of every round counts as verified);
* ``accept_rate_at[k]`` (k = 0..gamma-1) — cumulative prefix survival:
  ``#{accepted >= k + 1} / #{proposed > k}`` (DeepSpec's ``accepted_at_pos / proposals_at_pos``);
* ``conditional_acceptance[k] = accept_rate_at[k] / accept_rate_at[k - 1]`` (k = 0: ``accept_rate_at[0]``)
  — the paper's position-wise conditional acceptance (Figure 2).  With a constant proposal length
  (the offline protocol) it is exactly ``P(slot k accepted | slots < k accepted)``.

A ratio whose denominator is 0 is NaN (``None`` in :meth:`AcceptanceStats.to_dict`, so the output is
strict JSON).  :func:`macro_mean` averages several datasets (the "mean" column of Table 1).
The paper's own Table 1 is :mod:`dspark_jax.eval.paper_table` (its names are importable here too).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from dspark_jax.eval.paper_table import PAPER_DATASETS, PAPER_TABLE1_TAU
from dspark_jax.eval.report_numbers import json_float, nanmean, ratio

__all__ = [
    "AcceptanceStats",
    "acceptance_stats",
    "stats_from_records",
    "macro_mean",
    "summarize",
    "PAPER_DATASETS",
    "PAPER_TABLE1_TAU",
]


@dataclass(frozen=True)
class AcceptanceStats:
    """Acceptance statistics of one dataset (or a macro mean of several)."""

    rounds: int  # R, number of verification rounds
    gamma: int  # block size used for the per-position statistics
    tau: float  # sum(acceptance) / R  (acceptance = accepted + 1, or eos_pos + 1 on a stop round)
    verify_rate: float  # sum(acceptance) / (sum(proposed) + R)
    accept_rate_at: tuple[float, ...]  # [gamma] cumulative prefix survival
    conditional_acceptance: tuple[float, ...]  # [gamma] position-wise conditional acceptance
    total_accepted: int  # sum(accepted)
    total_proposed: int  # sum(proposed)
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (NaN -> None)."""
        return {
            "name": self.name,
            "rounds": int(self.rounds),
            "gamma": int(self.gamma),
            "tau": json_float(self.tau),
            "verify_rate": json_float(self.verify_rate),
            "accept_rate_at": [json_float(v) for v in self.accept_rate_at],
            "conditional_acceptance": [json_float(v) for v in self.conditional_acceptance],
            "total_accepted": int(self.total_accepted),
            "total_proposed": int(self.total_proposed),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AcceptanceStats":
        """Inverse of :meth:`to_dict` (None -> NaN)."""
        f = lambda v: math.nan if v is None else float(v)  # noqa: E731
        return cls(
            rounds=int(d["rounds"]),
            gamma=int(d["gamma"]),
            tau=f(d["tau"]),
            verify_rate=f(d["verify_rate"]),
            accept_rate_at=tuple(f(v) for v in d["accept_rate_at"]),
            conditional_acceptance=tuple(f(v) for v in d["conditional_acceptance"]),
            total_accepted=int(d["total_accepted"]),
            total_proposed=int(d["total_proposed"]),
            name=d.get("name"),
        )


def _conditional(rates: Sequence[float]) -> tuple[float, ...]:
    out = []
    for k, rate in enumerate(rates):
        if k == 0:
            out.append(float(rate))
        else:
            prev = rates[k - 1]
            out.append(ratio(rate, prev) if not (math.isnan(prev) or math.isnan(rate)) else math.nan)
    return tuple(out)


def acceptance_stats(
    proposed: Sequence[int] | np.ndarray,  # [R]
    accepted: Sequence[int] | np.ndarray,  # [R]
    gamma: int | None = None,
    name: str | None = None,
    acceptance: Sequence[int] | np.ndarray | None = None,  # [R]
) -> AcceptanceStats:
    """Statistics of one dataset from per-round ``proposed`` / ``accepted`` counts and DeepSpec's
    per-round ``acceptance`` lengths (module docstring; None: ``accepted + 1`` every round).

    ``gamma`` defaults to ``max(proposed)`` (0 if there are no rounds).  Raises ``ValueError`` on
    shape mismatch, negative counts, ``accepted > proposed``, ``proposed > gamma``, or an
    acceptance length that is neither ``accepted + 1`` nor a stop round's
    ``accepted == proposed >= 1``.
    """
    prop = np.asarray(proposed, dtype=np.int64).reshape(-1)
    acc = np.asarray(accepted, dtype=np.int64).reshape(-1)
    if prop.shape != acc.shape:
        raise ValueError(f"proposed {prop.shape} and accepted {acc.shape} differ in length")
    if np.any(prop < 0) or np.any(acc < 0):
        raise ValueError("counts must be non-negative")
    if np.any(acc > prop):
        raise ValueError("accepted must not exceed proposed")
    if acceptance is None:
        alen = acc + 1
    else:
        alen = np.asarray(acceptance, dtype=np.int64).reshape(-1)
        if alen.shape != acc.shape:
            raise ValueError(f"acceptance {alen.shape} and accepted {acc.shape} differ in length")
        stop_round = (alen == acc) & (acc == prop) & (acc >= 1)
        if np.any((alen != acc + 1) & ~stop_round):
            r = int(np.nonzero((alen != acc + 1) & ~stop_round)[0][0])
            raise ValueError(
                f"round {r}: acceptance length {int(alen[r])} with accepted={int(acc[r])}, "
                f"proposed={int(prop[r])}: expected accepted + 1, or on a stop round "
                "acceptance == accepted == proposed >= 1")
    r_ = int(prop.size)
    if gamma is None:
        gamma = int(prop.max()) if r_ else 0
    gamma = int(gamma)
    if r_ and int(prop.max()) > gamma:
        raise ValueError(f"a round proposed {int(prop.max())} > gamma={gamma} drafts")
    committed = int(alen.sum())
    rates = tuple(
        ratio(int(np.sum(acc >= k + 1)), int(np.sum(prop > k))) for k in range(gamma)
    )
    return AcceptanceStats(
        rounds=r_,
        gamma=gamma,
        tau=ratio(committed, r_),
        verify_rate=ratio(committed, int(prop.sum()) + r_),
        accept_rate_at=rates,
        conditional_acceptance=_conditional(rates),
        total_accepted=int(acc.sum()),
        total_proposed=int(prop.sum()),
        name=name,
    )


def stats_from_records(
    records: Iterable[Mapping[str, Any]], gamma: int | None = None, name: str | None = None,
    *, source: str | os.PathLike | None = None,
) -> AcceptanceStats:
    """Same as :func:`acceptance_stats` from records ``{"proposed": int, "accepted": int}``, with
    ``"acceptance": int`` (DeepSpec's acceptance length of the round) where the records have it
    (all of them or none).

    Records without ``"acceptance"`` are counted ``accepted + 1`` every round, which overstates
    τ by one token on each round that ended on a stop token among its accepted drafts; a
    ``UserWarning`` naming ``source`` (the file the records came from) says so.
    """
    recs = list(records)
    has = ["acceptance" in r for r in recs]
    if any(has) and not all(has):
        raise ValueError("some records have 'acceptance' and others not")
    if recs and not any(has):
        warnings.warn(
            f"{source if source is not None else 'records'}: no per-round 'acceptance' "
            "lengths; τ counts accepted + 1 on every round, one token too many on a round that "
            "ended on a stop token among its accepted drafts", UserWarning, stacklevel=2)
    return acceptance_stats(
        [int(r["proposed"]) for r in recs], [int(r["accepted"]) for r in recs], gamma=gamma,
        name=name, acceptance=[int(r["acceptance"]) for r in recs] if all(has) and recs else None,
    )


def macro_mean(
    stats: Mapping[str, AcceptanceStats] | Sequence[AcceptanceStats], name: str = "mean"
) -> AcceptanceStats:
    """Unweighted mean over datasets (each dataset counts once, whatever its number of rounds).

    ``tau``, ``verify_rate``, ``accept_rate_at[k]`` and ``conditional_acceptance[k]`` are averaged
    over the datasets where they are defined
    (:func:`~dspark_jax.eval.report_numbers.nanmean`: NaN, ±inf and None skipped; a dataset with
    a smaller ``gamma`` contributes nothing to the higher positions).  ``rounds`` and the totals
    are summed.  The mean conditional acceptance is the mean of the per-dataset curves, as in the
    paper's Figure 2.
    """
    items = list(stats.values()) if isinstance(stats, Mapping) else list(stats)
    gamma = max((s.gamma for s in items), default=0)

    def at(seq: tuple[float, ...], k: int) -> float:
        return seq[k] if k < len(seq) else math.nan

    return AcceptanceStats(
        rounds=sum(s.rounds for s in items),
        gamma=gamma,
        tau=nanmean([s.tau for s in items]),
        verify_rate=nanmean([s.verify_rate for s in items]),
        accept_rate_at=tuple(nanmean([at(s.accept_rate_at, k) for s in items]) for k in range(gamma)),
        conditional_acceptance=tuple(
            nanmean([at(s.conditional_acceptance, k) for s in items]) for k in range(gamma)
        ),
        total_accepted=sum(s.total_accepted for s in items),
        total_proposed=sum(s.total_proposed for s in items),
        name=name,
    )


def summarize(per_dataset: Mapping[str, AcceptanceStats], mean_key: str = "mean") -> dict[str, Any]:
    """``{dataset: stats.to_dict(), ..., mean_key: macro_mean(...).to_dict()}`` (JSON-ready)."""
    out = {k: v.to_dict() for k, v in per_dataset.items()}
    out[mean_key] = macro_mean(per_dataset, name=mean_key).to_dict()
    return out
