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


@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_context_rows_match_the_oracle(normed, dtype):
    """A drafter's context rows (`write_context_rows`, interpreted): each layer's keys normed
    by its own k norm (or not) and rotated, its values as they are, at their (row, position);
    the out-of-range tokens dropped; Kh = 3 (not a power of two); fp32 and bf16 caches; the
    keys rotated at the positions they are written to."""
    L, B, S, Kh, H, T = 3, 2, 16, 3, 32, 5
    rng = np.random.RandomState(1)
    ck, cv, rows, pos, _, _ = _inputs(L=L, B=B, S=S, Kh=Kh, H=H, T=T)
    ck, cv = (tuple(c.astype(dtype) for c in cs) for cs in (ck, cv))
    kv = jnp.asarray(rng.randn(T, L, 2, Kh, H), dtype)
    norms = tuple(jnp.asarray(1 + 0.1 * rng.randn(H), dtype) for _ in range(L)) if normed else None
    inv_freq = jnp.asarray(0.3 / (1.0 + np.arange(H // 2)), jnp.float32)
    from pallas_kernels.cache_write import ref_write_context_rows, write_context_rows
    want = ref_write_context_rows(ck, cv, rows, pos, kv, norms, inv_freq, eps=1e-6)
    got = write_context_rows(ck, cv, rows, pos, kv, norms, inv_freq, eps=1e-6, interpret=True)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for g, w, old in zip(got[0] + got[1], want[0] + want[1], ck + cv):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=tol, rtol=tol)
        assert not np.array_equal(np.asarray(g, np.float32), np.asarray(old, np.float32))
    # token 0 (row 0, position 3): its keys rotated at their position, not the product's rows
    raw = np.asarray(kv[0, 0, 0], np.float32)
    assert not np.allclose(np.asarray(got[0][0][0, 0, 3], np.float32), raw, atol=1e-3)
    with pytest.raises(ValueError, match=r"\[T, L, 2, Kh, H\]"):
        write_context_rows(ck, cv, rows, pos, kv[:, :2], norms, inv_freq, eps=1e-6,
                           interpret=True)
