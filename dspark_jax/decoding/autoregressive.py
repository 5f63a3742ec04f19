"""Plain batched autoregressive decoding: the baseline speculative decoding must equal (SPEC §1).

A static-shape state machine: ragged prompts are prefilled into a KV cache with per-request
lengths, in length groups each padded to its own bucket (`prefill_plan`, as the serving
engine's joins), then an on-device `lax.while_loop` decodes one token per request per
step until every request hit a stop token or `max_new_tokens`. `steps_per_call` bounds the
steps per device call so a host loop can drive a progress bar with the same compiled program.

Continuous batching (regeneration, serving) is the serving engine's plain decoding
(`decoding.plain_steps`); it samples with the same `sampling.sample_request_rows`, so a
request's reply is the same on either path.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.placement import place_slots, prefill_call_tokens
from dspark_jax.decoding.precision import model_precision, with_precision_policy
from dspark_jax.decoding.prefill_plan import (PREFILL_TOKENS, pow2_rows, prefill_groups,
                                              prefill_length, round_up)
from dspark_jax.decoding.sampling import check_sampling, sample_request_rows, top_k_cap_for
from dspark_jax.decoding.stops import is_stop, stop_array
from dspark_jax.models.decoder import KVCache, decode_one, init_cache, prefill
from dspark_jax.sharding import use_mesh, weights_mesh


@flax.struct.dataclass
class ARState:
    cache: KVCache
    last_token: jax.Array   # [B] the token to feed next
    out: jax.Array          # [B, max_new] generated ids (−1 = none)
    num_out: jax.Array      # [B]
    done: jax.Array         # [B] bool
    key_data: jax.Array     # [B, 2] uint32: one threefry key per row
    steps: jax.Array        # [] int32 device steps taken


def sample_rows(key_data: jax.Array, index: jax.Array, logits: jax.Array,
                temperature: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Token number `index[b]` of row b from row b's own key, one static top-k / top-p for the
    batch: `sampling.sample_request_rows` (the one plain-decoding sampler) with its candidate
    cap set from `top_k`."""
    return sample_request_rows(key_data, index, logits, temperature, top_k, top_p,
                               top_k_cap=top_k_cap_for(top_k, logits.shape[-1]))


