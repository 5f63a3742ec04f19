"""The serving engine is lossless under every scheduler: greedy output equals
`autoregressive_generate` token for token with prompts of different lengths, chunked prefill
and requests joining mid-run (slots reused); no recompiles after warm-up; DeepSpec's
bookkeeping on stop tokens and its token-budget rule; bad settings fail naming the setting."""

from __future__ import annotations

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding import autoregressive_generate, verification
from dspark_jax.decoding import speculative_round as round_
from dspark_jax.models import init_draft, load_target
from dspark_jax.serving import Engine
from dspark_jax.serving import engine as engine_mod
from hf_tiny import save_tiny_hf
from scheduler_by_name import MODES

BASE = dict(block_size=3, num_draft_layers=1, target_layer_ids=(-1, 0), mask_token_id=96,
            markov_rank=8)
# 5 requests over 2 slots: three join mid-run; the 13-token prompt spans two prefill chunks
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23, 24],
           list(range(30, 43))]
MAX_NEW = 12
ENGINE_KW = dict(max_requests=2, max_len=32, prefill_chunk=8, stop_token_ids=[])


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                    layers=2, seed=1))


@pytest.fixture(scope="module")
def draft(target):
    return init_draft(target, BASE, seed=3)


@pytest.fixture(scope="module")
def greedy_ref(target):
    return autoregressive_generate(target, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])


# a steep SPS so that algorithm1 / production / adaptive actually prune (top bucket = 2·(γ+1) = 8)
SPS = np.asarray([1.0, 1.0, 1.0, 0.8, 0.7, 0.5, 0.45, 0.4, 0.35], np.float32)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_every_mode_equals_autoregressive(target, draft, greedy_ref, mode):
    eng = Engine(target, draft, scheduler=mode, threshold=0.5, sps=SPS, **ENGINE_KW)
    res = eng.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert res.tokens == greedy_ref
    # API fields
    assert {"active", "verified_tokens", "capacity", "seconds"} <= set(res.rounds[0])
    for pr, toks in zip(res.per_request, res.tokens):
        assert {"accepted", "proposed", "first_token_s", "finish_s"} <= set(pr)
        assert len(pr["accepted"]) == len(pr["proposed"])
        assert all(0 <= a <= p <= 3 for a, p in zip(pr["accepted"], pr["proposed"]))
        assert pr["first_token_s"] <= pr["finish_s"]
        assert sum(pr["acceptance"]) + 1 == len(toks)
    assert max(r["active"] for r in res.rounds) == 2
    for r in res.rounds:   # the capacity holds the admitted tokens: Σ(1 + ℓ_r) ≤ K
        assert r["active"] + r["verified_tokens"] <= r["capacity"] in eng.buckets
    if mode == "none":
        assert all(r["verified_tokens"] == 0 for r in res.rounds)
    if mode == "fixed":   # γ, or fewer where the token budget cannot use them
        assert all(p == min(3, MAX_NEW - 2 - sum(a + 1 for a in pr["accepted"][:i]))
                   for pr in res.per_request for i, p in enumerate(pr["proposed"]))
    if mode in ("algorithm1", "production", "adaptive"):   # the scheduler prunes (this SPS)
        assert sum(r["verified_tokens"] for r in res.rounds) < 3 * sum(
            r["active"] for r in res.rounds)


