"""Draft trees without a model (docs/TREES.md): the grown tree's shape (the chain first, every
prefix a tree, siblings distinct, depth limits), the ancestor mask, the tree rule against the
chain's rule on a chain and against greedy matching on one-hot rows, and, statistically, that
trees grown by Gumbel-top-k from a drafter and verified by recursive rejection sampling emit the
target's joint distribution (with top-k on the drafter), while a broken rule does not."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.acceptance_rule import rejection_verify_with_uniforms
from dspark_jax.decoding.tree import ancestor_mask, grow_tree, node_survival, path_cells
from dspark_jax.decoding.tree_acceptance import (tree_greedy_verify,
                                                 tree_rejection_verify_stepwise,
                                                 tree_rejection_verify_with_uniforms)
from tests.decoding.test_acceptance_rule import chi2_stat

V = 6


def _tables(seed: int, gamma: int, scale: float = 2.0):
    """Drafter logits: a per-depth part [γ, V] and a bias on the parent's token [V, V]."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(gamma, V)) * scale, jnp.float32),
            jnp.asarray(rng.normal(size=(V, V)) * scale, jnp.float32))


def _child_logits(bias):
    return lambda h, u, tokens, states: (u + bias[tokens], states)


def _grow(R, gamma, budget, branching, temperature, seed=0, top_k=0, depth_limit=None):
    base_g, bias = _tables(seed, gamma)
    base = jnp.broadcast_to(base_g, (R, gamma, V))
    keys = jax.random.split(jax.random.key(seed + 1), R)
    fill = lambda v, dt: jnp.full((R,), v, dt)   # noqa: E731
    return grow_tree(_child_logits(bias), jnp.zeros((R, gamma, 1)), base,
                     jnp.zeros((R,), jnp.int32), jnp.zeros((R, 1)), keys,
                     fill(temperature, jnp.float32), fill(top_k, jnp.int32),
                     fill(1.0, jnp.float32), budget=budget, branching=branching,
                     depth_limit=depth_limit), base_g, bias


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_holds_its_chain_and_every_prefix_is_a_tree(temperature):
    gamma, N, c = 3, 9, 3
    tree, base_g, bias = _grow(64, gamma, N, c, temperature)
    tok, par, dep, rank = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.depth,
                                                   tree.rank))
    valid = np.asarray(tree.valid)
    assert valid.all()
    for r in range(64):
        cell_depth = np.concatenate([[0], dep[r]])
        for i in range(N):
            p = par[r, i]
            assert p <= i, "a parent comes before its child"
            assert dep[r, i] == cell_depth[p] + 1
            sibs = [j for j in range(N) if par[r, j] == p]
            assert sorted(rank[r, sibs]) == list(range(len(sibs))), "sibling ranks are a prefix"
            assert len(set(tok[r, sibs])) == len(sibs), "siblings carry distinct tokens"
        # the chain: nodes 0..γ−1, each the rank-0 child of the one before
        assert list(par[r, :gamma]) == list(range(gamma)) and (rank[r, :gamma] == 0).all()
    if temperature == 0:   # the chain is the greedy chain of the drafter
        prev = 0
        for k in range(gamma):
            want = int(jnp.argmax(base_g[k] + bias[prev]))
            assert (tok[:, k] == want).all()
            prev = want
    kids = np.asarray(tree.children)
    for r in range(4):
        for cell in range(N + 1):
            listed = [int(x) for x in kids[r, cell] if x >= 0]
            assert listed == [i + 1 for i in np.argsort(rank[r]) if par[r, i] == cell
                              and i + 1 in listed] and \
                sorted(listed) == sorted(i + 1 for i in range(N) if par[r, i] == cell)


