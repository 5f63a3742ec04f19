"""Where a decoding state's arrays live when the target's weights span several devices (SPEC
§9: the serving engine on a TPU slice or a GPU host, and the autoregressive loop beside it).

The weights keep the mesh they were loaded on (`load_target(mesh=...)`, FSDP × tensor by
`sharding.LOGICAL_RULES`). The request slots follow them: the KV caches [L, R, S, Kh, H] split
their slots over (data, fsdp) and their heads over tensor, the small per-slot arrays ([R],
[R, D], ...) their slots, and whatever does not divide stays replicated. The engine and the
autoregressive loop lay their state out by `slot_sharding` and trace their programs under the
mesh (`sharding.use_mesh`), so each kernel runs inside `shard_map` on its own slots and heads;
`aot --decode --topology` compiles the same programs with the same rule.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from dspark_jax.sharding import logical_to_spec, named, put_on_mesh

# a KV cache layer's logical axes ([L or 1, R, S, Kh, H])
CACHE_AXES = (None, "batch", "cache_seq", "kv_heads", "head_dim")


def slot_sharding(x: Any, mesh: Mesh) -> NamedSharding:
    """The sharding of one array of a decoding state on `mesh`: a KV cache layer's slots over
    (data, fsdp) and heads over tensor; an array of rows ([R], [R, D], …) its rows over (data,
    fsdp); a scalar replicated; a dimension the mesh does not divide stays whole."""
    shape = tuple(x.shape)
    axes = CACHE_AXES if len(shape) == 5 else (
        ("batch",) + (None,) * (len(shape) - 1) if shape else ())
    return named(mesh, axes, shape)


def slot_shards(mesh: Mesh | None) -> int:
    """How many parts `slot_sharding` splits the request slots into on `mesh` (the mesh axes
    the logical "batch" axis maps to: data × fsdp); 1 without a mesh."""
    if mesh is None:
        return 1
    axes = logical_to_spec(("batch",))[0] or ()
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def prefill_call_tokens(prefill_tokens: int, mesh: Mesh | None) -> int:
    """The most padded tokens one prefill call takes (`EngineSettings.prefill_tokens` a slot
    shard): each part of the slots holds its own rows' fresh cache and features, so a call
    on a mesh takes as many tokens a chip as one device takes."""
    return int(prefill_tokens) * slot_shards(mesh)


def place_slots(tree: Any, mesh: Mesh | None) -> Any:
    """`tree` (a decoding state: the engine's, the autoregressive loop's) laid on `mesh` by
    `slot_sharding`, also where the mesh spans several processes (`sharding.put_on_mesh`:
    every process holds the same host-local state); unchanged without a mesh."""
    if mesh is None:
        return tree
    return put_on_mesh(tree, jax.tree.map(lambda x: slot_sharding(x, mesh), tree))


__all__ = ["CACHE_AXES", "place_slots", "prefill_call_tokens", "slot_shards", "slot_sharding"]
