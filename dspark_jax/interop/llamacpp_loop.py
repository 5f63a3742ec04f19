"""llama.cpp's own DSpark loop against ours on the same exported drafter.

What it does, for each `--draft` export directory (DeepSpec or speculators format, full or
pruned draft vocabulary, passed to llama.cpp exactly as written; nothing is edited):

1. Converts, with llama.cpp's own, unpatched `LC/convert_hf_to_gguf.py --outtype f32` run by
   `--convert-python` with `PYTHONPATH=LC/gguf-py`:
   - the target: a Hugging Face directory of the embedded SmolLM2 target written here
     (`models.io.gguf_to_hf.write_target_hf`: `read_gguf_checkpoint`'s fp32 tensors = the
     weights our target loads, and our target's own tokenizer, `models.tokenizer.load_tokenizer`),
     or `--target-hf DIR`;
   - the drafter, with `--target-model-dir` that directory (the converter takes the target's
     tokenizer from it).
   The converter needs torch, sentencepiece, safetensors and transformers in the interpreter
   that runs it; the script checks and names what is missing. Conversions are cached under
   `WORK/gguf/` (keyed by the source files' sizes and times; `--reconvert` redoes them).
2. Renders the first `--prompts` first turns of `DATA_DIR/DATASET.jsonl` (DeepSpec's eval
   format) with the chat template (`data.chat.render_prompt`, as `evaluate` does) and checks that
   llama.cpp tokenizes the prompt text to the same ids as ours: with `BUILD/bin/llama-tokenize`
   when it is built (`cmake --build BUILD --target llama-tokenize`, a few seconds), else by the
   count of tokens llama.cpp's loop reports. The text goes in a file read by `-f` (which drops one
   trailing newline, so one is added) with `--no-escape` (code prompts hold backslashes); the
   chat markers are parsed as special tokens, and the SmolLM2 GGUF adds no BOS.
3. Runs `llama-speculative-simple -m TARGET.gguf -md DRAFT.gguf --spec-type draft-dspark
   --spec-draft-n-max γ --temp 0 -v` twice per prompt:
   - "plain": on the prompt, with `-n M`, as a user would. Its output must equal ours token for
     token (the first M tokens, each cut after a stop token), and its decode speed is the
     llama.cpp tok/s of the table.
   - "aligned": on the prompt followed by the first generated token g1, with `-n M+γ`. Rounds
     only line up this way: llama.cpp evaluates all but the last prompt token and drafts its
     first block from the last PROMPT token, while our engine (as DeepSpec's loop) prefills the
     whole prompt, takes g1 from the target and drafts its first block from g1. Given prompt+g1,
     llama.cpp's first round has our first round's context (features of the prompt) and anchor
     (g1 at position P), and every later round follows. `-n M+γ` keeps llama.cpp drafting full
     blocks through all of our rounds (it shortens drafts near its -n). Its output must equal
     ours after g1, and its accepted drafts per round must equal ours, on every round where both
     verified a full block of γ (a round holding a stop token is compared up to the stop).
   Per round, llama.cpp's verbose log gives the drafts (`draft candidate 0, pos i: ID (p)`) and
   `accepted A/N draft tokens, the last target token is: (T)`, so its emitted ids are
   drafts[:A] + [T].
4. Runs our engine (`speculative_generate`, T = 0, batch 1, the drafter read by `load_draft`
   from the same directory, the union of our stop ids and llama.cpp's end-of-generation ids)
   with `-n M`'s budget.
5. Where outputs first differ it prints our target's top-2 logit margin at that token. For a
   prompt whose first difference is a round's accepted count, it recomputes that round:
   our drafter's logits on llama.cpp's drafts (`Draft.block_logits`, teacher-forced Markov
   chain) and our target's logits on them, and prints the top-2 margins (logit units; llama.cpp's
   is log(p0/p1) of its draft candidates, the same quantity). A difference is acceptable only as
   a floating-point near-tie, which these margins show.

Table: drafter, format, vocabulary (full / K), prompts, identical outputs, identical rounds /
compared rounds, llama.cpp τ (mean accepted+1 over the compared rounds, i.e. its full-block
rounds), ours over the same rounds, llama.cpp decode tok/s (plain runs, from its log) and ours
(tokens / wall seconds without JAX compilation, prefill included).

Example (llama.cpp built as ../shared/reference/PEERS.md says, plus `--target llama-tokenize`;
a converter venv with torch, sentencepiece, safetensors, transformers):
  python -m dspark_jax.interop.llamacpp_loop \\
      --llama-cpp /work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp \\
      --build /work/peers/llama-build --convert-python /work/peers/venv-convert/bin/python \\
      --draft runs/smollm2_dspark/export --draft runs/smollm2_dspark/export-deepspec-fullvocab \\
      --prompts 4 --max-new-tokens 64 --threads 1 --work /tmp/lcpp-interop \\
      --data-dir EVAL_DATA --json /tmp/lcpp-interop.json
tests/interop/test_llamacpp_loop.py runs it (slow; LLAMA_CPP_DIR / LLAMA_CPP_BUILD).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Iterator, Sequence

import numpy as np

from dspark_jax.measurement import StealMeter, host_facts, print_table, save_json
from dspark_jax.models.io.gguf_to_hf import write_target_hf

CONVERTER_MODULES = ("numpy", "torch", "sentencepiece", "safetensors", "transformers")
TARGET_NAME = "smollm2-135m-instruct"


class InteropError(RuntimeError):
    """llama.cpp, its converter or its output is not what this check needs (says why)."""


# ----------------------------------------------------------------------------- llama.cpp tree


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    source: pathlib.Path          # the llama.cpp tree (convert_hf_to_gguf.py, gguf-py/)
    build: pathlib.Path           # its CMake build directory (bin/llama-speculative-simple)

    @property
    def converter(self) -> pathlib.Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> pathlib.Path:
        return self.source / "gguf-py"

    @property
    def speculative_simple(self) -> pathlib.Path:
        return self.build / "bin" / "llama-speculative-simple"

    @property
    def tokenize(self) -> pathlib.Path | None:
        p = self.build / "bin" / "llama-tokenize"
        return p if p.exists() else None


def locate_llama_cpp(source: str | os.PathLike, build: str | os.PathLike) -> LlamaCpp:
    """The tree and build, checked; InteropError naming what is missing."""
    lc = LlamaCpp(pathlib.Path(source).resolve(), pathlib.Path(build).resolve())
    for p, what in ((lc.converter, "llama.cpp's converter"), (lc.gguf_py / "gguf", "its gguf-py"),
                    (lc.speculative_simple, "llama-speculative-simple (cmake --build BUILD "
                                            "--target llama-speculative-simple)")):
        if not p.exists():
            raise InteropError(f"{what} is missing: {p}")
    return lc


def converter_env(lc: LlamaCpp) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(lc.gguf_py)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    return env


def check_converter_python(python: str, lc: LlamaCpp) -> None:
    """InteropError unless `python` imports everything llama.cpp's converter needs."""
    code = ("import importlib.util, sys\n"
            f"print(' '.join(m for m in {list(CONVERTER_MODULES)!r} "
            "if importlib.util.find_spec(m) is None))")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True,
                           env=converter_env(lc), timeout=120)
    except OSError as e:
        raise InteropError(f"--convert-python {python}: cannot run it ({e})") from e
    missing = r.stdout.split() if r.returncode == 0 else ["(the interpreter failed: "
                                                           f"{r.stderr.strip()[-300:]})"]
    if missing:
        raise InteropError(
            f"--convert-python {python} lacks {', '.join(missing)}, which llama.cpp's "
            f"convert_hf_to_gguf.py needs (torch, sentencepiece, safetensors, transformers). "
            f"Install them there (pip install torch sentencepiece safetensors transformers "
            f"protobuf) or pass --convert-python PY of a virtual environment that has them.")


