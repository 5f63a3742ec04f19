"""The cost profile (`serving.cost_profile`): capacity buckets, the SPS step table of Algorithm 1
(paper §3.2.2; SPEC §8–9), round-robin timing with a fake clock, and the disk cache."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.serving import cost_profile as cp
from dspark_jax.serving.engine_spec import bucket_for, capacity_buckets


def test_capacity_buckets():
    assert capacity_buckets(4, 4) == (4, 8, 16, 20)
    assert capacity_buckets(1, 7) == (1, 2, 4, 8)
    assert capacity_buckets(4, 4, [8, 4]) == (4, 8, 20)      # the top R(γ+1) is added
    with pytest.raises(ValueError, match="cannot hold every anchor"):
        capacity_buckets(4, 4, [2, 20])
    assert bucket_for((4, 8, 20), 5) == 8
    with pytest.raises(ValueError, match="exceed the largest"):
        bucket_for((4, 8, 20), 21)


def test_sps_table_is_a_step_function_over_the_buckets():
    # the program that runs B tokens is the smallest bucket ≥ B: SPS(B) = 1 / its seconds
    table = cp.sps_table([2, 4, 8], {2: 0.1, 4: 0.2, 8: 0.25})
    assert table.shape == (9,) and table.dtype == np.float32
    np.testing.assert_allclose(table, [10, 10, 10, 5, 5, 4, 4, 4, 4], rtol=1e-6)
    # noise (a larger bucket timed faster) is clipped: SPS never rises with B
    noisy = cp.sps_table([2, 4, 8], {2: 0.1, 4: 0.3, 8: 0.2})
    assert np.all(np.diff(noisy) <= 0)
    assert noisy[8] == pytest.approx(1 / 0.3)


def _fake_device(cost):
    """A clock that only the calls advance, and calls that take `cost(name)` seconds."""
    clock, calls = [0.0], []

    def make(name):
        def fn():
            calls.append(name)
            clock[0] += cost(name)
            return jnp.zeros(())
        return fn

    return clock, calls, make


def test_profile_calls_round_robin_with_fake_clock():
    def cost(b: int) -> float:   # seconds per step: flat to 8 tokens, then linear
        return 0.01 if b <= 8 else 0.01 * b / 8

    clock, calls, make = _fake_device(cost)
    secs = cp.profile_calls({b: make(b) for b in (1, 8, 16, 32)}, repeats=3,
                            timer=lambda: clock[0])
    assert calls[:4] == [1, 8, 16, 32]                # one untimed call each (compilation)
    assert calls[4:] == [1, 8, 16, 32] * 3            # then round-robin: drift hits all alike
    assert secs == pytest.approx({b: cost(b) for b in (1, 8, 16, 32)})
    with pytest.raises(ValueError, match="repeats"):
        cp.profile_calls({1: make(1)}, repeats=0)


def test_time_call_excludes_warmup():
    clock, calls, make = _fake_device(lambda name: 0.5)
    times = cp.time_call(make("f"), repeats=4, warmup=2, timer=lambda: clock[0])
    assert len(calls) == 6 and times == [0.5] * 4


def test_load_or_profile_caches_on_disk(tmp_path):
    clock, calls, make = _fake_device(lambda b: 0.001 * b)
    buckets = {b: make(b) for b in (4, 8)}
    secs, took, cached = cp.load_or_profile("k1", tmp_path, buckets, repeats=2)
    assert not cached and set(secs) == {4, 8} and took >= 0
    n = len(calls)
    again, took2, cached2 = cp.load_or_profile("k1", tmp_path, buckets, repeats=2)
    assert cached2 and took2 == 0.0 and again == secs and len(calls) == n   # int keys back
    # named calls (the drafter's round, the plain step) share the format
    named = {"draft": make(3), "plain": make(4)}
    s1, _, c1 = cp.load_or_profile("k2", tmp_path, named)
    s2, _, c2 = cp.load_or_profile("k2", tmp_path, named)
    assert (c1, c2) == (False, True) and s1 == s2 and set(s2) == {"draft", "plain"}
    # another set of calls under the same key, or a damaged entry, is profiled again
    _, _, c3 = cp.load_or_profile("k1", tmp_path, {4: make(4)})
    assert not c3
    (tmp_path / "k2.json").write_text("{not json")
    _, _, c4 = cp.load_or_profile("k2", tmp_path, named)
    assert not c4 and "seconds" in json.loads((tmp_path / "k2.json").read_text())
