"""Device mesh and logical-axis rules: the one place that maps model axes to mesh axes.

Every parameter carries logical axis names in its `axes` metadata (e.g. ("embed", "mlp")) and
the main activations are constrained with `constrain(x, ("batch", "seq", "act_embed"))`. Which
mesh axis (data / fsdp / tensor) a logical axis lands on is decided only by `LOGICAL_RULES`
here, so moving from one host to a TPU pod changes the mesh shape, not the model code.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("cache_seq", None),
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("act_embed", None),
    ("mlp", "tensor"),
    ("act_mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("features", "fsdp"),
    ("rank", None),
    ("norm", None),
)

_active_mesh: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("mesh", default=None)


def select_devices(num_devices: int = -1,
                   devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """`num_devices` devices (-1: all), taken evenly from every process so that no process is
    left without a device of the mesh (a process with none could not feed its batch shard)."""
    devices = list(devices if devices is not None else jax.devices())
    if num_devices == -1 or num_devices == len(devices):
        return devices
    if not 0 < num_devices <= len(devices):
        raise ValueError(f"num_devices={num_devices} but {len(devices)} devices exist")
    by_proc: dict[int, list[jax.Device]] = {}
    for d in devices:
        by_proc.setdefault(d.process_index, []).append(d)
    n_proc = len(by_proc)
    if num_devices % n_proc:
        raise ValueError(f"num_devices={num_devices} must be a multiple of the {n_proc} "
                         "processes (every process keeps the same number of devices)")
    per = num_devices // n_proc
    return [d for p in sorted(by_proc) for d in by_proc[p][:per]]


def _num_slices(devices: Sequence[jax.Device]) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh laid out on the physical topology; `data=-1` takes all
    remaining devices.

    One slice: `mesh_utils.create_device_mesh` (ICI-aware placement on TPU, device order
    elsewhere). Several slices (devices with distinct `slice_index`): `create_hybrid_device_mesh`
    with data parallelism across slices over DCN and fsdp/tensor (and the rest of `data`) inside
    each slice.
    """
    from jax.experimental import mesh_utils

    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    if data == -1:
        if n % (fsdp * tensor):
            raise ValueError(f"{n} devices are not divisible by fsdp*tensor={fsdp * tensor}")
        data = n // (fsdp * tensor)
    if data * fsdp * tensor != n:
        raise ValueError(f"mesh {data}x{fsdp}x{tensor} does not match {n} devices")
    slices = _num_slices(devices)
    if slices > 1:
        if data % slices:
            raise ValueError(f"mesh data={data} must be a multiple of the {slices} slices "
                             "(data parallelism spans the slices over DCN)")
        grid = mesh_utils.create_hybrid_device_mesh((data // slices, fsdp, tensor),
                                                    (slices, 1, 1), devices,
                                                    allow_split_physical_axes=True)
    else:
        grid = mesh_utils.create_device_mesh((data, fsdp, tensor), devices,
                                             allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES)


def logical_to_spec(axes: Sequence[str | None] | None,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> P:
    """Maps logical axis names to a PartitionSpec; a mesh axis is used at most once."""
    if axes is None:
        return P()
    table = dict(rules)
    used: set[str] = set()
    out: list[Any] = []
    for name in axes:
        mesh_axes = table.get(name) if name is not None else None
        if mesh_axes is None:
            out.append(None)
            continue
        cand = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        cand = tuple(a for a in cand if a not in used)
        used.update(cand)
        out.append(cand[0] if len(cand) == 1 else (cand or None))
    return P(*out)


def _fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Drops mesh axes that do not divide the dimension (tiny test models, odd vocabularies)."""
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if entry is None:
            out.append(None)
            continue
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        size = int(np.prod([mesh.shape[a] for a in names]))
        out.append(entry if dim % size == 0 else None)
    return P(*out)


def _shape(x: Any) -> tuple[int, ...]:
    """Shape of an array or of an abstract jax.ShapeDtypeStruct (ahead-of-time compilation)."""
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def state_shardings(state: Any, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
    """NamedShardings for an nnx.State (or any pytree of Variables) from their `axes` metadata."""

    def one(v: Any) -> NamedSharding:
        if isinstance(v, nnx.Variable):
            axes = v.get_metadata().get("axes")
            shape = _shape(v.get_value())
        else:
            axes, shape = None, _shape(v)
        return NamedSharding(mesh, _fit_spec(logical_to_spec(axes, rules), shape, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_on_mesh(state: Any, mesh: Mesh,
                     rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
    """The same tree with every array (or nnx.Variable's value) replaced by a
    jax.ShapeDtypeStruct carrying its `state_shardings` sharding: an input for `jit(...).lower`
    that allocates nothing (ahead-of-time compilation)."""

    def one(v: Any, sh: NamedSharding) -> Any:
        x = v.get_value() if isinstance(v, nnx.Variable) else v
        out = jax.ShapeDtypeStruct(_shape(x), x.dtype, sharding=sh)
        return v.replace(out) if isinstance(v, nnx.Variable) else out

    return jax.tree.map(one, state, state_shardings(state, mesh, rules),
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def named(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
    spec = logical_to_spec(axes)
    if shape is not None:
        spec = _fit_spec(spec, shape, mesh)
    return NamedSharding(mesh, spec)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[Mesh | None]:
    """Activates `mesh` for `constrain` calls traced inside the block."""
    token = _active_mesh.set(mesh)
    try:
        yield mesh
    finally:
        _active_mesh.reset(token)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names; a no-op when no mesh is active."""
    mesh = _active_mesh.get()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named(mesh, axes, x.shape))


def active_mesh() -> Mesh | None:
    """The mesh `use_mesh` activated for the code being traced, or None."""
    return _active_mesh.get()


def weights_mesh(tree: Any) -> Mesh | None:
    """The mesh of several devices every array of `tree` (e.g. a model's weights) is laid on
    by a `NamedSharding`, or None (one device, arrays on different meshes, or abstract
    values)."""
    meshes = set()
    for x in jax.tree.leaves(tree):
        # a traced array has no sharding to read (AttributeError): abstract, as is a non-array
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        if not isinstance(sharding, NamedSharding):
            return None
        meshes.add(sharding.mesh)
    if len(meshes) != 1:
        return None
    mesh = meshes.pop()
    return mesh if mesh.size > 1 else None


def on_several_devices() -> bool:
    """Whether the code being traced runs under a mesh of more than one device (where a kernel
    needs `shard_kernel`, or its caller XLA's ops)."""
    mesh = _active_mesh.get()
    return mesh is not None and mesh.size > 1


Axes = Sequence[str | None]


def kernel_specs(shapes: Sequence[Sequence[int]], axes: Sequence[Axes], mesh: Mesh
                 ) -> dict[str, Any]:
    """logical axis name → the mesh axes (or None) that split it for one kernel call: the
    `LOGICAL_RULES` entry where it divides that dimension of every argument that carries the
    name, else None (that dimension is whole on every device). One entry per name, so the
    arguments and the outputs of the call are split alike."""
    chosen: dict[str, Any] = {}
    for shape, names in zip(shapes, axes):
        spec = _fit_spec(logical_to_spec(names), shape, mesh)
        for name, entry in zip(names, tuple(spec) + (None,) * (len(names) - len(spec))):
            if name is not None:
                chosen[name] = entry if chosen.get(name, entry) == entry else None
    return chosen


def shard_kernel(fn: Callable[..., Any], args: Sequence[jax.Array], in_axes: Sequence[Axes],
                 out_axes: Any) -> Any:
    """`fn(*args)` for a Pallas / Mosaic / Triton kernel (or code around one) traced inside a
    sharded program: run in `jax.shard_map` over the mesh `use_mesh` activated, each argument
    split by its logical axes (`in_axes`, one tuple of names per argument; `out_axes` the same
    for the output, or a tuple of them for several outputs) as `LOGICAL_RULES` splits the
    activations around it. XLA cannot partition a kernel's custom call (a Mosaic kernel under
    automatic partitioning does not compile; a Triton one is gathered whole to every device),
    while in `shard_map` each device runs the kernel on its own rows and heads with no
    collective in front of it. A dimension no rule splits evenly stays whole on every device.
    `fn` must compute each output block from the same blocks of the arguments: batch rows and
    heads, never a reduction across a split axis. Without an active mesh of several devices,
    `fn(*args)` as it is."""
    if not on_several_devices():
        return fn(*args)
    mesh = _active_mesh.get()
    chosen = kernel_specs([a.shape for a in args], in_axes, mesh)

    def spec(names: Axes) -> P:
        return P(*(chosen.get(n) if n is not None else None for n in names))

    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(n, (str, type(None)))  # noqa: E731
                                                    for n in x)
    out_specs = jax.tree.map(spec, out_axes, is_leaf=is_axes)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(a) for a in in_axes),
                           out_specs=out_specs, check_vma=False)
    return mapped(*args)


def put_on_mesh(tree: Any, shardings: Any) -> Any:
    """`jax.device_put(tree, shardings)` that also works when the mesh spans several processes:
    a host-local value (the same on every process, e.g. a seeded init) is cut into this
    process's shards with `make_array_from_callback`; global arrays are resharded; PRNG keys
    travel as their key data."""

    def one(x: Any, sh: NamedSharding) -> Any:
        if sh.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sh)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = one(jax.random.key_data(x), sh)
            wrap = functools.partial(jax.random.wrap_key_data, impl=jax.random.key_impl(x))
            return jax.jit(wrap, out_shardings=sh)(data)
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    # `shardings` may be a prefix of `tree` (one sharding per nnx.Variable, as state_shardings)
    return jax.tree.map(lambda sh, sub: jax.tree.map(lambda x: one(x, sh), sub), shardings, tree)