def row_key_data(seed: int, batch: int) -> jax.Array:
    """[B, 2] uint32 per-row keys derived from one seed."""
    return jax.random.key_data(jax.random.split(jax.random.key(seed, impl="threefry2x32"), batch))


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_cache: int | None,
                max_new_tokens: int, bucket: int = 64) -> tuple[np.ndarray, np.ndarray, int]:
    """Right-pads prompts to a bucketed length; validates them; returns (tokens, lens, cache len)."""
    if not prompts:
        raise ValueError("no prompts given")
    lens = []
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        arr = np.asarray(p)
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        lens.append(len(p))
    P = round_up(max(lens), bucket)
    need = round_up(max(lens) + max_new_tokens + 1, bucket)
    cache_len = max_cache or need
    if max(lens) + max_new_tokens > cache_len:
        i = int(np.argmax(lens))
        raise ValueError(f"prompt {i} ({lens[i]} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the cache length {cache_len}")
    tokens = np.zeros((len(prompts), min(P, cache_len)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens, np.asarray(lens, np.int32), cache_len


def empty_state(target: Any, key_data: jax.Array, *, cache_len: int, max_new: int,
                layer_buffers: bool | None = None) -> ARState:
    """A state of B = len(key_data) rows with nothing prefilled: every row done (a row starts
    when `ar_prefill_rows` prefills it; one it never prefills stays done: padding). The cache
    takes the layout of `target.decoding_layout(layer_buffers)`, which the steps run on; where
    its weights span a mesh of several devices, the rows lie on it as the serving engine's
    slots do (`placement.place_slots`)."""
    B = key_data.shape[0]
    stepper = target.decoding_layout(layer_buffers)
    return place_slots(ARState(cache=stepper.init_cache(B, cache_len),
                               last_token=jnp.zeros((B,), jnp.int32),
                               out=jnp.full((B, max_new), -1, jnp.int32),
                               num_out=jnp.zeros((B,), jnp.int32), done=jnp.ones((B,), bool),
                               key_data=jnp.asarray(key_data), steps=jnp.zeros((), jnp.int32)),
                       weights_mesh(stepper.state))


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk", "top_k", "top_p"),
                   donate_argnames=("s",))
@with_precision_policy
def ar_prefill_rows(graphdef: Any, state: Any, s: ARState, tokens: jax.Array, lens: jax.Array,
                    rows: jax.Array, temperature: jax.Array, stop_ids: jax.Array, *,
                    chunk: int, top_k: int = 0, top_p: float = 1.0) -> ARState:
    """Prefills n prompts `tokens` [n, P] (right-padded, `lens` [n]) into rows `rows` [n] of
    the state (a row ≥ B is padding: nothing written) and samples each row's first token
    (token 0 of its own key). One dense causal forward over [n, P] (`models.decoder.prefill`,
    in chunks of `chunk` tokens past it), its K/V rows moved into the cache
    (`KVCache.put_rows`): the cost of these prompts alone, padded to their own group's length."""
    model = nnx.merge(graphdef, state)
    n = tokens.shape[0]
    B, max_new = s.out.shape
    with model_precision(model):
        out = prefill(model, tokens, chunk, cache_dtype=jax.tree.leaves(s.cache.k)[0].dtype)
        logits = model.logits(out.hidden[jnp.arange(n), lens - 1])              # [n, V]
    first = sample_rows(s.key_data[jnp.clip(rows, 0, B - 1)], jnp.zeros((n,), jnp.int32),
                        logits, temperature, top_k, top_p)
    done = is_stop(first, stop_ids) | (max_new <= 1)
    return s.replace(cache=s.cache.put_rows(out.cache, rows, lens),
                     last_token=s.last_token.at[rows].set(first, mode="drop"),
                     out=s.out.at[rows, 0].set(first, mode="drop"),
                     num_out=s.num_out.at[rows].set(1, mode="drop"),
                     done=s.done.at[rows].set(done, mode="drop"))


def prefilled_state(target: Any, prompts: Sequence[Sequence[int]], key_data: Any,
                    temperature: jax.Array, stop_ids: jax.Array, *, cache_len: int,
                    max_new: int, top_k: int = 0, top_p: float = 1.0, rows: int | None = None,
                    len_bucket: int = 64, chunk: int = 128,
                    prefill_tokens: int = PREFILL_TOKENS,
                    layer_buffers: bool | None = None) -> ARState:
    """The decoding state after prefilling every prompt: `rows` (default len(prompts)) rows,
    prompt i in row i with key `key_data[i]` ([rows, 2]; rows past the prompts stay done).
    The prompts are prefilled in length groups (`prefill_plan.prefill_groups`, the serving
    engine's joins): one group of everything would pad every prompt to the longest (16 chat
    prompts of 41-308 tokens: 5,120 positions computed for 1,305), each of at most
    `prefill_tokens` padded tokens a slot shard (one longer prompt alone; on a mesh, as the
    serving engine's joins: `placement.prefill_call_tokens`), which bounds the memory a call
    holds beside the cache."""
    B = len(prompts) if rows is None else rows
    target = target.decoding_layout(layer_buffers)    # the steps' weights, read once
    s = empty_state(target, jnp.asarray(key_data), cache_len=cache_len, max_new=max_new,
                    layer_buffers=layer_buffers)
    lengths = [len(p) for p in prompts]
    for idx in prefill_groups(lengths, B, len_bucket, chunk, cache_len,
                              max_tokens=prefill_call_tokens(prefill_tokens,
                                                             weights_mesh(target.state))):
        n = pow2_rows(len(idx))
        P = prefill_length(max(lengths[i] for i in idx), len_bucket, chunk, cache_len)
        tokens = np.zeros((n, P), np.int32)
        lens = np.ones((n,), np.int32)
        where = np.full((n,), B, np.int32)     # B: a padding row, dropped
        for j, i in enumerate(idx):
            tokens[j, :lengths[i]], lens[j], where[j] = prompts[i], lengths[i], i
        s = ar_prefill_rows(target.graphdef, target.state, s, jnp.asarray(tokens),
                            jnp.asarray(lens), jnp.asarray(where), temperature, stop_ids,
                            chunk=min(P, chunk), top_k=top_k, top_p=top_p)
    return s


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "top_p"),
                   donate_argnames=("s",))
