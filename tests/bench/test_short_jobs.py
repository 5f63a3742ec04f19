"""The short-jobs benchmark's pieces (the runs themselves are measured by hand:
`python -m dspark_jax.bench.short_jobs`): its compile counter counts the programs a phase
compiles, and its rows and table read the children's results."""

import jax
import jax.numpy as jnp

from dspark_jax.bench import short_jobs as sj


def test_compile_counter_counts_a_phase_programs():
    counter, phases = sj.CompileCounter(), {}
    with counter.phase("first", phases):
        jax.jit(lambda x: jnp.sin(x) * 3.0)(jnp.arange(5.0)).block_until_ready()
    f, x = jax.jit(lambda x: x + 1), jnp.ones(3)
    with counter.phase("second", phases):
        f(x).block_until_ready()
        f(x).block_until_ready()       # cached: no second program
    assert phases["first"]["programs"] >= 1 and phases["first"]["compile_s"] > 0
    assert phases["second"]["programs"] == 1 and phases["second"]["cache_hits"] == 0
    assert phases["second"]["wall_s"] > 0
    assert sj.summed(phases)["programs"] == phases["first"]["programs"] + 1


def _phase(programs, compile_s, wall_s, hits=0):
    return dict(programs=programs, cache_hits=hits, compile_s=compile_s, trace_s=0.5,
                lower_s=0.25, wall_s=wall_s)


def test_rows_and_table():
    engine = {"phases": {"load": _phase(9, 1.0, 5.0), "construct": _phase(3, 0.5, 1.0),
                         "generate": _phase(7, 6.0, 12.0, hits=2)},
              "tokens": [[1, 2], [3]], "process_s": 30.0}
    row = sj.job_row("engine", "cold", engine, {"seconds": 39.0, "tokens": [[1, 2], [4]]})
    assert row["programs"] == {"construct": 3, "generate": 7}      # loading left out
    assert row["cache_hits"] == 2 and row["wall_s"] == 13.0
    assert abs(row["compile_s"] - (6.5 + 1.0 + 0.5)) < 1e-9
    assert row["ratio"] == 3.0 and row["bar"] == 1.5 and row["identical"] == 1
    regen = {"phases": {"regenerate": _phase(20, 10.0, 40.0)}, "process_s": 50.0}
    slow = sj.job_row("regenerate", "warm", regen, {"seconds": 25.0})
    assert slow["wall_s"] == 50.0 and slow["ratio"] == 0.5          # the whole process
    skipped = sj.job_row("engine", "warm", engine, {"skipped": "no DeepSpec"})
    failed = sj.job_row("regenerate", "cold", {"error": "exited 1", "process_s": 1.0}, None)
    text = sj.table_text([row, slow, skipped, failed])
    lines = text.splitlines()
    assert lines[0].startswith("job") and "ratio (bar)" in lines[0] and set(lines[1]) == {"-"}
    assert "construct 3, generate 7 (+2 cache hits)" in lines[2]
    assert "3.00× (≥ 1.5×: met)" in lines[2] and "0.50× (≥ 1×: not met)" in lines[3]
    assert "— (no DeepSpec)" in lines[4] and "error: exited 1" in lines[5]


def test_children_get_the_settings():
    a = sj.parse_args(["--draft", "D", "--prompt-file", "mbpp.jsonl", "--engine-prompts", "3"])
    assert a.deepspec_draft == "D"
    b = sj.parse_args(sj.child_argv(a) + ["--child", "engine"])
    assert (b.draft, b.prompt_file, b.engine_prompts, b.child) == ("D", "mbpp.jsonl", 3,
                                                                  "engine")