def test_node_survival_is_a_prefix_estimate():
    """Non-increasing along the nodes (admitting the best n admits a prefix), a chain node's
    edge is its confidence, another node's its rank mass, and a child never beats its parent."""
    gamma = 3
    tree, _, _ = _grow(16, gamma, 9, 3, 1.0)
    conf = jnp.full((16, gamma), 0.5)
    s = np.asarray(node_survival(tree, conf, gamma))
    assert (np.diff(s, axis=1) <= 1e-7).all() and (s > 0).all() and (s <= 1).all()
    np.testing.assert_allclose(s[:, :gamma], np.broadcast_to(0.5 ** np.arange(1, gamma + 1),
                                                            (16, gamma)), rtol=1e-6)
    raw = np.asarray(node_survival(tree, None, gamma))
    par = np.asarray(tree.parent)
    for r in range(16):
        cell = np.concatenate([[1.0], raw[r]])
        assert (raw[r] <= cell[par[r]] + 1e-7).all()
    np.testing.assert_allclose(raw[:, 0], np.exp(np.asarray(tree.score)[:, 0]), rtol=1e-6)


def test_depth_limit_and_small_support():
    tree, _, _ = _grow(8, 3, 9, 3, 1.0, top_k=2,
                       depth_limit=jnp.asarray([0, 1, 2, 3, 3, 3, 3, 3], jnp.int32))
    depth, valid = np.asarray(tree.depth), np.asarray(tree.valid)
    assert valid[0].sum() == 0
    for r, limit in enumerate([0, 1, 2, 3]):
        assert (depth[r][valid[r]] <= limit).all()
        assert (np.flatnonzero(~valid[r]) >= valid[r].sum()).all(), "valid nodes: a prefix"
    # top-k 2: at most two children a node
    assert (np.asarray(tree.rank)[valid] < 2).all()
    assert valid[1].sum() == 2 and valid[2].sum() == 2 + 4


def test_ancestor_mask_and_path():
    parent = jnp.asarray([[0, 1, 0, 2, 3]], jnp.int32)     # cells 1..5
    mask = np.asarray(ancestor_mask(parent, 4))[0]
    ancestors = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 3}, 4: {0, 1, 2, 4}, 5: {0, 3, 5}}
    for j, seen in ancestors.items():
        assert set(np.flatnonzero(mask[j])) == seen
    tree = type("T", (), {"parent": parent})
    path = np.asarray(path_cells(tree, jnp.asarray([3]), jnp.asarray([4]), 4))
    assert list(path[0]) == [0, 1, 2, 4, 4]


def test_chain_tree_rule_is_the_chain_rule():
    """A tree whose every node has one child (c = 1), with the same uniforms, emits what the
    chain's rule emits."""
    R, g = 512, 4
    k = jax.random.split(jax.random.key(3), 5)
    tp = jax.nn.softmax(jax.random.normal(k[0], (R, g + 1, V)) * 2, -1)
    dp = jax.nn.softmax(jax.random.normal(k[1], (R, g, V)) * 2, -1)
    drafts = jax.random.categorical(k[2], jnp.log(dp)).astype(jnp.int32)
    acc_u = jax.random.uniform(k[3], (R, g))
    smp_u = jax.random.uniform(k[4], (R,))
    ell = jnp.asarray(np.arange(R) % (g + 1), jnp.int32)
    chain = rejection_verify_with_uniforms(acc_u, smp_u, tp, dp, drafts, ell)
    children = jnp.broadcast_to(jnp.concatenate([jnp.arange(1, g + 1), jnp.asarray([-1])])
                                [None, :, None], (R, g + 1, 1)).astype(jnp.int32)
    q = jnp.concatenate([dp, jnp.zeros((R, 1, V))], axis=1)
    tree = tree_rejection_verify_with_uniforms(acc_u[..., None], smp_u, tp, q, drafts,
                                               children, ell)
    np.testing.assert_array_equal(tree.num_accepted, chain.num_accepted)
    np.testing.assert_array_equal(tree.next_token, chain.next_token)
    np.testing.assert_array_equal(tree.last_cell, chain.num_accepted)


