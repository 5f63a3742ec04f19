"""The offline target-feature cache of DSpark/DFlash training (SPEC §4; DeepSpec's offline mode).

Training the drafter needs, for every training token, the target's hidden-state taps at the
drafter's `layer_ids` (its conditioning features, [S, n·d]) and the target's final-normed hidden
state (the soft labels p_t = softmax(lm_head(h)), [S, d]). DeepSpec can either run the frozen
target inside every training step or compute these once; this module is the "once" path:

- `estimate_cache_bytes(T, d, n) = T · (6 + 2·d·(n+1))`: int32 ids + int16 loss mask + bf16
  taps of n layers + the bf16 final hidden, per token. `write_feature_cache` prints this size
  first and refuses (nothing written, not even the directory) when `shutil.disk_usage` reports
  less free space.
- `write_feature_cache` runs the target over the records in length-sorted, fixed-shape batches
  (right padding is invisible to a causal model) and streams the results into token-concatenated
  shards `shard-XXXXX.<field>.npy` (plain `.npy`, loaded with `allow_pickle=False`; bf16 is kept
  as its uint16 bit pattern because `.npy` has no bf16 type). `manifest.json` — target name,
  layer ids, d, n, dtypes, shards, and per record (shard, offset, length) in INPUT order — is
  written last, atomically (temp file + rename): a directory without it is an incomplete cache.
- `FeatureCache(dir)` memory-maps the shards; item i is record i with features widened to f32.
  `expected_target` / `expected_layer_ids` guard against training on features of another target
  or other taps (the error names the manifest file).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

MANIFEST = "manifest.json"
FORMAT = "dspark_jax.feature_cache"
VERSION = 1
FIELDS = ("input_ids", "loss_mask", "features", "target_hidden")
# on-disk dtype of each field; bf16 fields are stored as their uint16 bit pattern
STORED_DTYPES = {"input_ids": "int32", "loss_mask": "int16", "features": "bfloat16",
                 "target_hidden": "bfloat16"}
DEFAULT_SHARD_BYTES = 1 << 30
_BUCKET = 64


class FeatureCacheError(ValueError):
    """A feature cache directory is missing, incomplete, or does not match what was expected."""


class InsufficientDiskError(OSError):
    """The feature cache would not fit on the destination disk; nothing was written."""


def estimate_cache_bytes(num_tokens: int, d: int, n: int) -> int:
    """Bytes of a cache of `num_tokens` tokens with n taps of width d (+ the final hidden)."""
    return int(num_tokens) * (6 + 2 * int(d) * (int(n) + 1))


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _shard_file(out_dir: Path, shard: int, field: str) -> Path:
    return out_dir / f"shard-{shard:05d}.{field}.npy"


@functools.lru_cache(maxsize=8)
def _forward_fn(graphdef: Any, layer_ids: tuple[int, ...]):
    @jax.jit
    def fwd(state: Any, tokens_bs: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, state)
        out = model(tokens_bs, tap_layer_ids=layer_ids)
        return out.taps.astype(jnp.bfloat16), out.hidden.astype(jnp.bfloat16)

    return fwd


def _plan_shards(order: np.ndarray, lengths: np.ndarray, shard_tokens: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Assigns records (in compute order) to shards of ≤ shard_tokens tokens (a longer record gets
    a shard of its own) → (shard of record, offset of record, tokens per shard)."""
    shard_of = np.zeros(len(lengths), np.int64)
    offset_of = np.zeros(len(lengths), np.int64)
    sizes: list[int] = []
    cur = 0
    for i in order:
        n = int(lengths[i])
        if not sizes or (cur + n > shard_tokens and cur > 0):
            sizes.append(0)
            cur = 0
        shard_of[i], offset_of[i] = len(sizes) - 1, cur
        cur += n
        sizes[-1] = cur
    return shard_of, offset_of, sizes


