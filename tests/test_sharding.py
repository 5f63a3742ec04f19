"""Topology-aware meshes (8 fake CPU devices; a 2-slice TPU topology when libtpu is installed)."""

import dataclasses
import importlib.util

import jax
import numpy as np
import pytest

from dspark_jax.sharding import make_mesh, select_devices

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def test_mesh_uses_every_device_once():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    ids = sorted(d.id for d in mesh.devices.flat)
    assert ids == sorted(d.id for d in jax.devices())
    assert make_mesh(fsdp=4).shape["data"] == 2


def test_bad_mesh_shapes_are_errors():
    with pytest.raises(ValueError, match="fsdp\\*tensor"):
        make_mesh(fsdp=3)
    with pytest.raises(ValueError, match="does not match"):
        make_mesh(data=3, fsdp=2)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def test_select_devices_keeps_every_process():
    devs = [FakeDevice(i, i // 4) for i in range(8)]          # 2 processes × 4 devices
    picked = select_devices(4, devs)
    assert [d.id for d in picked] == [0, 1, 4, 5]             # not [0, 1, 2, 3]: process 1 stays
    assert {d.process_index for d in picked} == {0, 1}
    assert select_devices(-1, devs) == devs
    with pytest.raises(ValueError, match="multiple of the 2 processes"):
        select_devices(3, devs)
    with pytest.raises(ValueError, match="num_devices=9"):
        select_devices(9, devs)


@pytest.mark.tpu
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install -e '.[tpu]') for a TPU "
                    "topology on CPU")
def test_two_slices_put_data_parallelism_over_dcn():
    from dspark_jax.aot.topology import topology_devices

    devs = topology_devices("v5e:2x2", num_slices=2)
    mesh = make_mesh(data=2, fsdp=2, tensor=2, devices=devs)
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    # each data row is one whole slice: fsdp/tensor collectives never cross DCN
    assert (slices[0] == 0).all() and (slices[1] == 1).all()
    with pytest.raises(ValueError, match="multiple of the 2 slices"):
        make_mesh(data=1, fsdp=8, devices=devs)


def test_kernel_specs_split_a_name_alike_or_not_at_all():
    """One mesh entry per logical name for all of a kernel's arguments: batch over (data,
    fsdp) where every argument's batch divides by 4, KV heads over tensor; a dimension one
    argument cannot split stays whole in all of them."""
    from dspark_jax.sharding import kernel_specs

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    q, kv = ("batch", "seq", "kv_heads", None, "head_dim"), ("batch", "seq", "kv_heads", "head_dim")
    got = kernel_specs([(8, 16, 2, 2, 8), (8, 16, 2, 8)], [q, kv], mesh)
    assert got["batch"] == ("data", "fsdp") and got["kv_heads"] == "tensor"
    assert got["seq"] is None and got["head_dim"] is None
    # 6 rows do not split 4 ways; 3 KV heads do not split 2 ways in the second argument
    got = kernel_specs([(8, 16, 2, 2, 8), (6, 16, 3, 8)], [q, kv], mesh)
    assert got["batch"] is None and got["kv_heads"] is None


def test_shard_kernel_maps_over_the_active_mesh_only():
    """Without an active mesh the function is called as it is; under one it runs in shard_map
    on each device's block, and its result equals the unsharded call."""
    import jax.numpy as jnp

    from dspark_jax.sharding import shard_kernel, use_mesh

    x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)
    seen = []

    def fn(a):
        seen.append(a.shape)
        return a * 2.0

    axes = [("batch", None)]
    np.testing.assert_array_equal(shard_kernel(fn, (x,), axes, ("batch", None)), x * 2.0)
    assert seen == [(8, 4)]
    with use_mesh(make_mesh(data=2, fsdp=2, tensor=2)):
        out = jax.jit(lambda a: shard_kernel(fn, (a,), axes, ("batch", None)))(x)
    assert seen[-1] == (2, 4)                                  # a quarter of the rows a device
    np.testing.assert_array_equal(out, x * 2.0)
