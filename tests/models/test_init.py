"""A fresh drafter is initialised as DeepSpec's `post_init` / `_init_weights`:
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


def test_backbone_from_target_starts_on_the_targets_own_context_kv(target):
    """`from_target`: draft layer 0 is the target layer after the last tap, and its context K/V
    from the tapped features equal the K/V the target itself computes in that layer."""
    import jax.numpy as jnp

    from dspark_jax.models import layers as L
    from dspark_jax.models.drafters.draft import copied_target_layers

    model = create_target(target.config, seed=1)     # norms ≠ 1, so a wrong norm shows
    rng = np.random.default_rng(1)
    for var in (model.layers.input_norm, model.final_norm):
        var.set_value(jnp.asarray(rng.uniform(0.5, 2.0, var.get_value().shape), jnp.float32))
    target = Target.from_model(model)

    cfg = DraftConfig(target=target.config, block_size=4, num_draft_layers=2,
                      target_layer_ids=(0, 1), mask_token_id=511, markov_rank=32)
    assert copied_target_layers(cfg) == [2, 3]
    assert copied_target_layers(cfg.replace(target_layer_ids=(0, 2))) == [2, 3]  # last 2 layers
    draft = init_draft(target, cfg, seed=3, from_target=True)
    tl, dl = target.model.layers, draft.model.layers
    for name in dl.NAMES:
        np.testing.assert_array_equal(getattr(dl, name).get_value(),
                                      getattr(tl, name).get_value()[2:4], err_msg=name)
    np.testing.assert_array_equal(draft.model.norm.get_value(),
                                  target.model.final_norm.get_value())
    ids = np.random.default_rng(0).integers(3, 500, (2, 9))
    feats = jnp.asarray(target.hidden_states(ids, (0, 1)))          # taps: outputs of layers 0, 1
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    k_draft, v_draft = draft.model.context_kv(feats, pos)          # [Ld, B, S, K, H]
    lp = {k: v[2] for k, v in tl.stacked(jnp.float32).items()}      # the target's layer 2
    eps, rope = target.config.rms_norm_eps, target.config.rope
    x = L.rms_norm(feats[..., 64:], lp["input_norm"], eps)           # layer 1's output, normed
    k, v = L.project_kv(lp, x, eps)
    np.testing.assert_allclose(k_draft[0], L.apply_rope(k, pos, rope), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v_draft[0], v, rtol=1e-5, atol=1e-5)
    eagle = cfg.replace(model_type="eagle3", markov_rank=0, enable_confidence_head=False)
    with pytest.raises(Exception, match="only DSpark / DFlash"):
        init_draft(target, eagle, from_target=True)
