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


class _Node(NamedTuple):
    """The rule at one node: which child it accepted, or the residual it stopped with."""
    moved: jax.Array      # [R] a child was accepted
    child: jax.Array      # [R] its cell
    scale: jax.Array      # [R] C: the residual is max(p − C·q, 0) …
    tried: jax.Array      # [R, c] … except at the tried tokens (first occurrences),
    residual: jax.Array   # [R, c] which hold these


def _try_children(p: jax.Array, q: jax.Array, x: jax.Array, kids: jax.Array,
                  accept_u: jax.Array, renormalise: bool) -> _Node:
    """The children x [R, c] (cells `kids`, −1: none) of a node with target p and draft q
    [R, V], tried in rank order with uniforms accept_u [R, c], the residual in closed form
    (`tree_rejection_verify_with_uniforms`)."""
    c = x.shape[1]
    rank = jnp.arange(c)
    tried = kids >= 1
    p_x = jnp.take_along_axis(p, x, axis=1)
    q_x = jnp.take_along_axis(q, x, axis=1)
    # x_i == x_j for a tried j < i: q_i(x_i) = 0 and r_i(x_i) is x_j's residual
    same = ((x[:, :, None] == x[:, None, :]) & tried[:, None, :]
            & (rank[None, :, None] > rank[None, None, :]))                         # [R, i, j]
    seen = jnp.any(same, axis=2)
    first = tried & ~seen
    same_first = same & first[:, None, :]
    if renormalise:     # Z_i: q's mass left once the earlier tried tokens are removed
        removed = jnp.cumsum(jnp.where(first, q_x, 0.0), axis=1) - jnp.where(first, q_x, 0.0)
        any_before = (jnp.cumsum(tried.astype(jnp.int32), axis=1) - tried) > 0
        z = jnp.where(any_before,
                      jnp.maximum(jnp.sum(q, axis=-1, keepdims=True) - removed, 1e-30), 1.0)
    else:
        z = jnp.ones_like(q_x)
    R = x.shape[0]
    scale = jnp.zeros((R,), jnp.float32)
    mass = jnp.ones((R,), jnp.float32)
    held = jnp.zeros((R,), jnp.float32)     # Σ of the tried tokens' residuals
    residuals: list[jax.Array] = []         # each tried token's unnormalised residual
    moved = jnp.zeros((R,), bool)
    child = jnp.zeros((R,), jnp.int32)
    for i in range(c):
        own = jnp.maximum(p_x[:, i] - scale * q_x[:, i], 0.0)
        for j in range(i):
            own = jnp.where(same_first[:, i, j], residuals[j], own)
        q_i = jnp.where(seen[:, i], 0.0, q_x[:, i] / z[:, i])
        ok = accept_u[:, i] * q_i < own / mass            # u < min(1, r/q), q_x > 0
        trying = tried[:, i] & ~moved
        child = jnp.where(trying & ok, kids[:, i], child)
        moved = moved | (trying & ok)
        # the residual's mass after rejecting x_i: every token at C_{i+1}, plus the tried
        # tokens' own residuals (a rejected token's term is ≤ 0 at any later C)
        scale_next = scale + mass / z[:, i]
        mass_next = held + jnp.sum(jnp.maximum(p - scale_next[:, None] * q, 0.0), axis=-1)
        step = trying & ~ok & (mass_next > RESIDUAL_EPS * mass)
        residuals.append(jnp.where(step, 0.0, own))
        held = held + jnp.where(first[:, i] & ~step, own, 0.0)
        scale = jnp.where(step, scale_next, scale)
        mass = jnp.where(step, mass_next, mass)
    return _Node(moved, child, scale, first, jnp.stack(residuals, axis=1))


