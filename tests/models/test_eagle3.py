"""Eagle3 drafter (SPEC §5): TTT geometry, loss vs a naive unrolled reference, frozen params,
cached inference vs full recomputation and vs the TTT training graph, DeepSpec round trip,
and a tiny overfit run."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models import DraftConfig, Target, init_draft, load_draft
from dspark_jax.models.config import DecoderConfig, RopeConfig, rope_inv_freq
from dspark_jax.models.decoder import create_target
from dspark_jax.models.drafters.dspark import FrozenParam
from dspark_jax.models.drafters.eagle3 import (Eagle3Draft, base_positions, ttt_base_mask,
                                      ttt_dense_mask, ttt_diag_valid, ttt_positions)
from dspark_jax.train.eagle3_loss import eagle3_loss

D = 32


@pytest.fixture(scope="module")
def target():
    """A tiny random Qwen3 target (q/k norm, GQA 4/2, head_dim 8) built directly — no torch."""
    cfg = DecoderConfig(family="qwen3", vocab_size=97, hidden_size=D, intermediate_size=64,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, qk_norm=True, rope=RopeConfig(theta=1e6))
    return Target.from_model(create_target(cfg, seed=0))


def _randomize(model: nnx.Module, seed: int) -> nnx.Module:
    """Non-trivial values for every trainable parameter (norms ≠ 1) so a bug cannot hide."""
    rng = np.random.RandomState(seed)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            shape = var.get_value().shape
            is_norm = "norm" in str(path[-1]) or "norm" in str(path)
            val = 1.0 + 0.2 * rng.randn(*shape) if is_norm else 0.25 * rng.randn(*shape)
            var.set_value(jnp.asarray(val, jnp.float32))
    return model


@pytest.fixture(scope="module")
def draft(target):
    d = init_draft(target, DraftConfig(target=target.config, model_type="eagle3", ttt_length=3))
    model = _randomize(d.model, 1)
    # a peakier frozen LM head (the tiny target's is ~N(0, 0.02)) so argmaxes are meaningful
    model.lm_head.set_value(model.lm_head.get_value() * 20.0)
    return model


# ----------------------------------------------------------------------------- naive reference
# float64 numpy (eager jnp would recompile every op for every new sequence length)
def _np(x):
    return np.asarray(x, np.float64)


def _rms(x, w, eps=1e-6):
    return _np(w) * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _rope(x_btnh, pos_bt, cfg):
    inv = np.asarray(rope_inv_freq(cfg.rope, x_btnh.shape[-1]))
    ang = np.asarray(pos_bt)[..., None] * inv                              # [B,T,H/2]
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = np.split(x_btnh, 2, -1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _naive_layer(m, l, emb, h, pos, prev_k, prev_v, mask):
    """One Eagle3 layer, explicit attention over [prev keys ; own keys] with a dense mask."""
    c = m.cfg.target
    lp = {k: _np(v)[l] for k, v in m.layers.stacked(jnp.float32).items()}
    hn = _np(m.hidden_norm.get_value())[l]
    x = np.concatenate([_rms(emb, lp["input_norm"]), _rms(h, hn)], -1)    # [emb ; hidden]
    q = _rms(np.einsum("btd,dnh->btnh", x, lp["wq"]), lp["q_norm"])
    k = _rms(np.einsum("btd,dkh->btkh", x, lp["wk"]), lp["k_norm"])
    v = np.einsum("btd,dkh->btkh", x, lp["wv"])
    q, k = _rope(q, pos, c), _rope(k, pos, c)
    K = np.concatenate(prev_k + [k], 1)
    V = np.concatenate(prev_v + [v], 1)
    rep = c.num_attention_heads // c.num_key_value_heads
    K, V = np.repeat(K, rep, 2), np.repeat(V, rep, 2)
    s = np.einsum("btnh,bsnh->bnts", q, K) / np.sqrt(c.head_dim)
    s = np.where(np.asarray(mask)[:, None], s, -np.inf)
    a = np.einsum("bnts,bsnh->btnh", _softmax(s), V)
    h = h + np.einsum("btnh,nhd->btd", a, lp["wo"])
    y = _rms(h, lp["post_norm"])
    gate = y @ lp["w_gate"]
    h = h + (gate / (1 + np.exp(-gate)) * (y @ lp["w_up"])) @ lp["w_down"]
    return h, k, v


def _naive_logits(m, h):
    return _rms(h, m.norm.get_value()) @ _np(m.lm_head.get_value()).T


def _brute_visible(seg, s, t, j, u):
    return (j == 0 and u <= t and seg[u] == seg[t]) or (1 <= j <= s and u == t)


def _brute_positions(seg):
    return np.asarray([t - min(i for i in range(t + 1) if all(seg[k] == seg[t]
                                                              for k in range(i, t + 1)))
                       for t in range(len(seg))])


def _naive_ttt_loss(m, feats, ids, loss_mask, tgt_hidden, seg):
    """Unrolled TTT: per step, explicit attention over all keys of steps 0..s (brute mask);
    loss under both normalisations and DeepSpec's metrics, position by position."""
    T, Ld = m.cfg.ttt_length, m.cfg.draft_num_hidden_layers
    B, S = ids.shape
    pos0 = np.stack([_brute_positions(r) for r in seg])
    keys = [[] for _ in range(Ld)]
    vals = [[] for _ in range(Ld)]
    h_prev = _np(feats) @ _np(m.fc.get_value())
    seq_len = {(b, k): int(np.sum(seg[b] == k)) for b in range(B) for k in set(seg[b]) if k > 0}
    n_seq = len(seq_len)
    pooled, local, tokens = np.zeros(T), np.zeros(T), np.zeros(T)
    correct, accept, valid = np.zeros((3, T, B, S))
    for s in range(T):
        tok = np.asarray([[ids[b, t + 1 + s] if t + 1 + s < S else 0 for t in range(S)]
                          for b in range(B)])
        emb = _np(m.embed.get_value())[tok]
        mask = np.asarray([[[_brute_visible(seg[b], s, t, j, u) for j in range(s + 1)
                             for u in range(S)] for t in range(S)] for b in range(B)])
        h = h_prev
        for l in range(Ld):
            h, k, v = _naive_layer(m, l, emb, h, pos0 + s, keys[l], vals[l], mask)
            keys[l].append(k)
            vals[l].append(v)
        h_prev = h
        d_logp = np.log(_softmax(_naive_logits(m, h)))
        t_logits = _np(tgt_hidden) @ _np(m.lm_head.get_value()).T
        for b in range(B):
            for t in range(S):
                j = t + 1 + s
                if j >= S or not loss_mask[b, t + s] or seg[b][j] != seg[b][t]:
                    continue
                p = _softmax(t_logits[b, j])
                ce = -(p * d_logp[b, t]).sum()
                pooled[s] += ce
                local[s] += ce / seq_len[(b, seg[b][t])]
                tokens[s] += 1
                valid[s, b, t] = 1
                correct[s, b, t] = float(d_logp[b, t].argmax() == t_logits[b, j].argmax())
                accept[s, b, t] = np.clip(1 - 0.5 * np.abs(np.exp(d_logp[b, t]) - p).sum(), 0, 1)
    decay = m.cfg.step_loss_decay ** np.arange(T)
    start = valid[0] > 0
    chain = lambda x: (1 + np.cumprod(x * valid, axis=0).sum(0))[start].sum() / start.sum()
    return {
        # DeepSpec's local mean: each sequence's masked sum / its length, mean over sequences
        "local_mean": (decay @ local / n_seq, local / n_seq),
        # one valid-token mean with weights 0.8^s · mask
        "pooled": ((decay @ pooled) / (decay @ tokens), pooled / tokens),
        "accuracy": (correct * valid).sum((1, 2)) / tokens,
        "accept_rate": (accept * valid).sum((1, 2)) / tokens,
        "tokens": tokens, "tau_greedy": chain(correct), "tau_probabilistic": chain(accept)}