def write_feature_cache(
    target: Any,
    records: Sequence[Mapping[str, np.ndarray]],
    out_dir: str | os.PathLike[str],
    layer_ids: Sequence[int],
    *,
    batch_size: int,
    shard_tokens: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Computes and stores the target features of `records` (dicts with `input_ids`, `loss_mask`).

    `shard_tokens`: tokens per shard (default: about 1 GiB of data per shard). Refuses with
    `InsufficientDiskError` before creating anything when the estimated size exceeds the free
    space, and with `FeatureCacheError` when `out_dir` already holds a cache (unless `overwrite`).
    Returns `out_dir`. Record i of the input is item i of `FeatureCache(out_dir)`.
    """
    out_dir = Path(out_dir)
    layer_ids = tuple(int(i) for i in layer_ids)
    if not layer_ids:
        raise ValueError("layer_ids is empty: the drafter needs at least one target layer")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not records:
        raise ValueError("no records to cache")
    cfg = target.config
    d, n = int(cfg.hidden_size), len(layer_ids)
    for i in layer_ids:
        if not -1 <= i < cfg.num_hidden_layers:
            raise ValueError(f"layer id {i} out of range [-1, {cfg.num_hidden_layers - 1}]")
    ids_list, mask_list = [], []
    for r, rec in enumerate(records):
        ids = np.asarray(rec["input_ids"])
        mask = np.asarray(rec["loss_mask"])
        if ids.ndim != 1 or ids.shape != mask.shape or ids.size == 0:
            raise ValueError(f"record {r}: input_ids/loss_mask must be equal-length non-empty 1-D arrays")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"record {r}: token ids outside [0, {cfg.vocab_size})")
        ids_list.append(ids.astype(np.int32))
        mask_list.append(mask.astype(np.int16))
    lengths = np.asarray([len(x) for x in ids_list], np.int64)
    total = int(lengths.sum())
    need = estimate_cache_bytes(total, d, n)
    free = shutil.disk_usage(_existing_parent(out_dir)).free
    print(f"feature cache {out_dir}: {len(records)} records, {total} tokens, d={d}, "
          f"n={n} taps → {_human(need)} (free: {_human(free)})", file=sys.stderr, flush=True)
    if need > free:
        raise InsufficientDiskError(
            f"feature cache {out_dir} needs {_human(need)} ({need} bytes) but only {_human(free)} "
            f"is free on that disk; nothing was written")
    manifest_path = out_dir / MANIFEST
    if manifest_path.exists():
        if not overwrite:
            raise FeatureCacheError(f"{manifest_path} exists: a feature cache is already there "
                                    "(pass overwrite=True to replace it)")
        manifest_path.unlink()  # a crash from here on must not leave a valid-looking cache
    out_dir.mkdir(parents=True, exist_ok=True)

    per_token = estimate_cache_bytes(1, d, n)
    shard_tokens = shard_tokens or max(1, DEFAULT_SHARD_BYTES // per_token)
    order = np.argsort(-lengths, kind="stable")  # longest first: similar lengths share a batch
    shard_of, offset_of, sizes = _plan_shards(order, lengths, shard_tokens)
    fwd = _forward_fn(target.graphdef, layer_ids)

    open_shard: dict[str, np.memmap] = {}
    open_index = -1

    def shard_arrays(s: int) -> dict[str, np.memmap]:
        nonlocal open_shard, open_index
        if s != open_index:
            for arr in open_shard.values():
                arr.flush()
            shapes = {"input_ids": (sizes[s],), "loss_mask": (sizes[s],),
                      "features": (sizes[s], n * d), "target_hidden": (sizes[s], d)}
            dtypes = {"input_ids": np.int32, "loss_mask": np.int16, "features": np.uint16,
                      "target_hidden": np.uint16}
            open_shard = {f: np.lib.format.open_memmap(_shard_file(out_dir, s, f), mode="w+",
                                                       dtype=dtypes[f], shape=shapes[f])
                          for f in FIELDS}
            open_index = s
        return open_shard

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="target features", unit="tok", unit_scale=True)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        S = -(-int(lengths[idx].max()) // _BUCKET) * _BUCKET
        tokens = np.zeros((batch_size, S), np.int32)  # fixed batch: one compile per bucket
        for row, i in enumerate(idx):
            tokens[row, :lengths[i]] = ids_list[i]
        taps, hidden = fwd(target.state, jnp.asarray(tokens))
        taps = np.asarray(taps).view(np.uint16)
        hidden = np.asarray(hidden).view(np.uint16)
        for row, i in enumerate(idx):
            L, off = int(lengths[i]), int(offset_of[i])
            arrs = shard_arrays(int(shard_of[i]))
            arrs["input_ids"][off:off + L] = ids_list[i]
            arrs["loss_mask"][off:off + L] = mask_list[i]
            arrs["features"][off:off + L] = taps[row, :L]
            arrs["target_hidden"][off:off + L] = hidden[row, :L]
        if bar is not None:
            bar.update(int(lengths[idx].sum()))
    for arr in open_shard.values():
        arr.flush()
    open_shard = {}
    if bar is not None:
        bar.close()

    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "target": getattr(target, "name", "") or "",
        "target_config": {"vocab_size": int(cfg.vocab_size), "hidden_size": d,
                          "num_hidden_layers": int(cfg.num_hidden_layers)},
        "layer_ids": list(layer_ids),
        "d": d,
        "n": n,
        "dtype": dict(STORED_DTYPES),
        "num_records": len(records),
        "num_tokens": total,
        "shards": [{"index": s, "num_tokens": t,
                    "files": {f: _shard_file(out_dir, s, f).name for f in FIELDS}}
                   for s, t in enumerate(sizes)],
        "records": [[int(shard_of[i]), int(offset_of[i]), int(lengths[i])] for i in range(len(records))],
    }
    tmp = out_dir / f".{MANIFEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, manifest_path)
    return out_dir


class FeatureCache:
    """Read access to a cache written by `write_feature_cache` (a random-access data source).

    `cache[i]` → dict(input_ids int32 [S], loss_mask int32 [S], features f32 [S, n·d],
    target_hidden f32 [S, d]). `lengths` gives every record's S without reading shards.
    """

    def __init__(self, path: str | os.PathLike[str], *, expected_target: str | None = None,
                 expected_layer_ids: Sequence[int] | None = None):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise FeatureCacheError(f"{manifest_path} not found: {self.path} is not a (complete) "
                                    "feature cache")
        try:
            m = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise FeatureCacheError(f"{manifest_path}: unreadable manifest ({exc})") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
            raise FeatureCacheError(f"{manifest_path}: not a {FORMAT} v{VERSION} manifest")
        self.manifest_path = manifest_path
        self.target: str = m["target"]
        self.layer_ids: tuple[int, ...] = tuple(m["layer_ids"])
        self.d: int = int(m["d"])
        self.n: int = int(m["n"])
        if expected_target is not None and expected_target != self.target:
            raise FeatureCacheError(f"{manifest_path}: cache was computed with target "
                                    f"{self.target!r}, expected {expected_target!r}")
        if expected_layer_ids is not None and tuple(int(i) for i in expected_layer_ids) != self.layer_ids:
            raise FeatureCacheError(f"{manifest_path}: cache holds layer ids {list(self.layer_ids)}, "
                                    f"expected {list(expected_layer_ids)}")
        if m["dtype"] != STORED_DTYPES:
            raise FeatureCacheError(f"{manifest_path}: unsupported dtypes {m['dtype']}")
        rec = np.asarray(m["records"], np.int64).reshape(-1, 3)
        if len(rec) != m["num_records"]:
            raise FeatureCacheError(f"{manifest_path}: {len(rec)} records listed, header says "
                                    f"{m['num_records']}")
        self._records = rec
        self._shards: list[dict[str, np.ndarray]] = []
        widths = {"input_ids": None, "loss_mask": None, "features": self.n * self.d,
                  "target_hidden": self.d}
        for shard in m["shards"]:
            arrs = {}
            for f in FIELDS:
                file = self.path / shard["files"][f]
                if not file.is_file():
                    raise FeatureCacheError(f"{manifest_path}: shard file {file} is missing")
                arr = np.load(file, mmap_mode="r", allow_pickle=False)
                want = (shard["num_tokens"],) + ((widths[f],) if widths[f] else ())
                if arr.shape != want:
                    raise FeatureCacheError(f"{file}: shape {arr.shape}, manifest {manifest_path} "
                                            f"expects {want}")
                arrs[f] = arr
            self._shards.append(arrs)
        ends = rec[:, 1] + rec[:, 2]
        sizes = np.asarray([s["num_tokens"] for s in m["shards"]], np.int64)
        if len(rec) and (rec[:, 0].min() < 0 or rec[:, 0].max() >= len(sizes)
                         or np.any(ends > sizes[np.clip(rec[:, 0], 0, len(sizes) - 1)])):
            raise FeatureCacheError(f"{manifest_path}: record offsets point outside the shards")

    def __len__(self) -> int:
        return len(self._records)

    @property
    def lengths(self) -> np.ndarray:
        """Token count of every record (int64 [N])."""
        return self._records[:, 2].copy()

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} out of range for a cache of {len(self)}")
        s, off, length = (int(x) for x in self._records[i])
        arrs = self._shards[s]
        sl = slice(off, off + length)
        return {
            "input_ids": np.asarray(arrs["input_ids"][sl], np.int32),
            "loss_mask": np.asarray(arrs["loss_mask"][sl], np.int32),
            "features": np.asarray(arrs["features"][sl]).view(ml_dtypes.bfloat16).astype(np.float32),
            "target_hidden": np.asarray(arrs["target_hidden"][sl]).view(ml_dtypes.bfloat16).astype(np.float32),
        }

    def __repr__(self) -> str:
        return (f"FeatureCache({str(self.path)!r}, records={len(self)}, target={self.target!r}, "
                f"layer_ids={list(self.layer_ids)})")


__all__ = ["estimate_cache_bytes", "write_feature_cache", "FeatureCache", "FeatureCacheError",
           "InsufficientDiskError", "MANIFEST"]
