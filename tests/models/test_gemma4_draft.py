"""Gemma4 drafters (DSpark with its sequential + confidence heads, DFlash, Eagle3) as DeepSpec
builds them: DeepSpec's Gemma4 checkpoint layout read and written exactly, and greedy
speculative decoding through the existing engine equal to autoregressive decoding."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding import autoregressive_generate
from dspark_jax.serving import speculative_generate
from dspark_jax.models import init_draft, load_draft, load_target
from dspark_jax.models.config import ConfigError
from dspark_jax.models.io.hf import read_safetensors_dir
from draft_fitting import fit_draft
from hf_tiny import save_tiny_gemma4

# DeepSpec's Gemma4 drafters refuse per-layer inputs: a target with every other feature
TARGET_KW = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                 hidden_size_per_layer_input=0, num_kv_shared_layers=0)
BASE = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1, 2), mask_token_id=4,
            markov_rank=8)
DRAFTS = {
    "dspark": dict(BASE),
    "dflash": dict(BASE, model_type="dflash", markov_rank=0, enable_confidence_head=False),
    "eagle3": dict(block_size=4, target_layer_ids=(0, 1, 2), mask_token_id=4,
                   model_type="eagle3", draft_num_hidden_layers=1, ttt_length=3),
}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_gemma4(tmp_path_factory.mktemp("g4t"), "all_features", seed=2,
                                        **TARGET_KW))


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_gemma4_drafter_round_trips_deepspec_layout(target, kind, tmp_path):
    draft = init_draft(target, DRAFTS[kind], seed=1)
    draft.save(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    n = 1 if kind == "eagle3" else 2
    arch = "Gemma4Eagle3Model" if kind == "eagle3" else "Gemma4DSparkModel"
    assert raw["architectures"] == [arch]
    assert raw["model_type"] == "gemma4_text" and raw["num_hidden_layers"] == n
    assert raw["layer_types"] == ["full_attention"] * n and raw["tie_word_embeddings"] is False
    assert raw["global_head_dim"] == 16 and raw["num_global_key_value_heads"] == 1
    assert raw["attention_k_eq_v"] is True
    assert raw["num_target_layers"] == 4 and raw["target_layer_ids"] == [0, 1, 2]
    if kind == "eagle3":  # DeepSpec's Eagle3 reads no block/Markov/confidence fields
        assert (raw["ttt_length"], raw["step_loss_decay"]) == (3, 0.8)
        assert not {"mask_token_id", "markov_rank", "enable_confidence_head"} & set(raw)
    else:
        assert raw["mask_token_id"] == 4
        assert raw["markov_rank"] == (8 if kind == "dspark" else 0)
        assert raw["enable_confidence_head"] is (kind == "dspark")
    names = set(read_safetensors_dir(tmp_path / "d"))
    layer = {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"}
    want = {f"layers.{i}.{name}.weight" for i in range(n) for name in layer}
    want |= {f"layers.{i}.layer_scalar" for i in range(n)}
    want |= {"embed_tokens.weight", "lm_head.weight", "norm.weight", "fc.weight"}
    want |= ({"layers.0.hidden_norm.weight"} if kind == "eagle3" else {"hidden_norm.weight"})
    if kind == "dspark":
        want |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert names == want  # k=v: no v_proj; the scale-free v_norm has no weight
    back = load_draft(tmp_path / "d", target=target)
    assert back.config == draft.config
    a, b = nnx.to_pure_dict(draft.state), nnx.to_pure_dict(back.state)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", [
    "dspark", pytest.param("eagle3", marks=pytest.mark.slow), pytest.param("dflash", marks=pytest.mark.slow)])  # dflash: dspark's path
def test_gemma4_greedy_speculative_equals_autoregressive(target, kind):
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    draft = init_draft(target, DRAFTS[kind], seed=3)
    res = speculative_generate(target, draft, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    assert res.tokens == ref


def test_gemma4_bad_drafter_checkpoints_name_file_and_field(target, tmp_path):
    """MoE / per-layer-input drafter configs, head shapes other than the target's and tensors
    whose shapes disagree with config.json fail naming the file and the field."""
    from dspark_jax.models.io.hf import CheckpointError, write_safetensors

    src = tmp_path / "d"
    init_draft(target, DRAFTS["dspark"], seed=1).save(src)
    raw = json.loads((src / "config.json").read_text())
    tensors = read_safetensors_dir(src)

    def variant(name, tensors=tensors, **changes):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(raw, **changes)))
        write_safetensors(d / "model.safetensors", tensors)
        return d

    with pytest.raises(ConfigError, match=r"moe.config\.json.*'enable_moe_block'"):
        load_draft(variant("moe", enable_moe_block=True), target=target)
    with pytest.raises(ConfigError, match=r"hd.config\.json.*'global_head_dim'.*16"):
        load_draft(variant("hd", global_head_dim=8), target=target)
    with pytest.raises(ConfigError, match=r"kv.config\.json.*'num_global_key_value_heads'"):
        load_draft(variant("kv", num_global_key_value_heads=2), target=target)
    bad = dict(tensors)
    bad["layers.1.self_attn.q_proj.weight"] = bad["layers.1.self_attn.q_proj.weight"][:-1]
    with pytest.raises(CheckpointError,
                       match=r"shape.*layers\.1\.self_attn\.q_proj\.weight.*'global_head_dim'"):
        load_draft(variant("shape", tensors=bad), target=target)


def test_gemma4_drafter_config_writes_the_k_eq_v_head_count(target):
    """k=v targets whose full layers have as many K/V heads as the sliding ones still write an
    int `num_global_key_value_heads` (DeepSpec's drafters call int() on it)."""
    from dspark_jax.models.drafters.config import DraftConfig
    from dspark_jax.models.gemma4.drafters import deepspec_base_config

    t = target.config.replace(num_global_key_value_heads=None)
    assert t.attention_k_eq_v and t.attn_shape("full_attention")[0] == t.num_key_value_heads
    raw = deepspec_base_config(DraftConfig(target=t, **DRAFTS["dspark"]))
    assert raw["num_global_key_value_heads"] == t.num_key_value_heads == 2


def test_gemma4_targets_with_per_layer_inputs_are_refused(tmp_path):
    ple = load_target(save_tiny_gemma4(tmp_path / "ple", "all_features", **dict(
        TARGET_KW, hidden_size_per_layer_input=4)))
    with pytest.raises(ConfigError, match="hidden_size_per_layer_input"):
        init_draft(ple, DRAFTS["dspark"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_gemma4_trained_draft_is_accepted_and_lossless(target, kind):
    """Training through the existing jitted step on the target's own greedy outputs: drafts
    get accepted (multi-token commits run) and greedy output still equals autoregressive."""
    trained, prompts, _ = fit_draft(target, DRAFTS[kind])
    ref = autoregressive_generate(target, prompts, max_new_tokens=20, stop_token_ids=[])
    res = speculative_generate(target, trained, prompts, max_new_tokens=20, stop_token_ids=[])
    assert res.tokens == ref
    assert res.tau > 1.5, f"trained draft should get drafts accepted (τ={res.tau})"
