"""Draft trees: a static-shape token tree grown from a block drafter's per-position logits
(docs/TREES.md §1–2; beyond the paper's chain of γ drafts, paper §3.2).

A tree of budget N holds N nodes below the anchor. Cell 0 is the anchor and cell i + 1 node i;
node i has a parent cell, a depth in 1..γ, a sibling rank and a token. The nodes are stored in
priority order, so every prefix of them is itself a tree (closed under parents and under earlier
siblings): admitting the first n nodes of a request admits a smaller tree.

Growing it (`grow_tree`) needs one function from the drafter: the logits of the children of a
batch of parents (`ChildLogits`). For DSpark that is U_k + the Markov head's rank-r bias on the
parent's token (a rank-r product per parent, no backbone pass); for DFlash U_k alone. Given
in that low-rank form (`LowRankChildren`), a greedy depth on a GPU takes its children from
`pallas_kernels.tree_children` without writing the frontier's [R, F, V] logits to HBM, and a
DFlash depth ranks U_k once a request. Depth by depth, every frontier node proposes
`branching` children:
  - T > 0: a sample without replacement from the request's drafter distribution q (top-k / top-p
    and temperature applied), in sampling order: the top of log q plus Gumbel noise;
  - T ≤ 0: the top tokens of the logits (the first is the argmax: the greedy chain).
A child's score is its parent's times the mass of its sibling rank: the rank-th largest
probability of the parent's distribution (softmax of the logits at T ≤ 0), which does not
depend on which token that rank drew. The rank-0 path (the chain a chain drafter samples) is
always kept, so the tree contains the chain. The frontier keeps the `budget` best candidates of
each depth, and the tree the `budget` best nodes of all depths.

Lossless at T > 0 (`tree_acceptance`): whether a node is kept depends only on scores that do not
depend on its own token (nor on those of its later siblings and descendants, which rank below
it), so a node that is kept is still a draw from q without the siblings drawn before it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from dspark_jax.decoding.precision import precision_for
from dspark_jax.decoding.sampling import filtered_probs
from dspark_jax.models import layers as L

# a node's most children by default: wide trees accept more than deep ones where the drafter's
# first choice is often wrong (`python -m dspark_jax.experiments.tree_tau --branching C`)
DEFAULT_BRANCHING = 16
# the priority bonus of the chain's nodes (log scores are above −1e3)
_CHAIN_BONUS = 1e4

# (h [R, F, D], U [R, F, Vd], parent tokens [R, F] (target ids), parent states [R, F, r])
#   → (children's logits [R, F, Vd] f32, the children's states [R, F, r])
ChildLogits = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _top_of(logits: jax.Array, c: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The c largest logits, their ids and their softmax masses (one top-k, one
    log-sum-exp)."""
    top_val, ids = jax.lax.top_k(logits, c)
    return top_val, ids, jnp.exp(top_val - jax.nn.logsumexp(logits, axis=-1, keepdims=True))


