"""The matmul precision policy of decoding: one explicit precision per weight dtype, so that a
verification block and a one-token step compute the target's logits alike (SPEC §1: greedy
speculative decoding equals greedy autoregressive decoding).

Backends choose different default precisions for fp32 dots: XLA:GPU runs them in TF32 and TPUs
in one bf16 pass, and a [1, K] verification block then rounds differently from a [1, 1] step,
enough to flip a greedy token. fp32 weights therefore decode with HIGHEST (true fp32 products);
bf16 weights with the backend's default, where the products are exact in the accumulator and
the greedy tokens of a verification block and a one-token step can still differ at near-ties
(the accept rule is exact given the logits on each path).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp

F = TypeVar("F", bound=Callable[..., Any])

POLICY = {jnp.dtype(jnp.float32): "highest", jnp.dtype(jnp.float64): "highest"}


def matmul_precision(dtype: Any) -> str:
    """The policy's precision for dots over weights of `dtype`: "highest" for fp32, else
    "default"."""
    return POLICY.get(jnp.dtype(dtype), "default")


def weights_dtype(tree: Any) -> Any:
    """The dtype of the first floating-point leaf of `tree` (a model state), or None."""
    for leaf in jax.tree.leaves(tree):
        dt = getattr(leaf, "dtype", None)
        if dt is not None and jnp.issubdtype(dt, jnp.floating):
            return dt
    return None


def with_precision_policy(fn: F) -> F:
    """Traces `fn` under `matmul_precision` of its weights' dtype (the first floating-point
    leaf among its positional arguments: the model states come first). Apply it under
    `jax.jit`, so that it acts while tracing and the lowered dots carry the precision."""
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        dtype = weights_dtype(args)
        if dtype is None:
            return fn(*args, **kwargs)
        with jax.default_matmul_precision(matmul_precision(dtype)):
            return fn(*args, **kwargs)

    return traced  # type: ignore[return-value]
