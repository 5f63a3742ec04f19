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


def test_load_preset_parses_and_its_headline_is_rendered(tmp_path):
    from dspark_jax.bench import load

    for preset in ("gpu-h200", "cpu-smoke"):
        argv = [x.replace("{out}", str(tmp_path)) for x in suite.PRESETS[preset]["load"]]
        a = load.parse_args(argv)
        assert a.draft == "random" and a.out == f"{tmp_path}/load" and "adaptive" in a.modes
    points = [{"mode": "none", "concurrency": 2, "aggregate_tok_s": 20.0},
              {"mode": "adaptive", "concurrency": 2, "aggregate_tok_s": 19.0}]
    head = load.headline(points)
    assert head == {"none@c2": 20.0, "adaptive@c2": 19.0, "adaptive_over_none@c2": 0.95}
    ok = {"status": "ok", "wall_s": 3.0, "result": {"headline": head}}
    table = suite.markdown("cpu-smoke", {"load": ok}, "cpu")
    assert "| load | ok | 3.0 | none@c2 20, adaptive@c2 19, adaptive_over_none@c2 0.95 |" in table


def _check_sh_commands() -> list[tuple[str, list[str]]]:
    """(module, arguments) of each `$B.MODULE ...` step of the shared GPU check, if present."""
    import pathlib
    import shlex

    repo = pathlib.Path(__file__).resolve().parents[2]
    found = [p for p in (repo.parent / "shared", repo / "shared")
             if (p / "tools/gpu/check.sh").exists()]
    if not found:
        return []
    path = found[0] / "tools/gpu/check.sh"
    out = []
    for line in path.read_text().splitlines():
        words = shlex.split(line) if line.startswith("step ") else []
        if len(words) > 3 and words[3].startswith("$B."):
            out.append((words[3][3:], [w.replace("$OUT", "/tmp/out") for w in words[4:]]))
    return out


def test_the_gpu_check_and_presets_parse_in_their_benchmarks():
    """The GPU check (`../shared/tools/gpu/check.sh`, where present) and the `gpu-h200` and
    `cpu-smoke` presets call the four benchmarks with flags each benchmark accepts."""
    import importlib

    calls = [(name, [x.replace("{out}", "/tmp/out") for x in argv])
             for preset in ("gpu-h200", "cpu-smoke") for name, argv in suite.PRESETS[preset].items()]
    check = _check_sh_commands()
    assert not check or {m for m, _ in check} == {"decode_step", "spec_round", "train_step", "load"}
    for name, argv in calls + check:
        a = importlib.import_module(f"dspark_jax.bench.{name}").parse_args(argv)
        assert a.repeats >= 1, (name, argv)
