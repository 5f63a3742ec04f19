"""The grain input pipeline of DSpark/DFlash training (SPEC §4 data; STYLE habit 8).

Rendered samples (`records_from_conversations`) or a target-feature cache (`FeatureCache`) become
fixed-shape numpy batches [b_local, S] for the jitted train step:

    grain.MapDataset.source(records)          random access to the samples
    units (records, or greedy-packed rows)    → per-epoch shuffle (`order` "grain": grain
                                                 `shuffle` + `repeat`, seeded, a different
                                                 permutation every epoch; "deepspec": DeepSpec's
                                                 sampler, `data/deepspec_order.py`)
    per-host slice of every global batch      → host h takes rows [h·b, (h+1)·b) of each global
                                                 batch of B = batch_size rows, b = B / shard_count
    pad (or pack) to the batch width, batch   → `to_iter_dataset()`: a checkpointable iterator

Each batch holds `input_ids`, `loss_mask`, `positions`, `segment_ids` (int32 [b, S]; segment 0 is
padding) and, from a feature cache, `features` f32 [b, S, n·d] and `target_hidden` f32 [b, S, d]
(zero-padded). Records longer than `max_length` are truncated (right).

The width S is `pad_to`'s: "max_length" (default) pads every row to `max_length`, one static
shape for every step; "longest" pads each global batch to its longest record rounded up to a
multiple of `pad_multiple`, capped at `max_length` — DeepSpec's collator pads each micro-batch to
its longest sample, which `pad_multiple=1` reproduces at the granularity of the global batch (the
train step scans its micro-batches over one [m, B/m, S] array, so they share one width). The
jitted step compiles once per width: at most ⌈max_length / pad_multiple⌉ shapes.

Design decisions:
- Everything is index arithmetic over a grain `MapDataset`, so the iterator state is one integer
  (`it.get_state() == {"next_index": k}`), restoring is exact, and all hosts agree on the number
  of steps (they compute the same global plan and each takes its slice).
- Packing (`pack=True`) is decided ONCE per dataset: records are visited in a seeded order and
  placed first-fit into the open rows of a small window (`pack_window`); a record that fits no
  open row opens a new one (closing the oldest when the window is full). The packed rows are the
  units that are shuffled per epoch. Packing once keeps `steps_per_epoch` exact and identical on
  every host (LR schedules need it), at the price of the same records sharing a row every epoch.
  Packed segments get `segment_ids` 1, 2, 3, … and `positions` restarting at 0.
- `drop_remainder=False`: the last, partial global batch is completed with all-padding rows
  (loss_mask 0, segment_ids 0) so every batch keeps its static shape and every host its share.
- "longest" reads the record lengths (a FeatureCache's manifest) and takes the width of global
  batch k from the global plan, which every host computes alike: the hosts agree on the shape of
  the global array without communicating, and the width is a function of k alone, so a resumed
  iterator yields the same batches, shapes included.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np

from dspark_jax.data.chat import DEFAULT_MAX_LENGTH, default_system_prompt_for, render_dataset
from dspark_jax.data.deepspec_order import DeepSpecOrder
from dspark_jax.data.features import FeatureCache
from dspark_jax.data.prompts import Conversation

Records = Sequence[Mapping[str, np.ndarray]] | FeatureCache
ORDERS = ("grain", "deepspec")
PAD_TO = ("max_length", "longest")
# the default bucket: the target's flash-attention tile (`models.layers.FLASH_BLOCK`), so that an
# online target forward over a "longest" batch keeps its kernels on a GPU or TPU
DEFAULT_PAD_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Batching settings. `batch_size` is GLOBAL (all hosts together); `num_epochs=None` repeats
    forever. `pack_window`: open rows considered by first-fit packing. `read_threads` /
    `prefetch`: grain ReadOptions (0 threads = read synchronously, best for in-memory records).
    `order` (with `shuffle`): "grain", grain's seeded shuffle; "deepspec", DeepSpec's sampler
    with seed `seed` (one record a row, full batches only), its micro-step j in the rows of
    micro-batch j of `micro_batches` (`DeepSpecOrder`). `pad_to`: the row width, "max_length"
    or "longest" (each global batch's longest record rounded up to a multiple of `pad_multiple`,
    capped at `max_length`; one record a row, so `pack=False`)."""

    batch_size: int
    max_length: int
    pack: bool = False
    shuffle: bool = True
    seed: int = 0
    num_epochs: int | None = None
    drop_remainder: bool = True
    pack_window: int = 8
    read_threads: int = 0
    prefetch: int = 2
    order: str = "grain"
    micro_batches: int = 1
    pad_to: str = "max_length"
    pad_multiple: int = DEFAULT_PAD_MULTIPLE

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.pad_to not in PAD_TO:
            raise ValueError(f"pad_to must be one of {PAD_TO}, got {self.pad_to!r}")
        if isinstance(self.pad_multiple, bool) or not isinstance(self.pad_multiple, int) \
                or self.pad_multiple < 1:
            raise ValueError(f"pad_multiple must be an integer >= 1, got {self.pad_multiple!r}")
        if self.pad_to == "longest" and self.pack:
            raise ValueError("pad_to 'longest' pads one record a row to its batch's longest; "
                             "packed rows fill max_length: needs pack=False")
        if self.order == "deepspec" and (self.pack or not self.shuffle or not self.drop_remainder):
            raise ValueError("order 'deepspec' (DeepSpec's sampler) takes one record a row and "
                             "full batches: needs pack=False, shuffle=True, drop_remainder=True")
        if self.micro_batches < 1 or self.batch_size % self.micro_batches:
            raise ValueError(f"micro_batches {self.micro_batches} must divide batch_size "
                             f"{self.batch_size}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {self.num_epochs}")
        if self.pack_window < 1:
            raise ValueError(f"pack_window must be >= 1, got {self.pack_window}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")


