"""Target decoder: Hugging Face parity, KV-cache semantics, ragged batches, sharding, export."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspark_jax.models import ConfigError, load_target
from dspark_jax.models.decoder import init_cache
from dspark_jax.models.io.hf import CheckpointError, export_hf_target
from hf_tiny import load_hf, save_tiny_hf

VARIANTS = {
    "qwen3_untied_hd16": ("qwen3", dict(head_dim=16)),       # head_dim ≠ hidden/heads (=8)
    "qwen3_tied": ("qwen3", dict(tie=True)),
    "llama_tied": ("llama", dict(tie=True)),
    "llama3_rope": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 16})),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, pathlib.Path]:
    out = {}
    for name, (fam, kw) in VARIANTS.items():
        out[name] = save_tiny_hf(tmp_path_factory.mktemp(name), fam, **kw)
    return out


def _ids(b: int, s: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 97, (b, s)).astype(np.int32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_taps_match_transformers(ckpts, variant):
    path = ckpts[variant]
    hf = load_hf(path)
    target = load_target(path)
    ids = _ids(2, 40)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long), output_hidden_states=True)
    logits = target.logits(ids)
    assert logits.dtype == np.float32 and logits.shape == (2, 40, 97)
    assert np.abs(logits - ref.logits.numpy()).max() <= 1e-4
    layer_ids = [-1, 0, 1]  # HF reports the LAST layer after the final norm: not a tap
    taps = target.hidden_states(ids, layer_ids)
    want = np.concatenate([ref.hidden_states[i + 1].numpy() for i in layer_ids], axis=-1)
    assert taps.shape == (2, 40, 3 * 32)
    assert np.abs(taps - want).max() <= 1e-4


def test_incremental_kv_decoding_equals_full_forward(ckpts):
    target = load_target(ckpts["qwen3_untied_hd16"])
    model = target.model
    ids = jnp.asarray(_ids(1, 24, seed=3))
    full = model.logits(model(ids).hidden)
    cache = init_cache(model.cfg, 1, 64)
    # prefill 10, then chunks of 1, 5 and 8 tokens
    pieces, start = [10, 1, 5, 8], 0
    got = []
    for n in pieces:
        out = model(ids[:, start:start + n], cache=cache, advance=jnp.asarray([n]))
        cache = out.cache
        got.append(model.logits(out.hidden))
        start += n
    got = jnp.concatenate(got, axis=1)
    assert np.abs(np.asarray(got - full)).max() <= 1e-4
    assert int(cache.lengths[0]) == 24


def test_rollback_is_moving_the_length(ckpts):
    target = load_target(ckpts["qwen3_tied"])
    model = target.model
    ids = jnp.asarray(_ids(1, 12, seed=4))
    cache = model(ids[:, :8], cache=init_cache(model.cfg, 1, 32), advance=jnp.asarray([8])).cache
    # speculate 4 wrong tokens, then roll back 3 of them and feed the true continuation
    wrong = jnp.asarray([[1, 2, 3, 4]])
    spec = model(wrong, cache=cache, advance=jnp.asarray([4])).cache
    rolled = spec.with_lengths(spec.lengths - 4)
    a = model(ids[:, 8:12], cache=rolled).hidden
    b = model(ids[:, 8:12], cache=cache).hidden
    assert np.abs(np.asarray(a - b)).max() <= 1e-5


def test_ragged_batch_equals_per_sequence_runs(ckpts):
    target = load_target(ckpts["llama3_rope"])
    model = target.model
    seqs = [_ids(1, n, seed=n)[0] for n in (5, 13, 9)]
    B, P = len(seqs), 16
    toks = np.zeros((B, P), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    lens = jnp.asarray([len(s) for s in seqs])
    cache = init_cache(model.cfg, B, 48)
    out = model(jnp.asarray(toks), cache=cache)
    cache = out.cache.with_lengths(lens)
    # one extension step of 3 tokens at ragged positions
    ext = _ids(B, 3, seed=11)
    out2 = model(jnp.asarray(ext), cache=cache, advance=jnp.full((B,), 3))
    for i, s in enumerate(seqs):
        full = np.concatenate([s, ext[i]])[None]
        ref = target.logits(full)[0]
        got_prefill = np.asarray(model.logits(out.hidden[i, :len(s)]))
        got_ext = np.asarray(model.logits(out2.hidden[i]))
        assert np.abs(got_prefill - ref[:len(s)]).max() <= 1e-4
        assert np.abs(got_ext - ref[len(s):]).max() <= 1e-4


def test_sharded_forward_equals_unsharded(ckpts):
    from dspark_jax.sharding import make_mesh, use_mesh

    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    path = ckpts["qwen3_untied_hd16"]
    ref = load_target(path).logits(_ids(4, 16))
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    target = load_target(path, mesh=mesh)
    wq = target.state["layers"]["wq"].get_value()
    assert len(wq.sharding.device_set) > 1, "parameters should be spread over the mesh"
    with use_mesh(mesh):
        ids = jax.device_put(jnp.asarray(_ids(4, 16)),
                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
        model = target.model
        got = jax.jit(lambda i: model.logits(model(i).hidden))(ids)
    assert np.abs(np.asarray(got) - ref).max() <= 1e-5


def test_greedy_generate_equals_argmax_loop(ckpts):
    from dspark_jax.decoding import autoregressive_generate

    target = load_target(ckpts["qwen3_untied_hd16"])
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]
    out = autoregressive_generate(target, prompts, max_new_tokens=10, stop_token_ids=[])
    for p, o in zip(prompts, out):
        seq, ref = list(p), []
        for _ in range(10):
            nxt = int(np.argmax(target.logits(np.asarray([seq]))[0, -1]))
            ref.append(nxt)
            seq.append(nxt)
        assert o == ref


def test_generate_stops_and_samples_reproducibly(ckpts):
    from dspark_jax.decoding import autoregressive_generate

    target = load_target(ckpts["llama_tied"])
    prompts = [[5, 6, 7], [8, 9]]
    greedy = autoregressive_generate(target, prompts, max_new_tokens=8, stop_token_ids=[])
    stop = greedy[0][2]
    cut = autoregressive_generate(target, prompts, max_new_tokens=8, stop_token_ids=[stop])
    assert cut[0] == greedy[0][:greedy[0].index(stop) + 1]
    a = autoregressive_generate(target, prompts, max_new_tokens=8, temperature=1.0, seed=3)
    b = autoregressive_generate(target, prompts, max_new_tokens=8, temperature=1.0, seed=3)
    c = autoregressive_generate(target, prompts, max_new_tokens=8, temperature=1.0, seed=4,
                                stop_token_ids=[])
    assert a == b and a != c


def test_export_round_trip_loads_in_transformers(ckpts, tmp_path):
    target = load_target(ckpts["qwen3_untied_hd16"])
    out = export_hf_target(target.model, tmp_path / "export")
    hf = load_hf(out)
    ids = _ids(1, 9)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(ref - target.logits(ids)).max() <= 1e-4


def test_sharded_safetensors_index_loads(ckpts, tmp_path):
    hf = load_hf(ckpts["qwen3_untied_hd16"])
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ids = _ids(1, 7)
    ref = load_target(ckpts["qwen3_untied_hd16"]).logits(ids)
    np.testing.assert_array_equal(load_target(tmp_path / "sharded").logits(ids), ref)


def test_bf16_forward_is_close(ckpts):
    path = ckpts["qwen3_tied"]
    ref = load_target(path).logits(_ids(1, 12))
    got = load_target(path, dtype="bfloat16").logits(_ids(1, 12))
    assert np.abs(got - ref).max() < 0.1


def test_bad_inputs_name_the_problem(ckpts, tmp_path):
    with pytest.raises(ValueError, match="unknown target 'no-such-model'"):
        load_target("no-such-model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_target(empty)
    # unsupported architecture
    bad = tmp_path / "bad_arch"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unsupported architecture"):
        load_target(bad)
    # config that disagrees with the weights
    src = ckpts["llama_tied"]
    mism = tmp_path / "mismatch"
    mism.mkdir()
    (mism / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (mism / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight.*shape"):
        load_target(mism)
    # a corrupted safetensors file
    (mism / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_target(mism)
    # token ids out of range
    target = load_target(src)
    with pytest.raises(ValueError, match="vocabulary"):
        target.logits(np.asarray([[1, 500]]))
