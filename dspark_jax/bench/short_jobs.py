"""Short jobs, compilation included: what one process pays, from start to end, for a small
piece of work on a cold (or warm) persistent compilation cache, against the peer it replaces.

Two jobs, each in fresh subprocesses (JAX's persistent compilation cache in a new temporary
directory, `$DSPARK_JAX_COMPILATION_CACHE`: first empty, then, for the second pass, holding
what the first pass stored):

- **regenerate**: `python -m dspark_jax.data.regenerate` on the first `--prompts` prompts of
  `--prompt-file` (greedy, `--max-new-tokens`, `--batch`): the whole process's wall time,
  against Hugging Face transformers' `generate` on the same chat-rendered prompts, same batch and
  new-token cap (static left-padded batches, in its own process, model loading excluded:
  `bench.regenerate.run_transformers`). Bar: ours ≤ theirs (ratio ≥ 1).
- **engine**: `Engine(target, draft, settings=EngineSettings(scheduler="fixed"))` (default
  settings otherwise) built and run once on `--engine-prompts` prompts × `--engine-new-tokens`
  greedy tokens, construction and compilation included, model loading excluded, against
  DeepSpec's own batch-1 loop (`interop.deepspec_loop`, PyTorch) on the same prompts with the
  DeepSpec-format export of the same drafter, model loading excluded. Bar: ours ≥ 1.5× faster.

Every job's process counts the XLA programs it compiles with `jax.monitoring`'s events
(`/jax/core/compile/backend_compile_duration` per program, less the persistent cache's hits,
`/jax/compilation_cache/cache_hits`) and their seconds (backend compile, tracing, lowering),
per phase (engine construction, the `generate` call). The comparison runs once per job,
between our cold and warm runs, so each ratio is of runs back to back (a loaded machine
drifts over minutes); PyTorch's peers slow down far more than JAX when other processes
share the cores, so a ratio means something only on an otherwise idle machine. The table:
per job and cache state, programs
compiled (and cache hits), compile seconds, wall seconds, the comparison's seconds and the
ratio to the bar.

Example (the embedded SmolLM2 target; DeepSpec's source and the eval data under ../shared):
  python -m dspark_jax.bench.short_jobs --draft runs/smollm2_dspark/export \\
      --deepspec-draft runs/smollm2_dspark/export-deepspec-fullvocab \\
      --deepspec-src ../shared/reference/deepspec \\
      --prompt-file ../shared/eval_datasets/mbpp.jsonl --json /tmp/short_jobs.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator, Sequence

from dspark_jax.bench.common import save_json

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
HIT_EVENT = "/jax/compilation_cache/cache_hits"
RESULT_TAG = "SHORT_JOB_RESULT "
BARS = {"regenerate": 1.0, "engine": 1.5}


# ----------------------------------------------------------------------------- compile counts
class CompileCounter:
    """Counts `jax.monitoring` compile events between `phase()` marks: programs handed to the
    backend, persistent-cache hits among them, and the seconds of backend compilation, tracing
    and lowering. Listeners cannot be removed in JAX, so one counter per process."""

    def __init__(self) -> None:
        import jax.monitoring

        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, name: str, secs: float, **_: Any) -> None:
        self.counts[name] += 1
        self.seconds[name] += float(secs)

    def _event(self, name: str, **_: Any) -> None:
        self.counts[name] += 1

    def snapshot(self) -> dict[str, float]:
        hits = self.counts[HIT_EVENT]
        return {"programs": self.counts[COMPILE_EVENT] - hits, "cache_hits": hits,
                "compile_s": self.seconds[COMPILE_EVENT], "trace_s": self.seconds[TRACE_EVENT],
                "lower_s": self.seconds[LOWER_EVENT]}

    @contextlib.contextmanager
    def phase(self, name: str, into: dict[str, Any]) -> Iterator[None]:
        """Records the phase's compile counts and wall seconds under `into[name]`."""
        before, t0 = self.snapshot(), time.perf_counter()
        yield
        after = self.snapshot()
        into[name] = {k: after[k] - before[k] for k in after} | {
            "wall_s": time.perf_counter() - t0}


def summed(phases: dict[str, dict[str, float]]) -> dict[str, float]:
    """The phases' counts and seconds added up."""
    out: dict[str, float] = collections.defaultdict(float)
    for ph in phases.values():
        for k, v in ph.items():
            out[k] += v
    return dict(out)


# ----------------------------------------------------------------------------- children
def read_prompts(path: str, n: int, tokenizer: Any) -> list[list[int]]:
    """The first `n` prompts (first user turns) of a DeepSpec `{"turns"}` file or a named
    prompt source, chat-rendered with the generation prompt."""
    from dspark_jax.data.chat import render_prompt
    from dspark_jax.data.regeneration import load_prompt_files

    convs = load_prompt_files([path])[:n]
    if len(convs) < n:
        raise ValueError(f"{path}: {len(convs)} prompts, {n} requested")
    return [render_prompt([next(m for m in c.messages if m["role"] == "user")], tokenizer)
            .tolist() for c in convs]


