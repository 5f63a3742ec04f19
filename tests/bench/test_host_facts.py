"""The host facts CPU benchmarks print next to their figures (`dspark_jax.measurement`)."""

from __future__ import annotations

import pytest

from dspark_jax import measurement as common
from dspark_jax.bench.regenerate import _host_line


def test_memory_copy_bandwidth_is_positive_and_finite():
    gbs = common.memory_copy_gbs(megabytes=8, repeats=2)
    assert 0 < gbs < 10_000


def test_steal_meter_reads_a_fraction_from_proc_stat(monkeypatch):
    ticks = iter([[100, 0, 50, 800, 0, 0, 0, 50, 0, 0],     # at construction
                  [200, 0, 100, 1500, 0, 0, 0, 200, 0, 0]])  # at fraction(): steal 150 of 1000
    monkeypatch.setattr(common, "_cpu_times", lambda: next(ticks))
    assert common.StealMeter().fraction() == pytest.approx(0.15)


def test_steal_meter_without_proc_stat_says_none(monkeypatch):
    monkeypatch.setattr(common, "_cpu_times", lambda: None)
    assert common.StealMeter().fraction() is None


def test_host_line_names_processor_cpus_bandwidth_and_steal():
    host = {"cpu": "AMD EPYC", "logical_cpus": 2, "memory_copy_gbs": 10.2,
            "steal_fraction": 0.2}
    assert _host_line(host) == ("AMD EPYC, 2 logical CPUs, memory copy 10.2 GB/s, "
                                "20% of CPU time stolen during the run")
    host["steal_fraction"] = None
    assert _host_line(host) == "AMD EPYC, 2 logical CPUs, memory copy 10.2 GB/s"


def test_host_facts_fields():
    facts = common.host_facts()
    assert set(facts) == {"cpu", "logical_cpus", "memory_copy_gbs"}
    assert facts["cpu"] and facts["logical_cpus"] >= 1 and facts["memory_copy_gbs"] > 0
