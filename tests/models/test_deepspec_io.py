"""DeepSpec checkpoint interop: exact round trip, loading DeepSpec-named tensors written by hand
(torch layouts), and clear errors for mismatched or corrupted checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.models import init_draft, load_draft, load_target
from dspark_jax.models.config import ConfigError
from dspark_jax.models.hf_io import CheckpointError, read_safetensors_dir, write_safetensors
from hf_tiny import save_tiny_hf

BASE = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1), mask_token_id=96,
            markov_rank=8)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                    layers=4))


@pytest.fixture(scope="module")
def feats(target):
    return target.hidden_states(np.arange(3, 15)[None], [0, 1])[0]


@pytest.mark.parametrize("kw", [dict(), dict(markov_head_type="gated"),
                                dict(markov_head_type="rnn", confidence_head_with_markov=False),
                                dict(model_type="dflash", markov_rank=0,
                                     enable_confidence_head=False)])
def test_round_trip_is_exact(target, feats, tmp_path, kw):
    draft = init_draft(target, dict(BASE, **kw), seed=4)
    draft.save(tmp_path / "ck")
    again = load_draft(tmp_path / "ck", target=target)
    assert again.config == draft.config
    a = draft.block_logits(feats, 7, prev_tokens=[7, 8, 9, 10])
    b = again.block_logits(feats, 7, prev_tokens=[7, 8, 9, 10])
    for k in a:
        if a[k] is None:
            assert b[k] is None
        else:
            np.testing.assert_array_equal(a[k], b[k])
    # the files use DeepSpec's names and architectures
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"]
    assert cfg["num_hidden_layers"] == 2 and cfg["block_size"] == 4
    names = set(read_safetensors_dir(tmp_path / "ck"))
    assert {"embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight",
            "lm_head.weight", "layers.1.self_attn.q_norm.weight"} <= names
    if draft.config.has_markov:
        assert "markov_head.markov_w1.weight" in names


def test_loads_a_deepspec_directory_written_by_hand(target, feats, tmp_path):
    """A checkpoint with only DeepSpec's fields (no `dspark_jax` extras) and rope_parameters."""
    draft = init_draft(target, dict(BASE, markov_head_type="gated"), seed=5)
    src = tmp_path / "ours"
    draft.save(src)
    raw = json.loads((src / "config.json").read_text())
    theta = raw.pop("rope_theta")
    raw.pop("rope_scaling", None)
    raw.pop("dspark_jax")
    raw.pop("num_target_layers")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    dst = tmp_path / "deepspec"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = read_safetensors_dir(src)
    # DeepSpec's torch layouts: fc.weight [d, n·d], Markov matrices [V, r]
    assert tensors["fc.weight"].shape == (32, 64)
    assert tensors["markov_head.markov_w2.weight"].shape == (97, 8)
    assert tensors["markov_head.gate_proj.weight"].shape == (8, 32 + 8)
    write_safetensors(dst / "model.safetensors", tensors)
    loaded = load_draft(dst, target=target)
    assert loaded.config.markov_head_type == "gated" and loaded.config.block_size == 4
    np.testing.assert_array_equal(draft.block_logits(feats, 5)["logits"],
                                  loaded.block_logits(feats, 5)["logits"])


def test_mismatched_and_corrupted_checkpoints(target, tmp_path):
    draft = init_draft(target, BASE, seed=0)
    draft.save(tmp_path / "ck")
    other = load_target(save_tiny_hf(tmp_path / "other", "qwen3", head_dim=16, layers=4,
                                     vocab=120))
    with pytest.raises(ConfigError, match="vocab_size"):
        load_draft(tmp_path / "ck", target=other)
    small = load_target(save_tiny_hf(tmp_path / "small", "qwen3", head_dim=16, layers=2))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        load_draft(tmp_path / "ck", target=small)
    # a tensor with the wrong shape
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "ck" / "config.json").read_text())
    t = read_safetensors_dir(tmp_path / "ck")
    t["fc.weight"] = t["fc.weight"][:, :10]
    write_safetensors(bad / "model.safetensors", t)
    with pytest.raises(CheckpointError, match="fc.weight.*shape"):
        load_draft(bad, target=target)
    del t["fc.weight"]
    write_safetensors(bad / "model.safetensors", t)
    with pytest.raises(CheckpointError, match="missing tensor 'fc.weight'"):
        load_draft(bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_draft(bad)
    (bad / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    with pytest.raises(ConfigError, match="not a DeepSpec drafter"):
        load_draft(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        load_draft(bad)


def test_block_never_sees_context_at_or_after_its_anchor(target, feats):
    """Visibility (SPEC §3): context strictly before the anchor; the anchor's own feature and
    everything after it are invisible; the block itself is bidirectional."""
    draft = init_draft(target, dict(BASE, markov_head_type="rnn"), seed=6)
    a = 6
    ref = draft.block_logits(feats, 9, anchor_position=a)["logits"]
    later = feats.copy()
    later[a:] = 50.0 * np.random.RandomState(0).randn(*later[a:].shape)
    np.testing.assert_array_equal(draft.block_logits(later, 9, anchor_position=a)["logits"], ref)
    earlier = feats.copy()
    earlier[a - 1] *= 3.0
    assert np.abs(draft.block_logits(earlier, 9, anchor_position=a)["logits"] - ref).max() > 1e-4
    # bidirectional inside the block: slot 0's base logits depend on what follows it only via
    # mask tokens, so changing the mask token id changes slot 0
    other = init_draft(target, dict(BASE, markov_head_type="rnn", mask_token_id=95), seed=6)
    assert np.abs(other.block_logits(feats, 9, anchor_position=a)["base_logits"][0]
                  - draft.block_logits(feats, 9, anchor_position=a)["base_logits"][0]).max() > 1e-5
