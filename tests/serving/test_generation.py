"""`speculative_generate` (the serving engine's speculative round) is lossless: greedy equals
autoregressive token for token for every drafter type, also when each request verifies its own
number of drafts; sampled output matches the target's distribution (and a broken rule fails)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding import acceptance_rule as verify_mod
from dspark_jax.decoding import speculative_round as round_mod
from dspark_jax.decoding import autoregressive_generate
from dspark_jax.models import init_draft, load_target
from dspark_jax.models.config import ConfigError
from dspark_jax.serving import Engine, SpecSettings, speculative_generate
from draft_fitting import fit_draft
from hf_tiny import save_tiny_hf

BASE = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1), mask_token_id=96,
            markov_rank=8)
DRAFTS = {
    "dspark_vanilla": dict(BASE),
    "dspark_gated": dict(BASE, markov_head_type="gated"),
    "dspark_rnn": dict(BASE, markov_head_type="rnn"),
    "dflash": dict(BASE, model_type="dflash", markov_rank=0, enable_confidence_head=False),
    # Eagle3 drafts ttt_length tokens a round (DeepSpec): γ = 4 like the others
    "eagle3": dict(BASE, model_type="eagle3", draft_num_hidden_layers=1, ttt_length=4),
    # a pruned draft vocabulary (every other id): proposals outside it never happen
    "dspark_pruned_vocab": dict(BASE, draft_vocab_size=48, draft_vocab=tuple(range(0, 96, 2))),
    "eagle3_pruned_vocab": dict(BASE, model_type="eagle3", draft_num_hidden_layers=1, ttt_length=4,
                                draft_vocab_size=48, draft_vocab=tuple(range(0, 96, 2))),
}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                    layers=4, seed=1))


@pytest.fixture(scope="module")
def greedy_ref(target):
    return autoregressive_generate(target, PROMPTS, max_new_tokens=16, stop_token_ids=[])


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_greedy_equals_autoregressive_random_draft(target, greedy_ref, kind):
    draft = init_draft(target, DRAFTS[kind], seed=3)
    res = speculative_generate(target, draft, PROMPTS, max_new_tokens=16, stop_token_ids=[])
    assert res.tokens == greedy_ref
    for p, a, toks in zip(res.proposed, res.accepted, res.tokens):
        assert len(p) == len(a) and all(0 <= x <= y <= 4 for x, y in zip(a, p))
        assert sum(x + 1 for x in a) + 1 >= len(toks)  # every round emits accepted + 1


@pytest.mark.parametrize("kind", ["dspark_rnn", pytest.param("eagle3", marks=pytest.mark.slow)])
def test_greedy_equals_autoregressive_trained_draft(target, kind):
    draft, prompts, outs = fit_draft(target, DRAFTS[kind])
    # ragged batch, stop token inside the output, max_new cut mid-round
    stop = outs[0][9]
    ref = autoregressive_generate(target, prompts, max_new_tokens=23, stop_token_ids=[stop])
    res = speculative_generate(target, draft, prompts, max_new_tokens=23, stop_token_ids=[stop])
    assert res.tokens == ref
    assert res.tau > 1.5, f"trained draft should get drafts accepted (τ={res.tau})"


def test_per_request_verification_lengths(target, greedy_ref, monkeypatch):
    """Requests verifying ℓ = 0, 1, 2 and 4 of their 4 drafts in the same rounds (the pruned
    slots never reach the target) still decode exactly the greedy output, and every round
    records exactly its request's ℓ as proposed."""
    ells = [0, 1, 2, 4]
    draft = init_draft(target, DRAFTS["dspark_vanilla"], seed=3)
    eng = Engine(target, draft, max_requests=4, max_len=64, scheduler="fixed",
                 stop_token_ids=[], capacity_buckets=[4 * 5], budget_rule="deepspec")
    drafted = round_mod._draft_and_schedule

    def fixed_lengths(config, arrays, state, slots, capacity):   # ℓ replaced per request
        lengths = jnp.where(slots.active, jnp.asarray(ells, jnp.int32), 0)
        return drafted(config, arrays, state, slots, capacity).replace(
            lengths=lengths,
            n_tokens=jnp.sum(jnp.where(slots.active, 1 + lengths, 0)).astype(jnp.int32))

    # the engine's fused rounds trace the scheduling step: patched, then traced afresh
    monkeypatch.setattr(round_mod, "_draft_and_schedule", fixed_lengths)
    round_mod.speculative_rounds.clear_cache()
    try:
        res = eng.generate(PROMPTS, max_new_tokens=16)
    finally:
        round_mod.speculative_rounds.clear_cache()
    assert res.tokens == greedy_ref
    for per, ell in zip(res.per_request, ells):
        assert set(per["proposed"]) == {ell}
        assert all(0 <= a <= ell for a in per["accepted"])
    assert any(a > 0 for per in res.per_request for a in per["accepted"])


