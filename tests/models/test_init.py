"""A fresh drafter is initialised as DeepSpec's `post_init` / `_init_weights` (issue 8 item 5):
every Linear / Embedding weight ~ N(0, initializer_range = 0.02) — the Markov W2 included —
biases zero, RMSNorm weights one; embedding and LM head copied from the target."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from dspark_jax.models import DraftConfig, Target, init_draft
from dspark_jax.models.config import DecoderConfig, RopeConfig
from dspark_jax.models.decoder import create_target

STD = 0.02   # Qwen3's initializer_range, which DeepSpec's drafters inherit
# every trainable tensor of every drafter variant, by its path, with DeepSpec's rule
ONES = {"hidden_norm", "norm", "layers/input_norm", "layers/post_norm", "layers/q_norm",
        "layers/k_norm"}
ZEROS = {"markov/gate_b", "markov/joint_b", "confidence/b"}
NORMAL = {"fc", "layers/wq", "layers/wk", "layers/wv", "layers/wo", "layers/w_gate",
          "layers/w_up", "layers/w_down", "markov/w1", "markov/w2", "markov/gate_w",
          "markov/joint_w", "confidence/w"}


@pytest.fixture(scope="module")
def target():
    cfg = DecoderConfig(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, qk_norm=True, rope=RopeConfig(theta=1e6))
    return Target.from_model(create_target(cfg, seed=0))


def _trainable(draft) -> dict[str, np.ndarray]:
    _, params, _ = nnx.split(draft.model, nnx.Param, ...)
    return {"/".join(map(str, k)): np.asarray(v.get_value(), np.float64)
            for k, v in nnx.to_flat_state(params)}


@pytest.mark.parametrize("kw", [
    dict(markov_head_type="vanilla"),
    dict(markov_head_type="gated", confidence_head_with_markov=False),
    dict(markov_head_type="rnn"),
    dict(model_type="dflash", markov_rank=0, enable_confidence_head=False),
    dict(model_type="eagle3", markov_rank=0, enable_confidence_head=False),
])
def test_fresh_drafter_follows_deepspec_init(target, kw):
    cfg = DraftConfig(target=target.config, block_size=4, num_draft_layers=2,
                      target_layer_ids=(0, 1), mask_token_id=511, **dict(dict(markov_rank=32), **kw))
    draft = init_draft(target, cfg, seed=3)
    params = _trainable(draft)
    unknown = set(params) - ONES - ZEROS - NORMAL
    assert not unknown, f"no DeepSpec init rule for {sorted(unknown)}"
    if cfg.has_markov:
        assert {"markov/w1", "markov/w2"} <= set(params)
    for name, x in params.items():
        if name in ONES:
            np.testing.assert_array_equal(x, 1.0, err_msg=name)
        elif name in ZEROS:
            np.testing.assert_array_equal(x, 0.0, err_msg=name)
        else:
            n = x.size
            # 5-sigma bounds of the sample mean and standard deviation of n normal draws
            assert abs(x.mean()) < 5 * STD / np.sqrt(n), (name, x.mean())
            assert abs(x.std() / STD - 1) < 5 / np.sqrt(2 * n), (name, x.std())
    # different tensors are independent draws
    flat = [params[k].ravel()[:64] for k in sorted(NORMAL & set(params))]
    assert len({v.tobytes() for v in flat}) == len(flat)
    m = draft.model
    np.testing.assert_array_equal(m.embed.get_value(), target.model.embed.get_value())
    np.testing.assert_array_equal(m.lm_head.get_value(), target.model.lm_head_weight())
