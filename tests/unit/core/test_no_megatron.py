"""The layers below megatron: ``megatron_pg_agg.core`` (the maths) and ``megatron_pg_agg.data`` (rollouts,
files, the planner), and the public API of ``megatron_pg_agg`` itself, import without megatron-core.

Each check runs in a fresh interpreter where any ``import megatron...`` raises ImportError, as in a venv
without megatron-core; it would catch a module-level ``import megatron`` (or an import of the
``megatron``/``training`` subpackages or of ``patches``) added to any of those modules."""
import subprocess
import sys
import textwrap

from tests.support.launching import ROOT

_WITHOUT_MEGATRON = textwrap.dedent("""
    import importlib, pkgutil, sys

    class NoMegatron:
        def find_spec(self, name, path=None, target=None):
            if name == "megatron" or name.startswith("megatron."):
                raise ImportError(f"No module named {name!r} (blocked: no megatron-core here)")

    sys.meta_path.insert(0, NoMegatron())
    import megatron_pg_agg
    for package in sys.argv[1:]:
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__, package + "."):
            importlib.import_module(info.name)
    from megatron_pg_agg import (PGLossConfig, add_pg_agg_args, aggregate, config_from_args,
                                 resolve_mode, token_weights)
    loaded = sorted(m for m in sys.modules if m.startswith("megatron_pg_agg."))
    assert not any(m.startswith(("megatron_pg_agg.megatron", "megatron_pg_agg.patches")) for m in loaded), loaded
    print(" ".join(loaded))
""")


def test_core_and_data_import_without_megatron_core():
    run = subprocess.run([sys.executable, "-c", _WITHOUT_MEGATRON, "megatron_pg_agg.core", "megatron_pg_agg.data"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = set(run.stdout.split())
    assert {"megatron_pg_agg.core.aggregation", "megatron_pg_agg.core.losses",
            "megatron_pg_agg.core.rollout_correction", "megatron_pg_agg.core.value", "megatron_pg_agg.data.planner",
            "megatron_pg_agg.data.rollout_files", "megatron_pg_agg.data.synthetic"} <= loaded


def test_the_blocker_blocks():
    """The control: the same interpreter set-up refuses a module that does import megatron."""
    run = subprocess.run([sys.executable, "-c", _WITHOUT_MEGATRON, "megatron_pg_agg.megatron"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "blocked: no megatron-core here" in run.stderr
