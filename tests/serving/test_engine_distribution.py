"""Lossless under scheduling, statistically (paper Appendix A; SPEC §1, §8).

Default suite (seconds): in every scheduler mode, the engine's sampled output at T > 0 with
top-k / top-p (two groups of per-request settings in one call) has the target's exact joint
distribution over the first NEW tokens (computed by enumerating prefixes of a tiny vocabulary);
the tokens after the first come from verification rounds. Control: the same test rejects a
subtly broken acceptance rule (the correction drawn from p_t instead of the residual).
Slow: per-position marginals at 20k samples per mode on a sharper target (also the Pallas
sampler), with an accept-every-draft rule as the control. And the Appendix A counterexample:
the global search on current confidences is biased, the causal modes are not."""

from __future__ import annotations

import itertools
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding import acceptance_rule
from dspark_jax.models import init_draft, load_target
from dspark_jax.serving import Engine
from hf_tiny import save_tiny_hf
import scheduler_by_name as scheduler
from tests.decoding.test_acceptance_rule import chi2_stat

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


def _filter_np(logits, top_k, top_p):
    """numpy oracle of a request's top-k / top-p on raw logits [..., V] (→ −inf outside): the k
    largest (ties with the k-th kept), then the smallest prefix of the survivors, by
    probability, whose mass reaches top_p (the token crossing it is kept)."""
    lg = np.asarray(logits, np.float64)
    if 0 < top_k < lg.shape[-1]:
        lg = np.where(lg < np.sort(lg, -1)[..., -top_k:-top_k + 1], -np.inf, lg)
    if top_p < 1.0:
        desc = -np.sort(-lg, -1)
        p = np.exp(desc - desc[..., :1])
        p /= p.sum(-1, keepdims=True)
        keep = np.cumsum(p, -1) - p < top_p
        lg = np.where(lg < np.where(keep, desc, np.inf).min(-1, keepdims=True), -np.inf, lg)
    return lg


def _exact_joint(target, prompt, vocab, n_pos, temperature=1.0, top_k=0, top_p=1.0):
    """P(t_0 … t_{n-1}) [V]·n after `prompt`, by enumerating every prefix (one causal forward
    over all V^(n-1) continuations), under a request's temperature / top-k / top-p."""
    rows = [prompt + list(k) for k in itertools.product(range(vocab), repeat=n_pos - 1)]
    logits_all = target.logits(np.asarray(rows))                     # [V^(n-1), P+n-1, V]
    joint = np.ones(())
    for i in range(n_pos):
        # the prefixes of length i: the rows ending in n-1-i zeros (causal: unseen)
        logits = logits_all[np.arange(vocab ** i) * vocab ** (n_pos - 1 - i), len(prompt) - 1 + i]
        logits = _filter_np(logits, top_k, top_p) / temperature
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        joint = (joint.reshape(-1, 1) * p).reshape((vocab,) * (i + 1))
    return joint


def _exact(target, n_pos, top_k=0, top_p=1.0):
    """P(token at output position i), i < n_pos, under the same filter."""
    joint = _exact_joint(target, PROMPT, V, n_pos, 1.0, top_k, top_p)
    return [joint.sum(axis=tuple(j for j in range(n_pos) if j != i)) for i in range(n_pos)]


def _chi2(counts, probs):
    exp = counts.sum() * probs
    keep = exp > 5
    return float((((counts[keep] - exp[keep]) ** 2) / exp[keep]).sum()), int(keep.sum()) - 1


# "adaptive_skip": adaptive with a drafter that costs more than it could ever gain, probing
# every 2nd round, so rounds alternate plain decoding (drafter not run) and drafting
SKIP_KW = dict(draft_seconds=1e3, probe_interval=2, max_probe_interval=2, explore=None)


