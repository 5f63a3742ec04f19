"""Continuous batching of target generation for regeneration (SPEC §4 data; issue 10 item 2).

A static batch waits for its slowest row: with sampled replies of very different lengths most
rows sit idle for most of the steps. Here the batch has `batch_size` slots that stay busy: the
on-device decode loop (`autoregressive.ar_decode`) returns as soon as `refill_size` rows are
done, their replies are handed back, and the next requests from the queue are prefilled into the
freed slots (`ar_refill`) before decoding goes on. Shapes come from a small set, so steady state
never recompiles: prompts are right-padded to a multiple of `len_bucket`, a refill always
prefills `refill_size` rows (padding rows are dropped on device), and the cache length only
grows, to the next `len_bucket` multiple that fits the longest prompt admitted so far plus
`max_new_tokens` (`ar_grow`). The queue serves the shortest bucket first (FIFO within a bucket)
so the cache stays short while it can.

Each request carries its own key data (`ARState.key_data`): token i of a reply is sampled with
`fold_in(key, i)`, so a reply does not depend on the slot, the batch or the order it ran in —
the property resumable, deterministic regeneration relies on. The batcher knows nothing about
conversations; a reply callback may submit follow-up requests (the next user turn).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.autoregressive import (ar_decode, ar_empty, ar_grow, ar_refill,
                                                round_up, stop_array)

ReplyFn = Callable[[Hashable, list[int]], None]


class ContinuousBatcher:
    """Generates one reply per submitted request with a batch that is refilled as rows finish.

    `submit(handle, prompt_ids, key_data)` queues a request; `run(on_reply)` decodes until the
    queue and the batch are empty, calling `on_reply(handle, reply_ids)` as each reply ends (the
    stop token, when hit, is the last id; replies are at most `max_new_tokens` long) and
    `on_chunk()` after every device call that finished a reply (a point to write results).

    Where the time goes: `device_calls` counts the calls of each kind (refill / decode / grow),
    `device_seconds` is their wall time (each call waited for; the first call of each shape
    includes its compilation) and `decode_steps` the batched decode steps run.
    """

    def __init__(self, target: Any, *, batch_size: int, max_new_tokens: int,
                 temperature: float, top_k: int, top_p: float, stop_token_ids: Sequence[int],
                 refill_size: int | None = None, steps_per_call: int = 64,
                 len_bucket: int = 64):
        if batch_size < 1 or max_new_tokens < 1:
            raise ValueError("batch_size and max_new_tokens must be >= 1")
        self.target = target
        self.B = batch_size
        self.R = refill_size or max(1, batch_size // 4)
        if not 1 <= self.R <= batch_size:
            raise ValueError(f"refill_size must be in [1, batch_size={batch_size}], got {self.R}")
        self.max_new = max_new_tokens
        self.top_k, self.top_p = top_k, top_p
        self.temp = jnp.asarray(temperature, jnp.float32)
        self.stops = stop_array(stop_token_ids, ())
        self.steps_per_call = steps_per_call
        self.bucket = len_bucket
        self._queue: list[tuple[int, int, Hashable, np.ndarray, np.ndarray]] = []
        self._seq = itertools.count()
        self.device_calls = {"refill": 0, "decode": 0, "grow": 0}
        self.device_seconds = {"refill": 0.0, "decode": 0.0, "grow": 0.0}
        self.decode_steps = 0

    def _call(self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, waited for and booked under `kind`."""
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        self.device_seconds[kind] += time.perf_counter() - t0
        self.device_calls[kind] += 1
        return out

    def submit(self, handle: Hashable, prompt_ids: Sequence[int], key_data: np.ndarray) -> None:
        ids = np.asarray(prompt_ids, np.int32)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"request {handle!r}: the prompt must be a non-empty 1-D id list")
        vocab = self.target.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"request {handle!r}: token ids outside [0, {vocab})")
        heapq.heappush(self._queue, (round_up(ids.size, self.bucket), next(self._seq), handle,
                                     ids, np.asarray(key_data, np.uint32)))

    def _cache_len_for(self, prompt_bucket: int) -> int:
        return round_up(prompt_bucket + self.max_new, self.bucket)

    def run(self, on_reply: ReplyFn, on_chunk: Callable[[], None] | None = None) -> None:
        t = self.target
        slots: list[Hashable | None] = [None] * self.B
        s = None
        while True:
            if s is not None:
                done, num, out = jax.device_get((s.done, s.num_out, s.out))
                finished = False
                for b, handle in enumerate(slots):
                    if handle is not None and done[b]:
                        slots[b] = None
                        finished = True
                        on_reply(handle, out[b, :num[b]].tolist())  # may submit follow-ups
                if finished and on_chunk is not None:
                    on_chunk()
            free = [b for b, h in enumerate(slots) if h is None]
            while self._queue and len(free) >= min(self.R, len(self._queue)):
                n = min(self.R, len(self._queue), len(free))
                group = [heapq.heappop(self._queue) for _ in range(n)]
                P = max(g[0] for g in group)
                need = self._cache_len_for(P)
                if s is None:
                    s = ar_empty(t.config, self.B, need, self.max_new, t.dtype)
                elif need > s.cache.max_len:
                    s = self._call("grow", ar_grow, s, cache_len=need)
                tokens = np.zeros((self.R, P), np.int32)
                lens = np.ones((self.R,), np.int32)
                rows = np.full((self.R,), self.B, np.int32)  # B = padding row, dropped
                keys = np.zeros((self.R, 2), np.uint32)
                for r, (_, _, handle, ids, key) in enumerate(group):
                    tokens[r, :ids.size], lens[r], keys[r] = ids, ids.size, key
                    rows[r] = free.pop(0)
                    slots[rows[r]] = handle
                s = self._call("refill", ar_refill, t.graphdef, t.state, s, jnp.asarray(tokens),
                               jnp.asarray(lens), jnp.asarray(rows), jnp.asarray(keys),
                               self.temp, self.stops, top_k=self.top_k, top_p=self.top_p)
            if len(free) == self.B:  # an all-free batch admits any queued request: all done
                return
            # return to the host as soon as a refill is possible (or one more reply when the
            # queue is empty but replies may still submit follow-ups)
            min_done = len(free) + 1 if not self._queue else max(self.R, len(free) + 1)
            steps_before = int(s.steps)
            s = self._call("decode", ar_decode, t.graphdef, t.state, s, self.temp, self.stops,
                           num_steps=self.steps_per_call, top_k=self.top_k, top_p=self.top_p,
                           min_done=jnp.asarray(min_done, jnp.int32))
            self.decode_steps += int(s.steps) - steps_before


__all__ = ["ContinuousBatcher"]
