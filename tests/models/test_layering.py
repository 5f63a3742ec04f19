"""Data flows one way (STYLE.md; issue 12 item 8): models never import decoding or serving, and
the sampling helpers they need live below both."""

from __future__ import annotations

import ast
import pathlib

import dspark_jax

PKG = pathlib.Path(dspark_jax.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_models_do_not_import_decoding_or_serving():
    bad = {f.name: sorted(m for m in _imports(f)
                          if m.startswith(("dspark_jax.decoding", "dspark_jax.serving")))
           for f in (PKG / "models").glob("*.py")}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_sampling_imports_neither_models_nor_decoding():
    mods = _imports(PKG / "sampling.py")
    assert not [m for m in mods if m.startswith("dspark_jax.")], mods
