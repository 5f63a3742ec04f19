"""`tau_probabilistic` counted as DeepSpec counts it (`deepspec/modeling/dspark/loss.py`,
`_compute_local_probabilistic_stats` with its `valid_blocks = keep & any(eval_mask)`)."""

from __future__ import annotations

import pathlib
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.train.losses import tau_sums

DEEPSPEC = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepspec"


def test_blocks_and_expected_tau_equal_deepspecs():
    if not (DEEPSPEC / "deepspec").is_dir():
        pytest.skip(f"DeepSpec's source is not at {DEEPSPEC} (../shared/reference is absent)")
    import torch

    sys.path.insert(0, str(DEEPSPEC.resolve()))
    from deepspec.modeling.dspark.loss import _compute_local_probabilistic_stats

    rng = np.random.default_rng(0)
    B, A, G = 3, 5, 4
    accept = rng.uniform(size=(B, A, G)).astype(np.float32)
    supervised = rng.integers(0, G + 1, size=(B, A))           # a prefix of each block
    eval_mask = np.arange(G)[None, None] < supervised[..., None]
    keep = rng.uniform(size=(B, A)) < 0.8
    eval_mask &= keep[..., None]
    eval_mask[0, 0] = False                                     # kept, nothing supervised
    keep[0, 0] = True
    outputs = types.SimpleNamespace(draft_logits=torch.zeros(B, A, G, 2),
                                    eval_mask=torch.from_numpy(eval_mask))
    blocks = torch.from_numpy(keep) & torch.from_numpy(eval_mask).any(dim=-1)
    want_sum, _ = _compute_local_probabilistic_stats(
        outputs=outputs, accept_rate_3d=torch.from_numpy(accept),
        valid_block_weights=blocks.to(torch.float32))
    got_sum, got_blocks = tau_sums(jnp.asarray(accept), jnp.asarray(eval_mask, jnp.float32),
                                   jnp.asarray(keep))
    assert float(got_blocks) == float(blocks.sum()) < keep.sum()   # the empty kept block: out
    np.testing.assert_allclose(float(got_sum), float(want_sum), rtol=1e-6)
