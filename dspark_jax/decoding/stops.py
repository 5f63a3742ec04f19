"""Stop tokens of a request (SPEC §1 step 6; DeepSpec's evaluator stops at the first stop token
among the emitted tokens, which is kept in the output).

The stop ids are a static-shape array padded with −1 (never a token id), so that a compiled
decoding step serves any set of stop tokens.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def stop_array(stop_token_ids: Sequence[int] | None, default: Sequence[int]) -> jax.Array:
    """The stop ids [n + 1] int32 ending in −1: `stop_token_ids`, or `default` (the tokenizer's
    or the config's stop ids) when None; [] disables stopping."""
    ids = list(default if stop_token_ids is None else stop_token_ids)
    return jnp.asarray(ids + [-1], jnp.int32)


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens [...] ∈ stop_ids [n] (padded with −1)."""
    return jnp.any(tokens[..., None] == stop_ids, axis=-1)
