"""Regeneration and target-feature caching split across processes.

Each of `count` processes (by default `jax.process_index()` of `jax.process_count()`; each can
hold its own devices) takes its share of the work by a deterministic rule, writes its own
resumable part, and one process merges the parts into exactly what a single process writes:

- regeneration: conversation `id` belongs to part `blake2b(id) mod count` (stable when the
  input grows); part i is an ordinary resumable regeneration output `<out>.part-i-of-n.jsonl`
  whose completion is marked by `<part>.done.json`. The merge writes `<out>` with the records in
  input order (the canonical order; a single-process output holds the same records), atomically.
- feature cache: records sorted by length (longest first) are dealt round-robin to the parts,
  which balances tokens; part i is a complete feature cache in `<out_dir>/part-i-of-n/`. The
  merge writes only a top-level `manifest.json` whose record table points into the parts'
  shard files (no data copied), so `FeatureCache(out_dir)` reads record r of the input as
  record r. A part with a manifest is finished and is not recomputed on a rerun.

`*_distributed` helpers do part → barrier → merge on process 0 → barrier; with one process they
are the plain single-process path.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.data import features as F
from dspark_jax.data.prompts import Conversation
from dspark_jax.data.regeneration import RegenerationError, RegenStats, regenerate, scan_output

PathLike = str | os.PathLike[str]


def _check_part(index: int, count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"process count must be a positive integer, got {count!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ValueError(f"process index must be in [0, {count}), got {index!r}")


def part_of_id(sample_id: str, count: int) -> int:
    """The part (process) a conversation id belongs to."""
    digest = hashlib.blake2b(sample_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def conversations_of_part(conversations: Sequence[Conversation], index: int,
                          count: int) -> list[Conversation]:
    _check_part(index, count)
    return [c for c in conversations if part_of_id(c.id, count) == index]


def part_path(out_path: PathLike, index: int, count: int) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(f"{out_path.name}.part-{index}-of-{count}.jsonl")


def regenerate_part(target: Any, conversations: Sequence[Conversation], out_path: PathLike,
                    index: int, count: int, **kwargs: Any) -> RegenStats:
    """Regenerates this process's share into its part file (resumable as `regenerate`)."""
    path = part_path(out_path, index, count)
    mine = conversations_of_part(conversations, index, count)
    done_marker = path.with_name(path.name + ".done.json")
    if not mine:  # nothing to do: an empty, finished part
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        stats = RegenStats()
    else:
        stats = regenerate(target, mine, path, **kwargs)
    done_marker.write_text(json.dumps({"index": index, "count": count,
                                       "conversations": len(mine)}), encoding="utf-8")
    return stats


def _read_lines_by_id(path: Path, records: dict[str, str]) -> None:
    """Adds the JSONL lines of a regeneration output to `records` by id (a corrupt file is
    refused, `scan_output`)."""
    scan_output(path, truncate_torn=False)
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                records[json.loads(line)["id"]] = line if line.endswith("\n") else line + "\n"


def _write_in_input_order(conversations: Sequence[Conversation], records: Mapping[str, str],
                          out_path: Path, foreign: str) -> None:
    """Writes the JSONL lines `records` (by id) to `out_path` in input order, atomically."""
    order, seen = [], set()
    for c in conversations:
        if c.id in records and c.id not in seen:
            seen.add(c.id)
            order.append(records[c.id])
    if len(order) != len(records):
        raise RegenerationError(foreign)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("".join(order))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out_path)


def put_in_input_order(conversations: Sequence[Conversation], out_path: PathLike) -> Path:
    """Rewrites a finished single-process regeneration output in input order (it is written in
    completion order), so that one process and a merge of parts give the same file."""
    out_path = Path(out_path)
    records: dict[str, str] = {}
    _read_lines_by_id(out_path, records)
    _write_in_input_order(conversations, records, out_path,
                          f"{out_path} holds ids that are not in the input prompts")
    return out_path


def merge_regenerated(conversations: Sequence[Conversation], out_path: PathLike,
                      count: int) -> Path:
    """Merges the `count` finished parts into `out_path`, records in input order."""
    out_path = Path(out_path)
    records: dict[str, str] = {}
    settings = None
    for i in range(count):
        path = part_path(out_path, i, count)
        if not path.with_name(path.name + ".done.json").is_file():
            raise RegenerationError(f"regeneration part {i} of {count} is not finished ({path}); "
                                    "run every process to completion before merging")
        meta = path.with_name(path.name + ".regen.json")
        if meta.is_file():
            s = json.loads(meta.read_text(encoding="utf-8"))
            if settings is not None and s != settings:
                raise RegenerationError(f"{meta}: settings differ from the other parts")
            settings = s
        _read_lines_by_id(path, records)
    _write_in_input_order(conversations, records, out_path,
                          f"the parts of {out_path} hold ids that are not in the input")
    if settings is not None:
        out_path.with_name(out_path.name + ".regen.json").write_text(json.dumps(settings, indent=1),
                                                                     encoding="utf-8")
    return out_path


# ---------------------------------------------------------------- feature cache


