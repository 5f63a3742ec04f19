"""The learning-rate schedule against DeepSpec's own (`deepspec/utils/optim.py`:
`CosineAnnealingWarmupLR`, driven as its `BF16Optimizer` drives it), step by step."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from dspark_jax.train.step import OptimConfig, make_schedule

DEEPSPEC = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepspec"


@pytest.mark.parametrize("total,ratio", [(100, 0.04), (1000, 0.04), (37, 0.1), (50, 0.0)])
def test_each_step_takes_deepspecs_learning_rate(total, ratio):
    if not (DEEPSPEC / "deepspec").is_dir():
        pytest.skip(f"DeepSpec's source is not at {DEEPSPEC} (../shared/reference is absent)")
    import torch

    sys.path.insert(0, str(DEEPSPEC.resolve()))
    from deepspec.utils.optim import CosineAnnealingWarmupLR

    lr = 6e-4
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=lr)
    sched = CosineAnnealingWarmupLR(opt, total_steps=total, warmup_steps=int(ratio * total))
    theirs = []
    for _ in range(total):          # the lr each optimizer step runs with, then the step
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = make_schedule(OptimConfig(lr=lr, warmup_ratio=ratio, total_steps=total))
    got = np.asarray([float(ours(k)) for k in range(total)])
    np.testing.assert_allclose(got, theirs, rtol=1e-5, atol=1e-6 * lr)   # fp32 near 0
    assert got[0] > 0                   # the first step trains