# ----------------------------------------------------------------------------- conversion


def _fingerprint(*dirs: pathlib.Path, extra: Sequence[str] = ()) -> str:
    h = hashlib.sha256()
    for d in dirs:
        for f in sorted(d.iterdir()):
            if f.is_file():
                st = f.stat()
                h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()


def convert(lc: LlamaCpp, python: str, src: pathlib.Path, out: pathlib.Path, log: pathlib.Path,
            target_dir: pathlib.Path | None = None, reconvert: bool = False) -> pathlib.Path:
    """`convert_hf_to_gguf.py SRC --outtype f32 [--target-model-dir T] --outfile OUT`."""
    deps = [src] + ([target_dir] if target_dir else [])
    stamp = out.with_suffix(".stamp")
    key = _fingerprint(*deps, extra=[str(lc.converter)])
    if not reconvert and out.exists() and stamp.exists() and stamp.read_text() == key:
        return out
    cmd = [python, str(lc.converter), str(src), "--outtype", "f32", "--outfile", str(out)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ PYTHONPATH=" + str(lc.gguf_py) + " " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=converter_env(lc))
    if r.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-6:]
        raise InteropError(f"llama.cpp's converter failed on {src} (exit {r.returncode}; log "
                           f"{log}):\n  " + "\n  ".join(tail))
    stamp.write_text(key)
    print(f"converted {src} -> {out} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


# ----------------------------------------------------------------------------- llama.cpp runs


_ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((-?\d+)\)")
_CANDIDATE = re.compile(
    r"draft candidate\s+(\d+), pos\s+(\d+):\s+(-?\d+) \(\s*([-+0-9.eE]+|nan|inf)\)")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds, speed:\s+([0-9.]+) t/s")
_HIST = re.compile(r"hist size = (\d+)")
_EOG_HEAD = "printing all EOG tokens"
_EOG = re.compile(r"load:\s+- (\d+) \('")


@dataclasses.dataclass
class LcRound:
    drafts: list[int]             # the block's drafts, as proposed (before the budget cut)
    probs: list[list[float]]      # per slot: llama.cpp's top-3 draft probabilities (top-10 softmax)
    drafted: int                  # drafts verified (N of "accepted A/N")
    accepted: int
    last: int                     # the target's token that ends the round

    @property
    def emitted(self) -> list[int]:
        return self.drafts[:self.accepted] + [self.last]


@dataclasses.dataclass
class LcRun:
    rounds: list[LcRound]
    eog: set[int]
    hist_size: int | None         # target tokens before the first block (prompt length − 1)
    decoded: int | None
    decode_s: float | None
    log: str

    def tokens(self) -> list[int]:
        return [t for r in self.rounds for t in r.emitted]


def parse_llama_log(text: str, log: str = "") -> LcRun:
    """Rounds, end-of-generation ids and decode timing from `llama-speculative-simple -v`."""
    rounds: list[LcRound] = []
    cur: dict[int, list[tuple[int, float]]] = {}
    eog: set[int] = set()
    hist = decoded = None
    decode_s = None
    in_eog = False
    for line in text.splitlines():
        if _EOG_HEAD in line:
            in_eog = True
            continue
        if in_eog:
            m = _EOG.search(line)
            if m:
                eog.add(int(m.group(1)))
                continue
            in_eog = False
        m = _CANDIDATE.search(line)
        if m:
            k, pos, tok, p = int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))
            cur.setdefault(pos, [])
            if len(cur[pos]) == k:
                cur[pos].append((tok, p))
            continue
        m = _ACCEPTED.search(line)
        if m:
            slots = [cur[i] for i in sorted(cur)]
            if sorted(cur) != list(range(len(cur))):
                raise InteropError(f"{log}: draft candidate positions {sorted(cur)} are not "
                                   "0..n-1 before an 'accepted' line")
            rounds.append(LcRound(drafts=[s[0][0] for s in slots],
                                  probs=[[p for _, p in s] for s in slots],
                                  drafted=int(m.group(2)), accepted=int(m.group(1)),
                                  last=int(m.group(3))))
            cur = {}
            continue
        m = _HIST.search(line)
        if m and hist is None:
            hist = int(m.group(1))
            continue
        m = _DECODED.search(line)
        if m:
            decoded, decode_s = int(m.group(1)), float(m.group(2))
    for r in rounds:
        if r.accepted > r.drafted or r.drafted > len(r.drafts):
            raise InteropError(f"{log}: a round reports {r.accepted}/{r.drafted} with "
                               f"{len(r.drafts)} logged drafts")
    return LcRun(rounds=rounds, eog=eog, hist_size=hist, decoded=decoded, decode_s=decode_s,
                 log=log)


