"""DeepSpec's training order (its trainer's `StatelessResumableDistributedSampler`), without torch.

DeepSpec's sampler draws epoch e's order as `torch.randperm(N, generator seeded seed + e)` and
keeps its first `total_size` = (N // global batch) · global batch entries; each rank r takes
entries r, r + R, r + 2R, … of it, and its loader cuts that stream into micro-batches of
`local_batch_size`, `gradient_accumulation_steps` of them to an optimizer step. Whatever the
world size R, optimizer step s of an epoch therefore trains on entries [s·B, (s+1)·B) of the
epoch's permutation (B the global batch), and its micro-step j (accumulated over all ranks) on
the j-th of the A equal chunks of that slice.

`torch_randperm` reproduces torch's CPU `randperm` bit for bit: torch's generator is an MT19937
seeded with the low 32 bits of the seed (the standard `init_genrand`, as numpy's legacy
`RandomState(seed)`), and for n < 2³²/20 `randperm` is a Fisher–Yates pass that swaps entry i
with entry i + (next 32-bit output mod (n − i)), for i = 0 … n − 2.
`DeepSpecOrder` maps (epoch, position in the epoch) to a record index, placing micro-step j's
records in the rows of our j-th (strided) micro-batch.
"""

from __future__ import annotations

import functools

import numpy as np

RANDPERM_MAX = (2 ** 32 - 1) // 20   # torch switches to another algorithm from here on


def torch_randperm(n: int, seed: int) -> np.ndarray:
    """`torch.randperm(n, generator=torch.Generator().manual_seed(seed))` on CPU, as int64."""
    if not 0 <= n < RANDPERM_MAX:
        raise ValueError(f"torch_randperm: n={n} must be in [0, {RANDPERM_MAX}) (torch's small-n "
                         "algorithm)")
    if seed < 0:
        raise ValueError(f"torch_randperm: seed {seed} must be ≥ 0")
    perm = list(range(n))
    if n < 2:
        return np.asarray(perm, np.int64)
    draws = np.random.RandomState(seed & 0xFFFFFFFF).randint(0, 2 ** 32, size=n - 1,
                                                              dtype=np.uint32)
    i = np.arange(n - 1, dtype=np.int64)
    swap = (draws.astype(np.int64) % (n - i) + i).tolist()
    for a, b in enumerate(swap):
        perm[a], perm[b] = perm[b], perm[a]
    return np.asarray(perm, np.int64)


class DeepSpecOrder:
    """Record index of each row of DeepSpec's training order.

    `n` records, global batch `batch_size` (B), `micro_batches` (m) micro-batches a step, the
    sampler's `seed`. `record(epoch, pos)` is the record at position `pos` (< steps·B) of the
    epoch's row order, where step s holds rows [s·B, (s+1)·B) and our micro-batch j is rows
    j, j + m, j + 2m, … of the step (`step.micro_batches_of`): row j + m·t of step s holds entry
    s·B + j·(B/m) + t of the epoch's permutation, so our micro-batch j trains on DeepSpec's
    micro-step j when m is its accumulation count.
    """

    def __init__(self, n: int, batch_size: int, micro_batches: int, seed: int):
        if micro_batches < 1 or batch_size % micro_batches:
            raise ValueError(f"micro_batches {micro_batches} must divide batch_size {batch_size}")
        if n < batch_size:
            raise ValueError(f"{n} records make no global batch of {batch_size}")
        self.n, self.B, self.m, self.seed = n, batch_size, micro_batches, seed
        self.steps = n // batch_size

    @functools.lru_cache(maxsize=2)
    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's kept permutation: its first steps·B entries."""
        return torch_randperm(self.n, self.seed + epoch)[: self.steps * self.B]

    def entry(self, pos: int) -> int:
        """The permutation entry a row position of an epoch takes (the micro-batch layout)."""
        step, q = divmod(pos, self.B)
        j, t = q % self.m, q // self.m
        return step * self.B + j * (self.B // self.m) + t

    def record(self, epoch: int, pos: int) -> int:
        return int(self.permutation(epoch)[self.entry(pos)])
