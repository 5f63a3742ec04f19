"""The matmul precision policy of decoding: one explicit precision per compute dtype, so that a
verification block and a one-token step compute the target's logits alike (SPEC §1: greedy
speculative decoding equals greedy autoregressive decoding).

Backends choose different default precisions for fp32 dots: XLA:GPU runs them in TF32 and TPUs
in one bf16 pass, and a [1, K] verification block then rounds differently from a [1, 1] step,
enough to flip a greedy token. Dots that compute in fp32 therefore run at HIGHEST (true fp32
products); bf16 dots at the backend's default, where the products are exact in the
accumulator.

The precision follows the dtype a model's dots compute in (`TargetDecoder.dtype`, the
drafters' `dtype`: the weights are cast to it before every dot), not the dtype its weights are
stored in, and each model gets its own: a decoding program is traced under the fp32 policy
(`with_precision_policy`: the sampling and scheduling arithmetic around the models), and each
model's forward inside it under its own compute dtype's (`model_precision`), so an fp32 drafter
beside a bf16 target runs its dots at HIGHEST and the target's at the default.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, TypeVar

import jax
import jax.numpy as jnp

F = TypeVar("F", bound=Callable[..., Any])

POLICY = {jnp.dtype(jnp.float32): "highest", jnp.dtype(jnp.float64): "highest"}


def matmul_precision(dtype: Any) -> str:
    """The policy's precision for dots computing in `dtype`: "highest" for fp32, else
    "default"."""
    return POLICY.get(jnp.dtype(dtype), "default")


def weights_dtype(tree: Any) -> Any:
    """The dtype of the first floating-point leaf of `tree` (a model state), or None."""
    for leaf in jax.tree.leaves(tree):
        dt = getattr(leaf, "dtype", None)
        if dt is not None and jnp.issubdtype(dt, jnp.floating):
            return dt
    return None


def compute_dtype(model: Any) -> Any:
    """The dtype `model`'s dots compute in: its `dtype` attribute (the target decoder's and the
    drafters' compute dtype), else the dtype of its first floating-point parameter."""
    dtype = getattr(model, "dtype", None)
    if dtype is not None:
        return jnp.dtype(dtype)
    from flax import nnx

    return weights_dtype(nnx.state(model))


@contextlib.contextmanager
def precision_for(dtype: Any) -> Iterator[None]:
    """Dots traced inside the block run at the policy's precision for compute dtype `dtype`."""
    with jax.default_matmul_precision(matmul_precision(dtype)):
        yield


def model_precision(model: Any) -> contextlib.AbstractContextManager[None]:
    """The block runs `model`'s forward: its dots are traced at the policy's precision for the
    model's compute dtype (`compute_dtype`)."""
    return precision_for(compute_dtype(model))


def with_precision_policy(fn: F) -> F:
    """Traces `fn` under the policy's fp32 precision (HIGHEST), which the decoding arithmetic
    outside the models (sampling, scheduling, tree bookkeeping) computes in; the models'
    forwards inside `fn` take their own compute dtype's precision (`model_precision`). Apply it
    under `jax.jit`, so that it acts while tracing and the lowered dots carry the precision."""
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with precision_for(jnp.float32):
            return fn(*args, **kwargs)

    return traced  # type: ignore[return-value]
