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


def test_per_layer_rows_write_as_the_stacked_rows():
    """The new rows as each layer's own buffer [1, T, Kh, H] (as the layers make them) land
    where the stacked rows do, in the kernel and the oracle alike."""
    ck, cv, rows, pos, kn, vn = _inputs()
    per_layer = lambda x: tuple(x[i][None] for i in range(x.shape[0]))  # noqa: E731
    want_k, want_v = ref_write_rows(ck, cv, rows, pos, kn, vn)
    for fn in (ref_write_rows, lambda *a: write_rows(*a, interpret=True)):
        got_k, got_v = fn(ck, cv, rows, pos, per_layer(kn), per_layer(vn))
        for g, w in zip(got_k + got_v, want_k + want_v):
            np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match="both be stacked or both per layer"):
        write_rows(ck, cv, rows, pos, per_layer(kn), vn, interpret=True)
    with pytest.raises(ValueError, match=r"buffers \[1, T, Kh, H\]"):
        write_rows(ck, cv, rows, pos, per_layer(kn)[:2], per_layer(vn), interpret=True)


def test_bad_shapes():
    ck, cv, rows, pos, kn, vn = _inputs()
    with pytest.raises(ValueError, match="one each a layer"):
        write_rows(ck, cv[:2], rows, pos, kn, vn, interpret=True)
    with pytest.raises(ValueError, match=r"\[L, T, Kh, H\]"):
        write_rows(ck, cv, rows, pos, kn[:, :2], vn, interpret=True)
