"""What a wheel ships: every package folder of megatron_pg_agg is listed in setup.py (an
editable install hides a missing one; a user's `pip install .` would not)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup_call_keyword(name: str):
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == name))


def test_every_package_folder_is_shipped():
    packages = set(_setup_call_keyword("packages"))
    package_dir = _setup_call_keyword("package_dir")
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "megatron_pg_agg").rglob("__init__.py")}
    # patches/ ships as megatron_pg_agg.patches, its subfolders (patches/cpu) as its subpackages
    on_disk |= {".".join(("megatron_pg_agg", *p.parent.relative_to(ROOT).parts))
                for p in (ROOT / "patches").rglob("__init__.py")}
    assert on_disk <= packages, sorted(on_disk - packages)
    for package in packages:
        folder = ROOT / package_dir.get(package, package.replace(".", "/"))
        assert (folder / "__init__.py").exists(), package