def write_prompt_file(text: str, path: pathlib.Path) -> pathlib.Path:
    """`-f` drops one trailing newline, so one is added: llama.cpp then reads `text` exactly."""
    path.write_bytes((text + "\n").encode("utf-8"))
    return path


def run_llama(lc: LlamaCpp, target_gguf: pathlib.Path, draft_gguf: pathlib.Path,
              prompt_file: pathlib.Path, n_predict: int, n_max: int, threads: int | None,
              log: pathlib.Path, timeout: float) -> LcRun:
    cmd = [str(lc.speculative_simple), "-m", str(target_gguf), "-md", str(draft_gguf),
           "--spec-type", "draft-dspark", "--spec-draft-n-max", str(n_max),
           "-f", str(prompt_file), "--no-escape", "-n", str(n_predict), "--temp", "0", "-v"]
    if threads:
        cmd += ["-t", str(threads)]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(lc.build / "bin")] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep)
                                   if p])
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                               timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise InteropError(f"llama-speculative-simple ran past {timeout:.0f} s (log "
                               f"{log})") from e
    text = log.read_text(errors="replace")
    if r.returncode != 0:
        tail = [ln[:200] for ln in text.strip().splitlines()[-8:]]
        raise InteropError(f"llama-speculative-simple failed (exit {r.returncode}; log {log}):"
                           "\n  " + "\n  ".join(tail))
    run = parse_llama_log(text, str(log))
    if not run.rounds:
        raise InteropError(f"{log}: no 'accepted A/N draft tokens' lines (was -v given?)")
    return run


