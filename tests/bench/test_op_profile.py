"""`bench.op_profile` reads a profile's ops on the runtime's threads: how long no op, one op and
two or more ran at once, and the dots' thread time against the rest (checked on hand-made event
timelines, since the numbers are only sums over intervals)."""

from __future__ import annotations

import pytest

from dspark_jax.bench import op_profile


def test_occupancy_splits_the_span_by_ops_running():
    # thread 1: dot 0–10, add 12–20; thread 2: dot 5–8, copy 25–30
    events = [(0, 10, "ynn_fusion.1"), (12, 20, "bitcast_add_fusion.3"),
              (5, 8, "ynn_fusion.2"), (25, 30, "copy_bitcast_fusion.4")]
    occ = op_profile.occupancy(events)
    assert occ == {0: 2 + 5, 1: 5 + 2 + 8 + 5, 2: 3}
    assert sum(occ.values()) == 30
    assert op_profile.occupancy([]) == {0: 0, 1: 0, 2: 0}


def test_three_overlapping_ops_count_as_two_or_more():
    occ = op_profile.occupancy([(0, 6, "a"), (1, 5, "b"), (2, 4, "c")])
    assert occ == {0: 0, 1: 2, 2: 4}


def test_thread_time_separates_dots_from_other_ops():
    events = [(0, 10, "ynn_fusion.1"), (12, 20, "bitcast_add_fusion.3"),
              (5, 8, "xnn_fusion.2"), (25, 30, "copy_bitcast_fusion.4")]
    assert op_profile.thread_time(events) == (13, 13)


def test_summary_is_per_step_in_ms_with_the_byte_floor():
    events = [(0, 4_000_000, "ynn_fusion.1"), (2_000_000, 6_000_000, "wrapped_scatter")]
    s = op_profile.summarise(events, wall_s=0.008, steps=2, nbytes=2e8, copy_gbps=20.0)
    assert s["wall_ms"] == pytest.approx(4.0)
    assert (s["idle_ms"], s["one_op_ms"], s["two_plus_ms"]) == pytest.approx((0.0, 2.0, 1.0))
    assert (s["dots_thread_ms"], s["other_thread_ms"]) == pytest.approx((2.0, 2.0))
    assert s["floor_ms"] == pytest.approx(10.0)
    row = op_profile.table({"parts": {"verify K = 8": dict(s, weight_mb=200.0)}})
    assert "| verify K = 8 | 4.0 | 0.0 | 2.0 | 1.0 | 2.0 | 2.0 | 200 | 10.0 |" in row
    no_floor = op_profile.summarise(events, 0.008, 2, None, 20.0)
    assert no_floor["floor_ms"] is None
    assert "| draft | 4.0 | 0.0 | 2.0 | 1.0 | 2.0 | 2.0 | – | – |" in op_profile.table(
        {"parts": {"draft": dict(no_floor, weight_mb=None)}})


def test_a_trace_starts_beside_a_plugin_built_for_another_jaxlib(tmp_path):
    """With the CUDA plugin of another JAX installed (the test command installs one, to compile
    for an H200), `jax.profiler` crashes when a trace starts unless the plugin's profiler is
    kept out: a fresh process profiles a computation after `skip_mismatched_plugin_profilers`."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        from dspark_jax.bench import op_profile
        print(op_profile.skip_mismatched_plugin_profilers())
        import jax, jax.numpy as jnp
        events, wall = op_profile.profile(lambda: jnp.arange(512.0) @ jnp.arange(512.0), 2)
        print(isinstance(events, list), wall > 0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True True", out.stdout


def test_op_kinds_sum_each_kind_per_step_costliest_first():
    events = [(0, 4_000_000, "ynn_fusion.1"), (0, 2_000_000, "ynn_fusion.7"),
              (1_000_000, 3_000_000, "dynamic-slice_bitcast_fusion.12"), (0, 1_000_000, "copy")]
    assert op_profile.op_kinds(events, steps=2) == {
        "ynn_fusion": 3.0, "dynamic-slice_bitcast_fusion": 1.0, "copy": 0.5}
    assert list(op_profile.op_kinds(events, steps=2, top=1)) == ["ynn_fusion"]


def test_the_guard_wraps_the_profiler_once_and_only_for_a_mismatched_plugin(monkeypatch):
    """A fake `jax_cuda13_pjrt` of another version: plugin profiler registration becomes a
    no-op, everything else passes through, and a second call does not wrap twice; with the
    versions equal nothing changes."""
    from importlib import metadata
    from types import SimpleNamespace

    import jaxlib
    from jax._src import xla_bridge

    calls = []
    fake = SimpleNamespace(register_plugin_profiler=calls.append, other=lambda: "passed")
    monkeypatch.setattr(xla_bridge, "_profiler", fake)
    monkeypatch.setattr(xla_bridge, "_backends", {})

    def dists(version):
        return lambda: [SimpleNamespace(metadata={"Name": "jax_cuda13_pjrt"}, version=version)]

    monkeypatch.setattr(metadata, "distributions", dists(jaxlib.__version__))
    assert op_profile.skip_mismatched_plugin_profilers() == []
    assert xla_bridge._profiler is fake
    monkeypatch.setattr(metadata, "distributions", dists("0.0.1"))
    assert op_profile.skip_mismatched_plugin_profilers() == ["jax_cuda13_pjrt==0.0.1"]
    op_profile.skip_mismatched_plugin_profilers()
    guard = xla_bridge._profiler
    assert isinstance(guard, op_profile._NoPluginProfilers) and guard._real is fake
    guard.register_plugin_profiler("c_api")
    assert calls == [] and guard.other() == "passed"