@dataclasses.dataclass(frozen=True)
class LowRankChildren:
    """`ChildLogits` as U + z·W2ᵀ: `project(h, parent tokens, parent states)` → (z [R, F, r],
    the children's states) and `w2` [Vd, r] (the draft vocabulary's rows); `project=None`:
    the children's logits are U alone (DFlash, the same for every node of a request)."""

    project: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None
    w2: jax.Array | None = None

    def __call__(self, h: jax.Array, u: jax.Array, tokens: jax.Array, states: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
        z, new_states = self.lowrank(h, tokens, states)
        return self.logits(u, z), new_states

    def lowrank(self, h: jax.Array, tokens: jax.Array, states: jax.Array
                ) -> tuple[jax.Array | None, jax.Array]:
        return (None, states) if self.project is None else self.project(h, tokens, states)

    def logits(self, u: jax.Array, z: jax.Array | None) -> jax.Array:
        """[R, F, Vd] f32 from u [R, F, Vd] (or [R, Vd]) and z [R, F, r]."""
        u = u.astype(jnp.float32)
        u = u[:, None] if u.ndim == 2 else u
        if z is None:
            return u
        return u + jnp.einsum("RFr,Vr->RFV", z, self.w2.astype(z.dtype),
                              preferred_element_type=jnp.float32)

    def top(self, u: jax.Array, z: jax.Array | None, c: int, frontier: int
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`_top_of` the children's logits of every frontier node, u [R, Vd]: for U alone from
        u once a request; on a GPU (one device, kernels enabled) from the tree-children kernel,
        the logits never stored; elsewhere from XLA's materialised logits."""
        R = u.shape[0]
        if z is None:
            out = _top_of(u.astype(jnp.float32), c)
            return tuple(jnp.broadcast_to(x[:, None], (R, frontier, c)) for x in out)

        def xla(u, z):
            return _top_of(self.logits(u, z), c)

        if not L.kernels_called_directly():
            return xla(u, z)

        def gpu(u, z, interpret):
            from pallas_kernels.tree_children import top_children

            top_val, ids, lse = top_children(u, z, self.w2, c=c, interpret=interpret)
            return top_val, ids, jnp.exp(top_val - lse[..., None])

        return L.on_gpu(gpu, xla, u, z)


@flax.struct.dataclass
class DraftTree:
    """A batch of draft trees, nodes in priority order (cell i + 1 is node i, cell 0 the
    anchor). `probs[r, c]` is the drafter's distribution q of cell c's children over the
    target vocabulary (what they were drawn from; zeros past depth γ − 1), computed where it
    is read: only a sampled verification reads it, so a greedy round never stores the
    [R, N + 1, V] array. A tree lives inside the program that grew it (`q_of` closes over its
    arrays)."""

    tokens: jax.Array      # [R, N] int32 node tokens (target vocabulary ids)
    parent: jax.Array      # [R, N] int32 parent cell (0: the anchor)
    depth: jax.Array       # [R, N] int32 in 1..γ (0 for invalid nodes)
    rank: jax.Array        # [R, N] int32 sibling rank
    valid: jax.Array       # [R, N] bool (the valid nodes are a prefix)
    score: jax.Array       # [R, N] f32 log score (rank masses along the path)
    chain: jax.Array       # [R, N] bool: on the rank-0 path (the chain)
    children: jax.Array    # [R, N + 1, c] int32 cells of each cell's children by rank (−1: none)
    q_of: Callable[[], jax.Array] = flax.struct.field(pytree_node=False)   # → `probs`

    @property
    def probs(self) -> jax.Array:
        """[R, N + 1, V] f32 q of each cell's children."""
        return self.q_of()

    @property
    def num_nodes(self) -> jax.Array:
        """[R] int32 valid nodes."""
        return jnp.sum(self.valid, axis=-1).astype(jnp.int32)


def cell_depths(tree: DraftTree) -> jax.Array:
    """[R, N + 1] depth of every cell (0: the anchor)."""
    return jnp.concatenate([jnp.zeros_like(tree.depth[:, :1]), tree.depth], axis=1)


def ancestor_mask(parent: jax.Array, depth_limit: int) -> jax.Array:
    """[R, N + 1, N + 1] bool: cell j sees cell i iff i is j or one of j's ancestors (the
    attention mask of a tree's own tokens in verification). `parent` [R, N] (node i's parent
    cell); `depth_limit` ≥ the trees' depth (γ)."""
    R, N = parent.shape
    up = jnp.concatenate([jnp.zeros((R, 1), jnp.int32), parent.astype(jnp.int32)], axis=1)
    cells = jnp.arange(N + 1, dtype=jnp.int32)
    seen = jnp.broadcast_to(cells[None, :, None] == cells[None, None, :], (R, N + 1, N + 1))
    walk = jnp.broadcast_to(cells[None], (R, N + 1))                 # each cell's ancestor so far
    for _ in range(depth_limit):
        walk = jnp.take_along_axis(up, walk, axis=1)
        seen = seen | (walk[:, :, None] == cells[None, None, :])
    return seen


def path_cells(tree: DraftTree, num_accepted: jax.Array, last_cell: jax.Array,
               max_depth: int) -> jax.Array:
    """[R, max_depth + 1] the cells of the path from the anchor to `last_cell` (cell 0 first,
    then depth 1 …; entries past `num_accepted` repeat the last cell)."""
    R = last_cell.shape[0]
    up = jnp.concatenate([jnp.zeros((R, 1), jnp.int32), tree.parent.astype(jnp.int32)], axis=1)
    out = jnp.zeros((R, max_depth + 1), jnp.int32)
    cur = last_cell.astype(jnp.int32)
    for d in range(max_depth, -1, -1):
        here = d <= num_accepted
        out = out.at[:, d].set(jnp.where(here, cur, 0))
        cur = jnp.where(here, jnp.take_along_axis(up, cur[:, None], axis=1)[:, 0], cur)
    last = jnp.take_along_axis(out, num_accepted[:, None], axis=1)
    position = jnp.arange(max_depth + 1)[None]
    return jnp.where(position <= num_accepted[:, None], out, last)


def _stable_top(key: jax.Array, n: int) -> jax.Array:
    """Indices [..., n] of the n largest keys along the last axis, ties to the lower index."""
    return jnp.argsort(-key, axis=-1, stable=True)[..., :n].astype(jnp.int32)


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [R, F, ...] gathered along axis 1 with idx [R, G] → [R, G, ...]."""
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


@dataclasses.dataclass(frozen=True)
class _Growth:
    """What every depth of one `grow_tree` call reads (its arguments there)."""

    child_logits: ChildLogits
    h: jax.Array                 # [R, γ, D]
    base: jax.Array              # [R, γ, Vd]
    keys: jax.Array              # [R]
    temperature: jax.Array       # [R]
    top_k: jax.Array             # [R]
    top_p: jax.Array             # [R]
    depth_limit: jax.Array       # [R]
    vocab_ids: jax.Array | None  # [Vd] target ids of the draft vocabulary
    c: int                       # children a node

    def q(self, logits: jax.Array) -> jax.Array:
        """Each row's sampling distribution of children's logits [R, F, Vd]."""
        return filtered_probs(logits, self.temperature[:, None], self.top_k[:, None],
                              self.top_p[:, None])


def _candidates(g: _Growth, k: int, tokens: jax.Array, states: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The c children of each of the F frontier nodes [R, F] at block position k:
    (their keys [R, F, c] (finite: drawn), draft-vocabulary ids, rank masses, the children's
    states [R, F, r]). Greedy rows: the top logits and their softmax masses; sampling rows:
    Gumbel-top-c of log q and the rank masses of q."""
    R, F = tokens.shape
    c, sampled = g.c, g.temperature > 0
    hk = jnp.broadcast_to(g.h[:, k][:, None], (R, F, g.h.shape[-1]))
    if isinstance(g.child_logits, LowRankChildren):
        z, child_states = g.child_logits.lowrank(hk, tokens, states)             # [R,F,r]
        logits_of = lambda: g.child_logits.logits(g.base[:, k], z)               # noqa: E731
        greedy = lambda: g.child_logits.top(g.base[:, k], z, c, F)               # noqa: E731
    else:
        uk = jnp.broadcast_to(g.base[:, k][:, None], (R, F, g.base.shape[-1]))
        logits, child_states = g.child_logits(hk, uk, tokens, states)             # [R,F,Vd]
        logits_of = lambda: logits                                                # noqa: E731
        greedy = lambda: _top_of(logits, c)                                       # noqa: E731

    def mixed() -> tuple[jax.Array, jax.Array, jax.Array]:
        logits = jnp.broadcast_to(logits_of(), (R, F, g.base.shape[-1]))
        q = g.q(logits)
        noise = jax.vmap(lambda key: jax.random.gumbel(jax.random.fold_in(key, k),
                                                       logits.shape[1:], jnp.float32))(g.keys)
        perturbed = jnp.where(q > 0, jnp.log(jnp.maximum(q, 1e-38)) + noise, -jnp.inf)
        top_val, child = jax.lax.top_k(perturbed, c)
        mass = jax.lax.top_k(q, c)[0]
        g_val, g_child, g_mass = _top_of(logits, c)
        row = sampled[:, None, None]
        return (jnp.where(row, top_val, g_val), jnp.where(row, child, g_child),
                jnp.where(row, mass, g_mass))

    top_val, child, mass = jax.lax.cond(jnp.any(sampled), mixed, greedy)         # [R,F,c]
    return top_val, child, mass, child_states


def _expand(g: _Growth, k: int, tokens: jax.Array, states: jax.Array, score: jax.Array,
            chain: jax.Array) -> dict[str, jax.Array]:
    """The candidates of depth k + 1, [R, F·c] each: token (target ids), score, chain, rank,
    parent (frontier index) and state."""
    R, F = tokens.shape
    c = g.c
    top_val, child, mass, child_states = _candidates(g, k, tokens, states)
    if g.vocab_ids is not None:   # draft-vocabulary positions → target ids
        child = g.vocab_ids[child]
    ok = (jnp.isfinite(top_val) & (mass > 0) & jnp.isfinite(score)[..., None]
          & (k < g.depth_limit)[:, None, None])
    rank = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (R, F, c))
    out = dict(token=child,
               score=jnp.where(ok, score[..., None] + jnp.log(jnp.maximum(mass, 1e-38)),
                               -jnp.inf),
               chain=chain[..., None] & (rank == 0) & ok, rank=rank,
               parent=jnp.broadcast_to(jnp.arange(F, dtype=jnp.int32)[:, None], (R, F, c)),
               state=jnp.broadcast_to(child_states[:, :, None],
                                      (R, F, c, child_states.shape[-1])))
    return {name: x.reshape((R, F * c) + x.shape[3:]) for name, x in out.items()}


def _priority(nodes: dict[str, jax.Array]) -> jax.Array:
    return nodes["score"] + jnp.where(nodes["chain"], _CHAIN_BONUS, 0.0)


def _grow_pool(g: _Growth, anchor: jax.Array, state0: jax.Array, budget: int
               ) -> dict[str, jax.Array]:
    """Depth by depth, each depth's best `budget` candidates: the pool [R, P] of every kept
    candidate (token, score, chain, rank, state, depth, parent as a pool index, −1 the
    anchor), the next frontier being the depth's kept candidates."""
    R, gamma = g.base.shape[:2]
    tokens, states = anchor.astype(jnp.int32)[:, None], state0[:, None]
    score, chain = jnp.zeros((R, 1), jnp.float32), jnp.ones((R, 1), bool)
    pool: list[dict[str, jax.Array]] = []
    offset = 0
    for k in range(gamma):
        cand = _expand(g, k, tokens, states, score, chain)
        keep = _stable_top(_priority(cand), min(budget, cand["token"].shape[1]))   # [R, F']
        kept = {name: _take(x, keep) for name, x in cand.items()}
        kept["parent"] = (offset - tokens.shape[1] + kept["parent"] if k
                          else jnp.full(keep.shape, -1, jnp.int32))
        kept["depth"] = jnp.full(keep.shape, k + 1, jnp.int32)
        pool.append(kept)
        offset += keep.shape[1]
        tokens, states, score, chain = (kept[n] for n in ("token", "state", "score", "chain"))
    return {name: jnp.concatenate([d[name] for d in pool], axis=1) for name in pool[0]}


def _select(pool: dict[str, jax.Array], budget: int, c: int) -> dict[str, jax.Array]:
    """The tree: the pool's `budget` best nodes in priority order (a prefix of valid nodes,
    closed under parents) with their parent cells, and each cell's children by rank."""
    N = budget
    R, P = pool["score"].shape
    priority = _priority(pool)
    chosen = _stable_top(priority, N)                                           # [R, N] pool idx
    valid = jnp.isfinite(_take(priority, chosen))
    cell_of_pool = jnp.full((R, P), -1, jnp.int32).at[
        jnp.arange(R)[:, None], chosen].set(jnp.arange(1, N + 1, dtype=jnp.int32))
    parent_pool = _take(pool["parent"], chosen)
    parent_cell = jnp.where(parent_pool < 0, 0, jnp.take_along_axis(
        cell_of_pool, jnp.maximum(parent_pool, 0), axis=1))
    valid = valid & (parent_cell >= 0)
    nodes = {name: _take(x, chosen) for name, x in pool.items() if name != "parent"}
    nodes = {name: jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x,
                             -jnp.inf if name == "score" else 0)
             for name, x in nodes.items()}
    nodes.update(valid=valid, parent=jnp.where(valid, parent_cell, 0).astype(jnp.int32))
    nodes["chain"] = nodes["chain"].astype(bool)
    nodes["children"] = jnp.full((R, N + 1, c), -1, jnp.int32).at[
        jnp.arange(R)[:, None], jnp.where(valid, parent_cell, N + 1), nodes["rank"]].set(
        jnp.arange(1, N + 1, dtype=jnp.int32)[None], mode="drop")
    return nodes