def _batch(seed, B=2, S=10, nfeat=2):
    rng = np.random.RandomState(seed)
    feats = rng.randn(B, S, nfeat * D).astype(np.float32)
    ids = rng.randint(0, 97, (B, S)).astype(np.int32)
    loss_mask = (rng.rand(B, S) < 0.8).astype(np.int32)
    tgt = rng.randn(B, S, D).astype(np.float32)
    return feats, ids, loss_mask, tgt


# ----------------------------------------------------------------------------- tests
def test_ttt_masks_and_positions_match_brute_force():
    B, S, T = 2, 7, 4
    seg = np.asarray([[1, 1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3, 3]], np.int32)
    base = ttt_base_mask(B, S, jnp.asarray(seg))
    pos0 = base_positions(B, S, jnp.asarray(seg))
    for s in range(T):
        dense = np.asarray(ttt_dense_mask(base, s))
        assert dense.shape == (B, S, (s + 1) * S)
        want = np.asarray([[[_brute_visible(seg[b], s, t, j, u) for j in range(s + 1)
                             for u in range(S)] for t in range(S)] for b in range(B)])
        np.testing.assert_array_equal(dense, want)
        # a query never sees a step-0 key after its own position
        assert not np.any(np.triu(dense[:, :, :S], k=1))
        np.testing.assert_array_equal(np.asarray(ttt_diag_valid(s, T)),
                                      [1 <= j <= s for j in range(1, T)])
        want_pos = np.stack([_brute_positions(r) for r in seg]) + s
        np.testing.assert_array_equal(np.asarray(ttt_positions(pos0, s)), want_pos)
    assert list(np.asarray(pos0[0])) == [0, 1, 2, 0, 1, 2, 0]
    np.testing.assert_array_equal(base_positions(B, S), np.tile(np.arange(S), (B, 1)))


