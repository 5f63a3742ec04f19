"""What a verified round emits, and whether a request ends with it (SPEC §1 step 6; DeepSpec's
evaluator's bookkeeping on stop tokens and its token-budget rule).

A pure step on small per-slot arrays, after the acceptance rule: the accepted drafts then the
correction (or bonus) token, cut after the first stop token among them and at the request's
token budget. Plain decoding's one-token steps end requests by the same rule
(`step_emission`). DeepSpec's bookkeeping: a stop token among the accepted drafts at index e records
e + 1 as both accepted and proposed, and e + 1 (no bonus) as the round's acceptance length.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dspark_jax.decoding.round_types import BUDGET_RULES, RoundOutputs
from dspark_jax.decoding.stops import is_stop


def _serving_finished(n_emit: jax.Array, n_through_stop: jax.Array,
                      remaining: jax.Array) -> jax.Array:
    """A request ends once it has emitted its budget."""
    del n_through_stop
    return n_emit >= remaining


def _deepspec_finished(n_emit: jax.Array, n_through_stop: jax.Array,
                       remaining: jax.Array) -> jax.Array:
    """DeepSpec's `while start < max_length`: a request ends only when this round's tokens
    (before the cut at the budget) exceed its budget, so a round that ends exactly on the
    budget is followed by one more."""
    del n_emit
    return n_through_stop > remaining


# budget rule → (tokens emitted, tokens up to the first stop, remaining budget) → ends (no stop)
BUDGET_ENDS: dict[str, Callable[[jax.Array, jax.Array, jax.Array], jax.Array]] = {
    "serving": _serving_finished, "deepspec": _deepspec_finished}


def check_budget_rule(budget_rule: str) -> None:
    """Raises ValueError for a rule that is not in `round_types.BUDGET_RULES`."""
    if budget_rule not in BUDGET_ENDS:
        raise ValueError(f"unknown budget_rule {budget_rule!r}; choose from {BUDGET_RULES}")


def step_emission(live: jax.Array, remaining: jax.Array, stop_hit: jax.Array,
                  budget_rule: str) -> tuple[jax.Array, jax.Array]:
    """A one-token step of plain decoding, per slot [R]: (emits, ends). A live slot emits its
    token while it has budget left, and ends at a stop token or by `budget_rule` — a round
    with no drafts under `emit_and_finish`'s rule."""
    emit = live & (remaining > 0)
    budget_ends = BUDGET_ENDS[budget_rule](emit.astype(jnp.int32), jnp.ones_like(remaining),
                                           remaining)
    return emit, live & (stop_hit | budget_ends)


def emitted_tokens(drafts: jax.Array, num_accepted: jax.Array,
                   next_token: jax.Array) -> jax.Array:
    """[R, γ+1]: each slot's first `num_accepted` drafts, then `next_token` (the correction or
    bonus) in every later cell."""
    cell = jnp.arange(drafts.shape[1] + 1, dtype=jnp.int32)
    drafts_and_last = jnp.pad(drafts, ((0, 0), (0, 1)))
    return jnp.where(cell[None] < num_accepted[:, None], drafts_and_last, next_token[:, None])


def emit_and_finish(tokens: jax.Array, num_accepted: jax.Array, draft_lengths: jax.Array,
                    active: jax.Array, remaining: jax.Array, stop_ids: jax.Array,
                    budget_rule: str) -> RoundOutputs:
    """The round's outputs per slot from its tokens [R, γ+1] (`emitted_tokens`), the accepted
    drafts [R], the verified drafts ℓ [R], which slots run a request [R], their remaining
    budgets [R] and the stop ids (padded with −1). Inactive slots emit nothing and do not
    finish."""
    check_budget_rule(budget_rule)
    cell = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    n_round = num_accepted + 1                  # accepted drafts + the correction / bonus
    stop_hit = is_stop(tokens, stop_ids) & (cell[None] < n_round[:, None])
    any_stop = jnp.any(stop_hit, axis=1)
    first_stop = jnp.argmax(stop_hit, axis=1).astype(jnp.int32)
    stop_in_drafts = any_stop & (first_stop < num_accepted)
    n_through_stop = jnp.where(any_stop, first_stop + 1, n_round)
    n_emit = jnp.where(active, jnp.minimum(n_through_stop, remaining), 0)
    budget_ends = BUDGET_ENDS[budget_rule](n_emit, n_through_stop, remaining)
    return RoundOutputs(
        tokens=tokens, n_emit=n_emit, finished=active & (any_stop | budget_ends),
        accepted=jnp.where(stop_in_drafts, first_stop + 1, num_accepted),
        proposed=jnp.where(stop_in_drafts, first_stop + 1, draft_lengths),
        tau_term=jnp.where(stop_in_drafts, first_stop + 1, n_round))
