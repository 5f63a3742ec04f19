"""The serving engine's host records (paper §5.2–5.4; SPEC §8, §9): the host's copy of the
request slots' settings (`HostSlots`, sent to the device as `round_types.SlotSettings`), and
what a run records of each request (`RequestRecord`) and of each round or device call
(`RoundSummary`), which `Engine.generate` returns and which also read by name, as the mappings
of the engine's stable API (`record["accepted"]`)."""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.round_types import SlotSettings


class ReadsByName(collections.abc.Mapping):
    """A dataclass record that also reads as a mapping of its fields (`record["accepted"]`,
    `set(record)`, `record.get("admitted_capacity")`)."""

    def __getitem__(self, name: str) -> Any:
        if name not in self._names():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def _names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))


@dataclasses.dataclass(eq=False)
class HostSlots(ReadsByName):
    """The host's copy of `SlotSettings`: [R] arrays it writes as requests join, run and
    leave, sent with every device call (`to_device`)."""

    active: np.ndarray        # bool: slot holds a running request
    remaining: np.ndarray     # int32: tokens it may still emit
    counter: np.ndarray       # int32: rounds it has run (folds its key)
    temperature: np.ndarray   # f32
    top_k: np.ndarray         # int32 (0 = off)
    top_p: np.ndarray         # f32 (1 = off)
    key_data: np.ndarray      # [R, 2] uint32

    @classmethod
    def empty(cls, num_slots: int) -> "HostSlots":
        """R empty slots."""
        R = int(num_slots)
        return cls(active=np.zeros(R, bool), remaining=np.zeros(R, np.int32),
                   counter=np.zeros(R, np.int32), temperature=np.zeros(R, np.float32),
                   top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
                   key_data=np.zeros((R, 2), np.uint32))

    def to_device(self) -> SlotSettings:
        """These settings as the device programs take them."""
        return SlotSettings(**{f: jnp.asarray(getattr(self, f)) for f in SlotSettings._fields})


@dataclasses.dataclass(eq=False)
class RequestRecord(ReadsByName):
    """One request of a run: per round its accepted and verified drafts, its acceptance length
    (τ term) and (drafting rounds) its proposals' confidence logits; when it arrived, joined,
    got its first token and finished (seconds into the run)."""

    arrival_s: float
    prompt_tokens: int
    accepted: list[int] = dataclasses.field(default_factory=list)
    proposed: list[int] = dataclasses.field(default_factory=list)
    acceptance: list[int] = dataclasses.field(default_factory=list)
    confidence: list[np.ndarray] = dataclasses.field(default_factory=list)
    join_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None


@dataclasses.dataclass(eq=False)
class RoundSummary(ReadsByName):
    """One round (a drafting round of a device call) or one device call of plain steps or
    plain rounds: the requests active, the drafts verified, the capacity bucket K it ran in,
    the tokens emitted, whether it drafted, its seconds (a call's, for its rounds), the steps
    or rounds it stands for, and (plain steps) the cache length or (drafting) the capacity
    its schedule admitted."""

    active: int
    verified_tokens: int
    capacity: int
    tokens: int
    drafted: bool
    seconds: float
    steps: int
    cache_len: int | None = None
    admitted_capacity: int | None = None