def _cell_probs(g: _Growth, anchor: jax.Array, state0: jax.Array, nodes: dict[str, jax.Array],
                width: int) -> Callable[[], jax.Array]:
    """`DraftTree.probs`: q of every kept cell's children over `width` target ids, their
    logits recomputed from the cells' tokens and states (zeros at depth γ), the dots at the
    precision of the drafter's compute dtype."""
    R, gamma = g.base.shape[:2]
    first = jnp.ones((R, 1), bool)
    cell_tokens = jnp.concatenate([anchor.astype(jnp.int32)[:, None], nodes["token"]], 1)
    cell_states = jnp.concatenate([state0[:, None], nodes["state"]], axis=1)
    position = jnp.clip(jnp.concatenate([jnp.zeros((R, 1), jnp.int32), nodes["depth"]], 1), 0,
                        gamma - 1)
    has_children = (jnp.concatenate([first, nodes["depth"] < gamma], axis=1)
                    & jnp.concatenate([first, nodes["valid"]], axis=1))

    def q() -> jax.Array:   # read where the drafter's precision context has ended
        with precision_for(g.h.dtype):
            logits, _ = g.child_logits(_take(g.h, position), _take(g.base, position),
                                       cell_tokens, cell_states)
        probs = jnp.where(has_children[..., None], g.q(logits), 0.0).astype(jnp.float32)
        if g.vocab_ids is None:
            return probs
        return jnp.zeros(probs.shape[:2] + (width,), jnp.float32).at[..., g.vocab_ids].set(
            probs)

    return q


