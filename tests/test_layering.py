"""The package's layering (docs/ARCHITECTURE.md), read from the source of every module with `ast`
(imports inside functions count too):

    kernels (pallas_kernels/)           stand alone: no dspark_jax import
    sharding, jaxpr_flops, measurement  utilities: import nothing above them
    models, cli_support  ←  decoding  ←  serving  ←  data  ←  interop
                                        each imports only its own layer and what lies left of it
    train, eval, bench, aot, the CLIs (evaluate, calibrate, generate, export)
                                        applications: anything below them
    experiments                         runs of the applications: nothing imports them

and no two modules import each other, directly or through a circle. A module that makes itself
another one (`sys.modules[__name__] = module`: an old import path kept for users) is an alias,
not a dependency: its import is not checked against the layers.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"sharding": 0, "jaxpr_flops": 0, "measurement": 0, "models": 1, "cli_support": 1,
          "decoding": 2, "serving": 3, "data": 4, "interop": 5, "experiments": 7}
APP = 6


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


def _is_alias(path: pathlib.Path) -> bool:
    """Whether the module assigns `sys.modules[__name__]` (it then is the module it imports)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute)
                        and t.value.attr == "modules" and isinstance(t.slice, ast.Name)
                        and t.slice.id == "__name__"):
                    return True
    return False


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}
ALIASES = {m for m, p in MODULES.items() if _is_alias(p)}


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


@pytest.mark.parametrize("lower", ["sharding", "jaxpr_flops", "measurement", "models",
                                   "cli_support", "decoding", "serving", "data", "interop",
                                   "applications"])
def test_no_module_imports_a_higher_layer(lower):
    bad = []
    for m, deps in GRAPH.items():
        if m in ALIASES or m.startswith("pallas_kernels"):
            continue
        if lower == "applications":
            if _layer(m) != APP:
                continue
        elif not (m == f"dspark_jax.{lower}" or m.startswith(f"dspark_jax.{lower}.")):
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


def test_aliases_name_the_one_module_they_are():
    assert ALIASES, "no alias modules found: the detection is broken"
    for m in sorted(ALIASES):
        deps = {d for d in GRAPH[m] if not any(e.startswith(d + ".") for e in GRAPH[m])}
        assert len(deps) == 1, (m, deps)
        doc = ast.get_docstring(ast.parse(MODULES[m].read_text())) or ""
        assert f"`{deps.pop()}`" in doc, (m, doc)
