"""Verification of draft trees in one target forward, and what it commits (docs/TREES.md §4–5;
the chain's verification is `verification`).

Each request's anchor and its admitted nodes (a prefix of its tree, `DraftTree`) are flattened
into the K slots of a capacity bucket as Q = N + 1 cells a request. The target's ragged forward
places every node at its depth below the anchor (siblings share a position) and lets each cell
attend to the committed prefix and to its own ancestors (`tree.ancestor_mask`), so one forward
gives the target's distribution after every node. The tree's rule (`tree_acceptance`) picks the
accepted path; only that path's K/V rows are written (at the positions they were computed for)
and only its features reach the drafter, so the cache and the drafter's context end as a chain
round's would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.emission import emit_and_finish
from dspark_jax.decoding.precision import model_precision
from dspark_jax.decoding.round_types import (CommitWrites, EngineArrays, EngineState,
                                             RoundConfig, RoundOutputs, SlotSettings)
from dspark_jax.decoding.tree import DraftTree, ancestor_mask, cell_depths, path_cells
from dspark_jax.decoding.tree_acceptance import (TreeVerifyResult, tree_greedy_verify,
                                                 tree_rejection_verify_with_uniforms)
from dspark_jax.decoding.verification import (VerifyPlan, commit_writes, plan_cells,
                                              rule_on_target)
from dspark_jax.models.decoder import RaggedOutput, ragged_forward


def tree_plan(state: EngineState, active: jax.Array, tree: DraftTree, num_nodes: jax.Array,
              capacity: int) -> VerifyPlan:
    """Each active request's anchor and first `num_nodes` nodes, flattened into `capacity`
    slots (`verification.plan_cells`); a node's position is the request's length plus its
    depth."""
    return plan_cells(state, active, tree.tokens, num_nodes, capacity, cell_depths(tree))


def accept_tree(logits: jax.Array, plan: VerifyPlan, slots: SlotSettings, tree: DraftTree,
                num_nodes: jax.Array, max_depth: int) -> TreeVerifyResult:
    """The tree's rule on the target's logits [K, V] under each request's sampling settings
    (`verification.rule_on_target`); with every live request greedy, from the target's argmax
    alone."""
    branching = tree.children.shape[-1]

    def sampled(accept_u: jax.Array, sample_u: jax.Array, probs: jax.Array, cells: jax.Array
                ) -> TreeVerifyResult:
        return tree_rejection_verify_with_uniforms(accept_u, sample_u, probs, tree.probs,
                                                   tree.tokens, tree.children, num_nodes,
                                                   target_cells=cells)

    def greedy(target_argmax: jax.Array) -> TreeVerifyResult:
        return tree_greedy_verify(target_argmax, tree.tokens, tree.children, num_nodes,
                                  max_depth)

    return rule_on_target(logits, plan, slots, (max_depth, branching), sampled, greedy)


def verify_tree(config: RoundConfig, arrays: EngineArrays, state: EngineState,
                slots: SlotSettings, tree: DraftTree, num_nodes: jax.Array, *, capacity: int,
                width: int | None = None) -> tuple[RoundOutputs, CommitWrites]:
    """Verification of each request's first `num_nodes` [R] tree nodes in `capacity` K,
    without touching the state: → (per-slot outputs, the writes `verification.commit`
    applies; token axis `width` ≥ K). Outputs as a chain round's: the accepted path's tokens
    then the correction / bonus, [R, γ + 1]; `proposed` is the depth the admitted nodes reach
    (the positions verified, as a chain's ℓ)."""
    target = nnx.merge(arrays.target_graphdef, arrays.target_state)
    R, N = tree.tokens.shape
    gamma = arrays_gamma(arrays)
    width = capacity if width is None else int(width)
    plan = tree_plan(state, slots.active, tree, num_nodes, capacity)
    admitted = jnp.concatenate([jnp.ones((R, 1), bool),
                                jnp.arange(N)[None] < num_nodes[:, None]], axis=1)
    own = ancestor_mask(tree.parent, gamma) & admitted[:, None, :] & admitted[:, :, None]
    with model_precision(target):
        forward: RaggedOutput = ragged_forward(
            target, plan.tokens, plan.slot, plan.positions, plan.valid, state.cache,
            tap_layer_ids=config.tap_layer_ids, grid=(plan.grid_rows, plan.grid_cells),
            defer_writes=True, own_mask=own)
        logits = target.logits(forward.hidden)
    verdict = accept_tree(logits, plan, slots, tree, num_nodes, gamma)
    path = path_cells(tree, verdict.num_accepted, verdict.last_cell, gamma)     # [R, γ+1]
    cells = plan.cells
    path_tokens = jnp.take_along_axis(cells, path[:, 1:], axis=1)               # [R, γ]
    position = jnp.arange(gamma + 1, dtype=jnp.int32)[None]
    tokens = jnp.where(position < verdict.num_accepted[:, None],
                       jnp.pad(path_tokens, ((0, 0), (0, 1))), verdict.next_token[:, None])
    admitted_depth = jnp.max(jnp.where(jnp.arange(N)[None] < num_nodes[:, None], tree.depth,
                                       0), axis=1)
    outputs = emit_and_finish(tokens, verdict.num_accepted, admitted_depth, slots.active,
                              slots.remaining, arrays.stop_ids, config.budget_rule)
    # the path's cells, flattened; a token is committed iff its cell is on the path
    on_path = jnp.zeros((R, N + 1), bool).at[jnp.arange(R)[:, None], path].set(True)
    committed = plan.valid & on_path[plan.slot, jnp.clip(plan.index, 0, N)] & \
        slots.active[plan.slot]
    writes = commit_writes(plan, forward, slots.active, verdict, tokens, width,
                           committed=committed,
                           dense_index=jnp.take_along_axis(plan.dense_index, path, axis=1))
    return outputs, writes


def arrays_gamma(arrays: EngineArrays) -> int:
    """The drafter's block size γ (the trees' depth)."""
    return int(nnx.merge(arrays.draft_graphdef, arrays.draft_state).cfg.num_drafts)