@pytest.mark.slow
def test_eagle3_greedy_and_chain_stops_at_drafted_stop(target):
    dr = init_draft(target, dict(BASE, model_type="eagle3", draft_num_hidden_layers=1,
                                 ttt_length=3), seed=4)   # γ = ttt_length (DeepSpec)
    stop = 9999 % 97
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=MAX_NEW,
                                  stop_token_ids=[stop])
    eng = Engine(target, dr, scheduler="fixed", **dict(ENGINE_KW, stop_token_ids=[stop]))
    res = eng.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert res.tokens == ref


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_caches_grow_as_longer_requests_join(target, draft, greedy_ref, kind, monkeypatch):
    """With len_bucket 8 the caches grow through 8, 16, 24, 32 (powers of two and 1.5× them)
    as longer requests join: they start at what the first two need, 16 (prompt + budget + one
    verified block), and grow to 24 when the 13-token prompt joins mid-run. Target and drafter
    caches grow together; the output stays autoregressive."""
    dr = draft if kind == "dspark" else init_draft(
        target, dict(BASE, model_type="eagle3", draft_num_hidden_layers=1, ttt_length=3), seed=4)
    eng = Engine(target, dr, scheduler="fixed", len_bucket=8, **ENGINE_KW)
    assert eng.cache_lengths() == [8, 16, 24, 32]
    grown, real = [], eng.grown

    def record(s, n):
        out = real(s, n)
        grown.append((out.cache.max_len, out.draft_cache.k.shape[2]))
        return out

    monkeypatch.setattr(eng, "grown", record)
    res = eng.generate(PROMPTS, max_new_tokens=4)
    assert res.tokens == [t[:4] for t in greedy_ref]
    assert grown == [(24, 24)]
    assert engine_mod._Run(eng, 4).start_state().cache.max_len == 8   # nothing queued yet
    # the drafter's context survives the growth: the rounds are those of caches of max_len
    # from the start, to the drafts accepted and (DSpark) the confidence of every proposal
    whole = Engine(target, dr, scheduler="fixed", **ENGINE_KW).generate(PROMPTS, max_new_tokens=4)
    for a, b in zip(res.per_request, whole.per_request):
        assert a["accepted"] == b["accepted"]
        np.testing.assert_allclose(np.stack(a["confidence"]), np.stack(b["confidence"]),
                                   atol=1e-5)


def _prefilled(eng, prompt):
    run = engine_mod._Run(eng, 8)
    run.add(engine_mod.Request(prompt, np.zeros(2, np.uint32)))
    run.t0 = 0.0
    s = run._prefill(eng.fresh_state(), run._admit(0.0))
    return run, s


