"""`order="deepspec"`: the training order of DeepSpec's own sampler.

DeepSpec's `StatelessResumableDistributedSampler` (`../shared/reference/deepspec`, imported, never
copied) is driven as its trainer drives it: `total_size` = its samples per epoch, one sampler per
rank, the stream cut into micro-batches of `local_batch_size` and `gradient_accumulation_steps`
of them to an optimizer step. Our pipeline's batches must hold the same records at every
optimizer step, and our micro-batch j (rows j, j + m, …) DeepSpec's micro-step j, across epochs
and whatever the number of ranks or hosts; resuming from the iterator state stays exact.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from dspark_jax.data.deepspec_order import DeepSpecOrder, torch_randperm
from dspark_jax.data.pipeline import PipelineConfig, make_dataset
from dspark_jax.train.step import micro_batches_of

DEEPSPEC = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepspec"
TAG = 1000   # record i starts with token TAG + i


def _records(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        ids = rng.integers(1, 900, int(rng.integers(3, 12))).astype(np.int32)
        ids[0] = TAG + i
        out.append({"input_ids": ids, "loss_mask": np.ones_like(ids)})
    return out


@pytest.fixture(scope="module")
def sampler_cls():
    """DeepSpec's sampler class (skips where its source or torch is absent)."""
    if not (DEEPSPEC / "deepspec").is_dir():
        pytest.skip(f"DeepSpec's source is not at {DEEPSPEC} (../shared/reference is absent; a "
                    "user's clone has none)")
    pytest.importorskip("torch", reason="DeepSpec's sampler is PyTorch")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(DEEPSPEC.resolve()))
        from deepspec.utils.distributed import StatelessResumableDistributedSampler

        yield StatelessResumableDistributedSampler


def _deepspec_steps(cls, n: int, world: int, local_batch: int, accumulation: int, seed: int,
                    steps: int) -> list[list[list[int]]]:
    """DeepSpec's optimizer steps → micro-steps → record indices (all ranks together), from one
    sampler per rank as its trainer builds them (`_build_train_dataloader`, from offset 0)."""
    global_batch = world * local_batch * accumulation
    per_epoch = (n // global_batch) * global_batch
    streams = []
    for rank in range(world):
        s = cls(list(range(n)), num_replicas=world, rank=rank, total_size=per_epoch, seed=seed,
                start_global_offset_samples=0, num_samples=steps * accumulation * local_batch)
        streams.append(list(s))
    out = []
    for step in range(steps):
        micro = []
        for j in range(accumulation):
            at = (step * accumulation + j) * local_batch
            micro.append(sorted(i for st in streams for i in st[at: at + local_batch]))
        out.append(micro)
    return out


def _our_steps(n: int, batch: int, micro: int, seed: int, steps: int, hosts: int = 1
               ) -> list[list[list[int]]]:
    """Our pipeline's optimizer steps → micro-batches → record indices (hosts' rows joined)."""
    pc = PipelineConfig(batch_size=batch, max_length=16, seed=seed, order="deepspec",
                        micro_batches=micro)
    its = [iter(make_dataset(_records(n), pc, shard_index=h, shard_count=hosts))
           for h in range(hosts)]
    out = []
    for _ in range(steps):
        ids = np.concatenate([next(it)["input_ids"][:, 0] for it in its]) - TAG
        out.append([sorted(m.tolist()) for m in micro_batches_of(ids, micro)])
    return out


@pytest.mark.parametrize("n", [1, 2, 5, 23, 1000])
@pytest.mark.parametrize("seed", [0, 42, 2 ** 32 + 7])
def test_torch_randperm_is_torchs(n, seed):
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    np.testing.assert_array_equal(torch_randperm(n, seed), torch.randperm(n, generator=g).numpy())


# (world size, local batch, accumulation) of DeepSpec against our (hosts, micro-batches)
LAYOUTS = [((1, 4, 1), 1), ((1, 1, 4), 1), ((1, 2, 2), 1), ((2, 1, 2), 2), ((2, 2, 1), 2)]


@pytest.mark.parametrize("layout,hosts", LAYOUTS)
def test_order_is_deepspecs_sampler_order(sampler_cls, layout, hosts):
    """23 records, global batch 4: 5 steps an epoch (3 records left out of each), 13 steps
    cross two epoch boundaries; seed 42 is the one DeepSpec's trainer uses."""
    world, local_batch, accumulation = layout
    batch = world * local_batch * accumulation
    theirs = _deepspec_steps(sampler_cls, 23, world, local_batch, accumulation, 42, 13)
    ours = _our_steps(23, batch, accumulation, 42, 13, hosts=hosts)
    assert ours == theirs
    assert len({tuple(sum(s, [])) for s in ours[:5]}) == 5       # distinct batches


def test_steps_hold_the_same_records_whatever_the_micro_batches(sampler_cls):
    """`micro_batches` only places the step's records into rows (micro-step j of DeepSpec in
    our micro-batch j); another seed is another order."""
    theirs = _deepspec_steps(sampler_cls, 23, 1, 2, 2, 42, 5)
    flat = lambda steps: [sorted(sum(s, [])) for s in steps]
    assert flat(_our_steps(23, 4, 1, 42, 5)) == flat(theirs)
    assert flat(_our_steps(23, 4, 4, 42, 5)) == flat(theirs)
    assert flat(_our_steps(23, 4, 2, 43, 5)) != flat(theirs)


def test_resume_from_iterator_state_is_exact():
    pc = PipelineConfig(batch_size=4, max_length=16, seed=42, order="deepspec", micro_batches=2)
    recs = _records(23)
    it = iter(make_dataset(recs, pc, shard_index=0, shard_count=1))
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it)["input_ids"] for _ in range(9)]       # crosses an epoch boundary
    fresh = iter(make_dataset(recs, pc, shard_index=0, shard_count=1))
    fresh.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(fresh)["input_ids"], want)


def test_config_errors():
    with pytest.raises(ValueError, match="order must be one of"):
        PipelineConfig(batch_size=4, max_length=16, order="torch")
    with pytest.raises(ValueError, match="pack=False"):
        PipelineConfig(batch_size=4, max_length=16, order="deepspec", pack=True)
    with pytest.raises(ValueError, match="micro_batches 3 must divide"):
        PipelineConfig(batch_size=4, max_length=16, order="deepspec", micro_batches=3)
    with pytest.raises(ValueError, match="no global batch"):
        DeepSpecOrder(3, 4, 1, 0)
