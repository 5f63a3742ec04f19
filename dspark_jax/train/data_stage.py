"""Stage 1 of the training job, data preparation (SPEC §4 data; DeepSpec's recipe):
(a) prompts and a seeded train / held-out split, (b) regeneration of the assistant turns by the
target, (c) chat rendering with assistant loss masks into records and, offline, the target
feature cache. `prepare_data` returns everything the training loop and the evaluation need.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import ml_collections

from dspark_jax.train.job_config import UsageError


def load_prompts(c: ml_collections.ConfigDict) -> list:
    from dspark_jax.data.prompts import PROMPT_SOURCES, load_humaneval, subsample
    from dspark_jax.data.regenerate import load_prompt_files

    paths = [str(p) for p in c.data.prompts]
    for p in paths:
        if not os.path.isfile(p) and p not in PROMPT_SOURCES:
            raise UsageError(f"config.data.prompts: file {p!r} not found (and not a named "
                             f"source {list(PROMPT_SOURCES)})")
    decontaminate = c.data.get("decontaminate", "") or None
    convs = (load_prompt_files(paths, decontaminate=decontaminate) if paths
             else load_humaneval())
    if c.data.max_prompts >= 0:
        convs = subsample(convs, c.data.max_prompts, seed=c.data.split_seed)
    if not convs:
        raise UsageError("no prompts (config.data.prompts / max_prompts)")
    return convs


def heldout_arg(x: float) -> float | int:
    return int(x) if x >= 1 else float(x)


def prepare_conversations(c, target, workdir: pathlib.Path,
                          is_main: bool) -> tuple[list, list, dict]:
    """(a)+(b): training and held-out regenerated conversations, and info for the summary."""
    import jax

    from dspark_jax.data.prompts import load_conversations, split_train_heldout
    from dspark_jax.data.regenerate import regenerate

    heldout = heldout_arg(c.data.heldout)
    info: dict[str, Any] = {}
    if c.data.regenerated and os.path.isfile(c.data.regenerated):
        path = pathlib.Path(c.data.regenerated)
        info["regenerated"] = {"path": str(path), "reused": True}
    else:
        path = pathlib.Path(c.data.regenerated or workdir / "data" / "regenerated.jsonl")
        prompts = load_prompts(c)
        info["prompts"] = len(prompts)
        if jax.process_count() > 1:
            if not path.is_file():
                raise UsageError("multi-host runs need the regenerated data first: run once on "
                                 f"one host with --config.train.max_steps=0 (writes {path}), or set "
                                 "config.data.regenerated")
        else:
            stats = regenerate(target, prompts, path, max_new_tokens=c.data.max_new_tokens,
                               batch_size=c.data.regen_batch_size,
                               temperature=c.data.temperature, top_p=c.data.top_p,
                               top_k=c.data.top_k, seed=c.data.regen_seed,
                               progress=c.logging.progress and is_main)
            info["regenerated"] = {"path": str(path), "reused": False,
                                   **dataclasses.asdict(stats)}
    # the split is a function of the regenerated ids alone, so a run that reuses a regenerated
    # file splits it exactly as the run that wrote it
    convs = load_conversations(path)
    train, held = split_train_heldout(convs, heldout, seed=c.data.split_seed)
    info["split"] = {"train": len(train), "heldout": len(held)}
    return train, held, info


def feature_source(c, target, draft_cfg, records: list, workdir: pathlib.Path):
    """(c) offline mode: the feature cache for `records` (written once, then reused)."""
    import numpy as np

    from dspark_jax.data.features import MANIFEST, FeatureCache, write_feature_cache

    out = pathlib.Path(c.data.feature_cache or workdir / "data" / "features")
    if not (out / MANIFEST).is_file():
        import jax

        if jax.process_count() > 1:
            raise UsageError(f"multi-host offline training needs the feature cache {out} first "
                             "(write it on one host with --config.train.max_steps=0)")
        write_feature_cache(target, records, out, draft_cfg.target_layer_ids,
                            batch_size=c.data.feature_batch_size, progress=c.logging.progress)
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


def prepare_data(c: ml_collections.ConfigDict, target: Any, draft_cfg: Any,
                 workdir: pathlib.Path, is_main: bool, lap: Any = lambda name: None
                 ) -> PreparedData:
    """(a)+(b)+(c); `lap(name)` is called after each part (timings)."""
    from dspark_jax.data.pipeline import records_from_conversations

    # (a)+(b) prompts and regeneration
    train_convs, held_convs, data_info = prepare_conversations(c, target, workdir, is_main)
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
    source = records if online else feature_source(c, target, draft_cfg, records, workdir)
    lap("records_and_features")
    return PreparedData(records=records, held_records=held_records, held_convs=held_convs,
                        source=source, info=data_info)