def test_adaptive_rounds_that_skip_drafting(target, draft, greedy_ref, monkeypatch):
    """A drafter that costs more than it could ever gain (draft_seconds ≫ a step), probing
    every 4th round: rounds mix plain decoding (drafter not run, nothing verified) and drafting,
    the plain stretches run several rounds per device call, greedy output still equals
    autoregressive decoding, and the drafter's context cache holds every committed token's
    features exactly as a prefill of the committed sequence writes them (skipped rounds
    included)."""
    kw = dict(scheduler="adaptive", sps=SPS, draft_seconds=100.0, probe_interval=4,
              max_probe_interval=4, explore=None)
    calls = []
    real = engine_mod.round_.anchor_rounds
    monkeypatch.setattr(engine_mod.round_, "anchor_rounds",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    eng = Engine(target, draft, **kw, **ENGINE_KW)
    res = eng.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert res.tokens == greedy_ref
    flags = [r["drafted"] for r in res.rounds]
    assert flags.count(False) >= 6 and flags.count(True) >= 2
    assert all(r["verified_tokens"] == 0 for r in res.rounds if not r["drafted"])
    assert 0 < len(calls) < flags.count(False)   # several plain rounds per device call

    one = Engine(target, draft, **kw, **dict(ENGINE_KW, max_requests=1))
    run = engine_mod._Run(one, MAX_NEW)
    run.add(engine_mod.Request(PROMPTS[1], np.zeros(2, np.uint32)))
    out = run.loop()
    assert not all(r["drafted"] for r in out.rounds)
    s = run.final_state
    L = int(s.cache.lengths[0])
    committed = (PROMPTS[1] + out.tokens[0])[:L]
    _, ref = _prefilled(Engine(target, draft, scheduler="fixed",
                               **dict(ENGINE_KW, max_requests=1)), committed)
    for got, want in ((s.draft_cache.k, ref.draft_cache.k), (s.draft_cache.v, ref.draft_cache.v)):
        np.testing.assert_allclose(np.asarray(got[:, 0, :L]), np.asarray(want[:, 0, :L]),
                                   atol=1e-4)


def test_adaptive_policy_persists_across_generate_calls(target, draft, greedy_ref):
    """One policy per engine: the second `generate` starts from what the first learned (no
    second free probe: it decides on the carried estimate queue, ρ and budget), output stays
    exact; `reset_policy` and `warmup` start over."""
    kw = dict(scheduler="adaptive", sps=SPS, draft_seconds=0.5, plain_seconds=1.0)
    eng = Engine(target, draft, **kw, **ENGINE_KW)
    first = eng.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert first.tokens == greedy_ref
    assert first.rounds[0]["drafted"]          # the free first probe
    pol = eng.policy
    assert pol.started and pol.queue[1] is not None
    carried = (list(pol.queue), pol.ratio, pol.budget)
    seen = []
    decide = pol.decide
    pol.decide = lambda n: seen.append((list(pol.queue), pol.ratio, pol.budget)) or decide(n)
    second = eng.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert second.tokens == greedy_ref
    assert eng.policy is pol and seen[0] == carried
    eng.reset_policy()
    assert eng.policy is not pol and not eng.policy.started
    third = eng.generate(PROMPTS[:2], max_new_tokens=4)
    assert third.rounds[0]["drafted"]
    eng.warmup()
    assert not eng.policy.started


@pytest.mark.parametrize("mode", ["fixed", "production"])
def test_one_slot_verifies_densely_and_equals_autoregressive(target, draft, greedy_ref, mode,
                                                            monkeypatch):
    """One request slot verifies its contiguous tokens with the dense cached forward over
    [1, K] (no ragged forward while drafting): the requests, served one at a time through the
    slot, equal autoregressive decoding, and the drafter's context stays exact (its accepted
    drafts equal those of a two-slot engine, which verifies on the ragged path)."""
    calls = []
    real = verification.ragged_forward
    monkeypatch.setattr(verification, "ragged_forward",
                        lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    one = Engine(target, draft, scheduler=mode, sps=SPS, **dict(ENGINE_KW, max_requests=1))
    res = one.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert res.tokens == greedy_ref
    assert all(shape == (1,) for shape in calls), calls   # only one-token plain steps
    two = Engine(target, draft, scheduler="fixed", **ENGINE_KW).generate(
        PROMPTS, max_new_tokens=MAX_NEW)
    if mode == "fixed":
        assert [pr["accepted"] for pr in res.per_request] == [
            pr["accepted"] for pr in two.per_request]


def test_adaptive_chooses_on_device_as_the_host_policy_would(target, draft, monkeypatch):
    """`adaptive` runs several drafting rounds a device call, the device choosing before each
    round after the first (`scheduler.drafting_pays`) and ending the call at the first it would
    not draft: the rounds (drafted or not, capacities admitted), the output and the policy's
    final state equal those of the host deciding every round (`rounds_per_call=1`), on costs
    where the choice flips both ways within a run."""
    kw = dict(scheduler="adaptive", sps=SPS, draft_seconds=0.0, plain_seconds=1.2,
              probe_interval=2, max_requests=2, max_len=64, prefill_chunk=8, stop_token_ids=[])
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=24, stop_token_ids=[])
    calls = []
    real = engine_mod.round_.speculative_rounds
    monkeypatch.setattr(engine_mod.round_, "speculative_rounds",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = {}
    for rpc in (1, 8):
        calls.clear()
        eng = Engine(target, draft, rounds_per_call=rpc, **kw)
        res = eng.generate(PROMPTS, max_new_tokens=24)
        assert res.tokens == ref
        runs[rpc] = (res, eng.policy, len(calls))
    (one, pol1, _), (many, pol8, n_calls) = runs[1], runs[8]
    flags = "".join("D" if r["drafted"] else "." for r in one.rounds)
    assert "DDD" in flags and "D.." in flags and "..D" in flags, flags
    assert [(r["drafted"], r.get("admitted_capacity")) for r in many.rounds] == [
        (r["drafted"], r.get("admitted_capacity")) for r in one.rounds]
    assert n_calls < flags.count("D")          # drafting rounds shared device calls
    assert [pol8.queue, pol8.interval, pol8.since_draft, pol8.budget] == [
        pol1.queue, pol1.interval, pol1.since_draft, pol1.budget]
    np.testing.assert_allclose([pol8.pred, pol8.real], [pol1.pred, pol1.real], rtol=1e-6)


def test_production_always_drafts_with_the_capacity_of_two_rounds_before(target, draft,
                                                                         greedy_ref):
    """`production` (the paper's §5.2 schedule alone): with the costs under which `adaptive`
    skips drafting, every round drafts; output equals autoregressive decoding; round t admits
    at most the K of round t − 2 (R·γ in rounds 1–2); its queue starts over with each run."""
    kw = dict(sps=SPS, draft_seconds=100.0, probe_interval=2, max_probe_interval=2,
              explore=None)
    adaptive = Engine(target, draft, scheduler="adaptive", **kw, **ENGINE_KW)
    skipped = adaptive.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert not all(r["drafted"] for r in skipped.rounds)
    eng = Engine(target, draft, scheduler="production", **kw, **ENGINE_KW)
    assert isinstance(eng.policy, engine_mod.policy.CapacityQueue)
    made = []

    class Spy(engine_mod.policy.CapacityQueue):
        def update(self, drafted, est=None, predicted=0.0, realised=0.0):
            made.append(est.capacity)
            super().update(drafted, est, predicted, realised)

    eng.new_policy = lambda: Spy(eng.R * eng.gamma)
    for _ in range(2):   # the second run starts from K₀ again
        made.clear()
        res = eng.generate(PROMPTS, max_new_tokens=MAX_NEW)
        assert res.tokens == greedy_ref
        assert all(r["drafted"] for r in res.rounds)
        # the queue runs on device, several rounds a call: what each round admitted
        used = [r["admitted_capacity"] for r in res.rounds]
        assert len(used) == len(made) == len(res.rounds)
        assert used == [eng.R * eng.gamma] * 2 + made[:-2]
        assert all(r["verified_tokens"] <= k for r, k in zip(res.rounds, used))
        assert min(made) < eng.R * eng.gamma   # the steep SPS prunes
    with pytest.raises(ValueError, match="confidence head"):
        Engine(target, init_draft(target, dict(BASE, model_type="dflash", markov_rank=0,
                                               enable_confidence_head=False), seed=0),
               scheduler="production", sps=SPS)


def test_stop_token_among_accepted_drafts_follows_deepspec(target, draft):
    """Drafts = the target's greedy continuation, a stop token at draft index 1: accepted =
    proposed = eos_pos + 1 = 2, τ term 2 (no bonus), emission cut after the stop token."""
    cands = [[5, 6, 7], [8, 9], [20, 21, 22], [40, 3], [11, 60, 12]]
    outs = autoregressive_generate(target, cands, max_new_tokens=5, stop_token_ids=[])
    prompt, greedy = next((p, g) for p, g in zip(cands, outs) if g[2] not in g[:2])
    stop = greedy[2]
    eng = Engine(target, draft, scheduler="fixed", max_requests=1, max_len=32,
                 stop_token_ids=[stop])
    run, s = _prefilled(eng, prompt)
    assert run.out[0] == greedy[:1]
    drafts = jnp.asarray([greedy[1:4]], jnp.int32)
    probs = jax.nn.one_hot(drafts, 97, dtype=jnp.float32)
    s, o = round_.verify_and_commit(eng.config, eng.arrays, s, eng.slot_settings(run.host),
                                    drafts, probs, jnp.asarray([3]), capacity=4)
    o = jax.device_get(o)
    assert int(o.accepted[0]) == int(o.proposed[0]) == 2
    assert int(o.tau_term[0]) == 2 and int(o.n_emit[0]) == 2 and bool(o.finished[0])
    assert o.tokens[0, :2].tolist() == greedy[1:3]


def test_deepspec_budget_rule_runs_the_rounds_deepspec_runs(target, draft, greedy_ref):
    """budget_rule="deepspec" is DeepSpec's `while start < max_length`: every round verifies γ
    drafts and starts with at most MAX_NEW tokens out, the last one goes past MAX_NEW (no stop
    tokens here), the output is cut at MAX_NEW. A request whose rounds land exactly on MAX_NEW
    runs one more round than under "serving" (which stops there); the others run the same
    rounds. A budget of one token still runs one round."""
    eng = Engine(target, draft, scheduler="fixed", budget_rule="deepspec", **ENGINE_KW)
    assert not eng.cap_to_budget
    res = eng.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert res.tokens == greedy_ref
    serving = Engine(target, draft, scheduler="fixed", cap_to_budget=False, **ENGINE_KW
                     ).generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert serving.tokens == greedy_ref
    landed = 0
    for pr, sv in zip(res.per_request, serving.per_request):
        out = 1 + np.cumsum([0] + pr["acceptance"])   # tokens out before each round, after
        assert (out[:-1] <= MAX_NEW).all() and out[-1] > MAX_NEW
        assert all(p == 3 for p in pr["proposed"])
        if out[-2] == MAX_NEW:
            landed += 1
            assert pr["acceptance"][:-1] == sv["acceptance"]
        else:
            assert pr["acceptance"] == sv["acceptance"]
    assert landed >= 1
    assert res.tau != serving.tau
    one = eng.generate(PROMPTS[:2], max_new_tokens=1)
    assert one.tokens == [g[:1] for g in greedy_ref[:2]]
    assert [len(pr["acceptance"]) for pr in one.per_request] == [1, 1]
    with pytest.raises(ValueError, match="cap_to_budget"):
        Engine(target, draft, scheduler="fixed", budget_rule="deepspec", cap_to_budget=True,
               **ENGINE_KW)
    with pytest.raises(ValueError, match="budget_rule"):
        Engine(target, draft, scheduler="fixed", budget_rule="vllm", **ENGINE_KW)


def test_no_recompile_after_warmup(target, draft):
    eng = Engine(target, draft, scheduler="adaptive", sps=SPS, **ENGINE_KW)
    eng.warmup()
    # the warm-up's drafting call goes on drafting on device (not only a call's first round)
    assert eng._warm_device_choice(eng.cache_lengths()[0]) == 3
    eng.generate(PROMPTS[:3], max_new_tokens=MAX_NEW)
    events = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:   # other prompts, other join pattern, sampled with per-request settings
        res = eng.generate(PROMPTS[::-1] + [[7, 7]], max_new_tokens=MAX_NEW - 3,
                           temperature=[0.0, 1.0, 0.7, 0.0, 1.0, 0.5], top_k=[0, 5, 0, 0, 3, 0],
                           top_p=[1.0, 1.0, 0.9, 1.0, 1.0, 0.8], seed=[1, 2, 3, 4, 5, 6],
                           arrivals=[0.0, 0.0, 0.01, 0.02, 0.02, 0.03])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert events == [], f"{len(events)} compilations after warm-up"
    assert len(res.tokens) == 6 and all(len(t) >= 1 for t in res.tokens)


def test_request_output_independent_of_batch(target, draft):
    """Per-request seeds: a sampled request decodes the same alone and among others."""
    eng = Engine(target, draft, scheduler="fixed", **ENGINE_KW)
    alone = eng.generate([PROMPTS[1]], max_new_tokens=MAX_NEW, temperature=1.0, seed=[42])
    mixed = eng.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=1.0,
                         seed=[0, 42, 1, 2, 3])
    assert mixed.tokens[1] == alone.tokens[0]


def test_bad_inputs(target, draft):
    dflash = init_draft(target, dict(BASE, model_type="dflash", markov_rank=0,
                                     enable_confidence_head=False), seed=0)
    with pytest.raises(ValueError, match="unknown scheduler"):
        Engine(target, draft, scheduler="greedy")
    with pytest.raises(ValueError, match="max_requests"):
        Engine(target, draft, max_requests=4, scheduler="fixed", capacity_buckets=[2, 8])
    with pytest.raises(ValueError, match="confidence head"):
        Engine(target, dflash, scheduler="adaptive", sps=SPS)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(target, None, scheduler="fixed")
    with pytest.raises(ValueError, match="probe_interval"):
        Engine(target, draft, scheduler="adaptive", sps=SPS, probe_interval=8,
               max_probe_interval=4)
    with pytest.raises(ValueError, match="draft_seconds"):
        Engine(target, draft, scheduler="adaptive", sps=SPS, draft_seconds=-1.0)
    with pytest.raises(ValueError, match="confidence_temperatures"):
        Engine(target, draft, scheduler="fixed", confidence_temperatures=[1.0])
    eng = Engine(target, draft, scheduler="fixed", **ENGINE_KW)
    with pytest.raises(ValueError, match="max_len=32"):
        eng.generate([list(range(3, 30))], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[1], []], max_new_tokens=4)
    # draft=None works with scheduler="none"
    plain = Engine(target, None, scheduler="none", **ENGINE_KW)
    assert plain.generate([[5, 6]], max_new_tokens=3).tokens == autoregressive_generate(
        target, [[5, 6]], max_new_tokens=3, stop_token_ids=[])


