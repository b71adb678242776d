"""The package's layers import downward only: core <- data <- megatron <- training <- integrations.
A lower layer that imports a higher one (even inside a function) makes the higher layer's optional
stack a dependency of the lower one; the trainer reaches Megatron-Bridge through the model-source
seam (training/model_source.py) instead. The package root (``megatron_pg_agg/__init__.py``, the
public API) imports core and training, so core, data, megatron and training never import a name
from it (its version lives in ``megatron_pg_agg/versions.py``, which they may import)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_pg_agg"
ORDER = ["core", "data", "megatron", "training", "integrations"]
BELOW_THE_ROOT = ["core", "data", "megatron", "training"]


def _is_submodule(dotted: str) -> bool:
    """Whether ``dotted`` (``megatron_pg_agg.x.y``) is a module or package of the package on disk."""
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set:
    """Every module ``path`` imports, at its top or inside a function; ``from P import name`` counts
    as an import of ``P.name`` where that is a module, else of ``P`` itself (a package root's name)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-node.level]
                module = ".".join((*base, *(node.module.split(".") if node.module else ())))
            else:
                module = node.module
            for alias in node.names:
                inner = f"{module}.{alias.name}"
                names.add(inner if _is_submodule(inner) else module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_layer_imports_a_higher_one():
    wrong = []
    for rank, layer in enumerate(ORDER):
        higher = [f"megatron_pg_agg.{name}" for name in ORDER[rank + 1:]]
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for name in _imports(path):
                if any(name == h or name.startswith(h + ".") for h in higher):
                    wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not wrong, wrong


def test_no_layer_below_the_root_imports_the_package_root():
    """``from megatron_pg_agg import __version__`` (or any public name) in core/data/megatron/training is an
    arrow back up: the root imports training.args, so the layer would import itself through it."""
    wrong = []
    for layer in BELOW_THE_ROOT:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            if "megatron_pg_agg" in _imports(path):
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports the package root megatron_pg_agg")
    assert not wrong, wrong


def test_the_hf_source_is_reached_through_its_entry_point():
    """The installed package's metadata names the opener the trainer loads (a stale install
    without it would fail every --hf-model run)."""
    import importlib.metadata

    (entry,) = importlib.metadata.entry_points(group="megatron_pg_agg.model_sources", name="hf")
    assert entry.value == "megatron_pg_agg.integrations.hf_bridge:open_hf_model"