def records_from_conversations(
    conversations: Sequence[Conversation], tokenizer: Any, max_length: int = DEFAULT_MAX_LENGTH,
    **render_kw: Any,
) -> tuple[list[dict[str, np.ndarray]], collections.Counter[str]]:
    """Renders conversations into training samples (`chat.render_dataset`) → (records, stats).

    Unless `default_system_prompt` is given, DeepSpec's per-template choice is used
    (`chat.default_system_prompt_for`: Qwen-style templates get "You are a helpful assistant.",
    templates with their own default system turn, like SmolLM2's, keep theirs).
    """
    render_kw.setdefault("default_system_prompt", default_system_prompt_for(tokenizer))
    return render_dataset(conversations, tokenizer, max_length, **render_kw)


def record_lengths(records: Records) -> np.ndarray:
    """Token count of every record (int64 [N]); a FeatureCache answers from its manifest."""
    if isinstance(records, FeatureCache):
        return records.lengths
    return np.asarray([len(r["input_ids"]) for r in records], np.int64)


def _mixed_seed(seed: int, salt: str) -> int:
    # grain reseeds epoch e with (seed + e): hashing keeps seed s, epoch 1 ≠ seed s+1, epoch 0
    digest = hashlib.blake2b(f"{salt}\x00{seed}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


def pack_rows(lengths: Sequence[int] | np.ndarray, max_length: int, *, seed: int = 0,
              shuffle: bool = True, window: int = 8) -> list[tuple[int, ...]]:
    """Greedy first-fit packing of records (lengths truncated to `max_length`) into rows.

    Records are visited in a seeded random order (input order when `shuffle` is False); each goes
    into the first of up to `window` open rows with room, else into a new row. Returns the rows
    as tuples of record indices, in the order they were opened.
    """
    lengths = np.minimum(np.asarray(lengths, np.int64), max_length)
    order = (np.random.default_rng(_mixed_seed(seed, "pack")).permutation(len(lengths))
             if shuffle else np.arange(len(lengths)))
    rows: list[list[int]] = []
    room: list[int] = []
    open_rows: list[int] = []  # indices into rows, oldest first
    for i in order:
        n = int(lengths[i])
        for r in open_rows:
            if room[r] >= n:
                rows[r].append(int(i))
                room[r] -= n
                break
        else:
            rows.append([int(i)])
            room.append(max_length - n)
            open_rows.append(len(rows) - 1)
            if len(open_rows) > window:
                open_rows.pop(0)
        open_rows = [r for r in open_rows if room[r] > 0]
    return [tuple(r) for r in rows]


def _units(lengths: np.ndarray | None, pc: PipelineConfig) -> list[tuple[int, ...]] | None:
    """Packed rows, or None for one record per row."""
    if not pc.pack:
        return None
    assert lengths is not None
    return pack_rows(lengths, pc.max_length, seed=pc.seed, shuffle=pc.shuffle, window=pc.pack_window)


def max_segments_per_row(lengths: Sequence[int] | np.ndarray, pc: PipelineConfig) -> int:
    """The most records any row holds (1 without packing): the static bound the train step needs
    to give every packed sequence its own `num_anchors` (train/anchors.py)."""
    units = _units(np.asarray(lengths, np.int64), pc)
    return 1 if units is None else max((len(u) for u in units), default=1)


def steps_per_epoch(n_records: int, pc: PipelineConfig, *, lengths: Sequence[int] | np.ndarray | None = None) -> int:
    """Global batches per epoch. With `pack=True` the record `lengths` are needed (packing
    decides the number of rows; see `record_lengths`)."""
    if pc.pack:
        if lengths is None:
            raise ValueError("steps_per_epoch with pack=True needs the record lengths")
        if len(lengths) != n_records:
            raise ValueError(f"{len(lengths)} lengths for {n_records} records")
        n_units = len(pack_rows(lengths, pc.max_length, seed=pc.seed, shuffle=pc.shuffle,
                                window=pc.pack_window))
    else:
        n_units = n_records
    return n_units // pc.batch_size if pc.drop_remainder else -(-n_units // pc.batch_size)


class _RowBuilder:
    """Makes one padded/packed row [width] from a unit (a tuple of record indices; () = all
    padding); records are truncated to `max_length`, then to the width."""

    def __init__(self, source: grain.MapDataset, max_length: int, feature_dims: tuple[int, int] | None):
        self.source = source
        self.S = max_length
        self.feature_dims = feature_dims

    def __call__(self, unit: tuple[int, ...], width: int | None = None) -> dict[str, np.ndarray]:
        S = self.S if width is None else width
        row = {k: np.zeros((S,), np.int32) for k in ("input_ids", "loss_mask", "positions", "segment_ids")}
        if self.feature_dims is not None:
            f, d = self.feature_dims
            row["features"] = np.zeros((S, f), np.float32)
            row["target_hidden"] = np.zeros((S, d), np.float32)
        at = 0
        for seg, i in enumerate(unit, start=1):
            rec = self.source[i]
            n = min(len(rec["input_ids"]), S - at)
            sl = slice(at, at + n)
            row["input_ids"][sl] = rec["input_ids"][:n]
            row["loss_mask"][sl] = rec["loss_mask"][:n]
            row["positions"][sl] = np.arange(n, dtype=np.int32)
            row["segment_ids"][sl] = seg
            if self.feature_dims is not None:
                row["features"][sl] = rec["features"][:n]
                row["target_hidden"][sl] = rec["target_hidden"][:n]
            at += n
        return row


class _HostRows:
    """Local row index → unit of this host: epoch e, step s, slot j of the global batch."""

    def __init__(self, order: grain.MapDataset | DeepSpecOrder | None,
                 units: list[tuple[int, ...]] | None, n_units: int, steps: int,
                 global_batch: int, local_batch: int, shard_index: int):
        self.order, self.units, self.n_units = order, units, n_units
        self.steps, self.B, self.b, self.h = steps, global_batch, local_batch, shard_index

    def unit(self, epoch: int, pos: int) -> tuple[int, ...]:
        """The unit at position `pos` of epoch `epoch`'s unit order (() past its end)."""
        if pos >= self.n_units:
            return ()  # filler row of the last, partial batch (grain would drop a None)
        if isinstance(self.order, DeepSpecOrder):
            u = self.order.record(epoch, pos)
        elif self.order is not None:
            u = int(self.order[epoch * self.n_units + pos])
        else:
            u = pos
        return self.units[u] if self.units is not None else (u,)

    def __call__(self, local_index: int) -> tuple[int, ...]:
        per_epoch = self.steps * self.b
        epoch, within = divmod(int(local_index), per_epoch)
        step, slot = divmod(within, self.b)
        return self.unit(epoch, step * self.B + self.h * self.b + slot)

    def global_units(self, batch_index: int) -> list[tuple[int, ...]]:
        """The units of every row of global batch `batch_index`, all hosts' rows."""
        epoch, step = divmod(int(batch_index), self.steps)
        return [self.unit(epoch, step * self.B + j) for j in range(self.B)]


def batch_width(lengths: np.ndarray, max_length: int, pad_multiple: int) -> int:
    """The row width `pad_to="longest"` gives a batch of records of `lengths`: the longest (each
    capped at `max_length`) rounded up to a multiple of `pad_multiple`, capped at `max_length`."""
    longest = max(1, min(int(np.max(lengths, initial=1)), max_length))
    return min(max_length, -(-longest // pad_multiple) * pad_multiple)


class _HostBatch:
    """Local batch index (= global step, counted over epochs) → this host's batch [b, width]."""

    def __init__(self, rows: _HostRows, build: _RowBuilder, pc: PipelineConfig,
                 lengths: np.ndarray | None):
        self.rows, self.build, self.pc, self.lengths = rows, build, pc, lengths

    def width(self, batch_index: int) -> int:
        if self.pc.pad_to == "max_length":
            return self.pc.max_length
        assert self.lengths is not None
        units = [u for u in self.rows.global_units(batch_index) if u]
        lengths = [sum(int(self.lengths[i]) for i in u) for u in units]
        return batch_width(np.asarray(lengths, np.int64), self.pc.max_length,
                           self.pc.pad_multiple)

    def __call__(self, batch_index: int) -> dict[str, np.ndarray]:
        width = self.width(batch_index)
        b = self.rows.b
        rows = [self.build(self.rows(batch_index * b + j), width) for j in range(b)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def make_dataset(records: Records, pc: PipelineConfig, *, shard_index: int | None = None,
                 shard_count: int | None = None) -> grain.IterDataset:
    """The host-local batch stream (see the module docstring). `shard_index`/`shard_count`
    default to `jax.process_index()` / `jax.process_count()`; `pc.batch_size` must divide by
    `shard_count`. Iterate with `it = iter(ds)`; checkpoint with `it.get_state()` and resume with
    `it.set_state(state)` on a fresh iterator of an identically built dataset."""
    shard_index = jax.process_index() if shard_index is None else int(shard_index)
    shard_count = jax.process_count() if shard_count is None else int(shard_count)
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"bad host shard {shard_index} of {shard_count}")
    if pc.batch_size % shard_count:
        raise ValueError(f"global batch_size {pc.batch_size} is not divisible by the "
                         f"{shard_count} host shards")
    n_records = len(records)
    if n_records == 0:
        raise ValueError("no records: the dataset is empty")
    first = records[0]
    for key in ("input_ids", "loss_mask"):
        if key not in first:
            raise ValueError(f"records need {key!r} (got keys {sorted(first)})")
    feature_dims = None
    if "features" in first:
        feature_dims = (int(np.shape(first["features"])[-1]), int(np.shape(first["target_hidden"])[-1]))

    lengths = record_lengths(records) if pc.pack or pc.pad_to == "longest" else None
    units = _units(lengths, pc)
    n_units = len(units) if units is not None else n_records
    steps = steps_per_epoch(n_records, pc, lengths=lengths)
    if steps == 0:
        raise ValueError(f"{n_units} rows per epoch make no full global batch of {pc.batch_size} "
                         "(use drop_remainder=False or a smaller batch)")
    local = pc.batch_size // shard_count

    order: grain.MapDataset | DeepSpecOrder | None = None
    if pc.shuffle and pc.order == "deepspec":
        order = DeepSpecOrder(n_units, pc.batch_size, pc.micro_batches, pc.seed)
    elif pc.shuffle:
        order = grain.MapDataset.range(n_units).shuffle(seed=_mixed_seed(pc.seed, "epoch"))
        order = order.repeat(pc.num_epochs)
    n_batches = sys.maxsize // local if pc.num_epochs is None else pc.num_epochs * steps

    source = grain.MapDataset.source(records)
    rows = _HostRows(order, units, n_units, steps, pc.batch_size, local, shard_index)
    build = _RowBuilder(source, pc.max_length, feature_dims)
    ds = grain.MapDataset.range(n_batches).map(_HostBatch(rows, build, pc, lengths))
    options = grain.ReadOptions(num_threads=pc.read_threads, prefetch_buffer_size=pc.prefetch)
    return ds.to_iter_dataset(options)


def batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """Rows over the mesh's batch axes (the logical "batch" rule of `dspark_jax.sharding`)."""
    from dspark_jax.sharding import logical_to_spec

    return jax.sharding.NamedSharding(mesh, logical_to_spec(("batch",)))


def to_global_batch(local_batch: Mapping[str, np.ndarray],
                    sharding: jax.sharding.Sharding | Mapping[str, jax.sharding.Sharding]) -> dict[str, jax.Array]:
    """Assembles every host's local rows into global `jax.Array`s
    (`jax.make_array_from_process_local_data`); `sharding` is one sharding or one per key."""
    out = {}
    for key, value in local_batch.items():
        s = sharding[key] if isinstance(sharding, Mapping) else sharding
        out[key] = jax.make_array_from_process_local_data(s, np.asarray(value))
    return out


__all__ = ["PipelineConfig", "make_dataset", "records_from_conversations", "steps_per_epoch",
           "pack_rows", "record_lengths", "max_segments_per_row", "batch_sharding",
           "to_global_batch", "batch_width", "PAD_TO", "DEFAULT_PAD_MULTIPLE"]
