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