def _engine(target, draft, mode, n, gamma, prompt_len, new, verifier="jax", sampler="jax"):
    """One slot per request, one capacity bucket (every slot verifying γ drafts) and an SPS
    that falls with the load, so that algorithm1 / adaptive prune some slots, not all."""
    kw = SKIP_KW if mode == "adaptive_skip" else {}
    mode = "adaptive" if mode == "adaptive_skip" else mode
    top = n * (gamma + 1)
    sps = (1.0 / (1.0 + 0.6 * np.arange(top + 1) / n)).astype(np.float32)  # prunes partly
    return Engine(target, draft, max_requests=n, max_len=prompt_len + new + gamma + 1,
                  scheduler=mode, sps=sps, capacity_buckets=[top], prefill_chunk=n * prompt_len,
                  verifier=verifier, sampler=sampler, stop_token_ids=[], **kw)


def _run(target, draft, mode, n, verifier="jax", top_k=0, top_p=1.0, sampler="jax"):
    eng = _engine(target, draft, mode, n, GAMMA, len(PROMPT), NEW, verifier, sampler)
    res = eng.generate([PROMPT] * n, max_new_tokens=NEW, temperature=1.0, seed=11,
                       top_k=top_k, top_p=top_p)
    return np.asarray(res.tokens), res


def _always_accept(accept_u, sample_u, tp, dp, drafts, ell):
    """A deliberately broken rule: accept every verified draft (the drafts then follow the
    drafter's distribution)."""
    B, g = drafts.shape
    n = ell.astype(jnp.int32)
    bonus = acceptance_rule.inverse_cdf_sample(tp[jnp.arange(B), n], sample_u)
    return acceptance_rule.VerifyResult(n, bonus, jnp.arange(g)[None] < n[:, None])


def _residual_is_target(accept_u, sample_u, tp, dp, drafts, ell):
    """A subtly broken rule: after a rejection the correction is drawn from p_t instead of
    norm(max(p_t − p_d, 0)) (accepts as the true rule)."""
    res = acceptance_rule.rejection_verify_with_uniforms(accept_u, sample_u, tp, dp, drafts, ell)
    n = res.num_accepted
    redraw = acceptance_rule.inverse_cdf_sample(tp[jnp.arange(drafts.shape[0]), n], sample_u)
    return res._replace(next_token=jnp.where(n < ell, redraw, res.next_token))


BROKEN_RULES = {"always_accept": _always_accept, "residual_is_target": _residual_is_target}


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


# ------------------------------------------------------------------ default suite: every mode
FV = 6            # vocabulary: the joint of the first FNEW tokens is enumerated exactly
FG = 2            # γ
FNEW = 4          # t_0 comes from the prefill, t_1 … t_3 from verification rounds
FN = 4096         # requests in one generate call, one slot each (one batch, compiled once)
FPROMPT = [1, 4, 2]
# per-request (temperature, top_k, top_p), alternating over the requests: top-k and top-p
# together, and top-p alone at another temperature
GROUPS = ((1.0, 3, 0.75), (0.7, 0, 0.6))
FAST_MODES = (*scheduler.MODES, "adaptive_skip")
ALPHA = 1e-4      # a true distribution fails one check with probability 1e-4
# the control: the subtle broken rule (always_accept, gross, is the slow test's control; it
# fails here by orders of magnitude too, but costs another compile of the verification)
FAST_BROKEN = ("residual_is_target",)