@pytest.mark.slow
def test_pallas_verifier_greedy_equals_autoregressive(target, draft, greedy_ref):
    """verifier="pallas" runs the Pallas verification kernel (interpreted on CPU)."""
    eng = Engine(target, draft, scheduler="fixed", verifier="pallas", **ENGINE_KW)
    assert eng.generate(PROMPTS, max_new_tokens=MAX_NEW).tokens == greedy_ref


def test_kernel_drafting_path_equals_model_scan(target):
    """The drafting path of sampler="pallas" (`DSparkAdapter.propose_with_uniforms`) given the
    same uniforms reproduces the model's own per-slot scan — tokens, draft probabilities and
    confidence logits, on greedy and sampled rows — with the batched Pallas kernel and the
    tiled one a GPU round drafts with (both interpreted on CPU) and with their pure-JAX
    oracle."""
    import functools

    from pallas_kernels.markov_sample.tiled import markov_sample_tiled
    from dspark_jax.decoding.draft_adapters import DSparkAdapter
    from dspark_jax.decoding.acceptance_rule import inverse_cdf_sample
    from dspark_jax.decoding.markov_sampling import (pallas_markov_sample_with_uniforms,
                                                     sequential_markov_sample_with_uniforms)

    m = init_draft(target, BASE, seed=4).model
    # W2 is zero at init (DeepSpec): give the Markov bias real weight so x_{k−1} matters
    m.markov.w2.set_value(3 * jax.random.normal(jax.random.key(1), m.markov.w2.get_value().shape))
    B, S, g = 3, 16, m.cfg.num_drafts
    cache = DSparkAdapter.init_cache(m, B, S)
    cache = cache.replace(k=jax.random.normal(jax.random.key(2), cache.k.shape),
                          v=jax.random.normal(jax.random.key(3), cache.v.shape))
    anchor, pos = jnp.asarray([3, 17, 90], jnp.int32), jnp.asarray([5, 9, 2], jnp.int32)
    temp = jnp.asarray([0.0, 1.0, 0.7], jnp.float32)         # a greedy row and two sampled
    u = jax.random.uniform(jax.random.key(9), (B, g), jnp.float32)
    salt_key = jax.random.key(0)
    salts = jax.random.key_data(jax.random.split(salt_key, g))[:, -1]     # one per slot

    def sample_fn(k, probs):   # the model's scan gets slot k's key: use that slot's uniforms
        slot = jnp.argmax(salts == jax.random.key_data(k)[-1])
        return inverse_cdf_sample(probs, u[:, slot])

    def all_paths(c):   # one program: the backbone is shared, compiled once
        want = DSparkAdapter.propose(m, c, anchor, pos, salt_key, temp[:, None], sample_fn)
        return want, [DSparkAdapter.propose_with_uniforms(m, c, anchor, pos, u, temp, f)
                      for f in (sequential_markov_sample_with_uniforms,
                                pallas_markov_sample_with_uniforms,
                                functools.partial(markov_sample_tiled, block_v=32,
                                                  interpret=True))]

    want, gots = jax.jit(all_paths)(cache)
    for got in gots:
        np.testing.assert_array_equal(got["tokens"], want["tokens"])
        np.testing.assert_allclose(got["probs"], want["probs"], atol=1e-5)
        np.testing.assert_allclose(got["confidence"], want["confidence"], atol=1e-5)
    assert not np.allclose(want["confidence"][:, 1:], want["confidence"][:, :1]), \
        "confidence must vary with the slot and the sampled previous token"


