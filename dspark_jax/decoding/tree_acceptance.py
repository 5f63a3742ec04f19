"""The lossless rule for draft trees: recursive rejection sampling over each node's children
(docs/TREES.md §3; SpecInfer's multi-draft speculative sampling; the chain's rule is SPEC §1).

From the anchor, depth by depth: the children of the current node, drawn from q without
replacement in rank order, are tried in that order. Child x_i is accepted with probability
min(1, r(x_i) / q_i(x_i)); on a rejection r ← norm(max(r − q_i, 0)) and q_{i+1} ← q_i without
x_i, renormalised. An accepted child becomes the current node (r ← p there); when no child is
accepted the correction is drawn from r and the round ends; a node with no children emits the
bonus from its p. The emitted tokens are distributed as the target's (proof sketch in
docs/TREES.md). At T = 0 (one-hot p) this is greedy matching: `tree_greedy_verify`.

Randomness enters as explicit uniforms: accept_u [R, γ, c] (depth, sibling rank) and
sample_u [R]. With one child a node (a chain) and the same uniforms the rule is the chain's
(`acceptance_rule.rejection_verify_with_uniforms`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.decoding.acceptance_rule import RESIDUAL_EPS, draw_rows


class TreeVerifyResult(NamedTuple):
    num_accepted: jax.Array   # [R] int32 accepted depth d
    last_cell: jax.Array      # [R] int32 the accepted path's last cell (0: the anchor)
    next_token: jax.Array     # [R] int32 correction or bonus


def _children_of(children: jax.Array, cell: jax.Array, num_nodes: jax.Array) -> jax.Array:
    """[R, c] the admitted children cells of `cell` [R] (−1: none)."""
    kids = jnp.take_along_axis(children, cell[:, None, None], axis=1)[:, 0]      # [R, c]
    return jnp.where((kids >= 1) & (kids <= num_nodes[:, None]), kids, -1)


def tree_greedy_verify(target_argmax: jax.Array, tokens: jax.Array, children: jax.Array,
                       num_nodes: jax.Array, max_depth: int) -> TreeVerifyResult:
    """The rule for one-hot target rows (T = 0): follow the child whose token is the target's
    argmax at its parent, emit the argmax where none is. target_argmax [R, N + 1] (per cell),
    tokens [R, N], children [R, N + 1, c], num_nodes [R] admitted nodes (a prefix)."""
    R = tokens.shape[0]
    cell_tokens = jnp.concatenate([jnp.zeros((R, 1), tokens.dtype), tokens], axis=1)
    cur = jnp.zeros((R,), jnp.int32)
    n_acc = jnp.zeros((R,), jnp.int32)
    for _ in range(max_depth):
        kids = _children_of(children, cur, num_nodes)
        want = jnp.take_along_axis(target_argmax, cur[:, None], axis=1)            # [R, 1]
        kid_tok = jnp.take_along_axis(cell_tokens, jnp.maximum(kids, 0), axis=1)    # [R, c]
        match = (kids >= 1) & (kid_tok == want)
        found = jnp.any(match, axis=1)
        nxt = jnp.max(jnp.where(match, kids, 0), axis=1)
        cur = jnp.where(found, nxt, cur)
        n_acc = n_acc + found.astype(jnp.int32)
    nxt_tok = jnp.take_along_axis(target_argmax, cur[:, None], axis=1)[:, 0]
    return TreeVerifyResult(n_acc, cur, nxt_tok.astype(jnp.int32))


def tree_rejection_verify_with_uniforms(accept_u: jax.Array, sample_u: jax.Array,
                                        target_probs: jax.Array, draft_probs: jax.Array,
                                        tokens: jax.Array, children: jax.Array,
                                        num_nodes: jax.Array, *,
                                        renormalise: bool = True) -> TreeVerifyResult:
    """Recursive rejection sampling down a batch of trees (module docstring).

    accept_u [R, γ, c], sample_u [R] in [0, 1); target_probs p [R, N + 1, V] per cell;
    draft_probs q [R, N + 1, V] (q of each cell's children); tokens [R, N]; children
    [R, N + 1, c]; num_nodes [R]. `renormalise=False` breaks the rule (q_{i+1} keeps the
    rejected tokens' mass): a control that tests must catch."""
    R, max_depth, c = accept_u.shape
    cell_tokens = jnp.concatenate([jnp.zeros((R, 1), tokens.dtype), tokens], axis=1)
    rows = jnp.arange(R)

    def at_cell(x: jax.Array, cell: jax.Array) -> jax.Array:
        return x[rows, cell]

    cur = jnp.zeros((R,), jnp.int32)
    n_acc = jnp.zeros((R,), jnp.int32)
    live = jnp.ones((R,), bool)                 # still descending
    residual = at_cell(target_probs, cur)       # [R, V] r
    for depth in range(max_depth):
        kids = jnp.where(live[:, None], _children_of(children, cur, num_nodes), -1)
        q = at_cell(draft_probs, cur)
        moved = jnp.zeros((R,), bool)
        nxt = cur
        for i in range(c):
            kid = kids[:, i]
            trying = (kid >= 1) & ~moved
            x = jnp.take_along_axis(cell_tokens, jnp.maximum(kid, 0)[:, None], axis=1)[:, 0]
            r_x = residual[rows, x]
            q_x = q[rows, x]
            ok = accept_u[:, depth, i] * q_x < r_x        # u < min(1, r/q), q_x > 0
            accept = trying & ok
            reject = trying & ~ok
            moved = moved | accept
            nxt = jnp.where(accept, kid, nxt)
            left = jnp.maximum(residual - q, 0.0)
            mass = jnp.sum(left, axis=-1, keepdims=True)
            left = jnp.where(mass > RESIDUAL_EPS, left / jnp.maximum(mass, 1e-30), residual)
            residual = jnp.where(reject[:, None], left, residual)
            q_less = q.at[rows, x].set(0.0)
            if renormalise:
                q_less = q_less / jnp.maximum(jnp.sum(q_less, axis=-1, keepdims=True), 1e-30)
            q = jnp.where(reject[:, None], q_less, q)
        cur = jnp.where(moved, nxt, cur)
        n_acc = n_acc + moved.astype(jnp.int32)
        residual = jnp.where(moved[:, None], at_cell(target_probs, cur), residual)
        live = live & moved
    next_token = draw_rows(residual, sample_u)
    return TreeVerifyResult(n_acc, cur, next_token.astype(jnp.int32))