def records_of_part(lengths: Sequence[int], index: int, count: int) -> np.ndarray:
    """Indices (ascending) of the records of part `index`: longest first, dealt round-robin."""
    _check_part(index, count)
    order = np.argsort(-np.asarray(lengths, np.int64), kind="stable")
    return np.sort(order[index::count])


def cache_part_dir(out_dir: PathLike, index: int, count: int) -> Path:
    return Path(out_dir) / f"part-{index}-of-{count}"


def write_feature_cache_part(target: Any, records: Sequence[Mapping[str, np.ndarray]],
                             out_dir: PathLike, layer_ids: Sequence[int], index: int, count: int,
                             **kwargs: Any) -> Path:
    """Writes this process's share of the records as a complete cache in its part directory
    (skipped when that part is already finished)."""
    part = cache_part_dir(out_dir, index, count)
    if (part / F.MANIFEST).is_file():
        return part
    mine = records_of_part([len(r["input_ids"]) for r in records], index, count)
    if len(mine) == 0:
        raise ValueError(f"feature cache part {index} of {count} has no records "
                         f"({len(records)} records for {count} processes)")
    return F.write_feature_cache(target, [records[i] for i in mine], part, layer_ids, **kwargs)


def merge_feature_cache_parts(out_dir: PathLike, num_records: int, lengths: Sequence[int],
                              count: int) -> Path:
    """Writes `out_dir/manifest.json` over the finished parts; record r of the input is item r."""
    out_dir = Path(out_dir)
    head = None
    shards: list[dict] = []
    table = np.zeros((num_records, 3), np.int64)
    for i in range(count):
        part = cache_part_dir(out_dir, i, count)
        mpath = part / F.MANIFEST
        if not mpath.is_file():
            raise F.FeatureCacheError(f"feature cache part {i} of {count} is not finished "
                                      f"({mpath} missing)")
        m = json.loads(mpath.read_text(encoding="utf-8"))
        key = (m["target"], m["layer_ids"], m["d"], m["n"], m["dtype"], m["target_config"])
        if head is None:
            head = m | {"shards": [], "records": []}
            first_key = key
        elif key != first_key:
            raise F.FeatureCacheError(f"{mpath}: target / layer ids / dtypes differ from part 0")
        mine = records_of_part(lengths, i, count)
        if len(mine) != m["num_records"]:
            raise F.FeatureCacheError(f"{mpath}: {m['num_records']} records, the split expects "
                                      f"{len(mine)} (other records or process count?)")
        base = len(shards)
        for s in m["shards"]:
            shards.append({"index": base + s["index"], "num_tokens": s["num_tokens"],
                           "files": {f: f"{part.name}/{name}" for f, name in s["files"].items()}})
        for r, (shard, off, length) in zip(mine, m["records"]):
            if length != int(lengths[r]):
                raise F.FeatureCacheError(f"{mpath}: record length {length} != {lengths[r]}")
            table[r] = (base + shard, off, length)
    assert head is not None
    manifest = head | {"num_records": num_records, "num_tokens": int(np.sum(lengths)),
                       "shards": shards, "records": table.tolist()}
    tmp = out_dir / f".{F.MANIFEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out_dir / F.MANIFEST)
    return out_dir


# ---------------------------------------------------------------- multi-process drivers


def _process() -> tuple[int, int, Callable[[str], None]]:
    import jax

    if jax.process_count() == 1:
        return 0, 1, lambda name: None
    from jax.experimental import multihost_utils

    return jax.process_index(), jax.process_count(), multihost_utils.sync_global_devices


def regenerate_distributed(target: Any, conversations: Sequence[Conversation], out_path: PathLike,
                           **kwargs: Any) -> RegenStats:
    """Every process regenerates its part; process 0 merges; all return after the merge."""
    index, count, barrier = _process()
    if count == 1:
        stats = regenerate(target, conversations, out_path, **kwargs)
        put_in_input_order(conversations, out_path)
        return stats
    stats = regenerate_part(target, conversations, out_path, index, count, **kwargs)
    barrier("dspark_jax.regenerate.parts")
    if index == 0:
        merge_regenerated(conversations, out_path, count)
    barrier("dspark_jax.regenerate.merged")
    return stats


def write_feature_cache_distributed(target: Any, records: Sequence[Mapping[str, np.ndarray]],
                                    out_dir: PathLike, layer_ids: Sequence[int],
                                    **kwargs: Any) -> Path:
    """Every process caches its part; process 0 writes the merged manifest."""
    index, count, barrier = _process()
    if count == 1:
        return F.write_feature_cache(target, records, out_dir, layer_ids, **kwargs)
    write_feature_cache_part(target, records, out_dir, layer_ids, index, count, **kwargs)
    barrier("dspark_jax.features.parts")
    if index == 0:
        merge_feature_cache_parts(out_dir, len(records), [len(r["input_ids"]) for r in records],
                                  count)
    barrier("dspark_jax.features.merged")
    return Path(out_dir)


__all__ = ["part_of_id", "conversations_of_part", "part_path", "regenerate_part",
           "merge_regenerated", "put_in_input_order", "records_of_part", "cache_part_dir",
           "write_feature_cache_part",
           "merge_feature_cache_parts", "regenerate_distributed",
           "write_feature_cache_distributed"]