def child_regenerate(a: argparse.Namespace) -> dict[str, Any]:
    """The regeneration CLI's `main` in this process, counted."""
    from dspark_jax.data.regeneration import main

    counter, phases = CompileCounter(), {}
    with tempfile.TemporaryDirectory() as tmp, counter.phase("regenerate", phases):
        main(["--target", a.target, "--prompts", a.prompt_file, "--limit", str(a.prompts),
              "--temperature", "0", "--max-new-tokens", str(a.max_new_tokens),
              "--batch-size", str(a.batch), "--out", str(pathlib.Path(tmp) / "out.jsonl"),
              "--no-progress"])
    return {"phases": phases}


def child_transformers(a: argparse.Namespace) -> dict[str, Any]:
    from dspark_jax.bench.regenerate import run_transformers
    from dspark_jax.data.regeneration import load_prompt_files
    from dspark_jax.models.target import load_target

    tok = load_target(a.target).tokenizer
    convs = load_prompt_files([a.prompt_file])[:a.prompts]
    r = run_transformers(convs, tok, batch=a.batch, max_new_tokens=a.max_new_tokens,
                         temperature=0.0, top_k=0, top_p=1.0)
    return {"seconds": r["seconds"], "tokens": r["tokens"]}


def child_engine(a: argparse.Namespace) -> dict[str, Any]:
    """An engine with `EngineSettings(scheduler="fixed")` built and run once, counted per
    phase (loading excluded)."""
    from dspark_jax.models import load_draft, load_target
    from dspark_jax.serving import Engine, EngineSettings

    counter, phases = CompileCounter(), {}
    with counter.phase("load", phases):
        target = load_target(a.target)
        draft = load_draft(a.draft, target)
        prompts = read_prompts(a.prompt_file, a.engine_prompts, target.tokenizer)
    with counter.phase("construct", phases):
        eng = Engine(target, draft, settings=EngineSettings(scheduler="fixed"))
    with counter.phase("generate", phases):
        res = eng.generate(prompts, max_new_tokens=a.engine_new_tokens)
    return {"phases": phases, "tau": res.tau, "tokens": res.tokens}


def child_deepspec(a: argparse.Namespace) -> dict[str, Any]:
    from dspark_jax.interop import deepspec_loop as dl
    from dspark_jax.models.target import load_target

    ok, why = dl.locate_deepspec(a.deepspec_src)
    if not ok:
        return {"skipped": why}
    tok = load_target(a.target).tokenizer
    prompts = read_prompts(a.prompt_file, a.engine_prompts, tok)
    ev = dl.deepspec_evaluator(dl.torch_target(a.target), a.deepspec_draft,
                               max_new_tokens=a.engine_new_tokens, temperature=0.0)
    t0 = time.perf_counter()
    res = dl.run_deepspec_loop(ev, prompts, list(tok.stop_token_ids))
    return {"seconds": time.perf_counter() - t0, "tau": dl.deepspec_tau(res),
            "tokens": [r.tokens for r in res]}


CHILDREN = {"regenerate": child_regenerate, "transformers": child_transformers,
            "engine": child_engine, "deepspec": child_deepspec}


# ----------------------------------------------------------------------------- parent
def run_child(kind: str, argv: Sequence[str], cache_dir: str | None) -> dict[str, Any]:
    """`kind` in a fresh process (`cache_dir`: the persistent compilation cache; None: off);
    → its result, with the whole process's wall seconds (`process_s`)."""
    env = dict(os.environ)
    env["DSPARK_JAX_COMPILATION_CACHE"] = cache_dir or ""
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "dspark_jax.bench.short_jobs", "--child", kind, *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        return {"error": f"{kind} exited {proc.returncode}: {tail}", "process_s": took}
    return json.loads(lines[-1][len(RESULT_TAG):]) | {"process_s": took}


