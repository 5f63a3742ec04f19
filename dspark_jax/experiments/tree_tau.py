"""τ against the draft-tree budget: the chain and trees of N nodes, evaluated under DeepSpec's
protocol (`dspark_jax.evaluate`, scheduler fixed) on the same prompts, at each temperature.

For every (dataset, temperature, budget) it prints τ (tokens a round = tokens a target
forward), τ against the chain's, and the decoding's tokens per second without compilation
(batch `--batch-size`; `--batch-size 1` is the c = 1 figure), and writes `tree_tau.json` and
`tree_tau.png` (τ against the budget, one line per dataset and temperature) to `--out`.
Example (the README main job's drafter):
  python -m dspark_jax.experiments.tree_tau --target smollm2-135m-instruct --draft WORKDIR/export \
      --data WORKDIR/data/eval:heldout --data ../shared/eval_datasets:mbpp --max-samples 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence


BUDGETS = (0, 8, 16, 32, 64)


def run(target: Any, draft: Any, data: Sequence[tuple[str, str]], *, budgets: Sequence[int],
        temperatures: Sequence[float], branching: int | None, max_samples: int,
        max_new_tokens: int, batch_size: int) -> list[dict[str, Any]]:
    """One evaluation per (dataset, temperature, budget); budget 0 is the chain."""
    from dspark_jax.evaluate import EvalConfig, evaluate

    tree = {} if branching is None else {"tree_branching": branching}
    rows = []
    for data_dir, name in data:
        for temperature in temperatures:
            chain_tau = None
            for budget in budgets:
                res = evaluate(EvalConfig(
                    target, draft, data_dir, datasets=[name], max_samples=max_samples,
                    temperature=temperature, max_new_tokens=max_new_tokens,
                    batch_size=batch_size, tree_budget=budget, plots=False, progress=False,
                    **tree))
                ds = res["datasets"][name]
                chain_tau = ds["tau"] if budget == 0 else chain_tau
                rows.append({"dataset": name, "temperature": temperature, "budget": budget,
                             "tau": ds["tau"], "rounds": ds["rounds"],
                             "vs_chain": None if chain_tau is None else ds["tau"] / chain_tau,
                             "tokens_per_s": ds["tokens_per_s_excl_compile"],
                             "prompts": ds["num_evaluated"]})
                print(f"{name} T={temperature} budget={budget}: tau {ds['tau']:.3f}", flush=True)
    return rows


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """τ against the budget (0 drawn as γ's chain at the left), a line per dataset and T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["dataset"], r["temperature"]) for r in rows}):
        pts = [r for r in rows if (r["dataset"], r["temperature"]) == key]
        ax.plot([max(r["budget"], 1) for r in pts], [r["tau"] for r in pts], marker="o",
                label=f"{key[0]}, T = {key[1]:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget N (nodes; 1 = the chain)")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.experiments.tree_tau",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--data", action="append", required=True,
                   help="DIR:NAME, a DeepSpec-format prompt file DIR/NAME.jsonl (repeatable)")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--branching", type=int, default=None,
                   help="a tree node's most children (default: the engine's)")
    p.add_argument("--max-samples", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default="tree_tau")
    args = p.parse_args(argv)
    from dspark_jax.models import load_draft, load_target

    data = []
    for spec in args.data:
        if ":" not in spec:
            p.error(f"--data {spec!r}: expected DIR:NAME")
        data.append(tuple(spec.rsplit(":", 1)))
    target = load_target(args.target)
    draft = load_draft(args.draft, target=target)
    rows = run(target, draft, data, budgets=[int(b) for b in args.budgets.split(",")],
               temperatures=[float(t) for t in args.temperatures.split(",")],
               branching=args.branching, max_samples=args.max_samples,
               max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_tau.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "tree_tau.png")
    print(tau_markdown(rows))


def tau_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| dataset | T | budget | τ | × chain | rounds | tok/s |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['temperature']:g} | {r['budget'] or 'chain'} | "
                     f"{r['tau']:.3f} | "
                     + ("" if r["vs_chain"] is None else f"{r['vs_chain']:.3f}")
                     + f" | {r['rounds']} | {r['tokens_per_s']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