@with_precision_policy
def ar_decode(graphdef: Any, state: Any, s: ARState, temperature: jax.Array,
              stop_ids: jax.Array, *, num_steps: int | jax.Array, top_k: int = 0,
              top_p: float = 1.0) -> ARState:
    """Runs up to `num_steps` decode steps on device (stops early when all requests are done).
    `num_steps` is traced: changing it does not recompile."""
    model = nnx.merge(graphdef, state)
    max_new = s.out.shape[1]
    B = s.out.shape[0]
    start = s.steps

    def cond(s: ARState):
        return jnp.any(~s.done) & (s.steps - start < num_steps)

    def body(s: ARState) -> ARState:
        with model_precision(model):
            hidden, cache = decode_one(model, s.last_token, s.cache, ~s.done)
            logits = model.logits(hidden)
        nxt = sample_rows(s.key_data, s.num_out, logits, temperature, top_k, top_p)
        active = ~s.done
        buf = s.out.at[jnp.arange(B), jnp.minimum(s.num_out, max_new - 1)].set(
            jnp.where(active, nxt, s.out[jnp.arange(B), jnp.minimum(s.num_out, max_new - 1)]))
        num_out = s.num_out + active.astype(jnp.int32)
        done = s.done | (active & is_stop(nxt, stop_ids)) | (num_out >= max_new)
        return ARState(cache=cache, last_token=jnp.where(active, nxt, s.last_token), out=buf,
                       num_out=num_out, done=done, key_data=s.key_data, steps=s.steps + 1)

    return jax.lax.while_loop(cond, body, s)


def autoregressive_generate(target: Any, prompts: Sequence[Sequence[int]], *,
                            max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                            stop_token_ids: Sequence[int] | None = None, top_k: int = 0,
                            top_p: float = 1.0, max_cache_len: int | None = None,
                            steps_per_call: int | None = None,
                            progress: bool = False,
                            layer_buffers: bool | None = None) -> list[list[int]]:
    """Generates up to `max_new_tokens` per prompt (token-id lists); returns the new ids.

    Generation of a request stops after its first stop token (included in the output).
    `stop_token_ids=None` uses the tokenizer's stop ids (or the config's eos); [] disables.
    The prefill and the decode steps run on `target.decoding_layout(layer_buffers)` (default:
    the layout of the devices the weights live on).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)
    cfg = target.config
    default_stops = (getattr(target.tokenizer, "stop_token_ids", None) or cfg.stop_token_ids)
    stops = stop_array(stop_token_ids, default_stops)
    _, _, cache_len = pad_prompts(prompts, cfg.vocab_size, max_cache_len, max_new_tokens)
    temp = jnp.asarray(temperature, jnp.float32)
    stepper = target.decoding_layout(layer_buffers)
    per_call = steps_per_call or max_new_tokens
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, desc="generate", unit="tok")
    # weights spread over a mesh: the programs are traced under it, kernels in `shard_map`
    with use_mesh(weights_mesh(stepper.state)):
        s = prefilled_state(target, prompts, row_key_data(seed, len(prompts)), temp, stops,
                            cache_len=cache_len, max_new=max_new_tokens, top_k=top_k,
                            top_p=top_p, layer_buffers=layer_buffers)
        if bar is not None:
            bar.update(1)
        while not bool(jnp.all(s.done)):
            before = int(s.steps)
            s = ar_decode(stepper.graphdef, stepper.state, s, temp, stops, num_steps=per_call,
                          top_k=top_k, top_p=top_p)
            if bar is not None:
                bar.update(int(s.steps) - before)
    if bar is not None:
        bar.close()
    out, num = np.asarray(s.out), np.asarray(s.num_out)
    return [out[i, :num[i]].tolist() for i in range(len(prompts))]