def job_row(job: str, cache: str, ours: dict[str, Any], peer: dict[str, Any] | None
            ) -> dict[str, Any]:
    """One table row: programs compiled per phase, their seconds, our wall seconds (the whole
    process for `regenerate`, construction + `generate` for `engine`), the peer's seconds and
    the ratio peer / ours against the job's bar."""
    row: dict[str, Any] = {"job": job, "cache": cache}
    if "error" in ours:
        return row | {"error": ours["error"]}
    phases = {k: v for k, v in ours["phases"].items() if k != "load"}
    total = summed(phases)
    row["programs"] = {k: int(v["programs"]) for k, v in phases.items()}
    row["cache_hits"] = int(total["cache_hits"])
    row["compile_s"] = total["compile_s"] + total["trace_s"] + total["lower_s"]
    row["backend_compile_s"] = total["compile_s"]
    row["wall_s"] = ours["process_s"] if job == "regenerate" else total["wall_s"]
    row["peer_s"] = None if not peer or "seconds" not in peer else float(peer["seconds"])
    if peer and "seconds" not in peer:
        row["peer_note"] = peer.get("skipped") or peer.get("error")
    row["ratio"] = row["peer_s"] / row["wall_s"] if row["peer_s"] else None
    row["bar"] = BARS[job]
    if job == "engine" and peer and "tokens" in peer:
        row["identical"] = sum(list(map(int, o)) == t for o, t in
                               zip(ours["tokens"], peer["tokens"]))
    return row


COLUMNS = ("job", "cache", "programs compiled per call", "compile s", "wall s", "peer s",
           "ratio (bar)")


def table_cells(row: dict[str, Any]) -> list[str]:
    """A row's cells under `COLUMNS`."""
    if "error" in row:
        return [row["job"], row["cache"], f"error: {row['error']}", "", "", "", ""]
    progs = ", ".join(f"{k} {v}" for k, v in row["programs"].items())
    if row["cache_hits"]:
        progs += f" (+{row['cache_hits']} cache hits)"
    peer = "—" if row["peer_s"] is None else f"{row['peer_s']:.1f}"
    if row.get("peer_note"):
        peer += f" ({row['peer_note']})"
    ratio = "—" if row["ratio"] is None else (
        f"{row['ratio']:.2f}× (≥ {row['bar']:g}×: "
        f"{'met' if row['ratio'] >= row['bar'] else 'not met'})")
    return [row["job"], row["cache"], progs, f"{row['compile_s']:.1f}", f"{row['wall_s']:.1f}",
            peer, ratio]


def table_text(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an aligned text table (a header, a rule, a line per row)."""
    cells = [list(COLUMNS)] + [table_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="regenerate,engine", help="comma-separated: " +
                   ", ".join(BARS))
    p.add_argument("--caches", default="cold,warm",
                   help="cold: an empty compilation cache; warm: the one the cold run filled")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--prompt-file", default="humaneval",
                   help="DeepSpec {\"turns\"} file or named prompt source")
    p.add_argument("--prompts", type=int, default=64, help="regenerate: prompts")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft", default=None, help="engine: drafter (speculators / DeepSpec dir)")
    p.add_argument("--deepspec-draft", default=None,
                   help="engine: the same drafter in DeepSpec's format (default: --draft)")
    p.add_argument("--deepspec-src", default=None, help="DeepSpec's source directory")
    p.add_argument("--engine-prompts", type=int, default=6)
    p.add_argument("--engine-new-tokens", type=int, default=64)
    p.add_argument("--skip-peers", action="store_true", help="time ours only")
    p.add_argument("--json", default=None)
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.deepspec_draft = a.deepspec_draft or a.draft
    return a


def child_argv(a: argparse.Namespace) -> list[str]:
    argv = ["--target", a.target, "--prompt-file", a.prompt_file, "--prompts", str(a.prompts),
            "--batch", str(a.batch), "--max-new-tokens", str(a.max_new_tokens),
            "--engine-prompts", str(a.engine_prompts),
            "--engine-new-tokens", str(a.engine_new_tokens)]
    for flag, value in (("--draft", a.draft), ("--deepspec-draft", a.deepspec_draft),
                        ("--deepspec-src", a.deepspec_src)):
        if value:
            argv += [flag, value]
    return argv


PEERS = {"regenerate": "transformers", "engine": "deepspec"}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.child:
        from dspark_jax.cli_support import enable_compilation_cache

        enable_compilation_cache()
        print(RESULT_TAG + json.dumps(CHILDREN[a.child](a)), flush=True)
        return {}
    jobs = [j for j in a.jobs.split(",") if j]
    caches = [c for c in a.caches.split(",") if c]
    if "engine" in jobs and not a.draft:
        raise SystemExit("error: the engine job needs --draft")
    rows = []
    for job in jobs:
        peer = None
        with tempfile.TemporaryDirectory(prefix="short-jobs-cache-") as cache_dir:
            for cache in caches:
                ours = run_child(job, child_argv(a), cache_dir)
                if peer is None and not a.skip_peers:   # between our cold and warm runs
                    peer = run_child(PEERS[job], child_argv(a), None)
                rows.append(job_row(job, cache, ours, peer))
                print(table_text(rows[-1:]).splitlines()[-1], flush=True)
    print("\nshort jobs, compilation included\n" + table_text(rows))
    result = {"rows": rows, "settings": vars(a)}
    save_json(result, a.json)
    return result


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)    # each child sets its own cache
