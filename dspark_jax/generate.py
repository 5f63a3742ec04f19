"""`python -m dspark_jax.generate`: chat with a target model (plain or speculative decoding).

Renders `--prompt` with the target's chat template as evaluation does (`data.chat.render_prompt`:
thinking off; Gemma4's empty thought channel), decodes (autoregressive by default, with the
on-device loop of `decoding.autoregressive`; speculative with `--draft CKPT`, through
`serving.speculative_generate`) until a stop token of the target's
tokenizer (eos, the end-of-turn marker such as Gemma4's `<turn|>`, generation_config.json's
eos ids) and prints the reply.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.generate", description=__doc__)
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="embedded target name or a Hugging Face model directory")
    p.add_argument("--prompt", action="append", required=True,
                   help="user message (repeat for a batch)")
    p.add_argument("--system", default=None, help="optional system prompt")
    p.add_argument("--draft", default=None, help="drafter checkpoint (DeepSpec or speculators format) to "
                   "decode speculatively")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens (0: all); plain and speculative")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest nucleus of mass ≥ top-p (1: all); plain and "
                   "speculative")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree-budget", type=int, default=0,
                   help="with --draft: draft trees of this many nodes (0: the chain)")
    p.add_argument("--tree-branching", type=int, default=None,
                   help="a tree node's most children (default: the engine's, 16)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if (args.tree_budget or args.tree_branching is not None) and not args.draft:
        p.error("--tree-budget and --tree-branching shape the drafter's trees: they need --draft")
    from dspark_jax.decoding.sampling import check_sampling

    try:   # a usage error before any model loads
        if args.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {args.max_new_tokens}")
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as exc:   # "top_p must be …" → "--top-p must be …"
        name, rule = str(exc).split(" ", 1)
        p.error(f"--{name.replace('_', '-')} {rule}")
    return args


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = parse_args(argv)
    from dspark_jax.data.chat import render_prompt
    from dspark_jax.models import load_draft, load_target

    target = load_target(args.target, dtype=args.dtype)
    tok = target.tokenizer
    if tok is None:
        sys.exit(f"{args.target}: no tokenizer found (tokenizer.json) — cannot render a prompt")
    prompts = []
    for text in args.prompt:
        if not text.strip():
            sys.exit("--prompt must not be empty")
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": text})
        prompts.append(render_prompt(messages, tok).tolist())
    t0 = time.perf_counter()
    if args.draft:
        from dspark_jax.serving import generation_settings, speculative_generate

        draft = load_draft(args.draft, target=target)
        target = target.decoding_layout()   # one layout, the stacked layers released
        tree = ({} if args.tree_branching is None else {"tree_branching": args.tree_branching})
        settings = generation_settings(tree_budget=args.tree_budget, **tree)
        res = speculative_generate(target, draft, prompts, max_new_tokens=args.max_new_tokens,
                                   settings=settings, temperature=args.temperature,
                                   seed=args.seed, top_k=args.top_k, top_p=args.top_p,
                                   record_confidence=False, progress=not args.no_progress)
        outs, extra = res.tokens, f", τ = {res.tau:.2f} over {res.rounds} rounds"
    else:
        from dspark_jax.decoding import autoregressive_generate

        target = target.decoding_layout()   # one layout, the stacked layers released
        outs = autoregressive_generate(target, prompts, max_new_tokens=args.max_new_tokens,
                                       temperature=args.temperature, seed=args.seed,
                                       top_k=args.top_k, top_p=args.top_p, steps_per_call=16,
                                       progress=not args.no_progress)
        extra = ""
    dt = time.perf_counter() - t0
    stops = set(tok.stop_token_ids)
    replies = []
    for text, ids in zip(args.prompt, outs):
        reply = tok.decode([i for i in ids if i not in stops]).strip()
        replies.append(reply)
        print(f"user: {text}\nassistant: {reply}\n")
    n = sum(len(o) for o in outs)
    print(f"[{n} tokens in {dt:.1f}s incl. compilation{extra}]", file=sys.stderr)
    return replies


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main)
