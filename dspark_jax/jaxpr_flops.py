"""Matmul FLOPs of a traced function, loops counted (for the AOT report).

XLA's `cost_analysis()` counts a while-loop body once, whatever its trip count, so a step made of
scans (micro-batches, layers, anchor and key chunks) reports a small fraction of its work. This
walks the jaxpr instead: 2·M·N·K per `dot_general`, sub-jaxprs (jit, remat, custom VJP rules)
counted where they run, `scan` bodies times their length, a Pallas kernel's body times its grid
(a block a kernel skips, as causal flash attention does, counted as run; a loop inside a Triton
kernel's body counted once, as `while` is), a `shard_map` body, traced on one device's shards,
times the devices that run it. Elementwise work is ignored: it is
memory-bound and not what MFU measures. The count is global (all devices together).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax


def _dot_flops(eqn: Any) -> int:
    lhs, _ = (v.aval for v in eqn.invars)
    (contract, _), _ = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval
    k = math.prod(lhs.shape[d] for d in contract)
    return 2 * math.prod(out.shape) * k


def _sub_jaxprs(params: dict) -> list[Any]:
    subs = []
    for p in params.values():
        for x in (p if isinstance(p, (tuple, list)) else (p,)):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                subs.append(inner)
    return subs


def _platform_branch(eqn: Any, platform: str | None) -> int | None:
    """The branch a `lax.platform_dependent` cond takes when compiled for `platform`."""
    chosen = eqn.params.get("branches_platforms")
    if not chosen or platform is None:
        return None
    default = None
    for i, names in enumerate(chosen):
        if names is None:
            default = i
        elif platform in names:
            return i
    return default


def jaxpr_matmul_flops(jaxpr: Any, platform: str | None = None) -> int:
    """`platform` ("cpu", "cuda", "tpu"): a `lax.platform_dependent` choice counts the branch
    that platform compiles; without it, every conditional its costliest branch."""
    def count(j: Any) -> int:
        return jaxpr_matmul_flops(j, platform)

    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
        elif name == "scan":
            total += eqn.params["length"] * count(eqn.params["jaxpr"].jaxpr)
        elif name == "pallas_call":
            grid = eqn.params["grid_mapping"].grid
            total += math.prod(int(g) for g in grid) * count(eqn.params["jaxpr"])
        elif name == "shard_map":   # the body sees one device's shards and runs on each
            mesh = eqn.params["mesh"]
            manual = eqn.params.get("newly_manual_axes") or mesh.axis_names
            copies = math.prod(int(mesh.shape[a]) for a in manual)
            total += copies * count(eqn.params["jaxpr"])
        elif name == "cond":
            branches = eqn.params["branches"]
            pick = _platform_branch(eqn, platform)
            total += (count(branches[pick].jaxpr) if pick is not None
                      else max(count(b.jaxpr) for b in branches))
        else:   # pjit, remat, custom_jvp/vjp calls, while (body once: none in our steps)
            total += sum(count(s) for s in _sub_jaxprs(eqn.params))
    return total


def matmul_flops(fn: Callable, *args: Any, platform: str | None = None) -> int:
    """Global matmul FLOPs of one call `fn(*args)`; args may be jax.ShapeDtypeStructs;
    `platform`: as `jaxpr_matmul_flops`."""
    return jaxpr_matmul_flops(jax.make_jaxpr(fn)(*args).jaxpr, platform)