# ----------------------------------------------------------------------------- sampling
V_SMALL = 8


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    t = load_target(save_tiny_hf(tmp_path_factory.mktemp("small"), "llama", vocab=V_SMALL,
                                 layers=3, seed=5))
    model = t.model
    model.embed.set_value(model.embed.get_value() * 30.0)   # sharper, context-dependent p_t
    return type(t).from_model(model)


def _exact_distributions(target, prompt, n_pos):
    """P(token at output position i) for i < n_pos by enumerating all prefixes (V^i)."""
    dists = []
    prefix_probs = {(): 1.0}
    for _ in range(n_pos):
        marg = np.zeros(V_SMALL)
        nxt = {}
        keys = list(prefix_probs)
        seqs = np.asarray([prompt + list(k) for k in keys])
        logits = target.logits(seqs)[:, -1].astype(np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        for k, row in zip(keys, p):
            marg += prefix_probs[k] * row
            for v in range(V_SMALL):
                nxt[k + (v,)] = prefix_probs[k] * row[v]
        dists.append(marg)
        prefix_probs = nxt
    return dists


def _chi2_stat(counts, probs):
    n = counts.sum()
    exp = n * probs
    keep = exp > 5
    return float((((counts - exp) ** 2) / exp)[keep].sum()), int(keep.sum()) - 1


# 0.9999 quantiles of chi-square (df 1..7): a true distribution fails with p < 1e-4
CHI2_Q9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}
N_SAMPLES = 20000


def _sample_positions(target, draft, verifier: str, prompt, n: int = N_SAMPLES):
    res = speculative_generate(target, draft, [prompt] * n, max_new_tokens=4,
                               temperature=1.0, seed=11, stop_token_ids=[],
                               settings=SpecSettings(verifier=verifier, record_confidence=False))
    toks = np.asarray(res.tokens)
    return toks, res


def _always_accept(accept_u, sample_u, target_probs, draft_probs, draft_tokens, verify_len):
    """A deliberately broken rule: accept every verified draft."""
    B, g = draft_tokens.shape
    n = verify_len.astype(jnp.int32)
    bonus = verify_mod.inverse_cdf_sample(target_probs[jnp.arange(B), n], sample_u)
    return verify_mod.VerifyResult(num_accepted=n, next_token=bonus,
                                   accepted_mask=jnp.arange(g)[None] < n[:, None])


@pytest.mark.slow   # the default suite's every-mode check covers it in seconds (below)
def test_sampled_output_matches_target_distribution(small_target, monkeypatch):
    """20k samples through `speculative_generate` (the `fixed` engine): per-position marginals
    match the target; an accept-every-draft rule fails. Default suite:
    tests/serving/test_engine_distribution.py checks every mode's joint, with top-k / top-p and
    a subtler broken rule."""
    draft = init_draft(small_target, dict(BASE, mask_token_id=V_SMALL - 1, target_layer_ids=(0, 1)),
                       seed=7)
    model = draft.model   # a sharper, different draft distribution: a broken rule shows clearly
    model.lm_head.set_value(model.lm_head.get_value() * 4.0)
    draft = type(draft).from_model(model)
    prompt = [1, 4, 2]
    exact = _exact_distributions(small_target, prompt, 4)
    toks, res = _sample_positions(small_target, draft, "jax", prompt)
    assert toks.shape == (N_SAMPLES, 4)
    assert 0 < np.mean([a for r in res.accepted for a in r]) < 4, "need both accepts and rejects"
    for i in range(1, 4):  # position 0 is sampled by the target's prefill, not by verification
        stat, df = _chi2_stat(np.bincount(toks[:, i], minlength=V_SMALL), exact[i])
        assert stat < CHI2_Q9999[df], (i, stat, df)
    # the same statistic rejects a broken acceptance rule
    monkeypatch.setitem(verify_mod.VERIFIERS, "always_accept", _always_accept)
    bad, _ = _sample_positions(small_target, draft, "always_accept", prompt, n=4000)
    stats = [_chi2_stat(np.bincount(bad[:, i], minlength=V_SMALL), exact[i]) for i in range(1, 4)]
    assert any(s > 5 * CHI2_Q9999[df] for s, df in stats), stats


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs(target, tmp_path):
    draft = init_draft(target, DRAFTS["dspark_vanilla"], seed=0)
    other = load_target(save_tiny_hf(tmp_path / "other", "qwen3", head_dim=16, layers=4,
                                     vocab=120))
    with pytest.raises(ConfigError, match="vocab_size"):
        speculative_generate(other, draft, [[1, 2]], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        speculative_generate(target, draft, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the cache length"):
        speculative_generate(target, draft, [list(range(3, 60))], max_new_tokens=8,
                             max_cache_len=32)