def llama_tokenize(lc: LlamaCpp, target_gguf: pathlib.Path, text: str) -> list[int] | None:
    """llama.cpp's ids for `text` (special tokens parsed, as the loop does), or None without
    llama-tokenize."""
    if lc.tokenize is None:
        return None
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(lc.build / "bin")
    r = subprocess.run([str(lc.tokenize), "-m", str(target_gguf), "--stdin", "--ids",
                        "--no-escape", "--log-disable"], input=text.encode("utf-8"),
                       capture_output=True, env=env, timeout=120)
    if r.returncode != 0:
        raise InteropError(f"llama-tokenize failed: {r.stderr.decode(errors='replace')[-300:]}")
    line = r.stdout.decode().strip().splitlines()[-1]
    return [int(x) for x in line.strip("[]").split(",") if x.strip()]


# ----------------------------------------------------------------------------- ours


_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                   "/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")


@contextlib.contextmanager
def compile_seconds() -> Iterator[list[float]]:
    """[seconds] of JAX tracing/lowering/compilation while active."""
    import jax.monitoring

    box = [0.0]

    def on(event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            box[0] += float(duration)

    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        yield box
    finally:
        jax.monitoring.unregister_event_duration_listener(on)


def run_ours_on_prompt(target: Any, draft: Any, prompt: Sequence[int], max_new_tokens: int,
             stop_ids: Sequence[int], cache_len: int) -> dict[str, Any]:
    from dspark_jax.serving import generation_settings, speculative_generate

    with compile_seconds() as comp:
        t0 = time.perf_counter()
        res = speculative_generate(target, draft, [list(prompt)], max_new_tokens=max_new_tokens,
                                   settings=generation_settings(stop_token_ids=list(stop_ids)),
                                   temperature=0.0, max_cache_len=cache_len)
        wall = time.perf_counter() - t0
    return {"tokens": [int(t) for t in res.tokens[0]],
            "accepted": [int(a) for a in res.accepted[0]],
            "proposed": [int(p) for p in res.proposed[0]],
            "wall_s": wall, "compile_s": comp[0]}


# ----------------------------------------------------------------------------- comparison


def cut_at_stop(tokens: Sequence[int], stops: set[int]) -> list[int]:
    out = []
    for t in tokens:
        out.append(int(t))
        if t in stops:
            break
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, len(shorter) if one is a proper prefix of the other
    and both were meant to be equally long, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _clipped(acc: int, emitted: Sequence[int], stops: set[int]) -> int:
    for j, t in enumerate(emitted):
        if t in stops:
            return min(acc, j)
    return acc


def compare_rounds(ours: dict[str, Any], lc: LcRun, gamma: int, stops: set[int]) -> dict:
    """Round k of ours against round k of the aligned llama.cpp run (the same anchor: token
    s_k of our output, s_0 = 0 is g1). Compared: rounds where both verified γ drafts and the
    output before the round is identical; a round holding a stop token is compared up to it."""
    T, acc_o, prop_o = ours["tokens"], ours["accepted"], ours["proposed"]
    L = [T[0]] + lc.tokens() if T else lc.tokens()
    rows, s = [], 0
    for k in range(min(len(acc_o), len(lc.rounds))):
        r = lc.rounds[k]
        row = {"round": k, "anchor_index": s, "ours": acc_o[k], "llama_cpp": r.accepted,
               "llama_cpp_drafted": r.drafted, "ours_proposed": prop_o[k]}
        if T[:s + 1] != L[:s + 1]:
            row["status"] = "after a token difference"
            rows.append(row)
            break
        if r.drafted != gamma or prop_o[k] != gamma:
            row["status"] = "short block"
        else:
            a = _clipped(acc_o[k], T[s + 1:s + acc_o[k] + 2], stops)
            b = _clipped(r.accepted, r.emitted, stops)
            row["status"] = "identical" if a == b else "different"
        rows.append(row)
        if any(t in stops for t in T[s + 1:s + acc_o[k] + 2]):
            break
        s += acc_o[k] + 1
    compared = [r for r in rows if r["status"] in ("identical", "different")]
    return {"rows": rows, "compared_rounds": len(compared),
            "identical_rounds": sum(r["status"] == "identical" for r in compared),
            "first_different": next((r["round"] for r in compared
                                     if r["status"] == "different"), None),
            "llama_cpp_accept_plus_one": sum(r["llama_cpp"] + 1 for r in compared),
            "ours_accept_plus_one": sum(r["ours"] + 1 for r in compared)}


def _top2(row: np.ndarray) -> tuple[int, int, float]:
    i1, i2 = np.argsort(row)[::-1][:2]
    return int(i1), int(i2), float(row[i1] - row[i2])


def diagnose_round(target: Any, draft: Any, prompt: Sequence[int], ours_tokens: Sequence[int],
                   anchor_index: int, lc_round: LcRound) -> dict[str, Any]:
    """Round `anchor_index`'s block recomputed by our drafter and target on llama.cpp's drafts:
    per slot our draft argmax and top-2 margin beside llama.cpp's (log p0/p1), and our target's
    greedy token and margin at each verified position."""
    P, s = len(prompt), anchor_index
    ctx = list(prompt) + list(ours_tokens[:s])
    anchor = int(ours_tokens[s])
    g = draft.config.num_drafts
    d = list(lc_round.drafts[:g])
    feats = target.hidden_states(np.asarray([ctx], np.int32), draft.config.target_layer_ids)[0]
    prev = [anchor] + d[:g - 1]
    out = draft.block_logits(feats, anchor, P + s, prev)["logits"]
    tl = target.logits(np.asarray([ctx + [anchor] + d], np.int32))[0, P + s:]
    slots = []
    for j in range(min(g, len(d))):
        o1, o2, om = _top2(out[j])
        # llama.cpp logs its top-3 draft probabilities with 3 decimals: log(p0/p1) is its top-2
        # logit margin, a lower bound (p1 < 0.0005) when p1 prints as 0
        p = lc_round.probs[j]
        p1 = p[1] if len(p) > 1 else 0.0
        lm = math.log(p[0] / max(p1, 0.0005)) if p[0] > 0 else 0.0
        t1, t2, tm = _top2(tl[j])
        slots.append({"slot": j, "llama_cpp_draft": d[j], "llama_cpp_margin": lm,
                      "llama_cpp_margin_lower_bound": p1 <= 0.0,
                      "ours_draft": o1, "ours_second": o2, "ours_margin": om,
                      "ours_logit_gap_to_llama_cpp_draft": float(out[j][o1] - out[j][d[j]]),
                      "target_token": t1, "target_second": t2, "target_margin": tm})
    ours_acc = next((j for j, x in enumerate(slots) if x["target_token"] != d[j]), len(slots))
    return {"anchor": anchor, "anchor_position": P + s, "slots": slots,
            "ours_target_accepts_llama_cpp_drafts": ours_acc}


def diagnose_token(target: Any, prompt: Sequence[int], tokens: Sequence[int], i: int,
                   other: int | None) -> dict[str, Any]:
    """Our target's logits where two outputs first differ (token i)."""
    lg = target.logits(np.asarray([list(prompt) + list(tokens[:i])], np.int32))[0, -1]
    t1, t2, m = _top2(lg)
    gap = None if other is None else float(lg[t1] - lg[other])
    return {"index": i, "ours": int(tokens[i]) if i < len(tokens) else None, "llama_cpp": other,
            "target_top1": t1, "target_top2": t2, "target_margin": m,
            "target_gap_to_llama_cpp_token": gap}


# ----------------------------------------------------------------------------- prompts


def bench_prompts(data_dir: str, dataset: str, n: int, tokenizer: Any) -> list[list[int]]:
    """The first `n` first turns of `data_dir/dataset.jsonl`, chat-rendered (evaluate's way)."""
    from dspark_jax.data.chat import render_prompt
    from dspark_jax.data.prompts import read_eval_file

    path = pathlib.Path(data_dir) / f"{dataset}.jsonl"
    if not path.is_file():
        raise InteropError(f"no eval dataset at {path} (--data-dir, --dataset)")
    convs = read_eval_file(path, first_turn_only=True)[:n]
    if len(convs) < n:
        raise InteropError(f"{path} has only {len(convs)} prompts, {n} requested")
    return [render_prompt(c.messages, tokenizer).tolist() for c in convs]


# ----------------------------------------------------------------------------- one drafter


def _label(path: pathlib.Path, used: set[str]) -> str:
    name = path.name if path.name not in ("export", "") else f"{path.parent.name}/{path.name}"
    base, i = name, 2
    while name in used:
        name, i = f"{base}#{i}", i + 1
    used.add(name)
    return name


def bench_drafter(lc: LlamaCpp, target: Any, target_gguf: pathlib.Path, draft_dir: pathlib.Path,
                  draft_gguf: pathlib.Path, prompts: list[list[int]], max_new: int,
                  work: pathlib.Path, label: str, threads: int | None, timeout: float,
                  plain: bool) -> dict[str, Any]:
    from dspark_jax.models import load_draft
    from dspark_jax.models.io.hf import read_config_json
    from dspark_jax.models.io.speculators import is_speculators_config

    tok = target.tokenizer
    draft = load_draft(draft_dir, target)
    cfg = draft.config
    gamma = cfg.num_drafts
    fmt = "speculators" if is_speculators_config(read_config_json(draft_dir)) else "deepspec"
    vocab = f"K={cfg.draft_vocab_size}" if cfg.pruned_vocab else "full"
    logs = work / "logs" / label.replace("/", "_")
    logs.mkdir(parents=True, exist_ok=True)
    our_stops = set(int(t) for t in tok.stop_token_ids)
    cache_len = int(math.ceil((max(map(len, prompts)) + max_new + 2 * gamma + 2) / 256) * 256)

    per_prompt: list[dict[str, Any]] = []
    lc_runs = []
    for i, ids in enumerate(prompts):
        text = tok.decode(ids)
        pf = write_prompt_file(text, logs / f"prompt{i}.txt")
        lc_ids = llama_tokenize(lc, target_gguf, text)
        if lc_ids is not None and lc_ids != ids:
            raise InteropError(f"prompt {i}: llama.cpp tokenizes the prompt text to other ids "
                               f"than ours (first difference at {first_difference(lc_ids, ids)})")
        runs = {}
        if plain:
            runs["plain"] = run_llama(lc, target_gguf, draft_gguf, pf, max_new, gamma, threads,
                                      logs / f"plain{i}.log", timeout)
            if runs["plain"].hist_size is not None and runs["plain"].hist_size != len(ids) - 1:
                raise InteropError(f"prompt {i}: llama.cpp's loop holds {runs['plain'].hist_size}"
                                   f" prompt tokens before its first block, ours {len(ids) - 1}")
        lc_runs.append((text, pf, lc_ids is not None, runs))
    stops = set(our_stops)
    for _, _, _, runs in lc_runs:
        for r in runs.values():
            stops |= r.eog

    for i, ids in enumerate(prompts):
        text, pf, tok_checked, runs = lc_runs[i]
        ours = run_ours_on_prompt(target, draft, ids, max_new, sorted(stops), cache_len)
        T = cut_at_stop(ours["tokens"], stops)
        rec: dict[str, Any] = {"prompt": i, "prompt_tokens": len(ids),
                               "prompt_ids_checked": "llama-tokenize" if tok_checked
                               else "token count", "ours": ours}
        ok = True
        if "plain" in runs:
            L = cut_at_stop(runs["plain"].tokens(), stops)
            d = first_difference(T[:max_new], L[:max_new])
            rec["plain"] = {"identical": d is None, "first_difference": d,
                            "llama_cpp_tokens": L, "decoded": runs["plain"].decoded,
                            "decode_s": runs["plain"].decode_s}
            if d is not None:
                other = L[d] if d < len(L) else None
                rec["plain"]["diagnosis"] = diagnose_token(target, ids, T, d, other) \
                    if d < len(T) else None
                ok = False
        # aligned: the prompt and g1, so llama.cpp's rounds are ours
        if T and T[0] not in stops:
            aligned_text = tok.decode(list(ids) + [T[0]])
            if tok.encode(aligned_text) != list(ids) + [T[0]]:
                rec["aligned"] = {"skipped": "prompt + g1 does not re-tokenize to the same ids"}
            else:
                apf = write_prompt_file(aligned_text, logs / f"aligned{i}.txt")
                run = run_llama(lc, target_gguf, draft_gguf, apf, max_new + gamma, gamma,
                                threads, logs / f"aligned{i}.log", timeout)
                if run.hist_size is not None and run.hist_size != len(ids):
                    raise InteropError(f"prompt {i} (aligned): llama.cpp holds {run.hist_size} "
                                       f"tokens before its first block, ours {len(ids)}")
                L = cut_at_stop(run.tokens(), stops)
                d = first_difference(T[1:max_new], L[:max_new - 1])
                cmp = compare_rounds(ours, run, gamma, stops)
                rec["aligned"] = {"identical": d is None,
                                  "first_difference": None if d is None else d + 1,
                                  "llama_cpp_tokens": L, **cmp}
                if cmp["first_different"] is not None:
                    row = cmp["rows"][cmp["first_different"]]
                    rec["aligned"]["diagnosis"] = diagnose_round(
                        target, draft, ids, T, row["anchor_index"],
                        run.rounds[cmp["first_different"]])
                if d is not None or cmp["identical_rounds"] != cmp["compared_rounds"]:
                    ok = False
        rec["identical"] = ok and rec.get("plain", {}).get("identical", True) and \
            rec.get("aligned", {}).get("identical", True)
        per_prompt.append(rec)
        al = rec.get("aligned", {})
        print(f"  {label} prompt {i}: output {'identical' if rec['identical'] else 'DIFFERENT'}"
              f", rounds {al.get('identical_rounds', '-')}/{al.get('compared_rounds', '-')}",
              flush=True)

    compared = sum(r.get("aligned", {}).get("compared_rounds", 0) for r in per_prompt)
    same = sum(r.get("aligned", {}).get("identical_rounds", 0) for r in per_prompt)
    lc_sum = sum(r.get("aligned", {}).get("llama_cpp_accept_plus_one", 0) for r in per_prompt)
    our_sum = sum(r.get("aligned", {}).get("ours_accept_plus_one", 0) for r in per_prompt)
    dec = [(r["plain"]["decoded"], r["plain"]["decode_s"]) for r in per_prompt
           if r.get("plain") and r["plain"]["decoded"] is not None and r["plain"]["decode_s"]]
    our_tok = sum(len(r["ours"]["tokens"]) for r in per_prompt)
    our_s = sum(max(r["ours"]["wall_s"] - r["ours"]["compile_s"], 1e-9) for r in per_prompt)
    return {"drafter": label, "dir": str(draft_dir), "gguf": str(draft_gguf), "format": fmt,
            "vocabulary": vocab, "gamma": gamma, "prompts": len(prompts),
            "identical_outputs": sum(r["identical"] for r in per_prompt),
            "identical_rounds": same, "compared_rounds": compared,
            "llama_cpp_tau": lc_sum / compared if compared else None,
            "ours_tau": our_sum / compared if compared else None,
            "llama_cpp_tok_s": (sum(n for n, _ in dec) / sum(s for _, s in dec)) if dec else None,
            "ours_tok_s": our_tok / our_s if per_prompt else None,
            "stop_ids": sorted(stops), "per_prompt": per_prompt}


def _fmt(x: Any, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def drafter_table_rows(results: list[dict[str, Any]]) -> list[tuple[str, str]]:
    head = ("drafter", "format       vocab    prompts  identical  rounds       τ llama.cpp  "
                       "τ ours  tok/s llama.cpp  tok/s ours")
    rows = [head]
    for r in results:
        rows.append((r["drafter"],
                     f"{r['format']:<12} {r['vocabulary']:<8} {r['prompts']:>7}  "
                     f"{r['identical_outputs']:>4}/{r['prompts']:<4}  "
                     f"{r['identical_rounds']:>4}/{r['compared_rounds']:<6}  "
                     f"{_fmt(r['llama_cpp_tau']):>11}  {_fmt(r['ours_tau']):>6}  "
                     f"{_fmt(r['llama_cpp_tok_s'], 1):>15}  {_fmt(r['ours_tok_s'], 1):>10}"))
    return rows


def print_differences(results: list[dict[str, Any]]) -> None:
    for r in results:
        for p in r["per_prompt"]:
            if p["identical"]:
                continue
            print(f"\n{r['drafter']} prompt {p['prompt']}: differs")
            pl = p.get("plain")
            if pl and not pl["identical"]:
                print(f"  plain run: first different token at {pl['first_difference']}: "
                      f"{json.dumps(pl.get('diagnosis'))}")
            al = p.get("aligned", {})
            if al.get("first_difference") is not None:
                print(f"  aligned run: first different token at {al['first_difference']}")
            dg = al.get("diagnosis")
            if dg:
                k = al["first_different"]
                row = al["rows"][k]
                print(f"  round {k}: accepted ours {row['ours']}, llama.cpp {row['llama_cpp']}; "
                      f"anchor {dg['anchor']} at {dg['anchor_position']}; our target accepts "
                      f"{dg['ours_target_accepts_llama_cpp_drafts']} of llama.cpp's drafts")
                for s in dg["slots"]:
                    ge = "≥ " if s["llama_cpp_margin_lower_bound"] else ""
                    print(f"    slot {s['slot']}: llama.cpp draft {s['llama_cpp_draft']} "
                          f"(margin {ge}{s['llama_cpp_margin']:.4f}), ours {s['ours_draft']} "
                          f"(margin {s['ours_margin']:.4f}, gap to llama.cpp's "
                          f"{s['ours_logit_gap_to_llama_cpp_draft']:.4f}); target "
                          f"{s['target_token']} (margin {s['target_margin']:.4f})")


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.interop.llamacpp_loop",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (LC)")
    p.add_argument("--build", required=True, help="its CMake build directory")
    p.add_argument("--draft", action="append", required=True,
                   help="an exported drafter directory (repeatable)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--work", required=True, help="directory for the HF target, GGUFs and logs")
    p.add_argument("--convert-python", default=sys.executable,
                   help="the interpreter that runs llama.cpp's converter (needs torch, "
                   "sentencepiece, safetensors, transformers)")
    p.add_argument("--target-hf", default=None,
                   help="an existing HF directory of the target (default: written to WORK)")
    p.add_argument("--data-dir", required=True,
                   help="a directory of evaluation prompt files (DATASET.jsonl, evaluate's format)")
    p.add_argument("--dataset", default="mbpp")
    p.add_argument("--threads", type=int, default=None,
                   help="llama.cpp -t (default: its own, one per core; on a machine busy with "
                   "other jobs -t 1 can be far faster)")
    p.add_argument("--no-plain", action="store_true",
                   help="skip the plain (prompt-only) llama.cpp runs; no llama.cpp tok/s then")
    p.add_argument("--reconvert", action="store_true", help="redo cached GGUF conversions")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per llama.cpp run")
    p.add_argument("--json", default=None, help="also write the result here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.prompts < 1 or a.max_new_tokens < 2:
        raise SystemExit("--prompts must be ≥ 1 and --max-new-tokens ≥ 2")
    lc = locate_llama_cpp(a.llama_cpp, a.build)
    work = pathlib.Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    drafts = [pathlib.Path(d).resolve() for d in a.draft]
    for d in drafts:
        if not (d / "config.json").exists():
            raise InteropError(f"--draft {d}: no config.json (an exported drafter directory)")
    check_converter_python(a.convert_python, lc)

    host = host_facts()
    steal = StealMeter()
    from dspark_jax.models import load_target

    target = load_target(TARGET_NAME)
    if a.target_hf:
        target_hf = pathlib.Path(a.target_hf).resolve()
    else:
        target_hf = work / "target-hf"
        if not (target_hf / "tokenizer.json").exists():
            tmp = work / ".target-hf.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(target_hf, ignore_errors=True)
            write_target_hf(tmp)
            os.replace(tmp, target_hf)
    gdir = work / "gguf"
    target_gguf = convert(lc, a.convert_python, target_hf, gdir / "target.f32.gguf",
                          gdir / "target.convert.log", reconvert=a.reconvert)
    prompts = bench_prompts(a.data_dir, a.dataset, a.prompts, target.tokenizer)

    used: set[str] = set()
    results = []
    for d in drafts:
        label = _label(d, used)
        safe = label.replace("/", "_").replace("#", "_")
        dg = convert(lc, a.convert_python, d, gdir / f"{safe}.f32.gguf",
                     gdir / f"{safe}.convert.log", target_dir=target_hf, reconvert=a.reconvert)
        results.append(bench_drafter(lc, target, target_gguf, d, dg, prompts, a.max_new_tokens,
                                     work, label, a.threads, a.timeout, not a.no_plain))
    host["steal_fraction"] = steal.fraction()
    out = {"llama_cpp": str(lc.source), "build": str(lc.build), "target_gguf": str(target_gguf),
           "threads": a.threads,
           "target_hf": str(target_hf), "dataset": a.dataset, "prompts": a.prompts,
           "max_new_tokens": a.max_new_tokens, "host": host, "drafters": results}
    save_json(out, a.json)
    print_differences(results)
    rows = drafter_table_rows(results)
    steal_s = "" if host["steal_fraction"] is None else \
        f", {100 * host['steal_fraction']:.0f}% CPU stolen"
    threads = f"-t {a.threads}" if a.threads else "its default threads"
    rows.append(("setting", f"{a.dataset} first turns, {a.max_new_tokens} new tokens, T = 0; "
                            f"llama.cpp {threads}; {host['cpu']}, {host['logical_cpus']} CPUs"
                            f"{steal_s}"))
    print_table(rows, "llama.cpp DSpark loop (--spec-type draft-dspark) vs dspark_jax")
    return out


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, errors=(InteropError,), compilation_cache=False)   # it times the decoding
