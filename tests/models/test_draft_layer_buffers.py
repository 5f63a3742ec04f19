"""A DSpark drafter with one buffer per draft layer (`drafters.dspark.with_layer_buffers`, the
serving engine's layout on XLA:CPU) computes what the stacked drafter computes: the context
K/V of committed features and the block hidden states the drafts come from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models import init_draft, load_target
from dspark_jax.models import layers as L
from dspark_jax.models.drafters.dspark import with_layer_buffers
from hf_tiny import save_tiny_hf


def test_per_layer_drafter_equals_the_stacked_one(tmp_path):
    target = load_target(save_tiny_hf(tmp_path, "qwen3", head_dim=16, layers=3, seed=2))
    draft = init_draft(target, dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1),
                                    mask_token_id=96, markov_rank=8), seed=3)
    gd, st = with_layer_buffers(draft.graphdef, draft.state)
    stacked, per_layer = nnx.merge(draft.graphdef, draft.state), nnx.merge(gd, st)
    assert type(per_layer.layers) is L.UnstackedLayers
    assert type(stacked.layers) is L.DecoderLayers       # the source is left as it was
    rng = np.random.RandomState(0)
    S, F = 12, draft.config.num_features * target.config.hidden_size
    feats = jnp.asarray(rng.randn(1, S, F), jnp.float32)
    pos = jnp.arange(S, dtype=jnp.int32)[None]
    (k0, v0), (k1, v1) = (m.context_kv(feats, pos) for m in (stacked, per_layer))
    np.testing.assert_allclose(np.asarray(k1), np.asarray(k0), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(v1), np.asarray(v0), atol=1e-5, rtol=1e-5)
    anchor, apos = jnp.asarray([[5]], jnp.int32), jnp.asarray([[S]], jnp.int32)
    visible = (jnp.arange(S)[None] < S)[:, None, :]
    h0, h1 = (jax.jit(m.backbone)(anchor, apos, k0, v0, visible, jnp.ones((1, 1), bool))
              for m in (stacked, per_layer))
    assert h0.shape == (1, 1, 4, target.config.hidden_size)
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(h0).sum()) > 0
