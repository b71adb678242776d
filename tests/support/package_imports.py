"""The package's own import graph, read as text (whatever stack is installed): every module of
``megatron_pg_agg/`` and of ``patches/`` (shipped as ``megatron_pg_agg.patches``, setup.py's
package_dir) by its shipped dotted name, and what each imports, at its top or inside a function.
Used by tests/unit/test_layers.py and tests/unit/test_import_cycles.py."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = {"megatron_pg_agg": ROOT / "megatron_pg_agg", "megatron_pg_agg.patches": ROOT / "patches"}
"""Dotted package -> the folder it is shipped from."""


def _find_modules() -> dict[str, Path]:
    found = {}
    for package, folder in TREES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _find_modules()
"""Every module of the package by its shipped dotted name (a package by its ``__init__.py``)."""
NAME_OF = {path: name for name, path in MODULES.items()}


def imports(path: Path) -> set[str]:
    """Every module the module at ``path`` imports, at its top or inside a function (other packages'
    included). ``from P import n`` is an import of ``P.n`` where that is one of the package's modules,
    else of ``P`` (a name its ``__init__`` defines); relative imports resolve against the shipped name."""
    module = NAME_OF[path]
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts[: len(parts) - node.level + is_package]
                base = ".".join((*parts, *([base] if base else [])))
            for alias in node.names:
                inner = f"{base}.{alias.name}"
                names.add(inner if inner in MODULES else base)
    return names