def grow_tree(child_logits: ChildLogits, h: jax.Array, base: jax.Array, anchor: jax.Array,
              state0: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
              top_p: jax.Array, *, budget: int, branching: int,
              depth_limit: jax.Array | None = None, vocab_ids: jax.Array | None = None,
              vocab_size: int | None = None) -> DraftTree:
    """Grows a batch of draft trees of `budget` nodes (module docstring): the candidates of
    each depth (`_expand`), the pool of each depth's best (`_grow_pool`), the tree's nodes
    (`_select`) and, where read, their q (`_cell_probs`).

    h [R, γ, D] the drafter's block outputs and base [R, γ, Vd] its per-position logits U (over
    the draft vocabulary `vocab_ids` [Vd] when pruned, else Vd = V); anchor [R]; state0 [R, r]
    the sequential head's initial state; keys [R] per-request keys; temperature, top_k, top_p
    [R] each request's sampling settings (q is `filtered_probs` of the children's logits);
    depth_limit [R] (default γ): no node deeper (nodes past a request's token budget).
    """
    R, gamma, vd = base.shape
    if int(budget) < gamma:
        raise ValueError(f"tree budget {budget} is below the block's {gamma} drafts")
    if depth_limit is None:
        depth_limit = jnp.full((R,), gamma, jnp.int32)
    g = _Growth(child_logits, h, base, keys, temperature, top_k, top_p, depth_limit,
                vocab_ids, min(int(branching), vd))
    nodes = _select(_grow_pool(g, anchor, state0, int(budget)), int(budget), g.c)
    width = int(vocab_size) if vocab_ids is not None else vd
    return DraftTree(tokens=nodes["token"].astype(jnp.int32), parent=nodes["parent"],
                     depth=nodes["depth"].astype(jnp.int32),
                     rank=nodes["rank"].astype(jnp.int32), valid=nodes["valid"],
                     score=nodes["score"], chain=nodes["valid"] & nodes["chain"],
                     children=nodes["children"],
                     q_of=_cell_probs(g, anchor, state0, nodes, width))