@pytest.mark.parametrize("renormalise", [True, False])
def test_closed_form_rule_is_the_stepwise_rule(renormalise):
    """The rule's closed-form residual (one reduction a sibling) emits what the stepwise
    recurrence of docs/TREES.md §3 emits, token for token: on targets near and far from the
    drafter, on targets whose residual mass vanishes (the rule keeps r), on sparse and one-hot
    targets, and with duplicate siblings."""
    tree, _, _ = _grow(3000, 3, 14, 5, 1.0, seed=5)
    R, N = tree.tokens.shape
    k = jax.random.split(jax.random.key(5), 6)
    q = tree.probs
    noisy = lambda s: jax.nn.softmax(jnp.log(q + 1e-9) + s * jax.random.normal(k[0], q.shape), -1)  # noqa: E731
    sparse = jnp.where(jax.random.uniform(k[1], q.shape) < 0.5, 0.0,
                       jax.nn.softmax(jax.random.normal(k[1], q.shape), -1))
    one_hot = jax.nn.one_hot(jax.random.randint(k[2], q.shape[:2], 0, V), V)
    u = jax.random.uniform(k[3], (R, 3, 5))
    s = jax.random.uniform(k[4], (R,))
    twins = jnp.where(jax.random.uniform(k[5], tree.tokens.shape) < 0.3,
                      jnp.roll(tree.tokens, 1, axis=1), tree.tokens)
    for target, tokens in ((noisy(1.0), tree.tokens), (noisy(3.0), tree.tokens),
                           (0.5 * q, tree.tokens), (sparse, tree.tokens),
                           (one_hot, tree.tokens), (noisy(3.0), twins), (0.5 * q, twins)):
        args = (u, s, target, q, tokens, tree.children, tree.num_nodes)
        closed = tree_rejection_verify_with_uniforms(*args, renormalise=renormalise)
        stepwise = tree_rejection_verify_stepwise(*args, renormalise=renormalise)
        for got, want in zip(closed, stepwise):
            np.testing.assert_array_equal(got, want)
        assert 0 < float(jnp.mean(closed.num_accepted)) < 3


def test_the_rule_reads_the_target_rows_where_verification_left_them():
    """The target's rows handed over as verification's [K, V] with each cell's row
    (`target_cells`, shuffled among spare rows) give what the same rows gathered per cell
    [R, N + 1, V] give."""
    tree, _, _ = _grow(256, 3, 8, 3, 1.0, seed=6)
    R, N = tree.tokens.shape
    k = jax.random.split(jax.random.key(6), 4)
    target = jax.nn.softmax(jnp.log(tree.probs + 1e-9)
                            + 2.0 * jax.random.normal(k[0], tree.probs.shape), -1)
    K = R * (N + 1) + 7                                   # spare rows the rule never reads
    cells = jax.random.permutation(k[1], K)[:R * (N + 1)].reshape(R, N + 1)
    rows = jnp.zeros((K, V)).at[cells].set(target)
    u = jax.random.uniform(k[2], (R, 3, 3))
    s = jax.random.uniform(k[3], (R,))
    args = (tree.probs, tree.tokens, tree.children, tree.num_nodes)
    want = tree_rejection_verify_with_uniforms(u, s, target, *args)
    got = tree_rejection_verify_with_uniforms(u, s, rows, *args, target_cells=cells)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert 0 < float(jnp.mean(want.num_accepted)) < 3


def test_greedy_tree_rule_on_one_hot_rows():
    tree, _, _ = _grow(256, 3, 8, 3, 0.0, seed=4)
    R, N = tree.tokens.shape
    argmax = jax.random.randint(jax.random.key(0), (R, N + 1), 0, V)
    # make the target agree with the tree often: copy a random child's token as the argmax
    pick = jnp.take_along_axis(jnp.concatenate([jnp.zeros((R, 1), jnp.int32), tree.tokens], 1),
                               jnp.maximum(tree.children[..., 0], 0), axis=1)
    argmax = jnp.where(jax.random.uniform(jax.random.key(1), (R, N + 1)) < 0.7, pick, argmax)
    greedy = tree_greedy_verify(argmax, tree.tokens, tree.children, tree.num_nodes, 3)
    one_hot = jax.nn.one_hot(argmax, V)
    u = jax.random.uniform(jax.random.key(2), (R, 3, 3))
    ruled = tree_rejection_verify_with_uniforms(u, jnp.full((R,), 0.5), one_hot, tree.probs,
                                                tree.tokens, tree.children, tree.num_nodes)
    np.testing.assert_array_equal(greedy.num_accepted, ruled.num_accepted)
    np.testing.assert_array_equal(greedy.next_token, ruled.next_token)
    np.testing.assert_array_equal(greedy.last_cell, ruled.last_cell)
    assert 0 < float(jnp.mean(greedy.num_accepted)) < 3


