"""Draft trees through the serving engine (docs/TREES.md): greedy tree decoding equals greedy
autoregressive decoding token for token (every DSpark head kind, DFlash, a pruned draft
vocabulary; a stop token inside the output and the budget cut mid-round), a tree never accepts
less than the chain it holds, a warmed-up tree engine compiles nothing more, and settings a tree
cannot serve are refused. The sampled
distribution test is `test_engine_distribution.test_trees_sample_the_target_with_top_k_top_p`."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dspark_jax.decoding import autoregressive_generate
from dspark_jax.models import init_draft
from dspark_jax.serving import Engine, speculative_generate
from draft_fitting import fit_draft
from tests.serving.test_generation import DRAFTS, PROMPTS, greedy_ref, target  # noqa: F401


@pytest.mark.parametrize("kind,budget,branching", [
    ("dspark_vanilla", 8, 4),
    ("dspark_pruned_vocab", 12, 3),
    ("dspark_rnn", 8, 2), ("dspark_gated", 16, 4), ("dflash", 8, 4)])
def test_greedy_tree_equals_autoregressive(target, greedy_ref, kind, budget, branching):
    draft = init_draft(target, DRAFTS[kind], seed=3)
    res = speculative_generate(target, draft, PROMPTS, max_new_tokens=16, stop_token_ids=[],
                               tree_budget=budget, tree_branching=branching)
    assert res.tokens == greedy_ref
    for proposed, accepted in zip(res.proposed, res.accepted):   # depths verified: γ = 4
        assert all(0 <= a <= p == 4 for a, p in zip(accepted, proposed))


def test_trained_tree_beats_its_chain_and_stays_exact(target):
    """A fitted drafter: with a stop token inside the output and the budget cut mid-round, the
    tree's tokens are the greedy ones, and its τ is at least its chain's."""
    draft, prompts, outs = fit_draft(target, DRAFTS["dspark_rnn"])
    stop = outs[0][9]
    ref = autoregressive_generate(target, prompts, max_new_tokens=23, stop_token_ids=[stop])
    chain = speculative_generate(target, draft, prompts, max_new_tokens=23,
                                 stop_token_ids=[stop])
    tree = speculative_generate(target, draft, prompts, max_new_tokens=23,
                                stop_token_ids=[stop], tree_budget=12, tree_branching=3)
    assert chain.tokens == ref and tree.tokens == ref
    assert tree.tau >= chain.tau > 1.5, (tree.tau, chain.tau)


@pytest.mark.parametrize("mode", [pytest.param("algorithm1", marks=pytest.mark.slow),
                                  pytest.param("production", marks=pytest.mark.slow),
                                  "adaptive"])
def test_scheduled_trees_stay_greedy(target, greedy_ref, mode):
    """The scheduler admits a prefix of each tree by the nodes' survival estimates (an SPS
    that falls with the load prunes some): still the greedy tokens."""
    draft = init_draft(target, DRAFTS["dspark_vanilla"], seed=3)
    R, budget = len(PROMPTS), 8
    top = R * (budget + 1)
    sps = (1.0 / (1.0 + 0.5 * np.arange(top + 1) / R)).astype(np.float32)
    eng = Engine(target, draft, max_requests=R, max_len=64, scheduler=mode, sps=sps,
                 stop_token_ids=[], tree_budget=budget, tree_branching=3,
                 draft_seconds=0.0, plain_seconds=1.0)
    res = eng.generate(PROMPTS, max_new_tokens=16)
    assert res.tokens == greedy_ref
    verified = [p for r in res.per_request for p in r["proposed"]]
    assert min(verified) < 4, "the scheduler should cut some trees short"


def test_serving_engine_caps_trees_at_the_budget(target, greedy_ref):
    """The serving budget rule: no node deeper than a request's remaining budget is drafted,
    and the requests end exactly at their budgets."""
    draft = init_draft(target, DRAFTS["dspark_vanilla"], seed=3)
    eng = Engine(target, draft, max_requests=2, max_len=64, scheduler="fixed",
                 stop_token_ids=[], tree_budget=8, tree_branching=4)
    budget = 5
    res = eng.generate(PROMPTS, max_new_tokens=budget)
    assert res.tokens == [g[:budget] for g in greedy_ref]
    for r in res.per_request:   # no node deeper than the tokens still to emit
        assert all(p < budget for p in r["proposed"])


@pytest.mark.parametrize("kw,match", [
    (dict(tree_budget=2), "below the drafter's block"),
    (dict(tree_budget=8, scheduler="threshold"), "trees are scheduled by"),
    (dict(tree_budget=8, tree_branching=0), "tree_branching"),
    (dict(tree_budget=8, kind="eagle3"), "drafts one chain")])
def test_settings_a_tree_cannot_serve_are_refused(target, kw, match):
    kw = dict(kw)
    draft = init_draft(target, DRAFTS[kw.pop("kind", "dspark_vanilla")], seed=3)
    kw.setdefault("scheduler", "fixed")
    with pytest.raises(ValueError, match=match):
        Engine(target, draft, max_requests=2, max_len=64, **kw)


def test_tree_engine_does_not_recompile_after_warmup(target):
    """Static shapes: once warmed up, a tree engine serves other prompts, join patterns and
    sampling settings without compiling again."""
    import jax

    draft = init_draft(target, DRAFTS["dspark_vanilla"], seed=3)
    R, budget = 2, 8
    sps = (1.0 / (1.0 + 0.5 * np.arange(R * (budget + 1) + 1) / R)).astype(np.float32)
    eng = Engine(target, draft, max_requests=R, max_len=48, scheduler="adaptive", sps=sps,
                 stop_token_ids=[], tree_budget=budget, tree_branching=3,
                 draft_seconds=0.0, plain_seconds=1.0)
    eng.warmup()
    eng.generate(PROMPTS[:2], max_new_tokens=8)
    events = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        res = eng.generate(PROMPTS[::-1], max_new_tokens=6, temperature=[0.0, 1.0, 0.7, 0.0],
                           top_k=[0, 5, 0, 0], top_p=[1.0, 1.0, 0.9, 1.0], seed=[1, 2, 3, 4],
                           arrivals=[0.0, 0.0, 0.01, 0.02])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert events == [], f"{len(events)} compilations after warm-up"
    assert len(res.tokens) == len(PROMPTS) and all(len(t) >= 1 for t in res.tokens)


def test_the_gpu_tree_round_interpreted_is_exact(target, greedy_ref, monkeypatch):
    """The tree round a GPU compiles, run on a CPU with its kernels interpreted
    (`layers.interpret_kernels`): the tree grows its greedy children through the tree-children
    kernel, its verification attends through the decode-attention kernel under the ancestor
    mask (traced with the tree's cells as own keys), and greedy output equals autoregressive
    decoding."""
    import pallas_kernels.decode_attention as DA
    import pallas_kernels.tree_children as TC
    from dspark_jax.models import layers as L

    own_keys, frontiers = [], []
    kernel, children = DA.decode_attention, TC.top_children

    def counted(q, *args, **kw):
        own_keys.append(args[3].shape[1])
        return kernel(q, *args, **kw)

    def counted_children(u, z, w2, **kw):
        frontiers.append(z.shape[1])
        return children(u, z, w2, **kw)

    monkeypatch.setattr(DA, "decode_attention", counted)
    monkeypatch.setattr(TC, "top_children", counted_children)
    draft = init_draft(target, DRAFTS["dspark_vanilla"], seed=3)
    with L.interpret_kernels():
        eng = Engine(target, draft, max_requests=2, max_len=64, scheduler="fixed",
                     stop_token_ids=[], tree_budget=8, tree_branching=4)
        res = eng.generate(PROMPTS, max_new_tokens=16)
        if 9 not in own_keys:   # the rounds came from the compilation cache of an earlier test
            jax.clear_caches()
            res = eng.generate(PROMPTS, max_new_tokens=16)
    assert 9 in own_keys, own_keys   # the tree's cells: the anchor and its 8 nodes
    assert frontiers and max(frontiers) == 8, frontiers   # the widest frontier: the budget
    assert res.tokens == greedy_ref
