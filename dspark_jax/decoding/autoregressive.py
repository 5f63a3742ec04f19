"""Plain batched autoregressive decoding: the baseline speculative decoding must equal (SPEC §1).

A static-shape state machine: ragged prompts are right-padded and prefilled into a KV cache
with per-request lengths, then an on-device `lax.while_loop` decodes one token per request per
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

from dspark_jax.decoding.sampling import sample_request_rows, top_k_cap_for
from dspark_jax.decoding.stops import is_stop, stop_array
from dspark_jax.models.decoder import KVCache, init_cache


def round_up(x: int, m: int) -> int:
    return ((x + m - 1) // m) * m


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


def _prefill(model: Any, tokens: jax.Array, lens: jax.Array, key_data: jax.Array,
             temperature: jax.Array, stop_ids: jax.Array, active: jax.Array | None, *,
             cache_len: int, max_new: int, top_k: int, top_p: float) -> ARState:
    B = tokens.shape[0]
    cache = init_cache(model.cfg, B, cache_len, model.dtype)
    out = model(tokens, cache=cache)
    last_h = out.hidden[jnp.arange(B), lens - 1]  # [B, D]
    first = sample_rows(key_data, jnp.zeros((B,), jnp.int32), model.logits(last_h), temperature,
                        top_k, top_p)
    buf = jnp.full((B, max_new), -1, jnp.int32).at[:, 0].set(first)
    done = is_stop(first, stop_ids) | (max_new <= 1)
    if active is not None:
        done = done | ~active
    return ARState(cache=out.cache.with_lengths(lens), last_token=first, out=buf,
                   num_out=jnp.ones((B,), jnp.int32), done=done, key_data=key_data,
                   steps=jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len", "max_new", "top_k",
                                             "top_p"))
def ar_prefill(graphdef: Any, state: Any, tokens: jax.Array, lens: jax.Array,
               key_data: jax.Array, temperature: jax.Array, stop_ids: jax.Array,
               active: jax.Array | None = None, *, cache_len: int, max_new: int,
               top_k: int = 0, top_p: float = 1.0) -> ARState:
    """Prefill + the first sampled token. `active` [B] marks real rows (padding rows start
    done); `key_data` [B, 2] holds one key per row."""
    return _prefill(nnx.merge(graphdef, state), tokens, lens, key_data, temperature, stop_ids,
                    active, cache_len=cache_len, max_new=max_new, top_k=top_k, top_p=top_p)


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "top_p"),
                   donate_argnames=("s",))
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
        out = model(s.last_token[:, None], cache=s.cache, advance=(~s.done).astype(jnp.int32))
        nxt = sample_rows(s.key_data, s.num_out, model.logits(out.hidden[:, 0]), temperature,
                          top_k, top_p)
        active = ~s.done
        buf = s.out.at[jnp.arange(B), jnp.minimum(s.num_out, max_new - 1)].set(
            jnp.where(active, nxt, s.out[jnp.arange(B), jnp.minimum(s.num_out, max_new - 1)]))
        num_out = s.num_out + active.astype(jnp.int32)
        done = s.done | (active & is_stop(nxt, stop_ids)) | (num_out >= max_new)
        return ARState(cache=out.cache, last_token=jnp.where(active, nxt, s.last_token), out=buf,
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
    The decode steps run on `target.decoding_layout(layer_buffers)` (default: one buffer per
    layer on XLA:CPU), the prefill on the stacked layers.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be ≥ 1")
    cfg = target.config
    default_stops = (getattr(target.tokenizer, "stop_token_ids", None) or cfg.stop_token_ids)
    stops = stop_array(stop_token_ids, default_stops)
    tokens, lens, cache_len = pad_prompts(prompts, cfg.vocab_size, max_cache_len, max_new_tokens)
    temp = jnp.asarray(temperature, jnp.float32)
    s = ar_prefill(target.graphdef, target.state, jnp.asarray(tokens), jnp.asarray(lens),
                   row_key_data(seed, len(prompts)), temp, stops, cache_len=cache_len,
                   max_new=max_new_tokens, top_k=top_k, top_p=top_p)
    per_call = steps_per_call or max_new_tokens
    stepper = target.decoding_layout(layer_buffers)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, desc="generate", unit="tok")
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