@pytest.mark.slow
def test_pallas_sampler_greedy_and_same_samples_as_jax(target, draft, greedy_ref):
    """sampler="pallas" drafts with the batched Markov-head kernel (interpreted on CPU): greedy
    output equals autoregressive decoding, and at T = 1 it consumes the same per-request
    uniforms as the pure-JAX sampler, so the engine emits the same tokens and acceptances."""
    kw = dict(ENGINE_KW, max_requests=3)
    eng = Engine(target, draft, scheduler="fixed", sampler="pallas", **kw)
    assert eng.generate(PROMPTS, max_new_tokens=MAX_NEW).tokens == greedy_ref
    ref = Engine(target, draft, scheduler="fixed", sampler="jax", **kw)
    a = eng.generate(PROMPTS[:3], max_new_tokens=MAX_NEW, temperature=1.0, seed=5)
    b = ref.generate(PROMPTS[:3], max_new_tokens=MAX_NEW, temperature=1.0, seed=5)
    assert a.tokens == b.tokens
    assert [r["accepted"] for r in a.per_request] == [r["accepted"] for r in b.per_request]
    assert any(x < p for r in a.per_request for x, p in zip(r["accepted"], r["proposed"])), \
        "random drafter: some drafts must be rejected, or the comparison proves little"


