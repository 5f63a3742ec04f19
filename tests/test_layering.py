"""The package's layering (docs/ARCHITECTURE.md), read from the source of every module with `ast`
(imports inside functions count too):

    kernels (pallas_kernels/)           stand alone: no dspark_jax import
    sharding, jaxpr_flops               utilities: import nothing above them
    models    ←  decoding  ←  serving   each imports only itself and what lies left of it
    data, train, eval, bench, aot, the CLIs (evaluate, calibrate, generate, export)
                                        applications: anything below them

and no two modules import each other, directly or through a circle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"sharding": 0, "jaxpr_flops": 0, "models": 1, "decoding": 2, "serving": 3}
APP = 4


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in ("dspark_jax", "pallas_kernels"):
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import names (a submodule, or the package it lives in)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(mod: str, path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for n in names:
            r = _resolve(n)
            if r and r != mod and (r.startswith("dspark_jax") or r.startswith("pallas_kernels")):
                found.add(r)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}

def _layer(mod: str) -> int | None:
    parts = mod.split(".")
    if parts[0] == "pallas_kernels":
        return None
    if len(parts) == 1:
        return APP                         # the dspark_jax package itself
    return LAYERS.get(parts[1], APP)


def _package_init(mod: str, dep: str) -> bool:
    """A package's __init__ re-exporting its own modules is not an upward import."""
    return dep.startswith(mod + ".")


def test_kernels_stand_alone():
    bad = {m: sorted(d for d in deps if d.startswith("dspark_jax"))
           for m, deps in GRAPH.items() if m.startswith("pallas_kernels")}
    assert not {m: d for m, d in bad.items() if d}, bad


@pytest.mark.parametrize("lower", ["sharding", "models", "decoding", "serving"])
def test_no_module_imports_a_higher_layer(lower):
    bad = []
    for m, deps in GRAPH.items():
        if not m.startswith(f"dspark_jax.{lower}"):
            continue
        for d in deps:
            if _package_init(m, d):
                continue
            if d.startswith("pallas_kernels"):
                continue                    # kernels stand beside their oracles, below all
            ld = _layer(d)
            if ld is not None and ld > _layer(m):
                bad.append(f"{m} imports {d}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles():
    """Tarjan's strongly connected components over the module graph: every one a single
    module (a package's __init__ importing its own submodules is not a circle)."""
    graph = {m: {d for d in deps if not _package_init(m, d) and d in GRAPH}
             for m, deps in GRAPH.items()}
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    import sys
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    assert not sccs, "import circles:\n" + "\n".join(" ↔ ".join(c) for c in sccs)
