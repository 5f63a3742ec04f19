"""What a verified round emits and when a request ends (`decoding.emission`; SPEC §1 step 6,
DeepSpec's bookkeeping on stop tokens and its `while start < max_length` budget rule), on small
arrays with no model; and the round's static pieces: the flattened layout, the choice of
forward path and the static config."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.emission import emit_and_finish, emitted_tokens
from dspark_jax.decoding.round_types import RoundConfig
from dspark_jax.decoding.verification import (_dense_anchors, _dense_block, _ragged_deferred,
                                              _ragged_in_place, flatten_plan, forward_path)

NO_STOPS = jnp.asarray([-1], jnp.int32)
DRAFTS = jnp.asarray([[11, 12, 13]], jnp.int32)          # one slot, γ = 3


def _emit(num_accepted: int, next_token: int, remaining: int, *, stops=NO_STOPS,
          lengths: int = 3, active: bool = True, rule: str = "serving"):
    acc = jnp.asarray([num_accepted], jnp.int32)
    tokens = emitted_tokens(DRAFTS, acc, jnp.asarray([next_token], jnp.int32))
    out = emit_and_finish(tokens, acc, jnp.asarray([lengths], jnp.int32),
                          jnp.asarray([active]), jnp.asarray([remaining], jnp.int32), stops,
                          rule)
    return {f.name: np.asarray(getattr(out, f.name))[0] for f in dataclasses.fields(out)}


def test_tokens_are_the_accepted_drafts_then_the_correction():
    acc = jnp.asarray([0, 2, 3], jnp.int32)
    drafts = jnp.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9]], jnp.int32)
    got = emitted_tokens(drafts, acc, jnp.asarray([50, 60, 70], jnp.int32))
    np.testing.assert_array_equal(got, [[50, 50, 50, 50], [4, 5, 60, 60], [7, 8, 9, 70]])


def test_no_stop_emits_accepted_plus_one():
    out = _emit(2, 99, remaining=10)
    assert out["n_emit"] == 3 and not out["finished"]
    assert (out["accepted"], out["proposed"], out["tau_term"]) == (2, 3, 3)
    assert out["tokens"][:3].tolist() == [11, 12, 99]


def test_stop_among_accepted_drafts_follows_deepspec():
    """A stop token at accepted-draft index 1: accepted = proposed = τ term = 2 (no bonus), the
    emission cut after it, the request finished."""
    out = _emit(3, 99, remaining=10, stops=jnp.asarray([12, -1], jnp.int32))
    assert out["n_emit"] == 2 and out["finished"]
    assert (out["accepted"], out["proposed"], out["tau_term"]) == (2, 2, 2)


def test_stop_as_the_correction_token_keeps_the_records():
    out = _emit(1, 99, remaining=10, stops=jnp.asarray([99, -1], jnp.int32))
    assert out["n_emit"] == 2 and out["finished"]
    assert (out["accepted"], out["proposed"], out["tau_term"]) == (1, 3, 2)


def test_stop_in_a_rejected_draft_is_not_emitted():
    out = _emit(1, 99, remaining=10, stops=jnp.asarray([13, -1], jnp.int32))
    assert out["n_emit"] == 2 and not out["finished"]
    assert (out["accepted"], out["proposed"], out["tau_term"]) == (1, 3, 2)


@pytest.mark.parametrize("remaining, serving, deepspec", [
    (2, (2, True), (2, True)),      # the round overshoots the budget: cut, both end
    (3, (3, True), (3, False)),     # exactly on the budget: DeepSpec runs one more round
    (4, (3, False), (3, False)),
    (0, (0, True), (0, True)),      # DeepSpec's extra round: emits nothing and ends
])
def test_budget_rules(remaining, serving, deepspec):
    for rule, (n_emit, finished) in (("serving", serving), ("deepspec", deepspec)):
        out = _emit(2, 99, remaining=remaining, rule=rule)
        assert (int(out["n_emit"]), bool(out["finished"])) == (n_emit, finished), rule
        assert out["accepted"] == 2 and out["tau_term"] == 3   # the records ignore the cut


def test_inactive_slot_emits_nothing_and_does_not_finish():
    out = _emit(2, 99, remaining=0, stops=jnp.asarray([11, -1], jnp.int32), active=False)
    assert out["n_emit"] == 0 and not out["finished"]


def test_unknown_budget_rule():
    with pytest.raises(ValueError, match="budget_rule 'vllm'"):
        _emit(0, 1, remaining=4, rule="vllm")


def test_flatten_plan_is_request_major():
    slot, index, valid, start = flatten_plan(jnp.asarray([2, 0, 3], jnp.int32), 8)
    np.testing.assert_array_equal(slot, [0, 0, 2, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(index[:5], [0, 1, 0, 1, 2])
    np.testing.assert_array_equal(valid, [1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(start, [0, 2, 2])


def test_forward_path_by_slots_drafts_and_width():
    assert forward_path(1, 3, 4) is _dense_block          # one request, a block of ≤ γ+1
    assert forward_path(1, 3, 8) is _ragged_deferred      # one request, wider buckets
    assert forward_path(1, 0, 1) is _ragged_in_place      # one anchor
    assert forward_path(4, 0, 4) is _dense_anchors        # the anchors alone
    assert forward_path(4, 3, 16) is _ragged_deferred


def test_round_config_is_a_static_argument():
    a = RoundConfig(mode="fixed", tap_layer_ids=(1, 2), buckets=(4, 8))
    assert hash(a) == hash(dataclasses.replace(a)) and a == dataclasses.replace(a)
    assert a != dataclasses.replace(a, buckets=(4, 16))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.mode = "threshold"
    with pytest.raises(ValueError, match="budget_rule"):
        RoundConfig(budget_rule="vllm")
    with pytest.raises(ValueError, match="sampler"):
        RoundConfig(sampler="cuda")
