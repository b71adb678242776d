"""The package's layers import downward only: core <- data <- patches <- megatron <- training <- integrations <- online
<- audit (the audit command reads the hosts' configs and runs their losses and the plug-ins' lines).
A lower layer that imports a higher one (even inside a function) makes the higher layer's optional
stack a dependency of the lower one; the trainer reaches Megatron-Bridge through the model-source
seam (training/model_source.py) instead. ``patches`` (the top-level ``patches/`` folder, shipped as
``megatron_pg_agg.patches``) holds Megatron's patches and the machinery only: the hosts' patches and
stand-ins live in ``integrations/<host>/``, so importing megatron/ or training/ loads no host module.
``online`` (online GRPO, the main job's command line) sits on top: the trainer takes the online job as
an argument of its command line, and the reach task is data (``data/reach.py``).
The package root (``megatron_pg_agg/__init__.py``, the public API) imports core and training, so no
layer below integrations imports a name from it (its version lives in ``megatron_pg_agg/versions.py``,
which they may import)."""
import subprocess
import sys

from tests.support.package_imports import ROOT, imports

PACKAGE = ROOT / "megatron_pg_agg"
ORDER = ["core", "data", "patches", "megatron", "training", "integrations", "online", "audit"]
BELOW_THE_ROOT = ["core", "data", "patches", "megatron", "training"]
FOLDERS = {layer: ROOT / "patches" if layer == "patches" else PACKAGE / layer for layer in ORDER}
"""Each layer's folder on disk (setup.py's package_dir ships ``patches/`` as ``megatron_pg_agg.patches``)."""
HOSTS = ["areal", "verl", "slime", "slime_family", "miles", "nemo_rl", "bridge"]


def test_the_walk_resolves_the_shipped_patches_folder():
    """``patches/cpu/cpu_gloo.py``'s ``from .._machinery import ...`` is megatron_pg_agg.patches._machinery:
    without the folder map it would resolve to no module and every import of patches/ would pass unseen."""
    assert "megatron_pg_agg.patches._machinery" in imports(ROOT / "patches" / "cpu" / "cpu_gloo.py")
    assert "megatron_pg_agg.versions" in imports(ROOT / "patches" / "_machinery.py")


def test_no_layer_imports_a_higher_one():
    wrong = []
    for rank, layer in enumerate(ORDER):
        higher = [f"megatron_pg_agg.{name}" for name in ORDER[rank + 1:]]
        for path in sorted(FOLDERS[layer].rglob("*.py")):
            for name in imports(path):
                if any(name == h or name.startswith(h + ".") for h in higher):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, wrong


def test_no_layer_below_the_root_imports_the_package_root():
    """``from megatron_pg_agg import __version__`` (or any public name) in core/data/patches/megatron/training
    is an arrow back up: the root imports training.args, so the layer would import itself through it."""
    wrong = []
    for layer in BELOW_THE_ROOT:
        for path in sorted(FOLDERS[layer].rglob("*.py")):
            if "megatron_pg_agg" in imports(path):
                wrong.append(f"{path.relative_to(ROOT)} imports the package root megatron_pg_agg")
    assert not wrong, wrong


def test_importing_megatron_and_training_loads_no_host_module():
    """Every module of megatron/ and training/ imported in a fresh interpreter: neither a host folder of
    integrations/ nor a host's own package is loaded (a host's patch registered from patches/ would be)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import megatron_pg_agg.megatron as m, megatron_pg_agg.training as t\n"
        "for pkg in (m, t):\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        f"hosts = {[f'megatron_pg_agg.integrations.{h}' for h in HOSTS]!r}\n"
        "own = ('verl', 'areal', 'nemo_rl', 'slime', 'miles', 'mbridge')\n"
        "loaded = [n for n in sys.modules if any(n == h or n.startswith(h + '.') for h in hosts)\n"
        "          or n.split('.')[0] in own or n.startswith('megatron.bridge')]\n"
        "print(len([n for n in sys.modules if n.startswith('megatron_pg_agg.training.')]), sorted(loaded))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    count, loaded = out.stdout.strip().split(" ", 1)
    assert int(count) >= 10 and loaded == "[]", out.stdout


def test_the_hf_source_is_reached_through_its_entry_point():
    """The installed package's metadata names the opener the trainer loads (a stale install
    without it would fail every --hf-model run)."""
    import importlib.metadata

    (entry,) = importlib.metadata.entry_points(group="megatron_pg_agg.model_sources", name="hf")
    assert entry.value == "megatron_pg_agg.integrations.bridge.hf_model:open_hf_model"