def chi2_isf(df: int, alpha: float = ALPHA) -> float:
    """The (1 − alpha) quantile of χ²(df), Wilson–Hilferty: at 1e-4 it overshoots scipy's by
    < 4 % (df 3) and < 1 % (df ≥ 12), so a check is if anything conservative; no scipy."""
    z, h = statistics.NormalDist().inv_cdf(1 - alpha), 2.0 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def joint_chi2(toks: np.ndarray, joint: np.ndarray) -> tuple[float, int, int]:
    """Pearson χ² of the rows of toks [N, n] against the joint distribution [V]·n: cells
    expecting < 5 are pooled into one (itself merged into the likeliest cell when the pool
    expects < 5). → (statistic, degrees of freedom, rows outside the support)."""
    p = joint.ravel()
    cell = np.ravel_multi_index(tuple(toks.T), joint.shape)
    outside = int((p[cell] == 0).sum())
    n = len(toks) - outside
    big = np.nonzero(p * n >= 5)[0]
    small = (p > 0) & (p * n < 5)
    idx = np.full(p.size, -1)
    idx[big] = np.arange(big.size)
    idx[small] = big.size if p[small].sum() * n >= 5 else idx[np.argmax(p)]
    probs = np.bincount(idx[p > 0], weights=p[p > 0])
    mapped = idx[cell]
    stat, df = chi2_stat(mapped[mapped >= 0], probs)
    return stat, df, outside


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 1-layer target over 6 tokens whose p_t depends on the context (neither flat nor
    one-hot) and a drafter whose p_d differs from it (both accepts and rejects)."""
    t = load_target(save_tiny_hf(tmp_path_factory.mktemp("tiny"), "llama", vocab=FV, layers=1,
                                 seed=5))
    model = t.model
    model.lm_head.set_value(model.lm_head.get_value() * 5.0)
    t = type(t).from_model(model)
    d = init_draft(t, dict(block_size=FG, num_draft_layers=1, target_layer_ids=(-1,),
                           mask_token_id=FV - 1, markov_rank=4), seed=7)
    dm = d.model   # init_draft copies the target's head: sharpen the drafter's own
    dm.lm_head.set_value(dm.lm_head.get_value() * 3.0)
    exact = [_exact_joint(t, FPROMPT, FV, FNEW, *g) for g in GROUPS]
    return t, type(d).from_model(dm), exact


def _sample_groups(target, draft, mode, verifier="jax"):
    eng = _engine(target, draft, mode, FN, FG, len(FPROMPT), FNEW, verifier)
    temps, ks, ps = zip(*(GROUPS[i % len(GROUPS)] for i in range(FN)))
    res = eng.generate([FPROMPT] * FN, max_new_tokens=FNEW, temperature=list(temps),
                       top_k=list(ks), top_p=list(ps), seed=11)
    toks = np.asarray(res.tokens)
    assert toks.shape == (FN, FNEW)
    return [toks[g::len(GROUPS)] for g in range(len(GROUPS))], res


@pytest.mark.parametrize("mode", FAST_MODES)
def test_every_mode_samples_the_target_with_top_k_top_p(tiny, monkeypatch, mode):
    """The joint of the first 4 tokens of 2048 requests per sampling group matches the exact
    target distribution (χ² at α = 1e-4, nothing outside the top-k / top-p support); with a
    broken acceptance rule the same check fails (every mode that drafts)."""
    target, draft, exact = tiny
    groups, res = _sample_groups(target, draft, mode)
    ver = np.mean([v for r in res.per_request for v in r["proposed"]])
    acc = np.mean([a for r in res.per_request for a in r["accepted"]])
    if mode != "none":   # the tested tokens went through the rule: both accepts and rejects
        assert 0 < acc < ver, (acc, ver)
    if mode in ("algorithm1", "adaptive", "adaptive_skip"):
        assert ver < FG, "the scheduler should prune some slots"
    if mode == "adaptive_skip":
        assert {r["drafted"] for r in res.rounds} == {True, False}, res.rounds
    for toks, joint in zip(groups, exact):
        stat, df, outside = joint_chi2(toks, joint)
        assert outside == 0, f"{outside} requests emitted a token outside top-k / top-p"
        assert stat < chi2_isf(df), (mode, stat, df, chi2_isf(df))
    if mode == "none":   # nothing is drafted: no acceptance rule to break
        return
    for name in FAST_BROKEN:
        monkeypatch.setitem(acceptance_rule.VERIFIERS, name, BROKEN_RULES[name])
        bad, _ = _sample_groups(target, draft, mode, verifier=name)
        checks = [joint_chi2(toks, joint) for toks, joint in zip(bad, exact)]
        assert any(o > 0 or s > chi2_isf(df) for s, df, o in checks), (name, checks)


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


def _sample_tree_groups(target, draft, mode="fixed"):
    n, budget = FN, 4
    top = n * (budget + 1)
    sps = (1.0 / (1.0 + 0.6 * np.arange(top + 1) / n)).astype(np.float32)  # prunes partly
    eng = Engine(target, draft, max_requests=n, max_len=len(FPROMPT) + FNEW + FG + 1,
                 scheduler=mode, sps=sps, capacity_buckets=[top],
                 prefill_chunk=n * len(FPROMPT), stop_token_ids=[], tree_budget=budget,
                 tree_branching=3)
    temps, ks, ps = zip(*(GROUPS[i % len(GROUPS)] for i in range(n)))
    res = eng.generate([FPROMPT] * n, max_new_tokens=FNEW, temperature=list(temps),
                       top_k=list(ks), top_p=list(ps), seed=11)
    toks = np.asarray(res.tokens)
    return [toks[g::len(GROUPS)] for g in range(len(GROUPS))], res


@pytest.mark.parametrize("mode", ["fixed", "algorithm1", "production", "adaptive"])
def test_trees_sample_the_target_with_top_k_top_p(tiny, monkeypatch, mode):
    """Draft trees (4 nodes, up to 3 children a node, γ 2) verified by recursive rejection
    sampling, every node admitted (`fixed`) or a prefix by the nodes' survival estimates: the
    joint of the first 4 tokens matches the target's in both sampling groups; a rule that draws
    the correction from p instead of the residual fails the same check."""
    from dspark_jax.decoding import tree_acceptance, tree_verification

    target, draft, exact = tiny
    groups, res = _sample_tree_groups(target, draft, mode)
    acc = np.mean([a for r in res.per_request for a in r["accepted"]])
    assert 0 < acc < FG, acc
    if mode != "fixed":
        ver = np.mean([v for r in res.per_request for v in r["proposed"]])
        assert ver < FG, "the scheduler should cut some trees short"
    for toks, joint in zip(groups, exact):
        stat, df, outside = joint_chi2(toks, joint)
        assert outside == 0, f"{outside} requests emitted a token outside top-k / top-p"
        assert stat < chi2_isf(df), (stat, df, chi2_isf(df))
    if mode != "fixed":   # one control is enough
        return
    true_rule = tree_acceptance.tree_rejection_verify_with_uniforms

    def residual_is_target(accept_u, sample_u, tp, dp, tokens, children, num_nodes,
                           target_cells):
        """After every child of a node is rejected, the correction is drawn from p there
        instead of the residual (tp: verification's rows, `target_cells` each cell's)."""
        res = true_rule(accept_u, sample_u, tp, dp, tokens, children, num_nodes,
                        target_cells=target_cells)
        rows = jnp.arange(tokens.shape[0])
        kids = children[rows, res.last_cell]
        rejected = jnp.any((kids >= 1) & (kids <= num_nodes[:, None]), axis=1)
        redraw = acceptance_rule.inverse_cdf_sample(tp[target_cells[rows, res.last_cell]],
                                                    sample_u)
        return res._replace(next_token=jnp.where(rejected, redraw, res.next_token))

    monkeypatch.setattr(tree_verification, "tree_rejection_verify_with_uniforms",
                        residual_is_target)
    jax.clear_caches()   # the rounds compiled with the true rule would be reused
    try:
        bad, _ = _sample_tree_groups(target, draft)
    finally:
        jax.clear_caches()   # and no later test may reuse the broken ones
    checks = [joint_chi2(toks, joint) for toks, joint in zip(bad, exact)]
    assert any(o > 0 or s > chi2_isf(df) for s, df, o in checks), checks
