"""Stage 1 of the training job, data preparation (SPEC §4 data; DeepSpec's recipe):
(a) prompts and a seeded train / held-out split, (b) regeneration of the assistant turns by the
target, (c) chat rendering with assistant loss masks into records and, offline, the target
feature cache. `prepare_data` returns everything the training loop and the evaluation need.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable

import ml_collections
import numpy as np

from dspark_jax.train.job_config import UsageError


def load_prompt_pool(c: ml_collections.ConfigDict) -> list:
    """Every prompt of `config.data.prompts` (files or named sources; HumanEval when empty),
    with `config.data.decontaminate`'s overlap filter applied, before any subsampling."""
    from dspark_jax.data.prompt_sources import PROMPT_SOURCES
    from dspark_jax.data.prompts import load_humaneval
    from dspark_jax.data.regeneration import load_prompt_files

    paths = [str(p) for p in c.data.prompts]
    for p in paths:
        if not os.path.isfile(p) and p not in PROMPT_SOURCES:
            raise UsageError(f"config.data.prompts: file {p!r} not found (and not a named "
                             f"source {list(PROMPT_SOURCES)})")
    decontaminate = c.data.get("decontaminate", "") or None
    return load_prompt_files(paths, decontaminate=decontaminate) if paths else load_humaneval()


def load_prompts(c: ml_collections.ConfigDict, pool: list | None = None) -> list:
    """The prompts to regenerate: the pool (`load_prompt_pool`, or `pool` when the caller
    already loaded it), subsampled to `config.data.max_prompts`."""
    from dspark_jax.data.prompts import subsample

    convs = load_prompt_pool(c) if pool is None else pool
    if c.data.max_prompts >= 0:
        convs = subsample(convs, c.data.max_prompts, seed=c.data.split_seed)
    if not convs:
        raise UsageError("no prompts (config.data.prompts / max_prompts)")
    return convs


def heldout_arg(x: float) -> float | int:
    return int(x) if x >= 1 else float(x)


def process_local_target(c: ml_collections.ConfigDict, target: Any) -> Callable[[], Any]:
    """→ a function giving the target itself with one process; with several, a copy on this
    process's own devices (FSDP over them, loaded on first use, then kept): per-process
    regeneration and feature caching run different programs on different data in each
    process, which parameters sharded over the global mesh cannot do."""
    import jax

    held: list[Any] = []

    def get() -> Any:
        if jax.process_count() == 1:
            return target
        if not held:
            from dspark_jax.models import load_target
            from dspark_jax.sharding import make_mesh

            local = jax.local_devices()
            mesh = make_mesh(data=1, fsdp=len(local), tensor=1, devices=local)
            held.append(load_target(c.target, dtype=c.train.target_dtype, mesh=mesh))
        return held[0]

    return get


def prepare_conversations(c, target, workdir: pathlib.Path, is_main: bool,
                          local_target: Callable[[], Any]) -> tuple[list, list, dict, list | None]:
    """(a)+(b): training and held-out regenerated conversations, info for the summary, and the
    prompt pool (`load_prompt_pool`) when it was loaded to regenerate (None when reusing)."""
    import jax

    from dspark_jax.data.distributed import regenerate_distributed
    from dspark_jax.data.prompts import load_conversations, split_train_heldout

    heldout = heldout_arg(c.data.heldout)
    info: dict[str, Any] = {}
    pool = None
    if c.data.regenerated and os.path.isfile(c.data.regenerated):
        path = pathlib.Path(c.data.regenerated)
        info["regenerated"] = {"path": str(path), "reused": True}
    else:
        path = pathlib.Path(c.data.regenerated or workdir / "data" / "regenerated.jsonl")
        pool = load_prompt_pool(c)
        prompts = load_prompts(c, pool)
        info["prompts"] = len(prompts)
        # several processes: each regenerates its share of the prompts with its own copy of
        # the target and process 0 merges the parts into what one process writes (resumable;
        # the work directory must be visible to every process)
        stats = regenerate_distributed(
            local_target(), prompts, path,
            max_new_tokens=c.data.max_new_tokens, batch_size=c.data.regen_batch_size,
            temperature=c.data.temperature, top_p=c.data.top_p, top_k=c.data.top_k,
            seed=c.data.regen_seed, progress=c.logging.progress and is_main)
        info["regenerated"] = {"path": str(path), "reused": False,
                               "processes": jax.process_count(), **dataclasses.asdict(stats)}
    # the split is a function of the regenerated ids alone, so a run that reuses a regenerated
    # file splits it exactly as the run that wrote it
    convs = load_conversations(path)
    train, held = split_train_heldout(convs, heldout, seed=c.data.split_seed)
    info["split"] = {"train": len(train), "heldout": len(held)}
    return train, held, info, pool


