"""`layers.attend` for one query per row (the decode path) equals the batched-dot path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import layers as L


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_query_attend_matches_the_einsum_path(dtype):
    B, S, N, K, H = 3, 11, 6, 2, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, 1, N, H), dtype)
    k = jax.random.normal(ks[1], (B, S, K, H), dtype)
    v = jax.random.normal(ks[2], (B, S, K, H), dtype)
    lens = jnp.asarray([4, S, 0])                        # the last row sees nothing: zeros
    mask = jnp.arange(S)[None, None, :] < lens[:, None, None]          # [B, 1, S]
    one = L.attend(q, k, v, mask, scale=0.3, one_query_reduce=True)
    # the same query twice takes the T > 1 (einsum) path; its first row is the reference
    two = L.attend(jnp.concatenate([q, q], 1), k, v, jnp.concatenate([mask, mask], 1), scale=0.3)
    assert one.shape == (B, 1, N, H) and one.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(one, np.float32), np.asarray(two[:, :1], np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(one[2], np.float32), 0.0)
