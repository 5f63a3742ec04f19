"""`pallas_kernels.cache_write.write_rows` (interpreted) against its oracle: every layer's K and
V rows land at their (row, position), out-of-range tokens are dropped, every other position
keeps its value; Kh not a power of two; bad shapes refused."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cache_write import ref_write_rows, write_rows


def _inputs(L=3, B=2, S=16, Kh=3, H=16, T=5, seed=0):
    rng = np.random.RandomState(seed)
    cache = lambda: tuple(jnp.asarray(rng.randn(1, B, S, Kh, H), jnp.float32)  # noqa: E731
                          for _ in range(L))
    new = lambda: jnp.asarray(rng.randn(L, T, Kh, H), jnp.float32)  # noqa: E731
    rows = jnp.asarray([0, 1, 1, B, 0], jnp.int32)[:T]        # row B: padding, dropped
    pos = jnp.asarray([3, 0, S - 1, 2, S], jnp.int32)[:T]     # position S: past the cache
    return cache(), cache(), rows, pos, new(), new()


def test_matches_the_oracle():
    args = _inputs()
    want_k, want_v = ref_write_rows(*args)
    got_k, got_v = write_rows(*args, interpret=True)
    for g, w, old in zip(got_k + got_v, want_k + want_v, args[0] + args[1]):
        np.testing.assert_array_equal(g, w)
        assert not np.array_equal(g, old)                    # something was written
    # the dropped tokens left their would-be places alone
    np.testing.assert_array_equal(got_k[0][0, 0, 15], args[0][0][0, 0, 15])


def test_bad_shapes():
    ck, cv, rows, pos, kn, vn = _inputs()
    with pytest.raises(ValueError, match="one each a layer"):
        write_rows(ck, cv[:2], rows, pos, kn, vn, interpret=True)
    with pytest.raises(ValueError, match=r"\[L, T, Kh, H\]"):
        write_rows(ck, cv, rows, pos, kn[:, :2], vn, interpret=True)
