"""Plain decoding on the serving engine (`scheduler="none"`, `Engine.serve`), the continuous
batching regeneration runs on: every reply equals the same request decoded alone by the
on-device loop (greedy and sampled), slots are refilled mid-flight and the cache grows,
follow-up requests returned by a reply are served, steady state does not recompile, several
steps run per device call; the plain sampler draws from the filtered distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.data import regeneration as R
from dspark_jax.decoding import plain_steps as P
from dspark_jax.decoding.autoregressive import autoregressive_generate
from dspark_jax.decoding.sampling import filter_logits, sample_request_rows
from dspark_jax.models import load_target
from dspark_jax.serving import Engine, Request
from hf_tiny import save_tiny_hf

MAX_NEW = 10


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_hf(path, "llama", vocab=97, layers=2)
    return load_target(path, with_tokenizer=False)


def _prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = [5, 17, 3, 40, 9, 70, 12, 2]  # 70 > 64: a second length bucket, the cache grows
    return [rng.integers(3, 97, size=n).astype(np.int32) for n in lengths]


def _engine(target, stops, **kw):
    return Engine(target, None, scheduler="none", **dict(dict(max_len=256), **kw),
                  stop_token_ids=stops)


def _alone(target, prompt, key, temperature, stops):
    return R.generate_rows(target, [prompt], key[None], max_new_tokens=MAX_NEW, batch_size=1,
                           temperature=temperature, top_k=8, top_p=0.9, stop_token_ids=stops)[0]


def _stops_that_end_rows_early(target, prompts) -> list[int]:
    """A stop token the greedy replies hit at different positions, so rows end at different
    steps and the batch must be refilled while other rows are still decoding."""
    free = [_alone(target, p, np.zeros(2, np.uint32), 0.0, []) for p in prompts]
    best, best_n = None, -1
    for tok in {t for reply in free for t in reply}:
        firsts = {reply.index(tok) for reply in free if tok in reply[:-1]}
        if len(firsts) > best_n:
            best, best_n = tok, len(firsts)
    assert best_n >= 2
    return [int(best)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replies_equal_the_request_decoded_alone(target, temperature):
    prompts = _prompts()
    stops = _stops_that_end_rows_early(target, prompts)
    keys = [R.sample_key_data(3, f"r{i}", 0) for i in range(len(prompts))]
    want = {i: _alone(target, p, k, temperature, stops) for i, (p, k) in enumerate(zip(prompts, keys))}
    assert len({len(r) for r in want.values()}) > 1  # rows really end at different steps

    got: dict = {}
    follow_up = {}

    def on_reply(req, reply):
        got[req.handle] = reply
        if req.handle == 2:  # a reply may queue a follow-up (the next turn of a conversation)
            follow_up["prompt"] = np.concatenate([prompts[2], np.asarray(reply, np.int32)])
            return [Request(follow_up["prompt"], keys[2], temperature, 8, 0.9, handle="2b")]
        return []

    eng = _engine(target, stops, max_requests=3, plain_steps_per_call=4)
    res = eng.serve([Request(p, k, temperature, 8, 0.9, handle=i)
                     for i, (p, k) in enumerate(zip(prompts, keys))], on_reply,
                    max_new_tokens=MAX_NEW)
    assert {h: got[h] for h in want} == want
    assert got["2b"] == _alone(target, follow_up["prompt"], keys[2], temperature, stops)
    assert res.tokens[:len(prompts)] == [want[i] for i in range(len(prompts))]
    assert res.tokens[-1] == got["2b"]
    lens = [r["cache_len"] for r in res.rounds]   # 64-token buckets; the 70-token prompt
    assert lens[0] == 64 and max(lens) == 128         # grew the cache to the second
    # each reply's first token comes from its prefill; the others take one decode step of the
    # 3 slots each, every step advances at least one reply, and calls run several steps
    stepped = sum(len(r) - 1 for r in got.values())
    steps = sum(r["steps"] for r in res.rounds)
    assert stepped / 3 <= steps <= stepped
    assert max(r["steps"] for r in res.rounds) > 1
    assert all(r["steps"] <= 4 for r in res.rounds)


def test_steady_state_does_not_recompile(target):
    prompts = _prompts()[:5]  # one length bucket
    keys = [R.sample_key_data(0, str(i), 0) for i in range(len(prompts))]
    eng = _engine(target, [5, 6, 7], max_requests=3)

    def run():
        res = eng.serve([Request(p, k, 0.5, 8, 0.9) for p, k in zip(prompts, keys)],
                        max_new_tokens=MAX_NEW)
        return res.tokens

    first = run()
    sizes = (P.plain_prefill._cache_size(), P.plain_steps._cache_size())
    assert run() == first
    assert (P.plain_prefill._cache_size(), P.plain_steps._cache_size()) == sizes


def test_bad_requests(target):
    eng = _engine(target, [], max_requests=2, max_len=16)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        eng.serve([Request([], np.zeros(2, np.uint32))], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 97\)"):
        eng.serve([Request([1, 97], np.zeros(2, np.uint32))], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_len=16"):
        eng.serve([Request([1] * 12, np.zeros(2, np.uint32))], max_new_tokens=4)
    with pytest.raises(ValueError, match="plain_steps_per_call"):
        _engine(target, [], plain_steps_per_call=0)
    # sampling settings that would fall silently into greedy decoding or no filter
    for field, value in (("temperature", -1.0), ("temperature", float("nan")), ("top_k", -1),
                         ("top_p", 1.5), ("top_p", 0.0)):
        req = Request([1, 2], np.zeros(2, np.uint32), **{field: value})
        with pytest.raises(ValueError, match=f"request 0: {field} must be"):
            eng.serve([req], max_new_tokens=4)
        with pytest.raises(ValueError, match=f"^{field} must be"):
            autoregressive_generate(target, [[1, 2]], max_new_tokens=4, **{field: value})


@pytest.mark.parametrize("cap", [0, 10])
def test_plain_sampler_matches_the_filtered_distribution(cap):
    """`sample_request_rows` draws from softmax(filter_logits(·)/T), per request: rows with
    different temperature / top-k / top-p in one batch, on the top-k candidate path (cap 10)
    and on the whole vocabulary (cap 0); T = 0 rows are greedy."""
    V, N = 40, 12000
    logits = jax.random.normal(jax.random.key(1), (V,)) * 2.0
    settings = [(10, 0.8, 0.7), (5, 1.0, 1.3)] + ([(0, 0.6, 1.0)] if cap == 0 else [])
    sample = jax.jit(sample_request_rows, static_argnames=("top_k_cap",))
    rows = [(k, p, t) for k, p, t in settings for _ in range(N)] + [(7, 0.9, 0.0)] * 3
    k_b, p_b, t_b = (jnp.asarray([r[j] for r in rows]) for j in range(3))
    key_data = jax.random.key_data(jax.random.split(jax.random.key(7), len(rows)))
    draws = np.asarray(sample(key_data, jnp.zeros((len(rows),), jnp.int32),
                              jnp.tile(logits, (len(rows), 1)), t_b, k_b, p_b, top_k_cap=cap))
    for j, (top_k, top_p, temp) in enumerate(settings):
        want = np.asarray(jax.nn.softmax(filter_logits(logits, top_k, top_p) / temp))
        freq = np.bincount(draws[j * N:(j + 1) * N], minlength=V) / N
        assert set(np.nonzero(freq)[0]) <= set(np.nonzero(want)[0])  # never outside the nucleus
        assert 0.5 * np.abs(freq - want).sum() < 0.03  # total variation (≈ 0.01 expected)
    assert np.all(draws[-3:] == int(jnp.argmax(logits)))


def _served_equal_alone(target, prompts, seed: int, temperature: float, slots: int) -> None:
    """Serves the prompts through `slots` slots (4 steps a call) and checks every reply against
    the request decoded alone by the on-device loop."""
    keys = [R.sample_key_data(seed, f"r{i}", 0) for i in range(len(prompts))]
    want = [_alone(target, p, k, temperature, []) for p, k in zip(prompts, keys)]
    res = _engine(target, [], max_requests=slots, plain_steps_per_call=4).serve(
        [Request(p, k, temperature, 8, 0.9, handle=i)
         for i, (p, k) in enumerate(zip(prompts, keys))],
        lambda req, reply: [], max_new_tokens=MAX_NEW)
    assert res.tokens == want


def test_gemma4_replies_equal_the_request_decoded_alone(tmp_path_factory):
    """The plain step is the family's dense cached forward: Gemma4's (sliding and full layer
    groups, shared K/V) serves slots that join and leave like Llama's."""
    from hf_tiny import GEMMA4_VARIANTS, save_tiny_gemma4

    variant = list(GEMMA4_VARIANTS)[0]
    gemma = load_target(save_tiny_gemma4(tmp_path_factory.mktemp(variant), variant),
                        with_tokenizer=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 97, size=n).astype(np.int32) for n in (5, 17, 3, 9, 12)]
    _served_equal_alone(gemma, prompts, seed=5, temperature=0.0, slots=2)


def test_one_slot_replies_equal_the_request_decoded_alone(target):
    """One slot: the replies, served one after the other, still equal each request decoded
    alone."""
    _served_equal_alone(target, _prompts()[:3], seed=7, temperature=0.8, slots=1)
