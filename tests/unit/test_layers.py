"""The package's layers import downward only: core <- data <- megatron <- training <- integrations.
A lower layer that imports a higher one (even inside a function) makes the higher layer's optional
stack a dependency of the lower one; the trainer reaches Megatron-Bridge through the model-source
seam (training/model_source.py) instead."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_pg_agg"
ORDER = ["core", "data", "megatron", "training", "integrations"]


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against the module's package
                base = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-node.level]
                names.add(".".join((*base, *node.module.split("."))))
            else:
                names.add(node.module)
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


def test_the_hf_source_is_reached_through_its_entry_point():
    """The installed package's metadata names the opener the trainer loads (a stale install
    without it would fail every --hf-model run)."""
    import importlib.metadata

    (entry,) = importlib.metadata.entry_points(group="megatron_pg_agg.model_sources", name="hf")
    assert entry.value == "megatron_pg_agg.integrations.hf_bridge:open_hf_model"
