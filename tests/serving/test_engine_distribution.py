"""Lossless under scheduling, statistically (paper Appendix A; SPEC §1, §8): at T = 1 the engine's
output under `algorithm1` / `adaptive` (and with top-k / top-p) is distributed as the target's
(a broken acceptance rule fails the same test), and the Appendix A counterexample: the global
search on current confidences is biased, the causal modes are not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding import acceptance_rule, scheduler
from dspark_jax.decoding.sampling import filter_logits
from dspark_jax.models import init_draft, load_target
from dspark_jax.serving import Engine
from hf_tiny import save_tiny_hf

V = 8
N = 20000
PROMPT = [1, 4, 2]
NEW = 4
GAMMA = 3
# 0.9999 quantiles of chi-square (df 1..7): a true distribution fails with p < 1e-4
CHI2_Q9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    t = load_target(save_tiny_hf(tmp_path_factory.mktemp("small"), "llama", vocab=V, layers=3,
                                 seed=5))
    model = t.model
    model.embed.set_value(model.embed.get_value() * 30.0)   # sharper, context-dependent p_t
    t = type(t).from_model(model)
    d = init_draft(t, dict(block_size=GAMMA, num_draft_layers=1, target_layer_ids=(0, 1),
                           mask_token_id=V - 1, markov_rank=8), seed=7)
    dm = d.model   # a sharper, different draft distribution: a broken rule shows clearly
    dm.lm_head.set_value(dm.lm_head.get_value() * 4.0)
    return t, type(d).from_model(dm)


def _exact(target, n_pos, top_k=0, top_p=1.0):
    """P(token at output position i) by enumerating all prefixes, under the same filter."""
    dists, prefix = [], {(): 1.0}
    for _ in range(n_pos):
        keys = list(prefix)
        logits = target.logits(np.asarray([PROMPT + list(k) for k in keys]))[:, -1]
        logits = np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p), np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        marg, nxt = np.zeros(V), {}
        for k, row in zip(keys, p):
            marg += prefix[k] * row
            for v in range(V):
                nxt[k + (v,)] = prefix[k] * row[v]
        dists.append(marg)
        prefix = nxt
    return dists


def _chi2(counts, probs):
    exp = counts.sum() * probs
    keep = exp > 5
    return float((((counts[keep] - exp[keep]) ** 2) / exp[keep]).sum()), int(keep.sum()) - 1


# "adaptive_skip": adaptive with a drafter that costs more than it could ever gain, probing
# every 2nd round, so rounds alternate plain decoding (drafter not run) and drafting
SKIP_KW = dict(draft_seconds=1e3, probe_interval=2, max_probe_interval=2, explore=None)


def _run(target, draft, mode, n, verifier="jax", top_k=0, top_p=1.0, sampler="jax"):
    kw = SKIP_KW if mode == "adaptive_skip" else {}
    mode = "adaptive" if mode == "adaptive_skip" else mode
    R = n
    top = R * (GAMMA + 1)
    sps = (1.0 / (1.0 + 0.6 * np.arange(top + 1) / R)).astype(np.float32)  # prunes partly
    eng = Engine(target, draft, max_requests=R, max_len=12, scheduler=mode, sps=sps,
                 capacity_buckets=[top], prefill_chunk=R * len(PROMPT), verifier=verifier,
                 sampler=sampler, stop_token_ids=[], **kw)
    res = eng.generate([PROMPT] * n, max_new_tokens=NEW, temperature=1.0, seed=11,
                       top_k=top_k, top_p=top_p)
    return np.asarray(res.tokens), res


def _always_accept(accept_u, sample_u, tp, dp, drafts, ell):
    """A deliberately broken rule: accept every verified draft."""
    B, g = drafts.shape
    n = ell.astype(jnp.int32)
    from dspark_jax.decoding.acceptance_rule import VerifyResult, inverse_cdf_sample

    bonus = inverse_cdf_sample(tp[jnp.arange(B), n], sample_u)
    return VerifyResult(n, bonus, jnp.arange(g)[None] < n[:, None])


@pytest.mark.slow
@pytest.mark.parametrize("mode,top_k,top_p,sampler", [
    ("algorithm1", 0, 1.0, "jax"), ("adaptive", 0, 1.0, "jax"), ("adaptive", 4, 0.9, "jax"),
    ("adaptive", 0, 1.0, "pallas"), ("adaptive", 4, 0.9, "pallas"),
    ("adaptive_skip", 0, 1.0, "jax")])
def test_sampled_output_matches_target(small, monkeypatch, mode, top_k, top_p, sampler):
    """sampler="pallas": the Markov-head kernel drafts (it ignores top-k/top-p: still lossless)."""
    target, draft = small
    exact = _exact(target, NEW, top_k, top_p)
    toks, res = _run(target, draft, mode, N, top_k=top_k, top_p=top_p, sampler=sampler)
    assert toks.shape == (N, NEW)
    ver = [v for r in res.per_request for v in r["proposed"]]
    acc = [a for r in res.per_request for a in r["accepted"]]
    assert 0 < np.mean(ver) < GAMMA, "the scheduler should prune some slots, not all"
    assert 0 < np.mean(acc) < np.mean(ver), "need both accepts and rejects"
    if mode == "adaptive_skip":
        skipped = [r for r in res.rounds if not r["drafted"]]
        assert skipped and sum(r["tokens"] for r in skipped) > N // 10, res.rounds
    for i in range(NEW):
        counts = np.bincount(toks[:, i], minlength=V)
        stat, df = _chi2(counts, exact[i])
        assert stat < CHI2_Q9999[df], (i, stat, df)
        assert counts[exact[i] == 0].sum() == 0, "a filtered-out token was emitted"
    if top_k or sampler != "jax" or mode == "adaptive_skip":
        return
    monkeypatch.setitem(acceptance_rule.VERIFIERS, "always_accept", _always_accept)
    bad, _ = _run(target, draft, mode, N, verifier="always_accept")
    stats = [_chi2(np.bincount(bad[:, i], minlength=V), exact[i]) for i in range(1, NEW)]
    assert any(s > 3 * CHI2_Q9999[df] for s, df in stats), stats


def test_appendix_a_counterexample():
    """SPEC §8: R = 1, γ = 2, a1 = 0.8, SPS = (1, .5, .45) at B = 1..3, p_t = (.7, .3),
    p_d = (.5, .5); c2 = .9 if x1 = A else 0. The engine's schedule + verification, 200k
    independent rounds: a global search on current confidences emits A with probability .85;
    algorithm1 and adaptive (capacity from an independent stale round) keep .7."""
    n = 200_000
    sps = jnp.asarray([0.0, 1.0, 0.5, 0.45], jnp.float32)
    k = jax.random.split(jax.random.key(0), 4)
    x1 = (jax.random.uniform(k[0], (n,)) >= 0.5).astype(jnp.int32)          # 0 = A, 1 = B
    x1_stale = (jax.random.uniform(k[1], (n,)) >= 0.5).astype(jnp.int32)
    conf = lambda x: jnp.stack([jnp.full(x.shape, 0.8), jnp.where(x == 0, 0.9, 0.0)], -1)  # noqa
    c, c_stale = conf(x1), conf(x1_stale)
    active = jnp.ones((1,), bool)

    def lengths(mode, c_r, cs_r):
        if mode == "global":
            return scheduler.schedule_verification(c_r[None], active, sps,
                                                   early_stop=False).lengths[0]
        cap = scheduler.schedule_lengths("adaptive", cs_r[None], active, 2, 0.5, sps,
                                         jnp.zeros((), jnp.int32))[1]
        return scheduler.schedule_lengths(mode, c_r[None], active, 2, 0.5, sps, cap)[0][0]

    tp = jnp.broadcast_to(jnp.asarray([0.7, 0.3]), (n, 3, 2))
    dp = jnp.full((n, 2, 2), 0.5)
    drafts = jnp.stack([x1, jnp.zeros_like(x1)], -1)
    acc_u = jax.random.uniform(k[2], (n, 2))
    smp_u = jax.random.uniform(k[3], (n,))
    p_a = {}
    for mode in ("global", "algorithm1", "adaptive"):
        ell = jax.jit(jax.vmap(lambda a, b, m=mode: lengths(m, a, b)))(c, c_stale)
        res = acceptance_rule.VERIFIERS["jax"](acc_u, smp_u, tp, dp, drafts, ell)
        first = jnp.where(res.num_accepted > 0, x1, res.next_token)
        p_a[mode] = float(jnp.mean(first == 0))
    tol = 6 * np.sqrt(0.7 * 0.3 / n)
    assert abs(p_a["global"] - 0.85) < tol, p_a        # detectably biased
    assert abs(p_a["algorithm1"] - 0.7) < tol, p_a
    assert abs(p_a["adaptive"] - 0.7) < tol, p_a