@pytest.mark.parametrize("norm", ["local_mean", "pooled"])
def test_ttt_loss_equals_naive_unrolled_reference(draft, norm):
    """Each normalisation against its own reference (local_mean is DeepSpec's default)."""
    model = nnx.clone(draft)
    model.cfg = model.cfg.replace(eagle3_loss_normalization=norm)
    feats, ids, lmask, tgt = _batch(0)
    seg = np.asarray([[1] * 5 + [2] * 3 + [0] * 2, [1] * 10], np.int32)
    lmask = lmask * (seg > 0)
    fn = jax.jit(lambda f, i, lm, t, sg, pos: eagle3_loss(model, f, i, lm, t, segment_ids=sg,
                                                          positions=pos, chunk_size=3))
    loss, met = fn(feats, ids, lmask, tgt, seg, np.stack([_brute_positions(r) for r in seg]))
    ref = _naive_ttt_loss(model, feats, ids, lmask, tgt, seg)
    ref_loss, ref_steps = ref[norm]
    other = ref["pooled" if norm == "local_mean" else "local_mean"][0]
    assert abs(ref_loss - other) > 1e-3 * abs(ref_loss), "the two rules must differ here"
    assert abs(float(loss) - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    np.testing.assert_allclose(np.asarray(met["step_loss"]), ref_steps, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(met["step_acc"]), ref["accuracy"], atol=1e-6)
    T = model.cfg.ttt_length
    for s in range(T):
        np.testing.assert_allclose(float(met[f"ploss_{s}"]), ref_steps[s], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(float(met[f"accuracy@{s}"]), ref["accuracy"][s], atol=1e-6)
        np.testing.assert_allclose(float(met[f"accept_rate@{s}"]), ref["accept_rate"][s],
                                   rtol=1e-5, atol=1e-6)
        assert float(met[f"valid_tokens@{s}"]) == ref["tokens"][s]
    for k in ("tau_greedy", "tau_probabilistic"):
        np.testing.assert_allclose(float(met[k]), ref[k], rtol=1e-5)
    if norm == "pooled":
        return
    # without packing the same reference holds with a single segment (the row is a sequence)
    seg1 = np.ones_like(seg)
    loss1, _ = fn(feats, ids, lmask, tgt, seg1, np.tile(np.arange(10), (2, 1)))
    loss_none, _ = jax.jit(lambda f, i, lm, t: eagle3_loss(model, f, i, lm, t, chunk_size=4))(
        feats, ids, lmask, tgt)
    ref1 = _naive_ttt_loss(model, feats, ids, lmask, tgt, seg1)["local_mean"][0]
    assert abs(float(loss1) - ref1) <= 1e-5 * max(1.0, ref1)
    assert abs(float(loss_none) - ref1) <= 1e-5 * max(1.0, ref1)
    # replies of 4 and 2 tokens (prompt and padding unsupervised): the per-row compaction
    # computes chunks 0–1 (the longer row's 4 positions) and skips chunks 2–3; same numbers
    lm2 = np.zeros_like(lmask)
    lm2[0, 1:5], lm2[1, 7:9] = 1, 1
    loss2, met2 = fn(feats, ids, lm2, tgt, seg1, np.tile(np.arange(10), (2, 1)))
    ref2 = _naive_ttt_loss(model, feats, ids, lm2, tgt, seg1)
    assert ref2["local_mean"][0] > 0
    assert abs(float(loss2) - ref2["local_mean"][0]) <= 1e-5 * max(1.0, ref2["local_mean"][0])
    for s in range(T):
        np.testing.assert_allclose(float(met2[f"accuracy@{s}"]), ref2["accuracy"][s], atol=1e-6)
        np.testing.assert_allclose(float(met2[f"accept_rate@{s}"]), ref2["accept_rate"][s],
                                   rtol=1e-5, atol=1e-6)
    for k in ("tau_greedy", "tau_probabilistic"):
        np.testing.assert_allclose(float(met2[k]), ref2[k], rtol=1e-5)


def test_gradients_reach_trainable_params_only(target):
    # ttt_length 2 (cheaper to compile); every parameter is on the step-0 path anyway
    cfg = DraftConfig(target=target.config, model_type="eagle3", ttt_length=2)
    model = _randomize(init_draft(target, cfg).model, 3)
    feats, ids, lmask, tgt = _batch(1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    frozen_leaves = jax.tree.leaves(nnx.to_pure_dict(rest))
    assert {type(v) for _, v in nnx.to_flat_state(rest)} == {FrozenParam}
    assert len(frozen_leaves) == 2  # embed, lm_head

    def f(p):
        return eagle3_loss(nnx.merge(graphdef, p, rest), feats, ids, lmask, tgt,
                           chunk_size=4, remat=True)[0]

    val, grads = jax.jit(jax.value_and_grad(f))(params)
    assert np.isfinite(float(val))
    flat = {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(grads)}
    for name in ("fc", "hidden_norm", "norm", "layers/wq", "layers/wk", "layers/wv",
                 "layers/wo", "layers/input_norm", "layers/q_norm", "layers/k_norm",
                 "layers/post_norm", "layers/w_gate", "layers/w_up", "layers/w_down"):
        assert np.all(np.isfinite(flat[name])) and np.abs(flat[name]).max() > 0, name
    assert not any(k.startswith(("embed", "lm_head")) for k in flat)


def test_chunked_loss_and_gradients_equal_the_unchunked_ones(draft):
    """fp32: the position-chunked logits (chunk 3 over S = 10: a padded last chunk) with the
    TTT layers rematerialised (the train step's setting) and the TTT attention in query chunks
    of 4 (padded too; step 0 included) give the loss and parameter gradients of one chunk over
    the whole sequence without remat and with dense attention scores."""
    feats, ids, lmask, tgt = _batch(4)
    seg = np.asarray([[1] * 6 + [2] * 4, [1] * 8 + [0] * 2], np.int32)
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)

    def loss_and_grads(chunk_size, remat, query_chunk=None):
        def f(p):
            return eagle3_loss(nnx.merge(graphdef, p, rest), feats, ids, lmask * (seg > 0), tgt,
                               segment_ids=seg, chunk_size=chunk_size, remat=remat,
                               query_chunk=query_chunk)[0]

        val, g = jax.jit(jax.value_and_grad(f))(params)
        return float(val), {"/".join(map(str, k)): np.asarray(v.get_value())
                            for k, v in nnx.to_flat_state(g)}

    ref_loss, ref_grads = loss_and_grads(10, False)             # one chunk: the whole sequence
    assert np.isfinite(ref_loss) and ref_loss > 0
    loss, grads = loss_and_grads(3, True, query_chunk=4)
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss
    assert grads.keys() == ref_grads.keys()
    for k, g in grads.items():
        assert np.abs(ref_grads[k]).max() > 0, k
        # fp32 summation order differs between the chunkings: an absolute floor of 1e-5 of the
        # tensor's largest gradient (a wrong chunk bound is off by orders of magnitude more)
        np.testing.assert_allclose(g, ref_grads[k], rtol=1e-5,
                                   atol=1e-5 * np.abs(ref_grads[k]).max(), err_msg=k)


def _naive_causal_hidden(m, g_seq, tok_seq):
    """Plain causal recomputation over an explicit sequence of (g, token) pairs at 0..n−1."""
    n = len(tok_seq)
    h = _np(g_seq)[None]
    emb = _np(m.embed.get_value())[np.asarray(tok_seq)][None]
    mask = np.tril(np.ones((n, n), bool))[None]
    for l in range(m.cfg.draft_num_hidden_layers):
        h, _, _ = _naive_layer(m, l, emb, h, np.arange(n)[None], [], [], mask)
    return h[0]


def test_commit_and_propose_equal_naive_recomputation_and_ttt(draft):
    from dspark_jax.decoding.sampling import sample_probs

    rng = np.random.RandomState(2)
    B, gamma, F = 3, 4, draft.cfg.num_features * D
    prompt_len = [6, 3, 5]
    chunks = [(prompt_len, 6), ([2, 0, 3], 3)]          # (counts, padded width) per commit
    pairs = [[] for _ in range(B)]                       # committed (feat, next token)
    commit = jax.jit(draft.commit)
    propose = jax.jit(draft.propose, static_argnums=(3, 4))
    cache = draft.init_cache(B, 32)
    for counts, width in chunks:
        feats = rng.randn(B, width, F).astype(np.float32)
        toks = rng.randint(0, 97, (B, width)).astype(np.int32)
        cache = commit(cache, feats, toks, jnp.asarray(counts))
        for b in range(B):
            pairs[b] += [(feats[b, t], toks[b, t]) for t in range(counts[b])]
    assert list(np.asarray(cache.lengths)) == [len(p) for p in pairs]

    argmax_fn = lambda key, p: jnp.argmax(p, -1).astype(jnp.int32)
    greedy = propose(cache, jax.random.key(0), 0.0, gamma, sample_probs)
    soft = propose(cache, jax.random.key(0), 1.0, gamma, argmax_fn)
    np.testing.assert_array_equal(greedy["tokens"], soft["tokens"])
    assert greedy["probs"].shape == (B, gamma, 97)
    fc = _np(draft.fc.get_value())
    for b in range(B):
        g_seq = [f @ fc for f, _ in pairs[b]]
        tok_seq = [t for _, t in pairs[b]]
        for s in range(gamma):
            h = _naive_causal_hidden(draft, np.stack(g_seq), tok_seq)
            logits = _naive_logits(draft, h[-1])
            d = int(np.argmax(logits))
            assert int(greedy["tokens"][b, s]) == d, (b, s)
            np.testing.assert_allclose(soft["probs"][b, s], _softmax(logits), atol=1e-5)
            assert float(greedy["probs"][b, s, d]) == 1.0
            g_seq.append(h[-1])                       # chain: previous output hidden + draft
            tok_seq.append(d)
    # propose never commits
    again = propose(cache, jax.random.key(0), 0.0, gamma, sample_probs)
    np.testing.assert_array_equal(again["tokens"], greedy["tokens"])

    # the chain is the TTT training graph: chain step s at the last committed position
    # t = n−1 equals TTT step s at t when the sequence continues with the drafts
    n = [len(p) for p in pairs]
    S = max(n) + gamma
    feats = rng.randn(B, S, F).astype(np.float32)
    ids = rng.randint(0, 97, (B, S)).astype(np.int32)
    for b in range(B):
        feats[b, :n[b]] = np.stack([f for f, _ in pairs[b]])
        ids[b, 1:n[b] + 1] = [t for _, t in pairs[b]]
        ids[b, n[b] + 1:n[b] + gamma] = np.asarray(soft["tokens"][b, :gamma - 1])
    hs = jax.jit(lambda f, i: draft.ttt_hidden(f, i, ttt_length=gamma))(feats, ids)
    for b in range(B):
        want = jax.nn.softmax(draft.logits(hs[:, b, n[b] - 1]), -1)       # [γ, V]
        np.testing.assert_allclose(soft["probs"][b], want, atol=1e-5)


def test_deepspec_round_trip(target, tmp_path):
    # canonical Eagle3 fields (the reader sets block_size = ttt_length; no Markov/confidence)
    cfg = DraftConfig(target=target.config, model_type="eagle3", ttt_length=5, block_size=5,
                      markov_rank=0, enable_confidence_head=False, step_loss_decay=0.7)
    d = init_draft(target, cfg, seed=4)
    np.testing.assert_array_equal(d.model.embed.get_value(), target.model.embed.get_value())
    np.testing.assert_array_equal(d.model.lm_head.get_value(), target.model.lm_head_weight())
    m = _randomize(d.model, 5)
    d = type(d).from_model(m)
    d.save(tmp_path / "e3")
    raw = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3Eagle3Model"] and raw["num_hidden_layers"] == 1
    from dspark_jax.models.io.hf import read_safetensors_dir

    tensors = read_safetensors_dir(tmp_path / "e3")
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (4 * 8, 2 * D)
    assert tensors["layers.0.hidden_norm.weight"].shape == (D,)
    assert tensors["fc.weight"].shape == (D, cfg.num_features * D)
    loaded = load_draft(tmp_path / "e3", target)
    assert loaded.config == d.config and isinstance(loaded.model, Eagle3Draft)
    feats, ids, _, _ = _batch(6)
    gd, _ = nnx.split(m)
    fwd = jax.jit(lambda st: (lambda mm: mm.logits(mm.ttt_hidden(feats, ids, ttt_length=2)))(
        nnx.merge(gd, st)))
    a, b = fwd(nnx.state(m)), fwd(loaded.state)
    assert np.abs(np.asarray(a)).max() > 0
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tiny_eagle3_overfits_target_with_the_train_step(target):
    """200 AdamW steps (lr 3e-3) of the project's jitted train step — online target features,
    2 micro-batches accumulated through `eagle3_loss_sums` — reach step-0 accuracy > 0.9."""
    from dspark_jax.sharding import make_mesh
    from dspark_jax.train.step import (OptimConfig, build_train_step, init_train_state,
                                       make_optimizer, make_schedule, split_draft)

    tm = nnx.clone(target.model)
    # peakier target distributions so its argmax is a learnable function
    tm.lm_head.set_value(tm.lm_head.get_value() * 20.0)
    peaked = type(target).from_model(tm)
    cfg = DraftConfig(target=target.config, model_type="eagle3", ttt_length=2)
    gd, params, frozen = split_draft(init_draft(peaked, cfg, seed=0).model)
    oc = OptimConfig(lr=3e-3, total_steps=200, warmup_ratio=0.02)
    tx = make_optimizer(oc)
    mesh = make_mesh(devices=jax.devices()[:1])
    state, sh = init_train_state(params, tx, 0, mesh)
    fns = build_train_step(gd, cfg, tx, make_schedule(oc), target_graphdef=peaked.graphdef,
                           mesh=mesh, state_sh=sh, frozen=frozen, target_state=peaked.state,
                           micro_batches=2)
    ids = np.random.RandomState(7).randint(3, 97, (4, 24)).astype(np.int32)
    batch = dict(input_ids=ids, loss_mask=np.ones_like(ids),
                 positions=np.tile(np.arange(24, dtype=np.int32), (4, 1)),
                 segment_ids=np.ones_like(ids))
    first = None
    for _ in range(200):
        state, met = fns.train(state, frozen, peaked.state, batch)
        first = first or {k: float(v) for k, v in met.items()}
    assert first["accuracy@0"] < 0.2 and first["loss_tokens"] == 4 * 23
    assert float(met["accuracy@0"]) > 0.9, (first, met)
    assert float(met["loss"]) < first["loss"]


def test_pruned_vocabulary_loss_is_the_reference_over_its_rows(draft):
    """A pruned draft vocabulary: draft and target distributions both over its K ids, i.e. the
    naive reference with the LM head cut to those rows; drafting logits mask the other ids."""
    keep = tuple(range(0, 97, 2))
    model = nnx.clone(draft)
    model.cfg = model.cfg.replace(draft_vocab_size=len(keep), draft_vocab=keep)
    feats, ids, lmask, tgt = _batch(0)
    loss, met = jax.jit(lambda f, i, lm, t: eagle3_loss(model, f, i, lm, t, chunk_size=4))(
        feats, ids, lmask, tgt)
    ref_model = nnx.clone(draft)
    ref_model.lm_head.set_value(draft.lm_head.get_value()[np.asarray(keep)])
    ref = _naive_ttt_loss(ref_model, feats, ids, lmask, tgt, np.ones_like(ids))
    full = _naive_ttt_loss(draft, feats, ids, lmask, tgt, np.ones_like(ids))
    assert abs(ref["local_mean"][0] - full["local_mean"][0]) > 1e-3, "pruning must matter here"
    assert abs(float(loss) - ref["local_mean"][0]) <= 1e-5 * max(1.0, ref["local_mean"][0])
    for k in ("tau_greedy", "tau_probabilistic"):
        np.testing.assert_allclose(float(met[k]), ref[k], rtol=1e-5)
    h = jax.random.normal(jax.random.key(0), (5, D))
    probs = np.asarray(jax.nn.softmax(model.logits(h), axis=-1))
    assert probs[:, 1::2].max() == 0.0
    np.testing.assert_allclose(np.asarray(model.logits(h))[:, ::2],
                               np.asarray(draft.logits(h))[:, ::2], rtol=1e-6)