# ------------------------------------------------------------------ statistics
def _target_tables(seed: int):
    """The target: p(x1) [V] and p(x2 | x1) [V, V], with zeros (its top-k / top-p)."""
    rng = np.random.default_rng(seed)
    p1 = rng.dirichlet(np.ones(V) * 0.7)
    p1[rng.choice(V, 1)] = 0
    p2 = rng.dirichlet(np.ones(V) * 0.7, size=V)
    p2[np.arange(V), rng.integers(0, V, V)] = 0
    return p1 / p1.sum(), p2 / p2.sum(-1, keepdims=True)


def _sample_tree_round(n, rule, top_k, seed=0):
    """The first two tokens of n independent tree rounds (γ 2, 5 nodes, 3 children a node)
    after one anchor, against the target's joint."""
    gamma, N, c = 2, 5, 3
    tree, _, _ = _grow(n, gamma, N, c, 1.0, seed=seed, top_k=top_k)
    p1, p2 = _target_tables(seed + 7)
    cells = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), tree.tokens], 1)
    depth = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), tree.depth], 1)
    uniform = jnp.full((V,), 1.0 / V)
    tp = jnp.where((depth == 0)[..., None], jnp.asarray(p1, jnp.float32),
                   jnp.where((depth == 1)[..., None], jnp.asarray(p2, jnp.float32)[cells],
                             uniform))
    k = jax.random.split(jax.random.key(seed + 11), 2)
    res = rule(jax.random.uniform(k[0], (n, gamma, c)), jax.random.uniform(k[1], (n,)), tp,
               tree.probs, tree.tokens, tree.children, tree.num_nodes)
    path = path_cells(tree, res.num_accepted, res.last_cell, gamma)
    tokens = jnp.where(jnp.arange(gamma + 1)[None] < res.num_accepted[:, None],
                       jnp.pad(jnp.take_along_axis(cells, path[:, 1:], 1), ((0, 0), (0, 1))),
                       res.next_token[:, None])
    # a round that emitted one token is continued by the target itself (exact p(x2 | x1))
    toks = np.array(tokens[:, :2])
    acc = np.asarray(res.num_accepted)
    rng = np.random.default_rng(seed)
    stopped = np.flatnonzero(acc == 0)
    toks[stopped, 1] = [rng.choice(V, p=p2[x]) for x in toks[stopped, 0]]
    return toks, p1[:, None] * p2, acc


def _joint_stat(toks, joint):
    cell = toks[:, 0] * V + toks[:, 1]
    p = joint.ravel()
    assert (p[cell] > 0).all(), "a token outside the target's support was emitted"
    keep = p * len(toks) >= 5
    idx = np.where(keep, np.cumsum(keep) - 1, keep.sum())
    probs = np.bincount(idx[p > 0], weights=p[p > 0])
    return chi2_stat(idx[cell], probs)


@pytest.mark.parametrize("top_k", [0, 3])
def test_tree_rounds_emit_the_target_distribution(top_k):
    n = 40000
    toks, joint, acc = _sample_tree_round(n, tree_rejection_verify_with_uniforms, top_k)
    assert 0 < acc.mean() < 2, "need accepts and rejects"
    stat, df = _joint_stat(toks, joint)
    assert stat < 2.0 * df + 40, (stat, df)   # df ≈ 25–30: p ≪ 1e-4 beyond this


def test_a_broken_tree_rule_is_caught():
    """Control: q_{i+1} keeps the rejected siblings' mass (not renormalised)."""
    broken = functools.partial(tree_rejection_verify_with_uniforms, renormalise=False)
    toks, joint, _ = _sample_tree_round(40000, broken, 0)
    stat, df = _joint_stat(toks, joint)
    assert stat > 2.0 * df + 40, (stat, df)
