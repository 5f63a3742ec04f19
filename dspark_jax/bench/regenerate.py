"""Regeneration throughput against Hugging Face transformers' `generate`.

Same model (the embedded SmolLM2-135M-Instruct GGUF, fp32, loaded by transformers from the same
file), same prompts (chat-rendered with the generation prompt), same batch, same new-token cap,
same sampling settings (T, top-k, top-p), both in this process back to back, so the ratio is
meaningful even on a loaded machine. Ours is the whole `data.regeneration.regenerate` call
(prompt rendering, compilation, continuous batching, decoding the text, writing the JSONL);
theirs is `model.generate` over static batches of `batch` prompts (left-padded), counting only
the tokens each row really generated (up to and including its stop token). Model loading is
excluded on both sides. The table also names the host (processor, logical CPUs, the memory
bandwidth a numpy copy reaches) and the CPU time stolen by other guests during the run: the same
code measures different ratios on different VMs (this command's table, run on each). Example:
  python -m dspark_jax.bench.regenerate --prompts 64 --batch 32 --max-new-tokens 128
Greedy on DeepSpec's MBPP prompts (the setting of `bench.short_jobs`, which times the whole
regeneration process instead):
  python -m dspark_jax.bench.regenerate --source ../shared/eval_datasets/mbpp.jsonl \
      --temperature 0 --prompts 64 --batch 32 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dspark_jax.bench.common import StealMeter, host_facts, print_table, save_json


def source_conversations(n: int, source: str) -> list:
    """The first `n` conversations of a named prompt source
    (`data.prompt_sources.load_named_prompts`) or of a prompt file (a DeepSpec `{"turns"}`
    file or training conversations: `data.regeneration.load_prompt_files`)."""
    from dspark_jax.data.regeneration import load_prompt_files

    convs = load_prompt_files([source])[:n]
    if len(convs) < n:
        raise ValueError(f"prompt source {source!r} has only {len(convs)} prompts, {n} requested")
    return convs


def run_ours_regeneration(target, convs, *, batch: int, max_new_tokens: int, temperature: float,
             top_k: int, top_p: float, engine: str) -> dict:
    from dspark_jax.data.regeneration import regenerate

    with tempfile.TemporaryDirectory() as tmp:
        stats = regenerate(target, convs, Path(tmp) / "out.jsonl", max_new_tokens=max_new_tokens,
                           batch_size=batch, temperature=temperature, top_k=top_k, top_p=top_p,
                           progress=False, engine=engine)
    return {"tokens": stats.generated_tokens, "seconds": stats.elapsed_s,
            "tok_s": stats.tokens_per_s, "refill_s": stats.refill_s, "decode_s": stats.decode_s,
            "decode_steps": stats.decode_steps, "ms_per_decode_step": stats.ms_per_decode_step}


def run_transformers(convs, tok, *, batch: int, max_new_tokens: int, temperature: float,
                     top_k: int, top_p: float) -> dict:
    import torch
    import transformers

    from dspark_jax.data.chat import render_prompt
    from dspark_jax.models.io.gguf import locate_smollm2_gguf

    path = locate_smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    stops = list(tok.stop_token_ids)
    pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else stops[0]
    prompts = [render_prompt(c.messages, tok) for c in convs]
    sample = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) \
        if temperature > 0 else dict(do_sample=False)
    torch.manual_seed(0)
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 eos_token_id=stops, pad_token_id=pad, **sample)
        for row in out[:, width:].tolist():
            n = len(row)
            for j, t in enumerate(row):
                if t in stops:
                    n = j + 1
                    break
            tokens += n
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def _host_line(host: dict) -> str:
    steal = host.get("steal_fraction")
    stolen = "" if steal is None else f", {100 * steal:.0f}% of CPU time stolen during the run"
    return (f"{host['cpu']}, {host['logical_cpus']} logical CPUs, memory copy "
            f"{host['memory_copy_gbs']:.1f} GB/s{stolen}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="offline-mix",
                   help="named prompt source or prompt file (e.g. a DeepSpec eval file)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--engine", default="refill", help="our engine: refill / static")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--warm", action="store_true",
                   help="also time a second regeneration (programs already compiled)")
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args(argv)

    from dspark_jax.models import load_target

    host = host_facts()
    steal = StealMeter()
    target = load_target("smollm2-135m-instruct")
    convs = source_conversations(a.prompts, a.source)
    kw = dict(batch=a.batch, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
              top_k=a.top_k, top_p=a.top_p)
    ours = run_ours_regeneration(target, convs, engine=a.engine, **kw)
    print(f"dspark_jax regenerate: {ours['tok_s']:.1f} tok/s ({ours['tokens']} tokens in "
          f"{ours['seconds']:.1f} s)", flush=True)
    if a.warm:
        warm = run_ours_regeneration(target, convs, engine=a.engine, **kw)
        print(f"dspark_jax regenerate, compiled: {warm['tok_s']:.1f} tok/s", flush=True)
        ours["warm_tok_s"] = warm["tok_s"]
    theirs = None if a.skip_transformers else run_transformers(convs, target.tokenizer, **kw)
    host["steal_fraction"] = steal.fraction()
    r = {"prompts": a.prompts, "source": a.source, **kw, "engine": a.engine, "host": host,
         "ours": ours, "transformers": theirs,
         "ratio": ours["tok_s"] / theirs["tok_s"] if theirs else None}
    save_json(r, a.json)
    rows = [("setting", f"{a.prompts} prompts ({a.source}), batch {a.batch}, "
                        f"{a.max_new_tokens} new tokens, T {a.temperature}"),
            ("host", _host_line(host)),
            ("dspark_jax regenerate", f"{ours['tok_s']:.1f} tok/s ({ours['tokens']} tokens, "
                                      f"{ours['seconds']:.1f} s, incl. compile)")]
    if ours["decode_steps"]:
        rows.append(("  of which", f"prefill {ours['refill_s']:.1f} s, decode {ours['decode_s']:.1f} s "
                                   f"({ours['decode_steps']} steps × "
                                   f"{ours['ms_per_decode_step']:.0f} ms)"))
    if "warm_tok_s" in ours:
        rows.append(("dspark_jax, compiled", f"{ours['warm_tok_s']:.1f} tok/s"))
    if theirs:
        rows += [("transformers generate", f"{theirs['tok_s']:.1f} tok/s ({theirs['tokens']} "
                                           f"tokens, {theirs['seconds']:.1f} s)"),
                 ("ratio", f"{r['ratio']:.2f}x (bar ≥ 2x)")]
    print_table(rows, "regeneration benchmark")
    return r


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
