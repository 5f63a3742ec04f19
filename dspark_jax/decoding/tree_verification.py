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
from dspark_jax.decoding.sampling import filtered_probs
from dspark_jax.decoding.tree import DraftTree, ancestor_mask, cell_depths, path_cells
from dspark_jax.decoding.tree_acceptance import (TreeVerifyResult, tree_greedy_verify,
                                                 tree_rejection_verify_with_uniforms)
from dspark_jax.decoding.verification import (VerifyPlan, flatten_plan, pad_to, row_keys,
                                              row_uniforms)
from dspark_jax.models.decoder import RaggedOutput, ragged_forward


def tree_plan(state: EngineState, active: jax.Array, tree: DraftTree, num_nodes: jax.Array,
              capacity: int) -> VerifyPlan:
    """Each active request's anchor and first `num_nodes` nodes, flattened into `capacity`
    slots; a node's position is the request's length plus its depth."""
    R, N = tree.tokens.shape
    n_tokens = jnp.where(active, 1 + num_nodes, 0)
    slot, index, valid, start = flatten_plan(n_tokens, capacity)
    cells = jnp.concatenate([state.anchor[:, None].astype(jnp.int32), tree.tokens], axis=1)
    cell_index = jnp.clip(index, 0, N)
    cell = jnp.arange(N + 1, dtype=jnp.int32)
    depth = cell_depths(tree)
    return VerifyPlan(
        cells=cells, slot=slot, index=index, valid=valid, tokens=cells[slot, cell_index],
        positions=state.cache.lengths[slot] + depth[slot, cell_index],
        grid_rows=jnp.where(cell[None] < n_tokens[:, None], start[:, None] + cell[None],
                            capacity),
        grid_cells=slot * (N + 1) + cell_index,
        dense_index=jnp.clip(start[:, None] + cell[None], 0, capacity - 1))


def accept_tree(logits: jax.Array, plan: VerifyPlan, slots: SlotSettings, tree: DraftTree,
                num_nodes: jax.Array, max_depth: int) -> TreeVerifyResult:
    """The tree's rule on the target's logits [K, V] under each request's sampling settings;
    with every live request greedy, from the target's argmax alone."""
    R, _, branching = tree.children.shape

    def sampled(logits: jax.Array) -> TreeVerifyResult:
        probs = filtered_probs(logits, slots.temperature[plan.slot], slots.top_k[plan.slot],
                               slots.top_p[plan.slot])
        key_pairs = jax.vmap(lambda k: jax.random.split(k))(row_keys(slots, 1))
        accept_u = row_uniforms(key_pairs[:, 0], (max_depth, branching))
        sample_u = row_uniforms(key_pairs[:, 1], ())
        return tree_rejection_verify_with_uniforms(
            accept_u, sample_u, probs[plan.dense_index], tree.probs, tree.tokens,
            tree.children, num_nodes)

    def greedy(logits: jax.Array) -> TreeVerifyResult:
        return tree_greedy_verify(jnp.argmax(logits, axis=-1)[plan.dense_index], tree.tokens,
                                  tree.children, num_nodes, max_depth)

    all_greedy = jnp.all(jnp.where(slots.active, slots.temperature <= 0, True))
    return jax.lax.cond(all_greedy, greedy, sampled, logits)


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
    path_index = jnp.take_along_axis(plan.dense_index, path, axis=1)            # [R, γ+1]

    writes = CommitWrites(
        slot=pad_to(plan.slot, width), positions=pad_to(plan.positions, width),
        write_rows=pad_to(jnp.where(committed, plan.slot, R), width, R),
        commit_valid=pad_to(committed, width, False), dense_index=path_index,
        n_commit=jnp.where(slots.active, verdict.num_accepted + 1, 0), tokens=tokens,
        next_anchor=verdict.next_token,
        taps=None if forward.taps is None else pad_to(forward.taps, width),
        new_kv=jax.tree.map(lambda a: pad_to(a, width, axis=1), forward.new_kv))
    return outputs, writes


def arrays_gamma(arrays: EngineArrays) -> int:
    """The drafter's block size γ (the trees' depth)."""
    return int(nnx.merge(arrays.draft_graphdef, arrays.draft_state).cfg.num_drafts)
