"""The disk-cache keys of the engine's profiles (`cost_profile.profile_key`): the SPS profile
(`profile_buckets`) and the adaptive costs (`profile_costs`) are cached under a key that changes
with what the timed calls depend on — the verifier, the sampler, the drafter's draft vocabulary,
the decoding layout (one buffer per layer or the stacked layers), the draft tree — and stays the same for the
same settings (a rebuilt engine, a drafter with other weights)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.models import init_draft, load_target
from dspark_jax.serving import Engine
from dspark_jax.serving import cost_profile
from dspark_jax.serving.settings import EngineSettings
from hf_tiny import save_tiny_hf

BASE = dict(block_size=3, num_draft_layers=1, target_layer_ids=(-1, 0), mask_token_id=96,
            markov_rank=8)
R = 2
SPS = np.ones(R * (BASE["block_size"] + 1) + 1, np.float32)   # passed in: nothing profiled


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                    layers=2, seed=1))


def _keys(monkeypatch, target, draft, **kw) -> tuple[str, str]:
    """(SPS key, costs key) that `profile_buckets` / `profile_costs` look up, read by a stand-in
    for `cost_profile.load_or_profile` (nothing is timed or written)."""
    kw.setdefault("sps", SPS)
    eng = Engine(target, draft, max_requests=R, max_len=32, scheduler="adaptive",
                 stop_token_ids=[], **kw)
    seen = []

    def lookup(key, cache_dir, calls, repeats=3):
        seen.append(key)
        return {name: 1e-3 for name in calls}, 0.0, True

    monkeypatch.setattr(cost_profile, "load_or_profile", lookup)
    eng.profile_buckets()
    eng.profile_costs()
    assert len(seen) == 2
    return seen[0], seen[1]


def test_profile_keys_name_verifier_sampler_and_draft_vocabulary(target, monkeypatch):
    draft = init_draft(target, BASE, seed=3)
    base = _keys(monkeypatch, target, draft)
    assert base[0] != base[1], "the SPS profile and the costs share a key"
    # identical settings: the same keys (a rebuilt engine; the drafter's weights do not count)
    assert _keys(monkeypatch, target, draft) == base
    assert _keys(monkeypatch, target, init_draft(target, BASE, seed=4)) == base
    assert _keys(monkeypatch, target, draft, verifier="jax", sampler="jax") == base
    variants = {
        "verifier": _keys(monkeypatch, target, draft, verifier="pallas"),
        "sampler": _keys(monkeypatch, target, draft, sampler="pallas"),
        "decoding layout": _keys(monkeypatch, target, draft,
                                 layer_buffers=target.decoding_layout() is target),
        "draft_vocab_size": _keys(monkeypatch, target, init_draft(
            target, dict(BASE, draft_vocab_size=48, draft_vocab=tuple(range(0, 96, 2))),
            seed=3)),
    }
    for what, keys in variants.items():
        assert keys[0] != base[0], f"SPS profile key ignores the {what}"
        assert keys[1] != base[1], f"costs key ignores the {what}"
    every = [k for keys in variants.values() for k in keys]
    assert len(set(every)) == len(every), "two different settings share a key"



def test_profile_keys_name_the_draft_tree(target, monkeypatch):
    """A tree's drafting call costs more than a chain's: trees of other shapes never share a
    profile, even where their verification buckets coincide."""
    draft = init_draft(target, BASE, seed=3)
    sps = np.ones(R * 5 + 1, np.float32)      # the buckets of a 4-node tree
    keys = [_keys(monkeypatch, target, draft, sps=sps, tree_budget=4, tree_branching=c)
            for c in (2, 3)]
    assert _keys(monkeypatch, target, draft, sps=sps, tree_budget=4, tree_branching=2) == keys[0]
    assert keys[0][0] != keys[1][0] and keys[0][1] != keys[1][1]
    assert _keys(monkeypatch, target, draft)[1] not in (keys[0][1], keys[1][1])

def test_profiles_time_steps_inside_one_device_call(target, monkeypatch):
    """The SPS profile and the drafter's cost are a step's share of one device call of
    `profile_steps` steps (the rounds' device loop pays no call overhead a round), under a key
    naming that count; the looped verification equals as many one-step calls (each step
    commits), and the looped drafting drafts from the previous draft."""
    import jax
    import jax.numpy as jnp
    from dspark_jax.decoding import speculative_round as round_

    draft = init_draft(target, BASE, seed=3)
    eng = Engine(target, draft, max_requests=R, max_len=32, scheduler="adaptive", sps=SPS,
                 stop_token_ids=[])
    m = eng.profile_steps
    assert m > 1
    seen = []

    def lookup(key, cache_dir, calls, repeats=3):
        seen.append(list(calls))
        return {name: 1e-3 for name in calls}, 0.0, True

    monkeypatch.setattr(cost_profile, "load_or_profile", lookup)
    secs, _, _ = eng.profile_buckets()
    assert all(v == pytest.approx(1e-3 / m) for v in secs.values())
    assert eng.profile_costs()["draft"] == pytest.approx(1e-3 / m)
    assert f"draft_{m}_steps" in seen[1]

    g, p = eng.gamma, cost_profile.all_slots_active(eng)
    drafts = jnp.asarray(np.arange(R * g).reshape(R, g) % 90 + 1, jnp.int32)
    probs = jnp.full((R, g, eng.V), 1.0 / eng.V, jnp.float32)
    ell = jnp.asarray([g, 1], jnp.int32)

    def verify(state, steps=1):
        return round_.verify_and_commit(eng.config, eng.arrays, state, p, drafts, probs, ell,
                                        capacity=8, steps=steps)

    looped, out = verify(eng.fresh_state(), steps=3)
    s = eng.fresh_state()
    for _ in range(3):
        s, one = verify(s)
    assert np.all(np.asarray(looped.cache.lengths) >= 3)   # each step commits ≥ 1 token
    np.testing.assert_array_equal(looped.cache.lengths, s.cache.lengths)
    for a, b in zip(jax.tree.leaves((looped, out)), jax.tree.leaves((s, one))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)

    def first_draft(state):
        return round_.draft_and_schedule(eng.config, eng.arrays, state, p,
                                         jnp.asarray(R * g, jnp.int32)).tokens[:, 0]

    s0 = eng.fresh_state()
    anchor, _ = cost_profile.draft_step_fn(eng, 2)(0)
    second = first_draft(s0.replace(anchor=first_draft(s0)))
    np.testing.assert_array_equal(anchor, second)


def test_a_verification_step_with_no_active_slot_writes_nothing(target):
    """`verify_and_commit` verifies only when a slot is active: with none, the state (cache,
    lengths, drafter's context, anchors) comes back as it went in."""
    import jax
    import jax.numpy as jnp
    from dspark_jax.decoding import speculative_round as round_

    draft = init_draft(target, BASE, seed=3)
    eng = Engine(target, draft, max_requests=R, max_len=32, scheduler="fixed",
                 stop_token_ids=[])
    g = eng.gamma
    idle = eng.slot_settings(eng.host_arrays())
    state = eng.fresh_state()
    state = state.replace(anchor=jnp.asarray([5, 7], jnp.int32),
                          cache=state.cache.with_lengths(jnp.asarray([3, 4], jnp.int32)))
    before = jax.tree.map(np.asarray, state)
    after, out = round_.verify_and_commit(
        eng.config, eng.arrays, state, idle, jnp.ones((R, g), jnp.int32),
        jnp.full((R, g, eng.V), 1.0 / eng.V, jnp.float32), jnp.zeros((R,), jnp.int32),
        capacity=eng.buckets[0])
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert not np.any(np.asarray(out.n_emit))
