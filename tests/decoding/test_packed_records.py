"""A call's round records in one packed int32 buffer (`round_types.PackedRecords`, the floats
by their bits): a round's record set as one row unpacks to the same fields, dtypes and values
(bools, ints, floats, negative and fractional; with and without the schedule), on device and on
the host."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.round_types import PackedRecords, RoundRecord


def _record(seed: int, R: int, gamma: int, scheduled: bool) -> RoundRecord:
    """One round's record of random values in each field's dtype."""
    zeros = jax.tree.map(lambda a: a[0], RoundRecord.zeros(1, R, gamma, gamma + 1, scheduled))
    leaves, tree = jax.tree.flatten(zeros)
    rng = np.random.RandomState(seed)
    out = []
    for a in leaves:
        if a.dtype == jnp.bool_:
            out.append(jnp.asarray(rng.rand(*a.shape) > 0.5))
        elif jnp.issubdtype(a.dtype, jnp.floating):
            out.append(jnp.asarray(rng.randn(*a.shape), a.dtype))
        else:
            out.append(jnp.asarray(rng.randint(-5, 1 << 20, a.shape), a.dtype))
    return jax.tree.unflatten(tree, out)


@pytest.mark.parametrize("scheduled", [True, False])
def test_records_set_a_row_and_unpack_to_the_same_fields(scheduled):
    R, gamma, rounds = 3, 4, 5
    stacked = jax.eval_shape(functools.partial(RoundRecord.zeros, rounds, R, gamma, gamma + 1,
                                               scheduled=scheduled))
    packed = PackedRecords.zeros(stacked)
    assert packed.data.dtype == jnp.int32 and packed.rounds == rounds
    written = {1: _record(1, R, gamma, scheduled), 3: _record(2, R, gamma, scheduled)}
    step = jax.jit(lambda p, i, r: p.set(i, r))
    for i, r in written.items():
        packed = step(packed, jnp.asarray(i), r)
    for unpacked in (packed.unpack(), jax.device_get(packed).unpack()):   # device; host
        for i in range(rounds):
            want = written.get(i, jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype),
                                               stacked))
            got = jax.tree.map(lambda a: a[i], unpacked)
            assert jax.tree.structure(got) == jax.tree.structure(want)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert g.dtype == w.dtype and g.shape == w.shape
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert (packed.unpack().schedule is None) == (not scheduled)
