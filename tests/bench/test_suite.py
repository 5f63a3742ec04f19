"""The benchmark suite records skips and failures without stopping (the runs themselves are
measured by hand: `python -m dspark_jax.bench.suite --preset cpu-smoke`)."""

from dspark_jax.bench import suite


def test_missing_and_failing_benchmarks_are_recorded():
    skipped = suite.run_one("no_such_bench", [])
    assert skipped["status"] == "skipped" and "not importable" in skipped["reason"]
    failed = suite.run_one("common", [])           # a module without main(): an error
    assert failed["status"] == "error" and "main" in failed["error"]
    ok = {"status": "ok", "wall_s": 1.0, "result": {"ms_per_step": 2.5, "ratio_to_floor": 1.1}}
    table = suite.markdown("cpu-smoke", {"decode_step": ok, "load": skipped}, "cpu")
    assert "| decode_step | ok | 1.0 | decode step ms 2.500, × HBM floor 1.10 |" in table
    assert "| load | skipped |" in table


def test_presets_name_the_four_benchmarks():
    for preset in ("gpu-h200", "cpu-smoke"):
        assert set(suite.PRESETS[preset]) == {"decode_step", "spec_round", "train_step", "load"}
