"""No function of the library, the patches or the launchers is longer than 80 lines: a longer one is split
along its seams, each piece named after what it does. Measured with ``ast``: from the first decorator (or
the ``def`` line when there is none) to the last line of the body, docstring and comments included; a nested
function counts on its own and inside the one that holds it."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("megatron_pg_agg", "patches", "launch")
LIMIT = 80


def _lengths(path: Path) -> list:
    """``(line, name, length)`` of every function and method of ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out.append((node.lineno, node.name, node.end_lineno - first + 1))
    return out


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_function_is_longer_than_80_lines(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    long = [f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
            for path in files for line, name, length in _lengths(path) if length > LIMIT]
    assert not long, long


def test_the_measure_counts_decorators_and_the_whole_body(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("@property\n@staticmethod\ndef f():\n    \"\"\"doc\"\"\"\n\n    return 1\n")
    assert _lengths(path) == [(3, "f", 6)]
