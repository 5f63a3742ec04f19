"""Continuous batching: every reply equals the same request decoded alone in a static batch
(greedy and sampled), rows are refilled mid-flight and the cache grows, follow-up requests
submitted from a reply are served, steady state does not recompile; the top-k candidate sampler
draws from the same distribution as `sampling.filter_logits`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.data import regenerate as R
from dspark_jax.data.continuous import ContinuousBatcher
from dspark_jax.decoding import autoregressive as A
from dspark_jax.decoding.sampling import filter_logits
from dspark_jax.models import load_target
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

    def on_reply(handle, reply):
        got[handle] = reply
        if handle == 2:  # a reply may queue a follow-up (the next turn of a conversation)
            follow_up["prompt"] = np.concatenate([prompts[2], np.asarray(reply, np.int32)])
            batcher.submit("2b", follow_up["prompt"], keys[2])

    batcher = ContinuousBatcher(target, batch_size=3, max_new_tokens=MAX_NEW,
                                temperature=temperature, top_k=8, top_p=0.9,
                                stop_token_ids=stops, refill_size=1, steps_per_call=4)
    for i, (p, k) in enumerate(zip(prompts, keys)):
        batcher.submit(i, p, k)
    batcher.run(on_reply)
    assert {h: got[h] for h in want} == want
    assert got["2b"] == _alone(target, follow_up["prompt"], keys[2], temperature, stops)
    assert batcher.device_calls["grow"] == 1
    assert batcher.device_calls["refill"] == len(prompts) + 1  # one row per refill, R = 1
    assert all(batcher.device_seconds[k] > 0 for k in ("refill", "decode", "grow"))
    # each reply's first token comes from its prefill; the others take one decode step of the
    # batch of 3 each, and every step advances at least one reply
    stepped = sum(len(r) - 1 for r in got.values())
    assert stepped / 3 <= batcher.decode_steps <= stepped


def test_steady_state_does_not_recompile(target):
    prompts = _prompts()[:5]  # one length bucket
    keys = [R.sample_key_data(0, str(i), 0) for i in range(len(prompts))]

    def run():
        b = ContinuousBatcher(target, batch_size=3, max_new_tokens=MAX_NEW, temperature=0.5,
                              top_k=8, top_p=0.9, stop_token_ids=[5, 6, 7], refill_size=1)
        for i, (p, k) in enumerate(zip(prompts, keys)):
            b.submit(i, p, k)
        out = {}
        b.run(lambda h, r: out.__setitem__(h, r))
        return out

    first = run()
    sizes = (A.ar_refill._cache_size(), A.ar_decode._cache_size())
    assert run() == first
    assert (A.ar_refill._cache_size(), A.ar_decode._cache_size()) == sizes


def test_bad_requests(target):
    b = ContinuousBatcher(target, batch_size=2, max_new_tokens=4, temperature=0.0, top_k=0,
                          top_p=1.0, stop_token_ids=[])
    with pytest.raises(ValueError, match="request 'x': the prompt must be a non-empty"):
        b.submit("x", [], np.zeros(2, np.uint32))
    with pytest.raises(ValueError, match=r"request 'y': token ids outside \[0, 97\)"):
        b.submit("y", [1, 97], np.zeros(2, np.uint32))
    with pytest.raises(ValueError, match="refill_size"):
        ContinuousBatcher(target, batch_size=2, max_new_tokens=4, temperature=0.0, top_k=0,
                          top_p=1.0, stop_token_ids=[], refill_size=3)


def test_top_k_candidate_sampler_matches_the_filtered_distribution():
    V, N = 40, 20000
    logits = jax.random.normal(jax.random.key(1), (V,)) * 2.0
    sample = jax.jit(A.sample_rows, static_argnums=(4, 5))
    for top_k, top_p, temp in [(10, 0.8, 0.7), (5, 1.0, 1.3)]:
        want = np.asarray(jax.nn.softmax(filter_logits(logits, top_k, top_p) / temp))
        key_data = A.row_key_data(7, N)
        draws = sample(key_data, jnp.zeros((N,), jnp.int32), jnp.tile(logits, (N, 1)),
                       jnp.asarray(temp), top_k, top_p)
        freq = np.bincount(np.asarray(draws), minlength=V) / N
        assert set(np.nonzero(freq)[0]) <= set(np.nonzero(want)[0])  # never outside the nucleus
        assert 0.5 * np.abs(freq - want).sum() < 0.02  # total variation (≈ 0.008 expected)
    greedy = sample(A.row_key_data(0, 3), jnp.zeros((3,), jnp.int32),
                           jnp.tile(logits, (3, 1)), jnp.asarray(0.0), 10, 0.8)
    assert np.all(np.asarray(greedy) == int(jnp.argmax(logits)))


def test_decode_steps_and_device_time_are_booked(target):
    """Three requests in a batch of three: every decode step advances every unfinished row, so
    the steps booked are exactly the longest reply's length minus its prefill-sampled token."""
    prompts = _prompts()[:3]
    stops = _stops_that_end_rows_early(target, _prompts())
    keys = [R.sample_key_data(1, str(i), 0) for i in range(3)]
    b = ContinuousBatcher(target, batch_size=3, max_new_tokens=MAX_NEW, temperature=0.0,
                          top_k=8, top_p=0.9, stop_token_ids=stops, refill_size=3,
                          steps_per_call=3)
    for i, (p, k) in enumerate(zip(prompts, keys)):
        b.submit(i, p, k)
    out: dict = {}
    b.run(lambda h, r: out.__setitem__(h, r))
    assert b.decode_steps == max(len(r) for r in out.values()) - 1
    assert b.device_calls["refill"] == 1 and b.device_calls["decode"] >= 2
    assert b.device_seconds["refill"] > 0 and b.device_seconds["decode"] > 0
