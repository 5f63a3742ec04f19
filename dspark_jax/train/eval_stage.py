"""Stage 3 of the training job: export of the trained drafter (`export_draft`), the
held-out teacher-forced acceptance (accept_rate@k, tau_probabilistic; SPEC §6 metrics), and
optionally speculative decoding on the held-out prompts (measured τ, `dspark_jax.evaluate`).
Only process 0 writes files; every process takes part in the collectives.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

from dspark_jax.train.job_config import attn_kernel, attn_key_chunk


def barrier(name: str) -> None:
    """All processes wait here (what process 0 wrote is then readable by every process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def heldout_evaluator(c, fns_mesh, draft_cfg, target, records: list, *,
                      extra_metrics: Callable[[dict], dict[str, float]] | None = None
                      ) -> Callable[[Any, Any], dict[str, float]] | None:
    """(e) teacher-forced acceptance on held-out regenerated data as a function of the drafter's
    (params, frozen), compiled once (the periodic `eval.every_steps` evaluation calls it during
    training); None without held-out records. Pooled over all batches (sums are added before
    the ratios are taken, so it equals one big batch); the same anchors every call.
    `extra_metrics` (pooled float64 sums → more scalars) adds to the drafter kind's metrics."""
    import jax
    import numpy as np

    from dspark_jax.data.pipeline import PipelineConfig, make_dataset, to_global_batch
    from dspark_jax.sharding import use_mesh
    from dspark_jax.train.step import make_loss_sums_fn, metrics_fn

    mesh, batch_sh, graphdef = fns_mesh
    if not records:
        return None
    sums_fn = make_loss_sums_fn(graphdef, draft_cfg, target.graphdef, c.train.anchor_chunk,
                                attn_key_chunk=attn_key_chunk(c),
                                attn_kernel=attn_kernel(c), precision=c.train.precision)

    @jax.jit
    def eval_sums(params, frozen, target_state, batch, key):
        with use_mesh(mesh):
            return sums_fn(params, frozen, target_state, batch, key)

    pc = PipelineConfig(batch_size=c.eval.batch_size, max_length=c.data.max_length, shuffle=False,
                        num_epochs=1, drop_remainder=False)
    to_metrics = metrics_fn(draft_cfg)

    def evaluate(params, frozen) -> dict[str, float]:
        total = None
        key = jax.random.key(c.eval.seed)
        for i, local in enumerate(make_dataset(records, pc)):
            if 0 <= c.eval.max_batches <= i:
                break
            batch = to_global_batch(local, batch_sh)
            sums = jax.device_get(eval_sums(params, frozen, target.state, batch,
                                            jax.random.fold_in(key, i)))
            sums = jax.tree.map(lambda x: np.asarray(x, np.float64), sums)
            total = sums if total is None else jax.tree.map(np.add, total, sums)
        if total is None:
            return {}
        out = {k: float(np.asarray(v)) for k, v in to_metrics(total).items()}
        return out if extra_metrics is None else {**out, **extra_metrics(total)}

    return evaluate


def heldout_eval(c, fns_mesh, draft_cfg, target, params, frozen, records: list) -> dict[str, float]:
    """(e) teacher-forced acceptance on held-out regenerated data (see `heldout_evaluator`)."""
    evaluate = heldout_evaluator(c, fns_mesh, draft_cfg, target, records)
    return evaluate(params, frozen) if evaluate is not None else {}


def speculative_eval(c, target, export_dir: pathlib.Path, heldout_convs,
                     workdir: pathlib.Path) -> dict[str, Any]:
    """Speculative decoding with the exported drafter (read by every process once written)."""
    from dspark_jax.models.drafters.draft import load_draft

    return speculative_hook(c, target, load_draft(export_dir, target), heldout_convs, workdir)


def speculative_hook(c, target, draft, heldout_convs, workdir: pathlib.Path) -> dict[str, Any]:
    """`config.eval.speculative`: measured τ with speculative decoding by `dspark_jax.evaluate`
    (DeepSpec's protocol, another module's job). Default data: the held-out prompts (first user
    turn), written as a DeepSpec `{"turns"}` file; or `eval.speculative_data_dir`. It needs no
    optional dependency, so it is never skipped for a failed import: an ImportError propagates."""
    import jax

    from dspark_jax.eval.eval_config import EvalConfig
    from dspark_jax.evaluate import evaluate as fn

    is_main = jax.process_index() == 0
    e = c.eval
    if e.speculative_data_dir:
        data_dir, datasets = pathlib.Path(e.speculative_data_dir), None
    else:
        data_dir, datasets = workdir / "data" / "eval", ["heldout"]
        data_dir.mkdir(parents=True, exist_ok=True)
        firsts = [next(m["content"] for m in conv.messages if m["role"] == "user")
                  for conv in heldout_convs]
        if not firsts:
            return {"skipped": "no held-out prompts (config.data.heldout)"}
        if is_main:
            (data_dir / "heldout.jsonl").write_text(
                "".join(json.dumps({"turns": [t]}) + "\n" for t in firsts))
        barrier("speculative_data")
    max_new = e.speculative_max_new_tokens if e.speculative_max_new_tokens > 0 \
        else c.data.max_new_tokens
    temps = [float(t) for t in e.speculative_temperatures]
    by_t: dict[str, Any] = {}
    for t in temps:
        out_dir = workdir / "speculative" / f"T{t:g}"
        # every process decodes (the target is sharded over all of them); process 0 writes
        results = fn(EvalConfig(target, draft, data_dir, datasets=datasets, max_samples=None,
                                max_new_tokens=max_new, batch_size=e.speculative_batch_size,
                                temperature=t, out_dir=out_dir if is_main else None,
                                progress=c.logging.progress and is_main, plots=False))
        by_t[f"{t:g}"] = {"out_dir": str(out_dir), "mean": results.get("mean")}
    first = by_t[f"{temps[0]:g}"]
    return {"out_dir": first["out_dir"], "data_dir": str(data_dir), "mean": first["mean"],
            "temperature": temps[0], "by_temperature": by_t}


def export_draft(graphdef, params, frozen, out: pathlib.Path, verifier: str | None = None
                 ) -> dict[str, Any]:
    """The trained drafter, written by process 0 in the consumer format that holds it
    faithfully (`faithful_format`): DeepSpec's for a full-vocabulary drafter; EAGLE-3's layout
    for a draft-vocabulary Eagle3 (`--format deepspec` writes it; vLLM, SGLang, SpecForge);
    speculators' (vLLM, llama.cpp) for a draft-vocabulary DSpark / DFlash, plus DeepSpec's
    full-vocabulary fallback beside it (`<out>-deepspec-fullvocab`, for DeepSpec / SGLang users,
    with the export's warning). Returns {"primary": dir, "format": name, "deepspec": the
    directory DeepSpec's own loop can load, or None (a draft-vocabulary Eagle3)}."""
    import jax
    from flax import nnx

    from dspark_jax.export import write_export
    from dspark_jax.models.drafters.draft import Draft
    from dspark_jax.models.io.deepspec import faithful_format

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        params, frozen = multihost_utils.process_allgather((params, frozen), tiled=True)
    model = nnx.merge(graphdef, jax.device_get(params), jax.device_get(frozen))
    draft = Draft.from_model(model)
    fmt = faithful_format(draft.config)
    fallback = fmt == "speculators"        # DeepSpec's format cannot hold it: the lossy fallback
    deepspec_dir = {"speculators": out.with_name(out.name + "-deepspec-fullvocab"),
                    "eagle3": None, "deepspec": out}[fmt]
    if jax.process_index() == 0:
        if fallback:
            import warnings

            write_export(draft, out, "speculators", verifier=verifier)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # the fallback is stated in the summary
                write_export(draft, deepspec_dir, "deepspec", full_vocab_fallback=True)
        else:
            write_export(draft, out, "deepspec")    # DeepSpec's format records no verifier
    barrier("export")          # the others read the export only after it is complete
    return {"primary": out, "format": fmt, "deepspec": deepspec_dir}


def deepspec_check(c, target, deepspec_dir: pathlib.Path | None, heldout_convs
                   ) -> dict[str, Any]:
    """The job checks its own export in its consumer: DeepSpec's evaluation loop
    (interop/deepspec_loop.py) and our engine decode the same held-out prompts greedily with the
    DeepSpec-format export; both τ and whether every token agrees. Skipped, with the reason,
    without DeepSpec or PyTorch, or when `eval.deepspec_check_samples` is 0."""
    import jax

    from dspark_jax.interop import deepspec_loop as dl

    n = int(c.eval.deepspec_check_samples)
    if n <= 0:
        return {"skipped": "eval.deepspec_check_samples = 0"}
    if deepspec_dir is None:
        return {"skipped": "a draft-vocabulary Eagle3 exports in EAGLE-3's layout (K-row lm_head, "
                "d2t / t2d), which DeepSpec's Qwen3Eagle3Model (V-row lm_head) cannot load"}
    ok, where = dl.locate_deepspec(c.eval.deepspec_src or None)
    if not ok:
        return {"skipped": where}
    if jax.process_count() > 1:
        return {"skipped": "runs on single-process jobs only"}
    from dspark_jax.data.chat import render_prompt
    from dspark_jax.serving import generation_settings, speculative_generate
    from dspark_jax.models.drafters.draft import load_draft

    tok = target.tokenizer
    prompts = [render_prompt([next(m for m in conv.messages if m["role"] == "user")], tok)
               .tolist() for conv in heldout_convs[:n]]
    if not prompts:
        return {"skipped": "no held-out prompts (config.data.heldout)"}
    max_new = int(c.eval.deepspec_check_max_new_tokens)
    stops = list(tok.stop_token_ids)
    ev = dl.deepspec_evaluator(dl.torch_target(c.target), deepspec_dir,
                               max_new_tokens=max_new, temperature=0.0)
    theirs = dl.run_deepspec_loop(ev, prompts, stops)
    draft = load_draft(deepspec_dir, target)
    ours = speculative_generate(target, draft, prompts, max_new_tokens=max_new,
                                settings=generation_settings(stop_token_ids=stops),
                                temperature=0.0)
    same = [list(map(int, o)) == t.tokens for o, t in zip(ours.tokens, theirs)]
    return {"deepspec": where, "export": str(deepspec_dir), "prompts": len(prompts),
            "max_new_tokens": max_new, "deepspec_tau": dl.deepspec_tau(theirs),
            "ours_tau": float(ours.tau), "identical_tokens": int(sum(same)),
            "deepspec_rounds": sum(len(t.acceptance_lengths) for t in theirs)}
