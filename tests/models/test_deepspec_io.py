"""DeepSpec checkpoint interop: exact round trip, loading DeepSpec-named tensors written by hand
(torch layouts), and clear errors for mismatched or corrupted checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.models import init_draft, load_draft, load_target
from dspark_jax.models.config import ConfigError
from dspark_jax.models.io.hf import CheckpointError, read_safetensors_dir, write_safetensors
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
                                     enable_confidence_head=False),
                                dict(draft_vocab_size=48, draft_vocab=tuple(range(0, 96, 2)))])
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
    # the files use DeepSpec's names and architectures (speculators' for a draft vocabulary,
    # which DeepSpec's format cannot hold: tests/models/test_export.py)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    pruned = draft.config.pruned_vocab
    assert cfg["architectures"] == (["DSparkDraftModel"] if pruned else ["Qwen3DSparkModel"])
    assert (cfg["transformer_layer_config"] if pruned else cfg)["num_hidden_layers"] == 2
    assert cfg["block_size"] == 4
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


# ----------------------------------------------------------------------------- DeepSpec's reads
# Read off deepspec/modeling/{dspark,eagle3}/qwen3/{config,modeling}.py, their transformers Qwen3
# building blocks and post_init, and deepspec/eval/*: every config field a constructor or an
# evaluator reads (the conditional ones: DeepSpec asserts them only when the head exists).
QWEN3_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
               "attention_bias", "attention_dropout", "hidden_act", "max_position_embeddings",
               "initializer_range", "layer_types", "tie_word_embeddings")
DSPARK_READS = ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head",
                "markov_rank", "block_size", "num_target_layers")
EAGLE3_READS = ("target_layer_ids", "ttt_length", "step_loss_decay", "draft_num_hidden_layers",
                "num_target_layers")


def _dspark_state_names(n_layers, rank, head, conf):
    layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    names = {f"layers.{i}.{m}.weight" for i in range(n_layers) for m in layer}
    names |= {"embed_tokens.weight", "norm.weight", "fc.weight", "hidden_norm.weight",
              "lm_head.weight"}
    if rank:
        names |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
        proj = {"gated": "gate_proj", "rnn": "joint_proj"}.get(head)
        if proj:
            names |= {f"markov_head.{proj}.weight", f"markov_head.{proj}.bias"}
    if conf:
        names |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return names


@pytest.mark.parametrize("kw", [dict(), dict(markov_head_type="gated"),
                                dict(markov_head_type="rnn", confidence_head_with_markov=False),
                                dict(model_type="dflash", markov_rank=0,
                                     enable_confidence_head=False)])
def test_export_has_every_field_deepspec_reads(target, tmp_path, kw):
    """config.json parses as transformers' Qwen3Config with DeepSpec's fields at the top level
    (DeepSpec's names and values), our extras nested, and exactly DeepSpec's tensor names."""
    from transformers import AutoConfig

    draft = init_draft(target, dict(BASE, num_anchors=24, **kw), seed=1)
    draft.save(tmp_path / "ck")
    c = draft.config
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    hf = AutoConfig.from_pretrained(tmp_path / "ck")
    assert type(hf).__name__ == "Qwen3Config" and hf.architectures == ["Qwen3DSparkModel"]
    for f in QWEN3_SHAPE + DSPARK_READS:
        assert f in raw and hasattr(hf, f), f
    rank = c.markov_rank if c.has_markov else 0
    assert (raw["target_layer_ids"], raw["mask_token_id"], raw["num_anchors"], raw["block_size"],
            raw["markov_rank"], raw["enable_confidence_head"], raw["num_target_layers"],
            raw["num_hidden_layers"]) == ([0, 1], 96, 24, 4, rank, c.has_confidence, 4, 2)
    assert raw["tie_word_embeddings"] is False and hf.layer_types == ["full_attention"] * 2
    assert hf.rope_parameters["rope_theta"] == target.config.rope.theta
    # conditional fields exactly when DeepSpec asserts them
    assert ("markov_head_type" in raw) == (rank > 0)
    if rank:
        assert raw["markov_head_type"] == c.markov_head_type
    assert ("confidence_head_with_markov" in raw) == c.has_confidence
    if c.has_confidence:
        assert raw["confidence_head_with_markov"] == (c.confidence_head_with_markov and rank > 0)
    # ours: nested, and none of DeepSpec's fields duplicated there unless the values differ
    assert raw["dspark_jax"]["model_type"] == c.model_type
    assert "loss_decay_gamma" not in raw and "ce_loss_alpha" in raw["dspark_jax"]
    names = set(read_safetensors_dir(tmp_path / "ck"))
    assert names == _dspark_state_names(2, rank, c.markov_head_type, c.has_confidence)


def test_eagle3_export_has_every_field_deepspec_reads(target, tmp_path):
    from transformers import AutoConfig

    cfg = dict(BASE, model_type="eagle3", ttt_length=5, step_loss_decay=0.7)
    draft = init_draft(target, cfg, seed=2)
    draft.save(tmp_path / "e3")
    raw = json.loads((tmp_path / "e3" / "config.json").read_text())
    hf = AutoConfig.from_pretrained(tmp_path / "e3")
    assert hf.architectures == ["Qwen3Eagle3Model"]
    for f in QWEN3_SHAPE + EAGLE3_READS:
        assert f in raw and hasattr(hf, f), f
    assert (raw["ttt_length"], raw["step_loss_decay"], raw["draft_num_hidden_layers"],
            raw["num_hidden_layers"], raw["tie_word_embeddings"]) == (5, 0.7, 1, 1, False)
    # DSpark-only fields are ours here, nested
    for f in ("block_size", "mask_token_id", "markov_rank", "enable_confidence_head"):
        assert f not in raw
    layer = ["input_layernorm", "post_attention_layernorm", "hidden_norm", "self_attn.q_proj",
             "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
             "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert set(read_safetensors_dir(tmp_path / "e3")) == (
        {f"layers.0.{m}.weight" for m in layer}
        | {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"})
    assert load_draft(tmp_path / "e3", target).config == draft.config


def test_reads_the_eagle3_layouts_deepspec_evaluates(target, tmp_path):
    """eval.py maps Qwen3Eagle3Model and Eagle3DraftModel checkpoints: DeepSpec names with or
    without a `model.` prefix, SpecForge's `midlayer.` names with an identity d2t/t2d; only
    DeepSpec's fields in config.json. Anything else is an error naming the file."""
    draft = init_draft(target, dict(BASE, model_type="eagle3", ttt_length=3), seed=3)
    draft.save(tmp_path / "ours")
    raw = json.loads((tmp_path / "ours" / "config.json").read_text())
    raw.pop("dspark_jax")
    tensors = read_safetensors_dir(tmp_path / "ours")
    V = target.config.vocab_size
    feats = np.random.RandomState(0).randn(1, 6, 2 * 32).astype(np.float32)
    ids = np.arange(3, 9, dtype=np.int32)[None]

    def logits(d):
        m = d.model
        return np.asarray(m.logits(m.ttt_hidden(feats, ids, ttt_length=2)))

    want = logits(draft)
    layouts = {
        "deepspec": (["Qwen3Eagle3Model"], tensors),
        "prefixed": ([EAGLE3], {("model." + k if k != "lm_head.weight" else k): v
                                for k, v in tensors.items()}),
        "specforge": ([EAGLE3], {**{k.replace("layers.0.", "midlayer."): v
                                    for k, v in tensors.items()},
                                 "d2t": np.zeros(V, np.int64), "t2d": np.ones(V, bool)}),
    }
    for name, (arch, t) in layouts.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(raw, architectures=arch)))
        write_safetensors(d / "model.safetensors", t)
        loaded = load_draft(d, target)
        assert loaded.config.model_type == "eagle3" and loaded.config.ttt_length == 3, name
        np.testing.assert_array_equal(logits(loaded), want, err_msg=name)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(raw, architectures=[EAGLE3])))
    write_safetensors(bad / "model.safetensors", dict(tensors, **{"extra.weight": np.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"bad/model.safetensors: unexpected tensors "
                                              r"\['extra.weight'\]"):
        load_draft(bad, target)
    pruned = dict(tensors, d2t=np.zeros(V, np.int64), t2d=np.arange(V) < 50)
    write_safetensors(bad / "model.safetensors", pruned)
    with pytest.raises(CheckpointError, match=r"bad/model.safetensors: t2d marks 50 ids but "
                                              r"lm_head.weight has 97 rows"):
        load_draft(bad, target)


KEEP = tuple(range(1, 97, 3))       # 32 ids, the first not 0: d2t is no identity
E3_PRUNED = dict(BASE, model_type="eagle3", ttt_length=3, draft_vocab_size=len(KEEP),
                 draft_vocab=KEEP)


def _eagle3_outputs(d, feats, ids):
    """(draft-vocabulary logits of the TTT chain, 3 greedy drafts after committing `ids`)."""
    import jax
    import jax.numpy as jnp

    m = d.model
    logits = np.asarray(m.logits(m.ttt_hidden(feats, ids, ttt_length=2)))[..., list(KEEP)]
    cache = m.commit(m.init_cache(1, 16), feats, ids, jnp.asarray([ids.shape[1]]))
    greedy = m.propose(cache, jax.random.key(0), 1.0, 3, lambda k, p: jnp.argmax(p, axis=-1))
    return logits, np.asarray(greedy["tokens"])


def test_pruned_eagle3_round_trips_in_eagle3_layout(target, tmp_path):
    """An Eagle3 drafter with a draft vocabulary exports in EAGLE-3's checkpoint layout (a K-row
    lm_head, d2t with target_id = draft_id + d2t[draft_id], bool t2d, draft_vocab_size) — no
    full-vocabulary fallback — and reads back as the same drafter; so does the layout with only
    EAGLE-3's fields and SpecForge's `midlayer.` names."""
    from flax import nnx

    draft = init_draft(target, E3_PRUNED, seed=6)
    d = tmp_path / "e3"
    draft.save(d)
    raw = json.loads((d / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3Eagle3Model"] and raw["draft_vocab_size"] == len(KEEP)
    assert raw["vocab_size"] == 97 and "export" not in raw["dspark_jax"]
    from safetensors.numpy import load_file

    t = load_file(str(d / "model.safetensors"))        # the file's own dtypes (int64 d2t)
    K, V = len(KEEP), 97
    head = np.asarray(draft.model.lm_head.get_value())
    np.testing.assert_array_equal(t["lm_head.weight"], head[list(KEEP)])
    assert t["d2t"].dtype == np.int64 and t["d2t"].shape == (K,)
    assert all(i + int(t["d2t"][i]) == KEEP[i] for i in range(K))
    assert t["t2d"].dtype == bool and t["t2d"].shape == (V,)
    assert np.flatnonzero(t["t2d"]).tolist() == list(KEEP)
    again = load_draft(d, target)
    assert again.config == draft.config
    flat_a, flat_b = (dict(nnx.traversals.flatten_mapping(nnx.to_pure_dict(x.state)))
                      for x in (draft, again))
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        x, y = np.asarray(flat_a[k]), np.asarray(flat_b[k])
        if k == ("lm_head",):       # the K rows exact; rows of ids never proposed are not stored
            np.testing.assert_array_equal(y[list(KEEP)], x[list(KEEP)])
            assert not np.delete(y, list(KEEP), axis=0).any()
        else:
            np.testing.assert_array_equal(x, y, err_msg=str(k))
    feats = np.random.RandomState(1).randn(1, 6, 2 * 32).astype(np.float32)
    ids = np.asarray([[3, 9, 4, 22, 7, 5]], np.int32)
    want_logits, want_drafts = _eagle3_outputs(draft, feats, ids)
    assert set(want_drafts.ravel().tolist()) <= set(KEEP)
    for name, loaded in (("ours", again), ("eagle3-only", None)):
        if loaded is None:          # what EAGLE-3 / SpecForge write: no dspark_jax fields
            plain = tmp_path / "plain"
            plain.mkdir()
            raw.pop("dspark_jax")
            (plain / "config.json").write_text(json.dumps(dict(raw, architectures=[EAGLE3])))
            write_safetensors(plain / "model.safetensors",
                              {k.replace("layers.0.", "midlayer."): v for k, v in t.items()})
            loaded = load_draft(plain, target)
            assert (loaded.config.draft_vocab, loaded.config.ttt_length) == (KEEP, 3)
        got_logits, got_drafts = _eagle3_outputs(loaded, feats, ids)
        np.testing.assert_array_equal(got_logits, want_logits, err_msg=name)
        np.testing.assert_array_equal(got_drafts, want_drafts, err_msg=name)


def _shift_one(d2t):
    d2t = d2t.copy()
    d2t[5] += 1                     # still increasing ids, but not the ones t2d marks
    return d2t


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: dict(t, d2t=t["d2t"][:-1]), r"d2t has 31 entries but lm_head.weight has 32 rows"),
    (lambda t: dict(t, t2d=t["t2d"][:-1]), r"t2d has shape \[96\]; the target's vocabulary "
                                           r"needs \[97\]"),
    (lambda t: dict(t, t2d=t["t2d"] | (np.arange(97) == 0)),
     r"t2d marks 33 ids but lm_head.weight has 32 rows"),
    (lambda t: dict(t, d2t=_shift_one(t["d2t"])), r"d2t and t2d name different draft"),
    (lambda t: dict(t, d2t=t["d2t"][::-1].copy()), r"d2t does not name increasing target ids"),
    (lambda t: {k: v for k, v in t.items() if k not in ("d2t", "t2d")},
     r"the config gives a 32-id draft vocabulary but the tensors map none"),
], ids=["d2t-shape", "t2d-shape", "t2d-count", "d2t-vs-t2d", "d2t-order", "no-map"])
def test_inconsistent_eagle3_vocabulary_map_names_the_file(target, tmp_path, mutate, msg):
    src, bad = tmp_path / "ok", tmp_path / "bad"
    init_draft(target, E3_PRUNED, seed=7).save(src)
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    write_safetensors(bad / "model.safetensors", mutate(read_safetensors_dir(src)))
    with pytest.raises(CheckpointError, match=f"bad/model.safetensors: {msg}"):
        load_draft(bad, target)


EAGLE3 = "Eagle3DraftModel"


def _torch_dspark_block(cfg_json, t, feats, anchor_tok, anchor_pos, prev):
    """DeepSpec's Qwen3DSparkModel block forward, written from its modeling.py semantics with
    torch Linear/Embedding layouts, straight from the exported state dict (float64): one block
    [x0, M…M] at positions a..a+γ−1 over the context features strictly before a."""
    import torch
    import torch.nn.functional as F

    T = {k: torch.as_tensor(np.asarray(v, np.float64)) for k, v in t.items()}
    eps, D = cfg_json["rms_norm_eps"], cfg_json["hidden_size"]
    N, K, H = (cfg_json["num_attention_heads"], cfg_json["num_key_value_heads"],
               cfg_json["head_dim"])
    g = cfg_json["block_size"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):                                   # x [n, heads, H], rotate-half
        inv = 1.0 / cfg_json["rope_theta"] ** (torch.arange(0, H, 2, dtype=torch.float64) / H)
        ang = torch.as_tensor(pos, dtype=torch.float64)[:, None] * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        x1, x2 = x[..., :H // 2], x[..., H // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    ctx = rms(F.linear(torch.as_tensor(feats[:anchor_pos], dtype=torch.float64), T["fc.weight"]),
              T["hidden_norm.weight"])
    toks = torch.as_tensor([anchor_tok] + [cfg_json["mask_token_id"]] * (g - 1))
    h = F.embedding(toks, T["embed_tokens.weight"])
    bpos = np.arange(anchor_pos, anchor_pos + g)
    kpos = np.concatenate([np.arange(anchor_pos), bpos])
    for i in range(cfg_json["num_hidden_layers"]):
        p = lambda n: T[f"layers.{i}.{n}"]
        x = rms(h, p("input_layernorm.weight"))
        q = rms(F.linear(x, p("self_attn.q_proj.weight")).view(g, N, H), p("self_attn.q_norm.weight"))
        kv_in = torch.cat([ctx, x])
        k = rms(F.linear(kv_in, p("self_attn.k_proj.weight")).view(-1, K, H),
                p("self_attn.k_norm.weight"))
        v = F.linear(kv_in, p("self_attn.v_proj.weight")).view(-1, K, H)
        q, k = rope(q, bpos), rope(k, kpos)
        k, v = k.repeat_interleave(N // K, 1), v.repeat_interleave(N // K, 1)
        att = torch.softmax(torch.einsum("qnh,knh->nqk", q, k) * H ** -0.5, -1)
        o = torch.einsum("nqk,knh->qnh", att, v).reshape(g, N * H)
        h = h + F.linear(o, p("self_attn.o_proj.weight"))
        x = rms(h, p("post_attention_layernorm.weight"))
        h = h + F.linear(F.silu(F.linear(x, p("mlp.gate_proj.weight")))
                         * F.linear(x, p("mlp.up_proj.weight")), p("mlp.down_proj.weight"))
    h = rms(h, T["norm.weight"])
    logits = F.linear(h, T["lm_head.weight"])
    prev_emb = F.embedding(torch.as_tensor(prev), T["markov_head.markov_w1.weight"])
    logits = logits + F.linear(prev_emb, T["markov_head.markov_w2.weight"])   # vanilla Markov
    conf = F.linear(torch.cat([h, prev_emb], -1), T["confidence_head.proj.weight"],
                    T["confidence_head.proj.bias"])[:, 0]
    return logits.numpy(), conf.numpy()


def test_export_gives_deepspec_block_logits(target, feats, tmp_path):
    """The exported tensors, read with DeepSpec's (torch) semantics, give our block logits and
    confidence logits — the layouts of fc, the layers, W1/W2 and the confidence head."""
    draft = init_draft(target, BASE, seed=7)
    m = draft.model
    m.markov.w2.set_value(m.markov.w2.get_value() * 40.0)       # make the Markov bias matter
    draft = type(draft).from_model(m)
    draft.save(tmp_path / "ck")
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    t = read_safetensors_dir(tmp_path / "ck")
    a, prev = 7, [11, 12, 13, 14]
    ours = draft.block_logits(feats, 11, a, prev)
    logits, conf = _torch_dspark_block(raw, t, np.asarray(feats, np.float64), 11, a, prev)
    assert np.abs(ours["logits"] - ours["base_logits"]).max() > 1e-3
    np.testing.assert_allclose(ours["logits"], logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(ours["confidence_logits"], conf, atol=1e-4, rtol=1e-4)


def test_our_safetensors_writer_writes_the_librarys_file(tmp_path):
    """`hf.write_safetensors` (which reports each tensor as it is written) produces the very
    bytes `safetensors.numpy.save_file` does: same layout order, header and alignment."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from dspark_jax.models.io import hf

    tensors = {"b.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
               "a.bias": np.ones(5, np.float16), "c": np.zeros((2, 2), np.int64),
               "m": np.array([True, False]), "z": np.ones(3, ml_dtypes.bfloat16),
               "aa": np.arange(3, dtype=np.float32), "s": np.array(3.0, np.float32)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    seen = []
    hf.write_safetensors(tmp_path / "ours.safetensors", tensors,
                         progress=lambda name, n, total: seen.append(name))
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert sorted(seen) == sorted(tensors)