def test_the_gpu_drafting_program_interpreted_is_lossless(target, draft, greedy_ref,
                                                          monkeypatch):
    """The round a GPU compiles, run on a CPU with its kernels interpreted
    (`layers.interpret_kernels`): its drafts come from the tiled Markov-head kernels (traced
    into the rounds that ran, and in the proposal's jaxpr) and greedy output equals
    autoregressive decoding."""
    from dspark_jax.decoding import speculative_round as R_
    from dspark_jax.decoding.round_types import SlotSettings
    from dspark_jax.models import layers as L

    traced = []

    def counted(*args, **kw):
        traced.append(1)
        return markov_sample_tiled(*args, **kw)

    from pallas_kernels.markov_sample import tiled
    from pallas_kernels.markov_sample.tiled import markov_sample_tiled
    monkeypatch.setattr(tiled, "markov_sample_tiled", counted)
    with L.interpret_kernels():
        eng = Engine(target, draft, scheduler="fixed", **ENGINE_KW)
        out = eng.generate(PROMPTS, max_new_tokens=MAX_NEW).tokens
        if not traced:   # the rounds came from the compilation cache of an earlier test
            jax.clear_caches()
            out = eng.generate(PROMPTS, max_new_tokens=MAX_NEW).tokens
        assert traced, "the rounds did not draft through the tiled kernels"
        R = eng.R
        slots = SlotSettings(
            active=jnp.ones((R,), bool), remaining=jnp.full((R,), 8, jnp.int32),
            counter=jnp.zeros((R,), jnp.int32), temperature=jnp.ones((R,), jnp.float32),
            top_k=jnp.zeros((R,), jnp.int32), top_p=jnp.ones((R,), jnp.float32),
            key_data=jnp.zeros((R, 2), jnp.uint32))
        jaxpr = str(jax.make_jaxpr(lambda s: R_._propose_scan(
            R_._draft_model(eng.arrays), eng.arrays, s, slots))(eng.fresh_state()))
    assert "markov_tiles" in jaxpr and "markov_pick" in jaxpr
    assert out == greedy_ref