def feature_source(c, target, draft_cfg, records: list, workdir: pathlib.Path,
                   local_target: Callable[[], Any]):
    """(c) offline mode: the feature cache for `records` (written once, then reused)."""
    import numpy as np

    import jax

    from dspark_jax.data.distributed import write_feature_cache_distributed
    from dspark_jax.data.features import MANIFEST, FeatureCache

    out = pathlib.Path(c.data.feature_cache or workdir / "data" / "features")
    if not (out / MANIFEST).is_file():
        # several processes: each caches its share of the records (longest first, dealt
        # round-robin) and process 0 writes the manifest that points into the parts
        write_feature_cache_distributed(
            local_target(), records, out, draft_cfg.target_layer_ids,
            batch_size=c.data.feature_batch_size,
            progress=c.logging.progress and jax.process_index() == 0)
    cache = FeatureCache(out, expected_target=getattr(target, "name", "") or "",
                         expected_layer_ids=draft_cfg.target_layer_ids)
    lengths = np.asarray([len(r["input_ids"]) for r in records])
    if len(cache) != len(records) or not np.array_equal(cache.lengths, lengths):
        raise UsageError(f"feature cache {out} was computed from other training records "
                         f"({len(cache)} records vs {len(records)}); delete it or set "
                         "config.data.feature_cache to a new directory")
    return cache


@dataclasses.dataclass
class PreparedData:
    records: list            # rendered training records
    held_records: list       # rendered held-out records
    held_convs: list         # held-out conversations (prompts for speculative evaluation)
    source: Any              # what the grain pipeline reads: records (online) or a FeatureCache
    info: dict               # for the summary: prompts, regeneration, split, render stats
    prompt_pool: list | None = None  # `load_prompt_pool(c)` when the regeneration loaded it


def prepare_data(c: ml_collections.ConfigDict, target: Any, draft_cfg: Any,
                 workdir: pathlib.Path, is_main: bool, lap: Any = lambda name: None
                 ) -> PreparedData:
    """(a)+(b)+(c); `lap(name)` is called after each part (timings)."""
    from dspark_jax.data.pipeline import records_from_conversations

    # (a)+(b) prompts and regeneration; the prompt pool it loads (and decontaminates) is kept
    # for the draft vocabulary, which reads it again
    local_target = process_local_target(c, target)
    train_convs, held_convs, data_info, pool = prepare_conversations(c, target, workdir,
                                                                     is_main, local_target)
    lap("prompts_and_regeneration")
    # (c) rendering + loss masks
    records, rstats = records_from_conversations(train_convs, target.tokenizer, c.data.max_length)
    held_records, hstats = records_from_conversations(held_convs, target.tokenizer,
                                                      c.data.max_length)
    data_info["records"] = {"train": len(records), "heldout": len(held_records),
                            "render_stats_train": dict(rstats),
                            "render_stats_heldout": dict(hstats)}
    if not records:
        raise UsageError(f"no training records after rendering ({dict(rstats)}): more prompts or "
                         "a larger config.data.max_new_tokens / max_length are needed")
    online = c.data.features == "online"
    source = (records if online
              else feature_source(c, target, draft_cfg, records, workdir, local_target))
    lap("records_and_features")
    return PreparedData(records=records, held_records=held_records, held_convs=held_convs,
                        source=source, info=data_info, prompt_pool=pool)


def prompt_pool_records(c: ml_collections.ConfigDict, tokenizer: Any, exclude: set,
                        pool: list | None = None) -> list[dict]:
    """Every prompt of `config.data.prompts` before subsampling (minus the `exclude` ids, the
    held-out ones), tokenized as prompt-only records: word statistics for the draft vocabulary
    beyond the few hundred regenerated replies. `pool`: `load_prompt_pool(c)` if already
    loaded."""
    convs = load_prompt_pool(c) if pool is None else pool
    out = []
    for cv in convs:
        if cv.id in exclude:
            continue
        text = "\n".join(str(m.get("content", "")) for m in cv.messages)
        ids = np.asarray(tokenizer.encode(text), np.int64)
        out.append({"input_ids": ids, "loss_mask": np.zeros(len(ids), np.int8)})
    return out


def resolve_draft_vocab(c: ml_collections.ConfigDict, draft_cfg: Any, data: PreparedData,
                        target: Any) -> Any:
    """`draft.draft_vocab_size` > 0 without ids: the draft vocabulary chosen from the training
    records' replies, then the whole prompt pool (data/draft_vocab.py; the stop tokens always in
    it); its share of the held-out assistant tokens goes into the summary's data section."""
    if not draft_cfg.pruned_vocab or draft_cfg.draft_vocab:
        return draft_cfg
    from dspark_jax.data.draft_vocab import choose_draft_vocab, coverage

    V = draft_cfg.target.vocab_size
    pool = prompt_pool_records(c, target.tokenizer, {cv.id for cv in data.held_convs},
                               data.prompt_pool)
    ids = choose_draft_vocab(list(data.records) + pool, draft_cfg.draft_vocab_size, V,
                             always=target.config.stop_token_ids)
    data.info["draft_vocab"] = {
        "size": len(ids), "prompt_pool": len(pool),
        "coverage_train": round(coverage(data.records, ids, V), 4),
        "coverage_heldout": (round(coverage(data.held_records, ids, V), 4)
                             if data.held_records else None)}
    print(f"draft vocabulary: {len(ids)} of {V} ids, covering "
          f"{data.info['draft_vocab']['coverage_heldout']} of the held-out assistant tokens",
          flush=True)
    return draft_cfg.replace(draft_vocab=ids)
