"""The peer side of `dspark_jax.bench.peers`: greedy decoding in llama.cpp
(through `llama-cpp-python`'s ctypes bindings) or vLLM's CPU build, run by that peer's own
interpreter, never the project's.

This file is standalone: it imports only the standard library at module level and the peer's
package inside the function that runs it, so it runs as a script in a virtual environment that
has no dspark_jax (`PEER_PYTHON peers_runner.py < request.json`). It is also the spawned main
module that vLLM re-imports, hence the `if __name__ == "__main__":` guard.

Protocol: a JSON request on stdin,
  {"system": "llamacpp" | "vllm" | "quantize", "model": PATH, "max_new_tokens": N,
   "repeats": R, "threads": T | null, "batches": [{"batch": B, "prompts": [[id, ...], ...]}, ...]}
("quantize" takes "source" and "model": llama.cpp's `llama_model_quantize` writes `model` as
all-F32 from the GGUF `source`), and one line on stdout,
  RESULT_TAG {"ok": true, "version": ..., "batches": [{"batch": B, "seconds": median,
              "all_seconds": [...], "tokens": [[id, ...], ...]}, ...]}
or RESULT_TAG {"ok": false, "missing": MODULE | null, "error": TEXT}. Library logs may share
stdout (vLLM's do); only the tagged line is the result.

Every generation decodes each prompt greedily to exactly N new tokens, stop tokens ignored,
the whole batch at once. Each batch is run once untimed (warm-up), then timed R times from the
first prompt token to the N-th new token, model loading excluded.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

RESULT_TAG = "DSPARK_PEER_RESULT"


def emit(payload: dict[str, Any]) -> None:
    """The result line (flushed; preceded by a newline in case a library left one open)."""
    sys.stdout.write("\n" + RESULT_TAG + " " + json.dumps(payload) + "\n")
    sys.stdout.flush()


def timed_batches(generate: Callable[[list[list[int]], int], list[list[int]]],
                  request: dict[str, Any]) -> list[dict[str, Any]]:
    """Warm-up plus `repeats` timed calls of `generate(prompts, max_new)` per batch."""
    out = []
    n = int(request["max_new_tokens"])
    for b in request["batches"]:
        prompts = [list(map(int, p)) for p in b["prompts"]]
        tokens = generate(prompts, n)
        secs = []
        for _ in range(max(int(request.get("repeats", 1)), 1)):
            t0 = time.perf_counter()
            tokens = generate(prompts, n)
            secs.append(time.perf_counter() - t0)
        out.append({"batch": int(b["batch"]), "seconds": statistics.median(secs),
                    "all_seconds": secs, "tokens": tokens})
    return out


# ----------------------------------------------------------------------------- llama.cpp


def llama_quantize_f32(source: str, model: str) -> str:
    """`llama_model_quantize(source, model)` with LLAMA_FTYPE_ALL_F32 and allow_requantize."""
    import llama_cpp.llama_cpp as C

    params = C.llama_model_quantize_default_params()
    params.ftype = C.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = model + ".partial"
    rc = C.llama_model_quantize(source.encode(), tmp.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> F32) returned {rc}")
    os.replace(tmp, model)
    return model


def run_llamacpp(request: dict[str, Any]) -> dict[str, Any]:
    """Batched greedy decoding with llama.cpp's C API: one sequence per prompt (n_seq_max =
    batch), each prompt prefilled by itself, then one `llama_decode` of B tokens per step and
    the argmax of each row's logits."""
    import llama_cpp
    import llama_cpp.llama_cpp as C
    import numpy as np

    n_max = int(request["max_new_tokens"])
    widest = max(len(b["prompts"]) for b in request["batches"])
    longest = max(len(p) for b in request["batches"] for p in b["prompts"])
    per_seq = -(-(longest + n_max + 8) // 256) * 256
    threads = int(request.get("threads") or os.cpu_count() or 1)

    C.llama_backend_init()
    mp = C.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = C.llama_model_load_from_file(request["model"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {request['model']}")
    vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    cp = C.llama_context_default_params()
    cp.n_ctx = per_seq * widest
    cp.n_batch = cp.n_ubatch = max(512, widest)
    cp.n_seq_max = widest
    cp.n_threads = cp.n_threads_batch = threads
    ctx = C.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    batch = C.llama_batch_init(cp.n_batch, 0, 1)
    logits_of = (lambda i: np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, i), shape=(vocab,)))

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        batch.n_tokens = len(items)
        for j, (tok, pos, seq, want) in enumerate(items):
            batch.token[j], batch.pos[j] = tok, pos
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = seq
            batch.logits[j] = want
        rc = C.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        C.llama_memory_clear(C.llama_get_memory(ctx), True)
        out: list[list[int]] = []
        for s, p in enumerate(prompts):
            chunk: list[int] = []
            for k in range(0, len(p), cp.n_batch):
                chunk = p[k:k + cp.n_batch]
                decode([(t, k + j, s, k + j == len(p) - 1) for j, t in enumerate(chunk)])
            out.append([int(np.argmax(logits_of(len(chunk) - 1)))])
        for step in range(1, n):
            decode([(out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            for s in range(len(prompts)):
                out[s].append(int(np.argmax(logits_of(s))))
        return out

    try:
        batches = timed_batches(generate, request)
    finally:
        C.llama_batch_free(batch)
        C.llama_free(ctx)
        C.llama_model_free(model)
    return {"version": f"llama-cpp-python {llama_cpp.__version__}", "threads": threads,
            "batches": batches}


# ----------------------------------------------------------------------------- vLLM


def run_vllm(request: dict[str, Any]) -> dict[str, Any]:
    """vLLM's offline `LLM.generate` on token-id prompts: fp32, T = 0, ignore_eos, exactly N
    tokens; one engine (max_num_seqs = the largest batch) for every batch."""
    import vllm
    from vllm import LLM, SamplingParams

    n_max = int(request["max_new_tokens"])
    widest = max(len(b["prompts"]) for b in request["batches"])
    longest = max(len(p) for b in request["batches"] for p in b["prompts"])
    llm = LLM(model=request["model"], dtype="float32", seed=0, max_num_seqs=widest,
              max_model_len=-(-(longest + n_max + 8) // 256) * 256)
    sp = SamplingParams(temperature=0.0, max_tokens=n_max, min_tokens=n_max, ignore_eos=True,
                        detokenize=False)

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(map(int, r.outputs[0].token_ids)) for r in res]

    return {"version": f"vllm {vllm.__version__}", "batches": timed_batches(generate, request)}


# ----------------------------------------------------------------------------- main


RUNNERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llamacpp": run_llamacpp, "vllm": run_vllm,
    "quantize": lambda r: {"version": "llama_model_quantize",
                           "model": llama_quantize_f32(r["source"], r["model"])},
}


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    # run as a script, this file's folder heads sys.path: its siblings (common.py, load.py, …)
    # must not shadow the peer's imports
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        request = json.loads(sys.stdin.read())
        run = RUNNERS[request["system"]]
    except (ValueError, KeyError) as e:
        emit({"ok": False, "missing": None, "error": f"bad request: {e!r}"})
        return 2
    try:
        emit({"ok": True, **run(request)})
        return 0
    except ModuleNotFoundError as e:
        emit({"ok": False, "missing": e.name, "error": f"{type(e).__name__}: {e}"})
    except Exception as e:  # noqa: BLE001 - reported to the bench, which prints it
        emit({"ok": False, "missing": None, "error": f"{type(e).__name__}: {e}",
              "traceback": traceback.format_exc()[-3000:]})
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
