"""The engine's settings (`serving.settings.EngineSettings`): one frozen object built from
`Engine(target, draft, **kw)`'s keywords, validated before anything is built, naming the bad
setting; and what each built-in scheduler mode asks of the engine (`serving.modes`): its traits
and its policy."""

from __future__ import annotations

import dataclasses

import pytest

from dspark_jax.serving import policy
from dspark_jax.serving.modes import scheduler_mode
from dspark_jax.serving.settings import EngineSettings
from scheduler_by_name import CONFIDENCE_MODES, MODES, STALE_CAPACITY_MODES


def test_defaults_and_the_budget_cap():
    st = EngineSettings().validate()
    assert (st.max_requests, st.max_len, st.scheduler) == (16, 2048, "adaptive")
    assert st.caps_budget
    assert not EngineSettings(budget_rule="deepspec").validate().caps_budget
    assert not EngineSettings(cap_to_budget=False).caps_budget
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.max_len = 4


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="max_request"):
        EngineSettings(max_request=4)


@pytest.mark.parametrize("kw, match", [
    (dict(scheduler="greedy"), "unknown scheduler"),
    (dict(verifier="cuda"), "unknown verifier"),
    (dict(sampler="cuda"), "unknown sampler"),
    (dict(budget_rule="vllm"), "unknown budget_rule"),
    (dict(budget_rule="deepspec", cap_to_budget=True), "cap_to_budget"),
    (dict(max_requests=0), "max_requests"),
    (dict(prefill_chunk=0), "prefill_chunk"),
    (dict(prefill_tokens=0), "prefill_tokens must be"),
    (dict(rounds_per_call=0), "rounds_per_call"),
    (dict(scheduler="threshold", threshold=1.5), "threshold"),
    (dict(draft_seconds=-1.0), "draft_seconds"),
    (dict(plain_seconds=0.0), "plain_seconds"),
    (dict(probe_interval=8, max_probe_interval=4), "probe_interval"),
    (dict(explore=2.0), "explore"),
    (dict(max_len=0), "max_len must be ≥ 2"),
    (dict(stop_token_ids=[2, -5]), r"stop_token_ids must be token ids ≥ 0 .* \[2, -5\]"),
    (dict(layer_buffers="yes"), "layer_buffers must be True, False or None"),
])
def test_validate_names_the_bad_setting(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineSettings(**kw).validate()


POLICY_INPUTS = dict(verify_seconds=[1.0] * 9, draft_seconds=0.1, plain_seconds=1.0, gamma=3,
                     initial_capacity=6)


def test_mode_traits():
    assert set(CONFIDENCE_MODES) == {"threshold", "algorithm1", "production", "adaptive"}
    for name in MODES:
        mode = scheduler_mode(name)
        assert mode.name == str(mode) == name
        assert mode.needs_confidence == (name in CONFIDENCE_MODES), name
        assert mode.drafts == (name != "none"), name
        made = mode.new_policy(policy.PolicyInputs(**POLICY_INPUTS))
        assert (made is None) == (not mode.drafts), name
        # the stale-capacity modes search on SPS; only `adaptive` prices the drafter
        if name in STALE_CAPACITY_MODES:
            assert mode.profiles_sps, name
        assert mode.prices_drafting == (name == "adaptive"), name


def test_each_mode_gets_its_policy():
    kw = policy.PolicyInputs(**POLICY_INPUTS)
    kinds = {name: type(scheduler_mode(name).new_policy(kw)) for name in MODES}
    assert kinds["none"] is type(None)
    assert kinds["production"] is policy.CapacityQueue
    assert kinds["adaptive"] is policy.DraftPolicy
    assert {kinds[m] for m in ("fixed", "threshold", "algorithm1")} == {policy.AlwaysDraft}
    always = policy.AlwaysDraft()
    assert always.decide(4) == (True, 0)
    assert always.device_schedule(0) == ([0, 0], None)
    queue = scheduler_mode("production").new_policy(kw)
    queue.replay(True, policy.Estimate(4, 1.0, 2), 0.5, 0.0)
    assert queue.device_schedule(0) == ([6, 4], None)