def tree_rejection_verify_with_uniforms(accept_u: jax.Array, sample_u: jax.Array,
                                        target_probs: jax.Array, draft_probs: jax.Array,
                                        tokens: jax.Array, children: jax.Array,
                                        num_nodes: jax.Array, *,
                                        target_cells: jax.Array | None = None,
                                        renormalise: bool = True) -> TreeVerifyResult:
    """Recursive rejection sampling down a batch of trees (module docstring), with each node's
    residual in closed form.

    accept_u [R, γ, c], sample_u [R] in [0, 1); target_probs p [R, N + 1, V] per cell, or
    the verification's rows [K, V] with `target_cells` [R, N + 1] naming each cell's row (the
    rule gathers a node's row as it reaches it: no [R, N + 1, V] gather, which a TPU slice's
    compiler rejects where the vocabulary is split over chips); draft_probs q [R, N + 1, V] (q
    of each cell's children); tokens [R, N]; children [R, N + 1, c]; num_nodes [R].
    `renormalise=False` breaks the rule (q_{i+1} keeps the rejected tokens' mass): a control
    that tests must catch.

    At a node, q_i is q less the tokens tried before i, over Z_i, and every rejection subtracts
    a multiple of q from the residual, so after i rejections the unnormalised residual is
    u_i(v) = max(p(v) − C_i·q(v), 0) for every token not yet tried, D_i = Σ u_i is its mass,
    and C_{i+1} = C_i + D_i / Z_i. A rejected token's residual is 0 (r_i(x_i) < q_i(x_i)), and
    stays where it stood when the rule kept the residual (its mass ≤ RESIDUAL_EPS). A sibling
    then costs one reduction over the vocabulary (D_{i+1}) reading p and q, where
    `tree_rejection_verify_stepwise` writes the residual and q back every step; both are the
    same recurrence, up to rounding."""
    R, max_depth, c = accept_u.shape
    V = target_probs.shape[-1]
    cell_tokens = jnp.concatenate([jnp.zeros((R, 1), tokens.dtype), tokens], axis=1)
    rows = jnp.arange(R)

    def at_cell(x: jax.Array, cell: jax.Array) -> jax.Array:
        return x[rows, cell].astype(jnp.float32)

    def target_at(cell: jax.Array) -> jax.Array:
        if target_cells is None:
            return at_cell(target_probs, cell)
        return target_probs[target_cells[rows, cell]].astype(jnp.float32)

    cur = jnp.zeros((R,), jnp.int32)
    n_acc = jnp.zeros((R,), jnp.int32)
    live = jnp.ones((R,), bool)                 # still descending
    # the node each row stopped at: its residual, and its tried tokens
    stop = _Node(live, cur, jnp.zeros((R,), jnp.float32), jnp.zeros((R, c), bool),
                 jnp.zeros((R, c), jnp.float32))
    stop_x = jnp.zeros((R, c), jnp.int32)
    for depth in range(max_depth):
        kids = jnp.where(live[:, None], _children_of(children, cur, num_nodes), -1)
        x = jnp.take_along_axis(cell_tokens, jnp.maximum(kids, 0), axis=1)         # [R, c]
        node = _try_children(target_at(cur), at_cell(draft_probs, cur), x, kids,
                             accept_u[:, depth], renormalise)
        stops = live & ~node.moved
        stop = jax.tree.map(lambda new, old: jnp.where(
            stops.reshape(stops.shape + (1,) * (new.ndim - 1)), new, old), node, stop)
        stop_x = jnp.where(stops[:, None], x, stop_x)
        cur = jnp.where(node.moved, node.child, cur)
        n_acc = n_acc + node.moved.astype(jnp.int32)
        live = live & node.moved
    residual = jnp.maximum(target_at(cur) - stop.scale[:, None] * at_cell(draft_probs, cur),
                           0.0)
    residual = residual.at[rows[:, None], jnp.where(stop.tried, stop_x, V)].set(
        stop.residual, mode="drop")
    next_token = draw_rows(residual, sample_u)
    return TreeVerifyResult(n_acc, cur, next_token.astype(jnp.int32))


def tree_rejection_verify_stepwise(accept_u: jax.Array, sample_u: jax.Array,
                                   target_probs: jax.Array, draft_probs: jax.Array,
                                   tokens: jax.Array, children: jax.Array,
                                   num_nodes: jax.Array, *,
                                   renormalise: bool = True) -> TreeVerifyResult:
    """Recursive rejection sampling down a batch of trees, step by step as docs/TREES.md §3
    writes it: the residual and q updated over the whole vocabulary at every sibling. The
    oracle of `tree_rejection_verify_with_uniforms` (same arguments).

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
