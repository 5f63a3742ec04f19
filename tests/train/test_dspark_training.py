"""DSpark/DFlash drafter training: masks, losses vs an independent numpy reference, frozen
parameters, the RNN head's state, sharded step equality and a tiny overfit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import init_draft, load_target
from dspark_jax.models.config import ConfigError
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.sharding import make_mesh
from dspark_jax.train.anchors import sample_anchors
from dspark_jax.train.losses import dspark_loss_sums, metrics_from_sums
from dspark_jax.train.step import (OptimConfig, build_train_step, init_train_state,
                                   make_optimizer, make_schedule, split_draft)
from hf_tiny import save_tiny_hf

DRAFT = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1), mask_token_id=96,
             markov_rank=8, num_anchors=6)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                    layers=4))


def _batch(B=2, S=24, seed=0, prompt=5):
    rng = np.random.RandomState(seed)
    ids = rng.randint(3, 90, (B, S)).astype(np.int32)
    lm = np.ones((B, S), np.int32)
    lm[:, :prompt] = 0
    lm[1, S - 3:] = 0  # right padding in row 1
    return dict(input_ids=ids, loss_mask=lm,
                positions=np.tile(np.arange(S, dtype=np.int32), (B, 1)),
                segment_ids=np.ones((B, S), np.int32))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# a pruned draft vocabulary: 60 of the 97 ids, so many labels of _batch fall outside it
PRUNED = tuple(int(i) for i in np.sort(np.random.RandomState(3).choice(97, 60, replace=False)))


@pytest.mark.parametrize("head,pruned", [("vanilla", False), ("gated", False), ("rnn", False),
                                         ("vanilla", True), ("rnn", True)])
def test_loss_matches_numpy_reference_built_from_block_inference(target, head, pruned):
    """Training (all anchors at once, big masks, chunks) vs inference (one block at a time).
    Pruned: training computes K-column logits; the reference takes inference's full-vocabulary
    draft distribution (zero outside the draft vocabulary), renormalises the target's over the
    draft vocabulary, and gives a label outside it no CE."""
    extra = dict(draft_vocab_size=len(PRUNED), draft_vocab=PRUNED) if pruned else {}
    draft = init_draft(target, dict(DRAFT, markov_head_type=head, **extra), seed=2)
    model = draft.model
    # make the Markov output non-zero so the head matters
    model.markov.w2.set_value(0.3 * jax.random.normal(jax.random.key(5), model.markov.w2.shape))
    draft = type(draft).from_model(model)
    b = _batch()
    feats = target.hidden_states(b["input_ids"], [0, 1])
    hidden = np.asarray(target.model(jnp.asarray(b["input_ids"])).hidden)
    t_logits = target.logits(b["input_ids"])
    key = jax.random.key(7)
    sums = dspark_loss_sums(model, jnp.asarray(feats), jnp.asarray(hidden),
                            jnp.asarray(b["input_ids"]), jnp.asarray(b["loss_mask"]), key,
                            anchor_chunk=4)
    got = {k: np.asarray(v) for k, v in metrics_from_sums(sums, draft.config).items()}

    anchors, valid = map(np.asarray, sample_anchors(key, jnp.asarray(b["loss_mask"]), 6))
    cfg, g = draft.config, 4
    w_k = np.exp(-np.arange(g) / cfg.loss_decay_gamma)
    num = {"ce": 0.0, "l1": 0.0, "conf": 0.0, "abs_err": 0.0, "bias": 0.0, "cum_bias": 0.0}
    W, acc, cnt = 0.0, np.zeros(g), np.zeros(g)
    ids, lm = b["input_ids"], b["loss_mask"]
    S = ids.shape[1]
    sampler = {"valid_anchors_abs": 0.0, "valid_anchors_ratio": 0.0, "sampled_anchors_abs": 0.0,
               "sampled_anchors_ratio": 0.0, "block_supervised_tokens_abs": 0.0,
               "block_supervised_tokens_ratio": 0.0}
    for bi in range(2):
        n_cand = sum(bool(lm[bi, i] and lm[bi, i + 1]) for i in range(S - 1))
        sampled, supervised = int(valid[bi].sum()), 0
        for a, v in zip(anchors[bi], valid[bi]):
            if not v:
                continue
            assert lm[bi, a] and lm[bi, a + 1], "anchor must be a candidate"
            prev = [ids[bi, min(a + k, S - 1)] for k in range(g)]
            out = draft.block_logits(feats[bi], ids[bi, a], a, prev)
            pd = _softmax(out["logits"].astype(np.float64))
            if pruned:
                assert np.abs(np.delete(pd, PRUNED, axis=-1)).max() == 0.0
            m = 1.0
            prefix_c = prefix_t = 1.0
            for k in range(g):
                pos = a + k + 1
                m *= float(pos < S and lm[bi, min(pos, S - 1)] == 1)
                if m == 0:
                    break
                pt = _softmax(t_logits[bi, a + k].astype(np.float64))
                if pruned:
                    pt = np.zeros_like(pt)
                    pt[list(PRUNED)] = _softmax(t_logits[bi, a + k, list(PRUNED)]
                                                .astype(np.float64))
                l1 = np.abs(pd[k] - pt).sum()
                c_star = np.clip(1 - 0.5 * l1, 0, 1)
                c = out["confidence_logits"][k]
                bce = max(c, 0) - c * c_star + np.log1p(np.exp(-abs(c)))
                sig = 1 / (1 + np.exp(-c))
                prefix_c, prefix_t = prefix_c * sig, prefix_t * c_star
                w = w_k[k]
                if not pruned or ids[bi, pos] in PRUNED:
                    num["ce"] += w * -np.log(pd[k, ids[bi, pos]])
                num["l1"] += w * l1
                num["conf"] += w * bce
                # DeepSpec weights the confidence errors with the decayed loss weights
                num["abs_err"] += w * abs(sig - c_star)
                num["bias"] += w * (sig - c_star)
                num["cum_bias"] += w * (prefix_c - prefix_t)
                W += w
                acc[k] += c_star
                cnt[k] += 1
                supervised += 1
        # DeepSpec's anchor-sampler statistics, per sample (row) then averaged over samples
        sampler["valid_anchors_abs"] += n_cand / 2
        sampler["valid_anchors_ratio"] += n_cand / S / 2
        sampler["sampled_anchors_abs"] += sampled / 2
        sampler["sampled_anchors_ratio"] += sampled / 6 / 2
        sampler["block_supervised_tokens_abs"] += supervised / max(sampled, 1) / 2
        sampler["block_supervised_tokens_ratio"] += supervised / max(sampled, 1) / g / 2
    ref_loss = (0.1 * num["ce"] + 0.9 * num["l1"] + 1.0 * num["conf"]) / W
    np.testing.assert_allclose(got["loss"], ref_loss, rtol=2e-5)
    np.testing.assert_allclose(got["ce_loss"], num["ce"] / W, rtol=2e-5)
    np.testing.assert_allclose(got["l1_loss"], num["l1"] / W, rtol=2e-5)
    np.testing.assert_allclose(got["confidence_loss"], num["conf"] / W, rtol=2e-5)
    np.testing.assert_allclose(got["confidence_abs_error"], num["abs_err"] / W, rtol=2e-5)
    np.testing.assert_allclose(got["confidence_bias"], num["bias"] / W, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(got["confidence_cumprod_bias"], num["cum_bias"] / W, rtol=2e-5,
                               atol=1e-7)
    for k, v in sampler.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)
    for k in range(g):
        np.testing.assert_allclose(got[f"accept_rate@{k}"], acc[k] / cnt[k], rtol=2e-5)


def test_padding_blocks_change_nothing(target):
    draft = init_draft(target, DRAFT, seed=0)
    model = draft.model
    b = _batch()
    feats = jnp.asarray(target.hidden_states(b["input_ids"], [0, 1]))
    hidden = target.model(jnp.asarray(b["input_ids"])).hidden
    few = dict(b, loss_mask=b["loss_mask"] * 0)
    few["loss_mask"][:, 8:11] = 1   # only 2 candidates per row < num_anchors → pad blocks
    key = jax.random.key(0)
    s1 = dspark_loss_sums(model, feats, hidden, jnp.asarray(b["input_ids"]),
                          jnp.asarray(few["loss_mask"]), key)
    model2 = init_draft(target, dict(DRAFT, num_anchors=2), seed=0).model
    s2 = dspark_loss_sums(model2, feats, hidden, jnp.asarray(b["input_ids"]),
                          jnp.asarray(few["loss_mask"]), key)
    for k in ("ce", "l1", "conf", "weight"):
        np.testing.assert_allclose(np.asarray(s1[k]), np.asarray(s2[k]), rtol=1e-5)


def test_rnn_head_carries_state(target):
    draft = init_draft(target, dict(DRAFT, markov_head_type="rnn"), seed=3)
    head = draft.model.markov
    h = jax.random.normal(jax.random.key(1), (2, 4, 32))
    prev = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]])
    head.w2.set_value(jax.random.normal(jax.random.key(2), head.w2.shape))
    carried = head.teacher_forced(h, prev)
    # step by step with the state carried must agree with the scan …
    s = head.init_state((2,), h.dtype)
    steps = []
    for k in range(4):
        bias, s = head.step(h[:, k], prev[:, k], s)
        steps.append(bias)
    np.testing.assert_allclose(np.asarray(carried), np.asarray(jnp.stack(steps, 1)), atol=1e-5)
    # … and differ from a stateless head (state reset every slot) after slot 0
    stateless = jnp.stack([head.step(h[:, k], prev[:, k], head.init_state((2,), h.dtype))[0]
                           for k in range(4)], 1)
    np.testing.assert_allclose(np.asarray(carried[:, 0]), np.asarray(stateless[:, 0]), atol=1e-6)
    assert np.abs(np.asarray(carried[:, 1:] - stateless[:, 1:])).max() > 1e-3


def _setup_step(target, mesh, micro=1, draft_kw=None, lr=3e-3, total=100):
    draft = init_draft(target, dict(DRAFT, **(draft_kw or {})), seed=1)
    gd, params, frozen = split_draft(draft.model)
    oc = OptimConfig(lr=lr, total_steps=total)
    tx = make_optimizer(oc)
    state, sh = init_train_state(params, tx, 0, mesh)
    fns = build_train_step(gd, draft.config, tx, make_schedule(oc), target_graphdef=target.graphdef,
                           mesh=mesh, state_sh=sh, frozen=frozen, target_state=target.state,
                           micro_batches=micro)
    return state, frozen, fns


def test_only_trainable_parameters_change(target):
    mesh = make_mesh(devices=jax.devices()[:1])
    state, frozen, fns = _setup_step(target, mesh)
    before = jax.tree.map(np.asarray, state.params)
    b = _batch(B=2)
    for _ in range(3):
        state, metrics = fns.train(state, frozen, target.state, b)
    after = jax.tree.map(np.asarray, state.params)
    changed = jax.tree.map(lambda x, y: bool(np.abs(x - y).max() > 0), before, after)
    assert all(jax.tree.leaves(changed)), changed
    leaves = {"/".join(map(str, p)) for p, _ in
              jax.tree_util.tree_flatten_with_path(state.params)[0]}
    assert not any("embed" in p or "lm_head" in p for p in leaves), "frozen params leaked"
    assert np.isfinite(float(metrics["grad_norm"]))


def test_sharded_step_equals_single_device(target):
    b = _batch(B=4, seed=3)
    one = make_mesh(devices=jax.devices()[:1])
    s1, fr, f1 = _setup_step(target, one, micro=2)
    s1, m1 = f1.train(s1, fr, target.state, b)
    eight = make_mesh(data=2, fsdp=2, tensor=2)
    s8, fr8, f8 = _setup_step(target, eight, micro=2)
    s8, m8 = f8.train(s8, fr8, target.state, b)
    diff = jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()),
                        s1.params, s8.params)
    assert max(jax.tree.leaves(diff)) <= 1e-5
    np.testing.assert_allclose(float(m1["loss"]), float(m8["loss"]), rtol=1e-5)


def _uneven_batch():
    """4 rows whose loss-token counts differ a lot, so the two normalisations disagree."""
    b = _batch(B=4, seed=4)
    b["loss_mask"][0, 9:] = 0
    b["loss_mask"][2, 14:] = 0
    return b


# duplicate coverage of the accumulation path (the default "deepspec" rule has its own fast test)
@pytest.mark.slow
def test_global_normalization_micro_batches_equal_one_big_batch(target):
    """"global": accumulation of sums over 4 micro-batches == one batch (global token means).
    num_anchors ≥ S makes every candidate an anchor, so the draw does not depend on the key."""
    b = _uneven_batch()
    mesh = make_mesh(devices=jax.devices()[:1])
    kw = dict(num_anchors=32, loss_normalization="global")
    s1, fr, f1 = _setup_step(target, mesh, micro=1, draft_kw=kw)
    s2, _, f2 = _setup_step(target, mesh, micro=4, draft_kw=kw)
    s1, m1 = f1.train(s1, fr, target.state, b)
    s2, m2 = f2.train(s2, fr, target.state, b)
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-4)
    diff = jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()),
                        s1.params, s2.params)
    assert max(jax.tree.leaves(diff)) <= 1e-6


def test_deepspec_normalization_is_the_mean_of_micro_batch_losses(target):
    """"deepspec" (default): each micro-step's loss uses its own Σw and is divided by the
    accumulation count — loss and gradient are the means over micro-batches of each
    micro-batch's own token-weighted loss, not one big batch's."""
    from dspark_jax.train.step import make_loss_sums_fn

    b = _uneven_batch()
    mesh = make_mesh(devices=jax.devices()[:1])
    kw = dict(num_anchors=32)
    state, fr, fns = _setup_step(target, mesh, micro=4, draft_kw=kw)
    cfg = init_draft(target, dict(DRAFT, **kw), seed=1).config
    assert cfg.loss_normalization == "deepspec"
    gd = fns.graphdef
    sums_fn = make_loss_sums_fn(gd, cfg, target.graphdef, 64)
    params = jax.tree.map(jnp.copy, state.params)
    key = jax.random.key(0)

    @jax.jit
    def quarter_loss(p, mb):
        def f(p):
            sums = sums_fn(p, fr, target.state, mb, key)
            return sums["objective"] / sums["weight"], sums
        return jax.value_and_grad(f, has_aux=True)(p)

    outs = [quarter_loss(params, {k: v[i:i + 1] for k, v in b.items()}) for i in range(4)]
    losses = [float(o[0][0]) for o in outs]
    grads = [o[1] for o in outs]
    ref_loss = float(np.mean(losses))
    ref_grad = jax.tree.map(lambda *g: sum(g) / 4, *grads)
    import optax

    ref_norm = float(optax.global_norm(ref_grad))
    _, m = fns.train(state, fr, target.state, b)
    np.testing.assert_allclose(float(m["loss"]), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(float(m["grad_norm"]), ref_norm, rtol=1e-4)
    # … which is not what one big batch (the "global" rule) gives on this batch
    big = (sum(float(o[0][1]["objective"]) for o in outs)
           / sum(float(o[0][1]["weight"]) for o in outs))
    assert abs(big - ref_loss) > 1e-3 * ref_loss, (big, ref_loss)


def test_tiny_draft_overfits(tmp_path_factory):
    # a peaked target (large init) so that acceptance is not trivially high
    path = save_tiny_hf(tmp_path_factory.mktemp("peaked"), "qwen3", head_dim=16, layers=4,
                        seed=1)
    tgt = load_target(path)
    model = tgt.model
    model.lm_head.set_value(model.lm_head.get_value() * 20.0)
    tgt = type(tgt).from_model(model)
    mesh = make_mesh(devices=jax.devices()[:1])
    state, frozen, fns = _setup_step(tgt, mesh, draft_kw=dict(num_anchors=16), lr=1e-2,
                                     total=400)
    b = _batch(B=2, S=24, seed=9, prompt=2)
    first = None
    for i in range(400):
        state, m = fns.train(state, frozen, tgt.state, b)
        first = first if first is not None else float(m["accept_rate@0"])
        if float(m["accept_rate@0"]) > 0.9:
            break
    assert first < 0.6, f"target not peaked enough for a meaningful test ({first})"
    assert float(m["accept_rate@0"]) > 0.9, (i, first, float(m["accept_rate@0"]))
    # the same weights read under z-lab's block convention (slot k predicts p+k) are
    # silently useless (SPEC §3): teacher-forced acceptance collapses
    from flax import nnx

    from dspark_jax.train.losses import dspark_loss_sums, metrics_from_sums

    model = nnx.merge(fns.graphdef, state.params, frozen)
    feats_out = tgt.model(jnp.asarray(b["input_ids"]), tap_layer_ids=(0, 1))
    rates = {}
    for conv in ("deepspec", "zlab"):
        model.cfg = model.cfg.replace(block_convention=conv)
        sums = dspark_loss_sums(model, feats_out.taps, feats_out.hidden,
                                jnp.asarray(b["input_ids"]), jnp.asarray(b["loss_mask"]),
                                jax.random.key(0))
        rates[conv] = float(metrics_from_sums(sums, model.cfg)["accept_rate@0"])
    assert rates["deepspec"] > 0.85 and rates["zlab"] < 0.5, rates


def test_config_validation_errors(target):
    base = dict(DRAFT)
    cases = [(dict(block_size=0), "block_size"),
             (dict(target_layer_ids=(1, 0)), "strictly increasing"),
             (dict(target_layer_ids=(0, 3)), "last layer"),
             (dict(target_layer_ids=(0, 9)), "outside"),
             (dict(markov_rank=-1), "markov_rank"),
             (dict(mask_token_id=500), "mask_token_id"),
             (dict(markov_head_type="lstm"), "markov_head_type")]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            DraftConfig(target=target.config, **dict(base, **kw))


def test_online_and_offline_features_give_the_same_loss(target, tmp_path):
    """Online (target inside the step) vs offline (features in the batch: exact when given in
    fp32, within bf16 rounding when read back from the on-disk feature cache)."""
    from dspark_jax.data.features import FeatureCache, write_feature_cache

    draft = init_draft(target, DRAFT, seed=1)
    gd, params, frozen = split_draft(draft.model)
    oc = OptimConfig(total_steps=10)
    tx = make_optimizer(oc)
    mesh = make_mesh(devices=jax.devices()[:1])
    state, sh = init_train_state(params, tx, 0, mesh)
    b = _batch(B=2)
    common = dict(mesh=mesh, state_sh=sh, frozen=frozen, micro_batches=1)
    online = build_train_step(gd, draft.config, tx, make_schedule(oc),
                              target_graphdef=target.graphdef, target_state=target.state,
                              **common)
    offline = build_train_step(gd, draft.config, tx, make_schedule(oc), target_graphdef=None,
                               target_state=None, **common)
    key = jax.random.key(3)
    m_on = online.evaluate(state.params, frozen, target.state, b, key)
    out = target.model(jnp.asarray(b["input_ids"]), tap_layer_ids=(0, 1))
    fb = dict(b, features=np.asarray(out.taps), target_hidden=np.asarray(out.hidden))
    m_off = offline.evaluate(state.params, frozen, None, fb, key)
    np.testing.assert_allclose(float(m_off["loss"]), float(m_on["loss"]), rtol=1e-5)

    records = [dict(input_ids=b["input_ids"][i], loss_mask=b["loss_mask"][i]) for i in range(2)]
    write_feature_cache(target, records, tmp_path / "cache", (0, 1), batch_size=2,
                        progress=False)
    cache = FeatureCache(tmp_path / "cache")
    cb = dict(b, features=np.stack([cache[i]["features"] for i in range(2)]),
              target_hidden=np.stack([cache[i]["target_hidden"] for i in range(2)]))
    m_cache = offline.evaluate(state.params, frozen, None, cb, key)
    np.testing.assert_allclose(float(m_cache["loss"]), float(m_on["loss"]), rtol=2e-2)