def node_survival(tree: DraftTree, chain_conf: jax.Array | None, max_depth: int) -> jax.Array:
    """[R, N] an estimate of each node's probability of being on the accepted path, made
    non-increasing along the nodes' order (a running minimum), so that admitting the nodes of
    highest estimate admits a prefix (a tree), as the chain's prefix survival does (SPEC §8).

    A node's estimate is its parent's times its edge's: a chain node at depth k takes the
    confidence head's σ(c_k) (`chain_conf` [R, γ], calibrated; None: the rank mass), any other
    node its rank mass (the drafter's probability of its sibling rank, `score` differences);
    `max_depth` ≥ the trees' depth (γ).
    None of them depends on the node's own token, nor the running minimum on later nodes', so
    an admission by these estimates keeps the rule lossless (`scheduler`, Appendix A)."""
    R, N = tree.tokens.shape
    cell_score = jnp.concatenate([jnp.zeros((R, 1), jnp.float32), tree.score], axis=1)
    parent_score = jnp.take_along_axis(cell_score, tree.parent, axis=1)
    edge = jnp.exp(jnp.where(tree.valid, tree.score - parent_score, -jnp.inf))
    if chain_conf is not None:
        conf = jnp.take_along_axis(chain_conf.astype(jnp.float32),
                                   jnp.clip(tree.depth - 1, 0, chain_conf.shape[1] - 1), axis=1)
        edge = jnp.where(tree.chain, conf, edge)
    edge = jnp.where(tree.valid, jnp.clip(jnp.nan_to_num(edge), 0.0, 1.0), 0.0)
    reach = jnp.ones((R, N + 1), jnp.float32)
    for _ in range(max_depth):
        reach = reach.at[:, 1:].set(edge * jnp.take_along_axis(reach, tree.parent, axis=1))
    return jax.lax.cummin(reach[:, 1:], axis=1)


def markov_child_logits(model: Any, vocab_weights: Any = None) -> LowRankChildren:
    """The children's logits of a DSpark drafter: U plus the sequential head's bias on the
    parent's token, z·W2ᵀ (any head kind: the state is carried per node); U alone without a
    Markov head (DFlash)."""
    if not model.cfg.has_markov:
        return LowRankChildren(None)
    ids = model.vocab_ids()
    w2 = None if vocab_weights is None else vocab_weights.get("markov_w2")
    if w2 is None:
        w2 = model.markov.w2.get_value()
        if ids is not None:
            w2 = jnp.take(w2, ids, axis=0)

    def project(h: jax.Array, tokens: jax.Array, states: jax.Array):
        return model.markov.project(h, tokens, states.astype(h.dtype))

    return LowRankChildren(project, w2)