def test_the_gpu_chain_drafter_interpreted_draws_as_xla_does(target, monkeypatch):
    """Eagle3's chain, compiled for a GPU, draws each draft token (and each request's first
    token after its prefill) with the row sampler's two kernels (`row_sample`, interpreted
    here): at T = 1 with the same seed, the engine emits the tokens and acceptances of the
    XLA program, and greedy output equals autoregressive decoding."""
    from dspark_jax.decoding import acceptance_rule
    from dspark_jax.models import layers as L
    from pallas_kernels import row_sample as rs

    eagle = init_draft(target, dict(BASE, model_type="eagle3", draft_num_hidden_layers=1,
                                    ttt_length=3), seed=4)
    kw = dict(ENGINE_KW, max_requests=3)
    prompts = PROMPTS[:3]
    ref = Engine(target, eagle, scheduler="fixed", **kw)
    want = ref.generate(prompts, max_new_tokens=MAX_NEW, temperature=1.0, seed=7)
    traced = []

    def counted(*args, **kwargs):
        traced.append(1)
        return row_sample(*args, **kwargs)

    row_sample = rs.row_sample
    monkeypatch.setattr(acceptance_rule, "row_sample", counted)
    jax.clear_caches()
    with L.interpret_kernels():
        eng = Engine(target, eagle, scheduler="fixed", **kw)
        got = eng.generate(prompts, max_new_tokens=MAX_NEW, temperature=1.0, seed=7)
        greedy = eng.generate(prompts, max_new_tokens=MAX_NEW).tokens
    assert traced, "the rounds did not draw through the row sampler"
    assert got.tokens == want.tokens
    assert [r["accepted"] for r in got.per_request] == [r["accepted"] for r in want.per_request]
    assert any(x < p for r in got.per_request for x, p in zip(r["accepted"], r["proposed"])), \
        "random drafter: some drafts must be rejected, or the comparison proves little"
    assert greedy == autoregressive_generate(target, prompts, max_new_tokens=MAX_NEW,
                                             stop_token_ids=[])


def test_pallas_sampler_bad_drafter(target):
    gated = init_draft(target, dict(BASE, markov_head_type="gated"), seed=0)
    with pytest.raises(ValueError, match="sampler='pallas'.*gated"):
        Engine(target, gated, scheduler="fixed", sampler="pallas", **ENGINE_KW)
    with pytest.raises(ValueError, match="unknown sampler"):
        Engine(target, gated, scheduler="fixed", sampler="cuda", **ENGINE_KW)
